"""`griffin serve` as a process manager stops it: SIGTERM drains the running streams, then the process
exits 0. A module of its own: the command joins the suite's Ray (as on a cluster), where no other
deployment may run meanwhile (the other modules' deployments are stopped when their modules end)."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import first_content, free_port, joining_env, wait_for

TINY = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "tiny.yaml"
CHAT = "/v1/chat/completions"
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.mark.timeout(600)
def test_sigterm_drains_running_streams_then_exits_zero(tmp_path, ray_local):
    """`griffin serve` (joining the suite's Ray) gets SIGTERM while a stream runs: new requests get 503
    + Retry-After (``shutting_down``) from every ingress replica from then on, the running stream
    finishes with its last chunk and [DONE], and the process exits 0. The stream is 2,000 tokens (seconds
    of decoding on a fast machine), far longer than the signal takes to reach the ingress (~0.1 s measured)."""
    port = free_port()
    command = [sys.executable, "-m", "pipeline.cli", "serve", "-c", str(TINY), f"output_dir={tmp_path}"]
    command += [f"serve.port={port}", "serve.drain_s=120", "target.tiny.max_position_embeddings=4096"]
    command += ["decode.max_context=4096"]
    # no API key (a keyed deployment of another module may have left one in the environment)
    env = {k: v for k, v in joining_env().items() if k != "GRIFFIN_API_KEY"}
    server = subprocess.Popen(
        command, cwd=TINY.parents[2], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(server.stdout), daemon=True).start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        deadline = time.monotonic() + 300
        while not any("SIGTERM to stop" in line for line in output):  # run_serve waits for signals now
            assert server.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(0.5)
        long = {"messages": [{"role": "user", "content": "A long one."}], "max_tokens": 2000, "temperature": 0}
        with client.stream("POST", CHAT, json={**long, "stream": True}) as stream:
            assert stream.status_code == 200, stream.read()
            lines = stream.iter_lines()
            first_content(lines)  # the decode is running
            server.send_signal(signal.SIGTERM)
            refused = None
            while refused is None or refused.status_code != 503:
                try:
                    refused = client.post(CHAT, json=GOOD)
                except httpx.HTTPError:
                    raise AssertionError("".join(output)[-5000:])
            # once griffin serve says it drains, every ingress replica has heard it (each polls the board: one
            # may admit a request for up to a poll after another refuses, and that one is served whole)
            wait_for(lambda: any(line.startswith("draining:") for line in output), 60, "the drain line")
            # ... and refuses (the stream's is the busier one: Serve's proxy sends these to the other)
            after = [client.post(CHAT, json=GOOD).status_code for _ in range(6)]
            rest = [line for line in lines if line.startswith("data: ")]
        assert refused.json()["error"]["code"] == "shutting_down" and refused.headers["Retry-After"]
        assert after == [503] * 6, after
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.wait(timeout=180) == 0, "".join(output)[-3000:]
        assert any(re.match(r"draining: [1-9]\d* requests running", line) for line in output)
    finally:
        if server.poll() is None:
            server.kill()
