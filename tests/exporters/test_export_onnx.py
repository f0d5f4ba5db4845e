"""ONNX exports of tiny random Llamas: both profiles, fp32 and quantized, parity on the CPU provider,
the engine drafting with them (greedy token-equal to target-only, sampling in distribution), bad input."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest
import torch

from conftest import make_tokenizer
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError, ExportError, ProviderError, TokenizerMismatchError
from mirrorsd.exporters import export_draft, read_manifest, validate_export
from mirrorsd.runtime.drafters.exported import drafter_from_export
from mirrorsd.runtime.backends.onnx_lm import OnnxCausalLM

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:"


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tokenizer, target_model, other_model):
    """name -> export folder. 'self-*' come from the target's own weights, 'other-*' from other weights."""
    root = tmp_path_factory.mktemp("exports")
    made = {}
    for name, model, profile, quant in [("self-npu", target_model, "npu", "none"),
                                        ("self-dynamic", target_model, "dynamic", "none"),
                                        ("other-npu", other_model, "npu", "none"),
                                        ("self-npu-int8", target_model, "npu", "int8"),
                                        ("self-dynamic-int8", target_model, "dynamic", "int8"),
                                        ("self-dynamic-int4", target_model, "dynamic", "int4")]:
        made[name] = root / name
        export_draft(model, made[name], profile=profile, quant=quant, max_context=128, prefill_chunk=8,
                     tokenizer=tokenizer, validate=name.startswith("self"))
    return made


@pytest.mark.parametrize("name", ["self-npu", "self-dynamic"])
def test_fp32_export_matches_pytorch_on_the_cpu_provider(exports, name):
    manifest = read_manifest(exports[name])
    report = manifest["validation"]
    assert report["passed"], report
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["greedy_equal"] == "4/4" and report["top1_agreement"] == 1.0
    assert report["acceptance_rate"] == 1.0  # its own weights: every draft token accepted
    assert manifest["opset"] >= 18 and manifest["tools"]["onnxruntime"] and manifest["tools"]["torch"]
    assert len(manifest["tokenizer"]["fingerprint"]) == 64 and manifest["vocab_size"] == 300


