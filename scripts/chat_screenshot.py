"""Render the chat window offscreen with a real model, send one message, save a PNG of the window.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/chat_screenshot.py docs/chat-window.png [MESSAGE]

Used to make the README's screenshot; uses smollm2-135m with the default drafter, greedy, 64 tokens per reply.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEventLoop, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from mirrorsd import Engine  # noqa: E402
from mirrorsd.apps.chat_session import ChatSettings  # noqa: E402
from mirrorsd.apps.chat_window import ChatWindow  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    messages = sys.argv[2:] or ["Add a docstring to this function and show the whole function:\n\n"
                                "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]"]
    app = QApplication.instance() or QApplication([])
    window = ChatWindow(engine=Engine.load("smollm2-135m", draft="auto"),
                        settings=ChatSettings(temperature=0.0, max_new_tokens=64))
    window.resize(1000, 760)
    window.show()
    for message in messages:
        window.input.setPlainText(message)
        window.send()
        loop = QEventLoop()
        poll = QTimer(interval=100, timeout=lambda: None if window.generating else loop.quit())
        poll.start()
        loop.exec()
        poll.stop()
        app.processEvents()
    window.grab().save(out)
    print(f"{out}: {window.status.text()}; " + " · ".join(label.text() for label in window.stat_labels.values()))
    window.close()


if __name__ == "__main__":
    main()
