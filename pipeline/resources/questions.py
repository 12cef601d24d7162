"""Evaluation question sets: the shipped EAGLE/GRIFFIN MT-Bench and HumanEval files (``question_sets/``,
sha256-checked) by name, or any FastChat-format JSONL by path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.files import packaged_file


# name -> (file in question_sets/, sha256): the files are the exact EAGLE/GRIFFIN benchmark questions
QUESTION_SETS = {
    "mt_bench": ("mt_bench.jsonl", "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    "humaneval": ("humaneval.jsonl", "ce0244e2b228339e9a11afc63a151719beede1e389fdaec7cd9751d33902180e"),
    "humaneval_164": ("humaneval_164.jsonl", "48d211b0f7d442643d4740543ee80d456d86387171a4d4ec490cde0e6076947e"),
}


def question_set(name: str) -> Path:
    """A shipped question set by name (sha256-checked), or a FastChat-format JSONL path."""
    if name in QUESTION_SETS:
        filename, expected = QUESTION_SETS[name]
        path = packaged_file("pipeline.resources", "question_sets", filename)
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != expected:
            raise FileNotFoundError(
                f"question set {name!r}: {path} is missing or modified; reinstall the package "
                "(`make setup`) or pass a FastChat-format JSONL path in eval.datasets"
            )
        return path
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"eval dataset {name!r} is neither one of {sorted(QUESTION_SETS)} nor an existing "
            "FastChat-format JSONL file"
        )
    return path


def load_questions(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """FastChat question format: one JSON object a line with ``question_id`` and ``turns`` (user turns)."""
    path = question_set(name)
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg}); expected FastChat question format") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{number}: 'turns' must be a non-empty list of strings (FastChat format)")
        questions.append({"question_id": record.get("question_id", number), "turns": turns})
    return questions[:limit] if limit else questions
