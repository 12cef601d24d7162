"""Ray Serve: the target + a GRIFFIN draft behind an OpenAI-style HTTP API.

``app_builder({"config": "jobs/configs/tiny.yaml"})`` -> Application (also ``serve run
pipeline.serve:app_builder config=...``); ``start_serve(cfg) -> url`` / ``stop_serve()`` for tests
and jobs; ``run_serve(cfg)`` is ``griffin serve`` (prints the URL, blocks until Ctrl-C).

Endpoints: POST /v1/chat/completions, POST /v1/completions (``stream: true`` = server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``), GET /v1/models, GET /health. Every completion
carries ``usage`` and a ``speculative`` block (rounds = target verification passes, accepted draft
tokens, acceptance length tau = sum(accepted + 1) / rounds). Extension: ``"speculative": false``
decodes without the draft, for A/B comparisons through the endpoint. Bad input -> HTTP 4xx with an
OpenAI error body naming the field; the replica keeps serving.

Decoding is batch 1: a replica decodes one request at a time under a lock, in a worker thread, so the
event loop stays free for /health and queued requests; scale with replicas or autoscaling. Streams are
live: the decode's per-round ``on_tokens`` callback detokenizes in the worker and hands text deltas to
the event loop, which sends each as a chunk at once; a stop sequence or a client that goes away ends
the decode at its next round.
"""


import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from griffin.config import SamplingConfig
from griffin.decode import (GenerationResult, GenerationStats, TokenCallback, speculative_generate,
                            vanilla_generate)
from pipeline.config import RunConfig, config_from_dict, load_config
from pipeline.openai_api import (ApiError, ChatRequest, CompletionRequest, SamplingRequest, TextStream,
                                 completion_text, parse_request, render_chat, speculative_block, sse_stream,
                                 stop_sequences)

logger = logging.getLogger("ray.serve")
APP_NAME = "griffin"
api = FastAPI(title="GRIFFIN speculative decoding")


def served_model_name(cfg: RunConfig) -> str:
    return cfg.serve.model_name or cfg.target_slug


# ---- streaming: the decode in a worker thread, its rounds as server-sent events ----
class _StopDecoding(Exception):
    """Raised from the per-round callback to end a decode early; the worker catches it."""


def _result_from_rounds(rounds: list[list[int]]) -> GenerationResult:
    """A decode stopped early returns nothing: rebuild its result from the callbacks (the first is the
    prefill's token, each later one a round: its accepted draft tokens + 1; a vanilla round is 1 token)."""
    stats = GenerationStats(rounds=len(rounds) - 1, accepted_per_round=[len(r) - 1 for r in rounds[1:]])
    return GenerationResult([t for r in rounds for t in r], stats, "stop")


