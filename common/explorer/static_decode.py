"""The HF engine's own decode loop over a static KV cache: on CUDA each decode step is one replayed CUDA graph.

HF `generate` drives every decode step from Python: its logits processors, stop checks and sampling launch
kernels one by one between the model's replays, which on a GPU costs more than the step's own arithmetic. Here the
whole step (the model's forward over the static cache, the behaviour log-prob, sampling, the stop check) reads and
writes fixed tensors only, so on CUDA it is captured once as a CUDA graph and each step is a single replay; the
host checks whether every row has stopped once every `CHECK_EVERY` steps, not after each. On CUDA the model's
forward inside that step is compiled first (torch.compile: fused kernels, about a minute at 1.5B, once per run);
attention reads each KV head once for all the query heads that share it (`grouped_attention`), where transformers'
sdpa copies the whole cache to every query head whenever a mask is given.

What it keeps from `generate`, so the two agree token for token on the CPU for a fixed seed: left padding, the
positions of each row's real tokens, the temperature then top-p warpers, `torch.multinomial`'s draw over the same
probabilities, finished rows fed the pad token, the behaviour log-prob as log_softmax(logits / temperature) before
top-p (what the trainer recomputes). Simplifications: text models with sdpa or eager attention only (the engine
takes `generate` otherwise); every call runs all `slots` rows; no top-k, no repetition penalty (tandem's sampling
has neither).

Weight updates copy into the parameters in place, so a captured graph keeps reading the current weights.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface

CHECK_EVERY = 8  # decode steps between the host's "has every row stopped?" reads on CUDA (each one a sync)
GROUPED = "tandem_grouped_sdpa"  # the attention this loop's forwards use (registered below)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa under this loop's boolean mask [rows, 1, queries, keys], with the query heads that share a KV head
    stacked as extra query rows of that head: query head h reads KV head h // groups (transformers' grouping), so
    [rows, kv_heads x groups, queries, dim] is viewed as [rows, kv_heads, groups x queries, dim], and each KV head
    is read once."""
    rows, heads, queries, dim = query.shape
    groups = heads // key.shape[1]
    if groups > 1:
        mask = attention_mask.expand(-1, -1, groups, -1) if queries == 1 else attention_mask.repeat(1, 1, groups, 1)
    else:
        mask = attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(rows, key.shape[1], groups * queries, dim),
                                                           key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, queries, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED, grouped_attention)


