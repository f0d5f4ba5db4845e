"""Copy generated tables into the README and docs pages, so no figure there is typed in by hand.

A page marks each copied table with `<!-- table: SOURCE -->` ... `<!-- /table -->`, SOURCE a file that a
benchmark command wrote, relative to the repository root, optionally with `#best` (a bench report's
best-per-category table preceded by its verdict) or `#results` (a bench report from its first table to the
list of models).

    .venv/bin/python scripts/docs_tables.py          # refill every marked block
    .venv/bin/python scripts/docs_tables.py --check  # exit 1 if a block differs from its source (the tests run this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- table: (?P<source>[^ ]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _line(lines: list[str], prefix: str, source: str) -> int:
    for i, line in enumerate(lines):
        if line.startswith(prefix):
            return i
    raise SystemExit(f"{source}: no line starts with {prefix!r} (rerun the command that writes it)")


def extract(source: str) -> str:
    path, _, part = source.partition("#")
    lines = (ROOT / path).read_text().splitlines()
    if part == "best":  # bench's verdict, then its best-per-category table
        verdict = [line for line in lines if line.startswith("**Use ")][:1]
        start = _line(lines, "Best per category", source) + 2
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        lines = verdict + ([""] if verdict else []) + lines[start:end]
    elif part == "results":  # bench's tables and verdicts, without the header and the list of models
        lines = lines[_line(lines, "| configuration", source):_line(lines, "Models:", source)]
    elif part:
        raise SystemExit(f"{source}: unknown part {part!r} (best, results)")
    return "\n".join(lines).strip() + "\n"


def refill(page: Path) -> str:
    return BLOCK.sub(lambda m: m.group(1) + extract(m.group("source")) + m.group(4), page.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report stale blocks instead of rewriting them")
    args = ap.parse_args()
    stale = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        new = refill(page)
        if new != page.read_text():
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    for page in stale:
        print(f"{page}: {'stale' if args.check else 'refilled'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
