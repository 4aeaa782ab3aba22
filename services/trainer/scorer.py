"""`RemoteScorer`: the SpecOPD target pass on the verifiers (``Verifier.Score``), so the trainer
needs no target of its own.

Calls go round-robin over the verifier addresses; a verifier that answers UNAVAILABLE (down,
draining, not reachable) is skipped for the next one, and only when every one of them is
unavailable does the call fail (`ScorerUnavailable`). One `score` call is split into several
requests when the answer would exceed ``max_response_bytes`` (full distributions are
``rows x vocab`` float32); a single sequence is never split.

With ``transport="tensor"`` the probabilities come over a tensor channel per verifier instead
(`services.common.tensor_channel`: a 2-rank torch.distributed group, gloo on CPU, NCCL when
``device`` is CUDA), opened on the first call to that verifier and reused for every later one; the
gRPC answer carries only the shapes. A channel that cannot be set up, is declined or breaks is
dropped and logged, and that call is answered over plain gRPC (full distributions) instead: the
tensor transport never fails a step. The next call to that verifier opens a new channel, at once
after one failure and after a growing pause (1 s, 3 s, 7 s, ... at most a minute) after several
in a row, so a verifier that cannot take part costs little. Answers are still split to fit
``max_response_bytes``: a declined channel is answered over gRPC.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch
from torch import Tensor

from services.common.config import ServiceConfig
from services.common.server import MAX_MESSAGE_BYTES, open_channel
from services.common.tensor_channel import MAX_TIMEOUT_SECONDS, ChannelError, TrainerChannel
from services.common.wire import tensor_from_proto, tree_to_proto
from specd._proto.v1 import verifier_pb2, verifier_pb2_grpc
from specd.tree import TokenTree

logger = logging.getLogger(__name__)

TRANSPORTS = ("grpc", "tensor")
MAX_CHANNEL_BACKOFF_SECONDS = 60.0


class ScoreError(RuntimeError):
    """A verifier refused a Score request; ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ScorerUnavailable(ScoreError):
    """No verifier could be reached (all answered UNAVAILABLE): retry later."""


@dataclass(slots=True)
class ChannelCounters:
    """What the tensor transport did, summed over verifiers."""

    opened: int = 0
    """Channels opened (a store each)."""
    on_channel: int = 0
    """Score calls whose probabilities came over a channel."""
    fallbacks: int = 0
    """Score calls answered over plain gRPC because their channel was declined or failed."""
    dropped: int = 0
    """Channels dropped after a failure."""


