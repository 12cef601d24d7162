"""The ingress's own rules: API keys and the bind address, the names /v1/models shows, the admission
count, and a refused call that ends cleanly. The key tests run a deployment with a key set (tiny target,
random draft, the suite's local Ray); the rest need no server."""

import asyncio
import json
import os
import re
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from tests.conftest import tiny_deployment

from pipeline.config import load_config
from pipeline.serve.auth import KeyCheck, client_headers, key_digest, require_key
from pipeline.serve.deployment import public_name
from pipeline.serve.ingress import share
from pipeline.serve.relay import Admission, Call

TINY = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "tiny.yaml"
KEY = "sk-test-0123456789abcdef"
CHAT = "/v1/chat/completions"
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


# ---- no server ----
def serve_section(*overrides: str):
    return load_config(TINY, list(overrides)).serve


def test_a_host_reachable_from_outside_needs_a_key(monkeypatch):
    """0.0.0.0 without a key refuses to start, naming both ways out; a key, allow_unauthenticated or a
    loopback host lets it start."""
    monkeypatch.delenv("GRIFFIN_API_KEY", raising=False)
    for host in ("0.0.0.0", "'::'", "10.1.2.3", "serve.example.com"):  # quoted: YAML reads :: as a map
        with pytest.raises(ValueError, match="GRIFFIN_API_KEY") as refused:
            require_key(serve_section(f"serve.host={host}"))
        assert "serve.allow_unauthenticated" in str(refused.value)
    assert require_key(serve_section("serve.host=0.0.0.0", "serve.allow_unauthenticated=true")) is None
    for host in ("127.0.0.1", "::1", "localhost"):
        assert require_key(serve_section(f"serve.host={host}")) is None
    monkeypatch.setenv("GRIFFIN_API_KEY", KEY)
    assert require_key(serve_section("serve.host=0.0.0.0")) == key_digest(KEY)
    monkeypatch.setenv("OTHER_KEY", "sk-other")  # serve.api_key_env names another variable
    assert require_key(serve_section("serve.host=0.0.0.0", "serve.api_key_env=OTHER_KEY")) == key_digest("sk-other")


def test_start_serve_refuses_before_starting_anything(monkeypatch, tmp_path):
    from pipeline.serve import lifecycle

    monkeypatch.delenv("GRIFFIN_API_KEY", raising=False)
    monkeypatch.setattr("pipeline.runtime.ensure_ray", lambda cfg: pytest.fail("Ray was started"))
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "serve.host=0.0.0.0"])
    with pytest.raises(ValueError, match="no API key is set"):
        lifecycle.start_serve(cfg)


def test_the_app_admits_in_the_ingress_and_gives_replicas_a_grace_period(monkeypatch, tmp_path):
    """Completions: max_ongoing_requests per decoder replica (at most max_replicas of them) plus the
    ingress queue, counted by the 2 ingress replicas (each with CPU reserved); Serve's own queues unbounded (they would refuse a
    burst while a replica has room). Both deployments drain for serve.graceful_shutdown_timeout_s. The
    ingress is handed the key's digest, never the key."""
    from pipeline.serve.app import app_builder

    monkeypatch.setenv("GRIFFIN_API_KEY", KEY)
    overrides = [
        f"output_dir={tmp_path}",
        "serve.max_ongoing_requests=2",
        "serve.max_queued_requests=5",
        "serve.autoscaling={min_replicas: 1, max_replicas: 3}",
        "serve.graceful_shutdown_timeout_s=42",
    ]
    ingress = app_builder({"config": str(TINY), "overrides": overrides})._bound_deployment
    decoder_app, edge = ingress.init_args
    decoder = decoder_app._bound_deployment
    assert (edge.per_replica, edge.most_replicas, edge.queue) == (2, 3, 5)
    assert edge.key_digest == key_digest(KEY) and KEY not in repr(ingress.init_args)
    assert (ingress.num_replicas, ingress.max_ongoing_requests, ingress.max_queued_requests) == (2, 6 + 5 + 16, -1)
    assert ingress.ray_actor_options["num_cpus"] == 0.5  # serve.ingress_num_cpus: CPU of its own
    assert (decoder.max_ongoing_requests, decoder.max_queued_requests) == (6 + 5 + 16, -1)
    assert decoder._deployment_config.graceful_shutdown_timeout_s == 42
    assert ingress._deployment_config.graceful_shutdown_timeout_s > 42  # outlives a force-killed decoder


