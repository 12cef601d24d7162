"""One writer per run directory: ``run_lock(cfg.run_dir, command)`` holds ``<run_dir>/griffin.lock``.

Two commands on one run directory would corrupt each other (featurize's start-up removes the other's
temp parts, both write parts for the same samples, their trainers delete each other's checkpoints,
both append to one evaluation ledger), so every command that writes there takes this lease first
(``pipeline.cli``, ``pipeline.run.run_all``) and a second one is refused with ``RunLocked`` naming
the holder. The lease is the driver's: Ray workers, actors and replicas never take it.

- **Lease.** A JSON file created with ``O_CREAT | O_EXCL`` (atomic on a local disk and on NFS v3+,
  EFS, CephFS): ``host``, ``pid``, ``pid_started`` (the process's start time, Linux), ``boot_id``,
  ``started`` (UTC), ``command`` and a random ``token``.
- **Heartbeat.** A daemon thread touches the lease every ``HEARTBEAT_S``; its mtime is the holder's
  last sign of life for other hosts. A failing read or touch (NFS: ESTALE, EIO) is retried every
  ``RETRY_S``; after ``GIVE_UP_S`` of failures, or when the lease holds another token, the lease is
  lost: the holder stops (its main thread is interrupted and the ``with`` raises ``LeaseLost``, naming
  why), well before another host may judge the lease stale.
- **Stale.** On the holder's host: the pid is gone, or now belongs to another process (another start
  time or boot), or is this very process while it does not hold the lease (a container's pid 1
  after a restart). On another host, where the pid says nothing: no heartbeat for ``STALE_S``. A lease
  that cannot be read (half-written, or unreadable on a flaky mount) is never taken while its file is
  still touched: only once its mtime is ``STALE_S`` old.
- **Takeover.** Under ``<lease>.takeover`` (itself ``O_EXCL``) the taker re-reads the lease and removes
  it only if it still holds the stale token, then competes for a fresh lease like anyone else: of two
  racing takers one wins, the other is refused by the winner's lease.
- **Re-entrant.** A process that holds the lease takes it again at no cost (``griffin run``'s stages).
- **Stores.** ``store_lease(store, command)``: a feature store's own lease in its folder, held while
  featurize or regenerate writes it (a store outside the run directory is shared by runs).
- **Release.** On leaving the ``with``, on an exception and on SIGTERM (turned into ``SystemExit`` while
  held, in the main thread); a SIGKILL leaves a stale lease the next command takes over.

Imports: the standard library only.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEASE_NAME = "griffin.lock"
HEARTBEAT_S = 30.0
STALE_S = 600.0  # another host's lease with no heartbeat this long is stale: 20 missed beats, NFS clocks skew
TAKEOVER_STALE_S = 60.0  # a takeover takes milliseconds: a takeover file this old lost its taker
RETRY_S = 5.0  # a failing heartbeat's retry interval
GIVE_UP_S = STALE_S / 2  # a heartbeat failing this long gives up, before another host may take the lease
EXIT_LOCKED = 75  # sysexits EX_TEMPFAIL: try again later
LOST_SIGNAL = signal.SIGUSR2  # its handler, called by the heartbeat thread (no signal is sent), raises LeaseLost

logger = logging.getLogger("griffin")


class RunLocked(RuntimeError):
    """Another live process holds the lease (of a run directory or a feature store)."""


class LeaseLost(RuntimeError):
    """This process lost the lease it held: it must stop writing."""


@dataclass
class _Held:
    path: Path
    token: str
    pid: int
    depth: int = 1
    stop: threading.Event = field(default_factory=threading.Event)
    main: bool = False  # taken in the main thread, which a lost lease interrupts
    lost: str | None = None  # why the lease was lost
    raises: bool = False  # LOST_SIGNAL's handler raises LeaseLost in the main thread (``_lost_raises``)


_held: dict[Path, _Held] = {}
_guard = threading.Lock()


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def read_lease(path: Path) -> dict[str, Any] | None:
    """The lease at ``path``; None when there is none or it is not (yet) a whole lease."""
    try:
        lease = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return lease if isinstance(lease, dict) and "token" in lease else None


def stale_reason(lease: dict[str, Any], mtime: float, now: float | None = None) -> str | None:
    """Why ``lease`` (last touched at ``mtime``) no longer has a live holder, else None (held)."""
    if lease.get("host") != socket.gethostname():
        age = (time.time() if now is None else now) - mtime
        return f"no heartbeat for {age:.0f} s (> {STALE_S:.0f} s)" if age > STALE_S else None
    pid = int(lease.get("pid", -1))
    if lease.get("boot_id") and _boot_id() and lease["boot_id"] != _boot_id():
        return "its host rebooted"
    if pid == os.getpid():  # were it ours, the registry would say so
        return f"pid {pid} is this process, which does not hold it"
    if pid <= 0 or not _pid_alive(pid):
        return f"pid {pid} is gone"
    started = _pid_started(pid)
    if lease.get("pid_started") is not None and started is not None and started != lease["pid_started"]:
        return f"pid {pid} now belongs to another process"
    return None


def describe(lease: dict[str, Any], path: Path, mtime: float) -> str:
    return (
        f"`{lease.get('command', '?')}` (pid {lease.get('pid')} on {lease.get('host')}, started "
        f"{lease.get('started', '?')}, last heartbeat {time.time() - mtime:.0f} s ago; lease {path})"
    )


def _create(path: Path, command: str) -> str | None:
    """Create the lease with O_EXCL; its token, or None when a lease exists."""
    token = uuid.uuid4().hex
    lease = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_started": _pid_started(os.getpid()),
        "boot_id": _boot_id(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "token": token,
    }
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(lease, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def take_over(path: Path, stale_token: str | None) -> bool:
    """Remove the lease at ``path`` if it still holds ``stale_token`` (None: is still unreadable); True if
    this call removed it. Serialised by ``<lease>.takeover`` so that a taker that judged an older lease stale never removes
    the fresh lease another taker created meanwhile."""
    mutex = path.with_name(path.name + ".takeover")
    try:
        fd = os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - mutex.stat().st_mtime > TAKEOVER_STALE_S:
                mutex.unlink()  # its taker died mid-takeover
        except FileNotFoundError:
            pass
        return False
    try:
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        current = read_lease(path)
        if (current or {}).get("token") != stale_token or not path.exists():
            return False
        path.unlink()
        return True
    finally:
        os.close(fd)
        mutex.unlink(missing_ok=True)


def _acquire(path: Path, command: str, wait_partial_s: float = 5.0, what: str = "run directory") -> str:
    """A fresh lease's token, taking over a stale one; ``RunLocked`` when a live process holds it."""
    deadline = time.monotonic() + wait_partial_s
    while True:
        token = _create(path, command)
        if token is not None:
            return token
        lease = read_lease(path)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:  # released meanwhile: try again
            continue
        if lease is None:  # created but not yet written, its writer died in between, or a flaky mount
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            lease = {"token": None, "host": "?", "pid": -1, "command": "? (an unreadable lease)"}
            age = time.time() - mtime  # its holder, if alive, still touches it: never taken then
            reason = f"the lease is unreadable and untouched for {age:.0f} s" if age > STALE_S else None
        else:
            reason = stale_reason(lease, mtime)
        if reason is None:
            raise RunLocked(locked_message(path, lease, mtime, what))
        if take_over(path, lease["token"]):
            logger.warning("took over the stale lease %s of %s: %s", path, describe(lease, path, mtime), reason)
        time.sleep(0.05)  # let a concurrent taker finish before competing for the fresh lease


