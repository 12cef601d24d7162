"""The OpenAI-compatible wire protocol of ``pipeline.serve``: request schemas, error bodies, prompt
rendering, completion text with stop sequences, and server-sent-event chunks.

Pure functions of the tokenizer and plain data (no Ray, no model), so ``pipeline.evaluate`` renders
prompts and texts exactly as the server does, and tests can check them without a server.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


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

    def response(self) -> JSONResponse:
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


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


def text_pieces(tokenizer: Any, tokens: list[int], text: str):
    """Per-token deltas of the final ``text``; a piece goes out once the decoded prefix agrees with
    the final text that far, so half a multi-byte character is never sent."""
    sent = 0
    for k in range(1, len(tokens) + 1):
        agree = len(os.path.commonprefix([tokenizer.decode(tokens[:k], skip_special_tokens=True), text]))
        if agree > sent:
            yield text[sent:agree]
            sent = agree
    if sent < len(text):
        yield text[sent:]


def speculative_block(result: Any, enabled: bool, tree: Any) -> dict[str, Any]:
    """A GenerationResult's stats as the response's ``speculative`` block (tau includes the bonus token)."""
    stats = result.stats
    return {"enabled": enabled, "rounds": stats.rounds, "accepted_tokens": sum(stats.accepted_per_round),
            "acceptance_length": stats.acceptance_length, "accepted_per_round": stats.accepted_per_round,
            "draft_tokens_per_round": tree.total_tokens - 1 if enabled else 0}


def sse_events(head: dict, chat: bool, pieces, finish: str, tail: dict):
    """OpenAI stream chunks: (chat: a role delta first), one chunk per piece, a final chunk with
    ``finish_reason`` plus usage and the speculative block, then ``data: [DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict[str, str], finish_reason: str | None = None, extra: dict | None = None) -> str:
        choice = ({"index": 0, "delta": delta, "finish_reason": finish_reason} if chat else
                  {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason, "logprobs": None})
        return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice], **(extra or {})})}\n\n"

    if chat:
        yield chunk({"role": "assistant", "content": ""})
    for piece in pieces:
        yield chunk({"content": piece})
    yield chunk({}, finish, tail)
    yield "data: [DONE]\n\n"

