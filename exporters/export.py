"""`export_draft` / `export_target`: one call (and `mirrorsd export`) from a model to a validated export
folder. A draft export is a small model for an NPU (static profile) or a CPU/GPU provider; a target
export is the target itself in the dynamic profile, scoring K+1 tokens per call (`--backend onnx`)."""

from __future__ import annotations

import platform
import shutil
import time
from pathlib import Path

from mirrorsd.errors import ConfigError, ExportError
from mirrorsd.export_format import TOKENIZER_DIR
from mirrorsd.exporters.decoder import model_dims
from mirrorsd.exporters.manifest import write_manifest
from mirrorsd.exporters.phases import PhaseLog, quiet_tools
from mirrorsd.exporters.validate import PROMPTS, Limits

ROLES = ("draft", "target")
ROLE_ALIASES = {"verifier": "target"}  # the earlier spelling, still accepted
FORMATS = ("onnx", "coreml")
PROFILES = ("npu", "dynamic")
PRECISIONS = ("fp32", "fp16")
QUANTS = ("none", "int8", "int4", "gguf")


def _check_options(role: str, fmt: str, profile: str, precision: str, quant: str, max_context: int,
                   prefill_chunk: int) -> None:
    for value, allowed, what in ((role, ROLES, "role"), (fmt, FORMATS, "format"), (profile, PROFILES, "profile"),
                                 (precision, PRECISIONS, "precision"), (quant, QUANTS, "quant")):
        if value not in allowed:
            raise ConfigError(f"unknown {what} {value!r}", f"use one of {', '.join(allowed)}")
    if role == "target" and (fmt != "onnx" or profile != "dynamic"):
        raise ConfigError("a target export is ONNX in the dynamic profile: it scores a variable number of "
                          "drafted tokens per call", "mirrorsd export --role target --model M --out DIR "
                          "[--quant int4|int8] [--precision fp16]")
    if quant != "none" and precision != "fp32":
        raise ConfigError("quantized exports start from fp32 weights", "pass --precision fp32 with --quant")
    if quant == "gguf" and (fmt != "onnx" or profile != "dynamic"):
        raise ConfigError("--quant gguf carries a GGUF's blocks into MatMulNBits, a CPU/GPU provider format",
                          "use --format onnx --profile dynamic with --quant gguf")
    if fmt == "onnx" and quant == "int4" and profile == "npu":
        raise ConfigError("4-bit MatMulNBits is a CPU/GPU provider format; NPU providers do not take it",
                          "use --profile dynamic with --quant int4, or --quant int8 (QDQ) for the NPU profile")
    if fmt == "coreml" and (quant == "int8" or profile == "dynamic"):
        raise ConfigError("Core ML exports are static (KV cache as state) with fp16 or int4/palettized weights",
                          "use --format coreml [--quant int4]")
    if max_context < 16 or not 1 < prefill_chunk <= max_context:
        raise ConfigError(f"max_context {max_context} / prefill_chunk {prefill_chunk} out of range",
                          "use e.g. --max-context 1024 (prefill chunk 2..max_context)")


def providers_for(fmt: str, profile: str, quant: str) -> list[str]:
    """The providers an export is built for (recorded in the manifest)."""
    if fmt == "coreml":
        return ["CoreML (CPU_AND_NE)"]
    if profile == "npu":
        npu = ["QNNExecutionProvider", "OpenVINOExecutionProvider", "VitisAIExecutionProvider"] if quant == "int8" \
            else ["CoreMLExecutionProvider", "OpenVINOExecutionProvider", "DmlExecutionProvider"]
        return npu + ["CPUExecutionProvider"]
    gpu = ["CUDAExecutionProvider", "DmlExecutionProvider"] if quant != "int8" else []
    return ["CPUExecutionProvider", *gpu]


def export_target(model, out: str | Path, precision: str = "fp32", quant: str = "int4", max_context: int = 4096,
                    tokenizer=None, validate: bool = True, progress: bool = False, **options) -> dict:
    """Export a target model for the ONNX Runtime backend (`Engine.load(out)`, `--backend onnx`).
    options: gguf, phases, verbose, limits (as export_draft)."""
    return export_draft(model, out, role="target", profile="dynamic", precision=precision, quant=quant,
                        max_context=max_context, tokenizer=tokenizer, validate=validate, progress=progress, **options)


