"""The Serve endpoint on a real local Ray (127.0.0.1, a free port) with the tiny target and a random draft."""

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from griffin.config import SamplingConfig
from griffin.decode import vanilla_generate
from griffin.model import GriffinDraft
from griffin.weights import save_draft
from pipeline.config import load_config
from pipeline.openai_api import completion_text, render_chat, text_pieces
from pipeline.targets import load_target

TINY = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "tiny.yaml"
CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray

    from pipeline.serve import start_serve, stop_serve

    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    tmp = tmp_path_factory.mktemp("serve")
    target = load_target(load_config(TINY, [f"output_dir={tmp}"]).target)
    torch.manual_seed(0)
    draft_dir = save_draft(GriffinDraft.for_target(target), tmp / "draft")
    cfg = load_config(TINY, [f"output_dir={tmp}", f"serve.draft_uri={draft_dir}", f"serve.port={free_port()}",
                             "cluster.num_cpus=2", "serve.max_ongoing_requests=8"])
    url = start_serve(cfg)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield SimpleNamespace(client=client, cfg=cfg, target=target, draft_dir=draft_dir)
    finally:
        stop_serve()
        ray.shutdown()


def test_app_builder_loads_nothing(tmp_path):
    """Building the application only reads the config: the model loads in the replica."""
    from ray.serve import Application

    from pipeline.serve import ServeArgs, app_builder

    app = app_builder({"config": str(TINY), "overrides": f"output_dir={tmp_path} serve.num_replicas=2"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="exactly one of"):
        app_builder(ServeArgs())


def test_stop_trimming_and_pieces_without_server():
    """Stop sequences cut the text and count only the tokens that produced it; pieces rebuild the text."""
    from pipeline.targets import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokens = tokenizer("héllo wörld. more")["input_ids"] + [tokenizer.eos_token_id]
    text, used, hit = completion_text(tokenizer, tokens, [tokenizer.eos_token_id], [". m", "zzz"])
    assert (text, hit) == ("héllo wörld", True) and used == len(tokenizer("héllo wörld. m")["input_ids"])
    assert completion_text(tokenizer, tokens, [tokenizer.eos_token_id], [])[:2] == ("héllo wörld. more", len(tokens))
    pieces = list(text_pieces(tokenizer, tokens, "héllo wörld. more"))
    assert "".join(pieces) == "héllo wörld. more" and all("\ufffd" not in p for p in pieces)


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
    assert models[0]["draft"] == str(server.draft_dir)
    assert server.client.get("/health").json()["status"] == "ok"


def test_chat_greedy_equals_vanilla(server):
    """T=0 through the endpoint is the target's own greedy output; usage and the speculative block add up."""
    data = chat(server, "Tell me a story.")
    text, n_tokens = greedy_text(server.target, render_chat(server.target.tokenizer,
                                                            [{"role": "user", "content": "Tell me a story."}]), 12)
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["content"] == text
    usage, spec = data["usage"], data["speculative"]
    assert usage["completion_tokens"] == n_tokens and usage["total_tokens"] == usage["prompt_tokens"] + n_tokens
    assert spec["enabled"] and spec["rounds"] >= 1 and spec["acceptance_length"] >= 1.0
    assert spec["accepted_tokens"] == sum(spec["accepted_per_round"])
    assert data["choices"][0]["finish_reason"] in ("stop", "length")


def test_completion_greedy_equals_vanilla(server):
    response = server.client.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 10,
                                                           "temperature": 0})
    data = response.json()
    ids = server.target.tokenizer("def add(a, b):")["input_ids"]
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == greedy_text(server.target, ids, 10)[0]


def events(server, path, body):
    with server.client.stream("POST", path, json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streaming_matches_non_streaming(server):
    body = {"messages": [{"role": "user", "content": "Stream please."}], "max_tokens": 12, "temperature": 0}
    chunks = events(server, CHAT, {**body, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == chat(server, "Stream please.")["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in chunks[-1]
    text_chunks = events(server, "/v1/completions", {"prompt": "abc", "max_tokens": 6, "stream": True})
    assert text_chunks[-1]["speculative"]["rounds"] >= 1 and text_chunks[0]["object"] == "text_completion"


def test_seed_reproducible_at_t1(server):
    first, again, other = (chat(server, "Pick a word.", temperature=1.0, seed=s) for s in (7, 7, 8))
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert first["choices"][0]["message"]["content"] != other["choices"][0]["message"]["content"]


def test_stop_sequence_is_trimmed(server):
    full = chat(server, "Go on.", max_tokens=16)["choices"][0]["message"]["content"]
    stop = full[4:6]
    data = chat(server, "Go on.", max_tokens=16, stop=[stop, "never-there"])
    assert data["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] <= chat(server, "Go on.", max_tokens=16)["usage"]["completion_tokens"]


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (path, body, status, param named in the error)
    (CHAT, b"{not json", 400, None), (CHAT, b"[1, 2]", 400, None), (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"), (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    (CHAT, {**GOOD, "max_tokens": 0}, 400, "max_tokens"), (CHAT, {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {**GOOD, "max_tokens": 100000}, 400, "max_tokens"),
    (CHAT, {**GOOD, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {**GOOD, "top_p": 0}, 400, "top_p"), (CHAT, {**GOOD, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {**GOOD, "seed": "abc"}, 400, "seed"), (CHAT, {**GOOD, "stop": 5}, 400, "stop"),
    (CHAT, {**GOOD, "stop": [""]}, 400, "stop"), (CHAT, {**GOOD, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    (CHAT, {**GOOD, "model": "gpt-4"}, 404, "model"), ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"), ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
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
    from pipeline.evaluate import run_eval
    from pipeline.loadtest import run_bench_serve

    load = run_bench_serve(server.cfg, levels=(1, 2), requests_per_level=2, max_tokens=4)
    assert load["errors"] == 0 and [level["requests"] for level in load["levels"]] == [2, 2]
    assert (server.cfg.run_dir / "eval" / "serve_load.md").is_file()
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["Hi.", "More."]}) + "\n")
    cfg = server.cfg.model_copy(update={"eval": server.cfg.eval.model_copy(update={
        "datasets": [str(questions)], "temperatures": [0.0], "baselines": ["vanilla"], "through_serve": True})})
    summary = run_eval(cfg, draft=str(server.draft_dir))
    assert summary["mode"] == "through_serve" and summary["results"]["q/T0"]["mismatches"] == 0
