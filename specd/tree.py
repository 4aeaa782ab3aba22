"""Token trees: the one representation of "many continuations of a context, scored in one pass".

Used by verification (a drafted block is a chain; several candidates form a tree) and by the
SpecOPD trainer (proposal trees: branches at many anchors of a reference trajectory).

A tree is three flat tensors over its `num_nodes` nodes, in topological order:

- ``tokens[i]``  the token at node i;
- ``parents[i]`` the index of node i's parent, ``-1`` when node i hangs directly off the context;
  a parent always comes before its children (``parents[i] < i``);
- ``anchors[i]`` the context length node i's branch starts from: a root node at anchor ``a``
  continues ``context[:a]``. Every node of one branch shares its root's anchor.

Everything else is derived: a node's depth (0 for roots), its position id ``anchor + depth``,
which earlier nodes it may attend to (its ancestors and itself) and which context slots
(``< anchor``). The exactness contract every target honours: the output at each node equals
the output of running that node's root-to-node path alone after ``context[:anchor]``.

A plain causal chunk is the special case of a chain (``parents = [-1, 0, 1, ...]``) anchored at
the current context length, so prefill, decode and verification share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class TokenTree:
    """A token tree (see the module docstring). All tensors are int64 on one device."""

    tokens: Tensor  # [num_nodes]
    parents: Tensor  # [num_nodes], -1 = hangs off the context
    anchors: Tensor  # [num_nodes], context length the node's branch starts from

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,) or self.anchors.shape != (n,):
            raise ValueError(
                f"TokenTree needs three 1-D tensors of one length, got tokens {tuple(self.tokens.shape)}, "
                f"parents {tuple(self.parents.shape)}, anchors {tuple(self.anchors.shape)}"
            )
        index = torch.arange(n, device=self.parents.device)
        if bool(((self.parents >= index) | (self.parents < -1)).any()):
            raise ValueError("TokenTree parents must satisfy -1 <= parents[i] < i (topological order)")
        if bool((self.anchors < 0).any()):
            raise ValueError("TokenTree anchors must be >= 0")
        has_parent = self.parents >= 0
        parent_anchor = self.anchors[self.parents.clamp(min=0)]
        if bool((has_parent & (parent_anchor != self.anchors)).any()):
            raise ValueError("every node of a branch must share its root's anchor")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _trusted(cls, tokens: Tensor, parents: Tensor, anchors: Tensor) -> "TokenTree":
        """A tree from tensors already known to be valid, without `__post_init__`'s checks.

        The checks cost several tensor ops and a host sync each; the library calls this where
        validity holds by construction (a tree moved to another device, chains built in bulk by
        `ForwardBatch.from_chains`), so a per-step batch does not pay them once per sequence.
        """
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", tokens)
        object.__setattr__(tree, "parents", parents)
        object.__setattr__(tree, "anchors", anchors)
        return tree

    @staticmethod
    def chain(tokens: Sequence[int] | Tensor, anchor: int) -> "TokenTree":
        """A single path of ``len(tokens)`` nodes continuing ``context[:anchor]``."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n = tokens.shape[0]
        parents = torch.arange(-1, n - 1, dtype=torch.long)
        anchors = torch.full((n,), anchor, dtype=torch.long)
        return TokenTree(tokens, parents, anchors)

    @staticmethod
    def from_paths(paths: Sequence[tuple[int, Sequence[int]]]) -> "TokenTree":
        """A tree from ``(anchor, tokens)`` paths, merging shared prefixes at the same anchor.

        Node order is the order in which nodes are first created, so it is topological.
        """
        tokens: list[int] = []
        parents: list[int] = []
        anchors: list[int] = []
        children: dict[tuple[int, int, int], int] = {}  # (anchor, parent, token) -> node
        for anchor, path in paths:
            parent = -1
            for token in path:
                key = (anchor, parent, int(token))
                node = children.get(key)
                if node is None:
                    node = len(tokens)
                    children[key] = node
                    tokens.append(int(token))
                    parents.append(parent)
                    anchors.append(anchor)
                parent = node
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return TokenTree(as_long(tokens), as_long(parents), as_long(anchors))

    # ------------------------------------------------------------------ derived views
    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def ancestor_mask(self) -> Tensor:
        """``[num_nodes, num_nodes]`` bool: ``mask[i, j]`` iff j is i or an ancestor of i."""
        n = self.num_nodes
        index = torch.arange(n, device=self.tokens.device)
        if self.is_chain():
            return torch.ones(n, n, dtype=torch.bool, device=self.tokens.device).tril()
        mask = torch.zeros(n, n, dtype=torch.bool, device=self.tokens.device)
        mask[index, index] = True
        # Walk all nodes up one level per step: O(depth) vectorised steps, not O(n) python ones.
        current = self.parents.clone()
        while bool((current >= 0).any()):
            alive = current >= 0
            mask[index[alive], current[alive]] = True
            current = torch.where(alive, self.parents[current.clamp(min=0)], current)
        return mask

    def is_chain(self) -> bool:
        """True when the tree is one path (``parents = [-1, 0, 1, ...]``), i.e. a causal chunk."""
        index = torch.arange(self.num_nodes, device=self.parents.device)
        return bool((self.parents == index - 1).all())

    def depths(self) -> Tensor:
        """``[num_nodes]``: 0 for a root, parent's depth + 1 otherwise."""
        if self.is_chain():
            return torch.arange(self.num_nodes, device=self.tokens.device)
        return self.ancestor_mask().sum(dim=1) - 1

    def positions(self) -> Tensor:
        """``[num_nodes]`` position ids: ``anchor + depth``."""
        return self.anchors + self.depths()

    def context_mask(self, num_slots: int) -> Tensor:
        """``[num_nodes, num_slots]`` bool: node i sees context slot s iff ``s < anchors[i]``."""
        slots = torch.arange(num_slots, device=self.tokens.device)
        return slots[None, :] < self.anchors[:, None]

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        nodes = []
        parents = self.parents.tolist()
        while node >= 0:
            nodes.append(node)
            node = parents[node]
        return nodes[::-1]

    def leaves(self) -> list[int]:
        """Nodes that are nobody's parent."""
        is_parent = torch.zeros(self.num_nodes, dtype=torch.bool)
        is_parent[self.parents[self.parents >= 0].cpu()] = True
        return [i for i in range(self.num_nodes) if not is_parent[i]]

    def to(self, device: torch.device | str) -> "TokenTree":
        # A valid tree stays valid on another device: no re-validation.
        return TokenTree._trusted(self.tokens.to(device), self.parents.to(device), self.anchors.to(device))
