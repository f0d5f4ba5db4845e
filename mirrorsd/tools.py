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


def marker(tokenizer, text: str) -> str:
    """A call marker as a Lark term: the token itself (`<[id]>`) where the tokenizer has the marker as one added
    token (Qwen2.5's <tool_call> is token 151657, which llguidance matches only by id: as text the grammar would
    refuse the very token the model is trained to emit), else the quoted text."""
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] in tokenizer.added_tokens_decoder:
            return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_grammar(tools: list[dict], choice="auto", parallel: bool = True, tokenizer=None) -> str | None:
    """The Lark grammar (llguidance) of a reply under `tool_choice`: "none" (no constraint: None), "auto" (text
    that starts with neither "<" nor "{", or calls, or one bare call: a reply that is just the call's JSON
    object, as small Qwen2.5 models write it without the markers, and as llama.cpp's Hermes parser takes it),
    "required" (calls only), or a function's name (calls of it only).
    tokenizer: the target's, so markers that are tokens of their own are matched as those tokens."""
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
    rules = [f'call: {marker(tokenizer, OPEN)} "\\n" %json {json.dumps(schema)} "\\n" {marker(tokenizer, CLOSE)}',
             calls]
    if choice == "auto":
        return "\n".join(["start: calls | bare | TEXT", *rules, f"bare: %json {json.dumps(schema)}",
                          r"TEXT: /[^<{][\s\S]*/"]) + "\n"
    return "\n".join(["start: calls", *rules]) + "\n"


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The reply's text outside the calls (stripped) and the calls in order; a call that is not valid JSON of a
    name and an arguments object stays text (only a grammar-free reply can hold one). A reply that is one bare
    call object and nothing else (tool_grammar's "auto" admits it) is that call."""
    bare = _call_of(text.strip()) if text.strip().startswith("{") else None
    if bare is not None:
        return "", [bare]
    calls, kept, last = [], [], 0
    for m in CALLS.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _call_of(text: str) -> ToolCall | None:
    """The call a JSON object of a name and an arguments object makes, else None."""
    try:
        body = json.loads(text)
        call = ToolCall(body["name"], body["arguments"])
    except (ValueError, KeyError, TypeError):
        return None
    return call if isinstance(call.name, str) and isinstance(call.arguments, dict) else None


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
