"""Online against offline features: training tokens/s of a fresh GRIFFIN stage 1 on SmolLM2-135M-Instruct.

``train.features: offline`` reads the Parquet feature store that ``griffin featurize`` wrote;
``online`` has the featurize stage's target actors (``PartFeatures``) compute the same rows as training
reads them, nothing stored. One process: a small ShareGPT slice is featurized once into a store
(``run_featurize``), then stage 1 is trained from a random init (``train.init_from=null``) on
``train.num_workers`` worker(s), offline and online alternately (offline, online, offline, ...), each a
fresh run name, every run through ``pipeline.train.driver.run_train``.

Per run:
- **wall**: the seconds ``run_train`` takes (target load, data plan, Ray Train start, steps, checkpoint);
- **tokens/s**: the worker's steady rate, from the MLflow history of ``train/tokens`` (real, non-padding
  tokens of each step, logged with a millisecond timestamp at the end of the step): the tokens of steps
  ``skip+1 .. N-1`` over the time from step ``skip``'s timestamp to step ``N-1``'s. The first ``skip``
  steps (actor start-up, the first blocks) and the last step (which evaluates and checkpoints) are out;
- **target work** (online): the training rows are featurized again in every epoch the run reads (Ray
  Data re-runs the actors per epoch) and the held-out rows once: tokens from the store's manifest
  times epochs started (the audit's ``<epoch>:<sample id>``), and the seconds that costs at the
  featurize run's own tokens/s (the target alone on the machine);
- **data**: the per-step sample ids of ``<run_dir>/train/stage1/data_rank0.jsonl``, compared between
  runs of the same seed, and the bytes each run has on disk (an online run must hold no store).

Writes benchmarks/scale_out/online_offline.json and online_offline.md.

    python benchmarks/scale_out/online_offline.py [--limit 48] [--max-len 256] [--steps 12] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

OUT = Path(__file__).parent


def overrides(args, run_name: str, features: str) -> list[str]:
    return [
        f"run_name={run_name}",
        f"output_dir={args.work}",
        f"data.limit={args.limit}",
        f"data.max_len={args.max_len}",
        f"features.store={args.work / 'store'}",
        "train.init_from=null",
        f"train.schedule=[{{stage: 1, steps: {args.steps}}}]",
        f"train.features={features}",
        f"train.num_workers={args.workers}",
    ]


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def steady_rate(history: list, skip: int) -> dict:
    """tokens/s over steps skip+1 .. N-1 from the ``train/tokens`` history (one metric per step)."""
    by_step = {m.step: m for m in history}
    steps = sorted(by_step)
    last = steps[-1] - 1  # the final step also evaluates and checkpoints before it is logged
    window = [s for s in steps if skip < s <= last]
    seconds = (by_step[last].timestamp - by_step[skip].timestamp) / 1000
    tokens = sum(by_step[s].value for s in window)
    step_s = [(by_step[s].timestamp - by_step[s - 1].timestamp) / 1000 for s in window]
    return {
        "tokens_per_s": tokens / seconds,
        "steps": len(window),
        "tokens": tokens,
        "seconds": seconds,
        "step_s": step_s,
        "tokens_per_step": [by_step[s].value for s in steps],
    }


def audit(run_dir: Path) -> list[dict]:
    lines = (run_dir / "train" / "stage1" / "data_rank0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def one_run(args, load_config, run_train, features: str, index: int, manifest: dict) -> dict:
    from mlflow.tracking import MlflowClient

    cfg = load_config(args.config, overrides(args, f"so-{features}-{index}", features))
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    run_train(cfg)
    wall = time.perf_counter() - start
    run_id = (cfg.run_dir / "train" / "stage1" / "mlflow_run_id").read_text().strip()
    history = MlflowClient(cfg.tracking_uri).get_metric_history(run_id, "train/tokens")
    records = audit(cfg.run_dir)
    epochs = 1 + max(int(s.split(":", 1)[0]) for r in records for s in r["sample_ids"])
    parquet = [str(p) for p in cfg.run_dir.rglob("*.parquet")]
    result = {
        "features": features,
        "run_name": cfg.run_name,
        "wall_s": wall,
        "load_avg_1m_before": load,
        **steady_rate(history, args.skip),
        "epochs_started": epochs,
        "epochs_read": records[-1]["epochs_read"],
        "bytes_read_rank0": records[-1]["bytes_read"],
        "run_dir_bytes": tree_bytes(cfg.run_dir),
        "run_dir_parquet_files": parquet,
        "store_dir_exists": (cfg.run_dir / "features").exists(),
        "sample_ids": [r["sample_ids"] for r in records],
    }
    if features == "online":
        eval_ids = manifest["eval_ids"]
        train_tokens = manifest["tokens"] - manifest["eval_tokens"]
        featurized = train_tokens * epochs + manifest["eval_tokens"] * (1 if eval_ids else 0)
        result["target_tokens"] = featurized
        result["target_s_at_featurize_rate"] = featurized / manifest["featurize_tokens_per_s"]
    print(
        f"[bench] {cfg.run_name}: wall {wall:.1f} s, steady {result['tokens_per_s']:.0f} tokens/s over "
        f"{result['steps']} steps, {epochs} epochs",
        flush=True,
    )
    return result


def compare_ids(a: dict, b: dict) -> dict:
    """Same rows? per step (order), per epoch (sets) and over the whole run (multiset)."""
    steps_a, steps_b = a["sample_ids"], b["sample_ids"]
    same_steps = sum(x == y for x, y in zip(steps_a, steps_b))

    def by_epoch(steps):
        out: dict[str, list] = {}
        for ids in steps:
            for s in ids:
                epoch, sid = s.split(":", 1)
                out.setdefault(epoch, []).append(sid)
        return out

    ea, eb = by_epoch(steps_a), by_epoch(steps_b)
    full = sorted(set(ea) & set(eb), key=int)[:-1]  # the last epoch is cut wherever the steps end
    return {
        "runs": [a["run_name"], b["run_name"]],
        "steps_identical": same_steps,
        "steps": min(len(steps_a), len(steps_b)),
        "first_step_ids_identical": steps_a[0] == steps_b[0],
        "whole_epochs_compared": len(full),
        "whole_epochs_same_rows": all(sorted(ea[e]) == sorted(eb[e]) for e in full),
        "whole_epochs_same_order": all(ea[e] == eb[e] for e in full),
        "all_rows_same_multiset": sorted(s for ids in steps_a for s in ids)
        == sorted(s for ids in steps_b for s in ids),
    }


def machine() -> dict:
    import torch
    import transformers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), [])
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "avx2": "avx2" in flags,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def median(values):
    return statistics.median(values) if values else None


def write_md(report: dict, path: Path) -> None:
    s, m, st = report["summary"], report["machine"], report["store"]
    runs = report["runs"]
    isa = "AVX-512 BF16" if m["avx512_bf16"] else ("AVX2" if m["avx2"] else "?")
    rows = "\n".join(
        f"| {r['run_name']} | {r['features']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.0f} | "
        f"{r['within_epoch_tokens_per_s']:.0f} | {statistics.median(r['step_s']):.2f} | "
        f"{', '.join(f'{d:.1f}' for d in r['epoch_start_step_s'])} | {r['epochs_started']} | "
        f"{r.get('target_tokens', '-')} | {r.get('target_loads_in_log', '?')} | {r['run_dir_bytes'] / 1e6:.1f} | "
        f"{len(r['run_dir_parquet_files'])} | {r['load_avg_1m_before']:.1f} |"
        for r in runs
    )
    checks = "\n".join(
        f"| {' vs '.join(c['runs'])} | {c['steps_identical']}/{c['steps']} | {c['whole_epochs_compared']} | "
        f"{c['whole_epochs_same_rows']} | {c['whole_epochs_same_order']} | {c['all_rows_same_multiset']} |"
        for c in report["same_rows"]
    )
    text = f"""# Online against offline features: training tokens/s

