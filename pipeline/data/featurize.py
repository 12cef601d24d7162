"""Featurize: run the target over conversations into the Parquet feature store (docs/design.md
§5).

The driver loads the target (for its tokenizer and fingerprint), selects and tokenizes the
conversations (``pipeline.data.sources``), drops the sample ids the store already holds, and cuts the
rest into parts of similar lengths. A Ray Data actor pool of ``PartWriter``s, each loading the
target once, runs ``Featurizer`` over one part per call and writes it atomically; the driver
records every finished part in the manifest as it arrives, so a killed run resumes where it
stopped and only a finished run marks the store complete.

Shape legend: B conversations in a forward batch, T tokens, D hidden.
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from griffin.target import TargetAdapter
from pipeline import console
from pipeline.config import RunConfig, TargetSection
from pipeline.runtime import ensure_ray
from pipeline.data.heldout import held_out_ids
from pipeline.data.integrity import repair_command, repair_store, verify_store
from pipeline.data.part_files import next_index
from pipeline.data.parts import PartActor, PartProgress, carry, injected_faults, run_part_actors
from pipeline.data.sources import Ledger, Sample, load_conversations
from pipeline.resources.identity import TargetIdentity, target_fingerprint, target_identity
from pipeline.resources.targets import feature_layers, load_target
from pipeline.lock import store_lease
from pipeline.data.store import (
    ACTOR_REASONS,
    LAYER,
    encode_hidden,
    open_for_writing,
    part_table,
    write_manifest,
    write_part,
)

logger = logging.getLogger(__name__)

FAULT_ENV = "GRIFFIN_FEATURIZE_FAIL_AFTER"  # fault injection for tests: actors raise after this many parts
PART_BYTES = 256 << 20  # feature bytes per part file: big enough to stream, small enough to resume often
PARTS_PER_ACTOR = 8


def token_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Indices grouped longest first so that B * T_max <= batch_tokens (a longer one goes alone).
    E.g. lengths [3, 9, 4, 8], budget 16 -> [[1], [3], [2, 0]] (9 alone: 2 * 9 > 16; 8 alone; 4 and 3)."""
    groups, group = [], []
    for index in np.argsort(-lengths, kind="stable"):
        if group and (len(group) + 1) * lengths[group[0]] > batch_tokens:
            groups.append(np.asarray(group))
            group = []
        group.append(index)
    return groups + ([np.asarray(group)] if group else [])


def _objects(items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)  # (B,) one entry per row, never stacked into 2-D
    out[:] = items
    return out


