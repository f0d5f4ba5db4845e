"""The bench plots stay readable with many configurations: distinct colours read back from the drawn
artists, bounded image sizes, legends outside the axes, and per-position acceptance labelled with its
sample counts where they are small."""

from __future__ import annotations

import matplotlib.image
import pytest
from matplotlib.colors import to_hex

from mirrorsd.apps.bench.runner import Cell
from mirrorsd.apps.bench.configs import TARGET_ONLY, Output
from mirrorsd.apps.bench.plots import MIN_SAMPLES, draw_plots, write_plots
from mirrorsd.apps.bench.prompt_suite import BenchPrompt
from mirrorsd.results import Span

CATEGORIES = ["code", "chat", "math", "json", "creative"]


def synthetic(n_series: int):
    """A report (and its cells, prompts) of n_series drafting configurations plus the reference row."""
    names = [TARGET_ONLY] + [f"configuration number {j} with a long name (ours)" for j in range(n_series)]
    rows = []
    for j, name in enumerate(names):
        rows.append({
            "configuration": name, "reference": TARGET_ONLY, "ours": True, "speedup_vs_target_only": 1 + j / 10,
            "by_category": {c: {"speedup_vs_target_only": 1 + j / 20 + k / 10} for k, c in enumerate(CATEGORIES)},
            "greedy_equal_to_target_only": j != 3,  # one FAILED row
            "per_position_acceptance": [] if j == 0 else [0.9, 0.7, 0.5, 0.4, 1.0],
            "per_position_drafted": [] if j == 0 else [200, 120, 40, 9, 1],  # the last two: too few samples
            "acceptance_rate": None if j == 0 else 0.7, "propose_us_per_step": 10.0 * j,
            "draft_hidden_share": 0.0, "speedup": 1.0})
    report = {"rows": rows, "categories": CATEGORIES, "models": {"target": {"name": "tiny"}}}
    prompts = [BenchPrompt("code", text="def f():", label="code 1")]
    spans = [Span("verify", "verify", 0.01 * k, 0.008, drafted=4, accepted=k % 5) for k in range(10)]
    out = Output(tokens=list(range(20)), token_times=[0.005 * k for k in range(1, 21)], verify_spans=spans,
                 draft_spans=[Span("draft", "ngram draft", 0.01 * k, 0.002) for k in range(10)])
    cells = {name: [Cell(seconds=[0.1], first=out)] for name in names}
    return report, cells, prompts


@pytest.fixture(scope="module")
def figures():
    figs = draw_plots(*synthetic(14))
    yield figs
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)


def test_no_two_series_share_a_colour(figures):
    ax = figures["speedup.png"].axes[0]
    colours = {}
    for container in ax.containers:  # one BarContainer per configuration
        faces = {to_hex(patch.get_facecolor()) for patch in container.patches}
        assert len(faces) == 1  # one configuration, one colour
        colours[container.get_label()] = faces.pop()
    assert len(colours) == 14 and len(set(colours.values())) == 14, colours
    lines = [line for line in figures["acceptance_by_position.png"].axes[0].get_lines() if line.get_label()[0] != "_"]
    assert len({to_hex(line.get_color()) for line in lines}) == 14
    for ax in figures["tokens_per_second.png"].axes:
        assert len({to_hex(line.get_color()) for line in ax.get_lines()}) == 15  # the reference row too


def test_legends_sit_outside_the_axes(figures):
    for name in ("speedup.png", "acceptance_by_position.png", "tokens_per_second.png"):
        fig = figures[name]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend_ax = next(ax for ax in fig.axes if ax.get_legend() is not None)
        box, axes_box = legend_ax.get_legend().get_window_extent(renderer), legend_ax.get_window_extent(renderer)
        assert box.x0 >= axes_box.x1, name  # right of the plotting area: it covers no bar or line


def test_acceptance_positions_with_few_samples_are_faded_and_labelled(figures):
    ax = figures["acceptance_by_position.png"].axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("n=9") == 14 and labels.count("n=1") == 14 and "n=40" not in labels
    faded = [line for line in ax.get_lines() if line.get_alpha() is not None and line.get_alpha() < 1]
    assert len(faded) == 14 and all(line.get_linestyle() == "--" for line in faded)
    assert all(n < MIN_SAMPLES for n in (9, 1))


@pytest.mark.parametrize("n_series", [3, 14, 40])
def test_image_sizes_stay_bounded_and_grow_in_height_with_rows(tmp_path, n_series):
    report, cells, prompts = synthetic(n_series)
    names = write_plots(report, cells, prompts, tmp_path)
    assert names == ["speedup.png", "acceptance_by_position.png", "tokens_per_second.png", "timeline.png"]
    sizes = {name: matplotlib.image.imread(tmp_path / name).shape[:2] for name in names}
    for name, (height, width) in sizes.items():
        assert 300 <= width <= 2000 and 200 <= height <= 2100, (name, width, height)
        assert width / height < 6, (name, width, height)  # no 4004x528 strip
    speedup_height = sizes["speedup.png"][0]
    if n_series == 3:
        assert speedup_height < 900
    else:
        assert speedup_height > 1000  # more rows, taller, not wider
