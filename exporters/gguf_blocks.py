"""A GGUF's own quantized blocks carried into ONNX Runtime's `MatMulNBits`, without re-rounding
(`mirrorsd export --quant gguf`).

`MatMulNBits` dequantizes `w = scale * (code - zero_point)` per block, with integer zero points on its
fast CPU path (float zero points run ~100x slower: docs/measurements.md). Each GGUF type maps as:

| GGUF | its weight | MatMulNBits form |
|---|---|---|
| Q4_0 | d * (q - 8) | 4-bit, block 32, zp 8 |
| Q8_0 | d * q (signed) | 8-bit, block 32, codes q + 128, zp 128 |
| Q5_0 | d * (q - 16) | 8-bit, block 32, zp 16 |
| Q6_K | d * sc * (q - 32) | 8-bit, block 16, scale d*sc, zp 32 |
| Q4_1 / Q5_1 | d * q + m | 4- / 8-bit, block 32, zp 0, correction -m |
| Q4_K / Q5_K | d * sc * q - dmin * m | 4- / 8-bit, block 32, scale d*sc, zp 0, correction dmin*m |

The affine types need a correction the kernel cannot take: `A @ W^T = MatMulNBits(A; codes, scale, zp 0)
- BlockSums(A) @ correction^T`, a ReduceSum over each block of the activations and a small float MatMul
(K/32 columns). Every scale and correction is a product of the file's fp16 factors and small integers,
exact in float32, and `carry` checks that the carried form gives back gguf-py's own dequantization
bit for bit before it is used. Types without a form here (Q2_K, Q3_K, IQ*) stay float32 (exact, larger)
and the export's manifest counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# gguf type name -> (bits, block, zero point or None when the type has a per-block correction)
FORMS = {"Q4_0": (4, 32, 8), "Q8_0": (8, 32, 128), "Q5_0": (8, 32, 16), "Q6_K": (8, 16, 32),
         "Q4_1": (4, 32, 0), "Q5_1": (8, 32, 0), "Q4_K": (4, 32, 0), "Q5_K": (8, 32, 0)}


@dataclass
class Carried:
    """One weight matrix [N, K] as MatMulNBits operands: w = scales * (codes - zero_point) - correction."""

    qtype: str
    bits: int
    block: int
    zero_point: int
    codes: np.ndarray               # [N, K] uint8
    scales: np.ndarray              # [N, K / block] float32
    correction: np.ndarray | None   # [N, K / block] float32, or None


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    return raw[:, start:start + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def block_factors(qtype: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(scales, correction) per MatMulNBits block, from the headers of raw GGUF blocks [blocks, bytes];
    each row gives the blocks of one GGUF block in order (Q6_K: 16 of 16, the K types: 8 of 32)."""
    import gguf

    if qtype in ("Q4_0", "Q8_0", "Q5_0"):
        return _f16(raw, 0), None
    if qtype in ("Q4_1", "Q5_1"):
        return _f16(raw, 0), -_f16(raw, 2)
    if qtype in ("Q4_K", "Q5_K"):
        sc, m = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16].copy())
        return _f16(raw, 0) * sc.astype(np.float32), _f16(raw, 2) * m.astype(np.float32)
    if qtype == "Q6_K":
        sc = raw[:, 192:208].copy().view(np.int8).astype(np.float32)
        return _f16(raw, 208) * sc, None
    raise KeyError(qtype)


