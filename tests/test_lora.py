"""--lora-rank: the trainer trains adapters only; what the explorers get is the merged model, bit for bit."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from common.model import load_model
from conftest import TINY, run_in_process
from test_scale_trainer import make_trainer, uneven_experiences

pytestmark = pytest.mark.timeout(240)
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]


def test_lora_trains_adapters_only_and_merges_like_peft():
    trainer = make_trainer(*LORA, "--gradient-checkpointing", "--max-tokens-per-micro-batch", "80")
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    metrics = trainer.train_step(uneven_experiences())
    assert metrics["grad_norm"] > 0
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)  # frozen

    merged = trainer.named_weights()
    hf = load_model("tiny")
    assert [n for n, _ in merged] == [n for n, _ in hf.named_parameters()]  # the explorers' names and order
    reference = dict(trainer.model.merge_and_unload(safe_merge=True).named_parameters())  # peft's own merge
    moved = 0.0
    for name, w in merged:
        assert torch.allclose(w, reference[name], atol=1e-7), name
        moved = max(moved, (w - dict(hf.named_parameters())[name]).abs().max().item())
    assert moved > 1e-4  # the adapters changed the merged weights


def _sync_hashes(out_dir):
    events = [json.loads(line) for name in os.listdir(out_dir / "timeline") for line in open(out_dir / "timeline" / name)]
    pick = lambda proc: {e["version"]: e["hash"] for e in events
                         if e["process"] == proc and e["phase"].startswith("sync") and "hash" in e}
    return pick("trainer0"), pick("explorer0")


def test_lora_run_explorer_holds_merged_weights_after_every_sync(tmp_path):
    out = tmp_path / "run"
    r = run_in_process("train_sync.py", *TINY, *LORA, "--steps", "3", "--checkpoint-every", "2", "--verify-sync",
                       "--out-dir", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    sent, got = _sync_hashes(out)
    assert sorted(sent) == [0, 1, 2, 3] and sent == got
    final = load_file(out / "final" / "model.safetensors")  # a plain HF folder of the merged weights
    init = dict(load_model("tiny").named_parameters())
    assert set(final) == set(init) - {"lm_head.weight"}  # tied head left out, as save_pretrained does
    assert max((final[k] - init[k]).abs().max().item() for k in final) > 1e-4
    # final/ is the model and tokenizer only; step checkpoints keep the adapter to resume from
    assert os.path.exists(out / "checkpoints" / "step_2" / "adapter" / "adapter_model.safetensors")
    # resumes the adapter from checkpoints/step_2 (step 3 is off the --checkpoint-every grid)
    r = run_in_process("train_sync.py", *TINY, *LORA, "--steps", "4", "--verify-sync", "--resume", "--out-dir",
                       str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(l)["step"] for l in open(out / "metrics.jsonl")][-1] == 4
