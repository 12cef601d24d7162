"""The reports of ``griffin bench-serve`` (``pipeline.evaluate.loadtest``): ``serve_load.json`` (the
result and the resolved config), ``serve_load.md`` (one table row per mode and concurrency) and
``serve_load.png`` (latency, time to first token, tokens/s and shed rate against concurrency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.files import atomic_write_json, atomic_write_text

PANELS = (
    ("latency", "latency, s (p50 solid, p95 dashed)"),
    ("ttft", "time to first token, s (p50 solid, p95 dashed)"),
    ("tokens_per_s", "completion tokens/s, all clients"),
    ("shed_rate", "shed rate (refused after retries)"),
)


def write_reports(out_dir: Path, result: dict[str, Any], config: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "serve_load.json", {**result, "config": config})
    atomic_write_text(out_dir / "serve_load.md", markdown(result))
    plot(result, out_dir / "serve_load.png")


def _cell(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Serve load test: {result['url']} ({result.get('date', 'undated')})",
        "",
        f"Model {result.get('model')!r}; {result['max_tokens']} max tokens per request, greedy, streamed. "
        "Latency and TTFT (first text chunk) are client-side wall times from the first attempt, "
        "Retry-After waits included; tokens/s is all clients' completion tokens over the level's wall "
        "time; shed = still refused (503/429) after its retries.",
        "",
        "| mode | concurrency | requests | retries | shed rate | errors | requests/s | tokens/s | p50 s | p95 s | "
        "TTFT p50 s | TTFT p95 s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for level in result["levels"]:
        lines.append(
            f"| {level['mode']} | {level['concurrency']} | {level['requests']} | {level.get('retries', 0)} | "
            f"{level['shed_rate']:.0%} | {level['errors']} | {level['requests_per_s']:.2f} | "
            f"{level['tokens_per_s']:.1f} | {_cell(level['latency_p50_s'])} | {_cell(level['latency_p95_s'])} | "
            f"{_cell(level['ttft_p50_s'])} | {_cell(level['ttft_p95_s'])} |"
        )
    return "\n".join(lines) + "\n"


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[str, list[float], str]]:
    """(column suffix, values, line style) for a panel: p50 and p95 for the time panels."""
    if key in ("latency", "ttft"):
        return [(q, [r[f"{key}_{q}_s"] or 0.0 for r in rows], style) for q, style in (("p50", "-"), ("p95", "--"))]
    return [("", [r[key] or 0.0 for r in rows], "-")]


def plot(result: dict[str, Any], path: Path) -> Path:
    """One panel per PANELS entry, one line per mode (two for p50/p95), concurrency on a log2 axis."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    levels = result["levels"]
    modes = list(dict.fromkeys(level["mode"] for level in levels))
    colour = dict(zip(modes, colormaps["tab10"].colors))
    concurrencies = sorted({level["concurrency"] for level in levels})
    figure = Figure(figsize=(14, 3.4), layout="constrained")
    figure.suptitle(f"{result.get('model') or result['url']}: {result['max_tokens']} tokens a request", fontsize=10)
    for axes, (key, title) in zip(figure.subplots(1, len(PANELS)), PANELS):
        for mode in modes:
            rows = [level for level in levels if level["mode"] == mode]
            for suffix, values, style in _series(rows, key):
                label = mode if suffix in ("", "p50") else None
                xs = [r["concurrency"] for r in rows]
                axes.plot(xs, values, style, marker="o", color=colour[mode], label=label)
        axes.set_title(title, fontsize=9)
        axes.set_ylim(bottom=0)  # ratios between modes read true only from zero
        axes.set_xlabel("concurrent clients")
        if len(concurrencies) > 1:
            axes.set_xscale("log", base=2)
        axes.set_xticks(concurrencies, labels=[str(c) for c in concurrencies])
    figure.legend(*figure.axes[0].get_legend_handles_labels(), loc="outside right center")
    figure.savefig(path, dpi=110)
    return path
