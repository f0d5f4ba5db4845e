"""ollama's API beside the OpenAI one, on the same Engine and request queue: tools that speak only ollama's
protocol work against `mirrorsd serve`.

POST /api/chat and /api/generate (streamed as NDJSON unless "stream": false), GET /api/tags, POST /api/show,
GET /api/ps, GET /api/version. Field names are ollama's (`eval_count`, `prompt_eval_duration`, `done_reason`,
durations in nanoseconds); errors are ollama's `{"error": "..."}`. `options` map onto the sampling settings
(OPTIONS); runtime knobs that change no token are ignored (IGNORED_OPTIONS); options that would change the
reply in a way this server does not apply, and fields it does not support, are refused with a 400, never
silently dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mirrorsd.apps.chat.session import describe_error
from mirrorsd.apps.serve.requests import CANCELLED, OpenAIError, collect, first_non_text, json_depth
from mirrorsd.backends import ModelFacts, model_facts
from mirrorsd.config import GenerationConfig
from mirrorsd.errors import MirrorsdError
from mirrorsd.results import FinishEvent, GenerationResult, TokenEvent
from mirrorsd.tools import check_tools, parse_calls, template_takes_tools, tool_grammar

API_VERSION = "0.6.3"  # the ollama API release whose shapes these endpoints follow
DEFAULT_TEMPERATURE = 0.8  # ollama's default where a request sets none
OPTIONS = {  # ollama option -> GenerationConfig field
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "num_predict": "max_new_tokens", "stop": "stop",
    "draft_num_predict": "num_draft_tokens",  # ollama's draft-length knob: K, the draft tokens per step
}
IGNORED_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "use_mmap", "use_mlock",
                   "numa", "low_vram", "vocab_only", "f16_kv", "logits_all")
UNSUPPORTED_FIELDS = ("images", "context", "template", "suffix", "logprobs", "top_logprobs")
MAX_DEPTH = 64  # ollama's requests nest about 5 deep, tools' JSON schemas more


class OllamaError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": self.message}, headers=self.headers)


def add_ollama_routes(app, engine, runner, model_id: str, limits) -> None:
    """ollama's routes (/api/...) on `app`, over the request queue the OpenAI routes share, answering errors in
    ollama's shape."""

    @app.exception_handler(OllamaError)
    async def _ollama_error(request, exc: OllamaError):
        return exc.response()

    app.include_router(_OllamaRoutes(engine, runner, model_id, limits).router())


