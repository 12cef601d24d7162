"""pipeline.files: completion markers are written whole (the one atomic write) and a marker that is not
whole marks nothing done."""

import ast
from pathlib import Path

from pipeline.files import atomic_write_json, finished, read_marker

REPO = Path(__file__).resolve().parents[2]


def test_a_cut_short_marker_marks_nothing_done(tmp_path):
    marker = tmp_path / "_complete.json"
    assert read_marker(marker) is None
    atomic_write_json(marker, {"stage": 1, "key": "k"})
    assert read_marker(marker) == {"stage": 1, "key": "k"} and finished(marker, "k")
    marker.write_bytes(marker.read_bytes()[:7])  # what a kill mid-write left before writes were atomic
    assert read_marker(marker) is None and finished(marker, "k") is None
    marker.write_bytes(b"\xff\xfe")
    assert read_marker(marker) is None
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_pipeline_writes_json_only_through_the_atomic_write():
    """No ``path.write_text(json.dumps(...))``: a kill mid-write would leave a marker or report cut short."""
    found = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "write_text" and node.args:
                argument = node.args[0]
                if isinstance(argument, ast.Call) and getattr(argument.func, "attr", None) == "dumps":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"non-atomic JSON writes: {found}"
