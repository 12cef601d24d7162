"""The parts runner that featurize and regenerate share: a Ray Data pool of actors writes one part file per
planned part (``PartActor``), the driver records each finished part in the manifest as it arrives
(``run_part_actors``: a kill loses no finished part, a rerun resumes) and reports progress
(``PartProgress``: a log line per part and the stage's console line)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from typing import Any

from pipeline import console
from pipeline.config import RunConfig
from pipeline.data.part_files import part_name
from pipeline.data.store import write_manifest

logger = logging.getLogger(__name__)


KILL_ENV = "GRIFFIN_PART_KILL_ONCE"  # fault injection for tests: a flag file; see PartActor.written

ACTOR_START_S = 600  # the longest wait for a pool's actors to start (a cluster growing, a target loading)


class PartActor:
    """What every part-writing actor does around its own work: refuse a worker whose target differs from
    the driver's, name each part from its plan index and sample ids (``part_name``: a retry rewrites the
    same file), and fail on purpose (fault injection for the resume tests, set through ``injected_faults``):
    raise after ``fail_after`` parts, or die (SIGKILL) once, right after a part is renamed into place,
    when ``kill_once`` names a flag file that does not exist yet."""

    fault_env = ""

    def __init__(
        self,
        worker_fingerprint: dict[str, Any],
        fingerprint: dict[str, Any],
        fail_after: int | None,
        kill_once: str | None = None,
    ):
        if worker_fingerprint != fingerprint:
            raise ValueError(
                f"this worker's target differs from the driver's ({worker_fingerprint} vs {fingerprint}); "
                "every node must see the same model files"
            )
        self.fail_after, self.kill_once = fail_after, kill_once
        self.parts = 0

    def next_part(self, index: int, sample_ids: list[str]) -> str:
        """The file name of planned part ``index`` (holding ``sample_ids``, the rows written or not);
        raises the injected failure once ``fail_after`` parts are written."""
        if self.fail_after is not None and self.parts >= self.fail_after:
            raise RuntimeError(f"injected failure after {self.parts} parts ({self.fault_env})")
        self.parts += 1
        return part_name(index, sample_ids)

    def written(self) -> None:
        """Called once a part is in place, before the driver has the result: the injected kill. The
        flag file, created exclusively, makes it one kill across every actor and restart; SIGKILL, not
        an exception, so that the process dies as on a preempted node and Ray Data retries the task."""
        if not self.kill_once:
            return
        try:
            os.close(os.open(self.kill_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def injected_faults(fault_env: str) -> dict[str, Any]:
    """The fault-injection settings of a stage, read on the driver (actors do not see its environment):
    ``$<fault_env>`` parts per actor before raising, and ``$GRIFFIN_PART_KILL_ONCE``'s flag file."""
    return {
        "fail_after": int(os.environ[fault_env]) if os.environ.get(fault_env) else None,
        "kill_once": os.environ.get(KILL_ENV) or None,
    }


class PartProgress:
    """Finished parts counted (conversations, tokens, bytes written) into a log line per part and the
    stage's console line, counted in tokens when the total is known up front (featurize) and in
    conversations otherwise (regenerate)."""

    def __init__(self, stage: str, rows: int, tokens: int | None = None):
        self.stage, self.total_rows, self.total_tokens = stage, rows, tokens
        self.rows = self.tokens = self.bytes = 0
        self.start = time.perf_counter()
        self.console = (
            console.Progress(stage, tokens, "tokens")
            if tokens is not None
            else console.Progress(stage, rows, "conversations")
        )

    def update(self, result: dict[str, Any]) -> None:
        self.rows, self.tokens = self.rows + result["rows"], self.tokens + result["tokens"]
        self.bytes += (result["part"] or {}).get("bytes", 0)
        rate = self.tokens / max(self.elapsed, 1e-9)
        tokens = (
            f"{self.tokens} tokens generated"
            if self.total_tokens is None
            else f"{self.tokens}/{self.total_tokens} tokens"
        )
        line = f"{self.stage}: {self.rows}/{self.total_rows} conversations, {tokens}, {rate:.0f} tokens/s"
        if self.bytes:
            line += f", {self.bytes / 1e6:.1f} MB written"
        if "cut" in result:
            line += f", {result['cut']} answers cut at max_new_tokens in this part"
        if self.total_tokens is not None:
            line += f", ETA {(self.total_tokens - self.tokens) / max(rate, 1e-9):.0f} s"
            self.console.update(self.tokens, f"{self.rows}/{self.total_rows} conversations  {rate:.0f} tokens/s")
        else:
            self.console.update(self.rows, f"{rate:.0f} tokens/s")
        logger.info(line)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def run_part_actors(
    cfg: RunConfig,
    actor: type,
    parts: list[dict],
    location: str,
    manifest: dict,
    progress: Any,
    what: str,
    constructor_kwargs: dict[str, Any],
) -> None:
    """A Ray Data pool of ``features.num_actors`` ``actor``s (featurize's resources) writes one part
    per call; the driver records each finished part (``entry`` JSON: ``part``, ``skipped``) in
    ``location``'s manifest as it arrives, so a kill loses no finished part (featurize, regenerate)."""
    dataset = part_actor_dataset(cfg, actor, parts, constructor_kwargs)
    try:
        for row in dataset.iter_rows():
            result = json.loads(row["entry"])
            if part := result["part"]:  # a part rewritten under its own name replaces its entry
                manifest["files"] = [f for f in manifest["files"] if f["file"] != part["file"]] + [part]
            manifest["skipped"] += result["skipped"]
            write_manifest(location, manifest)  # progress survives a kill
            progress.update(result)
    except Exception as error:  # whatever stopped Ray, the manifest must say it is incomplete
        write_manifest(location, manifest)
        raise RuntimeError(
            f"{what} stopped ({root_cause(error)}); finished parts are kept in {location}: rerun "
            "the same command to resume"
        ) from error