def carry(qtype: str, raw: np.ndarray, shape: tuple[int, int], weights: np.ndarray) -> Carried | None:
    """The carried form of one GGUF tensor (raw: its blocks as uint8, shape: [N, K], weights: gguf-py's
    float32 dequantization of it), or None where the type has no form here or the check fails."""
    if qtype not in FORMS:
        return None
    bits, block, zp = FORMS[qtype]
    n, k = shape
    nb = k // block
    scales, correction = block_factors(qtype, raw.reshape(-1, _block_bytes(qtype)))
    scales = scales.reshape(n, nb)
    correction = None if correction is None else correction.reshape(n, nb)
    w = weights.reshape(n, nb, block)
    shifted = w if correction is None else w + correction[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scales[..., None] == 0, 0.0, np.rint(shifted / scales[..., None]))
    codes = q + (zp if correction is None else 0)
    if not np.isfinite(codes).all() or codes.min() < 0 or codes.max() >= 2 ** bits:
        return None
    carried = Carried(qtype, bits, block, zp, codes.astype(np.uint8).reshape(n, k), scales.astype(np.float32),
                      None if correction is None else correction.astype(np.float32))
    return carried if np.array_equal(dequantize(carried), weights.reshape(n, k)) else None


def dequantize(c: Carried) -> np.ndarray:
    """The float32 weights [N, K] of a carried form, rounded as gguf-py (and llama.cpp) round them."""
    n, k = c.codes.shape
    q = c.codes.reshape(n, -1, c.block).astype(np.float32) - np.float32(c.zero_point)
    w = c.scales[..., None] * q  # exact: a small integer times a product of fp16 factors
    if c.correction is not None:
        w = w - c.correction[..., None]
    return w.reshape(n, k).astype(np.float32)


def _block_bytes(qtype: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return size


@dataclass
class GGUFMatrices:
    """The 2-D quantized tensors of a GGUF file, found by their rows' values (an exported graph holds
    the same floats, possibly with rows reordered, as transformers does for llama's q and k)."""

    tensors: dict[str, object]                       # name -> gguf ReaderTensor
    rows: dict[tuple[int, int], dict[int, tuple[str, int]]]  # shape -> {row hash: (name, row)}

    @classmethod
    def read(cls, path: Path) -> GGUFMatrices:
        import gguf

        reader = gguf.GGUFReader(str(path))
        tensors, rows = {}, {}
        for t in reader.tensors:
            if len(t.shape) != 2 or t.tensor_type.name in ("F32", "F16", "BF16"):
                continue
            weights = gguf.quants.dequantize(t.data, t.tensor_type)  # [N, K]
            tensors[t.name] = t
            index = rows.setdefault(weights.shape, {})
            for i, row in enumerate(weights):
                index.setdefault(hash(row.tobytes()), (t.name, i))
        return cls(tensors, rows)

    def find(self, weight_t: np.ndarray) -> tuple[Carried | None, str, str]:
        """(carried form, GGUF tensor name, GGUF type) of a graph weight given as [N, K]; the carried form
        is None when no GGUF tensor holds these rows, or its type has no MatMulNBits form here."""
        index = self.rows.get(weight_t.shape, {})
        hits = [index.get(hash(row.tobytes())) for row in weight_t]
        names = {h[0] for h in hits if h is not None}
        if len(names) != 1 or any(h is None for h in hits):
            return None, "", ""
        name = names.pop()
        t = self.tensors[name]
        order = np.array([h[1] for h in hits])
        raw = np.asarray(t.data).reshape(weight_t.shape[0], -1)[order]  # whole GGUF blocks per row
        # the graph's rows are the tensor's dequantized rows (matched above); carry() checks its form
        # reproduces them exactly, so a hash collision cannot slip through
        return carry(t.tensor_type.name, raw, weight_t.shape, weight_t), name, t.tensor_type.name


def carry_gguf_blocks(src: Path, dst: Path, gguf_path: Path) -> dict:
    """Rewrite the float32 graph `src` into `dst`: every weight MatMul whose matrix is one of the GGUF's
    quantized tensors becomes MatMulNBits on that tensor's own blocks. Returns the manifest's account
    {"carried": {type: count}, "float32": {reason: count}}."""
    import onnx
    from onnx import helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    from mirrorsd.errors import ExportError
    from mirrorsd.exporters.onnx_files import save_external

    model = onnx.load(str(src), load_external_data=False)  # weights read one at a time (a 1.5b is 7 GB)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    found = GGUFMatrices.read(gguf_path)
    carried: dict[str, int] = {}
    kept: dict[str, int] = {}
    nodes = []
    for node in graph.node:
        b = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if b is None or len(b.dims) != 2 or b.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        weight_t = np.ascontiguousarray(_array(b, src.parent).T)  # [N, K]
        c, _, qtype = found.find(weight_t)
        if c is None:
            reason = f"{qtype} (no MatMulNBits form)" if qtype else "not a quantized tensor of the GGUF"
            kept[reason] = kept.get(reason, 0) + 1
            nodes.append(node)
            continue
        carried[c.qtype] = carried.get(c.qtype, 0) + 1
        new_nodes, new_inits = _matmulnbits(node, c)
        nodes.extend(new_nodes)
        graph.initializer.extend(new_inits)
    if not carried:
        raise ExportError(f"none of the graph's weights are quantized tensors of {gguf_path.name}",
                          "pass the GGUF this model was loaded from, or use --quant int4")
    used = {i for n in nodes for i in n.input}
    keep = [i for i in graph.initializer if i.name in used]
    for tensor in keep:
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(src.parent))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    del graph.initializer[:]
    graph.initializer.extend(keep)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save_external(model, dst)
    return {"carried": carried, "float32": kept}


