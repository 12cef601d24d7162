"""``griffin bench-serve``: a load test of an OpenAI-style endpoint.

For each decoding mode and each concurrency level (default 1, 2, 4, 8, 16) it sends a bounded number
of streamed chat requests (greedy, fixed max_tokens, prompts from the first eval dataset) from that
many client threads, stopping early when the level's time budget runs out. Modes: against this
project's server (its model card says ``speculative``), "speculative" with the served draft and
"vanilla" through the same endpoint via ``"speculative": false``; against any other server one
mode, "served", with no extension fields.

A 503 or 429 is the server refusing for capacity: the client waits its Retry-After (seconds or an
HTTP date; 1 s when absent) and sends again, up to ``max_retries`` times, counting the retries. A
request still refused after that is "shed", not an error. Latency and time to first token (the first
chunk with text) run from the request's first attempt, waits included: what a client sees.

Per level: aggregate completion tokens/s, requests/s, p50/p95 latency and TTFT, retries, shed and
errors (anything else but 200, or an error chunk; any error fails the command after the report is
written). Without ``url`` it targets ``serve.port`` on this machine, starting Serve when nothing
answers there and stopping it after. Writes ``<run_dir>/eval/serve_load.json`` (with the resolved
config), ``serve_load.md`` and ``serve_load.png`` (``pipeline.evaluate.loadtest_report``).
"""

from __future__ import annotations

import email.utils
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import RunConfig
from pipeline.evaluate.loadtest_report import write_reports

LEVELS = (1, 2, 4, 8, 16)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::")
SHED = (429, 503)
MODES = ("speculative", "vanilla")  # this project's server; any other gets ("served",)
DEFAULT_RETRY_S = 1.0  # a refusal without a usable Retry-After (e.g. a proxy's plain 503)
MAX_RETRY_S = 60.0  # a longer Retry-After is waited this long at most


def _prompts(cfg: RunConfig, count: int) -> list[str]:
    from pipeline.resources.questions import load_questions

    try:
        questions = load_questions(cfg.eval.datasets[0], count)
        return [q["turns"][0] for q in questions]
    except (FileNotFoundError, IndexError):  # no question file here: the load test still needs prompts
        return [f"Write a short note about the number {i}." for i in range(count)]


def retry_after_s(value: str | None) -> float:
    """A Retry-After header in seconds: delay-seconds or an HTTP date; DEFAULT_RETRY_S when absent or
    unreadable, at most MAX_RETRY_S."""
    if not value:
        return DEFAULT_RETRY_S
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return DEFAULT_RETRY_S
    return min(max(seconds, 0.0), MAX_RETRY_S)


def _attempt(client: Any, url: str, body: dict[str, Any], start: float, outcome: dict[str, Any]) -> str | None:
    """One streamed POST, filling ``outcome``; returns the Retry-After header of a refusal."""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        outcome["status"] = response.status_code
        if response.status_code != 200:
            response.read()
            outcome["error"] = f"HTTP {response.status_code}: {response.text[:200]}"
            return response.headers.get("retry-after")
        outcome["error"] = None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                outcome["error"] = f"in-stream error: {chunk['error'].get('message', chunk['error'])!s:.200}"
            elif chunk.get("usage"):
                outcome["tokens"] = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                outcome["chunks"] += 1  # the token count when the server sends no usage
                if outcome["ttft"] is None:
                    outcome["ttft"] = time.perf_counter() - start
    return None


def call(target: dict[str, Any], body: dict[str, Any], deadline: float) -> dict[str, Any]:
    """One streamed request, retried after Retry-After while refused for capacity (until
    ``max_retries`` or ``deadline``): status, latency, TTFT, completion tokens (usage, else content
    chunks), retries, error text."""
    import httpx

    start, url, max_retries = time.perf_counter(), target["url"], target["max_retries"]
    outcome: dict[str, Any] = {"status": None, "ttft": None, "tokens": None, "chunks": 0, "retries": 0, "error": None}
    with httpx.Client(timeout=target["budget_s"], headers=target["headers"]) as client:
        while True:
            try:
                retry_after = _attempt(client, url, body, start, outcome)
            except httpx.HTTPError as error:
                outcome["error"] = f"{type(error).__name__}: {error}"
                break
            if outcome["status"] not in SHED or outcome["retries"] >= max_retries:
                break
            wait = retry_after_s(retry_after)
            if time.perf_counter() + wait > deadline:
                break  # the level's time is up: it stays refused
            time.sleep(wait)
            outcome["retries"] += 1
    outcome["latency"] = time.perf_counter() - start
    if outcome["tokens"] is None:
        outcome["tokens"] = outcome["chunks"]
    if outcome["ttft"] is None:  # no text chunk (e.g. only whitespace): the first token came with the end
        outcome["ttft"] = outcome["latency"]
    return outcome


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _summary(results: list[dict | None], wall: float) -> dict[str, Any]:
    done = [r for r in results if r is not None]
    ok = [r for r in done if r["status"] == 200 and r["error"] is None]
    shed = [r for r in done if r["status"] in SHED]
    errors = [r for r in done if r not in ok and r not in shed]
    latencies, ttfts = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    return {
        "requests": len(done),
        "skipped_for_time": len(results) - len(done),
        "ok": len(ok),
        "retries": sum(r["retries"] for r in done),
        "retried_requests": sum(r["retries"] > 0 for r in done),
        "shed": len(shed),
        "shed_rate": len(shed) / len(done) if done else 0.0,
        "errors": len(errors),
        "error_examples": sorted({r["error"] for r in errors})[:3],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "latency_p50_s": _percentile(latencies, 50),
        "latency_p95_s": _percentile(latencies, 95),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p95_s": _percentile(ttfts, 95),
    }


