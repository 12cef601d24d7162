"""Loaded by every Python process the tests start (``tests/audit`` is on their PYTHONPATH): records
each file a process opens in the folder that holds the checkout, outside the checkout itself, to
``$GRIFFIN_AUDIT_LOG``. The suite fails when that log is not empty (tests/conftest.py): the project
must carry or install everything it reads, and users have nothing beside their clone."""

import os
import sys

_LOG = os.environ.get("GRIFFIN_AUDIT_LOG")
_REPO = os.environ.get("GRIFFIN_AUDIT_REPO")


def outside_checkout(path: str, repo: str) -> bool:
    """True for a path in the checkout's parent folder that is not inside the checkout."""
    parent = os.path.dirname(repo)
    path = os.path.abspath(path)
    return path.startswith(parent + os.sep) and not (path == repo or path.startswith(repo + os.sep))


def _hook(event: str, args: tuple) -> None:
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if outside_checkout(path, _REPO):
        with open(_LOG, "a") as log:  # the hook's own open is of the log, inside a temp folder
            log.write(f"{os.getpid()} {sys.argv[:2]} {path}\n")


if _LOG and _REPO:
    sys.addaudithook(_hook)
