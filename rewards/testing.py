"""Tiny offline models for the reward tests (no downloads): a random sequence-classification RM and judge LMs.

All use the byte-level tokenizer of `common.model.build_tiny_tokenizer` and are saved as ordinary HF folders,
so they load exactly like a real `rm_model` / `judge_model` path.
"""

from __future__ import annotations


def _tokenizer():
    from common.model import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _config(tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **extra)


def build_tiny_rm(path: str, seed: int = 0) -> str:
    """A random 2-layer LlamaForSequenceClassification (one logit) + tokenizer saved at `path`."""
    import torch
    from transformers import LlamaForSequenceClassification

    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(_config(tokenizer, num_labels=1))
    with torch.no_grad():  # spread the random head so different texts get clearly different scores
        model.score.weight.mul_(20)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_judge(path: str, kind: str = "random", seed: int = 0) -> str:
    """A tiny causal LM judge saved at `path`:
    - "random": random weights;
    - "uniform": an all-zero output layer, so every token has probability 1/V and P(yes) = 1/(1+V) exactly
      ("yes" is three bytes, "no" two): it always says no;
    - "yes": the residual stream carries only the token embedding (attention and MLP outputs zeroed) and the
      output layer is wired so that after the prompt's last token "y", "e", "s" follow with near certainty and
      "n" is near impossible: it always says yes.
    """
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(tokenizer, tie_word_embeddings=False))
    with torch.no_grad():
        if kind == "uniform":
            model.lm_head.weight.zero_()
        elif kind == "yes":
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            emb, head = model.model.embed_tokens.weight, model.lm_head.weight
            emb.zero_()
            head.zero_()
            tid = {c: tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c))[0] for c in "yesn"}
            last = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))[0]  # the chat prompt's last token
            for dim, (src, dst) in enumerate([(last, "y"), (tid["y"], "e"), (tid["e"], "s")]):
                emb[src, dim] = 1.0
                head[tid[dst], dim] = 10.0
            head[tid["n"], 0] = -10.0
        elif kind != "random":
            raise ValueError(f"unknown judge kind {kind!r}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
