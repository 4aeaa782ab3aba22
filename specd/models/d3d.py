"""D3D: the block-diffusion drafter (arXiv 2611.06425). It never reads the target's hidden states.

A small transformer over the target's vocabulary with two kinds of input in one pass:

- *known tokens* (the committed context, and tokens under verification) are encoded causally,
  exactly like a decoder LM, into the drafter's own KV cache;
- a *mask group* of ``B`` ``<|mask|>`` tokens placed after some known node denoises the next
  ``B`` tokens at once: every mask sees the known tokens on its path and, bidirectionally, the
  other masks of its group — nothing else.

Because the drafter needs only token ids, it can draft the block *after* the one being verified
while the target verifies it: for each likely outcome ``(k, c)`` of the verification (k tokens
accepted, then token c) a known node ``c`` hangs under the k-th drafted token with a mask group
under it, and all outcomes are packed into ONE pass (see `specd.drafters.d3d`).

Training (`specd.train.drafter`) packs many mask groups at random anchors of a sequence into one
pass too: blockwise denoising cross-entropy on the masks plus an auxiliary autoregressive
cross-entropy from the causal positions (``ar_head``), as D3D combines them.

With ``target_hidden_size > 0`` the same module is the *DFlash-style* baseline: the target's
hidden state at each known position is projected and added to that token's embedding. It drafts
better per pass but must wait for the target to verify before it can draft the next block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cache import KVCache
from specd.models.attention import AttentionMetadata, get_backend
from specd.models.layers import Linear, RMSNorm, rotary_tables, token_major
from specd.models.llama import LlamaConfig
from specd.models.qwen3 import Qwen3Config, Qwen3DecoderLayer, init_weights
from specd.tree import TokenTree


@dataclass(kw_only=True, slots=True)
class D3DConfig:
    vocab_size: int = 4096
    """Must equal the target's vocabulary: drafts are target token ids."""
    hidden_size: int = 256
    """Residual stream width."""
    intermediate_size: int = 768
    """SwiGLU inner width."""
    num_hidden_layers: int = 2
    """Decoder layers (bidirectional inside a mask group, causal elsewhere)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads."""
    head_dim: int = 64
    """Per-head width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    block_size: int = 17
    """Largest mask group: blocks of up to block_size - 1 tokens plus one bonus guess."""
    group_sizes: tuple[int, ...] = (5, 9, 17)
    """Mask-group sizes trained (and used at inference: the smallest that fits block + 1)."""
    mask_token_id: int = 3
    """The ``<|mask|>`` id of the shared tokenizer."""
    target_hidden_size: int = 0
    """0 for D3D; the target's hidden size for the DFlash-style variant that reads it."""
    qk_norm: bool = True
    """Per-head q/k RMSNorm in the layers (Qwen3's); False for Llama-shaped layers, so a drafter
    of a Llama target (SmolLM2) can start from the target's own layers."""
    draft_vocab_size: int = 0
    """0: the heads cover the whole vocabulary. Else (FR-Spec, arXiv 2502.14856) they cover only
    this many tokens, the most frequent in the target's own output (``lm_head.vocab``): the head's
    product shrinks by ``vocab_size / draft_vocab_size`` and every other token gets probability 0
    in the draft. Verification is exact, so the output distribution does not change; only
    acceptance can (a token outside is never drafted)."""
    tie_heads: bool = False
    """The auxiliary AR head is the denoising head (one matrix): right when both start from the
    target's LM head and stay frozen, as a SmolLM2 drafter's do."""
    torch_dtype: str = "float32"
    """Weights' dtype on disk and by default in memory."""

    model_type = "specd_d3d"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "D3DConfig":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in hf.items() if k in known}
        if "group_sizes" in values:
            values["group_sizes"] = tuple(values["group_sizes"])
        return cls(**values)

    def to_hf(self) -> dict[str, Any]:
        return {"architectures": ["D3DDrafter"], "model_type": self.model_type, **asdict(self)}

    def layer_config(self) -> Qwen3Config | LlamaConfig:
        """The decoder-layer shapes, shared with the Qwen3 (or, without q/k norm, Llama) implementation."""
        config_class = Qwen3Config if self.qk_norm else LlamaConfig
        return config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
        )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def group_size_for(self, block: int) -> int:
        """The smallest trained mask group holding ``block`` tokens plus the bonus guess."""
        fitting = [g for g in self.group_sizes if g >= block + 1]
        if not fitting:
            raise ValueError(f"block {block} is above this drafter's largest group {max(self.group_sizes)} - 1")
        return min(fitting)


