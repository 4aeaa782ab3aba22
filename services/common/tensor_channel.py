"""The Score tensor channel: a verifier's probabilities to the trainer over ``torch.distributed``.

Full distributions are ``rows x vocab`` float32; as protobuf bytes they are copied, framed and
parsed several times on the way. With a channel, the ``Verifier.Score`` answer carries only each
result's shape and dtype (``ScoreResult.on_channel``), and the tensors themselves go rank to rank
over a process group: gloo on CPU, NCCL on GPU (DESIGN.md, "Training: SpecOPD", item 3). One code
path; the backend only decides where the tensors live (`services.common.broadcast` helpers).

Design choices:

- **One 2-rank group per trainer-verifier pair**, the trainer rank 0 and the verifier rank 1, opened
  by the trainer on its first Score call to that verifier and kept for every later one. Not one
  world of all verifiers: verifiers come and go (autoscaling, restarts, rollouts), and a world is
  fixed at creation, so one departure would break every verifier's supervision and a newcomer
  could not join without rebuilding it. A pair breaks alone and is replaced alone.
- **Not the default group.** Like the weight broadcast, each channel is a ``ProcessGroupGloo`` /
  ``ProcessGroupNCCL`` on a fresh ``TCPStore`` (the trainer's, on a free port; it listens on every
  interface, and the host it is given is the one verifiers are told to connect to): a trainer holds one
  channel per verifier besides its broadcast groups, and a test (or a colocated deployment) puts
  both ranks in one process; ``init_process_group`` allows one default group per process.
- **Rendezvous in band.** The trainer starts the store (`TrainerChannel`) and names it in
  ``ScoreRequest.channel`` (address, port, a fresh ``channel_id``, backend, timeout). A verifier
  seeing an id it has not joined connects to the store and counts itself in (``joined``); any count
  but 1 means the channel was joined before by another process (the verifier restarted, or another
  replica answers at that address), and it declines. A verifier that cannot take part (declined,
  store unreachable, NCCL on a CPU target) answers that call with the data over gRPC and says why
  in ``ScoreResponse.channel_error``; nothing is lost but the saving.
- **Order and pairing.** One Score call at a time per channel: the trainer holds the channel's lock
  from the request until every tensor arrived, the verifier from checking the call's ``sequence``
  (strictly increasing) until its sends are queued. The verifier's channel thread sets up the
  group on its first send and sends the tensors in result order, after the gRPC answer is made
  (with NCCL the first send waits for the trainer's first receive, which comes after the answer);
  the trainer receives them after the answer arrived. Gloo messages carry the sequence as their tag,
  so a stale send can never fill a later call's buffers; the answer echoes the sequence too.
- **Failures drop the channel, never the step.** Any wait is bounded by ``timeout_seconds`` (store,
  group setup, each transfer). A trainer whose receive fails (timeout, the peer gone) aborts its
  group, closes its store and asks again over plain gRPC; its next call opens a new channel. A
  verifier whose send fails drops its side; channels a trainer abandoned without a failure (it
  exited) are evicted least recently used beyond ``max_channels``. With NCCL, run with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` so a timeout raises instead of ending the process.
- **Trust.** A verifier connects to the address a Score caller names, so Score callers must be
  trusted (bearer token / network policy, as for every other method).
"""

from __future__ import annotations

import logging
import math
import queue
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from services.common.broadcast import (
    BACKENDS,
    backend_for,
    cannot_join,
    master_store,
    new_group,
    seconds_timedelta,
    transfer_device,
)
from specd._proto.v1 import verifier_pb2

logger = logging.getLogger(__name__)

MAX_TIMEOUT_SECONDS = 600.0
"""The longest ``timeout_seconds`` a verifier accepts: a bound on what one bad caller can hold up."""
_CHANNEL_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_JOINED_KEY = "joined"
_GROUP_PREFIX = "group"


class ChannelError(RuntimeError):
    """A channel could not be set up or broke; the caller drops it and uses plain gRPC."""


def check_channel(message: verifier_pb2.TensorChannel) -> str | None:
    """What is wrong with a ``TensorChannel`` as a client sent it, None when it is usable."""
    if not message.master_addr or len(message.master_addr) > 255:
        return f"channel master_addr {message.master_addr!r:.80} must be a host name or address (1-255 characters)"
    if not 0 < message.master_port < 65536:
        return f"channel master_port {message.master_port} is not a TCP port (1-65535)"
    if not _CHANNEL_ID.fullmatch(message.channel_id):
        return f"channel_id {message.channel_id!r:.80} must be 1-128 characters of [A-Za-z0-9_.-]"
    if message.backend not in BACKENDS:
        return f"channel backend {message.backend!r:.40} is not one of {BACKENDS}"
    if not (math.isfinite(message.timeout_seconds) and 0.0 < message.timeout_seconds <= MAX_TIMEOUT_SECONDS):
        return f"channel timeout_seconds must be in (0, {MAX_TIMEOUT_SECONDS:g}] seconds, got {message.timeout_seconds}"
    if message.sequence < 1:
        return "channel sequence must start at 1 and increase with every call"
    return None


