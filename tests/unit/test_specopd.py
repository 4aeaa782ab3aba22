"""SpecOPD: one packed proposal tree gives exactly each branch's supervision; steps learn; bad data is skipped."""

from __future__ import annotations

import copy

import pytest
import torch

from specd.batch import ForwardBatch
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.models.qwen3_next import FLAVOURS as NEXT_FLAVOURS
from specd.models.qwen3_next import Qwen3NextForCausalLM
from specd.models.sparse import FLAVOURS as SPARSE_FLAVOURS
from specd.models.sparse import SparseForCausalLM
from specd.train.rollout import (
    OfflineDistillationTrainer,
    SequentialOPDTrainer,
    rollout,
)
from specd.train.specopd import (
    SpecOPDConfig,
    SpecOPDTrainer,
    Trajectory,
    draft_logits,
    sample_branches,
    score_branches,
    stop_mask,
)

VOCAB = FLAVOURS["debug"].vocab_size
TARGET_KINDS = {
    "qwen3": lambda: Qwen3ForCausalLM(FLAVOURS["debug"]),
    "qwen3_next": lambda: Qwen3NextForCausalLM(NEXT_FLAVOURS["debug"]),
    "sparse": lambda: SparseForCausalLM(SPARSE_FLAVOURS["debug"]),
}


def make_target(kind: str):
    torch.manual_seed(2)
    model = TARGET_KINDS[kind]().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # peaked p, so a wrong context shows up in the numbers
    return model


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(4)
    return D3DModel(D3D_FLAVOURS["debug"]).eval()


def trajectories(num: int, seed: int = 0) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        prompt = torch.randint(7, VOCAB, (3 + 2 * i,), generator=generator).tolist()
        response = torch.randint(7, VOCAB, (9 + 3 * i,), generator=generator).tolist()
        out.append(Trajectory(prompt=prompt, response=response))
    return out


@torch.no_grad()
def alone(target, tokens: list[int]) -> torch.Tensor:
    """Target probabilities after every prefix of ``tokens``, from a fresh pass with no cache."""
    return target(ForwardBatch.causal([tokens]))[0].float().softmax(-1)


@pytest.mark.parametrize("kind", sorted(TARGET_KINDS))
def test_packed_proposal_tree_equals_each_branch_alone(kind, drafter):
    target = make_target(kind)
    data = trajectories(2)
    # Anchors at the response start, inside and across GDN chunks (debug chunks are 4 tokens).
    anchors = [[3, 5, 8, 11], [5, 6, 13, 17]]
    prefixes = [t.tokens[: max(row)] for t, row in zip(data, anchors)]
    block, num_branches = 5, 3
    branches, _ = sample_branches(drafter, prefixes, anchors, block, num_branches, torch.Generator().manual_seed(0))
    branches[:, 1, :2] = branches[:, 0, :2]  # siblings sharing a prefix: merged nodes in the tree
    branches[0, 2] = branches[0, 0]  # an exact duplicate branch
    packed = score_branches(target, prefixes, anchors, branches)  # [groups * K, block, vocab]

    worst, row = 0.0, 0
    for b, seq_anchors in enumerate(anchors):
        for g_index, a in enumerate(seq_anchors):
            g = sum(len(r) for r in anchors[:b]) + g_index
            for k in range(num_branches):
                branch = branches[g, k].tolist()
                reference = alone(target, data[b].tokens[:a] + branch[: block - 1])[a - 1 :]  # [block, vocab]
                worst = max(worst, float((packed[row] - reference).abs().max()))
                row += 1
    print(f"{kind}: max |p_packed - p_alone| = {worst:.2e}")
    assert worst < 1e-5


