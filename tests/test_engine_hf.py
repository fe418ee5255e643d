"""The HF rollout engine: n samples per prompt, left padding, and behaviour log-probs equal to the trainer's."""

import pytest
import torch

from common.explorer.engine import HFEngine, SamplingConfig, StaticCacheSize, use_static_cache
from common.experience import Experience, collate
from common.model import build_tiny_tokenizer, chat_prompt_ids, load_model
from common.weight_sync import Buffers
from common.trainer.forward import sequence_logprobs
from tests.conftest import MaxTensor


def _engine_and_prompts():
    tokenizer = build_tiny_tokenizer()
    model = load_model("tiny", seed=1)
    prompts = [chat_prompt_ids(tokenizer, {"prompt": p}) for p in ["1+1?", "A much longer prompt about apples?"]]
    return HFEngine(model, tokenizer), tokenizer, model, prompts


def test_generate_shapes_and_stop():
    engine, tokenizer, _, prompts = _engine_and_prompts()
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=12, n=3))
    assert [len(gs) for gs in out] == [3, 3]
    for p, gs in zip(prompts, out):
        for g in gs:
            assert g.prompt_ids == p
            assert 1 <= len(g.response_ids) <= 12 and len(g.logprobs) == len(g.response_ids)
            assert tokenizer.pad_token_id not in g.response_ids
            if g.finish_reason == "stop":
                assert g.response_ids[-1] == tokenizer.eos_token_id
            else:
                assert len(g.response_ids) == 12 and tokenizer.eos_token_id not in g.response_ids
    greedy = SamplingConfig(temperature=0, max_new_tokens=8, n=2)
    a, b = engine.generate(prompts, greedy)[1]
    assert a.response_ids == b.response_ids  # greedy is deterministic