FLAVOURS: dict[str, D3DConfig] = {
    "tiny": D3DConfig(),
    "debug": D3DConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
}


@dataclass(frozen=True, slots=True)
class MaskGroup:
    """``size`` masks hanging under known node ``node`` of sequence ``seq`` (-1: the context end)."""

    seq: int
    node: int
    size: int


@dataclass(kw_only=True, slots=True)
class DraftPass:
    """One drafter pass: per-sequence trees of known nodes + mask groups, and where the masks sit."""

    batch: ForwardBatch
    groups: list[MaskGroup]
    mask_index: Tensor  # [num_groups, max_group] column of each group's masks in the batch (-1 pad)


def build_draft_pass(
    known: list[TokenTree],
    groups: list[MaskGroup],
    mask_token_id: int,
    cache_lens: list[int] | Tensor | None,
    device: torch.device | str = "cpu",
) -> DraftPass:
    """Append each group's masks to its sequence's tree, then make every group bidirectional.

    The masks of a group form a chain under their known node, so positions come out as
    ``anchor + depth`` (the positions of the tokens they predict) and the tree mask lets each
    see its known ancestors; the group is then opened up so its masks also see each other.
    """
    tokens = [t.tokens.tolist() for t in known]
    parents = [t.parents.tolist() for t in known]
    anchors = [t.anchors.tolist() for t in known]
    lens = [0] * len(known) if cache_lens is None else [int(x) for x in cache_lens]
    columns: list[list[int]] = []
    for group in groups:
        b = group.seq
        anchor = anchors[b][group.node] if group.node >= 0 else lens[b]
        parent = group.node
        cols = []
        for _ in range(group.size):
            cols.append(len(tokens[b]))
            tokens[b].append(mask_token_id)
            parents[b].append(parent)
            anchors[b].append(anchor)
            parent = cols[-1]
        columns.append(cols)
    trees = [
        TokenTree(torch.tensor(t, dtype=torch.long), torch.tensor(p, dtype=torch.long), torch.tensor(a, dtype=torch.long))
        for t, p, a in zip(tokens, parents, anchors)
    ]
    batch = ForwardBatch.from_trees(trees, cache_lens, device)
    mask = batch.mask
    max_group = max((g.size for g in groups), default=0)
    mask_index = torch.full((len(groups), max_group), -1, dtype=torch.long)
    for g, (group, cols) in enumerate(zip(groups, columns)):
        start = int(batch.cache_lens[group.seq]) if cache_lens is not None else 0
        slots = torch.tensor(cols, device=mask.device) + start
        rows = torch.tensor(cols, device=mask.device)
        mask[group.seq, rows[:, None], slots[None, :]] = True  # bidirectional inside the group
        mask_index[g, : len(cols)] = rows.cpu()
    return DraftPass(batch=batch, groups=groups, mask_index=mask_index.to(device))


class DraftHead(Linear):
    """A drafter's LM head: ``[.., hidden] -> [.., vocab_size]`` logits over the whole vocabulary.

    With a drafting vocabulary (``vocab``: the ``draft_vocab_size`` token ids it covers, FR-Spec)
    the product runs over those rows only and every other token's logit is ``-inf``, so callers
    (sampling, the outcome planner, the losses) see full-vocabulary logits either way.
    """

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int = 0) -> None:
        super().__init__(hidden_size, draft_vocab_size or vocab_size, bias=False)
        self.vocab_size = vocab_size
        self.register_buffer("vocab", torch.arange(draft_vocab_size, dtype=torch.long) if draft_vocab_size else None)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.draft_logits(x)
        if self.vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, logits)

    def draft_logits(self, x: Tensor) -> Tensor:
        """Logits over the drafting vocabulary only (column j is token ``vocab[j]``): what the
        training losses use, so that no step materialises full-vocabulary logits."""
        return super().forward(x)

    def draft_targets(self, ids: Tensor) -> Tensor:
        """Token ids as columns of `draft_logits`: -100 (ignored by cross-entropy) for a token the
        head cannot draft and for -100 itself."""
        if self.vocab is None:
            return ids
        column = torch.full((self.vocab_size,), -100, dtype=torch.long, device=ids.device)
        column[self.vocab.to(ids.device)] = torch.arange(len(self.vocab), device=ids.device)
        return torch.where(ids >= 0, column[ids.clamp(min=0)], -100)