@dataclass(slots=True)
class _Link:
    """The tensor channel to one verifier, and when to try again after failures."""

    channel: TrainerChannel | None = None
    failures: int = 0  # in a row
    retry_at: float = 0.0  # time.monotonic()


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

    ``transport="tensor"`` (full distributions only) receives the probabilities over a tensor
    channel per verifier (module docstring): its store listens on ``channel_host`` (empty: this
    machine's address), any one wait takes at most ``channel_timeout`` seconds, and the tensors
    arrive on ``device`` (CUDA: NCCL; else gloo, on the CPU). `counters` says what it did.
    """

    def __init__(self, addresses: Sequence[str], config: ServiceConfig, top_k: int = 0, *, vocab_size: int,
                 stop_token_ids: Sequence[int] = (), max_response_bytes: int = MAX_MESSAGE_BYTES // 2,
                 transport: str = "grpc", channel_host: str = "", channel_timeout: float = 30.0,
                 device: str | torch.device = "cpu") -> None:
        if not addresses:
            raise ValueError("RemoteScorer needs at least one verifier address (host:port)")
        if not 0 <= top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}], got {top_k}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "tensor" and top_k:
            raise ValueError("the tensor transport carries full distributions only: use top_k=0, or transport='grpc' for top-k")
        if not 0 < channel_timeout <= MAX_TIMEOUT_SECONDS:
            raise ValueError(f"channel_timeout must be in (0, {MAX_TIMEOUT_SECONDS:g}] seconds, got {channel_timeout}")
        self.addresses = list(addresses)
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_response_bytes = max_response_bytes
        self._channels = [open_channel(address, config) for address in self.addresses]
        self._stubs = [verifier_pb2_grpc.VerifierStub(channel) for channel in self._channels]
        self._turn = itertools.cycle(range(len(self._stubs)))
        self.transport = transport
        self.channel_host = channel_host or (socket.gethostbyname(socket.gethostname()) if transport == "tensor" else "")
        self.channel_timeout = channel_timeout
        self.device = torch.device(device)
        self._links = [_Link() for _ in self.addresses]
        self.counters = ChannelCounters()

    def score(self, contexts: list[list[int]], trees: list[TokenTree], context_rows: list[list[int]]) -> list[Tensor]:
        sequences = [
            verifier_pb2.ScoreSequence(context=context, tree=tree_to_proto(tree), context_rows=rows)
            for context, tree, rows in zip(contexts, trees, context_rows)
        ]
        row_bytes = 4 * self.vocab_size if self.top_k == 0 else 8 * self.top_k + 4
        out: list[Tensor] = []
        for part in self._split(sequences, row_bytes):
            out.extend(self._call(verifier_pb2.ScoreRequest(sequences=part, top_k=self.top_k)))
        return out

    def close(self) -> None:
        for link in self._links:
            if link.channel is not None:
                link.channel.close()
                link.channel = None
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

    def _call(self, request: verifier_pb2.ScoreRequest) -> list[Tensor]:
        """One Score call, failing over to the next verifier on UNAVAILABLE."""
        failures = []
        for _ in range(len(self._stubs)):
            index = next(self._turn)
            try:
                return self._score_at(index, request)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise ScoreError(error.code(), f"verifier {self.addresses[index]} refused Score: "
                                                   f"{error.code().name}: {error.details()}") from error
                logger.warning("verifier %s unavailable for Score (%s); trying the next", self.addresses[index], error.details())
                failures.append(f"{self.addresses[index]}: {error.details()}")
        raise ScorerUnavailable(grpc.StatusCode.UNAVAILABLE,
                                "no verifier answered Score (check they are up and reachable): " + "; ".join(failures))

    def _score_at(self, index: int, request: verifier_pb2.ScoreRequest) -> list[Tensor]:
        """The request's probabilities from verifier ``index``: over its channel when there is one
        (falling back to plain gRPC when it fails), else over gRPC. grpc.RpcError from a plain call."""
        channel = self._channel(index) if self.transport == "tensor" else None
        if channel is not None:
            with channel.lock:  # one call at a time per channel: the answers pair with the tensors
                try:
                    return self._score_on_channel(index, channel, request)
                except ChannelError as error:
                    self._drop(index, error)
            self.counters.fallbacks += 1
        return self._unpack(self._stubs[index].Score(request), request)

    def _score_on_channel(self, index: int, channel: TrainerChannel, request: verifier_pb2.ScoreRequest) -> list[Tensor]:
        """ChannelError when the channel failed (the caller asks again over plain gRPC);
        grpc.RpcError for UNAVAILABLE (the next verifier is tried)."""
        ask = verifier_pb2.ScoreRequest()
        ask.CopyFrom(request)
        ask.channel.CopyFrom(channel.next_request())
        sequence = ask.channel.sequence
        try:
            response = self._stubs[index].Score(ask)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:  # down or restarting: its side of the channel is gone
                self._drop(index, ChannelError(f"the verifier is unavailable ({error.details()})"))
                raise
            raise ChannelError(f"Score with a channel failed: {error.code().name}: {error.details()}") from None
        if not any(result.on_channel for result in response.results):
            # Declined: the data came over gRPC, with the reason.
            why = response.channel_error or "it did not say why (a verifier without tensor channels?)"
            self._drop(index, ChannelError(f"the verifier declined it and answered over gRPC: {why}"))
            self.counters.fallbacks += 1
            return self._unpack(response, request)
        shapes = self._channel_shapes(response, request, sequence)
        dtype = getattr(torch, response.results[0].probs.dtype)
        tensors = channel.receive(shapes, dtype, sequence)
        self.counters.on_channel += 1
        self._links[index].failures = 0
        return [t.float() for t in tensors]

    def _channel_shapes(self, response: verifier_pb2.ScoreResponse, request: verifier_pb2.ScoreRequest,
                        sequence: int) -> list[tuple[int, int]]:
        """The announced shapes, checked against the request: a mismatch would misalign the transfers."""
        expected = [(len(s.context_rows) + len(s.tree.tokens), self.vocab_size) for s in request.sequences]
        shapes = [tuple(result.probs.shape) for result in response.results]
        dtypes = {result.probs.dtype for result in response.results}
        if response.channel_sequence != sequence or not all(r.on_channel for r in response.results):
            raise ChannelError(f"the answer to call {sequence} says call {response.channel_sequence} and puts "
                               f"{sum(r.on_channel for r in response.results)} of {len(response.results)} results on the channel")
        if shapes != expected:
            raise ChannelError(f"the verifier announced shapes {shapes[:4]}... for rows {expected[:4]}...: "
                               "is it serving another target?")
        if len(dtypes) != 1 or not isinstance(dtype := getattr(torch, dtypes.pop(), None), torch.dtype) \
                or not dtype.is_floating_point:
            raise ChannelError(f"the verifier announced dtypes {sorted(r.probs.dtype for r in response.results)[:4]}, "
                               "expected one floating-point dtype")
        return shapes

    def _channel(self, index: int) -> TrainerChannel | None:
        """The open channel to verifier ``index``, opened now if there is none and it is time to try."""
        link = self._links[index]
        if link.channel is None and time.monotonic() >= link.retry_at:
            try:
                link.channel = TrainerChannel(self.channel_host, timeout=self.channel_timeout, device=self.device)
            except ChannelError as error:
                self._failed(index, error)
                return None
            self.counters.opened += 1
            logger.info("opened Score channel %s to verifier %s (%s, store %s:%d)", link.channel.channel_id,
                        self.addresses[index], link.channel.backend, link.channel.host, link.channel.port)
        return link.channel

    def _drop(self, index: int, error: ChannelError) -> None:
        link = self._links[index]
        if link.channel is not None:
            logger.warning("dropped Score channel %s to verifier %s: %s (plain gRPC until a new one is open)",
                           link.channel.channel_id, self.addresses[index], error)
            link.channel.close()
            link.channel = None
            self.counters.dropped += 1
        self._failed(index, error)

    def _failed(self, index: int, error: ChannelError) -> None:
        link = self._links[index]
        link.failures += 1
        # 0 s after one failure (a restarted verifier), then 1, 3, 7, ... s: one that cannot take part.
        pause = min(MAX_CHANNEL_BACKOFF_SECONDS, 2.0 ** (link.failures - 1) - 1)
        link.retry_at = time.monotonic() + pause
        if pause:
            logger.warning("no Score channel to verifier %s for %.0fs after %d failures in a row (last: %s)",
                           self.addresses[index], pause, link.failures, error)

    def _unpack(self, response: verifier_pb2.ScoreResponse, request: verifier_pb2.ScoreRequest) -> list[Tensor]:
        if len(response.results) != len(request.sequences):
            raise ScoreError(grpc.StatusCode.INTERNAL,
                             f"a verifier answered {len(response.results)} results for {len(request.sequences)} sequences")
        return [self._probs(result) for result in response.results]

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

