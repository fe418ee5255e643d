"""What runs inside vLLM's worker process (`worker_extension_cls`): weights loaded into the running vLLM model and
read back from it, for common/explorer/engine_vllm.py.

Load. `TandemWorkerExtension.tandem_load_slot` opens a flat buffer once (the engine's shared-memory file, or the
colocated trainer's slot: its file, or on a GPU its CUDA IPC handle) and copies each tensor straight into the
parameter vLLM computes with (`_worker_copy_plan`): 1:1 names as they are, q/k/v_proj into their
rows of the fused qkv_proj and gate/up_proj into gate_up_proj (by the fused layer's `output_sizes`), the vocabulary
into the leading rows of a padded embedding. On GPU that is the whole update. On CPU vLLM multiplies with a packed
copy of each linear weight (oneDNN / sgl kernels) and drops the plain tensor, so those layers are handed the new
weight (a view of the shared file: q/k/v and gate/up lie back to back there) and re-packed by vLLM's own
`process_weights_after_loading`; a tied lm_head (which keeps its plain weight, shared with the embedding) is
re-packed too. Where some name has no such home the update goes through vLLM's `reload_weights` instead (the
reference path; `fast=False` forces it). A safetensors folder (`tandem_load_checkpoint`) is copied the same way,
and so is each bucket of trainer0's broadcast, received here on the weights group the worker joined
(`tandem_join_weights_group`, `tandem_receive_broadcast`: NCCL from the trainer's GPU, gloo on the CPU).

Read back. `tandem_weights_digest` reads the worker's weights, un-fuses qkv_proj / gate_up_proj into the HF names,
drops vocabulary padding and hashes them with `common.weight_sync.base.tensor_digest`, so the checksum equals
`weights_hash(hf_model.named_parameters())` iff vLLM computes with the trainer's weights bit for bit. On CPU the
linear weights exist only packed inside oneDNN; they are read by running each layer's own GEMM on an identity
matrix (exact: every output is one weight times 1 plus zeros).

Process start (CPU). `TandemExecutor` (common/compat/vllm.py) is vLLM's multiprocess executor (what vLLM runs on CPU anyway) with its worker
forked from the engine core, vLLM's own default there: the engine core has imported vLLM already, so the worker does
not import it again (~4 CPU seconds per engine start), and a forked multiprocessing child ends with os._exit after
vLLM's explicit shutdown instead of a spawned interpreter's finalization (full cyclic-GC scans of the ~670k objects
importing vLLM leaves, which outlasted vLLM's 5 s grace on a loaded 2-core machine and made every `close` wait it).
The engine core itself is still spawned: tandem's own process runs gloo threads and must not be forked.

Waiting (CPU). The readers of vLLM's shared-memory queues between the engine core and its worker spin
(os.sched_yield) for a second after every message before they block on the writer's notification, so the engine
core spins through each whole forward pass of its worker. On the CPU it spins on a core one of the worker's OpenMP
threads computes on; that thread loses slices and its team waits for it at every barrier. `TandemExecutor` bounds
the spin to `SPIN_S` (the engine core's quick replies between two steps; with the CPU tuning on, the default), then
the reader sleeps until notified: vLLM on 2 cores ~200 -> ~290 tokens/s, on 1 core about the same
(bench/engines.py --arith --max-new-tokens 48).
"""

from __future__ import annotations

import glob
import os
import time

import torch

from common.buckets import flat_views
from common.compat.torch import set_threads_below_vllm
from common.compat.vllm import lora_model_manager
from common.explorer.vllm_logits import NormalizerProcessor
from common.runtime.cores import bind_threads
from common.weight_sync.base import tensor_digest
from common.weight_sync.broadcast import broadcast_weights, weights_group
from common.weight_sync.colocated import open_slot


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
    # ParallelLMHead (a subclass of VocabParallelEmbedding) does multiply
    return hasattr(module, "cpu_linear") and type(module).__name__ != "VocabParallelEmbedding"


