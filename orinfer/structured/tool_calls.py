"""Grammars that force an answer to be tool calls in the model's own format (tool_choice "required" or a named tool).

Two formats, as Qwen's chat templates render an assistant's tool calls (so the model writes them the same way):

- "qwen-json" (Qwen2.5, Qwen3): `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, ARGS a JSON
  object matching the tool's `parameters` schema (", " and ": " separators, as the template's tojson writes them).
- "qwen-xml" (Qwen3-Coder, Qwen3.5 and later): `<tool_call>\\n<function=NAME>\\n` then for each parameter
  `<parameter=P>\\nVALUE\\n</parameter>\\n`, then `</function>\\n</tool_call>`. A string parameter's VALUE is raw text
  (anything up to the first `\\n</parameter>\\n`, as the template writes strings unquoted); any other type is JSON
  matching the parameter's schema.

Several calls are separated by "\\n" (both templates). `<tool_call>`/`</tool_call>` are matched as the single
tokens the tokenizer has for them. XML parameters come in the schema's `properties` order, required ones always,
optional ones maybe (the template writes them in the order of the arguments; a model that follows the schema's order
loses nothing, and allowing every order would make the grammar grow with the factorial of the parameter count).
"""

from __future__ import annotations

import json
from typing import Any

from orinfer.errors import RequestError
from orinfer.structured.params import StructuredOutputsParams

FORMATS = ("qwen-json", "qwen-xml")


def tool_call_constraint(fmt: str, tools: list[dict[str, Any]], name: str | None = None,
                         parallel: bool = True) -> StructuredOutputsParams:
    """A structured-output constraint under which the answer is one tool call, or several when `parallel`.

    `fmt`: "qwen-json" or "qwen-xml" (see the module docstring). `tools`: OpenAI-style tool definitions
    (`{"type": "function", "function": {"name": ..., "parameters": {JSON schema}}}`; a bare function object is
    accepted too). `name`: only this tool may be called (tool_choice naming a function); None: any of `tools`
    (tool_choice "required"). Raises RequestError naming what is wrong (unknown format, no tools, unknown name)."""
    if fmt not in FORMATS:
        raise RequestError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(FORMATS)}")
    functions = [_function(tool, i) for i, tool in enumerate(tools or [])]
    if not functions:
        raise RequestError("tools is empty: a tool call cannot be required")
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
    rules = ['start: call ("\\n" call)*' if parallel else "start: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        rules += _json_call(i, fn) if fmt == "qwen-json" else _xml_call(i, fn)
    rules.append('raw_value[lazy]: /(?s:.*)/ "\\n</parameter>\\n"')
    return StructuredOutputsParams(grammar="\n".join(rules) + "\n")


def _function(tool: Any, index: int) -> dict[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"tools[{index}] needs a function with a name")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise RequestError(f"tools[{index}].function.parameters must be a JSON schema object")
    return {"name": fn["name"], "parameters": params}


def _lit(text: str) -> str:
    """A Lark string literal of `text` (Lark literals take JSON's escapes)."""
    return json.dumps(text)


def _json_call(i: int, fn: dict[str, Any]) -> list[str]:
    head, tail = _lit('\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": '), _lit("}\n")
    return [f"call_{i}: <tool_call> {head} args_{i} {tail} </tool_call>",
            f"args_{i}: %json {json.dumps(_with_layout(fn['parameters']))}"]


def _with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with the JSON layout Qwen's templates write (tojson: ", " and ": ", no other whitespace), unless
    it sets its own."""
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**schema, "x-guidance": {**layout, **schema.get("x-guidance", {})}}


def _xml_call(i: int, fn: dict[str, Any]) -> list[str]:
    schema = fn["parameters"]
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts, rules = [], []
    for j, (pname, pschema) in enumerate(props.items()):
        value = "raw_value"
        choices = pschema.get("enum") if isinstance(pschema, dict) and _is_text(pschema) else None
        if choices and all(isinstance(c, str) for c in choices):
            value = "(" + " | ".join(_lit(c + "\n</parameter>\n") for c in choices) + ")"
        elif not _is_text(pschema):
            rules.append(f"value_{i}_{j}: %json {json.dumps(_with_layout(pschema))}")
            value = f'value_{i}_{j} "\\n</parameter>\\n"'
        part = _lit("<parameter=" + pname + ">\n") + " " + value
        parts.append(part if pname in required else f"({part})?")
    head, tail = _lit("\n<function=" + fn["name"] + ">\n"), _lit("</function>\n")
    return [f"call_{i}: <tool_call> {head} {' '.join(parts)} {tail} </tool_call>"] + rules


def _is_text(schema: Any) -> bool:
    """Whether the template writes this parameter raw (a string, or no type given) rather than as JSON."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    if kind is None:
        return not any(k in schema for k in ("enum", "const", "anyOf", "oneOf", "properties", "items"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)
