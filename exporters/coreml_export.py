"""Draft model -> Core ML `mlprogram` (.mlpackage, iOS 18 / macOS 15) with the KV cache as Core ML state.

coremltools 9.0's PyTorch frontend is tested up to torch 2.7 and fails on this project's torch
("Unsupported fx node alias"), so the program is built with coremltools' MIL builder directly from
the model's weights: the same Llama/Qwen2 decoder as mirrorsd.exporters.decoder, spelled in MIL ops.
That runs on Linux next to any torch (conversion needs no macOS); only predicting needs macOS.

The program decodes one token per call (the Neural Engine wants static shapes):

    inputs  input_ids [1, 1] int32, position [1] int32 (the write pointer),
            attention_mask [1, 1, 1, max_context] fp16 (additive; slots <= position visible)
    states  key_cache, value_cache [layers, kv_heads, max_context, head_dim] fp16
    output  logits [1, 1, vocab] fp32

Each layer writes its new key/value at `position` (slice_update + coreml_update_state) and attends
over the whole cache under the mask, so rollback is moving the pointer on the host, as with ONNX.
Weights are fp16; --quant int4 quantizes them per block of 32 (coremltools.optimize, iOS 18).
Compute units: CPU_AND_NE (recorded in the manifest; Core ML takes it at load time).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mirrorsd.errors import ExportError
from mirrorsd.export_format import MASK_MIN
from mirrorsd.exporters.decoder import model_dims

PACKAGE = "draft.mlpackage"
COMPUTE_UNITS = "CPU_AND_NE"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def build_program(model, max_context: int):
    """The MIL program for one decode step of `model` (fp32 ops; fp16 states)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    cfg = model.config
    dims = model_dims(cfg)
    n_layers, nkv, nh, d, hidden = dims["layers"], dims["kv_heads"], dims["heads"], dims["head_dim"], dims["hidden"]
    groups, s = nh // nkv, max_context
    inner = model.model
    eps = float(cfg.rms_norm_eps)
    with torch.no_grad():
        positions = torch.arange(s)[None]
        cos, sin = inner.rotary_emb(torch.zeros(1, s, hidden), positions)  # [1, S, d]
    cos_table, sin_table = _np(cos[0]), _np(sin[0])
    cache_shape = (n_layers, nkv, s, d)

    def rms_norm(x, weight, name):
        var = mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[-1], keep_dims=True)
        x = mb.mul(x=x, y=mb.rsqrt(x=var, epsilon=eps))
        return mb.mul(x=x, y=_np(weight), name=name)

    def linear(x, module):
        bias = None if module.bias is None else _np(module.bias)
        return mb.linear(x=x, weight=_np(module.weight), bias=bias)

    def rope(x, cos_row, sin_row):  # x [1, heads, 1, d]
        half = d // 2
        x1 = mb.slice_by_index(x=x, begin=[0, 0, 0, 0], end=[0, 0, 0, half], end_mask=[True, True, True, False])
        x2 = mb.slice_by_index(x=x, begin=[0, 0, 0, half], end=[0, 0, 0, d], end_mask=[True, True, True, True])
        rotated = mb.concat(values=[mb.mul(x=x2, y=-1.0), x1], axis=-1)
        return mb.add(x=mb.mul(x=x, y=cos_row), y=mb.mul(x=rotated, y=sin_row))

    @mb.program(input_specs=[mb.TensorSpec((1, 1), dtype=types.int32), mb.TensorSpec((1,), dtype=types.int32),
                             mb.TensorSpec((1, 1, 1, s), dtype=types.fp16),
                             mb.StateTensorSpec(cache_shape, dtype=types.fp16),
                             mb.StateTensorSpec(cache_shape, dtype=types.fp16)],
                opset_version=ct.target.iOS18)
    def prog(input_ids, position, attention_mask, key_cache, value_cache):
        mask = mb.cast(x=attention_mask, dtype="fp32")
        h = mb.gather(x=_np(inner.embed_tokens.weight), indices=input_ids, axis=0)  # [1, 1, H]
        cos_row = mb.reshape(x=mb.gather(x=cos_table, indices=position, axis=0), shape=[1, 1, 1, d])
        sin_row = mb.reshape(x=mb.gather(x=sin_table, indices=position, axis=0), shape=[1, 1, 1, d])
        zero = np.array([0], dtype=np.int32)
        one = np.array([1], dtype=np.int32)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = rms_norm(h, layer.input_layernorm.weight, f"ln1_{i}")
            q = mb.transpose(x=mb.reshape(x=linear(x, attn.q_proj), shape=[1, 1, nh, d]), perm=[0, 2, 1, 3])
            k = mb.transpose(x=mb.reshape(x=linear(x, attn.k_proj), shape=[1, 1, nkv, d]), perm=[0, 2, 1, 3])
            v = mb.transpose(x=mb.reshape(x=linear(x, attn.v_proj), shape=[1, 1, nkv, d]), perm=[0, 2, 1, 3])
            q, k = rope(q, cos_row, sin_row), rope(k, cos_row, sin_row)
            begin = mb.concat(values=[np.array([i], dtype=np.int32), zero, position, zero], axis=0)
            end = mb.concat(values=[np.array([i + 1, nkv], dtype=np.int32), mb.add(x=position, y=one),
                                    np.array([d], dtype=np.int32)], axis=0)
            caches = []
            for state, new in ((key_cache, k), (value_cache, v)):
                updated = mb.slice_update(x=mb.read_state(input=state), update=mb.cast(x=new, dtype="fp16"),
                                          begin=begin, end=end)
                mb.coreml_update_state(state=state, value=updated)
                layer_cache = mb.slice_by_index(x=updated, begin=[i, 0, 0, 0], end=[i + 1, nkv, s, d])
                caches.append(mb.cast(x=layer_cache, dtype="fp32"))  # [1, nkv, S, d]
            keys, values = caches
            qg = mb.reshape(x=q, shape=[1, nkv, groups, d])  # head h reads kv head h // groups
            scores = mb.matmul(x=qg, y=keys, transpose_y=True)  # [1, nkv, groups, S]
            scores = mb.add(x=mb.mul(x=scores, y=float(d ** -0.5)), y=mask)
            probs = mb.softmax(x=scores, axis=-1)
            out = mb.reshape(x=mb.matmul(x=probs, y=values), shape=[1, 1, nh * d])
            h = mb.add(x=h, y=linear(out, attn.o_proj))
            x = rms_norm(h, layer.post_attention_layernorm.weight, f"ln2_{i}")
            mlp = layer.mlp
            gated = mb.mul(x=mb.silu(x=linear(x, mlp.gate_proj)), y=linear(x, mlp.up_proj))
            h = mb.add(x=h, y=linear(gated, mlp.down_proj))
        h = rms_norm(h, inner.norm.weight, "final_norm")
        return mb.cast(x=linear(h, model.lm_head), dtype="fp32", name="logits")

    return prog


