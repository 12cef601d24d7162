"""Import rules (docs/design.md §2): griffin/ never imports ray, mlflow, accelerate or pipeline, and each
pipeline package imports only the packages below it. Read from the source (AST), imports inside
functions included, so nothing has to be imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_GRIFFIN = {"ray", "mlflow", "accelerate", "pipeline"}
SHARED = {
    "pipeline.config",
    "pipeline.console",
    "pipeline.runtime",
    "pipeline.files",
    "pipeline.lock",
}  # any package may use these
# package -> the pipeline packages (or modules) it may import besides itself and SHARED
ALLOWED = {
    "pipeline.resources": set(),
    "pipeline.data": {"pipeline.resources"},
    "pipeline.train": {"pipeline.data", "pipeline.resources"},
    "pipeline.registry": {"pipeline.resources"},
    "pipeline.serve": {"pipeline.resources", "pipeline.data.chat"},
    "pipeline.evaluate": {"pipeline.serve", "pipeline.registry", "pipeline.resources", "pipeline.data.chat"},
}
ENTRY = {"pipeline.cli", "pipeline.run", "pipeline.submit"}  # the root modules that run stages: may import all


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every absolute module an import statement in ``path`` names (``from a.b import c`` -> a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def is_module(name: str) -> bool:
    path = REPO / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.mark.parametrize("path", sources("griffin"), ids=lambda p: p.name)
def test_griffin_imports_no_pipeline_ray_or_mlflow(path):
    """The method library stays single-process PyTorch."""
    bad = {name for name in imports(path) if name.split(".")[0] in FORBIDDEN_IN_GRIFFIN}
    assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def allowed(importer: str, name: str) -> bool:
    if importer in ENTRY or any(within(name, shared) for shared in SHARED) or name == "pipeline":
        return True
    if importer in SHARED:  # the shared root modules use each other only
        return False
    package = next(p for p in ALLOWED if within(importer, p))
    return within(name, package) or any(within(name, ok) for ok in ALLOWED[package])


@pytest.mark.parametrize("path", sources("pipeline"), ids=lambda p: str(p.relative_to(REPO / "pipeline")))
def test_pipeline_imports_follow_the_stage_order(path):
    """A stage package imports only the packages its docstring names (``ALLOWED``)."""
    importer = module_name(path)
    names = {name for name in imports(path) if within(name, "pipeline") and is_module(name)}
    bad = sorted(name for name in names if not allowed(importer, name))
    assert not bad, f"{importer} imports {bad} against the documented direction"


def test_pipeline_root_stays_small():
    """The stages live in packages; the root keeps the shared and entry modules only."""
    root = sorted(p.name for p in (REPO / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 8, root
    assert set(p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").is_file()) >= set(
        name.split(".")[1] for name in ALLOWED
    )


def test_every_package_says_what_it_owns():
    """Each package's ``__init__`` opens with a docstring naming what it may import."""
    for init in [*(REPO / "pipeline").rglob("__init__.py"), REPO / "griffin" / "__init__.py"]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init.relative_to(REPO)} has no docstring saying what it may import"


MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 70


@pytest.mark.parametrize("path", sources("griffin") + sources("pipeline"), ids=lambda p: str(p.relative_to(REPO)))
def test_library_modules_and_functions_stay_small(path):
    """A library module holds at most 450 lines and a function at most 70: split by job, not by accident."""
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{path.relative_to(REPO)}: {text.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(REPO)}: {long}"


def test_what_ray_data_and_the_stage_channel_unpickle_imports_no_torch():
    """A training stage's Ray Data processes (split coordinators, dataset managers, read tasks) and its
    channel actor import the modules of the functions and class they run: neither torch nor
    transformers, each of which costs seconds of CPU in every such process."""
    import subprocess
    import sys

    modules = ["pipeline.train.stream", "pipeline.train.feed", "pipeline.train.channel", "pipeline.data.layout"]
    probe = f"import sys; import {', '.join(modules)}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout
