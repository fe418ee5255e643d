"""multi_turn: n episodes of the agent (the policy) in the task's environment, token-in/token-out.

Each episode is one token sequence (common/explorer/chat.py): first prompt | sampled turn 1 | observation 1 |
sampled turn 2 | ... The experience trains the sampled ids only (loss mask 1), each with its behaviour log-prob and
the weights version that sampled it; observation and tool tokens have mask 0, log-prob 0.

What the environment sees of a turn is its text with the reasoning stripped (chat.strip_reasoning: nothing inside
`<think>...</think>` reaches the environment or the tool parser). With in-turn tools (--in-turn-tools, ReTool /
Search-R1 style) a turn that writes a complete `<tool_call>...</tool_call>` is cut right after it (the ids sampled
after the call are dropped: the kept prefix and its log-probs are exactly what the model sampled), the result is
appended as masked tokens and generation goes on in the same turn.

An episode ends (`end_reason`, counted as rollout/end/<reason>) when the environment says done ("done"), after
--max-turns turns ("max_turns"), when a turn is cut at --max-new-tokens ("truncated"; with --truncated-turns
continue the environment steps the cut turn and the episode goes on, still marked cut) or the next turn would not
fit in --episode-token-budget ("budget"), when an environment call (reset, step, close) raises anything, returns
something invalid ("error") or runs past --env-step-timeout-s ("timeout"), all through the one boundary
(common/envs/boundary.py; the finer reason is counted as rollout/env_failure/<call>_<kind>), or the chat template
cannot render its messages ("template"). Only the episodes cut by
a token limit (truncated, budget, or a cut turn that went on) carry finish reason "length", like a truncated
single-turn response, so --mask-truncated and rollout/truncated_frac see exactly them; running out of turns is a legitimate ending.
The failures (error, timeout, template) are marked failed and score the environment's `worst_reward` whatever
came before (an error never pays more than losing; --drop-failed-rewards drops them, counted per reason). The
verifier scores `final_text`: the last turn the policy wrote, "" when that turn was a tool call, was cut, or the
episode failed (an earlier turn's text never counts).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.envs.boundary import EnvFailure, EpisodeEnv
from common.explorer.chat import TemplateMismatch, strip_reasoning
from common.explorer.workflow import Group, TokenSample, Workflow
from rewards import Reward

CUT = ("truncated", "budget")              # ended by a token limit: finish reason "length"
FAILED = ("error", "timeout", "template")  # ended by a failure: scores worst_reward, dropped by --drop-failed-rewards


@dataclass
class Episode(TokenSample):
    finish_reason: str | None = None          # None while live; "stop", or "length" when a token limit cut it
    end_reason: str | None = None             # done | max_turns | truncated | budget | error | timeout | template
    turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    success: bool | None = None
    final_text: str = ""                      # the last turn's answer (what a verifier scores)
    format_ok: bool | None = None             # the environment's verdict on the answer's format, if it gives one
    error: str = ""
    failure: str = ""                         # an environment failure's reason: <call>_<kind> (boundary.py)
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    env: object = None
    in_turn: bool = False                     # the current turn goes on after an in-turn tool result
    tool_rounds: int = 0                      # in-turn tool results so far (bounded by --max-turns)
    cut_turns: int = 0                        # turns cut at --max-new-tokens (--truncated-turns continue)
    worst_reward: float = 0.0                 # the environment's: what the episode scores if it fails
    timeout_s: float = 300.0                  # --env-step-timeout-s, for every environment call

    @property
    def failed(self) -> bool:
        return self.end_reason in FAILED

    def env_reward(self, mode: str) -> float:
        """ALGO LOGIC: the environment's reward of the episode: the sum of its step rewards, or the last one."""
        if not self.turn_rewards:
            return 0.0
        return sum(self.turn_rewards) if mode == "sum" else self.turn_rewards[-1]

    # ------------------------------------------------------------------ reward (the Sample interface)
    def verifier_input(self, task: dict, tokenizer, whole_episodes: bool = False) -> str | None:
        """The final answer, only when the task names a verifier in "reward" (or with --reward-fn); never for a
        failed episode (it scores the environment's worst reward alone)."""
        return self.final_text if ("reward" in task or whole_episodes) and not self.failed else None

    def verifier_task(self, task: dict, whole_episodes: bool = False) -> dict:
        """For a --reward-fn: the task with the whole trajectory (every message, the assistant turns as sampled),
        the per-turn environment rewards and the end reason."""
        if not whole_episodes:
            return task
        return {**task, "trajectory": list(self.messages), "turn_rewards": list(self.turn_rewards),
                "end_reason": self.end_reason}

    def reward(self, verified: Reward | None, env_reward: str) -> Reward:
        """ALGO LOGIC: an episode's reward = the environment's (sum or last step reward) + the verifier's score (if
        the task names one). reward_info keeps the parts, the per-turn rewards, the end reason and format_ok (the
        verifier's, else the environment's verdict) for --format-reward. A failed episode (error, timeout,
        template) scores the environment's worst reward and nothing else, and is marked failed with its reason
        (--drop-failed-rewards; rewards/THREATS.md "Errors never pay")."""
        env = self.worst_reward if self.failed else self.env_reward(env_reward)
        info = {"reason": f"episode {self.end_reason}", "env_reward": env, "turn_rewards": list(self.turn_rewards),
                "end_reason": self.end_reason, "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": list(self.tool_errors)}
        if self.error:
            info["error"] = self.error
        if self.format_ok is not None:
            info["format_ok"] = self.format_ok
        score = env
        if verified is not None:
            score += verified.score
            info.update({"verifier": verified.score, "verifier_reason": verified.info.get("reason", "")})
            if "format_ok" in verified.info:
                info["format_ok"] = bool(verified.info["format_ok"]) and self.end_reason == "done"
            if verified.info.get("failed"):
                info["failed"] = True
        if self.failed:
            info.update({"failed": True, "failed_reason": self.end_reason, "format_ok": False})
        return Reward(score, info)

    def counts(self) -> dict[str, float]:
        """rollout/episodes, rollout/tool_calls, rollout/end/<reason>, rollout/episode_truncated (a count; the
        metrics divide it by the episodes) and rollout/tool_error/<reason>."""
        return {"rollout/episodes": 1, "rollout/tool_calls": self.tool_calls, f"rollout/end/{self.end_reason}": 1,
                "rollout/episode_truncated": int(self.finish_reason == "length"),
                **({f"rollout/env_failure/{self.failure}": 1} if self.failure else {}),
                **{f"rollout/tool_error/{k}": v for k, v in Counter(self.tool_errors).items()}}

    def fail(self, failure: EnvFailure):
        """End the episode on an environment failure."""
        self._note(failure)
        self._end(failure.reason)

    def _note(self, failure: EnvFailure):
        self.error, self.failure = self.error or str(failure), self.failure or failure.metric  # the first one counts

    def _end(self, reason: str, error: str = ""):
        self.end_reason, self.error = reason, error or self.error
        if self.env is not None:
            env, self.env = self.env, None
            try:
                env.close()
            except EnvFailure as exc:  # fails this episode, counted; not the run
                self._note(exc)
                self.end_reason = exc.reason
        self.finish_reason = "length" if self.end_reason in CUT or self.cut_turns else "stop"
        if self.end_reason in CUT or self.failed:
            self.final_text = ""  # a cut turn is no answer, a failed episode has none; an earlier turn's is not one
        if self.failed:  # nothing the episode collected before the failure counts (rewards/THREATS.md)
            self.turn_rewards = [0.0] * len(self.turn_rewards)
            self.success = False
            self.format_ok = False


