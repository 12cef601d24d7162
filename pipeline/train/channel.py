"""The stage's channel: one Ray actor that the driver and the ranks of a running stage share. A light
module (no torch): the actor's process imports only this."""

from __future__ import annotations

from typing import Any

from pipeline.train.stream import StreamStart


class StageChannel(StreamStart):
    """What the driver and the ranks of a running stage share, as one Ray actor with no CPU of its own
    (``ray.remote(num_cpus=0)``): where the stage's stream starts (``StreamStart``), and where the stage
    is: rank 0 pushes each step (fire and forget), the driver reads the latest for its console line."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, Any] = {}

    def update(self, step: int, loss: float, score: float | None) -> None:
        self.state = {"step": step, "loss": loss, "score": score if score is not None else self.state.get("score")}

    def latest(self) -> dict[str, Any]:
        return self.state
