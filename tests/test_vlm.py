"""A policy that sees (`--model tiny-vlm`, common/vlm.py): images reach the engine, the buffer and the trainer, the
trainer scores exactly what the engine sampled, and every schedule trains through the vision tower."""

import json
import pickle

import pytest
import torch

from common.experience import Experience, RolloutBatch, collate
from common.explorer.engine import HFEngine, SamplingConfig
from common.model import load_model, load_tokenizer
from common.trainer.forward import sequence_logprobs
from common.tasks import build_tasksets
from common.vlm import image_prompt, load_processor
from rewards.vision import load_images
from conftest import TINY, assert_trained, run_in_process


@pytest.fixture(scope="module")
def vlm():
    tokenizer = load_tokenizer("tiny-vlm")
    return load_model("tiny-vlm"), tokenizer, load_processor("tiny-vlm", "tiny-vlm", tokenizer)


def shapes(n: int, difficulty: int = 1) -> list[dict]:
    return build_tasksets("shapes", None, difficulty, n, seed=0)[1]


def sample(vlm, tasks, n=3, max_new_tokens=10):
    """Sampled experiences of `tasks` (n per task, one group each) through the HF engine, images included."""
    model, tokenizer, processor = vlm
    prompts = [image_prompt(processor, t["prompt"], load_images(t)) for t in tasks]
    generations = HFEngine(model, tokenizer).generate([ids for ids, _ in prompts],
                                                      SamplingConfig(1.0, 1.0, max_new_tokens, n),
                                                      images=[im for _, im in prompts])
    return [Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * len(g.response_ids), 0.0, k, t["id"], 0,
                       images=im)
            for k, (t, (_, im), group) in enumerate(zip(tasks, prompts, generations)) for g in group]


def test_prompt_holds_one_placeholder_per_image_token(vlm):
    _, tokenizer, processor = vlm
    ids, images = image_prompt(processor, shapes(1)[0]["prompt"], load_images(shapes(1)[0]))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merged = int(images.grid_thw.prod()) // 4  # 2x2 patches per token
    assert ids.count(pad) == images.tokens == merged > 0
    assert images.pixel_values.shape[0] == int(images.grid_thw.prod())


def test_trainer_recomputes_the_engines_logprobs_on_image_prompts(vlm):
    """Token-in/token-out with images: the trainer's log-probs of the sampled ids, given the same pixels, are the
    engine's sampling log-probs (fp32)."""
    model, tokenizer, _ = vlm
    experiences = sample(vlm, shapes(2))
    batch = collate(experiences, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask,
                                     images=batch.images)
    assert batch.response_mask.sum() > 0
    assert torch.allclose(logprobs * batch.response_mask, batch.old_logprobs, atol=1e-4)


def test_the_image_reaches_the_trainers_forward(vlm):
    """Same ids, other image (or none): the trainer's distribution changes, so no step of the way drops it."""
    model, tokenizer, processor = vlm
    tasks = [t for t in shapes(12, difficulty=2) if t["answer"] in ("red", "blue")]
    red = next(t for t in tasks if t["answer"] == "red")
    blue = next(t for t in tasks if t["answer"] == "blue")
    experiences = sample(vlm, [red], n=2)
    ids_blue, blue_images = image_prompt(processor, blue["prompt"], load_images(blue))
    assert ids_blue == experiences[0].prompt_ids  # level 2 asks one question: the ids are the same
    batch = collate(experiences, tokenizer.pad_token_id)
    with torch.no_grad():
        seen = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask,
                                 images=batch.images)
        other = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask,
                                  images=[blue_images] * len(batch))
    assert (seen - other).abs().max() > 1e-3