async def stream_rounds(run: Callable[[TokenCallback], GenerationResult], text: TextStream,
                        max_new: int) -> AsyncIterator[str | GenerationResult]:
    """Runs ``run(on_tokens)`` (the decode) in a worker thread; yields each round's text delta as soon
    as it is committed, then the GenerationResult. The decode ends early once ``text`` has met a stop
    sequence or this iterator is closed (the client went away), so the lock is not held for nothing."""
    loop, queue, closed, rounds = asyncio.get_running_loop(), asyncio.Queue(), threading.Event(), []

    def post(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def on_tokens(tokens: list[int]) -> None:  # in the worker: detokenizing here keeps the loop free
        rounds.append(tokens)
        delta = text.push(tokens)
        if delta:
            post(delta)
        ending = len(text.tokens) >= max_new or tokens[-1] in text.stop_ids  # its last call anyway
        if (text.stopped or closed.is_set()) and not ending:  # a finished decode keeps its exact stats
            raise _StopDecoding

    def work() -> None:
        try:
            outcome = run(on_tokens)
        except _StopDecoding:
            outcome = _result_from_rounds(rounds)
        except BaseException as error:  # re-raised in the event loop, where the stream reports it
            outcome = error
        post(outcome)

    loop.run_in_executor(None, work)
    try:
        while isinstance(item := await queue.get(), str):
            yield item
    finally:
        closed.set()  # early only when the consumer stopped listening: end the decode at its next round
    if isinstance(item, BaseException):
        raise item
    yield item


# ---- the deployment ----
@serve.deployment
@serve.ingress(api)
class SpeculativeDecoder:
    """One replica: the target and (when ``serve.draft_uri`` is set) a draft, one request at a time."""

    def __init__(self, run_config: dict[str, Any]):
        from pipeline.resources import load_draft, load_target

        cfg = config_from_dict(run_config)
        self.target = load_target(cfg.target, decoding=True)
        self.draft_uri = cfg.serve.draft_uri
        self.draft = load_draft(self.draft_uri, self.target, cfg) if self.draft_uri else None
        self.model_id, self.tree = served_model_name(cfg), cfg.decode.tree
        self.default_max_tokens = cfg.serve.default_max_tokens
        self.lock = threading.Lock()  # the model and its caches serve one decode at a time
        self.created = int(time.time())
        logger.info("serving %s with %s", self.model_id, f"draft {self.draft_uri}" if self.draft else "no draft")

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok", "model": self.model_id}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "griffin",
                "target": self.target.name, "draft": self.draft_uri, "speculative": self.draft is not None,
                "decoding": "griffin speculative" if self.draft is not None else "vanilla (no draft configured)",
                "tree": self.tree.model_dump(), "max_context": self.target.max_context}
        return {"object": "list", "data": [card]}

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, ChatRequest)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, CompletionRequest)

    async def _complete(self, request: Request, schema: type[SamplingRequest]):
        try:
            req = parse_request(await request.body(), schema)
            stops = stop_sequences(req.stop)
            prompt_ids, max_new = self._prepare(req)
            chat = isinstance(req, ChatRequest)
            head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                    "model": self.model_id}
            tail = functools.partial(self._tail, len(prompt_ids), self._uses_draft(req))
            if req.stream:
                run = functools.partial(self._generate, req, prompt_ids, max_new)
                text = TextStream(self.target.tokenizer, self.target.stop_token_ids, stops)
                events = sse_stream(stream_rounds(run, text, max_new), text, head, chat, tail)
                return StreamingResponse(events, media_type="text/event-stream")
            result = await asyncio.to_thread(self._generate, req, prompt_ids, max_new)
        except ApiError as error:
            return error.response()
        except Exception as error:  # a bug, not the client's fault: say so and keep serving
            logger.exception("generation failed")
            return ApiError(f"internal error: {error}", status=500, kind="server_error").response()
        text, n_tokens, hit_stop = completion_text(self.target.tokenizer, result.tokens,
                                                   self.target.stop_token_ids, stops)
        finish, extra = tail(result, n_tokens, hit_stop)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice], **extra}

    def _prepare(self, req: SamplingRequest) -> tuple[list[int], int]:
        """The prompt's token ids and the token budget, checked against the context window."""
        if req.model is not None and req.model != self.model_id:
            raise ApiError(f"model {req.model!r} does not exist; this server serves {self.model_id!r} "
                           "(see GET /v1/models)", "model", status=404, code="model_not_found")
        tokenizer, field = self.target.tokenizer, "messages" if isinstance(req, ChatRequest) else "prompt"
        try:
            ids = (render_chat(tokenizer, [m.as_dict() for m in req.messages]) if isinstance(req, ChatRequest)
                   else tokenizer(req.prompt)["input_ids"])
        except Exception as error:  # a template may refuse e.g. a system message: the client's input
            raise ApiError(f"'{field}' could not be rendered with the chat template: {error}", field) from None
        context = self.target.max_context
        if not ids or len(ids) >= context:
            raise ApiError(f"'{field}' is {len(ids)} tokens; it must be 1 to {context - 1} tokens "
                           f"(the context window is {context})", field)
        room = context - len(ids)
        if req.max_tokens is None:
            return ids, min(self.default_max_tokens, room)
        if req.max_tokens > room:
            raise ApiError(f"'max_tokens'={req.max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                           f"context window of {context}; use at most {room}", "max_tokens")
        return ids, req.max_tokens

    def _uses_draft(self, req: SamplingRequest) -> bool:
        return self.draft is not None and req.speculative

    def _generate(self, req: SamplingRequest, prompt_ids: list[int], max_new: int,
                  on_tokens: TokenCallback | None = None) -> GenerationResult:
        """The decode (blocking: run it in a worker thread); ``on_tokens`` gets each round's tokens."""
        # a temperature this small overflows logits / T; it means greedy (vLLM's cut-off too)
        temperature = req.temperature if req.temperature >= 1e-5 else 0.0
        sampling = SamplingConfig(temperature=temperature, top_p=req.top_p, top_k=req.top_k)
        device = self.target.device
        generator = None if req.seed is None else torch.Generator(device=device).manual_seed(req.seed)
        input_ids = torch.tensor([prompt_ids], device=device)  # (1, T)
        with self.lock:
            if self._uses_draft(req):
                return speculative_generate(self.target, self.draft, input_ids, self.tree, sampling, max_new,
                                            generator, on_tokens=on_tokens)
            return vanilla_generate(self.target, input_ids, sampling, max_new, generator, on_tokens=on_tokens)

    def _tail(self, prompt_tokens: int, used_draft: bool, result: GenerationResult, n_tokens: int,
              hit_stop: bool) -> tuple[str, dict[str, Any]]:
        """finish_reason, and the usage + speculative fields every response (or last chunk) ends with."""
        finish = "stop" if hit_stop or result.finish_reason == "stop" else "length"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                 "total_tokens": prompt_tokens + n_tokens}
        return finish, {"usage": usage, "speculative": speculative_block(result, used_draft, self.tree)}


