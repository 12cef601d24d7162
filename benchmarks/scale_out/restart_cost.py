"""What a training worker and the driver read of the target, against loading the whole target.

A Ray Train worker borrows the target's embedding and LM head (and ``draft.init_layer``'s layer): it
reads them by name from the weight files (``pipeline.resources.targets.load_target_parts``), where it
used to load the whole target and drop it. On SmolLM2-135M-Instruct (the shipped asset, the dtype of
``smollm2-quick.yaml`` on the CPU), interleaved in one process: the parts alone, the parts with
``draft.init_layer: -1``, and the whole target (``load_target``), each timed ``--repeats`` times.

Writes benchmarks/scale_out/restart_cost.json (and its table in restart_cost.md), with a training
stage's measures read from benchmarks/training/epoch_start.json and stage_restarts.json (run those
first).

    python benchmarks/scale_out/restart_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = "jobs/configs/smollm2-quick.yaml"


def measure(repeats: int) -> dict:
    import gc

    from pipeline.config import load_config
    from pipeline.resources.targets import load_target, load_target_parts

    section = load_config(CONFIG).target
    runs = {
        "parts": lambda: load_target_parts(section),
        "parts_with_layer": lambda: load_target_parts(section, layer=-1),
        "whole_target": lambda: load_target(section, device="cpu"),
    }
    seconds = {name: [] for name in runs}
    kept = {}
    for _ in range(repeats):  # interleaved: each round times every way once
        for name, run in runs.items():
            start = time.perf_counter()
            kept[name] = run()
            seconds[name].append(time.perf_counter() - start)
            gc.collect()
    parts, with_layer, whole = kept["parts"], kept["parts_with_layer"], kept["whole_target"]
    embed_head = parts.embed_weight.nbytes + (
        0 if parts.head_weight is parts.embed_weight else parts.head_weight.nbytes
    )
    return {
        "target": section.name,
        "dtype": str(parts.dtype).removeprefix("torch."),
        "tied_head": parts.head_weight is parts.embed_weight,
        "embed_head_bytes": embed_head,
        "target_bytes_per_worker": parts.bytes_read,
        "target_bytes_per_worker_with_init_layer": with_layer.bytes_read,
        "whole_target_file_bytes": parts.file_bytes,
        "whole_target_bytes_in_memory": sum(t.nbytes for t in whole.model.state_dict().values()),
        "median_s": {name: round(statistics.median(s), 3) for name, s in seconds.items()},
        "repeats": repeats,
    }


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def driver_reads() -> dict:
    """What a training driver reads of the target's weight files to name it and check stores and
    drafts (``pipeline.resources.identity``): the first time on a machine (the files are hashed once)
    and after (the digests are kept); counted by an audit hook on every file the process opens."""
    import os
    import sys
    import tempfile

    from griffin import target_files
    from pipeline.config import load_config
    from pipeline.resources.identity import target_fingerprint, target_identity

    opened: list[str] = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)
    section = load_config(CONFIG).target
    reads = {}
    target_identity(section)  # the asset is prepared once per machine, before anything is counted
    with tempfile.TemporaryDirectory() as cache:
        target_files.digest_cache = lambda: Path(cache)  # no digest known yet: the first time on a machine
        for when in ("first_time", "after"):
            opened.clear()
            target_fingerprint(target_identity(section))
            weights = {f for f in opened if f.endswith(WEIGHT_SUFFIXES)}
            reads[when] = {"weight_files_opened": len(weights), "bytes": sum(os.path.getsize(f) for f in weights)}
    return reads


def eval_reads(out: str) -> dict:
    """The bytes of part files the held-out dataset reads per stage start (``stored_eval``), against
    the held-out rows' share of the store, on a tiny-target store featurized here (``data.limit=96``)."""
    import os

    from pipeline.config import load_config
    from pipeline.data.featurize import run_featurize
    from pipeline.data.heldout import held_out_ids, heldout_parts, store_part_ids
    from pipeline.runtime import ensure_ray

    cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={out}", "data.limit=96"])
    ensure_ray(cfg)
    run_featurize(cfg)
    parts = store_part_ids(cfg.store_path)
    eval_ids = held_out_ids([i for ids in parts.values() for i in ids], cfg.train.eval_fraction)
    held, _ = heldout_parts(parts, eval_ids)
    size = {f: os.path.getsize(f) for f in parts}
    share = {f: sum(i in eval_ids for i in ids) / len(ids) for f, ids in parts.items()}
    return {
        "store_bytes": sum(size.values()),
        "eval_bytes_per_stage": sum(size[f] for f in held),
        "heldout_bytes": round(sum(size[f] * share[f] for f in parts)),
        "rows": sum(len(ids) for ids in parts.values()),
        "heldout_rows": len(eval_ids),
        "parts": len(parts),
        "heldout_parts": len(held),
        "eval_fraction": cfg.train.eval_fraction,
    }