A fresh GRIFFIN stage 1 (`train.init_from=null`, {report["args"]["steps"]} steps, {report["args"]["workers"]}
worker, base config `{report["args"]["config"]}`: 8k draft vocabulary, 2048-token micro-batches, target in
`dtype: auto`) on SmolLM2-135M-Instruct, trained on {st["rows"]} ShareGPT conversations (`data.limit={report["args"]["limit"]}`,
`data.max_len={report["args"]["max_len"]}`, {st["tokens"]} tokens, {len(report["eval_ids"])} held out) with
`train.features=offline` (the Parquet store below) and `train.features=online` (the featurize stage's
target actors, {report["featurize_actors"]} of them, compute the rows as training reads them), interleaved
{" / ".join(r["features"] for r in runs)} in one process through `pipeline.train.driver.run_train`.

Machine: {m["cpu"]}, {m["cpus"]} CPUs, {isa} (AMX: {m["amx_bf16"]}), torch {m["torch"]}, transformers
{m["transformers"]}; shared with another engineer's tests (load average
{report["load_avg_start"]:.1f} at the start, {report["load_avg_end"]:.1f} at the end), so absolute numbers are noisy.
Date {report["date"]}. Command (from the repository root):

    {report["command"]}

The analysis and this file again from the JSON (run.sh tees the console to `<work>.log`, where the target loads
are counted): `.venv/bin/python benchmarks/scale_out/online_offline.py --render --log /tmp/griffin-scale-out-bench.log`.

