"""The HTTP edge: a light deployment (FastAPI, no model) in front of the decoder (``pipeline.serve.deployment``).

Endpoints: POST /v1/chat/completions, POST /v1/completions (``stream: true`` = server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``), GET /v1/models, GET /health, GET /stats.

Admission is here (``relay.Admission``): the application takes ``serve.max_ongoing_requests``
completions per decoder replica running, and up to ``serve.max_queued_requests`` more wait here for one
of them; the next is refused at once, before its body is read, with 503 (or ``serve.shed_status``), an
OpenAI error body and ``Retry-After``. Each of the ``serve.ingress_replicas`` counts its share of both
(exact to the request with one) and sends up to every slot (``Ingress._limits`` says why). Serve
routes each admitted completion to a decoder replica with room, so no request is refused while a
replica has some. The ingress reads the body (413 beyond
``serve.max_body_bytes``, before buffering it) and hands it to a decoder replica through a streaming
``DeploymentHandle``; the decoder validates it (the one place that does) and answers with a ``Reply``: a
whole JSON answer (errors included), or a stream whose events the ingress relays as they come.

It lives apart from the decoder so that a decoder replica that dies (process killed, node preempted)
leaves someone to tell its clients: a stream ends with an error chunk (``type: server_error``, ``code:
replica_unavailable``, ``status: 503``) and ``[DONE]``; a request not yet answered gets 503 with
``Retry-After``. Either way the client knows to retry; Serve starts a replacement replica.

A client that goes away (streaming or not: a non-streaming request polls its connection every
``DISCONNECT_POLL_S``) or Serve's request timeout cancels the call, which stops the decode at its next
round. /health, /v1/models and /stats ask a decoder replica, on the slots Serve keeps free for them.
"""

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from pipeline.serve.auth import KeyCheck
from pipeline.serve.drain import POLL_S, find_board
from pipeline.serve.errors import internal_error, overloaded, replica_lost, retry_after, shutting_down
from pipeline.serve.protocol import ApiError, read_body
from pipeline.serve.relay import REPLICA_LOST, Admission, Call, ClientGone, until_done

logger = logging.getLogger("ray.serve")
# no /docs, /redoc or /openapi.json: the API is OpenAI's, and every route but /health sits behind the key
api = FastAPI(title="GRIFFIN speculative decoding", docs_url=None, redoc_url=None, openapi_url=None)

CONTROL_TIMEOUT_S = 5.0  # /health & co.: a decoder that cannot answer a cheap call this soon is unavailable
FOLLOW_S = 2.0  # how often an ingress replica counts the decoder replicas alive


def share(total: int, rank: int, ranks: int) -> int:
    """Replica ``rank``'s part of ``total`` among ``ranks``: parts differ by at most one and sum to ``total``."""
    return total // ranks + (rank < total % ranks)


def running_replicas(app: str, deployment: str) -> int:
    """How many replicas of ``deployment`` are running (a controller call: not on the event loop)."""
    from ray.serve.schema import ReplicaState

    application = serve.status().applications.get(app)
    status = application.deployments.get(deployment) if application is not None else None
    return status.replica_states.get(ReplicaState.RUNNING, 0) if status is not None else 0  # None: shutting down


@dataclass(frozen=True)
class EdgeConfig:
    """What the ingress needs of the run config (``app.app_builder`` fills it)."""

    model_id: str
    per_replica: int  # serve.max_ongoing_requests: completions at each decoder replica alive
    most_replicas: int  # decoder replicas at most (num_replicas, or autoscaling's max_replicas)
    queue: int  # serve.max_queued_requests: completions waiting in the ingress for a decoder slot
    max_body_bytes: int
    retry_after_s: float
    shed_status: int
    key_digest: str | None = None  # SHA-256 of the API key (auth.require_key); None: no key asked for


