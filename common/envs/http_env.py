"""Environments out of process: any registered environment served over HTTP, and the client that plays it.

The protocol is three JSON POSTs (the body and the answer are JSON objects; an error is a non-2xx status with
{"error": "<one line>"}):

    POST /reset  {"env": NAME, "task": {...}, "settings": {...}}
                 -> {"episode": ID, "messages": [...], "tools": [schema, ...], "worst_reward": float}
    POST /step   {"episode": ID, "action": "<the turn's text>"}
                 -> {"messages": [...], "reward": float, "done": bool, "info": {...}}
    POST /close  {"episode": ID} -> {}

Serve every environment of `ENVS` with one command (prints "listening on http://HOST:PORT" once ready; --port 0
picks a free port):

    python -m common.envs.http_env --port 8765

and play it with `--env-server http://127.0.0.1:8765`: every environment task of the run is then played by
`HttpEnv`, which sends the environment's name, the task and the environment settings with each reset, so the
episodes are the in-process ones (tests/test_http_env.py checks the same observations and ids). Each request
waits at most `request_timeout_s` (and the whole call --env-step-timeout-s, like any environment call); a request
that could not be sent (connection refused or reset) is retried at most `retries` times, `retry_backoff_s` apart;
a step that reached the server is never retried (it may have changed the game), and an error ends the episode
("error"). The server runs each request in its own thread and serves episodes independently, each behind the
same boundary as in process (common/envs/boundary.py: whatever the environment raises or returns wrong is a 500
with one line, each call bounded by the server's --step-timeout-s); what comes back is checked again by the
client's boundary (the server is untrusted too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from common.envs import Env, EnvSettings, StepResult
from common.envs.boundary import EnvFailure, EpisodeEnv


@dataclass
class HttpEnvSettings(EnvSettings):
    url: str = "http://127.0.0.1:8765"
    """the environment server (--env-server)"""
    request_timeout_s: float = 60.0
    """longest one request may take"""
    retries: int = 2
    """times a request that could not be sent is tried again"""
    retry_backoff_s: float = 0.5
    """seconds between those tries"""


class RemoteError(Exception):
    """The server answered with an error, or no answer could be had."""


class NotFound(Exception):
    """No such route or episode on the server (HTTP 404; the environment's own errors are 500)."""


class HttpEnv(Env):
    """An environment played on an environment server (the module docstring); `remote` is its name there."""

    Settings = HttpEnvSettings

    def __init__(self, settings: HttpEnvSettings | None = None, remote: str = "", remote_settings: dict | None = None):
        super().__init__(settings)
        self.remote, self.remote_settings = remote, dict(remote_settings or {})
        self.episode, self.schemas = None, []

    def _post(self, path: str, body: dict, resend: bool) -> dict:
        data = json.dumps(body).encode()
        for attempt in itertools.count():
            request = urllib.request.Request(self.settings.url.rstrip("/") + path, data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.settings.request_timeout_s) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as e:
                try:
                    message = json.loads(e.read()).get("error", "")
                except ValueError:
                    message = ""
                raise RemoteError(f"{path} {self.remote}: HTTP {e.code}: {message or e.reason}") from None
            except urllib.error.URLError as e:
                unsent = isinstance(e.reason, (ConnectionRefusedError, ConnectionResetError))
                if not (unsent or resend) or attempt >= self.settings.retries:
                    raise RemoteError(f"{path} {self.remote}: {self.settings.url}: {e.reason} "
                                      f"(after {attempt + 1} tries)") from None
                time.sleep(self.settings.retry_backoff_s)

    def reset(self, task: dict) -> list[dict]:
        self.remote = self.remote or str(task.get("remote_env", ""))  # a task row {"env": "http", "remote_env": ...}
        out = self._post("/reset", {"env": self.remote, "task": task, "settings": self.remote_settings}, resend=True)
        self.episode, self.schemas = out["episode"], out.get("tools") or []
        self.worst_reward = out.get("worst_reward", 0.0)  # checked by the boundary, like what follows
        return out["messages"]

    def step(self, action: str) -> StepResult:
        out = self._post("/step", {"episode": self.episode, "action": action}, resend=False)
        return StepResult(out.get("messages"), out.get("reward"), out.get("done"), out.get("info", {}))

    def tool_schemas(self) -> list[dict]:
        return self.schemas

    def close(self) -> None:
        if self.episode is not None:
            episode, self.episode = self.episode, None
            self._post("/close", {"episode": episode}, resend=True)


# ---------------------------------------------------------------------------------------------- the server
class EnvServer(ThreadingHTTPServer):
    """Every registered environment over HTTP: one environment instance per episode, each request in a thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], step_timeout_s: float = 300.0):
        super().__init__(address, Handler)
        self.step_timeout_s = step_timeout_s
        self.episodes: dict[str, EpisodeEnv] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count(1)

    def reset(self, body: dict) -> dict:
        env = EpisodeEnv(body["env"], body.get("settings") or {}, self.step_timeout_s)
        try:
            messages, tools = env.reset(body["task"])
        except Exception:  # the episode never started: free what the environment holds
            env.close()
            raise
        with self.lock:
            episode = f"ep{next(self.ids)}"
            self.episodes[episode] = env
        return {"episode": episode, "messages": messages, "tools": tools, "worst_reward": env.worst_reward}

    def step(self, body: dict) -> dict:
        result = self._episode(body).step(str(body["action"]))
        return {"messages": result.messages, "reward": result.reward, "done": result.done, "info": result.info}

    def close_episode(self, body: dict) -> dict:
        with self.lock:
            env = self.episodes.pop(body["episode"], None)
        if env is not None:
            env.close()
        return {}

    def _episode(self, body: dict) -> EpisodeEnv:
        with self.lock:
            env = self.episodes.get(body.get("episode"))
        if env is None:
            raise NotFound(f"no episode {body.get('episode')!r}")
        return env


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802  (the http.server API)
        routes = {"/reset": self.server.reset, "/step": self.server.step, "/close": self.server.close_episode}
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path not in routes:
                raise NotFound(f"no route {self.path} (POST /reset, /step, /close)")
            status, answer = 200, routes[self.path](body)
        except Exception as e:  # noqa: BLE001  (the environment's error goes back to the client as one line)
            status = 404 if isinstance(e, NotFound) else 500
            answer = {"error": str(e) if isinstance(e, EnvFailure) else f"{type(e).__name__}: {e}"}
        data = json.dumps(answer, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # one line per request would drown the run's output
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve every registered environment over HTTP (see the docstring).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0: a free port (printed)")
    parser.add_argument("--step-timeout-s", type=float, default=300.0, help="longest one environment call may take")
    args = parser.parse_args(argv)
    server = EnvServer((args.host, args.port), args.step_timeout_s)
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
