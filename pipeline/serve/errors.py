"""The answers the two deployments give each other and their clients when something goes wrong: the
decoder's ``Reply``, a shed request (``overloaded``), a lost decoder replica (``replica_lost``), a bug
(``internal_error``: logged with a request id, its text never sent). ``sse.sse_error`` ends a stream
with one of them."""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from pipeline.serve.protocol import ApiError


@dataclass
class Reply:
    """The decoder's answer to a call: a whole HTTP answer (``status``, JSON ``body``, ``headers``), or
    ``stream=True``: a 200 whose server-sent events the decoder yields next."""

    status: int
    body: Any = None
    headers: dict[str, str] | None = None
    stream: bool = False

    @classmethod
    def of(cls, error: ApiError) -> "Reply":
        return cls(error.status, error.body(), error.headers)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def overloaded(detail: str, status: int, retry_after_s: float) -> ApiError:
    """No room for a completion now: 503 (or 429) with when to retry."""
    headers = retry_after(retry_after_s)
    return ApiError(
        f"the server is at capacity ({detail}); retry after {headers['Retry-After']}s",
        status=status,
        kind="server_error",
        code="server_overloaded",
        headers=headers,
    )


def replica_lost(error: BaseException, retry_after_s: float) -> ApiError:
    """The decoder replica serving a request died before answering it all: 503, retry. Only the
    exception's type is named (``ActorDiedError``): its text holds process ids and node addresses."""
    return ApiError(
        f"the decoder replica serving this request was lost ({type(error).__name__}) before the answer was "
        "complete; retry the request",
        status=503,
        kind="server_error",
        code="replica_unavailable",
        headers=retry_after(retry_after_s),
    )


def shutting_down(retry_after_s: float) -> ApiError:
    """The server is draining before it stops (``griffin serve`` got SIGTERM): 503, retry elsewhere or later."""
    return ApiError(
        "the server is shutting down and takes no new requests; retry the request",
        status=503,
        kind="server_error",
        code="shutting_down",
        headers=retry_after(retry_after_s),
    )


def engine_failed(error: BaseException, retry_after_s: float) -> ApiError:
    """The replica's decoding engine stopped (an error outside any one request's decode): every request
    it held or gets fails with 503 and the replica reports unhealthy, so Serve replaces it. Only the
    exception's type is named; the replica logs the rest."""
    return ApiError(
        f"the decoder replica's engine failed ({type(error).__name__}); the replica is being replaced: retry "
        "the request",
        status=503,
        kind="server_error",
        code="replica_unavailable",
        headers=retry_after(retry_after_s),
    )


def internal_error(logger: logging.Logger, what: str) -> ApiError:
    """A bug, not the client's fault: the exception being handled goes to the log under a fresh request
    id; the client gets a 500 that names the id and nothing of the exception (its text may hold paths,
    prompts or configuration)."""
    request_id = uuid.uuid4().hex[:16]
    logger.exception("%s (request id %s)", what, request_id)
    return ApiError(
        f"internal server error (request id {request_id}); the server logged the details",
        status=500,
        kind="server_error",
        code="internal_error",
    )
