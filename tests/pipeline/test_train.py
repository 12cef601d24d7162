"""Ray Train stage: a schedule of stages, resume, worker restart, best checkpoint, MLflow, 2-rank DDP. A
run that fails and is rerun resumes bit for bit: here at 2 ranks (the same-crash test), and
tests/test_e2e.py with `griffin run` killed."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.train.driver import run_train, stage_dir
from pipeline.train.worker import SCORE
from tests.conftest import assert_same_train_state, last_checkpoint

CONVERSATIONS = [
    {
        "conversations": [
            {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 4)},
        ]
    }
    for i in range(40)
]


@pytest.fixture(scope="module")
def store(tmp_path_factory, ray_local):
    """A tiny-target feature store featurized once for the module."""
    from pipeline.data.featurize import run_featurize

    root = tmp_path_factory.mktemp("train")
    data = root / "conversations.json"
    data.write_text(json.dumps(CONVERSATIONS))
    overrides = [f"output_dir={root}", f"data.source={data}", "data.limit=null", "train.eval_fraction=0.2"]
    cfg = load_config("jobs/configs/tiny.yaml", overrides)  # the held-out fraction the stages train with
    run_featurize(cfg)
    return root, data, cfg.store_path


def train_overrides(store, name, *overrides) -> list[str]:
    root, data, store_path = store
    return [
        f"output_dir={root}",
        f"run_name={name}",
        f"data.source={data}",
        f"features.store={store_path}",
        "train.num_workers=2",
        "train.method.warmup_steps=0",
        "train.eval_fraction=0.2",
        "train.checkpoint_every=2",
        "train.eval_every=2",
        "train.batch_tokens=512",
        *overrides,
    ]


def train_cfg(store, name, *overrides):
    return load_config("jobs/configs/tiny.yaml", train_overrides(store, name, *overrides))


def final_weights(cfg, stage=1):
    return load_file(stage_dir(cfg, stage) / "best" / "model.safetensors")


def last_states(cfg, stage):
    """The stage's latest checkpoint: rank 0's train state, and each rank's RNG state."""
    ckpt = last_checkpoint(cfg.run_dir, cfg.run_name, stage)
    rngs = [torch.load(p, weights_only=True) for p in sorted(ckpt.glob("rng_rank*.pt"))]
    return torch.load(ckpt / "train_state.pt", weights_only=True), rngs


def assert_each_rank_packs_its_own_rows(cfg, stage_path: Path, world: int) -> None:
    """Each rank's steps (one micro-batch each) are its own rows packed greedily to train.batch_tokens
    (B * T_max), whatever the other ranks' rows: not the same row count on every rank."""
    import pyarrow.parquet as pq

    from pipeline.data.store import part_files

    lengths = {}
    for f in part_files(str(cfg.store_path)):
        table = pq.read_table(f, columns=["sample_id", "seq_len"])
        lengths.update(zip(table["sample_id"].to_pylist(), table["seq_len"].to_pylist()))
    counts = []
    for rank in range(world):
        steps = [json.loads(x)["sample_ids"] for x in (stage_path / f"data_rank{rank}.jsonl").read_text().splitlines()]
        for ids in steps:
            sizes = [lengths[i.split(":", 1)[1]] for i in ids]
            assert len(ids) * max(sizes) <= cfg.train.batch_tokens or len(ids) == 1  # it fits
        for ids, after in zip(steps, steps[1:]):  # and the next row would not have
            sizes = [lengths[i.split(":", 1)[1]] for i in [*ids, after[0]]]
            assert len(sizes) * max(sizes) > cfg.train.batch_tokens
        counts.append([len(ids) for ids in steps])
    assert any(len(set(step)) > 1 for step in zip(*counts)), counts  # the ranks took different counts


@pytest.fixture(scope="module")
def schedule_run(store):
    """One 2-stage run, shared: its stage 1 (4 steps, its own LR decay) is also the uninterrupted
    reference of the resume test. Each stage is a Ray Train run of its own: a third would repeat the second."""
    cfg = train_cfg(store, "sched", "train.schedule=[{stage: 1, steps: 4, lr: 0.002}, {stage: 2, steps: 2, lr: 0.002}]")
    return cfg, run_train(cfg)


