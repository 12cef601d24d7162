"""Every benchmark script imports (its work sits under ``if __name__ == "__main__"``), so a moved or renamed
project function cannot leave a script dead without a failing test."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "benchmarks").rglob("*.py"))


def _runs_only_as_main(tree: ast.Module) -> bool:
    """No top-level statement but imports, definitions, assignments, docstrings and the ``__main__`` guard."""
    quiet = (
        ast.Import,
        ast.ImportFrom,
        ast.FunctionDef,
        ast.AsyncFunctionDef,
        ast.ClassDef,
        ast.Assign,
        ast.AnnAssign,
        ast.If,
        ast.Expr,
        ast.Try,
    )
    return all(isinstance(node, quiet) for node in tree.body)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO / "benchmarks")))
def test_benchmark_script_imports(script, monkeypatch):
    """The script's project imports resolve and importing it runs nothing."""
    tree = ast.parse(script.read_text())
    assert _runs_only_as_main(tree), f"{script.name}: top-level work outside `if __name__ == '__main__'`"
    monkeypatch.syspath_prepend(str(script.parent))  # scripts that import a sibling script
    monkeypatch.setattr(sys, "argv", [str(script)])
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


PROJECT_IMPORT = re.compile(r"^\s*from ((?:pipeline|griffin)[\w.]*) import ([\w, ]+)", re.MULTILINE)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO / "benchmarks")))
def test_project_imports_in_script_templates_resolve(script):
    """Project imports anywhere in a script, the code it runs in a subprocess included, name real things."""
    for module_name, names in PROJECT_IMPORT.findall(script.read_text()):
        module = importlib.import_module(module_name)
        for name in (n.strip().split(" as ")[0] for n in names.split(",")):
            if name and not hasattr(module, name):
                importlib.import_module(f"{module_name}.{name}")  # a submodule, or the ImportError names it


def test_make_test_time_reads_a_make_test_log(monkeypatch):
    """The recorder of `make test`'s cost reads pytest's summary, the 15 slowest tests and `time`'s real."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "scale_out"))
    from make_test_time import parse

    log = "\n".join(
        [
            ".venv/bin/python -m pytest -q --durations=15 -n 2 --dist loadscope tests",
            "264.75s call     tests/test_e2e_resume.py::test_interrupted_run",
            "110.42s setup    tests/pipeline/test_train.py::test_a_schedule_of_stages_two_workers",
            "1 failed, 842 passed, 9 skipped, 1 error, 132 warnings in 1417.68s (0:23:37)",
            "",
            "real\t25m8.782s",
            "user\t17m26.954s",
        ]
    )
    run = parse(log)
    assert run["counts"] == {"failed": 1, "passed": 842, "skipped": 9, "error": 1}
    assert (run["pytest_s"], run["wall_s"], run["workers"]) == (1417.68, 1508.8, 2)
    assert [(s["s"], s["phase"]) for s in run["slowest"]] == [(264.75, "call"), (110.42, "setup")]
