"""Tool calling on `mirrorsd serve`, through the official `openai` and `ollama` clients on a loopback server: a
tiny target whose chat template takes tools (Qwen2.5's <tool_call> format), calls constrained to the declared
functions and their argument schemas, returned as OpenAI / ollama tool_calls, streamed and not, a tool's result
taken on the next turn; and what cannot be honoured refused."""

from __future__ import annotations

import copy
import json

import ollama
import openai
import pytest

from conftest import make_model
from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.serve.openai_api import BackgroundServer, ServerLimits, create_app
from mirrorsd.drafters import NGramDrafter
from mirrorsd.tools import parse_calls, tool_grammar

MODEL = "tiny-tools"
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def long_target(tools_tokenizer):
    return make_model(tools_tokenizer, seed=0, sharpness=30.0, context=2048)  # room for the tools' descriptions


@pytest.fixture(scope="module")
def engine(tools_tokenizer, long_target):
    return Engine(long_target, tools_tokenizer, NGramDrafter(), name=MODEL)


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, limits=ServerLimits(max_tokens=200))) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_a_required_call_is_one_of_the_declared_functions_and_the_targets_own(client, tools_tokenizer, long_target):
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, sorted(arguments)) in [("get_weather", ["unit"]), ("get_time", ["zone"])]
    plain = Engine(long_target, tools_tokenizer, None, name=MODEL)  # target-only: speculation changed nothing
    ids = plain.encode(ASK, tools=[WEATHER, TIME])
    alone = plain.generate(ids, GenerationConfig(max_new_tokens=80, grammar=tool_grammar([WEATHER, TIME], "required",
                                                                                          parallel=False)))
    assert [(c.name, c.arguments) for c in parse_calls(alone.text)[1]] == [(call.function.name, arguments)]


def test_a_named_tool_choice_calls_that_function_streamed_too(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                          parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "local")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                                 parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True))
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0].choices[0]
    assert final.finish_reason == "tool_calls"
    streamed = final.delta.tool_calls[0]
    assert streamed.index == 0 and streamed.function.name == "get_time"
    assert streamed.function.arguments == call.function.arguments  # greedy: the same call


def test_the_tools_result_is_taken_on_the_next_turn(client, engine):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    resp = client.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER], tool_choice="none",
                                          max_tokens=12, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.choices[0].message.tool_calls is None
    prompt = engine.tokenizer.decode(engine.encode(
        [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
         {"role": "tool", "content": "21 degrees"}], tools=[WEATHER]))
    assert "<tool_response>\n21 degrees" in prompt and '"arguments": {"unit": ' in prompt


def test_ollamas_chat_returns_tool_calls(server):
    resp = ollama.Client(host=server.url).chat(model=MODEL, messages=ASK, tools=[WEATHER],
                                               options={"temperature": 0, "num_predict": 80})
    if resp.message.tool_calls:  # "auto": the model may answer in text instead
        call = resp.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.function.arguments["unit"] in ("c", "f")
    else:
        assert resp.message.content and not resp.message.content.startswith("<")


@pytest.mark.parametrize("extra, words", [
    ({"tools": [{"type": "function", "function": {}}]}, "not a function definition"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "send one"),
    ({"tools": [WEATHER, WEATHER]}, "distinct"),
])
def test_tool_requests_that_cannot_be_honoured_are_400s(client, extra, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)


def test_a_template_without_tools_is_refused(tokenizer, target_model):
    assert "tools" not in (tokenizer.chat_template or "")
    with BackgroundServer(create_app(Engine(target_model, tokenizer, None, name="plain"))) as srv:
        plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no tool calling"):
            plain.chat.completions.create(model="plain", messages=ASK, tools=[WEATHER], max_tokens=4)
