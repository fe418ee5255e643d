"""Chunked log-probs and padding-free packing (common/trainer/forward.py): same numbers and gradients as the one-shot, padded
computation, and no [tokens, vocab] tensor in either pass."""

import functools

import pytest
import torch

from common.model import load_model
from common.trainer.forward import hidden_states, sequence_logprobs, token_logprobs_chunked, use_packed_attention
from tests.conftest import MaxTensor, entropy_from_logits, reference_varlen_attn

pytestmark = pytest.mark.timeout(120)


def one_shot_logprobs(model, input_ids, attention_mask, temperature, mask):
    """The textbook version: full [B, T, V] logits, log_softmax, gather."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp * mask, entropy_from_logits(logits) * mask


def _batch(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g)
    attn = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    mask = attn[:, 1:].float()
    mask[:, :2] = 0  # a 3-token "prompt"
    return ids, attn, mask


def test_chunked_equals_one_shot_values_and_gradients():
    model = load_model("tiny", seed=3)
    ids, attn, mask = _batch([20, 9, 31, 4])
    ref_lp, ref_ent = one_shot_logprobs(model, ids, attn, 0.7, mask)
    (ref_lp.sum() + ref_ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    import common.trainer.forward as m
    old, m.LOGPROB_CHUNK_TOKENS = m.LOGPROB_CHUNK_TOKENS, 7  # many chunks, a ragged last one
    try:
        lp, ent = sequence_logprobs(model, ids, attn, 0.7, mask, with_entropy=True, entropy_grad=True)
    finally:
        m.LOGPROB_CHUNK_TOKENS = old
    (lp.sum() + ent.sum()).backward()
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n  # fp32 sums of ~10


def test_logprob_head_memory_does_not_grow_with_vocab_times_tokens():
    """The head over N=512 tokens: the largest tensor in forward + backward is one chunk's logits (plus the
    [V, H] weight gradient), and the forward keeps nothing vocabulary-sized for the backward."""
    N, H, chunk = 512, 32, 64
    for V in (1000, 4000):
        head = torch.nn.Linear(H, V, bias=False)
        hidden = torch.randn(N, H, requires_grad=True)
        targets = torch.randint(0, V, (N,))
        saved = []  # what the forward keeps for the backward
        with MaxTensor() as probe:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
                lp, ent = token_logprobs_chunked(head, hidden, targets, 1.0, None, True, True, chunk_tokens=chunk)
            (lp.sum() + ent.sum()).backward()
        assert probe.max_numel <= max(chunk * V, V * H), (V, probe.max_numel)
        assert sum(saved) < N * V // 8, (V, sum(saved))  # one-shot would save [N, V] logits several times


def test_packed_hidden_states_equal_padded_on_uneven_lengths():
    model = load_model("tiny", seed=2)
    use_packed_attention(model)
    ids, attn, _ = _batch([3, 57, 5, 40, 2])  # very uneven
    with torch.no_grad():
        padded = hidden_states(model.base_model, ids, attn, packed=False)
        packed = hidden_states(model.base_model, ids, attn, packed=True)
    real = attn.bool()
    assert (packed[~real] == 0).all()
    assert torch.allclose(packed[real], padded[real], atol=1e-5)


def _packed_attention_runs(monkeypatch, device: str, dtype: torch.dtype, kernel=None):
    """A grouped-query Qwen2 body's packed forward and backward with the varlen call ("auto") and with sdpa per
    sequence ("split"), and its padded forward: [(hidden states, gradients)] in that order, the real tokens, and
    how many times the varlen call ran per layer. `kernel` stands in for flash attention's (CUDA only)."""
    import transformers
    from torch.nn.attention import varlen

    from common.trainer.forward import use_packed_attention

    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)
    ids, attn, _ = (t.to(device) for t in _batch([3, 157, 5, 140, 2, 64]))
    weights = torch.randn(*ids.shape, config.hidden_size, device=device)
    calls = []
    real_kernel = kernel or varlen.varlen_attn

    @functools.wraps(real_kernel)  # the same signature: the caller asks it which keywords it takes
    def counted(*args, **kwargs):
        calls.append(1)
        return real_kernel(*args, **kwargs)
    monkeypatch.setattr(varlen, "varlen_attn", counted)

    def run(mode, packed=True):
        use_packed_attention(model, split=mode == "split")
        model.zero_grad()
        hidden = hidden_states(model.base_model, ids, attn, packed=packed)
        (hidden.float() * weights).sum().backward()
        return hidden.float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    runs = [run("auto"), run("split"), run("split", packed=False)]
    return runs, attn.bool(), len(calls) / config.num_hidden_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's varlen kernel needs a CUDA GPU "
                    "(make gpu-check runs this test)")
def test_varlen_packed_attention_equals_per_sequence_on_cuda(monkeypatch):
    """On a GPU a packed micro-batch runs one varlen flash-attention call per layer (grouped-query heads as they
    are): the same hidden states and gradients as causal sdpa per sequence, and as the padded forward."""
    ((varlen_h, varlen_g), (split_h, split_g), (padded_h, _)), real, per_layer = _packed_attention_runs(
        monkeypatch, "cuda", torch.bfloat16)
    assert per_layer == 1  # one call per layer, none per sequence, none on the "split" runs
    assert (varlen_h[~real] == 0).all()
    for other in (split_h, padded_h):
        assert torch.allclose(varlen_h[real], other[real], atol=3e-2, rtol=3e-2)
    assert varlen_g.keys() == split_g.keys() and len(split_g) > 10
    for name, grad in split_g.items():  # bf16: single entries differ by ~1 % (measured on an H200), the whole by less
        assert (varlen_g[name] - grad).norm() <= 0.05 * grad.norm(), name