def _reason(err: BaseException) -> str:
    """The first line of a torch.distributed error (c10d appends a C++ stack trace)."""
    return str(err).strip().split("\n", 1)[0]


def _tag(sequence: int) -> int:
    # Gloo tags are non-negative 32-bit ints; 2^31 calls on one channel never wrap in practice.
    return sequence & 0x7FFFFFFF


# ---------------------------------------------------------------------------- the trainer's side
class TrainerChannel:
    """Rank 0 of one channel: a ``TCPStore`` on a free port of ``host``; the process group is set
    up on the first `receive` (the verifier joins while it answers the first call).

    ``device`` is where the trainer wants the tensors: NCCL when it is a CUDA device (the tensors
    arrive there), else gloo (CPU). Hold `lock` from `next_request` through `receive`.
    ChannelError when the store cannot be started.
    """

    def __init__(self, host: str, *, timeout: float, device: str | torch.device = "cpu") -> None:
        if not 0.0 < timeout <= MAX_TIMEOUT_SECONDS:
            raise ValueError(f"a channel timeout must be in (0, {MAX_TIMEOUT_SECONDS:g}] seconds, got {timeout}")
        self.host = host
        self.timeout = timeout
        self.backend = backend_for(device)
        self.device = transfer_device(self.backend, device)
        self.channel_id = uuid.uuid4().hex
        self.lock = threading.Lock()
        self._sequence = 0
        self._group: dist.Backend | None = None
        try:
            self._store: dist.TCPStore | None = master_store(host, timeout)
        except RuntimeError as err:
            raise ChannelError(f"cannot start a Score channel store on {host} (is --score-channel-host an "
                               f"address of this machine that verifiers reach?): {_reason(err)}") from None
        self.port: int = self._store.port

    def next_request(self) -> verifier_pb2.TensorChannel:
        """The channel message of the next call, with its sequence number."""
        self._sequence += 1
        return verifier_pb2.TensorChannel(master_addr=self.host, master_port=self.port, channel_id=self.channel_id,
                                          backend=self.backend, timeout_seconds=self.timeout, sequence=self._sequence)

    def receive(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype, sequence: int) -> list[Tensor]:
        """The tensors of call ``sequence`` from rank 1, in order, on this channel's device.

        ChannelError when the group cannot be set up or a transfer fails or times out; the channel
        is unusable afterwards (a timed-out gloo pair is closed): `close` it.
        """
        if self._store is None:
            raise ChannelError(f"Score channel {self.channel_id} is closed: open a new one")
        try:
            if self._group is None:
                self._group = new_group(self.backend, dist.PrefixStore(_GROUP_PREFIX, self._store), 0, 2, self.timeout)
            tensors = [torch.empty(tuple(shape), dtype=dtype, device=self.device) for shape in shapes]
            # Post every receive, then wait: the sender streams them back to back (FIFO per tag).
            works = [self._group.recv([t], 1, _tag(sequence)) for t in tensors if t.numel()]
            for work in works:
                work.wait(seconds_timedelta(self.timeout))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError as err:
            raise ChannelError(f"receiving call {sequence} over Score channel {self.channel_id} failed: {_reason(err)}") from None
        return tensors

    def close(self) -> None:
        group, self._group, self._store = self._group, None, None  # the store's server stops with it
        if group is not None:
            group.abort()


