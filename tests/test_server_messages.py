"""Chat messages as the server hands them to the chat template: tool calls whose arguments arrive as a JSON string
(OpenAI clients send them so) reach the template as the object, which Qwen3.5's XML tool-call format walks."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from orinfer.server.messages import chat_input  # noqa: E402
from orinfer.server.protocol import ChatMessage  # noqa: E402


def call(arguments):
    return {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def assistant_turn(arguments) -> dict:
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[call(arguments)]),
                ChatMessage(role="tool", content="sunny", tool_call_id="c1")]
    return chat_input(messages, limit=10, multimodal=False).messages[1]


def test_json_string_arguments_reach_the_template_as_an_object():
    msg = assistant_turn('{"city": "Paris", "days": 2}')
    assert msg["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert msg["tool_calls"][0]["id"] == "c1" and msg["content"] == ""


@pytest.mark.parametrize("arguments", ['{"city": ', '["Paris"]', {"city": "Paris"}])
def test_other_arguments_pass_as_sent(arguments):
    """Not a JSON object (broken model output, a list) or already an object: unchanged."""
    assert assistant_turn(arguments)["tool_calls"][0]["function"]["arguments"] == arguments
