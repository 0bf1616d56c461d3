"""A request as the scheduler tracks it (its parameters: sampling_params.py; lessons/readings §1, §7).

Four moments of a token: planned (KV slot and metadata ready), in flight (its batch queued),
materialized (in the FutureMap, usable by the next batch), committed (in `output_ids`, after copy_done).
Each length is one moment, never mixed up: `allocated_len` (planned KV slots) >= `launched_len` (KV a
launched batch writes) >= `kv_committed_len` (KV that committed batches wrote); `committed_len`
(prompt + committed output ids) lags the device by `inflight_samples`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .constraint import REJECTED
from .sampling_params import RequestTimes, SamplingParams, TokenLogprob, stop_ids

if TYPE_CHECKING:
    from .radix_cache import TreeNode


class Req:
    def __init__(self, rid: int, prompt_ids: list[int], params: SamplingParams, eos_ids: frozenset[int],
                 model_window: int, sample_seed: int) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sample_seed = sample_seed  # params.seed, or one drawn at arrival for unseeded sampling
        self.stop_ids = stop_ids(params, eos_ids)
        # The model's window caps generation: finishing there counts as "length".
        self.max_new_tokens = min(params.max_new_tokens, model_window - len(prompt_ids))

        self.output_ids: list[int] = []  # committed tokens only
        self.logprobs: list[TokenLogprob | None] = []  # by output index, committed with the tokens
        # Grammar state after the committed tokens: advanced at commit, never at planning.
        self.grammar_state = params.grammar.initial_state() if params.grammar is not None else REJECTED
        self.finish_reason: str | None = None
        self.abort_requested = False

        # Request-pool row and its generation (bumped at each reuse: a late reader detects a recycled row).
        self.row = -1  # assigned at admission, kept until released
        self.row_generation = -1
        self.slot_ids: list[int] = []  # KV slot of every planned position (host mirror of the row's table)
        self.prefix_node: TreeNode | None = None  # radix-cache node locked for the matched prefix
        self.cached_len = 0  # prompt positions taken from the radix cache at admission
        # Ids a prefill must cover: the prompt, plus (after a retraction) every output committed before it.
        self.prefill_len = len(self.prompt_ids)
        self.retractions = 0  # times this request gave its KV back and went back to waiting

        self.launched_len = 0  # positions whose KV a launched batch writes
        self.kv_committed_len = 0  # positions whose KV batches already committed have written
        self.inflight_samples = 0  # sampled tokens launched but not yet committed
        self.reserved_tokens = 0  # KV slots this request may still need (admission promise)
        self.released = False  # KV, cache lock and row given back (exactly once)

        self.times = RequestTimes(arrival=time.perf_counter())

    # --- derived lengths: properties, so they can never drift apart -------------------------
    @property
    def allocated_len(self) -> int:
        return len(self.slot_ids)

    @property
    def committed_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_launched(self) -> bool:
        return self.launched_len >= self.prefill_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_at(self, position: int) -> int:
        """Committed token id at `position` (prompt or output)."""
        if position < self.prompt_len:
            return self.prompt_ids[position]
        return self.output_ids[position - self.prompt_len]

    def committed_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def prefill_ids(self, start: int, n: int) -> list[int]:
        """Ids of prefill positions [start, start + n): prompt ids, then (after a retraction) outputs."""
        ids = self.prompt_ids if start + n <= self.prompt_len else self.committed_ids()
        return ids[start:start + n]

    def reset_for_retract(self) -> None:
        """Back to waiting, resources released: the next prefill covers everything committed; the
        sample in flight is forgotten, its result skipped at its commit (retract_skip_inflight)."""
        self.prefill_len = self.committed_len
        self.inflight_samples = 0
        self.row = self.row_generation = -1
        self.prefix_node = None
        self.retractions += 1

    def will_finish_by_length(self) -> bool:
        """True when the samples already launched reach max_new_tokens (known before commit)."""
        return len(self.output_ids) + self.inflight_samples >= self.max_new_tokens

    @property
    def next_sample_index(self) -> int:
        """Output index of the most recently planned sample (the seeded sampler's step)."""
        return len(self.output_ids) + self.inflight_samples - 1

    def commit_token(self, token: int, logprob: tuple[int, TokenLogprob] | None = None) -> None:
        """Append a committed token and its logprob, advance the grammar, decide whether it finished."""
        self.output_ids.append(token)
        if logprob is not None:
            index, entry = logprob
            self.logprobs += [None] * (index + 1 - len(self.logprobs))  # only a wrong index leaves a gap
            self.logprobs[index] = entry
        self.times.token_times.append(time.perf_counter())
        grammar = self.params.grammar
        if grammar is not None:
            self.grammar_state = grammar.advance(self.grammar_state, token)
        if token in self.stop_ids or (grammar is not None and grammar.is_final(self.grammar_state)):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid}, row={self.row}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
                f"launched={self.launched_len}, alloc={self.allocated_len}, finish={self.finish_reason})")