def test_behaviour_logprobs_match_trainer_recompute():
    """Same weights, fp32: what the explorer recorded while sampling equals what the trainer recomputes (at the
    temperature, without top-p's truncation)."""
    engine, tokenizer, model, prompts = _engine_and_prompts()
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (0.7, 0.8)):
        torch.manual_seed(1)
        gens = [g for gs in engine.generate(prompts, SamplingConfig(temperature, top_p, 16, n=2)) for g in gs]
        exps = [Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * len(g.response_ids), 0.0, 0, "t", 0)
                for g in gens]
        batch = collate(exps, tokenizer.pad_token_id)  # right padding here, left padding in the engine
        with torch.no_grad():
            recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
            only_response = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature,
                                              batch.response_mask)
        mask = batch.response_mask.bool()
        assert mask.sum() == sum(len(g.response_ids) for g in gens)
        diff = (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item()
        assert diff < 1e-4, f"temperature {temperature}: max |diff| {diff}"
        # Projecting only the response positions gives the same numbers and zeros elsewhere.
        assert torch.allclose(only_response[mask], recomputed[mask], atol=1e-5)
        assert (only_response[~mask] == 0).all()


def test_generate_keeps_no_step_logits():
    """No tensor of generate's rows x new tokens x vocabulary exists (every step's logits kept to the end), while
    the behaviour log-probs still come back for every token."""
    engine, tokenizer, model, prompts = _engine_and_prompts()
    model.resize_token_embeddings(4096)  # logits the largest thing a step makes, as in a real model
    rows, new_tokens, vocab = 2 * 4, 40, model.config.vocab_size
    engine.stop_ids = [4095]  # a token the byte tokenizer never made: every row runs all 40 steps (or nearly)
    torch.manual_seed(0)
    with MaxTensor() as probe:
        out = engine.generate(prompts, SamplingConfig(1.0, 1.0, new_tokens, n=4))
    assert all(len(g.logprobs) == len(g.response_ids) > 0 for gs in out for g in gs)
    assert probe.max_numel < rows * new_tokens * vocab / 4, probe.max_numel


def _static_engine(model, tokenizer, slots: int, tokens: int = 128) -> HFEngine:
    return HFEngine(model, tokenizer, static_cache=StaticCacheSize(slots, tokens))


def _same(a, b, atol=1e-5):
    """Two engines' outputs: the same tokens, finish reasons and behaviour log-probs, row by row."""
    for ga, gb in zip([g for gs in a for g in gs], [g for gs in b for g in gs]):
        assert ga.response_ids == gb.response_ids and ga.finish_reason == gb.finish_reason
        assert torch.allclose(torch.tensor(ga.logprobs), torch.tensor(gb.logprobs), atol=atol)


def test_static_cache_equals_dynamic_cache():
    """The static KV cache (the CUDA default, compiled there) makes the same tokens and log-probs as the dynamic one
    for a fixed seed: sampled and greedy, prompts of different lengths, the cache reused across calls, a call
    padded to the cache's rows and a call split over several chunks of them, and after an in-place weight update
    (what weight sync does; compiled graphs read the parameters where they are)."""
    engine, tokenizer, model, prompts = _engine_and_prompts()
    static = _static_engine(model, tokenizer, slots=4)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=12, n=2)  # 2 prompts x 2 = the cache's 4 rows
    for seed in (0, 1):  # the second call reuses (and resets) the same cache
        outs = []
        for e in (engine, static):
            torch.manual_seed(seed)
            outs.append(e.generate(prompts, sampled))
        _same(*outs)
    assert static._decoder.cache.keys[0].shape[0] == 4
    nucleus = SamplingConfig(temperature=0.7, top_p=0.8, max_new_tokens=12, n=2)  # the top-p warper, in the loop
    outs = []
    for e in (engine, static):
        torch.manual_seed(3)
        outs.append(e.generate(prompts, nucleus))
    _same(*outs)
    greedy = SamplingConfig(temperature=0, max_new_tokens=10, n=3)  # 6 rows: a full chunk of 4, then 2 + 2 padding
    _same(engine.generate(prompts, greedy), static.generate(prompts, greedy))
    _same(engine.generate(prompts[:1], greedy), static.generate(prompts[:1], greedy))  # 3 rows + 1 padding
    with torch.no_grad():
        for _, p in static.weight_buffers():
            p.add_(0.05 * torch.randn_like(p))
    torch.manual_seed(2)
    updated = static.generate(prompts, sampled)
    torch.manual_seed(2)
    _same(engine.generate(prompts, sampled), updated)
    gens = [g for gs in updated for g in gs]
    exps = [Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * len(g.response_ids), 0.0, 0, "t", 0)
            for g in gens]
    batch = collate(exps, tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
    mask = batch.response_mask.bool()
    assert (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item() < 1e-4


def test_static_cache_too_short_takes_the_dynamic_path(capsys):
    """A call longer than the static cache's positions is generated with the dynamic cache (said once), not cut."""
    engine, tokenizer, model, prompts = _engine_and_prompts()
    static = _static_engine(model, tokenizer, slots=4, tokens=64)
    greedy = SamplingConfig(temperature=0, max_new_tokens=40, n=1)  # the longer prompt + 40 > 64
    _same(engine.generate(prompts, greedy), static.generate(prompts, greedy))
    assert static._decoder is None
    assert "over the static KV cache's 64" in capsys.readouterr().err
    static.generate(prompts, greedy)
    assert "static KV cache" not in capsys.readouterr().err


def test_static_cache_plan_and_choice():
    assert StaticCacheSize.plan(33, 130) == StaticCacheSize(40, 192)
    assert use_static_cache("auto", "cuda", vlm=False) and not use_static_cache("auto", "cpu", vlm=False)
    assert not use_static_cache("auto", "cuda", vlm=True) and use_static_cache("static", "cpu", vlm=False)
    assert not use_static_cache("dynamic", "cuda", vlm=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode step's CUDA graphs run on CUDA only")
def test_compiled_static_cache_on_cuda_equals_dynamic():
    """On CUDA the static path captures its decode step as CUDA graphs: it makes the dynamic path's greedy tokens,
    log-probs the trainer recomputes, and it keeps doing so after an in-place weight update (no re-capture), also for
    requests that join its slots one after another."""
    tokenizer = build_tiny_tokenizer()
    model = load_model("tiny", device="cuda", seed=1)
    prompts = [chat_prompt_ids(tokenizer, {"prompt": p}) for p in ["1+1?", "A much longer prompt about apples?"]]
    dynamic = HFEngine(model, tokenizer)
    static = _static_engine(model, tokenizer, slots=8)
    assert static.warm_up(prompts[0]) > 0 and static._decoder.graphs and not static._decoder.graph_error
    greedy = SamplingConfig(temperature=0, max_new_tokens=24, n=2)
    for update in range(2):
        _same(dynamic.generate(prompts, greedy), static.generate(prompts, greedy), atol=1e-3)
        torch.manual_seed(update)
        gens = [g for gs in static.generate(prompts, SamplingConfig(1.0, 1.0, 24, n=4)) for g in gs]
        batch = collate([Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * len(g.response_ids), 0.0, 0, "t",
                                    0) for g in gens], tokenizer.pad_token_id)
        with torch.no_grad():
            recomputed = sequence_logprobs(model, batch.input_ids.cuda(), batch.attention_mask.cuda(), 1.0).cpu()
        mask = batch.response_mask.bool()
        assert (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item() < 1e-3
        with torch.no_grad():
            for _, p in static.weight_buffers():
                p.add_(0.05 * torch.randn_like(p))
    # requests joining the running slots at different steps: each as it would be alone
    greedy = SamplingConfig(temperature=0, max_new_tokens=20)
    out = _stream(static, object(), {0: [(k, prompts[k % 2], 20, greedy) for k in range(5)],
                                     1: [(k, prompts[k % 2], 20, greedy) for k in range(5, 11)]})
    for k in range(11):
        _same([[dynamic.generate([prompts[k % 2]], greedy)[0][0]]], [[out[k]]], atol=1e-3)


def _stream(engine, owner, requests, between=None) -> dict:
    """Step `engine` until every one of `owner`'s requests has finished; `requests`: {step: [(key, prompt, cap,
    sampling)]} added before that step (requests joining a running batch). Returns key -> Generation."""
    out, steps = {}, 0
    while steps == 0 or engine.running(owner) or any(s >= steps for s in requests):
        for key, prompt, cap, sampling in requests.pop(steps, []):
            engine.add(owner, key, prompt, cap, sampling)
        out.update(engine.step(owner))
        if between:
            between(steps)
        steps += 1
    return out


def test_static_slots_take_requests_as_they_come():
    """The static cache's rows are slots: requests join a running batch at any step, each with its own cap,
    temperature and top-p, more requests than slots wait for a free one, and each comes back as it would alone
    (greedy: the dynamic path's tokens; sampled: behaviour log-probs the trainer recomputes)."""
    engine, tokenizer, model, prompts = _engine_and_prompts()
    static = _static_engine(model, tokenizer, slots=4)
    assert static.streams and not engine.streams
    greedy, hot, nucleus = SamplingConfig(0, 1.0, 10), SamplingConfig(1.0, 1.0, 9), SamplingConfig(0.7, 0.8, 9)
    owner = object()
    torch.manual_seed(0)
    out = _stream(static, owner, {0: [("g0", prompts[0], 10, greedy), ("s0", prompts[1], 9, hot)],
                                  3: [("g1", prompts[1], 6, greedy), ("n0", prompts[0], 9, nucleus),
                                      ("n1", prompts[1], 9, nucleus), ("g2", prompts[0], 4, greedy)]})
    assert sorted(out) == ["g0", "g1", "g2", "n0", "n1", "s0"] and not static._slots and not static._queue
    for key, prompt, cap in (("g0", prompts[0], 10), ("g1", prompts[1], 6), ("g2", prompts[0], 4)):
        alone = engine.generate([prompt], SamplingConfig(0, 1.0, cap))[0][0]
        assert out[key].response_ids == alone.response_ids and out[key].finish_reason == alone.finish_reason
        assert torch.allclose(torch.tensor(out[key].logprobs), torch.tensor(alone.logprobs), atol=1e-4)
    for key, temperature in (("s0", 1.0), ("n0", 0.7), ("n1", 0.7)):
        g = out[key]
        assert 1 <= len(g.response_ids) <= 9 and (g.finish_reason == "stop") == (g.response_ids[-1] in static.stop_ids)
        batch = collate([Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * len(g.response_ids), 0.0, 0, "t",
                                    0)], tokenizer.pad_token_id)
        with torch.no_grad():
            recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
        mask = batch.response_mask.bool()
        assert (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item() < 1e-4, key


def test_static_slots_weights_between_steps_and_abort():
    """Weights loaded between two steps are used from the next step on and each token says which version made it;
    a batch `generate` joins requests already in the slots; an aborted owner's requests leave their slots."""
    engine, tokenizer, model, prompts = _engine_and_prompts()
    static = _static_engine(model, tokenizer, slots=2)
    static.stop_ids = [4095]  # never sampled: every request runs to its cap
    sampling = SamplingConfig(1.0, 1.0, 8)

    def update(step):
        if step == 2:
            with torch.no_grad():
                for _, p in static.weight_buffers():
                    p.add_(0.05 * torch.randn_like(p))
            static.load_weights(Buffers(), version=7)

    owner = object()
    out = _stream(static, owner, {0: [(k, prompts[0], 8, sampling) for k in "ab"] + [("c", prompts[1], 8, sampling)]},
                  between=update)
    assert [out[k].versions for k in "ab"] == [[0] * 4 + [7] * 4] * 2  # joined + 1 step, 2 steps, then the update
    assert out["c"].versions == [7] * 8  # waited for a slot; joined after the update
    g = out["c"]  # made with the new weights: the trainer's recomputation with them agrees
    batch = collate([Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * 8, 0.0, 0, "t", 0)],
                    tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
    mask = batch.response_mask.bool()
    assert (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item() < 1e-4
    later = object()
    static.add(later, "x", prompts[0], 8, sampling)
    static.step(later)
    (g,), = static.generate([prompts[1]], sampling)  # beside "x" in the other slot
    assert len(g.response_ids) == 8 and g.versions is None and static.running(later) == 1
    static.abort(later)
    assert static.running(later) == 0 and not static._slots and static.step(later) == []
