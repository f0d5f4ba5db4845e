"""What `mirrorsd export` shows: each phase as it runs and how long it took, then a short table of the
validation checks (the full report is in the export's manifest.json, or printed with --json)."""

from __future__ import annotations


class PhaseDisplay:
    """A PhaseLog listener writing to a rich Console: a spinner while a phase runs on a terminal, and one
    line per phase when it ends (the only output when the console is not a terminal: logs stay plain)."""

    def __init__(self, console) -> None:
        self.console = console
        self.status = None

    def started(self, name: str) -> None:
        if self.console.is_terminal:
            self.status = self.console.status(f"{name} ...")
            self.status.start()

    def finished(self, name: str, seconds: float | None, note: str) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        took = "skipped" if seconds is None else f"{seconds:.1f} s"
        self.console.print(f"{name:<9} {took:>9}  {note}".rstrip(), markup=False, highlight=False)


def _value(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def validation_table(report: dict):
    """The checks (measured against their threshold) and, below them, what was measured for information."""
    from rich.table import Table

    table = Table(title=f"validation: {'passed' if report['passed'] else 'FAILED'}")
    for col in ("check", "measured", "threshold", "result"):
        table.add_column(col)
    for c in report.get("checks", []):
        table.add_row(c["check"], _value(c["measured"]), c["threshold"], "ok" if c["passed"] else "FAILED")
    for key, label in (("mean_kl", "mean KL(torch || export)"), ("acceptance_rate", "acceptance as a draft (K=4)"),
                       ("numerics", "numerics"), ("provider", "provider")):
        if report.get(key) is not None:
            table.add_row(label, _value(report[key]), "", "info")
    return table


def failure_summary(report: dict) -> str:
    """One line naming each failed check with its measured value and threshold."""
    failed = [c for c in report.get("checks", []) if not c["passed"]]
    what = "; ".join(f"{c['check']} {_value(c['measured'])} (needs {c['threshold']})" for c in failed)
    return f"validation FAILED: {what or report.get('criteria', 'see the report')}"
