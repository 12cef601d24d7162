"""The request fields of OpenAI's API (and vLLM's extensions) that this server does not implement.

Ignoring such a field would return an answer the client did not ask for (no penalty applied, one
choice instead of n, free text instead of JSON), so ``pipeline.serve.protocol.refuse_unsupported``
answers 400 naming it. Each field has neutral values, the ones that change nothing: those are
accepted, since clients such as LangChain send ``presence_penalty: 0``, ``n: 1`` and the like with
every request. A neutral value matches in type as well (``False`` is not the penalty 0).

Fields in neither this table nor the schemas (``user``, ``metadata``, ``store``, ``service_tier``,
``parallel_tool_calls`` ...) do not change the text and are ignored, as OpenAI clients expect.
"""

from __future__ import annotations

import json
from typing import Any

_PENALTY = "penalties would change the target's distribution, and decoding here samples it exactly"
_STRUCTURED = "structured output (JSON mode, json_schema, guided decoding) is not supported"

# field -> (neutral values, accepted and ignored; why anything else is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenAI
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "response_format": (({"type": "text"},), _STRUCTURED),
    "logit_bias": (({},), "logit biases are not supported"),
    "presence_penalty": ((0, 0.0), _PENALTY),
    "frequency_penalty": ((0, 0.0), _PENALTY),
    "n": ((1,), "one choice is decoded per request; send n requests (with different seeds) instead"),
    "best_of": ((1,), "one completion is decoded per request; send separate requests instead"),
    "echo": ((False,), "echoing the prompt is not supported"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "only text output is supported"),
    # vLLM's sampling extensions
    "repetition_penalty": ((1, 1.0), _PENALTY),
    "min_p": ((0, 0.0), "min-p sampling is not supported; use top_p or top_k"),
    "typical_p": ((1, 1.0), "typical sampling is not supported; use top_p or top_k"),
    "min_tokens": ((0,), "a minimum length is not supported"),
    "ignore_eos": ((False,), "decoding always ends at the model's stop token"),
    "stop_token_ids": (([],), "stop token ids are not supported; use 'stop' with strings"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "beam search (and its length penalty) is not supported"),
    "include_stop_str_in_output": ((False,), "the stop sequence is always cut from the text"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "prompt_logprobs": ((), "log-probabilities of the prompt are not supported"),
    "guided_json": ((), _STRUCTURED),
    "guided_regex": ((), _STRUCTURED),
    "guided_choice": ((), _STRUCTURED),
    "guided_grammar": ((), _STRUCTURED),
}


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """None or one of the neutral values, type included."""
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def unsupported(body: dict[str, Any]) -> tuple[str, str] | None:
    """The first refused field with a non-neutral value, and the message naming it and the fix."""
    for name, (neutral, why) in REFUSED.items():
        if name in body and not is_neutral(body[name], neutral):
            allowed = " or ".join(json.dumps(n) for n in (None, *neutral))
            return name, f"'{name}' is not supported by this server: {why}. Remove it (or send {allowed})"
    return None
