"""Earlier tool calls as chat templates take them (the server and `LLM.chat` both pass assistant turns through here).

OpenAI clients send an assistant turn's `function.arguments` as a JSON string, and templates that walk the arguments
(the Qwen3.5 XML format iterates `arguments | items`) need the object: a string holding a JSON object is parsed (as
vLLM does); anything else is passed on as sent. The JSON template writes a string as it is and an object with
`tojson`, so both render the same call.
"""

from __future__ import annotations

import json
from typing import Any


def with_parsed_arguments(call: Any) -> Any:
    """One assistant tool call with its arguments as an object when they are a JSON object in a string."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every assistant turn's tool calls through `with_parsed_arguments` (others unchanged)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [with_parsed_arguments(c) for c in calls]}
        out.append(m)
    return out
