"""Engine as a context manager, close(), and sharing one Engine between threads."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from conftest import make_model
from drafters_for_tests import PacedDrafter
from mirrorsd import Engine, EngineClosedError, GenerationConfig
from mirrorsd.runtime.drafters import NGramDrafter


def test_with_block_closes_and_later_calls_say_so(tokenizer):
    with Engine(make_model(tokenizer, seed=0, sharpness=30.0), tokenizer, NGramDrafter()) as engine:
        assert engine.generate("hello", GenerationConfig(max_new_tokens=4)).token_ids
    assert engine.closed and engine.target.model is None  # the model is released
    with pytest.raises(EngineClosedError, match="closed"):
        engine.generate("hello")
    with pytest.raises(EngineClosedError, match="closed"):  # it tokenised as if open
        engine.encode("hello")
    engine.close()  # closing twice is fine


def test_close_waits_for_the_running_request(tokenizer):
    engine = Engine(make_model(tokenizer, seed=0, sharpness=30.0), tokenizer, PacedDrafter(NGramDrafter(), 0.01))
    stream = engine.stream("def f(x):", GenerationConfig(max_new_tokens=20))
    next(stream)  # the request now holds the engine
    closer = threading.Thread(target=engine.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive() and not engine.closed  # it waits for the request
    rest = list(stream)  # the request finishes normally
    closer.join(timeout=10)
    assert engine.closed and rest[-1].result.finish_reason in ("length", "stop")


class _CountingDrafter(NGramDrafter):
    """Records how many requests are inside the engine at once."""

    def __init__(self):
        super().__init__()
        self.inside = self.most = 0
        self.guard = threading.Lock()
        self.learner = self  # finish() marks the request's end

    def start(self, config):
        with self.guard:
            self.inside += 1
            self.most = max(self.most, self.inside)
        super().start(config)

    def finish(self, prompt, tokens):
        with self.guard:
            self.inside -= 1


def test_threads_are_served_one_at_a_time_with_the_same_results(tokenizer, target_model):
    drafter = _CountingDrafter()
    engine = Engine(target_model, tokenizer, drafter)
    prompts = ["hello", "def quicksort(arr):", "import numpy", "The quick brown fox", "for i in range(10):"]
    cfg = GenerationConfig(max_new_tokens=16)
    alone = {p: engine.generate(p, cfg).token_ids for p in prompts}
    got: dict[str, list[int]] = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, engine.generate(p, cfg).token_ids))
               for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone and drafter.most == 1


def test_ctrl_c_anywhere_in_a_request_leaves_the_engine_usable(tokenizer, target_model, ctrl_c_raises):
    """A real SIGINT lands wherever the main thread is (mid-forward, mid cache crop, in a drafter):
    the next request must still be exactly right (KV caches are reset, never left half-updated)."""
    engine = Engine(target_model, tokenizer, PacedDrafter(NGramDrafter(), 0.01))
    follow_up = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "ort"},
                 {"role": "user", "content": "hi"}]
    cfg = GenerationConfig(max_new_tokens=12)
    expected = engine.generate(follow_up, cfg).token_ids
    for delay in (0.0, 0.0, 0.0, 0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03):
        first = threading.Event()

        def interrupt():
            first.wait(10)
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        stream = engine.stream(follow_up[:1], GenerationConfig(max_new_tokens=200))  # shares the cached prefix
        with pytest.raises(KeyboardInterrupt):
            for _ in stream:
                first.set()
            time.sleep(5)  # the reply ended first: wait here for the signal
        stream.close()
        assert engine.generate(follow_up, cfg).token_ids == expected


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signal masks")
@pytest.mark.parametrize("mode", ["off", "overlap"])
def test_drafters_run_on_threads_that_leave_ctrl_c_to_the_main_thread(mode, tokenizer, target_model):
    """A Ctrl-C the kernel handed to a drafter's thread would not wake the main thread: those threads block it."""
    masks = []

    class MaskRecorder(NGramDrafter):
        bounded = False  # on a drafting thread (a bounded drafter runs on the request's own)

        def propose(self, committed, max_tokens):
            masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
            return super().propose(committed, max_tokens)

    engine = Engine(target_model, tokenizer, MaskRecorder(), helper=None)
    engine.generate("def f(x):", GenerationConfig(max_new_tokens=8, pipeline=mode))
    assert masks and all(signal.SIGINT in m and signal.SIGTERM in m for m in masks)