@pytest.mark.timeout(900)
def test_a_schedule_of_stages_two_workers(schedule_run):
    """Stage 2 starts from stage 1's best; ranks see disjoint rows and agree on weights;
    metrics are in MLflow; the best checkpoint has the highest eval/sim_accept_len."""
    import mlflow

    cfg, summary = schedule_run
    assert [s["stage"] for s in summary["stages"]] == [1, 2]
    provenance = json.loads((stage_dir(cfg, 2) / "best" / "config.json").read_text())["provenance"]
    assert provenance["init_from"] == str(stage_dir(cfg, 1) / "best") and provenance["stage"] == 2
    assert Path(summary["best"], "model.safetensors").exists()
    state, rngs = last_states(cfg, 1)
    assert len(rngs) == 2 and rngs[0]["weights_sha256"] == rngs[1]["weights_sha256"]
    # the optimizer state is written once, by rank 0: the other rank's file is its RNG state alone
    ckpt = last_checkpoint(cfg.run_dir, cfg.run_name, 1)
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert files == ["draft/config.json", "draft/model.safetensors", "rng_rank0.pt", "rng_rank1.pt", "train_state.pt"]
    assert set(rngs[1]) == {"rng", "weights_sha256"} and state["step"] == 4 and "optimizer" in state
    seen = [
        {
            s
            for line in (stage_dir(cfg, 1) / f"data_rank{r}.jsonl").read_text().splitlines()
            for s in json.loads(line)["sample_ids"]
            if s.startswith("0:")
        }
        for r in (0, 1)
    ]  # epoch 0
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert_each_rank_packs_its_own_rows(cfg, stage_dir(cfg, 1), world=2)

    mlflow.set_tracking_uri(cfg.tracking_uri)
    client = mlflow.tracking.MlflowClient()
    run_id = summary["stages"][0]["mlflow_run_id"]
    loss = [m.value for m in sorted(client.get_metric_history(run_id, "train/loss_1"), key=lambda m: m.step)]
    assert len(loss) == 4 and loss[-1] < loss[0]
    scores = {m.step: m.value for m in client.get_metric_history(run_id, SCORE)}
    checkpointed = [scores[s] for s in (2, 4)]
    assert summary["stages"][0]["best_metrics"][SCORE] == pytest.approx(max(checkpointed))
    assert "curves.png" in [a.path for a in client.list_artifacts(run_id)]
    (features,) = client.get_run(run_id).inputs.dataset_inputs  # the store, by its manifest's digest
    assert features.dataset.digest == provenance["feature_manifest_sha256"][:36]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_resume_at_another_world_size_is_refused_naming_both(tmp_path):
    """A stage's latest checkpoint saved by 2 ranks: resuming it with 1 or 4 workers is refused before Ray
    Train starts, naming both sizes; with 2 it goes ahead. Only the latest checkpoint counts."""
    from pipeline.config import StageSection
    from pipeline.train.driver import check_resume_world_size

    cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}", "train.num_workers=2"])
    stage = StageSection(stage=1, steps=4, lr=0.002)
    run = cfg.run_dir / "ray_train" / f"{cfg.run_name}-stage1"
    for name, ranks in (("checkpoint_2026-12-06_10-00-00.000000", 4), ("checkpoint_2026-12-06_10-05-00.000000", 2)):
        (run / name).mkdir(parents=True)
        for rank in range(ranks):
            (run / name / f"rng_rank{rank}.pt").write_bytes(b"")
    check_resume_world_size(cfg, stage)
    for workers in (1, 4):
        other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"num_workers": workers})})
        with pytest.raises(ValueError, match=rf"saved by 2 workers, with train.num_workers={workers}.*num_workers=2"):
            check_resume_world_size(other, stage)


