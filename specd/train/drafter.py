"""Offline drafter training (D3D pre-training, and the DFlash-style baseline on the same data).

Data is the target's *own* output: responses it generates (greedy and temperature 1, half each)
to prompts taken from the zoo's training documents, cached beside the drafter. That is what a
drafter must imitate, and with lossless decoding it is exactly what live traffic looks like.

One training pass packs, per sequence, the causal trunk (prompt tail + response) and ``G``
mask groups at random anchors in the response: group g holds ``block_size`` masks at positions
``a_g .. a_g + block_size - 1``, sees the trunk before ``a_g`` and, bidirectionally, itself.
Loss (D3D): blockwise denoising cross-entropy on the masks, weighted toward early positions
(acceptance is a prefix property: position i only counts if all before it are accepted), plus
an auxiliary autoregressive cross-entropy from the trunk through ``ar_head``.

The DFlash-style variant reads the target's final hidden states at trunk positions, and its
group starts with the known token before the block (whose target state the drafter cannot have
at draft time, since the target has not run on it yet). That token sees the trunk, not the masks
after it, as in the served pass.

Each batch is split over single-threaded processes (`specd.train.workers`) by rows; the loss's
denominators (weighted denoising targets, AR targets) are summed over the ranks before dividing,
so the summed gradients are the whole batch's, as in one process.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from specd.batch import ForwardBatch
from specd.data.chat import ChatTemplate, render_prompt
from specd.engine import autoregressive
from specd.models.d3d import D3DModel
from specd.models.loading import save_model
from specd.precision import cpu_autocast, cpu_computes_bf16
from specd.sampling import SamplingParams
from specd.train import workers as train_workers
from specd.train.pretrain import PretrainConfig, lr_at


@dataclass(kw_only=True, slots=True)
class DrafterTrainConfig:
    steps: int = 600
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 224
    """Trunk tokens per sequence (prompt tail + response), padded."""
    groups_per_seq: int = 12
    """Mask groups per sequence."""
    lr: float = 2e-3
    """Peak learning rate (warmup + cosine, like pre-training)."""
    warmup_steps: int = 30
    """Linear warmup."""
    ar_weight: float = 0.5
    """Weight of the auxiliary autoregressive loss."""
    position_decay: float = 6.0
    """Denoising loss weight exp(-i / decay) at block position i."""
    seed: int = 0
    """Seed for initialisation, anchors and batches."""
    bf16: bool = field(default_factory=cpu_computes_bf16)
    """bf16 autocast (default: where the CPU computes bf16, `specd.precision`)."""
    compile: bool = False
    """torch.compile the loss (about 1.5x per step, but one compile per group size)."""
    checkpoint_every: int = 100
    """Steps between resumable checkpoints."""
    distill: bool = False
    """Soft targets: at every predicted position, the target's own next-token distribution (over
    the drafting vocabulary, renormalised) instead of the one token of its response. One target
    pass per step buys many more bits per token, which a drafter trained on little data needs."""
    frozen: tuple[str, ...] = ()
    """Parameters not trained, by name prefix: ``("embed_tokens", "lm_head")`` keeps an embedding
    and head taken from the target exactly the target's (DFlash's sharing), and halves the work."""


# ---------------------------------------------------------------------------- data
def training_prompts(documents: dict[str, list[str]], tokenizer, per_domain: int, seed: int,
                     template: ChatTemplate | None = None, max_prompt_tokens: int = 160) -> list[list[int]]:
    """Prompts cut from training documents: chat turns up to the assistant, code heads. With a
    ``template`` (a pretrained target's own), chats are re-rendered in its format."""
    return [ids for _, ids in domain_prompts(documents, tokenizer, per_domain, seed, template, max_prompt_tokens)]


def domain_prompts(documents: dict[str, list[str]], tokenizer, per_domain: int, seed: int,
                   template: ChatTemplate | None = None, max_prompt_tokens: int = 160) -> list[tuple[str, list[int]]]:
    """`training_prompts` with the domain of each, in the same order: a response file's
    sequences follow its prompts, so this says which domain each sequence answers."""
    rng = np.random.default_rng(seed)
    prompts = []
    marker = "<|im_start|>assistant\n"
    for domain, docs in documents.items():
        for i in rng.choice(len(docs), size=min(per_domain, len(docs)), replace=False):
            text = docs[int(i)]
            if marker in text:
                text = text[: text.index(marker) + len(marker)]
            else:
                lines = text.splitlines(keepends=True)
                text = "".join(lines[: max(2, len(lines) // 4)])
            if template is not None:
                text = render_prompt(text, template)
            ids = tokenizer.encode(text).ids[-max_prompt_tokens:]
            if len(ids) >= 2:
                prompts.append((domain, ids))
    return prompts


def generate_responses(target: nn.Module, prompts: list[list[int]], max_tokens: int, batch: int = 32,
                       bf16: bool = False) -> list[list[int]]:
    """prompt + the target's response for each prompt: three in four greedy, one at T=1.

    ``bf16``: under bf16 autocast where the CPU computes bf16 (`specd.precision`; fp32 elsewhere).
    A large batch is compute-bound, and there bf16 on a CPU that has it is several times faster;
    the answers are then the bf16 model's, which differ from fp32 greedy text now and then — what
    a drafter learns from, not what it is measured against."""
    sequences = []
    for start in tqdm(range(0, len(prompts), batch), desc="target responses", unit="batch"):
        chunk = prompts[start : start + batch]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0.0 if (start + j) % 4 else 1.0,
                           seed=start + j, stop_token_ids=target.config.stop_token_ids)
            for j in range(len(chunk))
        ]
        with cpu_autocast(bf16):
            generations = autoregressive(target, chunk, params)
        for prompt, generation in zip(chunk, generations):
            sequences.append(prompt + generation.token_ids)
    return sequences


# ---------------------------------------------------------------------------- packed batches
def denoising_batch(
    tokens: Tensor,  # [num_seqs, seq_len] trunk tokens, right-padded
    lengths: Tensor,  # [num_seqs] real trunk lengths
    anchors: Tensor,  # [num_seqs, groups] first predicted position of each group
    group_size: int,
    mask_token_id: int,
    lead: int = 0,  # known tokens leading each group (1 for the DFlash-style drafter)
) -> tuple[ForwardBatch, Tensor]:
    """The packed pass of the module docstring and the denoising targets ``[num_seqs, groups, group_size]``."""
    num_seqs, seq_len = tokens.shape
    groups = anchors.shape[1]
    width = lead + group_size
    total = seq_len + groups * width
    offsets = torch.arange(width)
    positions_groups = anchors[:, :, None] - lead + offsets  # [num_seqs, groups, width]
    positions = torch.cat([torch.arange(seq_len).expand(num_seqs, seq_len), positions_groups.flatten(1)], dim=1)
    group_ids = torch.full((num_seqs, groups, width), mask_token_id, dtype=torch.long)
    if lead:
        group_ids[:, :, :lead] = tokens.gather(1, (anchors[:, :, None] - lead + torch.arange(lead)).flatten(1)).view(num_seqs, groups, lead)
    input_ids = torch.cat([tokens, group_ids.flatten(1)], dim=1)

    mask = torch.zeros(num_seqs, total, total, dtype=torch.bool)
    mask[:, :seq_len, :seq_len] = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    trunk = torch.arange(seq_len)
    sees_trunk = trunk[None, None, :] < (anchors - lead)[:, :, None]  # [num_seqs, groups, seq_len]
    group_of = torch.arange(groups).repeat_interleave(width)  # [groups * width]
    mask[:, seq_len:, :seq_len] = sees_trunk[:, group_of]
    # Masks see their whole group; a leading known token sees only the leads up to itself, as in
    # the served pass, where it is a committed node of the context and the masks come after it.
    in_group = torch.arange(width).repeat(groups)
    sees = (in_group[:, None] >= lead) | (in_group[None, :] <= in_group[:, None])
    mask[:, seq_len:, seq_len:] = (group_of[:, None] == group_of[None, :]) & sees

    target_positions = positions_groups[:, :, lead:]  # [num_seqs, groups, group_size]
    valid = target_positions < lengths[:, None, None]
    targets = tokens.gather(1, target_positions.clamp(max=seq_len - 1).flatten(1)).view_as(target_positions)
    targets = targets.masked_fill(~valid, -100)
    batch = ForwardBatch(
        input_ids=input_ids, positions=positions, mask=mask,
        write_slots=torch.full_like(input_ids, -1), num_new=torch.full((num_seqs,), total),
        trees=(), cache_lens=torch.zeros(num_seqs, dtype=torch.long),
    )
    return batch, targets


def sample_batch(sequences: list[list[int]], prompt_lens: list[int], config: DrafterTrainConfig,
                 lead: int, rng: np.random.Generator, pad_id: int):
    """Random sequences, cut to ``seq_len`` around their response, with anchors in the response."""
    picks = rng.integers(0, len(sequences), size=config.batch_size)
    tokens = torch.full((config.batch_size, config.seq_len), pad_id, dtype=torch.long)
    lengths = torch.zeros(config.batch_size, dtype=torch.long)
    anchors = torch.zeros(config.batch_size, config.groups_per_seq, dtype=torch.long)
    for row, i in enumerate(picks):
        seq, prompt_len = sequences[int(i)], prompt_lens[int(i)]
        start = max(0, min(prompt_len - config.seq_len // 3, len(seq) - config.seq_len))
        window = seq[start : start + config.seq_len]
        tokens[row, : len(window)] = torch.tensor(window)
        lengths[row] = len(window)
        low = max(lead + 1, prompt_len - start)
        high = max(low + 1, len(window) - 1)
        anchors[row] = torch.from_numpy(rng.integers(low, high, size=config.groups_per_seq))
    return tokens, lengths, anchors


def drafter_loss(model: D3DModel, batch: ForwardBatch, targets: Tensor, tokens: Tensor, lengths: Tensor,
                 config: DrafterTrainConfig, group_size: int, lead: int, target_hidden: Tensor | None,
                 soft: Tensor | None = None, anchors: Tensor | None = None,
                 total_counts: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(total loss, denoising loss). With ``soft`` (`target_soft_labels`) and the groups'
    ``anchors``, cross-entropy against the target's distributions instead of its tokens. Each
    loss is a mean over its targets; ``total_counts`` maps this batch's counts ``[denoise, ar]``
    to the counts to divide by (a rank of a split batch: the whole batch's)."""
    num_seqs, seq_len = tokens.shape
    with cpu_autocast(config.bf16):
        hidden = model.hidden_states(batch, None, target_hidden)
        groups = targets.shape[1]
        group_hidden = hidden[:, seq_len:].view(num_seqs, groups, lead + group_size, -1)[:, :, lead:]
        denoise_logits = model.lm_head.draft_logits(group_hidden).float()
        ar_logits = model.ar_head.draft_logits(hidden[:, : seq_len - 1]).float()
    weights = torch.exp(-torch.arange(group_size, dtype=torch.float32) / config.position_decay)
    ar_targets = tokens[:, 1:].masked_fill(torch.arange(1, seq_len)[None] >= lengths[:, None], -100)
    if soft is not None:
        # Token t is predicted at position t - 1 of the target's pass: its distribution there.
        predicted_at = (anchors[:, :, None] + torch.arange(group_size) - 1).clamp(0, seq_len - 1)
        group_soft = soft[torch.arange(num_seqs)[:, None, None], predicted_at]  # [num_seqs, groups, size, V']
        valid = (targets != -100).float() * weights
        ar_valid = (ar_targets != -100).float()
        denoise_sum = (-(group_soft * denoise_logits.log_softmax(-1)).sum(-1) * valid).sum()
        ar_sum = (-(soft[:, : seq_len - 1] * ar_logits.log_softmax(-1)).sum(-1) * ar_valid).sum()
    else:
        # As columns of the drafting vocabulary; a token the head cannot draft is not trained on.
        targets = model.lm_head.draft_targets(targets)
        ar_targets = model.ar_head.draft_targets(ar_targets)
        valid = (targets != -100).float() * weights
        ar_valid = (ar_targets != -100).float()
        per_token = F.cross_entropy(denoise_logits.flatten(0, 2), targets.flatten(), reduction="none",
                                    ignore_index=-100)
        denoise_sum = (per_token.view_as(targets) * weights).sum()
        ar_sum = F.cross_entropy(ar_logits.flatten(0, 1), ar_targets.flatten(), reduction="sum", ignore_index=-100)
    counts = torch.stack([valid.sum(), ar_valid.sum()])
    if total_counts is not None:
        counts = total_counts(counts)
    denoise = denoise_sum / counts[0].clamp(min=1)
    return denoise + config.ar_weight * ar_sum / counts[1].clamp(min=1), denoise


@torch.no_grad()
def target_soft_labels(target: nn.Module, tokens: Tensor, head: nn.Module, bf16: bool) -> Tensor:
    """The target's next-token distributions ``[num_seqs, seq_len, V']`` at every trunk position,
    over the drafter head's columns (its drafting vocabulary, renormalised; all of it without one)."""
    with cpu_autocast(bf16):
        hidden = target.hidden_states(ForwardBatch.dense(tokens))
    weight = target.lm_head.weight if head.vocab is None else target.lm_head.weight[head.vocab]
    return (hidden.float() @ weight.float().t()).softmax(-1)


# ---------------------------------------------------------------------------- the loop
def train_drafter(
    model: D3DModel,
    sequences: list[list[int]],
    prompt_lens: list[int],
    config: DrafterTrainConfig,
    out: Path,
    *,
    target: nn.Module | None = None,
    pad_id: int = 6,
    description: str = "drafter",
    workers: int | None = None,
) -> dict:
    """Train in place with resumable checkpoints under ``out``; returns summary figures. Each batch
    is split over ``workers`` processes (default `specd.train.workers.default_workers`)."""
    lead = 1 if model.config.target_hidden_size else 0
    if lead and target is None:
        raise ValueError("the DFlash-style drafter trains on target hidden states: pass target")
    if config.distill and target is None:
        raise ValueError("distillation trains on the target's distributions: pass target")
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or train_workers.default_workers()
    if workers == 1:
        return _train_drafter(model, target, sequences, prompt_lens, config, out, pad_id, description)
    args = (sequences, prompt_lens, config, out, pad_id, description)
    return train_workers.train(_train_drafter, [model, target], args, workers)


def _train_drafter(model: D3DModel, target: nn.Module | None, sequences: list[list[int]], prompt_lens: list[int],
                   config: DrafterTrainConfig, out: Path, pad_id: int, description: str, rank: int = 0,
                   world: int = 1) -> dict:
    """The training loop, as rank ``rank`` of ``world``: every rank draws the whole batch and
    trains on its rows; rank 0 writes the checkpoints, every rank resumes from them."""
    lead = 1 if model.config.target_hidden_size else 0
    checkpoint = out / "checkpoint.pt"
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not name.startswith(config.frozen))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.05)
    rng = np.random.default_rng(config.seed)
    first_step = 0
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        first_step = state["step"]
    schedule = PretrainConfig(steps=config.steps, lr=config.lr, warmup_steps=config.warmup_steps)
    loss_fn = torch.compile(drafter_loss) if config.compile else drafter_loss
    total_counts = train_workers.summed if world > 1 else None
    model.train()
    start, smoothed = time.perf_counter(), float("nan")
    bar = tqdm(range(first_step, config.steps), desc=description, unit="step", initial=first_step, total=config.steps,
               disable=rank != 0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        # Every trained group size in turn, so blocks of 4, 8 and 16 each get a matching group.
        group_size = model.config.group_sizes[step % len(model.config.group_sizes)]
        tokens, lengths, anchors = sample_batch(sequences, prompt_lens, config, lead, rng, pad_id)
        mine = train_workers.rows(len(tokens), rank, world)
        tokens, lengths, anchors = tokens[mine], lengths[mine], anchors[mine]
        batch, targets = denoising_batch(tokens, lengths, anchors, group_size, model.config.mask_token_id, lead)
        target_hidden = None
        if lead:
            target_hidden = _target_hidden(target, tokens, batch.input_ids.shape[1])
        soft = target_soft_labels(target, tokens, model.lm_head, config.bf16) if config.distill else None
        loss, denoise = loss_fn(model, batch, targets, tokens, lengths, config, group_size, lead, target_hidden,
                                soft, anchors, total_counts)
        loss.backward()
        if world > 1:
            denoise = train_workers.sum_gradients(trained, denoise)
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = denoise.item()
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        bar.set_postfix(denoise=f"{smoothed:.3f}")
        if rank == 0 and (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "step": step + 1},
                       checkpoint)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    if rank == 0:
        checkpoint.unlink(missing_ok=True)
    return {"denoise_loss": smoothed, "seconds": time.perf_counter() - start, "config": asdict(config)}


@torch.no_grad()
def drafted_blocks(model: D3DModel, sequences: list[list[int]], anchors: list[list[int]], block: int, *,
                   bf16: bool = False, rows: int = 16, target: nn.Module | None = None) -> Tensor:
    """The greedy block ``[num_anchors, block]`` a drafter drafts at each anchor of each sequence,
    in order: anchor ``a`` drafts tokens ``a .. a + block - 1`` from ``sequence[:a]``
    (``1 <= a <= len(sequence) - block``).

    One packed pass per ``rows`` sequences (`denoising_batch`) drafts every anchor's block as the
    served drafter drafts it (tests hold the two equal), without the engine:
    - D3D (`D3DDrafter.draft`): the first token from the AR head at the anchor's parent, the rest
      from the mask group;
    - the DFlash-style drafter (`DFlashDrafter.draft`; pass ``target``): the trunk reads the
      target's hidden states, and the whole block comes from a group led by the known token
      before it, whose state the drafter cannot have at draft time."""
    reads_target = bool(model.config.target_hidden_size)
    if reads_target and target is None:
        raise ValueError("the DFlash-style drafter drafts from the target's hidden states: pass target")
    lead = 1 if reads_target else 0
    group = model.config.group_size_for(block)
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(sequences), rows):
        chunk, chunk_anchors = sequences[start : start + rows], anchors[start : start + rows]
        per_seq = max(len(a) for a in chunk_anchors)
        width = max(len(s) for s in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        anchor_grid = torch.ones(len(chunk), per_seq, dtype=torch.long)
        real = torch.zeros(len(chunk), per_seq, dtype=torch.bool)
        for row, (seq, seq_anchors) in enumerate(zip(chunk, chunk_anchors)):
            if any(not 1 <= a <= len(seq) - block for a in seq_anchors):
                raise ValueError(f"anchors must lie in [1, len(sequence) - block = {len(seq) - block}]: {seq_anchors}")
            tokens[row, : len(seq)] = torch.tensor(seq)
            anchor_grid[row, : len(seq_anchors)] = torch.tensor(seq_anchors, dtype=torch.long)
            real[row, : len(seq_anchors)] = True
        lengths = torch.tensor([len(s) for s in chunk])
        batch, _ = denoising_batch(tokens, lengths, anchor_grid, group, model.config.mask_token_id, lead)
        # In the target's own dtype, as the engine hands them to the drafter.
        target_hidden = _target_hidden(target, tokens, batch.input_ids.shape[1], bf16=False) if reads_target else None
        with cpu_autocast(bf16):
            hidden = model.hidden_states(batch, None, target_hidden)
        group_hidden = hidden[:, width:].view(len(chunk), per_seq, lead + group, -1)[:, :, lead : lead + block]
        drafted = model.lm_head(group_hidden.float()).argmax(-1)  # [rows, per_seq, block]
        if not reads_target:
            parents = hidden[torch.arange(len(chunk))[:, None], anchor_grid - 1]
            drafted[:, :, 0] = model.ar_head(parents.float()).argmax(-1)
        out.append(drafted[real])
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, block, dtype=torch.long)


def block_acceptance(model: D3DModel, sequences: list[list[int]], anchors: list[list[int]], block: int, *,
                     bf16: bool = False, target: nn.Module | None = None) -> tuple[Tensor, int]:
    """Greedy acceptance per block position of the blocks `drafted_blocks` drafts, against the
    sequences' own next tokens: ``(counts [block], blocks)``, where ``counts[i]`` is how many
    blocks had their first ``i + 1`` drafted tokens all equal to the sequence's.

    When a sequence is the target's greedy continuation of its prompt, that is what greedy
    verification accepts, so ``1 + counts.sum() / blocks`` is τ at a fixed block, measured
    without the engine (nor the target, but for the hidden states a DFlash-style drafter reads)."""
    drafted = drafted_blocks(model, sequences, anchors, block, bf16=bf16, target=target)
    truth = torch.tensor([seq[a : a + block] for seq, seq_anchors in zip(sequences, anchors) for a in seq_anchors],
                         dtype=torch.long).view(-1, block)
    return (drafted == truth).long().cumprod(-1).sum(0), len(truth)


@torch.no_grad()
def _target_hidden(target: nn.Module, tokens: Tensor, total: int, bf16: bool = True) -> Tensor:
    """Target final hidden states at trunk positions, zero at group columns (``bf16``: under bf16
    autocast where the CPU computes it, as training reads them; the engine's target runs in its own
    dtype)."""
    num_seqs, seq_len = tokens.shape
    with cpu_autocast(bf16):
        hidden = target.hidden_states(ForwardBatch.dense(tokens)).float()
    out = hidden.new_zeros(num_seqs, total, hidden.shape[-1])
    out[:, :seq_len] = hidden
    return out


def save_drafter(model: D3DModel, out: Path, stats: dict) -> None:
    save_model(model, out)
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")


def init_from_target(drafter: D3DModel, target: nn.Module, layers_from: list[int] | None = None) -> bool:
    """Start the drafter from the target's embedding, first layers, norm and head, where shapes allow.

    A common warm start for drafters (the drafter learns the target's vocabulary geometry for
    free); both the D3D drafter and the DFlash-style baseline get it, so the comparison stays fair.
    Returns whether it applied (a Qwen3-style target with the drafter's widths).

    With a drafting vocabulary (`D3DConfig.draft_vocab_size`) the heads take the target head's
    rows of those tokens. ``layers_from`` picks which target layers the drafter's start from
    (default the first ones).
    """
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not isinstance(layers[0], type(drafter.layers[0])):
        return False
    chosen = list(layers_from) if layers_from is not None else list(range(min(len(layers), len(drafter.layers))))
    source = {
        "embed_tokens": inner.embed_tokens, "norm": inner.norm,
        **{f"layers.{i}": layers[j] for i, j in enumerate(chosen)},
    }
    own = dict(drafter.named_modules())
    if any(dict(own[name].named_parameters()).keys() != dict(module.named_parameters()).keys()
           or any(p.shape != q.shape for p, q in zip(own[name].parameters(), module.parameters()))
           for name, module in source.items()):
        return False
    head = target.lm_head.weight
    if head.shape != (drafter.config.vocab_size, drafter.config.hidden_size):
        return False
    with torch.no_grad():
        for name, module in source.items():
            for mine, theirs in zip(own[name].parameters(), module.parameters()):
                mine.copy_(theirs)
        for own_head in (drafter.lm_head, drafter.ar_head):
            rows = head if own_head.vocab is None else head[own_head.vocab]
            own_head.weight.copy_(rows)
    return True


def draft_vocabulary(sequences: list[list[int]], prompt_lens: list[int], size: int,
                     always: tuple[int, ...] = ()) -> list[int]:
    """FR-Spec's drafting vocabulary: the ``size`` tokens most frequent in the target's responses
    (ties by id), ``always`` (the stop tokens: a drafter must be able to end a turn) included."""
    counts = np.zeros(max(max(s) for s in sequences) + 1, dtype=np.int64)
    for seq, prompt_len in zip(sequences, prompt_lens):
        np.add.at(counts, np.asarray(seq[prompt_len:], dtype=np.int64), 1)
    ranked = [int(t) for t in np.argsort(-counts, kind="stable")]
    chosen = list(dict.fromkeys([*always, *ranked]))[:size]
    return sorted(chosen)


def read_sequences(path: Path) -> tuple[list[list[int]], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["ids"] for r in rows], [r["prompt_len"] for r in rows]


def write_sequences(path: Path, sequences: list[list[int]], prompt_lens: list[int]) -> None:
    path.write_text("".join(json.dumps({"prompt_len": n, "ids": s}) + "\n" for s, n in zip(sequences, prompt_lens)))
