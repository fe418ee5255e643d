"""The calculator agent of openai_calculator.py written with LangGraph and langchain-openai (a graph of a model node
and a ToolNode: the model calls tools until it answers), trained unchanged by tandem:

    python train_sync.py --agent examples/agents/langgraph_calculator.py:agent --taskset arith

ChatOpenAI is pointed at base_url with the episode's key, on an httpx client of the episode's own: langchain-openai's
default client is shared by the whole process and bound to the event loop that first used it, and tandem runs each
episode in an event loop of its own. LangSmith tracing stays off (its default).
"""

import httpx
from langchain_core.messages import SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from examples.agents.openai_calculator import calculate as evaluate


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as (3 + 4) * 2."""
    return evaluate(expression)


async def agent(task: dict, base_url: str, api_key: str, max_rounds: int = 4) -> str:
    system = SystemMessage("Use the calculate tool for arithmetic, then give the answer.")
    async with httpx.AsyncClient() as http:
        llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0,
                         http_async_client=http).bind_tools([calculate])

        async def model(state: MessagesState) -> dict:
            return {"messages": [await llm.ainvoke([system, *state["messages"]])]}

        graph = StateGraph(MessagesState)
        graph.add_node("model", model)
        graph.add_node("tools", ToolNode([calculate]))
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition)  # tool calls -> "tools", an answer -> the end
        graph.add_edge("tools", "model")
        try:  # each round is two steps (model, tools), the answer one more
            state = await graph.compile().ainvoke({"messages": [("user", task["prompt"])]},
                                                  {"recursion_limit": 2 * max_rounds})
        except GraphRecursionError:
            return ""  # still calling tools after max_rounds calls: no answer
    return str(state["messages"][-1].content)
