"""``griffin regenerate``: the target writes its own answers to the training conversations
(docs/method.md §3.6; the set's format: docs/design.md §5.1).

A draft learns to predict the target, so it trains best on text the target itself would write, not
on another model's answers. The driver selects the conversations of ``regenerate.source`` (any
``data.source`` form), drops those already regenerated, and cuts the rest into parts. A Ray Data
actor pool of ``PartRegenerator``s, each loading the target once (the same loader as featurize),
answers every user turn of a part's conversations in order, with the target's chat template and
its own earlier answers as the history, in left-padded batches, and writes the part atomically.
The driver records each finished part in the manifest as it arrives (provenance: the target's
fingerprint, sampling, source), so a killed run resumes with every conversation exactly once.

``data.source: regenerated`` trains on the result (``cfg.regenerated_path``); ``griffin run`` then
runs this stage first.

Shape legend: B conversations in a generation batch, P prompt tokens (left-padded), N new tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from pipeline import console
from pipeline.config import RunConfig, TargetSection
from pipeline.data.part_files import next_index
from pipeline.data.parts import PartActor, PartProgress, injected_faults, run_part_actors
from pipeline.data.chat import render_chat
from pipeline.resources.identity import target_fingerprint, target_identity
from pipeline.resources.targets import load_target
from pipeline.runtime import ensure_ray
from pipeline.data.sources import Conversation, Ledger, load_conversations
from pipeline.lock import store_lease
from pipeline.data.store import open_for_writing, write_manifest, write_part

logger = logging.getLogger(__name__)

KIND = "regenerated"  # the manifest's "kind": what sources.py recognises a regenerated set by
FAULT_ENV = "GRIFFIN_REGENERATE_FAIL_AFTER"  # fault injection for tests: actors raise after this many parts


def _pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, left-padded so that every row's next token is at column P."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, longest - len(prompt) :], mask[b, longest - len(prompt) :] = torch.tensor(prompt), 1
    return ids, mask


class Regenerator:
    """Conversations -> the same user turns with the target's own answers. Usable without Ray.

    ``settings``: temperature, top_p, max_new_tokens (per turn), batch_size and max_len (the
    tokens a conversation may reach: training truncates there, so no turn starts past it and no
    answer runs past it)."""

    def __init__(self, target: dict[str, Any], settings: dict[str, Any]):
        self.target = load_target(TargetSection(**target))
        self.settings = settings
        tokenizer = self.target.tokenizer
        self.stop_ids = self.target.stop_token_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        """One left-padded batch through HF ``generate``: each prompt's new tokens up to (without)
        its first stop token, and whether a stop token ended it (False: cut at max_new_tokens, or
        where the longest prompt reaches max_len)."""
        ids, mask = _pad_left(prompts, self.pad_id)  # (B, P)
        room = self.settings["max_len"] - max(len(p) for p in prompts)
        sampled = self.settings["temperature"] > 0
        torch.manual_seed(seed)
        out = self.target.model.generate(
            input_ids=ids.to(self.target.device),
            attention_mask=mask.to(self.target.device),
            max_new_tokens=max(1, min(self.settings["max_new_tokens"], room)),
            do_sample=sampled,
            temperature=self.settings["temperature"] if sampled else None,
            top_p=self.settings["top_p"] if sampled else None,
            top_k=None,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
        )[:, ids.shape[1] :].cpu()  # (B, N)
        answers = []
        for row in out.tolist():
            stops = [i for i, token in enumerate(row) if token in self.stop_ids]
            answers.append((row[: stops[0]], True) if stops else (row, False))
        return answers

    def answer(
        self, conversations: list[list[dict[str, str]]], seed: int = 0
    ) -> tuple[list[list[dict]], list[int], dict[str, int]]:
        """Every conversation's user turns answered in order, turn by turn across the conversations
        (a batch holds the same turn of several conversations). Returns the regenerated message
        lists (a conversation ends before a turn that would pass max_len, or whose answer is empty),
        the tokens generated for each, and counts: tokens, answers cut at max_new_tokens, turns dropped."""
        tokenizer, settings = self.target.tokenizer, self.settings
        users = [[m for m in c if m["role"] == "user"] for c in conversations]
        histories = [[m for m in c[:1] if m["role"] == "system"] for c in conversations]
        alive = list(range(len(conversations)))
        counts = {"tokens": 0, "cut": 0, "dropped_turns": 0}
        generated = [0] * len(conversations)  # new tokens per conversation, stop tokens included
        for turn in range(max((len(u) for u in users), default=0)):
            prompts = {}
            for i in alive:
                if turn < len(users[i]):
                    prompt = render_chat(tokenizer, histories[i] + [users[i][turn]])
                    if len(prompt) < settings["max_len"]:
                        prompts[i] = prompt
            counts["dropped_turns"] += sum(turn < len(users[i]) for i in alive) - len(prompts)
            order = sorted(prompts, key=lambda i: len(prompts[i]))  # similar lengths batch with little padding
            alive = []
            for start in range(0, len(order), settings["batch_size"]):
                group = order[start : start + settings["batch_size"]]
                batch_seed = seed * 1_000_003 + turn * 1009 + start
                for i, (tokens, stopped) in zip(group, self.generate([prompts[i] for i in group], batch_seed)):
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    counts["tokens"] += len(tokens) + stopped
                    generated[i] += len(tokens) + stopped
                    counts["cut"] += not stopped
                    if not text.strip():
                        counts["dropped_turns"] += 1
                        continue
                    histories[i] += [users[i][turn], {"role": "assistant", "content": text}]
                    alive.append(i)
        return histories, generated, counts


class PartRegenerator(PartActor):
    """The Ray Data actor: one planned part per row of ``batch`` -> answers -> a part file.
    Returns one JSON ``entry`` per part: its manifest entry and the conversations it had to skip."""

    fault_env = FAULT_ENV

    def __init__(
        self,
        target: dict[str, Any],
        settings: dict[str, Any],
        out: str,
        fingerprint: dict[str, Any],
        fail_after: int | None = None,
        kill_once: str | None = None,
    ):
        self.regenerator = Regenerator(target, settings)
        super().__init__(target_fingerprint(self.regenerator.target), fingerprint, fail_after, kill_once)
        self.out = out

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"entry": np.asarray([json.dumps(self.write(json.loads(item))) for item in batch["part"]])}

    def write(self, part: dict[str, Any]) -> dict[str, Any]:
        conversations = part["conversations"]
        name = self.next_part(part["index"], [c["sample_id"] for c in conversations])
        started = time.perf_counter()
        messages, generated, counts = self.regenerator.answer([c["messages"] for c in conversations], part["seed"])
        answered = [any(m["role"] == "assistant" for m in turns) for turns in messages]
        skipped = [
            {
                "sample_id": c["sample_id"],
                "reason": "no_answer",
                "where": c["where"],
                "detail": "no user turn fit data.max_len with a non-empty answer",
            }
            for c, ok in zip(conversations, answered)
            if not ok
        ]
        kept = [i for i, ok in enumerate(answered) if ok]
        entry = None
        if kept:
            table = pa.table(
                {
                    "sample_id": pa.array([conversations[i]["sample_id"] for i in kept], pa.string()),
                    "seq_len": pa.array([generated[i] for i in kept], pa.int32()),  # generated tokens
                    "where": pa.array([conversations[i]["where"] for i in kept], pa.string()),
                    "messages": pa.array([json.dumps(messages[i], ensure_ascii=False) for i in kept]),
                }
            )
            entry = write_part(self.out, name, table)
            self.written()
        return {
            "part": entry,
            "skipped": skipped,
            "rows": len(part["conversations"]),
            **counts,
            "seconds": time.perf_counter() - started,
        }


def plan_parts(conversations: list[Conversation], cfg: RunConfig, first: int = 0) -> list[dict[str, Any]]:
    """Parts of ``regenerate.conversations_per_part`` conversations, each with its plan index (from
    ``first``: ``part_name``) and a seed derived from its first conversation (a resumed run samples a
    part the same way whatever ran before it)."""
    size, parts = cfg.regenerate.conversations_per_part, []
    for start in range(0, len(conversations), size):
        chunk = conversations[start : start + size]
        seed = int(hashlib.sha256(f"{cfg.regenerate.seed}:{chunk[0].sample_id}".encode()).hexdigest()[:8], 16)
        parts.append(
            {
                "index": first + len(parts),
                "seed": seed,
                "conversations": [
                    {"sample_id": c.sample_id, "where": c.where, "messages": list(c.messages)} for c in chunk
                ],
            }
        )
    return parts


def capture_key(cfg: RunConfig, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """What every part of one regenerated set must share: the target, the sampling and the prompts' source."""
    settings = cfg.regenerate
    return {
        **fingerprint,
        "kind": KIND,
        "source": settings.source,
        "format": cfg.data.format,
        "system_prompt": cfg.data.system_prompt,
        "temperature": settings.temperature,
        "top_p": settings.top_p if settings.temperature > 0 else 1.0,
        "max_new_tokens": settings.max_new_tokens,
        "max_len": cfg.data.max_len,
        # only when set, so that sets regenerated before revisions were recorded keep their key
        **({"source_revision": cfg.prompt_data.revision} if cfg.prompt_data.revision else {}),
    }


