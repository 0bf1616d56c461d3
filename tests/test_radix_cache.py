import random
from typing import List

import pytest
import torch

from minisgl.kv_pool import KVAccountingError
from minisgl.invariants import check_radix_cache
from minisgl.radix_cache import RadixCache, TreeNode


class FakePool:
    """Records every slot the cache hands back."""

    def __init__(self) -> None:
        self.freed: List[int] = []
        self.calls = 0

    def __call__(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        self.calls += 1
        self.freed.extend(slots.tolist())


def make():
    pool = FakePool()
    return RadixCache(pool), pool


def t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def tree_slots(cache: RadixCache) -> List[int]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            out.extend(child.slots.tolist())
            stack.append(child)
    return out


def test_match_on_empty_tree():
    cache, _ = make()
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == torch.int64 and slots.numel() == 0
    assert node is cache.root
    slots, node = cache.match_prefix([])
    assert slots.numel() == 0 and node is cache.root
    assert cache.total_size == 0
    check_radix_cache(cache)


def test_insert_then_full_and_partial_match():
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], t([10, 11, 12, 13])) == 0
    assert cache.total_size == cache.evictable_size == 4

    slots, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert slots.tolist() == [10, 11, 12, 13]
    assert node.key == (1, 2, 3, 4)

    slots, node = cache.match_prefix([1, 2, 3, 4])
    assert slots.tolist() == [10, 11, 12, 13]

    slots, node = cache.match_prefix([9, 1])
    assert slots.numel() == 0 and node is cache.root
    check_radix_cache(cache)


def test_split_mid_edge_keeps_slots_and_sizes():
    cache, _ = make()
    cache.insert([1, 2, 3, 4, 5], t([10, 11, 12, 13, 14]))
    slots, node = cache.match_prefix([1, 2, 3, 9])
    assert slots.tolist() == [10, 11, 12]
    # the returned node ends exactly at the match
    assert node.key == (1, 2, 3) and node.slots.tolist() == [10, 11, 12]
    assert node.parent is cache.root
    (lower,) = node.children.values()
    assert lower.key == (4, 5) and lower.slots.tolist() == [13, 14]
    assert lower.parent is node
    assert cache.total_size == cache.evictable_size == 5
    check_radix_cache(cache)
    # full match still works through both halves
    slots, node2 = cache.match_prefix([1, 2, 3, 4, 5])
    assert slots.tolist() == [10, 11, 12, 13, 14] and node2 is lower


def test_split_of_locked_node_keeps_protected_size():
    cache, _ = make()
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.lock(node)
    assert cache.protected_size == 4
    _, upper = cache.match_prefix([1, 2])
    assert upper.lock_ref == 1
    assert cache.protected_size == 4 and cache.evictable_size == 0
    check_radix_cache(cache)
    cache.unlock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 4
    check_radix_cache(cache)


def test_insert_returns_already_present_prefix_len():
    cache, _ = make()
    assert cache.insert([1, 2, 3], t([10, 11, 12])) == 0
    assert cache.insert([1, 2, 3, 4, 5], t([20, 21, 22, 23, 24])) == 3
    # tree kept its own slots for the shared prefix, took the new suffix
    slots, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert slots.tolist() == [10, 11, 12, 23, 24]
    assert cache.insert([1, 2, 7], t([30, 31, 32])) == 2  # splits [1,2,3]
    slots, _ = cache.match_prefix([1, 2, 7])
    assert slots.tolist() == [10, 11, 32]
    assert cache.insert([1, 2, 3], t([40, 41, 42])) == 3  # nothing new
    assert cache.total_size == 6
    assert sorted(tree_slots(cache)) == [10, 11, 12, 23, 24, 32]
    check_radix_cache(cache)


def test_insert_copies_slots():
    cache, _ = make()
    row = t([10, 11, 12])
    cache.insert([1, 2, 3], row)
    row[:] = -1  # caller reuses its buffer
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [10, 11, 12]


def test_insert_length_mismatch_raises():
    cache, _ = make()
    with pytest.raises(KVAccountingError):
        cache.insert([1, 2, 3], t([1, 2]))


def test_lock_unlock_moves_sizes_and_protects():
    cache, pool = make()
    cache.insert([1, 2, 3], t([10, 11, 12]))
    cache.insert([1, 2, 3, 4, 5], t([0, 0, 0, 13, 14]))
    _, leaf = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(leaf)
    assert cache.protected_size == 5 and cache.evictable_size == 0
    cache.lock(leaf)  # second lock on the same path changes no sizes
    assert cache.protected_size == 5 and leaf.lock_ref == 2
    assert cache.evict(100) == 0 and pool.freed == []
    check_radix_cache(cache)
    cache.unlock(leaf)
    assert cache.protected_size == 5
    cache.unlock(leaf)
    assert cache.protected_size == 0 and cache.evictable_size == 5
    check_radix_cache(cache)
    assert cache.evict(100) == 5
    assert sorted(pool.freed) == [10, 11, 12, 13, 14]


