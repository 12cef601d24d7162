"""A serving replica with compiled decoding (decode.compile=on) captures its steps on its own engine
thread before it reports ready (CUDA graphs belong to the capturing thread), then decodes what eager
decoding does, without compiling anything new."""

import torch

from griffin.config import SamplingConfig
from griffin.decode import speculative_generate
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.model import GriffinDraft
from pipeline.serve.replica import ReplicaEngine
from tests.conftest import make_target
from tests.griffin.test_compiled import TREE, compiled_graphs, compiled_twin


def test_replica_warms_up_on_its_thread_then_decodes_as_eager():
    """The replica's warm-up (before its constructor returns) compiles the decode steps anew after a
    dynamo reset; a request then decodes what eager decoding does without compiling anything more."""
    torch._dynamo.reset()
    at_reset = compiled_graphs()
    target = make_target("llama")
    twin = compiled_twin(target)
    torch.manual_seed(1)
    draft = GriffinDraft.for_target(target, variant="griffin")
    replica = ReplicaEngine(twin, draft, SpeculationPolicy({1: TREE}), max_rows=1)
    try:
        assert replica.engine.rounds > 0 and not replica.engine.busy  # warmed before the constructor returned
        graphs = compiled_graphs()
        assert graphs > at_reset  # the warm-up compiled: "nothing new" below means something
        prompt = torch.randint(3, 128, (11,), generator=torch.Generator().manual_seed(2)).tolist()
        row = replica.engine.submit(DecodeRequest(prompt, SamplingConfig(), 40, stop_token_ids=[]))
        assert row.done.wait(120) and row.error is None
        eager = speculative_generate(
            target, draft, torch.tensor([prompt]), TREE, SamplingConfig(), 40, stop_token_ids=[]
        )
        assert row.result.tokens == eager.tokens
        assert compiled_graphs() == graphs
    finally:
        replica.close()
