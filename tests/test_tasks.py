"""Tasksets: the procedural arithmetic split is seeded and disjoint; file loaders fail in one line on bad rows."""

import json

import pytest

from common.tasks import arithmetic_split, build_tasksets, load_tasks


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
