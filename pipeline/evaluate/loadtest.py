"""``griffin bench-serve``: a small load test of the Serve endpoint on 127.0.0.1.

For each decoding mode (speculative with the served draft, and vanilla through the same endpoint via
``"speculative": false``) and each concurrency level (1, 2, 4, 8) it sends a bounded number of
streamed chat requests (greedy, fixed max_tokens, prompts from the first eval dataset) from that many
client threads, stopping early when the level's time budget runs out. Per level: p50/p95 latency,
p50/p95 time to first token (the first chunk with text; queueing and prefill included), requests/s,
completion tokens/s, the shed rate (503/429 answers: the server refused for capacity, with a
Retry-After; expected under overload, not an error) and errors (anything else but 200; any error
fails the command after the report is written). Starts Serve when nothing answers on
``serve.port`` and stops it after. Writes ``<run_dir>/eval/serve_load.json`` (with the resolved
config) and ``serve_load.md``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import RunConfig
from pipeline.files import atomic_write_json, atomic_write_text

LEVELS = (1, 2, 4, 8)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::")


def _prompts(cfg: RunConfig, count: int) -> list[str]:
    from pipeline.resources.questions import load_questions

    try:
        questions = load_questions(cfg.eval.datasets[0], count)
        return [q["turns"][0] for q in questions]
    except (FileNotFoundError, IndexError):  # no question file here: the load test still needs prompts
        return [f"Write a short note about the number {i}." for i in range(count)]


SHED = (429, 503)
MODES = ("speculative", "vanilla")


def _call(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One streamed request: status, latency, time to first token, completion tokens, error text."""
    import httpx

    start = time.perf_counter()
    outcome: dict[str, Any] = {"status": None, "latency": None, "ttft": None, "tokens": 0, "error": None}
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
        ):
            outcome["status"] = response.status_code
            if response.status_code != 200:
                response.read()
                outcome["error"] = f"HTTP {response.status_code}: {response.text[:200]}"
                return outcome
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    outcome["error"] = f"in-stream error: {chunk['error']['message'][:200]}"
                elif chunk.get("usage"):
                    outcome["tokens"] = chunk["usage"]["completion_tokens"]
                elif outcome["ttft"] is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    outcome["ttft"] = time.perf_counter() - start
    except httpx.HTTPError as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["latency"] = time.perf_counter() - start
    if outcome["ttft"] is None:  # no text chunk (e.g. only whitespace): the first token came with the end
        outcome["ttft"] = outcome["latency"]
    return outcome


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _one_level(
    url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int, budget_s: float, speculative: bool
) -> dict[str, Any]:
    deadline = time.perf_counter() + budget_s

    def call(i: int) -> dict[str, Any] | None:
        if time.perf_counter() > deadline:
            return None  # skipped for time
        body = {
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "speculative": speculative,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return _call(url, body, budget_s)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(call, range(requests)))
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    ok = [r for r in done if r["status"] == 200 and r["error"] is None]
    shed = [r for r in done if r["status"] in SHED]
    errors = [r for r in done if r not in ok and r not in shed]
    latencies, ttfts = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    return {
        "mode": "speculative" if speculative else "vanilla",
        "concurrency": concurrency,
        "requests": len(done),
        "skipped_for_time": len(results) - len(done),
        "ok": len(ok),
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


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Serve load test: {result['url']}",
        "",
        f"{result['max_tokens']} max tokens per request, greedy, streamed; latency and TTFT (first text "
        "chunk) are client-side wall times; shed = refused for capacity (503/429 + Retry-After).",
        "",
        "| mode | concurrency | requests | shed rate | errors | requests/s | tokens/s | p50 s | p95 s | "
        "TTFT p50 s | TTFT p95 s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else "-"

    for level in result["levels"]:
        lines.append(
            f"| {level['mode']} | {level['concurrency']} | {level['requests']} | {level['shed_rate']:.0%} | "
            f"{level['errors']} | {level['requests_per_s']:.2f} | {level['tokens_per_s']:.1f} | "
            f"{cell(level['latency_p50_s'])} | {cell(level['latency_p95_s'])} | "
            f"{cell(level['ttft_p50_s'])} | {cell(level['ttft_p95_s'])} |"
        )
    return "\n".join(lines) + "\n"


def run_bench_serve(
    cfg: RunConfig,
    levels: tuple[int, ...] = LEVELS,
    requests_per_level: int | None = None,
    max_tokens: int | None = None,
    budget_s: float = 120.0,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    """Load-test the endpoint in each of ``modes`` ("speculative" needs a served draft: skipped
    without one); ``requests_per_level`` defaults to 2 x concurrency (at least 4)."""
    import httpx

    from pipeline.serve.lifecycle import ensure_serving, stop_serve

    if cfg.serve.host not in LOCAL_HOSTS:
        raise ValueError(f"bench-serve only targets 127.0.0.1; serve.host is {cfg.serve.host!r}")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"bench-serve modes must be among {MODES}, got {sorted(unknown)}")
    max_tokens = max_tokens or min(cfg.serve.default_max_tokens, 64)
    url, started = ensure_serving(cfg)
    try:
        has_draft = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["speculative"]
        prompts = _prompts(cfg, 8)
        runs = [
            _one_level(
                url, prompts, c, requests_per_level or max(4, 2 * c), max_tokens, budget_s, mode == "speculative"
            )
            for mode in modes
            if mode == "vanilla" or has_draft
            for c in levels
        ]
    finally:
        if started:
            stop_serve()
    result = {
        "url": url,
        "max_tokens": max_tokens,
        "levels": runs,
        "errors": sum(r["errors"] for r in runs),
        "shed": sum(r["shed"] for r in runs),
    }
    out_dir = Path(cfg.run_dir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "serve_load.json", {**result, "config": cfg.resolved()})
    atomic_write_text(out_dir / "serve_load.md", _markdown(result))
    if result["errors"]:
        raise RuntimeError(
            f"bench-serve: {result['errors']} requests failed against {url}; see {out_dir / 'serve_load.json'}"
        )
    return result