def export_draft(model, out: str | Path, fmt: str = "onnx", profile: str | None = None, precision: str = "fp32",
                 quant: str = "none", max_context: int = 1024, prefill_chunk: int = 16, tokenizer=None,
                 validate: bool = True, progress: bool = False, role: str = "draft", phases: PhaseLog | None = None,
                 verbose: bool = False, limits: Limits | None = None, gguf: str | Path | None = None) -> dict:
    """Export a model; returns the manifest (with a "validation" report unless validate=False).

    model: a model argument (catalog name, folder, .gguf) or an in-memory transformers model (then
    pass its tokenizer). out: the export folder (replaced if it holds an earlier export).
    role: "draft" or "target" (see export_target). profile: default npu for a draft, dynamic for a target.
    phases: times the load/export/quantize/validate phases and tells its listener (the CLI's display);
    verbose: let the tools' own logs and warnings through; limits: validation thresholds.
    quant "gguf": the GGUF's own blocks in MatMulNBits (exporters/gguf_blocks.py); the GGUF is the model
    argument's (a catalog name or a .gguf path), or `gguf` for an in-memory model loaded from one.
    """
    role = ROLE_ALIASES.get(role, role)
    profile = profile or ("dynamic" if role == "target" else "npu")
    _check_options(role, fmt, profile, precision, quant, max_context, prefill_chunk)
    phases = phases or PhaseLog()
    gguf_path = _gguf_source(model, gguf) if quant == "gguf" else None
    with quiet_tools(verbose):
        spec = model if isinstance(model, str) else None
        if spec is not None:
            import torch

            from mirrorsd.models import load_model

            with phases.phase("load", spec):
                model, tokenizer = load_model(spec, torch.device("cpu"), torch.float32, progress)
        if tokenizer is None:
            raise ConfigError("an in-memory model needs its tokenizer", "export_draft(model, out, tokenizer=tok)")
        manifest = _export(model, tokenizer, spec, Path(out), role, fmt, profile, precision, quant, max_context,
                           prefill_chunk, phases, gguf_path)
        if validate:
            from mirrorsd.exporters.validate import validate_export

            with phases.phase("validate", "against PyTorch on the CPU provider"):
                manifest["validation"] = validate_export(out, model=model, tokenizer=tokenizer, limits=limits or Limits())
        else:
            phases.skip("validate", "not asked")
    manifest["phase_seconds"] = dict(phases.seconds)
    write_manifest(Path(out), manifest)
    return manifest


def _gguf_source(model, gguf: str | Path | None) -> Path:
    """The GGUF whose blocks `--quant gguf` carries."""
    from mirrorsd import catalog
    from mirrorsd.models import is_gguf

    if gguf is None and isinstance(model, str) and is_gguf(model):
        gguf = catalog.ensure_gguf(model) if model in catalog.CATALOG else model
    if gguf is None:
        raise ConfigError("--quant gguf carries a GGUF file's own blocks, and this model is not a GGUF",
                          "export a catalog model or a .gguf file, or use --quant int4")
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise ConfigError(f"GGUF file not found: {path}", "pass an existing .gguf file")
    return path


def _prepare(out: Path) -> None:
    """An empty `out`: an earlier export there is replaced, anything else is refused."""
    from mirrorsd.export_format import MANIFEST

    if out.exists():
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise ExportError(f"{out} exists and is not an earlier export", "pick an empty or new --out folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def _graphs(model, out: Path, fmt: str, profile: str, max_context: int, prefill_chunk: int, precision: str,
            quant: str, prompts: list[list[int]], phases: PhaseLog, gguf: Path | None = None,
            spare_row: bool = False) -> tuple[dict, dict]:
    if fmt == "onnx":
        from mirrorsd.exporters.onnx_export import OPSET, export_onnx_graphs

        graphs = export_onnx_graphs(model, out, profile, max_context, prefill_chunk, precision, quant, prompts, phases,
                                    gguf, spare_row=spare_row)
        return graphs, {"opset": OPSET, "spare_row": spare_row,
                        "io": _onnx_io(model_dims(model.config), graphs, profile, max_context)}
    from mirrorsd.exporters.coreml_export import export_coreml

    with phases.phase("export", "Core ML mlprogram"):
        result = export_coreml(model, out, max_context, quant)
    phases.skip("quantize", "done in the Core ML conversion" if quant != "none" else "fp16 weights (Core ML)")
    return result


