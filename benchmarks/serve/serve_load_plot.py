"""Plot a `griffin bench-serve` result: latency and throughput against concurrency, speculative and
vanilla through the same endpoint. The figures themselves come from

    .venv/bin/griffin bench-serve -c jobs/configs/smollm2-quick.yaml serve.draft_uri=drafts/smollm2-135m-instruct/griffin
    cp outputs/smollm2-quick/eval/serve_load.{json,md} benchmarks/serve/
    .venv/bin/python benchmarks/serve/serve_load_plot.py benchmarks/serve/serve_load.json

and this writes serve_load.png beside the JSON (bench-serve now writes the same plot itself; this
redraws a result file, older ones included).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.evaluate.loadtest_report import plot as plot_result  # noqa: E402


def plot(result_path: Path) -> Path:
    return plot_result(json.loads(result_path.read_text()), result_path.with_suffix(".png"))


if __name__ == "__main__":
    print(plot(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/serve/serve_load.json")))
