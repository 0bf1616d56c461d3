"""Requests and their sampling parameters: what the scheduler tracks for one generation.

The overlap scheduler keeps four moments of a token apart (lessons/readings §1 and §7):

- planned      the scheduler allocated a KV slot for it and built metadata (not launched)
- in flight    its batch is queued on the engine stream; the host cannot read the result
- materialized the sampled id sits in the FutureMap on the device; the next batch may use it
- committed    copy_done passed and the host appended it to `output_ids`

So a request carries several lengths, each a different moment, never mixed up:
`allocated_len` (planned KV slots) >= `launched_len` (positions whose KV a launched batch
writes) >= `kv_committed_len` (positions written by batches already committed), and
`committed_len` (prompt + committed output ids) lags the device by `inflight_samples`.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .checks import INT64_MAX, INT64_MIN, check_bool, check_int, check_real, check_token_ids, is_int
from .constraint import REJECTED, Constraint

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the staging buffers' dtype
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32 (kernels may flush subnormals to 0)
TOP_K_MAX = (1 << 31) - 1  # int32 range: already far more than any vocabulary

if TYPE_CHECKING:
    from .radix_cache import TreeNode


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token. Checked when built: a bad value is a TypeError/ValueError here,
    never a failure on the device later (see checks.py for why)."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = -1  # -1 means the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    grammar: Constraint | None = None  # allowed next tokens per state (features/grammar.py Grammar)
    logprobs: int | None = None  # k: return each token's logprob and its top-k alternatives

    def __post_init__(self) -> None:
        # A tuple before validating: a generator would be used up by the check and leave no stop
        # ids. A tuple also keeps the frozen params hashable, and nobody edits them in flight.
        stop = self.stop_token_ids
        if hasattr(stop, "__iter__") and not isinstance(stop, (str, bytes, bytearray)):
            object.__setattr__(self, "stop_token_ids", tuple(stop))
        self.validate()
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in self.stop_token_ids))

    def validate(self, vocab: int | None = None) -> None:
        """Raise one clear TypeError/ValueError for a bad parameter (the engine keeps running).
        With `vocab`, stop token ids must also be in [0, vocab)."""
        check_int("max_new_tokens", self.max_new_tokens, 1, INT64_MAX)
        check_real("temperature", self.temperature, 0.0, FLOAT32_MAX)  # staged as float32
        check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_p < FLOAT32_TINY:
            # Staged as float32, a smaller top_p rounds (or is flushed) to 0: no token is kept,
            # and the sampler then answers token 0 at every step.
            raise ValueError(f"top_p must be at least {FLOAT32_TINY} (the smallest normal float32), got {self.top_p}")
        if not (is_int(self.top_k) and self.top_k == -1):
            check_int("top_k (-1 for off)", self.top_k, 1, TOP_K_MAX)
        if self.seed is not None:
            check_int("seed", self.seed, INT64_MIN, INT64_MAX)  # staged as int64
        check_bool("ignore_eos", self.ignore_eos)
        check_token_ids("stop_token_ids", self.stop_token_ids, INT64_MAX if vocab is None else vocab)
        if self.grammar is not None:
            if not isinstance(self.grammar, Constraint):
                raise TypeError(f"grammar must be a minisgl.features.grammar.Grammar (a Constraint) or None, "
                                f"got {type(self.grammar).__name__}")
            if vocab is not None:
                self.grammar.validate(vocab)
        if self.logprobs is not None:
            check_int("logprobs (top-k alternatives, or None)", self.logprobs, 0, TOP_K_MAX if vocab is None else vocab)


@dataclass
class TokenLogprob:
    """One generated token's logprob (the model's raw distribution, float32) and the top-k
    alternatives, most likely first (the token itself among them when it is in the top k)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    rid: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    metrics: dict[str, float] = field(default_factory=dict)  # RequestTimes.latency()
    logprobs: list[TokenLogprob | None] | None = None  # one per token, when SamplingParams.logprobs was set


@dataclass
class RequestTimes:
    """When a request arrived and when each of its output tokens was committed (seconds,
    time.perf_counter() clock). What TTFT, TPOT and the online bench's ITL are computed from."""

    arrival: float
    token_times: list[float] = field(default_factory=list)

    def latency(self) -> dict[str, float]:
        """The RequestOutput.metrics: ttft and e2e once a token is committed, tpot from two on."""
        if not self.token_times:
            return {}
        first, last = self.token_times[0], self.token_times[-1]
        latency = {"ttft": first - self.arrival, "e2e": last - self.arrival}
        if len(self.token_times) > 1:
            latency["tpot"] = (last - first) / (len(self.token_times) - 1)
        return latency


class Req:
    """One generation request, as the scheduler sees it."""

    def __init__(self, rid: int, prompt_ids: list[int], params: SamplingParams, eos_ids: frozenset[int],
                 model_window: int, sample_seed: int) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sample_seed = sample_seed  # params.seed, or one drawn at arrival for unseeded sampling
        # EOS ids (from the model's config) plus the request's own stop ids.
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        # The model's window caps generation: finishing there counts as "length".
        self.max_new_tokens = min(params.max_new_tokens, model_window - len(prompt_ids))

        self.output_ids: list[int] = []  # committed tokens only
        self.logprobs: list[TokenLogprob | None] = []  # by output index, committed with the tokens
        # Grammar state after the committed tokens: advanced at commit, never at planning.
        self.grammar_state = params.grammar.initial_state() if params.grammar is not None else REJECTED
        self.finish_reason: str | None = None
        self.abort_requested = False

        # Request-pool row and its generation (bumped at every reuse, so late readers can
        # tell a recycled row from the one they were launched with).
        self.row = -1  # assigned at admission, kept until released
        self.row_generation = -1
        # KV slot of every planned position, host mirror of this row of the req-to-token table.
        self.slot_ids: list[int] = []
        self.prefix_node: TreeNode | None = None  # radix-cache node locked for the matched prefix
        self.cached_len = 0  # prompt positions taken from the radix cache at admission
        # Committed ids that a prefill must cover: the prompt, or after a retraction the prompt
        # and every output committed before it (re-prefilled, through the radix cache where it can).
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
        """Back to waiting, its resources already released: it resumes from its committed tokens.

        The next prefill covers everything committed, so its sample is output index
        len(output_ids), the step the seeded sampler would have used anyway. The sample in
        flight now is forgotten: its result must be skipped at its commit (retract_skip_inflight)."""
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
        """Append a committed token, store its logprob (at the output index it came with), advance
        the grammar, and decide whether the request is finished."""
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
