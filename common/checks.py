"""Cross-field rules of the configuration: `validate(args)`, run by `CommonArgs.validate` once the command line is
parsed, before any process starts; each impossible combination is a one-line error naming the field (and the fix).

A single field's range is its config class's `RANGES` (common/knobs.py checks them, first thing here); what needs
the machine, the model or the tasks is common/preflight.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil

from common.envs import parse_env_settings
from common.knobs import ConfigError, check_numeric_ranges
from common.lora import apply_defaults as apply_lora_defaults
from common.runtime.plugins import load_object
from common.tasks.named import taskset_has_envs
from common.tasks.processors import TASK_PROCESSORS
from common.trainer.losses import ALGOS, config_kwargs

# --episode-token-budget of agent runs (--agent, --agent-cmd) left unset: the frameworks' system prompts are long (on
# the default model's tokenizer, with one tool: smolagents' ToolCallingAgent 993 tokens, its CodeAgent 2,347), and
# each call of an episode sends the whole history again.
AGENT_TOKEN_BUDGET = 4096


def validate(args) -> None:
    """Impossible combinations, each a one-line error naming the field (and the fix); coupled fields with one
    obvious value are filled in first (resolve_coupled)."""
    resolve_coupled(args)
    check_numeric_ranges(args)  # every numeric field: finite and in range (common/knobs.py)
    if args.samples_per_task < 2 and not ALGOS[args.algo].critic:
        raise ConfigError("--samples-per-task must be >= 2: group-normalised advantages need a group")
    for name in ("rm_model", "judge_model", "teacher"):
        path = getattr(args, name)
        if path and path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError(f"--{name.replace('_', '-')} {path}: no such folder")
    _validate_judge(args)
    _validate_algo_extras(args)
    if args.micro_batch_size > args.minibatch_size:
        raise ConfigError(f"--micro-batch-size ({args.micro_batch_size}) > --minibatch-size ({args.minibatch_size}): "
                          f"pass --micro-batch-size {args.minibatch_size} or less")
    if args.minibatch_size > args.rollout_batch_size:
        raise ConfigError(f"--minibatch-size ({args.minibatch_size}) > rollout batch "
                          f"(--tasks-per-step x --samples-per-task = {args.rollout_batch_size}): pass "
                          f"--minibatch-size {args.rollout_batch_size} or less, or leave it out (= the rollout batch)")
    _validate_partial_rollouts_and_sampling(args)
    _validate_plugins(args)
    _validate_datasets(args)
    _validate_memory(args)
    _validate_workflows(args)
    check_placement(args.explorer_device_list, args.trainer_device_list)


def _validate_judge(args) -> None:
    """--judge-url names a server and --judge-model its model; --judge-device places a judge tandem serves."""
    if args.judge_url and not args.judge_model:
        raise ConfigError("--judge-url needs --judge-model (the model name that server judges with)")
    if args.judge_url and not re.match(r"^https?://[^/\s]+", args.judge_url):
        raise ConfigError(f"--judge-url {args.judge_url!r} is not an http(s) URL")
    if args.judge_device != "cpu" and (args.judge_url or not args.judge_model):
        raise ConfigError("--judge-device places the judge tandem serves: it needs --judge-model and no --judge-url")
    if args.judge_engine != "auto" and (args.judge_url or not args.judge_model):
        raise ConfigError(f"--judge-engine {args.judge_engine} runs the judge tandem serves: it needs --judge-model "
                          "and no --judge-url")
    if args.judge_device == "cuda" or not is_device(args.judge_device):
        raise ConfigError(f"--judge-device {args.judge_device!r} is neither cpu nor cuda:N")


def resolve_coupled(args) -> None:
    """Fields whose value follows from others when not given: the minibatch is the rollout batch, a micro-batch
    is 8 sequences or the whole minibatch if that is smaller, an episode's token budget 1024 (AGENT_TOKEN_BUDGET
    for an agent), LoRA's learning rate is scaled (common/lora.py)."""
    if args.minibatch_size is None:
        args.minibatch_size = args.rollout_batch_size
    if args.micro_batch_size is None:
        args.micro_batch_size = min(8, args.minibatch_size)
    if args.clip_eps_low is None:
        args.clip_eps_low = args.clip_eps
    if args.clip_eps_high is None:
        args.clip_eps_high = args.clip_eps
    if args.episode_token_budget is None:
        args.episode_token_budget = AGENT_TOKEN_BUDGET if args.agent or args.agent_cmd else 1024
    apply_lora_defaults(args)


