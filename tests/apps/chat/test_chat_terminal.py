"""The terminal chat (what `mirrorsd chat` opens without a display): in-process with a real Ctrl-C,
and as a user runs it (a subprocess with no DISPLAY)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading

import pytest

from drafters_for_tests import PacedDrafter
from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.chat.session import ChatSession, ChatSettings
from mirrorsd.apps.chat.terminal import DRAFT_STYLE, run_terminal_chat
from mirrorsd.runtime.drafters import NGramDrafter


class Screen(io.StringIO):
    def isatty(self) -> bool:
        return False


def lines_then_eof(*lines):
    queue = list(lines)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)
    return read


def test_commands_history_and_highlighting(tokenizer, target_model):
    engine = Engine(target_model, tokenizer, NGramDrafter(), name="tiny")
    session = ChatSession(engine, ChatSettings(temperature=0.0, max_new_tokens=40))
    out = Screen()
    run_terminal_chat(session, lines_then_eof("def quicksort(arr):", "/max 12", "/temp 0", "Hello world!",
                                              "/stats", "/show info", "/temp -1", "/bogus", '"""two',
                                              'lines"""', "/bye", "never read"), out, highlight=True)
    text = out.getvalue()
    assert "tiny on torch:cpu · draft ngram" in text
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert session.messages[4]["content"] == "two\nlines"  # ollama's \"\"\" block: one message of two lines
    first = engine.generate([{"role": "user", "content": "def quicksort(arr):"}], GenerationConfig(max_new_tokens=40))
    assert session.messages[1]["content"] == first.text
    assert "(max tokens 12)" in text and "reply 12 tokens in" in text and "prompt " in text
    assert "drafts by ngram" in text or "no drafts (plain decoding)" in text  # never an acceptance beside no drafts
    assert "speculation:\n" in text and "  verify steps: " in text and "{" not in text.split("speculation:")[1][:200]
    assert "architecture        llama" in text and "context length" in text  # /show info
    assert "usage: /temp X, a number >= 0 (0 = greedy) (now 0.0)" in text and "commands:" in text
    if any(first.from_draft):
        assert DRAFT_STYLE in text


def test_ctrl_c_at_the_prompt_says_how_to_quit_and_bad_settings_get_their_usage(tokenizer, target_model):
    session = ChatSession(Engine(target_model, tokenizer, NGramDrafter(), name="tiny"),
                          ChatSettings(temperature=0.0, max_new_tokens=8))
    lines = iter(["/max abc", "/temp", "/max 0", "/temp 0.5", "hi"])

    def read(prompt: str) -> str:
        if read.interrupted is False:  # the user typed something, then pressed Ctrl-C
            read.interrupted = True
            raise KeyboardInterrupt
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    read.interrupted = False
    out = Screen()
    run_terminal_chat(session, read, out)
    text = out.getvalue()
    assert "(Use Ctrl + d or /quit to exit.)" in text
    assert text.count("usage: /max N, a whole number >= 1 (now 8)") == 2 and "usage: /temp X" in text
    assert "(temperature 0.5)" in text and "Traceback" not in text and "invalid literal" not in text
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # the chat went on after Ctrl-C


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(tokenizer, target_model, ctrl_c_raises):
    engine = Engine(target_model, tokenizer, PacedDrafter(NGramDrafter(), 0.01), name="tiny")
    session = ChatSession(engine, ChatSettings(temperature=0.0, max_new_tokens=200))
    started = threading.Event()

    class Watched(Screen):
        def write(self, s):
            if s and "assistant> " in self.getvalue():
                started.set()
            return super().write(s)

    def press_ctrl_c():
        started.wait(30)
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered to this (main) thread

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    out = Watched()
    run_terminal_chat(session, lines_then_eof("def f(x):", "/max 5", "hi"), out)
    text = out.getvalue()
    assert "· stopped]" in text
    stopped_reply = session.messages[1]["content"]
    assert len(engine.encode(stopped_reply)) < 150 if stopped_reply else True
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]  # it went on
    assert "reply 5 tokens in" in text


