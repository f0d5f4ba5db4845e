"""OpenAI-compatible HTTP server on one Engine: `mirrorsd serve` (FastAPI + uvicorn).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with "stream": true for SSE),
GET /v1/models, GET /v1/models/{model}, GET /health, and GET / (where the API is). Responses carry OpenAI's
`usage`, llama.cpp-style `timings` and a `speculative` block (GenerationStats.to_dict(): acceptance, mean accepted length, drafter, ...).

Requests are served in turn: one worker thread runs them on the single Engine, first come first
served; a client that disconnects (mid-stream, or while its request waits) cancels its generation.
Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code"}}`), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from typing import Literal

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from mirrorsd.apps.chat.session import describe_error
from mirrorsd.apps.serve.ollama_api import add_ollama_routes
from mirrorsd.apps.serve.requests import (CANCELLED, Job, OpenAIError, Runner, collect, first_non_text,
                                          shutting_down)
from mirrorsd.config import GenerationConfig, SamplingParams
from mirrorsd.errors import ConfigError, MirrorsdError
from mirrorsd.results import FinishEvent, GenerationResult, TokenEvent
from mirrorsd.tools import check_tools, parse_calls, tool_grammar

log = logging.getLogger("mirrorsd.server")


@dataclass(frozen=True)
class ServerLimits:
    max_tokens: int = 4096
    """Largest max_tokens a request may ask for (over it: 400). Requests that omit it get this much,
    clipped to what is left of the context window."""

    max_body_bytes: int = 1 << 20
    """Largest request body (over it: 413)."""

    max_queue: int = 8
    """Requests that may wait behind the running one (over it: 429 with Retry-After)."""

    header_timeout_s: float = 20.0
    """Time a connection gets to send a request's headers; then it is closed (a slow client holding
    connections open, a byte at a time)."""

    body_timeout_s: float = 20.0
    """Longest wait for the next piece of a request body; then 408."""




# -- request bodies ---------------------------------------------------------------------------------------
# Applied: model, messages / prompt, max_tokens / max_completion_tokens, temperature, top_p, top_k,
# repetition_penalty, presence_penalty, frequency_penalty, seed, stop, stream, stream_options.include_usage,
# response_format (text, json_object, json_schema), logprobs / top_logprobs, tools / tool_choice /
# parallel_tool_calls (mirrorsd/tools.py).
# Refused with 400 (accepting them would silently change the meaning of the request): REFUSED_FIELDS,
# n > 1, echo. Ignored as harmless (they change no token): user, metadata, store, service_tier,
# parallel_tool_calls without tools, and any other unknown field.

REFUSED_FIELDS = ("functions", "function_call", "logit_bias", "prediction", "audio", "suffix")


SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]  # the request fields that set them, same names


def _refused(extra: dict) -> list[str]:
    """Fields set to something this server would not apply (empty values pass; best_of 1 is what runs)."""
    refused = [name for name in REFUSED_FIELDS if extra.get(name) not in (None, [], {}, False, "")]
    return refused + (["best_of"] if extra.get("best_of") not in (None, 1) else [])


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON valid against a schema (grammar-constrained)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_or_none(self) -> dict | None:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise OpenAIError(400, "response_format json_schema needs a json_schema object with a schema",
                                  param="response_format", code="invalid_value")
            return self.json_schema.schema_
        return {"type": "object"} if self.type == "json_object" else None





class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class _Request(BaseModel):
    # Integers are strict (true is not 1) and floats finite, so a value is applied as sent or refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)  # llama.cpp / vLLM extension
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)  # llama.cpp / vLLM extension
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0)  # llama.cpp / vLLM extension
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        """JSON can carry lone surrogates ("\ud800"), which are not text: refused in every field."""
        bad = first_non_text(data)
        if bad is not None:
            raise ValueError(f"{bad or 'a string'} holds a lone surrogate (not valid Unicode text)")
        return data

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token the request asks for (0: the chosen token's only), None: no logprobs."""
        return None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict] | None = None  # None: an assistant message that only calls tools


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[StrictInt]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)  # OpenAI's limit for completions

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


# -- the single-engine queue ---------------------------------------------------------------------------









