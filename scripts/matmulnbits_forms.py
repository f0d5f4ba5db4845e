"""Which MatMulNBits forms ONNX Runtime's CPU kernel runs fast: 4-bit with integer or float zero points,
8-bit with blocks of 16 and 32 (one 1536 x 8960 projection, M = 1 and 9 rows, 2 threads). Prints the error
against the dequantized weights and ms per call. Why: docs/measurements.md ("GGUF blocks in MatMulNBits").

    .venv/bin/python scripts/matmulnbits_forms.py
"""
import numpy as np, onnxruntime as ort, time
from onnx import helper, TensorProto, numpy_helper
def build(K, N, bits, block, q, scales, zp, float_zp, ACC=4):
    # q: [N, K] ints in [0, 2^bits); pack per MatMulNBits layout: [N, n_blocks, blob]
    nb = K // block
    if bits == 4:
        qq = q.reshape(N, nb, block).astype(np.uint8)
        packed = (qq[..., 0::2] | (qq[..., 1::2] << 4)).astype(np.uint8)
    else:
        packed = q.reshape(N, nb, block).astype(np.uint8)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.astype(np.float32).reshape(N * nb), "S")]
    inputs = ["A", "B", "S"]
    if zp is not None:
        if float_zp:
            inits.append(numpy_helper.from_array(zp.astype(np.float32).reshape(N * nb), "Z"))
        else:
            z = zp.astype(np.uint8).reshape(N, nb)
            if bits == 4:
                if nb % 2: z = np.concatenate([z, np.zeros((N,1),np.uint8)],1)
                z = (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1)
            inits.append(numpy_helper.from_array(z.reshape(-1), "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=block, accuracy_level=ACC)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
K, N = 1536, 8960
for bits, block, float_zp in [(4, 32, False), (4, 32, True), (8, 16, False), (8, 32, False)]:
    q = rng.integers(0, 2**bits, (N, K))
    scales = rng.random((N, K // block)) * 0.01 + 0.001
    zp = rng.random((N, K//block)) * (2**bits - 1) if float_zp else rng.integers(0, 2**bits, (N, K // block))
    W = ((q.reshape(N, K//block, block) - zp[..., None]) * scales[..., None]).reshape(N, K)
    try:
        s = build(K, N, bits, block, q, scales, zp, float_zp)
    except Exception as e:
        print(bits, block, float_zp, "FAIL", str(e)[:200]); continue
    A = rng.standard_normal((1, K)).astype(np.float32)
    y = s.run(None, {"A": A})[0]; ref = A @ W.T
    t = time.perf_counter()
    for _ in range(20): s.run(None, {"A": A})
    dt = (time.perf_counter() - t) / 20
    A9 = rng.standard_normal((9, K)).astype(np.float32); t = time.perf_counter()
    for _ in range(20): s.run(None, {"A": A9})
    dt9 = (time.perf_counter() - t) / 20
    print(bits, block, "floatzp" if float_zp else "intzp", "rel err %.2e" % (np.abs(y - ref).max() / np.abs(ref).max()), "ms M=1 %.2f M=9 %.2f" % (dt*1e3, dt9*1e3))
