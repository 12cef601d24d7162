"""Import rules (docs/design.md §2): griffin/ never imports ray, mlflow, accelerate or pipeline, and each
pipeline package imports only the packages below it. Read from the source (AST), imports inside
functions included, so nothing has to be imported to check it."""

from __future__ import annotations

import ast
import re
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


PACKAGES = ["griffin", "pipeline", "pipeline.config", *ALLOWED]


def package_doc(package: str) -> str:
    return ast.get_docstring(ast.parse((REPO / Path(*package.split(".")) / "__init__.py").read_text())) or ""


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_docstring_names_each_of_its_modules(package):
    """A reader of a package's ``__init__`` learns every module in it: each is named as ``module``."""
    doc, folder = package_doc(package), REPO / Path(*package.split("."))
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    modules += sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file())  # subpackages
    missing = [m for m in modules if f"``{m}``" not in doc]
    assert not missing, f"{package}/__init__.py does not name {missing}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_stage_docstrings_may_import_list_is_the_rule_tested_here(package):
    """The "May import:" sentence names exactly the pipeline packages ``ALLOWED`` lets it import (the
    pipeline root, which every package may use, in words)."""
    doc = " ".join(package_doc(package).split())
    sentence = re.search(r"May import: (.*?)(?:\. |\.$)", doc)
    assert sentence, f"{package}: no 'May import:' sentence"
    named = set(re.findall(r"``(pipeline(?:\.\w+)+)``", sentence.group(1)))
    assert named == ALLOWED[package], f"{package}: docstring {sorted(named)}, rule {sorted(ALLOWED[package])}"
    assert "pipeline root" in sentence.group(1)


def test_griffin_says_it_imports_no_pipeline_ray_or_mlflow():
    doc = package_doc("griffin")
    assert all(name in doc for name in ("never ray", "mlflow", "``pipeline``")), doc


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


def test_the_readme_stays_a_front_door():
    """README.md is read first: at most 150 lines; the detail lives in docs/ and benchmarks/."""
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines: move detail to docs/ or benchmarks/"


def test_what_ray_data_and_the_stage_channel_unpickle_imports_no_torch():
    """A training stage's Ray Data processes (split coordinators, dataset managers, read tasks), its
    channel actor and whatever unpickles its job import the modules of the functions and classes they run: neither torch nor
    transformers, each of which costs seconds of CPU in every such process."""
    import subprocess
    import sys

    modules = ["pipeline.train.stream", "pipeline.train.inputs", "pipeline.train.channel", "pipeline.data.part_files"]
    modules.append("pipeline.train.job")  # the stage's job, unpickled by Ray Train's controller
    probe = f"import sys; import {', '.join(modules)}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout
