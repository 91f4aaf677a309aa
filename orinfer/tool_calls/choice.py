"""The request side of tool calling: `check_tools` (the shape of `tools`), `parse_tool_choice` (OpenAI's `tool_choice`
as a `ToolChoice`) and `constrain_tool_choice`, the one place where sampling learns about the choice.

tool_choice, as OpenAI and vLLM take it:
- "none": the tools are not put in the prompt and the output is not parsed for calls (allowed without tools);
- "auto" (the default when tools are given): the model decides; its calls are parsed;
- "required": the model must call one of the tools; {"type": "function", "function": {"name": N}}: it must call N
  (one of the tools). Both are enforced by constrained decoding (`constrain_tool_choice`).
Anything else, and "auto"/"required"/a named function without tools, is a `ToolSpecError` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from orinfer.errors import RequestError
from orinfer.sampling_params import SamplingParams
from orinfer.structured.tool_calls import tool_call_constraint

MAX_TOOLS = 1024


class ToolSpecError(RequestError):
    """Bad `tools` or `tool_choice`; `param` names the field (e.g. "tools.2.function.name")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool_choice: `mode` "none" | "auto" | "required" | "function" (then `name` is the function)."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def parses(self) -> bool:
        """Whether tools go into the prompt and the output is parsed for calls."""
        return self.mode != "none"


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` (None or a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}) as
    given, after checking its shape; ToolSpecError naming the first bad entry."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ToolSpecError("must be a list of tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolSpecError(f"at most {MAX_TOOLS} tools are allowed", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise ToolSpecError("must be an object", where)
        if tool.get("type") != "function":
            raise ToolSpecError(f"type must be 'function', got {tool.get('type')!r}", where + ".type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolSpecError("must be an object with the function's name", where + ".function")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ToolSpecError("must be a non-empty string", where + ".function.name")
        if name in names:
            raise ToolSpecError(f"function {name!r} is given twice", where + ".function.name")
        names.add(name)
        if "description" in function and not isinstance(function["description"], (str, type(None))):
            raise ToolSpecError("must be a string", where + ".function.description")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ToolSpecError("must be a JSON Schema object", where + ".function.parameters")
    return tools


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """The ToolChoice of a request's `tool_choice` (None: "auto" with tools, else "none"), checked against `tools`
    (already through `check_tools`)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice == "none":
        return ToolChoice("none")
    if choice in ("auto", "required"):
        if not tools:
            raise ToolSpecError(f"{choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not tools:
            raise ToolSpecError("a named function needs tools", "tool_choice")
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise ToolSpecError(f"function {name!r} is not one of the tools ({', '.join(known)})", "tool_choice")
        return ToolChoice("function", name)
    raise ToolSpecError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                        "tool_choice")


def check_parser_for(choice: ToolChoice, tool_format: str | None) -> None:
    """"required" and a named function mean nothing when the answer is not parsed for calls (`tool_format` None: the
    template renders no tool calls, or the parser is off): a ToolSpecError rather than an answer without calls."""
    if choice.mode in ("required", "function") and tool_format is None:
        raise ToolSpecError(f"{choice.mode!r} needs tool-call parsing, which is off for this model (its chat template "
                            "renders no tool calls, or tool_call_parser is 'none')", "tool_choice")


def constrain_tool_choice(params: SamplingParams | None, choice: ToolChoice, tools: list[dict[str, Any]] | None,
                          tool_format: str | None, parallel: bool = True) -> SamplingParams | None:
    """The sampling params (None: the model's defaults) of a request with `choice`: the one place where the choice
    reaches sampling (the server and `LLM.chat` both call it).

    "required" and a named function constrain the answer to tool call(s) in the model's format (`tool_format`, from
    its chat template) through structured-output decoding (orinfer/structured/tool_calls.py): of any of `tools`, or
    of the named one; one call when `parallel` is False. With thinking on, the reasoning before `</think>` stays
    free. "auto" and "none" leave `params` as they are. A request that also asks for structured outputs of its own
    is a ToolSpecError: the two constraints would contradict each other."""
    if choice.mode not in ("required", "function"):
        return params
    if params is not None and params.structured_outputs is not None:
        raise ToolSpecError(f"{choice.mode!r} constrains the answer to tool calls and cannot be combined with "
                            "structured outputs (response_format, guided_*, structured_outputs)", "tool_choice")
    constraint = tool_call_constraint(tool_format, tools or [], choice.name, parallel)
    return dataclasses.replace(params or SamplingParams(), structured_outputs=constraint)
