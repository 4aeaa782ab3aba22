"""`specd bench opd`'s harness on debug models with a seconds-long budget: it runs end to end and reports sanely."""

from __future__ import annotations

import json

import torch

from specd.bench.opd import RUNS, OPDBenchSettings, format_report, run_bench, write
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.train.specopd import Trajectory

VOCAB = FLAVOURS["debug"].vocab_size


def test_bench_opd_harness_on_debug_models(tmp_path):
    torch.manual_seed(0)
    target, start = Qwen3ForCausalLM(FLAVOURS["debug"]).eval(), D3DModel(D3D_FLAVOURS["debug"]).eval()
    generator = torch.Generator().manual_seed(1)
    trajectories = [Trajectory(prompt=torch.randint(7, VOCAB, (6,), generator=generator).tolist(),
                               response=torch.randint(7, VOCAB, (16,), generator=generator).tolist()) for _ in range(6)]
    prompts = {d: [torch.randint(7, VOCAB, (5,), generator=generator).tolist() for _ in range(2)] for d in ("code", "math")}
    settings = OPDBenchSettings(budget_seconds=1.0, eval_points=2, max_tokens=8, batch_size=2, anchors_per_seq=2,
                                ablation_branches=(1, 4), throughput_tokens=64, threads=1)
    start_weights = {k: v.clone() for k, v in start.state_dict().items()}
    report = run_bench(settings, target, start, trajectories, prompts, log=lambda _: None)

    assert [r.name for r in report.runs] == [name for name, _, _ in RUNS]
    assert next(r for r in report.runs if r.name == "offline-kl").loss == "kl"
    assert all(r.num_supervised_tokens >= 64 for r in report.throughput) and report.throughput_ratio > 0
    for row in [*report.runs, *report.ablation]:
        assert row.seconds >= settings.budget_seconds and row.steps > 0 and set(row.tau) == {"code", "math"}
        assert len(row.curve) == 1 + settings.eval_points and all(1.0 <= t <= settings.block_size + 1 for _, t in row.curve)
    assert [r.branches_per_anchor for r in report.ablation] == [1, 4]
    # Every run starts from the same drafter, which the benchmark never changes.
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in start_weights.items())

    table = format_report(report)
    assert "SpecOPD / sequential OPD" in table and "goals:" in table
    paths = write(report, settings, tmp_path, None)
    assert json.loads(paths[0].read_text())["report"]["throughput_ratio"] == report.throughput_ratio
    assert all(p.stat().st_size > 0 for p in paths)
