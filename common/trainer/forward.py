"""The trainer's forward: token log-probs (and entropy) of a causal LM over a micro-batch, and the kernels under
them. `sequence_logprobs` is the one call; the rest is how it stays small in memory and time:

- only trained positions go through the LM head, in chunks, with a hand-written backward (`_HeadLogprobs`);
- padded micro-batches run a shared prompt once (`shared_prompt_layout`);
- packed micro-batches (`--max-tokens-per-micro-batch`) run padding-free, each sequence attending to itself only
  (`packed_attention`, which the trainer gives its models once, `use_packed_attention`);
- `micro_batches` cuts every pass the trainer runs (policy, reference, critic);
- FSDP: the sharded root runs `logprobs_forward` as one of its forwards (common/trainer/fsdp.py), so it gathers
  its parameters around it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist

import common.vlm as vlm
from common.compat.transformers import attention_implementation
from common.experience import Batch
from common.trainer.parallel import DataParallel


LOGPROB_CHUNK_TOKENS = 1024
"""Tokens per vocabulary projection in `sequence_logprobs`: peak logits memory is this x vocab x 4 bytes (fp32)."""


def lm_body(model):
    """The transformer body of a causal LM (the part before the LM head), also through a peft LoRA wrapper."""
    return model.get_base_model().base_model if hasattr(model, "get_base_model") else model.base_model


def hidden_states(body, input_ids, attention_mask, packed: bool = False, mask=None):
    """Last hidden states [B, T, H] of a causal LM body (`model.base_model`), in the padded layout.

    Position ids come from the attention mask, so left and right padding give the same numbers. `packed`: padding
    is removed first and the real tokens of every row run as one sequence of N tokens with position ids restarting
    per row, attending within its own row only (`packed_attention`, given by `use_packed_attention`; with flash
    attention transformers goes varlen from the position ids), so the padding costs no compute. Otherwise, given
    the trained positions `mask` [B, T-1], rows that share their prompt run it once (`shared_prompt_layout`). Either
    way the result is scattered back to the padded layout (zeros at padding), so callers see the same tensors.
    """
    shared = None if packed or mask is None else shared_prompt_layout(body, input_ids, attention_mask, mask)
    if shared is not None:
        flat_ids, flat_positions, allowed, index = shared
        flat = body(input_ids=flat_ids[None], attention_mask=allowed, position_ids=flat_positions[None],
                    use_cache=False).last_hidden_state[0]
        return flat[index] * attention_mask[..., None].to(flat.dtype)  # [B, T, H]; a prompt's gradients add up
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if not packed:
        return body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False).last_hidden_state
    real = attention_mask.bool()
    inputs = dict(input_ids=input_ids[real][None], attention_mask=None, position_ids=position_ids[real][None],
                  use_cache=False)
    if attention_implementation(getattr(body, "config", None)) not in (PACKED, PACKED_SPLIT):
        flat = body(**inputs).last_hidden_state[0]  # flash attention: varlen from the position ids; eager: a mask
    else:
        lengths = tuple(attention_mask.sum(-1).tolist())
        starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(input_ids.device)
        inputs["attention_mask"] = _NO_MASK.to(input_ids.device)  # a prepared 4D mask: none is built; unread
        flat = body(**inputs, tandem_segments=Segments(lengths, starts)).last_hidden_state[0]
    hidden = flat.new_zeros(*input_ids.shape, flat.shape[-1])
    return hidden.masked_scatter(real[..., None], flat)


_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""What a packed forward passes as its attention mask: transformers takes a 4D mask as prepared and builds no [N, N]
one; `packed_attention` attends per sequence and never reads it."""


PACKED, PACKED_SPLIT = "tandem_packed", "tandem_packed_split"
"""The attention implementations `use_packed_attention` gives a model (transformers' AttentionInterface, by name).
Both are sdpa in a padded forward. In a packed forward `PACKED` runs flash attention's varlen kernel where it runs
(CUDA, bf16 or fp16), one launch per layer over every sequence, else causal sdpa per sequence; `PACKED_SPLIT` always
runs per sequence (bench/train_step.py --packed-attention split, to compare)."""


