"""The calculator agent of openai_calculator.py as a program of its own, trained by tandem with `--agent-cmd`:

    python train_sync.py --agent-cmd "python examples/agents/cmd_calculator.py" --taskset arith

tandem starts it once per episode with OPENAI_BASE_URL and OPENAI_API_KEY set to the episode's endpoint and key, and
the task as JSON on stdin; the last line it prints is its result, here {"answer": ...} for the task's verifier.
"""

import asyncio
import json
import os
import sys

from openai_calculator import agent  # this file's folder is the script's first import path

if __name__ == "__main__":
    task = json.load(sys.stdin)
    answer = asyncio.run(agent(task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
    print(json.dumps({"answer": answer}))
