"""Data-parallel trainers and device placement: real runs over gloo on CPU; the CUDA runs skip without a GPU."""

import json
import os
from argparse import Namespace

import pytest
import torch
from safetensors.torch import load_file

from common.checks import check_placement
from common.knobs import ConfigError
from common.preflight import check_devices
from common.model import load_model
from conftest import TINY, assert_trained, run_in_process, run_script

pytestmark = pytest.mark.timeout(300)


def _train_hashes(out_dir):
    hashes = {}
    for name in os.listdir(os.path.join(out_dir, "timeline")):
        for line in open(os.path.join(out_dir, "timeline", name)):
            e = json.loads(line)
            if e["phase"] == "train":
                hashes.setdefault(e["step"], {})[e["process"]] = e["hash"]
    return hashes


def _final_weights(out_dir):
    return load_file(os.path.join(out_dir, "final", "model.safetensors"))


def test_two_trainers_stay_identical_and_match_one_trainer(tmp_path):
    common = [*TINY, "--steps", "3", "--verify-sync", "--checkpoint-every", "0"]
    dp = run_in_process("train_sync.py", *common, "--trainer-devices", "cpu,cpu", "--out-dir", str(tmp_path / "dp"))
    single = run_in_process("train_sync.py", *common, "--out-dir", str(tmp_path / "one"))
    assert dp.returncode == 0, dp.stderr[-2000:]
    assert single.returncode == 0, single.stderr[-2000:]
    dp_rows = assert_trained(tmp_path / "dp", steps=3)
    assert_trained(tmp_path / "one", steps=3)
    assert all(r["mismatch/logp_abs_max"] < 1e-4 for r in dp_rows)  # trainer 0's own rows, measured before the step

    hashes = _train_hashes(tmp_path / "dp")
    assert sorted(hashes) == [1, 2, 3]
    for step, by_trainer in hashes.items():
        assert set(by_trainer) == {"trainer0", "trainer1"}
        assert by_trainer["trainer0"] == by_trainer["trainer1"], f"replicas diverged at step {step}"

    # Summed half-gradients equal the whole gradient up to float rounding; training moved the weights far more.
    dp_w, one_w = _final_weights(tmp_path / "dp"), _final_weights(tmp_path / "one")
    init = dict(load_model("tiny").named_parameters())
    moved = max((one_w[k] - init[k].detach()).abs().max().item() for k in one_w)
    differ = max((dp_w[k] - one_w[k]).abs().max().item() for k in one_w)
    assert moved > 1e-3
    assert differ < moved / 100, (differ, moved)


def test_data_parallel_ppo_with_checkpoint_sync(tmp_path):
    """Actor and critic both train data-parallel (--kl-mode reward gives the critic something to fit once the policy
    has moved away from the reference, i.e. from step 2 on)."""
    out = tmp_path / "run"
    r = run_in_process("train_sync.py", *TINY, "--steps", "3", "--trainer-devices", "cpu,cpu", "--sync-method",
                       "checkpoint", "--algo", "ppo", "--kl-coef", "0.1", "--kl-mode", "reward", "--verify-sync",
                       "--out-dir", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = assert_trained(out, steps=3)  # one metrics row per step: only trainer 0 logs
    assert rows[-1]["value_loss"] > 0
    for step, by_trainer in _train_hashes(out).items():
        assert by_trainer["trainer0"] == by_trainer["trainer1"], f"replicas diverged at step {step}"


def test_impossible_placements_are_one_line_errors():
    with pytest.raises(ConfigError, match="--trainer-devices cpu,cuda:0: data-parallel trainers must be all cpu"):
        check_placement(["cpu"], ["cpu", "cuda:0"])
    with pytest.raises(ConfigError, match="--trainer-devices lists cuda:0 twice"):
        check_placement(["cpu"], ["cuda:0", "cuda:0"])
    with pytest.raises(ConfigError, match="'tpu:0' in --explorer-devices/--trainer-devices"):
        check_placement(["tpu:0"], ["cpu"])
    with pytest.raises(ConfigError, match="--explorer-devices and --trainer-devices each need"):
        check_placement([], ["cpu"])
    n = torch.cuda.device_count()
    args = Namespace(explorer_device_list=["cpu"], trainer_device_list=["cpu"], teacher_device=f"cuda:{n}", judge_device="cpu")
    why = "CUDA is not available here" if not torch.cuda.is_available() else "does not exist here"
    with pytest.raises(ConfigError, match=f"cuda:{n} in --teacher-device.* {why}"):
        check_devices(args)
    with pytest.raises(ConfigError, match=f"cuda:{n} in --explorer-devices.* {why}"):
        check_devices(Namespace(explorer_device_list=[f"cuda:{n}"], trainer_device_list=["cpu"], teacher_device="", judge_device="cpu"))


def test_bad_placement_fails_before_anything_starts(tmp_path):
    r = run_in_process("train_sync.py", *TINY, "--trainer-devices", "cpu,gpu0", "--out-dir", str(tmp_path / "x"))
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == ("error: device 'gpu0' in --explorer-devices/--trainer-devices is "
                                                 "neither cpu nor cuda[:N]")
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_colocated_on_one_gpu(tmp_path):
    """Explorer and trainer share cuda:0: the weight sync goes over gloo through the CPU, training on the GPU."""
    out = tmp_path / "run"
    r = run_script("train_sync.py", *TINY, "--steps", "2", "--explorer-devices", "cuda:0", "--trainer-devices",
                   "cuda:0", "--verify-sync", "--out-dir", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert_trained(out, steps=2)
    events = [json.loads(line) for name in os.listdir(out / "timeline") for line in open(out / "timeline" / name)]
    sent = {e["version"]: e["hash"] for e in events if e["process"] == "trainer0" and e["phase"] == "sync"}
    got = {e["version"]: e["hash"] for e in events if e["process"] == "explorer0" and e["phase"] == "sync"}
    assert sent and sent == got
