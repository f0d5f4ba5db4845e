"""The drafters, for your code and the apps: model-free (n-gram, retrieval over a datastore, their chain), a
draft model on any backend, and an exported draft (`mirrorsd export`); `make_drafter` builds any of them from
a spec string, as `Engine.load(draft=...)` does."""

from mirrorsd._lazy import lazy_names

SOURCES = {
    "mirrorsd.runtime.drafters": ("ChainDrafter", "ModelDrafter", "NGramDrafter", "RetrievalDrafter", "make_drafter"),
    "mirrorsd.runtime.drafters.retrieval.datastore": ("Datastore", "build_datastore", "default_datastore"),
    "mirrorsd.runtime.drafters.exported": ("drafter_from_export", "exports_dir"),
}
__all__ = [name for names in SOURCES.values() for name in names]
__getattr__ = lazy_names(globals(), SOURCES)
