"""The OpenAI-compatible wire protocol of ``pipeline.serve``: request parsing and schemas, error
bodies, completion text with stop sequences and log-probabilities. Prompts render through
``pipeline.data.chat.render_chat``; streams through ``pipeline.serve.sse``.

Pure functions of the tokenizer and plain data (no Ray, no model), so ``pipeline.evaluate`` renders
prompts and texts exactly as the server does, and tests can check them without a server.

Hostile input is a 400 naming the field, never a 500: ``parse_request`` rejects nesting deeper than
``MAX_JSON_DEPTH``, integers longer than ``MAX_INT_DIGITS`` digits and non-finite numbers (NaN,
Infinity, 1e999) anywhere in the body, and OpenAI fields the server cannot honour
(``pipeline.serve.fields.REFUSED``: penalties, ``n`` > 1, tools ...) unless they carry their neutral value.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.data.chat import encode, render_chat
from pipeline.serve.fields import unsupported

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


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with ``choices: []`` and the usage


MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit, vLLM's default max)


class SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)  # OpenAI's current name for max_tokens
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1 (vLLM's spelling): no top-k
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: bool = True  # extension: False decodes without the draft (A/B through the endpoint)
    return_token_ids: bool = False  # extension (vLLM's name): the emitted ids in the speculative block

    def token_budget(self) -> tuple[int | None, str]:
        """The requested number of new tokens and the field the client set it with."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprobs_top(self) -> int | None:
        """None: no log-probabilities; n: the emitted token's plus the top n alternatives."""
        return None

    def check(self) -> None:
        """Cross-field rules the schema cannot state; raises ApiError."""
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ApiError(
                f"'max_tokens'={self.max_tokens} and 'max_completion_tokens'={self.max_completion_tokens} "
                "disagree; they are the same limit, send only one",
                "max_completion_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
        self.top_k = max(self.top_k, 0)  # the decode's "no top-k" is 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")


class CompletionRequest(SamplingRequest):
    prompt: str = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the completions API's top-n

    def logprobs_top(self) -> int | None:
        return self.logprobs


FIELDS = {
    name for m in (TextPart, ChatMessage, StreamOptions, ChatRequest, CompletionRequest) for name in m.model_fields
}


class ApiError(Exception):
    """A request the server refuses, as an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.kind, self.headers = param, status, code, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(error: ValidationError) -> ApiError:
    errors = error.errors()
    first = max(errors, key=lambda e: len(e["loc"]))  # the deepest error says the most
    # union branches add type tags to the location ("stop", "list[str]"): keep field names and indices
    param = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in FIELDS) or None
    got = f"(got {first.get('input')!r:.80})"
    if first["type"] == "missing":
        return ApiError(f"missing required field '{param}'", param)
    tags = [
        e["loc"][-1]
        for e in errors
        if len(e["loc"]) == len(first["loc"]) and isinstance(e["loc"][-1], str) and e["loc"][-1] not in FIELDS
    ]
    if len(tags) > 1:  # no branch of a union fits
        return ApiError(f"invalid '{param}': expected one of {', '.join(map(str, tags))} {got}", param)
    return ApiError(f"invalid '{param}': {first['msg']} {got}", param)


MAX_JSON_DEPTH = 32  # an OpenAI request nests ~5 deep (messages[i].content[j].text)
MAX_INT_DIGITS = 64  # far above any valid value (seed < 2**63 has 19 digits), far below Python's 4300


class _HugeInt:
    """Stands in for a JSON integer too long to convert: ``int()`` of 4300+ digits raises, and a
    long one costs quadratic time; the body check reports it with its field."""

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _HugeInt:
    digits = len(text) - text.startswith("-")
    return int(text) if digits <= MAX_INT_DIGITS else _HugeInt(digits)


def _where(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None


def _check_values(body: Any) -> None:
    """Walks the parsed body (iteratively: a deep one must not recurse) for what JSON allows and a
    request must not hold: nesting deeper than MAX_JSON_DEPTH, huge integers, NaN / Infinity / 1e999."""
    stack = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise ApiError(
                f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at '{_where(path)}'); flatten it",
                _where(path),
            )
        if isinstance(value, dict):
            stack.extend((item, (*path, key), depth + 1) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((item, (*path, index), depth + 1) for index, item in enumerate(value))
        elif isinstance(value, _HugeInt):
            raise ApiError(
                f"'{_where(path)}' is an integer with {value.digits} digits; integers in a request have "
                f"at most {MAX_INT_DIGITS} digits: use a value in the field's range",
                _where(path),
            )
        elif isinstance(value, float) and not math.isfinite(value):
            raise ApiError(
                f"'{_where(path)}' must be a finite number, got {value} (NaN, Infinity and numbers "
                "beyond the float range such as 1e999 are not accepted)",
                _where(path),
            )


def parse_json(raw: bytes) -> Any:
    """The body as JSON, checked by ``_check_values``; every failure is an ApiError (400)."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_constant=float)
    except RecursionError:
        raise ApiError(
            f"the request body nests too deeply to parse; requests nest at most {MAX_JSON_DEPTH} levels"
        ) from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ApiError(f"the request body is not valid JSON: {error}") from None
    _check_values(body)
    return body


def refuse_unsupported(body: dict[str, Any]) -> None:
    """An OpenAI or vLLM field this server does not implement (``pipeline.serve.fields.REFUSED``) is a
    400 naming it, unless it holds a neutral value: clients that always send e.g. ``presence_penalty: 0``
    keep working, and none gets an answer that silently ignored what it asked for."""
    refused = unsupported(body)
    if refused is not None:
        raise ApiError(refused[1], refused[0], code="unsupported_parameter")


def parse_request(raw: bytes, schema: type[SamplingRequest]) -> SamplingRequest:
    """A request body -> the validated request; any problem is an ApiError (400) naming the field."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    refuse_unsupported(body)
    try:
        request = schema.model_validate(body)
    except ValidationError as error:
        raise _validation_error(error) from None
    request.check()
    return request


def stop_sequences(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError("'stop' must be a non-empty string or a list of at most 4 non-empty strings", "stop")
    return stops


# ---- prompts and completions ----


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


def content_tokens(tokens: list[int], n_tokens: int, stop_ids: list[int]) -> int:
    """How many of the first ``n_tokens`` tokens make up the text: a final stop token does not."""
    return n_tokens - 1 if n_tokens and tokens[n_tokens - 1] in stop_ids else n_tokens


def speculative_block(result: Any, enabled: bool, token_ids: list[int] | None = None) -> dict[str, Any]:
    """A GenerationResult's stats as the response's ``speculative`` block (tau includes the bonus token);
    ``draft_tokens_per_round``: the mean tree the decode drafted (the policy's per batch size, 0 in a
    plain round). ``token_ids`` (the emitted ids, on ``return_token_ids``) let a client compare outputs
    token by token."""
    stats = result.stats
    drafted = stats.drafted_per_round
    block = {
        "enabled": enabled,
        "rounds": stats.rounds,
        "accepted_tokens": sum(stats.accepted_per_round),
        "acceptance_length": stats.acceptance_length,
        "accepted_per_round": stats.accepted_per_round,
        "draft_tokens_per_round": round(sum(drafted) / len(drafted), 2) if drafted else 0,
    }
    if token_ids is not None:
        block["token_ids"] = token_ids
    return block


# ---- log-probabilities in OpenAI's two formats ----
LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinities)


class LogprobFormatter:
    """``TokenLogprob`` entries (griffin.results) as OpenAI ``logprobs`` objects: chat
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or completions ``{tokens, token_logprobs,
    top_logprobs, text_offset}``. A token's text is its own decode (a lone byte of a multi-byte
    character reads U+FFFD; ``bytes`` are that text's UTF-8). ``offset`` keeps completions'
    ``text_offset`` running across a stream's chunks."""

    def __init__(self, tokenizer: Any, chat: bool, top_n: int):
        self.tokenizer, self.chat, self.top_n, self.offset = tokenizer, chat, top_n, 0

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _chat_item(self, token: int, value: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": max(value, LOGPROB_FLOOR), "bytes": list(text.encode())}

    def format(self, tokens: list[int], entries: list[Any]) -> dict[str, Any]:
        if self.chat:
            content = [
                {**self._chat_item(token, entry.logprob), "top_logprobs": [self._chat_item(i, v) for i, v in entry.top]}
                for token, entry in zip(tokens, entries)
            ]
            return {"content": content, "refusal": None}
        texts = [self._text(token) for token in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        tops = (
            [{self._text(i): max(v, LOGPROB_FLOOR) for i, v in entry.top} for entry in entries] if self.top_n else None
        )
        return {
            "tokens": texts,
            "token_logprobs": [max(e.logprob, LOGPROB_FLOOR) for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 when it exceeds ``limit`` bytes: at once from Content-Length, else
    as soon as the chunks read so far pass the limit, so an oversized body is never buffered whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        f"the request body is {size} bytes; this server accepts at most {limit} bytes "
        "(serve.max_body_bytes): shorten the prompt",
        status=413,
        code="request_too_large",
    )


def prompt_and_budget(
    req: SamplingRequest, tokenizer: Any, model_id: str, context: int, default_max_tokens: int
) -> tuple[list[int], int]:
    """The prompt's token ids and the token budget, checked against the context window."""
    if req.model is not None and req.model != model_id:
        raise ApiError(
            f"model {req.model!r} does not exist; this server serves {model_id!r} (see GET /v1/models)",
            "model",
            status=404,
            code="model_not_found",
        )
    field = "messages" if isinstance(req, ChatRequest) else "prompt"
    try:
        ids = (
            render_chat(tokenizer, [m.as_dict() for m in req.messages])
            if isinstance(req, ChatRequest)
            else encode(tokenizer, req.prompt, add_special_tokens=True)
        )  # a raw prompt: BOS as usual
    except Exception as error:  # a template may refuse e.g. a system message: the client's input
        raise ApiError(f"'{field}' could not be rendered with the chat template: {error}", field) from None
    if not ids or len(ids) >= context:
        raise ApiError(
            f"'{field}' is {len(ids)} tokens; it must be 1 to {context - 1} tokens (the context window is {context}: "
            "decode.max_context, or the target's own when smaller)",
            field,
        )
    room = context - len(ids)
    requested, name = req.token_budget()
    if requested is None:
        return ids, min(default_max_tokens, room)
    if requested > room:
        raise ApiError(
            f"'{name}'={requested} plus the prompt's {len(ids)} tokens exceeds the "
            f"context window of {context} (decode.max_context, or the target's own when smaller); use at most {room}",
            name,
        )
    return ids, requested