class D3DModel(nn.Module):
    config_class = D3DConfig

    def __init__(self, config: D3DConfig) -> None:
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(layer_config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = DraftHead(config.hidden_size, config.vocab_size, config.draft_vocab_size)
        # Auxiliary autoregressive head (D3D): next-token prediction from causal positions.
        self.ar_head = (self.lm_head if config.tie_heads
                        else DraftHead(config.hidden_size, config.vocab_size, config.draft_vocab_size))
        if config.target_hidden_size:
            self.target_proj = nn.Linear(config.target_hidden_size, config.hidden_size, bias=False)
        self.apply(init_weights)
        self.attention_backend = get_backend("auto")

    def set_attention_backend(self, name: str) -> None:
        """How attention runs: "auto", "sdpa", "flex", "flash" or "triton" (`specd.models.attention`)."""
        self.attention_backend = get_backend(name)

    @torch.no_grad()
    def set_draft_vocab(self, ids: list[int]) -> None:
        """Name the tokens the heads cover (``draft_vocab_size`` distinct ids, before training)."""
        if not self.config.draft_vocab_size:
            raise ValueError("this drafter's heads cover the whole vocabulary (draft_vocab_size is 0)")
        vocab = torch.tensor(sorted(set(ids)), dtype=torch.long)
        if len(vocab) != self.config.draft_vocab_size or not 0 <= int(vocab[0]) <= int(vocab[-1]) < self.config.vocab_size:
            raise ValueError(f"a drafting vocabulary needs {self.config.draft_vocab_size} distinct ids in "
                             f"[0, {self.config.vocab_size}), got {len(vocab)} from {min(ids)} to {max(ids)}")
        for head in {id(h): h for h in (self.lm_head, self.ar_head)}.values():
            head.vocab.copy_(vocab.to(head.vocab.device))

    def tied_weights(self) -> dict[str, str]:
        """State-dict names that alias another entry (stored once; `specd.models.loading`)."""
        if not self.config.tie_heads:
            return {}
        return {name.replace("lm_head.", "ar_head.", 1): name for name in self.lm_head.state_dict(prefix="lm_head.")}

    def new_cache(self, num_seqs: int, capacity: int = 256) -> KVCache:
        c = self.config
        weight = self.embed_tokens.weight
        return KVCache(
            num_layers=c.num_hidden_layers, num_seqs=num_seqs, num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, capacity=capacity, dtype=weight.dtype, device=weight.device,
        )

    def hidden_states(
        self,
        batch: ForwardBatch,
        cache: KVCache | None = None,
        target_hidden: Tensor | None = None,  # [num_seqs, max_new, target_hidden] (DFlash-style)
    ) -> Tensor:
        """Final-norm hidden states ``[num_seqs, max_new, hidden]``; masks attend per `batch.mask`."""
        if cache is not None:
            cache.prepare(batch)
        x = self.embed_tokens(batch.input_ids)
        if self.config.target_hidden_size:
            if target_hidden is None:
                raise ValueError("this drafter reads target hidden states: pass target_hidden")
            is_known = (batch.input_ids != self.config.mask_token_id)[..., None]
            x = x + self.target_proj(target_hidden.to(x.dtype)) * is_known
        rotary = token_major(rotary_tables(batch.positions, self.config.head_dim, self.config.rope_theta, x.dtype))
        attention = AttentionMetadata.from_batch(batch, self.attention_backend)
        for layer in self.layers:
            x = layer(x, rotary, batch, cache, attention)
        return self.norm(x)

    def forward(self, batch: ForwardBatch, cache: KVCache | None = None, target_hidden: Tensor | None = None) -> Tensor:
        """Denoising logits ``[num_seqs, max_new, vocab]`` (meaningful at mask positions)."""
        return self.lm_head(self.hidden_states(batch, cache, target_hidden))

    def prune(self, keep: list[int]) -> "D3DModel":
        """A copy with only the decoder layers ``keep`` (D3D's acceptance-aware layer pruning)."""
        config = D3DConfig(**{**asdict(self.config), "num_hidden_layers": len(keep)})
        pruned = D3DModel(config)
        state = {}
        for name, value in self.state_dict().items():
            if name.startswith("layers."):
                _, index, rest = name.split(".", 2)
                if int(index) in keep:
                    state[f"layers.{keep.index(int(index))}.{rest}"] = value
            else:
                state[name] = value
        pruned.load_state_dict(state)
        for i, layer in enumerate(pruned.layers):
            layer.self_attn.layer_index = i
        pruned.attention_backend = self.attention_backend
        return pruned.to(self.embed_tokens.weight.dtype).eval()
