"""Radix cache: reuse the KV of shared prompt prefixes (lesson 0).

A trie whose edges hold runs of token ids (`key`) and their KV slots (`slots`): `match_prefix` finds the
longest cached prefix, `insert` adds a finished sequence, `lock` protects the nodes running requests use,
`evict` frees the least recently used unlocked leaves. Slots handed to `insert` beyond the cached prefix
become the tree's; it gives slots back only through `free_slots`. Page size 1: one slot per token."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .kv_pool import KVAccountingError


class TreeNode:
    """One edge of the radix tree, named after the node it leads to."""

    _ids = itertools.count()  # unique id, used to break ties in the eviction heap

    def __init__(self, key: Tuple[int, ...], slots: torch.Tensor,
                 parent: Optional["TreeNode"] = None, last_access: int = 0) -> None:
        self.children: Dict[int, TreeNode] = {}  # keyed by the child's first token id
        self.parent = parent
        self.key = key                            # token ids on the edge into this node
        self.slots = slots                        # int64 KV slot per token of `key`
        self.lock_ref = 0                         # number of locks held on this node's subtree
        self.last_access = last_access            # logical clock value, not wall time
        self.id = next(TreeNode._ids)

    def is_leaf(self) -> bool:
        return not self.children

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key}, lock_ref={self.lock_ref}, last_access={self.last_access})"


def _as_key(token_ids: Sequence[int]) -> Tuple[int, ...]:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    return tuple(int(t) for t in token_ids)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None]) -> None:
        self.free_slots = free_slots
        self.root = TreeNode(key=(), slots=torch.empty(0, dtype=torch.int64))
        self._clock = 0
        self._evictable = 0   # tokens in nodes with lock_ref == 0
        self._protected = 0   # tokens in nodes with lock_ref > 0
        self._num_nodes = 0   # nodes below the root
        # Candidates for eviction, oldest first: (last_access, id, node). See "eviction" below.
        self._leaf_heap: List[Tuple[int, int, TreeNode]] = []

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---------------------------------------------------------------- lookups
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _walk(self, key: Tuple[int, ...]) -> Tuple[TreeNode, int, List[torch.Tensor]]:
        """Follow `key` down the tree, splitting an edge where the match ends inside it. Returns
        (deepest matched node, matched tokens, matched slot runs). Every node on the path gets the
        same fresh `last_access`: a parent is never older than its children."""
        now = self._tick()
        node, pos, runs = self.root, 0, []
        node.last_access = now
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            n = _common_prefix_len(child.key, key[pos:])  # n >= 1: first tokens agree
            if n < len(child):
                child = self._split(child, n)
            child.last_access = now
            runs.append(child.slots)
            node, pos = child, pos + n
            # After a split the next token (if any) differs from the old edge's continuation: the loop ends.
        self._offer(node)  # only the path's last node can be a leaf: its new age is queued
        return node, pos, runs

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node`'s edge after `n` tokens; return the new upper node, which inherits lock_ref
        and last_access (the sizes do not change)."""
        assert 0 < n < len(node)
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:n], node.slots[:n], parent, node.last_access)
        upper.lock_ref = node.lock_ref
        node.key, node.slots = node.key[n:], node.slots[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        parent.children[upper.key[0]] = upper
        self._num_nodes += 1
        return upper

    def match_prefix(self, token_ids: Sequence[int]) -> Tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `token_ids`: (its slots, node ending exactly there)."""
        node, _, runs = self._walk(_as_key(token_ids))
        if not runs:
            return torch.empty(0, dtype=torch.int64), node
        return torch.cat(runs), node

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Store key -> slots; returns how many leading tokens were cached already. There the tree
        keeps its own slots (the caller frees its copies); the slots after become the tree's."""
        key = _as_key(token_ids)
        if len(key) != len(slots):
            raise KVAccountingError(f"{len(key)} tokens but {len(slots)} slots")
        node, matched, _ = self._walk(key)
        if matched < len(key):
            # clone: the caller's tensor may be a view into a table it will overwrite
            new_slots = torch.as_tensor(slots[matched:], dtype=torch.int64).clone()
            leaf = TreeNode(key[matched:], new_slots, node, node.last_access)
            node.children[leaf.key[0]] = leaf
            self._evictable += len(leaf)  # new leaf starts unlocked
            self._num_nodes += 1
            self._offer(leaf)
        return matched

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and all its ancestors from eviction. Locking root is a no-op."""
        while node is not self.root:
            if node.lock_ref == 0:  # crossing 0 -> 1 moves tokens to protected
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        # An ancestor's lock_ref is >= its descendants', so checking `node` suffices
        # to guarantee nothing on the path goes negative.
        if node is not self.root and node.lock_ref <= 0:
            raise KVAccountingError(f"unlock without matching lock: {node!r}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:  # crossing 1 -> 0 makes tokens evictable again
                self._protected -= len(node)
                self._evictable += len(node)
                self._offer(node)
            node = node.parent

    # --------------------------------------------------------------- eviction
    # Least recently used unlocked leaves first, from a heap insert, match and unlock keep current. An entry
    # is a hint, acted on only if its node is still an unlocked leaf of that age; one lost to a Ctrl-C is
    # found again by the walk `evict` falls back to.
    def _offer(self, node: TreeNode) -> None:
        """Queue `node` for eviction if it is an unlocked leaf (at its current age)."""
        if node is self.root or node.children or node.lock_ref:
            return
        heapq.heappush(self._leaf_heap, (node.last_access, node.id, node))
        if len(self._leaf_heap) > 2 * self._num_nodes + 64:  # mostly stale: rebuild, amortised O(1)
            self._rebuild_leaf_heap()

    def _rebuild_leaf_heap(self) -> None:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and node.is_leaf() and node.lock_ref == 0:
                leaves.append((node.last_access, node.id, node))
        heapq.heapify(leaves)
        self._leaf_heap = leaves

    @staticmethod
    def _is_current(entry: Tuple[int, int, TreeNode]) -> bool:
        last_access, _, node = entry
        parent = node.parent  # an evicted node keeps its parent pointer but is not its child
        return (parent is not None and parent.children.get(node.key[0]) is node and node.is_leaf()
                and node.lock_ref == 0 and node.last_access == last_access)

    def evict(self, num_tokens: int) -> int:
        """Free >= num_tokens slots (or all evictable ones), oldest leaves first."""
        num_freed, rebuilt = 0, False
        while num_freed < num_tokens:
            heap = self._leaf_heap
            if not heap:
                if rebuilt or self._evictable == 0:
                    break
                self._rebuild_leaf_heap()  # entries lost to an interrupt: the walk finds them
                rebuilt = True
                continue
            if not self._is_current(heap[0]):
                heapq.heappop(heap)
                continue
            node = heap[0][2]
            parent = node.parent
            assert parent is not None
            # Each node's slots go back as it is cut (an interrupt between cutting and freeing a
            # batch of nodes would leak them); its heap entry leaves only after the cut.
            self._evictable -= len(node)
            del parent.children[node.key[0]]
            self.free_slots(node.slots)
            self._num_nodes -= 1
            num_freed += len(node)
            heapq.heappop(heap)
            self._offer(parent)  # the parent may now be an unlocked leaf itself
        return num_freed

    def flush(self) -> int:
        """Evict every unlocked node."""
        return self.evict(self._evictable)
