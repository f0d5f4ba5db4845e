"""The desktop chat window, driven for real offscreen (QT_QPA_PLATFORM=offscreen) with pytest-qt:
type, get a streamed reply from the tiny model, press Stop mid-reply, read the stats widget, save a
screenshot of the window into the test's output folder."""

from __future__ import annotations

import time

import os
import re

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # set DISPLAY-less runs up before Qt starts
try:
    import PySide6.QtWidgets  # noqa: F401  (needs libEGL/libGL/fontconfig/xkbcommon from the system)
except ImportError as exc:  # say exactly what is missing, e.g. "libEGL.so.1: cannot open shared object file"
    pytest.skip(f"the Qt window cannot load here: {exc} (pip install 'mirrorsd[gui]'; on Debian "
                "apt-get install libegl1 libgl1 libfontconfig1 libxkbcommon0)", allow_module_level=True)

from PySide6.QtCore import Qt  # noqa: E402

from drafters_for_tests import FailingDrafter, PacedDrafter  # noqa: E402
from mirrorsd import Engine, GenerationConfig  # noqa: E402
from mirrorsd.apps.chat.session import ChatSettings  # noqa: E402
from mirrorsd.apps.chat.window import DRAFT_BACKGROUND, ChatWindow  # noqa: E402
from mirrorsd.runtime.drafters import NGramDrafter  # noqa: E402


@pytest.fixture
def window(qtbot, tokenizer, target_model):
    engine = Engine(target_model, tokenizer, PacedDrafter(NGramDrafter(), 0.01), name="tiny-llama")
    win = ChatWindow(engine=engine, settings=ChatSettings(temperature=0.0, max_new_tokens=200))
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    return win


def type_and_send(qtbot, win, text: str) -> None:
    qtbot.keyClicks(win.input, text)
    qtbot.keyClick(win.input, Qt.Key_Return)


def highlighted_chars(win) -> int:
    """Characters of the transcript drawn with the draft background."""
    count, block = 0, win.transcript.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().background().color() == DRAFT_BACKGROUND:
                count += frag.length()
            it += 1
        block = block.next()
    return count


def test_stream_stop_stats_and_screenshot(qtbot, window, tmp_path):
    win = window
    engine = win.session.engine
    assert "tiny-llama on torch:cpu" in win.served_by.text()

    # 1. A reply streams in, and Stop ends it mid-way.
    type_and_send(qtbot, win, "def quicksort(arr):")
    assert win.input.toPlainText() == ""  # Enter sent it
    qtbot.waitUntil(lambda: len(win._history[-1][1]) >= 5, timeout=20000)
    assert win.generating and win.stop_button.isEnabled()
    size = win.size()
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    assert win.focusWidget() is win.input  # typing goes on in the message box, not the model box
    qtbot.waitUntil(lambda: not win.generating and win.status.text() == "stopped", timeout=20000)
    assert win.size() == size  # a reply and its stats never resize the window
    shown = win.session.messages[-1]["content"]
    n_shown = int(win.stat_labels["tokens"].text().split(": ")[1])
    assert 5 <= n_shown < 200  # stopped well before max tokens
    assert shown and shown in win.transcript.toPlainText() and "stopped" in win.transcript.toPlainText()
    full = engine.generate([{"role": "user", "content": "def quicksort(arr):"}], GenerationConfig(max_new_tokens=200))
    assert full.text.startswith(shown)  # what was shown is the start of the real (lossless) reply

    # 2. A second turn runs to completion with the conversation as context.
    win.max_tokens.setValue(24)
    type_and_send(qtbot, win, "Hello world!")
    qtbot.waitUntil(lambda: win.status.text().startswith("done"), timeout=20000)
    assert [m["role"] for m in win.session.messages] == ["user", "assistant", "user", "assistant"]
    expected = engine.generate(win.session.messages[:3], GenerationConfig(max_new_tokens=24))
    assert win.session.messages[-1]["content"] == expected.text

    # 3. The stats widget shows this reply's numbers.
    result = win.last_turn.result
    stats = result.stats
    assert win.stat_labels["tokens"].text() == f"tokens: {len(result.token_ids)}"
    assert stats.verify_steps >= 1
    assert win.stat_labels["mean accepted length"].text() == \
        f"mean accepted length: {len(result.token_ids) / stats.verify_steps:.2f}"
    alpha = stats.acceptance_rate
    assert win.stat_labels["acceptance"].text() == "acceptance: " + ("n/a" if alpha is None else f"{alpha:.0%}")
    assert win.stat_labels["drafter"].text() == "drafter: " + (stats.drafted_by if stats.drafted_tokens else "no drafts")
    for label in win.stat_labels.values():  # every figure readable in full: wrapped within its share, not cut
        needed = label.fontMetrics().boundingRect(0, 0, label.width(), 10_000, int(Qt.TextWordWrap), label.text())
        assert label.wordWrap() and needed.width() <= label.width() and needed.height() <= label.height() + 2, \
            (label.text(), label.size(), needed)
    assert float(win.stat_labels["tokens/s"].text().split(": ")[1]) > 0
    details = win.stat_labels["tokens"].toolTip()  # every stats field, formatted for reading
    assert f"verify steps: {stats.verify_steps}\n" in details and "time to first token: " in details
    assert details.startswith("tokens:\n") and "\nspeculation:\n" in details  # grouped
    assert not re.search(r"\d\.\d{4,}", details), details  # no raw floats
    assert win.stat_labels["first token"].text().endswith(" s")

    # 4. Draft-accepted tokens are shaded in the rendered Markdown, and only while the box is ticked.
    win.highlight.setChecked(True)
    drafted = [t for role, pieces in win._history if role == "assistant" for t, d in pieces if d]
    visible = sum(len(t.strip()) for t in drafted)  # what of them shows (Markdown drops marks and spacing)
    assert visible == 0 or visible / 2 <= highlighted_chars(win) <= sum(len(t) for t in drafted)
    path = tmp_path / "chat-window.png"
    assert win.grab().save(str(path)) and path.stat().st_size > 1000
    print(f"\nscreenshot: {path}")
    win.highlight.setChecked(False)
    assert highlighted_chars(win) == 0

    # 5. New chat clears the conversation.
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    assert win.session.messages == [] and win.transcript.toPlainText() == ""