**tokens/s** is the worker's steady rate: from the MLflow history of `train/tokens` (real, non-padding tokens
per step, each logged with its timestamp), the tokens of steps {report["args"]["skip"] + 1}..N-1 over the time
between step {report["args"]["skip"]}'s and step N-1's timestamps (the first steps carry the start-up; the last
also evaluates and checkpoints). **wall** is `run_train` end to end.

## Result (medians over {s["repeats"]} runs each)

| | offline | online | online / offline |
|---|---|---|---|
| training tokens/s (steady window, epoch starts included) | {s["offline_tokens_per_s"]:.0f} | {s["online_tokens_per_s"]:.0f} | **{s["tokens_per_s_ratio"]:.2f}x** |
| training tokens/s within an epoch (steps that open an epoch left out) | {s["offline_within_epoch_tokens_per_s"]:.0f} | {s["online_within_epoch_tokens_per_s"]:.0f} | {s["within_epoch_ratio"]:.2f}x |
| median step, s | {s["offline_step_s"]:.2f} | {s["online_step_s"]:.2f} | {s["online_step_s"] / s["offline_step_s"]:.2f}x |
| a step that opens an epoch, s beyond the run's median step (median) | {s["offline_epoch_start_extra_s"]:.1f} | {s["online_epoch_start_extra_s"]:.1f} | {s["online_epoch_start_extra_s"] / s["offline_epoch_start_extra_s"]:.2f}x |
| `run_train` wall, s | {s["offline_wall_s"]:.1f} | {s["online_wall_s"]:.1f} | {s["wall_ratio"]:.2f}x |
| bytes on disk for features | {st["bytes"]:,} (the store) | 0 (no store, no Parquet file in the run) | |

