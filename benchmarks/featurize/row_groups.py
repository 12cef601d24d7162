"""What a row group a row costs a feature store part, against the 64 MiB row groups written before.

A store part is written a row group a row (``pipeline.data.store.write_part``) so that a resumed training
stream reads only the rows it has not trained on (``pipeline.train.inputs.read_part``). For three row
sizes (a tiny target's, SmolLM2-135M's at 300 tokens, an 8B target's at 512 tokens), one part of random
features is written both ways; then, interleaved ``--repeats`` times from the page cache: a whole read of
the columns training reads (a read task's), a read of the sample ids (the driver's, at a stage start),
and a resume's read of the part with a third of its rows trained on (the bytes it reads counted).
Writes benchmarks/featurize/row_groups.json and row_groups.md.

    .venv/bin/python benchmarks/featurize/row_groups.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.data import part_files  # noqa: E402
from pipeline.data import store as st  # noqa: E402
from pipeline.train.inputs import BASE_COLUMNS, read_part  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZES = {  # rows, tokens a row, hidden size
    "tiny target (H 64, 100 tokens)": (2048, 100, 64),
    "SmolLM2-135M (H 576, 300 tokens)": (256, 300, 576),
    "8B target (H 4096, 512 tokens)": (32, 512, 4096),
}


def part(rows: int, tokens: int, hidden: int) -> pa.Table:
    noise = np.random.default_rng(0)
    return st.part_table(
        {
            "sample_id": [f"s{i:08d}" for i in range(rows)],
            "input_ids": [np.arange(tokens, dtype=np.int32)] * rows,
            "loss_mask": [np.ones(tokens, np.uint8)] * rows,
            "hidden": [noise.bytes(tokens * hidden * 2) for _ in range(rows)],
        },
        "bf16",
        hidden,
    )


def write_before(table: pa.Table, path: Path) -> None:
    """The part as write_part wrote it before: row groups of up to 64 MiB."""
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    compression = {k: v for k, v in st._COMPRESSION.items() if k.split(".")[0] in table.column_names}
    pq.write_table(
        table,
        path,
        compression=compression,
        use_dictionary=["sample_id"],
        write_statistics=["sample_id", "seq_len"],
        row_group_size=max(1, (64 << 20) // row_bytes),
    )


class Counted(pafs.LocalFileSystem):
    """A local filesystem that counts the bytes read through it."""

    read = 0

    def open_input_file(self, path):
        source = open(path, "rb")
        original = source.read

        def counted(*args):
            data = original(*args)
            Counted.read += len(data)
            return data

        source.read = counted
        return pa.PythonFile(source, mode="r")


def resume_read(path: Path, rows: int) -> int:
    """Bytes ``read_part`` reads of a part whose first third of stream rows were trained on."""
    item = {
        "stream_epoch": [0],
        "stream_part": [0],
        "stream_from": [rows // 3],
        "stream_count": [rows],
        "stream_skip": [""],
    }
    Counted.read = 0
    read_part(item, [str(path)], list(BASE_COLUMNS), [], 0)
    return Counted.read


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(repeats: int) -> list[dict]:
    part_files.location_fs = lambda location: (Counted(), location)  # read_part's filesystem, counted
    folder = Path(tempfile.mkdtemp())
    results = []
    for name, (rows, tokens, hidden) in SIZES.items():
        table = part(rows, tokens, hidden)
        now, before = folder / "now", folder / f"before-{rows}.parquet"
        st.write_part(str(now), f"part-{rows}.parquet", table)
        write_before(table, before)
        paths = {"a row group a row": now / f"part-{rows}.parquet", "64 MiB row groups (before)": before}
        times: dict[str, dict[str, list[float]]] = {k: {"read": [], "ids": []} for k in paths}
        for _ in range(repeats):  # interleaved: the machine's load hits both layouts alike
            for layout, path in paths.items():
                times[layout]["read"].append(timed(lambda: pq.read_table(path, columns=list(BASE_COLUMNS))))
                times[layout]["ids"].append(timed(lambda: pq.read_table(path, columns=["sample_id"])))
        for layout, path in paths.items():
            meta = pq.ParquetFile(path).metadata
            results.append(
                {
                    "rows": name,
                    "layout": layout,
                    "row_bytes": table.nbytes // rows,
                    "row_groups": meta.num_row_groups,
                    "file_bytes": path.stat().st_size,
                    "footer_bytes": meta.serialized_size,
                    "read_s": statistics.median(times[layout]["read"]),
                    "ids_s": statistics.median(times[layout]["ids"]),
                    "resume_bytes": resume_read(path, rows),
                    "resume_needed_bytes": sum(
                        meta.row_group(g).column(c).total_compressed_size
                        for g in range(meta.num_row_groups)
                        for c in range(meta.num_columns)
                    )
                    * (rows - rows // 3)
                    // rows,
                }
            )
    return results


def write(results: list[dict], repeats: int) -> None:
    cpu = [
        line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
    ]
    machine = f"{cpu[0] if cpu else platform.machine()}, {len(os.sched_getaffinity(0))} threads"
    out = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "command": f"python benchmarks/featurize/row_groups.py --repeats {repeats}",
        "results": results,
    }
    (HERE / "row_groups.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "# A row group a row: what it costs a feature store part",
        "",
        f"{out['date']}, {machine}; `{out['command']}`. Medians of interleaved reads from the page cache. "
        "A resume's read: a third of the part's stream rows trained on (`read_part`, bytes read from the file), "
        "against two thirds of the part's row data (what it needs).",
        "",
        "| rows | layout | row groups | file bytes | footer bytes | read s | sample ids s | resume reads | of which needed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['layout']} | {r['row_groups']} | {r['file_bytes']:,} | {r['footer_bytes']:,} "
            f"| {r['read_s']:.4f} | {r['ids_s']:.4f} | {r['resume_bytes']:,} | {r['resume_needed_bytes']:,} |"
        )
    (HERE / "row_groups.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    write(measure(args.repeats), args.repeats)
    print((HERE / "row_groups.md").read_text())


if __name__ == "__main__":
    main()