def use_packed_attention(hf_model, split: bool = False) -> None:
    """Give an sdpa model tandem's packed attention (`packed_attention`), under its own name: the same as sdpa in a
    padded forward, causal within each sequence in a packed one. Other implementations keep theirs (flash attention
    packs from the position ids itself; eager packs nothing: `hidden_states` runs it as a block-diagonal mask)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if attention_implementation(hf_model.config) not in ("sdpa", PACKED, PACKED_SPLIT):
        return
    for name, varlen in ((PACKED, True), (PACKED_SPLIT, False)):
        AttentionInterface.register(name, functools.partial(packed_attention, varlen=varlen))
        AttentionMaskInterface.register(name, sdpa_mask)
    hf_model.set_attn_implementation(PACKED_SPLIT if split else PACKED)


class Segments(NamedTuple):
    """The sequences of a packed forward: their lengths in order and the offsets where each starts (int32 [S+1] on
    the tokens' device, flash attention's `cu_seqlens`)."""
    lengths: tuple[int, ...]
    starts: torch.Tensor


def _varlen_runs(query: torch.Tensor, dropout: float) -> bool:
    """Flash attention's varlen kernel takes these: CUDA on an sm80+ card, half precision, head size <= 256."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and dropout == 0.0 and query.shape[-1] <= 256 and query.shape[-1] % 8 == 0
            and torch.cuda.get_device_capability(query.device) >= (8, 0))


@functools.cache
def _takes_keyword(function, name: str) -> bool:
    return name in inspect.signature(function).parameters


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     tandem_segments: Segments | None = None, varlen: bool = True, **kwargs):
    """transformers' sdpa attention, except for a packed forward (`tandem_segments`), which attends causally
    within each sequence only: no [N, N] mask in memory and no attention computed across sequences (with a
    block-diagonal mask sdpa computes all N x N scores and cannot use its flash kernel). The segments travel as a
    keyword of the forward, so a checkpointed layer's recomputation sees them.

    On a GPU (`varlen`): one varlen flash-attention call over all sequences (grouped-query heads as they are).
    Per-sequence sdpa would launch a kernel per sequence per layer in each direction, each filling a fraction of
    the GPU. Elsewhere: causal sdpa per sequence, cut by `split`: the backward of one slice per sequence would write
    a zero-filled [N]-long gradient that is then added up, once per sequence; a split's backward is one
    concatenation."""
    if tandem_segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if varlen and _varlen_runs(query, dropout):
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, head size]
        longest = max(tandem_segments.lengths)
        # The kernel takes fewer key/value heads as they are; torch >= 2.13 asks to be told (enable_gqa), 2.11 has
        # no such keyword.
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] and _takes_keyword(varlen_attn, "enable_gqa") else {}
        out = varlen_attn(q, k, v, tandem_segments.starts, tandem_segments.starts, longest, longest, scale=scaling,
                          window_size=(-1, 0), **gqa)  # (-1, 0): causal
        return out[None], None
    gqa = query.shape[1] != key.shape[1]
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(*(t.split(tandem_segments.lengths, dim=2) for t in (query, key, value)))], dim=2)
    return out.transpose(1, 2).contiguous(), None


SHARED_PROMPT_MAX_TOKENS = 2048
"""`shared_prompt_layout` packs a micro-batch only up to this many tokens (its attention mask is a dense [N, N]);
0 turns prompt sharing off."""


