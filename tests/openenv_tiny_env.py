"""An OpenEnv environment defined in code, offline (`--taskset openenv:tests.openenv_tiny_env`): OpenEnv's own
server app (`create_app`) around a two-turn game. Its reward, at the end, is the share of ASCII characters in the
policy's messages, so even the random tiny model gets mixed rewards (a signal to train on in 2 steps)."""

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class TinyAction(Action):
    message: str


class TinyObservation(Observation):
    prompt: str = ""


class TwoTurns(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets an instance of its own

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.text = ""

    def reset(self, seed=None, episode_id=None, **kwargs) -> TinyObservation:
        self._state, self.text = State(step_count=0), ""
        return TinyObservation(prompt=f"Say something about the number {seed}.")

    def step(self, action: TinyAction, timeout_s=None, **kwargs) -> TinyObservation:
        self._state.step_count += 1
        self.text += action.message
        if self._state.step_count < 2:
            return TinyObservation(prompt="Once more, shorter.", reward=0.0)
        share = sum(ord(c) < 128 for c in self.text) / len(self.text) if self.text else 0.0
        return TinyObservation(done=True, reward=share)

    @property
    def state(self) -> State:
        return self._state


app = create_app(TwoTurns, TinyAction, TinyObservation, env_name="tiny", max_concurrent_envs=64)
