"""A verifiers environment defined in code, offline (`--taskset verifiers:tests.verifiers_tiny_env`): a two-turn
game over an in-memory dataset, scored by a rule-based rubric. The rubric pays the share of ASCII characters in
the policy's turns, so even the random tiny model gets mixed rewards (a signal to train on in 2 steps)."""

from datasets import Dataset

import verifiers as vf


class TwoTurns(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Once more, shorter.")]


def ascii_share(completion, **kwargs) -> float:
    text = "".join(m.content or "" for m in completion if m.role == "assistant" and isinstance(m.content, str))
    return sum(ord(c) < 128 for c in text) / len(text) if text else 0.0


def load_environment(**kwargs) -> vf.Environment:
    rows = [{"question": f"Say something about the number {i}.", "answer": str(i)} for i in range(16)]
    return TwoTurns(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[ascii_share]), max_turns=2,
                    system_prompt="Answer briefly.", **kwargs)