def _validate_datasets(args) -> None:
    if args.answer_regex is not None:
        try:
            if re.compile(args.answer_regex).groups < 1:
                raise ConfigError(f"--answer-regex {args.answer_regex!r} needs a group: (...) marks the answer")
        except re.error as e:
            raise ConfigError(f"--answer-regex {args.answer_regex!r}: not a valid regular expression ({e})") from None
    if "{prompt}" not in args.prompt_template:
        raise ConfigError(f"--prompt-template {args.prompt_template!r} must contain {{prompt}}")


def _validate_partial_rollouts_and_sampling(args) -> None:
    if not 0 <= args.rollout_token_budget < args.max_new_tokens:
        raise ConfigError(f"--rollout-token-budget must be 0 (off) or in 1..--max-new-tokens - 1 "
                          f"(got {args.rollout_token_budget} with --max-new-tokens {args.max_new_tokens})")
    if args.task_sampling == "prioritized" and args.taskset in ("arith", "parity", "shapes"):
        raise ConfigError("--task-sampling prioritized needs a finite --taskset (.jsonl or dataset): "
                          f"{args.taskset} never repeats a task")
    if args.curriculum and args.taskset in ("arith", "parity", "shapes") and args.difficulty < 2:
        raise ConfigError(f"--curriculum with --taskset {args.taskset} needs --difficulty >= 2 "
                          "(levels 1..difficulty)")


def _validate_plugins(args) -> None:
    """--loss-fn, --reward-fn, --agent, --processors: import them now, so a bad reference is a one-line error
    before any process starts (each worker imports them again itself)."""
    for flag, specs in (("--loss-fn", [args.loss_fn]), ("--reward-fn", [args.reward_fn]),
                        ("--agent", [args.agent]), ("--processors", list(args.processors))):
        for spec in specs:
            if spec:
                fn = load_object(spec, flag)
                if flag == "--loss-fn":
                    try:
                        config_kwargs(fn, args, skip=1)
                    except ValueError as e:
                        raise ConfigError(f"--loss-fn {spec}: {e}") from None


def _validate_workflows(args) -> None:
    """Multi-turn workflows, environments and task processors."""
    if args.episode_token_budget <= args.max_new_tokens:
        raise ConfigError(f"--episode-token-budget ({args.episode_token_budget}) must exceed --max-new-tokens "
                          f"({args.max_new_tokens}): a whole episode must hold more than one turn")
    try:
        parse_env_settings(args.env_setting)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.chat_template is not None:
        check_chat_template(args.chat_template)
    for name in filter(None, (n.strip() for n in args.task_processors.split(","))):
        if name not in TASK_PROCESSORS:
            raise ConfigError(f"--task-processors: unknown processor {name!r} (one of {', '.join(TASK_PROCESSORS)})")
    if args.rollout_token_budget and taskset_has_envs(args.taskset):
        raise ConfigError(f"--rollout-token-budget (partial rollouts) works with single-turn tasks only, and "
                          f"--taskset {args.taskset} has multi-turn (env) tasks")
    if args.agent and args.agent_cmd:
        raise ConfigError("--agent and --agent-cmd: give one (a function, or a program)")
    if args.agent_cmd:
        try:
            program = shlex.split(args.agent_cmd)[:1]
        except ValueError as e:
            raise ConfigError(f"--agent-cmd {args.agent_cmd!r}: {e}") from None
        if not program or shutil.which(program[0]) is None:
            raise ConfigError(f"--agent-cmd {args.agent_cmd!r}: no such program {program[0] if program else ''!r}")
    if (args.agent or args.agent_cmd) and args.rollout_token_budget:
        raise ConfigError(f"{'--agent' if args.agent else '--agent-cmd'} with --rollout-token-budget: partial "
                          "rollouts are single-turn only, and an agent's calls are answered whole")


def _validate_memory(args) -> None:
    """Sharding, packing and LoRA fields (one-line errors naming the field)."""
    if args.fsdp_cpu_offload and args.trainer_shard != "fsdp":
        raise ConfigError("--fsdp-cpu-offload needs --trainer-shard fsdp")
    if args.fsdp_cpu_offload and not all(d.startswith("cuda") for d in args.trainer_device_list):
        raise ConfigError("--fsdp-cpu-offload needs cuda --trainer-devices (CPU trainers hold everything in "
                          "CPU memory already)")
    if args.lora_rank and not [m for m in args.lora_target_modules.split(",") if m.strip()]:
        raise ConfigError("--lora-target-modules must name at least one module")
    if args.lora_rank and args.trainer_shard == "fsdp" and args.lora_sync == "merged":
        raise ConfigError("--lora-sync merged with --trainer-shard fsdp is not supported (sharded trainers send "
                          "the adapters: --lora-sync auto)")
    if args.lora_rank and args.ref_reset_every:
        raise ConfigError("--ref-reset-every with --lora-rank is not supported (the reference is the base model)")


