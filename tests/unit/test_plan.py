"""Profiles load or say what is wrong; the planner finds optima we can work out by hand."""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path

import helm_python as helm
import pytest
import torch
import yaml

from specd.bench.profile import ProfileSettings, format_profile, measure_profile
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.plan import planner
from specd.plan.compare import compare_serve, deployment_config, format_compare
from specd.plan.planner import PlanSettings, Split, format_table, parse_ratio, plan, splits, values_override
from specd.plan.profile import bench_acceptance, load_profile, parse_profile, with_acceptance

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "specd" / "plan" / "profiles" / "qwen3-8b-h200.json"
CHART = REPO / "deploy" / "k8s" / "specd"


def table(cost, batches=(1, 4, 16, 64), tokens=(1, 16, 256)) -> dict:
    return {"batch": list(batches), "tokens": list(tokens), "seconds": [[cost(b, t) for t in tokens] for b in batches]}


def synthetic(**extra) -> dict:
    return {
        "target": table(lambda b, t: 0.010), "drafter": table(lambda b, t: 1e-6), "block_size": 16,
        "acceptance_per_pos": [0.9 ** (i + 1) for i in range(16)], "hit_rate": 1.0, "rpc_seconds": 0.0,
        "padded_rows": False, **extra,
    }


# ---------------------------------------------------------------------------- profiles
def _without(data: dict, dotted: str) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    node = data
    for name in parents:
        node = node[name]
    del node[last]
    return data


@pytest.mark.parametrize("field", ["target", "drafter", "target.seconds", "drafter.batch", "block_size",
                                   "acceptance_per_pos", "hit_rate"])
def test_a_missing_field_is_named(field):
    with pytest.raises(ValueError, match=rf"field '{field}' is missing"):
        parse_profile(_without(synthetic(), field))


@pytest.mark.parametrize("change, field", [
    ({"target": {"batch": [4, 1], "tokens": [1], "seconds": [[1.0], [1.0]]}}, "target.batch"),
    ({"target": {"batch": [1, 2], "tokens": [1], "seconds": [[1.0]]}}, "target.seconds"),
    ({"drafter": {"batch": [1], "tokens": [1], "seconds": [[-1.0]]}}, "drafter.seconds"),
    ({"acceptance_per_pos": [0.5, 1.5]}, "acceptance_per_pos"),
    ({"hit_rate": "high"}, "hit_rate"),
    ({"block_size": 0}, "block_size"),
    ({"version": 2}, "version"),
    ({"by_block": {"8": {"hit_rate": 0.5}}}, "by_block.8.acceptance_per_pos"),
    ({"serving": {"verifier": {"rows": [1, 4], "overhead_seconds": [0.001, 0.002]}}}, "serving.verifier.target_scale"),
    ({"serving": {"verifier": {"rows": [4, 1], "overhead_seconds": [0.001, 0.002], "target_scale": [1, 1]}}},
     "serving.verifier.rows"),
    ({"serving": {"verifier": {"rows": [1, 4], "overhead_seconds": [0.001], "target_scale": [1, 1]}}},
     "serving.verifier"),
    ({"serving": {"verifier": {"rows": [1], "overhead_seconds": [-0.001], "target_scale": [1]}}},
     "serving.verifier.overhead_seconds"),
    ({"tensor_parallel": {"1": {"pass_scale": 1.0}}}, "tensor_parallel.1"),
    ({"tensor_parallel": {"2": {}}}, "tensor_parallel.2.pass_scale"),
    ({"tensor_parallel": {"2": {"pass_scale": 0}}}, "tensor_parallel.2.pass_scale"),
    ({"confidence_per_pos": [0.9, 1.2]}, "confidence_per_pos"),
    ({"block_samples": {"confidence": [[0.5] * 16], "accepted": [1, 2]}}, "block_samples"),
    ({"block_samples": {"confidence": [[0.5] * 3], "accepted": [1]}}, "block_samples.confidence"),
    ({"block_samples": {"confidence": [[0.5] * 16], "accepted": [17]}}, "block_samples.accepted"),
])
def test_a_bad_field_is_named(change, field):
    with pytest.raises(ValueError, match=rf"field '{field}'"):
        parse_profile({**synthetic(), **change})


def test_a_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match="specd bench profile"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_profile(tmp_path / "bad.json")


