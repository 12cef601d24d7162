"""Streaming responses: text deltas that never split a stop sequence or a character (``TextStream``),
streamed log-probabilities, and server-sent-event chunks (``sse_chunk``, ``usage_chunk``, ``sse_stream``)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pipeline.serve.errors import internal_error
from pipeline.serve.protocol import ApiError, LogprobFormatter, completion_text, content_tokens

logger = logging.getLogger(__name__)


class StreamLogprobs:
    """Hands out a stream's log-probabilities chunk by chunk: ``take(tokens, upto)`` formats the
    entries not sent yet up to token ``upto`` (None when there are none). ``entries`` is the decode's
    ``LogprobRecorder.entries``, filled before the stream sees the tokens."""

    def __init__(self, formatter: LogprobFormatter, entries: list[Any]):
        self.formatter, self.entries, self.sent = formatter, entries, 0

    def take(self, tokens: list[int], upto: int) -> dict[str, Any] | None:
        upto = min(upto, len(self.entries), len(tokens))
        if upto <= self.sent:
            return None
        part = self.formatter.format(tokens[self.sent : upto], self.entries[self.sent : upto])
        self.sent = upto
        return part


def _pending_stop(text: str, stops: list[str]) -> int:
    """Where the earliest stop sequence that may still be completing at the end of ``text`` starts
    (``len(text)`` when none): the text from there on must wait for more tokens."""
    start = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):  # the longest partial match starts earliest
            if text.endswith(stop[:k]):
                start = min(start, len(text) - k)
                break
    return start


class TextDelta(str):
    """A text delta that also says how many leading tokens of the stream its text completes
    (``covered``), so the chunk sending it can carry those tokens' log-probabilities."""

    covered: int = 0


class IncrementalText:
    """``tokenizer.decode(tokens, skip_special_tokens=True)`` of a growing list of tokens, decoding only
    its last ones: a stream of n tokens pushed a few at a time decodes O(n) tokens in all, not O(n²).

    The text up to a boundary is kept. The tokens after it are decoded together with the ``ANCHOR``
    tokens before it, whose own text is then cut off: a token's text may depend on the token before it
    (SentencePiece drops the space of a text's first token; a character's bytes span tokens). The
    boundary moves ``STEP`` tokens behind the end once a whole decode confirms that the kept text and
    the rest add up to it (a boundary inside a character does not), and tries again ``RETRY`` tokens
    later when they do not. A rest that does not start with its anchor's text falls back to a whole
    decode."""

    STEP, ANCHOR, RETRY = 64, 4, 8

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.boundary, self.kept, self.anchor = 0, "", ""  # tokens[:boundary]'s text; its last ANCHOR tokens'
        self.next_move = 2 * self.STEP

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _rest(self, tokens: list[int], boundary: int, anchor: str) -> str | None:
        """The text of ``tokens[boundary:]`` as it continues ``tokens[:boundary]``; None if unsure."""
        piece = self._decode(tokens[max(0, boundary - self.ANCHOR) :])
        return piece[len(anchor) :] if piece.startswith(anchor) else None

    def text(self, tokens: list[int]) -> str:
        if len(tokens) >= self.next_move:
            self._move(tokens)
        rest = self._rest(tokens, self.boundary, self.anchor)
        return self._decode(tokens) if rest is None else self.kept + rest

    def _move(self, tokens: list[int]) -> None:
        split = len(tokens) - self.STEP
        before = self._rest(tokens[:split], self.boundary, self.anchor)
        anchor = self._decode(tokens[max(0, split - self.ANCHOR) : split])
        after = self._rest(tokens, split, anchor)
        if before is not None and after is not None and self.kept + before + after == self._decode(tokens):
            self.boundary, self.kept, self.anchor = split, self.kept + before, anchor
            self.next_move = len(tokens) + self.STEP
        else:
            self.next_move = len(tokens) + self.RETRY


