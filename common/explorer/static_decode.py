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
positions of each row's real tokens, the temperature then top-p warpers (per row here), `torch.multinomial`'s draw
over the same probabilities, finished rows fed the pad token, the behaviour log-prob as log_softmax(logits /
temperature) before top-p (what the trainer recomputes). Simplifications: text models with sdpa or eager attention
only (the engine takes `generate` otherwise); every call runs all `slots` rows; no top-k, no repetition penalty
(tandem's sampling has neither).

The cache's rows are slots that requests join and leave (`join`, `decode`, `progress`, `outputs`: continuous
batching, the streaming explorer's `add`/`step` on the HF engine). All slots write the same cache column each step,
a clock that wraps around the cache; a joining request's prompt goes into the columns just before the clock, so its
tokens stay contiguous (attention is order-free over the cached keys: their positions were applied before caching).
`run` is a whole batch joined at once from column 0, as `generate` has it.

Weight updates copy into the parameters in place, so a captured graph keeps reading the current weights.
"""

from __future__ import annotations

import sys

import torch

from common.compat.transformers import attention_implementation, attention_implementation_set

CHECK_EVERY = 8  # decode steps between the host's "has every row stopped?" reads on CUDA (each one a sync)
GROUPED = "tandem_grouped_sdpa"  # the attention this loop's forwards use (registered with transformers)


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


def supported(model) -> bool:
    """A text model whose attention takes the explicit 4-D mask this loop builds."""
    return attention_implementation(model.config) in ("sdpa", "eager") and not hasattr(model.config, "vision_config")


class SlotCache:
    """Keys and values of `slots` rows x `tokens` columns per layer, written where the decoder says: every row at
    `columns` (a decode step, or a whole batch's prefill), or only `rows` (a prefill of joining requests; their
    rows come back for attention). transformers' attention calls `update` with each layer's new keys and values
    (the protocol common/compat/transformers.py checks)."""

    def __init__(self, slots: int, tokens: int, layers: int):
        self.slots, self.tokens, self.keys, self.values = slots, tokens, [None] * layers, [None] * layers
        self.rows: torch.Tensor | None = None
        self.columns: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:  # allocated at the first prefill, in the model's dtype and head layout
            shape = (self.slots, key_states.shape[1], self.tokens, key_states.shape[3])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape[:3] + value_states.shape[3:])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is None:
            keys.index_copy_(2, self.columns, key_states)
            values.index_copy_(2, self.columns, value_states)
            return keys, values
        some_keys, some_values = keys[self.rows], values[self.rows]
        some_keys.index_copy_(2, self.columns, key_states)
        some_values.index_copy_(2, self.columns, value_states)
        keys[self.rows], values[self.rows] = some_keys, some_values
        return some_keys, some_values


class StaticDecoder:
    """`slots` rows x `tokens` positions of KV cache and every per-step tensor, allocated once on the model's
    device. `run` decodes one batch to its end; `join` / `decode` / `finished` let requests come and go."""

    def __init__(self, model, slots: int, tokens: int, pad_id: int, stop_ids: list[int]):
        from transformers import AttentionInterface

        AttentionInterface.register(GROUPED, grouped_attention)
        self.model, self.slots, self.tokens = model, slots, tokens
        device = next(model.parameters()).device
        self.cuda = device.type == "cuda"
        self.check_every = CHECK_EVERY if self.cuda else 1  # decode steps between reads of the stop flags
        self.cache = SlotCache(slots, tokens, model.config.num_hidden_layers)
        long = dict(dtype=torch.long, device=device)
        self.pad = torch.tensor(pad_id, **long)
        self.stop_ids = torch.tensor(stop_ids, **long)
        self.clock = 0  # the cache column the next decode step writes (host copy of `column`)
        self.column = torch.zeros(1, **long)
        self.valid = torch.zeros(slots, tokens, dtype=torch.bool, device=device)  # cache columns a row attends to
        self.next_ids = torch.zeros(slots, 1, **long)  # the token each row feeds the next step
        self.positions = torch.zeros(slots, 1, **long)  # its position in the row (left padding not counted)
        self.count = torch.zeros(slots, **long)  # new tokens so far (where the next one is written)
        self.limit = torch.zeros(slots, **long)  # at most this many new tokens
        self.done = torch.ones(slots, dtype=torch.bool, device=device)  # finished, or a free slot
        self.out_ids = torch.zeros(slots, tokens, **long)
        self.out_logprobs = torch.zeros(slots, tokens, dtype=torch.float32, device=device)
        self.temperature = torch.ones(slots, 1, dtype=torch.float32, device=device)  # 1 for greedy rows' log-probs
        self.top_p = torch.ones(slots, 1, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(slots, dtype=torch.bool, device=device)
        self.sampling = [(1.0, 1.0)] * slots  # host copy of each slot's (temperature, top_p): the graph to replay
        # the step's forward: compiled on CUDA (its kernels fused), then captured with the rest of the step
        self.forward = torch.compile(self._forward, dynamic=False) if self.cuda else self._forward
        self.graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        self.graph_error = ""  # why the CUDA graph could not be captured (then the steps run eagerly)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None

    def _forward(self, input_ids, position_ids, mask) -> torch.Tensor:
        """The model over `input_ids` at `position_ids` into the cache, attending where `mask` [rows, 1, queries,
        cache columns] is True: the last position's logits."""
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def _model(self, forward, *inputs) -> torch.Tensor:
        """`forward` with the model's attention set to `grouped_attention` for the call (every forward of this loop;
        the model keeps its own attention for anyone else)."""
        with attention_implementation_set(self.model.config, GROUPED):
            return forward(*inputs)

    # ------------------------------------------------------------------ one step: fixed tensors in, fixed tensors out
    def _pick(self, logits: torch.Tensor, temperature, top_p, greedy, sample: bool, nucleus: bool):
        """Each row's token from its last position's logits, and its behaviour log-prob: log_softmax(logits /
        temperature) (1 for greedy rows). `sample`: some row samples; `nucleus`: some row has top-p < 1."""
        scores = logits.float()
        logprobs = torch.log_softmax(scores / temperature, -1)
        chosen = scores.argmax(-1)
        if sample:
            scores = scores / temperature
            if nucleus:  # transformers' TopPLogitsWarper, with each row's threshold in a tensor
                ordered, order = torch.sort(scores, descending=False)
                drop = ordered.softmax(-1).cumsum(-1) <= (1 - top_p)
                drop[..., -1:] = False
                scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
            # torch.multinomial's own draw for one sample (the same numbers for a seed) without its asserts on the
            # probabilities, which a CUDA graph need not hold
            probs = scores.softmax(-1)
            chosen = torch.where(greedy, chosen, (probs / torch.empty_like(probs).exponential_(1)).argmax(-1))
        return chosen, logprobs.gather(-1, chosen[:, None]).squeeze(1)

    def _decode_step(self, sample: bool, nucleus: bool) -> None:
        """Every slot one token: written at its `count`; a finished row (or a free slot) feeds the pad token, as
        generate's finished rows do, and writes nothing that is read."""
        self.valid.index_fill_(1, self.column, True)
        self.cache.columns = self.column
        logits = self._model(self.forward, self.next_ids, self.positions, self.valid[:, None, None, :])
        chosen, behaviour = self._pick(logits, self.temperature, self.top_p, self.greedy, sample, nucleus)
        chosen = torch.where(self.done, self.pad, chosen)
        at = self.count.clamp(max=self.tokens - 1)[:, None]
        self.out_ids.scatter_(1, at, chosen[:, None])
        self.out_logprobs.scatter_(1, at, behaviour[:, None])
        self.count += (~self.done).long()
        self.done |= torch.isin(chosen, self.stop_ids) | (self.count >= self.limit)
        self.next_ids.copy_(chosen[:, None])
        self.column.copy_((self.column + 1) % self.tokens)
        self.positions += 1

    # ------------------------------------------------------------------ capture
    def _state(self) -> list[torch.Tensor]:
        return [self.valid, self.column, self.next_ids, self.positions, self.count, self.done]

    def _graph(self, key: tuple[bool, bool]):
        """The decode step captured as a CUDA graph (None on the CPU, or where capture failed: said once). The
        first capture also compiles the forward; a forward that fails to compile is captured uncompiled."""
        if not self.cuda or self.graph_error:
            return None
        while key not in self.graphs:
            # what the warm-up steps overwrite: the state, and the two cache columns they write
            columns = torch.tensor([self.clock, (self.clock + 1) % self.tokens], device=self.column.device)
            saved = [t.clone() for t in self._state()]
            kv = [(k.index_select(2, columns), v.index_select(2, columns))
                  for k, v in zip(self.cache.keys, self.cache.values)]
            try:
                self.graphs[key] = self._capture(*key)
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
            finally:  # the warm-up steps and the capture leave nothing a request keeps: back to before them
                for t, s in zip(self._state(), saved):
                    t.copy_(s)
                for (k, v), (sk, sv) in zip(zip(self.cache.keys, self.cache.values), kv):
                    k.index_copy_(2, columns, sk)
                    v.index_copy_(2, columns, sv)
        return self.graphs[key]

    def _capture(self, sample: bool, nucleus: bool) -> torch.cuda.CUDAGraph:
        # kernels chosen (and the forward compiled) on a side stream before capture, as CUDA graphs require; the
        # capture itself records without running
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(sample, nucleus)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._decode_step(sample, nucleus)
        return graph

    # ------------------------------------------------------------------ requests come and go
    @torch.no_grad()
    def join(self, slots: list[int], prompts: list[list[int]], limits: list[int],
             sampling: list[tuple[float, float]]) -> None:
        """Requests into free `slots`: `prompts` prefilled into the columns just before the clock, each with its
        new-token limit and (temperature, top_p) (temperature 0: greedy); the first token of each is chosen here."""
        device = self.valid.device
        width = max(map(len, prompts))
        assert all(len(p) + n <= self.tokens for p, n in zip(prompts, limits)), "a request longer than the cache"
        rows = torch.tensor(slots, device=device)
        input_ids = torch.full((len(slots), width), int(self.pad), dtype=torch.long)
        real = torch.zeros(len(slots), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            real[i, width - len(p):] = True
        input_ids, real = input_ids.to(device), real.to(device)
        columns = (self.clock - width + torch.arange(width, device=device)) % self.tokens
        valid = torch.zeros(len(slots), self.tokens, dtype=torch.bool, device=device)
        valid[:, columns] = real
        self.valid[rows] = valid
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        # causal over each row's real tokens; a padding query sees itself only (no row of -inf)
        order = torch.arange(width, device=device)
        seen = (order[None, :] <= order[:, None])[None] & real[:, None, :] | torch.eye(width, dtype=torch.bool,
                                                                                     device=device)
        mask = torch.zeros(len(slots), width, self.tokens, dtype=torch.bool, device=device)
        mask[:, :, columns] = seen
        everyone = slots == list(range(self.slots))
        self.cache.rows, self.cache.columns = (None if everyone else rows), columns
        try:
            logits = self._model(self._forward, input_ids, positions, mask[:, None])
        finally:
            self.cache.rows = None
        temperature = torch.tensor([[t if t > 0 else 1.0] for t, _ in sampling], device=device)
        top_p = torch.tensor([[p] for _, p in sampling], device=device)
        greedy = torch.tensor([t == 0 for t, _ in sampling], device=device)
        sample = not bool(greedy.all())
        chosen, behaviour = self._pick(logits, temperature, top_p, greedy, sample,
                                       any(t > 0 and p < 1 for t, p in sampling))
        limit = torch.tensor(limits, device=device)
        self.temperature[rows], self.top_p[rows], self.greedy[rows] = temperature, top_p, greedy
        self.limit[rows] = limit
        self.out_ids[rows, 0], self.out_logprobs[rows, 0] = chosen, behaviour
        self.count[rows] = 1
        self.done[rows] = torch.isin(chosen, self.stop_ids) | (limit <= 1)
        self.next_ids[rows, 0] = chosen
        self.positions[rows] = positions[:, -1:] + 1
        for slot, s in zip(slots, sampling):
            self.sampling[slot] = s

    @torch.no_grad()
    def decode(self, steps: int, active: list[int]) -> None:
        """`steps` decode steps over every slot (replays of the step's CUDA graph on CUDA); `active`: the slots
        whose sampling decides which graph."""
        chosen = [self.sampling[s] for s in active]
        key = (any(t > 0 for t, _ in chosen), any(t > 0 and p < 1 for t, p in chosen))
        graph = self._graph(key)
        for _ in range(steps):
            if graph is not None:
                graph.replay()
            else:
                self._decode_step(*key)
            self.clock = (self.clock + 1) % self.tokens

    def progress(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's (finished, new tokens so far), on the CPU (one read from the device)."""
        return self.done.cpu(), self.count.cpu()

    def outputs(self, slots: list[int], count: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """The new token ids and behaviour log-probs of `slots`, `count` of each (from `progress`)."""
        if not slots:
            return []
        rows = torch.tensor(slots, device=self.out_ids.device)
        ids, logprobs = self.out_ids[rows].cpu(), self.out_logprobs[rows].cpu()
        return [(ids[i, :count[s]].tolist(), logprobs[i, :count[s]].tolist()) for i, s in enumerate(slots)]

    def free(self, slots: list[int]) -> None:
        """Stop `slots` where they are (their requests were dropped)."""
        if slots:
            self.done[torch.tensor(slots, device=self.done.device)] = True

    # ------------------------------------------------------------------ a batch
    @torch.no_grad()
    def run(self, rows: list[list[int]], real: int, max_new_tokens: int, temperature: float,
            top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` (exactly `slots` prompts, left-padded here; rows from `real` on are padding, stopped from the
        start): new token ids and behaviour log-probs, [real, steps] each on the CPU, each row to be cut at its
        first stop id. At most `max_new_tokens` steps; fewer once every row has stopped."""
        assert len(rows) == self.slots, (len(rows), self.slots)
        width = max(map(len, rows))
        self.clock = width  # the prompts in columns 0..width-1, as generate has them
        self.column.fill_(width)
        self.join(list(range(self.slots)), rows, [max_new_tokens] * self.slots, [(temperature, top_p)] * self.slots)
        self.done[real:] = True
        steps = 1
        while steps < max_new_tokens and (steps % self.check_every or not bool(self.done.all())):
            self.decode(1, list(range(real)))
            steps += 1
        return self.out_ids[:real, :steps].cpu(), self.out_logprobs[:real, :steps].cpu()
