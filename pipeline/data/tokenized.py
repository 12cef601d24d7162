"""Tokenizing conversations on Ray Data: ``map_batches`` tasks render the chat template, tokenize
and build the loss mask (``pipeline.data.sources.build_sample``) spread over the cluster's CPUs,
instead of one loop on the driver. The driver keeps what it needs to plan parts and hold out rows:
the tokens and masks (a few bytes a token, next to a feature store's kilobytes a token)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.data.sources import Conversation, Ledger, Sample, SkipSample, build_sample

CONVERSATIONS_PER_TASK = 256


def _tokenize_batch(batch: pa.Table, tokenizer: Any, max_len: int, end_ids: list[int]) -> pa.Table:
    """Conversations (sample_id, messages JSON, where) -> samples, or the reason a row was skipped."""
    out: dict[str, list] = {k: [] for k in ("sample_id", "input_ids", "loss_mask", "truncated", "skip", "detail")}
    for sample_id, messages, where in zip(*(batch.column(c).to_pylist() for c in ("sample_id", "messages", "where"))):
        conversation = Conversation(sample_id, tuple(json.loads(messages)), where)
        try:
            sample = build_sample(conversation, tokenizer, max_len, set(end_ids))
            ids, mask, truncated, skip, detail = sample.input_ids, sample.loss_mask, sample.truncated, "", ""
        except SkipSample as error:
            ids, mask, truncated, skip, detail = [], [], False, error.reason, error.detail
        for key, value in zip(out, (sample_id, ids, mask, truncated, skip, detail)):
            out[key].append(value)
    types = {"input_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.uint8())}
    return pa.table({k: pa.array(v, types.get(k)) for k, v in out.items()})


def tokenize_conversations(
    conversations: list[Conversation], tokenizer: Any, max_len: int, end_ids: list[int], ledger: Ledger
) -> list[Sample]:
    """The samples of ``conversations`` in their order; skipped ones go to ``ledger`` (on a running Ray)."""
    import ray

    if not conversations:
        return []
    where = {c.sample_id: c.where for c in conversations}
    items = [
        {"sample_id": c.sample_id, "messages": json.dumps(list(c.messages)), "where": c.where} for c in conversations
    ]
    dataset = ray.data.from_items(items).map_batches(
        _tokenize_batch,
        batch_size=CONVERSATIONS_PER_TASK,
        batch_format="pyarrow",
        fn_kwargs={"tokenizer": tokenizer, "max_len": max_len, "end_ids": list(end_ids)},
    )
    dataset.context.execution_options.preserve_order = True  # samples and ledger in source order
    samples = []
    for table in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        for row in table.to_pylist():
            if row["skip"]:
                ledger.add(row["sample_id"], row["skip"], where[row["sample_id"]], row["detail"])
            else:
                ids, mask = np.asarray(row["input_ids"], np.int32), np.asarray(row["loss_mask"], np.uint8)
                samples.append(Sample(row["sample_id"], ids, mask, row["truncated"]))
    return samples