def test_costs_interpolate_between_points_and_extend_past_the_last():
    profile = parse_profile(synthetic(target=table(lambda b, t: 0.001 * b + 0.0001 * t, batches=(1, 4), tokens=(1, 9))))
    cost = profile.target
    assert cost(4, 9) == pytest.approx(0.0049)  # on the grid
    assert cost(2, 5) == pytest.approx(0.002 + 0.0005)  # bilinear inside
    assert cost(8, 17) == pytest.approx(0.008 + 0.0017)  # linear past the last point, both axes
    assert cost(1, 0) == cost(1, 1)  # clamped below
    noisy = parse_profile(synthetic(target={"batch": [1], "tokens": [1, 9], "seconds": [[0.005, 0.004]]})).target
    assert noisy(1, 100) == 0.004  # a last segment sloping down does not extend below the edge


def test_acceptance_past_the_measured_block_carries_the_last_rate_on():
    profile = parse_profile(synthetic(acceptance_per_pos=[0.8, 0.4, 0.5], block_size=3))
    assert profile.acceptance(2) == [0.8, 0.4]
    assert profile.acceptance(5) == pytest.approx([0.8, 0.4, 0.4, 0.4, 0.4])  # made non-increasing, then ratio 1


def test_the_example_profile_loads_and_states_its_assumptions():
    profile = load_profile(EXAMPLE)
    assert "assumption" in profile.notes.lower()
    # Bandwidth-bound small batches: ~16 GB at ~4 TB/s is 4-5 ms, and more tokens cost more once compute-bound.
    assert 0.004 <= profile.target(1, 1) <= 0.006
    assert profile.target(64, 512) > 10 * profile.target(64, 1)
    assert profile.to_json() == json.loads(EXAMPLE.read_text())  # typed throughout, nothing dropped or added


def test_a_measured_profile_loads_back():
    torch.manual_seed(0)
    target, drafter = Qwen3ForCausalLM(FLAVOURS["debug"]).eval(), D3DModel(D3D_FLAVOURS["debug"]).eval()
    settings = ProfileSettings(batches=(1, 2), tokens=(1, 9), budgets=(1, 2), tails=(2, 16), context=16, repeats=1,
                               block_size=4, extra_blocks=(2,), acceptance_batches=(1, 2), max_tokens=6)
    prompts = [torch.randint(7, 512, (9,)).tolist() for _ in range(3)]
    measured = measure_profile(target, drafter, prompts, settings)
    data = json.loads(json.dumps(measured.to_json()))
    # What it was built with, and nothing it was not (no services here: no serving block).
    assert set(data) >= {"version", "machine", "target", "drafter", "speculate", "block_samples", "by_block",
                         "overhead", "workload"} and "serving" not in data
    profile = parse_profile(data)
    assert profile.to_json() == data  # the JSON loads back to the same profile
    assert profile.target.tokens == [1, 9]
    assert profile.drafter.tokens == [2 + 5, 16 + 5]  # Draft: unseen tokens + the 5-mask group for block 4
    # Speculate: block + c * (1 + group), for blocks 4 and 2 (both use the 5-mask group), c = 1, 2.
    assert profile.speculate.tokens == [2 + 6, 4 + 6, 2 + 12, 4 + 12]
    assert len(profile.acceptance_per_pos) == 4 and sorted(profile.by_block) == [2, 4]
    assert len(profile.workload.output_tokens) == 3 and max(profile.workload.output_tokens) <= 6
    print(format_profile(profile))


# ---------------------------------------------------------------------------- planning
def settings(**changes) -> PlanSettings:
    base = {"gpus": 6, "concurrency": 96, "block_sizes": (4, 16), "requests": 192, "prompt_tokens": "16",
            "output_tokens": "160", "max_num_seqs": 16, "adaptive_block": False}
    return PlanSettings(**{**base, **changes})


def test_a_cheap_drafter_gets_one_replica_and_the_longest_block():
    """A free drafter and a flat pass cost: every GPU but one verifies, blocks as long as they go."""
    result = plan(parse_profile(synthetic()), settings(), progress=False)
    best = result.best
    assert (best.split, best.block_size, best.mode) == (Split(verifiers=5, drafters=1), 16, "async")
    assert best.result.tokens_per_s > 4 * result.plain.result.tokens_per_s


