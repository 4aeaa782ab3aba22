"""When a Triton kernel can run, and what to tell the user when it cannot.

Triton is an optional dependency on the CPU (the ``gpu`` and ``test`` extras install it): specd
imports it behind `triton_available`, never at start. A kernel runs on CUDA tensors, or on CPU
tensors under the interpreter (``TRITON_INTERPRET=1``, read when Triton is first imported, so set
it before starting Python). The interpreter cannot autotune over several configs:
`autotune_configs` keeps the first one there.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from torch import Tensor

INSTALL_HINT = "pip install 'triton==3.7.1' (the specd[gpu] extra; torch 2.13 pins this version)"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton kernels run in the interpreter (on the CPU) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_run(*tensors: Tensor) -> bool:
    """A Triton kernel can run on these tensors: Triton is installed, and they are on CUDA, or on
    the CPU under the interpreter."""
    if not triton_available():
        return False
    return all(t.is_cuda for t in tensors) or (interpreting() and all(t.device.type == "cpu" for t in tensors))


def require(*tensors: Tensor, kernel: str) -> None:
    """Raise a RuntimeError that says what to do when ``kernel`` cannot run on these tensors."""
    if not triton_available():
        raise RuntimeError(f"the Triton kernel {kernel} needs Triton: {INSTALL_HINT}")
    if not can_run(*tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(f"the Triton kernel {kernel} runs on CUDA tensors (or on the CPU with TRITON_INTERPRET=1 "
                           f"set before Python starts), got tensors on {devices}: use the torch reference here")


def autotune_configs(configs: list) -> list:
    """All configs on a GPU; the first only under the interpreter (it cannot autotune over many)."""
    return configs[:1] if interpreting() else configs
