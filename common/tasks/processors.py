"""Task processors: small named functions between the taskset and the workflow (`--task-processors a,b`).

A processor takes a task and the config and returns the task (changed or not) or None (dropped). Each application
is counted in the explorer's metrics: tasks/<name>_dropped for the tasks it dropped. Adding one is a function plus
a line in TASK_PROCESSORS. `--prompt-template` is not listed there: it applies to every task, first, whenever it
is not the identity "{prompt}".
"""

from __future__ import annotations


def prompt_template(task: dict, args) -> dict | None:
    """Wrap the prompt: --prompt-template with {prompt} replaced (tasks given as messages: the last user message)."""
    if "prompt" in task:
        return {**task, "prompt": args.prompt_template.replace("{prompt}", task["prompt"])}
    if task.get("messages"):
        messages = [dict(m) for m in task["messages"]]
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last]["content"] = args.prompt_template.replace("{prompt}", messages[last]["content"])
        return {**task, "messages": messages}
    return task


def difficulty_tag(task: dict, args) -> dict | None:
    """Tag the task with its difficulty ('difficulty' field, else a size bucket of its prompt), for metrics and
    curricula downstream: task['tags'] gains 'difficulty:<d>'."""
    level = task.get("difficulty")
    if level is None:
        size = len(task.get("prompt") or str(task.get("messages", "")))
        level = "short" if size < 200 else "medium" if size < 800 else "long"
    return {**task, "tags": list(task.get("tags", [])) + [f"difficulty:{level}"]}


def max_prompt_chars(task: dict, args) -> dict | None:
    """Drop tasks whose prompt is longer than --max-prompt-chars (0: keep all)."""
    size = len(task.get("prompt") or str(task.get("messages", "")))
    return None if args.max_prompt_chars and size > args.max_prompt_chars else task


def env_partial_credit(task: dict, args) -> dict | None:
    """Let environment tasks keep an environment library's partial credit (TextArena's reward for a game ended on
    an invalid move, reasoning-gym's scores below 1), which the adapters in common/envs/ withhold by default: a
    policy can collect it without solving anything."""
    return {**task, "partial_credit": True} if task.get("env") else task


def blind(task: dict, args) -> dict | None:
    """Keep the task's image from the policy (its prompt is the text alone) while the verifier still checks the
    answer against it: the blind control of a vision run (docs/BENCHMARKS.md)."""
    return {**task, "blind": True} if task.get("image") else task


TASK_PROCESSORS = {
    "blind": blind,
    "difficulty_tag": difficulty_tag,
    "env_partial_credit": env_partial_credit,
    "max_prompt_chars": max_prompt_chars,
}


def apply_task_processors(tasks: list[dict], names: str, args) -> tuple[list[dict], dict]:
    """The tasks that pass every processor in `names` (comma-separated), and counts tasks/<name>_dropped."""
    counts = {}
    if args.prompt_template != "{prompt}":
        tasks = [prompt_template(t, args) for t in tasks]
    for name in filter(None, (n.strip() for n in names.split(","))):
        fn, kept = TASK_PROCESSORS[name], []
        for task in tasks:
            out = fn(task, args)
            if out is not None:
                kept.append(out)
        counts[f"tasks/{name}_dropped"] = len(tasks) - len(kept)
        tasks = kept
    return tasks, counts