def part_actor_dataset(cfg: RunConfig, actor: type, parts: list[dict] | Any, constructor_kwargs: dict[str, Any]):
    """``parts`` (packed parts, or a dataset of them) through a pool of ``features.num_actors``
    ``actor``s with featurize's resources, one actor call per part (so finished parts stream back one
    by one; a part stays one block where the dataset's ``target_max_block_size`` is None)."""
    import ray

    # Start every actor before handing out parts: otherwise the first actor up (a target load takes
    # seconds) drains a short queue alone and the rest of the pool idles. Fails clearly, instead of
    # hanging, when the cluster cannot place the pool (featurize, regenerate, online training alike).
    if isinstance(parts, list):
        size, parts = len(parts), ray.data.from_items(parts, override_num_blocks=len(parts))
    else:
        size = cfg.features.num_actors  # a stream of parts: as many as it reads
    parts.context.wait_for_min_actors_s = ACTOR_START_S  # the context this dataset runs with
    return parts.map_batches(
        actor,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=min(cfg.features.num_actors, size)),
        num_cpus=cfg.features.cpus_per_actor,
        num_gpus=cfg.features.gpus_per_actor or None,
        resources=cfg.features.resources or None,
        fn_constructor_kwargs=constructor_kwargs,
    )


def root_cause(error: BaseException) -> str:
    """The worker's own error line: Ray's message prints the original traceback first, then its wrappers
    (the exception objects themselves lose ``__cause__`` on the way back from the worker)."""
    text = str(error)
    found = re.search(r"^(\w+(?:\.\w+)*(?:Error|Exception)): (.*)$", text, re.MULTILINE)
    return f"{found[1]}: {found[2][:300]}" if found else f"{type(error).__name__}: {text[:300]}"


# A read item's place in a training stream (pipeline.train.stream): its epoch, part, first stream row
# and the part's training row count, carried onto its part's rows by whatever makes them (a read task,
# a target actor), so that the rows say which item they came from.
CARRIED = ("stream_epoch", "stream_part", "stream_from", "stream_count")


def empty_rows(schema: Any, count: int) -> Any:
    """``count`` rows of ``schema`` holding nothing (empty strings, lists and bytes, zeros): a stream
    slot whose row is not read (``pipeline.train.stream``), its ``seq_len`` 0."""
    import pyarrow as pa

    def nothing(kind: Any) -> Any:
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            return []
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return ""
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            return b""
        return 0

    return pa.table({f.name: pa.array([nothing(f.type)] * count, f.type) for f in schema}, schema=schema)


def carry(table: Any, item: dict[str, Any]) -> Any:
    """``table`` (Arrow) with the ``CARRIED`` values of ``item`` (a batch of one) as constant columns;
    ``table`` unchanged when the item carries none (featurize's parts). An empty table gets one empty
    row (``empty_rows``) to carry them: an item whose rows are all left unread still says where it is."""
    import numpy as np
    import pyarrow as pa

    table = table.drop_columns([c for c in CARRIED if c in table.column_names])
    if not any(name in item for name in CARRIED):
        return table
    if not table.num_rows:
        table = empty_rows(table.schema, 1)
    for name in CARRIED:
        table = table.append_column(name, pa.array(np.full(table.num_rows, int(item[name][0]), np.int64)))
    return table
