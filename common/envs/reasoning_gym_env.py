"""reasoning-gym (pip reasoning-gym==0.1.25) as a taskset source: `--taskset reasoning_gym:NAME[,NAME]` draws
procedural questions from its datasets; the library's own `score_answer` (by the entry's source dataset) is the
verifier of the final answer. One attempt by default (a single-turn episode); a task with "attempts" > 1 gets
"not correct, try again" feedback like the retry environment.

The reward is 1 for a solved question (the library's score >= 1) and 0 otherwise: its default scorers give partial
credit that a policy can collect without solving anything (0.1 when the true answer is a substring of the reply,
so a reply listing every digit earns it on letter_counting or leg_counting; 0.01 for any wrong number on
gsm_symbolic). A task with `partial_credit: true` (the `env_partial_credit` task processor) gets the library's
score as is. `success` means solved either way."""

from __future__ import annotations

from common.envs import Env, StepResult
from rewards.math import extract_answer

INSTRUCTION = "Think briefly, then end with 'Answer: <answer>'."


def reasoning_gym_tasks(names: list[str], size: int, seed: int, prefix: str) -> list[dict]:
    """`size` questions of each dataset, as env rows (the entry travels with the task)."""
    import reasoning_gym

    tasks = []
    for name in names:
        try:
            data = reasoning_gym.create_dataset(name, size=size, seed=seed)
        except (KeyError, ValueError) as e:
            raise SystemExit(f"error: --taskset reasoning_gym:{name}: {e}") from None
        for i in range(size):
            entry = data[i]
            tasks.append({"id": f"{prefix}{name}-{i}", "env": "reasoning_gym", "dataset": name,
                          "prompt": f"{entry['question']}\n{INSTRUCTION}",
                          "entry": {"question": entry["question"], "answer": entry["answer"],
                                    "metadata": entry["metadata"]}})
    return tasks


def final_answer(text: str) -> str:
    answer = extract_answer(text)
    return (answer if answer is not None else text).strip()


def reasoning_gym_task_list(arg: str | None, size: int, seed: int, prefix: str) -> list[dict]:
    names = [n for n in (arg or "").split(",") if n]
    if not names:
        raise SystemExit("error: --taskset reasoning_gym:NAME[,NAME]: name at least one dataset")
    return reasoning_gym_tasks(names, max(1, size // len(names)), seed, prefix)


class ReasoningGym(Env):
    required_fields = ("entry", "prompt")
    task_list = staticmethod(reasoning_gym_task_list)

    def reset(self, task: dict) -> list[dict]:
        import reasoning_gym

        self.entry, self.attempts, self.tries = task["entry"], int(task.get("attempts", 1)), 0
        self.partial_credit = bool(task.get("partial_credit", False))
        self.score_answer = reasoning_gym.get_score_answer_fn(self.entry["metadata"]["source_dataset"])
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action: str) -> StepResult:
        self.tries += 1
        library_score = float(self.score_answer(final_answer(action), self.entry))
        solved = library_score >= 1.0
        if solved or self.tries >= self.attempts:
            reward = library_score if self.partial_credit else float(solved)
            return StepResult([], reward, True, {"success": solved, "library_reward": library_score})
        return StepResult([{"role": "user", "content": "That is not correct. Try again."}], 0.0, False, {})
