"""PNG plots of a `mirrorsd bench` run (matplotlib, headless Agg backend).

Readable for any number of configurations: every series gets its own colour (a qualitative palette,
then evenly spaced colormap colours beyond it), the speedup bars run horizontally so the width stays
bounded while the height grows with the rows, and legends sit outside the axes so they cover nothing."""

from __future__ import annotations

from pathlib import Path

from mirrorsd.apps.bench.configs import TARGET_ONLY

MIN_SAMPLES = 10  # per-position acceptance from fewer drafted tokens is drawn faded, labelled n=...
WIDTH_IN = 10.0  # the axes' width; a legend beside them adds to it
MAX_HEIGHT_IN = 18.0
DPI = 110


def write_plots(report: dict, cells: dict, prompts: list, outdir: Path) -> list[str]:
    """Write the plots into outdir; return their file names."""
    import matplotlib.pyplot as plt

    written = []
    for name, fig in draw_plots(report, cells, prompts).items():
        fig.savefig(outdir / name, dpi=DPI, bbox_inches="tight")  # "tight": the outside legend is kept
        plt.close(fig)
        written.append(name)
    return written


def draw_plots(report: dict, cells: dict, prompts: list) -> dict:
    """File name -> matplotlib Figure, for the plots this report has data for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    for name, draw in (("speedup.png", _speedup), ("acceptance_by_position.png", _acceptance),
                       ("tokens_per_second.png", _throughput), ("timeline.png", _timeline)):
        fig = draw(plt, report, cells, prompts)
        if fig is not None:
            fig.tight_layout()
            figures[name] = fig
    return figures


def series_colours(n: int) -> list:
    """n distinct colours: tab10, then tab20, then evenly spaced along turbo (any n)."""
    import numpy as np
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](x) for x in np.linspace(0.03, 0.97, n)]


def _legend_outside(ax, **kw) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7, **kw)


def _subtitle(report: dict) -> str:
    m = report["models"]
    target = (m.get("target") or m.get("target (llama.cpp)") or {"name": "?"})["name"]
    draft = next((m[k]["name"] for k in ("draft", "draft (llama.cpp)") if k in m), None)
    return target + (f" / draft {draft}" if draft else "")


def _speedup(plt, report, cells, prompts):
    """Horizontal bars: one block per category ("all" first), one bar per configuration in it."""
    rows = [r for r in report["rows"] if r["configuration"] != r.get("reference", TARGET_ONLY)]
    if not rows:
        return None
    groups = ["all", *report["categories"]]
    height = min(MAX_HEIGHT_IN, 1.5 + 0.14 * len(groups) * len(rows) + 0.25 * len(groups))
    fig, ax = plt.subplots(figsize=(WIDTH_IN, height))
    bar = 0.8 / len(rows)
    for j, (r, colour) in enumerate(zip(rows, series_colours(len(rows)))):
        values = [r["speedup_vs_target_only"], *(r["by_category"][c]["speedup_vs_target_only"]
                                                 for c in report["categories"])]
        failed = r["greedy_equal_to_target_only"] is False
        ax.barh([g + (j - (len(rows) - 1) / 2) * bar for g in range(len(groups))], values, bar, color=colour,
                label=r["configuration"] + (" (FAILED)" if failed else ""), hatch="//" if failed else None)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(groups)), groups)
    ax.invert_yaxis()  # "all" on top, the configurations in legend order within each block
    ax.set_xlabel("speedup over target-only, same backend (tok/s ratio)")
    ax.set_title(f"Speedup by configuration and category: {_subtitle(report)}", fontsize=9)
    _legend_outside(ax)
    return fig


def _acceptance(plt, report, cells, prompts):
    """Acceptance per draft position; positions with fewer than MIN_SAMPLES drafted tokens are faded
    (a dashed line, hollow markers) and labelled n=..., so a 1-of-1 does not read as a measured 100%."""
    rows = [r for r in report["rows"] if r["per_position_acceptance"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(WIDTH_IN * 0.8, 4.6))
    for r, colour in zip(rows, series_colours(len(rows))):
        acc = r["per_position_acceptance"]
        counts = r.get("per_position_drafted") or [MIN_SAMPLES] * len(acc)  # (reports written before counts)
        pos = list(range(1, len(acc) + 1))
        solid = [j for j, n in enumerate(counts[: len(acc)]) if n >= MIN_SAMPLES]
        few = [j for j in range(len(acc)) if j not in solid]
        ax.plot([pos[j] for j in solid], [acc[j] for j in solid], marker="o", color=colour, label=r["configuration"])
        if few:  # joined to the last solid point, so the series reads as one line
            tail = solid[-1:] + few
            ax.plot([pos[j] for j in tail], [acc[j] for j in tail], linestyle="--", marker="o", color=colour,
                    alpha=0.35, markerfacecolor="none", label=None if solid else r["configuration"])
        for j in few:
            ax.annotate(f"n={counts[j]}", (pos[j], acc[j]), textcoords="offset points", xytext=(3, 4), fontsize=6,
                        color=colour, alpha=0.8)
    longest = max(len(r["per_position_acceptance"]) for r in rows)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlim(0.6, longest + 0.6)  # room for the last position's n= label
    ax.set_xlabel(f"draft position (faded, n=...: fewer than {MIN_SAMPLES} tokens drafted there)")
    ax.set_ylabel("acceptance (accepted / drafted at that position)")
    ax.set_ylim(0, 1.08)
    ax.set_title(f"Acceptance by draft position: {_subtitle(report)}", fontsize=9)
    _legend_outside(ax)
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
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH_IN * 1.2, 4.4))
    for (name, times), colour in zip(series.items(), series_colours(len(series))):
        left.step(times, range(1, len(times) + 1), where="post", label=name, color=colour)
        rates = [sum(1 for u in times if t - window < u <= t) / min(window, t) for t in times if t > 0]
        right.plot([t for t in times if t > 0], rates, label=name, color=colour)
    left.set_xlabel("seconds from the start of the request")
    left.set_ylabel("tokens generated")
    right.set_xlabel("seconds from the start of the request")
    right.set_ylabel(f"tokens/s over the last {window:.2g} s")
    _legend_outside(right)
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