# ---------------------------------------------------------------------------- a verifier's side
class VerifierChannel:
    """Rank 1 of one channel, joined by `VerifierChannels.join`. Its thread sets up the group on
    the first send and sends each call's tensors until `close` or a failure; either way it ends by
    calling ``on_exit`` (the registry forgets the channel) and leaving the group.
    """

    def __init__(self, message: verifier_pb2.TensorChannel, device: str | torch.device,
                 on_exit: Callable[[VerifierChannel], None]) -> None:
        self.channel_id = message.channel_id
        self.master = (message.master_addr, message.master_port)
        self.backend = message.backend
        self.timeout = float(message.timeout_seconds)
        self.device = transfer_device(self.backend, device)
        self.lock = threading.Lock()
        """One call at a time: held from `begin` until the call's tensors are queued (`send`)."""
        self.sequence = 0
        """The last call whose tensors were queued."""
        self._on_exit = on_exit
        where = f"the trainer's store at {message.master_addr}:{message.master_port}"
        try:
            store = dist.TCPStore(message.master_addr, message.master_port, None, False,
                                  timeout=seconds_timedelta(self.timeout))
            joined = store.add(_JOINED_KEY, 1)
        except RuntimeError as err:
            raise ChannelError(f"cannot reach {where} for channel {self.channel_id} (is --score-channel-host "
                               f"reachable from the verifiers?): {_reason(err)}") from None
        if joined != 1:
            raise ChannelError(f"channel {self.channel_id} was joined before by another process (this verifier "
                               "restarted, or another replica answers at its address); the trainer opens a new one")
        self._store: dist.TCPStore | None = store
        self._queue: queue.SimpleQueue[tuple[int, list[Tensor]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"score-channel-{self.channel_id[:8]}", daemon=True)
        self._thread.start()

    def begin(self, sequence: int) -> None:
        """Check that call ``sequence`` comes after the last one (hold `lock`); ChannelError if not."""
        if not self._thread.is_alive():
            raise ChannelError(f"channel {self.channel_id} is closed on this verifier: open a new one")
        if sequence <= self.sequence:
            raise ChannelError(f"channel {self.channel_id}: call {sequence} does not follow call {self.sequence}; "
                               "the trainer and this verifier disagree on the channel: open a new one")

    def send(self, tensors: list[Tensor], sequence: int) -> None:
        """Queue call ``sequence``'s tensors (hold `lock`); the channel's thread sends them in order."""
        self.sequence = sequence
        self._queue.put((sequence, tensors))

    def close(self) -> None:
        """Stop after the queued sends (each bounded by the timeout)."""
        self._queue.put(None)

    def _run(self) -> None:
        group = None
        try:
            while (item := self._queue.get()) is not None:
                sequence, tensors = item
                if group is None:
                    group = new_group(self.backend, dist.PrefixStore(_GROUP_PREFIX, self._store), 1, 2, self.timeout)
                # Moved here, not in the handler: the gRPC answer goes out without waiting for a copy.
                moved = [t.to(self.device).contiguous() for t in tensors if t.numel()]
                works = [group.send([t], 0, _tag(sequence)) for t in moved]
                for work in works:
                    work.wait(seconds_timedelta(self.timeout))
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError as err:
            logger.warning("Score channel %s to %s:%d broke (%s); dropped it (the trainer retries over gRPC and "
                           "opens a new one)", self.channel_id, *self.master, _reason(err))
        finally:
            self._on_exit(self)  # before leaving the group: once the trainer sees it gone, so does the registry
            if group is not None:
                group.abort()
            self._store = None


class VerifierChannels:
    """A verifier's joined channels by ``channel_id``: at most ``max_channels``, least recently
    used evicted (a trainer that exits does not say so). ``device`` is the target's device."""

    def __init__(self, device: str | torch.device, max_channels: int = 64) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self.device = torch.device(device)
        self.max_channels = max_channels
        self._channels: OrderedDict[str, VerifierChannel] = OrderedDict()
        self._lock = threading.Lock()

    def join(self, message: verifier_pb2.TensorChannel) -> VerifierChannel:
        """The channel ``message`` names, joined first when new. ChannelError (saying why) when it
        cannot be used; ``message`` must have passed `check_channel`."""
        with self._lock:
            channel = self._channels.get(message.channel_id)
            if channel is not None:
                self._channels.move_to_end(message.channel_id)
        if channel is not None:
            if channel.master != (message.master_addr, message.master_port) or channel.backend != message.backend:
                raise ChannelError(f"channel {message.channel_id} was joined at {channel.master[0]}:{channel.master[1]} "
                                   f"({channel.backend}), not {message.master_addr}:{message.master_port} "
                                   f"({message.backend}): use a new channel_id for a new channel")
            return channel
        problem = cannot_join(message.backend, self.device)
        if problem:
            raise ChannelError(f"cannot join channel {message.channel_id}: {problem}; open channels with gloo "
                               "(a CPU trainer) or run the verifier's target on CUDA")
        # Joined outside the registry lock: reaching the store may take up to the timeout.
        channel = VerifierChannel(message, self.device, self._forget)
        with self._lock:
            self._channels[channel.channel_id] = channel
            evicted = [self._channels.popitem(last=False)[1] for _ in range(len(self._channels) - self.max_channels)]
        for old in evicted:
            logger.info("evicting Score channel %s (least recently used of %d)", old.channel_id, self.max_channels)
            old.close()
        return channel

    def drop(self, channel: VerifierChannel) -> None:
        """Forget ``channel`` and stop it."""
        self._forget(channel)
        channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), OrderedDict()
        for channel in channels:
            channel.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._channels)

    def __contains__(self, channel_id: str) -> bool:
        with self._lock:
            return channel_id in self._channels

    def _forget(self, channel: VerifierChannel) -> None:
        with self._lock:
            if self._channels.get(channel.channel_id) is channel:
                del self._channels[channel.channel_id]
