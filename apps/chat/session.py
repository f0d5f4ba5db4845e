"""Chat logic shared by the desktop window and the terminal chat, free of any UI toolkit.

A `ChatSession` holds the conversation and the settings and runs one turn at a time: it streams the
reply from the Engine, hands each TokenEvent to a callback, stops when asked (a threading.Event, set
from any thread, or Ctrl-C in a terminal) and keeps the conversation consistent whatever happens:
a stopped reply is kept as far as it got, a failed turn leaves the history as it was before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mirrorsd.config import GenerationConfig
from mirrorsd.errors import MirrorsdError
from mirrorsd.results import FinishEvent, GenerationResult, TokenEvent


@dataclass
class ChatSettings:
    """What the user can change between turns."""

    temperature: float = 0.7
    max_new_tokens: int = 512
    seed: int | None = None
    system: str = ""  # the system prompt, sent before the conversation ("" = none)

    def config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=self.seed)


@dataclass
class Turn:
    """How one turn ended. `result` is None when the turn failed (`error` says why) or was stopped
    before its first verify step finished."""

    text: str = ""
    tail: str = ""  # the end of `text` that came with the FinishEvent (held back until then), not via on_token
    finish_reason: str = ""  # "stop", "length", "cancelled" or "error"
    result: GenerationResult | None = None
    error: str = ""
    stats: dict = field(default_factory=dict)  # GenerationStats.to_dict() of the last event seen


class ChatSession:
    def __init__(self, engine=None, settings: ChatSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or ChatSettings()
        self.messages: list[dict] = []
        self.first_token_s: float | None = None  # time to first token of the turn in flight / the last one

    def new_chat(self) -> None:
        self.messages = []

    def prompt(self):
        """The conversation as the engine takes it: chat messages through the model's template, or a
        plain "User:/Assistant:" transcript for a model without one. The system prompt goes first."""
        system = self.settings.system.strip()
        messages = ([{"role": "system", "content": system}] if system else []) + self.messages
        if getattr(self.engine.tokenizer, "chat_template", None) is not None:
            return messages
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nAssistant:"

    def reply(self, user_text: str, on_token: Callable[[TokenEvent], None] | None = None,
              stop: threading.Event | None = None) -> Turn:
        """Add the user's message, stream the reply, and record it. Never raises for a generation
        error: the Turn says what went wrong and the history is rolled back to before the turn."""
        if self.engine is None:
            return Turn(finish_reason="error", error="no model is loaded yet")
        before = list(self.messages)
        self.messages.append({"role": "user", "content": user_text})
        turn = Turn()
        stream = None
        self.first_token_s, started = None, time.perf_counter()
        try:
            stream = self.engine.stream(self.prompt(), self.settings.config())
            for event in stream:
                if self.first_token_s is None:  # prompt processing included: what the user waits for
                    self.first_token_s = time.perf_counter() - started
                if isinstance(event, FinishEvent):
                    turn.result, turn.finish_reason = event.result, event.result.finish_reason
                    turn.text, turn.tail = turn.text + event.text, event.text
                    turn.stats = self.stats_of(event)
                    break
                turn.text += event.text
                turn.stats = self.stats_of(event)
                if on_token is not None:
                    on_token(event)
                if stop is not None and stop.is_set():
                    turn.finish_reason = "cancelled"
                    break
        except KeyboardInterrupt:  # Ctrl-C in the terminal chat: stop this reply, keep the chat
            turn.finish_reason = "cancelled"
        except Exception as exc:  # shown to the user; the conversation stays as it was
            self.messages = before
            return Turn(text=turn.text, finish_reason="error", error=describe_error(exc), stats=turn.stats)
        finally:
            if stream is not None:
                stream.close()  # cancels the request if it is still running
        self.messages.append({"role": "assistant", "content": turn.text})
        return turn

    def stats_of(self, event) -> dict:
        """The event's GenerationStats as a dict, with this turn's time to first token."""
        return {**event.stats.to_dict(), "time_to_first_token_s": self.first_token_s}


def describe_error(exc: BaseException) -> str:
    """A message a person can act on, without a traceback."""
    if isinstance(exc, MirrorsdError):
        return str(exc)
    text = str(exc)
    if "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError":
        return (f"out of memory: {text.splitlines()[0] if text else type(exc).__name__}\n"
                "  hint: lower max tokens, pick a smaller model, or use --dtype bfloat16")
    return f"{type(exc).__name__}: {text}"


def stats_fields(stats: dict) -> dict[str, str]:
    """The live speculation numbers worth showing, from GenerationStats.to_dict() (so fields other
    modules add later travel with the dict and can be shown in a details view)."""
    alpha = stats.get("acceptance_rate")
    first = stats.get("time_to_first_token_s")
    drafted = bool(stats.get("drafted_tokens"))
    return {
        "tokens/s": f"{stats.get('tokens_per_second', 0.0):.1f}",
        "first token": "–" if first is None else f"{first:.2f} s",
        "acceptance": "n/a" if alpha is None else f"{alpha:.0%}",
        "mean accepted length": f"{stats.get('mean_accepted_length', 0.0):.2f}",
        # who drafted the steps that carried drafts; never "none" beside an acceptance
        "drafter": str(stats.get("drafted_by", "?")) if drafted else "no drafts",
        "tokens": str(stats.get("generated_tokens", 0)),
        "pipeline": _pipeline(stats),
    }


def _pipeline(stats: dict) -> str:
    """The scheduling mode that ran (the two-queue pipeline's) and how much drafting it hid."""
    mode = str(stats.get("pipeline", "off"))
    hidden = stats.get("hidden_draft_share")
    return f"{mode}, {hidden:.0%} of drafting hidden" if hidden and mode != "off" else mode


def format_stat(key: str, value) -> str:
    """One statistic as a person reads it: seconds with a unit, rates as percentages, 3 significant
    digits for other floats, lists and dicts without Python's brackets and quotes."""
    if value is None:
        return "n/a"
    if isinstance(value, int):  # bools too
        return str(value)
    if isinstance(value, float):
        if key.endswith("_s"):
            return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
        if key.endswith(("_rate", "_share", "_acceptance")):
            return f"{value:.0%}"
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {format_stat(key, v)}" for k, v in value.items()) or "–"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_stat(key, v) for v in value) or "–"
    return str(value) or "–"


STAT_GROUPS = {  # how /stats and the window's tooltip group GenerationStats.to_dict(); the rest goes under "other"
    "tokens": ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "verify_steps"),
    "time": ("total_time_s", "time_to_first_token_s", "prompt_time_s", "tokens_per_second", "draft_time_s",
             "verify_time_s", "draft_hidden_s", "hidden_draft_share", "draft_idle_s", "verify_idle_s"),
    "speculation": ("drafter", "drafted_by", "drafting_share", "drafter_shares", "chain", "drafted_tokens",
                    "accepted_tokens", "acceptance_rate", "acceptance_by_drafter", "mean_accepted_length",
                    "per_position_acceptance", "per_position_drafted", "per_position_accepted", "drafters",
                    "drafter_tokens", "fallbacks"),
    "pipeline and branches": ("pipeline", "branch_source", "branch_hits", "branch_misses", "branch_hit_rate",
                              "branch_coverage", "hinted_steps", "hinted_rejections", "hinted_covered",
                              "branches_planned", "branches_ready", "branches_ready_share", "branch_plans_late",
                              "branch_states"),
    "backend": ("backend", "exact"),
}


