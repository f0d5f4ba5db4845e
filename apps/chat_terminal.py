"""`mirrorsd chat` without a display: the same chat in a terminal.

Type a message and press Enter; the reply streams, tokens that came from the draft highlighted
(when the output is a terminal, or with --highlight). Ctrl-C stops a reply at once and keeps the
chat; Ctrl-C or Ctrl-D at the prompt leaves. Commands: /new, /temp X, /max N, /stats, /help, /quit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TextIO

from mirrorsd.apps.chat_session import ChatSession, engine_summary, stats_line, with_settings
from mirrorsd.errors import MirrorsdError

HELP = """commands:
  /new        start a new chat (forget the conversation)
  /temp X     sampling temperature (0 = greedy)
  /max N      most tokens per reply
  /stats      every statistic of the last reply (JSON)
  /help       this text
  /quit       leave (Ctrl-D also does)
Ctrl-C stops a reply mid-way; the chat goes on."""

DRAFT_STYLE = "\x1b[32m"  # draft-accepted tokens: green
DIM, RESET = "\x1b[2m", "\x1b[0m"


def run_terminal_chat(session: ChatSession, read: Callable[[str], str] = input, out: TextIO = sys.stdout,
                      highlight: bool | None = None) -> None:
    """The read-reply loop. `read` is input() unless a test or an embedding program supplies lines."""
    colour = out.isatty() if highlight is None else highlight
    dim = (lambda s: f"{DIM}{s}{RESET}") if colour else (lambda s: s)
    out.write(dim(f"mirrorsd chat · {engine_summary(session.engine)} · /help for commands") + "\n")
    last_stats: dict = {}
    while True:
        try:
            line = read("you> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text.partition(" ")
            if command in ("/quit", "/exit"):
                return
            try:
                if command == "/new":
                    session.new_chat()
                    out.write(dim("(new chat)") + "\n")
                elif command == "/temp":
                    with_settings(session, temperature=float(arg))
                    out.write(dim(f"(temperature {session.settings.temperature})") + "\n")
                elif command == "/max":
                    with_settings(session, max_new_tokens=int(arg))
                    out.write(dim(f"(max tokens {session.settings.max_new_tokens})") + "\n")
                elif command == "/stats":
                    out.write((json.dumps(last_stats) if last_stats else "(no reply yet)") + "\n")
                else:
                    out.write(HELP + "\n")
            except (ValueError, MirrorsdError) as exc:
                out.write(f"error: {exc}\n")
            continue

        out.write("assistant> ")

        def show(event) -> None:
            out.write(f"{DRAFT_STYLE}{event.text}{RESET}" if colour and event.from_draft and event.text else event.text)
            out.flush()

        turn = session.reply(text, on_token=show)
        if turn.finish_reason == "error":
            out.write(f"\nerror: {turn.error}\n")
            continue
        last_stats = turn.stats
        note = " · stopped" if turn.finish_reason == "cancelled" else ""
        out.write(turn.tail + "\n" + dim(f"[{stats_line(turn.stats)}{note}]") + "\n")
        for reason in turn.stats.get("fallbacks", ()):
            out.write(dim(f"[{reason}; the reply is unaffected]") + "\n")
