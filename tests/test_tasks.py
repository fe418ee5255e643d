"""Tasksets: the procedural arithmetic split is seeded and disjoint; file loaders fail in one line on bad rows."""

import json

import pytest

from common.tasks.procedural import arithmetic_split
from common.tasks import build_tasksets
from common.tasks.files import load_tasks


def test_arithmetic_split_seeded_and_disjoint():
    train, held_out = arithmetic_split(seed=3, difficulty=2, eval_size=50)
    train2, held_out2 = arithmetic_split(seed=3, difficulty=2, eval_size=50)
    batch = train.next_batch(500)
    assert batch[:20] == train2.next_batch(20) and held_out == held_out2
    assert not {t["prompt"] for t in batch} & {t["prompt"] for t in held_out}
    for t in batch[:50]:
        assert t["reward"] == "math" and int(t["answer"]) >= 0 and "Answer:" in t["prompt"]
    assert len({t["id"] for t in batch}) == 500


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_arithmetic_answers_are_right(level):
    import re

    train, _ = arithmetic_split(seed=0, difficulty=level, eval_size=1)
    for t in train.next_batch(30):
        nums = [int(x) for x in re.findall(r"\d+", t["prompt"].split("\n")[0])]
        if level == 1:
            assert int(t["answer"]) == nums[0] + nums[1]
        elif level == 2:
            assert int(t["answer"]) == nums[0] + nums[1] - nums[2]
        elif level == 3:
            assert int(t["answer"]) == nums[0] * nums[1] + nums[2]
        else:
            assert int(t["answer"]) == (nums[0] + nums[1]) * nums[2] - nums[3]


def test_jsonl_taskset_with_held_out_and_epochs(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(10)))
    train, held_out = build_tasksets(str(path), None, 1, eval_size=3, seed=0)
    seen = train.next_batch(14)
    assert len(held_out) == 3 and {t["id"] for t in seen[:7]} == {t["id"] for t in seen[7:14]}  # 7 per epoch
    assert not {t["id"] for t in seen} & {t["id"] for t in held_out}
    assert held_out[0]["reward"] == "math"  # the default verifier


@pytest.mark.parametrize("line,fragment", [
    ('{"answer": "2"}', "missing field 'prompt'"),
    ('{"prompt": "x", "reward": "code"}', "missing field 'tests'"),
    ('{"prompt": "x", "answer": "1", "reward": "poetry"}', "unknown reward 'poetry'"),
    ('{"prompt": "x", ', "not valid JSON"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(SystemExit) as e:
        load_tasks(str(path))
    assert str(e.value).startswith(f"error: {path}:3: ") and fragment in str(e.value)


def test_hf_dataset_file_loader(tmp_path):
    import datasets

    path = tmp_path / "tasks.parquet"
    datasets.Dataset.from_list([{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]).to_parquet(path)
    tasks = load_tasks(str(path))
    assert [t["answer"] for t in tasks] == ["2", "4"] and tasks[1]["id"].endswith(":1")
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([{"prompt": "1+1?", "x": 1}]).to_parquet(bad)
    with pytest.raises(SystemExit, match="row 0: missing field 'answer'"):
        load_tasks(str(bad))


def _tasks(n, difficulty=lambda i: 1):
    return [{"id": f"t{i}", "prompt": f"{i}?", "answer": "0", "difficulty": difficulty(i)} for i in range(n)]


def test_prioritized_sampling_favours_low_success_tasks():
    """Weights 1 - success rate: tasks solved 90% of the time should be drawn ~9x less often than 10% ones."""
    from common.tasks.stream import TaskStream

    stream = TaskStream(tasks=_tasks(20), seed=0, sampling="prioritized")
    for i in range(20):
        stream.record(f"t{i}", [True] * 9 + [False] if i < 10 else [True] + [False] * 9)
    drawn = [t["id"] for _ in range(500) for t in stream.next_batch(4)]
    hard_share = sum(int(i[1:]) >= 10 for i in drawn) / len(drawn)
    # Exactly proportional draws give 0.9; no repeats within a batch of 4 flatten it a little. Uniform gives 0.5.
    assert hard_share > 0.8, hard_share
    assert len(set(drawn[:4])) == 4  # no task twice in one batch
    uniform = TaskStream(tasks=_tasks(20), seed=0)
    assert 0.4 < sum(int(t["id"][1:]) >= 10 for t in uniform.next_batch(2000)) / 2000 < 0.6


def test_prioritized_sampling_prefers_untried_and_falls_back_when_all_solved():
    from common.tasks.stream import TaskStream

    stream = TaskStream(tasks=_tasks(4), seed=1, sampling="prioritized")
    for i in range(3):
        stream.record(f"t{i}", [True, True])
    assert {t["id"] for _ in range(20) for t in stream.next_batch(1)} == {"t3"}  # the solved ones have weight 0
    stream.record("t3", [True])
    assert len({t["id"] for _ in range(40) for t in stream.next_batch(1)}) == 4  # all solved: uniform


def test_curriculum_opens_levels_from_easy_to_hard(tmp_path):
    from common.tasks.stream import TaskStream

    stream = TaskStream(tasks=_tasks(30, difficulty=lambda i: [3, 1, 2][i % 3]), seed=0, curriculum=True)
    seen = [{t["difficulty"] for _ in range(30) for t in stream.next_batch(2, progress=p)} for p in (0.0, 0.4, 0.7)]
    assert seen == [{1}, {1, 2}, {1, 2, 3}]
    # The arithmetic stream: levels 1..difficulty open over the run; the held-out split stays at --difficulty.
    train, held_out = build_tasksets("arith", None, 3, eval_size=4, seed=0, curriculum=True)
    levels = [{t["difficulty"] for t in train.next_batch(40, progress=p)} for p in (0.1, 0.5, 0.99)]
    assert levels == [{1}, {1, 2}, {1, 2, 3}] and {t["difficulty"] for t in held_out} == {3}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}?", "answer": "1"}) + "\n" for i in range(6)))
    with pytest.raises(SystemExit, match="--curriculum: task .* has no numeric 'difficulty'"):
        build_tasksets(str(path), None, 1, eval_size=2, seed=0, curriculum=True)
