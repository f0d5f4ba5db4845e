"""The measurement scripts stay runnable: every name they import from mirrorsd exists, and each one with a
command line starts and prints its usage (a rename inside mirrorsd breaks the test, not a later measurement)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_names_a_script_imports_exist(script):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mirrorsd"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{script.name}: {node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mirrorsd"):
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "argparse" in s.read_text()], ids=lambda p: p.name)
def test_a_script_with_a_command_line_starts(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]


@pytest.mark.integration
def test_kernel_forms_runs_each_form_in_processes_of_its_own(tmp_path):
    """scripts/kernel_forms.py on smollm2, one process a form: each form's environment reaches its process (the
    row-pairs switch, read back there), and both forms' passes are exact."""
    from mirrorsd.apps.bench.runner import machine_info

    scripts = SCRIPTS[0].parent
    out = subprocess.run([sys.executable, str(scripts / "kernel_forms.py"), "--model", "smollm2-135m",
                          "--processes", "1", "--passes", "2", "--positions", "2", "3",
                          "--form", "pairs", "GGML_CPU_ROW_PAIRS=1", "--form", "no pairs", "GGML_CPU_ROW_PAIRS=0",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads((tmp_path / "results.json").read_text())["results"]
    assert runs["pairs"][0]["row_pairs"] is (machine_info()["simd"] == "AVX-512")
    assert runs["no pairs"][0]["row_pairs"] is False
    assert all(run["max_abs_diff"] == 0 for form in runs.values() for run in form)
    assert (tmp_path / "table.md").read_text().count("**0 (exact)**") == 2


@pytest.mark.slow
def test_the_gpu_checks_llamacpp_part_runs_on_the_cpu(tmp_path):
    """scripts/gpu_check.py's llama.cpp part, as a dry run: the same fixed-shape passes on the CPU's stock kernels
    are exact on every file, smollm2 loads exact (the check at its load), and every drafter x mode on it keeps
    target only's greedy tokens."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "code", "temperature": 0.0, "top_p": 1.0, "messages": [
        {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]}) + "\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--small", "--parts", "llamacpp",
                          "--max-new-tokens", "6", "--prompts", str(prompts), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["errors"] == {}
    part = report["llamacpp"]
    assert len(part["shapes"]) == 2  # the 1.5b's and the 0.5b's shapes, tiny
    for name, rows in part["shapes"].items():
        fixed = rows["fixed 16 rows"]
        assert fixed["backend"] == "llamacpp-static:cpu" and fixed["max_abs_diff"] == 0, name
    assert part["smollm2"]["target"]["exact_batches"] is True
    assert {label: r["greedy_equal"] for label, r in part["smollm2"]["rows"].items()} == dict.fromkeys(
        part["smollm2"]["rows"], "1/1")
    assert all(part["smollm2"]["seeded_sampled_same_in_every_mode"].values())
    assert "## llama.cpp, stock kernels" in (tmp_path / "out" / "report.md").read_text()
