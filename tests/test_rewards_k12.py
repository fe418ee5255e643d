"""K-12 and vision verifiers: tables of equivalent / different answers (both directions), choices, true/false,
the generative judge with tiny offline models, and image decoding."""

import base64
import io

import pytest

from rewards import score
from tests.reward_helpers import build_tiny_judge

# (a, b): a response answering `a` to a task whose reference is `b` must score 1, and the other way round.
EQUIVALENT = [("12 cm", "0.12 m"), ("1.2 km", "1,200 meters"), ("three", "3"), ("50%", "50 %"),
              ("The Nile River.", "nile river"), ("3.14159", "3.1416"), ("x = 5", "5"), ("1/4", "0.25"),
              ("90 min", "1.5 h"), ("yes", "true"), ("错误", "false"), ("correct", "True"), ("3 apples", "3 apple"),
              ("\\text{Paris}", "paris"), ("2,000", "2000")]
DIFFERENT = [("12 cm", "12 kg"), ("12 cm", "13 cm"), ("Amazon", "Nile"), ("yes", "no"), ("3.2", "3.1416"),
             ("4 apples", "3 apples"), ("1/4", "0.4"), ("true", "false"), ("Paris", "Paris, Texas")]


@pytest.mark.parametrize("a,b", EQUIVALENT)
def test_equivalent_pairs_both_directions(a, b):
    assert score(f"Answer: {a}", {"id": "k", "reward": "k12", "answer": b}).score == 1.0
    assert score(f"so \\boxed{{{b}}}", {"id": "k", "reward": "k12", "answer": a}).score == 1.0


@pytest.mark.parametrize("a,b", DIFFERENT)
def test_different_pairs_both_directions(a, b):
    assert score(f"Answer: {a}", {"id": "k", "reward": "k12", "answer": b}).score == 0.0
    assert score(f"Answer: {b}", {"id": "k", "reward": "k12", "answer": a}).score == 0.0


CHOICES = ["Paris", "London", "Berlin", "Rome"]
# (response answer, reference): letters, option text, "(b)", "B) London", "Option B", an index, multi-select.
SAME_CHOICE = [("B", "London"), ("(b)", "B"), ("London", "B"), ("B) London", "B"), ("Option B", "London"),
               ("A, C", "AC"), ("C and A", "AC")]
OTHER_CHOICE = [("A", "London"), ("Paris", "B"), ("A", "AC"), ("B) Paris", "B"), ("E", "A")]


@pytest.mark.parametrize("a,b", SAME_CHOICE)
def test_choice_same_both_directions(a, b):
    assert score(f"Answer: {a}", {"id": "mc", "reward": "k12", "answer": b, "choices": CHOICES}).score == 1.0
    assert score(f"Answer: {b}", {"id": "mc", "reward": "k12", "answer": a, "choices": CHOICES}).score == 1.0


@pytest.mark.parametrize("a,b", OTHER_CHOICE)
def test_choice_different(a, b):
    r = score(f"Answer: {a}", {"id": "mc", "reward": "k12", "answer": b, "choices": CHOICES})
    assert r.score == 0.0


def test_choice_details():
    task = {"id": "mc2", "reward": "k12", "answer": 1, "choices": CHOICES}  # an index names option B
    assert score("I think it is London.\nAnswer: B", task).score == 1.0
    r = score("The answer is\nB", task)  # no Answer: line: the last line is used, format_ok says so
    assert r.score == 1.0 and r.info["format_ok"] is False
    assert score("Answer: B", {**task, "choices": {"A": "cat", "B": "dog"}}).score == 1.0
    with pytest.raises(ValueError, match="task mc3"):
        score("Answer: A", {"id": "mc3", "reward": "k12", "answer": "Madrid", "choices": CHOICES})
    assert score("no idea", {"id": "t", "reward": "k12", "answer": "x"}).info["reason"] == "no match"
    assert score("", {"id": "t", "reward": "k12", "answer": "x"}).info["reason"] == "no answer"


def test_tolerance_and_accepted_lists():
    task = {"id": "n", "reward": "k12", "answer": "9.8 m/s", "tolerance": 0.01}
    assert score("Answer: 9.81 m/s", task).score == 1.0
    assert score("Answer: 9.81 m/s", {**task, "tolerance": 1e-4}).score == 0.0
    assert score("Answer: 35.3 km/h", {**task, "answer": "9.8 m/s"}).score == 1.0  # 35.3 km/h = 9.806 m/s
    multi = {"id": "s", "reward": "k12", "answer": ["photosynthesis", "light reaction"]}
    assert score("Answer: Light reaction", multi).score == 1.0 and score("Answer: osmosis", multi).score == 0.0


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("judges")
    return {kind: build_tiny_judge(str(root / kind), kind) for kind in ("random", "uniform", "yes")}


