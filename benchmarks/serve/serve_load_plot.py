"""Plot a `griffin bench-serve` result: latency and throughput against concurrency, speculative and
vanilla through the same endpoint. The figures themselves come from

    .venv/bin/griffin bench-serve -c jobs/configs/smollm2-quick.yaml serve.draft_uri=drafts/smollm2-135m-instruct/griffin
    cp outputs/smollm2-quick/eval/serve_load.{json,md} benchmarks/serve/
    .venv/bin/python benchmarks/serve/serve_load_plot.py benchmarks/serve/serve_load.json

and this writes serve_load.png beside the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PANELS = (
    ("latency_p50_s", "p50 latency, s"),
    ("ttft_p50_s", "p50 time to first token, s"),
    ("tokens_per_s", "completion tokens/s"),
    ("shed_rate", "shed rate (503 + Retry-After)"),
)


def plot(result_path: Path) -> Path:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    levels = json.loads(result_path.read_text())["levels"]
    modes = sorted({level["mode"] for level in levels})  # speculative, vanilla
    colour = dict(zip(modes, colormaps["tab10"].colors))
    figure = Figure(figsize=(13, 3.2), layout="constrained")
    for axes, (key, title) in zip(figure.subplots(1, len(PANELS)), PANELS):
        for mode in modes:
            rows = [level for level in levels if level["mode"] == mode]
            axes.plot(
                [r["concurrency"] for r in rows],
                [r[key] or 0.0 for r in rows],
                marker="o",
                color=colour[mode],
                label=mode,
            )
        axes.set_title(title, fontsize=9)
        axes.set_xlabel("concurrent clients")
        axes.set_xscale("log", base=2)
        axes.set_xticks(
            [r["concurrency"] for r in levels[: len(levels) // len(modes)]],
            labels=[str(r["concurrency"]) for r in levels[: len(levels) // len(modes)]],
        )
    figure.legend(*figure.axes[0].get_legend_handles_labels(), loc="outside right center")
    out = result_path.with_suffix(".png")
    figure.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/serve/serve_load.json")))
