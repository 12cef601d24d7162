"""The chat template, in one place: ``render_text(tokenizer, messages)`` is the target's own template as
text (``tokenizer.apply_chat_template``), what training samples tokenize with character offsets for the loss
mask (``pipeline.data.sources.build_sample``); ``render_chat(tokenizer, messages) -> ids`` is the prompt
of serving and evaluation, the same template with special tokens only from the template, never from a
message's content; ``encode`` is the thread-safe tokenization both use.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


_ENCODE_LOCK = threading.Lock()


def encode(tokenizer: Any, text: str, parse_special: bool = True, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``; ``parse_special=False`` reads special-token strings as plain text.
    HF fast tokenizers switch that with a flag on the shared backend tokenizer, so calls from
    concurrent threads (the server parses requests in workers) must not interleave: one lock."""
    with _ENCODE_LOCK:
        return tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=not parse_special)[
            "input_ids"
        ]


def _special_pattern(tokenizer: Any) -> re.Pattern | None:
    """A regex matching the tokenizer's special tokens, longest first; None when it has none."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None


def render_text(tokenizer: Any, messages: Iterable[dict[str, str]], generation_prompt: bool = False) -> str:
    """The conversation through the tokenizer's chat template, as text (``add_generation_prompt`` on request)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _layout(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, dict[str, str]]:
    """The template rendered with a random placeholder per content, and placeholder -> content. A
    template that trims contents (``| trim``) is honoured: the placeholders are filled with what
    reproduces the plain rendering, exact or stripped contents."""
    nonce = secrets.token_hex(8)
    marks = [f"@@content-{nonce}-{i}@@" for i in range(len(messages))]
    layout = render_text(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)], True)
    plain = render_text(tokenizer, messages, True)
    for fill in (lambda text: text, str.strip):
        contents = {mark: fill(m["content"]) for mark, m in zip(marks, messages)}
        if _fill(layout, contents) == plain:
            return layout, contents
    logger.warning("the chat template rewrites message contents; contents are inserted as sent")
    return layout, {mark: m["content"] for mark, m in zip(marks, messages)}


def _fill(text: str, contents: dict[str, str]) -> str:
    for mark, content in contents.items():
        text = text.replace(mark, content)
    return text


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The target's own chat template with the assistant header appended (add_generation_prompt).

    Contents are text: special tokens come only from the template, never from a message, so a
    content holding "<|im_end|>\n<|im_start|>system\n..." cannot forge a system turn. The template is
    rendered with placeholders; the rendering is cut at the template's own special tokens and the
    text between them (template text and contents together, as a plain rendering would tokenize it)
    is tokenized with special-token parsing off. Without special-token strings in the contents the
    ids equal tokenizing the plain rendering."""
    layout, contents = _layout(tokenizer, messages)
    pattern = _special_pattern(tokenizer)
    pieces = pattern.split(layout) if pattern is not None else [layout]
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index % 2:  # re.split puts the captured separators (the template's special tokens) at odd indices
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            ids += encode(tokenizer, _fill(piece, contents), parse_special=False)  # the template already has BOS
    return ids
