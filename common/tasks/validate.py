"""Task rows checked when loaded: a bad row is a one-line error naming the file and line (or row) and what is wrong.

A task is a dict with `id`, `prompt` (or `messages`), `reward` (the verifier, rewards/base.py `KINDS`) and the
fields that verifier needs; a multi-turn task names its environment (`env`, common/envs/ `ENVS`) instead.
"""

from __future__ import annotations

from common.envs import ENVS, env_class
from rewards.base import KINDS, missing_fields

WHERE = "_where"  # task key holding the file:line (or row) the task came from


def validate_task(task: dict, where: str, check_reward: bool = True) -> dict:
    if not isinstance(task, dict):
        raise SystemExit(f"error: {where}: a task must be a JSON object, got {type(task).__name__}")
    if "env" in task:  # a multi-turn row: its environment makes the prompt (common/explorer/multi_turn.py)
        return validate_env_task(task, where)
    if "prompt" not in task and "messages" not in task:
        raise SystemExit(f"error: {where}: missing field 'prompt' (or 'messages')")
    check_prompt_type(task, where)
    kind = task.setdefault("reward", "math")
    if not check_reward:  # --reward-fn scores every task: the kind's fields do not matter
        return task
    if kind not in KINDS:  # the one registry of verifiers: rewards/base.py
        raise SystemExit(f"error: {where}: unknown reward {kind!r} (one of {', '.join(KINDS)})")
    if kind == "code" and not isinstance(task.get("prompt"), str):
        raise SystemExit(f"error: {where}: reward 'code' needs 'prompt' as text (the function it completes)")
    missing = missing_fields(task, kind)
    if missing:
        raise SystemExit(f"error: {where}: missing field {missing[0]} (needed by reward {kind!r})")
    if kind in ("judge", "judge_group") and not (isinstance(task["rubric"], str) and task["rubric"].strip()):
        raise SystemExit(f"error: {where}: reward {kind!r} needs 'rubric' as non-empty text")
    return task


def check_prompt_type(task: dict, where: str) -> None:
    """'prompt' must be non-empty text, or chat messages (a non-empty list of {role, content: text} objects)
    under 'messages' or under 'prompt' (TRL's conversational format; moved to 'messages')."""
    if isinstance(task.get("prompt"), list) and "messages" not in task:
        task["messages"] = task.pop("prompt")
    if task.get("messages") is not None:
        messages = task["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise SystemExit(f"error: {where}: 'messages' must be a non-empty list of "
                             f"{{\"role\": text, \"content\": text}} objects (got {str(messages)[:60]})")
    elif not isinstance(task.get("prompt"), str) or not task["prompt"].strip():
        raise SystemExit(f"error: {where}: 'prompt' must be non-empty text or a list of messages "
                         f"(got {type(task.get('prompt')).__name__} {str(task.get('prompt'))[:40]})")
    task[WHERE] = where  # for errors found later (e.g. a prompt longer than the model's context)


def validate_env_task(task: dict, where: str) -> dict:
    """A task row naming an environment: the env (and the verifier, if it names one) must exist. One-line errors."""
    if task["env"] not in ENVS:
        raise SystemExit(f"error: {where}: unknown env {task['env']!r} (one of {', '.join(sorted(ENVS))})")
    for name in env_class(task["env"]).required_fields:
        if name not in task:
            raise SystemExit(f"error: {where}: missing field {name!r} (needed by env {task['env']!r})")
    if "reward" in task and task["reward"] not in KINDS:
        raise SystemExit(f"error: {where}: unknown reward {task['reward']!r} (one of {', '.join(KINDS)})")
    task[WHERE] = where  # for errors found later (a first prompt longer than --episode-token-budget)
    return task
