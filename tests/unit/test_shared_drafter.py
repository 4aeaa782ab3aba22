"""A drafter built from a pretrained target: Llama-shaped layers taken from the target, its
embedding and head shared (tied heads, frozen in training), and an FR-Spec drafting vocabulary.
Speculation with it stays lossless, and its head is exactly the target's rows."""

from __future__ import annotations

import copy

import pytest
import torch

from specd.batch import ForwardBatch
from specd.drafters.base import DraftRequest
from specd.drafters.d3d import D3DDrafter
from specd.drafters.dflash import DFlashDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.d3d import D3DModel
from specd.models.llama import FLAVOURS, LlamaForCausalLM
from specd.models.loading import load_model, save_model
from specd.sampling import SamplingParams
from specd.train.drafter import (
    DrafterTrainConfig,
    block_acceptance,
    denoising_batch,
    draft_vocabulary,
    drafted_blocks,
    init_from_target,
    train_drafter,
)
from specd.zoo import shared_drafter_config

VOCAB = FLAVOURS["debug"].vocab_size
DRAFT_VOCAB = 96


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = LlamaForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # greedy text with structure (the head is tied to the embedding)
    return model


def prompts(num: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(num)
    return [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 20, (num,), generator=generator)]


def shared_drafter(target, vocab: list[int], reads_target: bool = False,
                   layers_from: tuple[int, ...] = (1,)) -> D3DModel:
    config = shared_drafter_config(target.config, num_hidden_layers=len(layers_from), draft_vocab_size=len(vocab),
                                   mask_token_id=1, reads_target=reads_target)
    drafter = D3DModel(config)
    drafter.set_draft_vocab(vocab)
    assert init_from_target(drafter, target, layers_from=list(layers_from))
    return drafter.eval()


def test_draft_vocabulary_ranks_response_tokens_and_keeps_stop_tokens():
    sequences = [[9, 9, 5, 5, 5, 4], [9, 8, 5, 7, 7]]
    prompt_lens = [2, 1]  # 9s in the prompts do not count
    assert draft_vocabulary(sequences, prompt_lens, 3, always=(0,)) == [0, 5, 7]
    assert draft_vocabulary(sequences, prompt_lens, 2) == [5, 7]


def test_the_heads_are_the_targets_rows_and_minus_inf_elsewhere(target):
    vocab = list(range(0, 2 * DRAFT_VOCAB, 2))
    drafter = shared_drafter(target, vocab)
    assert drafter.ar_head is drafter.lm_head
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[vocab])
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, target.model.layers[1].mlp.down_proj.weight)
    hidden = torch.randn(3, FLAVOURS["debug"].hidden_size)
    logits = drafter.lm_head(hidden)
    assert logits.shape == (3, VOCAB)
    expected = hidden @ target.lm_head.weight.t()
    torch.testing.assert_close(logits[:, vocab], expected[:, vocab])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert bool(torch.isneginf(logits[:, outside]).all())
    targets = torch.tensor([0, 1, 2, -100, 2 * DRAFT_VOCAB - 2])
    assert drafter.lm_head.draft_targets(targets).tolist() == [0, -100, 1, -100, DRAFT_VOCAB - 1]


def test_a_drafting_vocabulary_must_fit(target):
    config = shared_drafter_config(target.config, num_hidden_layers=1, draft_vocab_size=4, mask_token_id=1)
    drafter = D3DModel(config)
    with pytest.raises(ValueError, match="4 distinct ids"):
        drafter.set_draft_vocab([1, 2, 3])
    with pytest.raises(ValueError, match="4 distinct ids"):
        drafter.set_draft_vocab([1, 2, 3, VOCAB])


def test_saved_and_loaded_with_one_head_and_integer_ids(target, tmp_path):
    vocab = list(range(DRAFT_VOCAB))
    drafter = shared_drafter(target, vocab)
    save_model(drafter, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.ar_head is loaded.lm_head
    assert loaded.lm_head.vocab.dtype == torch.long and loaded.lm_head.vocab.tolist() == vocab
    hidden = torch.randn(2, FLAVOURS["debug"].hidden_size)
    assert torch.equal(loaded.lm_head(hidden), drafter.lm_head(hidden))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("num_seqs", [1, 4])
def test_greedy_with_a_shared_drafter_equals_plain_greedy(target, mode, num_seqs):
    batch = prompts(num_seqs)
    params = SamplingParams(max_tokens=20)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    drafter = D3DDrafter(shared_drafter(target, list(range(DRAFT_VOCAB))), max_num_seqs=num_seqs)
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=num_seqs, block_size=4, mode=mode))
    got = [g.token_ids for g in engine.generate(batch, params)]
    engine.close()
    assert got == expected


def test_sampled_drafts_never_propose_a_token_outside_the_vocabulary(target):
    vocab = list(range(0, 2 * DRAFT_VOCAB, 2))
    drafter = D3DDrafter(shared_drafter(target, vocab), max_num_seqs=2)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=2, block_size=4, mode="sync"))
    proposed = []
    original = drafter._block

    def spy(seq, logits, block_size, sampling, start=None):  # seeded: drafted keyed, from start
        block = original(seq, logits, block_size, sampling, start=start)
        proposed.extend(block.tokens)
        return block

    drafter._block = spy
    engine.generate(prompts(2), params)
    engine.close()
    assert proposed and set(proposed) <= set(vocab)


