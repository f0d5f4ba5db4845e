"""Core ML export (MIL builder, KV cache as state): the package's spec on any OS; numerics on macOS."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from mirrorsd.errors import ExportError, ProviderError
from mirrorsd.exporters import export_draft, read_manifest, validate_export
from mirrorsd.exporters.coreml_export import check_coreml_spec

ON_MAC = platform.system() == "Darwin"


@pytest.fixture(scope="module")
def coreml_export(tmp_path_factory, target_model, tokenizer):
    folder = tmp_path_factory.mktemp("coreml") / "draft"
    export_draft(target_model, folder, fmt="coreml", max_context=64, tokenizer=tokenizer, validate=False)
    return folder


def test_spec_has_the_kv_state_inputs_and_outputs(coreml_export):
    manifest = read_manifest(coreml_export)
    spec = check_coreml_spec(coreml_export, manifest)
    assert spec["ok"], spec["problems"]
    assert spec["specification_version"] >= 9  # iOS 18 / macOS 15: stateful programs
    assert spec["states"] == {"key_cache": {"shape": [2, 2, 64, 12], "dtype": "float16"},
                              "value_cache": {"shape": [2, 2, 64, 12], "dtype": "float16"}}
    assert spec["inputs"]["attention_mask"] == {"shape": [1, 1, 1, 64], "dtype": "float16"}
    assert spec["outputs"]["logits"] == {"shape": [1, 1, 300], "dtype": "float32"}
    assert manifest["compute_units"] == "CPU_AND_NE" and manifest["precision"] == "fp16"


def test_spec_check_catches_a_package_that_does_not_match(coreml_export, tmp_path):
    manifest = read_manifest(coreml_export)
    manifest["io"]["decode"]["states"][0]["shape"] = [2, 2, 128, 12]
    assert not check_coreml_spec(coreml_export, manifest)["ok"]
    shutil.copytree(coreml_export, tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone" / "draft.mlpackage")
    with pytest.raises(ExportError, match="missing"):
        check_coreml_spec(tmp_path / "gone", read_manifest(tmp_path / "gone"))


def test_int4_per_block_weights(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    manifest = export_draft(LlamaForCausalLM(cfg).eval(), tmp_path / "q4", fmt="coreml", quant="int4",
                            max_context=32, tokenizer=tokenizer)
    assert manifest["quant"] == "int4" and manifest["validation"]["spec"]["ok"]
    import coremltools as ct

    spec = ct.models.MLModel(str(tmp_path / "q4" / "draft.mlpackage"), skip_model_load=True).get_spec()
    ops = {op.type for op in spec.mlProgram.functions["main"].block_specializations["CoreML8"].operations}
    assert "constexpr_blockwise_shift_scale" in ops, ops  # iOS 18's per-block quantized weights


@pytest.mark.skipif(ON_MAC, reason="checks the non-macOS behaviour")
def test_off_macos_validation_checks_the_spec_and_says_numerics_were_skipped(coreml_export):
    report = validate_export(coreml_export)
    assert report["passed"] and report["numerics"].startswith("skipped: Core ML runs predictions only on macOS")
    from mirrorsd.runtime.backends.coreml_lm import CoreMLCausalLM

    with pytest.raises(ProviderError, match="only on macOS"):
        CoreMLCausalLM(coreml_export, read_manifest(coreml_export))


@pytest.mark.skipif(not ON_MAC, reason="Core ML predicts only on macOS; the spec is checked on every OS")
def test_coreml_drafter_matches_pytorch_and_is_lossless_on_macos(coreml_export, target_model, tokenizer):
    from mirrorsd import Engine, GenerationConfig
    from mirrorsd.runtime.drafters.exported import drafter_from_export

    report = validate_export(coreml_export, model=target_model, tokenizer=tokenizer)
    assert report["top1_agreement"] >= 0.99, report
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=4)
    engine = Engine(target_model, tokenizer, drafter_from_export(coreml_export, tokenizer, "tiny"))
    plain = Engine(target_model, tokenizer, None)
    engine.eos_ids = plain.eos_ids = frozenset()
    assert engine.generate("def f(x):", cfg).token_ids == plain.generate("def f(x):", cfg).token_ids