def test_unlock_underflow_raises():
    cache, _ = make()
    cache.insert([1, 2], t([10, 11]))
    _, node = cache.match_prefix([1, 2])
    with pytest.raises((ValueError, RuntimeError)):
        cache.unlock(node)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises((ValueError, RuntimeError)):
        cache.unlock(node)
    assert node.lock_ref == 0
    check_radix_cache(cache)


def test_lock_root_is_noop():
    cache, _ = make()
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.total_size == 0
    check_radix_cache(cache)


def test_evict_lru_order_and_parent_after_children():
    cache, pool = make()
    cache.insert([1, 2], t([10, 11]))          # parent
    cache.insert([1, 2, 3], t([0, 0, 12]))     # child A
    cache.insert([1, 2, 4], t([0, 0, 13]))     # child B
    cache.insert([7, 8], t([20, 21]))          # separate leaf C
    # access order now: C newer than A/B; touch A to make it newest of all
    cache.match_prefix([1, 2, 3])
    # LRU leaves: B (oldest) then C then A; parent [1,2] only after A and B
    assert cache.evict(1) == 1
    assert pool.freed == [13]
    assert cache.evict(1) == 2
    assert pool.freed == [13, 20, 21]
    # A then its now-leaf parent
    assert cache.evict(2) == 3
    assert pool.freed == [13, 20, 21, 12, 10, 11]
    assert cache.total_size == 0
    check_radix_cache(cache)


def test_evict_skips_locked_nodes():
    cache, pool = make()
    cache.insert([1, 2, 3], t([10, 11, 12]))
    cache.insert([1, 2, 5], t([0, 0, 15]))
    cache.insert([9], t([19]))
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    freed = cache.evict(100)
    # only [5] and [9] can go; the shared parent [1,2] is locked through [3]
    assert freed == 2 and sorted(pool.freed) == [15, 19]
    assert cache.protected_size == 3 and cache.evictable_size == 0
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [10, 11, 12]
    check_radix_cache(cache)


def test_flush_frees_all_unlocked():
    cache, pool = make()
    cache.insert([1, 2, 3], t([10, 11, 12]))
    cache.insert([4, 5], t([14, 15]))
    cache.insert([1, 6], t([0, 16]))
    _, locked = cache.match_prefix([4, 5])
    cache.lock(locked)
    assert cache.flush() == 4
    assert sorted(pool.freed) == [10, 11, 12, 16]
    assert cache.total_size == cache.protected_size == 2
    cache.unlock(locked)
    assert cache.flush() == 2
    assert cache.total_size == 0 and list(cache.root.children) == []
    assert cache.flush() == 0
    check_radix_cache(cache)


def test_check_invariants_detects_corruption():
    cache, _ = make()
    cache.insert([1, 2, 3], t([10, 11, 12]))
    cache._evictable += 1
    with pytest.raises(AssertionError):
        check_radix_cache(cache)
    cache._evictable -= 1
    check_radix_cache(cache)
    child = cache.root.children.pop(1)
    cache.root.children[2] = child  # wrong first token
    with pytest.raises(AssertionError):
        check_radix_cache(cache)
    cache.root.children = {1: child}
    child.lock_ref = -1
    with pytest.raises(AssertionError):
        check_radix_cache(cache)
    child.lock_ref = 0
    cache.root.children[5] = TreeNode((), t([]), cache.root)
    with pytest.raises(AssertionError):
        check_radix_cache(cache)