class _OllamaRoutes:
    """ollama's chat, generate and model routes for one served engine."""

    def __init__(self, engine, runner, model_id: str, limits) -> None:
        self.engine, self.runner, self.model_id, self.limits = engine, runner, model_id, limits
        self.facts = model_facts(engine.target)  # read once: a loaded model's facts do not change

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/api/chat", self.chat, methods=["POST"])
        router.add_api_route("/api/generate", self.generate, methods=["POST"])
        router.add_api_route("/api/tags", self.tags, methods=["GET"])
        router.add_api_route("/api/show", self.show, methods=["POST"])
        router.add_api_route("/api/ps", self.ps, methods=["GET"])
        router.add_api_route("/api/version", self.version, methods=["GET"])
        return router

    def check_model(self, name) -> None:
        if name not in (self.model_id, f"{self.model_id}:latest"):
            raise OllamaError(404, f"model '{name}' not found; this server serves '{self.model_id}'")

    async def body_of(self, request: Request) -> dict:
        try:
            body = await request.json()
        except RecursionError:
            raise OllamaError(400, f"the JSON body nests deeper than {MAX_DEPTH} levels") from None
        except ValueError as exc:
            raise OllamaError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise OllamaError(400, "the body must be a JSON object")
        if json_depth(body) > MAX_DEPTH:  # every field's checks stay shallow, and no reply echoes a deep value
            raise OllamaError(400, f"the JSON body nests deeper than {MAX_DEPTH} levels")
        bad = first_non_text(body)
        if bad is not None:
            raise OllamaError(400, f"{bad or 'a string'} holds a lone surrogate (not valid Unicode text)")
        return body

    async def run(self, request: Request, body: dict, ids: list[int], config: GenerationConfig, chat: bool):
        try:
            job = self.runner.submit(ids, config)
        except OpenAIError as exc:  # the queue is full, or the server is stopping
            raise OllamaError(exc.status, exc.message, exc.headers) from None  # a 429 keeps its Retry-After
        reply = Reply(self.model_id, chat, ids, tools_active=config.grammar is not None)
        if body.get("stream", True):
            return StreamingResponse(_lines(job, reply), media_type="application/x-ndjson")
        return await _whole(job, request, reply)

    async def chat(self, request: Request):
        body = await self.body_of(request)
        self.check_model(body.get("model"))
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise OllamaError(400, "messages must be a list of {role, content} objects")
        if any(m.get("images") for m in messages):  # would be dropped: the reply would not be about them
            raise OllamaError(400, "images are not supported by this server (a message carries some; it would "
                                   "be answered without them)")
        prompt = [{k: m[k] for k in ("role", "content", "tool_calls", "tool_name") if k in m} for m in messages]
        # tokenising: off the loop
        ids, config = await asyncio.to_thread(encode_request, self.engine, body, prompt, self.limits)
        return await self.run(request, body, ids, config, chat=True)

    async def generate(self, request: Request):
        body = await self.body_of(request)
        self.check_model(body.get("model"))
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise OllamaError(400, "prompt must be a string")
        if not prompt:  # ollama: an empty prompt loads the model and answers at once
            return {"model": self.model_id, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        system = body.get("system") or ""
        request_prompt = prompt if body.get("raw") else (
            ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}])
        ids, config = await asyncio.to_thread(encode_request, self.engine, body, request_prompt, self.limits)
        return await self.run(request, body, ids, config, chat=False)

    async def tags(self) -> dict:
        return {"models": [card(self.model_id, self.facts)]}

    async def show(self, request: Request) -> dict:
        body = await self.body_of(request)
        self.check_model(body.get("model") or body.get("name"))
        template = getattr(self.engine.tokenizer, "chat_template", None) or ""
        info = card(self.model_id, self.facts)
        family = info["details"]["family"]
        return {"modelfile": f"FROM {self.model_id}\n", "parameters": f"temperature {DEFAULT_TEMPERATURE}",
                "template": template, "details": info["details"], "capabilities": capabilities(self.engine),
                "model_info": {"general.architecture": family, "general.parameter_count": self.facts.parameters,
                               f"{family or 'model'}.context_length": self.engine.target.max_context,
                               "mirrorsd.backend": self.engine.target.backend,
                               "mirrorsd.drafter": "none" if self.engine.drafter is None else self.engine.drafter.name},
                "modified_at": info["modified_at"]}

    async def ps(self) -> dict:
        loaded = card(self.model_id, self.facts)
        # loaded until the server stops (ollama's keep_alive -1); on the GPU the weights count as VRAM
        on_gpu = self.engine.target.computes_on == "gpu"
        loaded.update(expires_at=(datetime.now(timezone.utc) + timedelta(days=365)).isoformat(),
                      size_vram=loaded["size"] if on_gpu else 0, context_length=self.engine.target.max_context)
        return {"models": [loaded]}

    async def version(self) -> dict:
        return {"version": API_VERSION}


def encode_request(engine, body: dict, prompt, limits) -> tuple[list[int], GenerationConfig]:
    """The request's token ids and GenerationConfig from ollama's fields and options."""
    unsupported = [f for f in UNSUPPORTED_FIELDS if body.get(f) not in (None, [], {}, "", False)]
    if unsupported:
        raise OllamaError(400, f"{unsupported[0]} is not supported by this server (it would be ignored, and the "
                               "reply would not be what you asked for)")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    refused = sorted(set(options) - set(OPTIONS) - set(IGNORED_OPTIONS))
    if refused:
        raise OllamaError(400, f"option {refused[0]} is not supported (applied: {', '.join(OPTIONS)}; "
                               f"ignored, as they change no token: {', '.join(IGNORED_OPTIONS)})")
    tools = body.get("tools") or None
    if tools and body.get("format"):
        raise OllamaError(400, "tools and format each constrain the whole reply: send one")
    given = {OPTIONS[k]: v for k, v in options.items() if k in OPTIONS and v is not None}
    wanted = given.pop("max_new_tokens", None)
    if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool)):
        raise OllamaError(400, f"num_predict must be an integer, got {wanted!r}")
    if wanted is not None and wanted > limits.max_tokens:
        raise OllamaError(400, f"num_predict is {wanted}; this server allows at most {limits.max_tokens}")
    stop = given.pop("stop", [])
    if not isinstance(stop, (str, list)):  # a dict or a number would be coerced (a dict's keys, ...)
        raise OllamaError(400, f"options.stop must be a string or a list of strings, got {type(stop).__name__}")
    if "num_draft_tokens" in given:  # a limit on K, as llama.cpp's --draft-max: K adapts within it
        given["max_draft_tokens"] = given["num_draft_tokens"]
    try:
        ids = engine.encode(prompt, tools=None if tools is None else check_tools(tools))
        grammar = None if tools is None else tool_grammar(tools, tokenizer=engine.tokenizer)
        config = GenerationConfig(
            max_new_tokens=wanted if wanted is not None and wanted > 0 else limits.max_tokens,  # -1, -2: to the limit
            stop=stop, json_schema=_schema(body.get("format")),
            grammar=grammar,
            **{"temperature": DEFAULT_TEMPERATURE, **given})
        engine.constraint(config)  # a schema that does not compile is this request's 400
    except (MirrorsdError, TypeError, ValueError) as exc:
        raise OllamaError(400, str(exc)) from None
    return ids, config