def _counters(model_id: str) -> dict[str, Any]:
    """Defined before ``Ingress``: ``serve.ingress`` serializes the class as it is decorated."""
    try:
        from ray.serve import metrics

        counters = {
            "lost": metrics.Counter(
                "griffin_num_requests_replica_lost",
                "Requests whose decoder replica died before answering them (503 or an in-stream error chunk).",
                ("model",),
            ),
            "shed": metrics.Counter(
                "griffin_num_requests_shed",
                "Completions refused with 503/429 because every decoder slot and the ingress queue were taken.",
                ("model",),
            ),
        }
        for counter in counters.values():
            counter.set_default_tags({"model": model_id})
        return counters
    except Exception:  # metrics are an aid: never a reason not to serve
        logger.exception("Ray metrics unavailable; serving without them")
        return {}


@serve.deployment
@serve.ingress(api)
class Ingress:
    """The HTTP edge of the application; ``decoder`` is the ``SpeculativeDecoder`` deployment's handle."""

    def __init__(self, decoder: DeploymentHandle, edge: EdgeConfig):
        self.decoder, self.streaming, self.edge = decoder, decoder.options(stream=True), edge
        self.replica_id = serve.get_replica_context().replica_id.unique_id  # the drain board's key
        self.admission = Admission(*self._limits(1))  # until the first count of the decoders running
        self.draining = False  # griffin serve's drain: new completions get 503 while the running ones finish
        # the constructor runs on the replica's event loop: the count and the drain follow from there
        self.follower = asyncio.get_running_loop().create_task(self._follow())
        self.keys = KeyCheck(edge.key_digest)
        self.counters = _counters(edge.model_id)

    @staticmethod
    def _place() -> tuple[int, int]:
        """(this replica's rank, ingress replicas): read each time, not kept, because Serve renumbers
        the replicas alive to 0..N-1 after a redeploy or a replacement (a reconfigure that updates the
        replica context); a rank kept from the constructor was seen at 1 and 2 of 2."""
        context = serve.get_replica_context()
        return context.rank.rank, max(context.world_size, 1)

    def _limits(self, alive: int) -> tuple[int, int, int]:
        """This ingress replica's limits with ``alive`` decoder replicas: its shares of the slots and of
        the queue (shares differ by at most one and sum to the whole: the application's shed limit is
        exact; every ingress keeps at least one slot, so none refuses everything), and every slot as
        what it may send at once. Serve's proxy may route a burst between ingress replicas unevenly, and
        an ingress that sent only its share of the slots left a request waiting here while the decoders
        had room (8 requests at once on 8 slots: ~1.7x slower in two of three repetitions)."""
        slots = self.edge.per_replica * min(max(alive, 1), self.edge.most_replicas)
        rank, ingresses = self._place()
        return max(share(slots, rank, ingresses), 1), share(self.edge.queue, rank, ingresses), slots

    async def _follow(self) -> None:
        """Every ``FOLLOW_S``, the decoder replicas running (serve.status) set the limits: a replica
        that died or has not started yet (autoscaling) holds no slots, so requests beyond the replicas
        alive wait here and are refused past the queue, instead of waiting in Serve's queues. With none
        running, one replica's slots: requests wait here for its replacement. Every ``drain.POLL_S``,
        ``griffin serve``'s drain board (pipeline.serve.drain) hears this replica's count and says
        whether to drain."""
        board, counted = None, float("-inf")
        while True:
            try:
                if time.monotonic() - counted >= FOLLOW_S:
                    counted = time.monotonic()
                    alive, board = await asyncio.to_thread(self._look_around, board)
                    self.admission.resize(*self._limits(alive))
                if board is not None:
                    report = board.report.remote(self.replica_id, self.admission.admitted)
                    self.draining = await asyncio.wait_for(report, CONTROL_TIMEOUT_S) or self.draining
            except Exception:  # the controller or the board restarting: keep the last limits, look again
                logger.warning("could not count the decoder replicas or read the drain board", exc_info=True)
                board = None
            await asyncio.sleep(POLL_S if board is not None else FOLLOW_S)  # idle unless griffin serve may drain

    def _look_around(self, board: Any) -> tuple[int, Any]:
        """(decoder replicas running, the drain board or None); blocking calls, off the event loop."""
        return running_replicas(self.decoder.app_name, self.decoder.deployment_name), board or find_board()

    @api.get("/health")
    async def health(self):
        """Liveness for load balancers: a decoder replica's answer (503 ``wedged`` when its decode has
        stalled), or 503 ``unavailable`` when none answers (all dead, or starting)."""
        try:
            return (await self._ask(self.decoder.health)).response()
        except ApiError as error:
            return JSONResponse({"status": "unavailable", "detail": str(error)}, 503, headers=error.headers)

    @api.get("/stats")
    async def stats(self, request: Request):
        """A decoder replica's counters and recent requests, with the application's admission (here)."""
        if (denied := self.keys.denied(request)) is not None:
            return denied
        try:
            decoder = await self._ask(self.decoder.stats)
        except ApiError as error:
            return error.response()
        rank, ingresses = self._place()
        ingress = {**self.admission.counters(), "replica": rank, "replicas": ingresses}
        return {**decoder, "shed": self.admission.shed, "ingress": ingress}

    @api.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self.keys.denied(request)) is not None:
            return denied
        try:
            return await self._ask(self.decoder.models)
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
                headers=retry_after(self.edge.retry_after_s),
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
        """Admit (or shed, before reading the body), read the body, wait for a decoder slot, call the
        decoder, answer with its reply or relay its stream. A decoder replica that dies before answering
        gets the client a 503 + Retry-After. Without the API key (when one is set): 401, before anything."""
        if (denied := self.keys.denied(request)) is not None:
            return denied
        if self.draining:
            return shutting_down(self.edge.retry_after_s).response()
        if self.admission.full():
            return self._shed()
        ticket = self.admission.enter()
        call: Call | None = None
        streaming = False
        try:
            raw = await read_body(request, self.edge.max_body_bytes)
            await until_done(ticket.wait(), request)  # a decoder slot, first come first served
            call = Call(self.streaming.complete.remote(raw, chat), ticket, self._lost, self._failed)
            reply = await until_done(call.first(), request)
            if not reply.stream:
                return reply.response()
            response = StreamingResponse(call.events(), media_type="text/event-stream")
            weakref.finalize(response, call.end)  # a stream that never started still stops its decode
            streaming = True
            return response
        except ApiError as error:
            return error.response()
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except BackPressureError:  # not expected: the decoders' Serve queue is unbounded, admission is here
            return overloaded("no decoder replica has room", self.edge.shed_status, self.edge.retry_after_s).response()
        except REPLICA_LOST as error:
            return self._lost(error).response()
        except Exception:  # a bug, not the client's fault: say so (not what it was) and keep serving
            return self._failed("the decoder call failed").response()
        finally:
            if streaming:
                pass  # the stream's end frees the ticket
            elif call is not None:
                call.end()
            else:
                ticket.release()

    def _failed(self, what: str) -> ApiError:
        return internal_error(logger, what)

    def _shed(self) -> Response:
        """Every decoder slot and the queue here are taken: refuse at once, with when to retry."""
        self.admission.shed += 1
        if "shed" in self.counters:
            self.counters["shed"].inc()
        detail = f"{self.admission.admitted} requests in progress or queued"
        return overloaded(detail, self.edge.shed_status, self.edge.retry_after_s).response()

    def _lost(self, error: BaseException) -> ApiError:
        """A decoder replica died under a request: logged, counted, answered 503 + Retry-After."""
        logger.warning("a decoder replica was lost under a request: %r", error)
        if "lost" in self.counters:
            self.counters["lost"].inc()
        return replica_lost(error, self.edge.retry_after_s)
