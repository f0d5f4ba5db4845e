"""Where the chat keeps what outlives a session: saved conversations (the window's sidebar) and the
terminal chat's line history, under the user data folder (MIRRORSD_DATA overrides it).

Every conversation is one JSON file, replaced atomically (written to a temporary file in the same
folder, flushed to disk, then renamed over the old one), so a crash mid-save leaves the previous
version intact rather than a truncated file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("mirrorsd")
ID = re.compile(r"[^./\\\x00][^/\\\x00]{0,127}")  # a file name in the store folder, never a path


def data_dir() -> Path:
    """MIRRORSD_DATA, else the user's data folder (e.g. ~/.local/share/mirrorsd)."""
    env = os.environ.get("MIRRORSD_DATA")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("mirrorsd"))


def history_file() -> Path:
    """The terminal chat's line history (prompt_toolkit's FileHistory format)."""
    return data_dir() / "chat_history"


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class Conversation:
    messages: list[dict] = field(default_factory=list)
    system: str = ""
    model: str = ""
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    name: str = ""  # the title the user gave it ("": its first message)

    @property
    def title(self) -> str:
        if self.name.strip():
            return self.name.strip()
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "(empty)")
        line = " ".join(first.split())
        return line if len(line) <= 48 else line[:47] + "…"


class ConversationStore:
    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or data_dir() / "conversations"

    def path(self, conversation_id: str) -> Path:
        """The conversation's file: its id is the file name (checked: no separators, no '..')."""
        if not isinstance(conversation_id, str) or not ID.fullmatch(conversation_id):
            raise ValueError(f"not a conversation id: {conversation_id!r}")
        return self.folder / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> None:
        conversation.updated = time.time()
        write_atomically(self.path(conversation.id), json.dumps(asdict(conversation), ensure_ascii=False, indent=1))

    def load(self, conversation_id: str) -> Conversation:
        """The conversation in <id>.json; ValueError for a file that is not one. Its id is the file's name,
        whatever an "id" inside it says."""
        path = self.path(conversation_id)
        if path.exists() and not path.is_file():  # a FIFO would block the read forever, a folder fail oddly
            raise ValueError(f"{path.name} is not a regular file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        return _conversation(data, conversation_id)

    def list(self) -> list[Conversation]:
        """Newest first; a file that is not a conversation (edited by hand, another program) is skipped
        with a warning."""
        found = []
        for path in self.folder.glob("*.json") if self.folder.is_dir() else ():
            try:
                found.append(self.load(path.stem))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping %s: not a saved conversation (%s)", path, exc)
        return sorted(found, key=lambda c: c.updated, reverse=True)

    def delete(self, conversation_id: str) -> None:
        self.path(conversation_id).unlink(missing_ok=True)


def _conversation(data, conversation_id: str) -> Conversation:
    """A Conversation from parsed JSON, checked field by field (ValueError names the first bad one)."""
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    messages = data.get("messages", [])
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("'messages' is not a list of {role, content} strings")
    for key in ("system", "model", "name"):
        if not isinstance(data.get(key, ""), str):
            raise ValueError(f"{key!r} is not a string")
    for key in ("created", "updated"):
        value = data.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise ValueError(f"{key!r} is not a time in seconds")
    return Conversation(messages=[dict(m) for m in messages], system=data.get("system", ""),
                        model=data.get("model", ""), id=conversation_id, name=data.get("name", ""),
                        created=float(data.get("created", 0.0)), updated=float(data.get("updated", 0.0)))


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int of hundreds of digits
        return False
