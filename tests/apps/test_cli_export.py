"""`mirrorsd export`, `mirrorsd devices` and `generate --draft EXPORT_DIR`, run as a user runs them."""

from __future__ import annotations

import json

import pytest

from mirrorsd import Engine, GenerationConfig

from helpers import run  # (tiny_folder is a conftest fixture)


def test_devices_on_this_machine_keeps_the_model_free_chain():
    result = run("devices")
    assert result.returncode == 0, result.stderr
    assert "onnxruntime providers: " in result.stdout and "CPUExecutionProvider" in result.stdout
    assert "draft    -> no NPU: model-free chain" in result.stdout


@pytest.fixture(scope="module")
def exported(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-export") / "npu"
    result = run("export", "--model", str(tiny_folder), "--out", str(out), "--max-context", "128",
                 "--prefill-chunk", "8")
    assert result.returncode == 0, result.stderr
    assert '"passed": true' in result.stdout
    return out


def test_export_validate_and_generate_with_the_export(exported, tiny_folder):  # noqa: F811
    check = run("export", "--validate", str(exported))
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["max_abs_logit_diff"] <= 1e-4
    common = ["--target", str(tiny_folder), "--raw", "--max-new-tokens", "40", "--json"]
    with_export = run("generate", *common, "--draft", str(exported), "--verifier-device", "cpu", "def f(x): return x")
    assert with_export.returncode == 0, with_export.stderr
    a = json.loads(with_export.stdout)
    plain = Engine.load(target=str(tiny_folder), draft="none", device="cpu")  # --device stays an alias
    assert a["token_ids"] == plain.generate("def f(x): return x", GenerationConfig(max_new_tokens=40)).token_ids
    assert a["stats"]["drafter"] == "onnx:CPU" and a["stats"]["drafted_tokens"] > 0


def test_cli_errors_are_clear(exported, tiny_folder):  # noqa: F811
    missing = run("generate", "--target", str(tiny_folder), "--raw", "--draft", str(exported),
                  "--draft-device", "qnn", "hi")
    assert missing.returncode == 2 and "QNNExecutionProvider is not installed" in missing.stderr
    assert "hint: pip install onnxruntime-qnn" in missing.stderr
