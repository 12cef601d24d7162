"""A decoder replica killed for real (SIGKILL of its process, as a preempted node's would go) under
requests in flight: its clients get a retryable 503, in-band for a stream (an error chunk, then
[DONE]), and Serve's replacement replica serves the next request. A replica replaced by a redeploy
finishes its streams within serve.graceful_shutdown_timeout_s, and past it ends them the same way. The
deployment is the tiny target with a random draft on the suite's local Ray; the module owns it because
it kills and replaces its replicas."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import tiny_deployment

from pipeline.serve.app import APP_NAME

CHAT = "/v1/chat/completions"
# greedy "A long one." never meets the stop token within 480 tokens and, with the random draft, decodes
# for seconds: the kill lands mid-decode
LONG = {"messages": [{"role": "user", "content": "A long one."}], "max_tokens": 400, "temperature": 0}
ENDS_WITHIN_S = 30.0  # the answer to a killed request: seconds after the kill, not a hang


@pytest.fixture(scope="module")
def server(tmp_path_factory, ray_local):
    with tiny_deployment(tmp_path_factory.mktemp("death"), "serve.retry_after_s=3") as deployment:
        yield deployment


def decoder_pids() -> list[int]:
    """The live decoder replicas' worker processes (never the ingress's)."""
    import ray
    from ray.util.state import list_actors

    # this Ray's own State API server (pipeline.runtime.ensure_ray): other Rays may run on this machine
    address = ray.get_runtime_context().runtime_env["env_vars"]["RAY_API_SERVER_ADDRESS"]
    actors = list_actors(
        address,
        filters=[("class_name", "=", f"ServeReplica:{APP_NAME}:SpeculativeDecoder"), ("state", "=", "ALIVE")],
    )
    return [actor.pid for actor in actors]


def wait_for(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def kill_the_decoder(server) -> int:
    """SIGKILLs the one decoder replica once it is decoding; returns its pid."""
    wait_for(lambda: server.client.get("/stats").json().get("running") == 1)
    (pid,) = decoder_pids()
    os.kill(pid, signal.SIGKILL)
    return pid


def serving_again(server, dead: int) -> None:
    """Serve has replaced the killed replica: a live decoder with another pid answers /health."""
    wait_for(lambda: (pids := decoder_pids()) and dead not in pids)
    wait_for(lambda: server.client.get("/health").status_code == 200)


def test_a_stream_whose_replica_dies_ends_with_a_retryable_error_and_done(server):
    with server.client.stream("POST", CHAT, json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        data = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        role, first = json.loads(next(data)), json.loads(next(data))  # decoding: a first content chunk is out
        assert role["choices"][0]["delta"]["role"] == "assistant" and first["choices"][0]["delta"]["content"]
        dead = kill_the_decoder(server)
        killed = time.monotonic()
        rest = list(data)
    assert time.monotonic() - killed < ENDS_WITHIN_S
    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])["error"]
    assert error["status"] == 503 and error["type"] == "server_error" and error["code"] == "replica_unavailable"
    assert "retry" in error["message"]
    assert all("choices" in json.loads(chunk) for chunk in rest[:-2])  # before it: ordinary content chunks
    assert not any(json.loads(chunk)["choices"][0]["finish_reason"] for chunk in rest[:-2])  # never "finished"
    serving_again(server, dead)


def test_a_request_whose_replica_dies_gets_503_with_retry_after(server):
    """Serve does not retry a request its replica had accepted: the ingress answers 503 + Retry-After.
    /health meanwhile answers (503 while no decoder is up) instead of hanging."""
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(httpx.post(f"{server.url}{CHAT}", json=LONG, timeout=120)))
    waiting.start()
    dead = kill_the_decoder(server)
    killed = time.monotonic()
    waiting.join(ENDS_WITHIN_S)
    assert answers and time.monotonic() - killed < ENDS_WITHIN_S
    (response,) = answers
    assert response.status_code == 503 and response.headers["retry-after"] == "3", response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_unavailable"
    start = time.monotonic()
    assert server.client.get("/health").status_code in (200, 503)
    assert time.monotonic() - start < 10.0  # CONTROL_TIMEOUT_S and a margin: never a hang
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
    """The replica going away keeps decoding the stream it had; the stream ends as usual (its
    finish_reason, [DONE]), before Serve has replaced the replica."""
    with server.client.stream("POST", CHAT, json={**LONG, "max_tokens": 200, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(lines), next(lines)  # the role chunk and a first content chunk: decoding
        (old,) = decoder_pids()
        redeploying = redeploy(server, default_max_tokens=server.cfg.serve.default_max_tokens + 1)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert redeploying.is_alive()  # the old replica could not stop before the stream ended
    assert rest[-1] == "[DONE]" and "error" not in json.loads(rest[-2]), rest[-3:]
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    redeploying.join(180)
    serving_again(server, old)


def test_a_redeploy_past_the_grace_period_ends_streams_with_an_error_chunk(server):
    redeploy(server, graceful_shutdown_timeout_s=1.0).join(180)  # the running replica's grace period
    wait_for(lambda: server.client.get("/health").status_code == 200)
    with server.client.stream("POST", CHAT, json={**LONG, "stream": True}) as response:
        lines = response.iter_lines()
        next(lines), next(lines)
        (old,) = decoder_pids()
        redeploying = redeploy(server, default_max_tokens=server.cfg.serve.default_max_tokens + 1)
        start = time.monotonic()
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert time.monotonic() - start < ENDS_WITHIN_S
    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])["error"]
    assert error["status"] == 503 and error["code"] == "replica_unavailable" and "retry" in error["message"]
    redeploying.join(180)
    serving_again(server, old)


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