class TandemWorkerExtension:
    """Methods added to vLLM's worker class (`worker_extension_cls`), called by name with LLM.collective_rpc.

    Arguments and results are plain data (strings, bytes, numbers, lists), so they cross vLLM's engine-core process
    boundary; tensors travel through a shared buffer, a checkpoint folder or the weights group.
    """

    def tandem_load_slot(self, shared: bytes, layout: list, fast: bool = True) -> float:
        """Load the weights in a flat buffer another process laid out (the engine's /dev/shm buffers, or a colocated
        trainer's slot: a /dev/shm file or a GPU tensor's CUDA IPC handle, opened on this worker's device by
        common/weight_sync/colocated.py `open_slot`): copied straight into the parameters vLLM computes with
        (fused slices, CPU re-pack; `_worker_copy_plan`), or through vLLM's reload where that plan does not apply
        (or fast is False: the reference path). Each buffer is opened once and stays open (its owner may unlink
        its file); on a GPU the copy has finished reading it when this returns (its owner may write it next)."""
        opened = self.__dict__.setdefault("_tandem_slots", {})
        if shared not in opened:
            views = flat_views(open_slot(shared, self.device), layout)
            opened[shared] = (views, _worker_copy_plan(self.get_model(), views))
        views, plan = opened[shared]
        if not fast or plan is None:
            seconds = self._tandem_reload(iter(views))
        else:
            start = time.time()
            _worker_copy_weights(self.get_model(), plan)
            seconds = time.time() - start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return seconds

    def tandem_join_weights_group(self, host: str, port: int, rank: int, size: int, backend: str,
                                  timeout_s: float) -> None:
        """Join trainer0's weights group (common/weight_sync/broadcast.py `weights_group`) as `rank`."""
        self._tandem_group = weights_group(host, port, rank, size, backend, timeout_s)
        self._tandem_group_device = self.device if backend == "nccl" else torch.device("cpu")

    def tandem_receive_broadcast(self, layout: list, bucket_mb: int, fast: bool = True) -> list:
        """Receive trainer0's next broadcast on the weights group (the HF (name, shape, dtype) `layout` checked
        against the sender's first) and load it: each bucket is copied into the parameters vLLM computes with as it
        arrives (`_worker_copy_plan`), so only one bucket is held at a time; layers vLLM re-packs (CPU) are
        re-packed once every bucket is in, and where the plan does not apply (or fast is False) the whole update
        goes through vLLM's reload. Returns [seconds spent loading, version, time the header arrived]."""
        model = self.get_model()
        shapes = [(name, torch.empty(shape, dtype=getattr(torch, dt), device="meta")) for name, shape, dt in layout]
        direct = fast and _worker_copy_plan(model, shapes) is not None
        held, loading = [], [0.0]

        def on_bucket(views):
            plan = _worker_copy_plan(model, views) if direct else None
            if plan is None:  # the reference path: every tensor kept for vLLM's reload at the end
                held.extend(views)
                return
            start = time.time()
            now = [entry for entry in plan if not entry[3]]
            _worker_copy_weights(model, now)
            held.extend((name, view) for name, view in views if any(  # pieces of a layer re-packed at the end
                v is view for entry in plan if entry[3] for _, v in entry[2]))
            loading[0] += time.time() - start

        version, arrived = broadcast_weights(shapes, 0, group=self._tandem_group, group_src=0,
                                             device=self._tandem_group_device, bucket_mb=bucket_mb,
                                             on_bucket=on_bucket)
        if held and not direct:
            loading[0] += self._tandem_reload(iter(held))
        elif held:
            start = time.time()
            _worker_copy_weights(model, _worker_copy_plan(model, held))
            loading[0] += time.time() - start
        return [loading[0], version, arrived]

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
        return tensor_digest((name, weights[name]) for name, _ in layout)

    # ------------------------------------------------------------------ LoRA: one adapter per weights version
    def tandem_add_lora(self, lora_id: int, shared: bytes, layout: list, rank: int, alpha: float,
                        targets: list[str], keep: list[int]) -> float:
        """Build adapter `lora_id` from the fp32 adapter tensors in a flat buffer another process laid out (opened
        as `tandem_load_slot` opens one: a /dev/shm file or a CUDA IPC handle; common/lora.py
        `adapter_tensors` names) and register it in vLLM's adapter cache, where requests naming that id find it
        (common/explorer/engine_vllm.py `lora_request`); every other registered adapter not in `keep` goes. vLLM
        packs q/k/v and gate/up, casts to its LoRA dtype and folds the scale alpha / rank into B."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        start = time.time()
        mapped = self.__dict__.setdefault("_tandem_lora_files", {})
        if shared not in mapped:
            mapped[shared] = flat_views(open_slot(shared, self.device), layout)
        views = mapped[shared]
        digests = getattr(self, "_tandem_lora_digests", None)
        if digests is None:
            digests = self._tandem_lora_digests = {}
        digests[lora_id] = tensor_digest(views)[0]  # what arrived, for --verify-sync
        worker_manager = self.model_runner.lora_manager
        manager = lora_model_manager(self)
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha, "target_modules": targets})
        helper.validate_legal(worker_manager.lora_config)
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            lora_id, {f"base_model.model.{name}": t.clone() for name, t in views}, helper, device="cpu",
            dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
        for old in set(manager.list_adapters()) - set(keep):
            manager.remove_adapter(old)
            digests.pop(old, None)
        manager.add_adapter(adapter)
        return time.time() - start

    def tandem_lora_digest(self, lora_id: int) -> str:
        """The digest of the adapter tensors adapter `lora_id` was built from (`tandem_add_lora`)."""
        return self._tandem_lora_digests[lora_id]

    def tandem_lora_deltas(self, lora_id: int, path: str) -> list[str]:
        """Save, as safetensors at `path`, the weight update adapter `lora_id` adds to each HF linear layer, B' @ A
        in fp32 from the device buffers vLLM computes with (B' = scale * B; q/k/v and gate/up un-fused). The adapter
        must be active (a request has used it). Returns the names."""
        from safetensors.torch import save_file

        manager = lora_model_manager(self)
        slot = manager.lora_index_to_id.index(lora_id)
        packed = manager.packed_modules_mapping
        out = {}
        for module_name, module in manager.modules.items():
            a_stacked, b_stacked = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
            if not isinstance(a_stacked, tuple) or not isinstance(b_stacked, tuple):  # embeddings: not adapted here
                continue
            prefix, _, short = module_name.rpartition(".")
            parts = packed.get(short, [short]) if len(a_stacked) > 1 else [short]
            for part, a, b in zip(parts, a_stacked, b_stacked):
                out[f"{prefix}.{part}" if prefix else part] = (b[slot, 0].float() @ a[slot, 0].float()).contiguous()
        save_file(out, path)
        return sorted(out)

    def tandem_use_cores(self, cores: list[int], threads: int) -> None:
        """Compute on `cores` with `threads` OpenMP threads (common/runtime/cores.py `widen` / `narrow`). vLLM's CPU
        worker started its OpenMP threads bound to the cores it was given (OMP_PLACES / OMP_PROC_BIND, set from
        VLLM_CPU_OMP_THREADS_BIND) and disabled `torch.set_num_threads` afterwards; a pool thread that starts now is
        bound the same way. So: set the count, run one parallel region (the pool grows now), then bind every thread
        of this process."""
        set_threads_below_vllm(threads)
        torch.ones(threads << 16).add_(1)  # one parallel region: OpenMP starts the threads it lacks
        bind_threads(os.getpid(), cores)

    def tandem_pop_logz(self, keys: list[str]) -> dict[str, list[float]]:
        """The top-p corrections NormalizerProcessor recorded for these requests (and forget them)."""
        out = {}
        for key in keys:
            steps = NormalizerProcessor.recording.pop(key, {})
            out[key] = [steps[i] for i in range(len(steps))] if all(i in steps for i in range(len(steps))) else []
        return out