def stage_measures() -> dict:
    """The measures a training stage shows, taken from the benchmarks that run one: epoch starts
    (benchmarks/training/epoch_start.json) and a stage's target loads, steps lost to a killed worker
    and what its resume read again (stage_restarts.json); run those first."""
    from statistics import median

    epochs = json.loads((HERE.parent / "training" / "epoch_start.json").read_text())
    stages = json.loads((HERE / "stage_restarts.json").read_text())
    later = [s for run in epochs["runs"]["one execution, files"] for s in run["epoch_start_s"][1:]]
    before = [s for run in epochs["runs"]["execution per epoch, files"] for s in run["epoch_start_s"][1:]]
    clean, killed = stages["undisturbed"], stages["worker_killed"]
    held_out = clean["pool_size"]  # the held-out rows' pool, once a run
    return {
        "epoch_start_s": median(later),
        "epoch_start_s_one_execution_per_epoch": median(before),
        "online_target_loads_per_stage": (clean["target_loads"] - held_out) / clean["stages"],
        "online_target_loads": clean["target_loads"],
        "online_stages": clean["stages"],
        "pool_size": clean["pool_size"],
        "online_epochs_read": clean["stage1_epochs_read"],
        "online_target_loads_with_a_killed_worker": killed["target_loads"],
        "steps_lost_on_kill": killed["steps_lost"],
        "killed_after_step": killed["killed"]["after_step"],
        "resumed_from_step": killed["resume"]["from_step"],
        "checkpoint_every": killed["checkpoint_every"],
        "resume": killed["resume"],
        "dates": {"epoch_start": epochs.get("date"), "stage_restarts": stages["date"]},
    }


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
    return names[0] if names else platform.processor()


def make_test() -> dict:
    """The last fresh-clone `make test` (make_test.json, written by make_test_time.py)."""
    return json.loads((HERE / "make_test.json").read_text())


MAKE_TEST_GOAL_S = 720  # `make test` on a fresh clone, 2 cores: 12 minutes


def _make_test_line(run: dict) -> str:
    counts = ", ".join(f"{n} {kind}" for kind, n in run["counts"].items())
    minutes = run["wall_s"] / 60
    verdict = (
        "met" if run["wall_s"] <= MAKE_TEST_GOAL_S else f"missed by {(run['wall_s'] - MAKE_TEST_GOAL_S) / 60:.1f} min"
    )
    return (
        f"`make test` on a fresh clone ({run['date']}, {run['machine']}, commit {run['commit']}, "
        f"{run['workers']} pytest-xdist workers): **{minutes:.1f} min** with set-up and lint, pytest "
        f"{run['pytest_s']:.0f} s, {counts} (goal <= 12 min, **{verdict}**; make_test.json lists the slowest tests)."
    )