The store: {st["files"]} part files, {st["bytes"]:,} bytes on disk ({st["dir_bytes"]:,} with the manifest),
{st["rows"]} rows, {st["tokens"]} tokens: **{st["bytes_per_token"]:.0f} bytes per token** (2·H = {2 * 576} for
SmolLM2's H = 576 in bf16, plus the token ids and masks). Featurizing it took {st["seconds"]:.1f} s,
**{st["tokens_per_s"]:.0f} target tokens/s** ({report["featurize_actors"]} actors alone on the machine).

What the target spent online: every epoch the run reads, Ray Data runs the actors over the training
rows again (nothing is kept), and the held-out rows once. The online runs started
{s["online_epochs"]:.0f} epochs, i.e. {s["online_target_tokens"]:.0f} target tokens, ~{s["online_target_s"]:.0f} s of
target time at the featurize run's rate: the target's forward competes with the training step for the
same {m["cpus"]} cores.

## Every run

| run | features | wall s | tokens/s | tokens/s within an epoch | median step s | steps opening an epoch, s | epochs started | target tokens | target loads (log) | run dir MB | Parquet files in run dir | load avg before |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

## Same rows? (`data_rank0.jsonl`, same seed)

| runs | steps with identical sample ids | whole epochs compared | same rows per epoch | same order per epoch | same rows over the run |
|---|---|---|---|---|---|
{checks}

{report["notes"]}
"""
    path.write_text(text)


def notes(report: dict) -> str:
    checks = report["same_rows"]
    cross = [c for c in checks if c["kind"] == "offline vs online"]
    same = [c for c in checks if c["kind"] != "offline vs online"]
    lines = ["Reading the checks:", ""]
    if all(c["whole_epochs_same_rows"] for c in checks):
        lines.append("- Every compared run trained on the same rows in every whole epoch.")
    else:
        lines.append("- Some runs did NOT train on the same rows per epoch (table above).")
    if same and all(c["steps_identical"] == c["steps"] for c in same):
        lines.append("- Two runs of the same mode trained on identical sample ids at every step (determinism).")
    extra = report["summary"]
    lines.append(
        f"- Every epoch start stalls the step that opens it: {extra['offline_epoch_start_extra_s']:.0f} s offline, "
        f"{extra['online_epoch_start_extra_s']:.0f} s online beyond a median step (medians). Ray Data runs the "
        "dataset again for every epoch (`streaming_split` asks for the next epoch only when it is needed), so the "
        "read, the row split and the 16-row reblocking start over; online, the `PartFeatures` actor pool is made "
        "anew too, and every actor loads the target again before its first part"
        + (
            f" (the console log shows {median([r['target_loads_in_log'] for r in report['runs'] if r['features'] == 'online']):g} "
            f"target loads per online run, {median([r['target_loads_in_log'] for r in report['runs'] if r['features'] == 'offline']):g} "
            "per offline run, the driver's and the worker's; online the driver loads it once more to tokenize)"
            if all("target_loads_in_log" in r for r in report["runs"])
            else ""
        )
        + ". Within an epoch the two run at the same step time; the stalls make the difference."
    )
    if cross and not all(c["steps_identical"] == c["steps"] for c in cross):
        lines.append(
            "- Offline and online see the rows in a different order: the store's part files are read in "
            "file-name order (`part-<actor id>-<seq>`, sorted), while online reads the parts in the planned "
            "(seeded) order; with 2 featurize actors the two orders differ, and the per-rank shuffle of a "
            "different input order gives different micro-batches. Same rows per epoch, not the same steps."
        )
    elif cross:
        lines.append("- Offline and online trained on identical sample ids at every step.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="jobs/configs/base/cpu.yaml")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the steady rate")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/griffin-scale-out-bench"))
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--render", action="store_true", help="only redo the analysis and Markdown from the JSON")
    parser.add_argument("--log", type=Path, help="with --render: the run's console log (run.sh: <work>.log)")
    args = parser.parse_args()
    if args.render:
        finish(json.loads((OUT / "online_offline.json").read_text()), args.log)
        return

    import pyarrow.parquet as pq
    import ray

    from pipeline.config import load_config
    from pipeline.data.featurize import run_featurize
    from pipeline.data.store import part_files, read_manifest
    from pipeline.data.heldout import held_out_ids
    from pipeline.train.driver import run_train

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    load_start = os.getloadavg()[0]
    fcfg = load_config(args.config, overrides(args, "so-featurize", "offline"))
    start = time.perf_counter()
    featurized = run_featurize(fcfg)
    featurize_wall = time.perf_counter() - start
    store = fcfg.store_path
    totals = read_manifest(store)["totals"]
    ids, lengths = [], {}
    for f in part_files(store):
        table = pq.read_table(f, columns=["sample_id", "seq_len"])
        for sid, n in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
            ids.append(sid)
            lengths[sid] = n
    eval_ids = sorted(held_out_ids(ids, fcfg.train.eval_fraction))
    manifest = {
        "tokens": totals["tokens"],
        "eval_ids": eval_ids,
        "eval_tokens": sum(lengths[s] for s in eval_ids),
        "featurize_tokens_per_s": featurized["tokens_per_s"],
    }
    store_info = {
        **{k: featurized[k] for k in ("files", "rows", "tokens", "bytes", "bytes_per_token", "seconds")},
        "tokens_per_s": featurized["tokens_per_s"],
        "wall_s": featurize_wall,
        "dir_bytes": tree_bytes(Path(store)),
    }
    print(f"[bench] store: {store_info}", flush=True)

    runs = []
    for index in range(args.repeats):
        for features in ("offline", "online"):
            runs.append(one_run(args, load_config, run_train, features, index, manifest))
    ray.shutdown()

    command = (
        "benchmarks/scale_out/run.sh  # = PYTHONPATH=$PWD .venv/bin/python benchmarks/scale_out/online_offline.py "
        f"--limit {args.limit} --max-len {args.max_len} --steps {args.steps} --skip {args.skip} "
        f"--repeats {args.repeats} --workers {args.workers}"
    )
    report = {
        "date": args.date,
        "command": command,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg()[0],
        "featurize_actors": fcfg.features.num_actors,
        "store": store_info,
        "eval_ids": eval_ids,
        "runs": runs,
    }
    finish(report)


def finish(report: dict, log: Path | None = None) -> None:
    """The comparisons, the epoch-boundary split and the medians from the runs' samples, then the JSON and the
    Markdown (``--render`` redoes this from a saved JSON, with the run's console log for the target loads)."""
    runs, skip = report["runs"], report["args"]["skip"]
    if log is not None:
        segments = re.split(r"^\[bench\].*$", log.read_text(), flags=re.MULTILINE)[1:]  # [0]: featurize
        for run, segment in zip(runs, segments):
            run["target_loads_in_log"] = segment.count("Loading weights: 100%")
    for run in runs:
        run.update(analyse(run, skip))
    offline = [r for r in runs if r["features"] == "offline"]
    online = [r for r in runs if r["features"] == "online"]
    checks = [{"kind": "offline vs online", **compare_ids(a, b)} for a, b in zip(offline, online)]
    for group in (offline, online):
        if len(group) > 1:
            checks.append({"kind": f"{group[0]['features']} vs {group[0]['features']}", **compare_ids(*group[:2])})
    summary = {"repeats": len(offline)}
    for name, group in (("offline", offline), ("online", online)):
        summary |= {
            f"{name}_tokens_per_s": median([r["tokens_per_s"] for r in group]),
            f"{name}_within_epoch_tokens_per_s": median([r["within_epoch_tokens_per_s"] for r in group]),
            f"{name}_step_s": median([statistics.median(r["step_s"]) for r in group]),
            f"{name}_epoch_start_extra_s": median([x for r in group for x in r["epoch_start_extra_s"]]),
            f"{name}_wall_s": median([r["wall_s"] for r in group]),
        }
    summary |= {
        "online_epochs": median([r["epochs_started"] for r in online]),
        "online_target_tokens": median([r["target_tokens"] for r in online]),
        "online_target_s": median([r["target_s_at_featurize_rate"] for r in online]),
        "online_wrote_no_store": all(not r["store_dir_exists"] and not r["run_dir_parquet_files"] for r in online),
        "tokens_per_s_ratio": ratio(summary["online_tokens_per_s"], summary["offline_tokens_per_s"]),
        "within_epoch_ratio": ratio(
            summary["online_within_epoch_tokens_per_s"], summary["offline_within_epoch_tokens_per_s"]
        ),
        "wall_ratio": ratio(summary["online_wall_s"], summary["offline_wall_s"]),
    }
    report |= {"summary": summary, "same_rows": checks}
    report["notes"] = notes(report)
    (OUT / "online_offline.json").write_text(json.dumps(report, indent=1, default=str))
    write_md(report, OUT / "online_offline.md")
    print(json.dumps(summary, indent=1), flush=True)


def ratio(a, b):
    return a / b if a is not None and b else None


def epoch_starts(sample_ids: list[list[str]]) -> list[int]:
    """The steps (from 1) whose micro-batch opens an epoch: a rank takes a micro-batch from one epoch only
    (``ShardFeed.take``), and the first one of a new epoch waits for Ray Data to start that epoch."""
    out, latest = [], 0
    for step, ids in enumerate(sample_ids, 1):
        epoch = max(int(s.split(":", 1)[0]) for s in ids)
        if epoch > latest:
            out.append(step)
        latest = max(latest, epoch)
    return out


def analyse(run: dict, skip: int) -> dict:
    """The steady window split into steps within an epoch and steps that open one."""
    starts = set(epoch_starts(run["sample_ids"]))
    window = list(zip(range(skip + 1, skip + 1 + len(run["step_s"])), run["step_s"]))
    inside = [(s, d) for s, d in window if s not in starts]
    typical = statistics.median(d for _, d in inside)
    opening = [d for s, d in window if s in starts]
    return {
        "epoch_start_steps": sorted(starts),
        "within_epoch_tokens_per_s": sum(run["tokens_per_step"][s - 1] for s, _ in inside) / sum(d for _, d in inside),
        "epoch_start_step_s": opening,
        "epoch_start_extra_s": [d - typical for d in opening],
    }


if __name__ == "__main__":
    main()