def test_errors_are_shown_and_the_conversation_is_kept(qtbot, window):
    win = window
    win.max_tokens.setValue(8)
    type_and_send(qtbot, win, "hello")
    qtbot.waitUntil(lambda: win.status.text().startswith("done"), timeout=20000)
    kept = list(win.session.messages)

    too_long = "hi " * 400  # over the tiny model's 256-token context
    type_and_send(qtbot, win, too_long)
    qtbot.waitUntil(lambda: win.status.text().startswith("error"), timeout=20000)
    assert win.session.messages == kept
    assert "context window" in win.transcript.toPlainText() and "hint:" in win.transcript.toPlainText()
    assert win.input.toPlainText() == too_long.strip()  # given back to edit and resend

    engine = win.session.engine
    win.model_box.setCurrentText("no-such-model")
    qtbot.mouseClick(win.load_button, Qt.LeftButton)
    assert win.progress.isVisible()  # loading shows progress
    qtbot.waitUntil(lambda: "could not load" in win.status.text(), timeout=20000)
    assert "unknown model" in win.transcript.toPlainText()
    assert win.session.engine is engine and win.session.messages == kept and not win.progress.isVisible()


def test_a_failing_draft_device_is_reported_and_the_reply_is_unchanged(qtbot, tokenizer, target_model):
    engine = Engine(target_model, tokenizer, FailingDrafter(len(tokenizer), "raise"), name="tiny-llama")
    win = ChatWindow(engine=engine, settings=ChatSettings(temperature=0.0, max_new_tokens=16))
    qtbot.addWidget(win)
    type_and_send(qtbot, win, "hello")
    qtbot.waitUntil(lambda: win.status.text().startswith("done"), timeout=20000)
    assert "NPU went away" in win.transcript.toPlainText() and "the reply is unaffected" in win.transcript.toPlainText()
    plain = Engine(target_model, tokenizer, None).generate([{"role": "user", "content": "hello"}],
                                                           GenerationConfig(max_new_tokens=16))
    assert win.session.messages[-1]["content"] == plain.text


CODE_REPLY = "Sorted:\n\n```python\ndef square(x):\n    return x * x\n```\n\nDone."


