"""What overlap can gain over sequential decoding at most, per draft, from a bench report's own measurements:
the acceptance rate alpha and the draft's cost per token c (its sequential row's drafting time per drafted
token over the target-only row's time per token), put through the pipeline's cost model
(runtime/decode/policy/speedup.py: a step that lands on the lookahead costs max(K c, verify); the step after any
other waits for K fresh tokens, K c + verify, or with short fresh steps for its best fresh_k), each mode at
its best K. Why: docs/pipeline.md (the overlap goal against a cheap draft).

    .venv/bin/python scripts/overlap_ceiling.py docs/results/bench-pinned/report.json [--growth 0 0.065]
"""

from __future__ import annotations

import argparse
import json

from mirrorsd.runtime.decode.policy.speedup import speedup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--growth", type=float, nargs="+", default=[0.0, 0.065],
                    help="verify cost growth per drafted token, in plain steps (docs/verify-cost.md)")
    args = ap.parse_args()
    rows = {r["configuration"]: r for r in json.load(open(args.report))["rows"]}
    plain_s = 1.0 / rows["target only (ours)"]["tokens_per_second"]
    print("| draft | alpha | c | growth | model: overlap / pipeline off, fresh steps of K | "
          "... with the best fresh_k | measured |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        draft = name.removesuffix(" (ours)")  # the pipeline-off row of each draft has no mode in its name
        if f"{draft}, overlap (ours)" not in rows or not row.get("per_position_drafted"):
            continue
        overlap = rows.get(f"{draft}, overlap (ours)")
        steps = sum(row["drafters"].values())  # every verify step (propose_us_per_step averages over them)
        per_token = row["propose_us_per_step"] * 1e-6 * steps / sum(row["per_position_drafted"])
        alpha, c = row["acceptance_rate"], per_token / plain_s
        measured = f"{overlap['tokens_per_second'] / row['tokens_per_second']:.2f}x" if overlap else "-"
        for g in args.growth:
            seq = max(speedup(alpha, k, c, False, growth=g) for k in range(1, 17))
            ovl = max(speedup(alpha, k, c, True, growth=g) for k in range(1, 17))
            fresh = max(speedup(alpha, k, c, True, growth=g, fresh_k=f) for k in range(1, 17) for f in range(1, k + 1))
            print(f"| {draft} | {alpha:.3f} | {c:.3f} | {g} | {ovl / seq:.2f}x | {fresh / seq:.2f}x | {measured} |")


if __name__ == "__main__":
    main()