def test_a_drafter_as_busy_as_a_verifier_gets_one_replica_each():
    """A drafter replica needs as long for one verifier's 16 sequences as the target pass: the
    throughput goes as min(verifiers, drafters), so 8 GPUs split 4:4."""
    profile = parse_profile(synthetic(drafter=table(lambda b, t: 0.010 * b / 16), acceptance_per_pos=[1.0] * 16))
    result = plan(profile, settings(gpus=8, concurrency=128, requests=256), progress=False)
    rates = {(r.split.verifiers, r.split.drafters): r.result.tokens_per_s for r in result.rows if r.block_size == 16}
    print({k: round(v) for k, v in rates.items()})
    assert (result.best.split, result.best.block_size) == (Split(verifiers=4, drafters=4), 16)
    assert rates[(4, 4)] > 1.2 * max(rates[(3, 5)], rates[(5, 3)])


def test_plain_decoding_wins_when_speculation_does_not_pay():
    profile = parse_profile(synthetic(acceptance_per_pos=[0.0] * 16, hit_rate=0.0))
    result = plan(profile, settings(output_tokens="48", requests=96), progress=False)
    assert result.best.mode == "plain" and result.best.split == Split(verifiers=6, drafters=0)


def test_a_tpot_slo_picks_the_fastest_split_that_meets_it():
    # Slow drafter round trips and a modest tau: TPOT and throughput disagree across splits.
    profile = parse_profile(synthetic(acceptance_per_pos=[0.55 ** (i + 1) for i in range(16)], hit_rate=0.5,
                                      rpc_seconds=0.010))
    short = {"output_tokens": "64", "requests": 96}
    free = plan(profile, settings(**short), progress=False)
    tpots = sorted(r.result.tpot_p99 for r in free.rows)
    slo = tpots[len(tpots) // 2]
    bounded = plan(profile, settings(tpot_slo=slo, **short), progress=False)
    assert [r.meets_slo for r in bounded.rows] == [r.result.tpot_p99 <= slo for r in bounded.rows]
    assert not all(r.meets_slo for r in bounded.rows)
    assert bounded.best.result.tokens_per_s == max(r.result.tokens_per_s for r in bounded.rows if r.meets_slo)
    with pytest.raises(ValueError, match="no split meets TPOT p99"):
        plan(profile, settings(tpot_slo=1e-6, gpus=2, **short), progress=False)


def test_splits_fill_the_budget():
    assert splits(settings(gpus=4)) == [Split(verifiers=v, drafters=4 - v) for v in (1, 2, 3)]
    assert splits(settings(gpus=10, tensor_parallel=2, gpus_per_drafter=1)) == [
        Split(verifiers=v, drafters=10 - 2 * v) for v in (1, 2, 3, 4)]
    assert splits(settings(gpus=12, ratios=("1:2", "1:1", "0.5"))) == [Split(verifiers=8, drafters=4),
                                                                       Split(verifiers=6, drafters=6)]
    big = splits(settings(gpus=64))
    assert len(big) >= 8 and all(s.verifiers + s.drafters == 64 for s in big)


@pytest.mark.parametrize("ratio", ["1:0", "-1", "a:b", "", "100"])
def test_nonsense_ratios_are_refused(ratio):
    with pytest.raises(ValueError, match="bad ratio"):
        parse_ratio(ratio)


def test_bad_budgets_and_loads_are_refused():
    profile = parse_profile(synthetic())
    with pytest.raises(ValueError, match="cannot hold one verifier replica"):
        plan(profile, settings(gpus=1, tensor_parallel=2), progress=False)
    with pytest.raises(ValueError, match="exactly one of --concurrency"):
        plan(profile, settings(rate=5.0), progress=False)
    with pytest.raises(ValueError, match="none of the ratios 4:1 fits"):
        plan(profile, settings(gpus=3, ratios=("4:1",)), progress=False)
    with pytest.raises(ValueError, match="no room for a drafter"):
        plan(profile, settings(gpus=1, plain=False), progress=False)
    with pytest.raises(ValueError, match="block 32 is above the drafter's largest block 16"):
        plan(parse_profile(synthetic(drafter={**table(lambda b, t: 1e-6), "group_sizes": [5, 9, 17]})),
             settings(block_sizes=(8, 32)), progress=False)


def test_the_values_override_is_what_the_chart_reads():
    result = plan(parse_profile(synthetic()), settings(), progress=False)
    values = yaml.safe_load(values_override(result, settings(), "p.json"))
    assert values == {"drafter": {"replicas": 1},
                      "verifier": {"replicas": 5, "tensorParallel": 1,
                                   "extraArgs": ["--block-size", "16", "--max-num-seqs", "16"]}}


def test_a_tensor_parallel_override_renders_with_the_chart():
    """8 GPUs, 2 to a data-parallel trainer, verifiers of 2 ranks: the chart's pods ask for exactly
    the GPUs the plan counted, and launch the ranks."""
    chosen = settings(gpus=8, trainer_gpus=2, tensor_parallel=2)
    result = plan(parse_profile(synthetic()), chosen, progress=False)
    values = yaml.safe_load(values_override(result, chosen, "p.json"))
    assert values["verifier"]["tensorParallel"] == 2 and values["trainer"]["dataParallel"] == 2
    with helm.Chart.load(CHART) as chart:  # validates the values against the chart's schema too
        rendered = chart.render(values=values, name="specd", namespace="inference", is_install=True)
    pods = {d["metadata"]["name"].removeprefix("specd-"): d for path, text in rendered.items()
            if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment"}
    specs = {role: pods[role]["spec"]["template"]["spec"]["containers"][0] for role in ("drafter", "verifier", "trainer")}
    gpus = {role: specs[role]["resources"]["limits"]["nvidia.com/gpu"] * pods[role]["spec"]["replicas"]
            for role in specs}
    assert gpus == {"drafter": result.best.split.drafters, "verifier": 2 * result.best.split.verifiers, "trainer": 2}
    assert sum(gpus.values()) <= 8
    assert specs["verifier"]["command"][0] == specs["trainer"]["command"][0] == "torchrun"
    assert "--tensor-parallel=2" in specs["verifier"]["args"] and "--data-parallel=2" in specs["trainer"]["args"]


# ---------------------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize(("ranks", "extra", "allreduce", "pass_seconds", "how"), [
    (1, {}, 0.001, 0.010, None),
    (2, {}, 0.0, 0.005, "assumed"),
    (2, {}, 0.001, 0.006, "assumed"),
    (4, {}, 0.0005, 0.003, "assumed"),
    (2, {"tensor_parallel": {"2": {"pass_scale": 0.7}}}, 0.001, 0.007, "measured"),
    (4, {"tensor_parallel": {"2": {"pass_scale": 0.7}}}, 0.0, 0.0025, "assumed"),  # measured for 2 ranks only
])
def test_plain_decoding_on_tensor_parallel_verifiers_matches_the_hand_count(ranks, extra, allreduce, pass_seconds, how):
    """Plain decoding, no overheads: TPOT is one pass, and tokens/s is the busy rows per pass
    time, the rows being min(clients, verifiers x max_num_seqs), verifiers = GPUs / ranks."""
    chosen = settings(gpus=8, tensor_parallel=ranks, tp_allreduce_seconds=allreduce)
    result = plan(parse_profile(synthetic(**extra)), chosen, progress=False)
    plain = result.plain
    assert plain.split == Split(verifiers=8 // ranks, drafters=0)
    assert plain.result.tpot_p50 == pytest.approx(pass_seconds)
    rows = min(chosen.concurrency, 8 // ranks * chosen.max_num_seqs)
    assert plain.result.tokens_per_s == pytest.approx(rows / pass_seconds, rel=0.01)
    assert all(row.split.verifiers * ranks + row.split.drafters <= 8 for row in result.rows)
    if how is None:
        assert not result.notes
    else:  # the table says what the pass cost rests on
        assert how in result.notes[0] and format_table(result).startswith(result.notes[0])


def test_the_trainers_gpus_come_off_the_budget():
    chosen = settings(gpus=8, trainer_gpus=3)
    assert splits(chosen) == [Split(verifiers=v, drafters=5 - v) for v in (1, 2, 3, 4)]
    result = plan(parse_profile(synthetic()), chosen, progress=False)
    assert result.plain.split == Split(verifiers=5, drafters=0)
    assert any("trainer: 3 GPUs" in note for note in result.notes)


@pytest.mark.parametrize(("changes", "message"), [
    ({"tensor_parallel": 0}, "power of two >= 1"),
    ({"tensor_parallel": 3}, "power of two >= 1"),
    ({"gpus": 3, "tensor_parallel": 4}, "cannot hold one verifier replica"),
    ({"gpus": 4, "tensor_parallel": 2, "trainer_gpus": 3}, "after the trainer's 3: raise --gpus, lower"),
    ({"trainer_gpus": -1}, "--trainer-gpus must be >= 0"),
    ({"tp_allreduce_seconds": -1e-6}, "--tp-allreduce-us must be >= 0"),
])
def test_bad_tensor_parallel_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(parse_profile(synthetic()), settings(**changes), progress=False)


def test_gpus_per_verifier_is_the_older_name_of_tensor_parallel(tmp_path, capsys):
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps(synthetic()))
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    common = ["--profile", str(profile_path), "--gpus", "4", "--concurrency", "16", "--requests", "32",
              "--block-sizes", "4", "--output-tokens", "32", "--levels", "", "--out", str(tmp_path / "values.yaml")]
    assert planner.run(parser.parse_args([*common, "--gpus-per-verifier", "2"])) == 0
    assert yaml.safe_load((tmp_path / "values.yaml").read_text())["verifier"]["tensorParallel"] == 2
    assert "tensor parallel 2 (2 GPUs each)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="disagree"):
        planner.run(parser.parse_args([*common, "--gpus-per-verifier", "2", "--tensor-parallel", "4"]))


def test_the_command_writes_the_override_and_a_plot(tmp_path, capsys):
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps(synthetic()))
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    args = parser.parse_args(["--profile", str(profile_path), "--gpus", "3", "--concurrency", "32", "--requests", "64",
                              "--block-sizes", "4,8", "--output-tokens", "64", "--prompt-tokens", "16",
                              "--levels", "0.5,1", "--out", str(tmp_path / "values.yaml"),
                              "--json", str(tmp_path / "plan.json")])
    assert planner.run(args) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"chosen: (\d+) verifiers \+ (\d+) drafters, block (\d+)", out)
    assert chosen, out
    assert int(chosen[1]) + int(chosen[2]) == 3 and chosen[3] in ("4", "8")
    assert yaml.safe_load((tmp_path / "values.yaml").read_text())["verifier"]["replicas"] == int(chosen[1])
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((tmp_path / "plan.json").read_text())["rows"]) == 1 + 2 * 2
    bad = parser.parse_args(["--profile", str(tmp_path / "missing.json"), "--gpus", "3", "--concurrency", "4"])
    with pytest.raises(ValueError, match="no profile at"):
        planner.run(bad)


