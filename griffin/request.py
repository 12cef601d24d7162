"""A request to the batching engine (``DecodeRequest``) and its decode in progress there (``Row``):
its output so far, its stats, the pairs the draft has not seen yet, and, once done, its result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from griffin.config import SamplingConfig
from griffin.results import GenerationResult, GenerationStats, LogprobRecorder, TokenCallback
from griffin.verify import position_keys


@dataclass
class DecodeRequest:
    prompt: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int | None = None  # keys T>0 sampling (griffin.verify.position_keys); None: a fresh one
    stop_token_ids: list[int] | None = None  # None: the target's
    speculative: bool = True  # False: this request never drafts (A/B through one endpoint)
    on_tokens: TokenCallback | None = None  # each round's committed tokens; raising ends the request
    logprobs: LogprobRecorder | None = None
    on_done: Callable[["Row"], None] | None = None  # called once with the finished row (its result or error)


@dataclass
class Row:
    """A request's decode in progress, and, once ``done`` is set, its ``result`` or ``error``."""

    request: DecodeRequest
    stop: set[int]
    seed: int  # the request's, or a fresh one drawn at submit
    out: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    # committed positions the draft has not seen, a (T_i, D_f) run per round, and the token after each
    # ((T_i,) runs; the last is the root): kept as runs, joined once at the catch-up, so that plain
    # rounds (the draft idle) never copy the growing backlog
    pending_features: list[Tensor] = field(default_factory=list)
    pending_tokens: list[Tensor] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the target's KV: a long prompt goes in chunks (decode.prefill_chunk)
    finish: str | None = None
    cancelled: bool = False
    error: BaseException | None = None
    result: GenerationResult | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def root(self) -> int:
        return self.out[-1]

    def keys(self, count: int) -> list[int]:
        """The keys of this row's next ``count`` output positions (griffin.verify.position_keys)."""
        return position_keys(self.seed, len(self.out), count)
