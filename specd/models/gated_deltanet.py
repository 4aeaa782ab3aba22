"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", arXiv 2412.06464), the linear
attention of Qwen3-Next, exact on token trees. Shared by `specd.models.qwen3_next` and
`specd.models.sparse`.

Per token t and value head h, with a state ``S`` of shape ``[key_dim, value_dim]``
(Hugging Face's `Qwen3NextGatedDeltaNet`, plain-torch path):

    x_t        = SiLU(causal depthwise conv_K(W_qkv h)_t)          short conv, kernel K (= 4)
    q_t, k_t   = l2norm(.) of x_t's q/k channels;  q_t <- q_t / sqrt(key_dim)
    beta_t     = sigmoid(W_b h_t)                                   write strength
    g_t        = -exp(A_log) * softplus(W_a h_t + dt_bias)          log decay (<= 0)
    S_t        = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
    o_t        = S_t^T q_t,   out = W_o GatedRMSNorm(o_t, z_t)

Three evaluation orders of the same recurrence, all here:

- `recurrent_gated_delta_rule`: token by token (decode, and the obviously-correct reference);
- `chunked_gated_delta_rule`: the WY/UT-transform chunked form (prefill, training): within a
  chunk, ``(I + A) U = beta V - beta exp(c) K S`` with ``A[t, s] = beta_t exp(c_t - c_s) k_t.k_s``
  (s < t) solved by one triangular solve; a sequential scan carries S across chunks. Chunks
  are aligned to *absolute* positions (identity tokens ``g = beta = k = 0`` pad the front), so
  the inter-chunk states are the cache's checkpoints at multiples of ``chunk_size``;
- `tree_gated_delta_rule`: the same algebra on a token tree. Along one root-to-node path the
  recurrence only sees the path, so replacing "s < t" by "s is a strict ancestor of t", the
  cumulative decay ``c`` by the sum of ``g`` over the node's in-tree ancestors, and the initial
  state by *the state at the node's anchor* gives, in one pass, exactly each path alone.

**Indexed state replay.** A branch at anchor ``a`` needs the state and the conv tail after
``context[:a]``. The cache keeps every committed token's conv inputs and gates, checkpoints
every ``chunk_size`` tokens and the tip (`specd.state_cache`); the layer replays the trunk from
the nearest kept state to each anchor (at most ``chunk_size - 1`` tokens), then runs the tree
from those states. The conv of a node reads its K-1 predecessors *along its path* (ancestors,
then context slots before the anchor), not the previous slots. A tree mask alone cannot do
this: a recurrence has no mask to apply, and scanning the packed nodes in slot order feeds
sibling branches into each other's state (see tests/unit/test_hybrid_trees.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.state_cache import PendingStates, RecurrentStateCache


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """FLA's (and Hugging Face's) ``x / sqrt(sum x^2 + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the output, then a SiLU gate from ``z`` (Hugging Face `Qwen3NextRMSNormGated`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:  # [..., dim] each
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


# ---------------------------------------------------------------------------------- kernels
# All kernels take q/k already l2-normed (q scaled by key_dim^-0.5) and repeated to the value
# heads, everything fp32, laid out [batch, tokens, heads, dim]; states [batch, heads, key, value].


def recurrent_gated_delta_rule(
    q: Tensor,  # [batch, num_tokens, num_heads, key_dim]
    k: Tensor,  # [batch, num_tokens, num_heads, key_dim]
    v: Tensor,  # [batch, num_tokens, num_heads, value_dim]
    g: Tensor,  # [batch, num_tokens, num_heads] log decay
    beta: Tensor,  # [batch, num_tokens, num_heads]
    state: Tensor,  # [batch, num_heads, key_dim, value_dim]
) -> tuple[Tensor, Tensor]:
    """Token-by-token: outputs ``[batch, num_tokens, num_heads, value_dim]`` and the final state."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        memory = (state * k[:, t, :, :, None]).sum(dim=-2)  # what S predicts for k_t: [b, h, value]
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(dim=-2))
    return torch.stack(outputs, dim=1), state


