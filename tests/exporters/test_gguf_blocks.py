"""`--quant gguf`: a GGUF's own blocks in MatMulNBits. Files quantized by llama.cpp's own quantizer
(llama_model_quantize) from a tiny random Llama 256 wide (K-quants need rows of 256): every carried form
gives back gguf-py's dequantization bit for bit, the exported graph computes the GGUF model's logits
(exactly, with float activations), its verify passes are batch-invariant, speculation on it is token-equal
to its target-only decoding, and bad input is a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import onnx
import pytest
import torch

from gguf_files import load_gguf_weights, quantize_gguf, write_llama_gguf
from helpers import invariance_tokens, run
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError, ExportError
from mirrorsd.exporters import export_target, read_manifest, validate_export
from mirrorsd.exporters.gguf_blocks import FORMS, carry, dequantize
from mirrorsd.runtime.backends.invariance import check_batch_invariance
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter

PROMPTS = ["def quicksort(arr):\n    if len(arr) <= 1:", "The quick brown fox", "import numpy as np\n"]


def wide_llama(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory, tokenizer):
    return write_llama_gguf(wide_llama(tokenizer), tmp_path_factory.mktemp("gguf") / "wide-f32.gguf")


@pytest.fixture(scope="module")
def q4km(tmp_path_factory, tokenizer, f32_gguf):
    """(model with the Q4_K_M file's weights, the file, its gguf export)."""
    root = tmp_path_factory.mktemp("q4km")
    path = quantize_gguf(f32_gguf, root / "wide-q4km.gguf", "Q4_K_M")
    model = load_gguf_weights(wide_llama(tokenizer), path)
    export_target(model, root / "export", quant="gguf", gguf=path, max_context=256, tokenizer=tokenizer)
    return model, path, root / "export"


@pytest.mark.parametrize("ftype, types", [("Q4_0", {"Q4_0"}), ("Q4_1", {"Q4_1"}), ("Q5_0", {"Q5_0"}),
                                          ("Q5_1", {"Q5_1"}), ("Q8_0", {"Q8_0"}), ("Q4_K_M", {"Q4_K", "Q6_K"}),
                                          ("Q5_K_M", {"Q5_K", "Q6_K"})])
def test_every_carried_form_gives_back_the_gguf_weights_bit_for_bit(tmp_path, f32_gguf, ftype, types):
    path = quantize_gguf(f32_gguf, tmp_path / f"{ftype}.gguf", ftype)
    seen = set()
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type.name not in FORMS:
            continue
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
        c = carry(t.tensor_type.name, np.asarray(t.data).reshape(weights.shape[0], -1), weights.shape, weights)
        assert c is not None, t.name
        assert (c.bits, c.block) == FORMS[c.qtype][:2] and c.codes.max() < 2 ** c.bits
        assert np.array_equal(dequantize(c), weights), t.name
        seen.add(c.qtype)
    assert types <= seen


def test_the_export_carries_every_weight_matrix_and_says_so(q4km):
    manifest = read_manifest(q4km[2])
    graph = manifest["graphs"]["model"]
    assert graph["carried"] == {"Q4_K": 12, "Q6_K": 3} and graph["float32"] == {}  # 2 layers x 7 + LM head
    assert manifest["quant"] == "gguf" and "not re-rounded" in manifest["quant_form"]
    assert manifest["source"] == {"model": "in-memory model", "weights": "GGUF blocks, carried into MatMulNBits",
                                  "gguf": "wide-q4km.gguf"}
    model = onnx.load(str(q4km[2] / "model.onnx"), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    weight_matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert all(n.input[1].endswith("_offsets") for n in weight_matmuls)  # only the Q4_K corrections stay float
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 15


def test_with_float_activations_the_graph_computes_the_gguf_models_logits(q4km, tokenizer, tmp_path):
    """accuracy_level 0 (float32 activations) isolates the weights: the carried blocks are the GGUF's.
    The export itself runs accuracy_level 4 (int8 activations, as llama.cpp quantizes them for K-quants)."""
    model, _, export = q4km
    graph = onnx.load(str(export / "model.onnx"))
    for node in graph.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                assert attr.i == 4
                attr.i = 0
    exact = tmp_path / "exact"
    exact.mkdir()
    for f in export.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            (exact / f.name).write_bytes(f.read_bytes())
    (exact / "tokenizer").mkdir()
    for f in (export / "tokenizer").iterdir():
        (exact / "tokenizer" / f.name).write_bytes(f.read_bytes())
    onnx.save_model(graph, str(exact / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    report = validate_export(exact, model=model, tokenizer=tokenizer)
    assert report["max_abs_logit_diff"] < 1e-4 and report["greedy_equal"] == "4/4"


def test_the_gguf_export_is_batch_invariant_and_declared_so(q4km):
    """Q4_K and Q6_K blocks in MatMulNBits with int8 activations: every row of a verify pass of 1..17
    positions equals one-token decoding bit for bit, after whole and chunked prefills."""
    lm = Engine.load(str(q4km[2]), draft=None).target
    assert lm.exact_batches
    report = check_batch_invariance(lm, invariance_tokens(300, 230), offsets=(9, 200))
    assert report.exact, report.summary()


@pytest.mark.parametrize("pipeline", ["off", "overlap"])
def test_speculation_on_the_gguf_export_is_token_equal_to_its_target_only(q4km, pipeline):
    model, _, export = q4km
    engine = Engine.load(str(export), draft=None)
    engine.eos_ids = frozenset()
    for drafter in (NGramDrafter(), ModelDrafter(TorchCausalLM(model))):
        spec = engine.with_drafter(drafter, helper=None)
        for prompt in PROMPTS:
            want = engine.generate(prompt, GenerationConfig(max_new_tokens=32)).token_ids
            got = spec.generate(prompt, GenerationConfig(max_new_tokens=32, num_draft_tokens=4,
                                                         pipeline=pipeline)).token_ids
            assert got == want, (type(drafter).__name__, prompt)


def test_bad_input_is_a_clear_error(q4km, tokenizer, target_model, tmp_path, f32_gguf, tiny_folder):
    model, path, _ = q4km
    cli = run("export", "--model", str(tiny_folder), "--role", "target", "--quant", "gguf", "--out", str(tmp_path / "x"))
    assert cli.returncode != 0 and "mirrorsd: error:" in cli.stderr and "not a GGUF" in cli.stderr
    assert "Traceback" not in cli.stderr and not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="not a GGUF"):
        export_target(target_model, tmp_path / "a", quant="gguf", tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="not found"):
        export_target(model, tmp_path / "b", quant="gguf", gguf=tmp_path / "missing.gguf", tokenizer=tokenizer)
    with pytest.raises(ExportError, match="none of the graph's weights"):  # another model's file
        export_target(target_model, tmp_path / "c", quant="gguf", gguf=path, tokenizer=tokenizer)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ConfigError, match="MatMulNBits"):
        from mirrorsd.exporters import export_draft

        export_draft(model, tmp_path / "d", profile="npu", quant="gguf", gguf=path, tokenizer=tokenizer)


def test_a_matrix_the_file_does_not_hold_stays_float32_and_is_counted(tokenizer, tmp_path, q4km, f32_gguf):
    _, path, _ = q4km
    model = load_gguf_weights(wide_llama(tokenizer), path)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0  # no longer the file's output.weight
    manifest = export_target(model, tmp_path / "e", quant="gguf", gguf=path, tokenizer=tokenizer, validate=False)
    assert manifest["graphs"]["model"]["carried"] == {"Q4_K": 12, "Q6_K": 2}
    assert manifest["graphs"]["model"]["float32"] == {"not a quantized tensor of the GGUF": 1}
    assert "1 weight matrices kept float32" in manifest["quant_form"]
    with pytest.raises(ExportError, match="none of the graph's weights"):  # an F32 file has no blocks to carry
        export_target(load_gguf_weights(wide_llama(tokenizer), f32_gguf), tmp_path / "f", quant="gguf",
                        gguf=f32_gguf, tokenizer=tokenizer)
