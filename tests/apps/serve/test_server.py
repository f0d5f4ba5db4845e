"""The OpenAI-compatible server, for real: uvicorn on a loopback port, the official `openai` client,
and raw HTTP (httpx) for the error cases."""

from __future__ import annotations

import json
import time

import httpx
import openai  # the official client
import pytest

from drafters_for_tests import PacedDrafter
from helpers import wait_idle
from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.serve.openai_api import BackgroundServer, ServerLimits, create_app
from mirrorsd.runtime.drafters import NGramDrafter

KEY = "sk-test-key"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine(tokenizer, target_model):
    # 5 ms per step: a long reply lasts ~1 s, long enough to disconnect from it midway.
    return Engine(target_model, tokenizer, PacedDrafter(NGramDrafter(), 0.005), name=MODEL)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, api_key=KEY, limits=ServerLimits(max_tokens=200, max_body_bytes=4096))
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_chat_completion_matches_the_engine_and_carries_stats(client, engine):
    messages = [{"role": "user", "content": "def quicksort(arr):"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    expected = engine.generate(messages, GenerationConfig(max_new_tokens=24))
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(engine.encode(messages))
    extra = resp.model_extra
    # prompt caching: the engine's own request just ran this prompt, so only its last token is fed again
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == expected.text
    cached = len(engine.encode(messages)) - 1
    assert again.usage.prompt_tokens_details.cached_tokens == again.model_extra["timings"]["cache_n"] == cached
    assert again.model_extra["timings"]["prompt_n"] == 1
    assert extra["timings"]["predicted_n"] == len(expected.token_ids)
    assert extra["timings"]["draft_n_accepted"] <= extra["timings"]["draft_n"]
    assert 0 < extra["timings"]["prompt_ms"] <= extra["timings"]["time_to_first_token_ms"] <= extra["timings"]["predicted_ms"]
    spec = extra["speculative"]
    for key in ("tokens_per_second", "acceptance_rate", "mean_accepted_length", "drafter", "verify_steps"):
        assert key in spec
    assert spec["generated_tokens"] == len(expected.token_ids)
    # which steps drafted depends on measured timings (the speculation gate), so the two runs' shares may
    # differ; each run's own account must hold together
    shares = spec["drafter_shares"]
    assert abs(sum(shares.values()) - 1) < 0.01 and spec["drafter"] == max(shares, key=lambda k: (shares[k], k != "none"))


def test_chat_completion_streams_the_same_text(client, engine):
    messages = [{"role": "user", "content": "Hello world!"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, timings = [], None, None, None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            pieces.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            timings = (chunk.model_extra or {}).get("timings") or timings
        if chunk.usage:
            usage = chunk.usage
    expected = engine.generate(messages, GenerationConfig(max_new_tokens=30))
    assert "".join(pieces) == expected.text
    assert len([p for p in pieces if p]) > 1  # really streamed, not one lump
    assert finish == expected.finish_reason
    assert usage.completion_tokens == len(expected.token_ids) and timings["predicted_n"] == len(expected.token_ids)


def test_text_completions_with_and_without_streaming(client, engine):
    prompt = "import numpy as np\n"
    expected = engine.generate(prompt, GenerationConfig(max_new_tokens=20))
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert resp.choices[0].text == expected.text and resp.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == expected.text


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    root = httpx.get(server.url + "/", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert root["model"] == MODEL and "POST /v1/chat/completions" in root["endpoints"]
    health = httpx.get(server.url + "/health").json()  # no key needed for /health
    assert health["status"] == "ok" and "finished" in health


def test_api_key_is_required(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def _post(server, body: bytes | dict, path="/v1/chat/completions"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


@pytest.mark.parametrize("body, status, field", [
    (b'{"model": "tiny-llama", "messages": [', 400, None),                                      # malformed JSON
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),         # unknown model
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 201}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),       # body size
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 400}]}, 400, None),      # over the context
])
def test_bad_requests_get_openai_style_errors(server, body, status, field):
    r = _post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in r.text
    if field:
        assert error["param"] == field or field in error["message"]


def test_unknown_route_and_unsupported_options(server):
    r = httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    r = _post(server, {"model": MODEL, "prompt": "hi", "echo": True}, path="/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_client_disconnect_cancels_generation(server):
    before = wait_idle(server.url)["finished"].get("cancelled", 0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert got and "[DONE]" not in got[-1]
        # leaving the block closes the connection mid-stream
    health = wait_idle(server.url, timeout=10)
    assert health["finished"].get("cancelled", 0) == before + 1
    # The engine is free: the next request is served at once and completes.
    t0 = time.monotonic()
    r = _post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                       "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - t0 < 5


def test_concurrent_requests_are_served_in_turn(client, engine):
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["hello", "def quicksort(arr):", "import numpy", "The quick brown fox"]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                                                  temperature=0).choices[0].text, prompts))
    assert texts == [engine.generate(p, GenerationConfig(max_new_tokens=12)).text for p in prompts]


def test_mirrorsd_serve_command(tiny_folder):
    """`mirrorsd serve` as a user starts it: a subprocess on a free loopback port, stopped with Ctrl-C."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mirrorsd", "serve", "--target", str(tiny_folder), "--draft",
                             "ngram", "--port", str(port), "--api-key", "k", "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0)
        assert resp.usage.completion_tokens >= 1 and resp.model_extra["speculative"]["drafter"] in ("ngram", "none")
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and f"serving tiny at http://127.0.0.1:{port}/v1" in out
