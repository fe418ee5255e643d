"""`make gpu-check`: what to run on a GPU machine after installing, in a few minutes.

    python bench/gpu_check.py --out gpu_check.md         # the matrix, then the realistic-size table
    python bench/gpu_check.py --skip-size --jobs 2       # the matrix alone (a CPU machine runs its CPU subset)

1. The matrix of placements and features: the three schedules colocated, explorer and trainer on separate GPUs,
   a CPU explorer with a GPU trainer, torchrun, checkpoint sync, LoRA, PPO, FSDP2 + CPU offload + gradient
   checkpointing + packing, LoRA + FSDP2 + CPU offload, a VLM, an agent, vLLM (synchronous; asynchronous with top-p, new weights between
   decode steps and --verify-sync): each a real run of an entry script (tiny model, 2 steps, bf16 on
   a GPU) in its own process with a timeout; its verdict is one line: ok (trained: a step with loss != 0 and a
   gradient), FAILED (the error's last line; the whole log is kept) or skipped (why: no CUDA, one GPU, no vLLM).
   Then the suite's tests that skip without CUDA (CUDA_TESTS), and where vLLM imports the vLLM engine's tests on
   the device (VLLM_TESTS), with pytest's verdict (a skip there is a failure).
2. One table at a realistic size: a Qwen2.5-1.5B-shaped model (bench/train_step.py SHAPES, random weights, no hub)
   - rollout tokens/s of each HF generation path at 128 x 256 new tokens (bench/engines.py --device cuda: dynamic
     cache, tandem's decode loop over a static cache in CUDA graphs, transformers' continuous batching), each path's
     warm-up (compile) seconds, and after an in-place weight update the first token's latency and the behaviour
     log-probs against a recomputation;
   - rollout tokens/s in a run, its rollout : train time, and the weight hand-off's GB/s of each --sync-method:
     `train_sync.py` runs with both sides on one GPU (metrics.jsonl's rollout/tokens_per_s, time/rollout and
     time/train; the timeline's sync phases: from trainer0 starting to send a version to explorer0 holding it,
     medians after the first version);
   - train tokens/s and MFU (6·N·tokens over the bf16 matmul rate measured on the card): the train-step
     benchmark's `measure` beside this file (TRAIN_STEP_HOOK; its row says so where that module is absent), once
     as the MFU goal's configuration (four packed micro-batches of 8192 tokens, a GRPO step of ~35k tokens, no
     checkpointing) with a profiled step (the GPU's busy fraction, kernels, the
     top kernels; the whole list in its log), once with gradient checkpointing;
   - peak GPU memory of each process (metrics.jsonl's memory/*_peak_gib, torch's allocator);
   - a Qwen2.5-7B-shaped LoRA policy (rank 16, bf16) colocated on the GPU: fits, rollout and train tokens/s, the
     adapter sync's bytes and ms, peak memory (`lora_size_rows`). The matrix's "LoRA, fp32" row gives the mismatch
     the bf16 LoRA row's is read against.
   A new sync method registered in --sync-method gets its row without a change here.
3. The plan: `train_async.py --plan` for this machine (a Qwen2.5-1.5B-shaped config, no weights), its verdict a row,
   and bench/plan.py's `--plan` tables for the 1.5B / 7B / 8B shapes on 1/2/4/8 GPUs and 2 x 8 like this machine's
   (80 GiB where it has none).

The table is printed as markdown (for docs/BENCHMARKS.md) and written to --out. Needs torch (+ CUDA for the GPU
rows) and the project's pure-Python requirements. Every check is a subprocess: a failure is reported, never raised.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.runtime.metrics import read_metrics, read_timeline  # noqa: E402

SIZE_SHAPE = "qwen2.5-1.5b"  # bench/train_step.py SHAPES: a public config's shape, random weights, no hub
# The train-step benchmark (module, function) in this folder: measure(model, device, dtype, tokens, ...) -> dict
TRAIN_STEP_HOOK = ("train_step", "measure")
HOOK_NAME = f"bench/{TRAIN_STEP_HOOK[0]}.py {TRAIN_STEP_HOOK[1]}()"
STEPS = 2
ROLLOUT_SHAPE = (32, 4, 256)  # prompts x samples each x new tokens of the realistic-size rollouts: 128 x 256
CUDA_TESTS = ["tests/test_scale_logprobs.py::test_varlen_packed_attention_equals_per_sequence_on_cuda",
              "tests/test_engine_hf.py::test_compiled_static_cache_on_cuda_equals_dynamic",
              "tests/test_weight_sync_methods.py::test_colocated_cuda_slot_opens_in_another_process",
              "tests/test_data_parallel.py::test_colocated_on_one_gpu"]  # the suite's tests that skip on a CPU
# tests/test_engine_vllm.py's tests that run on any device (TANDEM_VLLM_TEST_DEVICE)
VLLM_TESTS = ("generate_n_samples or behaviour_logprobs or load_weights_checksum or weights_change_between_decode_steps"
              " or checkpoint_sync or load_from_another or straight_into or runner_vllm_picks")
HARD_END = [float("inf")]  # no subprocess runs past this (set from --budget-s): the whole check ends in time


def timeout_for(seconds: float) -> float:
    return max(5.0, min(seconds, HARD_END[0] - time.time()))


@dataclass
class Check:
    name: str
    argv: list[str]                # after the interpreter, run in the repository root
    skip: str = ""                 # why it does not run here ("" = it runs)
    timeout_s: float = 180
    pytest: bool = False           # argv runs tests: the verdict is pytest's, not a training run's
    env: dict = field(default_factory=dict)  # added to the environment it runs in
    result: dict = field(default_factory=dict)


def tiny_flags(gpu: bool) -> list[str]:
    return ["--model", "tiny", "--taskset", "parity", "--tasks-per-step", "4", "--samples-per-task", "2",
            "--max-new-tokens", "12", "--ppo-epochs", "2", "--minibatch-size", "8", "--micro-batch-size", "4",
            "--eval-size", "4", "--eval-every", "0", "--lr", "1e-3", "--steps", str(STEPS), "--engine", "hf",
            "--num-threads", "2", *(["--dtype", "bfloat16"] if gpu else [])]


def matrix(gpus: int, vllm: tuple[bool, str]) -> list[Check]:
    gpu = gpus > 0
    d = "cuda:0" if gpu else "cpu"
    on = ["--explorer-devices", d, "--trainer-devices", d]
    no_cuda = "" if gpu else "needs CUDA"
    fsdp = (["--trainer-devices", "cuda:0", "--fsdp-cpu-offload"] if gpu else ["--trainer-devices", "cpu,cpu"])
    checks = [
        Check("sync, colocated", ["train_sync.py", *on]),
        Check("offpolicy, colocated", ["train_offpolicy.py", *on]),
        Check("async, colocated", ["train_async.py", *on]),
        Check("explorer and trainer on separate GPUs", ["train_async.py", "--explorer-devices", "cuda:0",
                                                        "--trainer-devices", "cuda:1"],
              "" if gpus >= 2 else f"needs 2 GPUs ({gpus} here)"),
        Check("CPU explorer + GPU trainer", ["train_sync.py", "--explorer-devices", "cpu", "--trainer-devices",
                                             "cuda:0"], no_cuda),
        Check("torchrun --nproc-per-node 2", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                              "train_async.py", *on]),
        Check("checkpoint sync", ["train_async.py", *on, "--sync-method", "checkpoint"]),
        Check("LoRA", ["train_sync.py", *on, "--lora-rank", "4"]),
        # the bf16 LoRA run's mismatch (the row above, bf16 on a GPU) against the same run in fp32
        Check("LoRA, fp32 (mismatch against the LoRA row)", ["train_sync.py", *on, "--lora-rank", "4", "--dtype",
                                                              "float32"], no_cuda),
        Check("HF engine, dynamic KV cache", ["train_sync.py", *on, "--hf-cache", "dynamic"]),
        Check("PPO (critic)", ["train_sync.py", *on, "--algo", "ppo"]),
        Check("FSDP2 + offload + checkpointing + packing" if gpu else "FSDP2 (2 trainers) + checkpointing + packing",
              ["train_sync.py", "--explorer-devices", d, *fsdp, "--trainer-shard", "fsdp", "--gradient-checkpointing",
               "--max-tokens-per-micro-batch", "64"]),
        # the frozen base, the fp32 adapters and their AdamW state offloaded; the sync gathers the adapters from host
        # memory (over gloo on the CPU in tests/test_fsdp.py, where offloading moves nothing)
        Check("LoRA + FSDP2 + offload", ["train_sync.py", "--explorer-devices", d, "--trainer-devices", d,
                                         "--trainer-shard", "fsdp", "--fsdp-cpu-offload", "--lora-rank", "4"], no_cuda),
        Check("VLM (tiny-vlm, shapes+parity)", ["train_sync.py", *on, "--model", "tiny-vlm", "--taskset",
                                                "shapes+parity"]),
        Check("agent (guess_number+parity, 3 turns)", ["train_sync.py", *on, "--taskset", "guess_number+parity",
                                                       "--max-turns", "3", "--episode-token-budget", "400"]),
        Check("vLLM engine", ["train_sync.py", *on, "--engine", "vllm", "--vllm-gpu-memory-utilization", "0.15"],
              "" if vllm[0] else f"vLLM: {vllm[1]}", timeout_s=300),
        Check("vLLM on a second GPU, NCCL broadcast into its worker",
              ["train_async.py", "--explorer-devices", "cuda:1", "--trainer-devices", "cuda:0", "--engine", "vllm",
               "--sync-method", "broadcast", "--vllm-gpu-memory-utilization", "0.3", "--verify-sync"],
              f"vLLM: {vllm[1]}" if not vllm[0] else "" if gpus >= 2 else f"needs 2 GPUs ({gpus} here)",
              timeout_s=300),
        Check("vLLM, async, top-p 0.9, updates between decode steps",
              ["train_async.py", *on, "--engine", "vllm", "--vllm-gpu-memory-utilization", "0.15", "--top-p", "0.9",
               "--verify-sync"], "" if vllm[0] else f"vLLM: {vllm[1]}", timeout_s=300),
        # the vLLM engine's own tests on this device: generation, behaviour log-probs (top-p too) against the
        # trainer's, weight loads read back bit for bit, new weights between two decode steps, checkpoint loads
        Check(f"vLLM engine tests on {d}", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine_vllm.py",
                                            "-k", VLLM_TESTS], "" if vllm[0] else f"vLLM: {vllm[1]}",
              timeout_s=400, pytest=True, env={"TANDEM_VLLM_TEST_DEVICE": d}),
        Check("tests that skip without CUDA", ["-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
              no_cuda, timeout_s=300, pytest=True),
    ]
    for c in checks:
        if c.pytest:
            continue
        script = c.argv.index(next(a for a in c.argv if a.endswith(".py")))
        c.argv[script + 1:script + 1] = tiny_flags(gpu)  # the check's own flags come after: they win
    return checks


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error") or "Error" in ln.split(":")[0]:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def run_check(check: Check, work: str, logs: str) -> dict:
    out_dir = os.path.join(work, re.sub(r"\W+", "_", check.name).strip("_"))
    argv = [sys.executable, *check.argv, *([] if check.pytest else ["--out-dir", out_dir])]
    log = os.path.join(logs, os.path.basename(out_dir) + ".log")
    start = time.time()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_for(check.timeout_s),
                              env={**os.environ, **check.env,
                                   "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    seconds = time.time() - start
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n\n" + text)
    rows = read_metrics(out_dir)
    trained = any(r.get("loss", 0) != 0 and r.get("grad_norm", 0) > 0 for r in rows)
    if rc is None:
        return {"verdict": "FAILED", "seconds": seconds, "detail": f"timed out after {check.timeout_s:.0f}s (log: {log})"}
    if check.pytest:  # pytest's own summary line: "3 passed", "2 passed, 1 skipped", "1 failed, ..."
        summary = next((ln.strip("= ") for ln in reversed(text.splitlines())
                        if re.match(r"=*\s*\d+ (passed|failed|skipped|errors?)\b", ln)), last_error(text))
        ok = rc == 0 and "skipped" not in summary
        return {"verdict": "ok" if ok else "FAILED", "seconds": seconds,
                "detail": summary if ok else f"{summary} (log: {log})"}
    if rc != 0:
        return {"verdict": "FAILED", "seconds": seconds, "detail": f"{last_error(text)} (log: {log})"}
    if len(rows) != STEPS:
        return {"verdict": "FAILED", "seconds": seconds, "detail": f"{len(rows)} metrics rows, expected {STEPS}"}
    if not trained:
        return {"verdict": "FAILED", "seconds": seconds, "detail": "no step had loss != 0 and a gradient"}
    mem = {k: v for r in rows for k, v in r.items() if k.startswith("memory/")}
    mismatch = max((r["mismatch/logp_abs_max"] for r in rows if "mismatch/logp_abs_max" in r), default=None)
    detail = ([] if mismatch is None else [f"mismatch max {mismatch:.1e}"]) + \
        [f"{k[7:].replace('_peak_gib', '')} peak {v:.2f} GiB" for k, v in sorted(mem.items())]
    return {"verdict": "ok", "seconds": seconds, "detail": ", ".join(detail)}


def run_matrix(checks: list[Check], jobs: int, work: str, logs: str, deadline: float) -> None:
    def one(c: Check):
        if c.skip:
            c.result = {"verdict": "skipped", "seconds": 0.0, "detail": c.skip}
        elif time.time() > deadline:
            c.result = {"verdict": "skipped", "seconds": 0.0, "detail": "out of the --budget-s time"}
        else:
            try:
                c.result = run_check(c, work, logs)
            except Exception as e:  # noqa: BLE001 -- a broken check is a verdict, the others still run
                c.result = {"verdict": "FAILED", "seconds": 0.0, "detail": f"gpu_check: {type(e).__name__}: {e}"}
        print(f"{c.result['verdict']:8s} {c.name} ({c.result['seconds']:.0f}s) {c.result['detail']}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(one, checks))


# ----------------------------------------------------------------------------- the realistic size (GPU only)
def _make_model(folder: str, shape: str = SIZE_SHAPE) -> None:
    """A folder of `shape` (Qwen2.5-1.5B), random bf16 weights built on the GPU (seconds, not a CPU init), with the
    tiny byte-level tokenizer (nothing is decoded that matters: the parity verifier scores any text)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.train_step import resolve_config
    from common.model import build_tiny_tokenizer

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(resolve_config(f"shape:{shape}"), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": n, "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))


