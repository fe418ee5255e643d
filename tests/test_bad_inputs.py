"""Every bad input is one line naming the field (or file:line), exit non-zero, before any worker starts.
Table-driven: each case runs train_sync.py's main() (a few of them as a new process, as a user would)."""

import dataclasses
import json
import math
import typing

import pytest

from common.cli import parse_args
from common.knobs import field_types
from conftest import TINY, run_script


def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def _jsonl(*rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


GOOD = {"prompt": "What is 2 + 2?", "answer": "4"}


def _write_vlm_folder(t) -> str:
    """A vision-language model folder without its preprocessor_config.json."""
    from transformers.utils.logging import disable_progress_bar

    from common.model import load_model, load_tokenizer

    disable_progress_bar()  # the test reads stderr: only the error line may be there
    folder = t / "vlm"
    load_model("tiny-vlm").save_pretrained(folder)
    load_tokenizer("tiny-vlm").save_pretrained(folder)
    return str(folder)

# (id, extra argv (a callable of tmp_path for files), fragments the error line must contain)
CASES = [
    ("max-grad-norm", lambda t: ["--max-grad-norm", "-1"], ["--max-grad-norm", "> 0"]),
    ("lr-nan", lambda t: ["--lr", "nan"], ["--lr", "finite"]),
    ("lr-inf", lambda t: ["--lr", "inf"], ["--lr", "finite"]),
    ("lr-negative", lambda t: ["--lr", "-1"], ["--lr", "> 0"]),
    ("temperature-nan", lambda t: ["--temperature", "nan"], ["--temperature", "finite"]),
    ("timeout-zero", lambda t: ["--timeout-s", "0"], ["--timeout-s", "> 0"]),
    ("num-threads", lambda t: ["--num-threads", "-1"], ["--num-threads", ">= 0"]),
    ("checkpoint-every", lambda t: ["--checkpoint-every", "-1"], ["--checkpoint-every", ">= 0"]),
    ("eval-every", lambda t: ["--eval-every", "-1"], ["--eval-every", ">= 0"]),
    ("difficulty", lambda t: ["--difficulty", "9"], ["--difficulty", "[1, 4]"]),
    ("keep-checkpoints", lambda t: ["--keep-checkpoints", "-2"], ["--keep-checkpoints"]),
    ("top-p-nan", lambda t: ["--top-p", "nan"], ["--top-p", "finite"]),
    ("yaml-wrong-type", lambda t: ["--config", _write(t / "c.yaml", b"lr: fast\n")], ["c.yaml", "lr", "fast"]),
    ("yaml-not-utf8", lambda t: ["--config", _write(t / "c.yaml", b"steps: 2\n# caf\xe9\n")], ["c.yaml:2", "not UTF-8"]),
    ("jsonl-not-utf8", lambda t: ["--taskset", _write(t / "d.jsonl", _jsonl(GOOD) + b'{"prompt": "caf\xe9"}\n')],
     ["d.jsonl:2", "not UTF-8"]),
    ("json-not-utf8", lambda t: ["--taskset", _write(t / "d.json", b'[{"prompt": "caf\xe9", "answer": "1"}]')],
     ["d.json:1", "not UTF-8"]),
    ("prompt-not-text", lambda t: ["--taskset", _write(t / "d.jsonl", _jsonl(GOOD, {"prompt": 5, "answer": "1"}))],
     ["d.jsonl:2", "'prompt'"]),
    ("messages-malformed", lambda t: ["--taskset", _write(t / "d.jsonl", _jsonl(GOOD, {"messages": [{"role": "user"}],
                                                                                       "answer": "1"}))],
     ["d.jsonl:2", "'messages'"]),
    ("prompt-longer-than-context", lambda t: ["--taskset", _write(t / "d.jsonl", _jsonl(
        *[GOOD] * 6, {"prompt": "x" * 1100, "answer": "1"}))], ["d.jsonl:7", "context of 1024"]),
    ("out-dir-is-a-file", lambda t: ["--out-dir", _write(t / "afile", b"x")], ["--out-dir", "is a file"]),
    ("resume-nothing", lambda t: ["--resume", "--out-dir", str(t)], ["--resume", "checkpoint"]),
    ("resume-no-out-dir", lambda t: ["--resume"], ["--resume needs --out-dir"]),
    ("image-task-text-model", lambda t: ["--taskset", "shapes"], ["shapes-eval-0", "--model tiny is text-only"]),
    ("image-does-not-decode", lambda t: ["--model", "tiny-vlm", "--taskset", _write(t / "d.jsonl", _jsonl(
        *[GOOD] * 6, {**GOOD, "reward": "vision", "image": "data:image/png;base64,iVBORw0KGgo="}))],
     ["d.jsonl:7", "does not decode"]),
    ("vlm-on-vllm", lambda t: ["--model", "tiny-vlm", "--engine", "vllm"], ["--engine vllm", "HF engine only"]),
    ("vlm-with-critic", lambda t: ["--model", "tiny-vlm", "--algo", "ppo"], ["--algo ppo", "vision-language"]),
    ("freeze-language-without-images", lambda t: ["--model", "tiny-vlm", "--freeze", "language"],
     ["--freeze language", "no task shows"]),
    ("vlm-without-processor", lambda t: ["--model", _write_vlm_folder(t)], ["no image processor"]),
]


# Run as a user would (a new process, stderr read back) for these; in this process for the rest, through the same
# train_sync.main() (each new process costs ~2 s of CPU for its imports).
AS_A_PROCESS = {"max-grad-norm", "yaml-not-utf8", "prompt-longer-than-context"}


def _error_line(argv, in_process, capsys, monkeypatch) -> str:
    if in_process:
        import train_sync

        monkeypatch.setattr("sys.argv", ["train_sync.py", *argv])
        with pytest.raises(SystemExit) as e:  # any other exception would be a traceback for the user
            train_sync.main()
        assert capsys.readouterr().err == ""
        code = e.value.code
        assert isinstance(code, str) and "\n" not in code, code
        return code
    proc = run_script("train_sync.py", *argv, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_worker(tmp_path, case, capsys, monkeypatch):
    name, argv, fragments = case
    out = tmp_path / "run"
    extra = argv(tmp_path)
    args = [*TINY, "--eval-size", "2", *([] if "--out-dir" in extra or "--resume" in extra else ["--out-dir", str(out)]),
            *extra]
    line = _error_line(args, name not in AS_A_PROCESS, capsys, monkeypatch)
    assert line.startswith("error:"), line
    for fragment in fragments:
        assert fragment in line, line
    assert not (out / "timeline").exists() and not (tmp_path / "timeline").exists()  # no worker started


def _numeric_fields(cls):
    for name, tp in field_types(cls).items():
        options = typing.get_args(tp) or (tp,)
        if any(o in (int, float) for o in options):
            yield name, tp


def _schedules():
    import train_async
    import train_offpolicy
    import train_sync

    return [train_sync.Args, train_async.Args, train_offpolicy.Args]


@pytest.mark.parametrize("cls", _schedules(), ids=["sync", "async", "offpolicy"])
def test_every_numeric_field_rejects_nan_infinity_and_negatives(cls, tmp_path):
    """Not only the fields named in the issue: every int/float field of every schedule, new ones included."""
    base = parse_args(cls, [*TINY, "--out-dir", str(tmp_path)])
    fields = list(_numeric_fields(cls))
    assert len(fields) > 30
    for name, _ in fields:
        for bad in (math.nan, math.inf, -math.inf, -1):
            args = dataclasses.replace(base, **{name: bad})
            with pytest.raises(SystemExit) as e:
                args.validate()
            assert f"--{name.replace('_', '-')}" in str(e.value.code), (name, bad, e.value.code)
