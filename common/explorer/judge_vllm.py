"""The served judge on vLLM (`--judge-engine vllm`): a judge model for rewards/judge_server.py on the explorers'
`VLLMEngine` (common/explorer/engine_vllm.py, its one `LLM(...)` and its settings), in float32 as the HF judge, eager
(a judge prefills; it decodes a token or a short reply). The explorer hands `VLLMJudge` to its reward pool, whose
judge server process loads it (rewards sit below the explorer and never import it).
"""

from __future__ import annotations

import tempfile

from common.explorer.engine import SamplingConfig
from common.explorer.engine_vllm import VLLMEngine
from common.model import load_tokenizer, resolve_model, save_servable_tiny


def kv_cache_bytes(config, tokens: int) -> float:
    """The vLLM judge's float32 KV cache (its model's HF config): two requests of `tokens` (the candidates' requests
    share the judge prompt through the prefix cache, each adding a block of its own). common/memory.py counts it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_dim = (getattr(text, "num_key_value_heads", None) or heads) * (getattr(text, "head_dim", None) or
                                                                      text.hidden_size // heads)
    return 2 * 2 * text.num_hidden_layers * kv_dim * 4 * tokens


class VLLMJudge:
    """`tokenizer`, `continuation_logprobs`, `generate` (as rewards/judge_server.py `HFJudge`) on vLLM, for
    requests of up to `max_model_len` tokens (0: the model's context) in a KV cache of `kv_cache_bytes`: what the
    memory plan counted (common/memory.py `judge_bytes`)."""

    def __init__(self, name: str, device: str, max_model_len: int = 0):
        from transformers import AutoConfig

        self.tokenizer = load_tokenizer(name)
        self._tiny = tempfile.TemporaryDirectory(prefix="tandem-judge-") if name == "tiny" else None
        path = save_servable_tiny(self._tiny.name) if self._tiny else resolve_model(name, "--judge-model")
        config = AutoConfig.from_pretrained(path)
        tokens = max_model_len or config.max_position_embeddings
        # With kv_cache_memory_bytes vLLM sizes nothing by gpu_memory_utilization: it only checks at start that this
        # share of the GPU is free (vllm/v1/worker/utils.py request_memory); what the judge takes was planned.
        self.engine = VLLMEngine(path, tokenizer=self.tokenizer, dtype="float32", device=device,
                                 max_model_len=tokens, enforce_eager=True, gpu_memory_utilization=0.01,
                                 kv_cache_memory_bytes=int(kv_cache_bytes(config, tokens)),
                                 max_num_batched_tokens=tokens)

    def continuation_logprobs(self, prefix_ids: list[int], rows: list[list[int]]) -> list[float]:
        """log p(row | prefix) of each row, summed over the rows' prefix tree: one request per distinct partial row,
        asking only for the tokens that continue it (the shared judge prompt is computed once: prefix cache)."""
        nodes: dict[tuple, set] = {}
        for row in rows:
            for j in range(len(row)):
                nodes.setdefault(tuple(row[:j]), set()).add(row[j])
        keys = list(nodes)
        wanted = [sorted(nodes[k]) for k in keys]
        got = self.engine.next_token_logprobs([prefix_ids + list(k) for k in keys], wanted)
        table = {(k, t): lp for k, ts, lps in zip(keys, wanted, got) for t, lp in zip(ts, lps)}
        return [sum(table[tuple(row[:j]), row[j]] for j in range(len(row))) for row in rows]

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        return self.engine.generate([ids], SamplingConfig(temperature=0.0, max_new_tokens=max_tokens))[0][0] \
            .response_ids

    def close(self):
        self.engine.close()
        if self._tiny:
            self._tiny.cleanup()
