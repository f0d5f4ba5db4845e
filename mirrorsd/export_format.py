"""The format an export is written in, shared by the exporters (which write it) and the runtime (which
reads it): manifest.json, and the I/O layout of the exported decoder graphs (see
mirrorsd.exporters.decoder for the graph itself)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mirrorsd.config import is_plain_file_name
from mirrorsd.errors import ExportError, TokenizerMismatchError
from mirrorsd.tokenizer_check import tokenizer_fingerprint

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"  # the model's tokenizer, saved beside the graphs
FORMAT_VERSION = 1
MASK_MIN = -30000.0  # additive mask value: exp() underflows to 0, and it still fits in float16


def is_export(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ExportError(f"{folder} holds no {MANIFEST}: not a mirrorsd export",
                          "create one with `mirrorsd export --model NAME --out DIR`")
    try:
        manifest = json.loads(path.read_text())
        for key in ("format", "profile", "graphs", "dims", "max_context", "tokenizer"):
            manifest[key]  # noqa: B018 - presence check
        files = [graph["file"] for graph in manifest["graphs"].values()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ExportError(f"{path} is not a valid mirrorsd manifest ({exc})", "re-run `mirrorsd export`") from exc
    outside = [f for f in files if not is_plain_file_name(f)]
    if outside:  # joined to the folder to load it: a path would reach outside the export
        raise ExportError(f"{path} names a graph file {str(outside[0])[:80]!r} that is not a plain file name in "
                          "the export's folder", "re-run `mirrorsd export`")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{path} has format version {manifest.get('format_version')}, this mirrorsd reads "
                          f"{FORMAT_VERSION}", "re-run `mirrorsd export` with this version of mirrorsd")
    return manifest


def check_tokenizer(manifest: dict, target_tokenizer, target_name: str, folder: str | Path) -> None:
    """The export must come from a model with the target's tokenizer (same fingerprint)."""
    want = tokenizer_fingerprint(target_tokenizer)
    have = manifest["tokenizer"]["fingerprint"]
    if have != want:
        raise TokenizerMismatchError(
            f"the exported draft in {folder} (from {manifest.get('model')!r}, tokenizer {have[:12]}) does not share "
            f"the {target_name}'s tokenizer ({want[:12]}): its token ids would mean other text",
            f"export a draft from {target_name}'s model family, e.g. `mirrorsd export --model <small sibling> "
            "--out DIR`, or use a model-free drafter (--draft auto)",
        )


def io_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    new = [f"new_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "position_ids", "attention_mask", *past], ["logits", *new]


def block_mask(pointer: int, past_len: int, t: int, n_real: int | None = None):
    """Additive mask [1, 1, t, past_len + t] for a block whose first token sits at position
    `pointer`: past slots below the pointer are visible, the block is causal, and padding rows
    (beyond n_real) see only themselves so their softmax stays finite."""
    n_real = t if n_real is None else n_real
    mask = np.full((1, 1, t, past_len + t), MASK_MIN, dtype=np.float32)
    mask[..., :pointer] = 0.0
    causal = np.tril(np.ones((t, t), dtype=bool))
    causal[n_real:, :] = np.eye(t, dtype=bool)[n_real:, :]
    mask[0, 0, :, past_len:][causal] = 0.0
    return mask
