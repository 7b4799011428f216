"""The approximate prefix tree of ``cache_aware``: which worker was last sent which request text.

One radix tree over characters shared by every worker ("tenant"): each node holds an edge label and,
per tenant that passed through it, the logical time of its last use. A tenant present on a node is
present on all its ancestors, so a tenant's longest match is the deepest node on the path carrying
it. Sizes are counted in characters per tenant; ``evict`` drops a tenant's least recently used
leaves until it holds at most ``max_chars``. Pure Python, no I/O; the router calls it on its event loop.
"""
from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("text", "parent", "children", "last_use")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text  # edge label from the parent
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.last_use: dict[str, int] = {}  # tenant -> logical time it last inserted through this node


def common_prefix_len(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[pos:]`` (binary search on C-level compares)."""
    if text.startswith(edge, pos):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """A multi-tenant radix tree over characters with per-tenant LRU eviction."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self._clock = itertools.count(1)
        self._chars: dict[str, int] = {}  # tenant -> characters it holds

    # ---- queries ------------------------------------------------------------------------------
    def match(self, text: str) -> dict[str, int]:
        """For every tenant sharing a prefix with ``text``: the length of its longest shared prefix
        (characters). Tenants with no shared character are left out. Does not refresh recency."""
        matched: dict[str, int] = {}
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = common_prefix_len(child.text, text, pos)
            for tenant in child.last_use:  # deeper nodes overwrite: the longest match wins
                matched[tenant] = pos + n
            if n < len(child.text):
                break
            node, pos = child, pos + n
        return matched

    def size(self, tenant: str) -> int:
        """Characters ``tenant`` holds (0 if unknown)."""
        return self._chars.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._chars)

    # ---- updates ------------------------------------------------------------------------------
    def insert(self, text: str, tenant: str) -> None:
        """Record that ``tenant`` now holds ``text`` (refreshes the recency of the whole path)."""
        now = next(self._clock)
        self._chars.setdefault(tenant, 0)
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node)
                node.children[text[pos]] = child
            else:
                n = common_prefix_len(child.text, text, pos)
                if n < len(child.text):
                    child = self._split(child, n)
            if tenant not in child.last_use:
                self._chars[tenant] += len(child.text)
            child.last_use[tenant] = now
            node, pos = child, pos + len(child.text)

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node``'s label after ``n`` characters; returns the new upper node (same tenants)."""
        assert 0 < n < len(node.text)
        parent = node.parent
        assert parent is not None
        upper = _Node(node.text[:n], parent)
        upper.last_use = dict(node.last_use)
        parent.children[upper.text[0]] = upper
        node.text = node.text[n:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    def evict(self, tenant: str, max_chars: int) -> int:
        """Drop ``tenant``'s least recently used leaves until it holds at most ``max_chars``
        characters; returns how many characters were dropped."""
        if self.size(tenant) <= max_chars:
            return 0
        before = self.size(tenant)
        heap = [(n.last_use[tenant], id(n), n) for n in self._nodes_of(tenant) if self._is_leaf_of(n, tenant)]
        heapq.heapify(heap)
        while heap and self._chars[tenant] > max_chars:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._drop(node, tenant)
            if parent is not self.root and parent is not None and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.last_use[tenant], id(parent), parent))
        return before - self._chars[tenant]

    def evict_all(self, max_chars: int) -> int:
        """``evict`` every tenant down to ``max_chars``; returns the characters dropped in all."""
        return sum(self.evict(tenant, max_chars) for tenant in self.tenants())

    def remove_tenant(self, tenant: str) -> None:
        """Forget ``tenant`` everywhere (its worker left or failed)."""
        for node in reversed(self._nodes_of(tenant)):  # children before their parents
            self._drop(node, tenant)
        self._chars.pop(tenant, None)

    # ---- internals ----------------------------------------------------------------------------
    def _nodes_of(self, tenant: str) -> list[_Node]:
        """Every non-root node carrying ``tenant``, parents before children."""
        out: list[_Node] = []
        stack = [c for c in self.root.children.values() if tenant in c.last_use]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(c for c in node.children.values() if tenant in c.last_use)
        return out

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: str) -> bool:
        return tenant in node.last_use and not any(tenant in c.last_use for c in node.children.values())

    def _drop(self, node: _Node, tenant: str) -> None:
        """Remove ``tenant`` from ``node`` (which holds no child of ``tenant``); unlink it if empty."""
        del node.last_use[tenant]
        self._chars[tenant] -= len(node.text)
        if not node.last_use:
            assert not node.children, "a node without tenants has no children (tenants are prefix-closed)"
            parent = node.parent
            assert parent is not None
            del parent.children[node.text[0]]
            node.parent = None

    def check_integrity(self) -> None:
        """Assert the invariants: tenants prefix-closed, per-tenant sizes exact, children keyed by first char."""
        chars: dict[str, int] = {t: 0 for t in self._chars}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.text and child.text[0] == key and child.parent is node
                assert child.last_use, "empty node left in the tree"
                for tenant in child.last_use:
                    assert node is self.root or tenant in node.last_use, "tenant not prefix-closed"
                    chars[tenant] += len(child.text)
                stack.append(child)
        assert chars == self._chars, (chars, self._chars)
