"""The OpenAI Agents SDK (`openai-agents`, its default Responses model) runs a one-tool agent against
Duet on SmolLM2 to completion: the model calls the tool through /v1/responses, the SDK runs it and
sends its output back as a function_call_output item, and the agent ends with a final answer."""

from __future__ import annotations

import pytest

MODEL = "smollm2-135m-instruct"


async def test_a_one_tool_agent_runs_to_completion(real_stack):
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    client = openai.AsyncOpenAI(base_url=real_stack.url("prefix") + "/v1", api_key="k", max_retries=0,
                                timeout=300)
    agent = Agent(name="weather", instructions="Answer questions about the weather using the tool.",
                  tools=[get_weather], model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = await Runner.run(agent, "What is the weather like in Paris?", max_turns=4)
    await client.close()
    assert calls, "the agent called its tool"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


pytestmark = pytest.mark.timeout(900)