def one_level(target: dict[str, Any], prompts: list[str], concurrency: int, requests: int, mode: str) -> dict:
    """``requests`` streamed requests from ``concurrency`` threads; ``target``: url, headers, model,
    max_tokens, budget_s, max_retries."""
    deadline = time.perf_counter() + target["budget_s"]
    extension = {} if mode == "served" else {"speculative": mode == "speculative"}

    def send(i: int) -> dict[str, Any] | None:
        if time.perf_counter() > deadline:
            return None  # skipped for time
        body = {
            "model": target["model"],
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": target["max_tokens"],
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extension,
        }
        return call(target, body, deadline)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, range(requests)))
    return {"mode": mode, "concurrency": concurrency, **_summary(results, time.perf_counter() - start)}


def _served(url: str, headers: dict[str, str], model: str | None) -> tuple[str | None, tuple[str, ...]]:
    """The model to ask for (the first listed unless named) and the modes this server offers."""
    import httpx

    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    cards = response.json().get("data") or [{}]
    card = next((c for c in cards if c.get("id") == model), cards[0])
    if "speculative" not in card:  # not this project's server: no extension fields
        return model or card.get("id"), ("served",)
    return model or card.get("id"), MODES if card["speculative"] else ("vanilla",)


def base_url(url: str) -> str:
    """``http://host:port``, ``.../`` or ``.../v1`` (what OpenAI clients take) -> the server's root."""
    return url.rstrip("/").removesuffix("/v1")


def run_bench_serve(
    cfg: RunConfig,
    levels: tuple[int, ...] = LEVELS,
    requests_per_level: int | None = None,
    max_tokens: int | None = None,
    budget_s: float = 120.0,
    modes: tuple[str, ...] | None = None,
    url: str | None = None,
    api_key: str | None = None,
    model: str | None = None,
    max_retries: int = 5,
) -> dict[str, Any]:
    """Load-test ``url`` (default: this machine's ``serve.port``, started when nothing answers) in
    each of ``modes`` the server offers (default all); ``requests_per_level`` defaults to
    2 x concurrency (at least 4). ``api_key`` (default: the key of ``serve.api_key_env``'s variable,
    when set) goes as ``Authorization: Bearer``."""
    from pipeline.serve.auth import client_headers
    from pipeline.serve.lifecycle import ensure_serving, stop_serve

    if url is None and cfg.serve.host not in LOCAL_HOSTS:
        raise ValueError(f"without --url bench-serve targets this machine; serve.host is {cfg.serve.host!r}")
    if not levels or min(levels) < 1:
        raise ValueError(f"bench-serve concurrency levels must be positive integers, got {levels}")
    unknown = set(modes or ()) - {*MODES, "served"}
    if unknown:
        raise ValueError(f"bench-serve modes must be among {(*MODES, 'served')}, got {sorted(unknown)}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else client_headers(cfg.serve)
    url, started = (base_url(url), False) if url else ensure_serving(cfg)
    try:
        model, offered = _served(url, headers, model)
        target = {
            "url": url,
            "headers": headers,
            "model": model,
            "max_tokens": max_tokens or min(cfg.serve.default_max_tokens, 64),
            "budget_s": budget_s,
            "max_retries": max_retries,
        }
        prompts = _prompts(cfg, 8)
        runs = [
            one_level(target, prompts, c, requests_per_level or max(4, 2 * c), mode)
            for mode in offered
            if modes is None or mode in modes
            for c in levels
        ]
    finally:
        if started:
            stop_serve()
    return _report(cfg, url, model, target["max_tokens"], runs)


def _report(cfg: RunConfig, url: str, model: str | None, max_tokens: int, runs: list[dict]) -> dict[str, Any]:
    result = {
        "url": url,
        "model": model,
        "max_tokens": max_tokens,
        "date": time.strftime("%Y-%m-%d"),
        "levels": runs,
        "errors": sum(r["errors"] for r in runs),
        "shed": sum(r["shed"] for r in runs),
        "retries": sum(r["retries"] for r in runs),
    }
    out_dir = Path(cfg.run_dir) / "eval"
    write_reports(out_dir, result, cfg.resolved())
    if result["errors"]:
        raise RuntimeError(
            f"bench-serve: {result['errors']} requests failed against {url}; see {out_dir / 'serve_load.json'}"
        )
    return result