# ---------------------------------------------------------------------------- against bench serve
def test_bench_serve_deployments_map_onto_simulated_ones():
    settings = {"block_size": 4, "max_num_seqs": 64}
    plain, fast = deployment_config("plain", settings), deployment_config("async 2:1", settings)
    assert (plain.mode, plain.drafters) == ("plain", 0)
    assert (fast.mode, fast.drafters, fast.verifiers, fast.block_size, fast.max_num_seqs) == ("async", 2, 1, 4, 64)
    with pytest.raises(ValueError, match="unknown bench serve deployment 'turbo'"):
        deployment_config("turbo", settings)


def test_compare_serve_against_an_analytic_plain_run(tmp_path, capsys):
    """Plain decoding, 16 padded rows at 10 ms a pass, 4 clients: 400 tokens/s, 10 ms TPOT."""
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps(synthetic(padded_rows=True, workload={"prompt_tokens": [8], "output_tokens": [40]})))
    serve = {"settings": {"max_tokens": 32, "block_size": 8, "max_num_seqs": 16},
             "rows": [{"deployment": "plain", "concurrency": 4, "requests": 16, "tokens_per_s": 400.0,
                       "tpot_p50": 0.010, "ttft_p50": 0.010, "tau": 1.0, "hit_rate": 0.0}]}
    (row,) = compare_serve(parse_profile(json.loads(profile_path.read_text())), serve, seeds=1)
    assert row.ratio == pytest.approx(1.0, rel=0.01)  # outputs capped at the run's max_tokens (32)
    assert row.simulated_tpot_p50 == pytest.approx(0.010)
    serve["rows"][0]["runs"] = [380.0, 400.0, 460.0]  # a --repeats 3 run: the row is the median round
    serve_path = tmp_path / "serve.json"
    serve_path.write_text(json.dumps(serve))
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    assert planner.run(parser.parse_args(["--profile", str(profile_path), "--compare-serve", str(serve_path)])) == 0
    out = capsys.readouterr().out
    assert "within 15%: 1/1" in out and "20%" in out  # the rounds' spread, (460 - 380) / 400
    written = json.loads((tmp_path / "serve_compare.json").read_text())
    assert written["within_15_percent"] == 1 and written["rows"][0]["measured_runs"] == [380.0, 400.0, 460.0]
    assert (tmp_path / "serve_compare.png").stat().st_size > 0
    with pytest.raises(ValueError, match="not a `specd bench serve` JSON"):
        compare_serve(parse_profile(synthetic()), {"rows": 3})