# -- the app -------------------------------------------------------------------------------------------

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               limits: ServerLimits | None = None, allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The ASGI app serving `engine` under the model id `model_name` (default: engine.name): the OpenAI routes
    and ollama's, over one request queue (requests.py).
    allowed_hosts: the Host header names (any port) it answers; others get 403, so a web page cannot reach a
    loopback server through a rebinding DNS name. None: any Host (a server bound to a public address).
    allowed_origins: web pages (origins, e.g. 'https://chat.example', or '*') that may call it from a browser
    besides the server's own and loopback ones; other pages get 403 (see _BrowserCheck)."""
    limits = limits or ServerLimits()
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty", "pass a non-empty --api-key (or MIRRORSD_API_KEY), or none")
    if api_key is not None and api_key != api_key.strip():
        raise ConfigError("the API key starts or ends with whitespace, which no client header would carry",
                          "pass the key without surrounding spaces")
    model_id = model_name or engine.name
    runner = Runner(engine, limits.max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        runner.shut_down(running=True)
        runner.close()

    app = FastAPI(title="mirrorsd", description="OpenAI-compatible server on a mirrorsd Engine", lifespan=lifespan)
    app.state.runner, app.state.limits = runner, limits
    _add_checks(app, limits, api_key, allowed_hosts, allowed_origins)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return runner.health()

    add_ollama_routes(app, engine, runner, model_id, limits)
    app.include_router(_OpenAIRoutes(engine, runner, model_id, limits).router())
    return app


def _add_checks(app: FastAPI, limits: ServerLimits, api_key: str | None, allowed_hosts: tuple[str, ...] | None,
                allowed_origins: tuple[str, ...]) -> None:
    """The middleware every request passes, the last added outermost."""
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    if api_key is not None:  # outermost: the key is checked before any body is read or parsed
        app.add_middleware(_KeyCheck, key=api_key)
    # a page another origin serves may call it only where allowed, and then with CORS (preflights answered
    # before the key is asked for, as browsers send them without it)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.add_middleware(_BrowserCheck, allowed_origins=allowed_origins)
    if allowed_hosts is not None:  # outermost of all: a foreign Host learns nothing, not even the 401
        app.add_middleware(_HostCheck, allowed=allowed_hosts)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body (ollama's routes: ollama's), never a traceback."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(MirrorsdError)
    async def _mirrorsd_error(request, exc: MirrorsdError):
        return OpenAIError(400, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return OpenAIError(400, f"We could not parse the JSON body of your request: {first.get('msg', '')}",
                               code="invalid_json").response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param,
                           code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        if request.url.path.startswith("/api/"):  # ollama's routes answer in ollama's shape, unknown ones too
            return JSONResponse(status_code=exc.status_code, content={"error": str(exc.detail)})
        return OpenAIError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error")
        return OpenAIError(500, describe_error(exc), "server_error").response()


class _OpenAIRoutes:
    """The OpenAI-compatible routes over the shared request queue (requests.py)."""

    def __init__(self, engine, runner: Runner, model_id: str, limits: ServerLimits) -> None:
        self.engine, self.runner, self.model_id, self.limits = engine, runner, model_id, limits
        self.model_card = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "mirrorsd"}

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/", self.root, methods=["GET"])
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return router

    async def root(self) -> dict:
        return {"object": "mirrorsd.server", "model": self.model_id, "openai_api": "/v1",
                "endpoints": ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                              "GET /v1/models/{model}", "GET /health"], "docs": "/docs"}

    async def models(self) -> dict:
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model: str) -> dict:
        if model != self.model_id:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`",
                              param="model", code="model_not_found")
        return self.model_card

    async def chat_completions(self, body: ChatRequest, request: Request):
        messages = [_message(m) for m in body.messages]
        tools, grammar = _tool_settings(body.model_extra or {}, body.response_format is not None,
                                        self.engine.tokenizer)
        ids, config = await asyncio.to_thread(self.encode_request, body, messages, tools, grammar)  # off the loop
        return await self.respond(request, body, ids, config, chat=True, tools_active=grammar is not None)

    async def completions(self, body: CompletionRequest, request: Request):
        if body.echo:
            raise OpenAIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise OpenAIError(400, "send one prompt per request", param="prompt", code="invalid_value")
            prompt = prompt[0]
        ids, config = await asyncio.to_thread(self.encode_request, body, prompt)
        return await self.respond(request, body, ids, config, chat=False)

    def encode_request(self, body: _Request, prompt, tools: list[dict] | None = None,
                       grammar: str | None = None) -> tuple[list[int], GenerationConfig]:
        refused = _refused(body.model_extra or {})
        if refused:
            raise OpenAIError(400, f"{refused[0]} is not supported by this server (it would be ignored, and the "
                              "reply would not be what you asked for)", param=refused[0], code="unsupported_parameter")
        if body.model != self.model_id:
            raise OpenAIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_id}`",
                              param="model", code="model_not_found")
        if body.n != 1:
            raise OpenAIError(400, "only n=1 is supported", param="n", code="invalid_value")
        wanted = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if wanted is not None and wanted > self.limits.max_tokens:
            raise OpenAIError(400, f"max_tokens is {wanted}; this server allows at most {self.limits.max_tokens}",
                              param="max_tokens", code="invalid_value")
        ids = self.engine.encode(prompt, tools=tools)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
            config = GenerationConfig(
                max_new_tokens=wanted or self.limits.max_tokens, stop=stop,
                json_schema=body.response_format and body.response_format.schema_or_none(), grammar=grammar,
                logprobs=body.top_logprobs_wanted(), **{"temperature": 1.0, **given})  # 1.0: OpenAI's default
            self.engine.constraint(config)  # a grammar that does not compile is this request's 400, not a 500 later
        except MirrorsdError as exc:
            raise OpenAIError(400, str(exc), code="invalid_value") from exc
        return ids, config


    async def respond(self, request: Request, body: _Request, ids: list[int], config: GenerationConfig, chat: bool,
                      tools_active: bool = False):
        job = self.runner.submit(ids, config)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = _sse(job, rid, self.model_id, chat, include_usage, self.engine.tokenizer, tools_active)
            return StreamingResponse(events,
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = await collect(job, request)
        finally:
            job.cancel()  # a no-op once finished; cancels if this handler is torn down early
        if result is None and job.shutdown:
            return shutting_down().response()
        if result is None:  # the client went away
            return JSONResponse(status_code=499, content=OpenAIError(499, "client closed request").body())
        body_out = _envelope(rid, self.model_id, chat)
        logprobs = _logprobs(self.engine.tokenizer, result.token_ids, result.logprobs, chat)
        message, finish = _reply_message(result.text, result.finish_reason, tools_active)
        body_out["choices"] = [
            {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish} if chat else
            {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}]
        body_out.update(_accounting(result))
        return body_out


def _message(m: ChatMessage) -> dict:
    """A chat message for the template: its text, and a tool call's or result's fields where it has them."""
    extra = m.model_extra or {}
    out = {"role": m.role, "content": _text_of(m.content) if m.content is not None else None}
    if m.role == "assistant" and extra.get("tool_calls"):
        out["tool_calls"] = extra["tool_calls"]
    elif out["content"] is None:
        raise OpenAIError(400, f"a {m.role} message needs content", param="messages", code="invalid_value")
    out.update({k: extra[k] for k in ("tool_call_id", "name") if isinstance(extra.get(k), str)})
    return out


def _tool_settings(extra: dict, structured: bool, tokenizer) -> tuple[list[dict] | None, str | None]:
    """The request's tools and the grammar its tool_choice asks for (None: tools off, or tool_choice "none")."""
    tools = extra.get("tools")
    if not tools:
        if extra.get("tool_choice") not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None, None
    choice = extra.get("tool_choice") or "auto"
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(choice, str):
        raise OpenAIError(400, "tool_choice must be auto, none, required or {type: function, function: {name}}",
                          param="tool_choice", code="invalid_value")
    if structured and choice != "none":
        raise OpenAIError(400, "tools and response_format each constrain the whole reply: send one",
                          param="response_format", code="invalid_value")
    parallel = extra.get("parallel_tool_calls", True) is not False
    try:
        tools = check_tools(tools)
        return tools, tool_grammar(tools, choice, parallel, tokenizer)
    except MirrorsdError as exc:
        raise OpenAIError(400, str(exc), param="tools", code="invalid_value") from None


def _reply_message(text: str, finish: str, tools_active: bool) -> tuple[dict, str]:
    """The assistant message and finish reason: the calls as OpenAI's tool_calls where the reply made any (a reply
    cut by max_tokens still says "length": what followed its complete calls is left in content)."""
    content, calls = parse_calls(text) if tools_active else (text, [])
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]}, \
        "length" if finish == "length" else "tool_calls"


