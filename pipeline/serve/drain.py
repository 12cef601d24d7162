"""``griffin serve``'s drain on SIGTERM or Ctrl-C, told to every ingress replica. A Serve handle reaches
one replica (the less loaded one: never the one holding the streams), so the drain goes through a
small named actor, ``DrainBoard``, that ``griffin serve`` starts and each ingress replica polls
(``pipeline.serve.ingress``): once it says drain, a replica answers new completions with 503 +
Retry-After and reports how many of its own are still in progress or queued.

Without ``griffin serve`` (``serve run``, a RayService) there is no board, and nothing drains this way:
Serve's own graceful shutdown applies.
"""

from __future__ import annotations

import time

import ray

BOARD_NAME, BOARD_NAMESPACE = "griffin-drain", "griffin"
POLL_S = 0.25  # how often an ingress replica reports to the board, and griffin serve reads it
CONTROL_S = 10.0  # how long griffin serve waits for every ingress replica's first report


@ray.remote(num_cpus=0)
class DrainBoard:
    """Whether to drain, and each ingress replica's completions in progress or queued since it started."""

    def __init__(self):
        self.draining = False
        self.running: dict[str, int] = {}  # ingress replica id -> its last report after the drain began

    def start(self) -> None:
        self.draining = True

    def report(self, replica: str, running: int) -> bool:
        """An ingress replica's count; returns whether it drains. Keyed by replica id, not by rank: Serve
        renumbers ranks when replicas come and go."""
        if self.draining:
            self.running[replica] = running
        return self.draining

    def reports(self) -> dict[str, int]:
        return dict(self.running)


def start_board():
    """``griffin serve``'s board (one per Ray cluster and application name: an earlier one is reused)."""
    return DrainBoard.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True).remote()


def find_board():
    """The board, or None without ``griffin serve`` (a blocking GCS lookup: not on an event loop)."""
    try:
        return ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
    except ValueError:
        return None


def drain(board, seconds: float, ingresses: int) -> int:
    """Tell every ingress replica to stop admitting completions, and wait up to ``seconds`` for the
    running ones to finish; returns how many were still running at the end (a replica that never
    reported, dead or unreachable, counts with what it last said)."""
    ray.get(board.start.remote())
    deadline = time.monotonic() + CONTROL_S
    while len(reports := ray.get(board.reports.remote())) < ingresses and time.monotonic() < deadline:
        time.sleep(POLL_S)
    running = sum(reports.values())
    print(f"draining: {running} requests running, new ones get 503 (serve.drain_s={seconds:g})", flush=True)
    deadline = time.monotonic() + seconds
    while running and time.monotonic() < deadline:
        time.sleep(POLL_S)
        running = sum(ray.get(board.reports.remote()).values())
    return running
