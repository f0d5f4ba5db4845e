"""Branch statistics end to end: qwen2.5-coder-1.5b with the 0.5b draft in "branches" mode, per branch source,
(torch float32) on the first N HumanEval problems as chat prompts (greedy); prints the summed counts behind branch_coverage,
branch_hit_rate and branches_ready_share, and tokens per second.

    flock /tmp/mirrorsd-heavy.lock .venv/bin/python scripts/branch_stats.py [--prompts 4] [--tokens 96]
"""

from __future__ import annotations

import argparse
from collections import Counter

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.prompt_suite import code_chat, humaneval_prompts

COUNTS = ("generated_tokens", "verify_steps", "drafted_tokens", "accepted_tokens", "hinted_steps",
          "hinted_rejections", "hinted_covered", "branch_hits", "branch_misses", "branches_planned",
          "branches_ready", "branch_plans_late")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--sources", nargs="+", default=["draft", "early_exit"])
    args = ap.parse_args()
    engine = Engine.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", backend="torch", dtype="float32")
    prompts = [code_chat(p) for p in humaneval_prompts(args.prompts)]
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=8))  # warm-up
    for source in args.sources:
        cfg = GenerationConfig(max_new_tokens=args.tokens, num_draft_tokens=8, pipeline="branches",
                               branch_source=source)
        total, states, seconds = Counter(), Counter(), 0.0
        for messages in prompts:
            s = engine.generate(messages, cfg).stats
            total.update({k: getattr(s, k) for k in COUNTS})
            states.update(s.branch_states)
            seconds += s.total_time_s
        ratio = lambda a, b: f"{total[a] / total[b]:.2f}" if total[b] else "-"  # noqa: E731
        tried = total["branch_hits"] + total["branch_misses"]
        print(f"branch_source={source}: {total['generated_tokens'] / seconds:.2f} tok/s, "
              f"acceptance {ratio('accepted_tokens', 'drafted_tokens')}, "
              f"coverage {ratio('hinted_covered', 'hinted_rejections')}, "
              f"hit rate {total['branch_hits'] / tried if tried else float('nan'):.2f} ({total['branch_hits']}/{tried}), "
              f"ready share {ratio('branches_ready', 'branches_planned')}")
        print("  " + ", ".join(f"{k}={total[k]}" for k in COUNTS) + f", branch_states={dict(states)}")


if __name__ == "__main__":
    main()
