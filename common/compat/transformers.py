"""transformers' internals tandem uses: a model config's attention implementation (`config._attn_implementation`,
read by the trainer's forward and swapped by the HF engine's decode loop for its own call) and the KV-cache protocol
its attention layers call (`past_key_values.update(key_states, value_states, layer_idx, ...)`: one layer's new keys
and values in, the keys and values to attend over out), which the decode loop's `SlotCache` implements
(common/explorer/static_decode.py)."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

from common.compat import missing

CHECKED = "5.19"  # requirements.txt's pin


def check() -> list[str]:
    """The internals this module uses that this transformers lacks or changed (empty: all there)."""
    from transformers import PretrainedConfig
    from transformers.cache_utils import Cache

    moved = missing(PretrainedConfig(), ("_attn_implementation",), "PretrainedConfig")
    if list(inspect.signature(Cache.update).parameters)[1:4] != ["key_states", "value_states", "layer_idx"]:
        moved.append("Cache.update(key_states, value_states, layer_idx, ...)")
    return moved


def attention_implementation(config) -> str | None:
    """The attention implementation a model computes with ("sdpa", "eager", a registered name); None: no config."""
    return getattr(config, "_attn_implementation", None)


@contextmanager
def attention_implementation_set(config, name: str):
    """Inside: the model computes with attention `name` (registered with AttentionInterface); its own after, for
    anyone else. transformers reads it from the config at every forward."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
