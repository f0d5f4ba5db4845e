"""`mirrorsd export`, `mirrorsd devices` and `generate --draft EXPORT_DIR`, run as a user runs them."""

from __future__ import annotations

import json
import re

import pytest

from mirrorsd import Engine, GenerationConfig

from helpers import run, run_all  # (tiny_folder is a conftest fixture)


def test_devices_on_this_machine_keeps_the_model_free_chain():
    result = run("devices")
    assert result.returncode == 0, result.stderr
    assert "onnxruntime providers: " in result.stdout and "CPUExecutionProvider" in result.stdout
    assert "draft    -> no NPU: model-free chain" in result.stdout


@pytest.fixture(scope="module")
def export_run(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-export") / "npu"
    result = run("export", "--model", str(tiny_folder), "--out", str(out), "--max-context", "128",
                 "--prefill-chunk", "8")
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="module")
def exported(export_run):
    return export_run[0]


def test_export_shows_each_phase_with_its_time_and_a_validation_table(export_run):
    out, result = export_run
    lines = result.stderr.splitlines()
    for phase in ("load", "export", "validate"):  # stderr is no terminal here: one plain line per phase
        assert any(re.match(rf"{phase} +\d+\.\d s  \S", line) for line in lines), result.stderr
    assert any(re.match(r"quantize +skipped  fp32 weights kept", line) for line in lines), result.stderr
    assert "WARNING" not in result.stderr and "onnxscript" not in result.stderr  # the tools' noise stays out
    assert "validation: passed" in result.stdout and re.search(r"max \|logit diff\| .* <= 0\.0005 .* ok", result.stdout)
    assert f"full report in {out}/manifest.json" in result.stdout and len(result.stdout.splitlines()) < 15
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["phase_seconds"]) == {"load", "export", "validate"}
    assert manifest["validation"]["passed"] and manifest["validation"]["checks"][0]["check"] == "max |logit diff|"


def test_the_tools_noise_is_hidden_unless_verbose(tiny_folder, tmp_path):
    common = ["export", "--model", str(tiny_folder), "--max-context", "128", "--prefill-chunk", "8", "--quant", "int8",
              "--no-validate"]
    quiet, verbose = run_all((*common, "--out", str(tmp_path / "q")), (*common, "--out", str(tmp_path / "v"), "--verbose"))
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert "WARNING" in verbose.stderr  # onnxruntime's static quantizer warns on the root logger
    assert "WARNING" not in quiet.stderr, quiet.stderr
    assert re.search(r"^quantize +\d+\.\d s  quant int8$", quiet.stderr, re.M)
    assert re.search(r"^validate +skipped  not asked$", quiet.stderr, re.M)
    assert "validation" not in quiet.stdout  # nothing validated, no table


def test_a_failed_validation_says_which_check_failed_and_exits_1(tiny_folder, exported, tmp_path):
    out = tmp_path / "strict"
    strict, again, bad = run_all(("export", "--model", str(tiny_folder), "--out", str(out), "--max-context", "128",
                                  "--prefill-chunk", "8", "--atol", "1e-9"),  # ONNX Runtime is not bit-exact with PyTorch
                                 ("export", "--validate", str(exported), "--atol", "1e-9", "--json"),
                                 ("export", "--validate", str(exported), "--min-top1", "2"))
    assert strict.returncode == 1, strict.stderr
    assert re.search(r"mirrorsd: validation FAILED: max \|logit diff\| \S+ \(needs <= 1e-09\)", strict.stderr)
    assert "validation: FAILED" in strict.stdout and "FAILED" in strict.stdout.split("max |logit diff|")[1]
    assert json.loads((out / "manifest.json").read_text())["validation"]["passed"] is False  # kept, with its report
    assert again.returncode == 1 and "validation FAILED: max |logit diff|" in again.stderr
    report = json.loads(again.stdout)  # --json: the report alone on stdout
    assert report["passed"] is False and report["checks"][0]["threshold"] == "<= 1e-09"
    assert bad.returncode == 2 and bad.stderr.startswith("mirrorsd: error: --atol must be >= 0")


def test_export_validate_and_generate_with_the_export(exported, tiny_folder):  # noqa: F811
    common = ["--target", str(tiny_folder), "--raw", "--max-new-tokens", "40", "--json"]
    check, with_export = run_all(("export", "--validate", str(exported), "--json"),
                                 ("generate", *common, "--draft", str(exported), "--verifier-device", "cpu",
                                  "def f(x): return x"))
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["max_abs_logit_diff"] <= 1e-4
    assert with_export.returncode == 0, with_export.stderr
    a = json.loads(with_export.stdout)
    plain = Engine.load(target=str(tiny_folder), draft="none", device="cpu")  # --device stays an alias
    assert a["token_ids"] == plain.generate("def f(x): return x", GenerationConfig(max_new_tokens=40)).token_ids
    # the export drafted (the gate may pause it where it loses: a draft as large as this tiny target)
    assert "onnx:CPU" in a["stats"]["drafter_shares"] and a["stats"]["drafted_tokens"] > 0


def test_cli_errors_are_clear(exported, tiny_folder):  # noqa: F811
    missing = run("generate", "--target", str(tiny_folder), "--raw", "--draft", str(exported),
                  "--draft-device", "qnn", "hi")
    assert missing.returncode == 2 and "QNNExecutionProvider is not installed" in missing.stderr
    assert "hint: pip install onnxruntime-qnn" in missing.stderr
