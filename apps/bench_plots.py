"""PNG plots of a `mirrorsd bench` run (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

from mirrorsd.apps.bench_configs import TARGET_ONLY

WINDOW = 8  # tokens per point of the tokens/s-over-a-generation curve


def write_plots(report: dict, cells: dict, prompts: list, outdir: Path) -> list[str]:
    """Write the four plots into outdir; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in (("speedup.png", _speedup), ("acceptance_by_position.png", _acceptance),
                       ("tokens_per_second.png", _throughput), ("timeline.png", _timeline)):
        fig = draw(plt, report, cells, prompts)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(outdir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def _subtitle(report: dict) -> str:
    m = report["models"]
    return m["target"]["name"] + (f" / draft {m['draft']['name']}" if "draft" in m else "")


def _speedup(plt, report, cells, prompts):
    rows = [r for r in report["rows"] if r["configuration"] != TARGET_ONLY]
    if not rows:
        return None
    groups = ["all", *report["categories"]]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups) * max(1, len(rows)) / 3), 4.8))
    width = 0.8 / len(rows)
    for j, r in enumerate(rows):
        values = [r["speedup_vs_target_only"], *(r["by_category"][c]["speedup_vs_target_only"]
                                                 for c in report["categories"])]
        failed = r["greedy_equal_to_target_only"] is False
        ax.bar([g + (j - (len(rows) - 1) / 2) * width for g in range(len(groups))], values, width,
               label=r["configuration"] + (" (FAILED)" if failed else ""), hatch="//" if failed else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over target-only (tok/s ratio)")
    ax.set_title(f"Speedup by configuration and category: {_subtitle(report)}")
    ax.legend(fontsize=7, ncol=2)
    return fig


def _acceptance(plt, report, cells, prompts):
    rows = [r for r in report["rows"] if r["per_position_acceptance"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        acc = r["per_position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["configuration"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted at that position)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance by draft position: {_subtitle(report)}")
    ax.legend(fontsize=7)
    return fig


def _first_greedy(prompts) -> int:
    return next((i for i, p in enumerate(prompts) if p.greedy), 0)


def _throughput(plt, report, cells, prompts):
    i = _first_greedy(prompts)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = 0
    for name, row in cells.items():
        times = row[i].first.token_times if row[i].first else []
        if len(times) <= WINDOW:
            continue
        xs = list(range(WINDOW, len(times)))
        ys = [WINDOW / max(times[n] - times[n - WINDOW], 1e-9) for n in xs]
        ax.plot(xs, ys, label=name)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("generated token")
    ax.set_ylabel(f"tokens/s (over the last {WINDOW} tokens)")
    ax.set_title(f"Tokens/s over one generation ({prompts[i].label}): {_subtitle(report)}", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def _timeline(plt, report, cells, prompts):
    i = _first_greedy(prompts)
    drafted = [r for r in report["rows"] if r["ours"] and r["acceptance_rate"] is not None and r["configuration"] in cells]
    if not drafted:
        return None
    best = max(drafted, key=lambda r: r["speedup_vs_target_only"])
    steps = cells[best["configuration"]][i].first.steps
    if not steps:
        return None
    from matplotlib import colormaps

    cmap = colormaps["RdYlGn"]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    ax.broken_barh([(s.draft_start, s.draft_s) for s in steps], (10, 8), color="tab:blue")
    ax.broken_barh([(s.verify_start, s.verify_s) for s in steps], (0, 8),
                   color=[cmap(s.accepted / s.drafted) if s.drafted else "lightgrey" for s in steps])
    ax.set_yticks([4, 14], ["verify (target)", "draft"])
    ax.set_xlabel("seconds from the start of the request")
    ax.set_title(f"Draft/verify timeline of one request: {best['configuration']}, {prompts[i].label}; "
                 "verify colour = share of the draft accepted (red 0, green all, grey none drafted)", fontsize=8)
    return fig