def _train_step(folder: str, checkpointing: bool) -> None:
    import importlib

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    module, function = TRAIN_STEP_HOOK
    try:
        measure = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        print(json.dumps({"skip": f"{HOOK_NAME} is not on this checkout ({e})"}))
        return
    if checkpointing:
        r = measure(folder, "cuda", torch.bfloat16, 8192, steps=3, micro_batches=2, gradient_checkpointing=True)
    else:  # the MFU goal's configuration (docs/BENCHMARKS.md), profiled: where the step's time goes
        r = measure(folder, "cuda", torch.bfloat16, 8192, steps=3, micro_batches=4, profile=True)
        for name, ms, calls in r["profile"]["top"]:  # into the log
            print(f"{ms:10.1f} ms {calls:7d}x  {name}")
    print(json.dumps(r))


def _json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in its output")


def run_logged(argv: list[str], timeout_s: float, log: str) -> tuple[str, int | None]:
    """(its output, its exit code; None: timed out) of `python *argv` in the repository, written to `log` after the
    command line."""
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_for(timeout_s))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stderr or b"").decode(errors="replace"), None
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n\n" + text)
    return text, rc


def _sub(argv: list[str], timeout_s: float, log: str) -> tuple[dict | None, str]:
    """(the JSON its last such line printed, or None; an error line)."""
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_for(timeout_s),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f}s"
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return None, f"{last_error(proc.stdout + proc.stderr)} (log: {log})"
    try:
        return _json_line(proc.stdout), ""
    except ValueError as e:
        return None, f"{e} (log: {log})"


