"""Drafters from a spec string (`--draft`, `Engine.load(draft=...)`): the one way in for the apps."""

from __future__ import annotations

from pathlib import Path

from mirrorsd.contracts import Drafter
from mirrorsd.errors import ConfigError
from mirrorsd.runtime.drafters.chain import ChainDrafter
from mirrorsd.runtime.drafters.model import ModelDrafter
from mirrorsd.runtime.drafters.ngram import NGramDrafter
from mirrorsd.runtime.drafters.retrieval import RetrievalDrafter


DRAFTER_MEMBERS = ("name", "model", "learner", "bounded", "start", "propose", "accepted")


def make_drafter(spec: str | Drafter | None, target_tokenizer, target_name: str = "target", *,
                 device: str | None = "auto", dtype=None, backend: str = "torch", progress: bool = False,
                 export_device: str | None = None, export_threads: int | None = None) -> Drafter | None:
    """A drafter for the target whose tokenizer is given.

    spec: "auto" (an export on the NPU when the placement policy finds one, else the model-free chain:
    n-gram + retrieval from the default stdlib datastore), "ngram", "retrieval" / "chain" (default
    datastore), "retrieval:PATH" / "chain:PATH" (your datastore, learning from each reply), "none"/None,
    an export folder (`mirrorsd export`) for a draft on ONNX Runtime / Core ML, a model argument
    (catalog name, folder, .gguf, hub id) for a draft model on `backend`, or a Drafter (returned as is).
    device/dtype: a draft model's; export_device: the backend for an export (cpu, coreml, qnn, ...);
    export_threads: intra-op threads of an export on the CPU provider."""
    if spec is None or spec == "none":
        return None
    if not isinstance(spec, str):
        missing = [member for member in DRAFTER_MEMBERS if not hasattr(spec, member)]
        if missing:  # a check of the caller's object, not a probe for abilities (those are declared)
            raise ConfigError(f"draft must be a spec string or a Drafter, got {type(spec).__name__} "
                              f"(it lacks {', '.join(missing)})",
                              "pass e.g. draft='ngram', a model name, or an object with the members of "
                              "mirrorsd.Drafter: " + ", ".join(DRAFTER_MEMBERS)
                              + " (model/learner may be None; bounded False unless every call returns promptly)")
        return spec
    if spec == "ngram":
        return NGramDrafter()
    kind, _, where = spec.partition(":")
    if spec == "auto":
        from mirrorsd.runtime.drafters.exported import auto_export_drafter

        exported = auto_export_drafter(target_tokenizer, export_device)
        if exported is not None:
            return exported
    if kind in ("auto", "chain", "retrieval") and (kind != "auto" or not where):
        from mirrorsd.runtime.drafters.retrieval.datastore import Datastore, default_datastore

        store = (Datastore.open(where, target_tokenizer) if where
                 else default_datastore(target_tokenizer, progress=progress, tokenizer_name=target_name))
        retrieval = RetrievalDrafter(store, learn=bool(where))
        return retrieval if kind == "retrieval" else ChainDrafter(NGramDrafter(), retrieval)
    from mirrorsd.export_format import is_export

    if is_export(spec):
        from mirrorsd.runtime.drafters.exported import drafter_from_export

        return drafter_from_export(spec, target_tokenizer, target_name, export_device, export_threads)
    check_not_a_misspelt_keyword(spec)
    from mirrorsd.runtime.backends import load_lm
    from mirrorsd.tokenizer_check import check_tokenizers_match

    loaded = load_lm(spec, backend, device=device, dtype=dtype, progress=progress, role="draft")
    check_tokenizers_match(target_tokenizer, loaded.tokenizer, target_name, spec)
    # named by its model, not its backend: stats then say which model drafted (a path: its last part)
    return ModelDrafter(loaded.lm, name=Path(spec.rstrip("/\\")).name or spec)


DRAFTER_KEYWORDS = ("auto", "ngram", "retrieval", "chain", "none")


def check_not_a_misspelt_keyword(spec: str) -> None:
    """A spec that is no file or folder but nearly a drafter keyword ("ngrams") is a typo, not a model to fetch."""
    import difflib

    kind = spec.partition(":")[0]
    close = difflib.get_close_matches(kind, DRAFTER_KEYWORDS, n=1, cutoff=0.75)
    if close and kind not in DRAFTER_KEYWORDS and not Path(spec).expanduser().exists():
        raise ConfigError(f"unknown drafter {spec!r}: did you mean {close[0]!r}?",
                          "a drafter is auto, ngram, retrieval[:PATH], chain[:PATH] or none, an export folder, or "
                          "a draft model (catalog name, folder, .gguf file)")


def helper_for(drafter: Drafter | None) -> Drafter | None:
    """The model-free drafter beside a draft model: n-gram (free to set up; retrieval would first need a
    datastore for this tokenizer). The pipeline lets it serve the steps where its draft, made at once,
    beats waiting for the model's, and every step once the draft model fails; then plain decoding."""
    return NGramDrafter() if drafter is not None and drafter.model is not None else None