def supported(model) -> bool:
    """A text model whose attention takes the explicit 4-D mask this loop builds."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager") and not hasattr(
        model.config, "vision_config")


class StaticDecoder:
    """`slots` rows x `tokens` positions of KV cache and every per-step tensor, allocated once on the model's
    device; `run` prefills a batch, then decodes it step by step (a CUDA graph per sampling kind on CUDA)."""

    def __init__(self, model, slots: int, tokens: int, pad_id: int, stop_ids: list[int]):
        from transformers import StaticCache

        self.model, self.slots, self.tokens = model, slots, tokens
        device = next(model.parameters()).device
        self.cuda = device.type == "cuda"
        self.cache = StaticCache(config=model.config, max_cache_len=tokens)
        long = dict(dtype=torch.long, device=device)
        self.pad = torch.tensor(pad_id, **long)
        self.stop_ids = torch.tensor(stop_ids, **long)
        self.valid = torch.zeros(slots, tokens, dtype=torch.bool, device=device)  # cache columns a row attends to
        self.column = torch.zeros(1, **long)  # the cache column the next step writes
        self.next_ids = torch.zeros(slots, 1, **long)  # the token each row feeds the next step
        self.positions = torch.zeros(slots, 1, **long)  # its position in the row (left padding not counted)
        self.step = torch.zeros(1, **long)  # index of the next new token
        self.done = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out_ids = torch.zeros(slots, tokens, **long)
        self.out_logprobs = torch.zeros(slots, tokens, dtype=torch.float32, device=device)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)  # of the log-probs; sampling's too
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        # the step's forward: compiled on CUDA (its kernels fused), then captured with the rest of the step
        self.forward = torch.compile(self._forward, dynamic=False) if self.cuda else self._forward
        self.graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        self.graph_error = ""  # why the CUDA graph could not be captured (then the steps run eagerly)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None

    def _forward(self, input_ids, position_ids, mask) -> torch.Tensor:
        """The model over `input_ids` at `position_ids` into the static cache, attending where `mask` [rows, 1,
        queries, cache positions] is True: the last position's logits."""
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def _model(self, forward, *inputs) -> torch.Tensor:
        """`forward` with the model's attention set to `grouped_attention` for the call (every forward of this loop;
        the model keeps its own attention for anyone else)."""
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = GROUPED
        try:
            return forward(*inputs)
        finally:
            config._attn_implementation = before

    # ------------------------------------------------------------------ one step: fixed tensors in, fixed tensors out
    def _choose(self, logits: torch.Tensor, greedy: bool, top_p: bool) -> None:
        """From the last position's logits: each row's token and its behaviour log-prob into the outputs at
        `step`, the stop flags, and the next step's input ids."""
        scores = logits.float()
        logprobs = torch.log_softmax(scores / self.temperature, -1)
        if greedy:
            chosen = scores.argmax(-1)
        else:
            scores = scores / self.temperature
            if top_p:  # transformers' TopPLogitsWarper, with the threshold in a tensor
                ordered, order = torch.sort(scores, descending=False)
                drop = ordered.softmax(-1).cumsum(-1) <= (1 - self.top_p)
                drop[..., -1:] = False
                scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
            # torch.multinomial's own draw for one sample (the same numbers for a seed) without its asserts on the
            # probabilities, which a CUDA graph need not hold
            probs = scores.softmax(-1)
            chosen = (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)
        behaviour = logprobs.gather(-1, chosen[:, None])
        chosen = torch.where(self.done, self.pad, chosen)  # a finished row feeds the pad token, as generate's do
        self.out_ids.index_copy_(1, self.step, chosen[:, None])
        self.out_logprobs.index_copy_(1, self.step, behaviour)
        self.done |= torch.isin(chosen, self.stop_ids)
        self.next_ids.copy_(chosen[:, None])
        self.step += 1

    def _decode_step(self, greedy: bool, top_p: bool) -> None:
        self.valid.index_fill_(1, self.column, True)
        logits = self._model(self.forward, self.next_ids, self.positions, self.valid[:, None, None, :])
        self._choose(logits, greedy, top_p)
        self.column += 1
        self.positions += 1

    # ------------------------------------------------------------------ capture
    def _state(self) -> list[torch.Tensor]:
        return [self.valid, self.column, self.next_ids, self.positions, self.step, self.done,
                *(layer.cumulative_length for layer in self.cache.layers)]

    def _graph(self, greedy: bool, top_p: bool):
        """The decode step captured as a CUDA graph (None on the CPU, or where capture failed: said once). The
        first capture also compiles the forward; a forward that fails to compile is captured uncompiled."""
        key = (greedy, top_p)
        if not self.cuda or self.graph_error:
            return None
        while key not in self.graphs:
            saved = [t.clone() for t in self._state()]
            try:
                self.graphs[key] = self._capture(greedy, top_p)
            except Exception as e:  # an op the compiler or the capture refuses in some model's forward
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                torch.cuda.synchronize()
                if self.forward is not self._forward:
                    print(f"[tandem] HF engine: the decode step's forward did not compile ({error}); capturing it "
                          "uncompiled", file=sys.stderr, flush=True)
                    self.forward = self._forward
                    continue
                self.graph_error = error
                print(f"[tandem] HF engine: the decode step could not be captured as a CUDA graph ({error}); it "
                      "runs eagerly", file=sys.stderr, flush=True)
                return None
            finally:  # the warm-up steps and the capture wrote nothing a rollout keeps: back to after the prefill
                for t, s in zip(self._state(), saved):
                    t.copy_(s)
        return self.graphs[key]

    def _capture(self, greedy: bool, top_p: bool) -> torch.cuda.CUDAGraph:
        # kernels chosen (and the forward compiled) on a side stream before capture, as CUDA graphs require; the
        # capture itself records without running
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(greedy, top_p)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._decode_step(greedy, top_p)
        return graph

    # ------------------------------------------------------------------ a batch
    @torch.no_grad()
    def run(self, rows: list[list[int]], real: int, max_new_tokens: int, temperature: float,
            top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` (exactly `slots` prompts, left-padded here; rows from `real` on are padding, stopped from the
        start): new token ids and behaviour log-probs, [real, steps] each on the CPU, each row to be cut at its
        first stop id. At most `max_new_tokens` steps; fewer once every row has stopped."""
        device = self.valid.device
        width = max(map(len, rows))
        assert len(rows) == self.slots and width + max_new_tokens <= self.tokens, (len(rows), width, max_new_tokens)
        input_ids = torch.full((self.slots, width), int(self.pad), dtype=torch.long)
        real_ids = torch.zeros(self.slots, width, dtype=torch.bool)
        for i, p in enumerate(rows):
            input_ids[i, width - len(p):] = torch.tensor(p)
            real_ids[i, width - len(p):] = True
        input_ids, real_ids = input_ids.to(device), real_ids.to(device)
        greedy = temperature == 0
        self.temperature.fill_(1.0 if greedy else temperature)
        self.top_p.fill_(top_p)
        self.cache.reset()
        self.valid.zero_()
        self.valid[:, :width] = real_ids
        positions = (real_ids.long().cumsum(-1) - 1).clamp(min=0)
        # prefill: causal over each row's real tokens; a padding query sees itself only (no row of -inf)
        columns = torch.arange(self.tokens, device=device)
        causal = columns[None, :] <= torch.arange(width, device=device)[:, None]
        allowed = (causal[None] & self.valid[:, None, :]) | (columns[None, None, :] == torch.arange(
            width, device=device)[None, :, None])
        logits = self._model(self._forward, input_ids, positions, allowed[:, None])
        self.step.zero_()
        self.done.zero_()
        self.done[real:] = True
        self._choose(logits, greedy, top_p < 1.0)
        self.column.fill_(width)
        self.positions.copy_(positions[:, -1:] + 1)
        graph = self._graph(greedy, top_p < 1.0) if max_new_tokens > 1 else None
        check = CHECK_EVERY if self.cuda else 1
        steps = 1
        while steps < max_new_tokens and (steps % check or not bool(self.done.all())):
            if graph is not None:
                graph.replay()
            else:
                self._decode_step(greedy, top_p < 1.0)
            steps += 1
        return self.out_ids[:real, :steps].cpu(), self.out_logprobs[:real, :steps].cpu()
