"""The wire protocol without a server: request fields the server does not implement (400 unless
neutral), and the event stream's framing: where usage goes (OpenAI's ``include_usage``), and a
failure after the 200 ends with an error chunk and [DONE]."""

import asyncio
import json

import pytest

from griffin.results import GenerationResult, GenerationStats
from pipeline.resources.targets import tiny_tokenizer
from pipeline.serve.fields import REFUSED
from pipeline.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse_request
from pipeline.serve.sse import SSE_DONE, TextStream, sse_stream

HEAD = {"id": "chatcmpl-test", "created": 0, "model": "tiny"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def parse(body, schema=ChatRequest):
    return parse_request(json.dumps(body).encode(), schema)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unimplemented_fields_are_refused_unless_neutral(field):
    """Every refused field: its neutral values (and null) pass, anything else is a 400 naming the
    field and the fix; a neutral value must match in type (true is not the penalty 1)."""
    neutral, _ = REFUSED[field]
    for value in (None, *neutral):
        parse({**CHAT, field: value})
        parse({"prompt": "hi", field: value}, CompletionRequest)
    for value in ("surprise", 7, True, [{"x": 1}]):
        if any(type(value) is type(n) and value == n for n in neutral):
            continue
        with pytest.raises(ApiError) as refused:
            parse({**CHAT, field: value})
        error = refused.value.body()["error"]
        assert error["param"] == field and error["code"] == "unsupported_parameter", error
        assert f"'{field}' is not supported" in error["message"] and "Remove it" in error["message"]


def test_neutral_spellings_clients_send():
    request = parse({**CHAT, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "top_k": -1, "min_p": 0})
    assert request.top_k == 0  # vLLM's -1 is this decode's "no top-k"
    assert parse({**CHAT, "user": "u1", "metadata": {"a": "b"}, "store": False}).messages  # harmless: ignored
    with pytest.raises(ApiError, match="'n' is not supported.*send n requests"):
        parse({**CHAT, "n": 3})


def tail(result, n_tokens, hit):
    usage = {"prompt_tokens": 3, "completion_tokens": n_tokens, "total_tokens": 3 + n_tokens}
    return ("stop" if hit else result.finish_reason), {"usage": usage, "speculative": {"rounds": 1}}


async def decode(text, words, fail_at=None):
    """A decode stand-in: pushes each word's tokens and yields the deltas, then the result."""
    for i, word in enumerate(words):
        if i == fail_at:
            raise RuntimeError("the decode broke")
        delta = text.push(tiny_tokenizer()(word)["input_ids"])
        if delta:
            yield delta
    yield GenerationResult(list(text.tokens), GenerationStats(rounds=1, accepted_per_round=[0]), "length")


def run(words, chat=True, include_usage=False, fail_at=None, tail=tail):
    text = TextStream(tiny_tokenizer(), [tiny_tokenizer().eos_token_id], [])

    async def collect():
        events = sse_stream(decode(text, words, fail_at), text, HEAD, chat, tail, include_usage=include_usage)
        return [e async for e in events]

    events = [e + "\n\n" for e in "".join(asyncio.run(collect())).split("\n\n") if e]  # one per event
    assert events[-1] == SSE_DONE  # every stream ends with [DONE], failed or not
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.parametrize("chat", [True, False])
def test_usage_rides_only_on_the_include_usage_chunk(chat):
    plain = run(["Hello", " there", " world"], chat)
    assert all("usage" not in c for c in plain)  # OpenAI: no usage unless asked
    assert plain[-1]["choices"][0]["finish_reason"] == "length" and plain[-1]["speculative"] == {"rounds": 1}

    chunks = run(["Hello", " there", " world"], chat, include_usage=True)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert "speculative" not in chunks[-1] and chunks[-2]["speculative"] == {"rounds": 1}
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == len(plain) + 1


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_failure_mid_stream_is_an_error_chunk_then_done(include_usage):
    chunks = run(["Hello", " there", " world"], fail_at=2, include_usage=include_usage)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[1]["choices"][0]["delta"]["content"]
    error = chunks[-1]["error"]  # a 500 names a request id, never the exception's text
    assert error["type"] == "server_error" and error["status"] == 500 and "request id" in error["message"]
    assert "the decode broke" not in error["message"]
    assert all("error" not in c and c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_failure_while_finishing_is_reported_too():
    def broken_tail(result, n_tokens, hit):
        raise ValueError("no tail")

    chunks = run(["Hello"], tail=broken_tail)
    assert chunks[-1]["error"]["code"] == "internal_error" and "no tail" not in chunks[-1]["error"]["message"]


def test_a_request_beyond_the_context_cap_is_a_400_naming_it():
    """A prompt, or a prompt and max_tokens, beyond the context (decode.max_context when it is smaller
    than the target's): 400 with the limit and the setting named, and what would fit."""
    from pipeline.serve.protocol import prompt_and_budget

    tokenizer = tiny_tokenizer()
    long = parse_request(json.dumps({"prompt": "x" * 80}).encode(), CompletionRequest)
    with pytest.raises(ApiError) as refused:
        prompt_and_budget(long, tokenizer, "tiny", 64, 16)
    assert refused.value.status == 400 and "context window is 64: decode.max_context" in str(refused.value)
    short = parse_request(json.dumps({"prompt": "x" * 10, "max_tokens": 60}).encode(), CompletionRequest)
    with pytest.raises(ApiError, match=r"exceeds the context window of 64 \(decode.max_context.*use at most 54"):
        prompt_and_budget(short, tokenizer, "tiny", 64, 16)
