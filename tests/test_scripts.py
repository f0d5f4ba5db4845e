"""The measurement scripts stay runnable: every name they import from mirrorsd exists, and each one with a
command line starts and prints its usage (a rename inside mirrorsd breaks the test, not a later measurement)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_names_a_script_imports_exist(script):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mirrorsd"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{script.name}: {node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mirrorsd"):
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "argparse" in s.read_text()], ids=lambda p: p.name)
def test_a_script_with_a_command_line_starts(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
