"""Datastore build / open / append round trips, durability, and its error cases."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from mirrorsd.errors import DatastoreError
from mirrorsd.runtime.drafters.retrieval.datastore import HEADER, Datastore, _write_segment, build_datastore
from conftest import make_tokenizer

CODE = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "fib.py").write_text(CODE)
    (src / "notes.md").write_text("The quick brown fox jumps over the lazy dog.")
    (src / "image.bin").write_bytes(bytes(range(256)))  # not a text file: skipped
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Hello world! How can I help?"}]})
                     + "\n" + json.dumps({"text": "import numpy as np\n"}) + "\n")
    return [src, chats]


def test_build_open_and_match(corpus, tokenizer, tmp_path):
    store = build_datastore(corpus, tokenizer, tmp_path / "ds")
    assert store.header["documents"] == 5  # two files, two chat messages, one text row
    reopened = Datastore.open(tmp_path / "ds", tokenizer)
    assert reopened.num_tokens == store.num_tokens > 0
    ids = tokenizer(CODE, add_special_tokens=False)["input_ids"]
    cut = len(tokenizer("def fibonacci(n):\n    a, b =", add_special_tokens=False)["input_ids"])
    match = reopened.match(ids[:cut], k=6)
    assert match is not None and match.length >= 2
    assert match.tokens == ids[cut : cut + len(match.tokens)] and match.tokens
    assert reopened.match(tokenizer("zzzz qqqq", add_special_tokens=False)["input_ids"], 4) is None


def test_append_is_found_after_reopening_and_merges(corpus, tokenizer, tmp_path):
    store = build_datastore(corpus, tokenizer, tmp_path / "ds")
    replies = [f"reply number {i}: the answer is {i * 7} apples" for i in range(12)]
    for text in replies:
        store.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    reopened = Datastore.open(tmp_path / "ds", tokenizer)
    assert len(reopened.header["segments"]) <= 1 + 9  # appended segments were merged
    assert len(list((tmp_path / "ds").glob("*.npy"))) == 2 * len(reopened.header["segments"])
    for i in (0, 11):
        ids = tokenizer(replies[i], add_special_tokens=False)["input_ids"]
        prefix = tokenizer(f"reply number {i}: the answer", add_special_tokens=False)["input_ids"]
        match = reopened.match(prefix, k=4)
        assert match is not None and match.tokens == ids[len(prefix) : len(prefix) + len(match.tokens)]


def test_a_crash_mid_append_leaves_a_datastore_that_opens(corpus, tokenizer, tmp_path):
    store = build_datastore(corpus, tokenizer, tmp_path / "ds")
    before = store.num_tokens
    header = json.loads((tmp_path / "ds" / HEADER).read_text())
    _write_segment(tmp_path / "ds", header, np.arange(50, dtype=np.int32), appended=True)  # segment, no header
    (tmp_path / "ds" / (HEADER + ".tmp")).write_text('{"half a hea')  # a header write cut short
    reopened = Datastore.open(tmp_path / "ds", tokenizer)
    assert reopened.num_tokens == before
    reopened.append([1, 2, 3])  # and it can be appended to again
    assert Datastore.open(tmp_path / "ds", tokenizer).num_tokens == before + 4


def test_foreign_tokenizer_is_refused(corpus, tokenizer, tmp_path):
    build_datastore(corpus, tokenizer, tmp_path / "ds")
    other = make_tokenizer(corpus=["completely different text, other merges " * 3, "zzz yyy xxx"])
    with pytest.raises(DatastoreError, match="another tokenizer") as info:
        Datastore.open(tmp_path / "ds", other)
    assert "--tokenizer" in info.value.hint


def test_truncated_or_corrupt_datastores_are_clear_errors(corpus, tokenizer, tmp_path):
    build_datastore(corpus, tokenizer, tmp_path / "ds")
    seg = tmp_path / "ds" / "seg-00000.sa.npy"
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatastoreError, match="truncated"):
        Datastore.open(tmp_path / "ds")
    seg.write_bytes(data)
    (tmp_path / "ds" / HEADER).write_text("{not json")
    with pytest.raises(DatastoreError, match="corrupt"):
        Datastore.open(tmp_path / "ds")
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.open(tmp_path / "nothing-here")


def test_memory_stays_bounded_on_a_large_corpus(tokenizer, tmp_path):
    """2M tokens in 250k-token segments: building peaks near one segment's work arrays, and opening +
    lookups allocate almost nothing (memory-mapped), not the 16 MB of index."""
    rng = np.random.default_rng(0)
    docs = (rng.integers(0, 300, 1000).tolist() for _ in range(2000))  # 2M tokens, streamed
    tracemalloc.start()
    Datastore.create(tmp_path / "big", tokenizer, docs, segment_tokens=250_000)
    _, build_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert build_peak < 80 * 250_000  # ~60 bytes/token of one segment, not of the whole corpus (2M)

    tracemalloc.start()
    store = Datastore.open(tmp_path / "big", tokenizer)
    for _ in range(50):
        store.match(rng.integers(0, 300, 20).tolist(), k=8)
    _, lookup_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert store.num_tokens == 2_002_000 and len(store.segments) == 8
    assert lookup_peak < 2_000_000


def _doc(start: int) -> list[int]:
    return list(range(start, start + 12))  # distinct ids: a 10-token match is unique, so one copy is found


def _found(store: Datastore, start: int) -> bool:
    match = store.match(_doc(start)[:10], 1)
    return match is not None and match.tokens == [start + 10]


def _append_many(path: str, start: int, n: int) -> None:
    store = Datastore.open(path)
    for i in range(n):
        store.append(_doc(start + 20 * i))


def test_appends_from_two_handles_and_two_processes_all_land(corpus, tokenizer, tmp_path):
    """Each append re-reads the header under an inter-process lock: nothing another writer added is lost."""
    import multiprocessing

    store = build_datastore(corpus, tokenizer, tmp_path / "ds")
    docs = store.header["documents"]
    a, b = Datastore.open(tmp_path / "ds"), Datastore.open(tmp_path / "ds")
    b.append(_doc(100))
    a.append(_doc(200))  # a's header predates b's append
    reopened = Datastore.open(tmp_path / "ds")
    assert reopened.header["documents"] == docs + 2
    assert _found(reopened, 100) and _found(reopened, 200)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path / "ds"), 1000 * (k + 1), 12)) for k in range(2)]
    for p in procs:
        p.start()
    _append_many(str(tmp_path / "ds"), 3000, 12)  # and this process at the same time
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    final = Datastore.open(tmp_path / "ds")
    assert final.header["documents"] == docs + 2 + 36
    assert all(_found(final, start + 20 * i) for start in (1000, 2000, 3000) for i in range(12))


@pytest.mark.parametrize("header", ["[]", '{"format": "mirrorsd-datastore", "version": 1}'])
def test_a_header_that_is_not_a_datastore_is_a_clear_error(corpus, tokenizer, tmp_path, header):
    build_datastore(corpus, tokenizer, tmp_path / "ds")
    (tmp_path / "ds" / HEADER).write_text(header)
    with pytest.raises(DatastoreError, match="not a mirrorsd datastore"):
        Datastore.open(tmp_path / "ds")


@pytest.mark.parametrize("name", ["../victim/precious", "/tmp/precious", "..", "sub/seg", "seg\\..\\x", "", ".hidden",
                                  "seg\x00x", "a" * 200])
def test_a_segment_name_is_a_plain_file_name_never_a_path(corpus, tokenizer, tmp_path, name):
    """A header naming '../victim/precious' made a merge delete files outside the datastore and reads follow
    it: a name is joined to the folder, so anything but a plain file name is refused before any file is read."""
    victim = tmp_path / "victim"
    victim.mkdir()
    build_datastore(corpus, tokenizer, tmp_path / "ds")
    for kind in ("tokens", "sa"):  # a valid segment, so only the name can make the open fail
        (victim / f"precious.{kind}.npy").write_bytes((tmp_path / "ds" / f"seg-00000.{kind}.npy").read_bytes())
    header = json.loads((tmp_path / "ds" / HEADER).read_text())
    header["segments"].append({**header["segments"][0], "name": name, "appended": True})
    (tmp_path / "ds" / HEADER).write_text(json.dumps(header))
    with pytest.raises(DatastoreError, match="plain file name"):
        Datastore.open(tmp_path / "ds")
    store = build_datastore(corpus, tokenizer, tmp_path / "ok")
    (tmp_path / "ok" / HEADER).write_text(json.dumps(header))  # appends (and their merges) refuse it too
    with pytest.raises(DatastoreError, match="plain file name"):
        for i in range(12):
            store.append([5, 6, 7, i])
    assert sorted(p.name for p in victim.iterdir()) == ["precious.sa.npy", "precious.tokens.npy"]


@pytest.mark.parametrize("change", [
    {"documents": "5"}, {"documents": -1}, {"next_segment": 1.5}, {"next_segment": True},
    {"segments": ["seg-00000"]}, {"segments": [{"name": 7, "tokens": 3}]}, {"segments": [{"name": "seg-00000"}]},
    {"segments": [{"name": "seg-00000", "tokens": "3"}]}, {"segments": [{"name": "seg-00000", "tokens": 3,
                                                                         "appended": "no"}]},
])
def test_a_header_entry_of_the_wrong_type_is_a_datastore_error(corpus, tokenizer, tmp_path, change):
    build_datastore(corpus, tokenizer, tmp_path / "ds")
    header = json.loads((tmp_path / "ds" / HEADER).read_text())
    (tmp_path / "ds" / HEADER).write_text(json.dumps({**header, **change}))
    with pytest.raises(DatastoreError):
        Datastore.open(tmp_path / "ds")


def test_a_segment_cut_to_zero_bytes_is_a_datastore_error(corpus, tokenizer, tmp_path):
    build_datastore(corpus, tokenizer, tmp_path / "ds")
    (tmp_path / "ds" / "seg-00000.sa.npy").write_bytes(b"")
    with pytest.raises(DatastoreError, match="missing or truncated"):
        Datastore.open(tmp_path / "ds")
