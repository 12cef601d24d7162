"""The HTTP edge: a light deployment (FastAPI, no model) in front of the decoder (``pipeline.serve.decoder``).

Endpoints: POST /v1/chat/completions, POST /v1/completions (``stream: true`` = server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``), GET /v1/models, GET /health, GET /stats.

The ingress reads a completion's body (413 beyond ``serve.max_body_bytes``, before buffering it) and
hands it to a decoder replica through a streaming ``DeploymentHandle``; the decoder admits or sheds it,
validates it (the one place that does) and answers with a ``Reply``: a whole JSON answer (errors
included), or a stream whose events the ingress relays as they come. It lives apart from the decoder so
that a decoder replica that dies (process killed, node preempted) leaves someone to tell its clients: a
stream ends with an error chunk (``type: server_error``, ``code: replica_unavailable``, ``status: 503``)
and ``[DONE]``; a request not yet answered gets 503 with ``Retry-After``. Either way the client knows to
retry; Serve starts a replacement replica.

A client that goes away (streaming or not: a non-streaming request polls its connection every
``DISCONNECT_POLL_S``) or Serve's request timeout cancels the call, which stops the decode at its next
round. /health, /v1/models and /stats ask a decoder replica, on the slots Serve keeps free for them.
"""

import asyncio
import logging
import math
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pipeline.serve.protocol import ApiError, read_body
from pipeline.serve.sse import sse_error

logger = logging.getLogger("ray.serve")
api = FastAPI(title="GRIFFIN speculative decoding")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there
CONTROL_TIMEOUT_S = 5.0  # /health & co.: a decoder that cannot answer a cheap call this soon is unavailable
# a call's decoder replica is gone (its actor, worker process or node died) or there is none to call
REPLICA_LOST = (
    RayActorError,  # ActorDiedError, ActorUnavailableError
    WorkerCrashedError,
    NodeDiedError,
    ObjectLostError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
)


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
    """No room for a completion now (a decoder replica's queue, or Serve's queue in front of the
    decoders): 503 (or 429) with when to retry."""
    headers = retry_after(retry_after_s)
    return ApiError(
        f"the server is at capacity ({detail}); retry after {headers['Retry-After']}s",
        status=status,
        kind="server_error",
        code="server_overloaded",
        headers=headers,
    )


def replica_lost(error: BaseException, retry_after_s: float) -> ApiError:
    """The decoder replica serving a request died before answering it all: 503, retry."""
    return ApiError(
        f"the decoder replica serving this request was lost ({type(error).__name__}) before the answer was "
        "complete; retry the request",
        status=503,
        kind="server_error",
        code="replica_unavailable",
        headers=retry_after(retry_after_s),
    )


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def until_done(work: Awaitable[Any], request: Request, poll_s: float = DISCONNECT_POLL_S) -> Any:
    """``work``'s result, watching the client meanwhile: when it disconnects (or this coroutine is
    cancelled: Serve cancels a request whose client left or that timed out), ``work`` is cancelled and
    the caller cancels the decoder call."""
    consumer = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({consumer}, timeout=poll_s)
            if done:
                return consumer.result()
            if await _disconnected(request):
                raise ClientGone
    finally:
        consumer.cancel()  # a no-op once it is done


async def _disconnected(request: Request) -> bool:
    try:
        return await request.is_disconnected()
    except Exception:  # a receive channel that failed: Serve's own cancellation still applies
        return False


class Call:
    """One completion's streaming call to the decoder. ``cancel`` reaches the decoder's generator (its
    decode stops at the next round; a queued one never starts): every way a request ends before the
    decoder is done calls it."""

    def __init__(self, response: DeploymentResponseGenerator, lost: Callable[[BaseException], ApiError]):
        self.response, self.lost, self.over = response, lost, False

    async def first(self) -> Reply:
        reply = await anext(self.response)
        self.over = not reply.stream  # a whole answer is the decoder's last item
        return reply

    def cancel(self) -> None:
        if not self.over:
            self.over = True
            self.response.cancel()

    async def events(self) -> AsyncIterator[str]:
        """The rest of a stream, relayed as the decoder yields it. A stream the decoder cannot finish
        (its replica lost, a bug) ends with an error chunk and [DONE], never by just stopping."""
        try:
            async for event in self.response:
                yield event
            self.over = True
        except REPLICA_LOST as error:
            self.over = True
            yield sse_error(self.lost(error))
        except Exception as error:  # a decoder bug after the 200: report in-band
            self.over = True
            logger.exception("the decoder failed mid-stream")
            yield sse_error(ApiError(f"internal error: {error}", status=500, kind="server_error"))
        finally:
            self.cancel()  # the client left or the request timed out: stop the decode


