"""`mirrorsd chat` without a display: the same chat in a terminal.

Type a message and press Enter; the reply streams, tokens that came from the draft highlighted
(when the output is a terminal, or with --highlight). A line ending in a backslash continues on the
next line (and in a terminal, Esc then Enter inserts a new line). Up/Down recall earlier messages,
kept across sessions in the user data folder. Ctrl-C stops a reply at once and keeps the chat;
Ctrl-C or Ctrl-D at the prompt leaves. Commands: see HELP.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from mirrorsd.apps.chat.session import (ChatSession, engine_summary, finish_note, model_info, stats_details,
                                         stats_line, with_settings)
from mirrorsd.errors import MirrorsdError

COMMANDS = {
    "/new": "start a new chat (forget the conversation)",
    "/system TEXT": "set the system prompt (/system alone clears it)",
    "/temp X": "sampling temperature (0 = greedy)",
    "/max N": "most tokens per reply",
    "/stats": "every statistic of the last reply, grouped",
    "/show info": "the model: backend, family, size, quantization, context, drafter",
    "/help": "this text",
    "/bye": "leave (also /quit, Ctrl-D)",
}
HELP = "commands:\n" + "\n".join(f"  {name:<13}{what}" for name, what in COMMANDS.items()) + """
\"\"\" starts a message of several lines, up to a line ending in \"\"\" (as in ollama); a line ending in \\ also
continues on the next line, and in a terminal Esc then Enter starts a new line.
Ctrl-C stops a reply mid-way; the chat goes on."""

DRAFT_STYLE = "\x1b[32m"  # draft-accepted tokens: green
DIM, RESET = "\x1b[2m", "\x1b[0m"


def line_reader(history: Path | None = None, **prompt_options) -> Callable[[str], str]:
    """prompt_toolkit's line editor with a persistent history, in a terminal; input() otherwise (pipes,
    tests), where an editor would only get in the way. `prompt_options` go to PromptSession (tests pass
    their own input and output)."""
    if not prompt_options and not (sys.stdin.isatty() and sys.stdout.isatty()):
        return input
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings
    except ImportError:  # an install without it still chats, without line editing
        return input

    from mirrorsd.apps.chat.store import history_file

    path = history or history_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = KeyBindings()

    @keys.add("escape", "enter")  # Esc+Enter (also Alt+Enter): a new line instead of sending
    def _(event) -> None:
        event.current_buffer.insert_text("\n")

    return PromptSession(history=FileHistory(str(path)), key_bindings=keys, **prompt_options).prompt


@contextlib.contextmanager
def quiet_input(stream: TextIO | None = None):
    """While a reply streams, the terminal does not echo what is typed (it would land inside the reply's text);
    the keys stay in the input buffer and the next prompt reads them, as in ollama. A no-op off a terminal."""
    stream = stream or sys.stdin
    try:
        import termios

        fd = stream.fileno()
        old = termios.tcgetattr(fd) if os.isatty(fd) else None
    except (ImportError, OSError, ValueError, AttributeError):  # Windows, a pipe, a closed or replaced stdin
        old = None
    if old is None:
        yield
        return
    quiet = list(old)
    quiet[3] &= ~termios.ECHO  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


def read_message(read: Callable[[str], str]) -> str:
    """One message: a line, and the lines after it while each ends in a backslash; or, as ollama reads it, a
    block from a line starting with \"\"\" to the line that ends with \"\"\" (the quotes are not part of it)."""
    line = read("you> ")
    if line.lstrip().startswith('"""'):
        block = line.lstrip()[3:]
        while not (block.rstrip().endswith('"""') and (block.strip() != "" or block.count('"""'))):
            block += "\n" + read("...> ")
        return block.rstrip()[:-3]
    while line.endswith("\\"):
        line = line[:-1] + "\n" + read("...> ")
    return line


SETTINGS = {  # command -> (setting, its type, what a valid value is, its name in confirmations)
    "/temp": ("temperature", float, "a number >= 0 (0 = greedy)", "temperature"),
    "/max": ("max_new_tokens", int, "a whole number >= 1", "max tokens"),
}


def change_setting(session: ChatSession, command: str, arg: str) -> str:
    """/temp X, /max N: the new value; without a value, the current one; a bad value, the usage."""
    name, kind, valid, label = SETTINGS[command]
    current = getattr(session.settings, name)
    usage = f"usage: {command} {'X' if kind is float else 'N'}, {valid} (now {current})"
    if not arg:
        return usage
    try:
        with_settings(session, **{name: kind(arg)})
    except (ValueError, MirrorsdError):
        return usage
    return f"({label} {getattr(session.settings, name)})"


def run_command(session: ChatSession, text: str, last_stats: dict) -> str | None:
    """Carry out a /command and say what happened; None for /quit."""
    command, _, arg = text.partition(" ")
    arg = arg.strip()
    if command in ("/quit", "/exit", "/bye"):
        return None
    if command == "/show":
        return model_info(session.engine) if arg == "info" else "usage: /show info"
    if command == "/new":
        session.new_chat()
        return "(new chat)"
    if command == "/system":
        with_settings(session, system=arg)
        return f"(system prompt: {arg})" if arg else "(system prompt cleared)"
    if command in SETTINGS:
        return change_setting(session, command, arg)
    if command == "/stats":
        return stats_details(last_stats) if last_stats else "(no reply yet)"
    if command == "/help":
        return HELP
    return f"unknown command {command}\n{HELP}"


QUIT_HINT = "(Use Ctrl + d or /quit to exit.)"


class WordWrap:
    """Streamed text wrapped at a width, between words: a word that would cross the edge starts the next line
    (a longer one than the width is left whole). The word still being streamed, and the spaces before it, are
    held back until the word ends, so a word is never split across pieces and no line ends in a space.
    `style(text, from_draft)` colours a piece of a word."""

    def __init__(self, out: TextIO, width: int, style: Callable[[str, bool], str], column: int = 0) -> None:
        self.out, self.width, self.style = out, max(width, 20), style
        self.column = column  # where the cursor starts (after a prompt)
        self.space = ""  # spaces between the last word written and the next
        self.word: list[tuple[str, bool]] = []  # the pieces of the word in progress

    def write(self, text: str, from_draft: bool = False) -> None:
        for part in re.split(r"(\s)", text):
            if part == "\n":
                self._end_word()
                self.out.write("\n")
                self.column, self.space = 0, ""
            elif part.isspace():
                self._end_word()
                self.space += part
            elif part:
                self.word.append((part, from_draft))

    def flush(self) -> None:
        self._end_word()
        self.out.flush()

    def _end_word(self) -> None:
        if not self.word:
            return
        length = sum(len(p) for p, _ in self.word)
        if self.column and self.column + len(self.space) + length > self.width:
            self.out.write("\n")
            self.column = 0
        else:
            self.out.write(self.space)
            self.column += len(self.space)
        for piece, from_draft in self.word:
            self.out.write(self.style(piece, from_draft))
        self.column += length
        self.space, self.word = "", []


def run_terminal_chat(session: ChatSession, read: Callable[[str], str] | None = None, out: TextIO = sys.stdout,
                      highlight: bool | None = None, width: int | None = None) -> None:
    """The read-reply loop. `read` is line_reader() unless a test or an embedding program supplies lines.
    Replies wrap between words at `width` (default: the terminal's width; no wrapping into a pipe)."""
    read = read or line_reader()
    colour = out.isatty() if highlight is None else highlight
    if width is None and out.isatty():
        width = shutil.get_terminal_size().columns
    dim = (lambda s: f"{DIM}{s}{RESET}") if colour else (lambda s: s)
    out.write(dim(f"mirrorsd chat · {engine_summary(session.engine)} · /help for commands") + "\n")
    last_stats: dict = {}
    while True:
        try:
            text = read_message(read).strip()
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:  # as ollama: Ctrl-C clears the line, it does not end the chat
            out.write("\n" + dim(QUIT_HINT) + "\n")
            continue
        if not text:
            continue
        if text.startswith("/"):
            said = run_command(session, text, last_stats)
            if said is None:
                return
            out.write((dim(said) if said.startswith("(") else said) + "\n")  # confirmations dimmed
            continue

        out.write("assistant> ")

        def style(piece: str, from_draft: bool) -> str:
            return f"{DRAFT_STYLE}{piece}{RESET}" if colour and from_draft and piece.strip() else piece

        wrap = WordWrap(out, width, style, column=len("assistant> ")) if width else None

        def show(event) -> None:
            if wrap is not None:
                wrap.write(event.text, event.from_draft)
                out.flush()
                return
            out.write(style(event.text, event.from_draft) if event.text else event.text)
            out.flush()

        with quiet_input():  # keys typed meanwhile wait for the next prompt instead of landing in the reply
            turn = session.reply(text, on_token=show)
        if wrap is not None:
            wrap.write(turn.tail)
            wrap.flush()
            turn_tail = ""
        else:
            turn_tail = turn.tail
        if turn.finish_reason == "error":
            out.write(f"\nerror: {turn.error}\n")
            continue
        last_stats = turn.stats
        note = " · stopped" if turn.finish_reason == "cancelled" else ""
        line = f"[{stats_line(turn.stats)}{note}]"
        out.write(turn_tail + "\n" + dim(textwrap.fill(line, width, break_on_hyphens=False) if width else line) + "\n")
        if turn.finish_reason == "length":
            out.write(dim(f"[{finish_note(turn, session.settings.max_new_tokens)}]") + "\n")
        for reason in turn.stats.get("fallbacks", ()):
            out.write(dim(f"[{reason}; the reply is unaffected]") + "\n")
