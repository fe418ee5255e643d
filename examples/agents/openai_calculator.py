"""An agent on the plain `openai` client with a tool loop (a calculator), trained unchanged by tandem:

    python train_sync.py --agent examples/agents/openai_calculator.py:agent --taskset arith

tandem calls `agent(task, base_url, api_key)` once per episode; every call to the client goes to the explorer's
own engine, and the answer it returns is scored by the task's verifier. Nothing here knows about tandem.
"""

import ast
import json
import operator

from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression such as (3 + 4) * 2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+, -, *, / over numbers, nothing else (the model writes the expression)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and abs(node.value) < 1e12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * /")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


async def agent(task: dict, base_url: str, api_key: str, max_rounds: int = 4) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "Use the calculate tool for arithmetic, then give the answer."},
                {"role": "user", "content": task["prompt"]}]
    async with client:
        for _ in range(max_rounds):
            reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0]
            message = reply.message
            if not message.tool_calls:
                return message.content or ""
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                result = calculate(str(arguments.get("expression", "")))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""
