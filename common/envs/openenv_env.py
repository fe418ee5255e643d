"""OpenEnv environments (pip openenv-core==0.3.0): `--taskset openenv:URL` or `--taskset openenv:MODULE`.

- `openenv:http://HOST:PORT` plays an OpenEnv server that is already running: a Docker container
  (`docker run -p 8000:8000 IMAGE`), a Hugging Face Space, or `uvicorn PKG.server.app:app` of an installed
  environment package.
- `openenv:MODULE` serves the OpenEnv app `MODULE.app` (what `create_app(Environment, Action, Observation)`
  returns; every OpenEnv environment package has one in `PKG.server.app`) on 127.0.0.1, on a free port, in a
  thread of the explorer process (once per process), and plays it the same way: offline, no container. E.g.
  `openenv:tests.openenv_tiny_env` (tests/openenv_tiny_env.py).

Each episode is one WebSocket session of the library's own client (`GenericEnvClient`: reset, step, close), so the
server gives it an environment instance of its own. The observation the server sends is shown to the policy as
a user message: its `observation_field` (a setting) when it names one, else its only field when that is text, else
its fields as JSON (OpenEnv observations are typed objects, not chat). The policy's turn is sent as the action
`{action_field: text}` (`--env-setting openenv.action_field=...`; `message` is what OpenEnv's echo and chat
environments take). The reward is the server's per-step `reward` (None: 0), summed or last as --env-reward says;
the episode ends when the server says `done`. Everything the server sends is untrusted: a field missing or of the
wrong type ends the episode as an error, through the boundary.

Tasks: OpenEnv has no task list: task i is a reset with seed i (`reset(seed=...)`, which environments with
randomness use).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

from common.envs import Env, EnvSettings, StepResult

_servers: dict[str, str] = {}  # module -> base URL of the server this process started for it
_servers_lock = threading.Lock()
SERVER_START_TIMEOUT_S = 30.0


def is_url(arg: str) -> bool:
    return arg.startswith(("http://", "https://", "ws://", "wss://"))


def serve_module(module: str) -> str:
    """The base URL of `module`'s OpenEnv app, served by uvicorn in a daemon thread (started on first use)."""
    with _servers_lock:
        if module in _servers:
            return _servers[module]
        import importlib

        import uvicorn

        app = getattr(importlib.import_module(module), "app", None)
        if app is None:
            raise ValueError(f"module {module!r} has no `app` (an OpenEnv create_app(...) app)")
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a free port, ours from here on: no race with another process
        # log_level critical: openenv-core 0.3.0's server logs a traceback for every session its own client closes;
        # what goes wrong in an episode reaches tandem through the client (an error answer, a closed socket).
        server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                  name=f"openenv-server-{module}")
        thread.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:  # the explorer waits for its uvicorn thread, at most SERVER_START_TIMEOUT_S
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server of {module!r} did not start within "
                                   f"{SERVER_START_TIMEOUT_S:g}s" + ("" if thread.is_alive() else " (it exited)"))
            time.sleep(0.05)
        _servers[module] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return _servers[module]


def make_openenv_task(rng, index: int, difficulty: int, arg: str | None = None) -> dict:
    if not arg:
        raise SystemExit("error: --taskset openenv:URL|MODULE: name the server (http://HOST:PORT) or the module "
                         "of its app")
    return {"id": f"openenv-{index}", "env": "openenv", "openenv": arg, "seed": rng.randint(0, 2**31 - 1)}


@dataclass
class OpenEnvSettings(EnvSettings):
    action_field: str = "message"
    """the action's field that carries the policy's turn"""
    observation_field: str = ""
    """the observation's field shown to the policy ('': its only field if that is text, else all, as JSON)"""
    message_timeout_s: float = 60.0
    """longest the client waits for one answer of the server"""
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
            await client.close()