def _ut_transform(k: Tensor, v: Tensor, beta: Tensor, cum: Tensor, decay: Tensor) -> tuple[Tensor, Tensor]:
    """Solve ``(I + strict_lower(beta k k^T * decay)) [U | W] = [beta v | beta k exp(cum)]``.

    U are the new values before the state read, W the decayed keys that read the entry state
    (the DeltaNet "UT transform"); one triangular solve serves both right-hand sides.
    """
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    return solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]


def chunked_gated_delta_rule(
    q: Tensor,  # [batch, num_tokens, num_heads, key_dim]
    k: Tensor,  # [batch, num_tokens, num_heads, key_dim]
    v: Tensor,  # [batch, num_tokens, num_heads, value_dim]
    g: Tensor,  # [batch, num_tokens, num_heads]
    beta: Tensor,  # [batch, num_tokens, num_heads]
    initial_state: Tensor | None,  # [batch, num_heads, key_dim, value_dim], None = zeros
    chunk_size: int,
    offsets: Tensor | None = None,  # [batch] identity tokens in front (start position % chunk)
    lengths: Tensor | None = None,  # [batch] real tokens per row (the rest is padding)
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked form. Returns outputs ``[batch, num_tokens, num_heads, value_dim]``, the final
    state, and the state at the end of every (aligned) chunk ``[batch, num_chunks, heads, key, value]``.

    Row b's token t sits at padded index ``offsets[b] + t``; chunk i ends after padded index
    ``(i + 1) * chunk_size - 1``. Identity tokens (``g = beta = 0``, ``k = 0``) leave the state
    unchanged, so front and back padding are exact.
    """
    batch, num_tokens, num_heads, key_dim = k.shape
    value_dim = v.shape[-1]
    device = q.device
    if offsets is None and lengths is None:
        padded = -(-num_tokens // chunk_size) * chunk_size
        index = None
    else:
        offsets = torch.zeros(batch, dtype=torch.long, device=device) if offsets is None else offsets
        lengths = torch.full((batch,), num_tokens, device=device) if lengths is None else lengths
        padded = max(int((offsets + lengths).max()), 1)
        padded = -(-padded // chunk_size) * chunk_size
        index = offsets[:, None] + torch.arange(num_tokens, device=device)  # [batch, num_tokens]
        real = torch.arange(num_tokens, device=device) < lengths[:, None]
        index = torch.where(real, index, padded)  # padding tokens go to a dropped extra slot

    def place(x: Tensor) -> Tensor:  # [batch, num_tokens, heads(, dim)] -> [batch, heads, padded(, dim)]
        if index is None:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, padded - num_tokens))
        else:
            out = x.new_zeros(batch, padded + 1, *x.shape[2:])
            out.scatter_(1, index.view(batch, num_tokens, *[1] * (x.dim() - 2)).expand_as(x), x)
            x = out[:, :padded]
        return x.transpose(1, 2)

    q, k, v, g, beta = (place(x) for x in (q, k, v, g, beta))
    num_chunks = padded // chunk_size
    split = lambda x: x.reshape(batch, num_heads, num_chunks, chunk_size, *x.shape[3:])  # noqa: E731
    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # log decay from the chunk start, inclusive: [b, h, n, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    new_values, k_cumdecay = _ut_transform(k, v, beta, cum, decay)
    intra = (q @ k.transpose(-1, -2)) * decay  # causal (diagonal included) in-chunk attention
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = q.new_zeros(batch, num_heads, key_dim, value_dim) if initial_state is None else initial_state.float()
    outputs, states = [], []
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
        states.append(state)
    out = torch.stack(outputs, dim=2).reshape(batch, num_heads, padded, value_dim).transpose(1, 2)
    if index is None:
        out = out[:, :num_tokens]
    else:
        out = out.gather(1, index.clamp(max=padded - 1)[..., None, None].expand(-1, -1, num_heads, value_dim))
    return out, state, torch.stack(states, dim=1)


def tree_gated_delta_rule(
    q: Tensor,  # [batch, num_nodes, num_heads, key_dim]
    k: Tensor,  # [batch, num_nodes, num_heads, key_dim]
    v: Tensor,  # [batch, num_nodes, num_heads, value_dim]
    g: Tensor,  # [batch, num_nodes, num_heads]
    beta: Tensor,  # [batch, num_nodes, num_heads]
    ancestors: Tensor,  # [batch, num_nodes, num_nodes] bool: j is i or an ancestor of i
    entry_states: Tensor,  # [batch, num_entries, num_heads, key_dim, value_dim]
    entry_index: Tensor,  # [batch, num_nodes] which entry state node i's branch starts from
) -> Tensor:
    """Every node's output as if its root-to-node path ran alone from its entry state.

    One UT block over the whole tree: nodes are in topological order, so the ancestor mask is
    lower triangular and the chunked algebra holds with "ancestor" for "earlier". Cost is
    quadratic in the tree size, like tree attention.
    """
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))  # [b, h, n, ...]
    mask = ancestors[:, None]  # [b, 1, n, n]
    cum = (ancestors.to(g.dtype)[:, None] @ g[..., None]).squeeze(-1)  # path log decay: [b, h, n]
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~mask, float("-inf")).exp()
    new_values, k_cumdecay = _ut_transform(k, v, beta, cum, decay)
    # Each node reads its own entry state: one matmul reads every entry (there are few: one
    # per distinct anchor), then a gather keeps the node's.
    batch, num_entries, num_heads, key_dim, value_dim = entry_states.shape
    states = entry_states.permute(0, 2, 3, 1, 4).reshape(batch, num_heads, key_dim, num_entries * value_dim)
    pick = entry_index[:, None, :, None, None].expand(-1, num_heads, -1, 1, value_dim)

    def read(x: Tensor) -> Tensor:  # [b, h, n, key] -> x^T S_entry(n): [b, h, n, value]
        every = (x @ states).view(*x.shape[:3], num_entries, value_dim)
        return every.gather(3, pick).squeeze(3)

    v_new = new_values - read(k_cumdecay)
    out = read(q * cum.exp()[..., None]) + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------- metadata
@dataclass(kw_only=True, slots=True)
class RecurrentMetadata:
    """What every Gated DeltaNet layer of one pass needs about the batch's trees; built once."""

    chain: bool
    """Every sequence's tree is a chain anchored at its cached length (prefill, decode, blocks)."""
    conv_slots: Tensor | None
    """``[num_seqs, max_new, conv_kernel]``: the slots (in the cache, or in the new tokens when
    there is no cache) of each node's conv window along its path, oldest first; -1 = before the
    sequence start (zero). None: a dense causal training batch (plain conv1d)."""
    ancestors: Tensor | None = None
    """Tree passes: ``[num_seqs, max_new, max_new]`` inclusive ancestor masks."""
    entry_seq: Tensor | None = None
    """Tree passes: ``[num_seqs * num_entries]`` sequence of each entry (distinct anchors)."""
    entry_anchor: Tensor | None = None
    """Tree passes: ``[num_seqs * num_entries]`` anchor of each entry (unused entries: 0)."""
    entry_index: Tensor | None = None
    """Tree passes: ``[num_seqs, max_new]`` node -> entry of its sequence."""

    @staticmethod
    def build(batch: ForwardBatch, conv_kernel: int, has_cache: bool) -> "RecurrentMetadata":
        device = batch.input_ids.device
        if not batch.trees:  # a dense causal training batch built without trees
            return RecurrentMetadata(chain=True, conv_slots=None)
        lens = batch.cache_lens.tolist()
        chain = all(
            t.num_nodes == 0 or (t.is_chain() and int(t.anchors[0]) == start) for t, start in zip(batch.trees, lens)
        )
        if chain and not has_cache and batch.dense_causal:
            return RecurrentMetadata(chain=True, conv_slots=None)
        num_seqs, max_new = batch.input_ids.shape
        if chain:  # node j of sequence b sits at slot cache_len + j; its window is the slots before
            new_index = torch.arange(max_new, device=device)
            slots = (batch.cache_lens[:, None, None] + new_index[None, :, None]
                     - torch.arange(conv_kernel - 1, -1, -1, device=device))
            padding = (new_index[None, :] >= batch.num_new[:, None])[..., None]  # may lie past the cache
            return RecurrentMetadata(chain=True, conv_slots=slots.clamp(min=-1).masked_fill(padding, -1))
        slots = torch.full((num_seqs, max_new, conv_kernel), -1, dtype=torch.long, device=device)
        for b, tree in enumerate(batch.trees):
            slots[b, : tree.num_nodes] = _conv_window(tree, lens[b], conv_kernel)
        ancestors = torch.eye(max_new, dtype=torch.bool, device=device).repeat(num_seqs, 1, 1)
        anchor_lists, entry_index = [], torch.zeros(num_seqs, max_new, dtype=torch.long, device=device)
        for b, tree in enumerate(batch.trees):
            n = tree.num_nodes
            if n == 0:
                anchor_lists.append([])
                continue
            ancestors[b, :n, :n] = tree.ancestor_mask()
            anchors, inverse = torch.unique(tree.anchors, return_inverse=True)
            anchor_lists.append(anchors.tolist())
            entry_index[b, :n] = inverse
        num_entries = max(1, max(len(a) for a in anchor_lists))
        entry_anchor = torch.tensor(
            [a[i] if i < len(a) else 0 for a in anchor_lists for i in range(num_entries)], device=device
        )
        entry_seq = torch.arange(num_seqs, device=device).repeat_interleave(num_entries)
        return RecurrentMetadata(
            chain=False, conv_slots=slots, ancestors=ancestors,
            entry_seq=entry_seq, entry_anchor=entry_anchor, entry_index=entry_index,
        )


def _conv_window(tree, start: int, conv_kernel: int) -> Tensor:
    """``[num_nodes, conv_kernel]`` slots of each node's conv inputs along its path, oldest first.

    Distance r back from node i: its r-th ancestor's slot (``start + index``) while the path
    lasts, then context slot ``anchor - (r - depth)``; -1 before the sequence start.
    """
    n = tree.num_nodes
    depth = tree.depths()
    current = torch.arange(n, device=tree.tokens.device)  # node r steps up the path, -1 = context
    columns = []
    for r in range(conv_kernel):
        if r > 0:
            current = torch.where(current >= 0, tree.parents[current.clamp(min=0)], current)
        context = tree.anchors - (r - depth)
        slot = torch.where(current >= 0, start + current, torch.where(context >= 0, context, -1))
        columns.append(slot)
    return torch.stack(columns[::-1], dim=1)


# ---------------------------------------------------------------------------------- the layer
class GatedDeltaNet(nn.Module):
    """Hugging Face `Qwen3NextGatedDeltaNet` (same parameter names), over a `ForwardBatch`."""

    def __init__(
        self,
        *,
        layer_index: int,  # among the model's Gated DeltaNet layers (its slot in the cache)
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        rms_norm_eps: float,
        chunk_size: int,
    ) -> None:
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear value heads {num_value_heads} not a multiple of key heads {num_key_heads}")
        self.layer_index = layer_index
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim, self.value_dim = key_head_dim * num_key_heads, value_head_dim * num_value_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=conv_kernel, groups=self.conv_dim,
            bias=False, padding=conv_kernel - 1,
        )
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_value_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(value_head_dim, rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    # ------------------------------------------------------------------ pieces
    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Conv inputs ``[.., conv_dim]`` (q, k, v channels), z ``[.., value_heads, value_head_dim]``,
        b and a ``[.., value_heads]``. The projections are grouped per key head, as in HF."""
        lead = x.shape[:-1]
        ratio = self.num_value_heads // self.num_key_heads
        qkvz = self.in_proj_qkvz(x).view(*lead, self.num_key_heads, -1)
        q, k, v, z = torch.split(
            qkvz,
            [self.key_head_dim, self.key_head_dim, ratio * self.value_head_dim, ratio * self.value_head_dim],
            dim=-1,
        )
        b, a = torch.split(self.in_proj_ba(x).view(*lead, self.num_key_heads, 2 * ratio), [ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)], dim=-1)
        z = z.reshape(*lead, self.num_value_heads, self.value_head_dim)
        return mixed, z, b.reshape(*lead, -1), a.reshape(*lead, -1)

    def _gates(self, b: Tensor, a: Tensor) -> Tensor:
        """``[.., 2, value_heads]`` fp32: log decay g and write strength beta."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return torch.stack([g, b.sigmoid().float()], dim=-2)

    def _conv_windows(self, windows: Tensor) -> Tensor:
        """``[.., conv_kernel, conv_dim]`` inputs (oldest first) -> SiLU(conv) ``[.., conv_dim]``."""
        weight = self.conv1d.weight.squeeze(1).t()  # [conv_kernel, conv_dim]
        return F.silu((windows.to(weight.dtype) * weight).sum(dim=-2))

    def _heads(self, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Post-conv channels -> fp32 q (normed, scaled), k (normed), v, all on the value heads."""
        lead = conv_out.shape[:-1]
        q, k, v = torch.split(conv_out.float(), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(*lead, self.num_key_heads, self.key_head_dim)) * self.key_head_dim**-0.5
        k = l2norm(k.reshape(*lead, self.num_key_heads, self.key_head_dim))
        ratio = self.num_value_heads // self.num_key_heads
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
        return q, k, v.reshape(*lead, self.num_value_heads, self.value_head_dim)

    def _zero_states(self, count: int, device) -> Tensor:
        return torch.zeros(count, self.num_value_heads, self.key_head_dim, self.value_head_dim, device=device)

    def states_at(self, cache: RecurrentStateCache, seq_index: Tensor, anchors: Tensor) -> Tensor:
        """The state after ``context[:anchors[i]]`` of sequence ``seq_index[i]``: indexed state replay.

        Starts from the nearest kept state (tip or checkpoint) and replays the committed tokens
        in between from their stored conv inputs and gates; remembers what it finds.
        """
        layer = self.layer_index
        start, states = cache.nearest_state(layer, seq_index, anchors)
        span = anchors - start
        if not bool((span > 0).any()):
            return states
        device = anchors.device
        steps = torch.arange(int(span.max()), device=device)
        positions = start[:, None] + steps  # [num_queries, max_span]
        real = steps < span[:, None]
        inputs = cache.inputs.tensors[layer]  # [num_seqs, capacity, conv_dim]
        slots = positions[..., None] - torch.arange(self.conv_kernel - 1, -1, -1, device=device)
        # Steps past a row's span are padding (and may lie past the cache): clamp, then zero.
        last = inputs.shape[1] - 1
        windows = inputs[seq_index[:, None, None], slots.clamp(0, last)] * (slots >= 0)[..., None]
        _, k, v = self._heads(self._conv_windows(windows))
        gates = cache.gates.tensors[layer][seq_index[:, None], positions.clamp(max=last)]
        gates = gates * real[..., None, None]
        k = k * real[..., None, None]
        offsets = start % self.chunk_size
        _, final, chunk_states = chunked_gated_delta_rule(
            torch.zeros_like(k), k, v, gates[..., 0, :], gates[..., 1, :], states,
            self.chunk_size, offsets=offsets, lengths=span,
        )
        # Remember every aligned state the replay passed (checkpoints) and the states found.
        ends = (start - offsets)[:, None] + self.chunk_size * (1 + torch.arange(chunk_states.shape[1], device=device))
        passed = (ends > start[:, None]) & (ends <= anchors[:, None])
        rows = seq_index[:, None].expand_as(ends)
        cache.remember(layer, rows[passed], ends[passed], chunk_states[passed])
        cache.remember(layer, seq_index, anchors, final)
        return final

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,  # [num_seqs, max_new, hidden]
        batch: ForwardBatch,
        cache: RecurrentStateCache | None,
        meta: RecurrentMetadata,
    ) -> Tensor:
        num_seqs, max_new, _ = x.shape
        mixed, z, b, a = self._project(x)
        gates = self._gates(b, a)  # [num_seqs, max_new, 2, value_heads]
        if meta.conv_slots is None:  # dense causal training batch: the plain causal conv
            conv_out = F.silu(self.conv1d(mixed.transpose(1, 2))[..., :max_new]).transpose(1, 2)
        else:
            if cache is not None:
                cache.write(self.layer_index, mixed, gates, batch)
                pool = cache.inputs.tensors[self.layer_index]  # [num_seqs, capacity, conv_dim]
            else:
                pool = mixed  # no cache: anchors are 0 and node j is slot j
            slots = meta.conv_slots
            rows = torch.arange(num_seqs, device=x.device)[:, None, None]
            windows = pool[rows, slots.clamp(min=0)] * (slots >= 0)[..., None].to(pool.dtype)
            conv_out = self._conv_windows(windows)
        q, k, v = self._heads(conv_out)
        g, beta = gates[..., 0, :], gates[..., 1, :]
        # The recurrence in fp32 even under bf16 autocast (the decays and the UT solve need it).
        with torch.autocast(x.device.type, enabled=False):
            out = self._mix(q, k, v, g, beta, batch, cache, meta)
        out = self.norm(out.to(x.dtype), z).reshape(num_seqs, max_new, self.value_dim)
        return self.out_proj(out)

    def _mix(self, q, k, v, g, beta, batch: ForwardBatch, cache: RecurrentStateCache | None, meta) -> Tensor:
        num_seqs, max_new = q.shape[:2]
        device = q.device
        if not meta.chain:
            num_entries = meta.entry_seq.shape[0] // num_seqs
            if cache is None:
                entry_states = self._zero_states(meta.entry_seq.shape[0], device)
            else:
                entry_states = self.states_at(cache, meta.entry_seq, meta.entry_anchor)
            entry_states = entry_states.view(num_seqs, num_entries, *entry_states.shape[1:])
            return tree_gated_delta_rule(q, k, v, g, beta, meta.ancestors, entry_states, meta.entry_index)
        if cache is None:
            if meta.conv_slots is None:
                out, _, _ = chunked_gated_delta_rule(q, k, v, g, beta, None, self.chunk_size)
            else:
                out, _, _ = chunked_gated_delta_rule(
                    q, k, v, g, beta, None, self.chunk_size, lengths=batch.num_new
                )
            return out
        seqs = torch.arange(num_seqs, device=device)
        initial = self.states_at(cache, seqs, batch.cache_lens)
        if max_new == 1:  # decode: the recurrent form
            out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
            live = batch.num_new > 0
            cache.set_pending(self.layer_index, PendingStates(seqs[live], torch.zeros_like(seqs[live]), final[live]))
            return out
        offsets = batch.cache_lens % self.chunk_size
        out, final, chunk_states = chunked_gated_delta_rule(
            q, k, v, g, beta, initial, self.chunk_size, offsets=offsets, lengths=batch.num_new
        )
        # Tentative states: at each aligned chunk end inside the new tokens, and after the last.
        ends = (batch.cache_lens - offsets)[:, None] + self.chunk_size * (
            1 + torch.arange(chunk_states.shape[1], device=device)
        )
        nodes = ends - batch.cache_lens[:, None] - 1  # the node after which the chunk ends
        inside = (nodes >= 0) & (nodes < batch.num_new[:, None] - 1)
        live = batch.num_new > 0
        rows = seqs[:, None].expand_as(nodes)
        cache.set_pending(self.layer_index, PendingStates(
            torch.cat([rows[inside], seqs[live]]),
            torch.cat([nodes[inside], batch.num_new[live] - 1]),
            torch.cat([chunk_states[inside], final[live]]),
        ))
        return out
