"""The distribution: its name and licence, dependency ranges in pyproject.toml against the exact pins of
constraints.txt, and ``griffin --version``. Read from the files (and one subprocess), nothing installed."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from pipeline.cli import DISTRIBUTION

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def constraints() -> dict[str, str]:
    """name -> exact version of every ``name==version`` line of constraints.txt (names normalised)."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.]+", version.strip()), f"constraints.txt: {line!r} is not an exact pin"
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_name_and_licence():
    assert PROJECT["name"] == DISTRIBUTION != "griffin-pipeline"  # griffin-pipeline: the old, unpublishable name
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_dependencies_are_ranges_and_constraints_pin_each_exactly():
    pins = constraints()
    requirements = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["test"]]
    for req in requirements:
        operators = {spec.operator for spec in req.specifier}
        # a range: installable beside other packages, yet never an untested major
        assert operators == {">=", "<"}, f"{req}: want name>=LOW,<NEXT_MAJOR"
        name = normalise(req.name)
        assert name in pins, f"{req.name} has no exact pin in constraints.txt"
        assert req.specifier.contains(pins[name]), f"constraints.txt pins {req.name}=={pins[name]}, outside {req}"
    assert pins["torch"] == "2.13.0"  # the local CPU wheel here; the CUDA wheel of PyPI in the GPU image


def test_griffin_version_prints_the_distribution_version():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--version"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"griffin {PROJECT['version']}"