def stats_details(stats: dict) -> str:
    """Every statistic, formatted, one per line under its group (/stats, the window's tooltip)."""
    grouped = {name: [k for k in keys if k in stats] for name, keys in STAT_GROUPS.items()}
    listed = {k for keys in grouped.values() for k in keys}
    grouped["other"] = [k for k in stats if k not in listed]
    return "\n".join(f"{name}:\n" + "\n".join(f"  {k.removesuffix('_s').replace('_', ' ')}: {format_stat(k, stats[k])}"
                                              for k in keys)
                     for name, keys in grouped.items() if keys)


def model_info(engine) -> str:
    """What ollama's `/show info` says of a model: architecture, parameters, quantization, context; plus where
    it runs and what drafts for it."""
    from mirrorsd.backends import model_facts

    facts = model_facts(engine.target)
    rows = {"model": engine.name, "backend": engine.target.backend, "architecture": facts.family or "?",
            "parameters": facts.parameter_size or "?", "quantization": facts.quantization or "?",
            "weights": f"{facts.size_bytes / 1e6:.0f} MB" if facts.size_bytes else "?",
            "context length": str(engine.target.max_context),
            "exact verify passes": "yes" if engine.target.exact_batches else "no",
            "drafter": "none" if engine.drafter is None else engine.drafter.name}
    return "\n".join(f"  {k:<20}{v}" for k, v in rows.items())


