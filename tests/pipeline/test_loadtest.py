"""``griffin bench-serve`` against a stand-in OpenAI-style server (no Ray, no model): Retry-After is
honoured and counted, the API key is sent, reports are written; the real endpoint's run is in
tests/pipeline/test_serve.py."""

import email.utils
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.cli import build_parser, redacted
from pipeline.config import load_config
from pipeline.evaluate.loadtest import DEFAULT_RETRY_S, MAX_RETRY_S, retry_after_s, run_bench_serve


class FakeServer(BaseHTTPRequestHandler):
    """Refuses the first ``refusals`` completions with 503 + Retry-After, then streams two words."""

    refusals, seen = 0, []

    def log_message(self, *args):
        pass

    def _send(self, status, body, headers=()):
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append((self.headers.get("authorization"), body))
        if type(self).refusals > 0:
            type(self).refusals -= 1
            return self._send(503, b"busy", [("Retry-After", "0")])
        events = [{"choices": [{"delta": {"content": word}}], "usage": None} for word in ("Hi", " there")]
        events.append({"choices": [], "usage": {"completion_tokens": 2}})
        stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, stream.encode(), [("content-type", "text/event-stream")])


@pytest.fixture
def fake_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeServer.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"  # as OpenAI clients spell it
    server.shutdown()


def test_retry_after_is_honoured_and_counted(fake_url, tmp_path):
    FakeServer.refusals = 3
    cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}"])
    result = run_bench_serve(cfg, levels=(1, 2), requests_per_level=2, max_tokens=4, url=fake_url, api_key="k1")
    assert [(r["mode"], r["concurrency"]) for r in result["levels"]] == [("served", 1), ("served", 2)]
    assert result["retries"] == 3 and result["errors"] == 0 and result["shed"] == 0
    assert all(
        r["ok"] == 2 and r["tokens_per_s"] > 0 and r["ttft_p50_s"] <= r["latency_p50_s"] for r in result["levels"]
    )
    auth, body = FakeServer.seen[0]
    assert auth == "Bearer k1" and body["model"] == "fake-model" and "speculative" not in body  # not our server
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 4
    out = cfg.run_dir / "eval"
    assert json.loads((out / "serve_load.json").read_text())["retries"] == 3
    assert "| served | 2 | 2 |" in (out / "serve_load.md").read_text()
    assert (out / "serve_load.png").read_bytes()[:4] == b"\x89PNG"


def test_still_refused_after_retries_is_shed_not_an_error(fake_url, tmp_path):
    FakeServer.refusals = 10**6
    cfg = load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path}"])
    result = run_bench_serve(cfg, levels=(1,), requests_per_level=2, url=fake_url, max_retries=2)
    level = result["levels"][0]
    assert (level["shed"], level["retries"], level["errors"], level["ok"]) == (2, 4, 0, 0)
    assert level["latency_p50_s"] is None and "- |" in (cfg.run_dir / "eval" / "serve_load.md").read_text()


def test_retry_after_forms():
    assert retry_after_s("2") == 2.0 and retry_after_s("0.5") == 0.5 and retry_after_s("-3") == 0.0
    assert retry_after_s(None) == retry_after_s("soon") == DEFAULT_RETRY_S and retry_after_s("9999") == MAX_RETRY_S
    date = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3.0 <= retry_after_s(date) <= 5.0


def test_cli_flags_and_the_key_left_out_of_the_record():
    args = build_parser().parse_args(
        ["bench-serve", "-c", "x.yaml", "--url", "http://h:8000", "--api-key", "s3cret", "--levels", "1,2,4"]
    )
    assert (args.url, args.api_key, args.levels) == ("http://h:8000", "s3cret", (1, 2, 4))
    assert redacted(["bench-serve", "--api-key", "s3cret", "--api-key=other", "-c", "x"]) == [
        "bench-serve",
        "--api-key",
        "***",
        "--api-key=***",
        "-c",
        "x",
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench-serve", "-c", "x.yaml", "--levels", "0,2"])