def char_formats(win, text: str) -> list:
    """The character formats the transcript draws `text` with (one per fragment inside it)."""
    doc = win.transcript.document()
    found = doc.find(text)
    assert not found.isNull(), f"{text!r} is not in the transcript"
    formats, block = [], doc.findBlock(found.selectionStart())
    it = block.begin()
    while not it.atEnd():
        formats.append(it.fragment().charFormat())
        it += 1
    return formats


def click_text(qtbot, win, text: str) -> None:
    """A real mouse click on `text` in the transcript (a link there fires as it would for a user)."""
    found = win.transcript.document().find(text)
    cursor = win.transcript.textCursor()
    cursor.setPosition(found.selectionStart() + 1)
    qtbot.mouseClick(win.transcript.viewport(), Qt.LeftButton, pos=win.transcript.cursorRect(cursor).center())


def test_markdown_copy_system_prompt_and_saved_chats(qtbot, tokenizer, target_model, tmp_path):
    from PySide6.QtGui import QGuiApplication

    from mirrorsd.apps.chat.store import Conversation, ConversationStore

    store = ConversationStore(tmp_path / "chats")
    earlier = Conversation(messages=[{"role": "user", "content": "square it"},
                                     {"role": "assistant", "content": CODE_REPLY}], system="Be brief.")
    store.save(earlier)
    engine = Engine(target_model, tokenizer, NGramDrafter(), name="tiny-llama")
    win = ChatWindow(engine=engine, settings=ChatSettings(temperature=0.0, max_new_tokens=8), store=store)
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)

    # A saved chat is listed and reopens with a click: Markdown drawn, code highlighted in a monospace font.
    title, when = win.conversations.item(0).text().split("\n")
    assert win.conversations.count() == 1 and title == "square it"
    assert when == time.strftime("%b %d %H:%M", time.localtime(store.load(earlier.id).updated))  # its date
    item = win.conversations.item(0)
    qtbot.mouseClick(win.conversations.viewport(), Qt.LeftButton, pos=win.conversations.visualItemRect(item).center())
    assert win.session.messages == earlier.messages and win.system.text() == "Be brief."
    shown = win.transcript.toPlainText()
    assert "```" not in shown and "def square(x):" in shown  # the fence became a code block
    code = char_formats(win, "def square(x):")
    assert code and all(f.fontFixedPitch() or "mono" in (f.fontFamilies() or [""])[0].lower() for f in code)
    assert len({f.foreground().color().name() for f in code}) >= 2  # keywords coloured apart from names

    # The block's Copy link puts exactly the code on the clipboard.
    click_text(qtbot, win, "Copy")
    qtbot.waitUntil(lambda: QGuiApplication.clipboard().text() == "def square(x):\n    return x * x\n", timeout=5000)

    # The chat goes on with its system prompt sent first, and is saved again under the same id.
    type_and_send(qtbot, win, "and cube?")
    qtbot.waitUntil(lambda: win.status.text().startswith("done"), timeout=20000)
    messages = [{"role": "system", "content": "Be brief."}] + win.session.messages[:3]
    assert win.session.messages[-1]["content"] == engine.generate(messages, GenerationConfig(max_new_tokens=8)).text
    again = store.load(earlier.id)
    assert again.messages == win.session.messages and len(again.messages) == 4 and again.system == "Be brief."
    assert "cut at the 8-token limit" in win.transcript.toPlainText()

    # New chat + a turn = a second saved chat, listed first (newest).
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    type_and_send(qtbot, win, "hello there")
    qtbot.waitUntil(lambda: win.conversations.count() == 2, timeout=20000)
    assert win.conversations.item(0).text().startswith("hello there\n") and len(store.list()) == 2

    # Chats can be renamed and deleted (the sidebar's right-click menu calls these).
    newest = win.conversations.item(0).data(Qt.UserRole)
    win.rename_conversation(earlier.id, "Squares and cubes")
    assert store.load(earlier.id).name == "Squares and cubes"
    assert [win.conversations.item(i).text().split("\n")[0] for i in range(2)] == ["Squares and cubes", "hello there"]
    win.delete_conversation(newest)  # the open chat: the window starts a new one
    assert [c.id for c in store.list()] == [earlier.id] and win.session.messages == []


