"""pipeline.lock: one writer per run directory, with real processes: a live holder refuses a second
command and is named, SIGTERM releases, a SIGKILLed or silent holder's lease is taken over; and two real
`griffin featurize` on one output_dir."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import lock
from pipeline.lock import LEASE_NAME, STALE_S, LeaseLost, RunLocked, _acquire, read_lease, run_lock, take_over
from tests.conftest import joining_env, wait_for

REPO = Path(__file__).resolve().parents[2]
GRIFFIN = [sys.executable, "-m", "pipeline.cli"]
HOLD = "import sys, time; from pipeline.lock import run_lock\nwith run_lock(sys.argv[1], 'holder script'):\n"


def env():
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def holder(run_dir, body="    print('held', flush=True); time.sleep(120)\n"):
    """Another process holding ``run_dir``'s lease until it is signalled."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD + body, str(run_dir)], cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_reentrant_in_process_and_released_after(tmp_path):
    lease = tmp_path / LEASE_NAME
    with run_lock(tmp_path, "griffin run") as path:
        first = read_lease(path)
        with run_lock(tmp_path, "griffin featurize"):  # griffin run's stage: no deadlock, same lease
            assert read_lease(lease)["token"] == first["token"]
        assert lease.exists()
    assert not lease.exists()
    assert (first["host"], first["pid"], first["command"]) == (socket.gethostname(), os.getpid(), "griffin run")


