"""Forged requests from web pages (CSRF) against a keyless loopback server: a page can make the browser POST a
'simple' request (text/plain, a form, multipart: no preflight) to 127.0.0.1 with a Host the Host check accepts.
Every route refuses a body that is not JSON and any request from a foreign origin, before a generation runs or a
learning drafter writes to the user's datastore; JSON from the server's own or a loopback page, and curl's
default form type from a client that is not a browser (ollama's docs use `curl -d`), are answered."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers import PROMPTS
from mirrorsd import Engine
from mirrorsd.apps.serve.openai_api import BackgroundServer, create_app
from mirrorsd.runtime.drafters.factory import make_drafter
from mirrorsd.runtime.drafters.retrieval.datastore import Datastore

MODEL = "tiny"
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4},
    "/api/chat": {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "stream": False,
                  "options": {"num_predict": 4, "temperature": 0}},
    "/api/generate": {"model": MODEL, "prompt": PROMPTS[0], "stream": False,
                      "options": {"num_predict": 4, "temperature": 0}},
    "/api/show": {"model": MODEL},
}
GETS = ["/v1/models", "/api/tags", "/api/ps", "/api/version", "/health", "/"]
EVIL = "https://evil.example"
# what a page can send without a preflight, with the headers a browser adds
FORGED = [
    ("text/plain", {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"}),
    ("text/plain;charset=UTF-8", {"Sec-Fetch-Site": "cross-site"}),  # a browser that left Origin out
    ("application/x-www-form-urlencoded", {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"}),
    ("application/x-www-form-urlencoded", {"Sec-Fetch-Site": "cross-site"}),
    ("multipart/form-data; boundary=x", {"Origin": EVIL}),
    ("application/json", {"Origin": EVIL}),  # not simple, but sent anyway by a careless client or an old browser
    ("application/json", {"Origin": "null"}),  # a sandboxed frame or a file:// page
    ("application/json", {"Origin": "http://127.0.0.1.evil.example"}),
]


@pytest.fixture(scope="module")
def learning(tmp_path_factory, tokenizer, target_model):
    """A server whose chain drafter learns every reply into the user's datastore (`--draft chain:DS`)."""
    folder = tmp_path_factory.mktemp("user-ds")
    Datastore.create(folder, tokenizer, [tokenizer(PROMPTS[1])["input_ids"]])
    engine = Engine(target_model, tokenizer, make_drafter(f"chain:{folder}", tokenizer), name=MODEL)
    with BackgroundServer(create_app(engine)) as srv:
        yield srv, folder, engine


def documents(folder) -> int:
    return json.loads((folder / "datastore.json").read_text())["documents"]


def finished(http) -> int:
    return sum(http.get("/health").json()["finished"].values())


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("content_type, headers", FORGED)
def test_a_forged_post_runs_nothing_and_writes_nothing(learning, path, content_type, headers):
    srv, folder, _ = learning
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        before_docs, before_runs = documents(folder), finished(http)
        r = http.post(path, content=json.dumps(BODIES[path]).encode(),
                      headers={"Content-Type": content_type, **headers})
        assert r.status_code in (403, 415), (r.status_code, r.text)
        error = r.json()["error"]
        message = error if path.startswith("/api/") else error["message"]  # each API's own error shape
        assert isinstance(message, str) and ("--allowed-origins" in message or "application/json" in message)
        assert documents(folder) == before_docs and finished(http) == before_runs


@pytest.mark.parametrize("path", GETS)
def test_a_foreign_page_gets_403_on_reads_too(learning, path):
    srv, _, _ = learning
    r = httpx.get(srv.url + path, headers={"Origin": EVIL}, timeout=30)
    assert r.status_code == 403, r.text
    assert httpx.get(srv.url + path, timeout=30).status_code == 200


@pytest.mark.parametrize("path", sorted(BODIES))
def test_json_from_the_servers_own_or_a_loopback_page_is_answered_and_learned(learning, path):
    srv, folder, _ = learning
    for origin in (f"http://127.0.0.1:{srv.port}", "http://localhost:5173"):
        before = documents(folder)
        r = httpx.post(srv.url + path, json=BODIES[path], headers={"Origin": origin}, timeout=60)
        assert r.status_code == 200, (origin, r.text)
        assert r.headers.get("access-control-allow-origin") in ("*", origin)
        if path != "/api/show":  # a reply the chain learns from: the check above is not vacuous
            assert documents(folder) == before + 1, path


def test_curl_dash_d_works_on_the_ollama_routes_as_in_ollamas_docs(learning):
    srv, _, _ = learning
    body = json.dumps(BODIES["/api/generate"]).encode()
    r = httpx.post(srv.url + "/api/generate", content=body,
                   headers={"Content-Type": "application/x-www-form-urlencoded", "User-Agent": "curl/8.5.0"})
    assert r.status_code == 200 and r.json()["done"] is True, r.text
    r = httpx.post(srv.url + "/api/generate", content=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415 and "application/json" in r.json()["error"]


def test_a_preflight_from_a_loopback_page_is_answered_and_one_from_a_foreign_page_is_not(learning):
    srv, _, _ = learning
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(srv.url + "/api/chat", headers={"Origin": "http://localhost:3000", **ask}, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    refused = httpx.options(srv.url + "/api/chat", headers={"Origin": EVIL, **ask}, timeout=30)
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers


def test_allowed_origins_widen_the_check(tokenizer, target_model):
    engine = Engine(target_model, tokenizer, None, name=MODEL)
    with BackgroundServer(create_app(engine, allowed_origins=("https://chat.example/",))) as srv:
        r = httpx.post(srv.url + "/api/show", json={"model": MODEL}, headers={"Origin": "https://chat.example"},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.post(srv.url + "/api/show", json={"model": MODEL}, headers={"Origin": EVIL},
                          timeout=30).status_code == 403
    with BackgroundServer(create_app(engine, allowed_origins=("*",))) as srv:
        assert httpx.get(srv.url + "/api/tags", headers={"Origin": EVIL}, timeout=30).status_code == 200
