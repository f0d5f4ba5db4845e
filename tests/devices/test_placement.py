"""The placement policy against what five kinds of machine report, and discovery on this one."""

from __future__ import annotations

import pytest

from mirrorsd.devices import EpDevice, ExportInfo, Inventory, TorchBackend, discover, npu_backends, place

CPU_EPS = ("CPUExecutionProvider",)

MACHINES = {
    "mac": Inventory("Darwin", "arm64", "Apple M3 Pro", 12, (TorchBackend("mps", "Apple GPU (Metal)"),
                                                           TorchBackend("cpu", "Apple M3 Pro")),
                     ("CoreMLExecutionProvider", "CPUExecutionProvider"), coreml=True),
    "snapdragon": Inventory("Windows", "ARM64", "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU", 12,
                            (TorchBackend("cpu", "Snapdragon X Elite"),),
                            ("QNNExecutionProvider", "CPUExecutionProvider"),
                            (EpDevice("QNNExecutionProvider", "NPU", "Qualcomm"),
                             EpDevice("CPUExecutionProvider", "CPU", "Qualcomm"))),
    "core-ultra": Inventory("Windows", "AMD64", "Intel(R) Core(TM) Ultra 7 155H", 16,
                            (TorchBackend("xpu", "Intel(R) Arc(TM) Graphics", 0), TorchBackend("cpu", "Core Ultra 7")),
                            ("OpenVINOExecutionProvider", "CPUExecutionProvider")),
    "nvidia": Inventory("Linux", "x86_64", "AMD Ryzen 9 7950X", 32,
                        (TorchBackend("cuda", "NVIDIA GeForce RTX 4090", 0, 24.0), TorchBackend("cpu", "Ryzen 9")),
                        ("CUDAExecutionProvider", "CPUExecutionProvider"),
                        (EpDevice("CPUExecutionProvider", "CPU", "AMD"),)),
    "this": Inventory("Linux", "x86_64", "AMD EPYC", 2, (TorchBackend("cpu", "AMD EPYC"),),
                      ("AzureExecutionProvider", "CPUExecutionProvider"), (EpDevice("CPUExecutionProvider", "CPU"),)),
}

NPU_FP32 = ExportInfo("x/npu", "onnx", "npu", "none")
NPU_INT8 = ExportInfo("x/npu-int8", "onnx", "npu", "int8")
DYN_INT4 = ExportInfo("x/dyn-int4", "onnx", "dynamic", "int4")
COREML = ExportInfo("x/coreml", "coreml", "npu", "none")
ALL = [DYN_INT4, NPU_FP32, NPU_INT8, COREML]

# machine -> (target, draft with every export on offer under --draft auto: (export path, backend) or "chain")
AUTO_TABLE = {
    "mac": ("mps", ("x/coreml", "coreml")),
    "snapdragon": ("cpu", ("x/npu-int8", "QNNExecutionProvider")),  # QNN's HTP runs int8 QDQ best
    "core-ultra": ("xpu:0", ("x/npu-int8", "OpenVINOExecutionProvider")),
    "nvidia": ("cuda:0", "chain"),
    "this": ("cpu", "chain"),
}


@pytest.mark.parametrize("machine", list(AUTO_TABLE))
def test_auto_placement_table(machine):
    target, draft = AUTO_TABLE[machine]
    p = place(MACHINES[machine], ALL)
    assert p.target == target
    got = "chain" if p.draft == "chain" else (p.draft_export, p.draft_backend)
    assert got == draft, p
    assert p.draft_reason and p.target_reason


@pytest.mark.parametrize("machine", list(MACHINES))
def test_without_exports_the_model_free_chain_serves(machine):
    p = place(MACHINES[machine], [])
    assert p.draft == "chain"
    assert ("no compatible exported draft" in p.draft_reason) == bool(npu_backends(MACHINES[machine]))


def test_npus_need_a_compatible_export():
    # QNN takes the static profile; a dynamic int4 export alone is not for the NPU.
    assert place(MACHINES["snapdragon"], [DYN_INT4]).draft == "chain"
    # Without coremltools, the Mac still reaches the ANE through ONNX Runtime's Core ML EP.
    mac_no_ct = Inventory(**{**MACHINES["mac"].__dict__, "coreml": False})
    p = place(mac_no_ct, [COREML, NPU_FP32])
    assert (p.draft_export, p.draft_backend) == ("x/npu", "CoreMLExecutionProvider")
    # OpenVINO without an NPU listed and on a CPU without one is not an NPU.
    plain_intel = Inventory(**{**MACHINES["core-ultra"].__dict__, "cpu": "Intel(R) Core(TM) i7-12700"})
    assert npu_backends(plain_intel) == []
    listed = Inventory(**{**plain_intel.__dict__, "ep_devices": (EpDevice("OpenVINOExecutionProvider", "NPU"),)})
    assert npu_backends(listed)[0][0] == "OpenVINOExecutionProvider"


def test_an_export_asked_for_by_name_runs_on_the_cpu_provider_without_an_npu():
    for machine in ("this", "nvidia"):
        p = place(MACHINES[machine], [NPU_INT8], explicit=True)
        assert (p.draft, p.draft_backend) == ("export", "CPUExecutionProvider")
        assert "no NPU" in p.draft_reason


def test_user_overrides_win():
    p = place(MACHINES["snapdragon"], [NPU_INT8], draft_device="cpu", target_device="cpu")
    assert (p.target, p.draft_backend) == ("cpu", "CPUExecutionProvider") and "asked for" in p.draft_reason
    p = place(MACHINES["nvidia"], [NPU_FP32], explicit=True, draft_device="cuda", target_device="cuda:1")
    assert (p.target, p.draft_backend) == ("cuda:1", "CUDAExecutionProvider")
    p = place(MACHINES["this"], [DYN_INT4], draft_device="qnn")  # QNN cannot run a dynamic int4 export
    assert p.draft == "chain" and "QNNExecutionProvider" in p.draft_reason


def test_discovery_on_this_machine_uses_the_libraries():
    import onnxruntime as ort
    import torch

    inv = discover()
    assert inv.providers == tuple(ort.get_available_providers())
    assert inv.torch[-1].kind == "cpu" and inv.cores >= 1
    assert ("cuda" in [b.kind for b in inv.torch]) == torch.cuda.is_available()
    if hasattr(ort, "get_ep_devices"):
        assert any(d.provider == "CPUExecutionProvider" for d in inv.ep_devices)