def handoff_seconds(out_dir: str) -> tuple[float, float, float]:
    """The hand-off of a weight version: (from trainer0 starting to send to explorer0 holding it, trainer0's time
    in its sync phase, explorer0's), medians over the versions after the first."""
    spans: dict[int, dict[str, list[float]]] = {}
    for e in read_timeline(out_dir):
        if e["phase"] == "sync" and e["process"] in ("trainer0", "explorer0") and "version" in e:
            spans.setdefault(e["version"], {"trainer0": [], "explorer0": []})[e["process"]].append(e)
    done = [v for v in sorted(spans) if spans[v]["trainer0"] and spans[v]["explorer0"]]
    later = done[1:] or done

    def median(f):
        return statistics.median(f(spans[v]) for v in later)
    return (median(lambda s: max(e["end"] for e in s["explorer0"]) - min(e["start"] for e in s["trainer0"])),
            median(lambda s: sum(e["end"] - e["start"] for e in s["trainer0"])),
            median(lambda s: sum(e["end"] - e["start"] for e in s["explorer0"])))


def sync_methods() -> list[str]:
    try:
        from common.weight_sync import METHODS  # a registry of sync methods, where there is one
        return list(METHODS)
    except ImportError:
        from common.cli import choices
        from train_sync import Args
        return list(choices(Args)["sync_method"])