def test_a_request_reuses_the_prefix_it_shares_with_the_last_and_reset_forgets_it(tokenizer, target_model, other_model):
    """Prompt caching: a chat's next turn prefills only what is new, with output unchanged; reset() makes the
    next request prefill everything (the verifier's and the draft model's caches), as a first request does."""
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
    from mirrorsd.runtime.drafters.model import ModelDrafter

    cfg = GenerationConfig(max_new_tokens=12)
    draft = ModelDrafter(TorchCausalLM(other_model))
    engine = Engine(target_model, tokenizer, draft)
    first = engine.encode([{"role": "user", "content": "def quicksort(arr):"}])
    reply = engine.generate(first, cfg)
    assert reply.stats.cached_prompt_tokens == 0
    turn = first + reply.token_ids + engine.encode([{"role": "user", "content": "and in place?"}])
    warm = engine.generate(turn, cfg)
    assert warm.stats.cached_prompt_tokens >= len(first) and warm.stats.prompt_tokens == len(turn)
    engine.reset()
    assert engine.target.cached_prefix(turn) == 0 and draft.lm.cached_prefix(turn) == 0
    cold = engine.generate(turn, cfg)
    assert cold.stats.cached_prompt_tokens == 0
    assert cold.token_ids == warm.token_ids == Engine(target_model, tokenizer, None).generate(turn, cfg).token_ids


def test_a_stream_closed_on_another_thread_releases_the_engine(tokenizer, target_model):
    """Closing a stream from another thread (or the garbage collector finalizing it there) releases the
    request lock exactly once, and the engine serves the next request."""
    import gc

    from mirrorsd.runtime.drafters import NGramDrafter

    engine = Engine(target_model, tokenizer, NGramDrafter())
    cfg = GenerationConfig(max_new_tokens=20)
    want = engine.generate("The quick brown fox", cfg).token_ids
    for how in ("close", "gc"):
        holder = [engine.stream("The quick brown fox", cfg)]
        next(holder[0])  # started: the request holds the lock
        errors = []

        def finish():
            try:
                holder.pop().close() if how == "close" else (holder.clear(), gc.collect())
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        worker = threading.Thread(target=finish)
        worker.start()
        worker.join(timeout=30)
        assert not errors, errors
        got, done = [], threading.Event()
        threading.Thread(target=lambda: (got.append(engine.generate("The quick brown fox", cfg).token_ids),
                                         done.set()), daemon=True).start()
        assert done.wait(60), f"the engine hung after a stream was closed by {how} on another thread"
        assert got == [want]


def test_a_call_from_the_thread_of_an_open_stream_is_refused_not_a_hang(tokenizer, target_model):
    """The stream holds the engine while it is open; a call from its own thread would wait for ever, so it
    raises EngineBusyError, and the engine serves again once the stream is closed."""
    from mirrorsd import EngineBusyError

    engine = Engine(target_model, tokenizer, NGramDrafter())
    cfg = GenerationConfig(max_new_tokens=12)
    want = engine.generate("The quick brown fox", cfg).token_ids
    stream = engine.stream("The quick brown fox", cfg)
    next(stream)
    for call in (lambda: engine.generate("The quick brown fox", cfg), engine.reset, engine.close):
        with pytest.raises(EngineBusyError, match="still open on this thread"):
            call()
    stream.close()
    assert engine.generate("The quick brown fox", cfg).token_ids == want
