"""Planted bugs the suite must catch: a mutation check to rerun whenever the sampling code changes.

Each mutation below rewrites one line of griffin/verify.py or griffin/engine.py in a scratch copy of
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
VERIFY, ENGINE = "griffin/verify.py", "griffin/engine.py"
SAMPLE_RESIDUAL = "return VerifyResult(path, sample_one(probs, generator))"
# (name, file, the line's text as it is, what it becomes)
MUTATIONS = [
    ("no renormalisation after a rejected child", VERIFY, "            probs = probs / total\n", ""),
    ("first child accepted x1.3", VERIFY, "< p_token:", "< p_token * (1.3 if child == tree.children[node][0] else 1.0):"),
    ("uniform leaf bonus", VERIFY, SAMPLE_RESIDUAL,
     "return VerifyResult(path, sample_one(probs if tree.children[node] else torch.ones_like(probs), generator))"),
    ("leaf bonus without the warper", VERIFY, SAMPLE_RESIDUAL,
     "return VerifyResult(path, sample_one(probs if tree.children[node] else "
     "target_logits[node].float().softmax(-1), generator))"),
    ("top-p on the acceptance side only", VERIFY, SAMPLE_RESIDUAL,
     "return VerifyResult(path, sample_one(warp_probs(target_logits[node], sampling.model_copy(update="
     "{'top_p': 1.0})).index_fill(0, tree.tokens[tree.children[node]], 0.0), generator))"),
    ("residual keeps the rejected child", VERIFY, "            probs[token] = 0.0  #", "            pass  #"),
    ("acceptance below depth 1 reads the parent's law", VERIFY, "probs = warp_probs(target_logits[node], sampling)",
     "probs = warp_probs(target_logits[path[-2] if len(path) > 1 else node], sampling)"),
    ("warper: temperature squared", VERIFY, "logits.float() / sampling.temperature",
     "logits.float() / sampling.temperature**2"),
    ("warper: top-k keeps one more", VERIFY, "logits.topk(sampling.top_k, dim=-1)",
     "logits.topk(sampling.top_k + 1, dim=-1)"),
    ("warper: top-p keeps less", VERIFY, ">= sampling.top_p", ">= 0.9 * sampling.top_p"),
    ("plain draws without the warper", VERIFY, "return sample_one(warp_probs(logits, sampling), generator)",
     "return sample_one(logits.float().softmax(-1), generator)"),
    ("greedy walk compares the child's own argmax", VERIFY, "if tokens[c] == choice[node]", "if tokens[c] == choice[c]"),
    ("engine: a row verified with its neighbour's logits", ENGINE, "verify(t, logits[b, : t.size]",
     "verify(t, logits[(b + 1) % len(trees), : t.size]"),
    ("engine: the prefill token taken greedily", ENGINE,
     "token = next_token(logits[0, -1], req.sampling, req.generator)", "token = int(logits[0, -1].argmax())"),
    ("engine: a row draws from the first row's generator", ENGINE, "row.request.sampling, row.request.generator)",
     "row.request.sampling, self.rows[0].request.generator)"),
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
