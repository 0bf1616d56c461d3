"""The named overlap mechanisms: every one can be switched off to watch what breaks.

Each name is checked at the line that implements it (`mechanisms.on("name")`), next to a comment saying what breaks
without it and which section of lessons/readings explains it. One `Mechanisms` object answers for the whole engine
(scheduler, engine, staging), and it refuses a name it does not know, so a typo can never silently read as "on"."""

from __future__ import annotations

from typing import Iterable

MECHANISMS: dict[str, str] = {
    "future_map": "next batch's input ids gathered on the device from a buffer keyed by request-pool row "
    "(off: the scheduler waits for batch n's tokens before building n+1, the bubble returns)",
    "batch_snapshot": "the result queue holds a snapshot of batch n, not the live running batch "
    "(off: results land on the wrong requests after filter/merge)",
    "skip_finished": "late results of requests already finished (overshoot, aborted) are dropped "
    "(off: a token after EOS leaks into the output and the request is finished and freed twice)",
    "release_allocated": "KV released by allocated length, covering the overshoot slot "
    "(off: KV slots leak, kv_free ends below kv_total)",
    "commit_point_cache": "a finished prefix is handed to the radix cache (and its slots released) only at the "
    "commit point (off: handed over when its last step is planned; a request in the same batch reuses slots "
    "that step still reads: wrong tokens)",
    "deferred_row_free": "a request-pool row is reused only after the last in-flight batch that uses it commits "
    "(off: the old request's late write lands in the recycled row, ABA: wrong tokens)",
    "staging_double_buffer": "two host staging buffers for batch metadata alternate, so batch n+1 is written "
    "into the other buffer while the device may still read batch n's (off: one buffer; with staging_war_wait "
    "on the host waits for the device to read it, correct but the wait adds idle; with both off: wrong tokens)",
    "staging_war_wait": "before a staging buffer is rewritten the host waits for the event recorded after the "
    "device read it: the write-after-read barrier (off, with two buffers: still correct, because batch n "
    "commits before batch n+2 is planned; off with one buffer: batch n's metadata is overwritten: wrong tokens)",
    "row_generation_check": "a late result whose request-pool row was recycled is recognised by the row's "
    "generation and dropped (off, with deferred_row_free also off: the old request's late token is committed "
    "to the row's new owner)",
    "length_lookahead": "requests that will finish by length are left out of the next batch "
    "(off: wasted overshoot steps, counted in stats)",
    "prefill_sync": "consecutive prefill batches commit before the next launch, so the first one's tokens "
    "do not wait for the second's launch (off: no device idle between prefills, first tokens committed later "
    "when a launch is slow)",
    "cuda_graph": "(GPU) decode batches replay captured CUDA graphs (off: eager launches)",
    "pinned_copy": "(GPU) results copied device-to-host into pinned memory with a copy_done event "
    "(off: a blocking copy that stalls the host)",
    "retract_skip_inflight": "(admission=\"optimistic\") the in-flight batch's result for a request retracted "
    "since its launch is skipped at commit (off: the late token is appended to the waiting request, which then "
    "re-samples that step after its re-prefill: a repeated token, outputs differ from reserve)",
    "grammar_delayed_sample": "with a grammar in the batch, sampling waits until the previous batch is committed, "
    "so each mask is built from the grammar state after the request's latest token (off: masks built at planning, "
    "from a state one token behind in the overlap loop: outputs break their grammar)",
    "logprob_snapshot": "the rows and output indices of a batch's logprobs are fixed from the request lengths at "
    "planning (off: recomputed at commit from live lengths that the next schedule moved: each logprob lands one "
    "token late in the overlap loop)",
    "spec_alloc_reserve": "(speculation) KV for two verify steps past the committed length (off: unallocated writes)",
    "spec_publish_wait": "(speculation) the lengths' mirror is read after their publish (off: stale, wrong tokens)",
    "mixed_prefix_from_launched": "(mixed chunk) decode rows at the launched length (off: committed - 1, wrong tokens)",
}


def check_disable(names: Iterable[str]) -> frozenset[str]:
    """Validate a `disable=` argument: an unknown name is a ValueError that lists the valid ones."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n]
    if isinstance(names, (bytes, bytearray)) or not isinstance(names, Iterable):
        raise TypeError(f"disable must be a mechanism name or a list of names, got {type(names).__name__}")
    names = list(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"disable must list mechanism names (strings), got {names!r}")
    disabled = frozenset(names)
    unknown = sorted(disabled - MECHANISMS.keys())
    if unknown:
        raise ValueError(f"unknown mechanism(s) {unknown}; valid names: {sorted(MECHANISMS)}")
    return disabled


class Mechanisms:
    """The switches of one engine: `on(name)` is True unless disabled; a misspelt name raises, never reads "on"."""

    def __init__(self, disabled: Iterable[str] = ()) -> None:
        self.disabled = check_disable(disabled)

    def on(self, name: str) -> bool:
        if name not in MECHANISMS:
            raise KeyError(f"no mechanism named {name!r}; known: {sorted(MECHANISMS)}")
        return name not in self.disabled

    def __repr__(self) -> str:
        return f"Mechanisms(disabled={sorted(self.disabled)})"
