"""Token-in/token-out of multi-turn episodes (common/explorer/multi_turn.py): a 3-turn episode is the exact sampled ids plus the
template's observation tokens, decodes to the template's rendering of the whole conversation, trains only the
sampled tokens, and its behaviour log-probs equal the trainer's recomputation over the whole sequence."""

import pytest
import torch

from common.explorer.engine import HFEngine, SamplingConfig
from common.envs import Env, ENVS, StepResult
from common.experience import Experience, collate
from common.model import default_model_dir
from common.trainer.forward import sequence_logprobs
from common.explorer.rollouts import run_episodes
from common.explorer.workflow import Context
from common.explorer.chat import ChatRenderer


class Echo(Env):
    """Never done: answers every turn with a short user message (the episode runs to --max-turns)."""

    def reset(self, task):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action):
        return StepResult([{"role": "user", "content": f"Turn noted ({len(action)} chars). Go on."}], 0.25, False, {})


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    try:
        path = default_model_dir()
    except SystemExit as e:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    return AutoTokenizer.from_pretrained(str(path))


def eos_prone_model(tokenizer, seed=0):
    """A random 2-layer Llama over SmolLM2's vocabulary (real BPE merges, so re-tokenising sampled text differs from
    the sampled ids) that emits <|im_end|> with probability ~0.15 per token: residual dimension 0 carries a constant
    and only the untied head's <|im_end|> row reads it. Turns thus end both ways: stop token and length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 1.13
    return model.eval()


def test_three_turn_episode_is_token_exact(smol_tokenizer, monkeypatch):
    tok = smol_tokenizer
    monkeypatch.setitem(ENVS, "echo", "tests.test_workflows_tokens:Echo")
    model = eos_prone_model(tok)
    engine = HFEngine(model, tok)
    ctx = Context(tok, max_new_tokens=12, max_turns=3, episode_token_budget=2048, truncated_turns="continue")
    torch.manual_seed(3)
    task = {"id": "t0", "env": "echo", "prompt": "Say something about 12 apples."}
    groups, counts = run_episodes(engine, ctx, [task], SamplingConfig(temperature=1.0, max_new_tokens=12, n=4))
    assert counts["engine_calls"] == 3  # the 4 episodes advance together, one turn per engine call
    episodes = groups[0].responses
    renderer = ChatRenderer(tok)
    retokenised_differs, stops = False, set()
    for e in episodes:
        assert e.turns == 3 and e.end_reason == "max_turns" and e.turn_rewards == [0.25] * 3
        # The response is [sampled turn | observation] x 2 + sampled turn: split it by the mask.
        runs, start = [], 0
        for i in range(1, len(e.mask) + 1):
            if i == len(e.mask) or e.mask[i] != e.mask[start]:
                runs.append((e.mask[start], e.response_ids[start:i]))
                start = i
        assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
        assert len(e.logprobs) == len(e.response_ids) == len(e.mask) == len(e.versions)
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.mask) if not m)
        # The decoded sequence is the template's rendering of the whole conversation (up to the last sampled token).
        text = tok.decode(e.prompt_ids + e.response_ids, skip_special_tokens=False)
        full = renderer.render(e.messages)
        assert full.startswith(text) and full[len(text):] in ("\n", renderer.glue_text)
        for k, (m, ids) in enumerate(runs):
            if m == 1:
                stops.add(ids[-1] == tok.eos_token_id)
                content = tok.decode(ids, skip_special_tokens=True)
                if renderer.ids(content) != [t for t in ids if t != tok.eos_token_id]:
                    retokenised_differs = True
            else:  # an observation segment is the template's rendering of that turn: glue, message, next prompt
                turn = (k + 1) // 2  # messages: user, (assistant, user) x 2, assistant
                before, after = renderer.render(e.messages[:2 * turn]), \
                    renderer.render(e.messages[:2 * turn + 1], add_generation_prompt=True)
                delta = renderer.ids(after)[len(renderer.ids(before)):]
                sampled_stop = runs[k - 1][1][-1] == tok.eos_token_id
                glue_ids = renderer.ids(renderer.glue_text)  # the probe-rendered delta equals the full-render one
                glue = glue_ids[1:] if sampled_stop else glue_ids
                assert ids == glue + delta
        assert e.prompt_ids == renderer.prompt_ids(e.messages[:1])
    assert retokenised_differs, "no turn whose text re-tokenises to other ids: the test lost its point"
    assert stops == {True, False}, "turns should end both by <|im_end|> and by the token limit"
    # Behaviour log-probs == the trainer's recomputation over the whole multi-turn sequence (fp32).
    exps = [Experience(prompt_ids=e.prompt_ids, response_ids=e.response_ids, logprobs=e.logprobs,
                       loss_mask=e.loss_mask(), reward=0.0, group_id=0, task_id="t0", policy_version=0)
            for e in episodes]
    batch = collate(exps, tok.pad_token_id)
    assert batch.response_mask.sum().item() == sum(sum(e.mask) for e in episodes)
    with torch.no_grad():
        recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask)
    mask = batch.response_mask.bool()
    assert torch.allclose(recomputed[mask], batch.old_logprobs[mask], atol=1e-4), \
        (recomputed[mask] - batch.old_logprobs[mask]).abs().max()
