"""Drafters from exported drafts (mirrorsd.exporters): ONNX Runtime on a chosen provider, or Core ML.

The export loads as a CausalLM (runtime/backends/exported.py), so the draft loop, greedy or sampling
with q reported for lossless verification, is ModelDrafter's. What this module adds: the tokenizer
check against the target, placement of the draft on a backend (mirrorsd.devices.placement), and the
search for exports when `--draft auto`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mirrorsd.export_format import MANIFEST, check_tokenizer, read_manifest
from mirrorsd.runtime.backends.exported import load_export_lm
from mirrorsd.runtime.drafters.model import ModelDrafter

log = logging.getLogger("mirrorsd")

def exports_dir() -> Path:
    """Where `--draft auto` looks for exports: <cache>/exports/<name>/manifest.json."""
    from mirrorsd import catalog

    return Path(catalog.cache_dir()) / "exports"


def find_exports(target_tokenizer, folder: Path | None = None) -> list[tuple[Path, dict]]:
    """Exports under `folder` (default exports_dir()) made for the target's tokenizer."""
    from mirrorsd.errors import MirrorsdError
    from mirrorsd.tokenizer_check import tokenizer_fingerprint

    folder = folder or exports_dir()
    if not folder.is_dir():
        return []
    want = tokenizer_fingerprint(target_tokenizer)
    found = []
    for path in sorted(p.parent for p in folder.glob(f"*/{MANIFEST}")):
        try:
            manifest = read_manifest(path)
        except MirrorsdError as exc:
            log.warning("skipping %s: %s", path, exc.message)
            continue
        if manifest["tokenizer"]["fingerprint"] == want:
            found.append((path, manifest))
    return found


def drafter_from_export(path: str | Path, target_tokenizer, target_name: str, draft_device: str | None = None,
                        threads: int | None = None) -> ModelDrafter:
    """`--draft DIR`: the export in DIR, checked against the target's tokenizer, on the backend the
    placement policy picks (or the one named by draft_device)."""
    from mirrorsd.devices import discover, place
    from mirrorsd.devices.placement import ExportInfo

    manifest = read_manifest(path)
    check_tokenizer(manifest, target_tokenizer, target_name, path)
    placement = place(discover(), [ExportInfo.from_manifest(path, manifest)], explicit=True,
                      draft_device=draft_device)
    if placement.draft != "export":
        from mirrorsd.errors import ProviderError

        raise ProviderError(f"the exported draft in {path} cannot run on {draft_device}: {placement.draft_reason}",
                            "name a backend the export fits (--draft-device cpu runs any ONNX export)")
    log.info("draft %s on %s: %s", path, placement.draft_backend, placement.draft_reason)
    return ModelDrafter(load_export_lm(path, manifest, placement.draft_backend, threads))


def auto_export_drafter(target_tokenizer, draft_device: str | None = None) -> ModelDrafter | None:
    """`--draft auto`: an export for this target on an NPU when the placement policy finds one; None
    (the caller serves the model-free chain) otherwise."""
    from mirrorsd.devices import discover, place
    from mirrorsd.devices.placement import ExportInfo, npu_backends

    if not draft_device and not any(exports_dir().glob(f"*/{MANIFEST}")):
        return None  # no export to place: the chain serves, without even asking for devices
    inventory = discover()
    if not npu_backends(inventory) and not draft_device:
        return None  # no NPU: the chain serves, without even hashing the vocabulary
    exports = find_exports(target_tokenizer)
    placement = place(inventory, [ExportInfo.from_manifest(p, m) for p, m in exports], draft_device=draft_device)
    if placement.draft != "export":
        log.info("draft: %s", placement.draft_reason)
        return None
    manifest = dict(exports)[Path(placement.draft_export)]
    return ModelDrafter(load_export_lm(placement.draft_export, manifest, placement.draft_backend))
