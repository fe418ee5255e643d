"""Calculator (`--taskset calculator`): the arithmetic word problems with two tools, a calculator and a sandboxed
Python interpreter. The model may call them any number of turns, then answers without a tool call; the task's
verifier (reward "math") scores that final answer."""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass

from common.arithmetic import ANSWER_FORMAT, arithmetic_task
from common.envs import EnvSettings
from common.envs.tools import ToolEnv, ToolError, run_sandboxed
from rewards.sandbox import Limits

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
       ast.UAdd: operator.pos}


MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # every intermediate integer; ~1200 decimal digits, microseconds to compute


def _bits(value) -> int:
    return abs(int(value)).bit_length() if isinstance(value, int) else 64


def _bounded(op, left, right):
    """Refuse an operation whose integer result could exceed MAX_RESULT_BITS *before* computing it: C-level
    big-int arithmetic holds the GIL, so no timeout could stop it once started (9**64**64**64 runs for hours)."""
    if isinstance(left, int) and isinstance(right, int):
        if op is ast.Pow and right > 0 and _bits(left) > 1 and (_bits(left) - 1) * right > MAX_RESULT_BITS:
            raise ValueError(f"result too large (more than {MAX_RESULT_BITS} bits)")
        if op is ast.Mult and _bits(left) + _bits(right) > MAX_RESULT_BITS + 1:
            raise ValueError(f"result too large (more than {MAX_RESULT_BITS} bits)")
        if op is ast.Pow and right < -MAX_RESULT_BITS:
            raise ValueError("exponent too small")
    elif op is ast.Pow and isinstance(right, (int, float)) and abs(right) > MAX_RESULT_BITS:
        raise ValueError("exponent too large")
    return OPS[op](left, right)


def evaluate_arithmetic(expression: str) -> float | int:
    """+ - * / // % ** and parentheses over numbers; anything else is a ValueError (no names, no calls). Bounded
    at the root: at most MAX_EXPRESSION_CHARS characters, no integer beyond MAX_RESULT_BITS bits, so a call costs
    microseconds whatever the model writes."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if isinstance(node.value, int) and _bits(node.value) > MAX_RESULT_BITS:
                raise ValueError(f"number too large (more than {MAX_RESULT_BITS} bits)")
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return _bounded(type(node.op), walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")
    return walk(ast.parse(expression, mode="eval"))


def calculator_task(rng: random.Random, index: int, difficulty: int, arg: str | None = None) -> dict:
    task = arithmetic_task(rng, difficulty)
    question = task["prompt"].replace(ANSWER_FORMAT, "Use a tool if it helps, then reply 'Answer: <number>'.")
    return {**task, "prompt": question, "id": f"calc-{index}", "env": "calculator"}  # reward "math": the verifier


@dataclass
class CalculatorSettings(EnvSettings):
    sandbox_timeout_s: float = 5.0
    """seconds the python tool's program may run (in rewards/sandbox.py)"""
    sandbox_memory_mb: int = 512
    """memory the python tool's program may use"""


class Calculator(ToolEnv):
    Settings = CalculatorSettings
    tools = ("calculate", "python")
    required_fields = ("prompt",)
    make_task = staticmethod(calculator_task)

    def reset(self, task: dict) -> list[dict]:
        return list(task.get("messages") or [{"role": "user", "content": task["prompt"]}])

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3 * (4 + 5)"
        """
        value = evaluate_arithmetic(expression)
        return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e300 else value)

    def python(self, code: str) -> str:
        """Run Python code in a sandbox; returns what it printed.

        Args:
            code: a program that prints the result
        """
        limit = self.settings.sandbox_timeout_s
        result = run_sandboxed(code, Limits(timeout_s=limit, memory_mb=self.settings.sandbox_memory_mb),
                               wait_s=self.settings.tool_timeout_s)
        if result.timed_out:
            raise ToolError("timeout", f"program ran past {limit:g}s")
        return (result.stdout if result.ok else f"{result.stdout}\n{result.reason}").strip()[-2000:]