def test_a_group_carries_and_encodes_its_pixels_once(vlm):
    """The group's samples share one ImageInputs: pickled once per rollout batch, through the vision tower once per
    group in the trainer's forward."""
    model, tokenizer, _ = vlm
    experiences = sample(vlm, shapes(2), n=4, max_new_tokens=4)
    one_image = len(pickle.dumps(experiences[0].images))
    whole = len(pickle.dumps(RolloutBatch(1, experiences, {})))
    assert whole < 2 * one_image + 20_000, (whole, one_image)  # two groups: two images, not eight
    calls = []
    hook = model.model.visual.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        batch = collate(experiences, tokenizer.pad_token_id)
        sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask, images=batch.images)
    finally:
        hook.remove()
    patches = sum(int(e.images.grid_thw.prod()) for e in experiences[::4])
    assert calls == [patches]  # one call, each group's patches once


def parity_on_images(path, n=24) -> str:
    """Shapes images with the parity reward: a random policy gets mixed rewards, so every step has a gradient, and
    it flows through the image features into the vision tower."""
    with open(path, "w") as f:
        for i, task in enumerate(shapes(n)):
            f.write(json.dumps({**task, "id": f"img-{i}", "reward": "parity", "parity": "even"}) + "\n")
    return str(path)


@pytest.mark.parametrize("script", ["train_sync.py", "train_offpolicy.py", "train_async.py"])
def test_every_schedule_trains_the_vlm(tmp_path, script):
    """Parity on images gives the random policy a gradient through the vision tower. train_sync.py's run also mixes
    in `--taskset shapes` (its rewards from the vision verifier) and measures held-out accuracy."""
    out = tmp_path / "run"
    taskset, extra = parity_on_images(tmp_path / "t.jsonl"), []
    if script == "train_sync.py":
        taskset, extra = f"shapes+{taskset}", ["--eval-every", "1"]
    proc = run_in_process(script, *TINY, "--model", "tiny-vlm", "--taskset", taskset, "--steps", "2",
                          "--out-dir", str(out), "--verify-sync", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2, model="tiny-vlm")
    assert all(r["rollout/image_tokens_mean"] > 0 and r["reward/failed"] == 0 for r in rows)
    final, initial = load_model(str(out / "final")), load_model("tiny-vlm")
    tower = [n for n, p in initial.model.visual.named_parameters()
             if not torch.equal(p, final.model.visual.get_parameter(n))]
    assert tower, "the vision tower did not change: no gradient reached it"
    if script == "train_sync.py":
        assert json.load(open(out / "summary.json"))["eval_after"] is not None


def test_a_qwen2_vl_folder_loads_like_tiny_vlm(tmp_path, vlm):
    """A saved Qwen2-VL folder (weights, tokenizer, preprocessor_config.json) gives the same prompt ids, pixels and
    log-probs as the model it was saved from."""
    model, tokenizer, processor = vlm
    folder = str(tmp_path / "qwen2-vl")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    loaded, loaded_tokenizer = load_model(folder), load_tokenizer(folder)
    task = shapes(1)[0]
    ids, images = image_prompt(processor, task["prompt"], load_images(task))
    loaded_ids, loaded_images = image_prompt(load_processor(folder, folder, loaded_tokenizer), task["prompt"],
                                             load_images(task))
    assert loaded_ids == ids and torch.equal(loaded_images.pixel_values, images.pixel_values)
    batch = collate(sample(vlm, [task], n=2), tokenizer.pad_token_id)
    with torch.no_grad():
        here, there = (sequence_logprobs(m, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask,
                                         images=batch.images) for m in (model, loaded))
    assert torch.allclose(here, there, atol=1e-5)


def test_freeze_vision_keeps_the_tower(tmp_path):
    """--freeze vision: the language model learns, the tower stays as built and is left out of the weight sync
    (--verify-sync: the explorer's synced weights hash as the trainer's)."""
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--model", "tiny-vlm", "--taskset",
                          parity_on_images(tmp_path / "t.jsonl"), "--steps", "1", "--out-dir", str(out), "--freeze",
                          "vision", "--verify-sync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trained(out, steps=1, model="tiny-vlm")  # the language model learned
    final, initial = load_model(str(out / "final")), load_model("tiny-vlm")
    for name, p in initial.model.visual.named_parameters():
        assert torch.equal(p, final.model.visual.get_parameter(name)), name
