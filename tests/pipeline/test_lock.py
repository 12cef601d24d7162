"""pipeline.lock: one writer per run directory, with real processes: a live holder refuses a second
command and is named, SIGTERM releases, a SIGKILLed or silent holder's lease is taken over; and two real
`griffin featurize` on one output_dir."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.lock import LEASE_NAME, STALE_S, RunLocked, _acquire, read_lease, run_lock, take_over

REPO = Path(__file__).resolve().parents[2]
GRIFFIN = [sys.executable, "-m", "pipeline.cli"]
HOLD = "import sys, time; from pipeline.lock import run_lock\nwith run_lock(sys.argv[1], 'holder script'):\n"


def env():
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def wait_for(predicate, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


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
        assert "wait for it to finish, stop it, or use another output_dir or run_name" in message
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


def test_an_unreadable_lease_is_taken_over_after_a_grace(tmp_path):
    """A writer killed between O_EXCL and its write leaves an empty lease."""
    (tmp_path / LEASE_NAME).write_text("")
    token = _acquire(tmp_path / LEASE_NAME, "here", wait_partial_s=0.2)
    assert read_lease(tmp_path / LEASE_NAME)["token"] == token


def featurize(out, *extra, **kwargs):
    args = [*GRIFFIN, "featurize", "-c", "jobs/configs/tiny.yaml", f"output_dir={out}", "data.limit=4", *extra]
    return subprocess.Popen(args, cwd=REPO, env=env(), text=True, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.timeout(600)
def test_second_featurize_on_one_output_dir_is_refused_and_the_first_finishes(tmp_path):
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
def test_featurize_takes_over_the_lease_of_a_sigkilled_featurize(tmp_path):
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