def _text_of(content) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise OpenAIError(400, f"content parts of type {part.get('type')!r} are not supported (text only)",
                              param="messages", code="unsupported_content")
        if not isinstance(part.get("text"), str):
            raise OpenAIError(400, "a text content part needs a string 'text', got "
                                   f"{type(part.get('text')).__name__ if 'text' in part else 'none'}",
                              param="messages", code="invalid_value")
        parts.append(part["text"])
    return "".join(parts)


def _logprobs(tokenizer, token_ids: list[int], entries, chat: bool, offset: int = 0) -> dict | None:
    """The target's log-probabilities in OpenAI's shapes: chat's `content` list, or the completions API's parallel
    lists (text_offset counts from `offset`). None when the request did not ask for them."""
    if entries is None:
        return None
    pieces: dict[int, str] = {}

    def text(t: int) -> str:  # each id decoded once per call
        if t not in pieces:
            pieces[t] = tokenizer.decode([t])
        return pieces[t]

    if chat:
        return {"content": [
            {"token": text(t), "logprob": e.logprob, "bytes": list(text(t).encode()),
             "top_logprobs": [{"token": text(a), "logprob": lp, "bytes": list(text(a).encode())} for a, lp in e.top]}
            for t, e in zip(token_ids, entries)], "refusal": None}
    offsets = []
    for t in token_ids:
        offsets.append(offset)
        offset += len(text(t))
    return {"tokens": [text(t) for t in token_ids], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(a): lp for a, lp in e.top} for e in entries], "text_offset": offsets}