def test_live_holder_is_named_and_sigterm_releases(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(RunLocked) as refused:
            with run_lock(tmp_path, "second"):
                pass
        message = str(refused.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in message and "`holder script`" in message
        assert "wait for it to finish, stop it, or write elsewhere (another output_dir, run_name or" in message
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not (tmp_path / LEASE_NAME).exists()  # released on the way out, not left stale
    finally:
        proc.kill()


def test_sigkilled_holders_lease_is_taken_over(tmp_path):
    proc = holder(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    stale = read_lease(tmp_path / LEASE_NAME)
    assert stale["pid"] == proc.pid
    with run_lock(tmp_path, "next") as path:
        assert read_lease(path)["pid"] == os.getpid() and read_lease(path)["token"] != stale["token"]


def test_other_hosts_lease_is_stale_only_without_a_heartbeat(tmp_path):
    lease = tmp_path / LEASE_NAME
    lease.write_text(json.dumps({"host": "node-7", "pid": 1, "command": "griffin train", "token": "t1"}))
    with pytest.raises(RunLocked, match="`griffin train` \\(pid 1 on node-7"):
        with run_lock(tmp_path, "here"):
            pass
    old = time.time() - STALE_S - 60
    os.utime(lease, (old, old))
    with run_lock(tmp_path, "here"):
        assert read_lease(lease)["host"] == socket.gethostname()


def test_a_late_taker_never_removes_the_fresh_lease(tmp_path):
    """Two takers judged the same lease stale; the first replaced it: the second's takeover is a no-op."""
    lease = tmp_path / LEASE_NAME
    lease.write_text(json.dumps({"host": "node-7", "pid": 1, "token": "fresh"}))
    assert not take_over(lease, "stale") and read_lease(lease)["token"] == "fresh"
    assert take_over(lease, "fresh") and not lease.exists()


def test_an_unreadable_lease_is_never_taken_while_it_is_touched(tmp_path):
    """Half-written (a writer killed between O_EXCL and its write) or unreadable on a flaky mount: while
    its file is touched (a live holder's heartbeat) it is refused; once untouched for STALE_S, taken."""
    lease = tmp_path / LEASE_NAME
    lease.write_text("")
    with pytest.raises(RunLocked, match=r"an unreadable lease"):
        _acquire(lease, "here", wait_partial_s=0.2)
    assert lease.read_text() == ""  # left as it was
    old = time.time() - STALE_S - 5
    os.utime(lease, (old, old))
    token = _acquire(lease, "here", wait_partial_s=0.2)
    assert read_lease(lease)["token"] == token


@pytest.fixture
def fast_heartbeat(monkeypatch):
    """Heartbeats and retries every 50 ms, giving up after 1 s of failures."""
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(lock, "RETRY_S", 0.05)
    monkeypatch.setattr(lock, "GIVE_UP_S", 1.0)


def hold_until_interrupted(run_dir, seconds=60.0):
    """Hold the lease and wait: only losing it (LeaseLost) ends this early."""
    with run_lock(run_dir, "here"):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)


def flaky_utime(monkeypatch, failures: list):
    """``os.utime`` in pipeline.lock failing with the given errors first (None: fail for ever)."""
    real = os.utime

    def utime(path, *args, **kwargs):
        if failures is None or failures:
            raise failures.pop(0) if failures else OSError(errno.EIO, "Input/output error")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(lock.os, "utime", utime)


def test_a_heartbeat_retries_transient_errors(tmp_path, monkeypatch, fast_heartbeat):
    """ESTALE and EIO on a mount are retried: the lease stays held and touched once they pass."""
    failures = [OSError(errno.ESTALE, "Stale file handle"), OSError(errno.EIO, "Input/output error")] * 3
    flaky_utime(monkeypatch, failures)
    with run_lock(tmp_path, "here") as path:
        before = path.stat().st_mtime_ns
        wait_for(lambda: not failures and path.stat().st_mtime_ns > before, 30, "a heartbeat after the failures")
        assert read_lease(path)["command"] == "here"
    assert not path.exists()


def test_a_heartbeat_that_keeps_failing_stops_the_holder(tmp_path, monkeypatch, fast_heartbeat):
    """Failures past GIVE_UP_S (well before another host may take the lease): the holder's block ends
    with LeaseLost saying why, instead of writing on beside a possible new holder."""
    flaky_utime(monkeypatch, None)
    with pytest.raises(LeaseLost, match=r"could not be read or touched for 1 s: .*Input/output error"):
        hold_until_interrupted(tmp_path)


def test_a_holder_whose_lease_was_taken_stops_and_leaves_the_new_lease(tmp_path, fast_heartbeat):
    lease = tmp_path / LEASE_NAME

    def take_it():  # another writer replaced the lease (e.g. judged it stale across hosts)
        wait_for(lease.exists, 30, "the lease")
        lease.write_text(json.dumps({**read_lease(lease), "token": "another"}))

    import threading

    threading.Timer(0.2, take_it).start()
    with pytest.raises(LeaseLost, match=r"was taken from this process"):
        hold_until_interrupted(tmp_path)
    assert read_lease(lease)["token"] == "another"  # never removed another's lease


def test_a_store_outside_the_run_directory_has_its_own_lease(tmp_path):
    """Two runs featurizing into one shared store: the second is refused by the store's lease, with the
    holder named, before it opens the store (which deletes temp parts) or starts anything."""
    from pipeline.config import load_config
    from pipeline.data.featurize import run_featurize

    shared = tmp_path / "shared-store"
    first = holder(shared)
    try:
        cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}", f"features.store={shared}"])
        with pytest.raises(RunLocked, match=rf"feature store {shared} is in use by `holder script` \(pid {first.pid}"):
            run_featurize(cfg)
    finally:
        first.terminate()
        first.wait()
    assert sorted(p.name for p in shared.iterdir()) == []  # nothing written there


def featurize(out, *extra, **kwargs):
    """A real `griffin featurize`, joined to the suite's Ray (``ray_local``)."""
    args = [*GRIFFIN, "featurize", "-c", "jobs/configs/tiny.yaml", f"output_dir={out}", "data.limit=4", *extra]
    return subprocess.Popen(args, cwd=REPO, env=joining_env(), text=True, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.timeout(600)
def test_second_featurize_on_one_output_dir_is_refused_and_the_first_finishes(tmp_path, ray_local):
    """The first is stopped (SIGSTOP) once it holds the lease, so the second surely meets it; it is refused
    with the holder named and touches nothing; the first then finishes a store that verifies."""
    lease = tmp_path / "tiny" / LEASE_NAME
    first = featurize(tmp_path, stdout=subprocess.PIPE)
    try:
        wait_for(lambda: read_lease(lease) is not None, what="the first featurize's lease")
        os.kill(first.pid, signal.SIGSTOP)
        second = featurize(tmp_path, stdout=subprocess.PIPE)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 75, err
        assert f"griffin featurize: refused: run directory {tmp_path / 'tiny'} is in use by" in err
        assert f"pid {first.pid} on {socket.gethostname()}" in err and "griffin featurize -c" in err
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=500)
        assert first.returncode == 0, err
    finally:
        os.kill(first.pid, signal.SIGCONT) if first.poll() is None else None
        first.kill()
    assert '"complete": true' in out and not lease.exists()
    store = tmp_path / "tiny" / "features"
    verify = subprocess.run(
        [*GRIFFIN, "featurize", "-c", "jobs/configs/tiny.yaml", "--verify", str(store)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verify.returncode == 0, verify.stderr


@pytest.mark.timeout(600)
def test_featurize_takes_over_the_lease_of_a_sigkilled_featurize(tmp_path, ray_local):
    lease = tmp_path / "tiny" / LEASE_NAME
    killed = featurize(tmp_path, stdout=subprocess.DEVNULL)
    wait_for(lambda: read_lease(lease) is not None, what="the first featurize's lease")
    killed.kill()
    killed.wait(timeout=60)
    assert read_lease(lease)["pid"] == killed.pid  # left behind
    rerun = featurize(tmp_path, stdout=subprocess.PIPE)
    out, err = rerun.communicate(timeout=500)
    assert rerun.returncode == 0, err
    assert "took over the stale lease" in err and f"pid {killed.pid} is gone" in err
    assert '"complete": true' in out and not lease.exists()
