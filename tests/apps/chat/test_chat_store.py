"""Saved chats: JSON files under MIRRORSD_DATA, replaced atomically."""

from __future__ import annotations

import json
import os

import pytest

from mirrorsd.apps.chat.store import Conversation, ConversationStore, data_dir, history_file


def test_saved_chats_round_trip_newest_first_and_skip_broken_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_DATA", str(tmp_path))
    assert data_dir() == tmp_path and history_file() == tmp_path / "chat_history"
    store = ConversationStore()
    old = Conversation(messages=[{"role": "user", "content": "  first\n question " + "x" * 60}], system="s")
    new = Conversation(messages=[{"role": "user", "content": "ünïcode ok"}])
    store.save(old)
    store.save(new)
    (store.folder / "broken.json").write_text("{not json")
    listed = store.list()
    assert [c.id for c in listed] == [new.id, old.id]
    assert listed[1].messages == old.messages and listed[1].system == "s"
    assert listed[1].title.startswith("first question x") and listed[1].title.endswith("…")
    assert len(listed[1].title) == 48 and "ünïcode" in (store.folder / f"{new.id}.json").read_text("utf-8")


def test_a_save_that_dies_midway_leaves_the_previous_version(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    chat = Conversation(messages=[{"role": "user", "content": "kept"}])
    store.save(chat)
    chat.messages.append({"role": "assistant", "content": "lost"})

    def crash(src, dst):  # the process dies between writing the new file and renaming it into place
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.save(chat)
    monkeypatch.undo()
    assert json.loads(store.path(chat.id).read_text())["messages"] == [{"role": "user", "content": "kept"}]
    assert [p.name for p in tmp_path.iterdir()] == [f"{chat.id}.json"]  # no temporary file left behind


@pytest.mark.parametrize("body", ["[1, 2, 3]", "null", "42", '"text"', '{"updated": "yesterday"}',
                                  '{"messages": 5}', '{"messages": [{"content": "no role"}]}',
                                  '{"messages": [{"role": "user", "content": 7}]}', '{"system": []}',
                                  '{"created": ' + "9" * 400 + '}', '{"updated": 1e999}', "[" * 100_000 + "]" * 100_000])
def test_valid_json_that_is_not_a_conversation_is_skipped_with_a_warning(tmp_path, body, caplog):
    store = ConversationStore(tmp_path)
    good = Conversation(messages=[{"role": "user", "content": "kept"}])
    store.save(good)
    (tmp_path / "odd.json").write_text(body)
    with caplog.at_level("WARNING", logger="mirrorsd"):
        listed = store.list()
    assert [c.id for c in listed] == [good.id] and listed[0].title == "kept"
    assert "odd.json" in caplog.text


def test_the_file_name_is_the_id_and_no_id_escapes_the_folder(tmp_path):
    store = ConversationStore(tmp_path / "conversations")
    store.folder.mkdir()
    (store.folder / "hand-made.json").write_text(json.dumps(
        {"id": "../escaped", "messages": [{"role": "user", "content": "hello"}]}))
    (store.folder / "no-id.json").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    listed = {c.id: c for c in store.list()}
    assert set(listed) == {"hand-made", "no-id"}  # never the id written inside the file
    store.save(listed["hand-made"])  # saves where it was read from
    assert not (tmp_path / "escaped.json").exists() and (store.folder / "hand-made.json").is_file()
    store.delete("no-id")
    assert not (store.folder / "no-id.json").exists()
    for bad in ("../escaped", "a/b", "..", ".hidden", "", "x" * 200):
        with pytest.raises(ValueError):
            store.save(Conversation(id=bad))
    assert sorted(p.name for p in tmp_path.rglob("*.json")) == ["hand-made.json"]


def test_a_fifo_named_like_a_conversation_costs_only_itself(tmp_path, caplog):
    """A FIFO named x.json would block a read forever: the sidebar would never fill."""
    import os
    import threading

    store = ConversationStore(tmp_path)
    good = Conversation(messages=[{"role": "user", "content": "kept"}])
    store.save(good)
    os.mkfifo(tmp_path / "x.json")
    (tmp_path / "folder.json").mkdir()
    listed: list = []
    worker = threading.Thread(target=lambda: listed.extend(store.list()), daemon=True)
    with caplog.at_level("WARNING", logger="mirrorsd"):
        worker.start()
        worker.join(10)
    if worker.is_alive():  # unblock the stuck reader before failing
        with open(tmp_path / "x.json", "w"):
            pass
    assert not worker.is_alive() and [c.id for c in listed] == [good.id]
    assert "x.json" in caplog.text and "folder.json" in caplog.text
