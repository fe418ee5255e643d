"""Calculator (`--taskset calculator`): the arithmetic word problems with two tools, a calculator and a sandboxed
Python interpreter. The model may call them any number of turns, then answers without a tool call; the task's
verifier (reward "math") scores that final answer."""

from __future__ import annotations

import ast
import operator
import random

from common.envs.tools import ToolEnv

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
       ast.UAdd: operator.pos}


def evaluate_arithmetic(expression: str) -> float | int:
    """+ - * / // % ** and parentheses over numbers; anything else is a ValueError (no names, no calls)."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")
    return walk(ast.parse(expression, mode="eval"))


def calculator_task(rng: random.Random, index: int, difficulty: int) -> dict:
    from common.tasks.procedural import ANSWER_FORMAT, arithmetic_task

    task = arithmetic_task(rng, difficulty)
    question = task["prompt"].replace(ANSWER_FORMAT, "Use a tool if it helps, then reply 'Answer: <number>'.")
    return {**task, "prompt": question, "id": f"calc-{index}", "env": "calculator"}  # reward "math": the verifier


class Calculator(ToolEnv):
    tools = ("calculate", "python")
    required_fields = ("prompt",)
    sandbox_timeout_s = 5.0

    def reset(self, task: dict) -> list[dict]:
        return list(task.get("messages") or [{"role": "user", "content": task["prompt"]}])

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3 * (4 + 5)"
        """
        value = evaluate_arithmetic(expression)
        return str(int(value) if isinstance(value, float) and value.is_integer() else value)

    def python(self, code: str) -> str:
        """Run Python code in a sandbox; returns what it printed.

        Args:
            code: a program that prints the result
        """
        from rewards.sandbox import Limits, run

        result = run(code, limits=Limits(timeout_s=self.sandbox_timeout_s, memory_mb=512))
        if result.timed_out:
            from common.envs.tools import ToolError

            raise ToolError("timeout", f"program ran past {self.sandbox_timeout_s:g}s")
        return (result.stdout if result.ok else f"{result.stdout}\n{result.reason}").strip()[-2000:]
