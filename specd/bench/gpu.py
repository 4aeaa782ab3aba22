"""`specd bench gpu`: the CUDA paths checked, and the pass costs that matter measured, on one GPU in minutes.

`bench/gpu.sh` runs it on a lent GPU machine; it fits in 8 minutes on one H100/H200 and prints
a short table last. Every step is recorded, and a failed check does not stop the others (the
JSON says what failed and why):

1. **environment**: torch, CUDA, the device, Triton and flash-attn versions (a missing one is
   recorded, not fatal).
2. **kernels vs. their references on the GPU** (`specd.kernels`): the rejection sampler, the
   fused E2E-TV forward + backward and the tree-attention kernel — max difference and the
   kernel's time against the torch reference's (median of CUDA-synchronised repeats).
3. **attention backends**: every available backend gives the same greedy tokens as SDPA on a
   small random Qwen3.
4. **NCCL**: a one-rank NCCL process group on a fresh TCPStore broadcasts a tensor (the path
   the trainer's weight broadcast and score channel take; `specd.parallel.groups`).
5. **pass costs** of a Qwen3-8B-shaped target (random bf16 weights) for 1..32 new tokens at
   batch 1..64 after ``context`` cached tokens, and of a D3D drafter sized for it (Draft and
   Speculate packed passes, `specd.bench.profile.measure_drafter`).
6. **projection**: those tables become a cost profile (`specd.plan.profile`) with the acceptance
   per position and hit rate measured on the zoo (``--acceptance PROFILE``, default the
   profile `specd bench profile` wrote, else the bundled example's stated assumptions), and the
   simulator (`specd.plan.sim`) gives tokens/s of plain decoding and of async D3D (one verifier
   GPU, one drafter GPU) per concurrency: the projected end-to-end speedup.

``--device cpu --tiny`` runs the same steps with tiny shapes on the CPU (kernels under
``TRITON_INTERPRET=1``): how the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specd.batch import ForwardBatch
from specd.bench.profile import measure_drafter, measure_target
from specd.kernels import runtime
from specd.models.d3d import D3DConfig, D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3Config, Qwen3ForCausalLM
from specd.parallel import groups
from specd.plan.profile import load_profile, parse_profile
from specd.plan.sim import Lengths, SimConfig, Workload, simulate

EXAMPLE_PROFILE = Path(__file__).resolve().parents[1] / "plan" / "profiles" / "qwen3-8b-h200.json"

# A D3D drafter for a Qwen3-8B-class target: the target's vocabulary, about a tenth of its layers'
# compute (5 layers at 2048 wide, ~0.9B parameters with its own embedding and head).
DRAFTER_8B = D3DConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=5,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, rope_theta=1e6,
                       torch_dtype="bfloat16")
TINY_TARGET = FLAVOURS["debug"]
TINY_DRAFTER = D3DConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@dataclass(kw_only=True, slots=True)
class GpuSettings:
    device: str = "cuda"
    target: Qwen3Config = field(default_factory=lambda: FLAVOURS["qwen3-8b"])
    drafter: D3DConfig = field(default_factory=lambda: DRAFTER_8B)
    dtype: torch.dtype = torch.bfloat16
    batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 9, 16, 17, 32)
    drafter_batches: tuple[int, ...] = (1, 4, 16, 64)
    context: int = 512
    repeats: int = 5
    block_size: int = 8
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    kernel_rows: int = 256
    kernel_vocab: int = 151936

    @staticmethod
    def tiny(device: str) -> GpuSettings:
        return GpuSettings(device=device, target=TINY_TARGET, drafter=TINY_DRAFTER, dtype=torch.float32,
                           batches=(1, 4), tokens=(1, 9), drafter_batches=(1, 4), context=16, repeats=2,
                           concurrency=(1, 4), kernel_rows=8, kernel_vocab=300)


# ====================================================================== timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: compiles, allocates, autotunes
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step(record: list[dict], name: str, fn: Callable[[], dict]) -> dict:
    """Run one check; a failure is recorded with its reason and the run goes on."""
    started = time.perf_counter()
    try:
        result = {"name": name, "ok": True, **fn()}
    except (RuntimeError, ValueError, ImportError, AssertionError, OSError, torch.cuda.OutOfMemoryError) as err:
        result = {"name": name, "ok": False, "error": f"{type(err).__name__}: {err}"}
    result["seconds"] = round(time.perf_counter() - started, 2)
    record.append(result)
    print(f"[bench gpu] {name}: {'ok' if result['ok'] else 'FAILED ' + result['error']} ({result['seconds']} s)",
          flush=True)
    return result


# ====================================================================== checks
def environment(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "triton": None, "flash_attn": None}
    if device.type == "cuda":
        out.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(device),
                   memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    if runtime.triton_available():
        import triton

        out["triton"] = triton.__version__
    try:
        import flash_attn

        out["flash_attn"] = flash_attn.__version__
    except ImportError as err:
        out["flash_attn_missing"] = str(err)
    return out


def _compare(kernel: Callable[[], object], reference: Callable[[], object], device: torch.device,
             repeats: int, difference: Callable[[object, object], float]) -> dict:
    got, want = kernel(), reference()
    out = {"max_diff": difference(got, want)}
    out["kernel_ms"] = 1e3 * _median_seconds(kernel, device, repeats)
    out["torch_ms"] = 1e3 * _median_seconds(reference, device, repeats)
    out["speedup"] = out["torch_ms"] / out["kernel_ms"]
    return out


def check_rejection(device: torch.device, settings: GpuSettings) -> dict:
    from specd.kernels.rejection import rejection_sample, rejection_sample_reference

    generator = torch.Generator(device="cpu").manual_seed(0)
    num_seqs, vocab, block = settings.kernel_rows // 4 or 1, settings.kernel_vocab, 4
    cu = torch.arange(0, (num_seqs + 1) * block, block, dtype=torch.long)
    draft = torch.randint(0, vocab, (num_seqs * block,), generator=generator)
    q = torch.softmax(torch.randn(num_seqs * block, vocab, generator=generator), -1)
    p = torch.softmax(torch.randn(num_seqs * block + num_seqs, vocab, generator=generator), -1)
    coins = torch.rand(num_seqs * block, generator=generator)
    uniforms = torch.rand(num_seqs, generator=generator)
    greedy = torch.zeros(num_seqs, dtype=torch.bool)
    args = [t.to(device) for t in (draft, cu, q, p, uniforms, coins, greedy)]

    def mismatches(got, want) -> float:
        return float(sum(int((a != b).sum()) for a, b in zip(got, want)))

    out = _compare(lambda: rejection_sample(*args), lambda: rejection_sample_reference(*args), device,
                   settings.repeats, mismatches)
    if out["max_diff"]:
        raise AssertionError(f"the rejection kernel disagrees with its reference on {out['max_diff']:.0f} outputs")
    return out


def check_e2e_tv(device: torch.device, settings: GpuSettings) -> dict:
    from specd.kernels.e2e_tv import acceptance_probs_fused, acceptance_probs_reference

    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = (settings.kernel_rows // 8 or 1, 8, settings.kernel_vocab)
    p = torch.softmax(torch.randn(shape, generator=generator), -1).to(device)
    logits = torch.randn(shape, generator=generator).to(device, settings.dtype)

    def forward_backward(fn) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run():
            x = logits.detach().requires_grad_(True)
            alpha = fn(p, x)
            alpha.sum().backward()
            return alpha.detach().float(), x.grad.float()
        return run

    def difference(got, want) -> float:
        return max(float((got[0] - want[0]).abs().max()), float((got[1] - want[1]).abs().max()))

    out = _compare(forward_backward(acceptance_probs_fused), forward_backward(acceptance_probs_reference), device,
                   settings.repeats, difference)
    tolerance = 1e-4 if settings.dtype == torch.float32 else 2e-2
    if out["max_diff"] > tolerance:
        raise AssertionError(f"fused E2E-TV differs from its reference by {out['max_diff']:.3g} (> {tolerance})")
    return out


def check_nccl(device: torch.device) -> dict:
    """A one-rank group made, used and shut down the way the weight broadcast makes its groups
    (`specd.parallel.groups`): NCCL on CUDA, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = groups.master_store("127.0.0.1", timeout=30.0)
    group = groups.new_group(backend, store, 0, 1, timeout=30.0)
    tensor = torch.arange(1 << 20, dtype=torch.int64, device=device).to(torch.uint8)
    started = time.perf_counter()
    groups.broadcast_from_rank0(group, tensor, timeout=30.0)
    _sync(device)
    seconds = time.perf_counter() - started
    if hasattr(group, "shutdown"):
        group.shutdown()
    return {"backend": backend, "broadcast_1mib_ms": 1e3 * seconds}