def shared_prompt_layout(body, input_ids, attention_mask, mask):
    """One sequence in which every distinct prompt of the micro-batch appears once, followed by the rest of each row
    that starts with it, or None when no two rows share a prompt, or when that is not 20 % fewer tokens than the
    padded micro-batch, or more than SHARED_PROMPT_MAX_TOKENS.

    GRPO samples n responses per prompt, so a micro-batch of them holds each prompt n times; running it once cuts
    the tokens of the forward and backward by up to (n-1) prompts per group, with the same numbers: the prompt's
    tokens attend as before, each row's tokens attend to the shared prompt and to the row's own earlier tokens
    (position ids continue from the prompt), and the prompt's gradients add up over the rows that read it. A row's
    prompt is its tokens up to its first trained one (`mask` [B, T-1], 1 where the next token is trained). Rows must
    be right-padded. Returns (ids [N], position ids [N], attention mask [1, 1, N, N] as the attention implementation
    wants it, index [B, T] of each padded position in the N tokens).
    """
    implementation = attention_implementation(getattr(body, "config", None))
    if (SHARED_PROMPT_MAX_TOKENS <= 0 or implementation not in ("sdpa", "eager", PACKED, PACKED_SPLIT)
            or len(input_ids) < 2):
        return None
    lengths = attention_mask.sum(-1)
    if not bool((attention_mask.long().cumprod(-1).sum(-1) == lengths).all()):  # left padding: not handled here
        return None
    trained = mask.bool()
    prompt = torch.where(trained.any(-1), trained.long().argmax(-1) + 1, 0).tolist()  # 0: nothing trained, no prompt
    groups: dict[tuple | int, list[int]] = {}  # the prompt's ids (or the row, when it has none) -> its rows
    rows = input_ids.tolist()
    for i, p in enumerate(prompt):
        groups.setdefault(tuple(rows[i][:p]) if p else i, []).append(i)
    total = int(lengths.sum()) - sum(prompt[members[0]] * (len(members) - 1) for members in groups.values())
    if len(groups) == len(rows) or total > min(SHARED_PROMPT_MAX_TOKENS, 0.8 * input_ids.numel()):
        return None  # nothing shared, a mask too large, or under 20 % fewer tokens than the padded batch
    ids, positions, owner, segment = [], [], [], []  # owner: group of each token; segment: -1 prompt, else its row
    index = torch.zeros_like(input_ids)
    for g, members in enumerate(groups.values()):
        p = prompt[members[0]]
        start = len(ids)
        ids += rows[members[0]][:p]
        positions += range(p)
        owner += [g] * p
        segment += [-1] * p
        for i in members:
            n = int(lengths[i])
            index[i, :p] = torch.arange(start, start + p)
            index[i, p:n] = torch.arange(len(ids), len(ids) + n - p)
            ids += rows[i][p:n]
            positions += range(p, n)
            owner += [g] * (n - p)
            segment += [i] * (n - p)
    device = input_ids.device
    ids, positions = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
    owner, segment = torch.tensor(owner, device=device), torch.tensor(segment, device=device)
    # query q may read key k: same group, not later, and k is the prompt or q's own row
    allowed = ((owner[:, None] == owner[None, :]) & (positions[None, :] <= positions[:, None])
               & ((segment[None, :] == -1) | (segment[None, :] == segment[:, None])))[None, None]
    if implementation == "eager":  # eager attention adds its mask to the scores
        dtype = body.get_input_embeddings().weight.dtype
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return ids, positions, allowed, index


