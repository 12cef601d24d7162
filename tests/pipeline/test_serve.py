"""The Serve endpoint on a real local Ray (127.0.0.1, a free port) with the tiny target and a random draft."""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest
import torch

from tests.conftest import tiny_deployment

from griffin.config import SamplingConfig
from griffin.decode import vanilla_generate
from griffin.results import GenerationResult, GenerationStats
from griffin.request import DecodeRequest, Row
from pipeline.data.chat import render_chat
from pipeline.serve.protocol import completion_text
from pipeline.serve.sse import TextStream, sse_stream
from pipeline.resources.targets import tiny_tokenizer

TINY = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "tiny.yaml"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory, ray_local):
    """A deployment on the suite's one local Ray (conftest), shut down after the module."""
    with tiny_deployment(tmp_path_factory.mktemp("serve"), "serve.max_ongoing_requests=8") as deployment:
        yield deployment


def test_app_builder_loads_nothing(tmp_path):
    """Building the application only reads the config: the model loads in the replica."""
    from ray.serve import Application

    from pipeline.serve.app import ServeArgs, app_builder

    app = app_builder({"config": str(TINY), "overrides": f"output_dir={tmp_path} serve.num_replicas=2"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="exactly one of"):
        app_builder(ServeArgs())


def test_stop_trimming_without_server():
    """Stop sequences cut the text and count only the tokens that produced it."""
    tokenizer = tiny_tokenizer()
    tokens = tokenizer("héllo wörld. more")["input_ids"] + [tokenizer.eos_token_id]
    text, used, hit = completion_text(tokenizer, tokens, [tokenizer.eos_token_id], [". m", "zzz"])
    assert (text, hit) == ("héllo wörld", True) and used == len(tokenizer("héllo wörld. m")["input_ids"])
    assert completion_text(tokenizer, tokens, [tokenizer.eos_token_id], [])[:2] == ("héllo wörld. more", len(tokens))


def push_all(text_stream, tokens, per_round=1):
    """The deltas of pushing ``tokens`` in rounds, and the round after which ``stopped`` turned True."""
    deltas, stopped_at = [], None
    for i in range(0, len(tokens), per_round):
        deltas.append(text_stream.push(tokens[i : i + per_round]))
        if text_stream.stopped and stopped_at is None:
            stopped_at = i + per_round
    return deltas, stopped_at


@pytest.mark.parametrize("per_round", [1, 3])
def test_text_stream_is_safe_and_matches_completion_text(per_round):
    """Deltas never hold half a character or any part of a stop sequence; the stop is detected in the
    round that completes it; deltas + finish() == completion_text, token count included."""
    tokenizer, eos = tiny_tokenizer(), tiny_tokenizer().eos_token_id
    tokens = tokenizer("héllo wörld. more €")["input_ids"] + [eos]
    plain = TextStream(tokenizer, [eos], [])
    deltas, _ = push_all(plain, tokens, per_round)
    assert all("\ufffd" not in d for d in deltas) and sum(bool(d) for d in deltas) > 3  # many small deltas
    last, n_tokens, hit = plain.finish()
    assert ("".join(deltas) + last, n_tokens, hit) == ("héllo wörld. more €", len(tokens), False)

    stream = TextStream(tokenizer, [eos], [". m", "zzz"])
    deltas, stopped_at = push_all(stream, tokens, per_round)
    completes = len(tokenizer("héllo wörld. m")["input_ids"])
    assert stopped_at == -(-completes // per_round) * per_round  # the round holding the stop's last token
    assert "".join(deltas) == "héllo wörld" and all("." not in d for d in deltas)  # "." waited, never sent
    assert stream.finish() == ("", completes, True)


LONG_TEXT = " ".join(f"word{i % 37} héllo wörld, 東京 {i} 🙂." for i in range(160))


def sentencepiece_like_tokenizer(text: str):
    """A word-level tokenizer with SentencePiece's Metaspace decoding: a decoded text's first token loses
    its space, so the text of a token depends on whether it comes first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"\u2581{w}": i + 1 for i, w in enumerate(sorted(set(text.split())))}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


class CountingTokenizer:
    """A tokenizer whose ``decode`` counts the tokens it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["bytes", "sentencepiece"])
def test_a_long_stream_decodes_its_text_incrementally_and_exactly(kind):
    """The streamed text of ~2,000 tokens (multi-byte characters split across byte tokens; SentencePiece's
    dropped first space) is at every round exactly the whole decode, and equals completion_text in the
    end, while decoding at most ~3 * STEP tokens a round and a whole decode every STEP tokens (3 * STEP * n
    + n² / STEP in all: a tenth of decoding all each round, n² / 2, at these lengths)."""
    from pipeline.serve.sse import IncrementalText

    tokenizer = tiny_tokenizer() if kind == "bytes" else sentencepiece_like_tokenizer(LONG_TEXT)
    tokens = tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"]
    assert len(tokens) > 900
    counting = CountingTokenizer(tokenizer)
    incremental = IncrementalText(counting)
    for end in range(1, len(tokens) + 1):
        assert incremental.text(tokens[:end]) == tokenizer.decode(tokens[:end], skip_special_tokens=True), end
    n, step = len(tokens), IncrementalText.STEP
    assert counting.decoded <= 3 * step * n + n * n / step < n * n / 2
    assert incremental.boundary > n - 3 * step  # the boundary kept moving

    stream = TextStream(tokenizer, [], [])
    deltas, _ = push_all(stream, tokens, per_round=3)
    last, n_tokens, _ = stream.finish()
    assert "".join(deltas) + last == completion_text(tokenizer, tokens, [], [])[0] and n_tokens == len(tokens)


def test_text_stream_waits_for_a_stop_that_starts_earlier():
    """With stops "xyz" and "y", seeing "axy" must not stop yet: "xyz" (starting earlier) may complete."""
    tokenizer = tiny_tokenizer()
    stream = TextStream(tokenizer, [], ["xyz", "y"])
    tokens = tokenizer("axyzb")["input_ids"]
    deltas, stopped_at = push_all(stream, tokens)
    assert stopped_at == 4 and "".join(deltas) == "a"
    # the count runs to the first token completing any stop ("y"), as completion_text counts it
    assert stream.finish() == ("", 3, True) == ("", *completion_text(tokenizer, tokens, [], ["xyz", "y"])[1:])


# ---- the streaming bridge with a stand-in decode: no server, no model ----
HEAD = {"id": "chatcmpl-test", "created": 0, "model": "tiny"}
# How long a test waits on an event that its own next step causes (the stand-in decode's gate, a chunk the
# decode has already committed, its thread ending). Not a speed bound: each is a handful of milliseconds
# of work, and the waits only turn a deadlock (a stream that held its chunks back, a decode that never
# ended) into a failure; generous so that a loaded 2-core machine never reaches it (pytest's own
# timeout is 300 s).
DEADLOCK_S = 120.0


class FakeEngine:
    """Stands in for a ``ReplicaEngine``: a thread (in ``threads``) commits ``rounds`` through the
    request's on_tokens, waits on ``gate`` before the second round, and records in ``calls`` each round
    it starts and how the row ended (an exception's name, or "cancelled" when the row was cancelled at a
    round's start)."""

    def __init__(self, rounds, gate=None, calls=None):
        self.rounds, self.gate, self.calls = rounds, gate, [] if calls is None else calls
        self.threads = []
        self.engine = self  # stream_rounds talks to ``engine.engine``

    def submit(self, request):
        row = Row(request, set(), 0)
        self.threads.append(threading.Thread(target=self._run, args=(row,), daemon=True))
        self.threads[-1].start()
        return row

    def cancel(self, row):
        row.cancelled = True

    def _run(self, row):
        committed = []  # as the engine: a round's tokens are the row's before its consumer sees them
        for i, tokens in enumerate(self.rounds):
            if i == 1 and self.gate is not None and not self.gate.wait(DEADLOCK_S):
                row.error = TimeoutError("the test never released the decode")
                break
            if row.cancelled:
                self.calls.append("cancelled")
                break
            self.calls.append(i)
            row.out += tokens
            committed.append(tokens)
            try:
                row.request.on_tokens(tokens)
            except Exception as error:
                self.calls.append(type(error).__name__)
                row.error = error
                break
        stats = GenerationStats(rounds=len(committed) - 1, accepted_per_round=[len(r) - 1 for r in committed[1:]])
        row.result = GenerationResult(row.out, stats, "length")
        row.done.set()
        row.request.on_done(row)


def tail(result, n_tokens, hit):
    return ("stop" if hit else result.finish_reason), {
        "usage": {"completion_tokens": n_tokens},
        "rounds": result.stats.rounds,
    }


def sse_of(engine, stops=(), max_new=1000, include_usage=False):
    from pipeline.serve.replica import stream_rounds

    text = TextStream(tiny_tokenizer(), [tiny_tokenizer().eos_token_id], list(stops))
    request = DecodeRequest([1], SamplingConfig(), max_new)
    return sse_stream(
        stream_rounds(engine, request, text, max_new), text, HEAD, True, tail, include_usage=include_usage
    )


def test_an_engine_failure_fails_every_request_with_a_retryable_503(tmp_path, monkeypatch):
    """The real replica engine (tiny target, no Ray) made to fail at its 30th round (``FAULT_ENV``): the stream
    ends with a 503 error chunk and [DONE], a request waiting for a slot fails the same way, the engine
    says why (the replica's health check reads it), and a new request is refused at once, never left
    to hang."""
    from griffin.policy import SpeculationPolicy
    from pipeline.resources.targets import build_tiny_target
    from pipeline.serve import replica
    from pipeline.serve.protocol import ApiError

    flag = tmp_path / "fail"
    flag.write_text("30")
    monkeypatch.setenv(replica.FAULT_ENV, str(flag))
    target = build_tiny_target(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
        torch.float32,
    )
    engine = replica.ReplicaEngine(target, None, SpeculationPolicy({1: None}), max_rows=1, retry_after_s=7)

    def request():
        return DecodeRequest([5, 6, 7], SamplingConfig(), 400, stop_token_ids=[])

    async def consume():
        text = TextStream(target.tokenizer, [], [])
        events = sse_stream(replica.stream_rounds(engine, request(), text, 400), text, HEAD, True, tail)
        queued = asyncio.ensure_future(
            replica.last_item(replica.stream_rounds(engine, request(), TextStream(target.tokenizer, [], []), 400))
        )
        streamed = [e async for e in events]
        with pytest.raises(ApiError) as waited:
            await asyncio.wait_for(queued, DEADLOCK_S)
        return streamed, waited.value

    streamed, waited = asyncio.run(consume())
    assert any(parse(e)["choices"][0]["delta"].get("content") for e in streamed[1:-1])  # it was streaming
    chunk, done = streamed[-1].split("\n\n", 1)  # the error chunk, then [DONE], in one event write
    error = parse(chunk)["error"]
    assert done == "data: [DONE]\n\n" and error["status"] == 503 and error["code"] == "replica_unavailable"
    assert "engine failed (RuntimeError)" in error["message"] and "injected" not in error["message"]
    assert waited.status == 503 and waited.headers == {"Retry-After": "7"}
    assert isinstance(engine.failure, RuntimeError) and not flag.exists()
    late = engine.engine.submit(request())  # ended at once, never waiting behind the stopped loop
    assert late.done.is_set() and isinstance(late.error, ApiError) and "engine failed" in str(late.error)
    engine.close()


def parse(event):
    return json.loads(event.removeprefix("data: "))


def test_sse_stream_sends_each_round_while_decoding():
    """The first content chunk arrives while the decode is still blocked before its second round: the
    stand-in engine has started round 0 only, and its gate (which only this test opens, after the
    chunk) holds round 1. A stream that waited for the decode would never yield it (DEADLOCK_S ends
    the wait)."""
    tokens = tiny_tokenizer()("Hello there, streaming world")["input_ids"]
    rounds, gate, calls = [tokens[i : i + 4] for i in range(0, len(tokens), 4)], threading.Event(), []

    async def consume():
        events = sse_of(FakeEngine(rounds, gate, calls))
        try:
            role = parse(await asyncio.wait_for(anext(events), DEADLOCK_S))
            first = parse(await asyncio.wait_for(anext(events), DEADLOCK_S))
            assert calls == [0] and not gate.is_set()  # round 0's tokens are out; round 1 has not begun
        finally:
            gate.set()
        return role, first, [e async for e in events]

    role, first, rest = asyncio.run(consume())
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"]["content"] == "Hell"
    assert rest[-1] == "data: [DONE]\n\n" and parse(rest[-2])["choices"][0]["finish_reason"] == "length"
    chunks = [parse(e) for e in rest[:-2]]
    assert len(chunks) >= len(rounds) - 2  # one chunk per round (a round ending in " " waits for the next)
    assert "Hell" + "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hello there, streaming world"


def test_sse_stream_stops_the_decode_at_a_stop_sequence():
    """The round that completes a stop sequence is the decode's last; usage counts up to that token."""
    tokens = tiny_tokenizer()("one two three four five six")["input_ids"]
    rounds, calls = [tokens[i : i + 2] for i in range(0, len(tokens), 2)], []
    events = asyncio.run(collect(sse_of(FakeEngine(rounds, calls=calls), stops=["thr"], include_usage=True)))
    final, usage = parse(events[-3]), parse(events[-2])["usage"]
    content = "".join(parse(e)["choices"][0]["delta"].get("content", "") for e in events[:-3])
    assert content == "one two " and final["choices"][0]["finish_reason"] == "stop"
    n_stop = len(tiny_tokenizer()("one two thr")["input_ids"])
    assert usage["completion_tokens"] == n_stop and calls[-1] == "StopDecoding"
    assert calls[-2] == (n_stop - 1) // 2 and final["rounds"] == (n_stop - 1) // 2  # no round after it


async def collect(events):
    return [e async for e in events]


def test_sse_stream_closed_by_the_client_ends_the_decode():
    """Closing the event stream (a client that went away) makes the decode's next round its last."""
    tokens = tiny_tokenizer()("abcdefghijklmnop")["input_ids"]
    rounds, gate, calls = [[t] for t in tokens], threading.Event(), []

    async def leave_early():
        engine = FakeEngine(rounds, gate, calls)
        events = sse_of(engine)
        await anext(events), await anext(events)  # the role chunk, the first content chunk
        await events.aclose()
        gate.set()
        return engine

    engine = asyncio.run(leave_early())
    (worker,) = engine.threads
    worker.join(DEADLOCK_S)  # the decode's thread ends on its own: wait for that event, not for the clock
    assert not worker.is_alive(), "the decode never ended"
    # the row is cancelled before round 1 (the client left while it waited on the gate)
    assert calls == [0, "cancelled"]


def greedy_text(target, prompt_ids, max_new):
    """What vanilla greedy decoding of the same target says, in this process."""
    result = vanilla_generate(target, torch.tensor([prompt_ids]), SamplingConfig(), max_new)
    return completion_text(target.tokenizer, result.tokens, target.stop_token_ids, [])[0], len(result.tokens)


def chat(server, content, **params):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0.0, **params}
    response = server.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_and_health(server):
    models = server.client.get("/v1/models").json()["data"]
    assert models[0]["id"] == "tiny-llama" and models[0]["speculative"] is True
    assert models[0]["draft"] == "/".join(server.draft_dir.parts[-2:])  # a name, not the machine's path
    assert models[0]["torch_threads"] == 1  # Ray's OMP_NUM_THREADS for a replica of serve.num_cpus 1
    assert models[0]["sampling_tree"] is None  # decode.sampling_tree unset: T > 0 rounds draft the policy's trees
    assert server.client.get("/health").json()["status"] == "ok"


