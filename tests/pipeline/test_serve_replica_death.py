"""A decoder replica killed for real (SIGKILL of its process, as a preempted node's would go) under
requests in flight: its clients get a retryable 503, in-band for a stream (an error chunk, then
[DONE]), and Serve's replacement replica serves the next request. A replica replaced by a redeploy
finishes its streams within serve.graceful_shutdown_timeout_s, and past it ends them the same way. The
deployment is the tiny target with a random draft on the suite's local Ray; the module owns it because
it kills and replaces its replicas.

Nothing here depends on how fast the machine decodes. Every decode that must still be running when
something happens to its replica is one of thousands of tokens (the module's tiny target has a 16k
context), and the test acts on an event (a first content chunk, the replica reporting the request
running) within milliseconds of it. Where the decode must outlast a redeploy's drain or grace period,
the replica's process is held with SIGSTOP from that event on, so its decode cannot end first."""

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import first_content, tiny_deployment, wait_for

from pipeline.serve.app import APP_NAME
from pipeline.serve.ingress import CONTROL_TIMEOUT_S

CHAT = "/v1/chat/completions"
CONTEXT = 16384  # the module's tiny target (tiny.yaml: 512): room for decodes of thousands of rounds
# Greedy "A long one." never meets the stop token within the context (16338 tokens checked), and with the
# random draft a round commits about one token: LONG is 16000 rounds of decode, far more than the
# milliseconds between the event a test waits for and its kill, on any machine.
LONG = {"messages": [{"role": "user", "content": "A long one."}], "max_tokens": 16000, "temperature": 0}
# A killed request's answer: Ray reports the dead worker to the ingress within about a second. The bound
# only rules out a hang, which would last until the client's 120 s read timeout or Serve's 300 s request
# timeout (or, had the kill missed the decode, its 16000 rounds); 60 s leaves a loaded 2-core machine a
# wide margin.
ENDS_WITHIN_S = 60.0
DECODER = "SpeculativeDecoder"  # the decoder's Serve deployment


@pytest.fixture(scope="module")
def server(tmp_path_factory, ray_local):
    """The deployment, its target's context raised to CONTEXT (same weights: the draft's lineage holds)."""
    with tiny_deployment(
        tmp_path_factory.mktemp("death"),
        "serve.retry_after_s=3",
        # one decoder replica running, room for two: the ingress admits for the one alive
        "serve.autoscaling={min_replicas: 1, max_replicas: 2}",
        f"target.tiny.max_position_embeddings={CONTEXT}",
        f"decode.max_context={CONTEXT}",  # above the 8192 default cap
    ) as deployment:
        yield deployment


def replica_pids(deployment: str = DECODER) -> list[int]:
    """The live replicas' worker processes of ``deployment`` (the decoder's: never the ingress's)."""
    import ray
    from ray.util.state import list_actors

    # this Ray's own State API server (pipeline.runtime.ensure_ray): other Rays may run on this machine
    address = ray.get_runtime_context().runtime_env["env_vars"]["RAY_API_SERVER_ADDRESS"]
    actors = list_actors(
        address, filters=[("class_name", "=", f"ServeReplica:{APP_NAME}:{deployment}"), ("state", "=", "ALIVE")]
    )
    return [actor.pid for actor in actors]


def kill_the_decoder(server, running: int = 1) -> int:
    """SIGKILLs the one decoder replica as soon as it reports ``running`` requests decoding; returns its pid.
    The pid is looked up first, so that the kill follows the report within milliseconds."""
    (pid,) = replica_pids()
    wait_for(lambda: server.client.get("/stats").json().get("running") == running)
    os.kill(pid, signal.SIGKILL)
    return pid


