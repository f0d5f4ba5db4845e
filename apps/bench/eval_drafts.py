"""`mirrorsd eval-drafts`: which drafter, and which K, for *your* workload on *this* device.

Acceptance measured on synthetic data misleads; this measures it on the user's own prompts:

1. sample N prompts from the user's JSONL workload; decode each with the target alone (greedy): the
   target's own outputs are the ground truth, and their per-step time is the unit of cost;
2. offline, per candidate drafter: replay each output as greedy speculative decoding would commit it
   (propose up to K_max at each point, accept the matching prefix, advance by accepted + 1) and count
   token-level acceptance: alpha (accepted / positions reached, the per-token rate Leviathan's formula
   takes), alpha by draft position and by position in the generated sequence, and the draft's cost ratio
   c (propose seconds per drafted token / target seconds per decode step);
3. predict the speedup for every K from Leviathan's formula, sequential and overlapped
   (mirrorsd.bench.speedup), weighted by the share of steps that carry a draft at all (model-free
   drafters often have nothing to propose), and take the best K;
4. measure it: decode the same prompts end to end with each candidate at that K, interleaved with
   target-only runs, check the outputs token-equal, and recommend the drafter (and K) with the best
   measured speedup (none if nothing beats target-only); with a device price per hour, the cost per
   million generated tokens.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.runner import machine_info, versions
from mirrorsd.apps.bench.configs import BenchContext, ours
from mirrorsd.apps.bench.prompt_suite import load_workload
from mirrorsd.errors import ConfigError
from mirrorsd.bench import best_k, speedup
from mirrorsd.bench import BUCKET, AcceptanceCounts, replay_acceptance

@dataclass
class EvalOptions:
    workload: str
    target: str = "smollm2-135m"
    drafters: tuple[str, ...] = ("ngram", "retrieval", "chain")
    samples: int = 8
    seed: int = 0
    max_new_tokens: int = 64
    k_max: int = 8
    price_per_hour: float | None = None
    dtype: str = "float32"
    backend: str = "auto"
    out: str = "eval-drafts-out"


def run_eval_drafts(opts: EvalOptions, engine: Engine | None = None, candidates: dict | None = None,
                    command: str | None = None) -> dict:
    """Run the evaluation and write eval-drafts.json / eval-drafts.md. `engine` and `candidates`
    ({name: Drafter}) let a caller bring objects it already holds (the tests do)."""
    from rich.console import Console

    console = Console(stderr=True)
    if opts.samples < 1 or opts.k_max < 1 or opts.max_new_tokens < 2:
        raise ConfigError("--samples and --k-max must be >= 1, --max-new-tokens >= 2", "e.g. --samples 8 --k-max 8")
    workload = load_workload(opts.workload)
    prompts = random.Random(opts.seed).sample(workload, min(opts.samples, len(workload)))
    if engine is None:
        console.print(f"loading {opts.target}")
        engine = Engine.load(target=opts.target, draft="none", dtype=opts.dtype, progress=True, backend=opts.backend)
    if candidates is None:
        from mirrorsd.drafters import make_drafter

        candidates = {spec: make_drafter(spec, engine.tokenizer, opts.target, dtype=opts.dtype, progress=True,
                                         backend=opts.backend)
                      for spec in opts.drafters}
    if not candidates:
        raise ConfigError("no candidate drafters", "e.g. --drafter ngram --drafter qwen2.5-coder-0.5b")
    ids = [engine.encode(p.request) for p in prompts]
    greedy = GenerationConfig(max_new_tokens=opts.max_new_tokens)
    ctx = BenchContext(engine, opts.target)
    target_only = ours(ctx, None)
    target_only(ids[0][:16], GenerationConfig(max_new_tokens=2))  # warm-up

    state = _Progress(len(ids))
    try:
        _measure(opts, ids, candidates, target_only, {name: ours(ctx, d) for name, d in candidates.items()},
                 greedy, state, console)
    except KeyboardInterrupt:  # Ctrl-C: write what was measured so far, then stop as Ctrl-C does (exit 130)
        if not state.rows:
            console.print("interrupted before any candidate was measured: no report written")
            raise
        report = _report(opts, engine, workload, state, command,
                         interrupted=f"interrupted (Ctrl-C): {state.measured} of {len(ids)} prompts measured end to "
                                     f"end, {len(state.rows)} of {len(candidates)} candidates replayed offline")
        _write(opts, report, console)
        console.print(f"interrupted: partial report written to {Path(opts.out) / 'eval-drafts.json'} and "
                      f"{Path(opts.out) / 'eval-drafts.md'}")
        raise
    report = _report(opts, engine, workload, state, command)
    _write(opts, report, console)
    return report


@dataclass
class _Progress:
    """What the measurement has reached: the target's reference outputs, each candidate's offline counts and
    predictions (rows), and the prompts measured end to end by every runner (their sums)."""

    prompts: int
    reference: list = field(default_factory=list)
    step_s: float = 0.0
    rows: dict = field(default_factory=dict)
    measured: int = 0
    base_s: float = 0.0
    base_tokens: int = 0


def _measure(opts: EvalOptions, ids: list, candidates: dict, target_only, runners: dict, greedy: GenerationConfig,
             state: _Progress, console) -> None:
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("target's own outputs", total=len(ids))
        for x in ids:
            state.reference.append(target_only(x, greedy))
            bar.advance(task)
        # One decode step of the target: verify time of every step after the first (the prefill).
        state.step_s = statistics.median(s.seconds for out in state.reference for s in out.verify_spans[1:]) \
            if any(len(out.verify_spans) > 1 for out in state.reference) else state.reference[0].verify_spans[0].seconds
        task = bar.add_task("offline acceptance", total=len(ids) * len(candidates))
        for name, drafter in candidates.items():
            counts = AcceptanceCounts()
            for x, out in zip(ids, state.reference):
                replay_acceptance(drafter, x, out.tokens, opts.k_max, counts)
                bar.advance(task)
            state.rows[name] = {**_predict(counts, state.step_s, opts.k_max), "measured_seconds": 0.0,
                                "measured_tokens": 0, "greedy_equal": True}
        task = bar.add_task("end to end", total=len(ids) * (len(candidates) + 1))
        for x, ref in zip(ids, state.reference):  # interleaved per prompt: target-only, then every candidate
            t0 = time.perf_counter()
            base_tokens = len(target_only(x, greedy).tokens)
            base_s = time.perf_counter() - t0
            bar.advance(task)
            this = {}
            for name, run in runners.items():
                k = max(1, state.rows[name]["best_k"])
                t0 = time.perf_counter()
                out = run(x, GenerationConfig(max_new_tokens=opts.max_new_tokens, num_draft_tokens=k,
                                              max_draft_tokens=max(k, 16), adaptive_k=False))  # K fixed: the one tested
                this[name] = (time.perf_counter() - t0, len(out.tokens), out.tokens == ref.tokens)
                bar.advance(task)
            for name, (seconds, tokens, equal) in this.items():  # a prompt counts once every runner has run it
                row = state.rows[name]
                row["measured_seconds"] += seconds
                row["measured_tokens"] += tokens
                row["greedy_equal"] &= equal
            state.base_s += base_s
            state.base_tokens += base_tokens
            state.measured += 1


def _report(opts: EvalOptions, engine: Engine, workload: list, state: _Progress, command: str | None,
            interrupted: str | None = None) -> dict:
    measured = state.measured > 0
    base_tps = state.base_tokens / state.base_s if measured else None
    rows = {}
    for name, row in state.rows.items():
        row = dict(row)
        seconds, tokens = row.pop("measured_seconds"), row.pop("measured_tokens")
        row["measured_tokens_per_second"] = round(tokens / seconds, 3) if measured else None
        row["measured_speedup"] = round(tokens / seconds / base_tps, 3) if measured else None
        if not measured:
            row["greedy_equal"] = None
        rows[name] = row
    winners = [(name, r) for name, r in rows.items() if r["greedy_equal"] and (r["measured_speedup"] or 0) > 1.0]
    best = max(winners, key=lambda nr: nr[1]["measured_speedup"], default=None)
    rec_tps = best[1]["measured_tokens_per_second"] if best else base_tps
    recommendation = {
        "drafter": best[0] if best else None, "k": max(1, best[1]["best_k"]) if best else 0,
        "measured_speedup": best[1]["measured_speedup"] if best else 1.0,
        "why": (f"highest measured end-to-end speedup on {state.measured} sampled prompts" if best else
                "no candidate beat target-only decoding end to end on this workload and device" if measured else
                "interrupted before any prompt was measured end to end"),
    }
    costs = None
    if opts.price_per_hour is not None and measured:
        per_million = lambda tps: round(opts.price_per_hour / (tps * 3600) * 1e6, 4)  # noqa: E731
        costs = {"price_per_hour": opts.price_per_hour, "target_only_per_million_tokens": per_million(base_tps),
                 "recommended_per_million_tokens": per_million(rec_tps)}
    return {
        "command": command, "date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "workload": str(opts.workload), "workload_size": len(workload), "samples": state.prompts,
        "measured_samples": state.measured, "seed": opts.seed,
        "target": opts.target, "dtype": opts.dtype, "backend": engine.target.backend,
        "max_new_tokens": opts.max_new_tokens, "k_max": opts.k_max,
        "target_step_seconds": round(state.step_s, 5),
        "target_only_tokens_per_second": round(base_tps, 3) if measured else None,
        "machine": machine_info(), "versions": versions(),
        "candidates": rows, "recommendation": recommendation, "cost": costs,
        "partial": interrupted is not None, "interrupted": interrupted,
    }


def _write(opts: EvalOptions, report: dict, console) -> None:
    from rich.console import Console
    from rich.markdown import Markdown

    outdir = Path(opts.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "eval-drafts.json").write_text(json.dumps(report, indent=1))
    (outdir / "eval-drafts.md").write_text(markdown(report))
    Console().print(Markdown(markdown(report)))


def _predict(c: AcceptanceCounts, step_s: float, k_max: int) -> dict:
    alpha = c.alpha if c.alpha is not None else 0.0
    cost = (c.propose_s / c.drafted / step_s) if c.drafted else 0.0
    f = c.steps_drafted / c.steps if c.steps else 0.0
    k, predicted = best_k(alpha, cost, k_max, coverage=f)
    return {
        "alpha": round(alpha, 4),
        "acceptance_rate": round(c.accepted / c.drafted, 4) if c.drafted else None,
        "mean_accepted_length_offline": round(c.committed / c.steps, 3) if c.steps else None,
        "steps_with_a_draft": round(f, 3),
        "alpha_by_draft_position": [round(a / t, 4) for a, t in zip(c.pos_accepted, c.pos_trials)],
        "alpha_by_sequence_position": {f"{b * BUCKET}-{(b + 1) * BUCKET - 1}": round(c.seq_accepted[b] / t, 4)
                                       for b, t in sorted(c.seq_trials.items())},
        "cost_ratio_c": round(cost, 5),
        "predicted_speedup_by_k": {kk: round(speedup(alpha, kk, cost, coverage=f), 3) for kk in range(1, k_max + 1)},
        "predicted_overlapped_speedup_by_k": {kk: round(speedup(alpha, kk, cost, True, f), 3)
                                              for kk in range(1, k_max + 1)},
        "best_k": k, "predicted_speedup": round(predicted, 3),
        "predicted_overlapped_speedup": round(speedup(alpha, max(k, 1), cost, True, f), 3),
    }


def markdown(report: dict) -> str:
    lines = []
    if report.get("partial"):
        lines += [f"**Partial report: {report['interrupted']}; the numbers cover those only.**", ""]
    if report.get("command"):
        lines += [f"`{report['command']}`", ""]  # the date stays in the JSON: the page is the current state
    lines += [f"Target {report['target']} ({report['dtype'].replace('torch.', '')}), {report['samples']} prompts "
              f"sampled from {report['workload']} ({report['workload_size']}), greedy, {report['max_new_tokens']} "
              f"new tokens; target-only {_num(report['target_only_tokens_per_second'], '.2f')} tok/s, one decode step "
              f"{report['target_step_seconds'] * 1000:.1f} ms; {report['machine']['cpu']}.", "",
              "| drafter | alpha | steps with a draft | c | best K | predicted | predicted, overlapped | "
              "measured (at best K) | greedy equal |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["candidates"].items():
        lines.append(f"| {name} | {r['alpha']:.3f} | {r['steps_with_a_draft']:.0%} | {r['cost_ratio_c']:.4f} | "
                     f"{r['best_k']} | {r['predicted_speedup']:.2f}x | {r['predicted_overlapped_speedup']:.2f}x | "
                     f"{_num(r['measured_speedup'], '.2f', 'x')} | "
                     f"{'-' if r['greedy_equal'] is None else 'yes' if r['greedy_equal'] else 'FAILED'} |")
    lines += ["", "alpha: accepted / draft positions reached, offline against the target's own outputs; c: propose "
                  "seconds per drafted token / one target decode step; predicted: Leviathan's "
                  "(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)), weighted by the share of steps with a draft; "
                  "overlapped: a step on the lookahead (alpha^(K+1)) costs max(K c, 1), others K c + 1; measured: tok/s end to end over target-only, same prompts, "
                  "interleaved."]
    lines += ["", "alpha by draft position: " + "; ".join(
        f"{name} " + " ".join(f"{a:.2f}" for a in r["alpha_by_draft_position"])
        for name, r in report["candidates"].items())]
    rec = report["recommendation"]
    lines += ["", (f"**Recommendation: {rec['drafter']} with K={rec['k']}** ({rec['measured_speedup']:.2f}x, {rec['why']})."
                   if rec["drafter"] else f"**Recommendation: no drafter** ({rec['why']}).")]
    if report["cost"]:
        c = report["cost"]
        lines += ["", f"At {c['price_per_hour']} per device-hour: {c['target_only_per_million_tokens']} per million "
                      f"tokens target-only, {c['recommended_per_million_tokens']} with the recommendation."]
    return "\n".join(lines) + "\n"


def _num(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"
