"""OpenEnv environments (pip openenv-core==0.3.0): `--taskset openenv:URL` or `--taskset openenv:MODULE[:APP]`.

- `openenv:http://HOST:PORT` plays an OpenEnv server that is already running: a Docker container
  (`docker run -p 8000:8000 IMAGE`), a Hugging Face Space, or `uvicorn PKG.server.app:app` of an installed
  environment package.
- `openenv:MODULE[:APP]` serves the OpenEnv app `MODULE.APP` (default `app`: what `create_app(Environment,
  Action, Observation)` returns; every OpenEnv environment package has one in `PKG.server.app`) with uvicorn on
  127.0.0.1, on a free port, in a process of its own (one per explorer process, ended with it), and plays it the
  same way: offline, no container. E.g. `openenv:tests.openenv_tiny_env` (tests/openenv_tiny_env.py).

Each episode is one WebSocket session of the library's own client (`GenericEnvClient`: reset, step, close), so the
server gives it an environment instance of its own. The observation the server sends is shown to the policy as
a user message: its `observation_field` (a setting) when it names one, else its only field when that is text, else
its fields as JSON (OpenEnv observations are typed objects, not chat). The policy's turn is sent as the action
`{action_field: text}` (`--env-setting openenv.action_field=...`; `message` is what OpenEnv's echo and chat
environments take). The reward is the server's per-step `reward` (None: 0), summed or last as --env-reward says;
the episode ends when the server says `done`. Everything the server sends is untrusted: a field missing or of the
wrong type ends the episode as an error, through the boundary.

Tasks: OpenEnv has no task list: each task is a reset with a seed drawn for it (`reset(seed=...)`, which
environments with randomness use).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from common.envs import Env, EnvSettings, StepResult

_servers: dict[str, str] = {}  # module -> base URL of the server this process started for it
_servers_lock = threading.Lock()
SERVER_START_TIMEOUT_S = 30.0


def is_url(arg: str) -> bool:
    return arg.startswith(("http://", "https://", "ws://", "wss://"))


# The server process: binds a free port and listens before it prints it (connections wait in the backlog until
# uvicorn accepts them), and exits when its parent is gone.
_LAUNCH = """
import importlib, os, socket, sys, threading, time
import uvicorn
parent = os.getppid()
module, _, name = sys.argv[1].partition(":")
app = getattr(importlib.import_module(module), name or "app")
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(128)
def orphaned():
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)
threading.Thread(target=orphaned, daemon=True).start()
print(sock.getsockname()[1], flush=True)
# log_level critical: openenv-core 0.3.0's server logs a traceback for every session its own client closes
uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off")).run(sockets=[sock])
"""


def serve_module(module: str) -> str:
    """The base URL of `module`'s OpenEnv app, served by uvicorn in a process of its own (started on first use,
    one per explorer process): an environment that hangs or crashes there never holds the explorer, nor its exit."""
    with _servers_lock:
        if module in _servers:
            return _servers[module]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, module], stdout=subprocess.PIPE, stderr=log,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        atexit.register(stop_server, proc)
        ready, _, _ = select.select([proc.stdout], [], [], SERVER_START_TIMEOUT_S)  # the explorer waits for it
        line = proc.stdout.readline().strip() if ready else b""
        if not line.isdigit():
            stop_server(proc)
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the OpenEnv server of {module!r} did not start within {SERVER_START_TIMEOUT_S:g}s: "
                               f"{tail[0][:300]}")
        _servers[module] = f"http://127.0.0.1:{int(line)}"
        return _servers[module]


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)  # the explorer waits for the killed server to be reaped


def make_openenv_task(rng, index: int, difficulty: int, arg: str | None = None) -> dict:
    if not arg:
        raise SystemExit("error: --taskset openenv:URL|MODULE[:APP]: name the server (http://HOST:PORT) or the "
                         "module of its app")
    return {"id": f"openenv-{index}", "env": "openenv", "openenv": arg, "seed": rng.randint(0, 2**31 - 1)}


@dataclass
class OpenEnvSettings(EnvSettings):
    action_field: str = "message"
    """the action's field that carries the policy's turn"""
    observation_field: str = ""
    """the observation's field shown to the policy ('': its only field if that is text, else all, as JSON)"""
    message_timeout_s: float = 60.0
    """longest the client waits for one answer of the server"""
    close_timeout_s: float = 2.0
    """longest an episode's close waits for the server"""
    worst_reward: float = 0.0
    """the environment's lowest reward for a played episode: what an episode that ends in an error gets"""


class OpenEnv(Env):
    """One episode of an OpenEnv environment, over its client (the module docstring)."""

    Settings = OpenEnvSettings
    required_fields = ("openenv",)
    make_task = staticmethod(make_openenv_task)

    def __init__(self, settings: OpenEnvSettings | None = None):
        super().__init__(settings)
        self.worst_reward = self.settings.worst_reward
        self.client = None

    async def reset(self, task: dict) -> list[dict]:
        from openenv.core.generic_client import GenericEnvClient

        where = str(task["openenv"])
        url = where if is_url(where) else serve_module(where)
        self.client = GenericEnvClient(base_url=url, message_timeout_s=self.settings.message_timeout_s)
        await self.client.connect()
        result = await self.client.reset(seed=int(task.get("seed", 0)))
        if result.done:
            raise ValueError("the environment's reset says the episode is already done")
        return [self.render(result.observation)]

    async def step(self, action: str) -> StepResult:
        result = await self.client.step({self.settings.action_field: action})
        reward = 0.0 if result.reward is None else result.reward  # the boundary checks it is a finite number
        if not isinstance(result.done, bool):
            raise ValueError(f"done is {result.done!r:.60}, not a bool")
        return StepResult([] if result.done else [self.render(result.observation)], reward, result.done, {})

    def render(self, observation) -> dict:
        """The server's observation as the user message the policy sees."""
        if not isinstance(observation, dict):
            raise ValueError(f"the observation is a {type(observation).__name__}, not an object")
        name = self.settings.observation_field
        if name:
            if not isinstance(observation.get(name), str):
                raise ValueError(f"the observation's {name!r} is {observation.get(name)!r:.60}, not a string")
            return {"role": "user", "content": observation[name]}
        texts = [v for v in observation.values() if isinstance(v, str)]
        if len(observation) == 1 and len(texts) == 1:  # a text observation: shown as is
            return {"role": "user", "content": texts[0]}
        return {"role": "user", "content": json.dumps(observation, ensure_ascii=False)}

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            # A server still in a step the boundary gave up on does not answer the close handshake: bounded
            await asyncio.wait_for(client.close(), self.settings.close_timeout_s)
