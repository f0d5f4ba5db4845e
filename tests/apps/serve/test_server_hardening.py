"""The server under requests a careless or hostile client sends: every bad value is a 400 in
OpenAI's shape on a connection that stays usable, the key is checked before anything else, the queue is
bounded, a client that leaves mid-reply cancels it, and shutdown cancels what runs."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from drafters_for_tests import PacedDrafter
from helpers import run, run_all, wait_idle
from mirrorsd import Engine
from mirrorsd.apps.serve.openai_api import BackgroundServer, ServerLimits, create_app
from mirrorsd.errors import ConfigError
from mirrorsd.runtime.drafters import NGramDrafter

KEY = "sk-test"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def slow_engine(tokenizer, target_model):
    # 20 ms per step: a 200-token reply lasts seconds, long enough to leave it or shut down midway.
    return Engine(target_model, tokenizer, PacedDrafter(NGramDrafter(), 0.02), name=MODEL)


@pytest.fixture(scope="module")
def server(slow_engine):
    app = create_app(slow_engine, api_key=KEY, limits=ServerLimits(max_tokens=250, max_queue=1))
    with BackgroundServer(app) as srv:
        yield srv


BAD = [
    ("/v1/chat/completions", {**CHAT, "seed": -1}),
    ("/v1/chat/completions", {**CHAT, "seed": 2**70}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}),
    ("/v1/chat/completions", {**CHAT, "stop": ""}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "content": "x"}]}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": [300], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": [-1], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": [2**70], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1, "stream": True}),
]


def test_bad_values_are_400s_and_the_connection_stays_usable(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body in BAD:
            r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error" and "Traceback" not in r.text
        r = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [], "repetition_penalty": '
                                                      b'Infinity}', headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert http.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).status_code == 200


def test_the_key_is_checked_first_and_covers_the_docs(server, slow_engine):
    assert httpx.post(server.url + "/v1/chat/completions", content=b"{not json").status_code == 401
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(server.url + "/openapi.json", headers=AUTH).status_code == 200
    with pytest.raises(ConfigError):
        create_app(slow_engine, api_key="")


def test_a_client_leaving_a_non_streamed_reply_cancels_it(server):
    before = wait_idle(server.url)["finished"].get("cancelled", 0)
    body = {**CHAT, "max_tokens": 200, "temperature": 0, "messages": [{"role": "user", "content": "def f(x):"}]}
    with pytest.raises(httpx.ReadTimeout):  # tokens are flowing when the client gives up
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=1.0)
    health = wait_idle(server.url, timeout=10)
    assert health["finished"].get("cancelled", 0) == before + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 60, "temperature": 0}),
    ("/api/chat", {"model": MODEL, "messages": CHAT["messages"], "stream": False,
                   "options": {"num_predict": 60, "temperature": 0}}),  # ollama's route: the same header
])
def test_beyond_max_queue_requests_get_429_with_retry_after(server, path, body):
    wait_idle(server.url)
    results: list[httpx.Response] = []

    def post() -> None:
        results.append(httpx.post(server.url + path, json=body, headers=AUTH, timeout=60))

    threads = [threading.Thread(target=post) for _ in range(4)]  # one runs, one waits, the rest are refused
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 2 and 429 in codes, codes
    refused = next(r for r in results if r.status_code == 429)
    error = refused.json()["error"]
    assert refused.headers["Retry-After"] and (error["code"] == "queue_full" if path.startswith("/v1/") else
                                               "busy" in error)


def test_best_of_is_refused_rather_than_ignored(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "best_of": 1}).status_code == 200


class _Errors(logging.Handler):
    """The server's error log (uvicorn's and ours): a CancelledError traceback shows up here."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def error_log():
    handler = _Errors()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "mirrorsd")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def test_shutdown_ends_a_running_stream_with_a_final_abort_chunk(slow_engine, error_log):
    app = create_app(slow_engine, limits=ServerLimits(max_tokens=250))
    srv = BackgroundServer(app, shutdown_grace_s=0.5).__enter__()
    body = {**CHAT, "max_tokens": 250, "temperature": 0, "stream": True}
    got: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            got.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    while len(got) < 3:
        time.sleep(0.02)
    t0 = time.monotonic()
    srv.__exit__(None, None, None)  # what SIGTERM / Ctrl-C do: uvicorn's should_exit
    assert not srv.thread.is_alive() and time.monotonic() - t0 < 10
    reader.join(10)
    assert got[-1] == "data: [DONE]", got[-3:]
    last = json.loads(got[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"  # the 250-token reply (5 s at 20 ms a step) was cut
    assert not error_log, [r.getMessage() for r in error_log]


def test_shutdown_answers_running_and_queued_requests_with_503(slow_engine, error_log):
    app = create_app(slow_engine, limits=ServerLimits(max_tokens=250, max_queue=4))
    srv = BackgroundServer(app, shutdown_grace_s=0.5).__enter__()
    body = {**CHAT, "max_tokens": 250, "temperature": 0}
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60))

    clients = [threading.Thread(target=post) for _ in range(3)]  # one runs, two wait
    for client in clients:
        client.start()
    deadline = time.monotonic() + 30
    while not (app.state.runner.busy and app.state.runner.queued == 2):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.__exit__(None, None, None)
    for client in clients:
        client.join(10)
    assert [r.status_code for r in answers] == [503] * 3, [r.text for r in answers]
    for r in answers:
        assert r.json()["error"]["code"] == "server_shutting_down" and r.json()["error"]["type"] == "server_error"
    assert not error_log, [r.getMessage() for r in error_log]


