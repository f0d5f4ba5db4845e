"""Export the real smollm2-135m to ONNX (NPU profile) and validate it; draft with it losslessly."""

from __future__ import annotations

import pytest

from mirrorsd import Engine, GenerationConfig
from mirrorsd.exporters import export_draft

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smol_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol") / "npu"
    return folder, export_draft("smollm2-135m", folder, profile="npu", max_context=256, prefill_chunk=16)


def test_smollm2_npu_export_validates(smol_export):
    _, manifest = smol_export
    report = manifest["validation"]
    assert report["passed"], report  # fp32: logits within ATOL (5e-4) of PyTorch's, prefill and decode paths
    # Within ATOL a near-tie argmax can still flip (another kernel's rounding): greedy continuations of
    # the export may then part ways after that token; the verifier keeps the output lossless anyway.
    assert report["top1_agreement"] >= 0.99 and report["acceptance_rate"] > 0.95, report
    assert manifest["dims"]["layers"] == 30 and manifest["vocab_size"] == 49152


def test_engine_with_the_smollm2_export_is_token_equal(smol_export):
    folder, _ = smol_export
    engine = Engine.load(target="smollm2-135m", draft=str(folder), draft_device="cpu", backend="torch")
    plain = Engine(engine.verifier.model, engine.tokenizer, None)
    engine.eos_ids = plain.eos_ids = frozenset()
    assert engine.drafter.name == "onnx:CPU"
    cfg = GenerationConfig(max_new_tokens=40)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    result = engine.generate(messages, cfg)
    assert result.token_ids == plain.generate(messages, cfg).token_ids
    assert result.stats.acceptance_rate > 0.9  # its own weights on another runtime