def test_npu_profile_is_static_and_keeps_weights_outside_the_graph(exports):
    folder = exports["self-npu"]
    manifest = read_manifest(folder)
    assert set(manifest["graphs"]) == {"decode", "prefill"}
    assert manifest["graphs"]["decode"]["block"] == 1 and manifest["graphs"]["prefill"]["block"] == 8
    for name, graph in manifest["graphs"].items():
        model = onnx.load(str(folder / graph["file"]), load_external_data=False)
        shapes = {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                           for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert all(isinstance(d, int) and d > 0 for s in shapes.values() for d in s), shapes  # no dynamic axis
        assert shapes["past_key_0"] == [1, 2, 128, 12]
        assert shapes["attention_mask"] == [1, 1, graph["block"], 128 + graph["block"]]
        want = {i["name"]: i["shape"] for i in manifest["io"][name]["inputs"]}
        assert want == shapes
        assert (folder / (graph["file"] + ".data")).stat().st_size > 50_000  # weights as external data
    dyn = onnx.load(str(exports["self-dynamic"] / "model.onnx"), load_external_data=False)
    past = next(i for i in dyn.graph.input if i.name == "past_key_0").type.tensor_type.shape.dim
    assert past[2].dim_param  # the dynamic profile's past length is symbolic


@pytest.mark.parametrize("name, ops", [("self-npu-int8", {"QuantizeLinear", "DequantizeLinear"}),
                                       ("self-dynamic-int8", {"MatMulInteger", "DynamicQuantizeLinear"}),
                                       ("self-dynamic-int4", {"MatMulNBits"})])
def test_quantized_exports_use_the_onnxruntime_forms_and_are_reported(exports, name, ops):
    folder = exports[name]
    manifest = read_manifest(folder)
    for graph in manifest["graphs"].values():
        found = {n.op_type for n in onnx.load(str(folder / graph["file"]), load_external_data=False).graph.node}
        assert ops <= found, found
    report = manifest["validation"]
    for key in ("top1_agreement", "mean_kl", "greedy_equal", "acceptance_rate", "passed"):
        assert key in report
    # A random 48-wide model is a hard case for quantization; still, most argmaxes must survive.
    assert report["top1_agreement"] > 0.7 and report["mean_kl"] < 0.2, report


def target_only(model, tokenizer, prompt, cfg):
    engine = Engine(model, tokenizer, None)
    engine.eos_ids = frozenset()
    return engine.generate(prompt, cfg).token_ids


@pytest.mark.parametrize("name", ["self-npu", "other-npu", "self-dynamic", "self-npu-int8", "self-dynamic-int4"])
def test_engine_with_the_onnx_drafter_is_token_equal_to_target_only(exports, name, target_model, tokenizer):
    for pipeline in ("overlap", "off"):  # overlap: the two-queue pipeline drafts on its worker thread
        check_token_equal(exports[name], name, target_model, tokenizer,
                          GenerationConfig(max_new_tokens=60, num_draft_tokens=4, pipeline=pipeline))


def check_token_equal(folder, name, target_model, tokenizer, cfg):
    drafter = drafter_from_export(folder, tokenizer, "tiny", draft_device="cpu")
    assert drafter.name == "onnx:CPU"
    engine = Engine(target_model, tokenizer, drafter)
    engine.eos_ids = frozenset()
    for prompt in (PROMPT, "The quick brown fox", "import numpy as np\n"):
        result = engine.generate(prompt, cfg)
        assert result.token_ids == target_only(target_model, tokenizer, prompt, cfg)
        assert result.stats.drafted_tokens > 0
        if name == "other-npu":  # a poor draft: rejections every few tokens, so the pointer rolls back
            assert result.stats.accepted_tokens < result.stats.drafted_tokens


def test_pointer_rollback_gives_the_same_logits_as_a_fresh_cache(exports, tokenizer):
    folder = exports["self-npu"]
    manifest = read_manifest(folder)
    lm, fresh = OnnxCausalLM(folder, manifest), OnnxCausalLM(folder, manifest)
    ids = tokenizer(PROMPT)["input_ids"]
    lm.score(ids, [5, 6, 7, 8, 9, 10])  # drafts that will be "rejected"
    got = lm.score(ids + [11], [12])  # reconciles: pointer back to the prompt, then 11, 12
    want = fresh.score(ids + [11], [12])
    assert torch.allclose(got, want, atol=1e-5)
    assert lm._cached == ids + [11, 12]


def test_sampling_through_the_onnx_drafter_matches_the_target_distribution(exports, target_model, tokenizer):
    from helpers import assert_distribution, exact_first_two

    cfg = GenerationConfig(temperature=0.8, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False)
    prompt = "The quick brown fox"
    engine = Engine(target_model, tokenizer, drafter_from_export(exports["other-npu"], tokenizer, "tiny", "cpu"))
    engine.eos_ids = frozenset()
    p1, p2 = exact_first_two(target_model, tokenizer, cfg, prompt)
    assert_distribution(engine, prompt, cfg, p1, p2, seeds=1200, min_drafted=800)


# -- bad input ------------------------------------------------------------------------------------

def test_manifest_from_another_tokenizer_is_refused(exports):
    other_tok = make_tokenizer(vocab_size=280, corpus=["completely different text " * 20, "other words"])
    with pytest.raises(TokenizerMismatchError) as err:
        drafter_from_export(exports["self-npu"], other_tok, "other-target")
    assert "tokenizer" in err.value.message and err.value.hint


def test_corrupt_onnx_file_is_a_clear_error(exports, tmp_path, tokenizer):
    broken = tmp_path / "broken"
    shutil.copytree(exports["self-dynamic"], broken)
    with open(broken / "model.onnx", "r+b") as f:
        f.truncate(os.path.getsize(broken / "model.onnx") // 3)
    with pytest.raises(ExportError) as err:
        drafter_from_export(broken, tokenizer, "tiny")
    assert "corrupt" in err.value.hint


def test_missing_or_broken_manifest_and_unknown_options(tmp_path, tokenizer, target_model):
    with pytest.raises(ExportError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ExportError, match="not a valid"):
        read_manifest(tmp_path)
    with pytest.raises(ConfigError, match="MatMulNBits"):
        export_draft(target_model, tmp_path / "x", profile="npu", quant="int4", tokenizer=tokenizer)
    with pytest.raises(ConfigError):
        export_draft(target_model, tmp_path / "x", fmt="tflite", tokenizer=tokenizer)


@pytest.mark.parametrize("device", ["qnn", "openvino", "DmlExecutionProvider"])
def test_provider_not_installed_names_the_package(exports, tokenizer, device):
    with pytest.raises(ProviderError) as err:
        drafter_from_export(exports["self-npu"], tokenizer, "tiny", draft_device=device)
    assert "not installed" in err.value.message and "pip install" in err.value.hint


def test_validate_reports_a_broken_export(exports, tmp_path, target_model, tokenizer):
    """A graph whose weights were tampered with fails validation (the check can fail)."""
    folder = tmp_path / "tampered"
    shutil.copytree(exports["self-dynamic"], folder)
    data = folder / "model.onnx.data"
    raw = np.fromfile(data, dtype=np.float32)
    raw[: raw.size // 2] *= 1.01
    raw.tofile(data)
    report = validate_export(folder, model=target_model, tokenizer=tokenizer)
    assert not report["passed"] and report["max_abs_logit_diff"] > 1e-4


def test_manifest_is_plain_json_with_what_a_runtime_needs(exports):
    manifest = json.loads((exports["self-npu-int8"] / "manifest.json").read_text())
    for key in ("format", "profile", "max_context", "prefill_chunk", "graphs", "io", "vocab_size", "tokenizer",
                "precision", "quant", "quant_form", "opset", "tools", "providers"):
        assert key in manifest
    assert manifest["quant_form"].startswith("QDQ") and "QNNExecutionProvider" in manifest["providers"]


def test_fp16_export_keeps_float32_io_and_tracks_pytorch(tmp_path, target_model, tokenizer):
    from onnx import TensorProto

    manifest = export_draft(target_model, tmp_path / "fp16", profile="dynamic", precision="fp16", max_context=128,
                            tokenizer=tokenizer)
    model = onnx.load(str(tmp_path / "fp16" / "model.onnx"))
    weights = [t for t in model.graph.initializer if len(t.dims) == 2]
    assert weights and all(t.data_type == TensorProto.FLOAT16 for t in weights)
    assert model.graph.input[3].type.tensor_type.elem_type == TensorProto.FLOAT  # the host code stays float32
    report = manifest["validation"]
    assert report["top1_agreement"] > 0.98 and report["mean_kl"] < 1e-3, report


def test_an_unsupported_architecture_is_refused_before_exporting(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ExportError, match="'gpt2' models is not supported") as err:
        export_draft(gpt2, tmp_path / "gpt2", tokenizer=tokenizer)
    assert "qwen2.5-coder-0.5b" in err.value.hint and not (tmp_path / "gpt2").exists()


def test_qwen2_family_with_qkv_bias_and_tied_embeddings_exports_exactly(tmp_path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, rope_theta=1e6)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random (non-zero) q/k biases, as trained Qwen2 models have
            layer.self_attn.q_proj.bias.normal_()
            layer.self_attn.k_proj.bias.normal_()
    report = export_draft(model, tmp_path / "qwen2", profile="npu", max_context=64, prefill_chunk=8,
                          tokenizer=tokenizer)["validation"]
    assert report["passed"] and report["max_abs_logit_diff"] <= 1e-4, report


def test_an_export_on_the_cpu_provider_shares_the_cores_with_a_cpu_target(exports, tiny_folder):
    """Beside a CPU target, a CPU-provider export drafts with CPU_DRAFT_THREADS intra-op threads and the
    verifier keeps the rest; an export on Core ML or an NPU provider leaves the verifier every core."""
    from types import SimpleNamespace

    from mirrorsd.contracts import computes_on
    from mirrorsd.runtime.backends.onnx_lm import compute_kind
    from mirrorsd.runtime.decode.pipeline.threads import CPU_DRAFT_THREADS, overlap_threads
    from mirrorsd.runtime.drafters import ModelDrafter

    engine = Engine.load(target=str(tiny_folder), draft=str(exports["self-dynamic"]), device="cpu")
    drafter = engine.drafter
    session = next(iter(drafter.lm.sessions.values()))
    assert session.get_session_options().intra_op_num_threads == CPU_DRAFT_THREADS
    assert computes_on(drafter) == "cpu"
    cores = torch.get_num_threads()
    assert overlap_threads(engine.target, drafter) == (max(1, cores - CPU_DRAFT_THREADS), CPU_DRAFT_THREADS)
    on_gpu = SimpleNamespace(computes_on="gpu", threads=None)
    assert overlap_threads(on_gpu, drafter) is None
    for provider in ("CoreMLExecutionProvider", "QNNExecutionProvider", "OpenVINOExecutionProvider"):
        assert compute_kind(provider) == "npu"
        on_npu = ModelDrafter(SimpleNamespace(backend=provider, computes_on=compute_kind(provider)), name="npu")
        assert computes_on(on_npu) == "npu" and overlap_threads(engine.target, on_npu) is None
    assert compute_kind("CUDAExecutionProvider") == "gpu" and compute_kind("CPUExecutionProvider") == "cpu"