def test_model_list_marks_cached_models_and_asks_before_a_download(qtbot, monkeypatch, tmp_path, tiny_folder):
    import shutil

    from PySide6.QtWidgets import QMessageBox

    from mirrorsd import catalog

    # A real cache holding only smollm2-135m (the tiny model's files under its name, with the manifest).
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "cache"))
    root = catalog.entry_dir("smollm2-135m")
    shutil.copytree(tiny_folder, root / "hf")
    catalog._write_manifest(root, catalog.CATALOG["smollm2-135m"])
    asked = []

    def answer_no(parent, title, text, *args):  # only the dialog's answer is replaced
        asked.append(text)
        return QMessageBox.No

    monkeypatch.setattr(QMessageBox, "question", answer_no)
    win = ChatWindow("qwen2.5-coder-1.5b", "ngram", load=False)
    qtbot.addWidget(win)
    items = [win.model_box.itemText(i) for i in range(win.model_box.count())]
    assert "smollm2-135m  ✓ cached" in items and "qwen2.5-coder-1.5b  ↓ 1070 MB" in items

    qtbot.mouseClick(win.load_button, Qt.LeftButton)
    assert asked and "qwen2.5-coder-1.5b (about 1070 MB)" in asked[0]
    assert "download cancelled" in win.status.text() and win._loader is None and not win.progress.isVisible()

    # A cached model loads without a question; picking it from the list puts its bare name in the field.
    win.model_box.activated.emit(items.index("smollm2-135m  ✓ cached"))
    assert win.model_box.currentText() == "smollm2-135m"
    qtbot.mouseClick(win.load_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.session.engine is not None, timeout=60000)
    assert len(asked) == 1 and win.served_by.text().startswith("smollm2-135m")


def test_ctrl_q_quits_and_the_application_is_named(qtbot, window):
    from mirrorsd.apps.chat.window import make_application

    app = make_application()
    assert (app.applicationName(), app.desktopFileName()) == ("mirrorsd", "mirrorsd")
    assert window.windowTitle() == "mirrorsd chat"
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5000)
    qtbot.keyClick(window.input, Qt.Key_Q, Qt.ControlModifier)
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=5000)


def test_screenshot_script_draws_a_highlighted_code_block(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from PySide6.QtGui import QImage

    script = Path(__file__).resolve().parents[3] / "scripts" / "chat_screenshot.py"
    out = tmp_path / "shot.png"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert done.returncode == 0, done.stderr
    image = QImage(str(out))
    assert image.width() >= 900 and image.height() >= 600
    # The code block's keyword green (pygments' default style, #008000) is drawn somewhere.
    colours = {image.pixelColor(x, y).name() for x in range(0, image.width(), 2) for y in range(0, image.height(), 2)}
    assert "#008000" in colours


def test_a_streaming_reply_is_drawn_as_markdown_and_a_list_does_not_swallow_the_next_title(qtbot, window):
    from mirrorsd.results import GenerationStats, TokenEvent

    win = window
    win._history += [("user", [("show me", False)]), ("assistant", [])]
    win._streaming = True
    win._render()
    for i, piece in enumerate(["Here:\n\n", "```python\n", "def f(x):\n", "    return x\n"]):
        win._on_token(TokenEvent(i, piece, i % 2 == 1, i, GenerationStats()))
    # mid-stream (the fence is still open): already a code block in a monospace font
    qtbot.waitUntil(lambda: not win.transcript.document().find("def f(x):").isNull(), timeout=5000)
    code = char_formats(win, "def f(x):")
    assert "```" not in win.transcript.toPlainText()
    assert all(f.fontFixedPitch() or "mono" in (f.fontFamilies() or [""])[0].lower() for f in code)

    win._history[-1] = ("assistant", [("Two things:\n\n- one\n- two\n", False)])
    win._streaming = False
    win._history.append(("user", [("next", False)]))
    win._render()
    doc = win.transcript.document()
    titles = []
    block = doc.begin()
    while block.isValid():
        if block.text() == "You":
            titles.append(block)
        block = block.next()
    assert len(titles) == 2 and all(t.textList() is None for t in titles)  # not drawn as a list bullet
