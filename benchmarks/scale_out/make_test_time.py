"""What `make test` costs on a fresh clone: reads the log of ``time make test`` (run in an empty folder
after ``git clone``) and writes benchmarks/scale_out/make_test.json, which restart_cost.py reports
against the goal (12 minutes on 2 cores).

    (time make test) > make_test.log 2>&1; python benchmarks/scale_out/make_test_time.py make_test.log --commit REV
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from pathlib import Path

from restart_cost import cpu_name

HERE = Path(__file__).resolve().parent


def parse(log: str) -> dict:
    """The suite's outcome counts, pytest's seconds, the wall clock of the whole command (set-up, lint,
    suite) and the slowest tests, from the log's last summary line and `time`'s ``real``."""
    summary = [line for line in log.splitlines() if re.search(r"\d+ passed.* in [\d.]+s", line)][-1]
    counts = {kind.rstrip("s"): int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    minutes, seconds = re.search(r"^real\s+(\d+)m([\d.]+)s", log, re.M).groups()
    slowest = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)", log, re.M)
    return {
        "counts": counts,
        "pytest_s": float(re.search(r" in ([\d.]+)s", summary).group(1)),
        "wall_s": round(int(minutes) * 60 + float(seconds), 1),
        "workers": int(m.group(1)) if (m := re.search(r" -n (\d+) ", log)) else 1,
        "slowest": [{"s": float(s), "phase": phase, "test": test} for s, phase, test in slowest[:15]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the output of `time make test`")
    parser.add_argument("--commit", required=True, help="the commit the clone was at")
    args = parser.parse_args()
    result = {
        "date": datetime.date.fromtimestamp(Path(args.log).stat().st_mtime).isoformat(),  # the run's day
        "machine": f"{cpu_name()}, {os.cpu_count()} threads",
        "commit": args.commit,
        "command": "git clone ... && time make test",
        **parse(Path(args.log).read_text()),
    }
    (HERE / "make_test.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("counts", "pytest_s", "wall_s")}))


if __name__ == "__main__":
    main()