def decoder_replica_states() -> dict[str, int]:
    """How many of the decoder deployment's replicas are in each Serve state (RUNNING, STOPPING, ...)."""
    from ray import serve

    return serve.status().applications[APP_NAME].deployments[DECODER].replica_states


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie its parent has not reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@contextlib.contextmanager
def frozen(pid: int):
    """The replica's process stopped (SIGSTOP) inside the block: its decode takes no round, however fast
    the machine; resumed (SIGCONT) after, if it still exists."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def serving_again(server, dead: int) -> None:
    """Serve has replaced the killed replica: a live decoder with another pid answers /health."""
    wait_for(lambda: (pids := replica_pids()) and dead not in pids)
    wait_for(lambda: server.client.get("/health").status_code == 200)


def test_requests_whose_replica_dies_end_with_a_retryable_error(server):
    """A stream and a plain request decoding together (16000 rounds from their ends) when their replica is
    killed, after the stream's first content chunk. Within ENDS_WITHIN_S of the kill: the stream's last
    chunks are an error (503, replica_unavailable, retry) and [DONE], after ordinary content chunks only
    (never a finish_reason); the request, which Serve does not retry once its replica accepted it, gets
    503 + Retry-After from the ingress. /health meanwhile answers (503 "unavailable" from the ingress
    itself while no decoder is up) instead of hanging; Serve then replaces the replica."""
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(httpx.post(f"{server.url}{CHAT}", json=LONG, timeout=120)))
    with server.client.stream("POST", CHAT, json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        data = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        role, first = json.loads(next(data)), json.loads(next(data))  # decoding: a first content chunk is out
        assert role["choices"][0]["delta"]["role"] == "assistant" and first["choices"][0]["delta"]["content"]
        waiting.start()
        dead = kill_the_decoder(server, running=2)
        killed = time.monotonic()
        rest = list(data)
    waiting.join(ENDS_WITHIN_S)
    assert answers and time.monotonic() - killed < ENDS_WITHIN_S
    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])["error"]
    assert error["status"] == 503 and error["type"] == "server_error" and error["code"] == "replica_unavailable"
    assert "retry" in error["message"]
    assert all("choices" in json.loads(chunk) for chunk in rest[:-2])  # before it: ordinary content chunks
    assert not any(json.loads(chunk)["choices"][0]["finish_reason"] for chunk in rest[:-2])  # never "finished"
    (response,) = answers
    assert response.status_code == 503 and response.headers["retry-after"] == "3", response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_unavailable"
    start = time.monotonic()
    health = server.client.get("/health")
    # Not a speed bound: the ingress answers by itself once a decoder has not answered within
    # CONTROL_TIMEOUT_S (5 s); 6 times that only rules out a hang (the client's 120 s timeout).
    assert time.monotonic() - start < 6 * CONTROL_TIMEOUT_S
    assert (health.status_code, health.json()["status"]) in ((200, "ok"), (503, "unavailable")), health.text
    serving_again(server, dead)


def redeploy(server, **serve_fields) -> threading.Thread:
    """Deploys the application again with changed serve.* fields, in a thread (it returns once the new
    replicas are ready): a changed decoder config replaces the decoder replica, which first stops taking
    requests and drains (Serve starts the new one after the old one is gone)."""
    from pipeline.serve.lifecycle import start_serve

    cfg = server.cfg.model_copy(update={"serve": server.cfg.serve.model_copy(update=serve_fields)})
    server.cfg = cfg
    thread = threading.Thread(target=start_serve, args=(cfg,))
    thread.start()
    return thread


def test_a_redeploy_lets_running_streams_finish(server):
    """The replica going away keeps decoding the stream it had: its drain begins (Serve reports the
    replica STOPPING) while the stream's decode is held mid-way (SIGSTOP from its first content chunk,
    999 rounds from its end), and once resumed the stream ends as usual (its finish_reason, [DONE]),
    before Serve has replaced the replica."""
    (old,) = replica_pids()
    with server.client.stream("POST", CHAT, json={**LONG, "max_tokens": 1000, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first_content(lines)  # the decode has committed tokens
        with frozen(old):
            redeploying = redeploy(server, default_max_tokens=server.cfg.serve.default_max_tokens + 1)
            wait_for(lambda: decoder_replica_states().get("STOPPING"))  # draining, the decode not over
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert redeploying.is_alive()  # the old replica could not stop before the stream ended
    assert rest[-1] == "[DONE]" and "error" not in json.loads(rest[-2]), rest[-3:]
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    redeploying.join(180)
    serving_again(server, old)


def test_a_redeploy_past_the_grace_period_ends_streams_with_an_error_chunk(server):
    """A stream still decoding when its replica's grace period (1 s) is over ends with an error chunk
    (503, replica_unavailable, retry) and [DONE], within ENDS_WITHIN_S of the kill. The replica is held
    (SIGSTOP) from the stream's first content chunk until Serve has force-killed it, so the decode
    cannot finish within the grace period however fast the machine."""
    redeploy(server, graceful_shutdown_timeout_s=1.0).join(180)  # the running replica's grace period
    wait_for(lambda: server.client.get("/health").status_code == 200)
    (old,) = replica_pids()
    with server.client.stream("POST", CHAT, json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        first_content(lines)  # the decode has committed tokens
        with frozen(old):
            redeploying = redeploy(server, default_max_tokens=server.cfg.serve.default_max_tokens + 1)
            wait_for(lambda: process_gone(old))  # force-killed past its grace period, never resumed
        killed = time.monotonic()
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < ENDS_WITHIN_S
    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])["error"]
    assert error["status"] == 503 and error["code"] == "replica_unavailable" and "retry" in error["message"]
    redeploying.join(180)
    serving_again(server, old)


def test_a_replica_whose_engine_fails_answers_503_and_is_replaced(server):
    """The decoder's engine made to fail at its next round (``FAULT_ENV``, inherited by the replica from
    the suite's environment): the request gets a retryable 503, never a hang; the replica's health check
    fails on the failed engine, Serve replaces it, and the new replica answers."""
    from pipeline.serve.replica import FAULT_ENV

    wait_for(lambda: server.client.get("/health").status_code == 200)
    (pid,) = replica_pids()
    Path(os.environ[FAULT_ENV]).write_text("0")
    failed = server.client.post(CHAT, json={**LONG, "max_tokens": 12})
    assert failed.status_code == 503 and failed.headers["Retry-After"] == "3"
    assert (
        failed.json()["error"]["code"] == "replica_unavailable" and "engine failed" in failed.json()["error"]["message"]
    )
    serving_again(server, pid)
    answered = server.client.post(CHAT, json={**LONG, "max_tokens": 12})
    assert answered.status_code == 200 and not Path(os.environ[FAULT_ENV]).exists()


def test_the_replacement_replica_serves_normally(server):
    """After the kills above, requests stream and answer in full again, on a new replica."""
    with server.client.stream("POST", CHAT, json={**LONG, "max_tokens": 12, "stream": True}) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    whole = server.client.post(CHAT, json={**LONG, "max_tokens": 12})
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] <= 12
    streamed = "".join(json.loads(line)["choices"][0]["delta"].get("content", "") for line in lines[:-2])
    assert streamed == whole.json()["choices"][0]["message"]["content"]  # greedy: the same text both ways
    assert server.client.get("/stats").json()["recent"][-1]["outcome"] == "finished"


def ingress_admissions(server) -> dict[int, dict]:
    """Every ingress replica's admission, by rank, as its /stats reports it (Serve's proxy sends each
    call to either). The ranks must be 0..N-1, what the shares assume: after this module's redeploys
    Serve renumbers the replicas alive (1 and 2 become 0 and 1), and a rank kept from an ingress's
    constructor stayed at 2."""
    seen: dict[int, dict] = {}

    def every_replica():
        ingress = server.client.get("/stats").json()["ingress"]
        seen[ingress["replica"]] = ingress
        if ingress["replica"] >= ingress["replicas"]:  # not renumbered (yet): what was seen may be stale
            seen.clear()
        return sorted(seen) == list(range(ingress["replicas"])) and seen

    return wait_for(every_replica, what="/stats from every ingress replica")


def test_the_ingress_replicas_share_admission_for_the_decoders_alive_and_outlive_each_other(server):
    """serve.ingress_replicas' default 2, each with its share of the limits for the decoder replicas
    running: 1 of the module's 1 to 2 (autoscaling), so max_ongoing_requests' 8 slots, not 16, split
    4 + 4, and the queue's 16 split 8 + 8; each may send all 8 slots. One ingress replica SIGKILLed:
    the other answers every request meanwhile, and Serve replaces it."""
    admissions = ingress_admissions(server).values()
    assert sorted((a["slots"], a["queue"], a["sends_at_most"]) for a in admissions) == [(4, 8, 8), (4, 8, 8)]
    killed = replica_pids("Ingress")[0]
    os.kill(killed, signal.SIGKILL)
    answers = [server.client.post(CHAT, json={**LONG, "max_tokens": 4}) for _ in range(8)]
    assert [answer.status_code for answer in answers] == [200] * 8, [answer.text for answer in answers]
    wait_for(lambda: len(pids := replica_pids("Ingress")) == 2 and killed not in pids, what="a new ingress replica")
    assert len(ingress_admissions(server)) == 2
