"""The ingress's side of a completion: its place in the application's admission (``Admission``,
``Ticket``), its streaming call to a decoder replica (``Call``), and a non-streaming request's wait that
watches the client (``until_done``). No Serve deployment here: ``pipeline.serve.ingress`` uses these."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentResponseGenerator

from pipeline.serve.errors import Reply
from pipeline.serve.protocol import ApiError
from pipeline.serve.sse import sse_error

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there
# a call's decoder replica is gone (its actor, worker process or node died) or there is none to call
REPLICA_LOST = (
    RayActorError,  # ActorDiedError, ActorUnavailableError
    WorkerCrashedError,
    NodeDiedError,
    ObjectLostError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
)


class Admission:
    """An ingress replica's share of the application's completions, counted in its event loop (exact
    there, unlike Serve's ``max_queued_requests``, which may refuse a burst while a replica has room).
    It admits ``slots`` + ``queue`` completions (its shares of the decoders' slots,
    ``serve.max_ongoing_requests`` for each decoder replica alive, and of the queue; ``resize``d as
    replicas come and go) and refuses the next (``full``). Up to ``send`` of them are at the decoders
    at once (default ``slots``; the ingress passes every slot of the application: Serve's proxy may
    route a burst unevenly between ingress replicas, and a request must not wait here while the
    decoders have room); the rest wait here, first come first served, for one of those to end."""

    def __init__(self, slots: int, queue: int, send: int | None = None):
        self.admitted, self.sent, self.shed = 0, 0, 0
        self._waiters: deque[asyncio.Future] = deque()  # tickets waiting for a slot, oldest first
        self.resize(slots, queue, send)

    def full(self) -> bool:
        return self.admitted >= self.slots + self.queue

    @property
    def waiting(self) -> int:
        return self.admitted - self.sent

    def enter(self) -> "Ticket":
        self.admitted += 1
        return Ticket(self)

    def resize(self, slots: int, queue: int, send: int | None = None) -> None:
        """New limits (decoder replicas came or went): more slots go to waiting tickets at once; fewer
        take nothing back from completions already at the decoders."""
        self.slots, self.queue, self.send = slots, queue, slots if send is None else send
        self._grant()

    async def acquire(self) -> None:
        """A slot at the decoders, after every ticket that waited before this one."""
        if self.sent < self.send and not self._waiters:
            self.sent += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted, then cancelled before it resumed
                self.free()
            raise

    def free(self) -> None:
        self.sent -= 1
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.sent < self.send:
            granted = self._waiters.popleft()
            if not granted.done():  # a cancelled waiter leaves its future cancelled
                self.sent += 1
                granted.set_result(None)

    def counters(self) -> dict[str, int]:
        return {
            "admitted": self.admitted,
            "waiting": self.waiting,
            "slots": self.slots,
            "queue": self.queue,
            "sends_at_most": self.send,
        }


class Ticket:
    """One admitted completion: ``wait`` for a decoder slot, ``release`` when its answer is complete
    (once; every way a request ends calls it)."""

    def __init__(self, admission: Admission):
        self.admission, self.holds, self.released = admission, False, False

    async def wait(self) -> None:
        await self.admission.acquire()  # cancelled while waiting: nothing is held
        self.holds = True

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.admission.admitted -= 1
        if self.holds:
            self.admission.free()


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
    """One completion's streaming call to the decoder. ``end`` cancels the call when the decoder is not
    done (its decode stops at the next round; a queued one never starts) and frees the admission ticket:
    every way a request ends calls it, once."""

    def __init__(
        self,
        response: DeploymentResponseGenerator,
        ticket: Ticket,
        lost: Callable[[BaseException], ApiError],
        failed: Callable[[str], ApiError],
    ):
        self.response, self.ticket, self.lost, self.failed, self.over = response, ticket, lost, failed, False

    async def first(self) -> Reply:
        try:
            reply = await anext(self.response)
        except BaseException:
            self.over = True  # the call failed or was refused: nothing runs that cancel could stop
            raise
        self.over = not reply.stream  # a whole answer is the decoder's last item
        return reply

    def end(self) -> None:
        try:
            if not self.over:
                self.over = True
                self.response.cancel()  # re-raises the call's own error when it has failed: nothing to stop
        except Exception:
            pass
        finally:
            self.ticket.release()

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
        except Exception:  # a decoder bug after the 200: report in-band
            self.over = True
            yield sse_error(self.failed("the decoder failed mid-stream"))
        finally:
            self.end()  # the client left or the request timed out: stop the decode