def train_step_rows(folder: str, logs: str, deadline: float) -> list[tuple[str, str, str]]:
    """The train step alone, packed micro-batches of 8192 tokens: four per step without checkpointing (profiled),
    then two with gradient checkpointing."""
    rows: list[tuple[str, str, str]] = []
    for checkpointing in (False, True):
        how = "gradient checkpointing" if checkpointing else "no checkpointing"
        if time.time() > deadline:
            rows.append((f"train step, {how}", "skipped", "out of the --budget-s time"))
            continue
        argv = [os.path.abspath(__file__), "--_train-step", folder, *(["--_checkpointing"] if checkpointing else [])]
        log = os.path.join(logs, f"size_train_{'checkpointing' if checkpointing else 'profiled'}.log")
        r, err = _sub(argv, 300, log)
        if r is None:
            rows.append((f"train step, {how}", "FAILED", err))
            continue
        if "skip" in r:
            rows.append((f"train step, {how}", "skipped", r["skip"]))
            continue
        rows += [(f"train tokens/s, {how}", f"{r['tokens_per_s']:,.0f}", f"{HOOK_NAME}: {r['tokens']} tokens per "
                  f"step, packed micro-batches of {r['micro_batch_tokens']}"),
                 (f"MFU, {how}", f"{100 * r['mfu']:.1f} %", f"6·N·tokens / step time {r['step_s']:.3f} s / "
                  f"{r['matmul_tflops']:.0f} TFLOP/s (bf16 matmul measured on this card)"),
                 (f"peak GPU memory, train step alone, {how}", f"{r['peak_memory_gib']:.1f} GiB",
                  f"torch's reserved peak ({r['peak_allocated_gib']:.1f} GiB allocated); common/memory.py's "
                  f"estimate {r['estimate_gib']:.1f} GiB")]
        if "profile" in r:
            p = r["profile"]
            top = "; ".join(f"{name[:48]} {ms:.0f} ms x{calls}" for name, ms, calls in p["top"][:4])
            rows.append(("GPU busy in a profiled step", f"{100 * p['device_busy_frac']:.0f} %",
                         f"{p['kernels']} kernels in {p['wall_s']:.3f} s; top: {top} (all: {log})"))
    return rows