def test_mirrorsd_chat_without_a_display_falls_back_to_the_terminal(tiny_folder):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    out = subprocess.run([sys.executable, "-m", "mirrorsd", "chat", "--target", str(tiny_folder), "--draft",
                          "ngram", "--temperature", "0", "--max-new-tokens", "16"],
                         input="def quicksort(arr):\n/new\n/quit\n", capture_output=True, text=True, timeout=300,
                         env={**env, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "no display" in out.stderr and "chatting in the terminal" in out.stderr
    assert "assistant> " in out.stdout and "reply 16 tokens in" in out.stdout and "(new chat)" in out.stdout
    assert "\x1b[" not in out.stdout  # no colour codes when the output is not a terminal


def test_errors_read_as_messages():
    import torch

    from mirrorsd.apps.chat.session import describe_error
    from mirrorsd.errors import PromptError

    assert describe_error(PromptError("too long", "shorten it")) == "too long\n  hint: shorten it"
    oom = describe_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.startswith("out of memory: CUDA out of memory") and "hint:" in oom


def test_system_prompt_multiline_unknown_commands_and_the_cut_note(tokenizer, target_model):
    engine = Engine(target_model, tokenizer, NGramDrafter(), name="tiny")
    session = ChatSession(engine, ChatSettings(temperature=0.0, max_new_tokens=12))
    out = Screen()
    run_terminal_chat(session, lines_then_eof("/system You are terse.", "def f(x):\\", "    return x", "/frobnicate",
                                              "/system", "hi"), out)
    text = out.getvalue()
    assert "(system prompt: You are terse.)" in text and "(system prompt cleared)" in text
    assert session.messages[0]["content"] == "def f(x):\n    return x"  # the backslash continued the line
    with_system = [{"role": "system", "content": "You are terse."}, session.messages[0]]
    assert session.messages[1]["content"] == engine.generate(with_system, GenerationConfig(max_new_tokens=12)).text
    assert "unknown command /frobnicate" in text and "/system TEXT" in text  # and the list of the known ones
    assert session.prompt()[0]["role"] == "user"  # cleared: no system message any more
    assert text.count("[cut at the 12-token limit]") == 2  # the tiny model never stops on its own in 12 tokens


def test_line_editor_keeps_history_across_sessions_and_esc_enter_adds_a_line(tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from mirrorsd.apps.chat.terminal import line_reader

    history = tmp_path / "sub" / "chat_history"
    with create_pipe_input() as keys:
        read = line_reader(history, input=keys, output=DummyOutput())
        keys.send_text("hello\r")
        assert read("you> ") == "hello"
        keys.send_text("first\x1b\rsecond\r")  # Esc, Enter: a new line, not sent yet
        assert read("you> ") == "first\nsecond"
    with create_pipe_input() as keys:  # a new session finds them in its history (Up recalls the last)
        read = line_reader(history, input=keys, output=DummyOutput())
        keys.send_text("\x1b[A\r")
        assert read("you> ") == "first\nsecond"
    assert history.read_text().count("+hello") == 1
    assert line_reader() is input  # stdin here is not a terminal: plain input(), so pipes work


def test_a_window_that_cannot_start_falls_back_to_the_terminal(tiny_folder):
    from mirrorsd.apps.chat.launch import missing_libraries

    # xcb against a display that does not exist: Qt aborts there (here also for libraries it lacks).
    env = {**os.environ, "DISPLAY": ":987", "QT_QPA_PLATFORM": "xcb", "HF_HUB_OFFLINE": "1"}
    env.pop("WAYLAND_DISPLAY", None)
    out = subprocess.run([sys.executable, "-m", "mirrorsd", "chat", "--target", str(tiny_folder), "--draft", "ngram",
                          "--max-new-tokens", "4"], input="hi\n/quit\n", capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    hint = next(line for line in out.stderr.splitlines() if "chatting in the terminal" in line)
    assert "xcb" in hint or ":987" in hint
    missing = missing_libraries("xcb")
    if missing:  # on this machine Qt's xcb plugin lacks system libraries: the hint names their packages
        assert "sudo apt-get install libxcb-cursor0" in hint and all(lib in hint for lib in missing)
    assert "assistant> " in out.stdout


def test_the_qt_failure_is_described_in_one_line(monkeypatch):
    from mirrorsd.apps.chat.launch import debian_package, describe_qt_failure, why_no_window

    assert [debian_package(s) for s in ("libxcb-cursor.so.0", "libxkbcommon-x11.so.0", "libX11-xcb.so.1",
                                         "libxcb-icccm.so.4", "libEGL.so.1")] == \
        ["libxcb-cursor0", "libxkbcommon-x11-0", "libx11-xcb1", "libxcb-icccm4", "libegl1"]
    monkeypatch.setenv("DISPLAY", ":987")
    monkeypatch.setenv("QT_QPA_PLATFORM", "nosuch")  # a real probe of a platform Qt does not have
    reason = why_no_window()
    assert reason.startswith('there is no Qt platform plugin "nosuch" (available: ') and "offscreen" in reason
    gone = describe_qt_failure("qt.qpa.xcb: could not connect to display :987\n", "xcb", [])
    assert gone == "cannot connect to the X display :987"
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert why_no_window() is None


def test_word_wrap_breaks_between_words_even_when_a_word_arrives_in_pieces():
    from mirrorsd.apps.chat.terminal import WordWrap

    out = io.StringIO()
    wrap = WordWrap(out, 20, lambda piece, drafted: f"[{piece}]" if drafted else piece)
    for piece, drafted in [("The quick bro", False), ("wn fox jumps", True), (" over the lazy dog.\nA ", False),
                           ("supercalifragilistic-word ends", False)]:
        wrap.write(piece, drafted)
    wrap.flush()
    plain = out.getvalue().replace("[", "").replace("]", "")
    assert plain == "The quick brown fox\njumps over the lazy\ndog.\nA\nsupercalifragilistic-word\nends"
    assert "[wn]" in out.getvalue() and "[fox]" in out.getvalue()  # drafted pieces keep their colour


def test_replies_wrap_at_the_given_width(tokenizer, target_model):
    engine = Engine(target_model, tokenizer, NGramDrafter(), name="tiny")
    session = ChatSession(engine, ChatSettings(temperature=0.0, max_new_tokens=60))
    out = Screen()
    run_terminal_chat(session, lines_then_eof("Tell me a story about a fox and a dog."), out, width=30)
    reply = out.getvalue().split("assistant> ", 1)[1].split("\n[", 1)[0]
    lines = ("assistant> " + reply).split("\n")
    assert all(len(line) <= 30 or " " not in line.strip() for line in lines), lines
    assert " ".join(reply.split()) == " ".join(session.messages[-1]["content"].split())  # no text lost


def test_keys_typed_during_a_reply_are_not_echoed_into_it():
    """On a real terminal (a pty): echo is off while a reply streams and back on after, even when the reply
    fails; off a terminal nothing changes."""
    import os
    import pty
    import termios

    from mirrorsd.apps.chat.terminal import quiet_input

    parent, child = pty.openpty()
    try:
        with os.fdopen(os.dup(child), "r") as stream:
            assert termios.tcgetattr(child)[3] & termios.ECHO
            with quiet_input(stream):
                assert not termios.tcgetattr(child)[3] & termios.ECHO
            assert termios.tcgetattr(child)[3] & termios.ECHO
            with pytest.raises(RuntimeError), quiet_input(stream):
                raise RuntimeError("a failed reply")
            assert termios.tcgetattr(child)[3] & termios.ECHO
    finally:
        os.close(parent)
        os.close(child)
    with quiet_input(io.StringIO()):  # not a terminal: nothing to do
        pass


def test_the_stats_line_gives_the_speedup_estimate_only_where_there_is_one():
    from mirrorsd.apps.chat.session import stats_line
    from mirrorsd.results import GenerationStats

    stats = GenerationStats(verify_steps=5, generated_tokens=10, per_position_drafted=(2, 2, 2),
                            per_position_accepted=(2, 1, 0), drafted_tokens=6, accepted_tokens=3,
                            drafters={"ngram": 2, "none": 3}, verify_curve=(1.0, 1.2, 1.3, 1.5),
                            verify_time_s=0.7, prompt_time_s=0.2, total_time_s=0.8)
    assert "~1.50x plain decoding (est. from the verify-cost curve)" in stats_line(stats.to_dict())
    plain = GenerationStats(verify_steps=5, generated_tokens=5, drafters={"none": 5}, verify_curve=(1.0, 1.2),
                            verify_time_s=0.5, prompt_time_s=0.1, total_time_s=0.5)
    assert "plain decoding (est." not in stats_line(plain.to_dict())  # no drafts: no speedup claimed