def check_graphs(device: torch.device, settings: GpuSettings) -> dict:
    """Decode through captured CUDA graphs (`specd.cuda_graphs`) vs the eager pass: same logits,
    and the time of each, at batch 1 and 16 after ``context`` cached tokens."""
    from specd.cuda_graphs import GraphRunner
    from specd.tree import TokenTree

    model = _build(Qwen3ForCausalLM, settings.target, device, settings.dtype)
    out = {}
    for batch in (1, 16):
        cache = model.new_cache(batch, capacity=settings.context + 64)
        generator = torch.Generator().manual_seed(batch)
        prefix = torch.randint(4, settings.target.vocab_size, (batch, settings.context), generator=generator).tolist()
        fill = ForwardBatch.causal(prefix, [0] * batch, device)
        model(fill, cache)
        cache.commit(fill, [list(range(settings.context))] * batch)
        lengths = cache.lengths.clone()
        trees = [TokenTree.chain([7], settings.context) for _ in range(batch)]
        step = ForwardBatch.from_trees(trees, [settings.context] * batch, device)
        runner = GraphRunner(model, cache, tokens=(1,))

        def eager(cache=cache, lengths=lengths, step=step):
            cache.rollback(lengths)
            return model(step, cache)

        def graphed(cache=cache, lengths=lengths, step=step, runner=runner):
            cache.rollback(lengths)
            return runner(step)

        with torch.no_grad():
            difference = float((graphed().float() - eager().float()).abs().max())
            eager_seconds = _median_seconds(eager, device, settings.repeats)
            graph_seconds = _median_seconds(graphed, device, settings.repeats)
        if difference > (1e-4 if settings.dtype == torch.float32 else 5e-2):
            raise AssertionError(f"graph replay differs from the eager pass by {difference:.3g} at batch {batch}")
        out[f"batch_{batch}"] = {"max_diff": difference, "eager_ms": 1e3 * eager_seconds,
                                 "graph_ms": 1e3 * graph_seconds, "speedup": eager_seconds / graph_seconds,
                                 "replays": runner.num_replays, "captured": runner.eager_static is False}
    return out