@pytest.mark.timeout(900)
def test_a_restarted_group_replays_its_rows_and_the_same_crash_in_a_row_stops(store, schedule_run):
    """``train.max_failures=-1`` restarts a preempted group forever, so a deterministic crash is
    bounded by ``train.max_same_failures``: the same error from the same checkpoint twice, and the
    third attempt's workers refuse to start; the driver says which error. Both ranks raise each time,
    and each attempt still counts once. The restart (Ray Train's FailureConfig) resumes from the step-2
    checkpoint and replays step 3 on the same rows. A rerun resumes from it too, is restarted once more
    in the run, and ends with the uninterrupted run's (the schedule run's stage 1) weights, optimizer and
    data position, bit for bit."""
    from pipeline.train import driver, failures

    cfg = train_cfg(
        store,
        "same-crash",
        "train.schedule=[{stage: 1, steps: 4, lr: 0.002}]",
        "train.max_failures=-1",
        "train.max_same_failures=2",
        "train.debug_fail_at_step=3",
        "train.debug_fail_times=1000",  # every arrival at step 3, on any rank, raises
    )
    failure_config = driver._trainer(cfg, cfg.train.schedule[0], None, {}).run_config.failure_config
    assert (failure_config.max_failures, failure_config.max_preemption_failures) == (-1, -1)
    with pytest.raises(RuntimeError, match="same failure 2 times in a row") as raised:
        run_train(cfg)
    assert "injected failure at step 3" in str(raised.value)
    ledger = failures.read(stage_dir(cfg, 1))
    assert (ledger["count"], ledger["checkpoint_step"]) == (2, 2)
    log = [json.loads(x)["step"] for x in (stage_dir(cfg, 1) / "data_rank0.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 3]  # two attempts reached step 3 from the step-2 checkpoint; the third never trained
    for rank in (0, 1):  # the restarted group read the rows the first attempt had at step 3, on every rank
        records = [json.loads(x) for x in (stage_dir(cfg, 1) / f"data_rank{rank}.jsonl").read_text().splitlines()]
        first, replayed = (r["sample_ids"] for r in records if r["step"] == 3)
        assert first == replayed and first

    # a rerun is someone's decision to try again: the count starts afresh. It resumes from the step-2
    # checkpoint; one crash at step 4 (one rank, before the step's checkpoint) restarts the group from it
    # again, and the stage finishes
    (stage_dir(cfg, 1) / "_injected_failure").unlink()  # the hook's count of the injections so far
    schedule = "train.schedule=[{stage: 1, steps: 4, lr: 0.002}]"
    fixed = train_cfg(store, "same-crash", schedule, "train.max_failures=-1", "train.debug_fail_at_step=4")
    run_train(fixed)
    log = [json.loads(x)["step"] for x in (stage_dir(cfg, 1) / "data_rank0.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 3, 3, 4, 3, 4] and (stage_dir(fixed, 1) / "_complete.json").exists()
    ledger = failures.read(stage_dir(fixed, 1))
    assert ledger["count"] == 1 and "injected failure at step 4" in ledger["message"]
    # restarted in the run and rerun after it failed outright, it ends as the uninterrupted run, bit for bit
    ours, theirs = (last_checkpoint(c.run_dir, c.run_name, 1) for c in (fixed, schedule_run[0]))
    assert_same_train_state(ours, theirs, world=2)


@pytest.mark.timeout(600)
def test_a_preemption_notice_saves_a_checkpoint_at_once(store, tmp_path):
    """A real drain of the workers' node (Ray's preemption notice) mid-stage: the stage saves a
    checkpoint at that step although ``checkpoint_every`` would save none before the end, so a restart
    would lose no step, and the stage still finishes. Its own Ray (a drained node takes no new work):
    ``griffin train`` in a subprocess."""
    import os
    import subprocess
    import sys

    schedule = "train.schedule=[{stage: 1, steps: 6, lr: 0.002}]"
    overrides = train_overrides(store, "drained", schedule, "train.checkpoint_every=100", "train.debug_drain_at_step=3")
    overrides.append("train.preemption_check_every=1")
    cfg = load_config("jobs/configs/tiny.yaml", overrides)
    env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", "-c", "jobs/configs/tiny.yaml", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "preemption notice" in run.stdout + run.stderr and "checkpoint at step 3" in run.stdout + run.stderr
    run_dir = cfg.run_dir / "ray_train" / "drained-stage1"
    saved = [p / "train_state.pt" for p in run_dir.glob("checkpoint_*") if p.is_dir()]
    steps = sorted(torch.load(p, weights_only=True)["step"] for p in saved)
    assert steps == [3, 6]  # the notice's checkpoint, then the stage's last
    assert (stage_dir(cfg, 1) / "_complete.json").exists()


def test_a_stage_the_cluster_cannot_hold_is_refused_by_name(ray_local):
    """Online, the training workers and the feature actors run at once; offline, the workers and the
    stream's read tasks. A cluster (here the suite's 6 logical CPUs, no GPU) too small for them is
    refused before anything waits, naming what is short and the settings."""
    from pipeline.train.inputs import check_stage_fits

    online = ["train.features=online"]
    check_stage_fits(load_config("jobs/configs/tiny.yaml", [*online, "train.num_workers=2"]), wait_s=0)
    cpus = load_config("jobs/configs/tiny.yaml", [*online, "train.num_workers=4", "features.num_actors=4"])
    with pytest.raises(ValueError, match=r"8 CPU needed, the cluster has 6 .*train.num_workers=4"):
        check_stage_fits(cpus, wait_s=0)
    gpus = load_config("jobs/configs/tiny.yaml", [*online, "features.gpus_per_actor=1"])
    with pytest.raises(ValueError, match=r"1 GPU needed, the cluster has 0 .*features.gpus_per_actor=1"):
        check_stage_fits(gpus, wait_s=0)
    check_stage_fits(load_config("jobs/configs/tiny.yaml", ["train.num_workers=5"]), wait_s=0)  # 5 + 1 read
    every_cpu = load_config("jobs/configs/tiny.yaml", ["train.num_workers=2", "train.cpus_per_worker=3"])
    with pytest.raises(ValueError, match=r"train.features=offline .* 7 CPU needed, the cluster has 6 .*read tasks"):
        check_stage_fits(every_cpu, wait_s=0)


def test_rerun_skips_completed_stages(schedule_run, capsys):
    cfg, _ = schedule_run
    run_train(cfg)
    assert capsys.readouterr().out.count("already complete") == 2


def stream_ids(parts, start: dict, world: int = 2) -> list[list[tuple[int, str]]]:
    """(epoch, sample id) of each row each of ``world`` ranks reads from one execution of the stream
    of ``parts`` starting at ``start``, split as Ray Train splits it."""
    import threading

    import ray

    from pipeline.train.inputs import data_config
    from pipeline.train.stream import StreamStart, train_stream

    actor = ray.remote(num_cpus=0)(StreamStart).remote()
    ray.get(actor.set_stream_start.remote(start))
    splits = data_config().configure({"train": train_stream(parts, actor)}, world, None, None)
    seen: list[list[tuple[int, str]]] = [[] for _ in range(world)]

    def read(rank):  # every split must ask before the execution starts: the ranks read side by side
        for table in splits[rank]["train"].iter_batches(batch_size=None, batch_format="pyarrow"):
            seen[rank] += list(zip(table["epoch"].to_pylist(), table["sample_id"].to_pylist()))

    threads = [threading.Thread(target=read, args=(rank,)) for rank in range(world)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    ray.kill(actor)
    return seen


def test_the_stream_deals_every_training_row_once_an_epoch_in_a_new_order(store):
    """One execution spans the epochs: each epoch every training row reaches exactly one rank, the ranks
    get ~half each, the next epoch reads them in another order; read from the files or from parts
    held in the object store (``train.materialize``), every rank gets the same rows in the same order."""
    from pipeline.data.heldout import held_out_ids, store_part_ids
    from pipeline.data.store import read_manifest
    from pipeline.train.inputs import materialized_parts, stored_parts
    from pipeline.train.stream import first_start

    _, _, store_path = store
    part_ids, dtype = store_part_ids(store_path), read_manifest(store_path)["capture_key"]["dtype"]
    eval_ids = held_out_ids([i for ids in part_ids.values() for i in ids], 0.2)
    parts = stored_parts(part_ids, dtype, False, eval_ids, 0)
    ranks = stream_ids(parts, first_start(0, 2))
    train_ids = sorted({i for ids in part_ids.values() for i in ids} - eval_ids)
    for epoch in (0, 1):
        rows = [[sid for e, sid in seen if e == epoch] for seen in ranks]
        assert sorted(rows[0] + rows[1]) == train_ids and abs(len(rows[0]) - len(rows[1])) <= 16
    assert [s for e, s in ranks[0] if e == 0] != [s for e, s in ranks[0] if e == 1]
    assert stream_ids(materialized_parts(parts), first_start(0, 2)) == ranks


def test_a_part_is_shuffled_whole_however_large(store, monkeypatch):
    """Ray Data cuts a task's output into blocks of ``target_max_block_size`` (128 MB by default; a part
    holds up to 256 MB): the stream keeps each part one block until it is shuffled, so a part's rows
    are numbered 0..n-1 once, in one order, even when the blocks would be a few rows."""
    import ray

    from pipeline.data.heldout import store_part_ids
    from pipeline.data.store import read_manifest
    from pipeline.train.inputs import stored_parts
    from pipeline.train.stream import StreamStart, first_start, train_stream

    _, _, store_path = store
    part_ids, dtype = store_part_ids(store_path), read_manifest(store_path)["capture_key"]["dtype"]
    monkeypatch.setattr(ray.data.DataContext.get_current(), "target_max_block_size", 4096)  # a row or two
    actor = ray.remote(num_cpus=0)(StreamStart).remote()
    ray.get(actor.set_stream_start.remote(first_start(0, 1)))
    rows = list(train_stream(stored_parts(part_ids, dtype, False, set(), 0), actor).iter_rows())
    numbered: dict[int, list[int]] = {}
    for row in rows:
        numbered.setdefault(row["part"], []).append(row["row"])
    assert {part: sorted(n) for part, n in numbered.items()} == {
        p: list(range(len(ids))) for p, ids in enumerate(part_ids.values())
    }
    ray.kill(actor)


def test_a_stream_started_at_a_block_deals_every_rank_what_it_would_have_read(store):
    """The resume rule: started at the first row of a block of rank 0 (the place its rows carry), the
    stream gives each rank exactly the rows it had from that block on, in the same order, the epoch's
    part order and each part's shuffle included; mid-part and mid-epoch."""
    from pipeline.data.heldout import store_part_ids
    from pipeline.data.store import read_manifest
    from pipeline.train.inputs import stored_parts
    from pipeline.train.stream import first_start

    _, _, store_path = store
    part_ids, dtype = store_part_ids(store_path), read_manifest(store_path)["capture_key"]["dtype"]
    parts = stored_parts(part_ids, dtype, False, set(), 0)
    whole = stream_ids(parts, first_start(0, 3))
    places = places_of_rank0_blocks(parts, first_start(0, 3))
    assert all(places[block]["row"] > 0 for block in (1, 3))  # both inside a part: its rows from there on
    for block in (1, 3):  # rank 0's 2nd and 4th blocks: global blocks 2 and 6
        start = {**places[block], "skip": 0, "end": 3}
        resumed = stream_ids(parts, start)
        assert resumed == [rows[16 * block :] for rows in whole], block


def test_a_feed_crosses_executions_and_resumes_across_them(store):
    """One rank's feed of a stream sized for one epoch an execution: it starts the next execution when
    one ends, every epoch gives every training row once, and a feed started at a position saved after
    the switch (a checkpoint's ``Prefetch.position``) takes exactly the rows the first feed took next."""
    import ray

    from pipeline.data.heldout import store_part_ids
    from pipeline.data.store import read_manifest
    from pipeline.train.batches import Prefetch, ShardFeed
    from pipeline.train.inputs import data_config, stored_parts
    from pipeline.train.stream import StreamStart, first_start, train_stream

    root, data, store_path = store
    part_ids, dtype = store_part_ids(store_path), read_manifest(store_path)["capture_key"]["dtype"]
    parts = stored_parts(part_ids, dtype, False, set(), 0)
    train = load_config("jobs/configs/tiny.yaml", ["train.batch_tokens=256"]).train
    hidden = read_manifest(store_path)["capture_key"]["hidden_size"]

    def batches(start: dict, count: int):
        actor = ray.remote(num_cpus=0)(StreamStart).remote()
        (shard,) = data_config().configure({"train": train_stream(parts, actor)}, 1, None, None)
        feed = ShardFeed(shard["train"], 0, 1, "cpu", train, actor, start, epochs=1)
        return Prefetch(feed, hidden, "draft", False, count, 1)

    first = batches(first_start(0, 1), 40)
    taken, saved = [], None
    for i in range(40):
        if i == 30:
            saved = first.position()
        taken.append(first.next()[1][0])
    rows = [sid for ids in taken for sid in ids]
    epochs = {int(r.split(":")[0]) for r in rows}
    assert len(epochs) >= 3  # at least two switches to a new execution
    for epoch in sorted(epochs)[:-1]:  # every finished epoch: each row once
        assert sorted(r.split(":")[1] for r in rows if r.startswith(f"{epoch}:")) == sorted(
            i for ids in part_ids.values() for i in ids
        )
    assert saved["epoch"] >= 1, saved  # saved after a switch
    first.close()
    again = batches(saved, 10)
    assert [again.next()[1][0] for _ in range(10)] == taken[30:40]
    again.close()


class ThreadCollective:
    """What ``HostCollective`` does over gloo, for ranks run as threads of this process: shared slots
    and a barrier."""

    def __init__(self, slots: list, barrier, rank: int):
        self.slots, self._barrier, self.rank = slots, barrier, rank

    @classmethod
    def ranks(cls, world: int) -> list["ThreadCollective"]:
        import threading

        slots, barrier = [None] * world, threading.Barrier(world, timeout=120)  # a rank that died: fail, not hang
        return [cls(slots, barrier, rank) for rank in range(world)]

    def barrier(self) -> None:
        self._barrier.wait()

    def gather(self, values: list[int]) -> list[list[int]]:
        self.slots[self.rank] = list(values)
        self._barrier.wait()
        everyone = [list(v) for v in self.slots]
        self._barrier.wait()  # nobody writes the next values before every rank has read these
        return everyone

    def most(self, values: list[int]) -> list[int]:
        return [max(column) for column in zip(*self.gather(values))]


def test_two_ranks_pack_their_own_rows_within_a_drift_and_resume_exactly(store, monkeypatch):
    """Two ranks (threads, agreeing as they do over gloo), each packing its own micro-batches from a
    stream sized for one epoch an execution: no rank runs more than DRIFT_ROWS and a micro-batch ahead
    of the other, and two feeds started at a position saved mid-run (after several switches, with a
    rank held back) take exactly the steps the first two took next, on each rank, reading none of the
    rows they had trained on again; and a step a rank's
    share of an execution cannot fill is refused on both."""
    import threading

    import ray

    from pipeline.data.heldout import store_part_ids
    from pipeline.data.store import read_manifest
    from pipeline.train import batches
    from pipeline.train.inputs import data_config, stored_parts
    from pipeline.train.stream import StreamStart, first_start, train_stream

    monkeypatch.setattr(batches, "DRIFT_ROWS", 0)  # any gap: this small stream barely drifts
    _, _, store_path = store
    part_ids, dtype = store_part_ids(store_path), read_manifest(store_path)["capture_key"]["dtype"]
    parts = stored_parts(part_ids, dtype, False, set(), 0)
    train = load_config("jobs/configs/tiny.yaml", ["train.batch_tokens=256"]).train
    hidden = read_manifest(store_path)["capture_key"]["hidden_size"]

    def run(start: dict, steps: int, micro: int = 1, epochs: int = 1):
        actor = ray.remote(num_cpus=0)(StreamStart).remote()
        splits = data_config().configure({"train": train_stream(parts, actor)}, 2, None, None)
        agree, taken, gaps, saved, errors = ThreadCollective.ranks(2), [[], []], [], {}, []
        again = [0, 0]  # bytes each rank read of rows it had trained on

        def rank(r):
            try:
                feed = batches.ShardFeed(splits[r]["train"], r, 2, "cpu", train, actor, start, epochs, agree[r])
                try:
                    prefetch = batches.Prefetch(feed, hidden, "draft", False, steps, micro)
                except ValueError as error:
                    feed.close()
                    return errors.append(str(error))
                read(r, feed, prefetch)
            except BaseException as error:  # the test thread raises it
                errors.append(error)
                agree[r]._barrier.abort()  # the other rank's agreement fails instead of waiting

        def read(r, feed, prefetch):
            for i in range(steps):
                at = prefetch.position()  # a checkpoint's, before step i (a collective)
                if r == 0:
                    saved[i] = at
                taken[r].append(prefetch.next()[1][0])
                gaps.append((feed.start["epoch"], i, r, feed.taken))
            again[r] = feed.read_again
            prefetch.close()

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
        [thread.start() for thread in threads]
        [thread.join() for thread in threads]
        ray.kill(actor)
        if failed := [e for e in errors if isinstance(e, BaseException)]:
            raise failed[0]
        assert again == [0, 0]  # the rows a rank skips at a resume come empty
        return taken, gaps, saved, errors

    taken, gaps, saved, _ = run(first_start(0, 1), 24)
    assert {int(i.split(":")[0]) for rows in taken[0] for i in rows} >= {0, 1, 2}  # two switches
    counts = {}
    for epoch, step, r, rows in gaps:  # rows each rank had taken after each step, by execution
        counts.setdefault((epoch, step), {})[r] = rows
    gap = [abs(c[0] - c[1]) for c in counts.values() if len(c) == 2]
    widest = max(len(rows) for ranks in taken for rows in ranks)
    assert max(gap) > batches.DRIFT_ROWS  # the bound was reached
    assert max(gap) <= batches.DRIFT_ROWS + widest, gap
    # a step after a switch at which the ranks were at different rows (in one block: this small store
    # keeps them within a row or two)
    step = next(i for i, at in saved.items() if at["epoch"] >= 1 and len(set(at["skips"])) > 1)
    again, _, _, _ = run(saved[step], 24 - step)
    assert again == [rows[step:] for rows in taken]
    # a step that a rank's share of a whole execution cannot fill is refused on every rank, by name
    *_, errors = run(first_start(0, 1), 1, micro=50)
    assert len(errors) == 2 and all("too small for this many workers" in e for e in errors), errors


def places_of_rank0_blocks(parts, start: dict) -> list[dict]:
    """The (epoch, part, row) of the first row of each block rank 0 of 2 reads."""
    import threading

    import ray

    from pipeline.train.inputs import data_config
    from pipeline.train.stream import POSITION, StreamStart, train_stream

    actor = ray.remote(num_cpus=0)(StreamStart).remote()
    ray.get(actor.set_stream_start.remote(start))
    splits = data_config().configure({"train": train_stream(parts, actor)}, 2, None, None)
    places: list[dict] = []

    def read(rank):
        for table in splits[rank]["train"].iter_batches(batch_size=None, batch_format="pyarrow"):
            if rank == 0:
                places.append({key: table[key][0].as_py() for key in POSITION})

    threads = [threading.Thread(target=read, args=(rank,)) for rank in (0, 1)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    ray.kill(actor)
    return places


def test_held_out_rows_are_read_from_their_own_parts(store):
    """Featurize plans the held-out samples (``train.eval_fraction``'s) into parts of their own: the eval
    dataset reads those parts only, the training stream none of them. At another fraction the parts
    mix, and both read and filter the mixed ones: the same rows either way."""
    import ray

    from pipeline.data.heldout import held_out_ids, heldout_parts, store_part_ids
    from pipeline.train.inputs import stored_eval, stored_parts
    from pipeline.train.stream import StreamStart, first_start, train_stream

    _, _, store_path = store
    parts = store_part_ids(store_path)
    ids = [i for part in parts.values() for i in part]
    actor = ray.remote(num_cpus=0)(StreamStart).remote()
    ray.get(actor.set_stream_start.remote(first_start(0, 1)))
    for fraction, pure in ((0.2, True), (0.3, False)):
        eval_ids = held_out_ids(ids, fraction)
        held, train = heldout_parts(parts, eval_ids)
        assert (not set(held) & set(train)) == pure and len(held) < len(parts)
        if pure:
            assert sum(len(parts[f]) for f in held) == len(eval_ids) == 8
        evaluated = [r["sample_id"] for r in stored_eval(parts, "bf16", False, eval_ids).iter_rows()]
        stream = train_stream(stored_parts(parts, "bf16", False, eval_ids, 0), actor)
        trained = [r["sample_id"] for r in stream.iter_rows()]
        assert sorted(evaluated) == sorted(eval_ids) and sorted(trained) == sorted(set(ids) - eval_ids)
    ray.kill(actor)


def test_materialize_auto_holds_what_fits_a_quarter_of_the_object_store(ray_local):
    import ray

    from pipeline.train.inputs import should_materialize

    room = ray.cluster_resources()["object_store_memory"]
    assert should_materialize("auto", int(0.25 * room)) and not should_materialize("auto", int(0.26 * room))
    assert should_materialize(True, 10 * int(room)) and not should_materialize(False, 0)


def test_bad_configs_fail_clearly(store, tmp_path):
    with pytest.raises(ValueError, match="draft.variant"):
        train_cfg(store, "bad", "draft.variant=medusa")
    other = train_cfg(store, "other", "target.tiny.hidden_size=32", "target.tiny.intermediate_size=64")
    with pytest.raises(ValueError, match="capture key|hidden_size|target"):
        run_train(other)
    with pytest.raises(ValueError, match="stage 7"):
        run_train(train_cfg(store, "x"), stage=7)


def test_init_from_must_be_a_draft_of_the_same_variant_and_target(tmp_path):
    from griffin.model import GriffinDraft
    from pipeline.resources.drafts import save_draft_with_lineage
    from pipeline.resources.targets import load_target
    from pipeline.train.driver import _checked_init

    cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}"])
    target = load_target(cfg.target)
    with pytest.raises(FileNotFoundError, match="config.json"):
        _checked_init(
            cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": str(tmp_path)})}), target
        )
    eagle = save_draft_with_lineage(GriffinDraft.for_target(target, variant="eagle"), tmp_path / "eagle", target)
    bad = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}", f"train.init_from={eagle}"])
    with pytest.raises(ValueError, match="'eagle' draft but draft.variant='griffin'"):
        _checked_init(bad, target)
    good = load_config(
        "jobs/configs/tiny.yaml", [f"output_dir={tmp_path}", f"train.init_from={eagle}", "draft.variant=eagle"]
    )
    assert _checked_init(good, target) == str(Path(eagle).resolve())
    other = load_target(load_config("jobs/configs/tiny.yaml", ["target.tiny.num_hidden_layers=1"]).target)
    with pytest.raises(ValueError, match="target_weights_sha256: recorded"):
        _checked_init(good, other)


def test_stage_lr_decay_spans_the_stage_unless_total_steps_is_set(tmp_path):
    """The worker gets the driver's stage plan: the linear decay ends with the stage (total_steps =
    stage steps) unless the YAML sets total_steps itself; the LR has one home, the schedule."""
    from pipeline.train.driver import stage_plan

    cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}"])
    stages = cfg.train.schedule
    assert [stage_plan(cfg, s).total_steps for s in stages] == [s.steps for s in stages]
    assert [stage_plan(cfg, s).lr for s in stages] == [s.lr for s in stages]
    pinned = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}", "train.method.total_steps=800000"])
    assert stage_plan(pinned, stages[0]).total_steps == 800000


@pytest.mark.parametrize("key", ["train.method.variant=hass", "train.method.stage=2", "train.method.lr=0.001"])
def test_keys_that_would_do_nothing_are_errors(key):
    """variant, stage and lr live in draft.variant and train.schedule: in train.method they are refused."""
    with pytest.raises(ValueError, match="unknown key"):
        load_config("jobs/configs/tiny.yaml", [key])


def test_stage_lr_defaults_follow_the_official_recipe():
    from griffin.config import StagePlan

    assert [StagePlan.for_stage(j, "griffin", steps=10).lr for j in (1, 2, 3)] == [5e-5, 3e-5, 3e-5]
    assert StagePlan.for_stage(2, "hass", steps=10).alignment_mask is False


@pytest.mark.parametrize("tied", [False, True])
def test_a_worker_reads_the_embedding_and_head_but_never_the_target(monkeypatch, tmp_path, tied):
    """A training worker's draft (with ``draft.init_layer``) equals the one built from the whole target,
    but the worker never loads the target: it reads the embedding, the head, the final norm and the one
    layer by name from the target's sharded safetensors files, and nothing else."""
    import pipeline.resources.targets as targets
    import pipeline.train.worker as train
    from griffin.target_parts import read_target_parts
    from pipeline.resources.targets import build_tiny_target, load_target

    tiny = load_config("jobs/configs/tiny.yaml").target.tiny | {"tie_word_embeddings": tied}
    saved = build_tiny_target(tiny, torch.float32)
    saved.model.save_pretrained(tmp_path / "target", max_shard_size="100KB")  # several files and an index
    saved.tokenizer.save_pretrained(tmp_path / "target")
    cfg = load_config("jobs/configs/tiny.yaml", ["draft.init_layer=-1", f"target.name={tmp_path / 'target'}"])
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"tiny": None})})
    whole = load_target(cfg.target)
    reference = train._init_draft(cfg, whole, None, None)

    def no_whole_target(*args, **kwargs):
        raise AssertionError("a worker loaded the whole target")

    monkeypatch.setattr(targets, "load_target", no_whole_target)
    read = []

    def reading(*args, **kwargs):
        read.append(read_target_parts(*args, **kwargs))
        return read[-1]

    monkeypatch.setattr(targets, "read_target_parts", reading)
    draft, head = train._worker_draft(cfg, None, None, "cpu")
    assert torch.equal(head, whole.head_weight) and torch.equal(draft.embed_weight, whole.embed_weight)
    assert head.data_ptr() == draft.head_weight.data_ptr()  # the full head once, not a second copy
    assert (draft.embed_weight.data_ptr() == head.data_ptr()) == tied
    theirs = reference.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in draft.state_dict().items())
    layer, other = (sum(t.nbytes for t in whole.backbone.layers[i].parameters()) for i in (-1, 0))
    borrowed = whole.embed_weight.nbytes + (0 if tied else whole.head_weight.nbytes) + layer
    (parts,) = read  # exactly those tensors and the final norm; never the other layer
    assert parts.bytes_read == borrowed + whole.backbone.norm.weight.nbytes <= parts.file_bytes - other


