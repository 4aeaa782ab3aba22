"""The DFlash-style baseline: a block drafter that reads the target's hidden states.

Same architecture and training data as D3D (`specd.models.d3d` with ``target_hidden_size``),
but each committed token's embedding is enriched with the target's final hidden state at that
position. Those states exist only once the target has verified the token, so this drafter
*cannot* draft during verification: it drafts after, on the critical path (sync mode only).

Per sequence its cache holds the committed context except the last token ``c`` (the newest
correction/bonus token, which the target has not run on yet). A draft pass feeds the tokens
observed since (with their states), then ``c`` as a plain known token, then a mask group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specd.drafters.base import DraftBlock, DraftRequest, check_block_size
from specd.drafters.d3d import D3DDrafter
from specd.models.d3d import MaskGroup


class DFlashDrafter(D3DDrafter):
    name = "dflash"
    can_speculate = False  # it needs target states of the tokens being verified
    needs_target_hidden = True
    ar_first = False  # its first mask already sees the newest token c (DFlash's design)

    def __init__(self, model, **kwargs) -> None:
        if not model.config.target_hidden_size:
            raise ValueError("a DFlash-style drafter needs a model with target_hidden_size > 0")
        super().__init__(model, **kwargs)
        self._observed: dict[int, tuple[list[int], list[Tensor]]] = {}

    def observe(self, seq_id: int, tokens: list[int], hidden: Tensor) -> None:
        """Target hidden states ``[len(tokens), hidden]`` of tokens the target just committed."""
        observed = self._observed.setdefault(seq_id, ([], []))
        observed[0].extend(tokens)
        observed[1].append(hidden.detach().float().cpu())

    def release(self, seq_id: int) -> None:
        self._observed.pop(seq_id, None)
        super().release(seq_id)

    @torch.no_grad()
    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        for request in requests:
            check_block_size(request.block_size, self.max_block)
        known, hidden, groups, plans = {}, {}, [], []
        for request in requests:
            seq = self._seq(request.seq_id, request.params)
            tokens, states = self._observed.get(request.seq_id, ([], []))
            context = list(request.context)
            # Drafting needs states for everything before the last token.
            if seq.tokens + tokens != context[:-1]:
                plans.append(None)
                continue
            nodes = [(i - 1, t) for i, t in enumerate(tokens)] + [(len(tokens) - 1, context[-1])]
            known[seq.row] = nodes
            hidden[seq.row] = torch.cat(states) if states else torch.zeros(0, self.model.config.target_hidden_size)
            groups.append(MaskGroup(seq=seq.row, node=len(nodes) - 1, size=self.model.config.group_size_for(request.block_size)))
            plans.append((seq, tokens, len(groups) - 1))
        if not groups:
            return [DraftBlock.empty() for _ in requests]
        draft_pass, logits = self._run(known, groups, hidden)
        paths = [None] * self.max_num_seqs
        for plan in plans:
            if plan is not None:
                seq, tokens, _ = plan
                paths[seq.row] = list(range(len(tokens)))  # commit what has states, not c
        self.cache.commit(draft_pass.batch, paths[: draft_pass.batch.num_seqs])
        blocks = []
        for request, plan in zip(requests, plans):
            if plan is None:
                blocks.append(DraftBlock.empty())
                continue
            seq, tokens, g = plan
            seq.tokens = seq.tokens + tokens
            self._observed[request.seq_id] = ([], [])
            seq.returned = []
            blocks.append(self._block(seq, logits[g, : request.block_size + 1], request.block_size, request.params,
                                      start=len(request.context)))  # a seeded request drafts keyed
        return blocks