def _scaled_logits(raw: torch.Tensor, temperature: float, softcap,
                   with_slope: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's output as the sampler sees it, in a new fp32 tensor: softcapped (Gemma 2), then divided by the
    temperature; and, `with_slope` and softcapped, the softcap's derivative at every logit (else None)."""
    z = raw.to(torch.float32, copy=True)
    slope = None
    if softcap:
        z.div_(softcap).tanh_()
        slope = 1 - z.square() if with_slope else None  # d(c tanh(x / c))/dx
        z.mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z, slope


class _HeadLogprobs(torch.autograd.Function):
    """Log-prob of `targets` (and entropy) through the LM head for a chunk of hidden states [C, H], with the [C, V]
    logits alive only inside the forward and, recomputed from the hidden states, inside the backward: nothing
    vocabulary-wide is saved in between. The backward writes d/d(logits) in place over the recomputed logits (for
    log p_t: onehot - p; for the entropy H: -p (log p + H)) and takes them through the head's own graph, so any head
    (tied, biased, LoRA-wrapped, FSDP-gathered) gets its gradient: a few passes over one fp32 [C, V] buffer, where
    autograd through log-softmax, entropy and a checkpoint's recomputation makes several times as many. The head's
    trainable parameters are inputs (`params`, after the 7 others), so they get a gradient even where the hidden
    states have none (a frozen body under a trainable head)."""

    @staticmethod
    def forward(ctx, hidden, targets, head, temperature: float, softcap, with_entropy: bool, entropy_grad: bool,
                *params):
        z, _ = _scaled_logits(head(hidden), temperature, softcap)
        lse = torch.logsumexp(z, -1)
        logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        entropy = None
        if with_entropy:  # H = lse - sum(p z), the sum as a batched dot: no [C, V] product
            p = z.sub(lse[:, None]).exp_()
            entropy = lse - torch.bmm(p[:, None, :], z[:, :, None]).view(-1)
            if not entropy_grad:
                ctx.mark_non_differentiable(entropy)
        ctx.head, ctx.temperature, ctx.softcap = head, temperature, softcap
        ctx.save_for_backward(hidden, targets, lse, entropy if entropy_grad else None)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        grads = [None] * len(ctx.needs_input_grad)
        wanted = [i for i, needed in enumerate(ctx.needs_input_grad) if needed]  # 0: the hidden states, 7+: params
        if not wanted or (grad_logprobs is None and grad_entropy is None):
            return tuple(grads)
        hidden, targets, lse, entropy = ctx.saved_tensors
        params = [p for p in ctx.head.parameters() if p.requires_grad]  # the forward's `params`, in order
        with torch.enable_grad():
            leaf = hidden.detach().requires_grad_(ctx.needs_input_grad[0])
            raw = ctx.head(leaf)
        logp, slope = _scaled_logits(raw.detach(), ctx.temperature, ctx.softcap, with_slope=True)
        logp.sub_(lse[:, None])
        g = (grad_logprobs if grad_logprobs is not None else lse.new_zeros(lse.shape))[:, None]
        if grad_entropy is not None and entropy is not None:
            grad = logp.exp()
            grad.mul_(logp.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(g)).neg_()
        else:
            grad = logp.exp_().mul_(-g)
        grad.scatter_add_(-1, targets[:, None], g)
        if slope is not None:
            grad.mul_(slope)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        inputs = [leaf if i == 0 else params[i - 7] for i in wanted]
        for i, grad_input in zip(wanted, torch.autograd.grad(raw, inputs, grad.to(raw.dtype), allow_unused=True)):
            grads[i] = grad_input
        return tuple(grads)


def token_logprobs_chunked(head, hidden, targets, temperature: float = 1.0, softcap=None, with_entropy: bool = False,
                           entropy_grad: bool = False, chunk_tokens: int = LOGPROB_CHUNK_TOKENS):
    """Log-prob of `targets` [N] (and entropy) from hidden states [N, H] through the LM `head`, `chunk_tokens` at a
    time (`_HeadLogprobs`): memory holds one chunk's [C, V] logits at a time and never a [N, V] tensor, in either
    pass. The entropy has a gradient only if `entropy_grad`. With no position (N = 0) the head still runs once, on
    nothing: the result stays in the graph (a sharded trainer's empty turn joins the collectives through it)."""
    logprobs, entropies = [], []
    params = [p for p in head.parameters() if p.requires_grad]
    for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
        lp, ent = _HeadLogprobs.apply(h, t, head, temperature, softcap, with_entropy, entropy_grad, *params)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)


def sequence_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, mask=None,
                      with_entropy: bool = False, entropy_grad: bool = False, packed: bool = False, images=None):
    """Log-prob of every token given the ones before it, at `temperature`: [B, T-1] (the first token has none).

    Only positions where `mask` ([B, T-1], default: every real token) is 1 go through the vocabulary projection,
    so prompt tokens cost no [V]-wide logits; other positions are 0. The projection runs in chunks of
    LOGPROB_CHUNK_TOKENS tokens (`token_logprobs_chunked`): no [B, T, V] tensor exists in the forward or backward.
    Position ids come from the attention mask, so left and right padding give the same numbers; `packed` runs the
    rows padding-free (`hidden_states`). The explorer's behaviour log-probs are checked against this.
    Entropy (same shape) is computed without a graph unless `entropy_grad` (an entropy bonus needs one).
    `images` (a VLM's rows: each row's ImageInputs or None) go through the vision tower (common/vlm.py); such
    micro-batches run padded, without packing or prompt sharing (their rope positions are 3-D).
    """
    forward = getattr(model, "tandem_logprobs_forward", None)  # FSDP2: the root's forward, it gathers around it
    if forward is not None:
        return forward(input_ids, attention_mask, temperature, mask, with_entropy, entropy_grad, packed, images)
    return logprobs_forward(model, input_ids, attention_mask, temperature, mask, with_entropy, entropy_grad, packed,
                            images)