def tool_call_end(ids: list[int], decode, visible=lambda text: text, close: str = "</tool_call>") -> int | None:
    """The number of leading ids whose text first holds a complete tool call that `visible` keeps (one written
    inside unclosed reasoning is not a call), or None."""
    for k in range(1, decode(ids).count(close) + 1):
        lo, hi = 1, len(ids)
        while lo < hi:  # the text of a prefix grows with it: binary search for the first prefix with k close tags
            mid = (lo + hi) // 2
            if decode(ids[:mid]).count(close) >= k:
                hi = mid
            else:
                lo = mid + 1
        if close in visible(decode(ids[:lo])):
            return lo
    return None


class MultiTurn(Workflow):
    """The samples of one task as episodes; `requests` / `receive` let the runner batch every live episode's next
    turn (of every task) into one engine call. `receive` may run in a worker thread (Rollouts runs environment
    steps off the decode path): it touches only its own episode."""

    env_pool = True  # the n environment resets at once

    def __init__(self, task: dict, group_id: int, n: int, ctx):
        self.ctx = ctx
        renderer = ctx.renderer
        self.group = Group(task, group_id, [Episode(prompt_ids=renderer.ids(renderer.glue_text)[:1] or [0],
                                                    timeout_s=ctx.env_step_timeout_s) for _ in range(n)])
        self._resets: list = []
        if ctx.env_pool is None:
            for e in self.group.responses:
                self._start(task, e)
        else:  # the n resets at once in the environment pool (each bounded: reset, then close if it fails); nobody
            # waits for them: the group's first turns join the engine once all are done (`starting`)
            self._resets = [ctx.env_pool.submit(self._start, task, e) for e in self.group.responses]

    def starting(self) -> bool:
        if self._resets and all(f.done() for f in self._resets):
            for f in self._resets:
                f.result()  # an exception here is a bug of ours (_start catches the environment's)
            self._resets = []
        return bool(self._resets)

    def _start(self, task: dict, e: Episode) -> None:
        """Start episode `e`: its environment built and reset (under --env-step-timeout-s), its first prompt
        rendered; an episode that cannot start has no tokens to train (an empty response) and its reason counted."""
        renderer = self.ctx.renderer
        e.env = EpisodeEnv(task["env"], self.ctx.env_settings, e.timeout_s)
        try:
            first, schemas = e.env.reset(task)
        except EnvFailure as exc:
            e.fail(exc)
            return
        e.worst_reward = e.env.worst_reward
        try:
            messages, tools = renderer.with_tools(first, schemas)
            prompt = renderer.prompt_ids(messages, tools)
        except TemplateMismatch as exc:
            e._end("template", str(exc))
            return
        e.prompt_ids, e.messages, e.tools = prompt, list(messages), tools
        if len(prompt) >= self.ctx.episode_token_budget:  # files are checked at load (common/run.py); not built-ins
            e._end("budget", f"first prompt has {len(prompt)} tokens, --episode-token-budget "
                   f"{self.ctx.episode_token_budget}")

    def _visible(self, text: str) -> str:
        """What the environment and the tool parser see of a turn: its text without the reasoning."""
        return strip_reasoning(text) if self.ctx.reasoning_parser == "think" else text

    def _step(self, e: Episode, action: str):
        """env.step(action) through the boundary (bounded, checked); None when it failed (the episode then ended)."""
        try:
            return e.env.step(action)
        except EnvFailure as exc:
            e.turn_rewards.append(0.0)
            e.fail(exc)
            return None

    def _cap(self, e: Episode) -> int:
        return min(self.ctx.max_new_tokens, self.ctx.episode_token_budget - len(e.prompt_ids) - len(e.response_ids))

    def requests(self) -> list[tuple[Episode, list[int], int]]:
        return [(e, e.prompt_ids + e.response_ids, self._cap(e)) for e in self.group.responses
                if e.finish_reason is None]

    def receive(self, e: Episode, generation, version: int) -> int:
        """One sampled turn (or the rest of one, after an in-turn tool result): append its exact ids, step the
        environment, append the observation's ids. Returns the number of sampled tokens kept."""
        cap = self._cap(e)
        ids, logprobs = generation.response_ids[:cap], generation.logprobs[:cap]
        stopped = generation.finish_reason == "stop" and len(generation.response_ids) <= cap
        decode = self.ctx.renderer.decode
        close = self.ctx.tool_format.close
        if self.ctx.in_turn_tools and close and e.env is not None and e.env.tools:
            cut = tool_call_end(ids, decode, self._visible, close)
            if cut is not None:
                return self._in_turn_call(e, ids[:cut], logprobs[:cut], version, generation.versions)
        e._append(ids, logprobs, 1, version, generation.versions)
        if not e.in_turn:
            e.turns += 1
        e.in_turn = False
        e.turn_ends.append(len(e.response_ids))
        text = decode(ids)  # in-turn tools: only the part after the last tool result (the calls already ran)
        e.messages.append({"role": "assistant", "content": text})
        if not stopped:  # cut by a token limit: the turn is not finished, so the environment does not see it
            if cap < self.ctx.max_new_tokens or self.ctx.truncated_turns == "end":
                e.turn_rewards.append(0.0)
                e._end("budget" if cap < self.ctx.max_new_tokens else "truncated")
                return len(ids)
            e.cut_turns += 1  # --truncated-turns continue: it does, and the episode counts as cut
        action = self._visible(text)
        result = self._step(e, action)
        if result is None:
            return len(ids)
        e.turn_rewards.append(result.reward)
        if result.info.get("calls"):  # OpenAI-shaped: the text beside the calls, and the calls themselves
            e.messages[-1] = {"role": "assistant", "content": result.info.get("content", ""),
                              "tool_calls": result.info["calls"]}
        calls = result.info.get("tool_calls", 0)
        e.tool_calls += calls
        e.tool_errors += list(result.info.get("tool_errors", []))
        e.final_text = "" if calls or not stopped else action  # a tool-call turn or a cut turn is no answer
        if "success" in result.info:
            e.success = bool(result.info["success"])
        if "format_ok" in result.info:
            e.format_ok = bool(result.info["format_ok"])
        if result.done:
            e._end("done")
        elif e.turns >= self.ctx.max_turns:
            e._end("max_turns")
        else:
            self._observe(e, result.messages, ids[-1] if stopped and ids else None, version)
        return len(ids)

    def _observe(self, e: Episode, observation: list[dict], sampled_stop: int | None, version: int) -> None:
        try:
            obs = self.ctx.renderer.observation_ids(observation, sampled_stop)
        except TemplateMismatch as exc:
            e._end("template", str(exc))
            return
        if len(e.prompt_ids) + len(e.response_ids) + len(obs) >= self.ctx.episode_token_budget:
            e._end("budget")
        else:
            e._append(obs, [0.0] * len(obs), 0, version)
            e.messages += observation

    def _in_turn_call(self, e: Episode, ids, logprobs, version: int, versions) -> int:
        """The turn called a tool mid-way: run it, append the result as masked tokens, and let the turn go on."""
        e._append(ids, logprobs, 1, version, versions)
        if not e.in_turn:
            e.turns += 1
        e.final_text = ""  # this turn called a tool: an earlier turn's answer is not its answer
        action = self._visible(self.ctx.renderer.decode(ids))  # tool_call_end found the call in this part
        close = self.ctx.tool_format.close
        result = self._step(e, action[:action.rindex(close) + len(close)])
        if result is None:
            e.turn_ends.append(len(e.response_ids))
            return len(ids)
        e.tool_calls += result.info.get("tool_calls", 0)
        e.tool_errors += list(result.info.get("tool_errors", []))
        results = "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>" for m in result.messages) + "\n"
        obs = self.ctx.renderer.ids(results)
        e.tool_rounds += 1
        if len(e.prompt_ids) + len(e.response_ids) + len(obs) >= self.ctx.episode_token_budget \
                or e.tool_rounds >= self.ctx.max_turns:
            e.turn_ends.append(len(e.response_ids))
            e.turn_rewards.append(0.0)
            e._end("budget" if e.tool_rounds < self.ctx.max_turns else "max_turns")
            return len(ids)
        e._append(obs, [0.0] * len(obs), 0, version)
        e.in_turn = True
        return len(ids)


def cannot_start(task: dict, ctx) -> str | None:
    """Why an episode of `task` cannot start (its first prompt leaves no room for a turn in the token budget, or
    the environment fails to reset), or None; the environment is closed either way. For the checks before a run."""
    e = MultiTurn(task, 0, 1, ctx).group.responses[0]
    if e.end_reason is not None:
        return e.error or e.end_reason
    e._end("done")
    return None