def finish_note(turn: Turn, max_new_tokens: int) -> str:
    """Why a reply ended, when that is not the model's own choice ("" then)."""
    if turn.finish_reason == "length":
        return f"cut at the {max_new_tokens}-token limit"
    return "stopped" if turn.finish_reason == "cancelled" else ""


def stats_line(stats: dict, load_s: float | None = None) -> str:
    """One line a person reads, as ollama's --verbose counts: the load (where given), the prompt (tokens
    processed, cached ones apart, and their rate), the reply (tokens and the decode rate, prompt excluded), and
    what speculation did (who drafted, how often, how much was accepted). From GenerationStats.to_dict()."""
    prompt_s, total_s = stats.get("prompt_time_s", 0.0), stats.get("total_time_s", 0.0)
    cached = stats.get("cached_prompt_tokens", 0)
    processed = stats.get("prompt_tokens", 0) - cached
    generated = stats.get("generated_tokens", 0)
    parts = [] if load_s is None else [f"load {load_s:.2f} s"]
    parts.append(f"prompt {processed} tokens" + (f" (+{cached} cached)" if cached else "") +
                 f" in {prompt_s:.2f} s{_rate(processed, prompt_s)}")
    parts.append(f"reply {generated} tokens in {max(total_s - prompt_s, 0.0):.2f} s"
                 f"{_rate(generated, total_s - prompt_s)}")
    parts.append(_speculation(stats))
    return " · ".join(parts)


def _rate(tokens: int, seconds: float) -> str:
    return f" ({tokens / seconds:.1f} tok/s)" if tokens and seconds > 0 else ""


def _speculation(stats: dict) -> str:
    """Who drafted and what came of it; never an acceptance beside "no drafts"."""
    if not stats.get("drafted_tokens"):
        return "no drafts (plain decoding)"
    text = (f"drafts by {stats.get('drafted_by', '?')} on {stats.get('drafting_share', 0.0):.0%} of steps, "
            f"{stats.get('acceptance_rate') or 0.0:.0%} accepted, {stats.get('mean_accepted_length', 0.0):.2f} "
            "tokens per step")
    if stats.get("pipeline", "off") != "off":
        text += f", {_pipeline(stats)}"
    if stats.get("estimated_speedup"):
        text += f", ~{stats['estimated_speedup']:.2f}x plain decoding (est. from the verify-cost curve)"
    if stats.get("exact") is False:
        text += " (inexact backend: verify passes not batch-invariant)"
    return text


def engine_summary(engine) -> str:
    """Which model and backends serve: the target's backend and device (e.g. torch:cpu) and the drafter
    (its name carries the backend for model drafters; n-gram and retrieval run on the host CPU)."""
    draft = "none" if engine.drafter is None else engine.drafter.name
    return f"{engine.name} on {engine.target.backend} · draft {draft}"


def with_settings(session: ChatSession, **changes) -> None:
    """Change settings, checked the same way a request would be (raises ConfigError)."""
    new = replace(session.settings, **changes)
    new.config()
    session.settings = new
