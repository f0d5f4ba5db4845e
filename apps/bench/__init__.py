"""The benchmarks: `mirrorsd bench` (with its peers), eval-drafts and draft-bench."""
