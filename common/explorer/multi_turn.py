"""multi_turn: n episodes of the agent (the policy) in the task's environment, token-in/token-out.

Each episode is one token sequence (common/explorer/chat.py): first prompt | sampled turn 1 | observation 1 |
sampled turn 2 | ... The experience trains the sampled ids only (loss mask 1), each with its behaviour log-prob and
the weights version that sampled it; observation and tool tokens have mask 0, log-prob 0.

An episode ends when the environment says done ("done"), after --max-turns turns ("max_turns"), when the next
turn would not fit in --episode-token-budget ("budget": the finish reason is then "length", like a truncated
response), when the environment raises ("error") or the template cannot be extended prefix-wise ("template").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.envs import make_env
from common.explorer.chat import TemplateMismatch


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None          # None while live; "stop", or "length" when the budget ended it
    end_reason: str | None = None             # done | max_turns | budget | error | template
    turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    success: bool | None = None
    final_text: str = ""                      # the last assistant turn (what a verifier scores)
    error: str = ""
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    env: object = None

    @property
    def segments(self) -> int:
        return self.turns

    def loss_mask(self, partial_loss: str = "last_segment") -> list[int]:
        return list(self.mask)

    def trained_version(self, partial_loss: str = "last_segment") -> int:
        return min((v for v, m in zip(self.versions, self.mask) if m), default=self.versions[0] if self.versions else 0)

    def env_reward(self, mode: str) -> float:
        """ALGO LOGIC: the environment's reward of the episode: the sum of its step rewards, or the last one."""
        if not self.turn_rewards:
            return 0.0
        return sum(self.turn_rewards) if mode == "sum" else self.turn_rewards[-1]

    def _append(self, ids, logprobs, trained: int, version: int, versions: list[int] | None = None):
        self.response_ids += ids
        self.logprobs += logprobs
        self.mask += [trained] * len(ids)
        self.versions += versions[:len(ids)] if versions else [version] * len(ids)  # per token, if mid-generation

    def _end(self, reason: str):
        self.end_reason = reason
        self.finish_reason = "length" if reason == "budget" else "stop"
        if self.env is not None:
            self.env.close()
            self.env = None


class MultiTurn:
    """The samples of one task as episodes; `requests` / `receive` let the runner batch every live episode's next
    turn (of every task) into one engine call."""

    def __init__(self, task: dict, group_id: int, n: int, ctx):
        from common.explorer.groups import Group

        self.ctx = ctx
        self.group = Group(task, group_id, [self._start(task) for _ in range(n)])

    def _start(self, task: dict) -> Episode:
        env = make_env(task["env"])
        if hasattr(env, "tool_timeout_s"):
            env.tool_timeout_s = self.ctx.tool_timeout_s
        messages, tools = self.ctx.renderer.with_tools(env.reset(task), env.tool_schemas())
        prompt = self.ctx.renderer.prompt_ids(messages, tools)
        if len(prompt) >= self.ctx.episode_token_budget:
            raise ValueError(f"task {task.get('id')}: its first prompt has {len(prompt)} tokens, not below "
                             f"--episode-token-budget {self.ctx.episode_token_budget}")
        return Episode(prompt_ids=prompt, messages=messages, tools=tools, env=env)

    def _cap(self, e: Episode) -> int:
        return min(self.ctx.max_new_tokens, self.ctx.episode_token_budget - len(e.prompt_ids) - len(e.response_ids))

    def requests(self) -> list[tuple[Episode, list[int], int]]:
        return [(e, e.prompt_ids + e.response_ids, self._cap(e)) for e in self.group.responses
                if e.finish_reason is None]

    def receive(self, e: Episode, generation, version: int) -> int:
        """One sampled turn: append its exact ids, step the environment, append the observation's ids. Returns the
        number of sampled tokens kept."""
        cap = self._cap(e)
        ids, logprobs = generation.response_ids[:cap], generation.logprobs[:cap]
        stopped = generation.finish_reason == "stop" and len(generation.response_ids) <= cap
        e._append(ids, logprobs, 1, version, generation.versions)
        e.turns += 1
        if not stopped and cap < self.ctx.max_new_tokens:  # cut by the episode budget, not the per-turn limit
            e._end("budget")
            return len(ids)
        text = self.ctx.tokenizer.decode(ids, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        e.final_text = text
        try:
            result = e.env.step(text)
        except Exception as exc:  # noqa: BLE001  (an environment bug ends this episode, counted; not the run)
            e.error = f"{type(exc).__name__}: {exc}"
            e._end("error")
            return len(ids)
        e.turn_rewards.append(float(result.reward))
        e.tool_calls += int(result.info.get("tool_calls", 0))
        e.tool_errors += list(result.info.get("tool_errors", []))
        if "success" in result.info:
            e.success = bool(result.info["success"])
        if result.done:
            e._end("done")
        elif e.turns >= self.ctx.max_turns:
            e._end("max_turns")
        else:
            try:
                obs = self.ctx.renderer.observation_ids(e.messages, result.messages, ids[-1] if stopped else None,
                                                        e.tools)
            except TemplateMismatch as exc:
                e.error = str(exc)
                e._end("template")
                return len(ids)
            if len(e.prompt_ids) + len(e.response_ids) + len(obs) >= self.ctx.episode_token_budget:
                e._end("budget")
            else:
                e._append(obs, [0.0] * len(obs), 0, version)
                e.messages += result.messages
        return len(ids)

    def finished(self) -> bool:
        return all(e.finish_reason for e in self.group.responses)
