"""ollama's API on `mirrorsd serve`, for real: uvicorn on a loopback port and the official `ollama` client; the
replies are the engine's own (greedy: token for token), with ollama's counts, and what the server cannot apply
is refused in ollama's error shape."""

from __future__ import annotations

import json

import httpx
import ollama  # the official client
import pytest

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.serve.openai_api import BackgroundServer, ServerLimits, create_app
from mirrorsd.drafters import NGramDrafter

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "def quicksort(arr):"}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def engine(tokenizer, target_model):
    return Engine(target_model, tokenizer, NGramDrafter(), name=MODEL)


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, limits=ServerLimits(max_tokens=200))) as srv:
        yield srv


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, timeout=60)


def test_chat_is_the_engines_reply_with_ollamas_counts(client, engine):
    expected = engine.generate(MESSAGES, GenerationConfig(max_new_tokens=16))
    resp = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert resp.message.role == "assistant" and resp.message.content == expected.text
    assert resp.done and resp.done_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert resp.eval_count == len(expected.token_ids) and resp.prompt_eval_count >= 1
    assert resp.total_duration >= resp.prompt_eval_duration > 0 and resp.eval_duration > 0
    streamed = list(client.chat(model=f"{MODEL}:latest", messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in streamed) == expected.text
    assert [p.done for p in streamed] == [False] * (len(streamed) - 1) + [True]
    assert streamed[-1].eval_count == len(expected.token_ids)


def test_generate_templates_the_prompt_unless_raw(client, engine):
    templated = engine.generate([{"role": "system", "content": "Be brief."}, *MESSAGES],
                                GenerationConfig(max_new_tokens=16))
    resp = client.generate(model=MODEL, prompt=MESSAGES[0]["content"], system="Be brief.", options=GREEDY)
    assert resp.response == templated.text and resp.context[-len(templated.token_ids):] == templated.token_ids
    raw = engine.generate("def f(x):", GenerationConfig(max_new_tokens=16))
    streamed = client.generate(model=MODEL, prompt="def f(x):", raw=True, options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == raw.text


def test_a_seed_reproduces_a_sampled_reply_and_format_json_gives_json(client):
    sampled = {"temperature": 0.9, "seed": 7, "num_predict": 24, "top_p": 0.95}
    first, again = (client.chat(model=MODEL, messages=MESSAGES, options=sampled).message.content for _ in range(2))
    assert first == again
    reply = client.chat(model=MODEL, messages=MESSAGES, format="json", options={"temperature": 0, "num_predict": 120})
    if reply.done_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)
    else:  # cut by num_predict: still a prefix of a JSON object
        assert reply.message.content.lstrip().startswith("{")


def test_tags_show_ps_and_version_describe_the_served_model(client, server, engine):
    listed = client.list().models
    assert [m.model for m in listed] == [MODEL]
    params = sum(p.numel() for p in engine.target.model.parameters())
    assert listed[0].size == sum(t.numel() * t.element_size() for t in [*engine.target.model.parameters(),
                                                                          *engine.target.model.buffers()])
    details = listed[0].details
    assert (details.format, details.family, details.quantization_level) == ("torch", "llama", "F32")
    assert details.parameter_size == (f"{params / 1e6:.1f}".rstrip("0").rstrip(".") + "M" if params >= 1e6
                                      else f"{params / 1e3:.1f}".rstrip("0").rstrip(".") + "K")
    shown = client.show(MODEL)
    assert shown.details.family == "llama" and "mirrorsd.backend" in shown.modelinfo
    assert shown.modelinfo["general.parameter_count"] == params
    assert shown.capabilities == ["completion"]  # this tiny template takes no tools
    running = client.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].size == listed[0].size and running[0].expires_at
    assert httpx.get(server.url + "/api/version").json()["version"]


def test_unknown_api_routes_answer_in_ollamas_shape(server):
    for method, path in (("GET", "/api/nothing"), ("POST", "/api/pull"), ("GET", "/api/chat")):
        r = httpx.request(method, server.url + path, timeout=30)
        assert r.status_code in (404, 405) and isinstance(r.json()["error"], str), (path, r.text)


