"""The CLI fed malformed files and paths, generated: `datastore build` on JSONL lines of every shape (arrays,
numbers, messages that are strings or objects of the wrong types, invalid JSON, bytes that are not UTF-8,
lone surrogates, deep nesting) and on paths that are not what it expects (missing, a file as --out, a folder
inside a file), and `datastore info` on headers of any JSON. Every run ends with exit 0, or with exit 2 and
`mirrorsd: error:`; nothing escapes `main` (a traceback)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mirrorsd.apps.cli import main

_EDGES = ["\ud800", "\udfff", "\ufeff", "\x00", "\u202e", "\U0001f600", "\ufffe"]
_text = st.text(max_size=10) | st.lists(st.sampled_from(_EDGES) | st.text(max_size=3), max_size=3).map("".join)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=6)
_message = st.fixed_dictionaries({}, optional={"role": _json, "content": _json}) | _json
_row = (st.fixed_dictionaries({"messages": st.lists(_message, max_size=3) | _json}) |
        st.fixed_dictionaries({}, optional={"text": _json, "prompt": _json, "completion": _json}) | _json)
# one JSONL line as bytes: a JSON value (escaped or raw UTF-8), broken JSON, bytes that are not UTF-8, deep nesting
_line = st.one_of(
    _row.map(lambda v: json.dumps(v).encode()),
    _row.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.sampled_from([b"{", b'{"text": "a"', b"\xff\xfe", b"\xef\xbb\xbf{\"text\": \"bom\"}", b"",
                     b"[" * 5000 + b"]" * 5000, b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}"]),
    st.binary(max_size=20),
)
_out = st.sampled_from(["fresh", "a-file", "inside-a-file/ds", "existing-datastore", "corpus-folder"])
_input = st.sampled_from(["jsonl", "folder", "missing", "empty-folder"])


def _cli(*args: str, capsys) -> tuple[int, str]:
    """Run `mirrorsd ARGS` in this process: its exit code and stderr. Any exception but SystemExit fails."""
    with mock.patch.object(sys, "argv", ["mirrorsd", *args]):
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, capsys.readouterr().err


def _shaped(code: int, err: str) -> None:
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert err.startswith("mirrorsd: error:") and "\n  hint: " in err, err


@pytest.fixture(scope="module")
def corpus_root(tiny_folder):
    root = Path(tempfile.mkdtemp(prefix="cli-fuzz-"))
    (root / "a-file").write_text("x")
    (root / "corpus-folder").mkdir()
    (root / "corpus-folder" / "code.py").write_text("def f(x):\n    return x + 1\n")
    (root / "corpus-folder" / "binary.txt").write_bytes(b"\xff\xfe\x00\x81")
    (root / "empty-folder").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, min_size=1, max_size=4), source=_input, out=_out)
def test_datastore_build_on_malformed_jsonl_and_paths_fails_shaped(corpus_root, tiny_folder, capsys, lines, source,
                                                                   out):
    with tempfile.TemporaryDirectory(dir=corpus_root) as tmp:
        jsonl = Path(tmp) / "data.jsonl"
        jsonl.write_bytes(b"\n".join(lines) + b"\n")
        source_path = {"jsonl": jsonl, "folder": Path(tmp), "missing": Path(tmp) / "missing.jsonl",
                       "empty-folder": corpus_root / "empty-folder"}[source]
        out_path = Path(tmp) / "ds" if out == "fresh" else corpus_root / out
        if out == "existing-datastore":
            _shaped(*_cli("datastore", "build", str(corpus_root / "corpus-folder"), "--tokenizer", str(tiny_folder),
                          "--out", str(out_path), capsys=capsys))
        code, err = _cli("datastore", "build", str(source_path), "--tokenizer", str(tiny_folder),
                         "--out", str(out_path), capsys=capsys)
        _shaped(code, err)
        if code == 0 and out_path.is_dir():
            _shaped(*_cli("datastore", "info", str(out_path), capsys=capsys))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_json.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=30))
def test_datastore_info_on_any_header_fails_shaped(corpus_root, capsys, header):
    with tempfile.TemporaryDirectory(dir=corpus_root) as tmp:
        (Path(tmp) / "datastore.json").write_bytes(header)
        _shaped(*_cli("datastore", "info", tmp, capsys=capsys))
