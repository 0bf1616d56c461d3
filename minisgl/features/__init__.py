"""The features that plug into the lesson core through the seams of `minisgl/seams.py`.

Each lives in its own module, and the core never imports them: `plug_in` builds what a
scheduler's config asks for, and the front end hands it to the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..seams import Features
from .grammar import DelayedSampling
from .logprobs import LogprobsFeature
from .prefill_gate import PrefillGate
from .retraction import OptimisticAdmission

if TYPE_CHECKING:
    from ..scheduler import Scheduler


def plug_in(sched: Scheduler) -> Features:
    config = sched.config
    return Features(
        admission=OptimisticAdmission() if config.admission == "optimistic" else None,
        prefill_gate=PrefillGate(config.min_prefill_tokens, config.max_running_requests)
        if config.min_prefill_tokens else None,
        grammar=DelayedSampling(sched),
        logprobs=LogprobsFeature())
