"""What a caller hands in and gets back: sampling parameters, outputs, per-token logprobs and times."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from .checks import INT64_MAX, INT64_MIN, check_bool, check_int, check_real, check_token_ids, is_int
from .constraint import Constraint

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the staging buffers' dtype
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32 (kernels may flush subnormals to 0)
TOP_K_MAX = (1 << 31) - 1  # int32 range: already far more than any vocabulary


SPECULATIVE_WHY = ("its verify step applies no token mask and computes no logprobs (SGLang's EAGLE/STANDALONE "
                   "verify does both)")


def speculative_refuses(grammar: object | None, logprobs: int | None) -> str | None:
    """What speculative decoding cannot run, "grammar" or "logprobs" (SPECULATIVE_WHY says why), else
    None. The engine refuses it at add() (features/speculative), the server as a 400 before any work."""
    if grammar is not None:
        return "grammar"
    if logprobs is not None:
        return "logprobs"
    return None


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
        """One clear TypeError/ValueError for a bad parameter; with `vocab`, token ids must be in [0, vocab)."""
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


def stop_ids(params: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """The token ids that end a request: its stop_token_ids, and the model's end-of-sequence ids
    unless ignore_eos."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)


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
    """When a request arrived and each output token was committed (perf_counter seconds): TTFT, TPOT, ITL."""

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
