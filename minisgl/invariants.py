"""Who owns the memory: the report (`LLM.memory_report()`) and an audit anyone can run (`LLM.check_invariants()`).

Between two steps (a batch may be in flight) the audit checks from scratch that every KV slot is exactly one of
free, the radix cache's, a live request's or the reserved slot 0; that every request-pool row is free, a live
request's, or deferred (a batch in flight may still write it, so it is never free); and that no request sits in two queues.
`MINISGL_CHECK_INVARIANTS=1` runs it after every scheduler step (the tests do)."""

from __future__ import annotations

from collections import Counter, deque
from functools import lru_cache
from typing import Protocol

from .batch import RunningBatch
from .kv_pool import KVPool, ReqToTokenPool
from .radix_cache import RadixCache
from .request import Req
from .rows import RowTracker


class Owners(Protocol):
    """What the audit reads of the scheduler: every owner of a KV slot, a row or a request.
    A protocol, not the Scheduler class, so that scheduler.py can import this module."""

    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    cache: RadixCache
    waiting: deque[Req]
    prefilling: list[Req]
    running: RunningBatch
    releasing: list[Req]
    rows: RowTracker


class InvariantError(AssertionError):
    """A KV slot, request row or request is not owned exactly once."""


def memory_report(sched: Owners) -> dict[str, int]:
    return {
        "kv_total": sched.kv_pool.kv_tokens,
        "kv_free": sched.kv_pool.free_count,
        "kv_cached": sched.cache.total_size,
        "rows_total": sched.req_to_token.max_running_requests,
        "rows_free": sched.req_to_token.free_count,
    }


@lru_cache(maxsize=4)
def _every_slot(num_slots: int) -> frozenset[int]:
    return frozenset(range(num_slots))


def check_invariants(sched: Owners) -> None:
    queues = {"waiting": list(sched.waiting), "prefilling": sched.prefilling, "running": sched.running.reqs,
              "releasing": sched.releasing}
    seen: dict[int, str] = {}
    for name, reqs in queues.items():
        for req in reqs:
            if req.rid in seen:
                raise InvariantError(f"request {req.rid} is in both {seen[req.rid]} and {name}")
            seen[req.rid] = name
    # Live: admitted and not yet released. (A finished request may still sit in `running`
    # until the next schedule() filters it; its resources went back at its commit.)
    live = {req.rid: req for reqs in queues.values() for req in reqs if req.row >= 0 and not req.released}

    held = sched.kv_pool.free_slots() + radix_slots(sched.cache) + [KVPool.RESERVED_SLOT]
    for req in live.values():
        held += req.slot_ids[req.cached_len:]
    num_slots = sched.kv_pool.num_slots
    # exactly the ids 0..num_slots-1, once each: the common case, without the per-slot count below
    # (the tests audit every step)
    if len(held) == num_slots and set(held) == _every_slot(num_slots):
        wrong = {}
    else:
        owners = Counter(held)
        wrong = {slot: n for slot in range(num_slots) if (n := owners[slot]) != 1}
    if wrong:
        leaked = sorted(s for s, n in wrong.items() if n == 0)
        doubled = sorted(s for s, n in wrong.items() if n > 1)
        raise InvariantError(f"KV slots not owned exactly once: {len(leaked)} owned by nobody (leaked) "
                             f"{leaked[:8]}, {len(doubled)} owned twice {doubled[:8]}")

    rows: Counter[int] = Counter(sched.req_to_token.free_rows())
    rows.update(req.row for req in live.values())
    rows.update(sched.rows.deferred_rows)
    wrong_rows = {row: n for row in range(sched.req_to_token.max_running_requests) if (n := rows[row]) != 1}
    if wrong_rows:
        raise InvariantError(f"request rows not owned exactly once (row: owners): {dict(list(wrong_rows.items())[:8])}")
    # A free row goes to the next admission, whose prefix copy into the row's table line runs on the
    # scheduler stream, unordered with a batch in flight that still writes that line.
    reused_early = [row for row in sched.req_to_token.free_rows() if sched.rows.in_flight(row)]
    if reused_early:
        raise InvariantError(f"request rows free while a batch in flight uses them: {reused_early[:8]}")
    check_radix_cache(sched.cache)


def radix_slots(cache: RadixCache) -> list[int]:
    """Every KV slot the tree holds (for the ownership audit)."""
    out: list[int] = []
    stack = [cache.root]
    while stack:
        node = stack.pop()
        out += node.slots.tolist()
        stack.extend(node.children.values())
    return out

def check_radix_cache(cache: RadixCache) -> None:
    """Walk the whole radix tree and assert that its bookkeeping is consistent."""
    evictable = protected = nodes = 0
    queued = {entry[1] for entry in cache._leaf_heap if cache._is_current(entry)}
    stack = [cache.root]
    while stack:
        node = stack.pop()
        if node is not cache.root and node.is_leaf() and node.lock_ref == 0:
            assert node.id in queued, "an unlocked leaf is not queued for eviction"
        for first, child in node.children.items():
            nodes += 1
            assert len(child) > 0, "child with empty key"
            assert child.key[0] == first, "child stored under wrong first token"
            assert child.parent is node, "broken parent pointer"
            assert child.slots.dim() == 1 and len(child.slots) == len(child), \
                "slots/key length mismatch"
            assert child.lock_ref >= 0, "negative lock_ref"
            assert node is cache.root or node.lock_ref >= child.lock_ref, \
                "parent less locked than child"
            if child.lock_ref == 0:
                evictable += len(child)
            else:
                protected += len(child)
            stack.append(child)
    assert evictable == cache._evictable, f"evictable {cache._evictable} != {evictable}"
    assert protected == cache._protected, f"protected {cache._protected} != {protected}"
    assert nodes == cache._num_nodes, f"{cache._num_nodes} nodes counted, {nodes} in the tree"
