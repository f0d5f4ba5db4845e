"""`mirrorsd bench` end to end on tiny in-process models: every configuration runs, the reports are
well-formed, the plots are real PNGs, and a configuration whose output differs is marked FAILED."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import make_model
from mirrorsd import Engine
from mirrorsd.apps.bench.runner import (QUICK, QUICK_ONLY, BenchOptions, Cell, _decode_speedup, _tps, doubts, machine_busy, own_load, run_bench,
                                 _simd, llama_cpp_simd, machine_info, simd_of, to_fetch, verdict)
from mirrorsd.apps.bench.configs import CONFIGS, ONNX_TARGET_ONLY, TARGET_ONLY, BenchConfig, ours
from mirrorsd.apps.bench.prompt_suite import CATEGORIES, bundled_suite, load_workload
from mirrorsd.errors import PromptError
from mirrorsd.exporters import export_draft, export_target
from mirrorsd.runtime.drafters.retrieval.datastore import build_datastore

BROKEN = "output-altering configuration (broken on purpose)"
BROKEN_SAMPLED = "sampling-altering configuration (broken on purpose)"


def altering(run, vocab: int, sampled_only: bool = False):
    """A runner whose last token differs from what the wrapped one produced (sampled_only: on sampled prompts
    alone): the token check must catch it."""
    def altered(ids, cfg):
        out = run(ids, cfg)
        if cfg.temperature > 0 or not sampled_only:
            out.tokens[-1] = (out.tokens[-1] + 1) % vocab
        return out
    return altered


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("bench")
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def quicksort(arr):\n    return sorted(arr)\n" * 20)
    store = build_datastore([corpus], tokenizer, tmp / "ds")
    # Long enough a context for the bundled suite's prompts under the tiny byte-level tokenizer.
    target = make_model(tokenizer, seed=0, sharpness=30.0, context=4096)
    draft = make_model(tokenizer, seed=1, sharpness=30.0, context=4096)
    export = tmp / "draft-export"  # the same draft, exported for ONNX Runtime (the exported-draft rows)
    export_draft(draft, export, profile="dynamic", max_context=4096, tokenizer=tokenizer, validate=False)
    target_export = tmp / "target-export"  # the target, exported for the ONNX Runtime rows
    export_target(target, target_export, quant="none", max_context=4096, tokenizer=tokenizer, validate=False)
    broken = BenchConfig(BROKEN, lambda ctx: altering(ours(ctx, None), len(tokenizer)))
    broken_sampled = BenchConfig(BROKEN_SAMPLED, lambda ctx: altering(ours(ctx, None), len(tokenizer), True),
                                 seeded_equal=True)
    opts = BenchOptions(**{**QUICK, "target": "tiny-llama", "draft_model": "tiny-llama-draft",
                           "max_new_tokens": 24}, draft_export=str(export), target_export=str(target_export),
                        out=str(tmp / "out"))
    report = run_bench(opts, engine=Engine(target, tokenizer, name="tiny-llama"), draft_lm=draft, datastore=store,
                       configs=[*CONFIGS, broken, broken_sampled])
    return report, tmp / "out"


def test_every_configuration_runs_and_greedy_outputs_match(bench_report):
    report, _ = bench_report
    names = [r["configuration"] for r in report["rows"]]
    # The llama.cpp rows need a GGUF target (the tiny in-process model is none): listed as not run, with why.
    torch_rows = [c.name for c in CONFIGS if c.reference == TARGET_ONLY and "GGUF" not in c.name and not c.group]
    onnx_rows = [c.name for c in CONFIGS if c.reference == ONNX_TARGET_ONLY and "llama.cpp" not in c.name]
    assert names == torch_rows + onnx_rows + [BROKEN, BROKEN_SAMPLED]
    asked = {c.name for c in CONFIGS if not c.group}  # peer groups (vLLM) run only with --peers
    assert {s["configuration"] for s in report["skipped"]} == asked - set(torch_rows + onnx_rows)
    assert all("GGUF" in s["reason"] for s in report["skipped"])
    assert report["categories"] == list(CATEGORIES)
    for row in report["rows"]:
        assert row["tokens_per_second"] > 0 and set(row["by_category"]) == set(CATEGORIES)
        if row["configuration"] not in (BROKEN, BROKEN_SAMPLED):
            assert row["greedy_equal_to_target_only"] is True, row
    ngram = next(r for r in report["rows"] if r["configuration"] == "n-gram (ours)")
    assert ngram["per_position_acceptance"] and 0 <= ngram["acceptance_rate"] <= 1
    assert report["rows"][0]["speedup_vs_target_only"] == 1.0
    assert report["rows"][0]["decode_speedup_vs_target_only"] == 1.0
    assert all(r["by_category"][c]["decode_speedup_vs_target_only"] > 0 for r in report["rows"] for c in CATEGORIES)
    creative = [p for p in report["prompts"] if p["category"] == "creative"]
    assert creative and all(p["temperature"] > 0 and not p["greedy_checked"] and p["seed"] is not None
                            for p in creative)


def test_every_run_prefills_its_prompt_from_a_cold_cache(bench_report):
    """Rows share the loaded models, and each row runs the prompt the row before just ran: a KV cache kept
    from that run would let this one skip its prompt prefill and look faster than the reference."""
    report, _ = bench_report
    ours_rows = [r for r in report["rows"] if r["ours"]]
    assert len(ours_rows) > 5 and all(r["cached_prompt_tokens"] == 0 for r in ours_rows), \
        {r["configuration"]: r["cached_prompt_tokens"] for r in ours_rows}


def test_a_configuration_that_changes_the_output_is_marked_failed(bench_report):
    report, out = bench_report
    broken = next(r for r in report["rows"] if r["configuration"] == BROKEN)
    assert broken["greedy_equal_to_target_only"] is False and broken["mismatched_prompts"]
    assert f"FAILED: {BROKEN}" in (out / "report.md").read_text()


def test_a_model_free_row_is_held_to_target_only_tokens_on_seeded_sampled_prompts_too(bench_report):
    """Sampled prompts run seeded: a row whose seeded replies must be target-only's (our model-free rows) fails on
    a changed sampled reply; the n-gram row, checked the same way, passes."""
    report, _ = bench_report
    rows = {r["configuration"]: r for r in report["rows"]}
    sampled = {p["label"] for p in report["prompts"] if p["temperature"] > 0}
    assert rows[BROKEN_SAMPLED]["greedy_equal_to_target_only"] is False
    assert set(rows[BROKEN_SAMPLED]["mismatched_prompts"]) == sampled
    assert rows["n-gram (ours)"]["greedy_equal_to_target_only"] is True


def test_report_files_are_well_formed(bench_report):
    report, out = bench_report
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["rows"] == report["rows"]
    for key in ("machine", "models", "versions", "settings", "prompts", "ours_vs_peers"):
        assert on_disk[key], key
    assert on_disk["models"]["target"]["dtype"] == "torch.float32" and "draft" in on_disk["models"]
    assert on_disk["models"]["draft export"]["backend"] == "onnx:CPU"
    assert on_disk["models"]["target (onnx)"]["backend"] == "onnx:CPU"
    onnx = [r for r in on_disk["rows"] if r["reference"] == ONNX_TARGET_ONLY]
    assert onnx and all(r["model_memory_mb"] > 0 for r in onnx)
    exported = next(r for r in on_disk["rows"] if r["configuration"] == "exported draft, overlap (ours)")
    # the export served the drafted steps ("grammar": json-schema prompts draft what the schema forces)
    assert set(exported["drafters"]) - {"none", "ngram", "grammar"} == {"onnx:CPU"}
    assert {"torch", "transformers", "python"} <= set(on_disk["versions"])
    peers = {(c["ours"], c["peer"]) for c in on_disk["ours_vs_peers"]}
    assert ("draft model (ours)", "assisted generation (transformers)") in peers
    md = (out / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| configuration"))
    table = [line for line in md.splitlines() if line.startswith("| ") and line.count("|") == header.count("|")]
    assert len(table) == 1 + len(report["rows"])  # header + one line per configuration
    # the best row of ours against the best peer row, per category and over the suite (the last column)
    ratios = next(line for line in md.splitlines() if line.startswith("| ours / peers' best |"))
    ours_best = max(r["tokens_per_second"] for r in report["rows"] if r["ours"])
    peers_best = max(r["tokens_per_second"] for r in report["rows"] if not r["ours"])
    assert ratios.split("|")[-2].strip() == f"{ours_best / peers_best:.2f}x"
    assert "UTC" not in md  # the page is a map of the current state; the date stays in report.json
    assert f"Machine: {on_disk['machine']['cpu']}" in md and "simd" in on_disk["machine"]
    exact = [r for r in report["rows"] if r["ours"] and r["greedy_equal_to_target_only"] is not False]
    fastest = max(exact, key=lambda r: r["tokens_per_second"])
    if doubts(report, fastest):  # a busy test machine, or tiny models' noisy ratios: the verdict says so
        assert report["verdict"].startswith("No verdict: the measurement is unreliable (")
    else:
        assert report["verdict"].startswith(f"Use {fastest['configuration']}: ") and BROKEN not in report["verdict"]
    assert f"**{report['verdict']}**" in md
    assert ("**Warning: " in md) == bool(report["busy"])  # a busy machine is in the report, not only the console


def test_rates_count_each_repeats_own_tokens_and_decode_speedups_pair_runs_of_one_repeat():
    # a sampled prompt: the repeats stopped at different lengths; the first repeat's count must not stand for all
    cell = Cell(seconds=[2.0, 4.0, 4.0], tokens=[10, 40, 40], decode_seconds=[1.0, 3.0, 3.0])
    assert _tps([cell], [0]) == 40 / 4.0
    # the machine ran slow in the second repeat, for both rows: paired, the row is 1.5x in every repeat
    ref = Cell(seconds=[3.0, 6.0, 3.0], tokens=[31, 61, 31], decode_seconds=[3.0, 6.0, 3.0])
    row = Cell(seconds=[2.0, 4.0, 2.0], tokens=[31, 61, 31], decode_seconds=[2.0, 4.0, 2.0])
    assert _decode_speedup([row], [ref], [0]) == 1.5
    assert _decode_speedup([row, cell], [ref, ref], [0, 1]) == round((1.5 * 1.3) ** 0.5, 3)  # medians 1.5, 1.3


def row(name, tps, by_cat, ours=True, equal=True):
    return {"configuration": name, "ours": ours, "greedy_equal_to_target_only": equal, "tokens_per_second": tps,
            "speedup_vs_target_only": tps / 10, "by_category": {c: {"tokens_per_second": t,
                                                                    "speedup_vs_target_only": t / 10}
                                                                for c, t in by_cat.items()}}


def test_the_verdict_names_the_fastest_exact_row_and_clear_category_winners():
    report = {"categories": ["code", "chat", "json"], "rows": [
        row("target only (ours)", 10, {"code": 10, "chat": 10, "json": 10}),
        row("n-gram (ours)", 14, {"code": 20, "chat": 10.2, "json": 11}),
        row("chain (ours)", 12, {"code": 15, "chat": 10.3, "json": 16}),
        row("broken (ours)", 30, {"code": 30, "chat": 30, "json": 30}, equal=False),
        row("a peer", 40, {"code": 40, "chat": 40, "json": 40}, ours=False)]}
    assert verdict(report) == ("Use n-gram (ours): 14.0 tok/s, 1.40x plain decoding on its backend here (exact "
                               "output); chain (ours) if your work is mostly json.")
    assert verdict({"categories": [], "rows": [row("a peer", 5, {}, ours=False)]}) is None


def test_an_impossible_or_unreliable_measurement_gets_no_verdict():
    """`bench --quick` under load said "24.41x plain decoding": its reference row had run at 0.75 tok/s. A row
    that commits L tokens per target pass can be at most about L times its reference."""
    fast = {**row("n-gram (ours)", 16.37, {}), "speedup_vs_target_only": 24.41, "mean_accepted_length": 1.6}
    report = {"categories": [], "settings": {"repeats": 2}, "rows": [row("target only (ours)", 0.75, {}), fast]}
    said = verdict(report)
    assert said.startswith("No verdict: the measurement is unreliable (") and "allows at most 1.60x" in said
    plausible = {**fast, "speedup_vs_target_only": 1.5, "tokens_per_second": 15.0}
    report["rows"][1] = plausible
    assert verdict(report).startswith("Use n-gram (ours): ")
    assert "the machine is busy" in verdict({**report, "busy": "the machine is busy (load 5.0 on 2 cores)"})
    assert "--repeats 1" in verdict({**report, "settings": {"repeats": 1}})


def test_a_busy_machine_is_named(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 1.0, 1.0))
    assert "the machine is busy (load 64.0 on" in machine_busy()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert machine_busy() is None


def test_the_runs_own_load_is_not_taken_for_a_busy_machine(monkeypatch):
    """At the end of a run the load average holds the run itself (its threads, a served peer): only the rest counts."""
    started = (time.monotonic(), os.times())
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # one core kept busy by this process
        pass
    assert 0.3 < own_load(started) < 1.5
    cores = os.cpu_count()
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 0.5, 1.0, 1.0))
    assert machine_busy() is not None and machine_busy(own_load=1.0) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 2.0, 1.0, 1.0))
    assert "1.0 of it this run's own" in machine_busy(own_load=1.0)


def test_the_report_names_the_cpus_vector_instructions():
    """What a verify pass costs depends on the exact kernels the CPU gets, so each report says which."""
    assert simd_of("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n") == "AVX-512"
    assert simd_of("flags\t\t: fpu sse2 avx2 avx512f\n") == "AVX2"  # no AVX-512BW: ggml's AVX2 kernels
    assert simd_of("flags\t\t: fpu sse2 sse4_2\n") is None
    assert simd_of("Features\t: fp asimd evtstrm asimddp i8mm\n") == "NEON+dotprod+i8mm"
    assert simd_of("Features\t: fp asimd\n") == "NEON" and simd_of("") is None


def test_the_report_names_the_llama_cpp_builds_vector_instructions_where_they_are_less():
    """A build for less than the CPU has (the AVX2 variant on an AVX-512 machine) runs that level's kernels."""
    native = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
              "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
    avx2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | REPACK = 1 | "
    arm = "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | MATMUL_INT8 = 0 | REPACK = 1 | "
    assert [llama_cpp_simd(i) for i in (native, avx2, arm, "CPU : SSE3 = 1 | ", "")] == [
        "AVX-512", "AVX2", "NEON+dotprod", None, None]
    assert llama_cpp_simd("CPU : AVX2 = 0 | AVX = 1 | ") is None
    assert _simd({"simd": "AVX-512", "llama_cpp_simd": "AVX2"}) == " (AVX-512; llama.cpp built for AVX2)"
    assert _simd({"simd": "AVX2", "llama_cpp_simd": "AVX2"}) == _simd({"simd": "AVX2", "llama_cpp_simd": None}) == " (AVX2)"
    assert _simd({"simd": None, "llama_cpp_simd": None}) == ""


