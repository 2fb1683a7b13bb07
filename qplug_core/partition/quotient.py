"""The graph with partitions contracted to single vertices, kept acyclic while they merge.

Merging two partitions is only allowed when no path leads from one to the other through a
third vertex (that would make the fused graph cyclic). Checking that by a DFS over everything
downstream, as torch does, costs O(N) per attempt and O(N^2) overall. Here:

* a topological order of the contracted graph is maintained under merges (Pearce-Kelly style),
  so the search only visits vertices ordered *between* the two partitions;
* ``blocked_by`` bitsets record, per node, the nodes it reaches (or is reached from) through an
  unsupported node. Partitions separated that way can never merge, which filters most attempts
  with one big-int AND. They cost N^2/4 bytes (25 MB at 10k nodes).
"""

from __future__ import annotations

from typing import Sequence

from torch.fx import Node

__all__ = ["Quotient"]


class Quotient:
    """Vertices are node indices (graph order); a merged vertex keeps one member's index."""

    def __init__(self, nodes: Sequence[Node], candidate: Sequence[bool]) -> None:
        index = {node: i for i, node in enumerate(nodes)}
        n = len(nodes)
        self.vertex_of = list(range(n))
        self.members: dict[int, list[int]] = {i: [i] for i in range(n)}
        self.succ: dict[int, set[int]] = {i: set() for i in range(n)}
        self.pred: dict[int, set[int]] = {i: set() for i in range(n)}
        for i, node in enumerate(nodes):
            for user in node.users:
                j = index[user]
                self.succ[i].add(j)
                self.pred[j].add(i)
        self.ord = list(range(n))
        self.bits = {i: 1 << i for i in range(n)}
        self.blocked = self._blocked_bitsets(n, candidate)

    def _blocked_bitsets(self, n: int, candidate: Sequence[bool]) -> dict[int, int]:
        """Per node: nodes linked to it (either direction) through a non-candidate node."""
        down, down_blocked = [0] * n, [0] * n
        for i in reversed(range(n)):
            d = b = 0
            for j in self.succ[i]:
                d |= (1 << j) | down[j]
                b |= down_blocked[j] | (0 if candidate[j] else down[j])
            down[i], down_blocked[i] = d, b
        del down
        up, up_blocked = [0] * n, [0] * n
        for i in range(n):
            a = b = 0
            for j in self.pred[i]:
                a |= (1 << j) | up[j]
                b |= up_blocked[j] | (0 if candidate[j] else up[j])
            up[i], up_blocked[i] = a, b
        return {i: down_blocked[i] | up_blocked[i] for i in range(n)}

    def try_merge(self, a: int, b: int) -> int | None:
        """Contract vertices ``a`` and ``b`` unless that creates a cycle; return the new vertex."""
        if self.blocked[a] & self.bits[b]:
            return None
        if self.ord[a] > self.ord[b]:
            a, b = b, a
        lo, hi = self.ord[a], self.ord[b]
        forward = self._reach(a, b, hi, self.succ, below=True)
        if forward is None:
            return None
        backward = self._reach(b, a, lo, self.pred, below=False)  # non-None: implied by forward
        return self._contract(a, b, forward, backward)

    def _reach(self, start: int, target: int, bound: int, edges: dict[int, set[int]],
               below: bool) -> set[int] | None:
        """Vertices reachable from ``start`` (not via ``target``) inside the order window;
        None if one of them has an edge to ``target`` (a path of length >= 2 exists)."""
        ord_ = self.ord
        seen: set[int] = set()
        stack = [v for v in edges[start] if v != target and (ord_[v] < bound if below
                                                               else ord_[v] > bound)]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            nexts = edges[v]
            if target in nexts:
                return None
            for w in nexts:
                if w not in seen and (ord_[w] < bound if below else ord_[w] > bound):
                    stack.append(w)
        return seen

    def _contract(self, a: int, b: int, forward: set[int], backward: set[int]) -> int:
        ord_ = self.ord
        affected = backward | forward | {a, b}
        slots = sorted(ord_[v] for v in affected)
        keep, gone = (a, b) if len(self.members[a]) >= len(self.members[b]) else (b, a)
        before = sorted(backward, key=ord_.__getitem__)
        after = sorted(forward, key=ord_.__getitem__)
        for slot, v in zip(slots, before):
            ord_[v] = slot
        ord_[keep] = slots[len(before)]
        for slot, v in zip(slots[len(slots) - len(after):], after):
            ord_[v] = slot
        for m in self.members[gone]:
            self.vertex_of[m] = keep
        self.members[keep].extend(self.members.pop(gone))
        self.bits[keep] |= self.bits.pop(gone)
        self.blocked[keep] |= self.blocked.pop(gone)
        for s in self.succ.pop(gone):
            self.pred[s].discard(gone)
            if s != keep:
                self.pred[s].add(keep)
                self.succ[keep].add(s)
        for p in self.pred.pop(gone):
            self.succ[p].discard(gone)
            if p != keep:
                self.succ[p].add(keep)
                self.pred[keep].add(p)
        self.succ[keep].discard(gone)
        self.pred[keep].discard(gone)
        return keep
