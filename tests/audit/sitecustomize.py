"""Loaded by every Python process the tests start (``tests/audit`` is on their PYTHONPATH): records
each file a process opens in the folder that holds the checkout, outside the checkout itself, to
``$GRIFFIN_AUDIT_LOG``. The suite fails when that log is not empty (tests/conftest.py): the project
must carry or install everything it reads, and users have nothing beside their clone."""

import os
import sys
import tempfile

_LOG = os.environ.get("GRIFFIN_AUDIT_LOG")
_REPO = os.environ.get("GRIFFIN_AUDIT_REPO")
_TMP = os.path.realpath(tempfile.gettempdir())
# What the tests and the libraries they run create in the temp folder: scratch, never a user's files.
# It matters when the checkout itself sits in the temp folder (git clone into /tmp/x).
SCRATCH = (
    "pytest-of-",
    "tmp",
    "ray",
    "griffin-",
    "torchinductor_",
    "mlflow",
    "hf_",
    "mmap",
    "pymp-",
    "pip-",
    ".",
    "pytorch-errorfile-",
)  # the last: torch.multiprocessing.spawn's per-child error files
GIT_PROBES = ("HEAD", "commondir")  # a git repository search walking up from a Ray job's working_dir copy


def outside_checkout(path: str, repo: str) -> bool:
    """True for a path in the checkout's parent folder that is not inside the checkout (nor scratch
    in the temp folder, when the checkout lives there)."""
    parent = os.path.dirname(repo)
    path = os.path.abspath(path)
    if not path.startswith(parent + os.sep) or path == repo or path.startswith(repo + os.sep):
        return False
    below = path[len(parent) + 1 :]
    if parent == _TMP and (below.startswith(SCRATCH) or below in GIT_PROBES):
        return False
    return True


def _hook(event: str, args: tuple) -> None:
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if path != _LOG and outside_checkout(path, _REPO):
        with open(_LOG, "a") as log:  # the hook's own open is of the log, inside a temp folder
            log.write(f"{os.getpid()} {sys.argv[:2]} {path}\n")


if _LOG and _REPO:
    sys.addaudithook(_hook)