def _export(model, tokenizer, spec: str | None, out: Path, role: str, fmt: str, profile: str, precision: str,
            quant: str, max_context: int, prefill_chunk: int, phases: PhaseLog, gguf: Path | None = None) -> dict:
    """Write the graphs, the tokenizer and the manifest (no validation yet); returns the manifest."""
    from mirrorsd.exporters.decoder import check_supported
    from mirrorsd.exporters.manifest import tool_versions
    from mirrorsd.runtime.backends import eos_ids
    from mirrorsd.tokenizer_check import tokenizer_fingerprint

    check_supported(model.config)
    _prepare(out)
    max_context = min(max_context, int(getattr(model.config, "max_position_embeddings", max_context) or max_context))
    dims = model_dims(model.config)
    source = _source(spec, gguf)
    t0 = time.perf_counter()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    try:
        graphs, extra = _graphs(model, out, fmt, profile, max_context, prefill_chunk, precision, quant, prompts, phases,
                                gguf, spare_row=role == "target")  # a target export's graph is batch-invariant
        tokenizer.save_pretrained(out / TOKENIZER_DIR)  # a target export is loaded without its source model
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-written export left behind
        raise
    manifest = {
        "role": role, "format": fmt, "profile": "npu" if fmt == "coreml" else profile,
        "model": spec or getattr(model.config, "name_or_path", "") or "in-memory model",
        "model_type": model.config.model_type, "dims": dims, "max_context": max_context,
        "prefill_chunk": prefill_chunk if profile == "npu" and fmt == "onnx" else None,
        "graphs": graphs, "vocab_size": dims["vocab"],
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id},
        "eos_ids": sorted(eos_ids(model, tokenizer)), "source": source,
        "precision": "fp16" if fmt == "coreml" else precision, "quant": quant,
        "quant_form": _quant_form(fmt, profile, quant, from_gguf="gguf" in source, graphs=graphs), "providers": providers_for(fmt, profile, quant),
        "tools": tool_versions(), "export_seconds": round(time.perf_counter() - t0, 1),
        "exported_on": platform.platform(), **extra,
    }
    write_manifest(out, manifest)  # validation reads it
    return manifest


def _source(spec: str | None, carried: Path | None = None) -> dict:
    """Where the weights came from. A GGUF's blocks are dequantized to float32 on loading (transformers);
    an int4/int8 export re-rounds those floats, a gguf export carries the file's own blocks."""
    from mirrorsd.models import is_gguf

    if carried is not None:
        return {"model": spec or "in-memory model", "weights": "GGUF blocks, carried into MatMulNBits",
                "gguf": carried.name}
    if spec is None or not is_gguf(spec):
        return {"model": spec or "in-memory model", "weights": "float"}
    gguf = Path(spec).name if spec.endswith(".gguf") else f"{spec}.gguf"  # the catalog keeps <name>.gguf
    return {"model": spec, "weights": "GGUF, dequantized to float32", "gguf": gguf}


def _quant_form(fmt: str, profile: str, quant: str, from_gguf: bool = False, graphs: dict | None = None) -> str:
    if quant == "none":
        return "none"
    if quant == "gguf":
        from mirrorsd.exporters.gguf_blocks import FORMS

        counts: dict[str, int] = {}
        for graph in (graphs or {}).values():
            for qtype, n in graph.get("carried", {}).items():
                counts[qtype] = counts.get(qtype, 0) + n
        forms = "; ".join(f"{q} x{n} as {FORMS[q][0]}-bit, block {FORMS[q][1]}, "
                          + (f"zero point {FORMS[q][2]}" if q not in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
                             else "zero point 0 and a block-sum correction") for q, n in sorted(counts.items()))
        kept = sum(n for graph in (graphs or {}).values() for n in graph.get("float32", {}).values())
        return (f"the GGUF's own blocks in MatMulNBits, not re-rounded ({forms})"
                + (f"; {kept} weight matrices kept float32 (see graphs)" if kept else ""))
    if quant == "int4":
        if fmt == "coreml":
            return "palettized 4-bit (coremltools.optimize)"
        return "MatMulNBits 4-bit, block 32" + (" (LM head 8-bit), requantized from the dequantized GGUF "
                                                "weights, not carried block for block" if from_gguf else " (LM head 8-bit)")
    return "QDQ int8 (static, calibrated)" if profile == "npu" else "dynamic int8 (MatMulInteger)"


def _onnx_io(dims: dict, graphs: dict, profile: str, max_context: int) -> dict:
    """Input/output names and shapes of each graph ("T"/"P" mark dynamic axes)."""
    from mirrorsd.export_format import io_names
    from mirrorsd.exporters.manifest import io_spec

    inputs, outputs = io_names(dims["layers"])
    kv, d, v = dims["kv_heads"], dims["head_dim"], dims["vocab"]
    spec = {}
    for name, graph in graphs.items():
        t = graph["block"] or "T"
        p = max_context if profile == "npu" else "P"
        pt = (p + t) if profile == "npu" else "P+T"
        in_shapes = [[1, t], [1, t], [1, 1, t, pt]] + [[1, kv, p, d]] * (2 * dims["layers"])
        out_shapes = [[1, t, v]] + [[1, kv, t, d]] * (2 * dims["layers"])
        spec[name] = {"inputs": io_spec(inputs, in_shapes, ["int64", "int64"] + ["float32"] * (len(inputs) - 2)),
                      "outputs": io_spec(outputs, out_shapes, ["float32"] * len(outputs))}
    return spec
