"""Draw the chat window offscreen and save a PNG of it (the README's docs/chat-window.png).

    python scripts/chat_screenshot.py [out.png]                     # a saved chat with a code block
    python scripts/chat_screenshot.py out.png --live [MESSAGE ...]  # smollm2-135m replies for real

By default no model runs: a fixed conversation (written here, not a model's output) is saved and
reopened from the sidebar the way a user reopens a chat, to show Markdown and code highlighting.
--live sends MESSAGE(s) to smollm2-135m (greedy, 64 tokens) and shows its replies and live stats.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

CONVERSATION = [
    {"role": "user", "content": "Write quicksort in Python."},
    {"role": "assistant", "content": (
        "Here is a short **quicksort**: pick a pivot, split the rest, sort both halves.\n\n"
        "```python\n"
        "def quicksort(arr: list[int]) -> list[int]:\n"
        "    if len(arr) <= 1:\n"
        "        return arr\n"
        "    pivot, *rest = arr\n"
        "    smaller = [x for x in rest if x < pivot]\n"
        "    larger = [x for x in rest if x >= pivot]\n"
        "    return quicksort(smaller) + [pivot] + quicksort(larger)\n"
        "```\n\n"
        "It runs in `O(n log n)` on average and `O(n²)` when the pivot is always the smallest element.")},
]


def saved_chat_window():
    from mirrorsd.apps.chat.store import Conversation, ConversationStore
    from mirrorsd.apps.chat.window import ChatWindow

    store = ConversationStore()
    saved = Conversation(messages=CONVERSATION, system="You are a concise Python tutor.", model="smollm2-135m")
    store.save(saved)
    window = ChatWindow("smollm2-135m", "ngram", load=False, store=store)
    window.show()
    window.open_conversation(saved.id)
    window.conversations.setCurrentRow(0)
    return window


def live_window(messages: list[str]):
    from PySide6.QtCore import QEventLoop, QTimer

    from mirrorsd import Engine
    from mirrorsd.apps.chat.session import ChatSettings
    from mirrorsd.apps.chat.window import ChatWindow

    window = ChatWindow(engine=Engine.load("smollm2-135m", draft="auto"),
                        settings=ChatSettings(temperature=0.0, max_new_tokens=64))
    window.show()
    for message in messages or ["Add a docstring to this function and show the whole function:\n\n"
                                "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]"]:
        window.input.setPlainText(message)
        window.send()
        loop = QEventLoop()
        poll = QTimer(interval=100, timeout=lambda: None if window.generating else loop.quit())
        poll.start()
        loop.exec()
        poll.stop()
    return window


def main(argv: list[str]) -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="mirrorsd-shot-", ignore_cleanup_errors=True) as data:
        os.environ["MIRRORSD_DATA"] = data  # leave the user's chats alone
        shoot(argv)


def shoot(argv: list[str]) -> None:
    from mirrorsd.apps.chat.window import make_application

    out = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "docs" / "chat-window.png"
    app = make_application()
    window = live_window(argv[2:]) if argv[1:2] == ["--live"] else saved_chat_window()
    window.resize(1000, 680)
    app.processEvents()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not window.grab().save(str(out)):
        raise SystemExit(f"could not write {out}")
    print(f"{out}: {window.status.text()}")
    window.close()


if __name__ == "__main__":
    main(sys.argv[1:])