def test_an_application_the_local_ray_cannot_hold_is_refused_by_name(ray_local, tmp_path):
    """The suite's local Ray (tiny.yaml: 6 CPUs, no GPU) cannot grow: a decoder and two ingress replicas
    that need more are refused before anything deploys, with the settings named (Serve would wait)."""
    from pipeline.serve import lifecycle

    too_big = load_config(TINY, [f"output_dir={tmp_path}", "serve.num_cpus=6"])
    with pytest.raises(ValueError) as refused:
        lifecycle.start_serve(too_big)
    message = str(refused.value)
    assert "7 CPU needed, it has 6" in message and "serve.ingress_replicas=2 x serve.ingress_num_cpus=0.5" in message
    assert "1 decoder replica(s) x serve.num_cpus=6" in message
    gpu = load_config(TINY, [f"output_dir={tmp_path}", "serve.num_gpus=1"])
    with pytest.raises(ValueError, match="1 GPU needed, it has 0"):
        lifecycle.check_serve_fits(gpu)
    lifecycle.check_serve_fits(load_config(TINY, [f"output_dir={tmp_path}"]))  # the default fits


def test_the_key_is_checked_as_a_bearer_token():
    def request(header: str | None):
        headers = [] if header is None else [(b"authorization", header.encode())]
        return Request({"type": "http", "headers": headers})

    check = KeyCheck(key_digest(KEY))
    assert check.denied(request(f"Bearer {KEY}")) is None and check.denied(request(f"bearer  {KEY} ")) is None
    for header in (None, KEY, "Bearer", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer sk-wrong"):
        denied = check.denied(request(header))
        assert denied is not None and denied.status_code == 401, header
        assert denied.headers["www-authenticate"] == "Bearer"
    assert KeyCheck(None).denied(request(None)) is None  # no key configured: open


def test_models_card_names_are_never_machine_paths(tmp_path):
    draft = tmp_path / "drafts" / "smollm2-135m-instruct" / "griffin"
    draft.mkdir(parents=True)
    assert public_name(str(draft)) == "smollm2-135m-instruct/griffin"
    assert public_name("models:/llama3-griffin/7") == "models:/llama3-griffin/7"
    assert public_name("runs:/0a1b2c/draft") == "runs:/0a1b2c/draft"
    assert public_name("meta-llama/Meta-Llama-3-8B-Instruct") == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert public_name("/gone/elsewhere/draft") == "elsewhere/draft" and public_name(None) is None


def test_admission_counts_exactly_and_a_refused_call_ends_cleanly():
    """slots go out at once, queue more wait first come first served, the next is full; a call whose
    cancel re-raises its own error (Serve's DeploymentResponse.cancel() does, for a refused call) still
    frees its ticket and raises nothing."""

    class Refused:
        def cancel(self):
            raise RuntimeError("the call's own error, raised again")

    async def scenario():
        admission = Admission(slots=2, queue=1)
        tickets = [admission.enter() for _ in range(3)]
        assert admission.full()
        await tickets[0].wait(), await tickets[1].wait()
        third = asyncio.ensure_future(tickets[2].wait())
        await asyncio.sleep(0.01)
        assert not third.done() and admission.waiting == 1
        Call(Refused(), tickets[0], None, None).end()  # raises nothing
        await asyncio.wait_for(third, 1)  # the freed slot went to the one waiting
        assert (admission.admitted, admission.waiting, admission.full()) == (2, 0, False)
        tickets[0].release()  # a second release is a no-op
        for ticket in tickets[1:]:
            ticket.release()
        assert admission.admitted == admission.sent == 0

    asyncio.run(scenario())


def test_an_ingress_sent_more_than_its_share_of_a_burst_sends_it_all_while_the_decoders_have_room():
    """Two ingress replicas over 8 slots and a queue of 16 (4 + 8 each): Serve's proxy may route 5 of a
    burst of 8 to one. That one admits them all and sends all 5 (it may have every slot at the
    decoders), so none waits while a decoder slot is free; its shed limit stays its share, 4 + 8, so the
    application's (24) is exact. A ninth request at the same ingress waits for one of the 8 to end."""

    async def scenario():
        admission = Admission(slots=share(8, 0, 2), queue=share(16, 0, 2), send=8)
        tickets = [admission.enter() for _ in range(5)]
        await asyncio.wait_for(asyncio.gather(*(ticket.wait() for ticket in tickets)), 1)  # none waits
        assert admission.sent == 5 and not admission.full()
        tickets += [admission.enter() for _ in range(7)]
        assert admission.full()  # its share of the slots and of the queue: 12 admitted
        waiting = [asyncio.ensure_future(ticket.wait()) for ticket in tickets[5:]]
        await asyncio.sleep(0.01)
        assert admission.sent == 8 and sum(w.done() for w in waiting) == 3 and admission.waiting == 4
        tickets[0].release()
        await asyncio.sleep(0.01)
        assert admission.sent == 8 and sum(w.done() for w in waiting) == 4  # the oldest waiting one went
        for pending in waiting:  # the clients of the 3 still waiting leave
            pending.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for ticket in tickets:
            ticket.release()
        assert admission.admitted == admission.sent == 0 and admission.counters()["sends_at_most"] == 8

    asyncio.run(scenario())


def test_admission_follows_its_limits_as_decoder_replicas_come_and_go():
    """More slots go to the waiting tickets at once, oldest first; fewer take nothing back from calls at
    the decoders and hold the next; a ticket cancelled after its slot was granted, before it resumed,
    gives the slot back. Ingress replicas' shares differ by at most one and sum to the whole."""

    async def scenario():
        admission = Admission(slots=1, queue=3)
        tickets = [admission.enter() for _ in range(4)]
        await tickets[0].wait()
        second, third = asyncio.ensure_future(tickets[1].wait()), asyncio.ensure_future(tickets[2].wait())
        await asyncio.sleep(0.01)
        assert not second.done() and not third.done() and admission.waiting == 3
        admission.resize(2, 3)  # a decoder replica came up
        await asyncio.wait_for(second, 1)
        assert not third.done() and admission.sent == 2
        admission.resize(1, 3)  # ... and went: nothing is taken back
        tickets[0].release()
        await asyncio.sleep(0.01)
        assert not third.done() and admission.sent == 1  # one at the decoders, of one slot
        tickets[1].release()
        await asyncio.wait_for(third, 1)
        fourth = asyncio.ensure_future(tickets[3].wait())
        await asyncio.sleep(0.01)
        admission.resize(2, 3)  # granted ...
        fourth.cancel()  # ... and cancelled before it resumed: the slot goes back
        with pytest.raises(asyncio.CancelledError):
            await fourth
        assert admission.sent == 1 and not tickets[3].holds
        for ticket in tickets:
            ticket.release()
        assert admission.admitted == admission.sent == 0

    asyncio.run(scenario())
    assert [share(5, rank, 2) for rank in range(2)] == [3, 2] and sum(share(16, rank, 3) for rank in range(3)) == 16


def test_a_bug_is_logged_and_answered_without_its_text(caplog):
    """After the 200 a failing decode ends its stream with a 500 error chunk and [DONE]; the chunk names
    a request id, and only the log holds the exception (its text may hold paths or prompts)."""
    from pipeline.resources.targets import tiny_tokenizer
    from pipeline.serve.sse import TextStream, sse_stream

    async def items():
        yield "hel"
        raise RuntimeError("/srv/models/secret-weights.bin exploded")

    async def events():
        tokenizer = tiny_tokenizer()
        text = TextStream(tokenizer, [tokenizer.eos_token_id], [])
        return [e async for e in sse_stream(items(), text, {"id": "chatcmpl-1"}, True, lambda *a: ("stop", {}))]

    with caplog.at_level("ERROR"):
        sent = asyncio.run(events())
    assert sent[-1].endswith("data: [DONE]\n\n") and "hel" in sent[-2]
    error = json.loads(sent[-1].split("\n\n")[0].removeprefix("data: "))["error"]
    assert error["status"] == 500 and error["code"] == "internal_error" and "secret" not in sent[-1]
    request_id = re.search(r"request id (\w+)", error["message"]).group(1)
    assert any(request_id in r.getMessage() and "exploded" in r.exc_text for r in caplog.records if r.exc_text)


# ---- a deployment with a key ----
@pytest.fixture(scope="module")
def keyed(tmp_path_factory, ray_local):
    before = os.environ.get("GRIFFIN_API_KEY")
    os.environ["GRIFFIN_API_KEY"] = KEY  # read where the application is built: here, in start_serve
    try:
        with tiny_deployment(tmp_path_factory.mktemp("keyed")) as deployment:
            yield deployment
    finally:
        if before is None:
            os.environ.pop("GRIFFIN_API_KEY", None)
        else:
            os.environ["GRIFFIN_API_KEY"] = before


def test_every_route_but_health_needs_the_key(keyed):
    routes = [("GET", "/v1/models", None), ("GET", "/stats", None), ("POST", CHAT, GOOD)]
    routes.append(("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}))
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            response = httpx.request(method, f"{keyed.url}{path}", json=body, headers=headers, timeout=60)
            assert response.status_code == 401, (path, headers, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert KEY not in response.text
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{keyed.url}{CHAT}", json=GOOD, headers=ok, timeout=60).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models", headers=ok, timeout=60).status_code == 200
    assert httpx.get(f"{keyed.url}/health", timeout=60).json()["status"] == "ok"  # open: load balancers
    assert client_headers(keyed.cfg.serve) == ok  # what the evaluation through Serve sends
    assert httpx.get(f"{keyed.url}/docs", headers=ok, timeout=60).status_code == 404  # no schema pages


def test_models_card_shows_names_not_paths(keyed):
    card = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    (model,) = card["data"]
    assert model["draft"] == "keyed0/draft" and model["target"] == "tiny-llama"
    text = str(card)
    assert str(keyed.draft_dir) not in text and not re.search(r"'/[^']", text), card  # no absolute path anywhere
