"""Config fields of workflows, environments and task processors (a base of common.config.CommonArgs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkflowArgs:
    # --- workflows and environments (common/workflows, common/envs) --------------------------------------------
    max_turns: int = 8
    """Multi-turn episodes: most assistant turns per episode (--max-new-tokens bounds each turn)."""
    episode_token_budget: int = 1024
    """Multi-turn episodes: most tokens of a whole episode (first prompt + every turn and observation); an
    episode whose next turn would not fit ends with reason 'budget' (finish reason 'length')."""
    env_reward: str = "sum"
    """An episode's environment reward: sum (of its step rewards) or last (the final step's); a verifier named by
    the task's 'reward' field adds its score of the last assistant turn."""
    tool_timeout_s: float = 10.0
    """A tool call that takes longer gives an error observation ('timeout') and the episode goes on."""
    task_processors: str = ""
    """Comma-separated task processors applied between taskset and workflow, in order (common/explorer/
    processors.py: prompt_template, difficulty_tag, max_prompt_chars); each counted in metrics (tasks/...)."""
    prompt_template: str = "{prompt}"
    """The prompt_template task processor: a task's prompt becomes this with {prompt} replaced."""
    max_prompt_chars: int = 0
    """The max_prompt_chars task processor: drop tasks whose prompt is longer (0: no limit)."""


def validate_workflow_args(args) -> None:
    """One-line errors naming the field (called from CommonArgs.validate)."""
    from common.config import ConfigError
    from common.tasks.processors import TASK_PROCESSORS
    from common.tasks.named import taskset_has_envs

    if args.max_turns < 1:
        raise ConfigError(f"--max-turns must be >= 1 (got {args.max_turns})")
    if args.episode_token_budget <= args.max_new_tokens:
        raise ConfigError(f"--episode-token-budget ({args.episode_token_budget}) must exceed --max-new-tokens "
                          f"({args.max_new_tokens}): a whole episode must hold more than one turn")
    if args.env_reward not in ("sum", "last"):
        raise ConfigError(f"--env-reward must be sum or last (got {args.env_reward!r})")
    if args.tool_timeout_s <= 0:
        raise ConfigError(f"--tool-timeout-s must be > 0 (got {args.tool_timeout_s})")
    for name in filter(None, (n.strip() for n in args.task_processors.split(","))):
        if name not in TASK_PROCESSORS:
            raise ConfigError(f"--task-processors: unknown processor {name!r} (one of {', '.join(TASK_PROCESSORS)})")
    if "{prompt}" not in args.prompt_template:
        raise ConfigError(f"--prompt-template must contain {{prompt}} (got {args.prompt_template!r})")
    if args.max_prompt_chars < 0:
        raise ConfigError(f"--max-prompt-chars must be >= 0 (got {args.max_prompt_chars})")
    if args.rollout_token_budget and taskset_has_envs(args.taskset):
        raise ConfigError(f"--rollout-token-budget (partial rollouts) works with single-turn tasks only, and "
                          f"--taskset {args.taskset} has multi-turn (env) tasks")
