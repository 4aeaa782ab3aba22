"""Conversions between the library's contracts and their protobuf mirrors (proto/specd/v1/common.proto).

Pure functions, one place for all services. Everything that arrives from the wire is checked here
or by the dataclass it becomes (`DraftBlock`, `TokenTree`, `SamplingParams`), so a malformed
message is a ``ValueError`` with a message the servicer returns as INVALID_ARGUMENT.

Tensors travel as their raw bytes in row-major order with the dtype's torch name; the bytes are
the host's, and every machine specd runs on (x86-64, aarch64) is little-endian, as the proto says.
"""

from __future__ import annotations

import math

import torch

from specd._proto.v1 import common_pb2
from specd.drafters.base import DraftBlock
from specd.sampling import SamplingParams
from specd.tree import TokenTree


# ---------------------------------------------------------------------------- tensors
def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    """Any tensor (any device, any strides) -> its contiguous CPU bytes, shape and dtype name."""
    t = t.detach().to("cpu").contiguous()
    # Viewing as bytes works for every dtype, bfloat16 included (numpy has no bfloat16).
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return common_pb2.Tensor(data=data, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))


def tensor_from_proto(m: common_pb2.Tensor) -> torch.Tensor:
    """The tensor a `tensor_to_proto` message describes (a fresh, writable CPU tensor).

    Raises ValueError when the dtype is not a torch dtype name, a dimension is negative, or the
    byte count disagrees with shape x element size.
    """
    dtype = getattr(torch, m.dtype, None) if m.dtype else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Tensor.dtype {m.dtype!r} is not a torch dtype name (send e.g. 'float32', 'int64')")
    shape = tuple(m.shape)
    if any(size < 0 for size in shape):
        raise ValueError(f"Tensor.shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * dtype.itemsize
    if len(m.data) != expected:
        raise ValueError(
            f"Tensor has {len(m.data)} bytes but shape {list(shape)} of {m.dtype} needs {expected}: "
            "shape, dtype and data must describe the same tensor"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy, so the tensor does not alias the (immutable) message bytes.
    return torch.frombuffer(bytearray(m.data), dtype=torch.uint8).view(dtype).reshape(shape)


# ---------------------------------------------------------------------------- sampling params
_OPTIONAL_FLOATS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """Every field is sent explicitly, so the receiver never guesses (temperature 0 stays greedy)."""
    m = common_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        max_tokens=p.max_tokens,
        stop_token_ids=list(p.stop_token_ids),
        min_tokens=p.min_tokens,
        logit_bias=p.logit_bias or {},
        **{name: getattr(p, name) for name in _OPTIONAL_FLOATS},
    )
    if p.seed is not None:
        m.seed = p.seed
    return m


def params_from_proto(m: common_pb2.SamplingParams, *, default_max_tokens: int = 64) -> SamplingParams:
    """Absent fields take the library defaults (absent temperature = greedy; absent max_tokens =
    ``default_max_tokens``). ValueError, saying which field and why, on a value out of range
    (`SamplingParams` holds the rules, the same for HTTP and gRPC)."""
    floats = {name: getattr(m, name) for name in _OPTIONAL_FLOATS if m.HasField(name)}
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else default_max_tokens,
        temperature=m.temperature if m.HasField("temperature") else 0.0,
        top_k=m.top_k if m.HasField("top_k") else 0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids),
        min_tokens=m.min_tokens if m.HasField("min_tokens") else 0,
        logit_bias=dict(m.logit_bias) or None,
        **floats,
    )


# ---------------------------------------------------------------------------- blocks and trees
def block_to_proto(b: DraftBlock) -> common_pb2.DraftBlock:
    m = common_pb2.DraftBlock(tokens=b.tokens, confidence=b.confidence)
    if b.probs is not None:
        m.probs.CopyFrom(tensor_to_proto(b.probs.float()))  # the proto promises float32
    return m


def block_from_proto(m: common_pb2.DraftBlock) -> DraftBlock:
    """ValueError when probs is not a float [len(tokens), vocab] tensor or confidences are missing."""
    probs = None
    if m.HasField("probs"):
        probs = tensor_from_proto(m.probs)
        if not probs.is_floating_point():
            raise ValueError(f"DraftBlock.probs must be float32 probabilities, got dtype {m.probs.dtype!r}")
        probs = probs.float()
    return DraftBlock(tokens=list(m.tokens), probs=probs, confidence=list(m.confidence))


def tree_to_proto(t: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(
        tokens=t.tokens.tolist(), parents=t.parents.tolist(), anchors=t.anchors.tolist()
    )


def tree_from_proto(m: common_pb2.TokenTree) -> TokenTree:
    """ValueError (from `TokenTree`'s checks) when lengths differ, a parent is not an earlier node
    or -1, or a branch mixes anchors."""
    as_long = lambda values: torch.tensor(list(values), dtype=torch.long)  # noqa: E731
    return TokenTree(as_long(m.tokens), as_long(m.parents), as_long(m.anchors))
