"""Chat messages to one prompt, with the tokenizer's chat template. A tokenizer without one
(the demo model's) gets a minimal template: the messages' contents one after the other, which
is how the demo model was trained to see a task ("add 17 25:")."""

from __future__ import annotations

MINIMAL_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    template = getattr(tokenizer, "chat_template", None) or MINIMAL_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
