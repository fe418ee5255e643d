"""The checks of a run that need the machine, the model or the tasks, in one place: `check_machine` runs first, in
every process before it loads anything (common/run.py launch), `check_tasks` once the tasksets are built and before
any worker starts or any model loads (common/run.py prepare_run). Each failure is one line naming the task
(file:line) or the flag; the memory check (common/memory.py) may instead choose what the user left open. Field
ranges and cross-field rules that need none of these are common/knobs.py's and common/checks.py's.
"""

from __future__ import annotations

import os

import torch

from common.envs import ENVS, env_class
from common.envs.tools import check_tools
from common.explorer.engine import vllm_available
from common.explorer.multi_turn import cannot_start
from common.explorer.workflow import WORKFLOWS, Context, workflow_class, workflow_name
from common.knobs import ConfigError
from common.memory import plan_memory, served_judge
from common.model import chat_prompt_ids, load_tokenizer, resolve_model
from common.tasks.named import env_taskset, taskset_has_envs
from common.tasks.validate import WHERE
from common.trainer.losses import ALGOS
from common.vlm import is_vlm, load_processor
from rewards.vision import load_images


def check_machine(args) -> None:
    """What the configuration asks of this machine: vLLM importable for --engine / --judge-engine vllm, every cuda
    device present."""
    # vLLM reads its log level when it is first imported, in this process and in the workers spawned from it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if args.verbose else "WARNING")
    for flag, engine in (("--engine", args.engine), ("--judge-engine", args.judge_engine)):
        ok, why = vllm_available() if engine == "vllm" else (True, "")
        if not ok:
            raise ConfigError(f"{flag} vllm: {why} (GPU: pip install -r requirements-gpu.txt; "
                              "CPU: make install-vllm)")
    check_devices(args)


def check_devices(args) -> None:
    """Every cuda device of the placement exists here (common/checks.py check_placement: what is possible at all)."""
    named = [("--explorer-devices", d) for d in args.explorer_device_list] + \
        [("--trainer-devices", d) for d in args.trainer_device_list] + [("--teacher-device", args.teacher_device)] + \
        [("--judge-device", args.judge_device)]
    for flag, d in named:
        if d.startswith("cuda"):
            if not torch.cuda.is_available():
                built = (f" (torch {torch.__version__} is built for CUDA {torch.version.cuda}: the NVIDIA driver must "
                         "support it, >= 580 for CUDA 13; nvidia-smi shows the driver's)") if torch.version.cuda else ""
                raise ConfigError(f"device {d} in {flag}: CUDA is not available here{built}")
            if (torch.device(d).index or 0) >= torch.cuda.device_count():
                raise ConfigError(f"device {d} in {flag} does not exist here ({torch.cuda.device_count()} GPU(s))")


def check_tasks(args, model_path: str, tasks: list[dict], memory: bool = True) -> None:
    """Every check below, on the training and held-out tasks together (eval.py: all but the memory a run needs)."""
    check_workflows(tasks)
    check_images(args, model_path, tasks)
    check_episode_prompts(args, tasks)
    check_prompt_lengths(args, tasks)
    check_reward_models(args, tasks)
    if memory:
        check_memory(args, tasks)


def check_reward_models(args, tasks: list[dict]) -> None:
    """Tasks scored by a reward model or a judge need one: theirs, --rm-model, --judge-model, or a --reward-fn."""
    if any(t.get("reward") == "rm" and not t.get("rm_model") for t in tasks) and not (args.rm_model or args.reward_fn):
        raise ConfigError("--taskset has tasks with reward 'rm' that name no rm_model: pass --rm-model")
    judged = next((t for t in tasks if t.get("reward") in ("judge", "judge_group")), None)
    if judged and not (args.judge_model or args.reward_fn):
        raise ConfigError(f"{judged.get(WHERE, judged.get('id'))}: reward {judged['reward']!r} needs a judge: pass "
                          f"--judge-url and --judge-model, or --judge-model PATH (served by tandem)")
    if not judged and served_judge(args) and args.judge_device != "cpu" and "judge_device" not in args.given_fields:
        print(f"[tandem] placement: {args.judge_device} is set aside for a served judge and no task has reward "
              "'judge' or 'judge_group' (--judge-model alone judges k12/vision answers in the verifier workers): "
              "--judge-device cpu gives the GPU to the workers", flush=True)


def check_workflows(tasks: list[dict]) -> None:
    """A task naming a workflow that does not exist is a one-line error naming its file:line."""
    for task in tasks:
        if workflow_name(task) not in WORKFLOWS:
            raise ConfigError(f"{task.get(WHERE, task.get('id'))}: unknown workflow {task['workflow']!r} "
                              f"(one of {', '.join(WORKFLOWS)})")