# ====================================================================== pass costs
def _build(model_class, config, device: torch.device, dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the serving dtype: an 8B model in fp32 would not be needed
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def measure_passes(device: torch.device, settings: GpuSettings) -> dict:
    target = _build(Qwen3ForCausalLM, settings.target, device, settings.dtype)
    table = measure_target(target, settings.batches, settings.tokens, context=settings.context,
                           repeats=settings.repeats)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from specd.drafters.d3d import D3DDrafter

    drafter_model = _build(D3DModel, settings.drafter, device, settings.dtype)
    draft, speculate, calls = measure_drafter(
        drafter_model, settings.drafter_batches, block_size=settings.block_size,
        speculate_blocks=(settings.block_size,), budgets=(1, 2, 4), tails=(2, 128), context=settings.context,
        repeats=settings.repeats, make_drafter=lambda batch: D3DDrafter(drafter_model, max_num_seqs=batch, device=device))
    return {"target": {"name": "qwen3-8b-shaped, random weights", "context": settings.context, **table.to_json()},
            "drafter": {"name": "d3d for qwen3-8b, random weights", "group_sizes": list(settings.drafter.group_sizes),
                        "calls": [c for c in calls if c["call"] == "draft"], **draft.to_json()},
            "speculate": {"calls": [c for c in calls if c["call"] == "speculate"], **speculate.to_json()}}


def project(passes: dict, acceptance_path: Path, settings: GpuSettings) -> dict:
    """The measured tables with the zoo's acceptance: simulated plain vs async D3D tokens/s."""
    source = load_profile(acceptance_path)
    data = {**passes, "block_size": source.block_size, "acceptance_per_pos": source.acceptance_per_pos,
            "hit_rate": source.hit_rate, "rpc_seconds": 0.0002, "padded_rows": True,
            "notes": f"GPU pass costs measured by specd bench gpu; acceptance and hit rate from {acceptance_path.name}; "
                     "rpc 0.2 ms (one drafter round trip within a node)"}
    profile = parse_profile(data, source="the GPU profile")
    rows = []
    for concurrency in settings.concurrency:
        workload = Workload(requests=max(4 * concurrency, 16), concurrency=concurrency,
                            prompt_tokens=Lengths.parse(256), output_tokens=Lengths.parse(256))
        plain = simulate(profile, SimConfig(mode="plain", drafters=0, block_size=0, max_num_seqs=64), workload)
        fast = simulate(profile, SimConfig(mode="async", drafters=1, block_size=settings.block_size, max_num_seqs=64),
                        workload)
        rows.append({"concurrency": concurrency, "plain_tokens_per_s": plain.tokens_per_s,
                     "async_tokens_per_s": fast.tokens_per_s, "speedup": fast.tokens_per_s / plain.tokens_per_s,
                     "tau": fast.tau})
    return {"profile": data, "rows": rows, "acceptance_from": str(acceptance_path)}


# ====================================================================== the run
def run_all(settings: GpuSettings, acceptance_path: Path) -> dict:
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: run this on a GPU machine, or pass --device cpu --tiny to check the script")
    record: list[dict] = []
    env = _step(record, "environment", lambda: environment(device))
    _step(record, "kernel rejection sampler", lambda: check_rejection(device, settings))
    _step(record, "kernel e2e-tv forward+backward", lambda: check_e2e_tv(device, settings))
    _step(record, "nccl broadcast" if device.type == "cuda" else "gloo broadcast", lambda: check_nccl(device))
    _step(record, "cuda graphs decode" if device.type == "cuda" else "static decode pass", lambda: check_graphs(device, settings))
    passes = _step(record, "pass costs", lambda: measure_passes(device, settings))
    projection = None
    if passes["ok"]:
        projection = _step(record, "projection", lambda: project(
            {k: passes[k] for k in ("target", "drafter", "speculate")}, acceptance_path, settings))
    return {"environment": env, "steps": record, "projection": projection if projection and projection["ok"] else None}


def format_summary(result: dict) -> str:
    lines = [f"{'check':<34}{'ok':>4}{'detail':>60}"]
    for step in result["steps"]:
        if "kernel_ms" in step:
            detail = f"max diff {step['max_diff']:.2g}, kernel {step['kernel_ms']:.3f} ms vs torch {step['torch_ms']:.3f} ms ({step['speedup']:.2f}x)"
        elif step["ok"] and "batch_16" in step:
            graphs = step["batch_16"]
            detail = f"batch 16: eager {graphs['eager_ms']:.2f} ms, graph {graphs['graph_ms']:.2f} ms ({graphs['speedup']:.2f}x)"
        elif not step["ok"]:
            detail = step["error"][:58]
        else:
            detail = f"{step['seconds']} s"
        lines.append(f"{step['name']:<34}{'yes' if step['ok'] else 'NO':>4}{detail:>60}")
    passes = next((s for s in result["steps"] if s["name"] == "pass costs" and s["ok"]), None)
    if passes:
        target = passes["target"]
        lines.append("\ntarget pass (ms), rows = batch, columns = new tokens")
        lines.append(f"{'batch':>6}" + "".join(f"{t:>8}" for t in target["tokens"]))
        for batch, row in zip(target["batch"], target["seconds"]):
            lines.append(f"{batch:>6}" + "".join(f"{1e3 * s:>8.2f}" for s in row))
    if result.get("projection"):
        lines.append("\nprojected (simulator, 1 verifier + 1 drafter GPU): tokens/s")
        lines.append(f"{'conc':>6}{'plain':>10}{'async D3D':>11}{'speedup':>9}{'tau':>6}")
        for row in result["projection"]["rows"]:
            lines.append(f"{row['concurrency']:>6}{row['plain_tokens_per_s']:>10.0f}{row['async_tokens_per_s']:>11.0f}"
                         f"{row['speedup']:>8.2f}x{row['tau']:>6.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: checks the script itself)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and shapes (seconds; for CPU runs)")
    parser.add_argument("--acceptance", default="",
                        help="profile whose acceptance and hit rate the projection uses (default: out/bench/profile.json "
                             "when present, else the bundled qwen3-8b-h200 example's stated assumptions)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/bench"), help="directory for gpu.json (default $OUT)")


def run(args: argparse.Namespace) -> int:
    settings = GpuSettings.tiny(args.device) if args.tiny else GpuSettings(device=args.device)
    acceptance = Path(args.acceptance) if args.acceptance else Path("out/bench/profile.json")
    if not acceptance.is_file():
        if args.acceptance:
            raise ValueError(f"no profile at {acceptance}: write one with `specd bench profile`")
        acceptance = EXAMPLE_PROFILE
    result = run_all(settings, acceptance)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(format_summary(result))
    print(f"wrote {path}")
    return 0 if all(s["ok"] for s in result["steps"]) else 1