def write(result: dict) -> None:
    measured = result["measured"]
    ratio = measured["target_bytes_per_worker"] / measured["embed_head_bytes"]
    driver, evals, stage = measured["driver_target_bytes"], measured["eval_reads"], result["stage"]
    eval_ratio = evals["eval_bytes_per_stage"] / evals["heldout_bytes"]
    result["goals"] = {
        "eval_bytes_per_stage <= 1.1 x heldout_bytes": {"met": eval_ratio <= 1.1, "ratio": round(eval_ratio, 4)},
        "target_bytes_per_worker <= 1.1 x embed_head_bytes": {"met": ratio <= 1.1, "ratio": round(ratio, 4)},
        "driver_target_bytes == 0": {"met": driver["after"]["bytes"] == 0, "value": driver},
        "epoch_start_s <= 1 after the first": {"met": stage["epoch_start_s"] <= 1.0, "value": stage["epoch_start_s"]},
        "online_target_loads_per_stage == pool_size": {
            "met": stage["online_target_loads_per_stage"] == stage["pool_size"],
            "value": stage["online_target_loads_per_stage"],
        },
        "make_test_s <= 720 (2 cores)": {
            "met": result["make_test"]["wall_s"] <= MAKE_TEST_GOAL_S,
            "value": result["make_test"]["wall_s"],
        },
        "resume_reread_bytes == 0": {
            "met": stage["resume"]["bytes_read_again"] == 0,
            "value": f"{stage['resume']['bytes_read_again']} bytes of trained rows read again by the ranks; "
            f"{stage['resume']['rows_left_unread']} rows left unread (the resume part's rows before its row, "
            "and the rows each rank skips)",
        },
    }
    (HERE / "restart_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    m = measured
    lines = [
        "# What a training worker reads of the target",
        "",
        f"{result['date']}, {result['machine']}; `{result['command']}`. Times are medians of interleaved "
        "rounds; the files were in the page cache.",
        "",
        "| | bytes | median s |",
        "|---|---:|---:|",
        f"| embedding + head ({'tied' if m['tied_head'] else 'untied'}, {m['dtype']}) | {m['embed_head_bytes']:,} | |",
        f"| a worker reads: the parts | {m['target_bytes_per_worker']:,} | {m['median_s']['parts']} |",
        f"| ... with `draft.init_layer` | {m['target_bytes_per_worker_with_init_layer']:,} "
        f"| {m['median_s']['parts_with_layer']} |",
        f"| it used to read: the whole target's files | {m['whole_target_file_bytes']:,} "
        f"| {m['median_s']['whole_target']} |",
        f"| the driver reads, to name the target: the first time on a machine (files hashed once) "
        f"| {driver['first_time']['bytes']:,} | |",
        f"| ... after (digests kept; a hub target: never, its LFS files are named by their sha256) "
        f"| {driver['after']['bytes']:,} | |",
        "",
        f"The held-out set (tiny target, a store of {evals['rows']} rows, `train.eval_fraction` "
        f"{evals['eval_fraction']}: {evals['heldout_rows']} rows): each stage "
        f"start reads {evals['eval_bytes_per_stage']:,} bytes of part files for it ({evals['heldout_parts']} of "
        f"{evals['parts']} parts), the held-out rows being {evals['heldout_bytes']:,}: **{eval_ratio:.2f}x** "
        f"(goal <= 1.1x, **{'met' if eval_ratio <= 1.1 else 'missed'}**). It used to read every part, "
        f"{evals['store_bytes']:,} bytes.",
        "",
        f"Goal target bytes per worker <= 1.1 x embedding + head: **met** ({ratio:.3f}x). "
        f"Driver target bytes 0: **{'met' if driver['after']['bytes'] == 0 else 'missed'}** "
        f"({driver['after']['bytes']} bytes once the digests are known; {driver['first_time']['bytes']:,} the first "
        "time a local target is named on a machine: read to hash, never loaded). Before, the driver loaded the "
        "whole target for every stage.",
        "",
        "## A training stage (tiny target; benchmarks/training/epoch_start.md, stage_restarts.json)",
        "",
        f"- Epoch start after the first: **{stage['epoch_start_s']:.2f} s** with one Ray Data execution per stage "
        f"(goal <= 1 s, **{'met' if stage['epoch_start_s'] <= 1 else 'missed'}**); "
        f"{stage['epoch_start_s_one_execution_per_epoch']:.2f} s with one execution per epoch, as before.",
        f"- Online, an undisturbed run of {stage['online_stages']} stages (the first read epochs "
        f"{stage['online_epochs_read']}) started {stage['online_target_loads']} feature actors (each loads the "
        f"target): the held-out rows' pool once ({stage['pool_size']}), then "
        f"**{stage['online_target_loads_per_stage']:g} a stage**, the pool size being {stage['pool_size']} (goal: "
        f"equal, **{'met' if stage['online_target_loads_per_stage'] == stage['pool_size'] else 'missed'}**). "
        "Before, every epoch and every stage started the pools again. With a worker killed, the restart starts "
        f"a new execution: {stage['online_target_loads_with_a_killed_worker']} in all for one stage.",
        f"- A training worker SIGKILLed after step {stage['killed_after_step']}: the restart resumed from step "
        f"{stage['resumed_from_step']}, **{stage['steps_lost_on_kill']} steps** trained again (`train.checkpoint_every` "
        f"{stage['checkpoint_every']}: the steps since the last checkpoint Ray Train had taken in; it polls reports, "
        "and a checkpoint saved moments before the kill may not count yet; with a preemption notice a checkpoint "
        "is saved at once, tests/pipeline/test_train.py).",
        f"- Its resume started the stream at {stage['resume']['position']}: the resume part's "
        f"{stage['resume']['rows_before_resume_row']} rows before its row were not featurized, and the rows each "
        f"rank had trained on from there ({stage['resume']['rows_skipped_per_rank']}) came empty: "
        f"**{stage['resume']['bytes_read_again']} bytes** of trained rows reached the ranks again (their audits' "
        "`bytes_read_again`). Goal 0: "
        f"**{'met' if stage['resume']['bytes_read_again'] == 0 else 'missed'}**. Before, a resume featurized "
        "(offline: read) the resume part's rows before its row and the rows each rank skipped again, and "
        "earlier every row of the epoch up to its position.",
        "",
        _make_test_line(result["make_test"]),
        "",
    ]
    (HERE / "restart_cost.md").write_text("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="/tmp/restart-cost", help="where the tiny store is featurized")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    machine = cpu_name()
    write(
        {
            "date": datetime.date.today().isoformat(),
            "machine": f"{machine}, {torch.get_num_threads()} threads, torch {torch.__version__}",
            "command": f"python benchmarks/scale_out/restart_cost.py --repeats {args.repeats}",
            "measured": {
                **measure(args.repeats),
                "driver_target_bytes": driver_reads(),
                "eval_reads": eval_reads(args.out),
            },
            "stage": stage_measures(),
            "make_test": make_test(),
        }
    )
