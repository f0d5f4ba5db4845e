"""Tool calling on a real catalog model: qwen2.5-coder-0.5b (Q8_0 GGUF, llama.cpp), whose tokenizer has <tool_call>
and </tool_call> as tokens of their own (151657, 151658). The whole round trip through the official `openai` and
`ollama` clients on a loopback server: the model calls the declared function, the tool's result goes back as a
`tool` message, the model answers with it; greedy, and the same tokens with speculation on as off."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from mirrorsd import Engine, catalog
from mirrorsd.apps.serve.openai_api import BackgroundServer, ServerLimits, create_app

pytestmark = pytest.mark.integration
pytest.importorskip("llama_cpp", reason="the llama.cpp backend is in the test extra: bash scripts/setup.sh installs it")

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
RESULT = "18 degrees Celsius and sunny"


@pytest.fixture(scope="module", params=["none", "ngram"])
def server(request):
    catalog.ensure_gguf(MODEL, progress=False)
    engine = Engine.load(target=MODEL, draft=request.param, backend="llamacpp")
    with engine, BackgroundServer(create_app(engine, model_name=MODEL, limits=ServerLimits(max_tokens=200))) as srv:
        yield srv


@pytest.fixture(scope="module")
def replies():
    """Each server's replies, by the parameter of its fixture: drafted must equal plain."""
    return {}


def openai_round_trip(url: str, choice) -> tuple[dict, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice0 = first.choices[0]
    assert choice0.finish_reason == "tool_calls" and len(choice0.message.tool_calls) == 1, choice0
    call = choice0.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and "paris" in arguments["city"].lower(), call
    turn = [*ASK, choice0.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    # the last turn without tools, as clients send it to get the answer (with them, this small model calls again)
    answer = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=60, temperature=0)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length") and not message.tool_calls, answer
    assert "18" in message.content, message.content  # the tool's result reached the model and its answer
    return arguments, message.content


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_openai_client_completes_a_round_trip(server, replies, request, choice):
    arguments, answer = openai_round_trip(server.url, choice)
    key = ("openai", json.dumps(choice))
    replies.setdefault(key, []).append((arguments, answer))
    assert all(r == replies[key][0] for r in replies[key]), replies[key]  # drafted == plain, token for token


def test_a_streamed_call_is_the_same_call(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60,
                                                 temperature=0, stream=True))
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0].choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.delta.tool_calls[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


def test_the_ollama_client_completes_a_round_trip(server, replies):
    client = ollama.Client(host=server.url, timeout=300)
    first = client.chat(model=MODEL, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
    assert first.message.tool_calls, first.message
    call = first.message.tool_calls[0]
    assert call.function.name == "get_weather" and "paris" in call.function.arguments["city"].lower()
    turn = [*ASK, first.message.model_dump(exclude_none=True),
            {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    answer = client.chat(model=MODEL, messages=turn, options={"temperature": 0, "num_predict": 60})
    assert not answer.message.tool_calls and "18" in answer.message.content, answer.message
    replies.setdefault("ollama", []).append((dict(call.function.arguments), answer.message.content))
    assert all(r == replies["ollama"][0] for r in replies["ollama"]), replies["ollama"]


def test_ollama_lists_the_models_facts_read_from_its_gguf(server):
    """What ollama's own /api/show says of this model: family, size, quantization, and tools."""
    client = ollama.Client(host=server.url, timeout=60)
    shown = client.show(MODEL)
    assert "tools" in shown.capabilities and "completion" in shown.capabilities
    details = shown.details
    assert (details.format, details.family, details.quantization_level) == ("gguf", "qwen2", "Q4_K_M")
    assert details.parameter_size == "630.2M" and shown.modelinfo["general.parameter_count"] == 630_167_424
    listed = client.list().models[0]
    assert 400e6 < listed.size < catalog.ensure_gguf(MODEL, progress=False).stat().st_size  # tensors, not headers
