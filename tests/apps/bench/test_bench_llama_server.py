"""`mirrorsd bench --peers llama-server`: llama.cpp's own server beside our llama.cpp rows (apps/bench/llama_server.py).
The real-server test needs llama-server built from the vendored llama.cpp (scripts/build_llama_variant.sh server, about
five minutes; or MIRRORSD_LLAMA_SERVER) and skips without it, saying so; the rest run everywhere."""

from __future__ import annotations

import json

import pytest

from conftest import make_model
from mirrorsd import Engine
from mirrorsd.apps.bench.runner import QUICK, BenchOptions, _choose, run_bench
from mirrorsd.apps.bench.configs import CONFIGS, CPP_TARGET_ONLY, TARGET_ONLY
from mirrorsd.apps.bench.llama_server import SERVER_TARGET_ONLY, LlamaServerRunner, completion_body, llama_server
from mirrorsd.config import GenerationConfig

SERVER_ROWS = {c.name for c in CONFIGS if c.group == "llama-server"}


def test_llama_server_rows_run_only_with_their_peer_group_and_say_what_they_need(tmp_path, tokenizer, monkeypatch):
    assert len(SERVER_ROWS) == 3 and not SERVER_ROWS & {c.name for c in _choose(list(CONFIGS), BenchOptions())}
    assert SERVER_ROWS <= {c.name for c in _choose(list(CONFIGS), BenchOptions(peers=("llama-server",)))}
    monkeypatch.setenv("MIRRORSD_LLAMA_SERVER", str(tmp_path / "no-such-binary"))
    assert llama_server() is None
    opts = BenchOptions(**{**QUICK, "target": "tiny-llama", "draft_model": None, "max_new_tokens": 8,
                           "repeats": 1}, out=str(tmp_path), peers=("llama-server",))
    engine = Engine(make_model(tokenizer, seed=0, sharpness=30.0, context=4096), tokenizer, name="tiny-llama")
    rows = [c for c in CONFIGS if c.name == TARGET_ONLY or c.group == "llama-server"]
    report = run_bench(opts, engine=engine, datastore=None, configs=rows)
    skipped = {s["configuration"]: s["reason"] for s in report["skipped"]}
    assert set(skipped) == SERVER_ROWS and "build_llama_variant.sh server" in skipped[SERVER_TARGET_ONLY]


def test_a_sampled_request_turns_off_the_samplers_llama_server_would_add_by_default():
    body = completion_body([1, 2, 3], GenerationConfig(max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3))
    assert (body["top_k"], body["min_p"], body["top_p"], body["temperature"], body["seed"]) == (0, 0.0, 0.9, 0.7, 3)
    assert completion_body([1], GenerationConfig(top_k=5, min_p=0.1, temperature=1.0))["top_k"] == 5


@pytest.mark.integration
@pytest.mark.skipif(llama_server() is None, reason="no llama-server: scripts/build_llama_variant.sh server builds it")
def test_llama_server_samples_with_our_settings_top_k_1_is_its_greedy_output():
    pytest.importorskip("llama_cpp")
    from mirrorsd.models import resolve_gguf

    runner = LlamaServerRunner(llama_server(), str(resolve_gguf("smollm2-135m", True)[0]), 2, None)
    runner.open()
    try:
        ids = list(range(1000, 1040))
        greedy = runner(ids, GenerationConfig(max_new_tokens=24)).tokens
        top1 = [runner(ids, GenerationConfig(max_new_tokens=24, temperature=1.5, top_k=1, seed=s)).tokens
                for s in (1, 2)]
    finally:
        runner.close()
    assert len(greedy) == 24 and top1 == [greedy, greedy]


@pytest.mark.integration
@pytest.mark.skipif(llama_server() is None, reason="no llama-server: scripts/build_llama_variant.sh server builds it")
def test_a_speculating_server_starts_afresh_for_each_measured_request_so_no_repeat_drafts_the_last_answer():
    pytest.importorskip("llama_cpp")
    from mirrorsd.models import resolve_gguf

    gguf = str(resolve_gguf("smollm2-135m", True)[0])
    for spec_type, restarts in ((None, False), ("ngram-mod", True)):
        runner = LlamaServerRunner(llama_server(), gguf, 2, spec_type)
        runner.open()
        try:
            before = runner.server.pid
            runner.fresh()
            assert (runner.server.pid != before) is restarts
            assert len(runner(list(range(1000, 1040)), GenerationConfig(max_new_tokens=8)).tokens) == 8
        finally:
            runner.close()


@pytest.mark.integration
@pytest.mark.skipif(llama_server() is None, reason="no llama-server: scripts/build_llama_variant.sh server builds it")
def test_bench_runs_llama_server_rows_beside_ours_each_greedy_equal_to_its_own_plain_run(tmp_path):
    pytest.importorskip("llama_cpp")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "code"}) + "\n" for p in (
        "Write a Python function that returns the n-th Fibonacci number.",
        "List three colors, one per line, then repeat the list.")))
    opts = BenchOptions(target="smollm2-135m", draft_model=None, prompts_file=str(prompts), max_new_tokens=32,
                        repeats=1, only=("n-gram, llama.cpp (ours)", "n-gram (llama-server ngram-mod)"),
                        peers=("llama-server",), out=str(tmp_path / "out"))
    report = run_bench(opts, datastore=None)
    rows = {r["configuration"]: r for r in report["rows"]}
    assert {CPP_TARGET_ONLY, SERVER_TARGET_ONLY, "n-gram (llama-server ngram-mod)"} <= set(rows), report["skipped"]
    assert rows["n-gram (llama-server ngram-mod)"]["greedy_equal_to_target_only"] is True
    assert rows["n-gram, llama.cpp (ours)"]["greedy_equal_to_target_only"] is True
    assert all(r["tokens_per_second"] > 0 for r in rows.values())
    assert any(p["peer"] == SERVER_TARGET_ONLY and p["ours"] == CPP_TARGET_ONLY for p in report["ours_vs_peers"])