def export_coreml(model, out: Path, max_context: int, quant: str) -> tuple[dict, dict]:
    """Write out/draft.mlpackage; returns (graphs, manifest extras)."""
    import coremltools as ct

    model = model.float().eval()
    prog = build_program(model, max_context)
    mlmodel = ct.convert(prog, minimum_deployment_target=ct.target.iOS18, convert_to="mlprogram",
                         compute_precision=ct.precision.FLOAT16, skip_model_load=True)
    if quant == "int4":
        from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig, linear_quantize_weights

        config = OptimizationConfig(global_config=OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=32))
        mlmodel = linear_quantize_weights(mlmodel, config)
    mlmodel.save(str(out / PACKAGE))
    dims = model_dims(model.config)
    cache = [dims["layers"], dims["kv_heads"], max_context, dims["head_dim"]]
    io = {"decode": {
        "inputs": [{"name": "input_ids", "shape": [1, 1], "dtype": "int32"},
                   {"name": "position", "shape": [1], "dtype": "int32"},
                   {"name": "attention_mask", "shape": [1, 1, 1, max_context], "dtype": "float16"}],
        "states": [{"name": "key_cache", "shape": cache, "dtype": "float16"},
                   {"name": "value_cache", "shape": cache, "dtype": "float16"}],
        "outputs": [{"name": "logits", "shape": [1, 1, dims["vocab"]], "dtype": "float32"}]}}
    return ({"decode": {"file": PACKAGE, "block": 1}},
            {"io": io, "deployment_target": "iOS18", "compute_units": COMPUTE_UNITS, "mask_min": MASK_MIN})


def check_coreml_spec(folder: Path, manifest: dict) -> dict:
    """Check the package's spec against the manifest: inputs, states, outputs, shapes, precision.
    Works anywhere coremltools installs (reads the spec; loads nothing into Core ML)."""
    import coremltools as ct
    from coremltools.proto import FeatureTypes_pb2 as ft

    path = folder / manifest["graphs"]["decode"]["file"]
    if not path.exists():
        raise ExportError(f"{path} is missing", "re-run `mirrorsd export --format coreml`")
    try:
        spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    except Exception as exc:
        raise ExportError(f"{path} is not a readable Core ML package: {exc}", "re-run the export") from exc
    dtypes = {ft.ArrayFeatureType.FLOAT16: "float16", ft.ArrayFeatureType.FLOAT32: "float32",
              ft.ArrayFeatureType.INT32: "int32"}

    def arrays(features, state=False):
        found = {}
        for f in features:
            arr = f.type.stateType.arrayType if state else f.type.multiArrayType
            found[f.name] = {"shape": list(arr.shape), "dtype": dtypes.get(arr.dataType, str(arr.dataType))}
        return found

    io = manifest["io"]["decode"]
    got = {"inputs": arrays(spec.description.input), "states": arrays(spec.description.state, state=True),
           "outputs": arrays(spec.description.output)}
    problems = []
    for kind in ("inputs", "states", "outputs"):
        for want in io[kind]:
            have = got[kind].get(want["name"])
            if have is None:
                problems.append(f"{kind[:-1]} {want['name']} missing")
            elif have["shape"] != want["shape"] or have["dtype"] != want["dtype"]:
                problems.append(f"{want['name']}: {have} != {want['shape']} {want['dtype']}")
    if spec.WhichOneof("Type") != "mlProgram":
        problems.append(f"model type {spec.WhichOneof('Type')}, expected mlProgram")
    if spec.specificationVersion < 9:
        problems.append(f"specification version {spec.specificationVersion} < 9 (iOS 18 / macOS 15, states)")
    return {"ok": not problems, "problems": problems, "specification_version": spec.specificationVersion, **got}