def test_serve_refuses_an_empty_key_a_bad_port_and_a_busy_port(tiny_folder):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        empty_key, *bad_ports, out = run_all(
            ("serve", "--target", str(tiny_folder), "--api-key", ""),
            *[("serve", "--target", str(tiny_folder), "--port", port) for port in ("-1", "99999")],
            ("serve", "--target", str(tiny_folder), "--port", str(busy.getsockname()[1])))
    assert empty_key.returncode == 2 and "api-key is empty" in empty_key.stderr and "Traceback" not in empty_key.stderr
    for bad in bad_ports:
        assert bad.returncode == 2 and "out of range" in bad.stderr, bad.stderr
    assert out.returncode == 2 and "cannot listen" in out.stderr and "Traceback" not in out.stderr
    assert "Loading" not in out.stderr  # refused before the model loaded


# -- fuzzing: generated request bodies ------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Unicode that is not plain text: lone surrogates (json.dumps sends them as \ud800 escapes), a BOM, NUL,
# right-to-left marks, 4-byte characters, noncharacters; mixed into every string field.
_EDGES = ["\ud800", "\udfff", "a\ud800b", "\ufeff", "\x00", "\u202e", "\u200f", "\U0001f600", "\U0001d54f",
          "\U0010ffff", "\ufffe", "\r\n"]
_text = st.text(max_size=12) | st.lists(st.sampled_from(_EDGES) | st.text(max_size=3), max_size=4).map("".join)
_json = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80) |
                     st.floats(allow_nan=False, allow_infinity=False) | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=6)
_part = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image_url", "input_audio", "", 5]),
                                            "text": _text | _json, "image_url": _json})
_message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant", "tool", 3]) |
                                               _text,
                                               "content": st.one_of(_text, _json, st.lists(_part, max_size=3))})