def locked_message(path: Path, lease: dict[str, Any], mtime: float, what: str = "run directory") -> str:
    return (
        f"{what} {path.parent} is in use by {describe(lease, path, mtime)}. "
        "One griffin command writes a run directory or a feature store at a time: wait for it to finish, stop "
        "it, or write elsewhere (another output_dir, run_name or features.store). A holder that died leaves a "
        f"stale lease the next command takes over (on its host at once, elsewhere after {STALE_S / 60:.0f} "
        "minutes without a heartbeat); delete the lease by hand only when you know its holder is gone."
    )


def _heartbeat(held: _Held) -> None:
    """Touch the lease every HEARTBEAT_S; retry failures every RETRY_S; give the lease up (``_lose``)
    when another token holds it or the failures last GIVE_UP_S."""
    failing_since, wait = None, HEARTBEAT_S
    while not held.stop.wait(wait):
        try:
            lease = read_lease(held.path)
            if lease is None and held.path.exists():
                raise OSError(f"{held.path} is unreadable")
            if lease is None or lease["token"] != held.token:
                return _lose(held, f"lease {held.path} was taken from this process (now {lease})")
            os.utime(held.path)
            failing_since, wait = None, HEARTBEAT_S
        except OSError as error:
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > GIVE_UP_S:
                return _lose(held, f"lease {held.path} could not be read or touched for {GIVE_UP_S:.0f} s: {error}")
            logger.warning("lease %s: heartbeat failed (%s); retrying in %.0f s", held.path, error, RETRY_S)
            wait = RETRY_S


