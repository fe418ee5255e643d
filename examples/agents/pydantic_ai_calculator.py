"""The calculator agent of openai_calculator.py written with pydantic-ai (an Agent with a function tool, run by
pydantic-ai's own tool loop), trained unchanged by tandem:

    python train_sync.py --agent examples/agents/pydantic_ai_calculator.py:agent --taskset arith

The model is pydantic-ai's default for OpenAI (`Agent("openai:...")`): OpenAIResponsesModel, the Responses API,
on a provider pointed at base_url with the episode's key (OpenAIChatModel, chat completions, works the same way).
"""

from pydantic_ai import Agent, UsageLimits
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from examples.agents.openai_calculator import calculate as evaluate


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as (3 + 4) * 2.

    Args:
        expression: numbers and + - * / with parentheses.
    """
    return evaluate(expression)


async def agent(task: dict, base_url: str, api_key: str, max_rounds: int = 4) -> str:
    model = OpenAIResponsesModel("policy", provider=OpenAIProvider(base_url=base_url, api_key=api_key))
    calculator = Agent(model, instructions="Use the calculate tool for arithmetic, then give the answer.",
                       tools=[calculate], retries=0)
    try:
        result = await calculator.run(task["prompt"], usage_limits=UsageLimits(request_limit=max_rounds))
    except (UsageLimitExceeded, UnexpectedModelBehavior):
        return ""  # still calling tools after max_rounds calls, or a reply pydantic-ai refuses: no answer
    return str(result.output)