def test_training_leaves_frozen_weights_exactly_as_the_target_has_them(target, tmp_path):
    vocab = list(range(DRAFT_VOCAB))
    drafter = shared_drafter(target, vocab).train()
    head, layer = drafter.lm_head.weight.clone(), drafter.layers[0].mlp.up_proj.weight.clone()
    sequences = [p + p for p in prompts(6)]
    config = DrafterTrainConfig(steps=3, batch_size=2, seq_len=32, groups_per_seq=2, warmup_steps=1, bf16=False,
                                frozen=("embed_tokens", "lm_head", "ar_head"))
    train_drafter(drafter, sequences, [len(s) // 2 for s in sequences], config, tmp_path / "work", pad_id=0, workers=1)
    assert torch.equal(drafter.lm_head.weight, head)
    assert torch.equal(drafter.embed_tokens.weight, target.model.embed_tokens.weight)
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, layer)
    assert all(p.requires_grad for p in drafter.parameters())


def test_distillation_moves_the_drafter_toward_the_targets_distributions(target, tmp_path):
    """Soft targets (the target's own next-token distributions over the drafting vocabulary):
    the drafter's AR head ends closer to them, in KL, than it started."""
    from specd.batch import ForwardBatch
    from specd.train.drafter import target_soft_labels

    torch.manual_seed(1)
    vocab = list(range(DRAFT_VOCAB))
    config = shared_drafter_config(target.config, num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB, mask_token_id=1)
    drafter = D3DModel(config)  # random: far from the target to begin with
    drafter.set_draft_vocab(vocab)
    sequences = [p + p for p in prompts(8)]
    tokens = torch.tensor([sequences[0]])

    def kl() -> float:
        with torch.no_grad():
            p = target_soft_labels(target, tokens, drafter.lm_head, bf16=False)[0]
            log_q = drafter.ar_head.draft_logits(drafter.hidden_states(ForwardBatch.dense(tokens))[0]).log_softmax(-1)
            return float((p * (p.clamp(min=1e-30).log() - log_q)).sum(-1).mean())

    before = kl()
    training = DrafterTrainConfig(steps=40, batch_size=4, seq_len=32, groups_per_seq=2, warmup_steps=2, lr=3e-3,
                                  bf16=False, distill=True)
    train_drafter(drafter, sequences, [len(s) // 2 for s in sequences], training, tmp_path / "work", target=target,
                  pad_id=0, workers=1)
    assert kl() < 0.8 * before


@pytest.mark.parametrize("reads_target", [False, True], ids=["d3d-hard-labels", "dflash-distilled"])
def test_a_batch_split_over_processes_trains_the_drafter_one_process_trains(target, tmp_path, reads_target):
    """Three ranks on 5 sequences a batch (uneven rows), against one process: the same weights
    after a few steps and the same denoising loss. The loss's denominators are the whole batch's
    (a drafting vocabulary of 96 of 512 tokens drops targets unevenly between ranks, so a mean of
    the ranks' means would differ); the DFlash-style case reads the target's hidden states and
    distils its distributions on each rank's own rows."""
    torch.manual_seed(2)
    vocab = list(range(DRAFT_VOCAB))
    split = shared_drafter(target, vocab, reads_target=reads_target).train()
    alone, start = copy.deepcopy(split), copy.deepcopy(split)
    sequences = [p + p for p in prompts(10)]
    config = DrafterTrainConfig(steps=3, batch_size=5, seq_len=32, groups_per_seq=2, warmup_steps=1, lr=3e-3,
                                bf16=False, distill=reads_target, frozen=("embed_tokens", "lm_head"))
    lens = [len(s) // 2 for s in sequences]
    many = train_drafter(split, sequences, lens, config, tmp_path / "split", target=target, pad_id=0, workers=3)
    one = train_drafter(alone, sequences, lens, config, tmp_path / "one", target=target, pad_id=0, workers=1)
    assert many["workers"] == 3
    assert many["denoise_loss"] == pytest.approx(one["denoise_loss"], rel=1e-5)
    for (name, a), b in zip(split.named_parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert max((a - b).abs().max().item() for a, b in zip(split.parameters(), start.parameters())) > 1e-3


def test_distillation_needs_the_target(target, tmp_path):
    drafter = shared_drafter(target, list(range(DRAFT_VOCAB)))
    config = DrafterTrainConfig(steps=1, batch_size=1, seq_len=16, groups_per_seq=1, bf16=False, distill=True)
    with pytest.raises(ValueError, match="pass target"):
        train_drafter(drafter, [list(range(3, 30))], [5], config, tmp_path / "work", pad_id=0, workers=1)


@pytest.mark.parametrize("block", [4, 8])
def test_packed_blocks_are_the_blocks_the_drafter_serves(target, block):
    """`drafted_blocks` (one packed training-style pass, no engine) drafts at every anchor exactly
    the greedy block `D3DDrafter.draft` returns for the context before it."""
    drafter = shared_drafter(target, list(range(DRAFT_VOCAB)))
    sequences = [p + p + p for p in prompts(5)]
    generator = torch.Generator().manual_seed(3)
    anchors = [sorted(torch.randint(1, len(s) - block + 1, (3,), generator=generator).tolist()) for s in sequences]
    packed = drafted_blocks(drafter, sequences, anchors, block, rows=2)
    served = D3DDrafter(drafter, max_num_seqs=1)
    greedy = SamplingParams(max_tokens=block, temperature=0.0)
    expected = []
    for seq, seq_anchors in zip(sequences, anchors):
        for a in seq_anchors:
            expected.append(served.draft([DraftRequest(seq_id=0, context=seq[:a], block_size=block, params=greedy)])[0].tokens)
            served.release(0)
    assert packed.tolist() == expected


@pytest.mark.parametrize("lead", [0, 1])
def test_a_group_sees_the_trunk_before_it_and_its_lead_sees_no_mask(lead):
    """The packed training pass's attention (`denoising_batch`): the trunk is causal; a group sees
    the trunk before its first position; its masks see the whole group; a leading known token
    (the DFlash-style drafter's) sees itself but no mask, as in the served pass, where it is a
    committed node that the masks come after."""
    tokens = torch.arange(3, 13).view(1, 10)
    anchors = torch.tensor([[4, 7]])
    batch, targets = denoising_batch(tokens, torch.tensor([10]), anchors, 3, mask_token_id=1, lead=lead)
    mask, width, trunk = batch.mask[0], lead + 3, 10
    assert torch.equal(mask[:trunk, :trunk], torch.ones(trunk, trunk, dtype=torch.bool).tril())
    assert targets[0].tolist() == [[7, 8, 9], [10, 11, 12]]
    for g, anchor in enumerate(anchors[0].tolist()):
        rows = slice(trunk + g * width, trunk + (g + 1) * width)
        assert torch.equal(mask[rows, :trunk], (torch.arange(trunk) < anchor - lead).expand(width, trunk))
        own = mask[rows, rows]
        assert bool(own[lead:].all())  # masks: the whole group, lead included
        assert torch.equal(own[:lead], torch.ones(lead, width, dtype=torch.bool).tril()[:, :width])
        others = [c for c in range(trunk, trunk + 2 * width) if not rows.start <= c < rows.stop]
        assert not bool(mask[rows][:, others].any())
    assert batch.input_ids[0, trunk:].tolist() == ([6, 1, 1, 1, 9, 1, 1, 1] if lead else [1] * 6)


@pytest.mark.parametrize("block", [4, 8])
def test_packed_dflash_blocks_are_the_blocks_the_dflash_drafter_serves(target, block):
    """The DFlash-style drafter, packed (`drafted_blocks` with the target) against served
    (`DFlashDrafter.draft` after `observe` handed it the target's states of the context but its
    last token, as the engine does): the whole block from the group led by the known last token."""
    drafter = shared_drafter(target, list(range(DRAFT_VOCAB)), reads_target=True, layers_from=(0, 1))
    sequences = [p + p + p for p in prompts(5)]
    generator = torch.Generator().manual_seed(4)
    anchors = [sorted(torch.randint(1, len(s) - block + 1, (3,), generator=generator).tolist()) for s in sequences]
    packed = drafted_blocks(drafter, sequences, anchors, block, rows=2, target=target)
    served = DFlashDrafter(drafter, max_num_seqs=1)
    greedy = SamplingParams(max_tokens=block, temperature=0.0)
    expected = []
    with torch.no_grad():
        for seq, seq_anchors in zip(sequences, anchors):
            for a in seq_anchors:
                context = seq[:a]
                states = target.hidden_states(ForwardBatch.dense(torch.tensor([context])))[0]
                served.observe(0, context[:-1], states[:-1])
                request = DraftRequest(seq_id=0, context=context, block_size=block, params=greedy)
                expected.append(served.draft([request])[0].tokens)
                served.release(0)
    assert packed.tolist() == expected
    with pytest.raises(ValueError, match="pass target"):
        drafted_blocks(drafter, sequences, anchors, block)


def test_block_acceptance_counts_the_matched_prefix_of_each_block(target):
    """Continuations built to match a drafted block for exactly m tokens count m accepted."""
    drafter = shared_drafter(target, list(range(DRAFT_VOCAB)))
    block, contexts = 4, prompts(6)
    drafted = drafted_blocks(drafter, [c + [3] * block for c in contexts], [[len(c)] for c in contexts], block)
    matched = [0, 1, 2, 4, 3, 1]
    sequences = []
    for context, draft, m in zip(contexts, drafted.tolist(), matched):
        tail = draft[:m] + ([(draft[m] + 1) % DRAFT_VOCAB] if m < block else [])
        sequences.append(context + tail + [5] * (block - len(tail)))
    counts, blocks = block_acceptance(drafter, sequences, [[len(c)] for c in contexts], block)
    assert blocks == len(contexts)
    assert counts.tolist() == [sum(m > i for m in matched) for i in range(block)]
