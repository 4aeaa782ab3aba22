"""Which floating-point type CPU compute uses, decided here and nowhere else.

bf16 autocast halves the bytes a matmul moves and, on a CPU that computes bf16 natively
(AVX512-BF16 or AMX), runs about twice as fast as fp32. On a CPU without it (an AVX2 part, seen:
AMD EPYC with ``get_cpu_capability() == "AVX2"``) torch emulates bf16 and a matmul is some 70x
slower than in fp32, which once turned the tiny zoo's hour of training into a day. So training
and the zoo use bf16 autocast only where the CPU computes it, fp32 elsewhere, and say which.

``SPECD_CPU_BF16=1`` / ``=0`` overrides the probe (to reproduce the other machine's recipe).
"""

from __future__ import annotations

import contextlib
import os

import torch

ENV_VAR = "SPECD_CPU_BF16"


def cpu_computes_bf16() -> bool:
    """Whether this CPU computes bf16 natively (then bf16 autocast pays), or ``SPECD_CPU_BF16``."""
    forced = os.environ.get(ENV_VAR, "")
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{ENV_VAR} must be 1 (use bf16) or 0 (fp32), got {forced!r}")
        return forced == "1"
    # torch's own dispatch probes (private, but the only ones it has; torch is pinned).
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def describe() -> str:
    """One line for logs: what CPU compute uses here, and why."""
    capability = torch.backends.cpu.get_cpu_capability()
    if os.environ.get(ENV_VAR):
        return f"{'bf16 autocast' if cpu_computes_bf16() else 'fp32'} ({ENV_VAR}={os.environ[ENV_VAR]}; CPU {capability})"
    if cpu_computes_bf16():
        return f"bf16 autocast (the CPU computes bf16 natively; capability {capability})"
    return f"fp32 (no native bf16 on this CPU, capability {capability}: bf16 would be emulated, far slower)"


def cpu_autocast(enabled: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on the CPU when ``enabled`` and the CPU computes bf16; fp32 otherwise."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled and cpu_computes_bf16())


def drafter_dtype(device: torch.device | str = "cpu") -> torch.dtype | None:
    """The dtype to run a drafter in: bf16 on a CPU that computes it natively, else None (the
    checkpoint's own). A drafter's passes (a block, and in async mode its candidates beside it)
    are compute-bound on a CPU, where bf16 runs them about twice as fast; its output only
    proposes — the target verifies in its own dtype, so output stays exact."""
    return torch.bfloat16 if torch.device(device).type == "cpu" and cpu_computes_bf16() else None


DRAFTER_DTYPES = {"auto": None, "checkpoint": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_drafter_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype | None:
    """A drafter dtype setting (``auto``, ``checkpoint``, ``float32`` or ``bfloat16``) as a dtype:
    ``auto`` is `drafter_dtype` for ``device``, ``checkpoint`` (None) the checkpoint's own."""
    if name not in DRAFTER_DTYPES:
        raise ValueError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {name!r}")
    return drafter_dtype(device) if name == "auto" else DRAFTER_DTYPES[name]
