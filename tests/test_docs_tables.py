"""The README's and docs' marked tables are the benchmark commands' own output (scripts/docs_tables.py copies
them), never typed in: a page that drifted from its source fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_marked_tables_equal_their_generated_sources():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_tables.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_readme_shows_a_generated_table():
    assert "<!-- table: docs/results/bench-categories/report.md#best -->" in (ROOT / "README.md").read_text()


def test_every_relative_link_in_the_docs_resolves():
    import re

    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", page.read_text()):
            target = match.group(1)
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
