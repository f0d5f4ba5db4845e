"""Every SDK example under apps/examples runs, on the tiny model saved as a folder, and says what it should."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest


def run_example(name: str, folder, capsys, *extra: str) -> str:
    module = importlib.import_module(f"mirrorsd.apps.examples.{name}")
    module.main(["--target", str(folder), "--draft", "ngram", "--max-new-tokens", "24", *extra])
    return capsys.readouterr().out


def test_generate_once(tiny_folder, capsys):
    out = run_example("generate_once", tiny_folder, capsys)
    assert "finish_reason=" in out and "tokens=" in out


def test_streaming_prints_the_text_as_events(tiny_folder, capsys):
    out = run_example("streaming", tiny_folder, capsys)
    last = out.strip().splitlines()[-1]
    assert last.startswith("[") and "tokens in" in last
    n_events = int(last.split(" in ")[1].split()[0])
    assert n_events >= 2


def test_chat_with_history(tiny_folder, capsys):
    out = run_example("chat_with_history", tiny_folder, capsys)
    assert out.count("user: ") == 2 and "history: 5 messages" in out


def test_cancellation(tiny_folder, capsys):
    out = run_example("cancellation", tiny_folder, capsys)
    assert "kept 5 tokens, then closed the stream" in out
    assert "stopped from another thread after" in out
    assert "next request: 3 tokens" in out


def test_choose_devices(tiny_folder, capsys):
    out = run_example("choose_devices", tiny_folder, capsys, "--device", "cpu", "--dtype", "float32")
    assert "target on torch:cpu (computes on the cpu)" in out and "drafter: ngram on the host CPU" in out


def test_choose_devices_with_a_draft_model(tiny_folder, capsys):
    module = importlib.import_module("mirrorsd.apps.examples.choose_devices")
    module.main(["--target", str(tiny_folder), "--draft", str(tiny_folder), "--device", "cpu",
                 "--draft-device", "cpu", "--max-new-tokens", "8"])
    assert f"drafter: {tiny_folder.name} on the cpu" in capsys.readouterr().out  # named by its model


def test_read_stats(tiny_folder, capsys):
    out = run_example("read_stats", tiny_folder, capsys)
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["generated_tokens"] >= 1 and "mean_accepted_length" in stats and "drafter" in stats
    assert "tokens/s:" in out and "acceptance rate:" in out


def test_threads_get_what_they_would_get_alone(tiny_folder, capsys):
    out = run_example("threads", tiny_folder, capsys)
    lines = [line for line in out.splitlines() if "same as alone" in line]
    assert len(lines) == 4 and all(line.endswith("True") for line in lines)


@pytest.mark.parametrize("name", ["streaming"])
def test_examples_run_as_scripts(tiny_folder, name):
    out = subprocess.run([sys.executable, "-m", f"mirrorsd.apps.examples.{name}", "--target", str(tiny_folder),
                          "--draft", "ngram", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "tokens in" in out.stdout
