"""TRL's GRPOTrainer vs tandem's synchronous schedule, one after another in one run on this machine: the same model
(embedded SmolLM2-135M-Instruct, fp32), the same arithmetic tasks and chat-templated prompts, the same math verifier
(rewards/math.py), 8 tasks x 4 samples per step, up to 48 new tokens at T = 0.5 (no top-k/top-p), lr 1e-5, no KL,
token-mean clipped surrogate with std-normalised group advantages (TRL loss_type "dapo", tandem --algo grpo), one
optimizer step of 32 samples per rollout batch (TRL: 8 per device x 4 accumulation steps; tandem: minibatch 32 in
micro-batches of 8).

TRL is an optional extra, not a tandem requirement. Install it next to tandem (trl 1.16.0 moves no pin of
requirements.txt: `pip install --dry-run` adds only trl), or into a folder of its own:

    .venv/bin/pip install -r requirements-trl.txt                      # or:
    .venv/bin/pip install --no-deps --target .trl-site trl==1.16.0     # then TRL_PATH=.trl-site

    python bench/vs_trl.py --steps 4                  # TRL, tandem --engine hf, tandem --engine auto (vLLM here)
    python bench/vs_trl.py --steps 2 --runs trl,tandem-hf

Prints per run: seconds per step (steps after the first; the first includes start-up), samples/s, mean reward per
sample, correct samples per minute (reward per wall-clock), and each tandem run's ratio to TRL. Figures are only
comparable within one invocation (same machine load); --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TASKS_PER_STEP, SAMPLES, MAX_NEW, TEMPERATURE, LR = 8, 4, 48, 0.5, 1e-5


def trl_worker(steps: int, out: str) -> None:
    """One TRL GRPOTrainer run (in its own process); writes {'step_end_times', 'rewards', 'start'} to out."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.model import resolve_model
    from common.tasks.procedural import arithmetic_split
    from rewards import score

    start = time.time()
    torch.manual_seed(0)
    path = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stream, _ = arithmetic_split(seed=0, difficulty=1, eval_size=48)
    tasks = stream.next_batch(TASKS_PER_STEP * steps)  # tandem's train_sync draws the same tasks, in this order
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t["prompt"]}], "answer": t["answer"]}
                              for t in tasks])
    rewards: list[float] = []

    def math_reward(completions, answer, **_):
        scores = [score(c[-1]["content"], {"answer": a, "reward": "math"}).score for c, a in zip(completions, answer)]
        rewards.extend(scores)
        return scores

    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "trl-run"), max_steps=steps, learning_rate=LR,
        per_device_train_batch_size=TASKS_PER_STEP, gradient_accumulation_steps=SAMPLES, num_generations=SAMPLES,
        max_completion_length=MAX_NEW, temperature=TEMPERATURE, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        loss_type="dapo", scale_rewards="group", use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, shuffle_dataset=False, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, weight_decay=0.0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[math_reward], args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    with open(out, "w") as f:
        json.dump({"start": start, "step_end_times": ends, "rewards": rewards}, f)


def run_trl(steps: int, out_dir: str, trl_path: str) -> dict:
    out = os.path.join(out_dir, "trl.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [trl_path, ROOT, os.environ.get("PYTHONPATH")] if p)}
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", out, "--steps", str(steps)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the TRL run failed (pip install -r requirements-trl.txt?):\n{proc.stderr[-3000:]}")
    r = json.load(open(out))
    ends = r["step_end_times"]
    return summarize("TRL GRPOTrainer (HF generate)", [e - s for s, e in zip([r["start"]] + ends, ends)],
                     r["rewards"], time.time() - start)


def run_tandem(steps: int, out_dir: str, engine: str) -> dict:
    from common.runtime.metrics import read_metrics

    out = os.path.join(out_dir, f"tandem-{engine}")
    flags = ["--config", os.path.join(ROOT, "configs", "sync_default.yaml"), "--steps", str(steps),
             "--engine", engine, "--eval-every", "0", "--eval-size", "8", "--checkpoint-every", "0",
             "--minibatch-size", "32", "--micro-batch-size", "8", "--top-p", "1.0",
             "--out-dir", out, "--overwrite"]
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_sync.py"), *flags], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: tandem --engine {engine} failed:\n{proc.stderr[-3000:]}")
    rows = read_metrics(out)
    elapsed = [r["time/elapsed"] for r in rows]
    first_line = proc.stdout.splitlines()[0] if proc.stdout else ""
    label = f"tandem train_sync.py --engine {engine}" + (f" ({first_line.split('engine ')[1].split(' ')[0]})"
                                                          if engine == "auto" and "engine " in first_line else "")
    rewards = [r["reward/mean"] for r in rows for _ in range(TASKS_PER_STEP * SAMPLES)]
    return summarize(label, [b - a for a, b in zip([0.0] + elapsed, elapsed)], rewards, time.time() - start)


def summarize(label: str, step_s: list[float], rewards: list[float], wall_s: float) -> dict:
    later = step_s[1:] or step_s  # the first step carries start-up (model load, vLLM start)
    s_per_step = sum(later) / len(later)
    samples_per_s = TASKS_PER_STEP * SAMPLES / s_per_step
    reward = sum(rewards) / max(len(rewards), 1)
    return {"run": label, "steps": len(step_s), "s_per_step": round(s_per_step, 1),
            "first_step_s": round(step_s[0], 1), "samples_per_s": round(samples_per_s, 3),
            "reward_per_sample": round(reward, 3), "correct_per_min": round(samples_per_s * reward * 60, 1),
            "wall_s": round(wall_s, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", default="trl,tandem-hf,tandem-auto")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "vs_trl"))
    p.add_argument("--trl-path", default=os.environ.get("TRL_PATH", ""), help="folder holding trl (pip --target)")
    p.add_argument("--json", default="")
    p.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.trl_worker:
        return trl_worker(opts.steps, opts.trl_worker)
    os.makedirs(opts.out, exist_ok=True)
    print(f"[vs_trl] {opts.steps} steps each, {TASKS_PER_STEP} tasks x {SAMPLES} samples, {MAX_NEW} new tokens, "
          f"T={TEMPERATURE}, lr {LR}; {os.cpu_count()} cores (shared: compare only within this run)", flush=True)
    results = []
    for run in opts.runs.split(","):
        r = run_trl(opts.steps, opts.out, opts.trl_path) if run == "trl" else \
            run_tandem(opts.steps, opts.out, run.split("-", 1)[1])
        results.append(r)
        print(f"[vs_trl] {json.dumps(r)}", flush=True)
    base = next((r for r in results if r["run"].startswith("TRL")), None)
    print("\n| run | s/step | samples/s | reward/sample | correct/min | vs TRL (samples/s) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        print(f"| {r['run']} | {r['s_per_step']} | {r['samples_per_s']} | {r['reward_per_sample']} | "
              f"{r['correct_per_min']} | {ratio} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
