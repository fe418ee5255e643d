"""The logits processor tandem starts vLLM with: behaviour log-probs under top-p made whole again.

vLLM is started with `logprobs_mode="processed_logprobs"`: log-probs after temperature and after top-k/top-p. With
top_p == 1 (tandem's default) that is exactly log_softmax(logits / temperature)[token], the quantity the trainer
recomputes with `common.trainer.forward.sequence_logprobs`. With top_p < 1 vLLM reports the truncated, renormalised
distribution; `NormalizerProcessor` (changes no logits) records log(kept probability mass) per step in the worker,
`TandemWorkerExtension.tandem_pop_logz` hands it over and the engine adds it back.
"""

from __future__ import annotations

import torch

try:  # the processor needs vLLM's base class
    from vllm.v1.sample.logits_processor import LogitsProcessor as _LogitsProcessorBase
except Exception:  # vLLM missing or broken: VLLMEngine reports why when it is constructed
    _LogitsProcessorBase = object


class NormalizerProcessor(_LogitsProcessorBase):
    """Records, per request and step, log(probability mass kept by top-p); changes no logits.

    vLLM's processed log-prob under top-p is log p_T(x) - log Z_kept with p_T = softmax(logits / T) and Z_kept the
    mass top-p keeps; adding log Z_kept back gives log p_T(x). Only requests that carry `KEY` in their
    SamplingParams.extra_args are measured. Not argmax-invariant, so vLLM runs it for every request (before its
    own temperature / top-p steps, on the same logits).
    """

    KEY = "tandem_logz_key"
    recording: dict[str, dict[int, float]] = {}  # lives in the worker's process

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, tuple[str, float, float, list[int]]] = {}  # row -> key, T, top_p, output ids

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            key = (params.extra_args or {}).get(self.KEY) if params is not None else None
            if key is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (key, params.temperature, params.top_p, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction.name == "SWAP":
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = sorted(self.rows)
        index = torch.tensor(rows, device=logits.device)
        temperature = torch.tensor([self.rows[r][1] for r in rows], dtype=torch.float32, device=logits.device)
        top_p = torch.tensor([self.rows[r][2] for r in rows], dtype=torch.float32, device=logits.device)
        # The same steps as vLLM's top-p: ascending sort, drop the tail whose cumulative mass <= 1 - p,
        # always keep the most likely token.
        probs = (logits[index].float() / temperature[:, None]).sort(dim=-1).values.softmax(dim=-1)
        dropped = probs.cumsum(dim=-1) <= (1 - top_p)[:, None]
        dropped[:, -1] = False
        logz = probs.masked_fill(dropped, 0).sum(dim=-1).log().tolist()
        for r, value in zip(rows, logz):
            key, _, _, output_ids = self.rows[r]
            self.recording.setdefault(key, {})[len(output_ids)] = value
        return logits
