"""The calculator agent of openai_calculator.py written with the OpenAI Agents SDK (`openai-agents`: an Agent with a
function tool, run by the SDK's own tool loop), trained unchanged by tandem:

    python train_sync.py --agent examples/agents/agents_sdk_calculator.py:agent --taskset arith

The SDK talks to tandem's endpoint through its default model class, OpenAIResponsesModel (the Responses API), on an
AsyncOpenAI client pointed at base_url; OpenAIChatCompletionsModel (chat completions) works the same way. Tracing is
off: it would upload each run to OpenAI.
"""

from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI

from examples.agents.openai_calculator import calculate as evaluate


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as (3 + 4) * 2.

    Args:
        expression: numbers and + - * / with parentheses.
    """
    return evaluate(expression)


async def agent(task: dict, base_url: str, api_key: str, max_rounds: int = 4) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    calculator = Agent(name="calculator", instructions="Use the calculate tool for arithmetic, then give the answer.",
                       tools=[calculate], model=OpenAIResponsesModel(model="policy", openai_client=client))
    async with client:
        try:
            result = await Runner.run(calculator, task["prompt"], max_turns=max_rounds,
                                      run_config=RunConfig(tracing_disabled=True))
        except (MaxTurnsExceeded, ModelBehaviorError):
            return ""  # still calling tools after max_rounds calls, or a reply the SDK refuses: no answer
    return str(result.final_output or "")
