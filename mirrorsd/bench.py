"""What `mirrorsd bench` and `eval-drafts` measure with, declared for your own measurements too: replaying a
drafter against the target's tokens (acceptance by position), the speedup a measured acceptance and cost
ratio give, core pinning for side-by-side runs (`CoreLayout`; `CorePins` is its deprecated spelling), and the CPU kernels' switches."""

from mirrorsd._lazy import lazy_names

SOURCES = {
    "mirrorsd.runtime.replay": ("BUCKET", "AcceptanceCounts", "greedy_continuation", "replay_acceptance"),
    "mirrorsd.runtime.decode.policy.speedup": ("best_k", "speedup"),
    "mirrorsd.runtime.decode.pipeline.threads": ("CoreLayout", "CorePins", "cpu_draft_threads"),
    "mirrorsd.runtime.backends.cpu_kernels": ("physical_cores", "use_onednn_linear"),
    "mirrorsd.runtime.backends.ggml_kernels": ("batch_invariant_switch", "stock_kernels"),
}
__all__ = [name for names in SOURCES.values() for name in names]
__getattr__ = lazy_names(globals(), SOURCES)