_FIELDS = {"model": st.sampled_from([MODEL, "gpt-4", 5]) | _text, "max_tokens": _json | st.integers(-2, 12),
           "temperature": _json | st.floats(-1, 3), "top_p": _json, "top_k": _json, "seed": _json,
           "repetition_penalty": _json, "stop": _json | _text | st.lists(_text, max_size=3),
           "stream": st.booleans() | _json, "user": _text,
           "n": _json, "logprobs": _json, "echo": _json, "stream_options": _json, "top_logprobs": _json,
           "response_format": _json | st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object",
                                                                                    "text", "x"])},
                                                            optional={"json_schema": _json}),
           "messages": st.lists(_message, max_size=3) | _json, "prompt": _text | _json |
           st.lists(st.integers(-5, 400), max_size=5) | st.lists(_text, max_size=2)}
_body = st.fixed_dictionaries({}, optional=_FIELDS)


@pytest.fixture(scope="module")
def fuzz_target(tokenizer, target_model):
    engine = Engine(target_model, tokenizer, NGramDrafter(), name=MODEL)
    with BackgroundServer(create_app(engine, limits=ServerLimits(max_tokens=8))) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            yield http


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_generated_bodies_never_get_a_500_or_a_dropped_connection(fuzz_target, body, path):
    r = fuzz_target.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert "Traceback" not in r.text
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], r.text


@pytest.mark.parametrize("extra", [{"functions": [{"name": "f", "parameters": {}}]}, {"function_call": "auto"},
                                   {"logit_bias": {"5": 10}}, {"suffix": "x"}])
def test_fields_that_would_be_ignored_are_refused(server, extra):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text
    assert r.json()["error"]["param"] == next(iter(extra))