@pytest.mark.timeout(900)
def test_online_features_train_the_same_weights_as_the_store(store, schedule_run):
    """``train.features=online``: the target actors featurize the planned parts as the two workers read
    them, nothing is written, and stage 1 ends with the stored run's weights, bit for bit."""
    clean, _ = schedule_run
    online = train_cfg(store, "online", "train.schedule=[{stage: 1, steps: 4, lr: 0.002}]", "train.features=online")
    online = online.model_copy(update={"data": online.data.model_copy(update={"limit": None})})  # the store's 40
    summary = run_train(online)
    reference, weights = final_weights(clean), final_weights(online)
    assert all(torch.equal(reference[k], weights[k]) for k in reference)
    provenance = json.loads((Path(summary["best"]) / "config.json").read_text())["provenance"]
    assert provenance["features"] == "online" and provenance["store"] is None
    assert not (online.run_dir / "features").exists()


def resumed_rows(parts, start: dict) -> list[dict]:
    """The rows of ``parts``' stream started at ``start``, unsplit: (epoch, part, row), id, features."""
    import ray

    from pipeline.train.stream import StreamStart, train_stream

    actor = ray.remote(num_cpus=0)(StreamStart).remote()
    ray.get(actor.set_stream_start.remote(start))
    stream = train_stream(parts, actor)
    stream.context.execution_options.preserve_order = True  # as training reads it (data_config)
    rows = [
        {k: row[k] for k in ("epoch", "part", "row", "sample_id", "seq_len", "hidden")} for row in stream.iter_rows()
    ]
    ray.kill(actor)
    return rows