def _lost_counter() -> Any:
    """Defined before ``Ingress``: ``serve.ingress`` serializes the class as it is decorated."""
    try:
        from ray.serve import metrics

        return metrics.Counter(
            "griffin_num_requests_replica_lost",
            "Requests whose decoder replica died before answering them (503 or an in-stream error chunk).",
        )
    except Exception:  # metrics are an aid: never a reason not to serve
        logger.exception("Ray metrics unavailable; serving without them")
        return None


@serve.deployment
@serve.ingress(api)
class Ingress:
    """The HTTP edge of the application; ``decoder`` is the ``SpeculativeDecoder`` deployment's handle."""

    def __init__(self, decoder: DeploymentHandle, max_body_bytes: int, retry_after_s: float, shed_status: int):
        self.decoder, self.streaming = decoder, decoder.options(stream=True)
        self.max_body_bytes, self.retry_after_s, self.shed_status = max_body_bytes, retry_after_s, shed_status
        self.lost_counter = _lost_counter()

    @api.get("/health")
    async def health(self):
        """Liveness for load balancers: a decoder replica's answer (503 ``wedged`` when its decode has
        stalled), or 503 ``unavailable`` when none answers (all dead, or starting)."""
        try:
            return (await self._ask(self.decoder.health)).response()
        except ApiError as error:
            return JSONResponse({"status": "unavailable", "detail": str(error)}, 503, headers=error.headers)

    @api.get("/stats")
    async def stats(self):
        """A decoder replica's counters and recent requests."""
        return await self._control(self.decoder.stats)

    @api.get("/v1/models")
    async def models(self):
        return await self._control(self.decoder.models)

    async def _control(self, method: Any) -> Any:
        try:
            return await self._ask(method)
        except ApiError as error:
            return error.response()

    async def _ask(self, method: Any) -> Any:
        """A cheap call to a decoder replica (on its control slots: never behind completions)."""
        response = method.remote()
        try:
            return await asyncio.wait_for(response, CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            raise ApiError(
                f"no decoder replica answered within {CONTROL_TIMEOUT_S:g}s (starting or gone); retry",
                status=503,
                kind="server_error",
                code="replica_unavailable",
                headers=retry_after(self.retry_after_s),
            ) from None
        except REPLICA_LOST as error:
            raise self._lost(error) from None

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool):
        """Read the body, call the decoder, answer with its reply or relay its stream. A decoder that
        cannot take the request (Serve's queue in front of it full) or dies before answering gets 503
        (or ``serve.shed_status``) + Retry-After."""
        call: Call | None = None
        try:
            raw = await read_body(request, self.max_body_bytes)
            call = Call(self.streaming.complete.remote(raw, chat), self._lost)
            reply = await until_done(call.first(), request)
            if not reply.stream:
                return reply.response()
            response = StreamingResponse(call.events(), media_type="text/event-stream")
            weakref.finalize(response, call.cancel)  # a stream that never started still stops its decode
            call = None
            return response
        except ApiError as error:
            return error.response()
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except BackPressureError:
            return overloaded(
                "the queue for a decoder replica is full", self.shed_status, self.retry_after_s
            ).response()
        except REPLICA_LOST as error:
            return self._lost(error).response()
        except Exception as error:  # a bug, not the client's fault: say so and keep serving
            logger.exception("the decoder call failed")
            return ApiError(f"internal error: {error}", status=500, kind="server_error").response()
        finally:
            if call is not None:
                call.cancel()

    def _lost(self, error: BaseException) -> ApiError:
        """A decoder replica died under a request: logged, counted, answered 503 + Retry-After."""
        logger.warning("a decoder replica was lost under a request: %r", error)
        if self.lost_counter is not None:
            self.lost_counter.inc()
        return replica_lost(error, self.retry_after_s)