def test_the_compare_shows_the_profile_s_own_measurement_of_a_calibrated_deployment():
    """A deployment `specd bench profile` calibrated (plain, async 1:1, sync 1:1) shows the tokens/s
    it measured there at the same concurrency beside bench serve's; the others show none."""
    serving = {"verifier": {"rows": [1.0, 3.9], "overhead_seconds": [0.0, 0.0], "target_scale": [1.0, 1.0],
                            "concurrency": [1, 4], "tokens_per_s": [90.0, 352.0]}}
    profile = parse_profile(synthetic(serving=serving))
    rows = [{"deployment": name, "concurrency": 4, "requests": 16, "tokens_per_s": 400.0, "tpot_p50": 0.01,
             "ttft_p50": 0.01} for name in ("plain", "async 2:1")]
    plain, other = compare_serve(profile, {"settings": {"max_tokens": 32}, "rows": rows}, seeds=1)
    assert plain.calibrated_tokens_per_s == 352.0 and other.calibrated_tokens_per_s == 0.0
    assert "profile/meas 0.88 to 0.88" in format_compare([plain, other])


def test_a_trace_with_arrivals_is_the_load(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"arrival_seconds": i * 0.05, "prompt_tokens": 16, "output_tokens": 48}) + "\n"
                            for i in range(40)))
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps(synthetic()))
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    args = parser.parse_args(["--profile", str(profile_path), "--gpus", "2", "--trace", str(path), "--block-sizes", "4",
                              "--out", str(tmp_path / "values.yaml")])
    assert planner.run(args) == 0
    assert "# specd plan: 2 GPUs, a trace" in (tmp_path / "values.yaml").read_text()
    with pytest.raises(ValueError, match="exactly one of --concurrency C"):
        planner.run(parser.parse_args(["--profile", str(profile_path), "--gpus", "2", "--trace", str(path),
                                       "--concurrency", "4"]))


