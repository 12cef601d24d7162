"""Resident memory of a decoding process's target: pre-packed with the plain weights kept (before) or
released (``TargetAdapter.prepack``, now).

Each arm runs in its own fresh process, three times alternating, and reads its RSS from
/proc/self/statm after loading SmolLM2-135M-Instruct and again after packing. Writes
benchmarks/decode/packed_memory.{json,md}.

    python benchmarks/decode/packed_memory.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
ARM = """
import gc, json, sys
sys.path.insert(0, {root!r})
from griffin.target import TargetAdapter, prepack_linears
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
target = TargetAdapter.from_pretrained("smollm2-135m-instruct", dtype={dtype!r})
gc.collect()
loaded = rss_mib()
if {arm!r} == "kept":  # every linear packed, every plain weight kept (the packing before this change)
    prepack_linears(target.model)
else:
    target.prepack()
gc.collect()
print(json.dumps({{"loaded_mib": loaded, "packed_mib": rss_mib()}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"kept": [], "released": []}
    for _ in range(3):
        for arm in runs:
            code = ARM.format(root=str(ROOT), dtype=args.dtype, arm=arm)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            runs[arm].append(json.loads(out.strip().splitlines()[-1]))
    summary = {
        arm: {key: median(r[key] for r in rows) for key in ("loaded_mib", "packed_mib")} for arm, rows in runs.items()
    }
    out = Path(__file__).parent
    (out / "packed_memory.json").write_text(
        json.dumps({"dtype": args.dtype, "runs": runs, "median": summary}, indent=2)
    )
    kept, released = summary["kept"]["packed_mib"], summary["released"]["packed_mib"]
    lines = [
        f"SmolLM2-135M-Instruct, {args.dtype}: resident memory (RSS) of a fresh process, median of 3.",
        "",
        "| packed target | RSS after loading, MiB | RSS after packing, MiB |",
        "|---|---|---|",
        f"| plain weights kept (before) | {summary['kept']['loaded_mib']:.0f} | {kept:.0f} |",
        f"| plain weights released, all but the LM head's (now) | {summary['released']['loaded_mib']:.0f} | "
        f"{released:.0f} |",
        "",
        f"Released / kept: {released / kept:.2f} ({kept - released:.0f} MiB less).",
    ]
    (out / "packed_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