@pytest.mark.timeout(60)
def test_generative_judge_with_tiny_models(judges):
    task = {"id": "j1", "reward": "k12", "prompt": "Which river flows through Cairo?", "answer": "the Nile"}
    assert score("Answer: Nile river", task).score == 0.0  # the rules alone say no
    r = score("Answer: Nile river", {**task, "judge_model": judges["yes"]})
    assert r.score == 1.0 and r.info["judge_p_yes"] > 0.99 and r.info["reason"].startswith("judge yes")
    r = score("Answer: Nile river", {**task, "judge_model": judges["uniform"]})
    vocab = 259  # byte-level tokenizer: 256 bytes + 3 specials; P(yes) = V^-3 / (V^-3 + V^-2) = 1 / (1 + V)
    assert r.score == 0.0 and r.info["judge_p_yes"] == pytest.approx(1 / (1 + vocab), rel=1e-4)
    # A rule-based match does not ask the judge (unless judge="always"); the random judge gives a valid P(yes).
    assert "judge_p_yes" not in score("Answer: The Nile", {**task, "judge_model": judges["uniform"]}).info
    r = score("Answer: The Nile", {**task, "judge_model": judges["uniform"], "judge": "always"})
    assert r.score == 0.0 and "judge no" in r.info["reason"]
    p = score("Answer: Amazon", {**task, "judge_model": judges["random"]}).info["judge_p_yes"]
    assert 0.0 < p < 1.0
    assert score("Answer: Amazon", {**task, "judge_model": judges["random"]}).info["judge_p_yes"] == p


def echo_judge(response: str, task: dict):
    """A verifier that reports which judge the pool handed it (the judge itself is tested above)."""
    from rewards import Reward

    return Reward(1.0, {"reason": "echo", "judge_model": task.get("judge_model")})


@pytest.mark.timeout(60)
def test_pool_level_judge_model_reaches_k12_and_vision_tasks():
    from rewards import RewardPool

    tasks = [{"id": "a", "reward": "k12", "answer": "x"}, {"id": "b", "reward": "vision", "answer": "x"},
             {"id": "c", "reward": "k12", "answer": "x", "judge_model": "/own"},  # a task's own judge wins
             {"id": "d", "reward": "math", "answer": "x"}]
    with RewardPool(num_workers=1, judge_model="/pool-judge", score_fn=echo_judge) as pool:
        got = pool.score_batch(["x"] * 4, tasks)
    assert [r.info["judge_model"] for r in got] == ["/pool-judge", "/pool-judge", "/own", None]


# ---------------------------------------------------------------- vision
def _png(width=8, height=6) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_vision_counting_choice_and_short_answers(tmp_path):
    png = _png()
    (tmp_path / "apples.png").write_bytes(png)
    b64 = base64.b64encode(png).decode()
    for image in (str(tmp_path / "apples.png"), b64, "data:image/png;base64," + b64):
        task = {"id": "v1", "reward": "vision", "image": image, "prompt": "How many apples?", "answer": "3",
                "type": "count"}
        r = score("I see three apples.\nAnswer: 3", task)
        assert r.score == 1.0 and r.info["image"] == "8x6 PNG"
    assert score("Answer: three", task).score == 1.0
    assert score("Answer: 4", task).score == 0.0
    assert score("Answer: 3", {**task, "answer": "three"}).score == 1.0
    assert score("Answer: many", task).info["reason"] == "no count"
    assert score("Answer: 2 or 3", task).score == 0.0 and score("Answer: 3 (three)", task).score == 1.0  # hedges
    rel = {"id": "v2", "reward": "vision", "image": "apples.png", "image_root": str(tmp_path), "answer": "B",
           "choices": ["a pear", "apples"]}
    assert score("Answer: apples", rel).score == 1.0 and score("Answer: A", rel).score == 0.0
    short = {"id": "v3", "reward": "vision", "image": b64, "answer": "red"}
    assert score("Answer: Red.", short).score == 1.0 and score("Answer: blue", short).score == 0.0


def test_vision_image_must_decode(tmp_path):
    truncated = base64.b64encode(_png()[:40]).decode()
    for image, message in ((truncated, "does not decode"), (str(tmp_path / "missing.png"), "not found"),
                           ("!!" * 50, "neither a file nor valid base64")):
        with pytest.raises(ValueError, match=f"task v9: .*{message}"):
            score("Answer: 3", {"id": "v9", "reward": "vision", "image": image, "answer": "3"})