def test_presence_and_frequency_penalties_are_applied(server, slow_engine):
    from mirrorsd import GenerationConfig

    body = {**CHAT, "max_tokens": 12, "temperature": 0, "frequency_penalty": 2.0, "presence_penalty": 1.0,
            "messages": [{"role": "user", "content": "def f(x):"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    want = slow_engine.generate(body["messages"], GenerationConfig(max_new_tokens=12, frequency_penalty=2.0,
                                                                    presence_penalty=1.0))
    plain = slow_engine.generate(body["messages"], GenerationConfig(max_new_tokens=12))
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert want.token_ids != plain.token_ids  # the penalties changed the reply


def test_prompts_are_tokenised_off_the_event_loop(tokenizer, target_model):
    """While one request's prompt is being tokenised (held here on an event), /health still answers."""
    engine = Engine(target_model, tokenizer, NGramDrafter(), name=MODEL)
    release = threading.Event()
    encode = engine.encode

    def slow_encode(prompt):
        release.wait(20)
        return encode(prompt)

    engine.encode = slow_encode
    with BackgroundServer(create_app(engine)) as srv:
        pending = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30))
        pending.start()
        time.sleep(0.3)  # the request is inside encode now
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200  # a blocked loop would time out
        release.set()
        pending.join(30)


def test_serve_refuses_a_zero_max_tokens_limit(tiny_folder):
    out = run("serve", "--target", str(tiny_folder), "--max-tokens-limit", "0")
    assert out.returncode == 2 and "--max-tokens-limit" in out.stderr and "Traceback" not in out.stderr


def test_a_rebinding_host_name_gets_403_and_loopback_names_are_answered(server):
    """DNS rebinding (ollama's CVE-2024-28224): a page whose name resolves to 127.0.0.1 sends its own name in
    Host. A loopback server answers only loopback names, before the key is even looked at."""
    port = server.port
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "0.0.0.0", "[::2]:80"):
            r = http.get("/v1/models", headers={**AUTH, "Host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)
            assert http.get("/health", headers={"Host": host}).status_code == 403
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
            assert http.get("/v1/models", headers={**AUTH, "Host": host}).status_code == 200, host


def test_allowed_hosts_widen_the_check_and_none_turns_it_off(slow_engine):
    app = create_app(slow_engine, allowed_hosts=("127.0.0.1", "my-laptop.lan"))
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/health", headers={"Host": "my-laptop.lan:8080"}).status_code == 200
        assert http.get("/health", headers={"Host": "evil.example"}).status_code == 403
    with BackgroundServer(create_app(slow_engine, allowed_hosts=None)) as srv:
        assert httpx.get(f"{srv.url}/health", headers={"Host": "anything.example"}, timeout=30).status_code == 200


def test_an_api_key_with_surrounding_whitespace_is_refused_at_start(slow_engine):
    for key in (" padded-key ", "key\n", "\tkey"):
        with pytest.raises(ConfigError, match="whitespace"):
            create_app(slow_engine, api_key=key)
    cli = run("serve", "--api-key", " padded-key ", "--port", "0")
    assert cli.returncode == 2 and "whitespace" in cli.stderr and "Traceback" not in cli.stderr


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/chat/completions", {**CHAT, "model": "x\ud800"}),
    ("/v1/chat/completions", {**CHAT, "stop": ["\udfff"]}),
    ("/v1/completions", {"model": MODEL, "prompt": "\udfff", "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2, "stream": True, "stop": "\ud800"}),
    ("/v1/completions", {"model": MODEL, "prompt": "ok", "stream_options": {"a\ud800": 1}}),  # in a key
])
def test_lone_surrogates_are_400s(server, path, body):
    raw = json.dumps(body)  # json.dumps writes them as \\ud800 escapes, as a hostile client may
    with httpx.Client(base_url=server.url, headers={**AUTH, "Content-Type": "application/json"}, timeout=30) as http:
        r = http.post(path, content=raw)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_queued_clients_that_leave_free_their_slots_at_once(slow_engine):
    """--max-queue 4, one long stream running, four queued clients give up and close their sockets: /health
    says nothing waits any more, and a new request is queued, not refused with 429."""
    app = create_app(slow_engine, limits=ServerLimits(max_tokens=250, max_queue=4))
    # greedy: a sampled reply may reach EOS before the queued clients have left (it did, in a CI run)
    body = {**CHAT, "max_tokens": 240, "temperature": 0, "messages": [{"role": "user", "content": "def f(x):"}]}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        running = threading.Thread(target=lambda: http.post("/v1/chat/completions", json=body))
        running.start()
        deadline = time.monotonic() + 30
        while not http.get("/health").json()["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)

        def leave(stream: bool) -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "stream": stream}, timeout=0.5)

        leavers = [threading.Thread(target=leave, args=(i % 2 == 0,)) for i in range(4)]
        for t in leavers:
            t.start()
        for t in leavers:
            t.join()
        while http.get("/health").json()["queued"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = http.get("/health").json()
        # freed while the long reply still runs (not when the worker would have reached them)
        assert health["busy"] and health["queued"] == 0 and health["finished"].get("cancelled", 0) >= 4, health
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        running.join()


@pytest.mark.parametrize("change", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"temperature": True}, {"temperature": "0.5"}, {"top_p": "1"}, {"presence_penalty": False},
    {"stream": True, "stream_options": {"include_usage": "yes"}},
])
def test_wrong_types_are_refused_not_coerced(server, change):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={**CHAT, **change})
        assert r.status_code == 400 and r.json()["error"]["message"], (change, r.text)
        assert http.post("/v1/chat/completions", json={**CHAT, "temperature": 1, "top_p": 1}).status_code == 200


def test_slow_clients_cannot_hold_connections_open(slow_engine):
    """Partial headers, a byte now and then, held 24 connections open for 40 s: the headers get
    header_timeout_s, each piece of a body body_timeout_s (408)."""
    import socket

    limits = ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0)
    with BackgroundServer(create_app(slow_engine, limits=limits)) as srv:
        start = time.monotonic()
        partial = []
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # never finished
            partial.append(s)
        for s in partial:
            assert s.recv(1024) == b""  # closed by the server
            s.close()
        assert time.monotonic() - start < 8
        s2 = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s2.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"model\": ")  # then nothing more
        answer = b""
        while b"request_timeout" not in answer and (chunk := s2.recv(4096)):  # headers and body may come apart
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        s2.close()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # a normal client is answered