def logprobs_forward(model, input_ids, attention_mask, temperature, mask, with_entropy, entropy_grad, packed,
                     images=None):
    """`sequence_logprobs` on one model, unsharded."""
    selected = (attention_mask[:, 1:] if mask is None else mask).bool()
    if images is not None:
        hidden = vlm.vlm_hidden_states(lm_body(model), input_ids, attention_mask, images)[:, :-1]
    else:
        hidden = hidden_states(lm_body(model), input_ids, attention_mask, packed, selected)[:, :-1]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    token_logprobs, token_entropy = token_logprobs_chunked(
        model.get_output_embeddings(), hidden[selected], input_ids[:, 1:][selected], temperature, softcap,
        with_entropy, entropy_grad)
    logprobs = torch.zeros(selected.shape, dtype=torch.float32, device=hidden.device)
    logprobs = logprobs.masked_scatter(selected, token_logprobs)
    if not with_entropy:
        return logprobs
    entropy = torch.zeros(selected.shape, dtype=torch.float32, device=hidden.device)
    return logprobs, entropy.masked_scatter(selected, token_entropy)


# ------------------------------------------------------------------------------------------------ micro-batches
# Which rows one forward/backward pass runs, decided here for the policy, the reference model and the critic
# alike: a group's samples sit together (rows that share a prompt run it once: `shared_prompt_layout`); data
# parallel: each trainer runs its own contiguous share of the minibatch (neighbours share prompts; possibly empty:
# it then adds zero gradient); a fixed number of sequences (--micro-batch-size) or whole sequences up to a token
# budget (--max-tokens-per-micro-batch, run padding-free); FSDP: every pass is a collective, so each trainer runs as
# many as the busiest one, the extra ones idle. Packing changes how the work is cut, not what is computed: each
# micro-batch's loss is still weighted by its share of the minibatch's tokens (or sequences), so the summed gradient
# is that of padded ones.

def cut(idx: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Index tensors, in order, covering `idx`: `micro_batch_size` sequences each, or (max_tokens > 0) as many
    consecutive sequences as fit in `max_tokens` real tokens (`lengths[i]`; a longer sequence goes alone)."""
    if max_tokens <= 0:
        return [idx[start: start + micro_batch_size] for start in range(0, len(idx), micro_batch_size)]
    out, current, used = [], [], 0
    for i in idx.tolist():
        n = int(lengths[i])
        if current and used + n > max_tokens:
            out.append(torch.tensor(current, dtype=idx.dtype))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        out.append(torch.tensor(current, dtype=idx.dtype))
    return out


def micro_batches(batch: Batch, rows: torch.Tensor, args,
                  dp: DataParallel | None = None) -> Iterator[tuple[torch.Tensor | None, Batch]]:
    """(rows, the micro-batch of those rows) for each pass this trainer runs over `rows` of `batch`. With `dp` (a
    minibatch's update) only this trainer's share; an idle pass of a sharded trainer comes as (None, row 0 of the
    batch): run it, scale its loss by 0. Without `dp` (a whole-batch pass, the same on every trainer) every row."""
    rows = rows[torch.argsort(batch.group_ids[rows].cpu(), stable=True)]  # index lists stay on the CPU
    if dp is not None:
        rows = torch.tensor_split(rows, dp.size)[dp.rank]
    parts = cut(rows, batch.attention_mask.sum(-1).cpu(), args.micro_batch_size, args.max_tokens_per_micro_batch)
    if dp is not None and dp.enabled and dp.sharded:
        most = torch.tensor([len(parts)], device=dp.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=dp.group)
        parts += [None] * (int(most.item()) - len(parts))
    for part in parts:
        yield part, batch.select(torch.zeros(1, dtype=torch.long) if part is None else part)


@torch.no_grad()
def batch_logprobs(model, batch, args) -> torch.Tensor:
    """Log-probs of a whole rollout batch's trained tokens, without a graph (reference and proximal policies)."""
    out = torch.zeros_like(batch.response_mask)
    for rows, mb in micro_batches(batch, torch.arange(len(batch)), args):
        out[rows] = sequence_logprobs(model, mb.input_ids, mb.attention_mask, args.temperature, mb.response_mask,
                                      packed=args.max_tokens_per_micro_batch > 0, images=mb.images)
    return out
