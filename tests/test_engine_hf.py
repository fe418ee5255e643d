"""The HF rollout engine: n samples per prompt, left padding, and behaviour log-probs equal to the trainer's."""

import torch

from common.explorer.engine import HFEngine, SamplingConfig
from common.experience import Experience, collate
from common.model import build_tiny_tokenizer, chat_prompt_ids, load_model
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
