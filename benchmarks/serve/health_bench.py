"""Benchmark: /health latency while the endpoint is busy (goal: p99 < 100 ms).

Serves SmolLM2 with the shipped GRIFFIN draft (``jobs/configs/smollm2-quick.yaml``, or ``--config``),
then polls GET /health every 50 ms in three phases of ``--seconds`` each:
- idle: nothing else running;
- streams: ``--streams`` long streamed completions in flight (re-sent as each finishes);
- streams + a body a second: the same, plus a client sending a 48 MB body, then pausing 1 s (each gets 413);
- streams + bodies back to back: the same with no pause (~10 bodies a second: 480 MB/s through Serve's proxy).
Latency is client-side wall time of the whole request over a kept-alive connection, as a load
balancer's probe sees it. Writes benchmarks/serve/health.json and benchmarks/serve/health.md.

    .venv/bin/python benchmarks/serve/health_bench.py [--seconds 30] [--streams 6] [draft URI overrides...]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.config import load_config  # noqa: E402
from pipeline.serve.lifecycle import start_serve, stop_serve  # noqa: E402

OUT = Path(__file__).parent
ROOT = Path(__file__).resolve().parents[2]
BODY_BYTES = 48 << 20


def poll(url: str, seconds: float) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as client:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(max(0.0, 0.05 - (time.perf_counter() - start)))
    return latencies


def stream_forever(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "max_tokens": 256,
        "temperature": 0.0,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=300) as client:
        while not stop.is_set():
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break
            counts[str(response.status_code)] = counts.get(str(response.status_code), 0) + 1


def upload_forever(url: str, stop: threading.Event, counts: dict[str, int], pause_s: float) -> None:
    blob = b'{"messages": [{"role": "user", "content": "' + b"x" * BODY_BYTES + b'"}]}'
    with httpx.Client(base_url=url, timeout=300) as client:
        while not stop.is_set():
            try:
                status = client.post(
                    "/v1/chat/completions", content=blob, headers={"Content-Type": "application/json"}
                ).status_code
            except httpx.HTTPError as error:  # the server may close the connection after its 413
                status = type(error).__name__
            counts[f"upload {status}"] = counts.get(f"upload {status}", 0) + 1
            stop.wait(pause_s)


def phase(url: str, seconds: float, streams: int, upload_pause_s: float | None) -> dict:
    stop, counts = threading.Event(), {}
    workers = [threading.Thread(target=stream_forever, args=(url, stop, counts)) for _ in range(streams)]
    if upload_pause_s is not None:
        workers.append(threading.Thread(target=upload_forever, args=(url, stop, counts, upload_pause_s)))
    for worker in workers:
        worker.start()
    time.sleep(3.0 if workers else 0.0)  # let the load build up
    latencies = poll(url, seconds)
    stop.set()
    for worker in workers:
        worker.join()
    ms = np.asarray(latencies) * 1e3
    return {
        "streams": streams,
        "upload_pause_s": upload_pause_s,
        "samples": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "responses": counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "jobs" / "configs" / "smollm2-quick.yaml"))
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(
        args.config,
        [
            "serve.draft_uri=drafts/smollm2-135m-instruct/griffin",
            "serve.port=8431",
            f"serve.max_ongoing_requests={args.streams + 2}",
            *args.overrides,
        ],
    )
    url = start_serve(cfg)
    try:
        rows = [
            phase(url, args.seconds, 0, None),
            phase(url, args.seconds, args.streams, None),
            phase(url, args.seconds, args.streams, 1.0),
            phase(url, args.seconds, args.streams, 0.0),
        ]
    finally:
        stop_serve()
    result = {"config": args.config, "draft": cfg.serve.draft_uri, "seconds_per_phase": args.seconds, "rows": rows}
    (OUT / "health.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# /health latency under load ({Path(args.config).name}, draft {cfg.serve.draft_uri})",
        "",
        f"GET /health every 50 ms for {args.seconds:.0f} s per phase; client-side wall time.",
        "",
        "| in flight | probes | p50 ms | p99 ms | max ms | other responses |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        bodies = {None: "", 1.0: " + a 48 MB body a second", 0.0: " + 48 MB bodies back to back"}
        load = "nothing" if not row["streams"] else f"{row['streams']} long streams" + bodies[row["upload_pause_s"]]
        lines.append(
            f"| {load} | {row['samples']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['max_ms']:.1f} | "
            f"{row['responses']} |"
        )
    (OUT / "health.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