def test_the_loaded_llama_cpp_build_is_in_machine_info():
    pytest.importorskip("llama_cpp")
    import llama_cpp

    info = machine_info()
    assert info["llama_cpp_simd"] == llama_cpp_simd(llama_cpp.llama_print_system_info().decode())
    if info["simd"] in ("AVX-512", "AVX2"):  # setup.sh builds for the CPU, the AVX2 variant for AVX2
        assert info["llama_cpp_simd"] in ("AVX-512", "AVX2")


def test_plots_are_valid_pngs(bench_report):
    import matplotlib.image

    report, out = bench_report
    assert report["plots"] == ["speedup.png", "acceptance_by_position.png", "tokens_per_second.png", "timeline.png"]
    for name in report["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 100 and image.shape[1] > 100


def test_bundled_suite_covers_every_category():
    suite = bundled_suite(2)
    assert [p.category for p in suite].count("code") == 2
    assert {p.category for p in suite} == set(CATEGORIES)
    assert all(p.temperature > 0 for p in suite if p.category == "creative")
    assert all(p.temperature == 0 for p in suite if p.category != "creative")
    chat = next(p for p in suite if p.category == "chat")
    assert len(chat.messages) == 3  # multi-turn


def test_workload_files_load_and_bad_ones_are_clear_errors(tmp_path):
    good = tmp_path / "w.jsonl"
    good.write_text('{"prompt": "hi", "category": "greet"}\n\n{"messages": [{"role": "user", "content": "x"}]}\n'
                    '{"text": "raw", "temperature": 0.7, "top_p": 0.9}\n')
    loaded = load_workload(good)
    assert [p.category for p in loaded] == ["greet", "custom", "custom"] and loaded[2].temperature == 0.7
    assert loaded[2].top_p == 0.9 and loaded[0].top_p == 1.0
    for content, message in (("not json\n", "not valid JSON"), ('{"x": 1}\n', "has no prompt"),
                             ('{"prompt": "a", "temperature": -1}\n', "temperature"),
                             ('{"prompt": "a", "top_p": 0}\n', "top_p")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(content)
        with pytest.raises(PromptError, match=message):
            load_workload(bad)
    with pytest.raises(PromptError, match="does not exist"):
        load_workload(tmp_path / "missing.jsonl")


def test_bench_command_line_with_a_prompt_file(tmp_path, tokenizer):
    import os
    import subprocess
    import sys

    folder = tmp_path / "tiny"
    make_model(tokenizer, seed=0, sharpness=30.0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "def quicksort(arr):", "category": "mine"}\n{"text": "Hello world!"}\n')
    cmd = [sys.executable, "-m", "mirrorsd", "bench", "--quick", "--target", str(folder), "--prompts", str(prompts),
           "--datastore", "none", "--only", "n-gram (ours)", "--max-new-tokens", "8", "--out", str(tmp_path / "o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [r["configuration"] for r in report["rows"]] == ["target only (ours)", "n-gram (ours)"]
    assert report["categories"] == ["mine", "custom"] and report["settings"]["repeats"] == 2  # --quick's
    assert "n-gram (ours)" in done.stdout
    bad = subprocess.run([*cmd[:-2], "--only", "no such row"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown configuration" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.integration
def test_llamacpp_rows_on_the_catalog_gguf(tmp_path):
    """smollm2-135m's GGUF on llama.cpp: our rows and llama-cpp-python's own generation side by side, ours
    token-equal to our llama.cpp target-only decoding, llama-cpp-python's prompt lookup checked against its
    own generate (its stock kernels), with model memory."""
    pytest.importorskip("llama_cpp")
    from mirrorsd.apps.bench.configs import CPP_TARGET_ONLY

    rows = (CPP_TARGET_ONLY, "llama-cpp-python generate", "n-gram, llama.cpp (ours)", "prompt lookup (llama-cpp-python)")
    prompts = tmp_path / "prompts.jsonl"  # two of the suite's categories: the rows, not the suite, are checked here
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in (
        ("def fibonacci(n):\n    ", "code"), ("List three colors, one per line, then repeat the list.", "chat"))))
    report = run_bench(BenchOptions(target="smollm2-135m", draft_model=None, prompts_file=str(prompts),
                                    max_new_tokens=16, repeats=1, only=rows, out=str(tmp_path)), datastore=None)
    by_name = {r["configuration"]: r for r in report["rows"]}
    assert list(by_name) == list(rows)  # no torch row was asked for, so none ran
    for r in by_name.values():
        assert r["reference"] == CPP_TARGET_ONLY and r["model_memory_mb"] > 50, r  # the Q4_1 file's weights
    for name in (CPP_TARGET_ONLY, "n-gram, llama.cpp (ours)"):
        assert by_name[name]["greedy_equal_to_target_only"] is True, by_name[name]
    # llama-cpp-python's prompt lookup verifies with the stock batched kernels: whether it keeps its own plain
    # greedy output is measured and reported (it need not: those kernels are not batch-invariant)
    lookup = by_name["prompt lookup (llama-cpp-python)"]
    assert lookup["greedy_checked_against"] == "llama-cpp-python generate"
    assert lookup["greedy_equal_to_target_only"] in (True, False)
    assert by_name["llama-cpp-python generate"]["greedy_checked_against"] is None
    assert by_name["n-gram, llama.cpp (ours)"]["acceptance_rate"] is not None
    assert {p["ours"] for p in report["ours_vs_peers"]} == {CPP_TARGET_ONLY, "n-gram, llama.cpp (ours)"}
    assert "target (llama.cpp)" in report["models"] and (tmp_path / "report.md").is_file()


def test_ctrl_c_writes_a_partial_report_of_the_finished_prompts_and_exits_130(tmp_path, tokenizer):
    import os
    import re
    import signal
    import subprocess
    import sys

    folder, out, prompts = tmp_path / "tiny", tmp_path / "o", tmp_path / "p.jsonl"
    make_model(tokenizer, seed=0, sharpness=30.0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}"}) + "\n" for i in range(200)))
    args = ["bench", "--target", str(folder), "--prompts", str(prompts), "--datastore", "none", "--only",
            "n-gram (ours)", "--repeats", "1", "--max-new-tokens", "32", "--out", str(out)]
    # Python's own Ctrl-C handler in the child, also where this test runs as a background job of a
    # non-interactive shell (the child would inherit SIGINT ignored).
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv = ['mirrorsd', *{args!r}]; from mirrorsd.apps.cli import main; main()")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    seen = []
    try:
        for line in child.stderr:  # 2 configurations x 1 repeat: run 2 finishes the first prompt
            seen.append(line)
            if re.match(r"\[2/400\] .* ETA \d\d:\d\d$", line.strip()):
                child.send_signal(signal.SIGINT)
                break
        stdout, rest = child.communicate(timeout=240)
    finally:
        child.kill()
    stderr = "".join(seen) + rest
    assert child.returncode == 130, stderr
    assert re.search(r"interrupted: partial report \((\d+) of 200 prompts\) written to .*report\.json", stderr), stderr
    report = json.loads((out / "report.json").read_text())
    done = len(report["prompts"])
    assert report["partial"] is True and 1 <= done < 200
    assert report["interrupted"] == f"interrupted (Ctrl-C) after {done} of 200 prompts"
    assert [r["configuration"] for r in report["rows"]] == ["target only (ours)", "n-gram (ours)"]
    assert all(r["tokens_per_second"] > 0 and r["greedy_equal_to_target_only"] for r in report["rows"])
    assert (out / "report.md").read_text().startswith(f"**Partial report: interrupted (Ctrl-C) after {done} of 200")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs per-thread affinity and two cores")
def test_pin_devices_runs_every_mode_pinned_and_token_equal(tmp_path):
    """`bench --pin-devices` on smollm2-135m drafting for itself (torch, and its GGUF on llama.cpp): target-only
    and each draft with the pipeline off / overlap / branches, the verify side on one core and the draft side on another."""
    pytest.importorskip("llama_cpp")
    from mirrorsd.apps.bench.configs import PINNED

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Write a Python function that reverses a list."}) + "\n")
    report = run_bench(BenchOptions(target="smollm2-135m", draft_model="smollm2-135m", prompts_file=str(prompts),
                                    max_new_tokens=16, repeats=1, pin_devices=True, out=str(tmp_path / "out")),
                       datastore=None)
    ran = [r["configuration"] for r in report["rows"]]
    assert ran == [name for name in PINNED if "exported" not in name], report["rows"]  # no --draft-export given
    assert all(r["greedy_equal_to_target_only"] is True for r in report["rows"]), report["rows"]
    assert report["settings"]["pin_devices"] is True and "separate compute" in report["settings"]["pinning"]
    overlap = next(r for r in report["rows"] if r["configuration"] == "draft model, overlap (ours)")
    assert overlap["acceptance_rate"] is not None and overlap["acceptance_rate"] > 0.5, overlap  # a self-draft drafted


def test_only_runs_the_rows_a_chosen_row_is_compared_with():
    """--only a peer row also runs the row its greedy tokens are checked against, and our reference row."""
    from mirrorsd.apps.bench.runner import _choose
    from mirrorsd.apps.bench.configs import CPP_TARGET_ONLY

    opts = BenchOptions(target="smollm2-135m", only=("prompt lookup (llama-cpp-python)",))
    names = [c.name for c in _choose(list(CONFIGS), opts)]
    assert set(names) == {"prompt lookup (llama-cpp-python)", "llama-cpp-python generate", CPP_TARGET_ONLY}
    assert names.index("llama-cpp-python generate") < names.index("prompt lookup (llama-cpp-python)")


def test_what_a_run_will_download_is_said_first(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))  # an empty cache
    notes = to_fetch("qwen2.5-coder-1.5b", "", "my/folder", None)
    assert len(notes) == 1 and notes[0].startswith("qwen2.5-coder-1.5b is not cached: fetching ~")
    assert "mirrorsd pull qwen2.5-coder-1.5b" in notes[0]


def test_ctrl_c_within_the_first_prompt_still_reports_the_rows_that_ran(tmp_path, tokenizer):
    """Ctrl-C a few rows into a run (here: raised by the third row's first timed run) keeps the rows that ran."""
    def interrupted(ctx):
        def run(ids, cfg):
            if cfg.max_new_tokens > 4:  # not the warm-up call
                raise KeyboardInterrupt
        return run

    rows = [c for c in CONFIGS if c.name in (TARGET_ONLY, "n-gram (ours)")]
    stop = BenchConfig("interrupted here (ours)", interrupted)
    opts = BenchOptions(**{**QUICK, "target": "tiny-llama", "draft_model": None, "max_new_tokens": 8,
                           "repeats": 2}, out=str(tmp_path))
    engine = Engine(make_model(tokenizer, seed=0, sharpness=30.0, context=4096), tokenizer, name="tiny-llama")
    with pytest.raises(KeyboardInterrupt):
        run_bench(opts, engine=engine, datastore=None, configs=[*rows, stop])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["partial"] and [r["configuration"] for r in report["rows"]] == [TARGET_ONLY, "n-gram (ours)"]
    assert {"configuration": "interrupted here (ours)", "reason": "not reached before Ctrl-C"} in report["skipped"]
    assert report["rows"][1]["greedy_equal_to_target_only"] is not False


def test_the_live_table_after_the_last_prompt_is_the_final_table(tmp_path, tokenizer, capsys, monkeypatch):
    """The live display (stderr) and the final table (stdout) are one rendering of the same numbers."""
    monkeypatch.setenv("COLUMNS", "200")
    rows = [c for c in CONFIGS if c.name in (TARGET_ONLY, "n-gram (ours)")]
    opts = BenchOptions(**{**QUICK, "target": "tiny-llama", "draft_model": None, "max_new_tokens": 8,
                           "repeats": 2}, out=str(tmp_path))
    engine = Engine(make_model(tokenizer, seed=0, sharpness=30.0, context=4096), tokenizer, name="tiny-llama")
    report = run_bench(opts, engine=engine, datastore=None, configs=rows)
    captured = capsys.readouterr()

    def table_rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("│") and "(ours)" in line]

    final, live = table_rows(captured.out), table_rows(captured.err)
    assert len(final) == 2 and live[-2:] == final, captured.err
    assert f"so far: {len(report['prompts'])} of {len(report['prompts'])} prompts" in captured.err
    speedup = f"{report['rows'][1]['speedup_vs_target_only']:.2f}x"
    assert speedup in final[1]


class Served:
    """A ServedRunner around our own engine: what a server-backed peer (vLLM) looks like to the bench."""

    def __init__(self, run, log: list[str], vocab: int | None = None):
        self.run, self.log, self.vocab = run, log, vocab

    def open(self):
        self.log.append("open")

    def fresh(self):
        self.log.append("fresh")

    def close(self):
        self.log.append("close")

    def __call__(self, ids, cfg):
        self.log.append("run")
        out = self.run(ids, cfg)
        if self.vocab is not None:  # an altering server: its greedy check must fail
            out.tokens[-1] = (out.tokens[-1] + 1) % self.vocab
        return out


def test_separate_rows_run_as_blocks_after_the_interleaved_ones_and_are_judged(tmp_path, tokenizer):
    """A row with a server of its own opens it once, runs every prompt and repeat (each after `fresh`, outside its
    timing), closes it, and is checked against its greedy reference; one whose server does not start is skipped
    with why, and the report still comes."""
    logs: dict[str, list[str]] = {"served": [], "altering": []}

    def failing(ctx):
        class NoServer(Served):
            def open(self):
                raise RuntimeError("port in use")
        return NoServer(ours(ctx, None), [])

    rows = [c for c in CONFIGS if c.name == TARGET_ONLY] + [
        BenchConfig("served (peer)", lambda ctx: Served(ours(ctx, None), logs["served"]), peer_of=TARGET_ONLY,
                    separate=True),
        BenchConfig("altering served (peer)", lambda ctx: Served(ours(ctx, None), logs["altering"], len(tokenizer)),
                    peer_of=TARGET_ONLY, separate=True, equal_to="served (peer)"),
        BenchConfig("no server (peer)", failing, peer_of=TARGET_ONLY, separate=True)]
    opts = BenchOptions(**{**QUICK, "target": "tiny-llama", "draft_model": None, "max_new_tokens": 8,
                           "repeats": 2}, out=str(tmp_path))
    engine = Engine(make_model(tokenizer, seed=0, sharpness=30.0, context=4096), tokenizer, name="tiny-llama")
    report = run_bench(opts, engine=engine, datastore=None, configs=rows)
    runs = len(report["prompts"]) * 2  # after the warm-up, every prompt twice
    assert logs["served"] == ["open", "run"] + ["fresh", "run"] * runs + ["close"] and logs["altering"][-1] == "close"
    by_name = {r["configuration"]: r for r in report["rows"]}
    assert by_name["served (peer)"]["greedy_equal_to_target_only"] is True
    assert by_name["altering served (peer)"]["greedy_equal_to_target_only"] is False
    assert {"configuration": "no server (peer)", "reason": "its server did not start (port in use)"} in report["skipped"]


def test_vllm_rows_run_only_with_peers_vllm_and_say_what_they_need(tmp_path, tokenizer, monkeypatch):
    from mirrorsd.apps.bench.runner import _choose
    from mirrorsd.apps.bench.vllm import VLLM_TARGET_ONLY
    from mirrorsd.errors import ConfigError

    vllm_rows = {c.name for c in CONFIGS if c.group == "vllm"}
    assert len(vllm_rows) == 3 and not vllm_rows & {c.name for c in _choose(list(CONFIGS), BenchOptions())}
    with pytest.raises(ConfigError, match="unknown peer group"):
        _choose(list(CONFIGS), BenchOptions(peers=("vlm",)))
    monkeypatch.setenv("MIRRORSD_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    opts = BenchOptions(**{**QUICK, "target": "tiny-llama", "draft_model": None, "max_new_tokens": 8,
                           "repeats": 1}, out=str(tmp_path), peers=("vllm",))
    engine = Engine(make_model(tokenizer, seed=0, sharpness=30.0, context=4096), tokenizer, name="tiny-llama")
    rows = [c for c in CONFIGS if c.name in (TARGET_ONLY, "n-gram (ours)") or c.group == "vllm"]
    report = run_bench(opts, engine=engine, datastore=None, configs=rows)
    skipped = {s["configuration"]: s["reason"] for s in report["skipped"]}
    assert set(skipped) == vllm_rows and "scripts/setup_vllm.sh" in skipped[VLLM_TARGET_ONLY]


def test_quick_runs_the_default_backends_rows_only():
    from mirrorsd.apps.bench.configs import CPP_TARGET_ONLY

    named = {c.name: c for c in CONFIGS}
    assert all(name in named and named[name].reference == CPP_TARGET_ONLY for name in QUICK_ONLY)