class TextStream:
    """Incremental detokenization of a generation's committed tokens, honouring stop sequences.

    ``push`` takes the text of all tokens so far (``IncrementalText``: what ``completion_text`` sees,
    tokenizer clean-ups included, decoding only the last tokens again) and returns only what is safe
    to send: never half a multi-byte character (a trailing U+FFFD waits for its next bytes), no
    trailing whitespace (a clean-up may still rewrite " ." as "."), never text that may be part of a
    stop sequence. ``stopped`` turns True once a stop sequence is certain; ``finish`` settles the rest
    with ``completion_text``, so the streamed text equals the non-streamed one. With ``track_tokens``
    each delta is a ``TextDelta`` saying how many tokens the text sent so far covers (a few extra
    decodes per round, only for streams that asked for log-probabilities)."""

    def __init__(
        self, tokenizer: Any, stop_ids: list[int], stops: list[str], track_tokens: bool = False, emit: bool = True
    ):
        self.tokenizer, self.stop_ids, self.stops = tokenizer, list(stop_ids), stops
        self.tokens: list[int] = []
        self.decoded = IncrementalText(tokenizer)
        self.sent, self.stopped = "", False
        self.track_tokens, self.covered = track_tokens, 0
        self.emit = emit  # False (a non-streaming request): decode only to watch for stop sequences

    def _cover(self, body: list[int]) -> int:
        """The most leading tokens whose text is a prefix of the text sent (binary search from the
        last answer: a longer prefix of tokens only ever decodes to a longer text)."""
        low, high = self.covered, len(body)
        while low < high:
            mid = (low + high + 1) // 2
            if self.sent.startswith(self.tokenizer.decode(body[:mid], skip_special_tokens=True)):
                low = mid
            else:
                high = mid - 1
        return low

    def push(self, tokens: list[int]) -> str:
        """Add a round's tokens; returns the new text that is safe to send ('' when none)."""
        self.tokens += tokens
        if self.stopped or not (self.emit or self.stops):
            return ""
        body = self.tokens[:-1] if self.tokens and self.tokens[-1] in self.stop_ids else self.tokens
        text = self.decoded.text(body).rstrip("\ufffd")
        pending = _pending_stop(text, self.stops)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts and min(cuts) <= pending:  # no stop sequence starting earlier can still complete
            self.stopped, ready = True, text[: min(cuts)]
        else:
            ready = text[: min(pending, len(text.rstrip()))]
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""  # nothing new, or the decoded prefix changed: wait, ``finish`` settles it
        delta, self.sent = TextDelta(ready[len(self.sent) :]), ready
        if self.track_tokens:
            self.covered = delta.covered = self._cover(body)
        return delta

    def finish(self) -> tuple[str, int, bool]:
        """The last delta, the completion's token count and whether a stop sequence ended it."""
        text, n_tokens, hit = completion_text(self.tokenizer, self.tokens, self.stop_ids, self.stops)
        if not text.startswith(self.sent):  # only a tokenizer that rewrites far back could do this
            logger.warning("streamed text %r is not a prefix of the final text %r", self.sent, text)
            return "", n_tokens, hit
        return text[len(self.sent) :], n_tokens, hit


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: ApiError) -> str:
    """The end of a stream that failed after its 200 was sent: the OpenAI error body, with the HTTP
    status the failure would have had (``status``: 503 = retry, 500 = a bug), then ``[DONE]``, so a
    client sees both why and that nothing more is coming."""
    body = error.body()
    body["error"]["status"] = error.status
    return f"data: {json.dumps(body)}\n\n{SSE_DONE}"


def sse_chunk(
    head: dict,
    chat: bool,
    delta: dict[str, str],
    finish_reason: str | None = None,
    extra: dict | None = None,
    logprobs: dict | None = None,
) -> str:
    """One OpenAI stream chunk: a chat ``delta`` ({"role"}/{"content"}) or a completion's ``text``,
    with the ``logprobs`` of its tokens when asked; the final one carries ``finish_reason`` and
    ``extra`` (the speculative block)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    choice = (
        {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if chat
        else {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason, "logprobs": logprobs}
    )
    return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice], **(extra or {})})}\n\n"


def usage_chunk(head: dict, chat: bool, usage: dict) -> str:
    """``stream_options.include_usage``: the extra last chunk, ``choices: []`` and the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': usage})}\n\n"


async def sse_stream(
    items: AsyncIterator[Any],
    text: TextStream,
    head: dict,
    chat: bool,
    tail: Callable[[Any, int, bool], tuple[str, dict]],
    logprobs: StreamLogprobs | None = None,
    include_usage: bool = False,
) -> AsyncIterator[str]:
    """A stream's events: (chat) the role chunk, one chunk per text delta the moment ``items`` yields it,
    then the final chunk with ``finish_reason`` from ``tail(result, completion_tokens, hit_stop)`` =
    (finish_reason, extra fields), where ``result`` is the last item, and [DONE]. Closing this closes
    ``items``.

    ``logprobs``: each chunk carries the log-probabilities of the tokens its text completes
    (``TextDelta.covered``), the last text chunk (or the final chunk) the rest. Usage follows OpenAI:
    only with ``include_usage`` (stream_options), as ``usage: null`` on every chunk and an extra chunk
    before [DONE] with ``choices: []`` and the usage; the final chunk carries the other extra fields
    (the speculative block). A failure after the 200 went out is an error chunk, then [DONE], so a
    client that reads to [DONE] sees the error and the end."""
    if include_usage:
        head = {**head, "usage": None}
    if chat:
        yield sse_chunk(head, chat, {"role": "assistant", "content": ""})
    try:
        async with contextlib.aclosing(items):
            async for item in items:
                if isinstance(item, str):
                    part = logprobs.take(text.tokens, getattr(item, "covered", 0)) if logprobs else None
                    yield sse_chunk(head, chat, {"content": item}, logprobs=part)
                else:
                    result = item
        delta, n_tokens, hit = text.finish()
        rest = logprobs.take(text.tokens, content_tokens(text.tokens, n_tokens, text.stop_ids)) if logprobs else None
        finish, extra = tail(result, n_tokens, hit)
    except ApiError as error:  # e.g. the replica's engine failed (503): the client may retry
        yield sse_error(error)
        return
    except Exception:  # the 200 and some chunks are out: report in-band and keep serving
        yield sse_error(internal_error(logger, "streamed generation failed"))
        return
    if delta:
        yield sse_chunk(head, chat, {"content": delta}, logprobs=rest)
        rest = None
    yield sse_chunk(head, chat, {}, finish, {k: v for k, v in extra.items() if k != "usage"}, rest)
    if include_usage:
        yield usage_chunk(head, chat, extra["usage"])
    yield SSE_DONE
