"""Tool calls of Qwen models, for the server and `LLM.chat`: which format a model writes (`formats`), the request's
tools and tool_choice (`choice`), an incremental parser of `<tool_call>` blocks (`parser`, rules in its docstring;
JSON bodies read as they stream by `json_call` over the strict-JSON scanner `json_scan`),
schema types of XML parameter values (`values`), and the split of an answer into reasoning, content and calls
(`output`, including calls written inside the reasoning)."""

from orinfer.tool_calls.choice import (ToolChoice, ToolSpecError, check_parser_for, check_tools, constrain_tool_choice,
                                      parse_tool_choice)
from orinfer.tool_calls.formats import detect_format, resolve_format
from orinfer.tool_calls.output import ChatDelta, ChatOutputParser, ChatResult, answer_start, parse_chat_output
from orinfer.tool_calls.parser import ToolCallParser, parse_tool_calls
from orinfer.tool_calls.types import ToolCall, ToolCallDelta

__all__ = ["answer_start", "ChatDelta", "ChatOutputParser", "ChatResult", "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolChoice",
           "ToolSpecError", "check_parser_for", "check_tools", "constrain_tool_choice", "detect_format", "parse_chat_output",
           "parse_tool_calls", "parse_tool_choice", "resolve_format"]
