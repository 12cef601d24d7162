"""A checkpoint when a node is about to go (docs/design.md §9).

Ray Train 2.60 watches the cluster's drain notices (a spot reclaim that the autoscaler or KubeRay turns
into a node drain, or ``ray drain-node``) and tells the workers through ``ray.train.get_preemption_info()``:
None, or which nodes and ranks go, by when. It is a collective (rank 0's answer, broadcast), so every
rank asks at the same steps: every ``train.preemption_check_every`` steps. The first notice makes the
stage save a checkpoint at that step, whatever ``checkpoint_every`` says; training goes on, and when
the node goes Ray Train restarts the group from that checkpoint (``max_preemption_failures: -1``), so
a preemption with notice loses only the steps between that checkpoint and the node's end (the regular
checkpoints keep being saved meanwhile). A node lost without notice costs what a crash costs: the
steps since the last checkpoint.

``train.debug_drain_at_step``: the tests' real notice. Rank 0 asks Ray to drain its own node (deadline
far enough for the test's short stage to finish first) and every rank waits for Ray Train's notice.
"""

from __future__ import annotations

import time
from typing import Any

NOTICE_WAIT_S = 60.0  # the tests' drain reaches the workers within Ray Train's poll interval (5 s by default)
DEBUG_DEADLINE_S = 600.0


class PreemptionWatch:
    """Asks Ray Train for a preemption notice every ``every`` steps (0: never); ``due(step)`` is a
    notice the first time it is seen, to checkpoint on, else None (a notice withdrawn and given again
    is seen again)."""

    def __init__(self, every: int, drain_at_step: int | None, rank: int):
        self.every, self.drain_at_step, self.rank = every, drain_at_step, rank
        self.noticed = False  # a notice already checkpointed on: the workers keep training until the node goes

    def due(self, step: int) -> Any:
        import ray.train

        if step == self.drain_at_step:
            self._drain_own_node()
        if not self.every or step % self.every:
            return None
        notice = ray.train.get_preemption_info()  # a collective: every rank asks at this step, gets rank 0's
        first, self.noticed = notice is not None and not self.noticed, notice is not None
        return notice if first else None

    def _drain_own_node(self) -> None:
        """The testing hook (module docstring): a real drain of rank 0's node, then every rank waits
        for the notice (the same broadcast answer on every rank, so they leave the loop together)."""
        import ray
        import ray.train
        from ray._private.worker import global_worker  # the GCS's drain call: `ray drain-node` in-process
        from ray.core.generated import autoscaler_pb2

        if self.rank == 0:
            reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
            deadline_ms = int((time.time() + DEBUG_DEADLINE_S) * 1000)
            node = ray.get_runtime_context().get_node_id()
            global_worker.gcs_client.drain_node(node, reason, "train.debug_drain_at_step", deadline_ms)
        start = time.monotonic()
        while ray.train.get_preemption_info() is None:
            if time.monotonic() - start > NOTICE_WAIT_S:
                raise RuntimeError(f"no preemption notice {NOTICE_WAIT_S:.0f} s after draining the node")
            time.sleep(0.5)
