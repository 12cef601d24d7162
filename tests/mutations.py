"""Planted bugs the suite must catch: a mutation check to rerun whenever the sampling code changes.

Each mutation below rewrites one line of the sampling code (griffin/verify.py, tree.py, engine.py, request.py) in a scratch copy of
the checkout, then runs the method tests there (the law tests first, stopping at the first failure).
A mutation the tests do not catch is reported as SURVIVED and the script exits 1. Not part of
`make test`: each mutation costs a pytest start-up, and a surviving one the whole method suite.

    .venv/bin/python tests/mutations.py            # every mutation
    .venv/bin/python tests/mutations.py -k warper  # those whose name contains "warper"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERIFY, TREE, ENGINE, REQUEST = "griffin/verify.py", "griffin/tree.py", "griffin/engine.py", "griffin/request.py"
# (name, file, the line's text as it is, what it becomes)
MUTATIONS = [
    ("warper: temperature squared", VERIFY, "logits.float() / rows.temperature", "logits.float() / rows.temperature**2"),
    ("warper: top-k keeps one more", VERIFY, "kth = top.gather(-1, (rows.top_k - 1).clamp(min=0, max=top.shape[-1] - 1))",
     "top = logits.topk(rows.max_top_k + 1, dim=-1).values; kth = top.gather(-1, rows.top_k)"),
    ("warper: top-p keeps less", VERIFY, ">= rows.top_p", ">= 0.9 * rows.top_p"),
    ("the race runs on the raw softmax", VERIFY, "race = warp_rows(logits, rows).double()",
     "race = logits.double().softmax(-1)"),
    ("the race's draws are uniform, not exponential", VERIFY, "return -torch.log((_shift_right(z, 12)",
     "return ((_shift_right(z, 12)"),
    ("the walk follows the argmax's child", VERIFY, "(tokens == choice[:, None])",
     "(tokens == logits[batch, node].argmax(-1)[:, None])"),
    ("every depth reads the root's law", VERIFY, "choose(logits[batch, node], rows", "choose(logits[batch, 0 * node], rows"),
    ("every depth shares one draw", VERIFY, "rows, keys[:, d])", "rows, keys[:, 0])"),
    ("a leaf's bonus is its parent's draw", VERIFY, "chosen.append(torch.where(alive, choice, -1))",
     "chosen.append(torch.where(alive, choice, -1) if d == 0 or d < depth else chosen[-1])"),
    ("keys from position i - 1", REQUEST, "position_keys(self.seed, len(self.out), count)",
     "position_keys(self.seed, max(len(self.out) - 1, 0), count)"),
    ("engine: a round reuses its first key", ENGINE, "[row.keys(depth + 1) for row in self.rows]",
     "[row.keys(1) * (depth + 1) for row in self.rows]"),
    ("engine: a row walked with its neighbour's logits", ENGINE, "walk(batch.tokens, batch.parents, logits,",
     "walk(batch.tokens, batch.parents, logits.roll(1, 0),"),
    ("the draft's race reads the next level's draws", TREE, "self.keys[:, level - 1]",
     "self.keys[:, level % self.keys.shape[1]]"),
    ("the draft's race on its unwarped law", TREE, "warp_rows(logits.reshape(-1, V), self.rows.repeat(per_row))",
     "logits.reshape(-1, V).softmax(-1)"),
    ("engine: the draft ranks by its own law at T>0", ENGINE, "return DraftRace.of(draft, sampling, keys)", "return None"),
    ("engine: the prefill token taken greedily", ENGINE,
     "token = int(choose(logits[0, -1:], rows,", "token = int(logits[0, -1].argmax()) or int(choose(logits[0, -1:], rows,"),
]  # fmt: skip
# the law tests first, most mutations stop there; then the rest of the method tests (pytest keeps
# the order of files named one by one, not of a folder named after its own files)
FIRST = ["tests/griffin/test_verify.py", "tests/griffin/test_engine_law.py"]
TESTS = FIRST + sorted(
    str(p.relative_to(REPO))
    for p in (REPO / "tests/griffin").glob("test_*.py")
    if str(p.relative_to(REPO)) not in FIRST
)


def scratch_copy() -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore) in a scratch folder."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="griffin-mutations-"))
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def mutate(root: Path, file: str, before: str, after: str) -> None:
    text = (REPO / file).read_text()
    assert text.count(before) == 1, f"{file}: {before!r} occurs {text.count(before)} times; update the mutation"
    (root / file).write_text(text.replace(before, after))


def run_tests(root: Path) -> tuple[bool, str]:
    """True when the tests fail (the mutation is caught), with pytest's last line."""
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy's griffin, ahead of the editable install
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *TESTS]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith("FAILED")]
    return done.returncode != 0, (failed[0] if failed else lines[-1] if lines else done.stderr[-300:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run only mutations whose name contains this text")
    selected = [m for m in MUTATIONS if parser.parse_args().k in m[0]]
    root = scratch_copy()
    check = subprocess.run(
        [sys.executable, "-c", "import griffin; print(griffin.__file__)"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
    )  # fmt: skip
    assert check.stdout.startswith(str(root)), f"the scratch copy's griffin is not the one imported: {check.stdout}"
    survived = []
    try:
        for name, file, before, after in selected:
            start = time.monotonic()
            mutate(root, file, before, after)
            caught, detail = run_tests(root)
            shutil.copy2(REPO / file, root / file)
            print(
                f"{'caught  ' if caught else 'SURVIVED'} {time.monotonic() - start:5.0f} s  {name}: {detail}",
                flush=True,
            )
            survived += [] if caught else [name]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(selected) - len(survived)}/{len(selected)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
