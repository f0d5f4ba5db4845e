"""The retrieval datastore: token sequences in the target's tokenizer, indexed by suffix arrays.

On disk a datastore is a folder:

    datastore.json            header: format, version, tokenizer fingerprint, segment list (written last)
    seg-00000.tokens.npy      int32 token ids, documents separated by -1
    seg-00000.sa.npy          its suffix array (int32)

Segments are memory-mapped, so opening takes milliseconds and memory holds only the pages lookups
touch. Building needs about 60 bytes per token of the largest segment (`segment_tokens`, default 8M:
about 0.5 GB peak); opening and looking up allocate O(matches), not O(datastore).

Appends (online learning from generated text) write a new small segment, fsync it, then replace the
header atomically: a crash mid-append leaves the previous header, which opens as before. When appended
segments pile up they are merged into one, by the same write-then-swap-the-header rule. An append holds
an inter-process lock on the folder (`.lock`, filelock) and re-reads the header under it, so appends
from several handles or processes (a server and a CLI run on one datastore) all land.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirrorsd.config import is_plain_file_name, is_text
from mirrorsd.errors import DatastoreError
from mirrorsd.tokenizer_check import tokenizer_fingerprint
from mirrorsd.runtime.drafters.continuation import SEPARATOR, continuation_matrix, likeliest_path
from mirrorsd.runtime.drafters.retrieval.suffix_array import build_suffix_array, find_range

FORMAT = "mirrorsd-datastore"
VERSION = 1
HEADER = "datastore.json"
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".js", ".ts", ".c", ".h", ".cpp", ".rs", ".go", ".java",
                 ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".sql"}
MAX_APPENDED_SEGMENTS = 8
LOCK = ".lock"
LOCK_TIMEOUT_S = 60.0


class _SegmentGone(Exception):
    """A segment named by the header was removed by a concurrent merge after the header was read."""


@dataclass(frozen=True)
class Match:
    length: int  # tokens of the context suffix that matched
    support: int  # occurrences that agree with the whole proposed path
    tokens: list[int]  # the proposed continuation


class Datastore:
    def __init__(self, path: Path, header: dict, segments: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.path = path
        self.header = header
        self.segments = segments

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, tokenizer=None) -> "Datastore":
        """Open a datastore; with `tokenizer`, check it was built for that tokenizer."""
        for _ in range(3):
            try:
                return cls._open(Path(path), tokenizer)
            except _SegmentGone:  # an append by another process merged it away meanwhile: read again
                continue
        return cls._open(Path(path), tokenizer, retry=False)

    @classmethod
    def _open(cls, path: Path, tokenizer, retry: bool = True) -> "Datastore":
        rebuild = f"rebuild it with `mirrorsd datastore build ... --out {path}`"
        try:
            header = json.loads((path / HEADER).read_text())
        except FileNotFoundError:
            raise DatastoreError(f"{path} is not a datastore (no {HEADER})", rebuild) from None
        except ValueError as exc:
            raise DatastoreError(f"{path / HEADER} is corrupt ({exc})", rebuild) from None
        if not isinstance(header, dict) or header.get("format") != FORMAT or \
                not isinstance(header.get("segments"), list):
            raise DatastoreError(f"{path} is not a mirrorsd datastore (its {HEADER} is not one)", rebuild)
        if header.get("version") != VERSION:
            raise DatastoreError(f"{path} has datastore version {header.get('version')}; this mirrorsd reads {VERSION}",
                                 rebuild)
        _check_entries(path, header, rebuild)
        if tokenizer is not None and header.get("tokenizer") != tokenizer_fingerprint(tokenizer):
            raise DatastoreError(
                f"{path} was built for another tokenizer ({header.get('tokenizer_name')!r}); its token ids "
                "mean nothing to this model",
                "build a datastore with this model's tokenizer: `mirrorsd datastore build ... --tokenizer MODEL`",
            )
        segments = []
        for seg in header["segments"]:
            try:
                tokens = np.load(path / f"{seg['name']}.tokens.npy", mmap_mode="r")
                sa = np.load(path / f"{seg['name']}.sa.npy", mmap_mode="r")
            except (OSError, ValueError, EOFError) as exc:  # EOFError: a file cut to zero bytes
                if retry and isinstance(exc, FileNotFoundError) and json.loads((path / HEADER).read_text()) != header:
                    raise _SegmentGone from None
                raise DatastoreError(f"{path}: segment {seg['name']} is missing or truncated ({exc})", rebuild) from None
            if len(tokens) != seg["tokens"] or len(sa) != seg["tokens"]:
                raise DatastoreError(
                    f"{path}: segment {seg['name']} has {len(tokens)} tokens / {len(sa)} index entries, "
                    f"header says {seg['tokens']}", rebuild)
            # Plain ndarray views of the maps: indexing a memmap object costs several times more per lookup.
            segments.append((tokens.view(np.ndarray), sa.view(np.ndarray)))
        return cls(path, header, segments)

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.header["segments"])

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def create(cls, out: str | os.PathLike, tokenizer, documents: Iterable[list[int]], *,
               segment_tokens: int = 8_000_000, progress=None, tokenizer_name: str = "") -> "Datastore":
        """Write a new datastore from tokenized documents (each a list of ids), in segments."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if (out / HEADER).exists():
            (out / HEADER).unlink()
        header = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_fingerprint(tokenizer),
                  "tokenizer_name": tokenizer_name or getattr(tokenizer, "name_or_path", ""), "segments": [],
                  "documents": 0, "next_segment": 0}
        buffer: list[np.ndarray] = []
        size = 0
        for doc in documents:
            if not doc:
                continue
            buffer.append(np.asarray(list(doc) + [SEPARATOR], dtype=np.int32))
            size += len(doc) + 1
            header["documents"] += 1
            if size >= segment_tokens:
                _write_segment(out, header, np.concatenate(buffer), appended=False)
                buffer, size = [], 0
                if progress:
                    progress(header)
        if buffer:
            _write_segment(out, header, np.concatenate(buffer), appended=False)
        _write_header(out, header)
        return cls.open(out, tokenizer)

    def append(self, token_ids: Sequence[int]) -> None:
        """Durably add one document (e.g. a generated reply) so later lookups can find it."""
        if not len(token_ids):
            return
        from filelock import FileLock, Timeout

        try:
            with FileLock(str(self.path / LOCK), timeout=LOCK_TIMEOUT_S):
                fresh = self._append_locked(np.asarray(list(token_ids) + [SEPARATOR], dtype=np.int32))
        except Timeout:
            raise DatastoreError(f"{self.path} stayed locked by another writer for {LOCK_TIMEOUT_S:.0f} s",
                                 f"check for a stuck mirrorsd process, or remove {self.path / LOCK}") from None
        self.header, self.segments = fresh.header, fresh.segments

    def _append_locked(self, document: np.ndarray) -> "Datastore":
        header = copy.deepcopy(Datastore.open(self.path).header)  # others may have appended since we opened
        _write_segment(self.path, header, document, appended=True)
        header["documents"] += 1
        appended = [s for s in header["segments"] if s.get("appended")]
        old_files: list[str] = []
        if len(appended) > MAX_APPENDED_SEGMENTS:  # merge the small appended segments into one
            merged = np.concatenate([np.load(self.path / f"{s['name']}.tokens.npy") for s in appended])
            header["segments"] = [s for s in header["segments"] if not s.get("appended")]
            _write_segment(self.path, header, merged, appended=True)
            old_files = [s["name"] for s in appended]
        _write_header(self.path, header)
        for name in old_files:
            for kind in ("tokens", "sa"):
                (self.path / f"{name}.{kind}.npy").unlink(missing_ok=True)
        return Datastore.open(self.path)

    # -- lookup --------------------------------------------------------------------------------

    def match(self, context: Sequence[int], k: int, min_match: int = 2, max_match: int = 16,
              max_occurrences: int = 256, min_share: float = 0.2, min_support: int = 2,
              unique_match: int = 8) -> Match | None:
        """Longest suffix of context (min_match..max_match tokens) found in the datastore, and the most
        frequent continuation after it. A continuation needs min_support agreeing occurrences, except
        after a match of unique_match+ tokens, where one occurrence is evidence enough (single occurrences
        after short matches are rarely accepted: docs/measurements.md). None when even min_match tokens
        do not occur."""
        best: list[tuple[int, int, int]] | None = None  # (segment, lo, hi) ranges of the longest match
        length = 0
        for m in range(min_match, min(max_match, len(context)) + 1):
            pattern = context[-m:]
            ranges = [(i, *find_range(tok, sa, pattern)) for i, (tok, sa) in enumerate(self.segments)]
            ranges = [r for r in ranges if r[2] > r[1]]
            if not ranges:
                break  # a longer suffix contains this one, so it cannot occur either
            best, length = ranges, m
        if not best:
            return None
        total = sum(hi - lo for _, lo, hi in best)
        rows = []
        for i, lo, hi in best:
            tokens, sa = self.segments[i]
            take = max(1, round(max_occurrences * (hi - lo) / total))
            picks = np.unique(np.linspace(lo, hi - 1, num=min(take, hi - lo)).astype(np.int64))
            starts = np.sort(np.asarray(sa[picks], dtype=np.int64)) + length
            rows.append(continuation_matrix(tokens, starts, k))
        path, support = likeliest_path(np.concatenate(rows), min_share,
                                       1 if length >= unique_match else min_support)
        return Match(length, support, path)


