"""The calculator agent of openai_calculator.py written with smolagents (a ToolCallingAgent with a tool, as its
documentation writes it: the model must call a tool every step, `final_answer` to answer), trained unchanged by
tandem:

    python train_sync.py --agent examples/agents/smolagents_calculator.py:agent --taskset arith

smolagents is synchronous: the agent runs in a thread of the episode's own (its time limit still applies). It asks
for tool_choice "required", which tandem serves as "auto" (the policy samples as it would: counted in
rollout/agent_override/tool_choice); a reply without a tool call is a step error smolagents shows the model. Its
system prompt is about 1,000 tokens, and every step sends the whole history again, rewritten in its own format: each
call starts a new sample of the episode (common/explorer/agent.py's capture rule).
"""

import asyncio

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from examples.agents.openai_calculator import calculate as evaluate


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as (3 + 4) * 2.

    Args:
        expression: numbers and + - * / with parentheses.
    """
    return evaluate(expression)


async def agent(task: dict, base_url: str, api_key: str, max_rounds: int = 4) -> str:
    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key=api_key, client_kwargs={"max_retries": 0})
    calculator = ToolCallingAgent(tools=[calculate], model=model, max_steps=max_rounds, verbosity_level=0)
    return str(await asyncio.to_thread(calculator.run, task["prompt"]) or "")
