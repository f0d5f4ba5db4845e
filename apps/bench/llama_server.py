"""llama-server beside our rows: `mirrorsd bench --peers llama-server`.

llama.cpp's own server, built from the same llama.cpp that llama-cpp-python vendors (`scripts/build_llama_variant.sh
server`; MIRRORSD_LLAMA_SERVER names another binary), with its stock kernels, on loopback, serving the same GGUF file
with as many threads as our llama.cpp backend: target-only, and its two n-gram speculation kinds (ngram-mod and
ngram-map-k), each compared with our llama.cpp row of the same kind. Requests send our prompt token ids to
/completion and stream the reply's token ids back; a speculating row serves each request from a fresh server, as
its n-gram tables outlive a request (ours hold only the request's own context). Each row's greedy output is
checked against llama-server's own target-only row. A server starts in seconds, but it is a process of its own:
each row runs as a block after the interleaved rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from mirrorsd.apps.bench.configs import CPP_TARGET_ONLY, BenchConfig, BenchContext, Output, register
from mirrorsd.apps.bench.vllm import ServedProcess, free_port, streamed_tokens, wait_healthy
from mirrorsd.config import GenerationConfig

SERVER_TARGET_ONLY = "target only (llama-server)"
CONTEXT = 4096
WARM_UP_TOKENS = 4  # shorter than either n-gram kind's key (ngram-mod 24 tokens, ngram-map-k 12)
NEEDS = "llama-server (scripts/build_llama_variant.sh server builds it; or MIRRORSD_LLAMA_SERVER), a GGUF target " \
        "and --peers llama-server"


def llama_server() -> str | None:
    """MIRRORSD_LLAMA_SERVER, else the one scripts/build_llama_variant.sh built for this machine, if any."""
    named = os.environ.get("MIRRORSD_LLAMA_SERVER")
    if named:
        return named if os.access(named, os.X_OK) else None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mirrorsd" / "llama-variants"
    built = sorted(root.glob("server-*/lib/llama-server"), key=lambda p: p.stat().st_mtime)
    return str(built[-1]) if built else None


class LlamaServerRunner(ServedProcess):
    """A bench Runner served by one llama-server: `open` starts it and waits until it answers, `close` stops it.
    spec_type: None (target-only) or one of llama-server's --spec-type kinds."""

    def __init__(self, binary: str, gguf: str, threads: int, spec_type: str | None) -> None:
        self.binary, self.gguf, self.threads, self.spec_type = binary, gguf, threads, spec_type

    def open(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="mirrorsd-bench-llama-server-"))
        self.port = free_port()
        command = [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t",
                   str(self.threads), "-tb", str(self.threads), "-c", str(CONTEXT), "-np", "1"]
        if self.spec_type:
            command += ["--spec-type", self.spec_type]
        log = self.folder / "llama-server.log"
        with open(log, "w") as out:
            self.server = subprocess.Popen(command, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.server, self.port, log, "llama-server")
        except BaseException:
            self.close()
            raise

    def fresh(self) -> None:
        """Speculating, a new server: its n-gram kinds keep their tables across requests (ngram-mod's is shared by
        every request the server serves), so a repeated prompt would draft the previous repeat's whole answer.
        A warm-up request follows, too short to leave an n-gram behind."""
        if self.spec_type is None:
            return  # target-only keeps nothing between requests (cache_prompt is off)
        self.close()
        self.open()
        self(list(range(WARM_UP_TOKENS)), GenerationConfig(max_new_tokens=WARM_UP_TOKENS))

    def __call__(self, ids: list[int], cfg: GenerationConfig) -> Output:
        body = completion_body(ids, cfg)
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        return streamed_tokens(request, "llama-server", lambda event: event.get("tokens"))


def completion_body(ids: list[int], cfg: GenerationConfig) -> dict:
    """The /completion request for `cfg`. top-k and min-p are sent even where off (0): llama-server's defaults
    (top-k 40, min-p 0.05) would otherwise sample from a narrower distribution than ours; its penalties are off
    by default, as the bench's are."""
    body = {"prompt": list(ids), "n_predict": cfg.max_new_tokens, "temperature": cfg.temperature,
            "top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p,
            "stream": True, "return_tokens": True, "cache_prompt": False}
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    if cfg.json_schema is not None:  # llama-server's own grammar engine
        body["json_schema"] = json.loads(cfg.json_schema) if isinstance(cfg.json_schema, str) else cfg.json_schema
    return body


def _llama_server(spec_type: str | None):
    """A row factory: a LlamaServerRunner serving the target's GGUF (None where there is no binary or no GGUF)."""
    def make(ctx: BenchContext) -> LlamaServerRunner | None:
        from mirrorsd.backends import physical_cores
        from mirrorsd.models import is_gguf, resolve_gguf

        binary = llama_server()
        if binary is None or not is_gguf(ctx.target_name):
            return None
        threads = ctx.cpp_engine.target.n_threads if ctx.cpp_engine is not None else physical_cores()
        return LlamaServerRunner(binary, str(resolve_gguf(ctx.target_name, True)[0]), threads, spec_type)
    return make


_ROW = dict(reference=CPP_TARGET_ONLY, equal_to=SERVER_TARGET_ONLY, group="llama-server", separate=True,
            needs=NEEDS, memory=(), own_grammar=True)
register(BenchConfig(SERVER_TARGET_ONLY, _llama_server(None), peer_of=CPP_TARGET_ONLY, **_ROW))
register(BenchConfig("n-gram (llama-server ngram-mod)", _llama_server("ngram-mod"),
                     peer_of="n-gram, llama.cpp (ours)", **_ROW))
register(BenchConfig("n-gram (llama-server ngram-map-k)", _llama_server("ngram-map-k"),
                     peer_of="n-gram, llama.cpp (ours)", **_ROW))