def _check_entries(path: Path, header: dict, rebuild: str) -> None:
    """The header's counts are integers and each segment entry names a plain file in the folder: a name is
    joined to the folder's path to read, merge and delete segments, so '../x' or '/x' would reach outside it."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not count(header.get("documents", 0)) or not count(header.get("next_segment", 0)):
        raise DatastoreError(f"{path / HEADER}: documents and next_segment must be counts", rebuild)
    for seg in header["segments"]:
        if not isinstance(seg, dict) or not isinstance(seg.get("name"), str) or not count(seg.get("tokens")) \
                or not isinstance(seg.get("appended", False), bool):
            raise DatastoreError(f"{path / HEADER}: a segment entry is not {{name, tokens, appended}}: "
                                 f"{str(seg)[:80]}", rebuild)
        if not is_plain_file_name(seg["name"]):
            raise DatastoreError(f"{path / HEADER}: segment name {seg['name'][:80]!r} is not a plain file name "
                                 "(a datastore reads only its own folder)", rebuild)


def _write_segment(root: Path, header: dict, tokens: np.ndarray, appended: bool) -> None:
    # Names are never reused while listed: a merge writes its result under a fresh name before the old
    # segments disappear from the header. A crashed append's orphan files carry the next name and are
    # simply overwritten by the next append.
    n = header.get("next_segment", 0)
    header["next_segment"] = n + 1
    name = f"seg-{n:05d}"
    sa = build_suffix_array(tokens)
    for kind, array in (("tokens", tokens), ("sa", sa)):
        final = root / f"{name}.{kind}.npy"
        tmp = root / f"{name}.{kind}.npy.tmp"
        with open(tmp, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    header["segments"].append({"name": name, "tokens": int(len(tokens)), "appended": appended})


def _write_header(root: Path, header: dict) -> None:
    tmp = root / (HEADER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(header, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / HEADER)  # the commit point
    try:
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


# -- corpora ------------------------------------------------------------------------------------

def iter_corpus_texts(paths: Sequence[str | os.PathLike]) -> Iterable[str]:
    """Texts from files, folders (recursively: source and text files) and JSONL files of conversations
    ({"messages": [{"content": ...}]}, {"text": ...} or {"prompt": ..., "completion": ...} per line)."""
    for p in map(Path, paths):
        if not p.exists():
            raise DatastoreError(f"corpus path {p} does not exist", "pass existing files or folders")
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES | {".jsonl"}) \
            if p.is_dir() else [p]
        for f in files:
            if f.suffix == ".jsonl":
                yield from _jsonl_texts(f)
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable: not corpus material
            if text.strip():
                yield text


def _jsonl_texts(path: Path) -> Iterable[str]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                raise DatastoreError(f"{where} is not valid JSON (or nested too deeply)",
                                     "one JSON object per line") from None
            if not isinstance(row, dict):
                raise DatastoreError(f"{where} is a JSON {type(row).__name__}, not an object",
                                     'one object per line: {"messages": [...]} or {"text": "..."}')
            if "messages" in row:
                messages = row["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    raise DatastoreError(f"{where}: 'messages' is not a list of message objects",
                                         'e.g. {"messages": [{"role": "user", "content": "..."}]}')
                texts = [_text_of(m.get("content"), where) for m in messages]
            else:
                texts = ["".join(_text_of(row.get(k), where) for k in ("text", "prompt", "completion"))]
            yield from (text for text in texts if text)


def _text_of(content, where: str) -> str:
    """A message's content as text: a string, or the text of OpenAI-style content parts; else an error."""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = "".join(p for p in parts if isinstance(p, str)) if len(parts) == len(content) else None
    if content is None:
        return ""
    if not isinstance(content, str):
        raise DatastoreError(f"{where}: a text or content field is a JSON {type(content).__name__}, not text",
                             'text fields are strings, e.g. {"role": "user", "content": "..."}')
    if not is_text(content):
        raise DatastoreError(f"{where} holds a lone surrogate (not valid Unicode text)", "write the file as UTF-8 text")
    return content


