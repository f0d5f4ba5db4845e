"""Draft model -> ONNX graphs, in the NPU (static) or dynamic profile, then optional quantization.

Both profiles export `ExplicitCacheDecoder` with `torch.onnx.export` (the dynamo exporter, opset 18)
rather than optimum's exporter: optimum-onnx 0.1.0 needs transformers < 4.58 and this project runs
transformers 5 (pip would downgrade it), and the NPU profile needs a graph of our own anyway
(fixed-size cache in/out, block-sized inputs, explicit positions and mask).

- npu profile: two static graphs sharing the cache layout: `decode.onnx` (block of 1 token) and
  `prefill.onnx` (block of `prefill_chunk` tokens), each with a cache of `max_context` slots.
- dynamic profile: one graph, `model.onnx`, whose block length and past length are dynamic.

Weights go to external data next to each graph (`<graph>.onnx.data`), as large models need.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from mirrorsd.export_format import block_mask, io_names
from mirrorsd.exporters.decoder import ExplicitCacheDecoder
from mirrorsd.exporters.onnx_files import save_external
from mirrorsd.exporters.phases import PhaseLog

OPSET = 18


def graph_blocks(profile: str, prefill_chunk: int) -> dict[str, int | None]:
    """Graph name -> fixed block length (None = dynamic)."""
    return {"decode": 1, "prefill": prefill_chunk} if profile == "npu" else {"model": None}


def export_graph(decoder: ExplicitCacheDecoder, path: Path, block: int | None, cache_slots: int | None) -> None:
    """One graph: static block `block` over a cache of `cache_slots`, or fully dynamic when None."""
    dims = decoder.dims
    t = block or 2
    p = cache_slots or 3
    args = (torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None],
            torch.tensor(block_mask(p, p, t)),
            *[torch.zeros(1, dims["kv_heads"], p, dims["head_dim"]) for _ in range(2 * dims["layers"])])
    inputs, outputs = io_names(dims["layers"])
    dynamic = None
    if block is None:
        T, P, PT = (torch.export.Dim.DYNAMIC,) * 3
        dynamic = ({1: T}, {1: T}, {2: T, 3: PT}, tuple({2: P} for _ in range(2 * dims["layers"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():  # (its warnings: exporters.phases.quiet_tools)
        program = torch.onnx.export(decoder, args, dynamo=True, opset_version=OPSET, input_names=inputs,
                                    output_names=outputs, dynamic_shapes=dynamic, optimize=True, verbose=False)
    program.save(str(path), external_data=True)


def to_fp16(src: Path, dst: Path) -> None:
    """float16 weights and compute, float32 inputs/outputs (the host code stays the same)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    save_external(convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True), dst)


def quantize_dynamic_int8(src: Path, dst: Path) -> None:
    """int8 weights, activations quantized at run time (MatMulInteger): the CPU provider's int8 form."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul", "Gemm"], use_external_data_format=True)


def quantize_int4(src: Path, dst: Path, block_size: int = 32) -> None:
    """4-bit weight-only MatMulNBits (CPU/GPU providers; NPU providers do not take it). The LM head,
    whose errors land straight on the logits, gets 8-bit MatMulNBits instead: on qwen2.5-coder-0.5b
    an all-4-bit export lost 4.7 points of acceptance for the 1.5b target (`mirrorsd draft-bench`)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    head = [n.name for n in model.graph.node if "logits" in n.output and n.op_type == "MatMul"]
    body = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=True, accuracy_level=4,
                                nodes_to_exclude=head)
    body.process()
    model = body.model.model
    if head:
        lm_head = MatMulNBitsQuantizer(model, bits=8, block_size=block_size, is_symmetric=True, accuracy_level=4,
                                       nodes_to_include=head)
        lm_head.process()
        model = lm_head.model.model
    save_external(model, dst)


