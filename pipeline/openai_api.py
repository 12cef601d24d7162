"""The OpenAI-compatible wire protocol of ``pipeline.serve``: request schemas, error bodies, prompt
rendering, completion text with stop sequences, incremental detokenization for streams
(``TextStream``) and server-sent-event chunks.

Pure functions of the tokenizer and plain data (no Ray, no model), so ``pipeline.evaluate`` renders
prompts and texts exactly as the server does, and tests can check them without a server.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("ray.serve")


# ---- request schemas: strict types, so "5" is not a number; unknown OpenAI fields are ignored ----
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1  # one choice per request
    speculative: bool = True  # extension: False decodes without the draft (A/B through the endpoint)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingRequest):
    prompt: str = Field(min_length=1)


FIELDS = {name for m in (TextPart, ChatMessage, ChatRequest, CompletionRequest) for name in m.model_fields}


class ApiError(Exception):
    """A request the server refuses, as an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_error(error: ValidationError) -> ApiError:
    errors = error.errors()
    first = max(errors, key=lambda e: len(e["loc"]))  # the deepest error says the most
    # union branches add type tags to the location ("stop", "list[str]"): keep field names and indices
    param = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in FIELDS) or None
    got = f"(got {first.get('input')!r:.80})"
    if first["type"] == "missing":
        return ApiError(f"missing required field '{param}'", param)
    tags = [e["loc"][-1] for e in errors if len(e["loc"]) == len(first["loc"])
            and isinstance(e["loc"][-1], str) and e["loc"][-1] not in FIELDS]
    if len(tags) > 1:  # no branch of a union fits
        return ApiError(f"invalid '{param}': expected one of {', '.join(map(str, tags))} {got}", param)
    return ApiError(f"invalid '{param}': {first['msg']} {got}", param)


def parse_request(raw: bytes, schema: type[SamplingRequest]) -> SamplingRequest:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise _validation_error(error) from None


def stop_sequences(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError("'stop' must be a non-empty string or a list of at most 4 non-empty strings", "stop")
    return stops


# ---- prompts and completions ----
def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The target's own chat template with the assistant header appended (add_generation_prompt)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already has BOS


def completion_text(tokenizer: Any, tokens: list[int], stop_ids: list[int], stops: list[str]) -> tuple[str, int, bool]:
    """Text of the new tokens (a final stop token dropped), cut before the first stop sequence.
    Returns the text, the tokens it took (counted up to the one completing a stop sequence) and
    whether a stop sequence ended it."""
    body = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
    text = tokenizer.decode(body, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    if not cuts:
        return text, len(tokens), False
    low, high = 1, len(body)  # the shortest token prefix whose text contains a stop sequence
    while low < high:
        mid = (low + high) // 2
        if any(s in tokenizer.decode(body[:mid], skip_special_tokens=True) for s in stops):
            high = mid
        else:
            low = mid + 1
    return text[: min(cuts)], low, True


def speculative_block(result: Any, enabled: bool, tree: Any) -> dict[str, Any]:
    """A GenerationResult's stats as the response's ``speculative`` block (tau includes the bonus token)."""
    stats = result.stats
    return {"enabled": enabled, "rounds": stats.rounds, "accepted_tokens": sum(stats.accepted_per_round),
            "acceptance_length": stats.acceptance_length, "accepted_per_round": stats.accepted_per_round,
            "draft_tokens_per_round": tree.total_tokens - 1 if enabled else 0}


# ---- streaming: safe text deltas and server-sent-event chunks ----
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


class TextStream:
    """Incremental detokenization of a generation's committed tokens, honouring stop sequences.

    ``push`` decodes all tokens so far (so the text is exactly what ``completion_text`` sees, tokenizer
    clean-ups included; one decode per round is cheap next to a target pass) and returns only what is
    safe to send: never half a multi-byte character (a trailing U+FFFD waits for its next bytes), no
    trailing whitespace (a clean-up may still rewrite " ." as "."), never text that may be part of a
    stop sequence. ``stopped`` turns True once a stop sequence is certain; ``finish`` settles the rest
    with ``completion_text``, so the streamed text equals the non-streamed one."""

    def __init__(self, tokenizer: Any, stop_ids: list[int], stops: list[str]):
        self.tokenizer, self.stop_ids, self.stops = tokenizer, list(stop_ids), stops
        self.tokens: list[int] = []
        self.sent, self.stopped = "", False

    def push(self, tokens: list[int]) -> str:
        """Add a round's tokens; returns the new text that is safe to send ('' when none)."""
        self.tokens += tokens
        if self.stopped:
            return ""
        body = self.tokens[:-1] if self.tokens and self.tokens[-1] in self.stop_ids else self.tokens
        text = self.tokenizer.decode(body, skip_special_tokens=True).rstrip("\ufffd")
        pending = _pending_stop(text, self.stops)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts and min(cuts) <= pending:  # no stop sequence starting earlier can still complete
            self.stopped, ready = True, text[: min(cuts)]
        else:
            ready = text[: min(pending, len(text.rstrip()))]
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""  # nothing new, or the decoded prefix changed: wait, ``finish`` settles it
        delta, self.sent = ready[len(self.sent):], ready
        return delta

    def finish(self) -> tuple[str, int, bool]:
        """The last delta, the completion's token count and whether a stop sequence ended it."""
        text, n_tokens, hit = completion_text(self.tokenizer, self.tokens, self.stop_ids, self.stops)
        if not text.startswith(self.sent):  # only a tokenizer that rewrites far back could do this
            logger.warning("streamed text %r is not a prefix of the final text %r", self.sent, text)
            return "", n_tokens, hit
        return text[len(self.sent):], n_tokens, hit


SSE_DONE = "data: [DONE]\n\n"


def sse_chunk(head: dict, chat: bool, delta: dict[str, str], finish_reason: str | None = None,
              extra: dict | None = None) -> str:
    """One OpenAI stream chunk: a chat ``delta`` ({"role"}/{"content"}) or a completion's ``text``;
    the final one carries ``finish_reason`` and ``extra`` (usage, the speculative block)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    choice = ({"index": 0, "delta": delta, "finish_reason": finish_reason} if chat else
              {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason, "logprobs": None})
    return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice], **(extra or {})})}\n\n"


async def sse_stream(items: AsyncIterator[Any], text: TextStream, head: dict, chat: bool,
                     tail: Callable[[Any, int, bool], tuple[str, dict]]) -> AsyncIterator[str]:
    """A stream's events: (chat) the role chunk, one chunk per text delta the moment ``items`` yields it,
    then the final chunk with ``tail(result, completion_tokens, hit_stop)`` = (finish_reason, extra
    fields), where ``result`` is the last item, and [DONE]. Closing this closes ``items``."""
    if chat:
        yield sse_chunk(head, chat, {"role": "assistant", "content": ""})
    try:
        async with contextlib.aclosing(items):
            async for item in items:
                if isinstance(item, str):
                    yield sse_chunk(head, chat, {"content": item})
                else:
                    result = item
    except Exception as error:  # the 200 and some chunks are out: report in-band and keep serving
        logger.exception("streamed generation failed")
        yield f"data: {json.dumps(ApiError(f'internal error: {error}', kind='server_error').body())}\n\n"
        return
    delta, n_tokens, hit = text.finish()
    if delta:
        yield sse_chunk(head, chat, {"content": delta})
    finish, extra = tail(result, n_tokens, hit)
    yield sse_chunk(head, chat, {}, finish, extra)
    yield SSE_DONE