def test_a_resumed_stream_reads_no_row_a_rank_trained_on(store):
    """A resume's stream, read from the store or featurized online, holds every row from its place on
    where it was, but leaves empty (not read, not featurized) the rows of its first part before its
    row and the rows each rank trained on (its first ``skips[rank]`` rows); online and offline alike."""
    from pipeline.data.featurize import prepare_samples
    from pipeline.data.heldout import held_out_ids, store_part_ids
    from pipeline.resources.targets import load_target
    from pipeline.train.inputs import ROWS_PER_BLOCK, materialized_parts, online_parts, packed_part, stored_parts
    from pipeline.train.stream import first_start

    _, _, store_path = store
    part_ids = store_part_ids(store_path)
    eval_ids = held_out_ids([i for ids in part_ids.values() for i in ids], 0.2)
    offline = stored_parts(part_ids, "bf16", False, eval_ids, 0)
    whole = resumed_rows(offline, first_start(0, 2))
    first = next(i for i in range(20, len(whole)) if whole[i]["row"] > 0)  # inside a part
    at = whole[first]
    assert len(whole) > first + 2 * ROWS_PER_BLOCK
    # rank 0 skips its first block (a part or more, left unread whole) and 3 rows of its second
    start = {"epoch": 0, "part": at["part"], "row": at["row"], "skips": [ROWS_PER_BLOCK + 3, 5], "end": 2}
    cfg = train_cfg(store, "online-resume", "train.features=online", "train.seed=0", "data.limit=null")
    key, samples, _ = prepare_samples(cfg, load_target(cfg.target))
    online, _ = online_parts(cfg, key, samples, eval_ids)
    count = online.counts[at["part"]]
    assert count - at["row"] <= ROWS_PER_BLOCK  # the first part: every row skipped, none featurized
    item = {"stream_epoch": [0], "stream_part": [at["part"]], "stream_from": [at["row"]], "stream_count": [count]}
    packed = packed_part({**item, "stream_skip": [str(at["row"])]}, online.holds, 0)  # what the target actors get
    assert len(packed["sample_id"][0]) == len(packed["lengths"][0]) == count - at["row"] - 1
    assert sum(packed["lengths"][0].as_py()) == len(packed["input_ids"][0])
    for parts in (offline, materialized_parts(offline), online):
        rows = resumed_rows(parts, start)
        assert [(r["part"], r["row"]) for r in rows] == [(r["part"], r["row"]) for r in whole[first:]]
        for slot, (row, was) in enumerate(zip(rows, whole[first:])):
            block, within = divmod(slot, ROWS_PER_BLOCK)
            trained = (block // 2) * ROWS_PER_BLOCK + within < start["skips"][block % 2]
            assert (row["seq_len"] == 0) == trained, slot
            if not trained:
                assert (row["sample_id"], bytes(row["hidden"])) == (was["sample_id"], bytes(was["hidden"]))


def test_a_resumed_part_reads_only_the_row_groups_of_its_rows(tmp_path, monkeypatch):
    """A row group a row (``write_part``): the read task of a resume's first part reads the file's
    footer and the row groups of its rows, not the rows before them nor the skipped ones."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from pipeline.data import part_files
    from pipeline.data.store import part_table, write_part
    from pipeline.train.inputs import needed_rows, read_part

    count, tokens, hidden = 8, 64, 1024  # 128 KiB of features a row, past the 64 KiB footer read
    noise = np.random.default_rng(0)
    rows = {
        "sample_id": [f"s{i}" for i in range(count)],
        "input_ids": [np.arange(tokens, dtype=np.int32)] * count,
        "loss_mask": [np.ones(tokens, np.uint8)] * count,
        "hidden": [noise.bytes(tokens * hidden * 2) for _ in range(count)],
    }
    write_part(str(tmp_path), "part-0.parquet", part_table(rows, "bf16", hidden))
    path = str(tmp_path / "part-0.parquet")
    read: list[int] = []

    class Counted(pafs.LocalFileSystem):
        def open_input_file(self, path):
            source = open(path, "rb")
            original = source.read

            def counted(*args):
                data = original(*args)
                read.append(len(data))
                return data

            source.read = counted
            return pa.PythonFile(source, mode="r")

    monkeypatch.setattr(part_files, "location_fs", lambda location: (Counted(), location))
    item = {"stream_epoch": [0], "stream_part": [0], "stream_from": [2], "stream_count": [count], "stream_skip": ["3"]}
    columns = ["sample_id", "input_ids", "loss_mask", "seq_len", "hidden"]
    table = read_part(item, [path], columns, [], seed=0)
    needed = needed_rows(item, 0)
    assert table["train_index"].to_pylist() == needed and len(needed) == count - 3
    assert table["sample_id"].to_pylist() == [f"s{i}" for i in needed]
    meta = pq.ParquetFile(path).metadata
    group = [
        sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns)) for g in range(count)
    ]
    assert meta.num_row_groups == count
    assert sum(read) <= sum(group[g] for g in needed) + (64 << 10) < sum(group)
