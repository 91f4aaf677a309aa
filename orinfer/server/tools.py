"""Tool calling in a chat request: `chat_tools` checks `tools`, `tool_choice` and `parallel_tool_calls` (400s naming
the field) and says what the handler does with them (`ChatTools`); `finish_reason` names why an answer with calls
ended. The parsing itself is orinfer/tool_calls (shared with `LLM.chat`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orinfer.server.errors import APIError
from orinfer.server.protocol import ChatCompletionRequest
from orinfer.reasoning import ThinkState
from orinfer.tool_calls import (ChatOutputParser, ChatResult, ToolChoice, ToolSpecError, check_parser_for,
                                check_tools, parse_chat_output, parse_tool_choice)


@dataclass(frozen=True)
class ChatTools:
    """What a request asks of tool calling: `prompt_tools` go into the chat template (None: no tools there), the
    answer is parsed for calls when `parse`, at most `max_calls` of them are returned (None: all)."""

    prompt_tools: list[dict[str, Any]] | None
    choice: ToolChoice
    parse: bool
    max_calls: int | None = None

    def parser(self, think: ThinkState) -> ChatOutputParser:
        return ChatOutputParser(think, self.parse, self.prompt_tools, self.max_calls)

    def split(self, text: str, think: ThinkState) -> ChatResult:
        return parse_chat_output(text, think, self.parse, self.prompt_tools, self.max_calls)


NO_TOOLS = ChatTools(None, ToolChoice("none"), False)


def chat_tools(req: ChatCompletionRequest, tool_format: str | None) -> ChatTools:
    """The request's tool settings; `tool_format`: the server's parser format (None: calls are not parsed)."""
    try:
        tools = check_tools(req.tools)
        choice = parse_tool_choice(req.tool_choice, tools)
        check_parser_for(choice, tool_format)
    except ToolSpecError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    if not choice.parses:
        return ChatTools(None, choice, False)
    return ChatTools(tools, choice, tool_format is not None, 1 if req.parallel_tool_calls is False else None)


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when calls were parsed and generation stopped by itself."""
    return "tool_calls" if has_calls and reason == "stop" else reason