def _lose(held: _Held, reason: str) -> None:
    """The lease is no longer this process's: say so and interrupt the main thread, where the ``with``
    turns the interruption into ``LeaseLost`` (another writer may be running: this one must stop)."""
    if held.stop.is_set():  # released meanwhile
        return
    held.lost = reason
    logger.error("%s: stopping", reason)
    if held.raises:
        _thread.interrupt_main(LOST_SIGNAL)
    elif held.main:  # another handler holds LOST_SIGNAL: a KeyboardInterrupt, turned into LeaseLost by run_lock
        _thread.interrupt_main()


def _release(held: _Held) -> None:
    held.stop.set()
    lease = read_lease(held.path)
    if lease is not None and lease["token"] == held.token:  # never another's
        held.path.unlink(missing_ok=True)


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM (``kill``, Ray's job stop, Kubernetes) unwinds like an exception, so the lease is released;
    only where SIGTERM still has its default action (never over another handler) and in the main thread."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_term)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is exit_on_term:  # ray.init installs its own: keep that
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _lost_message(held: _Held) -> str:
    return f"{held.lost}. Another command may be writing {held.path.parent}: this one stopped writing there"


@contextmanager
def _lost_raises(held: _Held) -> Iterator[None]:
    """While the lease is held in the main thread, losing it raises ``LeaseLost`` there: the heartbeat
    thread runs LOST_SIGNAL's handler through ``_thread.interrupt_main`` (no signal is sent). SIGINT's
    would do nothing in a process started in the background, which ignores SIGINT. Only where
    LOST_SIGNAL has its default action (an outer ``run_lock`` has installed it already)."""
    if not held.main or signal.getsignal(LOST_SIGNAL) is not signal.SIG_DFL:
        yield
        return

    def raise_lost(signum: int, frame: Any) -> None:
        raise LeaseLost(_lost_message(held))

    signal.signal(LOST_SIGNAL, raise_lost)
    held.raises = True
    try:
        yield
    finally:
        held.raises = False
        if signal.getsignal(LOST_SIGNAL) is raise_lost:
            signal.signal(LOST_SIGNAL, signal.SIG_DFL)


@contextmanager
def run_lock(run_dir: str | Path, command: str, what: str = "run directory") -> Iterator[Path]:
    """Hold ``<run_dir>/griffin.lock`` for the ``with`` block (re-entrant in this process); yields its path.
    Raises ``RunLocked`` naming the holder when another live process holds it, and ``LeaseLost`` from the
    block when the lease is lost while held."""
    path = (Path(run_dir).expanduser().resolve()) / LEASE_NAME
    with _guard:
        held = _held.get(path)
        if held is not None and held.pid == os.getpid():  # not a forked child's inherited entry
            held.depth += 1
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            main = threading.current_thread() is threading.main_thread()
            held = _held[path] = _Held(path, _acquire(path, command, what=what), os.getpid(), main=main)
            threading.Thread(target=_heartbeat, args=(held,), name="griffin-lease", daemon=True).start()
    try:
        with _sigterm_exits(), _lost_raises(held):
            yield path
    except KeyboardInterrupt as interrupt:
        if held.lost is not None:
            raise LeaseLost(_lost_message(held)) from interrupt
        raise
    finally:
        with _guard:
            held.depth -= 1
            if held.depth == 0:
                del _held[path]
                _release(held)


@contextmanager
def store_lease(store: str, command: str) -> Iterator[None]:
    """One writer per store: ``pipeline.lock``'s lease in the store's folder, held while a command writes
    it, wherever the store lies (a store outside the run directory is shared by runs: the run's lease
    does not cover it). Opening a store for writing deletes temp parts: only its lease holder may. An
    object store (``s3://``, ``gs://``) has no exclusive create: its writers are kept apart by their runs'
    leases alone."""
    if "://" in store:
        yield
        return
    with run_lock(store, command, what="feature store"):
        yield
