"""Which tool-call format a model writes, judged from its chat template (how the template renders an assistant's
`tool_calls`), never from the model's name; `EngineArgs.tool_call_parser` overrides it.

- `qwen-json` (Qwen2.5, Qwen3, Qwen3-2507): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `qwen-xml` (Qwen3-Coder, the Qwen3.5 family): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`.
"""

from __future__ import annotations

from orinfer.args import TOOL_CALL_PARSERS
from orinfer.errors import ConfigError


def detect_format(template: str | None) -> str | None:
    """The format a chat template teaches and renders, or None when it renders no tool calls."""
    if not template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return "qwen-xml"
    if "<tool_call>" in template:
        return "qwen-json"
    return None


def resolve_format(setting: str, template: str | None) -> str | None:
    """The format to parse: `setting` ("auto": the template's, see `detect_format`; "none": no parsing)."""
    if setting not in TOOL_CALL_PARSERS:
        raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {setting!r}")
    if setting == "none":
        return None
    if setting == "auto":
        return detect_format(template)
    return setting