def _schema(fmt) -> dict | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, dict):
        return fmt
    raise OllamaError(400, f'format must be "json" or a JSON schema object, got {fmt!r}')


def card(model_id: str, facts: ModelFacts) -> dict:
    """The model as /api/tags lists it: its size, family, parameter count and quantization, as the backend
    reports them (runtime/backends/facts.py; empty where it cannot tell)."""
    return {"name": model_id, "model": model_id, "modified_at": _now(), "size": facts.size_bytes,
            "digest": hashlib.sha256(model_id.encode()).hexdigest(),
            "details": {"parent_model": "", "format": facts.format, "family": facts.family,
                        "families": [facts.family] if facts.family else None,
                        "parameter_size": facts.parameter_size, "quantization_level": facts.quantization}}


def capabilities(engine) -> list[str]:
    """What ollama's /api/show says a model can do: completion, and tools where its chat template takes them."""
    return ["completion", *(["tools"] if template_takes_tools(engine.tokenizer) else [])]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass(frozen=True)
class Reply:
    """What a reply's objects carry: the served model, chat or generate, the prompt's ids, and whether tool
    calls are parsed out of it (then the reply is held back and sent whole at the end)."""

    model_id: str
    chat: bool
    ids: list[int]
    tools_active: bool


def _final(result: GenerationResult, reply: Reply, text: str) -> dict:
    """The last object of a reply: done, why, and ollama's counts and durations (nanoseconds)."""
    s = result.stats
    ns = 1_000_000_000
    model_id, chat, ids = reply.model_id, reply.chat, reply.ids
    out = {"model": model_id, "created_at": _now(), "done": True,
           "done_reason": "length" if result.finish_reason == "length" else "stop",
           "total_duration": int(s.total_time_s * ns), "load_duration": 0,
           "prompt_eval_count": s.prompt_tokens - s.cached_prompt_tokens,
           "prompt_eval_duration": int(s.prompt_time_s * ns), "eval_count": len(result.token_ids),
           "eval_duration": int(max(s.total_time_s - s.prompt_time_s, 0.0) * ns), "speculative": s.to_dict()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        content, calls = parse_calls(result.text) if reply.tools_active else (text, [])
        if calls:
            out["message"] = {"role": "assistant", "content": content, "tool_calls": [
                {"function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    else:
        out.update(response=text, context=list(ids) + list(result.token_ids))
    return out


async def _whole(job, request: Request, reply: Reply):
    try:
        result = await collect(job, request)
    finally:
        job.cancel()
    if result is None:
        raise OllamaError(503 if job.shutdown else 499, "the request was cancelled")
    return _final(result, reply, result.text)


async def _lines(job, reply: Reply) -> AsyncIterator[str]:
    """NDJSON as ollama streams it: one object per piece of text, then the final one with the counts."""
    def piece(text: str) -> str:
        body = {"message": {"role": "assistant", "content": text}} if reply.chat else {"response": text}
        return json.dumps({"model": reply.model_id, "created_at": _now(), **body, "done": False}) + "\n"

    try:
        while True:
            item = await job.events.get()
            if isinstance(item, TokenEvent):
                if item.text and not reply.tools_active:
                    yield piece(item.text)
                continue
            if isinstance(item, FinishEvent):
                text = item.result.text if reply.tools_active else item.text
                yield json.dumps(_final(item.result, reply, text)) + "\n"
            elif item is CANCELLED:
                yield json.dumps({"error": "the request was cancelled" + (
                    " (the server is shutting down)" if job.shutdown else "")}) + "\n"
            elif isinstance(item, Exception):
                yield json.dumps({"error": describe_error(item)}) + "\n"
            return
    finally:
        job.cancel()
