"""Rewards: verifiers behind one API, `score(response, task) -> Reward`, routed on task["reward"].

Start with rewards/base.py: `Reward`, and `KINDS`, the one registry of verifier kinds (each kind's module and the
task fields it needs). One module per verifier: math (math-verify), code (tests in rewards/sandbox.py), k12 (choice
/ true-false / short answer / judge), vision (an image task checked like k12), rm (a learned reward model), parity
(the smoke-test reward), judge (a judge model reads a rubric: one response, or a group together; judge_server.py
serves one). rewards/pool.py's `RewardPool` is the batch entry point: it scores in child processes (judge calls on
threads) under a time limit while the caller keeps generating. rewards/shaping.py adds per-group shaping terms.
"""

from rewards.base import KINDS, Kind, Reward, UserReward, check_kind, failed, score  # noqa: F401
from rewards.pool import RewardFuture, RewardPool  # noqa: F401