def test_training_pass_gives_the_q_that_drafting_samples_from(drafter):
    data = trajectories(3, seed=1)
    anchors = [[3, 7], [5, 9, 12], [7]]
    prefixes = [t.tokens[: max(row)] for t, row in zip(data, anchors)]
    _, q_sampled = sample_branches(drafter, prefixes, anchors, 6, 1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        q_trained = draft_logits(drafter, prefixes, anchors, 6).float().softmax(-1)
    assert (q_sampled - q_trained).abs().max() < 1e-5


def test_branches_are_sampled_from_q(drafter):
    """One anchor, many branches: empirical token frequencies at a position follow q."""
    data = trajectories(1)
    prefixes, anchors = [data[0].tokens[:6]], [[6]]
    branches, q = sample_branches(drafter, prefixes, anchors, 2, 4000, torch.Generator().manual_seed(1))
    counts = torch.bincount(branches[0, :, 1], minlength=VOCAB).float() / 4000
    assert (counts - q[0, 1]).abs().max() < 0.03


def test_repeated_steps_reduce_the_loss(drafter):
    torch.manual_seed(0)
    target, model = make_target("qwen3"), copy.deepcopy(drafter)
    config = SpecOPDConfig(block_size=4, anchors_per_seq=4, branches_per_anchor=4, lr=3e-3, seed=0)
    trainer = SpecOPDTrainer(target, model, config)
    batch = trajectories(3)
    fixed = trainer.supervise(batch)
    before, accepted_before = trainer.evaluate(fixed)
    losses = [trainer.train_on(fixed).loss for _ in range(8)]
    after, accepted_after = trainer.evaluate(fixed)
    print(f"loss {before:.4f} -> {after:.4f}; expected accepted length {accepted_before:.3f} -> {accepted_after:.3f}")
    assert losses[0] == pytest.approx(before, abs=1e-6)
    assert after < before and accepted_after > accepted_before
    # Full steps (fresh anchors and branches each time) improve the fixed held supervision too.
    for _ in range(5):
        result = trainer.step(batch)
        assert result.num_supervised_tokens == 3 * 4 * 4 * 4 and result.num_branches == 48
    assert trainer.evaluate(fixed)[0] < after


def test_bad_trajectories_are_skipped_counted_and_training_goes_on(drafter, caplog):
    target, model = make_target("qwen3"), copy.deepcopy(drafter)
    config = SpecOPDConfig(block_size=3, anchors_per_seq=2, branches_per_anchor=2, max_context=40)
    trainer = SpecOPDTrainer(target, model, config)
    good = trajectories(2)
    bad = [
        Trajectory(prompt=[9, 10], response=[]),
        Trajectory(prompt=[], response=[9, 10]),
        Trajectory(prompt=[9, 10], response=[11, VOCAB]),
        Trajectory(prompt=[9, -1], response=[11]),
        Trajectory(prompt=[9] * 30, response=[11] * 20),
        Trajectory(prompt=[9] * 39, response=[11]),
        Trajectory(prompt=[9, 10], response=[11, 2.5]),
    ]
    result = trainer.step([bad[0], good[0], *bad[1:], good[1]])
    assert result.skipped == {
        "empty_response": 1, "empty_prompt": 1, "out_of_vocabulary": 2, "too_long": 1,
        "no_anchor_in_context": 1, "not_token_ids": 1,
    }
    assert result.num_supervised_tokens == 2 * 2 * 2 * 3
    assert "out_of_vocabulary" in caplog.text
    # A batch with nothing usable changes nothing and does not raise.
    weights = [p.detach().clone() for p in model.parameters()]
    result = trainer.step(bad)
    assert result.num_supervised_tokens == 0 and result.loss != result.loss  # nan
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert trainer.skipped["out_of_vocabulary"] == 4 and trainer.num_steps == 1


def test_stop_token_ends_a_branch_supervision():
    tokens = torch.tensor([[5, 1, 6, 7], [5, 6, 7, 8], [1, 1, 2, 3]])
    assert stop_mask(tokens, (1,)).tolist() == [
        [True, True, False, False], [True, True, True, True], [True, False, False, False],
    ]


def test_sequential_rollout_records_the_target_p_of_each_drafted_block(drafter):
    target = make_target("qwen3")
    data = trajectories(2)
    sequences, records = rollout(target, copy.deepcopy(drafter), [t.prompt for t in data], [10, 12], 4, seed=0)
    assert records and all(len(tokens) == 4 for _, _, tokens, _ in records)
    for seq_id, anchor, tokens, probs in records[:6]:
        reference = alone(target, sequences[seq_id][:anchor] + tokens[:3])[anchor - 1 :]
        assert (probs - reference).abs().max() < 1e-5
    result = SequentialOPDTrainer(target, copy.deepcopy(drafter), SpecOPDConfig(block_size=4)).step(data)
    assert result.num_supervised_tokens > 0 and result.loss == result.loss


def test_offline_distillation_supervises_the_reference_blocks(drafter):
    target = make_target("qwen3")
    data = trajectories(2)
    trainer = OfflineDistillationTrainer(target, copy.deepcopy(drafter), SpecOPDConfig(block_size=4, loss="kl"))
    supervision = trainer.supervise(data)
    for g, (tokens, probs, valid) in enumerate(zip(supervision.tokens, supervision.target_probs, supervision.valid)):
        b = 0 if g < len(supervision.anchors[0]) else 1
        a = supervision.anchors[b][g if b == 0 else g - len(supervision.anchors[0])]
        reference_tokens = data[b].tokens[a : a + 4]
        assert tokens[: len(reference_tokens)].tolist() == reference_tokens
        assert valid.sum() == len(reference_tokens)
        reference = alone(target, data[b].tokens)[a - 1 : a - 1 + len(reference_tokens)]
        assert (probs[: len(reference_tokens)] - reference).abs().max() < 1e-5
    assert trainer.step(data).num_supervised_tokens > 0
