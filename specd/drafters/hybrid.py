"""A model drafter with prompt lookup beside it: per sequence and step, whichever block is
expected to be accepted further.

Prompt lookup (`NgramDrafter`) costs nothing and is right when the output repeats the context
(code edits, quoted text, tool arguments); a trained drafter (D3D) is right more often but less
far, and costs a pass. Verifying the better of the two each step is what a user running both
would hand-tune; here it is decided per sequence, per step, from the two drafters' confidences,
each calibrated against what the target went on to commit:

- every block a source proposes is remembered with the context length it continues;
- at the sequence's next call, the new context says how far each proposal matched what was
  committed (for the verified block that is its accepted length; for the other one a
  counterfactual, cut at the committed length — exact at temperature 0, where the target's
  tokens do not depend on the draft);
- a source's scale is matched / predicted over recent blocks (both cut at the same length), and
  the block with the larger scaled expected accepted length ``scale * sum_i confidence_i`` wins,
  returned with its scaled confidences so the engine's cost model sees one calibrated estimate;
- lookup runs first (it costs nothing), and the model's pass is skipped for a sequence whose
  lookup block is expected to reach well past the model's recent blocks (``SKIP_MARGIN``).

Choosing between two proposals is lossless as any drafting is: the target verifies whatever is
proposed, and a lookup block is deterministic (q one-hot), which the rejection sampler handles.

In async mode the model drafter's candidates (`speculate`) are kept, and each outcome's lookup
proposal (`NgramDrafter.draft_after`, the outcome's tokens looked up without indexing them)
replaces it where it is expected to go further.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from specd.drafters.base import DraftBlock, Drafter, DraftRequest, Outcome, SpeculateRequest
from specd.drafters.ngram import NgramDrafter

SOURCES = ("model", "lookup")
SKIP_MARGIN = 1.5
"""The model is not asked for a block when lookup's expected accepted length exceeds this many
times what the model's recent blocks were expected to reach."""


@dataclass(kw_only=True, slots=True)
class _Calibration:
    """Matched over predicted accepted tokens of one source, exponentially weighted."""

    decay: float = 0.95
    matched: float = 1.0  # a prior of one block at scale 1
    predicted: float = 1.0

    def add(self, predicted: float, matched: int) -> None:
        self.matched = self.decay * self.matched + matched
        self.predicted = self.decay * self.predicted + predicted

    @property
    def scale(self) -> float:
        return self.matched / max(self.predicted, 1e-6)


@dataclass(kw_only=True, slots=True)
class _Proposals:
    """The blocks each source last proposed for a sequence, and the context length they continue."""

    start: int = -1
    blocks: dict[str, DraftBlock] = field(default_factory=dict)


class LookupHybridDrafter(Drafter):
    """``model`` (any drafter) and prompt lookup, the better block per sequence and step (see the
    module docstring). Speculates when ``model`` does; reads target states when it does."""

    def __init__(self, model: Drafter, lookup: NgramDrafter | None = None) -> None:
        self.model = model
        self.lookup = lookup or NgramDrafter(vocab_size=model.vocab_size, max_block=model.max_block)
        if self.lookup.vocab_size != model.vocab_size:
            raise ValueError(f"the lookup drafter's vocabulary ({self.lookup.vocab_size}) differs from "
                             f"the model drafter's ({model.vocab_size})")
        self.name = f"{model.name}+lookup"
        self.vocab_size = model.vocab_size
        self.max_block = min(model.max_block, self.lookup.max_block)
        self.can_speculate = model.can_speculate
        self.needs_target_hidden = model.needs_target_hidden
        self.calibration = {source: _Calibration() for source in SOURCES}
        self.num_chosen = {source: 0 for source in SOURCES}
        self.num_model_skipped = 0
        self._model_expected = 1.0  # calibrated accepted length of the model's recent blocks (EMA)
        self._proposals: dict[int, _Proposals] = {}

    # ---------------------------------------------------------------- the Drafter protocol
    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        for request in requests:
            self._learn(request.seq_id, request.context)
        looked = self.lookup.draft(requests)
        # The model's pass is the cost: skip it for a sequence whose lookup block is expected to
        # go well past what the model's blocks have lately been expected to.
        ask = [i for i, block in enumerate(looked)
               if not (block.tokens and self._score("lookup", block) > SKIP_MARGIN * self._model_expected)]
        self.num_model_skipped += len(requests) - len(ask)
        modelled = [DraftBlock.empty()] * len(requests)
        if ask:
            for i, block in zip(ask, self.model.draft([requests[i] for i in ask])):
                modelled[i] = block
                self._model_expected = 0.9 * self._model_expected + 0.1 * self._score("model", block)
        return [self._choose(r.seq_id, len(r.context), m, l) for r, m, l in zip(requests, modelled, looked)]

    def speculate(self, requests: list[SpeculateRequest]) -> list[dict[Outcome, DraftBlock]]:
        candidates = self.model.speculate(requests)
        out = []
        for request, mine in zip(requests, candidates):
            chosen = {}
            for (k, c), block in mine.items():
                suffix = request.block[:k] + [c]
                looked = self.lookup.draft_after(request.seq_id, request.context, suffix, request.block_size)
                chosen[(k, c)] = self._better(block, looked)[1]
            out.append(chosen)
        return out

    def observe(self, seq_id: int, tokens: list[int], hidden: Tensor) -> None:
        self.model.observe(seq_id, tokens, hidden)

    def release(self, seq_id: int) -> None:
        self._proposals.pop(seq_id, None)
        self.lookup.release(seq_id)
        self.model.release(seq_id)

    # ---------------------------------------------------------------- choosing
    def _score(self, source: str, block: DraftBlock) -> float:
        return self.calibration[source].scale * sum(block.confidence)

    def _better(self, modelled: DraftBlock, looked: DraftBlock) -> tuple[str, DraftBlock]:
        """The source whose block is expected to be accepted further, and that block with its
        confidences scaled by the source's calibration (capped at 1, kept non-increasing)."""
        source = "lookup" if looked.tokens and self._score("lookup", looked) > self._score("model", modelled) else "model"
        block = looked if source == "lookup" else modelled
        scale = self.calibration[source].scale
        confidence = [min(1.0, scale * c) for c in block.confidence]
        for i in range(1, len(confidence)):
            confidence[i] = min(confidence[i], confidence[i - 1])
        return source, DraftBlock(tokens=block.tokens, probs=block.probs, confidence=confidence)

    def _choose(self, seq_id: int, start: int, modelled: DraftBlock, looked: DraftBlock) -> DraftBlock:
        source, block = self._better(modelled, looked)
        self.num_chosen[source] += 1
        self._proposals[seq_id] = _Proposals(start=start, blocks={"model": modelled, "lookup": looked})
        return block

    def _learn(self, seq_id: int, context: list[int]) -> None:
        """Score the sequence's last proposals against what was committed after them."""
        last = self._proposals.pop(seq_id, None)
        if last is None or last.start < 0 or len(context) <= last.start:
            return
        # Every committed token is the target's choice at its position (accepted, correction or
        # bonus), so both proposals are judged against them, up to the shorter of the two.
        committed = context[last.start :]
        horizon = min([len(committed), *(len(b.tokens) for b in last.blocks.values() if b.tokens)])
        if horizon < 1:
            return
        for source, block in last.blocks.items():
            if not block.tokens:
                continue
            matched = 0
            while matched < horizon and block.tokens[matched] == committed[matched]:
                matched += 1
            self.calibration[source].add(sum(block.confidence[:horizon]), matched)
