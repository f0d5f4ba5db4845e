"""`mirrorsd chat`: the desktop window where there is a display, a terminal chat where there is none."""

from __future__ import annotations

import os
import sys

from mirrorsd.apps.chat_session import ChatSession, ChatSettings


def why_no_window() -> str | None:
    """None if a Qt window can open here; otherwise the reason, for the fallback message."""
    if sys.platform not in ("darwin", "win32") and not (
            os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM")):
        return "no display (DISPLAY and WAYLAND_DISPLAY are unset)"
    try:
        import PySide6.QtWidgets  # noqa: F401
    except ImportError as exc:
        return f"the desktop window needs PySide6 (pip install 'mirrorsd[gui]'): {exc}"
    return None


def run_chat(target: str, draft: str, device: str = "auto", dtype: str = "auto",
             settings: ChatSettings | None = None, terminal: bool = False, highlight: bool | None = None,
             backend: str = "auto") -> int:
    reason = "--terminal" if terminal else why_no_window()
    if reason is None:
        from mirrorsd.apps.chat_window import run_window

        return run_window(target, draft, device, dtype, settings, backend=backend)
    if not terminal:
        print(f"mirrorsd chat: {reason}; chatting in the terminal", file=sys.stderr)
    from mirrorsd.apps.chat_terminal import run_terminal_chat
    from mirrorsd.engine import Engine

    with Engine.load(target=target, draft=draft, device=device, dtype=dtype, progress=True, backend=backend) as engine:
        run_terminal_chat(ChatSession(engine, settings), highlight=highlight)
    return 0
