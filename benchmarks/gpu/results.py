"""One record of a GPU run (benchmarks/gpu/run.sh): OUT/gpu.json and OUT/gpu.md, and each goal met or missed.

Reads what the steps left in OUT: steps.jsonl (each step's rc and seconds), gpu_tests.xml (the
gpu-marked tests), pipeline.log (``griffin run``'s stage times and its report table) and
gpu_decode.json (the decode benchmark). ``--render OUT/gpu.json`` copies a brought-back record to
benchmarks/gpu/gpu.{json,md}.

    python benchmarks/gpu/results.py OUT
    python benchmarks/gpu/results.py --render OUT/gpu.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).parent
STAGE_LINE = re.compile(r"=== \[(\d+)/(\d+)\] ([\w-]+)\s+\(t\+(\d+)s\) ===")


def read_steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_tests(out: Path) -> dict | None:
    path = out / "gpu_tests.xml"
    if not path.exists():
        return None
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def read_pipeline(out: Path) -> dict | None:
    """Each stage's wall seconds (from its start line to the next), the total, the report table."""
    path = out / "pipeline.log"
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    starts = [(m.group(3), int(m.group(4))) for m in STAGE_LINE.finditer(text)]
    finished = re.search(r"finished in (\d+)s", text)
    end = int(finished.group(1)) if finished else None
    ends = [s for _, s in starts[1:]] + [end]
    stages = {name: (stop - start if stop is not None else None) for (name, start), stop in zip(starts, ends)}
    table = [line for line in text.splitlines() if line.startswith("|")]
    return {"completed": finished is not None, "total_s": end, "stage_seconds": stages, "report": table}


def decode_figures(decode: dict) -> dict:
    """The goals' inputs from gpu_decode.json: per (dtype, T, dataset), each method's tokens/s, τ, speedup."""
    figures = {}
    for phase in decode.get("phases", []):
        for key, group in phase["results"].items():
            figures[f"{phase['dtype']} {key}"] = {
                name: {k: entry.get(k) for k in ("tokens_per_s_median", "tau", "speedup_vs_vanilla")}
                for name, entry in group["methods"].items()
            } | {"mismatches": len(group["mismatches"])}
    return figures


def graphs_per_request(decode: dict) -> float | None:
    """CUDA graphs the compiled methods recorded while decoding (after warm-up), per request they decoded."""
    counts = [phase["cuda_graphs"] for phase in decode.get("phases", []) if phase.get("cuda_graphs")]
    requests = sum(c["compiled_requests"] for c in counts)
    return sum(c["recorded_while_decoding"] for c in counts) / requests if requests else None


def read_smoke(out: Path) -> dict | None:
    path = out / "smoke.json"
    return json.loads(path.read_text()) if path.exists() else None


def goals(pipeline: dict | None, figures: dict, smoke: dict | None = None, graphs: float | None = None) -> list[dict]:
    """The issue's goals (H200, SmolLM2-135M-Instruct, batch 1): value, goal and met, or None when unmeasured.
    Every goal is "at least" but the graphs recorded after warm-up: "at most"."""

    def fig(group: str, method: str, key: str):
        return figures.get(group, {}).get(method, {}).get(key)

    vanilla = [fig(f"{d} mt_bench/T0", "vanilla", "tokens_per_s_median") for d in ("bfloat16", "float32")]
    bf16, fp32 = vanilla
    rows = [
        ("vanilla decode tokens/s (compiled, best dtype)", 150.0, max((v for v in vanilla if v), default=None)),
        (
            "GRIFFIN T=0 speedup over compiled vanilla, MT-Bench",
            2.0,
            fig("bfloat16 mt_bench/T0", "griffin", "speedup_vs_vanilla"),
        ),
        ("GRIFFIN T=1 speedup, MT-Bench", 1.5, fig("bfloat16 mt_bench/T1", "griffin", "speedup_vs_vanilla")),
        ("bf16 decode speed vs fp32 (compiled vanilla)", 1.0, bf16 / fp32 if bf16 and fp32 else None),
        ("griffin run through Ray on the GPU completes", 1.0, float(pipeline["completed"]) if pipeline else None),
        ("compile + CUDA-graph smoke test passes", 1.0, float(smoke["ok"]) if smoke else None),
    ]
    out = [
        {"measure": m, "goal": g, "value": v, "met": None if v is None else v >= g, "by": None if v is None else v / g}
        for m, g, v in rows
    ]
    at_most = graphs is not None and graphs <= 0.0
    out.append(
        {"measure": "CUDA graphs recorded per request after warm-up (at most)", "goal": 0.0, "value": graphs}
        | {"met": None if graphs is None else at_most, "by": None}
    )
    return out


