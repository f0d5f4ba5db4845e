"""Replies as Markdown, in the subset of HTML that Qt's text view draws (no CSS classes, no <div>
styling): markdown-it-py parses, pygments colours code blocks with inline styles, and each code
block gets a "Copy" link (href "copy:N", N counting the blocks of the whole transcript) that the
window answers by putting the block's text on the clipboard."""

from __future__ import annotations

import html

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

CODE_BACKGROUND = "#f6f8fa"
_FORMATTER = HtmlFormatter(noclasses=True, nowrap=True, style="default")  # inline colours: Qt reads no stylesheet


def highlight_code(code: str, language: str) -> str:
    try:
        lexer = get_lexer_by_name(language) if language else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    return highlight(code, lexer, _FORMATTER)


class MarkdownRenderer:
    """Renders one message at a time; `code_blocks` collects the raw code of every block rendered so
    far, so a "copy:N" link finds its text. `reset()` when the transcript is redrawn."""

    def __init__(self) -> None:
        # Raw HTML in a reply is shown as text: a model's "<b>" is not the user's markup.
        self._md = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
        def code_rule(_renderer, tokens, idx, _options, _env) -> str:  # markdown-it binds rules to its renderer
            return self._code(tokens[idx])

        self._md.add_render_rule("fence", code_rule)
        self._md.add_render_rule("code_block", code_rule)
        self.code_blocks: list[str] = []

    def reset(self) -> None:
        self.code_blocks = []

    def render(self, text: str) -> str:
        return self._md.render(text)

    def _code(self, token) -> str:
        language = token.info.strip().split(" ")[0] if token.info else ""
        self.code_blocks.append(token.content)
        n = len(self.code_blocks) - 1
        label = f'<span style="color:gray">{html.escape(language)}</span> ' if language else ""
        return (f'<p style="margin-bottom:0">{label}<a href="copy:{n}">Copy</a></p>'
                f'<table width="100%" cellpadding="6" bgcolor="{CODE_BACKGROUND}"><tr><td>'
                f"<pre>{highlight_code(token.content, language)}</pre></td></tr></table>")