def check_images(args, model_path: str, tasks: list[dict]) -> None:
    """Image tasks need a vision-language policy, single-turn workflows and images that decode; a VLM policy runs
    on the HF engine. One line naming the task (file:line) or the flag, before any compute."""
    vision = is_vlm(args.model, model_path)
    if args.freeze != "none" and not vision:
        raise ConfigError(f"--freeze {args.freeze}: --model {args.model} has no vision tower to tell apart")
    shown = any(t.get("image") for t in tasks) and "blind" not in args.task_processors
    if args.freeze == "language" and not shown:
        raise ConfigError("--freeze language trains only the vision tower, and no task shows the policy an image")
    if vision:
        load_processor(args.model, model_path, load_tokenizer(args.model, args.chat_template))  # it has one
    if vision and args.engine == "vllm":
        raise ConfigError(f"--engine vllm: --model {args.model} is a vision-language model, which tandem serves with "
                          "the HF engine only (--engine hf or auto)")
    if vision and ALGOS[args.algo].critic:
        raise ConfigError(f"--algo {args.algo}: its critic is a text-only model; --model {args.model} is a "
                          "vision-language policy (use a critic-free algorithm such as grpo)")
    for task in tasks:
        if not task.get("image"):
            continue
        where = task.get(WHERE, f"task {task.get('id')}")
        if not vision:
            raise ConfigError(f"{where}: an image task, but --model {args.model} is text-only and would answer "
                              "without seeing it (use a vision-language model: --model tiny-vlm or a Qwen2-VL folder)")
        if not workflow_class(workflow_name(task)).images:
            raise ConfigError(f"{where}: images work in single-turn tasks only, not in workflow "
                              f"{workflow_name(task)!r}")
        try:
            load_images(task)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None


def check_episode_prompts(args, tasks: list[dict]) -> None:
    """An environment task whose first prompt (the environment's reset, tools and chat template applied) leaves
    no room for a turn in --episode-token-budget is rejected with file:line, before any compute; so is a tool
    environment with a tool whose schema cannot be built."""

    if not (taskset_has_envs(args.taskset) or any("env" in t for t in tasks)):
        return
    named = [env_taskset(part) for part in args.taskset.split("+")]
    for name in sorted({t["env"] for t in tasks if t.get("env") in ENVS} | {n[0] for n in named if n}):
        try:
            check_tools(env_class(name))
        except ValueError as e:
            raise ConfigError(f"--taskset {args.taskset}: {e}") from None
    ctx = Context.from_args(load_tokenizer(args.model, args.chat_template), args)
    try:
        ctx.renderer
    except ValueError as e:
        raise ConfigError(f"--model {args.model}" + (f" --chat-template {args.chat_template}"
                                                     if args.chat_template else "") + f": {e}") from None
    for task in [t for t in tasks if WHERE in t and "env" in t]:
        problem = cannot_start(task, ctx)
        if problem:
            raise ConfigError(f"{task[WHERE]}: the episode cannot start: {problem} (a first prompt needs fewer "
                              f"than --episode-token-budget {args.episode_token_budget} tokens minus one turn)")


def model_context(model: str) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), None where it names none."""
    if model in ("tiny", "tiny-vlm"):
        return 1024
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model("default" if model == "default-vlm" else model))
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_prompt_lengths(args, tasks: list[dict]) -> None:
    """A prompt that leaves no room for --max-new-tokens in the model's context is rejected with file:line
    (rejected, not truncated: a cut question is a different task)."""
    tasks = [t for t in tasks if WHERE in t and "env" not in t]  # from files (the built-in arith prompts are short)
    if not tasks:
        return
    context = model_context(args.model)
    if not context:
        return
    tokenizer = load_tokenizer(args.model)
    for task in tasks:
        n = len(chat_prompt_ids(tokenizer, task))
        if n + args.max_new_tokens > context:
            raise ConfigError(f"{task.get(WHERE, task['id'])}: prompt is {n} tokens; with --max-new-tokens "
                              f"{args.max_new_tokens} it does not fit the model's context of {context} tokens")


PROMPTS_MEASURED = 2000
"""check_memory measures the longest of this many prompts (the first ones), not of a whole large dataset."""


def check_memory(args, tasks: list[dict]) -> None:
    """Every trainer and explorer must fit its device's memory (common/memory.py): the run as configured, or with
    --gradient-checkpointing and a smaller micro-batch where the user left them open (one line says so), or one
    line naming the flag to change, before any model loads."""
    sequence = rollout_sequence(args, tasks)
    if args.engine == "vllm" and not args.vllm_max_model_len:  # twice the longest measured: prompts past the first
        # PROMPTS_MEASURED may be longer, and vLLM's KV cache need only hold one sequence of it, not the context
        args.vllm_max_model_len = min(2 * sequence, model_context(args.model) or 2 * sequence)
    for line in plan_memory(args, sequence, args.given_fields):
        print(line, flush=True)


def rollout_sequence(args, tasks: list[dict]) -> int:
    """Tokens of the longest sequence a rollout makes: the longest prompt (of the first PROMPTS_MEASURED) plus
    --max-new-tokens, or a whole episode (--episode-token-budget) where tasks name an environment."""
    single = [t for t in tasks if "env" not in t][:PROMPTS_MEASURED]
    tokenizer = load_tokenizer(args.model, args.chat_template) if single else None
    sequence = max([len(chat_prompt_ids(tokenizer, t)) for t in single] or [0]) + args.max_new_tokens
    if taskset_has_envs(args.taskset) or any("env" in t for t in tasks) or args.agent or args.agent_cmd:
        sequence = max(sequence, args.episode_token_budget)  # an episode's sample may be this long
    return sequence