def rollout_rows(folder: str, logs: str) -> list[tuple[str, str, str]]:
    """The HF engine's generation paths at ROLLOUT_SHAPE, one after the other in one process (bench/engines.py)."""
    prompts, n, new_tokens = ROLLOUT_SHAPE
    out = os.path.join(logs, "rollout_paths.json")
    argv = ["bench/engines.py", "--model", folder, "--device", "cuda", "--dtype", "bfloat16", "--engines", "hf",
            "--hf-caches", "dynamic,static,cb", "--prompts", str(prompts), "--n", str(n), "--max-new-tokens",
            str(new_tokens), "--repeats", "2", "--json", out]
    log = os.path.join(logs, "rollout_paths.log")
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_for(420))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), None
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n\n" + text)
    if rc != 0 or not os.path.exists(out):
        return [("HF rollout paths", "FAILED", "timed out" if rc is None else f"{last_error(text)} (log: {log})")]
    with open(out) as f:
        r = json.load(f)
    rows = []
    how = {"dynamic": "HF generate, dynamic KV cache (the CPU default)",
           "static": "tandem's decode loop, static KV cache, each step one CUDA graph (the CUDA default)",
           "cb": "transformers continuous batching (generate_batch, paged attention), not used by tandem"}
    for path in ("dynamic", "static", "cb"):
        got = r.get(f"hf_{path}", {})
        if "error" in got or "tokens_per_s" not in got:
            rows.append((f"rollout tokens/s, {path}", "FAILED", got.get("error", f"no figure (log: {log})")))
            continue
        extra = "" if path == "cb" else (f"; after an in-place weight update: first token of the batch in "
                                         f"{got['first_token_after_update_s']:.3f} s, behaviour vs recomputed "
                                         f"log-prob max |diff| {got['logprob_mismatch_max']:.1e}")
        rows.append((f"rollout tokens/s, {path} ({prompts * n} x {new_tokens} new tokens)",
                     f"{got['tokens_per_s']:,.0f}", f"{how[path]}; warm-up (compile, capture) {got['warm_up_s']} s"
                     f"{extra}; bench/engines.py, best of 2"))
    if "tokens_per_s" in r.get("hf_static", {}) and "tokens_per_s" in r.get("hf_dynamic", {}):
        rows.append(("rollout speed-up, static / dynamic", f"{r['hf_static']['tokens_per_s'] / r['hf_dynamic']['tokens_per_s']:.1f}x",
                     "same process, same rows"))
    return rows


