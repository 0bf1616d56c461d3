"""The public API: `LLM(...).generate(prompts, SamplingParams(...))`, plus an incremental
interface (`add_request`, `step`, `abort`, `collect`) for staggered arrivals and lessons."""

from __future__ import annotations

import os
import random
import warnings
import weakref
from typing import Callable, Sequence

import torch

from ..checks import INT64_MAX, check_int, check_token_ids
from ..config import EngineConfig, resolve_config
from ..engine import Engine
from ..invariants import check_invariants, memory_report
from ..mechanisms import Mechanisms
from ..request import Req
from ..sampling_params import RequestOutput, SamplingParams, TokenLogprob
from ..features import plug_in
from ..scheduler import Scheduler
from .driving import DrivingMixin
from .guard import Guard, Held, whole
from .tokenizer import check_tokenizer_fits, eos_ids, load_tokenizer
from .validation import Prompt, check_params, params_list, prompt_list


class LLM(DrivingMixin):
    """An engine on one device. Not thread-safe by design: one LLM serves one thread at a time,
    and a call while another thread is inside it raises RuntimeError at once (state is never
    shared half-updated). `close()` frees it; any later use raises RuntimeError."""

    def __init__(self, model_path: str | os.PathLike, device: str | torch.device | None = None,
                 loop: str = "overlap", disable: Sequence[str] | str = (), device_delay_ms: float = 0.0,
                 dtype: str | torch.dtype | None = None, max_running_requests: int | None = None,
                 chunk_size: int | None = None, kv_tokens: int | None = None, trace: bool = False,
                 attention_backend: str = "auto", host_delay_ms: float = 0.0, deterministic: bool = False,
                 admission: str = "reserve", min_prefill_tokens: int | None = None,
                 speculative_algorithm: str | None = None, speculative_num_steps: int = 3,
                 speculative_draft_model_path: str | os.PathLike | None = None, enable_mixed_chunk: bool = False,
                 fused_kernels: bool = True, tensor_core_decode_min_batch: int | None = 1,
                 fast_decode_plan: bool = True, piecewise_cuda_graph: bool = True) -> None:
        """The keywords are the engine's settings, in minisgl.config.SETTINGS with their ranges and help
        (a test holds this signature to that table)."""
        settings = {name: value for name, value in locals().items() if name not in ("self", "model_path")}
        # Every argument is checked before anything is started, so a bad one leaves nothing behind.
        self.config: EngineConfig = resolve_config(model_path, settings)
        self.device = self.config.device
        self.model_path = self.config.model_path
        self._closed = False
        self._guard = Guard()  # the one thread inside a call (see the class doc and guard.py)
        self._pid = os.getpid()  # the process whose threads run the engine (see _refuse)
        self._reqs: dict[int, Req] = {}  # queued or running
        self._results: dict[int, RequestOutput] = {}  # finished, not yet handed to the caller
        self._abandoned: set[int] = set()  # started by a generate() that raised: results dropped
        self._next_rid = 0
        self._rng = random.Random(0)
        # Ctrl-C held back while the engine starts (its worker thread would leak); raised, it stops it.
        held = Held()
        try:
            try:
                self._start_engine()
            finally:
                held.let_go()
            return
        except BaseException:
            if hasattr(self, "_stop_engine"):
                self._stop_engine()
            raise

    def _start_engine(self) -> None:
        try:
            engine = Engine(self.config)
        except OSError as exc:  # transformers reports an unreadable config.json as OSError
            raise ValueError(f"cannot load the model in {self.model_path}: {exc}") from exc
        # Stops the engine's worker thread if this LLM is dropped or the interpreter exits
        # unclosed (a torch kernel still running during interpreter teardown can abort it).
        self.engine, self._stop_engine = engine, weakref.finalize(self, _stop_engine, engine, self._pid, self._guard)
        self.engine.tracer.enabled = self.config.trace
        self.tokenizer = load_tokenizer(self.model_path)
        check_tokenizer_fits(self.tokenizer, self.engine.model.vocab_size, self.model_path)
        self.eos_ids = eos_ids(self.engine.model.config, self.tokenizer, self.model_path)
        self.scheduler = Scheduler(self.config, self.engine)
        self.scheduler.features = plug_in(self.scheduler)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + new tokens this engine holds (see EngineConfig.max_seq_len)."""
        return self.config.max_seq_len

    # ---------------------------------------------------------------- lifecycle
    def _refuse(self, reentered: bool, closing: bool) -> None:
        """guard.whole refuses a call; `reentered`: a driving call from on_step (see _REENTRANT)."""
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(_FORKED)
        if reentered:
            raise RuntimeError(_REENTRANT)
        error = self.scheduler.error
        if error is not None and not closing:
            raise RuntimeError(f"the engine failed earlier ({type(error).__name__}: {error}) and refuses "
                               f"further work; close() it and build a new LLM") from error

    def close(self) -> None:
        """Commit the batch in flight, stop the engine and free its memory. Idempotent: a close()
        cut short by a second Ctrl-C is finished by the next one. Raises only when another
        thread is inside a call; a failure while finishing is a warning, and the engine stops
        anyway (no worker thread is left behind). After a second Ctrl-C (a hung device) it
        does not wait for the device work in progress."""
        if self._closed:
            return
        if os.getpid() != self._pid:  # a fork()ed child: the engine's threads live in the parent only
            self._closed = True
            return
        self._close()

    @whole(drives=True, closing=True)
    def _close(self) -> None:
        if self.scheduler.error is None:
            try:
                self.scheduler.close()  # commits the batch in flight
            except Exception as exc:  # noqa: BLE001 - closing must still stop the engine below
                warnings.warn(f"LLM.close(): the batch in flight failed: {exc!r}", RuntimeWarning, stacklevel=4)
        self._stop_engine()
        self._closed = True

    def __enter__(self) -> "LLM":
        if self._closed:
            raise RuntimeError("this LLM is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- incremental interface
    @whole()
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Bad input raises ValueError/TypeError and changes nothing."""
        req = self._new_req(prompt, check_params(params), self._next_rid)
        self._queue(req)
        self._guard.undo.append(lambda: self._unqueue(req))  # its id never reached the caller
        return req.rid

    @whole(drives=True)
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; return the requests that finished in it, plus any
        finished earlier (during a generate()) and not collected yet."""
        self._step()
        return self._take_results()

    @whole(closing=True)
    def collect(self) -> list[RequestOutput]:
        """The finished requests not handed out yet, without running the engine. Also after the
        engine failed: what finished before the failure is still handed out."""
        return self._take_results()

    @whole()
    def abort(self, rid: int) -> None:
        """Stop request `rid`; it finishes with reason "abort" at the next step. A request that
        already finished (its result not collected yet) is left as it is."""
        check_int("rid", rid, 0, INT64_MAX)
        if rid in self._reqs:
            req, before = self._reqs[rid], self._reqs[rid].abort_requested
            self.scheduler.abort(req)  # only marks it: the scheduler acts on it in its next step
            self._guard.undo.append(lambda: setattr(req, "abort_requested", before))
        elif rid not in self._results:
            raise ValueError(f"unknown or finished request id {rid}")

    @whole()
    def new_output(self, sent: dict[int, int]) -> dict[int, tuple[list[int], list[TokenLogprob | None]]]:
        """Read-only, for streaming: for each queued or running request id in `sent`, the output
        tokens committed beyond the first sent[rid] (with their logprobs, empty unless asked for),
        where there are any. Finished requests come out of step() whole instead."""
        new = {}
        for rid, start in sent.items():
            req = self._reqs.get(rid)
            if req is not None and len(req.output_ids) > start:
                new[rid] = (req.output_ids[start:], req.logprobs[start:])
        return new

    @whole()
    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or a result waits to be collected."""
        return self.scheduler.has_work() or bool(self._results)

    @whole(drives=True)
    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. Validates all input before starting.

        Requests queued with add_request() run alongside; their results stay collectable
        (step(), collect()). If anything escapes (KeyboardInterrupt included), the requests
        this call started are aborted: the next drain gives back their rows and KV slots.
        `on_step(n_done)` runs after every step; it may add_request(), abort(), read memory,
        but not step(), generate() or close() (RuntimeError)."""
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be callable, got {type(on_step).__name__}")
        prompts = prompt_list(prompts)
        params = params_list(sampling_params, len(prompts))
        # Validate every request before queueing any, so bad input leaves nothing half-started.
        reqs = [self._new_req(p, sp, self._next_rid + i) for i, (p, sp) in enumerate(zip(prompts, params))]
        self._guard.undo.append(lambda: self._abandon(reqs))
        for req in reqs:
            self._queue(req)
        return self._run_until_done(reqs, on_step)

    def _new_req(self, prompt: Prompt, params: SamplingParams, rid: int) -> Req:
        """Validate everything about one request (raises ValueError/TypeError) without queueing it."""
        vocab = self.engine.model.vocab_size
        params.validate(vocab)
        ids = self._tokenize(prompt)
        max_seq_len, model_window = self.config.max_seq_len, self.config.model_window
        if len(ids) >= max_seq_len:
            limit = "the model" if max_seq_len == model_window else "kv_tokens"
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {max_seq_len} "
                             f"(prompt plus at least one new token; {limit} sets it)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        # max_new_tokens is cut at the model's window (finish "length"), never at the pool's
        # size: a request the pool is too small for is refused by check_fits() instead.
        req = Req(rid, ids, params, self.eos_ids, model_window, seed)
        self.scheduler.kv_ledger.check_fits(req)
        if self.scheduler.features.speculation is not None:
            self.scheduler.features.speculation.check_params(params)
        return req

    def _queue(self, req: Req) -> None:
        self.scheduler.add(req)
        self._reqs[req.rid] = req
        self._next_rid = req.rid + 1

    def _unqueue(self, req: Req) -> None:  # add_request() undone: nobody has its id
        if req not in self.scheduler.waiting:  # given back late, after another thread's step admitted it
            self._abandon([req])
            return
        self.scheduler.waiting.remove(req)  # still waiting: nothing ran while the call held Ctrl-C back
        del self._reqs[req.rid]
        self._next_rid = req.rid

    # ---------------------------------------------------------------- memory
    @whole()
    def memory_report(self) -> dict[str, int]:
        return memory_report(self.scheduler)

    @whole()
    def flush_cache(self) -> int:
        return self.scheduler.cache.flush()

    @whole()
    def check_invariants(self) -> None:
        """Raise InvariantError unless every KV slot, request row and request is owned exactly once
        (see minisgl/invariants.py). Cheap enough to call between any two steps."""
        check_invariants(self.scheduler)

    @property
    def stats(self):
        return self.scheduler.stats

    @whole()
    def reset_stats(self) -> None:
        """Zero the scheduler's counters and drop recorded spans (e.g. after a warm-up)."""
        self.scheduler.stats = type(self.scheduler.stats)()
        self.engine.tracer.clear()  # its batch records too

    @property
    def mechanisms(self) -> Mechanisms:
        """This engine's switches (`minisgl.MECHANISMS` describes every one)."""
        return self.config.mechanisms

    # ---------------------------------------------------------------- helpers
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: pass token ids instead of text")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # the tokenizer's own message does not say what is wrong
                raise ValueError(f"prompt is not valid Unicode text ({exc.reason} at index {exc.start})") from None
            ids = self.tokenizer.encode(prompt)
            vocab = self.engine.model.vocab_size
            if any(not 0 <= i < vocab for i in ids):  # the tokenizer knows more ids than the embedding has rows
                bad = sorted({i for i in ids if not 0 <= i < vocab})
                raise ValueError(f"the tokenizer turned this prompt into token ids {bad[:8]} outside the model's "
                                 f"vocabulary of {vocab}: the checkpoint's tokenizer and weights disagree")
        else:
            ids = check_token_ids("prompt", prompt, self.engine.model.vocab_size)
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _output(self, req: Req) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(req.rid, req.prompt_ids, list(req.output_ids), text, req.finish_reason or "abort",
                             req.times.latency(), list(req.logprobs) if req.params.logprobs is not None else None)


_FORKED = ("this LLM was created in another process: after fork() its engine's worker thread does not exist "
           "here, so it cannot run; create a new LLM in this process (or use the 'spawn' start method)")
_REENTRANT = ("generate(), step() and close() cannot be called from inside generate() (its on_step callback): "
              "they would take over the running call's requests")

# How long the finalizer at interpreter exit waits for a daemon thread's call to park (Guard.stop_calls):
# a step's worth, plus an on_step callback. Past it the engine is stopped under the call, which may
# then be inside a torch op as the interpreter finishes: SIGABRT (see Guard.park).
_PARK_TIMEOUT_S = 10.0


def _stop_engine(engine: Engine, pid: int, guard: Guard) -> None:
    """The finalizer: stop the engine, in the process that started it (a fork()ed child has
    no worker thread to stop, and a hung device's work is not waited for: Engine.hung). At
    interpreter exit a daemon thread may still be inside a call: it parks at its next step
    boundary first, and the engine's stream worker is joined (Engine.close), so that no thread of
    ours is inside a torch op when the interpreter finishes."""
    if os.getpid() == pid:
        guard.stop_calls(0.0 if engine.hung else _PARK_TIMEOUT_S)
        engine.close()