def test_chat_greedy_equals_vanilla(server):
    """T=0 through the endpoint is the target's own greedy output; usage and the speculative block add up."""
    data = chat(server, "Tell me a story.")
    text, n_tokens = greedy_text(
        server.target, render_chat(server.target.tokenizer, [{"role": "user", "content": "Tell me a story."}]), 12
    )
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["content"] == text
    usage, spec = data["usage"], data["speculative"]
    assert usage["completion_tokens"] == n_tokens and usage["total_tokens"] == usage["prompt_tokens"] + n_tokens
    assert spec["enabled"] and spec["rounds"] == len(spec["accepted_per_round"]) >= 1
    assert spec["accepted_tokens"] == sum(spec["accepted_per_round"])
    # tau: every round commits its accepted tokens plus one; the prefill's first token is not a round
    assert spec["acceptance_length"] == pytest.approx((spec["accepted_tokens"] + spec["rounds"]) / spec["rounds"])
    assert spec["accepted_tokens"] + spec["rounds"] + 1 >= n_tokens
    assert data["choices"][0]["finish_reason"] in ("stop", "length")


def test_completion_greedy_equals_vanilla(server):
    response = server.client.post(
        "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0}
    )
    data = response.json()
    ids = server.target.tokenizer("def add(a, b):")["input_ids"]
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == greedy_text(server.target, ids, 10)[0]


