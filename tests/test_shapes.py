"""`--taskset shapes`: seeded, held-out images never trained on, every answer readable from the pixels, scored by the
vision verifier (right 1, wrong or hedged 0)."""

from collections import Counter

import pytest

from common.tasks import build_tasksets
from common.tasks.shapes import BLIND_CHANCE, IMAGE_SIZE, PALETTE, shapes_split
from common.tasks.validate import validate_task
from rewards.vision import image_info, load_image, score

WHITE = (255, 255, 255)
ANSWERS = {1: ["yes", "no"], 2: list(PALETTE), 3: ["left", "right"], 4: ["1", "2", "3", "4"]}


def ink(task: dict) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(x, y) -> colour of every non-white pixel of the task's image."""
    image = load_image(task)
    pixels = list(image.getdata())
    return {(i % image.width, i // image.width): p for i, p in enumerate(pixels) if p != WHITE}


def components(points) -> int:
    """Connected groups of points (8-neighbourhood)."""
    todo, count = set(points), 0
    while todo:
        count += 1
        stack = [todo.pop()]
        while stack:
            x, y = stack.pop()
            for nb in ((x + dx, y + dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1)):
                if nb in todo:
                    todo.remove(nb)
                    stack.append(nb)
    return count


def test_same_seed_same_tasks():
    train, held_out = shapes_split(seed=5, difficulty=3, eval_size=8, curriculum=True)
    train2, held_out2 = shapes_split(seed=5, difficulty=3, eval_size=8, curriculum=True)
    assert train.next_batch(12, progress=0.9) == train2.next_batch(12, progress=0.9) and held_out == held_out2
    _, other = shapes_split(seed=6, difficulty=3, eval_size=8)
    assert {t["image"] for t in other} != {t["image"] for t in held_out}


def test_held_out_images_never_in_training():
    train, held_out = shapes_split(seed=0, difficulty=1, eval_size=48)
    batch = train.next_batch(400)
    assert not {t["image"] for t in batch} & {t["image"] for t in held_out}
    assert len({t["id"] for t in batch}) == 400 and held_out[0]["id"] == "shapes-eval-0"


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_answer_is_in_the_pixels(level):
    train, _ = shapes_split(seed=1, difficulty=level, eval_size=1)
    tasks = train.next_batch(40)
    for t in tasks:
        assert image_info(t) == (IMAGE_SIZE, IMAGE_SIZE, "PNG")
        pixels = ink(t)
        shown = Counter(pixels.values()).most_common(1)[0][0]
        if level == 1:
            assert (shown == PALETTE["red"]) == (t["answer"] == "yes")
        elif level == 2:
            assert shown == PALETTE[t["answer"]]
        elif level == 3:
            mean_x = sum(x for x, _ in pixels) / len(pixels)
            assert t["answer"] == ("left" if mean_x < IMAGE_SIZE / 2 else "right")
        else:
            assert components(pixels) == int(t["answer"])
    assert {t["answer"] for t in tasks} == set(ANSWERS[level])  # every answer occurs: a blind policy has no favourite
    assert BLIND_CHANCE[level] == 1 / len(ANSWERS[level])


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_vision_verifier_scores_right_wrong_and_hedged(level):
    _, held_out = shapes_split(seed=2, difficulty=level, eval_size=6)
    for t in held_out:
        assert t["reward"] == "vision"
        right, wrong = t["answer"], next(a for a in ANSWERS[level] if a != t["answer"])
        assert score(f"I look at the image.\nAnswer: {right.capitalize()}.", t).score == 1.0
        assert score(f"Answer: {wrong}", t).score == 0.0
        for hedge in (f"{right} or {wrong}", f"{wrong}, {right}"):  # both hold the right answer, one last
            assert score(f"Answer: {hedge}", t).score == 0.0, hedge


def test_build_tasksets_and_validation():
    train, held_out = build_tasksets("shapes", None, difficulty=1, eval_size=4, seed=0)
    assert len(held_out) == 4 and train.next_batch(2)[0]["id"] == "shapes-0"
    for t in held_out:
        assert validate_task(dict(t), "shapes")["reward"] == "vision"
