"""``griffin bench-serve``: a small load test of the Serve endpoint on 127.0.0.1.

For each concurrency level (1, 2, 4, 8) it sends a bounded number of chat requests (greedy, fixed
max_tokens, prompts from the first eval dataset) from that many client threads, stopping early when
the level's time budget runs out, and measures requests/s, completion tokens/s, p50/p95 latency and
errors (anything but HTTP 200; any error fails the command after the report is written). Starts Serve
when nothing answers on ``serve.port`` and stops it after. Writes ``<run_dir>/eval/serve_load.json``
(with the resolved config) and ``serve_load.md``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import RunConfig

LEVELS = (1, 2, 4, 8)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::")


def _prompts(cfg: RunConfig, count: int) -> list[str]:
    from pipeline.resources import load_questions

    try:
        questions = load_questions(cfg.eval.datasets[0], count)
        return [q["turns"][0] for q in questions]
    except (FileNotFoundError, IndexError):  # no question file here: the load test still needs prompts
        return [f"Write a short note about the number {i}." for i in range(count)]


def _one_level(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
               budget_s: float) -> dict[str, Any]:
    import httpx

    deadline = time.perf_counter() + budget_s

    def call(i: int) -> tuple[float, int, str | None]:
        if time.perf_counter() > deadline:
            return 0.0, 0, "skipped"
        body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": max_tokens,
                "temperature": 0.0}
        start = time.perf_counter()
        try:
            with httpx.Client(timeout=budget_s) as client:
                response = client.post(f"{url}/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            return time.perf_counter() - start, 0, f"{type(error).__name__}: {error}"
        if response.status_code != 200:
            return time.perf_counter() - start, 0, f"HTTP {response.status_code}: {response.text[:200]}"
        return time.perf_counter() - start, response.json()["usage"]["completion_tokens"], None

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(call, range(requests)))
    wall = time.perf_counter() - start
    done = [r for r in results if r[2] != "skipped"]
    ok = [r for r in done if r[2] is None]
    latencies = [r[0] for r in ok]
    return {
        "concurrency": concurrency, "requests": len(done), "skipped_for_time": len(results) - len(done),
        "errors": len(done) - len(ok), "error_examples": sorted({r[2] for r in done if r[2]})[:3],
        "wall_s": wall, "requests_per_s": len(ok) / wall, "tokens_per_s": sum(r[1] for r in ok) / wall,
        "latency_p50_s": float(np.percentile(latencies, 50)) if latencies else None,
        "latency_p95_s": float(np.percentile(latencies, 95)) if latencies else None,
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# Serve load test: {result['url']}", "",
             f"{result['max_tokens']} max tokens per request, greedy; latency = client-side wall time per request.",
             "", "| concurrency | requests | errors | requests/s | tokens/s | p50 s | p95 s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for level in result["levels"]:
        p50, p95 = (f"{level[k]:.3f}" if level[k] is not None else "-" for k in ("latency_p50_s", "latency_p95_s"))
        lines.append(f"| {level['concurrency']} | {level['requests']} | {level['errors']} | "
                     f"{level['requests_per_s']:.2f} | {level['tokens_per_s']:.1f} | {p50} | {p95} |")
    return "\n".join(lines) + "\n"


def run_bench_serve(cfg: RunConfig, levels: tuple[int, ...] = LEVELS, requests_per_level: int | None = None,
                    max_tokens: int | None = None, budget_s: float = 120.0) -> dict[str, Any]:
    """Load-test the endpoint; ``requests_per_level`` defaults to 2 x concurrency (at least 4)."""
    from pipeline.serve import ensure_serving, stop_serve

    if cfg.serve.host not in LOCAL_HOSTS:
        raise ValueError(f"bench-serve only targets 127.0.0.1; serve.host is {cfg.serve.host!r}")
    max_tokens = max_tokens or min(cfg.serve.default_max_tokens, 64)
    url, started = ensure_serving(cfg)
    try:
        prompts = _prompts(cfg, 8)
        runs = [_one_level(url, prompts, c, requests_per_level or max(4, 2 * c), max_tokens, budget_s)
                for c in levels]
    finally:
        if started:
            stop_serve()
    result = {"url": url, "max_tokens": max_tokens, "levels": runs, "errors": sum(r["errors"] for r in runs)}
    out_dir = Path(cfg.run_dir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve_load.json").write_text(json.dumps({**result, "config": cfg.resolved()}, indent=2))
    (out_dir / "serve_load.md").write_text(_markdown(result))
    if result["errors"]:
        raise RuntimeError(f"bench-serve: {result['errors']} requests failed against {url}; "
                           f"see {out_dir / 'serve_load.json'}")
    return result