def size_table(work: str, logs: str, deadline: float) -> list[tuple[str, str, str]]:
    """(what, figure, how) rows."""
    rows: list[tuple[str, str, str]] = []
    folder = os.path.join(work, "qwen2.5-1.5b-random")
    made, err = _sub([os.path.abspath(__file__), "--_make-model", folder], 300, os.path.join(logs, "size_model.log"))
    if made is None:
        return [("model folder", "FAILED", err)]
    gb = made["bytes"] / 1e9
    rows.append(("model", f"{made['params'] / 1e9:.2f} B params, {gb:.2f} GB bf16",
                 f"shape:{SIZE_SHAPE} (bench/train_step.py SHAPES), random weights"))
    run_flags = ["--model", folder, "--dtype", "bfloat16", "--explorer-devices", "cuda:0", "--trainer-devices",
                 "cuda:0", "--taskset", "parity", "--samples-per-task", str(ROLLOUT_SHAPE[1]), "--eval-size", "4", "--eval-every", "0",
                 "--num-threads", "4", "--micro-batch-size", "8", "--gradient-checkpointing", "--overwrite"]
    # --sync-method auto's choice for this placement first: its run is the full-size one (rollout, memory)
    for i, method in enumerate(sorted(sync_methods(), key=lambda m: m != "colocated")):
        if time.time() > deadline:
            rows.append((f"weight sync {method}", "skipped", "out of the --budget-s time"))
            continue
        main = i == 0  # the first method's run also gives the rollout and memory rows: a full-size rollout
        size = ["--tasks-per-step", str(ROLLOUT_SHAPE[0]), "--max-new-tokens", str(ROLLOUT_SHAPE[2]), "--steps", "3"] \
            if main else \
            ["--tasks-per-step", "2", "--max-new-tokens", "16", "--steps", "3"]
        out_dir = os.path.join(work, f"size-{method}")
        argv = ["train_sync.py", *run_flags, *size, "--sync-method", method, "--out-dir", out_dir]
        log = os.path.join(logs, f"size_{method}.log")
        text, rc = run_logged(argv, 300, log)
        metrics = read_metrics(out_dir)[1:]  # the first step warms up
        if rc != 0 or not metrics:
            rows.append((f"train_sync.py --sync-method {method}", "FAILED",
                         "timed out" if rc is None else f"{last_error(text)} (log: {log})"))
            continue
        wall, sent, took = handoff_seconds(out_dir)
        rows.append((f"weight hand-off, --sync-method {method}, colocated", f"{1e3 * wall:,.1f} ms",
                     f"{gb:.2f} GB: {gb / wall:.2f} GB/s; trainer0 sending {1e3 * sent:,.1f} ms, explorer0 taking "
                     f"{1e3 * took:,.1f} ms (timeline sync phases, train_sync.py, median of the versions after the "
                     "first)"))
        if main:
            tps = statistics.median(r.get("rollout/tokens_per_s", float("nan")) for r in metrics)
            with open(os.path.join(out_dir, "config.json")) as f:
                engine = json.load(f)["engine"]
            rollout_s = statistics.median(r.get("time/rollout", float("nan")) for r in metrics)
            train_s = statistics.median(r.get("time/train", float("nan")) for r in metrics)
            rows.append((f"rollout tokens/s in a run ({engine} engine, {ROLLOUT_SHAPE[0] * ROLLOUT_SHAPE[1]} x "
                         f"{ROLLOUT_SHAPE[2]} new tokens)", f"{tps:,.0f}",
                         f"train_sync.py metrics rollout/tokens_per_s, median of steps 2-3; rollout {rollout_s:.2f} s "
                         f": train {train_s:.2f} s a step (time/rollout, time/train)"))
            for k in sorted({k for r in metrics for k in r if k.startswith("memory/")}):
                rows.append((f"peak GPU memory, {k[7:].replace('_peak_gib', '')} process",
                             f"{max(r.get(k, 0) for r in metrics):.1f} GiB", "torch max_memory_allocated"))
            rows += rollout_rows(folder, logs)  # before the other sync methods: they matter more
            rows += train_step_rows(folder, logs, deadline)
    return rows


