"""The `--plan` tables: where a self-placed run puts its workers and what each GPU is planned to hold, for public model
shapes on nodes this machine need not be (config-only folders: no weights, no hub):

    python bench/plan.py                                   # Qwen2.5-1.5B and -7B, 1/2/4/8 GPUs and 2 x 8, 80 GiB
    python bench/plan.py --models Llama-3.1-8B --gpu-memory-gb 40 --script train_sync.py

Each row is `python SCRIPT --plan --model FOLDER --gpus N --gpu-memory-gb G --nnodes M` with FLAGS below (the USAGE
GPU quick start's batch), read from the same functions (common/placement.py plan_report): trainers and
explorers (placement), the largest planned peak of a trainer GPU and of an explorer GPU, and the host memory per node
the weight sync takes (each vLLM explorer's model copy in /dev/shm, a sharded trainer's in-flight snapshot).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.memory import MODELS  # noqa: E402

FLAGS = ["--dtype", "bfloat16", "--engine", "vllm", "--max-new-tokens", "512", "--tasks-per-step", "32",
         "--samples-per-task", "8", "--minibatch-size", "64", "--micro-batch-size", "8"]
NODES = [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2)]  # (GPUs per node, nodes)


def model_folder(name: str, root: str) -> str:
    """A folder with `name`'s config (bench/memory.py MODELS) and the tiny tokenizer: what --plan reads."""
    import transformers

    from common.model import build_tiny_tokenizer

    cls, fields = MODELS[name]
    folder = os.path.join(root, name)
    getattr(transformers, cls)(**fields).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def plan_row(script: str, folder: str, gpus: int, nnodes: int, gpu_gib: float) -> list[str]:
    """[GPUs, placement, trainer GPU peak, explorer GPU peak, host per node] or the plan's one-line refusal."""
    from common.cli import parse_args
    from common.knobs import ConfigError
    from common.memory import GIB
    from common.placement import plan_report

    where = f"{gpus}" if nnodes == 1 else f"{nnodes} x {gpus}"
    Args = importlib.import_module(script.removesuffix(".py")).Args
    try:
        args = parse_args(Args, ["--plan", "--model", folder, *FLAGS, "--gpus", str(gpus), "--gpu-memory-gb",
                                 str(gpu_gib), "--nnodes", str(nnodes)])
        r = plan_report(args)
    except (ConfigError, SystemExit) as e:
        why = str(e.code if isinstance(e, SystemExit) else e).removeprefix("error: ")
        return [where, f"does not fit: {why.replace(folder, os.path.basename(folder))}", "", "", ""]

    def most(prefix: str, host: bool = False) -> str:
        peaks = [sum(b for _, b, _ in ws) for k, ws in r["devices"].items()
                 if k.startswith("cpu") == host and any(w[0].startswith(prefix) for w in ws)]
        return f"{max(peaks) / GIB:.1f}" if peaks else "-"

    trainers, explorers = len(args.trainer_device_list), len(args.explorer_device_list)
    shard = ", FSDP2" if args.trainer_shard == "fsdp" else ""
    colocated = " (sharing cuda:0)" if args.explorer_device_list[0] == args.trainer_device_list[0] != "cuda" else ""
    return [where, f"{trainers} trainer(s){shard}, {explorers} explorer(s){colocated}", most("trainer"),
            most("explorer"), most("weight sync", host=True)]


def table(script: str, name: str, folder: str, gpu_gib: float) -> str:
    rows = [plan_row(script, folder, gpus, nnodes, gpu_gib) for gpus, nnodes in NODES]
    head = ["GPUs", "placement", "trainer GPU GiB", "explorer GPU GiB", "host GiB / node"]
    lines = [f"{name}, {script}, {gpu_gib:g} GiB GPUs:", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="Qwen2.5-1.5B,Qwen2.5-7B", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--script", default="train_async.py")
    parser.add_argument("--gpu-memory-gb", type=float, default=80)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name in opts.models.split(","):
            print(table(opts.script, name, model_folder(name, root), opts.gpu_memory_gb) + "\n", flush=True)
    print(f"Flags of every row: {' '.join(FLAGS)} (python {opts.script} --plan --model FOLDER --gpus N "
          f"--gpu-memory-gb {opts.gpu_memory_gb:g} [--nnodes 2])")


if __name__ == "__main__":
    main()