def _envelope(rid: str, model_id: str, chat: bool, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model_id}


def _accounting(result: GenerationResult) -> dict:
    """`usage` (OpenAI), `timings` (llama.cpp's server names) and the full speculative-decoding stats."""
    s = result.stats
    completion = len(result.token_ids)
    total_ms = s.total_time_s * 1000.0
    return {
        "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": completion,
                  "total_tokens": s.prompt_tokens + completion,
                  "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens}},
        "timings": {"cache_n": s.cached_prompt_tokens, "prompt_n": s.prompt_tokens - s.cached_prompt_tokens,
                    "prompt_ms": s.prompt_time_s * 1000.0, "time_to_first_token_ms": s.time_to_first_token_s * 1000.0,
                    "predicted_n": completion, "predicted_ms": total_ms,
                    "predicted_per_token_ms": total_ms / completion if completion else 0.0,
                    "predicted_per_second": s.tokens_per_second, "draft_n": s.drafted_tokens,
                    "draft_n_accepted": s.accepted_tokens},
        "speculative": s.to_dict(),
    }






async def _sse(job: Job, rid: str, model_id: str, chat: bool, include_usage: bool,
               tokenizer, tools_active: bool = False) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them. If the client disconnects, Starlette cancels this
    generator and the `finally` cancels the generation. With tools, the reply is held back and sent whole at
    the end, as text or as tool_calls (a call is only known to be one once its text is complete)."""
    def chunk(choice: dict | None, extra: dict | None = None) -> str:
        out = _envelope(rid, model_id, chat, chunk=True)
        out["choices"] = [choice] if choice is not None else []
        out.update(extra or {})
        return f"data: {json.dumps(out)}\n\n"

    pending: list[TokenEvent] = []  # tokens whose log-probabilities go out with the next text
    sent = 0  # characters of the logprob tokens sent: the completions API's text_offset

    def logprobs() -> dict | None:
        nonlocal sent
        if not pending or pending[0].logprob is None:
            return None
        out = _logprobs(tokenizer, [e.token_id for e in pending], [e.logprob for e in pending], chat, sent)
        if not chat:  # only the completions shape carries text offsets
            sent += sum(len(token) for token in out["tokens"])
        pending.clear()
        return out

    try:
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        while True:
            item = await job.events.get()
            if isinstance(item, TokenEvent):
                pending.append(item)
                if item.text and not tools_active:
                    yield chunk({"index": 0, "delta": {"content": item.text}, "logprobs": logprobs(),
                                 "finish_reason": None} if chat else
                                {"index": 0, "text": item.text, "logprobs": logprobs(), "finish_reason": None})
                continue
            if isinstance(item, FinishEvent):
                accounting = _accounting(item.result)
                reason = item.result.finish_reason
                delta = {"content": item.text} if item.text else {}
                if tools_active:
                    message, reason = _reply_message(item.result.text, reason, True)
                    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                    for i, call in enumerate(delta.get("tool_calls", ())):
                        call["index"] = i
                last = ({"index": 0, "delta": delta, "logprobs": logprobs(),
                         "finish_reason": reason} if chat else
                        {"index": 0, "text": item.text, "logprobs": logprobs(), "finish_reason": reason})
                yield chunk(last, {"timings": accounting["timings"], "speculative": accounting["speculative"]})
                if include_usage:
                    yield chunk(None, {"usage": accounting["usage"]})
            elif item is CANCELLED and job.shutdown:  # a final chunk, so the client knows the reply was cut
                yield chunk({"index": 0, "delta": {}, "logprobs": logprobs(), "finish_reason": "abort"} if chat else
                            {"index": 0, "text": "", "logprobs": logprobs(), "finish_reason": "abort"})
            elif isinstance(item, Exception):
                err = OpenAIError(400 if isinstance(item, MirrorsdError) else 500, describe_error(item),
                                  "invalid_request_error" if isinstance(item, MirrorsdError) else "server_error")
                yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        job.cancel()


class _KeyCheck:
    """ASGI middleware: every path but /health needs 'Authorization: Bearer KEY' (the docs and the
    OpenAPI schema too), checked before the body is read."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            err = OpenAIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'",
                              code="invalid_api_key")
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _HostCheck:
    """ASGI middleware: 403 for a request whose Host header names no allowed host (DNS rebinding: a page on
    evil.example resolving its name to 127.0.0.1 would otherwise reach a loopback server from the browser)."""

    def __init__(self, app, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {h.lower().strip("[]") for h in allowed}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or host_name(dict(scope.get("headers") or []).get(b"host", b"")) in self.allowed:
            await self.app(scope, receive, send)
            return
        err = OpenAIError(403, "this server answers only requests addressed to its own host names "
                               "(the Host header); start it with --allowed-hosts NAME to add one",
                          code="host_not_allowed")
        await err.response()(scope, receive, send)


class _BrowserCheck:
    """ASGI middleware against forged requests from web pages (CSRF). A page can make the browser POST to a
    loopback server without asking first (a 'simple' request: text/plain, a form, multipart) and without the
    user knowing; on a keyless server that would run generations and, with a learning drafter, write to the
    user's datastore. So:
    - a request with an Origin header (browsers send it on every cross-origin POST) is answered only where the
      origin is the server's own (same host and port as the Host header), a loopback one, or allowed with
      `--allowed-origins`; others get 403 on every route;
    - a body must be JSON (application/json or */*+json, or no Content-Type); curl's default form type
      (`curl -d`, as ollama's docs use) is taken only from a client that is not a browser (no Origin, no
      Sec-Fetch-Site but same-origin or none); other types get 415.
    Errors have the shape of the route's API: ollama's under /api/, OpenAI's elsewhere."""

    JSON_FREE_METHODS = ("GET", "HEAD", "OPTIONS")

    def __init__(self, app, allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any_origin = "*" in allowed_origins
        self.allowed = {o.strip().rstrip("/").lower() for o in allowed_origins if o.strip() != "*"}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1").strip()
        if origin and not self.origin_allowed(origin, headers.get(b"host", b"")):
            await self._refuse(scope, send, 403, f"requests from the web page at {origin} are not allowed (a "
                               "page may call this server only from its own origin or a loopback one); start "
                               "the server with --allowed-origins ORIGIN to allow it", "origin_not_allowed")
            return
        if scope["method"] not in self.JSON_FREE_METHODS:
            media = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            fetch_site = headers.get(b"sec-fetch-site", b"none").decode("latin-1").strip().lower()
            browser = bool(origin) or fetch_site not in ("none", "same-origin")
            json_body = media in ("", "application/json") or media.endswith("+json")
            if not json_body and not (media == "application/x-www-form-urlencoded" and not browser):
                await self._refuse(scope, send, 415, f"the request body must be JSON, not {media}: send "
                                   "'Content-Type: application/json'", "unsupported_media_type")
                return
        await self.app(scope, receive, send)

    def origin_allowed(self, origin: str, host_header: bytes) -> bool:
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.allowed:
            return True
        scheme, sep, rest = origin.partition("://")
        if not sep or scheme not in ("http", "https"):
            return False  # 'null' (a sandboxed frame, a file), extensions' schemes: allowed only by name
        authority = rest.split("/", 1)[0]
        return authority == host_header.decode("latin-1").strip().lower() or host_name(authority.encode()) in (
            "localhost", "127.0.0.1", "::1")

    @staticmethod
    async def _refuse(scope, send, status: int, message: str, code: str) -> None:
        if scope["path"].startswith("/api/"):
            response = JSONResponse(status_code=status, content={"error": message})
        else:
            response = OpenAIError(status, message, code=code).response()
        await response(scope, None, send)


def host_name(header: bytes) -> str:
    """The name in a Host header, without its port: 'localhost:8080' -> 'localhost', '[::1]:80' -> '::1'."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class _BodyLimit:
    """ASGI middleware: answer 413 for a request body over `limit` bytes (by Content-Length, or as
    it arrives for a chunked body) before any endpoint parses it."""

    def __init__(self, app, limit: int, timeout_s: float = 20.0) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large(send)
            return
        body, more = bytearray(), True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:  # a body sent a byte at a time holds the connection: not for long
                err = OpenAIError(408, f"the request body stopped arriving for {self.timeout_s:g} s",
                                  code="request_timeout")
                await err.response()({"type": "http"}, None, send)
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._too_large(send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        err = OpenAIError(413, f"request body over the server's limit of {self.limit} bytes",
                          code="request_too_large")
        await err.response()({"type": "http"}, None, send)


# -- running it ----------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


SHUTDOWN_MARGIN_S = 2.0  # after the grace period, the time handlers get to answer before uvicorn cancels them


class Server(uvicorn.Server):
    """uvicorn's server with mirrorsd's shutdown (SIGINT, SIGTERM, should_exit): it stops accepting
    connections, refuses the queued requests at once (503), lets the running one finish for `grace_s`,
    then ends it: a 503 for a non-streamed reply, a final chunk with finish_reason "abort" and
    `data: [DONE]` for a stream. No request is cut off mid-response or ends in a traceback."""

    def __init__(self, app: FastAPI, grace_s: float, **config) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_s + SHUTDOWN_MARGIN_S,
                                        http=_headers_within(app.state.limits.header_timeout_s), **config))
        self.runner, self.grace_s = app.state.runner, grace_s

    async def shutdown(self, sockets=None) -> None:
        self.runner.shut_down(running=False)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.runner.shut_down, True)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()


def _headers_within(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers have not all arrived `seconds` after
    it opened or after its last response (uvicorn itself waits for them for ever: slowloris)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            super().data_received(data)
            if waiting and self.cycle is not None and not self.cycle.response_complete:  # the headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol


class BackgroundServer:
    """The real uvicorn server in a thread, on a socket bound before it starts (port 0 = any free
    port; `.url` tells which). A context manager; used by the tests and by programs that embed a server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, shutdown_grace_s: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = Server(app, shutdown_grace_s, log_level="warning", lifespan="on")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (before a model loads): a bad or busy port is a clear error."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} is out of range", "use a TCP port in 0-65535, e.g. --port 8080")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                          "pick another --port (is another server running there?) or --host") from exc
    return sock


def serve(engine, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          model_name: str | None = None, limits: ServerLimits | None = None, sock: socket.socket | None = None,
          shutdown_grace_s: float = 5.0, allowed_hosts: tuple[str, ...] = (),
          allowed_origins: tuple[str, ...] = ()) -> None:
    """Serve until Ctrl-C or SIGTERM (blocking). On either, the server stops accepting connections, lets
    refuses the queued requests (503), lets the running one finish for up to `shutdown_grace_s`, then ends it
    (503, or a stream's final chunk with finish_reason "abort") and exits (see `Server`).
    allowed_hosts: Host names answered besides the loopback ones (a loopback server answers only those; a
    server on another address answers any Host unless names are given).
    allowed_origins: web pages allowed to call it from a browser besides its own and loopback ones."""
    hosts = (*LOOPBACK_HOSTS, host, *allowed_hosts) if is_loopback(host) or allowed_hosts else None
    app = create_app(engine, model_name=model_name, api_key=api_key, limits=limits, allowed_hosts=hosts,
                     allowed_origins=allowed_origins)
    if not is_loopback(host) and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    sock = sock or bind_socket(host, port)
    server = Server(app, shutdown_grace_s, log_level="info")
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal once it has shut down
        server.run(sockets=[sock])

