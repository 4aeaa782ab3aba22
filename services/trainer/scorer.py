"""`RemoteScorer`: the SpecOPD target pass on the verifiers (``Verifier.Score``), so the trainer
needs no target of its own.

Calls go round-robin over the verifier addresses; a verifier that answers UNAVAILABLE (down,
draining, not reachable) is skipped for the next one, and only when every one of them is
unavailable does the call fail (`ScorerUnavailable`). One `score` call is split into several
requests when the answer would exceed ``max_response_bytes`` (full distributions are
``rows x vocab`` float32); a single sequence is never split.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import grpc
import torch
from torch import Tensor

from services.common.config import ServiceConfig
from services.common.server import MAX_MESSAGE_BYTES, open_channel
from services.common.wire import tensor_from_proto, tree_to_proto
from specd._proto.v1 import verifier_pb2, verifier_pb2_grpc
from specd.tree import TokenTree

logger = logging.getLogger(__name__)


class ScoreError(RuntimeError):
    """A verifier refused a Score request; ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ScorerUnavailable(ScoreError):
    """No verifier could be reached (all answered UNAVAILABLE): retry later."""


class RemoteScorer:
    """`specd.train.specopd.TreeScorer` over ``Verifier.Score`` at ``addresses``.

    ``top_k = 0`` asks for full fp32 distributions: the supervision is exactly the local one.
    ``top_k > 0`` asks for the k most likely ids per row and the log of the remaining mass, and
    rebuilds a distribution from them: the top-k probabilities as sent, and the rest mass spread
    uniformly over the other ``vocab - k`` ids. α = Σ min(p, q) (and so the TV and the E2E-TV
    loss) against it is exact on the top-k ids; elsewhere the flattened p makes it a bound, off by
    at most the rest mass per row, so pick k to leave little mass outside.

    ``vocab_size`` is the target's vocabulary (the drafter's, which must equal it) and
    ``stop_token_ids`` the target's stop tokens: a remote target does not say them.
    """

    def __init__(self, addresses: Sequence[str], config: ServiceConfig, top_k: int = 0, *, vocab_size: int,
                 stop_token_ids: Sequence[int] = (), max_response_bytes: int = MAX_MESSAGE_BYTES // 2) -> None:
        if not addresses:
            raise ValueError("RemoteScorer needs at least one verifier address (host:port)")
        if not 0 <= top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}], got {top_k}")
        self.addresses = list(addresses)
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_response_bytes = max_response_bytes
        self._channels = [open_channel(address, config) for address in self.addresses]
        self._stubs = [verifier_pb2_grpc.VerifierStub(channel) for channel in self._channels]
        self._turn = itertools.cycle(range(len(self._stubs)))

    def score(self, contexts: list[list[int]], trees: list[TokenTree], context_rows: list[list[int]]) -> list[Tensor]:
        sequences = [
            verifier_pb2.ScoreSequence(context=context, tree=tree_to_proto(tree), context_rows=rows)
            for context, tree, rows in zip(contexts, trees, context_rows)
        ]
        row_bytes = 4 * self.vocab_size if self.top_k == 0 else 8 * self.top_k + 4
        out: list[Tensor] = []
        for part in self._split(sequences, row_bytes):
            response = self._call(verifier_pb2.ScoreRequest(sequences=part, top_k=self.top_k))
            if len(response.results) != len(part):
                raise ScoreError(grpc.StatusCode.INTERNAL,
                                 f"a verifier answered {len(response.results)} results for {len(part)} sequences")
            out.extend(self._probs(result) for result in response.results)
        return out

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    # ------------------------------------------------------------------ internals
    def _split(self, sequences: list[verifier_pb2.ScoreSequence], row_bytes: int
               ) -> list[list[verifier_pb2.ScoreSequence]]:
        """Consecutive runs of sequences whose answers fit ``max_response_bytes`` (at least one each)."""
        parts: list[list[verifier_pb2.ScoreSequence]] = [[]]
        size = 0
        for sequence in sequences:
            need = (len(sequence.context_rows) + len(sequence.tree.tokens)) * row_bytes
            if parts[-1] and size + need > self.max_response_bytes:
                parts.append([])
                size = 0
            parts[-1].append(sequence)
            size += need
        return parts

    def _call(self, request: verifier_pb2.ScoreRequest) -> verifier_pb2.ScoreResponse:
        """One Score call, failing over to the next verifier on UNAVAILABLE."""
        failures = []
        for _ in range(len(self._stubs)):
            index = next(self._turn)
            try:
                return self._stubs[index].Score(request)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise ScoreError(error.code(), f"verifier {self.addresses[index]} refused Score: "
                                                   f"{error.code().name}: {error.details()}") from error
                logger.warning("verifier %s unavailable for Score (%s); trying the next", self.addresses[index], error.details())
                failures.append(f"{self.addresses[index]}: {error.details()}")
        raise ScorerUnavailable(grpc.StatusCode.UNAVAILABLE,
                                "no verifier answered Score (check they are up and reachable): " + "; ".join(failures))

    def _probs(self, result: verifier_pb2.ScoreResult) -> Tensor:
        """``[rows, vocab]`` fp32 from one result (see the class docstring for top-k)."""
        if self.top_k == 0:
            probs = tensor_from_proto(result.probs).float()
            if probs.dim() != 2 or probs.shape[1] != self.vocab_size:
                raise ScoreError(grpc.StatusCode.INTERNAL, f"a verifier sent probabilities of shape {tuple(probs.shape)}, "
                                                           f"expected [rows, {self.vocab_size}]: is it serving another target?")
            return probs
        ids = tensor_from_proto(result.top_ids).long()  # [rows, k]
        top = tensor_from_proto(result.top_logprobs).float().exp()  # [rows, k]
        rest = tensor_from_proto(result.rest_logprob).float().exp()  # [rows]
        others = self.vocab_size - self.top_k
        fill = rest / others if others else torch.zeros_like(rest)
        probs = fill[:, None].expand(-1, self.vocab_size).clone()
        return probs.scatter_(-1, ids, top)

