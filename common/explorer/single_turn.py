"""single_turn: the plain rollout as a workflow. The task's prompt (chat template applied) gets n sampled
responses; with --rollout-token-budget a response may take several rollout steps (partial rollouts, segments of
common.explorer.groups.Response), otherwise it ends in the step it started."""

from __future__ import annotations

from common.model import chat_prompt_ids
from common.explorer.groups import Response
from common.explorer.workflow import Group, Workflow
from common.vlm import image_prompt
from rewards.vision import load_images


class SingleTurn(Workflow):
    partial_rollouts = True
    images = True

    def __init__(self, task: dict, group_id: int, n: int, ctx):
        self.ctx = ctx
        images = None
        if task.get("image") and not task.get("blind"):  # a VLM policy (checked): placeholders, pixels alongside
            prompt, images = image_prompt(ctx.processor, task["prompt"], load_images(task))
        else:
            prompt = chat_prompt_ids(ctx.tokenizer, task)
        self.group = Group(task, group_id, [Response(list(prompt), images=images) for _ in range(n)])

    def requests(self):
        segment = self.ctx.token_budget or self.ctx.max_new_tokens
        return [(r, r.prompt_ids + r.response_ids, min(segment, self.ctx.max_new_tokens - len(r.response_ids)))
                for r in self.group.responses if r.finish_reason is None]

    def receive(self, r: Response, generation, version: int) -> int:
        before = len(r.response_ids)
        r.extend(generation, version, self.ctx.max_new_tokens)
        return len(r.response_ids) - before
