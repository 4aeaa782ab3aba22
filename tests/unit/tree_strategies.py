"""Hypothesis strategies for random token trees, shared by the tree exactness tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from specd.tree import TokenTree


@st.composite
def trees(draw, context_len: int, vocab: int):
    """Each node picks a parent among earlier nodes or starts a branch at any anchor <= context."""
    num_nodes = draw(st.integers(1, 14))
    tokens, parents, anchors = [], [], []
    for i in range(num_nodes):
        parent = draw(st.integers(-1, i - 1))
        anchor = anchors[parent] if parent >= 0 else draw(st.integers(0, context_len))
        tokens.append(draw(st.integers(0, vocab - 1)))
        parents.append(parent)
        anchors.append(anchor)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return TokenTree(as_long(tokens), as_long(parents), as_long(anchors))
