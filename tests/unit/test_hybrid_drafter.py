"""D3D with prompt lookup beside it (`specd.drafters.hybrid`): lossless whatever it chooses, the
choice follows the calibrated expectation, and calibration scores both proposals against what
was committed; a sampled block's confidence depends on q alone (the engine picks how much of a
block to verify from it)."""

from __future__ import annotations

import pytest
import torch
from test_engine import sharpened

from specd.drafters.base import DraftBlock, Drafter, DraftRequest
from specd.drafters.d3d import D3DDrafter
from specd.drafters.hybrid import LookupHybridDrafter
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.sampling import SamplingParams

VOCAB = FLAVOURS["debug"].vocab_size


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(3)
    return sharpened(Qwen3ForCausalLM(FLAVOURS["debug"]))  # greedy text with loops that lookup can copy


@pytest.fixture(scope="module")
def drafter_model():
    torch.manual_seed(4)
    return D3DModel(D3D_FLAVOURS["debug"]).eval()


def repetitive_prompts(num: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(num)
    out = []
    for _ in range(num):
        phrase = torch.randint(7, VOCAB, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator).tolist()
        out.append(phrase * 3 + phrase[:2])
    return out


@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("block_size", [3, 8])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_hybrid_equals_plain_greedy(target, drafter_model, num_seqs, block_size, mode):
    batch = repetitive_prompts(num_seqs)
    params = SamplingParams(max_tokens=32)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    hybrid = LookupHybridDrafter(D3DDrafter(drafter_model, max_num_seqs=num_seqs))
    engine = SpeculativeEngine(target, hybrid, EngineConfig(max_num_seqs=num_seqs, block_size=block_size, mode=mode,
                                                              adaptive_block=False))
    got = [g.token_ids for g in engine.generate(batch, params)]
    engine.close()
    assert got == expected
    assert hybrid.num_chosen["lookup"] > 0, hybrid.num_chosen  # the lookup's blocks were verified
    assert engine.stats.num_accepted_tokens > 0


class _Fixed(Drafter):
    """A model drafter that proposes a fixed block with fixed confidences."""

    name = "fixed"
    max_block = 16

    def __init__(self, tokens: list[int], confidence: list[float]) -> None:
        self.vocab_size = VOCAB
        self.tokens, self.confidence = tokens, confidence
        self.calls = 0

    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        self.calls += 1
        return [DraftBlock(tokens=self.tokens[: r.block_size], confidence=self.confidence[: r.block_size]) for r in requests]


def _request(context: list[int], block_size: int = 3) -> DraftRequest:
    return DraftRequest(seq_id=0, context=context, block_size=block_size, params=SamplingParams())


def test_the_block_expected_to_go_further_is_chosen_and_calibration_learns_from_what_was_committed():
    context = [10, 11, 12, 13, 10, 11]  # lookup: "10 11" was followed by 12 13 10 ...
    model = _Fixed([20, 21, 22], [0.9, 0.8, 0.7])  # expects 2.4 against lookup's 1.5 (one match)
    hybrid = LookupHybridDrafter(model, NgramDrafter(vocab_size=VOCAB))
    assert hybrid.draft([_request(context)])[0].tokens == [20, 21, 22]
    # The target committed what lookup proposed (the model's first token was wrong), three times.
    for _ in range(3):
        context = context + [12, 13, 10, 11]
        block = hybrid.draft([_request(context)])[0]
    model_cal, lookup_cal = hybrid.calibration["model"], hybrid.calibration["lookup"]
    assert model_cal.scale < 0.5 < 1.5 < lookup_cal.scale
    assert block.tokens == [12, 13, 10]  # lookup, now trusted
    assert all(0 < c <= 1 for c in block.confidence)
    assert block.confidence == sorted(block.confidence, reverse=True)
    assert hybrid.num_chosen == {"model": 1, "lookup": 3}
    # Trusted far above the model's recent blocks, lookup spares the model's pass.
    assert model.calls < 4 and hybrid.num_model_skipped == 4 - model.calls


def test_nothing_to_look_up_leaves_the_model_block():
    hybrid = LookupHybridDrafter(_Fixed([5, 6], [0.1, 0.05]), NgramDrafter(vocab_size=VOCAB))
    assert hybrid.draft([_request([1, 2, 3, 4], block_size=2)])[0].tokens == [5, 6]


def test_lookup_after_an_outcome_does_not_index_it():
    lookup = NgramDrafter(vocab_size=VOCAB)
    context = [1, 2, 3, 4, 1, 2]
    block = lookup.draft_after(0, context, [3, 9], block_size=2)
    assert block.tokens == []  # "... 3 9": no earlier 9, and 3 9 never occurred
    block = lookup.draft_after(0, context, [3], block_size=3)
    assert block.tokens == [4, 1, 2]
    # The index holds the context only: a plain draft still continues "1 2" as before.
    assert lookup.draft([_request(context)])[0].tokens == [3, 4, 1]


def test_a_sampled_d3d_blocks_confidence_depends_on_q_alone(drafter_model):
    """The engine chooses how much of a block to verify from its confidence; if that looked at
    the sampled tokens, the verified tokens would no longer be distributed as q."""
    context = [7, 8, 9, 10, 11]
    params = SamplingParams(temperature=1.0)
    blocks = []
    for seed in range(6):
        drafter = D3DDrafter(drafter_model, max_num_seqs=1)
        drafter._seq(0, params).generator.manual_seed(seed)
        blocks.append(drafter.draft([DraftRequest(seq_id=0, context=context, block_size=4, params=params)])[0])
    assert len({tuple(b.tokens) for b in blocks}) > 1  # the draws differ ...
    for block in blocks[1:]:  # ... their confidences do not
        assert block.confidence == pytest.approx(blocks[0].confidence, abs=1e-6)
