"""PNG plots of a `mirrorsd bench` run (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

from mirrorsd.apps.bench_configs import TARGET_ONLY


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
    target = (m.get("target") or m.get("target (llama.cpp)") or {"name": "?"})["name"]
    draft = next((m[k]["name"] for k in ("draft", "draft (llama.cpp)") if k in m), None)
    return target + (f" / draft {draft}" if draft else "")


def _speedup(plt, report, cells, prompts):
    rows = [r for r in report["rows"] if r["configuration"] != r.get("reference", TARGET_ONLY)]
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
    ax.set_ylabel("speedup over target-only, same backend (tok/s ratio)")
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
    """Left: tokens generated against time (the slope is tok/s). Right: tok/s over a trailing time window.
    A window in time, not in tokens: a verify step commits several tokens at one instant."""
    i = _first_greedy(prompts)
    series = {name: row[i].first.token_times for name, row in cells.items() if row[i].first and row[i].first.token_times}
    if not series:
        return None
    window = max(max(t[-1] for t in series.values()) / 12, 1e-3)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, times in series.items():
        left.step(times, range(1, len(times) + 1), where="post", label=name)
        rates = [sum(1 for u in times if t - window < u <= t) / min(window, t) for t in times if t > 0]
        right.plot([t for t in times if t > 0], rates, label=name)
    left.set_xlabel("seconds from the start of the request")
    left.set_ylabel("tokens generated")
    right.set_xlabel("seconds from the start of the request")
    right.set_ylabel(f"tokens/s over the last {window:.2g} s")
    left.legend(fontsize=7)
    fig.suptitle(f"Tokens/s over one generation ({prompts[i].label}): {_subtitle(report)}", fontsize=10)
    return fig


def _timeline(plt, report, cells, prompts):
    i = _first_greedy(prompts)
    drafted = [r for r in report["rows"] if r["ours"] and r["acceptance_rate"] is not None and r["configuration"] in cells]
    if not drafted:
        return None
    # The pipeline's overlap, if it ran, else the configuration whose drafts cost the most time, shows
    # the draft/verify split best.
    best = max(drafted, key=lambda r: ((r.get("draft_hidden_share") or 0) > 0, r["propose_us_per_step"] or 0,
                                       r["speedup_vs_target_only"]))
    out = cells[best["configuration"]][i].first
    if not out.verify_spans:
        return None
    from matplotlib import colormaps

    cmap = colormaps["RdYlGn"]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    ax.broken_barh([(s.start, s.seconds) for s in out.draft_spans], (10, 8), color="tab:blue", edgecolor="tab:blue")
    ax.broken_barh([(s.start, s.seconds) for s in out.verify_spans], (0, 8), edgecolor="white", linewidth=0.6,
                   color=[cmap(s.accepted / s.drafted) if s.drafted and s.accepted is not None else "lightgrey"
                          for s in out.verify_spans])
    ax.set_yticks([4, 14], ["verify (target)", "draft"])
    ax.set_xlabel("seconds from the start of the request")
    ax.set_title(f"Draft/verify timeline of one request: {best['configuration']}, {prompts[i].label}; "
                 "verify colour = share of the draft accepted (red 0, green all, grey none drafted)", fontsize=8)
    return fig