def _validate_algo_extras(args) -> None:
    """--- ALGO LOGIC: PPO / critic, reference model, experience filters (one-line errors naming the field)."""
    if not ALGOS[args.algo].critic:
        if args.critic_model is not None:
            raise ConfigError(f"--critic-model: --algo {args.algo} has no critic")
        if args.critic_warmup_steps:
            raise ConfigError(f"--critic-warmup-steps: --algo {args.algo} has no critic")
    if args.kl_mode == "reward" and args.kl_coef <= 0:
        raise ConfigError("--kl-mode reward needs --kl-coef > 0 (there is no KL to subtract otherwise)")
    if args.ref_reset_every and args.kl_coef <= 0:
        raise ConfigError("--ref-reset-every needs --kl-coef > 0 (there is no reference model otherwise)")
    _validate_this_years_algos(args)


def _validate_this_years_algos(args) -> None:
    """DAPO's refill and overlong shaping, on-policy distillation's teacher."""
    if args.overlong_buffer >= args.max_new_tokens:
        raise ConfigError(f"--overlong-buffer ({args.overlong_buffer}) must be below --max-new-tokens "
                          f"({args.max_new_tokens}): the punishment ramps over the last tokens before it")
    if args.overlong_buffer and taskset_has_envs(args.taskset):
        raise ConfigError(f"--overlong-buffer works with single-turn tasks only (--max-new-tokens bounds each "
                          f"turn of an episode), and --taskset {args.taskset} has multi-turn (env) tasks")
    if args.refill_rounds and (not args.drop_zero_signal_groups or not ALGOS[args.algo].group_signal):
        raise ConfigError("--refill-rounds replaces zero-signal groups: it needs --drop-zero-signal-groups and "
                          f"an algorithm whose signal is the group's rewards (not --algo {args.algo})")
    if args.refill_rounds and args.rollout_token_budget:
        raise ConfigError("--refill-rounds with --rollout-token-budget (partial rollouts) is not supported")
    if ALGOS[args.algo].teacher != bool(args.teacher):
        raise ConfigError("--teacher MODEL is needed by --algo distill, and only by it" if args.teacher else
                          "--algo distill needs --teacher MODEL (the model whose log-probs the student learns)")
    if args.teacher_device:
        d = args.teacher_device
        if not args.teacher:
            raise ConfigError("--teacher-device places --teacher: it needs --algo distill --teacher MODEL")
        if d == "cuda" or not is_device(d):
            raise ConfigError(f"--teacher-device {d!r} is neither cpu nor cuda:N")
        if len(args.trainer_device_list) > 1:
            raise ConfigError(f"--teacher-device with {len(args.trainer_device_list)} trainers: each would load its "
                              "own teacher onto it; leave it empty (each trainer's own device) or train with one")
    if args.teacher:
        from common.model import load_tokenizer

        if load_tokenizer(args.teacher).get_vocab() != load_tokenizer(args.model).get_vocab():
            raise ConfigError(f"--teacher {args.teacher}: its tokenizer differs from --model {args.model}'s "
                              "(on-policy distillation compares log-probs token by token)")


def check_chat_template(path: str) -> None:
    """--chat-template FILE must be a readable Jinja template: a one-line error naming file:line otherwise."""
    import jinja2

    try:
        text = open(path).read()
    except OSError as e:
        raise ConfigError(f"--chat-template {path}: {e.strerror}") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template {path}:{e.lineno}: {e.message}") from None


def is_device(d: str) -> bool:
    """cpu, cuda (each rank's own GPU) or cuda:N."""
    return d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())


def check_placement(explorers: list[str], trainers: list[str]) -> None:
    """Impossible device placements, before any process starts (whether the GPUs exist here is
    common/preflight.py's check_devices). Explorer and trainer may share a GPU (colocated: their weight sync then
    goes through the CPU over gloo, as NCCL cannot connect two ranks on one GPU)."""
    if not explorers or not trainers:
        raise ConfigError("--explorer-devices and --trainer-devices each need at least one device")
    for d in explorers + trainers:
        if not is_device(d):
            raise ConfigError(f"device {d!r} in --explorer-devices/--trainer-devices is neither cpu nor cuda[:N]")
    kinds = {d.split(":")[0] for d in trainers}
    if len(kinds) > 1:
        raise ConfigError(f"--trainer-devices {','.join(trainers)}: data-parallel trainers must be all cpu or all cuda")
    if "cuda" in kinds:
        seen = [d for d in trainers if d != "cuda"]  # bare cuda: each rank's own GPU (LOCAL_RANK)
        twice = next((d for d in seen if seen.count(d) > 1), None)
        if twice:
            raise ConfigError(f"--trainer-devices lists {twice} twice: each data-parallel trainer needs its own GPU")