# ---- building and running the application ----
class ServeArgs(BaseModel):
    """``app_builder`` arguments: a config file (+ ``section.field=value`` overrides) or a config dict."""

    model_config = ConfigDict(extra="forbid")
    config: str | None = None
    overrides: list[str] | str = Field(default_factory=list, description="a list, or one space-separated string")
    run_config: dict[str, Any] | None = None

    def load(self) -> RunConfig:
        if (self.config is None) == (self.run_config is None):
            raise ValueError("app_builder needs exactly one of 'config' (a YAML path) or 'run_config' (a dict)")
        if self.run_config is not None:
            return config_from_dict(self.run_config)
        overrides = self.overrides.split() if isinstance(self.overrides, str) else self.overrides
        return load_config(self.config, overrides)


def _portable(cfg: RunConfig) -> dict[str, Any]:
    """The config with local paths made absolute: replicas may start in another working directory."""
    data = cfg.resolved()
    data["output_dir"] = str(Path(cfg.output_dir).resolve())
    for section, key in (("serve", "draft_uri"), ("target", "name")):
        value = data[section][key]
        if value and Path(value).exists():
            data[section][key] = str(Path(value).resolve())
    return data


def app_builder(args: dict[str, Any] | ServeArgs) -> Application:
    """The Serve application for a run config: one ``SpeculativeDecoder`` deployment (loads nothing here)."""
    cfg = (args if isinstance(args, ServeArgs) else ServeArgs(**args)).load()
    section = cfg.serve
    scaling = ({"autoscaling_config": section.autoscaling} if section.autoscaling
               else {"num_replicas": section.num_replicas})
    return SpeculativeDecoder.options(
        max_ongoing_requests=section.max_ongoing_requests,
        ray_actor_options={"num_cpus": section.num_cpus, "num_gpus": section.num_gpus}, **scaling,
    ).bind(_portable(cfg))


def serve_url(cfg: RunConfig) -> str:
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    return f"http://{host}:{cfg.serve.port}"


def start_serve(cfg: RunConfig) -> str:
    """Start (or update) the application on the configured Ray; returns its base URL once ready."""
    from pipeline.runtime import ensure_ray

    ensure_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(app_builder(ServeArgs(run_config=cfg.resolved())), name=APP_NAME, route_prefix="/")
    return serve_url(cfg)


def stop_serve() -> None:
    serve.shutdown()


def is_serving(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def ensure_serving(cfg: RunConfig) -> tuple[str, bool]:
    """The endpoint's URL, starting Serve when nothing answers there; True when this call started it."""
    url = serve_url(cfg)
    return (url, False) if is_serving(url) else (start_serve(cfg), True)


def run_serve(cfg: RunConfig) -> None:
    """``griffin serve``: start, print the URL, block until Ctrl-C, shut Serve down."""
    url = start_serve(cfg)
    what = f"draft {cfg.serve.draft_uri}" if cfg.serve.draft_uri else "vanilla decoding (no serve.draft_uri)"
    print(f"serving {served_model_name(cfg)} with {what} at {url}/v1 (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop_serve()