def test_under_open_loop_arrivals_the_lowest_tpot_that_keeps_up_wins():
    result = plan(parse_profile(synthetic()), settings(concurrency=0, rate=20.0, requests=120), progress=False)
    best_rate = max(r.result.tokens_per_s for r in result.rows)
    keeping_up = [r for r in result.rows if r.result.tokens_per_s >= 0.98 * best_rate]
    assert len(keeping_up) > 1  # 20 requests/s is light work for any split here
    assert result.best.result.tpot_p99 == min(r.result.tpot_p99 for r in keeping_up)


def test_the_plan_goes_past_the_ratios_tried_while_the_best_sits_at_their_edge():
    """A drafter replica needs five times a verifier's pass for one verifier's sequences: the
    optimum is ~5:1, past the default ratios (up to 3:1), and the planner goes on to find it."""
    profile = parse_profile(synthetic(drafter=table(lambda b, t: 0.050 * b / 16), acceptance_per_pos=[1.0] * 16))
    result = plan(profile, settings(gpus=60, concurrency=480, requests=960, block_sizes=(16,), output_tokens="64"),
                  progress=False)
    best = result.best.split
    assert best.drafters / best.verifiers > 3, best
    assert any("until one no longer gained" in note for note in result.notes)
    tried = sorted({r.split.drafters / r.split.verifiers for r in result.rows if r.mode != "plain"})
    assert tried[-1] > best.drafters / best.verifiers  # it stopped one step past the optimum
    # With the ratios given, the planner keeps to them.
    given = plan(profile, settings(gpus=60, concurrency=480, requests=960, block_sizes=(16,), output_tokens="64",
                                   ratios=("1:1", "3:1")), progress=False)
    assert {(r.split.drafters, r.split.verifiers) for r in given.rows if r.mode != "plain"} == {(30, 30), (45, 15)}


