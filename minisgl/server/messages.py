"""What crosses the ZMQ sockets between the HTTP process and the scheduler process (pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling_params import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class GrammarSpec:
    """A constrained output, compiled in the scheduler process (xgrammar's compiled grammars do
    not cross processes): `kind` json_schema (text: the schema as JSON), json_object, regex or ebnf."""

    kind: str
    text: str = ""


@dataclass(frozen=True)
class GenerateRequest:
    """HTTP -> scheduler: start one generation (one choice of one prompt)."""

    rid: int  # the HTTP process's id; the scheduler maps it to the LLM's own
    prompt_ids: list[int]
    params: SamplingParams
    grammar: GrammarSpec | None = None


@dataclass(frozen=True)
class AbortRequest:
    """HTTP -> scheduler: the client went away, or a stop string matched."""

    rid: int


@dataclass(frozen=True)
class Shutdown:
    """HTTP -> scheduler: finish (drain) or abort what is in flight, check the pools, exit."""

    drain: bool


@dataclass(frozen=True)
class EngineInfo:
    """Scheduler -> HTTP, once, when the engine is up (or `error` when it could not start)."""

    vocab_size: int = 0
    max_seq_len: int = 0  # prompt + new tokens
    loop: str = ""
    device: str = ""
    kv_tokens: int = 0
    speculative: str | None = None  # the speculative algorithm, if on: its requests take no grammar, no logprobs
    eos_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids: they stop a request unless ignore_eos
    error: str | None = None


@dataclass
class TokenDelta:
    """New committed tokens of one request. `finish_reason` on its last delta; `error` when the
    engine refused the request (nothing ran)."""

    rid: int
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def __reduce__(self):
        # Pickled as its fields in order, cheaper than the default (which pickles a __dict__ and
        # rebuilds through copyreg): paid per request per step by both processes.
        return TokenDelta, (self.rid, self.token_ids, self.logprobs, self.finish_reason, self.error)


@dataclass(frozen=True)
class Load:
    """The scheduler's occupancy after a step, for /metrics."""

    num_running: int
    num_queue: int
    kv_used: int  # KV slots held by requests (not the free ones, not the radix cache's)
    kv_total: int


@dataclass
class StepOutput:
    """Scheduler -> HTTP after every step that changed something, and at least every
    scheduler_process.HEARTBEAT_S while its loop runs (a heartbeat: no deltas, the same load)."""

    deltas: list[TokenDelta]
    load: Load
    fatal: str | None = None  # the engine failed: every request in flight is lost, the process exits
