"""`specd bench gpu` (bench/gpu.sh) with tiny shapes on the CPU: every step runs and passes, so the
script a lent GPU machine runs is not debugged on the GPU's clock."""

from __future__ import annotations

import pytest
import torch

from specd.bench.gpu import EXAMPLE_PROFILE, GpuSettings, format_summary, run_all
from specd.kernels import runtime


@pytest.mark.skipif(not runtime.triton_available(), reason="the kernel checks need Triton (the test extra has it)")
def test_every_step_passes_with_tiny_shapes_on_the_cpu():
    result = run_all(GpuSettings.tiny("cpu"), EXAMPLE_PROFILE)
    failed = [s for s in result["steps"] if not s["ok"]]
    assert not failed, failed
    kernels = [s for s in result["steps"] if s["name"].startswith("kernel")]
    assert len(kernels) >= 2 and all(s["max_diff"] <= 1e-4 for s in kernels)
    passes = next(s for s in result["steps"] if s["name"] == "pass costs")
    assert passes["target"]["batch"] == [1, 4] and passes["target"]["tokens"] == [1, 9]
    rows = result["projection"]["rows"]
    assert [r["concurrency"] for r in rows] == [1, 4] and all(r["plain_tokens_per_s"] > 0 for r in rows)
    print(format_summary(result))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_how_to_check_the_script():
    with pytest.raises(RuntimeError, match="--device cpu --tiny"):
        run_all(GpuSettings(), EXAMPLE_PROFILE)