class Featurizer:
    """Tokenized conversations -> rows with the target's post-norm last-layer features (and the
    hidden states of ``layers``, when set).

    ``batch``: ``sample_id`` (B,), ``input_ids`` and ``loss_mask`` (B,) arrays of (T_i,) arrays.
    Returns the same plus ``seq_len`` (B,), ``hidden`` (B,) bytes, ``error`` (B,) ("" or
    "non_finite"), for fp8 ``scales`` (B,) arrays of (T_i,) fp32, and with layers ``layers`` (B,)
    bytes of (T_i, k, D) [+ ``layer_scales`` (B,) arrays of (T_i * k,) fp32]. Usable without Ray."""

    def __init__(
        self, target: dict[str, Any], dtype: str = "bf16", batch_tokens: int = 8192, layers: tuple[int, ...] = ()
    ):
        self.target = load_target(TargetSection(**target))
        self.dtype, self.batch_tokens, self.layers = dtype, batch_tokens, tuple(layers)
        self.pad_id = getattr(self.target.tokenizer, "pad_token_id", None) or 0

    @torch.inference_mode()
    def forward(self, sequences: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Right-padded batch through the backbone; each sequence's (T_i, D) final features and
        (T_i, k, D) layer features (None without layers)."""
        longest = max(len(s) for s in sequences)
        tokens = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)  # (B, T)
        attention = torch.zeros(len(sequences), longest, dtype=torch.long)  # (B, T)
        for b, sequence in enumerate(sequences):
            tokens[b, : len(sequence)], attention[b, : len(sequence)] = torch.from_numpy(sequence.astype(np.int64)), 1
        device = self.target.device
        out = self.target.backbone(
            input_ids=tokens.to(device),
            attention_mask=attention.to(device),
            output_hidden_states=list(self.layers) or None,
        )
        features = out.last_hidden_state.cpu()  # (B, T, D), after the final norm (docs/method.md §1)
        stacked = (
            torch.stack([out.hidden_states[i].cpu() for i in self.layers], dim=2) if self.layers else None
        )  # (B, T, k, D)
        # right padding never reaches these
        return [
            (features[b, : len(s)], None if stacked is None else stacked[b, : len(s)]) for b, s in enumerate(sequences)
        ]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        lengths = np.asarray([len(ids) for ids in batch["input_ids"]], dtype=np.int32)  # (B,)
        n = len(lengths)
        hidden, scales, error = [b""] * n, [None] * n, [""] * n
        layers, layer_scales = [b""] * n, [None] * n
        for group in token_batches(lengths, self.batch_tokens):
            for i, (features, stacked) in zip(group, self.forward([batch["input_ids"][i] for i in group])):
                if not torch.isfinite(features).all() or (stacked is not None and not torch.isfinite(stacked).all()):
                    error[i] = "non_finite"
                    continue
                hidden[i], scales[i] = encode_hidden(features, self.dtype)
                if stacked is not None:  # (T, k, D) -> (T * k, D): an fp8 scale per token and layer
                    layers[i], layer_scales[i] = encode_hidden(stacked.reshape(-1, stacked.shape[-1]), self.dtype)
        out = {**batch, "seq_len": lengths, "hidden": _objects(hidden), "error": np.asarray(error)}
        if self.layers:
            out["layers"] = _objects(layers)
            out |= {"layer_scales": _objects(layer_scales)} if self.dtype == "fp8" else {}
        return out | ({"scales": _objects(scales)} if self.dtype == "fp8" else {})


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


class PartWriter(PartActor):
    """The Ray Data actor: one planned part per row of ``batch`` -> features -> a part file.
    Returns one JSON ``entry`` per part: its manifest entry and the samples it had to skip."""

    fault_env = FAULT_ENV

    def __init__(
        self,
        target: dict[str, Any],
        store: str,
        dtype: str,
        batch_tokens: int,
        fingerprint: dict[str, Any],
        fail_after: int | None = None,
        layers: tuple[int, ...] = (),
        kill_once: str | None = None,
    ):
        self.featurizer = Featurizer(target, dtype, batch_tokens, tuple(layers))
        super().__init__(target_fingerprint(self.featurizer.target), fingerprint, fail_after, kill_once)
        self.store, self.dtype = store, dtype

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"entry": np.asarray([json.dumps(self.write(batch, i)) for i in range(len(batch["lengths"]))])}

    def write(self, batch: dict[str, np.ndarray], i: int) -> dict[str, Any]:
        part = unpack_part(batch, i)
        name = self.next_part(int(batch["index"][i]), part["sample_id"].tolist())
        table, rows = featurize_part(self.featurizer, part, self.dtype)
        ok = rows["error"] == ""
        skipped = [
            {"sample_id": s, "reason": e, "where": "featurize", "detail": "NaN/inf in the target's features"}
            for s, e in zip(rows["sample_id"][~ok], rows["error"][~ok])
        ]
        entry = None
        if table.num_rows:
            entry = write_part(self.store, name, table)
            entry["node"] = _node_id()  # where it ran: placement is auditable on a cluster
            self.written()
        return {"part": entry, "skipped": skipped, "rows": len(ok), "tokens": int(rows["seq_len"].sum())}


class PartFeatures(PartActor):
    """Online training's Ray Data actor: one planned part per call -> the part's rows with their
    features, the table a part file would hold (nothing is written), and each row's ``train_index``
    when the part says which of its training rows it holds (``pipeline.train.inputs.packed_part``).
    Rows with non-finite features are dropped, as featurize drops them from the store."""

    def __init__(self, target: dict[str, Any], dtype: str, batch_tokens: int, fingerprint: dict, layers=()):
        self.featurizer = Featurizer(target, dtype, batch_tokens, tuple(layers))
        super().__init__(target_fingerprint(self.featurizer.target), fingerprint, None)
        self.dtype = dtype

    def __call__(self, batch: dict[str, np.ndarray]):
        assert len(batch["lengths"]) == 1, "one part per call (batch_size=1): a part is one block"
        if not len(batch["lengths"][0]):  # a resume's part whose every row the ranks had trained on
            return carry(self._no_rows(), batch)
        table, rows = featurize_part(self.featurizer, unpack_part(batch, 0), self.dtype)
        if "train_index" in batch:
            index = np.asarray(batch["train_index"][0], np.int64)[rows["error"] == ""]
            table = table.append_column("train_index", pa.array(index, pa.int64()))
        return carry(table, batch)

    def _no_rows(self) -> pa.Table:
        """A part table of no rows, with ``train_index``."""
        names = ("sample_id", "input_ids", "loss_mask", "hidden", "scales", "layers", "layer_scales")
        table = part_table(
            dict.fromkeys(names, []), self.dtype, self.featurizer.target.hidden_size, self.featurizer.layers
        )
        return table.append_column("train_index", pa.array([], pa.int64()))


def unpack_part(batch: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Planned part ``i`` of an actor's batch (flat tokens + lengths) -> columns of (B,) rows."""
    cuts = np.cumsum(batch["lengths"][i])[:-1]  # flat tokens -> one array per conversation
    return {
        "sample_id": np.asarray(batch["sample_id"][i]),
        "input_ids": _objects(np.split(batch["input_ids"][i], cuts)),
        "loss_mask": _objects(np.split(batch["loss_mask"][i], cuts)),
    }


def featurize_part(featurizer: Featurizer, part: dict[str, np.ndarray], dtype: str):
    """A part's rows through the target -> (the table of its finite rows, the featurizer's rows)."""
    rows = featurizer(part)
    ok = rows["error"] == ""
    table = part_table({k: v[ok] for k, v in rows.items()}, dtype, featurizer.target.hidden_size, featurizer.layers)
    return table, rows


def group_parts(
    samples: list[Sample], cfg: RunConfig, hidden_size: int, layers: int = 0, heldout: set[str] | None = None
) -> list[list[Sample]]:
    """Length-sorted runs of samples (little padding), each at most ``file_rows`` rows and
    ``PART_BYTES`` of features, and at least ``PARTS_PER_ACTOR`` per actor, so every actor gets
    work, progress shows often and a kill loses little; the ``heldout`` samples (training's held-out
    set, ``pipeline.data.heldout``) in runs of their own, so that training reads them apart. Parts go
    out in a seeded random order: readers stream files in name order (= order written), and a
    longest-first order would feed training long conversations first and short ones last.
    ``layers``: feature layers per token."""
    heldout = heldout or set()
    parts = _runs([s for s in samples if s.sample_id not in heldout], cfg, hidden_size, layers)
    parts += _runs([s for s in samples if s.sample_id in heldout], cfg, hidden_size, layers)
    order = np.random.default_rng(cfg.data.shuffle_seed or 0).permutation(len(parts))
    return [parts[i] for i in order]


def _runs(samples: list[Sample], cfg: RunConfig, hidden_size: int, layers: int) -> list[list[Sample]]:
    bytes_per_token = hidden_size * (1 + layers) * (2 if cfg.features.dtype == "bf16" else 1)
    share = math.ceil(len(samples) / (PARTS_PER_ACTOR * cfg.features.num_actors))
    max_rows = min(cfg.features.file_rows, max(1, share))
    max_tokens = max(1, PART_BYTES // bytes_per_token)
    parts, current, tokens = [], [], 0
    for sample in sorted(samples, key=lambda s: (len(s.input_ids), s.sample_id)):
        if current and (len(current) >= max_rows or tokens + len(sample.input_ids) > max_tokens):
            parts.append(current)
            current, tokens = [], 0
        current.append(sample)
        tokens += len(sample.input_ids)
    return parts + ([current] if current else [])


def pack_part(part: list[Sample], index: int = 0) -> dict[str, Any]:
    """A part as one actor input row: its plan index (``part_name``), sample ids, lengths and the
    concatenated tokens and masks."""
    return {
        "index": index,
        "sample_id": [s.sample_id for s in part],
        "lengths": np.asarray([len(s.input_ids) for s in part], np.int32),
        "input_ids": np.concatenate([s.input_ids for s in part]),
        "loss_mask": np.concatenate([s.loss_mask for s in part]),
    }


def plan_parts(
    samples: list[Sample],
    cfg: RunConfig,
    hidden_size: int,
    layers: int = 0,
    first: int = 0,
    heldout: set[str] | None = None,
) -> list[dict[str, Any]]:
    """``group_parts``, packed for the actors, with plan indices from ``first`` (past the parts a
    resumed store already holds: ``next_index``)."""
    groups = group_parts(samples, cfg, hidden_size, layers, heldout)
    return [pack_part(part, first + i) for i, part in enumerate(groups)]


def capture_key(cfg: RunConfig, target) -> dict[str, Any]:
    """What every stored row depends on: the target's fingerprint and how its features were taken."""
    key = {
        **target_fingerprint(target),
        "layer": LAYER,
        "post_norm": True,
        "dtype": cfg.features.dtype,
        "max_len": cfg.data.max_len,
        "system_prompt": cfg.data.system_prompt,
    }  # both change every row
    if layers := feature_layers(cfg, target):  # absent without: stores from before feature layers keep their key
        key["feature_layers"] = list(layers)
    if cfg.training_data.revision:  # likewise: the hub dataset's rows at this revision only
        key["data_revision"] = cfg.training_data.revision
    return key


def target_part(key: dict[str, Any]) -> dict[str, Any]:
    """The target fingerprint within a capture key: what every actor's own target load must match."""
    capture = ("layer", "post_norm", "dtype", "max_len", "system_prompt", "feature_layers", "data_revision")
    return {k: v for k, v in key.items() if k not in capture}


def prepare_samples(
    cfg: RunConfig, target: TargetAdapter | TargetIdentity
) -> tuple[dict[str, Any], list[Sample], Ledger]:
    """Capture key, tokenized samples and the ledger; ``target``: the driver's, without its weights
    (``pipeline.resources.identity.target_identity``). Tokenizing runs on Ray Data
    (``pipeline.data.tokenized``), spread over the cluster's CPUs."""
    from pipeline.data.tokenized import tokenize_conversations

    key, ledger = capture_key(cfg, target), Ledger()
    conversations = load_conversations(cfg.training_data, ledger)
    ensure_ray(cfg)
    samples = tokenize_conversations(conversations, target.tokenizer, cfg.data.max_len, target.stop_token_ids, ledger)
    return key, samples, ledger


def _featurize_parts(cfg: RunConfig, parts: list[dict], key: dict, manifest: dict, progress: PartProgress) -> None:
    ensure_ray(cfg)
    fingerprint = target_part(key)
    run_part_actors(
        cfg,
        PartWriter,
        parts,
        cfg.store_path,
        manifest,
        progress,
        "featurization",
        dict(
            target=cfg.target.model_dump(),
            store=cfg.store_path,
            dtype=cfg.features.dtype,
            batch_tokens=cfg.features.batch_tokens,
            fingerprint=fingerprint,
            layers=tuple(key.get("feature_layers", ())),
            **injected_faults(FAULT_ENV),
        ),
    )


def _verify(store: str, repair: bool) -> dict[str, Any]:
    """``--verify``: the store's problems, or its sound state; with ``--repair`` first dropping repeated rows."""
    repaired = repair_store(store) if repair else []
    for line in repaired:
        console.say(f"[featurize] repaired {store}: {line}")
    if problems := verify_store(store):
        repeats = any("repeated rows" in p for p in problems)
        raise ValueError(
            f"feature store {store} failed verification:\n  "
            + "\n  ".join(problems)
            + (f"\nfix repeated rows: `{repair_command(store)}`" if repeats else "")
            + "\nfix damaged parts: delete the named part files and rerun `griffin featurize` with the store's "
            "config (resume re-featurizes their samples)"
        )
    return {"store": store, "ok": True, "repaired": repaired}


def run_featurize(cfg: RunConfig, verify: str | None = None, repair: bool = False) -> dict[str, Any]:
    """Featurize ``cfg``'s conversations into ``cfg.store_path`` (resuming), or verify (and repair) a store."""
    if repair and verify is None:
        raise ValueError("--repair goes with --verify STORE: `griffin featurize -c CONFIG --verify STORE --repair`")
    if verify is not None:
        with store_lease(verify, "griffin featurize --verify --repair") if repair else nullcontext():
            return _verify(verify, repair)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with store_lease(cfg.store_path, "griffin featurize"):
        return _featurize_store(cfg)


def _featurize_store(cfg: RunConfig) -> dict[str, Any]:
    """Featurize into ``cfg.store_path``, its lease held."""
    target = target_identity(cfg.target)  # the actors load it; the driver needs none of its weights
    key, samples, ledger = prepare_samples(cfg, target)
    manifest, done = open_for_writing(cfg.store_path, key, cfg.resolved(), lambda: target.weights_sha256)
    carried = [s for s in manifest["skipped"] if s["reason"] in ACTOR_REASONS]
    manifest["skipped"], manifest["selected"] = ledger.entries + carried, len(samples)
    todo = [s for s in samples if s.sample_id not in done]
    logger.info(
        "featurize: %d samples selected, %d already in %s, %d to do; skipped so far: %s",
        len(samples),
        len(samples) - len(todo),
        cfg.store_path,
        len(todo),
        ledger.counts(),
    )
    progress = PartProgress("featurize", len(todo), sum(len(s.input_ids) for s in todo))
    if todo:
        layers = len(key.get("feature_layers", ()))
        heldout = held_out_ids([s.sample_id for s in samples], cfg.train.eval_fraction)  # of all, not just todo
        parts = plan_parts(todo, cfg, key["hidden_size"], layers, next_index(manifest["files"]), heldout)
        _featurize_parts(cfg, parts, key, manifest, progress)
    manifest["complete"] = progress.rows == len(todo)  # every selected sample is in a part or the ledger
    write_manifest(cfg.store_path, manifest)
    totals = manifest["totals"]
    if todo:
        progress.console.close(f"{progress.rows}/{progress.total_rows} conversations")
    console.say(
        f"[featurize] store {cfg.store_path}: {totals['rows']} conversations, {totals['tokens']} tokens"
        f"{'' if todo else ' (already complete)'}"
    )
    rate = progress.tokens / max(progress.elapsed, 1e-9)
    return {
        "store": cfg.store_path,
        "complete": manifest["complete"],
        **{k: totals[k] for k in ("files", "rows", "tokens", "bytes", "bytes_per_token")},
        "new_rows": progress.rows,
        "new_tokens": progress.tokens,
        "seconds": round(progress.elapsed, 2),
        "tokens_per_s": round(rate, 1),
        "skipped": Ledger(manifest["skipped"]).counts(),
    }
