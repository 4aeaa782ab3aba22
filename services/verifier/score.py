"""``Verifier.Score``: tree supervision for the SpecOPD trainer, computed where the target lives.

A request carries proposal trees (one per sequence: the reference context, the tree hanging off
it, and the context rows whose next-token distribution is wanted too). The handler checks the
request against the target, runs `specd.train.specopd.LocalScorer` (prefill, then one packed tree
pass) and answers with, per sequence, the rows' full fp32 probabilities (``top_k = 0``) or their
top-k log-probs and the log of the mass outside them (``top_k > 0``: ``k`` ids + ``k`` log-probs
+ 1 float per row instead of ``vocab`` floats).

The target is shared with generation, whose engine holds the same lock (`ServingEngine.target_lock`)
around every step. A Score call therefore never holds it for the whole request: the sequences
are scored in *chunks*, runs of consecutive sequences whose padded pass (sequences x (longest
context + most tree nodes)) fits ``max_chunk_tokens``, a larger sequence alone; the lock is taken
for one chunk and released before the next; the lock is FIFO (`specd.threads.FairLock`), so an
engine step that waited goes before the next chunk, and a chunk that waited goes before the
engine's next step. So an engine step waits for
at most one chunk: ``max_chunk_tokens``, or one sequence of at most ``max_model_len`` context
tokens and its tree, about what the engine's own prefill of a full-length prompt costs. On an
accelerator the chunk's kernels are waited for before the lock is released, or its queued work
would still be ahead of the next step's. Chunks change only how sequences are padded together;
each sequence's numbers are what one pass over the whole request gives, up to fp32 rounding
(`tests/unit/test_score_service.py` compares them).

With ``ScoreRequest.channel`` (full distributions only), the probabilities go over a tensor
channel instead (`services.common.tensor_channel`): the answer holds each result's shape and dtype
(``on_channel``), and the channel's thread sends the tensors right after the answer is made. A
channel this verifier cannot use (cannot reach the trainer's store, joined before by another
process, NCCL on a CPU target, broken) is declined: that call is answered with the data as usual
and ``channel_error`` says why. Malformed channel parameters are INVALID_ARGUMENT.

Bad input never reaches the model: ids outside the vocabulary, a malformed tree, an anchor
beyond its context or a context row outside it are INVALID_ARGUMENT, and so is a sequence that
does not fit the model's context (its context, or a tree node's position anchor + depth, at or
past ``max_model_len``), as generation refuses a prompt that does not fit (gRPC
INVALID_ARGUMENT, HTTP 400 ``context_length_exceeded``): it is wrong for this model whatever the
load, and splitting the request would not help. A request above the handler's size limits is
RESOURCE_EXHAUSTED, with the limit in the message so the caller can split it or ask for top-k:
tree nodes, the per-call budget of tokens run through the target (context tokens + tree nodes,
summed over the sequences), answer bytes.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import grpc
import torch
from torch import Tensor, nn

from services.common.server import MAX_MESSAGE_BYTES, abort
from services.common.tensor_channel import ChannelError, VerifierChannels, check_channel
from services.common.wire import tensor_to_proto, tree_from_proto
from specd._proto.v1 import common_pb2, verifier_pb2
from specd.threads import FairLock, release_pool
from specd.train.specopd import LocalScorer
from specd.tree import TokenTree

logger = logging.getLogger(__name__)

@dataclass(kw_only=True, slots=True)
class _Sequence:
    context: list[int]
    tree: TokenTree
    rows: list[int]


class ScoreHandler:
    """The Score method's body; the verifier servicer calls it with its request and context.

    ``lock`` is the one the serving engine holds around each step (``engine.target_lock``);
    ``max_model_len`` the longest sequence the model takes (the engine's ``max_model_len``;
    None = the model's ``max_position_embeddings``). ``max_nodes`` bounds one request's tree
    nodes and ``max_call_tokens`` the tokens it runs through the target (context tokens + tree
    nodes, summed over its sequences); ``max_chunk_tokens`` bounds the padded tokens of the pass
    made per lock hold (module docstring). ``max_response_bytes`` bounds the answer (at most the
    gRPC message limit the services are configured with, because a declined channel is answered
    over gRPC). ``max_channels`` bounds the tensor channels kept joined; `close` leaves them all.
    """

    def __init__(self, target: nn.Module, lock: FairLock | threading.Lock, *, max_model_len: int | None = None,
                 max_nodes: int = 32768, max_call_tokens: int = 262144, max_chunk_tokens: int = 4096,
                 max_response_bytes: int = MAX_MESSAGE_BYTES - (1 << 20), max_channels: int = 64) -> None:
        if max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        self.target = target
        self.lock = lock
        self.vocab_size: int = target.config.vocab_size
        self.max_model_len: int = max_model_len or target.config.max_position_embeddings
        self.max_nodes = max_nodes
        self.max_call_tokens = max_call_tokens
        self.max_chunk_tokens = max_chunk_tokens
        self.max_response_bytes = max_response_bytes
        self.device = next(target.parameters()).device
        self.channels = VerifierChannels(self.device, max_channels)

    def __call__(self, request: verifier_pb2.ScoreRequest, context: grpc.ServicerContext) -> verifier_pb2.ScoreResponse:
        temperature = self._temperature(request, context)
        sequences = self._parse(request, context)
        if not request.HasField("channel"):
            return self._answer(sequences, temperature, request.top_k)
        sequence = request.channel.sequence
        try:
            channel = self.channels.join(request.channel)
        except ChannelError as error:
            return self._decline(sequences, temperature, error)
        with channel.lock:  # one call at a time per channel: its sends are queued in call order
            try:
                channel.begin(sequence)
            except ChannelError as error:
                self.channels.drop(channel)
                return self._decline(sequences, temperature, error)
            probs = self._score(sequences, temperature)  # each [rows, vocab] fp32, on the target's device
            results = [verifier_pb2.ScoreResult(probs=common_pb2.Tensor(shape=list(p.shape), dtype=_dtype_name(p)),
                                                on_channel=True) for p in probs]
            response = verifier_pb2.ScoreResponse(results=results, channel_sequence=sequence)
            channel.send(probs, sequence)
        return response

    def close(self) -> None:
        """Leave every tensor channel (a verifier shutting down)."""
        self.channels.close()

    # ------------------------------------------------------------------ scoring
    def _score(self, sequences: list[_Sequence], temperature: float) -> list[Tensor]:
        """Each sequence's probabilities [rows, vocab] fp32, one chunk per hold of the target lock."""
        probs: list[Tensor] = []
        for chunk in self._chunks(sequences):
            with self.lock:  # FIFO: an engine step waiting for the target goes before this chunk
                probs.extend(LocalScorer(self.target, temperature).score(
                    [s.context for s in chunk], [s.tree for s in chunk], [s.rows for s in chunk]
                ))
                if self.device.type != "cpu":
                    # Kernels still queued when the lock is released would run ahead of the next
                    # engine step all the same: the hold is only bounded if the chunk has finished.
                    torch.accelerator.synchronize(self.device)
            # This request thread computed: free its OpenMP pool, or the engine's thread would
            # share the CPUs with a second pool and its workers stop spinning (`specd.threads`).
            release_pool()
        return probs

    def _chunks(self, sequences: list[_Sequence]) -> list[list[_Sequence]]:
        """Consecutive runs of sequences whose padded pass fits ``max_chunk_tokens`` (at least one each).

        `LocalScorer` pads a chunk's contexts to the longest and its trees to the largest, so a
        chunk costs ``len(chunk) * (longest context + most nodes)`` tokens.
        """
        chunks: list[list[_Sequence]] = []
        longest = most_nodes = 0
        for sequence in sequences:
            context, nodes = max(longest, len(sequence.context)), max(most_nodes, sequence.tree.num_nodes)
            if chunks and (len(chunks[-1]) + 1) * (context + nodes) <= self.max_chunk_tokens:
                chunks[-1].append(sequence)
                longest, most_nodes = context, nodes
            else:
                chunks.append([sequence])
                longest, most_nodes = len(sequence.context), sequence.tree.num_nodes
        return chunks

    def _answer(self, sequences: list[_Sequence], temperature: float, top_k: int,
                channel_error: str = "") -> verifier_pb2.ScoreResponse:
        results = [self._result(p.cpu(), top_k) for p in self._score(sequences, temperature)]
        return verifier_pb2.ScoreResponse(results=results, channel_error=channel_error)

    def _decline(self, sequences: list[_Sequence], temperature: float, error: ChannelError) -> verifier_pb2.ScoreResponse:
        """Full distributions over gRPC, saying why the requested channel was not used."""
        logger.warning("Score over gRPC instead of the requested tensor channel: %s", error)
        return self._answer(sequences, temperature, 0, channel_error=str(error))

    # ------------------------------------------------------------------ checks
    def _temperature(self, request: verifier_pb2.ScoreRequest, context: grpc.ServicerContext) -> float:
        if not request.HasField("temperature"):
            return 1.0
        if not (math.isfinite(request.temperature) and request.temperature > 0.0):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"temperature must be a finite number > 0 (absent = 1.0), got {request.temperature}")
        return request.temperature

    def _parse(self, request: verifier_pb2.ScoreRequest, context: grpc.ServicerContext) -> list[_Sequence]:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if not request.sequences:
            abort(context, invalid, "ScoreRequest has no sequences: send one ScoreSequence per proposal tree")
        if request.top_k > self.vocab_size:
            abort(context, invalid, f"top_k {request.top_k} exceeds the vocabulary ({self.vocab_size}); use 0 for full distributions")
        if request.HasField("channel"):
            problem = check_channel(request.channel)
            if problem:
                abort(context, invalid, f"{problem}; or send the request without a channel")
            if request.top_k:
                abort(context, invalid, "a tensor channel carries full distributions only: send top_k = 0 with a "
                                        "channel, or no channel for top-k")
        num_nodes = sum(len(s.tree.tokens) for s in request.sequences)
        num_tokens = num_nodes + sum(len(s.context) for s in request.sequences)
        num_rows = num_nodes + sum(len(s.context_rows) for s in request.sequences)
        row_bytes = 4 * self.vocab_size if request.top_k == 0 else 8 * request.top_k + 4
        exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        if num_nodes > self.max_nodes:
            abort(context, exhausted, f"{num_nodes} tree nodes in one request, above the limit of {self.max_nodes}: "
                                      "split the sequences over several requests")
        if num_tokens > self.max_call_tokens:
            abort(context, exhausted, f"{num_tokens} tokens (context tokens + tree nodes) in one request, above the "
                                      f"per-call budget of {self.max_call_tokens} tokens: split the sequences over "
                                      "several requests")
        if num_rows * row_bytes > self.max_response_bytes:
            abort(context, exhausted, f"the answer would take {num_rows * row_bytes} bytes ({num_rows} rows), above "
                                      f"{self.max_response_bytes}: ask for top_k > 0 or send fewer sequences per request")
        parsed = []
        for b, sequence in enumerate(request.sequences):
            where = f"sequence {b}"
            ids = list(sequence.context)
            if not ids:
                abort(context, invalid, f"{where}: empty context; a proposal tree hangs off at least one token")
            try:
                tree = tree_from_proto(sequence.tree)
            except ValueError as error:
                abort(context, invalid, f"{where}: malformed tree: {error}")
            for name, values in (("context", ids), ("tree token", sequence.tree.tokens)):
                bad = next((t for t in values if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    abort(context, invalid, f"{where}: {name} id {bad} is outside the vocabulary [0, {self.vocab_size})")
            if tree.num_nodes and int(tree.anchors.max()) > len(ids):
                abort(context, invalid, f"{where}: tree anchor {int(tree.anchors.max())} is beyond its context "
                                        f"of {len(ids)} tokens (anchors index into the context)")
            self._check_fits(len(ids), sequence.tree, where, context)
            rows = list(sequence.context_rows)
            bad = next((r for r in rows if not 0 <= r < len(ids)), None)
            if bad is not None:
                abort(context, invalid, f"{where}: context row {bad} is outside its context [0, {len(ids)})")
            parsed.append(_Sequence(context=ids, tree=tree, rows=rows))
        return parsed

    def _check_fits(self, context_len: int, tree: common_pb2.TokenTree, where: str,
                    context: grpc.ServicerContext) -> None:
        """INVALID_ARGUMENT unless the context and every tree node's position fit ``max_model_len``.

        A node's position is its anchor + its depth (`TokenTree.positions`); computed here from the
        parent list in one sweep (parents come first), not with the tree's [nodes, nodes] mask.
        """
        limit = self.max_model_len
        if context_len > limit:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"{where}: the context has {context_len} tokens, but this model's context is {limit} tokens: "
                  "shorten the context (context_length_exceeded)")
        depths: list[int] = []
        for parent in tree.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        last = max((a + d for a, d in zip(tree.anchors, depths)), default=-1)
        if last >= limit:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"{where}: a tree node sits at position {last} (anchor + depth), but this model's context is "
                  f"{limit} tokens (positions 0 to {limit - 1}): anchor the branches earlier or shorten them "
                  "(context_length_exceeded)")

    # ------------------------------------------------------------------ answers
    @staticmethod
    def _result(probs: Tensor, top_k: int) -> verifier_pb2.ScoreResult:
        """``probs`` [rows, vocab] fp32 -> full probabilities, or top-k log-probs + rest log-mass."""
        if top_k == 0:
            return verifier_pb2.ScoreResult(probs=tensor_to_proto(probs))
        top, ids = probs.topk(top_k, dim=-1)  # [rows, k]
        # The rest mass summed from the other entries (not 1 - Σ top: that cancels catastrophically).
        rest = probs.scatter(-1, ids, 0.0).sum(-1)  # [rows]
        return verifier_pb2.ScoreResult(
            top_ids=tensor_to_proto(ids.to(torch.int32)),
            top_logprobs=tensor_to_proto(top.log()),
            rest_logprob=tensor_to_proto(rest.log()),
        )


def _dtype_name(t: Tensor) -> str:
    """The torch dtype name the wire uses (`services.common.wire`): "float32", ..."""
    return str(t.dtype).removeprefix("torch.")