# ----------------------------------------------------------------------------- the plan
def plan_section(work: str, logs: str, gpus: int) -> tuple[str, bool]:
    """(markdown, ok): the plan row (`train_async.py --plan` on this machine) and the --plan tables (bench/plan.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plan as plans
    import torch

    folder = plans.model_folder("Qwen2.5-1.5B", work)
    argv = [sys.executable, "train_async.py", "--plan", "--model", folder, *plans.FLAGS]
    start, verdict, detail = time.time(), "skipped", "needs CUDA (a CPU machine is placed as ever: no plan)"
    if gpus:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_for(300),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
        log = os.path.join(logs, "plan.log")
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n\n" + proc.stdout + proc.stderr)
        placed = next((ln for ln in proc.stdout.splitlines() if ln.startswith("placement:")), "")
        verdict = "ok" if proc.returncode == 0 and placed else "FAILED"
        detail = placed.removeprefix("placement: ") if verdict == "ok" else \
            f"{last_error(proc.stdout + proc.stderr)} (log: {log})"
    print(f"{verdict:8s} plan ({time.time() - start:.0f}s) {detail}", flush=True)
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpus else 80.0
    tables = [plans.table("train_async.py", name, plans.model_folder(name, work), round(gib))
              for name in plans.MODELS]
    return "\n".join(["", "| check | verdict | s | detail |", "|---|---|---|---|",
                      f"| plan (train_async.py --plan, Qwen2.5-1.5B shape) | {verdict} | {time.time() - start:.0f} | "
                      f"{detail} |", "", "\n\n".join(tables), ""]), verdict != "FAILED"


LORA_SHAPE, LORA_RANK = "qwen2.5-7b", 16  # the 7B LoRA row: a policy that fits one GPU only with LoRA


def lora_size_rows(work: str, logs: str, deadline: float) -> list[tuple[str, str, str]]:
    """A Qwen2.5-7B-shaped LoRA policy (rank 16, bf16) trained colocated on one GPU (train_sync.py, the explorer
    with --vllm-gpu-memory-utilization 0.35 where vLLM runs): whether it fits, rollout and train tokens/s, the
    adapter sync (bytes and ms), peak memory of each process."""
    if time.time() > deadline:
        return [("7B LoRA colocated", "skipped", "out of the --budget-s time")]
    folder = os.path.join(work, f"{LORA_SHAPE}-random")
    made, err = _sub([os.path.abspath(__file__), "--_make-model", folder, "--_shape", LORA_SHAPE], 600,
                     os.path.join(logs, "lora_model.log"))
    if made is None:
        return [("7B LoRA model folder", "FAILED", err)]
    out_dir, log = os.path.join(work, "lora-7b"), os.path.join(logs, "lora_7b.log")
    argv = ["train_sync.py", "--model", folder, "--dtype", "bfloat16", "--explorer-devices", "cuda:0",
            "--trainer-devices", "cuda:0", "--lora-rank", str(LORA_RANK), "--vllm-gpu-memory-utilization", "0.35",
            "--taskset", "parity", "--tasks-per-step", "8", "--samples-per-task", "4", "--max-new-tokens", "256",
            "--micro-batch-size", "8", "--gradient-checkpointing", "--steps", "3", "--eval-size", "4",
            "--eval-every", "0", "--num-threads", "4", "--overwrite", "--out-dir", out_dir]
    text, rc = run_logged(argv, 900, log)
    metrics = read_metrics(out_dir)[1:]  # the first step warms up
    what = f"7B LoRA rank {LORA_RANK} colocated ({made['params'] / 1e9:.2f} B params, bf16)"
    if rc != 0 or not metrics:
        return [(what, "FAILED", "timed out" if rc is None else f"{last_error(text)} (log: {log})")]
    med = lambda k: statistics.median(r.get(k, float("nan")) for r in metrics)  # noqa: E731
    rows_per_step = 8 * 4
    wall, sent, took = handoff_seconds(out_dir)
    rows = [(what, "fits", f"train_sync.py, 3 steps, explorer and trainer on cuda:0 (log: {log})"),
            ("7B LoRA rollout tokens/s", f"{med('rollout/tokens_per_s'):,.0f}",
             f"metrics rollout/tokens_per_s, median of steps 2-3 ({rows_per_step} x 256 new tokens)"),
            ("7B LoRA train response tokens/s", f"{rows_per_step * med('response/tokens_mean') / med('time/train'):,.0f}",
             f"{rows_per_step} x response/tokens_mean / time/train ({med('time/train'):.1f} s a step)"),
            ("7B LoRA adapter sync", f"{1e3 * wall:,.1f} ms", f"{med('sync/bytes') / 1e6:,.1f} MB (sync/bytes) a sync; "
             f"trainer0 sending {1e3 * sent:,.1f} ms, explorer0 taking {1e3 * took:,.1f} ms (timeline)")]
    for k in sorted({k for r in metrics for k in r if k.startswith("memory/")}):
        rows.append((f"7B LoRA peak GPU memory, {k[7:].replace('_peak_gib', '')} process",
                     f"{max(r.get(k, 0) for r in metrics):.1f} GiB", "torch max_memory_allocated"))
    return rows


# ----------------------------------------------------------------------------- report
def machine() -> tuple[str, int, tuple[bool, str]]:
    import torch
    import transformers

    from common.explorer.engine import vllm_available

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    card = torch.cuda.get_device_name(0) if gpus else platform.processor() or "CPU"
    cuda = f", CUDA {torch.version.cuda}" if gpus else ""
    desc = (f"{card} x {gpus}" if gpus else f"{os.cpu_count()}-core CPU, no GPU") + \
        f"; torch {torch.__version__}{cuda}, transformers {transformers.__version__}"
    return desc, gpus, vllm_available()


def markdown(desc: str, checks: list[Check], size: list[tuple[str, str, str]] | None, skipped_size: str) -> str:
    out = [f"### gpu-check, {time.strftime('%Y-%m-%d')}: {desc}", "", "`python bench/gpu_check.py` (`make gpu-check`)",
           "", "| check | verdict | s | detail |", "|---|---|---|---|"]
    out += [f"| {c.name} | {c.result['verdict']} | {c.result['seconds']:.0f} | {c.result['detail']} |" for c in checks]
    out += [""]
    if size is None:
        out += [f"Realistic size (Qwen2.5-1.5B shape): skipped ({skipped_size})."]
    else:
        out += ["Realistic size: Qwen2.5-1.5B shape, random weights, bf16, explorer and trainer on one GPU", "",
                "| what | figure | how |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in size]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="also write the markdown report here")
    parser.add_argument("--jobs", type=int, default=0, help="checks at once (default: 6 on a GPU, 1 on a CPU)")
    parser.add_argument("--only", nargs="*", default=None, help="run only checks whose name contains one of these")
    parser.add_argument("--skip-size", action="store_true", help="the matrix alone")
    parser.add_argument("--budget-s", type=float, default=300, help="start no new check after this many seconds")
    parser.add_argument("--grace-s", type=float, default=90, help="and stop any still running this much later")
    parser.add_argument("--_make-model", dest="make_model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--_shape", dest="shape", default=SIZE_SHAPE, help=argparse.SUPPRESS)
    parser.add_argument("--_train-step", dest="train_step", default="", help=argparse.SUPPRESS)
    parser.add_argument("--_checkpointing", dest="checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_model:
        return _make_model(args.make_model, args.shape)
    if args.train_step:
        return _train_step(args.train_step, args.checkpointing)
    start = time.time()
    deadline = start + args.budget_s
    HARD_END[0] = deadline + args.grace_s
    desc, gpus, vllm = machine()
    print(f"[gpu-check] {desc}", flush=True)
    work = tempfile.mkdtemp(prefix="gpu-check-")
    logs = os.path.join(work, "logs")
    os.makedirs(logs)
    checks = matrix(gpus, vllm)
    if args.only is not None:
        checks = [c for c in checks if any(o.lower() in c.name.lower() for o in args.only)]
    run_matrix(checks, args.jobs or (6 if gpus else 1), work, logs, deadline)
    size, why = None, "--skip-size" if args.skip_size else "needs CUDA"
    if gpus and not args.skip_size:
        try:
            size = size_table(work, logs, deadline)
            size += lora_size_rows(work, logs, deadline)
        except Exception as e:  # noqa: BLE001 -- reported in the table, the matrix's verdicts still print
            size = [("realistic size", "FAILED", f"gpu_check: {type(e).__name__}: {e}")]
    report = markdown(desc, checks, size, why)
    plan_md, plan_ok = plan_section(work, logs, gpus)
    report += plan_md
    print("\n" + report, flush=True)
    print(f"[gpu-check] {time.time() - start:.0f}s; logs in {logs}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    if any(c.result["verdict"] == "FAILED" for c in checks) or (size and any(b == "FAILED" for _, b, _ in size)) \
            or not plan_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
