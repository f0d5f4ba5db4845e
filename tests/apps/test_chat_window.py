"""The desktop chat window, driven for real offscreen (QT_QPA_PLATFORM=offscreen) with pytest-qt:
type, get a streamed reply from the tiny model, press Stop mid-reply, read the stats widget, save a
screenshot of the window into the test's output folder."""

from __future__ import annotations

import os

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
from mirrorsd.apps.chat_session import ChatSettings  # noqa: E402
from mirrorsd.apps.chat_window import DRAFT_BACKGROUND, ChatWindow  # noqa: E402
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
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not win.generating and win.status.text() == "stopped", timeout=20000)
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
    assert win.stat_labels["drafter"].text() == f"drafter: {stats.drafter}"
    assert float(win.stat_labels["tokens/s"].text().split(": ")[1]) > 0
    assert "verify_steps" in win.stat_labels["tokens"].toolTip()  # every stats field, in the tooltip

    # 4. Draft-accepted tokens are highlighted, and only while the box is ticked.
    drafted = sum(len(t) for role, pieces in win._history if role == "assistant" for t, d in pieces if d)
    assert highlighted_chars(win) == drafted
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