def build_datastore(paths: Sequence[str | os.PathLike], tokenizer, out: str | os.PathLike, *,
                    segment_tokens: int = 8_000_000, progress: bool = False, tokenizer_name: str = "") -> Datastore:
    """Tokenize a corpus (files, folders, JSONL) with the target's tokenizer and index it."""
    texts = list(iter_corpus_texts(paths))
    if not texts:
        raise DatastoreError(f"no text found in {', '.join(map(str, paths))}", "point at source/text files or JSONL")
    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("tokenizing", total=len(texts))

        def documents():
            for i in range(0, len(texts), 256):
                for ids in tokenizer(texts[i : i + 256], add_special_tokens=False)["input_ids"]:
                    yield ids
                bar.advance(task, min(256, len(texts) - i))

        return Datastore.create(out, tokenizer, documents(), segment_tokens=segment_tokens,
                                tokenizer_name=tokenizer_name)


def stdlib_sources() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def default_datastore(tokenizer, progress: bool = False, tokenizer_name: str = "") -> Datastore:
    """The datastore that needs no user data: this Python's standard library sources (tests excluded),
    built once per tokenizer and cached under MIRRORSD_CACHE."""
    from mirrorsd.catalog import cache_dir

    root = cache_dir() / "datastores" / f"stdlib-{tokenizer_fingerprint(tokenizer)[:16]}"
    if (root / HEADER).exists():
        try:
            return Datastore.open(root, tokenizer)
        except DatastoreError:
            pass  # unusable: rebuild below
    src = stdlib_sources()
    files = [f for f in sorted(src.rglob("*.py"))
             if not ({"test", "tests", "site-packages", "idlelib", "__pycache__"} & set(f.relative_to(src).parts))]
    if progress:
        import sys

        print(f"mirrorsd: building the default retrieval datastore from {len(files)} stdlib files (once)",
              file=sys.stderr, flush=True)
    return build_datastore(files, tokenizer, root, progress=progress, tokenizer_name=tokenizer_name)