def test_draft_num_predict_bounds_k_and_min_p_is_applied(client, engine):
    repeat = [{"role": "user", "content": "one two three four one two three four one two three four one two"}]
    resp = client.chat(model=MODEL, messages=repeat, options={"temperature": 0, "num_predict": 24,
                                                              "draft_num_predict": 2})
    spec = resp.model_dump()["speculative"] if "speculative" in resp.model_dump() else None
    if spec is None:  # the client drops fields it does not know: ask the server directly
        spec = httpx.post(client._client.base_url.join("/api/chat"), json={
            "model": MODEL, "messages": repeat, "stream": False,
            "options": {"temperature": 0, "num_predict": 24, "draft_num_predict": 2}}, timeout=60).json()["speculative"]
    assert spec["drafted_tokens"] > 0 and len(spec["per_position_drafted"]) <= 2
    expected = engine.generate(MESSAGES, GenerationConfig(max_new_tokens=12, temperature=0.9, min_p=0.2, seed=5))
    got = client.chat(model=MODEL, messages=MESSAGES, options={"temperature": 0.9, "min_p": 0.2, "seed": 5,
                                                               "num_predict": 12})
    assert got.message.content == expected.text
    with pytest.raises(ollama.ResponseError, match="min_p"):
        client.chat(model=MODEL, messages=MESSAGES, options={"min_p": 2})


@pytest.mark.parametrize("call, status, words", [
    (lambda c: c.chat(model="llama3", messages=MESSAGES), 404, "not found"),
    (lambda c: c.chat(model=MODEL, messages=MESSAGES, options={"mirostat": 2}), 400, "option mirostat"),
    (lambda c: c.generate(model=MODEL, prompt="hi", images=[b"\x89PNG"]), 400, "images"),
    (lambda c: c.chat(model=MODEL, messages=[{**MESSAGES[0], "images": [b"\x89PNG"]}]), 400, "images"),
    (lambda c: c.chat(model=MODEL, messages=MESSAGES, options={"stop": {"a": 1}}), 400, "stop"),
    (lambda c: c.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 10_000}), 400, "at most 200"),
    (lambda c: c.chat(model=MODEL, messages=MESSAGES, options={"temperature": -1}), 400, "temperature"),
])
def test_what_the_server_cannot_apply_is_refused_in_ollamas_shape(client, call, status, words):
    with pytest.raises(ollama.ResponseError, match=words) as err:
        call(client)
    assert err.value.status_code == status


def test_runtime_options_that_change_no_token_are_ignored(client, engine):
    expected = engine.generate(MESSAGES, GenerationConfig(max_new_tokens=8))
    resp = client.chat(model=MODEL, messages=MESSAGES, options={"temperature": 0, "num_predict": 8, "num_ctx": 4096,
                                                                "num_thread": 2}, keep_alive="5m")
    assert resp.message.content == expected.text


def test_a_bad_body_is_an_ollama_error_not_a_traceback(server):
    r = httpx.post(server.url + "/api/chat", content=b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = httpx.post(server.url + "/api/chat", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("path, body", [
    ("/api/generate", '{"model": "' + MODEL + '", "prompt": "hi", "options": {"stop": ' + deep(990) + '}}'),
    ("/api/chat", '{"model": "' + MODEL + '", "messages": ' + deep(990) + '}'),
    ("/api/chat", '{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi"}], "tools": '
                  + deep(990) + '}'),
    ("/api/show", '{"model": ' + deep(5000) + '}'),
    ("/api/generate", '{"model": "x\\ud800", "prompt": "hi"}'),
    ("/api/generate", '{"model": "' + MODEL + '", "prompt": "hi", "options": {"\\udfff": 1}}'),
    ("/api/chat", '{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi\\ud800"}]}'),
    ("/api/generate", '{"model": "' + MODEL + '", "prompt": "hi", "system": "\\ud800", "stream": false}'),
])
def test_hostile_bodies_get_an_ollama_400_never_a_500(server, path, body):
    r = httpx.post(server.url + path, content=body.encode(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code in (400, 404), (r.status_code, r.text[:300])
    assert isinstance(r.json()["error"], str) and "Traceback" not in r.text
    assert httpx.get(server.url + "/api/version", timeout=30).status_code == 200