def test_slot_accounting_simple():
    """Each slot given to insert ends up freed exactly once or still in the tree."""
    cache, pool = make()
    next_slot = 0
    caller_freed: List[int] = []
    handed: List[int] = []
    for key in ([1, 2, 3], [1, 2, 4, 5], [1, 2, 3, 6], [7]):
        matched, _ = cache.match_prefix(key)
        new = list(range(next_slot, next_slot + len(key) - len(matched)))
        next_slot += len(new)
        handed.extend(new)
        slots = torch.cat([matched, t(new)])
        n_present = cache.insert(key, slots)
        # caller frees its duplicates beyond what it matched
        caller_freed.extend(slots[len(matched):n_present].tolist())
    cache.flush()
    assert len(pool.freed) == len(set(pool.freed))
    all_back = pool.freed + caller_freed + tree_slots(cache)
    assert sorted(all_back) == sorted(handed)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_operations(seed: int):
    rng = random.Random(seed)
    cache, pool = make()
    next_slot = 0
    handed: set = set()
    caller_freed: List[int] = []
    locked: List[TreeNode] = []  # one entry per outstanding lock

    def random_key() -> List[int]:
        # small alphabet and shared stems -> lots of sharing and splits
        stem = rng.choice([[], [1, 2], [1, 2, 3, 4], [5, 6, 7]])
        return stem + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]

    for _ in range(600):
        op = rng.random()
        if op < 0.4:  # a request: match, allocate the rest, insert
            key = random_key()
            matched, _ = cache.match_prefix(key)
            new = list(range(next_slot, next_slot + len(key) - len(matched)))
            next_slot += len(new)
            handed.update(new)
            slots = torch.cat([matched, t(new)])
            n_present = cache.insert(key, slots)
            assert n_present >= len(matched)
            caller_freed.extend(slots[len(matched):n_present].tolist())
            # tree now serves the whole key from its own slots
            got, _ = cache.match_prefix(key)
            assert len(got) == len(key)
        elif op < 0.55:
            key = random_key()
            got, node = cache.match_prefix(key)
            assert len(got) <= len(key)
            if node is not cache.root:
                cache.lock(node)
                locked.append(node)
        elif op < 0.7 and locked:
            node = locked.pop(rng.randrange(len(locked)))
            cache.unlock(node)
        elif op < 0.95:
            before = cache.evictable_size
            protected = cache.protected_size
            want = rng.randrange(0, 8)
            freed = cache.evict(want)
            assert freed >= min(want, before) and freed <= before
            assert cache.protected_size == protected
            assert cache.evictable_size == before - freed
        else:
            before = cache.evictable_size
            assert cache.flush() == before
            assert cache.evictable_size == 0
        check_radix_cache(cache)
        # locked nodes are still attached to the tree
        for node in locked:
            assert node.lock_ref > 0
        in_tree = tree_slots(cache)
        assert len(in_tree) == cache.total_size
        assert len(pool.freed) == len(set(pool.freed)), "slot freed twice"
        everything = pool.freed + caller_freed + in_tree
        assert len(everything) == len(set(everything))
        assert set(everything) == handed

    while locked:
        cache.unlock(locked.pop())
    cache.flush()
    check_radix_cache(cache)
    assert cache.total_size == 0
    assert sorted(pool.freed + caller_freed) == sorted(handed)


def unlocked_leaves(cache: RadixCache) -> List[TreeNode]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not cache.root and node.is_leaf() and node.lock_ref == 0:
            out.append(node)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_evict_cuts_the_least_recently_used_unlocked_leaf_each_time(seed: int):
    """The eviction heap is kept up to date by insert, match and unlock (not rebuilt by a walk
    per eviction): each cut must still be the oldest unlocked leaf of the tree at that moment."""
    rng = random.Random(seed)
    cache, pool = make()
    next_slot, locked = 1, []
    cut: List[TreeNode] = []

    def checked_free(slots: torch.Tensor) -> None:
        node = by_first_slot[slots[0].item()]
        others = [n for n in unlocked_leaves(cache) if n is not node.parent]
        assert all((node.last_access, node.id) <= (n.last_access, n.id) for n in others), "not the oldest leaf"
        cut.append(node)
        pool(slots)

    cache.free_slots = checked_free
    for _ in range(800):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
        if op < 0.45:
            matched, _ = cache.match_prefix(key)
            new = list(range(next_slot, next_slot + len(key) - len(matched)))
            next_slot += len(new)
            cache.insert(key, torch.cat([matched, t(new)]))
        elif op < 0.6:
            _, node = cache.match_prefix(key)  # a match refreshes the path's age
            if node is not cache.root and rng.random() < 0.5:
                cache.lock(node)
                locked.append(node)
        elif op < 0.75 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            by_first_slot = {}
            stack = [cache.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node is not cache.root:
                    by_first_slot[node.slots[0].item()] = node
            before = len(cut)
            freed = cache.evict(rng.randrange(1, 6))
            assert freed == sum(len(n) for n in cut[before:])
        check_radix_cache(cache)
    assert cut, "the run evicted nothing: the check above never ran"


def test_evict_finds_leaves_whose_heap_entries_were_lost():
    """An entry lost (say to a Ctrl-C) is found again by the walk that evict falls back to."""
    cache, pool = make()
    for i, key in enumerate(([1, 2, 3], [4, 5], [6])):
        cache.insert(key, t(range(10 * i, 10 * i + len(key))))
    cache._leaf_heap.clear()
    assert cache.evict(100) == 6 and cache.total_size == 0
    assert sorted(pool.freed) == [0, 1, 2, 10, 11, 20]
    check_radix_cache(cache)


def test_eviction_heap_stays_bounded_under_repeated_matches():
    """Every match of a leaf queues it again at its new age; stale entries must not pile up."""
    cache, _ = make()
    cache.insert([1, 2, 3], t([1, 2, 3]))
    cache.insert([7, 8], t([7, 8]))
    for _ in range(10_000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._leaf_heap) <= 2 * 2 + 64 + 1
    assert cache.evict(1) == 2  # [7, 8] is now the least recently used
    check_radix_cache(cache)