def quantize_qdq_int8(src: Path, dst: Path, calibration: list[dict]) -> None:
    """Static int8 in QDQ form (QuantizeLinear/DequantizeLinear pairs), the form NPU providers
    (QNN, OpenVINO NPU, VitisAI) compile: per-channel int8 weights, uint8 activations calibrated on
    real inputs, MatMuls quantized (attention softmax and norms stay float)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calibration)

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    nodes_to_quantize=weight_matmuls(src), use_external_data_format=True,
                    extra_options={"ActivationSymmetric": False, "WeightSymmetric": True,
                                   "OpTypesToExcludeOutputQuantization": ["MatMul", "Gemm"]})


def weight_matmuls(path: Path) -> list[str]:
    """MatMul nodes whose second input is a weight: the projections and the LM head. The attention
    products (activation x activation) stay float: quantizing them cost most of the accuracy."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]


def remove_graph(path: Path) -> None:
    for p in (path, path.parent / (path.name + ".data")):
        if p.exists():
            os.remove(p)


def export_onnx_graphs(model, out: Path, profile: str, max_context: int, prefill_chunk: int, precision: str,
                       quant: str, calibration_prompts: list[list[int]], phases: PhaseLog | None = None,
                       gguf: Path | None = None, spare_row: bool = False) -> dict[str, dict]:
    """Write the graphs of one export into `out` (phases "export", then "quantize"); returns
    {graph name: {"file", "block"}} (and, for quant "gguf", what was carried: gguf_blocks).
    spare_row: the batch-invariant graph (ExplicitCacheDecoder), as a target export writes it."""
    phases = phases or PhaseLog()
    blocks = graph_blocks(profile, prefill_chunk)
    raw = out / "fp32"
    with phases.phase("export", f"{len(blocks)} graph(s), {profile} profile, opset {OPSET}"):
        decoder = ExplicitCacheDecoder(model.float(), spare_row=spare_row)
        for name, block in blocks.items():
            export_graph(decoder, raw / f"{name}.onnx", block, max_context if profile == "npu" else None)
    if quant == "none" and precision == "fp32":
        phases.skip("quantize", "fp32 weights kept")
        graphs = _convert(raw, out, blocks, lambda src, dst, name: _move_graph(src, dst))
    else:
        with phases.phase("quantize", f"quant {quant}" if quant != "none" else precision):
            calibration = None
            if quant == "int8" and profile == "npu":
                from mirrorsd.runtime.backends.onnx_lm import calibration_feeds

                calibration = calibration_feeds(raw, blocks, max_context, decoder.dims, calibration_prompts)
            graphs = _convert(raw, out, blocks, _converter(quant, profile, calibration, gguf))
    shutil.rmtree(raw, ignore_errors=True)
    return graphs


def _convert(raw: Path, out: Path, blocks: dict, convert) -> dict[str, dict]:
    graphs = {}
    for name, block in blocks.items():
        dst = out / f"{name}.onnx"
        report = convert(raw / f"{name}.onnx", dst, name)
        graphs[name] = {"file": dst.name, "block": block, **(report or {})}
    return graphs


def _move_graph(src: Path, dst: Path) -> None:
    remove_graph(dst)
    shutil.move(src, dst)
    shutil.move(src.parent / (src.name + ".data"), dst.parent / (dst.name + ".data"))


def _converter(quant: str, profile: str, calibration: dict | None, gguf: Path | None = None):
    """(src, dst, graph name) -> None or a report for the manifest: the fp16 conversion or quantization
    the options ask for."""
    if quant == "gguf":
        from mirrorsd.exporters.gguf_blocks import carry_gguf_blocks

        return lambda src, dst, name: carry_gguf_blocks(src, dst, gguf)
    if quant == "none":
        return lambda src, dst, name: to_fp16(src, dst)
    if quant == "int4":
        return lambda src, dst, name: quantize_int4(src, dst)
    if profile == "npu":
        return lambda src, dst, name: quantize_qdq_int8(src, dst, calibration[name])
    return lambda src, dst, name: quantize_dynamic_int8(src, dst)
