"""What a verifier is: `score(response, task) -> Reward`, and the one registry of verifier kinds.

A task names its verifier in `task["reward"]` (default math). `KINDS` maps each kind to the module that holds its
`score` function and the task fields it needs; common/tasks/validate.py checks those fields when it loads a task, and
`rewards.score` imports the module on first use. Adding a verifier = one module with `score` + one line here; a
function of your own without touching the package: `--reward-fn module:function` (`UserReward`, below).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass
class Reward:
    score: float  # in [0, 1]; only rewards.shaping may push it below 0
    info: dict = field(default_factory=dict)  # at least {"reason": str}


def failed(reason: str, **info) -> Reward:
    """Score 0 for a verifier failure (not a wrong answer): counted by the pool and in the run's metrics."""
    return Reward(0.0, {"reason": reason, "failed": True, **info})


@dataclass(frozen=True)
class Kind:
    module: str                                     # where `score(response, task) -> Reward` lives
    required: tuple[str, ...] = ()                  # task fields the verifier needs
    one_of: tuple[tuple[str, ...], ...] = ()        # groups of alternatives: at least one field of each group


KINDS: dict[str, Kind] = {
    "math": Kind("rewards.math", ("answer",)),
    "code": Kind("rewards.code", one_of=(("tests", "test"),)),
    "k12": Kind("rewards.k12", ("answer",)),
    "vision": Kind("rewards.vision", ("image", "answer")),
    "rm": Kind("rewards.rm"),
    "parity": Kind("rewards.parity", ("parity",)),
    "judge": Kind("rewards.judge", ("rubric",)),
    "judge_group": Kind("rewards.judge", ("rubric",)),
}


def check_kind(task: dict) -> str:
    """The verifier a task names (default math), or a ValueError naming the task id and the kind."""
    kind = task.get("reward", "math")
    if kind not in KINDS:
        raise ValueError(f"task {task.get('id')}: unknown reward {kind!r} (one of {', '.join(KINDS)})")
    return kind


def missing_fields(task: dict, kind: str) -> list[str]:
    """The fields `kind` needs that `task` lacks ('a' or 'b' for alternatives); [] when it has them all."""
    spec = KINDS[kind]
    missing = [name for name in spec.required if name not in task]
    missing += [" or ".join(repr(n) for n in group) for group in spec.one_of if not any(n in task for n in group)]
    return [m if m.startswith("'") else repr(m) for m in missing]


def score(response: str, task: dict) -> Reward:
    """Score one response in this process with the verifier its task names (no time limit: RewardPool has one)."""
    kind = check_kind(task)
    return importlib.import_module(KINDS[kind].module).score(response, task)


class UserReward:
    """`--reward-fn module:function` (or path/to/file.py:function): a function of yours that scores every task,
    fn(response, task) -> float or Reward, in place of the verifier the task names. It crosses into the pool's
    worker processes as its reference and is imported there on first use."""

    routes_kinds = False  # the pool sends every task to it (no kind check, no RM server)

    def __init__(self, spec: str):
        self.spec, self._fn = spec, None

    def __getstate__(self):
        return {"spec": self.spec, "_fn": None}

    def __call__(self, response: str, task: dict) -> Reward:
        if self._fn is None:
            from common.runtime.plugins import load_object

            self._fn = load_object(self.spec, "--reward-fn")
        out = self._fn(response, task)
        return out if isinstance(out, Reward) else Reward(float(out), {"reason": f"--reward-fn {self.spec}"})
