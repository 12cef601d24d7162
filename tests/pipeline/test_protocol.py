"""The wire protocol without a server: request fields the server does not implement (400 unless
neutral)."""

import json

import pytest

from pipeline.serve.fields import REFUSED
from pipeline.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse_request

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