def test_calibration_rounds_become_the_median_round_per_level():
    from specd.bench.profile import median_rounds

    def round_(scale: float) -> dict:
        return {"concurrency": [1, 16], "requests": [16, 64], "rows": [1.0, 14.0 * scale], "passes": [900, 300],
                "target_seconds": [0.003 * scale, 0.02 * scale], "overhead_seconds": [0.001, 0.004 * scale],
                "tokens_per_s": [300 / scale, 700 / scale], "trace": [[[10, 64]], [[12, 64]]]}

    merged = median_rounds([round_(1.0), round_(2.0), round_(1.1)])  # the middle round was on a slow minute
    assert merged["target_seconds"] == pytest.approx([0.0033, 0.022])
    assert merged["tokens_per_s"] == pytest.approx([300 / 1.1, 700 / 1.1])
    assert merged["overhead_seconds"] == pytest.approx([0.001, 0.0044])
    assert merged["concurrency"] == [1, 16] and merged["trace"] == [[[10, 64]], [[12, 64]]]
    assert merged["rounds_target_seconds"][0] == pytest.approx([0.003, 0.006, 0.0033])
    assert median_rounds([round_(1.0)])["target_seconds"] == [0.003, 0.02]


# ---------------------------------------------------------------------------- a projection of measured acceptance
def _decode_rows(method: str, fixed: list[list[float]], adaptive: list[float], hit_rate: float) -> list[dict]:
    """`specd bench decode` JSON rows: one fixed-block row per domain, one cost-model row."""
    rows = [{"method": method, "domain": f"d{i}", "temperature": 0.0, "batch": 1, "block": len(acc),
             "fixed_block": True, "accept_per_pos": acc, "tau": 1 + sum(acc), "hit_rate": hit_rate}
            for i, acc in enumerate(fixed)]
    rows.append({"method": method, "domain": "d0", "temperature": 0.0, "batch": 1, "block": len(adaptive),
                 "fixed_block": False, "accept_per_pos": adaptive, "tau": 1 + sum(adaptive), "hit_rate": 0.1})
    return rows


def test_acceptance_from_a_decode_bench_is_the_fixed_block_mean_of_the_domains(tmp_path):
    bench = {"rows": _decode_rows("d3d-async", [[0.8, 0.6, 0.4, 0.2], [0.6, 0.4, 0.2, 0.0]], [0.9, 0.9], 0.7)}
    measured = bench_acceptance(bench, method="d3d-async")
    assert measured["block_size"] == 4 and measured["fixed_block"] and measured["hit_rate"] == pytest.approx(0.7)
    assert measured["acceptance_per_pos"] == pytest.approx([0.7, 0.5, 0.3, 0.1])
    profile = with_acceptance(load_profile(EXAMPLE), measured, label="test")
    assert profile.acceptance(4) == pytest.approx([0.7, 0.5, 0.3, 0.1]) and profile.hit_rate == pytest.approx(0.7)
    assert profile.by_block == {} and profile.notes.startswith("PROJECTION")
    with pytest.raises(ValueError, match="no rows of method 'dflash'.*--fixed-block"):
        bench_acceptance(bench, method="dflash")


def test_a_better_measured_acceptance_projects_a_larger_speedup(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    speedups = []
    for name, rate in (("weak", 0.3), ("strong", 0.9)):
        acc = [rate ** (i + 1) for i in range(8)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"rows": _decode_rows("d3d-sync", [acc, acc], acc, float("nan"))}))
        args = parser.parse_args(["--profile", str(EXAMPLE), "--gpus", "2", "--concurrency", "1", "--requests", "16",
                                  "--block-sizes", "4,8", "--output-tokens", "64", "--prompt-tokens", "32",
                                  "--mode", "sync", "--levels", "", "--acceptance-from", str(path),
                                  "--acceptance-method", "d3d-sync", "--out", str(tmp_path / f"{name}.yaml")])
        assert planner.run(args) == 0
        out = capsys.readouterr().out
        assert "PROJECTION, not a measurement" in out
        speedups.append(float(re.search(r"\(([\d.]+)x plain\)", out).group(1)))
    assert speedups[1] > speedups[0] * 1.5, speedups