def events(server, path, body):
    with server.client.stream("POST", path, json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_text(chunks, chat=True):
    return "".join(c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"] for c in chunks)


def test_streaming_matches_non_streaming(server):
    body = {"messages": [{"role": "user", "content": "Stream please."}], "max_tokens": 48, "temperature": 0}
    chunks = events(server, CHAT, {**body, "stream": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    whole = chat(server, "Stream please.", max_tokens=48)
    assert streamed_text(chunks) == whole["choices"][0]["message"]["content"]
    assert len(chunks) > 3  # several rounds, several content chunks (not one blob at the end)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert "usage" not in chunks[-1] and chunks[-1]["speculative"] == whole["speculative"]  # usage: if asked
    completion = {"prompt": "abc", "max_tokens": 24, "temperature": 0}
    text_chunks = events(server, "/v1/completions", {**completion, "stream": True})
    assert text_chunks[-1]["speculative"]["rounds"] >= 1 and text_chunks[0]["object"] == "text_completion"
    expected = server.client.post("/v1/completions", json=completion).json()["choices"][0]["text"]
    assert streamed_text(text_chunks, chat=False) == expected


def test_streaming_with_stop_matches_non_streaming(server):
    """A stop sequence ends the stream with the same text, finish_reason and usage as without streaming."""
    full = chat(server, "Go on.", max_tokens=32)["choices"][0]["message"]["content"]
    for stop in (full[10:12], [full[3:5], "never-there"]):
        whole = chat(server, "Go on.", max_tokens=32, stop=stop)
        body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 32, "temperature": 0}
        usage_asked = {"stream": True, "stream_options": {"include_usage": True}}
        *chunks, last = events(server, CHAT, {**body, "stop": stop, **usage_asked})
        assert streamed_text(chunks) == whole["choices"][0]["message"]["content"], stop
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" == whole["choices"][0]["finish_reason"]
        assert last["choices"] == [] and last["usage"] == whole["usage"]
        assert chunks[-1]["speculative"]["rounds"] <= whole["speculative"]["rounds"]  # stopped early


def test_official_openai_client(server):
    """The official openai client, as users call the endpoint: chat, streamed chat with and without
    usage, completions, and a refused field; the answers are the plain HTTP ones."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    ask = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12}
    reply = client.chat.completions.create(**ask, temperature=0)
    expected = chat(server, "Tell me a story.")
    assert reply.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert reply.model_extra["speculative"]["rounds"] >= 1  # the extension block, an extra field
    for options in ({}, {"stream_options": {"include_usage": True}}):
        chunks = list(client.chat.completions.create(**ask, temperature=0, stream=True, **options))
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
        )
        usages = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        assert usages == ([reply.usage.completion_tokens] if options else [])
        assert chunks[-1].choices == [] if options else chunks[-1].choices[0].finish_reason
    completion = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=10, temperature=0)
    raw = server.client.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0})
    assert completion.choices[0].text == raw.json()["choices"][0]["text"] and completion.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**ask, presence_penalty=0.5)
    assert refused.value.param == "presence_penalty" and refused.value.code == "unsupported_parameter"


def test_client_leaving_mid_stream_leaves_the_server_serving(server):
    body = {
        "messages": [{"role": "user", "content": "A long one."}],
        "max_tokens": 400,
        "temperature": 0,
        "speculative": False,
        "stream": True,
    }
    with server.client.stream("POST", CHAT, json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk; then hang up mid-generation
    assert server.client.get("/health").status_code == 200
    ids = render_chat(server.target.tokenizer, [{"role": "user", "content": "Still fine?"}])
    assert chat(server, "Still fine?")["choices"][0]["message"]["content"] == greedy_text(server.target, ids, 12)[0]


def test_seeded_t1_requests_return_the_same_text_together_alone_and_plain(server):
    """Four seeded T=1 requests sent together each return the text they return alone, and the text
    the same request returns without a draft (``speculative: false``); another seed, another text."""

    def ask(seed: int, **params) -> str:
        reply = chat(server, f"Pick a word, {seed}.", temperature=1.0, seed=seed, max_tokens=24, **params)
        return reply["choices"][0]["message"]["content"]

    seeds = [7, 8, 9, 10]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, seeds))
    alone = [ask(seed) for seed in seeds]
    plain = [ask(seed, speculative=False) for seed in seeds]
    assert together == alone == plain
    assert (
        ask(7)
        != chat(server, "Pick a word, 7.", temperature=1.0, seed=70, max_tokens=24)["choices"][0]["message"]["content"]
    )


def test_stop_sequence_is_trimmed(server):
    full = chat(server, "Go on.", max_tokens=16)["choices"][0]["message"]["content"]
    stop = full[4:6]
    data = chat(server, "Go on.", max_tokens=16, stop=[stop, "never-there"])
    assert data["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] <= chat(server, "Go on.", max_tokens=16)["usage"]["completion_tokens"]


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (path, body, status, param named in the error)
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    (CHAT, {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {**GOOD, "max_tokens": 100000}, 400, "max_tokens"),
    (CHAT, {**GOOD, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {**GOOD, "top_p": 0}, 400, "top_p"),
    (CHAT, {**GOOD, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {**GOOD, "seed": "abc"}, 400, "seed"),
    (CHAT, {**GOOD, "stop": 5}, 400, "stop"),
    (CHAT, {**GOOD, "stop": [""]}, 400, "stop"),
    (CHAT, {**GOOD, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    (CHAT, {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
]


def test_bad_inputs_are_4xx_and_server_stays_up(server):
    """Each bad payload gets an OpenAI-style error naming the field; the server answers normally after."""
    for path, body, status, param in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = server.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert (param or "JSON") in error["message"], error
    assert server.client.get("/health").status_code == 200
    assert chat(server, "still there?")["choices"][0]["message"]["content"] is not None


def test_concurrent_requests_all_correct(server):
    """8 greedy requests from 4 threads: each answer is that prompt's own vanilla output."""
    prompts = [f"Question number {i}?" for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: chat(server, p)["choices"][0]["message"]["content"], prompts))
    for prompt, answer in zip(prompts, answers):
        ids = render_chat(server.target.tokenizer, [{"role": "user", "content": prompt}])
        assert answer == greedy_text(server.target, ids, 12)[0]


def test_bench_serve_and_eval_through_serve(server, tmp_path):
    """The load test and the evaluation both reuse the running endpoint."""
    from pipeline.evaluate.evaluate import run_eval
    from pipeline.evaluate.loadtest import run_bench_serve

    load = run_bench_serve(server.cfg, levels=(1, 2), requests_per_level=2, max_tokens=4)
    assert load["errors"] == 0 and [level["requests"] for level in load["levels"]] == [2, 2, 2, 2]
    assert [(level["mode"], level["concurrency"]) for level in load["levels"]] == [
        ("speculative", 1),
        ("speculative", 2),
        ("vanilla", 1),
        ("vanilla", 2),
    ]
    assert all(level["ttft_p50_s"] <= level["latency_p50_s"] and level["shed_rate"] == 0 for level in load["levels"])
    assert all((server.cfg.run_dir / "eval" / f"serve_load.{ext}").is_file() for ext in ("md", "json", "png"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["Hi.", "More."]}) + "\n")
    cfg = server.cfg.model_copy(
        update={
            "eval": server.cfg.eval.model_copy(
                update={
                    "datasets": [str(questions)],
                    "temperatures": [0.0],
                    "baselines": ["vanilla"],
                    "through_serve": True,
                }
            )
        }
    )
    summary = run_eval(cfg, draft=str(server.draft_dir))
    assert summary["mode"] == "through_serve" and summary["results"]["q/T0"]["mismatches"] == 0
