"""What a person sees while a long command runs: a line per stage with its progress and ETA, then a
summary; everything else goes to a log file whose path is printed.

``quiet(log_path)`` (``griffin run`` uses it) points file descriptors 1 and 2 at the log file, so
whatever this process and the processes it starts write there (Ray's and MLflow's warnings, Ray
workers' output, Ray Data's progress dumps, tracebacks of errors that were handled) lands in the
log, and keeps the real terminal for ``say`` and ``Progress``. Outside ``quiet`` both print to
stdout as usual, so the stages behave the same when called on their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_terminal: TextIO | None = None  # the real stdout while quiet() is active
HEARTBEAT_S = 120.0  # off a terminal (a pipe, CI), a running stage prints at most this often


def terminal() -> TextIO:
    return _terminal or sys.stdout


def say(text: str) -> None:
    """A line for the person running the command (the console, even inside ``quiet``)."""
    print(text, file=terminal(), flush=True)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """One line per stage: ``[train stage 1] 40/120 steps  loss 2.31  ETA 1m05s``. On a terminal the
    line is rewritten in place; elsewhere it is printed when the stage ends and, while it runs, at
    most every ``HEARTBEAT_S``. ``update`` is cheap: call it as often as there is news."""

    def __init__(self, label: str, total: float, unit: str, initial: float = 0.0):
        self.label, self.total, self.unit, self.initial = label, total, unit, initial  # initial: done before (resume)
        self.start = self.last_print = time.monotonic()
        self.live = terminal().isatty()
        self.done, self.detail, self.closed = initial, "", False

    def _line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = f"ETA {_duration((self.total - self.done) / rate)}" if 0 < rate and self.done < self.total else ""
        amount = f"{self.done:.0f}/{self.total:.0f} {self.unit}"
        return "  ".join(part for part in (f"[{self.label}]", amount, self.detail, eta) if part)

    def update(self, done: float, detail: str = "") -> None:
        self.done, self.detail = done, detail
        now = time.monotonic()
        if self.live:
            terminal().write("\r\033[K" + self._line())
            terminal().flush()
        elif now - self.last_print >= HEARTBEAT_S:
            say(self._line())
            self.last_print = now

    def close(self, detail: str | None = None) -> None:
        """The stage's last line, with its wall time."""
        if self.closed:
            return
        self.closed = True
        if detail is not None:
            self.detail = detail
        line = "  ".join(
            p
            for p in (
                f"[{self.label}]",
                f"{self.done:.0f}/{self.total:.0f} {self.unit}",
                self.detail,
                f"in {_duration(time.monotonic() - self.start)}",
            )
            if p
        )
        if self.live:
            terminal().write("\r\033[K")
        say(line)


@contextlib.contextmanager
def quiet(log_path: Path) -> Iterator[Path]:
    """Send fds 1 and 2 (this process and its children) and Python logging/warnings to ``log_path``;
    ``say``/``Progress`` keep writing to the terminal. Restores everything on exit."""
    global _terminal
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log = open(log_path, "a", buffering=1)
    _terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            yield log_path
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            _shutdown_ray()  # inside the redirect: Ray's shutdown chatter belongs in the log too
            root.removeHandler(handler)
            root.setLevel(previous_level)
            logging.captureWarnings(False)
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            _terminal.close()
            _terminal = None
            log.close()


def _shutdown_ray() -> None:
    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        with contextlib.suppress(Exception):
            from ray import serve

            serve.shutdown()
        ray.shutdown()
