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
    if config.enable_mixed_chunk and config.speculative_algorithm is not None:
        # SGLang switches mixed chunk off for STANDALONE and NGRAM (SpeculativeAlgorithm.supports_mixed_chunk)
        raise ValueError(f"enable_mixed_chunk does not combine with speculative_algorithm="
                         f"{config.speculative_algorithm!r} (nor does it in SGLang); choose one")
    return Features(
        admission=OptimisticAdmission() if config.admission == "optimistic" else None,
        prefill_gate=PrefillGate(config.min_prefill_tokens, config.max_running_requests)
        if config.min_prefill_tokens else None,
        grammar=DelayedSampling(sched.engine, sched.rows, sched.tracer, sched.stats, sched.mechanisms),
        logprobs=LogprobsFeature(),
        speculation=SpeculativeDecoding(sched) if config.speculative_algorithm is not None else None,
        mixed_chunk=MixedChunk(sched.mechanisms) if config.enable_mixed_chunk else None)
