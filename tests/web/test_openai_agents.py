"""An agent loop with the `openai-agents` SDK against a real server: the model is made to call a
python tool (tool_choice="required": the grammar forces a valid call), the SDK runs the tool and
sends its result back, tool_choice is reset (the SDK's `reset_tool_choice`), and the model then
answers in text. Both `Runner.run` and `Runner.run_streamed`.

SmolLM2-135M does not close a free string soon by itself, so the tool's argument is bounded
(max_length=12, which the grammar honours) and max_tokens leaves room for the whole forced call
(about 39 tokens with the call's markup): a call cut by max_tokens comes back as finish_reason
"length" with no tool_calls, which the SDK rightly raises as a ModelBehaviorError."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import agents  # openai-agents (a dev dependency)
import httpx2
import openai
import pytest
from pydantic import Field

MARKER = "WEATHER-7f3a: sunny, 21 C"
PROMPT = "What is the weather in Paris? Use the get_weather tool."


@pytest.fixture(scope="module", autouse=True)
def _no_tracing():
    agents.set_tracing_disabled(True)


class Recorder:
    """Records every python call of the tool and every chat-completions request body the SDK sends."""

    def __init__(self):
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.client: openai.AsyncOpenAI | None = None

    async def on_request(self, request):
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.read()))

    def agent(self, url: str):
        @agents.function_tool
        def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
            """Current weather for a city."""
            self.calls.append(city)
            return MARKER

        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120,
                                         http_client=httpx2.AsyncClient(
                                             event_hooks={"request": [self.on_request]}))
        model = agents.OpenAIChatCompletionsModel(model="smol", openai_client=self.client)
        return agents.Agent(name="weather", instructions="You answer questions about the weather.",
                            model=model, tools=[get_weather],
                            model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                max_tokens=48))


def check_loop(rec: Recorder, result) -> None:
    # the tool ran, once, with the string the model produced
    assert len(rec.calls) == 1 and isinstance(rec.calls[0], str), rec.calls
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item", kinds
    call, output = result.new_items[0], result.new_items[1]
    assert call.raw_item.name == "get_weather"
    assert json.loads(call.raw_item.arguments) == {"city": rec.calls[0]}
    assert output.output == MARKER and output.raw_item["call_id"] == call.raw_item.call_id
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # greedy under the server's exact numerics, SmolLM2 answers by quoting the tool result: it saw it
    assert MARKER in result.final_output, result.final_output
    assert len(result.raw_responses) == 2
    # two requests: the first forces a call; the second carries the call and its result back, and is
    # no longer forced (reset_tool_choice), so the model answers in text
    assert len(rec.bodies) == 2, [b.get("tool_choice") for b in rec.bodies]
    first, second = rec.bodies
    assert first["model"] == "smol" and first["tool_choice"] == "required"
    assert [t["function"]["name"] for t in first["tools"]] == ["get_weather"]
    assert "tool_choice" not in second  # reset after the call: the model may answer
    assistant, tool = second["messages"][-2:]
    assert assistant["role"] == "assistant"
    assert assistant["tool_calls"][0]["id"] == call.raw_item.call_id
    assert assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool == {"role": "tool", "tool_call_id": call.raw_item.call_id, "content": MARKER}


def run(rec: Recorder, url: str):
    """Runner.run of the recorder's agent against `url`: the result."""
    async def go():
        try:
            return await agents.Runner.run(rec.agent(url), PROMPT, max_turns=3)
        finally:
            await rec.client.close()

    return asyncio.run(go())


def run_streamed(rec: Recorder, url: str):
    """Runner.run_streamed of the recorder's agent against `url`: (result, its stream events)."""
    async def go():
        try:
            result = agents.Runner.run_streamed(rec.agent(url), PROMPT, max_turns=3)
            events = [e async for e in result.stream_events()]
            return result, events
        finally:
            await rec.client.close()

    return asyncio.run(go())


def test_runner_run_calls_the_tool_then_answers(smol_server):
    rec = Recorder()
    check_loop(rec, run(rec, smol_server.url))


def test_runner_run_streamed_calls_the_tool_then_answers(smol_server):
    rec = Recorder()
    result, events = run_streamed(rec, smol_server.url)
    check_loop(rec, result)
    assert all(b.get("stream") is True for b in rec.bodies)
    names = [e.name for e in events if e.type == "run_item_stream_event"]
    assert names[:2] == ["tool_called", "tool_output"] and "message_output_created" in names, names
    deltas = [e.data.delta for e in events if e.type == "raw_response_event"
              and e.data.type == "response.output_text.delta"]
    assert "".join(deltas) == result.final_output


# ---- the SDK's default model class: the Responses API ---------------------------------------------
class ResponsesRecorder(Recorder):
    async def on_request(self, request):
        if request.url.path.endswith("/responses"):
            self.bodies.append(json.loads(request.read()))

    def agent(self, url: str):
        agent = super().agent(url)
        return agent.clone(model=agents.OpenAIResponsesModel(model="smol", openai_client=self.client))


def check_responses_loop(rec: ResponsesRecorder, result) -> None:
    assert len(rec.calls) == 1 and isinstance(rec.calls[0], str), rec.calls
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": rec.calls[0]}
    assert MARKER in result.final_output, result.final_output
    assert len(rec.bodies) == 2
    first, second = rec.bodies
    assert first["tool_choice"] == "required" and [t["name"] for t in first["tools"]] == ["get_weather"]
    # the second request carries the call and its output back as input items
    items = second["input"]
    assert [i.get("type") for i in items[-2:]] == ["function_call", "function_call_output"]
    assert items[-1] == {"call_id": call.call_id, "output": MARKER, "type": "function_call_output"}


def test_responses_model_runs_the_tool_loop(smol_server):
    rec = ResponsesRecorder()
    check_responses_loop(rec, run(rec, smol_server.url))


def test_responses_model_streamed_runs_the_tool_loop(smol_server):
    rec = ResponsesRecorder()
    result, events = run_streamed(rec, smol_server.url)
    check_responses_loop(rec, result)
    deltas = [e.data.delta for e in events if e.type == "raw_response_event"
              and e.data.type == "response.output_text.delta"]
    assert "".join(deltas) == result.final_output
