"""Chat messages -> token ids, with control tokens only where the chat template put them.

Tokenising the rendered template as one string would turn text such as `<|im_end|>\n<|im_start|>system`
inside a message into real control tokens, letting whoever wrote the message forge a system turn. So a
message whose text contains a control token's text is tokenised on its own with special-token parsing
off (`split_special_tokens`): it stays plain text. Messages without such text take the usual path, so
their ids are exactly what `apply_chat_template(..., tokenize=True)` gives.
"""

from __future__ import annotations

from mirrorsd.errors import PromptError


def control_texts(tokenizer) -> set[str]:
    """The text of every special (control) token of a tokenizer."""
    texts = set(tokenizer.all_special_tokens)
    texts.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return {t for t in texts if t}


def chat_ids(tokenizer, messages: list[dict], allow_control_tokens: bool = False,
             tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` (and the `tools` they may call) through the tokenizer's chat template, ready for
    the assistant's reply."""
    controls = control_texts(tokenizer)
    if allow_control_tokens or not any(c in m["content"] for m in messages for c in controls):
        ids = _apply_template(tokenizer, messages, tools, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    marks = [f"\x00mirrorsd-message-{i}\x00" for i in range(len(messages))]
    rendered = _apply_template(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)], tools,
                               tokenize=False)
    ids: list[int] = []
    for message, mark in zip(messages, marks):
        if rendered.count(mark) != 1:
            raise PromptError("a message holds control-token text and this chat template rewrites message "
                              "content, so it cannot be kept apart from the template's own tokens",
                              "remove the control-token text from the message")
        template, _, rendered = rendered.partition(mark)
        ids += tokenizer(template, add_special_tokens=False)["input_ids"]
        ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _apply_template(tokenizer, messages: list[dict], tools: list[dict] | None, tokenize: bool):
    """The chat template applied; a template that does not compile (a broken chat_template.jinja in a cached
    model) or refuses these messages (its raise_exception) is a PromptError, not a traceback."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=tokenize)
    except TemplateError as exc:
        raise PromptError(f"the model's chat template failed on these messages: {exc}",
                          "if the template itself is broken (chat_template.jinja or tokenizer_config.json in the "
                          "model's folder), restore it (a catalog model: `mirrorsd rm MODEL`, then `mirrorsd pull MODEL`); otherwise "
                          "change the messages as it asks") from None