def _regenerate_parts(
    cfg: RunConfig, parts: list[dict], fingerprint: dict, manifest: dict, progress: PartProgress
) -> None:
    ensure_ray(cfg)
    settings = {
        "temperature": cfg.regenerate.temperature,
        "top_p": cfg.regenerate.top_p,
        "max_new_tokens": cfg.regenerate.max_new_tokens,
        "batch_size": cfg.regenerate.batch_size,
        "max_len": cfg.data.max_len,
    }
    run_part_actors(
        cfg,
        PartRegenerator,
        [{"part": json.dumps(part)} for part in parts],
        cfg.regenerated_path,
        manifest,
        progress,
        "regeneration",
        dict(
            target=cfg.target.model_dump(),
            settings=settings,
            out=cfg.regenerated_path,
            fingerprint=fingerprint,
            **injected_faults(FAULT_ENV),
        ),
    )


def run_regenerate(cfg: RunConfig) -> dict[str, Any]:
    """Regenerate ``regenerate.source``'s conversations into ``cfg.regenerated_path`` (resuming)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with store_lease(cfg.regenerated_path, "griffin regenerate"):
        return _regenerate_store(cfg)


def _regenerate_store(cfg: RunConfig) -> dict[str, Any]:
    """Regenerate into ``cfg.regenerated_path``, its lease held."""
    target = target_identity(cfg.target)  # the actors load it; the driver needs none of its weights
    fingerprint = target_fingerprint(target)
    ledger = Ledger()
    conversations = load_conversations(cfg.prompt_data, ledger)
    try:
        key = capture_key(cfg, fingerprint)
        manifest, done = open_for_writing(cfg.regenerated_path, key, cfg.resolved(), lambda: target.weights_sha256)
    except ValueError as error:
        raise ValueError(
            f"regenerated set {cfg.regenerated_path} was made differently ({error}); set "
            "regenerate.output to a new location or delete the old set"
        ) from None
    carried = [s for s in manifest["skipped"] if s["reason"] == "no_answer"]
    done |= {s["sample_id"] for s in carried}
    manifest["skipped"], manifest["selected"], manifest["kind"] = ledger.entries + carried, len(conversations), KIND
    todo = [c for c in conversations if c.sample_id not in done]
    logger.info(
        "regenerate: %d conversations selected, %d already in %s, %d to do; skipped: %s",
        len(conversations),
        len(conversations) - len(todo),
        cfg.regenerated_path,
        len(todo),
        ledger.counts(),
    )
    progress = PartProgress("regenerate", len(todo))
    if todo:
        _regenerate_parts(cfg, plan_parts(todo, cfg, next_index(manifest["files"])), fingerprint, manifest, progress)
        progress.console.close(f"{progress.tokens} tokens generated")
    manifest["complete"] = progress.rows == len(todo)
    write_manifest(cfg.regenerated_path, manifest)
    console.say(
        f"[regenerate] {cfg.regenerated_path}: {manifest['totals']['rows']} conversations"
        f"{'' if todo else ' (already complete)'}"
    )
    elapsed = time.perf_counter() - progress.start
    return {
        "output": cfg.regenerated_path,
        "complete": manifest["complete"],
        "rows": manifest["totals"]["rows"],
        "new_rows": progress.rows,
        "new_tokens": progress.tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(progress.tokens / max(elapsed, 1e-9), 1),
        "skipped": Ledger(manifest["skipped"]).counts(),
    }