def collect(out: Path) -> dict:
    decode_path = out / "gpu_decode.json"
    decode = json.loads(decode_path.read_text()) if decode_path.exists() else {}
    pipeline, smoke = read_pipeline(out), read_smoke(out)
    figures, graphs = decode_figures(decode), graphs_per_request(decode)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": decode.get("device_name") or "device unknown (no decode step)",
        "hardware": decode.get("hardware"),
        "torch": decode.get("torch"),
        "tree": decode.get("tree"),
        "steps": read_steps(out),
        "tests": read_tests(out),
        "pipeline": pipeline,
        "decode": figures,
        "smoke": smoke,
        "cuda_graphs": [phase.get("cuda_graphs") for phase in decode.get("phases", [])],
        "goals": goals(pipeline, figures, smoke, graphs),
    }


def render(record: dict) -> str:
    lines = [
        f"# GPU run, {record['date']}: {record['device']} (torch {record['torch']})",
        "",
        "Written by benchmarks/gpu/run.sh (results.py); the figures themselves are in gpu.json.",
        "",
        "| goal | target | measured | met |",
        "|---|---|---|---|",
    ]
    for g in record["goals"]:
        value = "unmeasured" if g["value"] is None else f"{g['value']:.2f}"
        by = f" ({g['by']:.2f}x of the goal)" if g["by"] is not None else ""
        met = "-" if g["met"] is None else ("met" if g["met"] else "missed") + by
        lines.append(f"| {g['measure']} | {g['goal']:g} | {value} | {met} |")
    lines += ["", "| step | rc | seconds |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['rc']} | {s['seconds']} |" for s in record["steps"]]
    if record["tests"]:
        lines += ["", "gpu-marked tests: " + ", ".join(f"{v} {k}" for k, v in record["tests"].items())]
    if record["pipeline"]:
        p = record["pipeline"]
        stages = ", ".join(f"{name} {s} s" for name, s in p["stage_seconds"].items())
        lines += ["", f"griffin run: {'completed' if p['completed'] else 'did not complete'} ({stages})", ""]
        lines += p["report"]
    if record["decode"]:
        lines += ["", f"Decoding, tree {record['tree']} (median tokens/s; speedup over compiled vanilla):", ""]
        lines += ["| dtype / set | method | tokens/s | τ | speedup |", "|---|---|---|---|---|"]
        for group, methods in record["decode"].items():
            for name, m in methods.items():
                if name == "mismatches":
                    continue
                tau = f"{m['tau']:.2f}" if m.get("tau") else "-"
                speed = f"{m['speedup_vs_vanilla']:.2f}x" if m.get("speedup_vs_vanilla") else "-"
                lines.append(f"| {group} | {name} | {m['tokens_per_s_median']:.1f} | {tau} | {speed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--render", type=Path, help="copy this gpu.json to benchmarks/gpu/gpu.{json,md}")
    args = parser.parse_args()
    if args.render:
        record = json.loads(args.render.read_text())
        (HERE / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")
        (HERE / "gpu.md").write_text(render(record))
        return
    if args.out is None:
        sys.exit("usage: results.py OUT | --render OUT/gpu.json")
    record = collect(args.out)
    (args.out / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "gpu.md").write_text(render(record))
    print(render(record))


if __name__ == "__main__":
    main()
