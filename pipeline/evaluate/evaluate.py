"""Evaluation: acceptance length and speedup against baselines, measured the way the paper does.

``run_eval(cfg, draft=None) -> summary`` writes ``<run_dir>/eval/`` (report.json, report.md,
generations.jsonl, tau.png, speedup.png, acceptance_histogram.png) and logs it to MLflow, tagged with
the draft's registered model version. While it runs, ``eval/unfinished.jsonl`` holds the finished
questions, so a killed evaluation resumes (``EvalLedger``); ``eval/finished.json``, written last, lets
``griffin run`` reuse a completed one with the same key (``eval_key``). Protocol and metric definitions:
``pipeline.evaluate.report.DEFINITIONS`` (docs/design.md §8, docs/method.md §6): every question turn goes
through every method back to back (GRIFFIN, vanilla in the same implementation, ``extra_drafts``, HF
``generate``, HF prompt lookup, HF assisted generation), same prompt, budget, sampling and seed. With ``through_serve`` GRIFFIN and vanilla
go through the HTTP endpoint (client-side wall time); the rest stay in-process.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any


from griffin.checkpoint import tensors_sha256
from griffin.decode import first_divergence as divergence_at
from griffin.policy import SpeculationPolicy
from griffin.offline import warm_up
from pipeline.files import atomic_write_json, atomic_write_text, finished, reuse_key
from pipeline.config import RunConfig
from pipeline.console import Progress, say
from pipeline.resources.drafts import draft_for_run
from pipeline.resources.questions import load_questions
from pipeline.resources.identity import FILES, WEIGHTS, target_fingerprint
from pipeline.resources.targets import load_decoding_target
from pipeline.data.chat import render_chat
from pipeline.evaluate.methods import Method, Output, build_methods, load_drafts
from pipeline.evaluate.report import log_report, machine_identity, summarize, write_reports

logger = logging.getLogger(__name__)
WARMUP_TOKENS = 16
FINISHED = "finished.json"  # {"key", "summary"} of the last completed evaluation in eval/


def _turn_records(
    name: str,
    temperature: float,
    question: dict,
    turn: int,
    prompt_ids: list[int],
    outputs: dict[str, Output],
    target: Any,
) -> list[dict[str, Any]]:
    """One record per method for one question turn; at T=0 a method that differs from vanilla is logged
    with its first divergence (a near tie in the target's logits is a warning, anything else an error)."""
    records = []
    for method, out in outputs.items():
        divergence = None
        if temperature == 0 and out.accepted_per_round is not None and _differs(out, outputs["vanilla"]):
            divergence = first_divergence(target, prompt_ids, out, outputs["vanilla"])
            log = logger.warning if divergence["near_tie"] else logger.error
            log(
                "%s question %s turn %d: %s differs from vanilla at T=0: %s",
                name,
                question["question_id"],
                turn + 1,
                method,
                divergence,
            )
        records.append(
            {
                "dataset": name,
                "temperature": temperature,
                "question_id": question["question_id"],
                "turn": turn + 1,
                "method": method,
                "prompt_tokens": len(prompt_ids),
                "new_tokens": out.new_tokens,
                "seconds": out.seconds,
                "tokens_per_s": out.new_tokens / out.seconds,
                "text": out.text,
                "tokens": out.tokens,
                "accepted_per_round": out.accepted_per_round,
                "draft_seconds": out.draft_seconds,
                "verify_seconds": out.verify_seconds,
                "mismatch": divergence is not None,
                "divergence": divergence,
            }
        )
    return records


def evaluate_dataset(
    name: str,
    questions: list[dict],
    temperature: float,
    methods: dict[str, Method],
    cfg: RunConfig,
    target: Any,
    progress: Progress | None = None,
    ledger: "EvalLedger | None" = None,
) -> list[dict[str, Any]]:
    """Every turn of every question through every method, interleaved; one record per generation.
    ``progress`` counts question turns; a question already in ``ledger`` is taken from it, and each
    finished question is added to it."""
    records, names, sampling = [], list(methods), cfg.sampling(temperature)
    for index, question in enumerate(questions):
        done = ledger.get(name, temperature, index) if ledger is not None else None
        if done is not None:
            records += done
            if progress is not None:
                progress.update(progress.done + len(question["turns"]), f"{name} T={temperature:g} (resumed)")
            continue
        first = len(records)
        order = names[index % len(names) :] + names[: index % len(names)]
        messages: list[dict[str, str]] = []
        for turn, user_text in enumerate(question["turns"]):
            messages.append({"role": "user", "content": user_text})
            prompt_ids = render_chat(target.tokenizer, messages)
            max_new = min(cfg.eval.max_new_tokens, target.max_context - len(prompt_ids))
            if max_new < 1:
                logger.warning(
                    "%s question %s turn %d: the prompt fills the context; skipped",
                    name,
                    question["question_id"],
                    turn + 1,
                )
                break
            seed = cfg.eval.seed + 1000 * turn + index
            outputs = {method: methods[method](messages, prompt_ids, sampling, max_new, seed) for method in order}
            records += _turn_records(name, temperature, question, turn, prompt_ids, outputs, target)
            messages.append({"role": "assistant", "content": outputs["griffin"].text})
            if progress is not None:
                progress.update(progress.done + 1, f"{name} T={temperature:g}")
        if ledger is not None:
            ledger.add(name, temperature, index, records[first:])
    return records


class EvalLedger:
    """The finished questions of one evaluation, appended and fsync'd as each finishes, so that a
    killed ``griffin eval`` reruns only the questions it had not finished. Each question's methods
    still run back to back in one process, so its per-question ratios stay interleaved. A ledger
    is reused only by a rerun with the same ``key`` (config, target and draft weights); the reports
    replace it when the evaluation completes."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        self.done: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
        lines = path.read_text().splitlines() if path.is_file() else []
        header = _json_or_none(lines[0]) if lines else None
        if header is not None and header.get("key") == key:
            for line in lines[1:]:
                item = _json_or_none(line)
                if item is None:  # the line a kill cut short, and nothing after it
                    break
                self.done[(item["dataset"], float(item["temperature"]), item["index"])] = item["records"]
        elif lines:
            logger.warning("%s: an unfinished evaluation with other settings, target or drafts; starting over", path)
        # rewritten without a cut-short tail before anything is appended
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            path,
            "".join(
                json.dumps(entry) + "\n"
                for entry in [{"key": key}]
                + [{"dataset": d, "temperature": t, "index": i, "records": r} for (d, t, i), r in self.done.items()]
            ),
        )

    @property
    def resumed(self) -> int:
        return len(self.done)

    def get(self, dataset: str, temperature: float, index: int) -> list[dict[str, Any]] | None:
        return self.done.get((dataset, float(temperature), index))

    def add(self, dataset: str, temperature: float, index: int, records: list[dict[str, Any]]) -> None:
        with open(self.path, "a") as out:
            out.write(
                json.dumps({"dataset": dataset, "temperature": temperature, "index": index, "records": records}) + "\n"
            )
            out.flush()
            os.fsync(out.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


# Settings that change where a through-Serve evaluation's endpoint listens, never what it measures: a rerun
# on another port reuses the finished evaluation.
ENDPOINT_ADDRESS = ("host", "port")


def eval_key(cfg: RunConfig, target: Any, drafts: dict[str, Any]) -> str:
    """What decides an evaluation's results: the whole config but where the endpoint listens, the target's
    identity (files or weights), every draft's weights (an alias such as @candidate may point at new weights
    between two runs) and the machine (the speeds are this machine's)."""
    config = cfg.model_dump(mode="json")
    config["serve"] = {k: v for k, v in config["serve"].items() if k not in ENDPOINT_ADDRESS}
    identity = {
        "config": config,
        "target": {k: v for k, v in target_fingerprint(target).items() if k in (FILES, WEIGHTS)},
        "drafts": {label: tensors_sha256(draft.state_dict()) for label, draft in drafts.items()},
        "machine": machine_identity(),
    }
    return reuse_key(identity)


def finished_summary(eval_dir: Path, key: str) -> dict[str, Any] | None:
    """The summary of a finished evaluation in ``eval_dir`` with this ``key``, else None."""
    data = finished(eval_dir / FINISHED, key)
    return data["summary"] if data is not None else None


def first_divergence(target: Any, prompt_ids: list[int], spec: Output, vanilla: Output) -> dict[str, Any]:
    """``griffin.decode.first_divergence`` of two outputs; without token ids (the endpoint) the gap is
    unknown and the divergence is reported as not a near-tie."""
    if spec.tokens is None or vanilla.tokens is None:
        return {"index": None, "gap": None, "near_tie": False}
    return divergence_at(target, prompt_ids, spec.tokens, vanilla.tokens)


def _differs(spec: Output, vanilla: Output) -> bool:
    if spec.tokens is not None and vanilla.tokens is not None:
        return spec.tokens != vanilla.tokens
    return spec.text != vanilla.text


def _warm_up(methods: dict[str, Method], target: Any, cfg: RunConfig, drafts: dict[str, Any]) -> None:
    """Untimed: compiled decode steps are captured (griffin.offline.warm_up), then each method decodes once."""
    if not cfg.eval.through_serve:
        warm_up(target, None, SpeculationPolicy({1: None}))
        for draft in drafts.values():
            warm_up(target, draft, SpeculationPolicy({1: cfg.eval_tree}))
    messages = [{"role": "user", "content": "Say hello."}]
    prompt_ids = render_chat(target.tokenizer, messages)
    for method in methods.values():
        method(messages, prompt_ids, cfg.sampling(0.0), min(WARMUP_TOKENS, cfg.eval.max_new_tokens), cfg.eval.seed)


def run_eval(cfg: RunConfig, draft: Any = None, reuse_finished: bool = False) -> dict[str, Any]:
    """``griffin eval``: every dataset x temperature, every method; reports + MLflow; returns the summary.
    With ``reuse_finished`` (``griffin run``), a finished evaluation with the same key is not redone."""
    target = load_decoding_target(cfg)
    questions = {name: load_questions(name, cfg.eval.num_questions) for name in cfg.eval.datasets}
    draft_model, draft_uri = draft_for_run(cfg, target, draft)
    drafts = load_drafts(cfg, target, draft_model)
    eval_dir, key = cfg.run_dir / "eval", eval_key(cfg, target, drafts)
    finished = finished_summary(eval_dir, key) if reuse_finished else None
    if finished is not None:
        say(f"evaluation of {draft_uri} with these settings already in {eval_dir}: reused")
        return finished
    (eval_dir / FINISHED).unlink(missing_ok=True)  # the reports below are about to be replaced
    methods, started = build_methods(cfg, target, drafts, draft_uri)
    ledger = EvalLedger(eval_dir / "unfinished.jsonl", key)
    turns = sum(len(q["turns"]) for items in questions.values() for q in items) * len(cfg.eval.temperatures)
    progress = Progress("evaluate", turns, f"question turns x {len(methods)} methods")
    if ledger.resumed:
        logger.warning("resuming an unfinished evaluation: %d questions done in an earlier run", ledger.resumed)
    try:
        _warm_up(methods, target, cfg, drafts)
        records = [
            record
            for name, items in questions.items()
            for temperature in cfg.eval.temperatures
            for record in evaluate_dataset(name, items, temperature, methods, cfg, target, progress, ledger)
        ]
    finally:
        if started:
            from pipeline.serve.lifecycle import stop_serve

            stop_serve()
    report = summarize(records, list(methods), cfg, target, draft_uri)
    report["summary"]["resumed_questions"] = ledger.resumed
    write_reports(eval_dir, report, records)
    ledger.remove()
    report["summary"]["mlflow_run_id"] = log_report(cfg, report, eval_dir, draft_uri)
    # written last, atomically: a kill before this line leaves no finished evaluation to reuse
    atomic_write_json(eval_dir / FINISHED, {"key": key, "summary": report["summary"]})
    progress.close(f"report {eval_dir / 'report.md'}")
    return report["summary"]
