"""The command line: typed choices (listed in --help, a wrong one is a one-line error), every field's docstring in
--help, flat `args.<field>` access, and config files that hold only what differs from the defaults."""

import dataclasses
import re
import glob
import os
from typing import Literal

import pytest
import yaml

from common.cli import choices, parse_args
from common.config import CommonArgs
from tests.conftest import ROOT, run_in_process

# The text fields whose value is open (a path, a name, a list, a template): every other text field of a schedule's
# Args is a choice and must be a Literal, so a new choice field typed `str` fails here until it is one.
FREE_TEXT = {"config", "out_dir", "wandb_project", "model", "explorer_devices", "trainer_devices", "taskset",
             "eval_taskset", "env_setting", "chat_template", "task_processors", "reward_fn", "rm_model", "judge_model",
             "loss_fn", "processors", "critic_model", "run_name", "wandb_entity", "wandb_tags", "dataset_config",
             "dataset_split", "eval_dataset_split", "prompt_column", "answer_column", "answer_regex",
             "prompt_template", "lora_target_modules", "env_server", "teacher", "teacher_device", "agent",
             "agent_cmd", "judge_url", "judge_api_key_env", "judge_device"}


def _text_fields(cls) -> set[str]:
    import typing

    from common.knobs import field_types

    def text(tp):
        return tp is str or any(text(a) for a in typing.get_args(tp))  # str | None, tuple[str, ...]
    return {n for n, tp in field_types(cls).items() if typing.get_origin(tp) is not Literal and text(tp)}


@pytest.mark.parametrize("script", ["train_sync", "train_offpolicy", "train_async"])
def test_every_choice_field_is_a_literal(script):
    import importlib

    cls = importlib.import_module(script).Args
    assert _text_fields(cls) - FREE_TEXT == set(), "choice fields typed str: make them Literal (or list open text)"
    assert FREE_TEXT <= _text_fields(cls)  # no stale entry
    assert {"env_reward", "reasoning_parser", "default_reward", "algo", "sync_method"} <= set(choices(cls))


@pytest.mark.parametrize("script", ["train_sync", "train_offpolicy", "train_async"])
def test_help_lists_every_choice_and_field(script, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        parse_args(importlib.import_module(script).Args, ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    squashed = re.sub(r"[\s│]", "", out)  # a long choice list wraps onto the help box's next line
    for name, allowed in choices(CommonArgs).items():
        assert "{" + ",".join(allowed) + "}" in squashed, name
    args_cls = importlib.import_module(script).Args
    for name in (f.name for f in dataclasses.fields(args_cls)):
        assert f"--{name.replace('_', '-')}" in out, name
    assert "--lr FLOAT" in out and "AdamW learning rate." in out  # each field's docstring is its help


def test_wrong_choice_is_a_one_line_error(tmp_path):
    proc = run_in_process("train_sync.py", "--algo", "ppo2", "--out-dir", str(tmp_path / "r"))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: --algo 'ppo2': not one of grpo, grpo_turn, dr_grpo, opmd, ppo, gspo, cispo, distill"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kl_mode: sideways\n")
    proc = run_in_process("train_sync.py", "--config", str(cfg), "--out-dir", str(tmp_path / "r"))
    assert proc.stderr.strip().splitlines() == [f"error: --config {cfg}: --kl-mode 'sideways': not one of loss, reward"]


def test_parsed_args_are_flat(tmp_path):
    from train_sync import Args

    args = parse_args(Args, ["--model", "tiny", "--lr", "0.5", "--algo", "opmd", "--kl-estimator", "k1"])
    assert type(args) is Args and (args.lr, args.algo, args.kl_estimator, args.steps) == (0.5, "opmd", "k1", 40)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_config_files_hold_only_what_differs_from_the_defaults(path):
    values = yaml.safe_load(open(path)) or {}
    defaults = CommonArgs()
    same = [k for k, v in values.items() if getattr(defaults, k.replace("-", "_"), object()) == v]
    assert not same, f"{path} repeats defaults: {same}"
