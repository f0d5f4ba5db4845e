"""Tool calling through the model's own chat template.

The declared tools go to the chat template, which tells the model how to call them; the reply is constrained by
a grammar (llguidance, as structured output is) to calls of the declared functions whose arguments fit their
JSON schemas; the calls are then parsed out of the reply. The call format is the one Qwen2.5's template (and
Hermes-style templates) teach: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. A template that
takes no tools is refused, not worked around. Speculation stays on: the grammar clips drafts as it does for
JSON schemas, so the output is still exactly the target's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mirrorsd.errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALLS = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as json.dumps writes


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def check_tools(tools) -> list[dict]:
    """OpenAI-shaped tool definitions, checked: [{"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema of an object)}}] with distinct names."""
    if not isinstance(tools, list) or not tools:
        raise ConfigError("tools must be a non-empty list of function definitions",
                          '[{"type": "function", "function": {"name": "f", "parameters": {...}}}]')
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConfigError(f"tools[{i}] is not a function definition",
                              '{"type": "function", "function": {"name": "f", "parameters": {...}}}')
        if not isinstance(fn.get("parameters", {}), dict):
            raise ConfigError(f"tools[{i}].function.parameters must be a JSON schema object", "")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ConfigError("tool names must be distinct", f"got {', '.join(names)}")
    return tools


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools and teaches the <tool_call> format."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template and OPEN in template


def tool_grammar(tools: list[dict], choice="auto", parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance) of a reply under `tool_choice`: "none" (no constraint: None), "auto" (text
    that does not start with "<", or calls), "required" (calls only), or a function's name (calls of it only)."""
    if choice == "none":
        return None
    names = [t["function"]["name"] for t in tools]
    if choice not in ("auto", "required") and choice not in names:
        raise ConfigError(f"tool_choice names {choice!r}, which is not among the tools", f"one of: {', '.join(names)}")
    chosen = [t["function"] for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for fn in chosen], "x-guidance": LAYOUT}
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    rules = [f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}", calls]
    if choice == "auto":
        return "\n".join(["start: calls | TEXT", *rules, r"TEXT: /[^<][\s\S]*/"]) + "\n"
    return "\n".join(["start: calls", *rules]) + "\n"


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The reply's text outside the calls (stripped) and the calls in order; a call that is not valid JSON of a
    name and an arguments object stays text (only a grammar-free reply can hold one)."""
    calls, kept, last = [], [], 0
    for m in CALLS.finditer(text):
        try:
            body = json.loads(m.group(1))
            call = ToolCall(body["name"], body["arguments"])
            if not isinstance(call.name, str) or not isinstance(call.arguments, dict):
                continue
        except (ValueError, KeyError, TypeError):
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped messages as chat templates take them: an assistant's tool_calls with their arguments as
    objects (OpenAI sends them as JSON strings), and a tool result's content as text."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
            m["content"] = m.get("content") or ""
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ConfigError("an assistant message's tool_calls need a function with a name",
                          '{"type": "function", "function": {"name": "f", "arguments": "{...}"}}')
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ConfigError(f"the arguments of the call to {fn['name']} are not JSON", "send a JSON object") from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