def test_the_varlen_call_around_a_reference_kernel_equals_per_sequence(monkeypatch):
    """The CPU half of the GPU's packed attention: the kernel replaced by its contract computed per sequence
    (tests/conftest.py reference_varlen_attn), the call around it (layouts, offsets, grouped-query heads, the output's
    shape) gives the per-sequence path's hidden states and gradients to fp32 rounding."""
    import common.trainer.forward

    monkeypatch.setattr(common.trainer.forward, "_varlen_runs", lambda query, dropout: True)
    ((varlen_h, varlen_g), (split_h, split_g), (padded_h, _)), real, per_layer = _packed_attention_runs(
        monkeypatch, "cpu", torch.float32, reference_varlen_attn)
    assert per_layer == 1
    assert (varlen_h[~real] == 0).all()
    for other in (split_h, padded_h):
        assert torch.allclose(varlen_h[real], other[real], atol=1e-5)
    assert varlen_g.keys() == split_g.keys() and len(split_g) > 10
    for name, grad in split_g.items():  # fp32: the two differ in summation order only
        assert (varlen_g[name] - grad).norm() <= 1e-5 * grad.norm(), name


def _grouped_batch(seed=0, vocab=256):
    """GRPO-shaped rows: two prompts x 3 responses of uneven lengths, one row with a prompt of its own and one row
    with no trained token (reference-style, all-prompt)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(9), rand(6)]
    rows, prompt_lens = [], []
    for p in prompts:
        for n in (4, 11, 7):
            rows.append(p + rand(n))
            prompt_lens.append(len(p))
    rows += [rand(5) + rand(8), rand(12)]
    prompt_lens += [5, 12]
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), T - 1)
    for i, (r, p) in enumerate(zip(rows, prompt_lens)):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :len(r)] = 1
        mask[i, p - 1:len(r) - 1] = 1
    return ids, attn, mask


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_run_once_with_the_same_numbers_and_gradients(attention):
    """Rows that share a prompt run it once (common/trainer/forward.py shared_prompt_layout): the packed sequence is shorter
    than the padded batch, and log-probs, entropies and every parameter's gradient equal the one-shot computation."""
    import common.trainer.forward as m

    model = load_model("tiny", seed=4)
    model.set_attn_implementation(attention)
    ids, attn, mask = _grouped_batch()
    layout = m.shared_prompt_layout(model.base_model, ids, attn, mask)
    assert layout is not None
    flat_ids, _, allowed, index = layout
    assert len(flat_ids) == int(attn.sum()) - 2 * 9 - 2 * 6  # each shared prompt once, every other token once
    assert (flat_ids[index][attn.bool()] == ids[attn.bool()]).all()  # every real position maps to its own token
    ref_lp, ref_ent = one_shot_logprobs(model, ids, attn, 0.7, mask)
    (ref_lp.sum() + ref_ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = sequence_logprobs(model, ids, attn, 0.7, mask, with_entropy=True, entropy_grad=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n  # fp32 sums of ~10
    old, m.SHARED_PROMPT_MAX_TOKENS = m.SHARED_PROMPT_MAX_TOKENS, len(flat_ids) - 1  # over the cap: the padded path
    try:
        assert m.shared_prompt_layout(model.base_model, ids, attn, mask) is None
    finally:
        m.SHARED_PROMPT_MAX_TOKENS = old


def _textbook_head(head, hidden, targets, temperature, softcap):
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("bias,softcap,temperature,entropy_grad,frozen_body", [
    (False, None, 1.0, True, False), (True, None, 0.7, True, False), (False, 3.0, 0.7, True, False),
    (True, 3.0, 1.3, False, False), (False, None, 1.0, False, False), (True, None, 0.7, True, True)])
def test_fused_head_gradients_equal_autograd(bias, softcap, temperature, entropy_grad, frozen_body):
    """`token_logprobs_chunked` writes d/d(logits) itself: the hidden states', weight's and bias's gradients equal
    autograd's through log-softmax and entropy, for any weighting of the two outputs (none for the entropy when it
    has no gradient), with softcapping and a temperature, and for a trainable head over hidden states that have no
    gradient (a frozen body)."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 23, 8, 50
    head = torch.nn.Linear(H, V, bias=bias).double()
    hidden = torch.randn(N, H, dtype=torch.float64, generator=g, requires_grad=not frozen_body)
    targets = torch.randint(0, V, (N,), generator=g)
    w_lp, w_ent = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)
    ref_lp, ref_ent = _textbook_head(head, hidden, targets, temperature, softcap)
    ((ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0)).backward()
    tensors = [*([] if frozen_body else [hidden]), *head.parameters()]
    ref = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    lp, ent = token_logprobs_chunked(head, hidden, targets, temperature, softcap, True, entropy_grad, chunk_tokens=5)
    assert ent.requires_grad == entropy_grad
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert torch.allclose(lp, ref_lp.float()) and torch.allclose(ent, ref_ent.float(), atol=1e-6)
    for got, want in zip((t.grad for t in tensors), ref):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()  # fp32 inside
