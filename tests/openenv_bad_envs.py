"""One-turn OpenEnv apps for tests/test_standard_envs.py, each served by the adapter in a process of its own
(`openenv:tests.openenv_bad_envs:NAME`): a sound one and ones whose step raises or hangs."""

import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from tests.openenv_tiny_env import TinyAction, TinyObservation


def one_turn_app(step):
    class OneTurn(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed=None, episode_id=None, **kwargs):
            return TinyObservation(prompt="go")

        def step(self, action, timeout_s=None, **kwargs):
            return step(action)

        @property
        def state(self):
            return State()

    return create_app(OneTurn, TinyAction, TinyObservation, env_name="one_turn", max_concurrent_envs=8)


def raises(action):
    raise RuntimeError("the environment's step broke")


good = one_turn_app(lambda action: TinyObservation(done=True, reward=0.25))
raising = one_turn_app(raises)
hanging = one_turn_app(lambda action: time.sleep(3600))
