"""The features that plug into the lesson core through the seams of `minisgl/seams.py`.

Each lives in its own module, and the core never imports them: `plug_in` builds what a
scheduler's config asks for, and the front end hands it to the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..seams import Features
from .grammar import DelayedSampling
from .logprobs import LogprobsFeature
from .mixed_chunk import MixedChunk
from .prefill_gate import PrefillGate
from .retraction import OptimisticAdmission
from .speculative import SpeculativeDecoding

if TYPE_CHECKING:
    from ..scheduler import Scheduler


def plug_in(sched: Scheduler) -> Features:
    config = sched.config
    speculation = SpeculativeDecoding(sched) if config.speculative_algorithm is not None else None
    return Features(
        admission=(OptimisticAdmission(speculation.step_need if speculation else len)
                   if config.admission == "optimistic" else None),
        prefill_gate=PrefillGate(config.min_prefill_tokens, config.max_running_requests)
        if config.min_prefill_tokens else None,
        grammar=DelayedSampling(sched),
        logprobs=LogprobsFeature(),
        speculation=speculation,
        mixed_chunk=MixedChunk(sched.mechanisms) if config.enable_mixed_chunk else None)
