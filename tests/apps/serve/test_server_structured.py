"""Structured output and logprobs through the server, with the official `openai` client: replies valid against
their schema and equal to the engine's constrained decoding, the target's log-probabilities in OpenAI's shapes
(streamed and not), and clear 400s for what cannot be honoured."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.serve.openai_api import BackgroundServer, ServerLimits, create_app
from mirrorsd.runtime.drafters import NGramDrafter

MODEL = "tiny-llama"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
MESSAGES = [{"role": "user", "content": "def quicksort(arr):"}]


@pytest.fixture(scope="module")
def engine(tokenizer, target_model):
    return Engine(target_model, tokenizer, NGramDrafter(), name=MODEL)


@pytest.fixture(scope="module")
def client(engine):
    with BackgroundServer(create_app(engine, limits=ServerLimits(max_tokens=64))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_json_schema_replies_follow_the_schema_and_equal_constrained_decoding(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                          response_format=fmt)
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == engine.generate(MESSAGES, max_new_tokens=60, json_schema=SCHEMA).text
    for seed in range(3):  # sampled replies follow it too
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0,
                                              seed=seed, response_format=fmt)
        if resp.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)


def test_json_object_gives_a_json_object(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                          response_format={"type": "json_object"})
    text = resp.choices[0].message.content
    assert text.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_chat_logprobs_streamed_and_not(client, engine):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    expected = engine.generate(MESSAGES, max_new_tokens=12, logprobs=3)
    assert [e.logprob for e in whole] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert [t for t in expected.token_ids] == engine.generate(MESSAGES, max_new_tokens=12).token_ids
    for entry in whole:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client, engine):
    resp = client.completions.create(model=MODEL, prompt="import numpy as np\n", max_tokens=8, temperature=0,
                                     logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset == sorted(lp.text_offset)  # tokens are decoded pieces; a split character shows as U+FFFD
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    expected = engine.generate("import numpy as np\n", GenerationConfig(max_new_tokens=8, logprobs=2))
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, None),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, None),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, None),
])
def test_what_cannot_be_honoured_is_a_400(client, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(str(client.base_url) + "chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in r.text
    if param:
        assert error["param"] == param