def _array(tensor, folder: Path) -> np.ndarray:
    """A float32 initializer's values, read from its external data file without loading the others."""
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    count = int(np.prod(tensor.dims))
    data = np.fromfile(folder / info["location"], np.float32, count, offset=int(info.get("offset", 0)))
    return data.reshape(tuple(tensor.dims))


def _matmulnbits(node, c: Carried):
    """MatMulNBits nodes and initializers computing node's MatMul on the carried blocks."""
    from onnx import helper, numpy_helper

    n, k = c.codes.shape
    nb = k // c.block
    name = node.name or node.output[0]
    if c.bits == 4:
        q = c.codes.reshape(n, nb, c.block)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        zp = np.full((n, (nb + 1) // 2), (c.zero_point | (c.zero_point << 4)), np.uint8)
    else:
        packed = c.codes.reshape(n, nb, c.block)
        zp = np.full((n, nb), c.zero_point, np.uint8)
    inits = [numpy_helper.from_array(np.ascontiguousarray(packed, np.uint8), f"{name}_Q"),
             numpy_helper.from_array(c.scales.reshape(-1), f"{name}_scales"),
             numpy_helper.from_array(zp.reshape(-1), f"{name}_zp")]
    out = node.output[0] if c.correction is None else f"{name}_nbits"
    nodes = [helper.make_node("MatMulNBits", [node.input[0], f"{name}_Q", f"{name}_scales", f"{name}_zp"], [out],
                              name=f"{name}_MatMulNBits", domain="com.microsoft", K=k, N=n, bits=c.bits,
                              block_size=c.block, accuracy_level=4)]
    if c.correction is not None:
        # the activations summed per block, times each block's offset: [..., K] -> [-1, nb] -> [-1, N]
        # (batch 1 graphs: the [-1, N] correction broadcasts against the [1, T, N] product)
        inits += [numpy_helper.from_array(np.array([-1, nb, c.block], np.int64), f"{name}_blockshape"),
                  numpy_helper.from_array(np.array([-1], np.int64), f"{name}_lastaxis"),
                  numpy_helper.from_array(np.ascontiguousarray(c.correction.T), f"{name}_offsets")]
        nodes += [helper.make_node("Reshape", [node.input[0], f"{name}_blockshape"], [f"{name}_blocks"]),
                  helper.make_node("ReduceSum", [f"{name}_blocks", f"{name}_lastaxis"], [f"{name}_sums"], keepdims=0),
                  helper.make_node("MatMul", [f"{name}_sums", f"{name}_offsets"], [f"{name}_shift"]),
                  helper.make_node("Sub", [out, f"{name}_shift"], [node.output[0]])]
    return nodes, inits
