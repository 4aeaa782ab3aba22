"""The pipeline simulator against what can be worked out by hand.

Synthetic profiles with constant or linear costs make the answers analytic: plain decoding at
batch b with pass cost t serves b / t tokens/s; a free drafter that always hits multiplies that
by τ; sync mode adds the Draft round trip to every step; one request's latencies are sums of
the hops and passes on its path.
"""

from __future__ import annotations

import itertools
import time

import pytest

from specd.plan.profile import ProfileError, parse_profile
from specd.plan.sim import Lengths, SimConfig, TraceRequest, Workload, load_trace, replayed, simulate


def table(cost, batches=(1, 2, 4, 8, 16, 32, 64), tokens=(1, 16, 256, 2048)) -> dict:
    """A cost table from ``cost(batch, tokens)`` seconds."""
    return {"batch": list(batches), "tokens": list(tokens), "seconds": [[cost(b, t) for t in tokens] for b in batches]}


def profile(*, target=lambda b, t: 0.010, drafter=lambda b, t: 1e-9, acceptance=None, hit_rate=1.0,
            rpc_seconds=0.0, **extra):
    return parse_profile({
        "target": table(target), "drafter": table(drafter), "block_size": 8,
        "acceptance_per_pos": acceptance or [0.9 ** (i + 1) for i in range(16)], "hit_rate": hit_rate,
        "rpc_seconds": rpc_seconds, "padded_rows": False, **extra,
    })


def closed(concurrency: int, requests: int, output: int = 64, prompt: int = 32) -> Workload:
    return Workload(requests=requests, concurrency=concurrency, prompt_tokens=Lengths.parse(prompt),
                    output_tokens=Lengths.parse(output))


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_plain_throughput_is_batch_over_pass_cost(batch):
    cost = lambda b, t: 0.002 + 0.0005 * b  # a batch-dependent pass, flat in tokens
    result = simulate(profile(target=cost), SimConfig(mode="plain", max_num_seqs=batch),
                      closed(batch, 8 * batch, output=32))
    expected = batch / cost(batch, 1)
    print(f"batch {batch}: simulated {result.tokens_per_s:.1f} tokens/s, analytic {expected:.1f}")
    assert result.tokens_per_s == pytest.approx(expected, rel=0.02)
    assert result.mean_batch == pytest.approx(batch)
    assert result.tpot_p50 == pytest.approx(cost(batch, 1), rel=0.01)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_a_measured_serving_cost_scales_the_pass_and_adds_its_overhead_by_rows(batch):
    cost = lambda b, t: 0.002 + 0.0005 * b
    serving = {"verifier": {"rows": [1, 16], "overhead_seconds": [0.001, 0.004], "target_scale": [1.0, 1.5]}}
    result = simulate(profile(target=cost, serving=serving), SimConfig(mode="plain", max_num_seqs=batch),
                      closed(batch, 8 * batch, output=32))
    fraction = (batch - 1) / 15  # rows interpolate linearly between the measured points
    step = cost(batch, 1) * (1.0 + 0.5 * fraction) + 0.001 + 0.003 * fraction
    print(f"batch {batch}: simulated {result.tokens_per_s:.1f} tokens/s, analytic {batch / step:.1f}")
    assert result.tokens_per_s == pytest.approx(batch / step, rel=0.02)
    assert result.overhead_seconds_per_step == pytest.approx(0.001 + 0.003 * fraction, rel=1e-6)
    assert result.target_seconds_per_pass == pytest.approx(cost(batch, 1) * (1.0 + 0.5 * fraction), rel=1e-6)


def tau_of(acceptance: list[float], block: int) -> float:
    return 1 + sum(acceptance[:block])


def test_async_with_free_drafter_and_every_hit_approaches_tau_times_plain():
    prof = profile()
    workload = closed(16, 320, output=512)
    plain = simulate(prof, SimConfig(mode="plain", max_num_seqs=16), workload)
    fast = simulate(prof, SimConfig(mode="async", max_num_seqs=16, block_size=8, adaptive_block=False), workload)
    tau = tau_of(prof.acceptance_per_pos, 8)
    ratio = fast.tokens_per_s / plain.tokens_per_s
    print(f"tau {tau:.3f}: async/plain {ratio:.3f}; simulated tau {fast.tau:.3f}, hit rate {fast.hit_rate:.2f}")
    assert fast.tau == pytest.approx(tau, rel=0.02)  # the k sampler follows the acceptance profile
    assert fast.hit_rate == 1.0
    # A little below tau: a finished request's row stays empty for a step (its successor arrives
    # during one), its last step is cut short, and the run's tail drains with part-full batches.
    assert 0.95 * tau <= ratio <= 1.01 * tau


def test_sync_pays_the_draft_round_trip_every_step_and_async_hides_it():
    target, draft, rpc = 0.010, 0.004, 0.002
    prof = profile(drafter=lambda b, t: draft, rpc_seconds=rpc)
    # Long outputs: a new request's first step waits for a blocking Draft in async mode too, and
    # with long outputs that is rare.
    workload = closed(8, 32, output=4096)
    config = {"max_num_seqs": 8, "block_size": 8, "adaptive_block": False}
    sync = simulate(prof, SimConfig(mode="sync", **config), workload)
    fast = simulate(prof, SimConfig(mode="async", **config), workload)
    tau = tau_of(prof.acceptance_per_pos, 8)
    assert sync.tokens_per_s == pytest.approx(8 * tau / (target + rpc + draft), rel=0.04)
    # async: the Speculate round trip (6 ms) hides under the 10 ms pass; every candidate hits.
    assert fast.tokens_per_s == pytest.approx(8 * tau / target, rel=0.04)
    assert sync.blocking_draft_calls == sync.target_passes


def test_misses_block_the_whole_step():
    """One sequence's miss makes the step wait for a Draft: at batch 16 and hit rate 0.9 most
    steps have one, so the hit rate per sequence overstates how often drafting is off the path."""
    prof = profile(drafter=lambda b, t: 0.004, rpc_seconds=0.002, hit_rate=0.9)
    result = simulate(prof, SimConfig(mode="async", max_num_seqs=16, adaptive_block=False), closed(16, 64, output=256))
    assert result.hit_rate == pytest.approx(0.9, abs=0.02)
    assert result.blocking_draft_calls / result.target_passes > 1 - 0.9 ** 16 - 0.05


def test_one_request_latencies_are_the_sum_of_its_path():
    hop, target, draft, spec = 0.001, 0.010, 0.003, 0.004
    prof = profile(drafter=lambda b, t: draft, speculate=table(lambda b, t: spec), rpc_seconds=2 * hop)
    one = Workload(requests=1, concurrency=1, prompt_tokens=Lengths.parse(8), output_tokens=Lengths.parse(200))
    plain = simulate(prof, SimConfig(mode="plain"), one)
    assert plain.ttft_p50 == pytest.approx(hop + target + hop)
    assert plain.tpot_p50 == pytest.approx(target)
    fast = simulate(prof, SimConfig(mode="async", block_size=8, adaptive_block=False), one)
    # Hop in, a blocking Draft round trip (first step), the pass with Speculate beside it, hop out.
    assert fast.ttft_p50 == pytest.approx(hop + (2 * hop + draft) + max(target, 2 * hop + spec) + hop)


def test_more_drafters_never_hurt_when_drafters_are_the_bottleneck():
    # 16 sequences per verifier step x 2 ms each: one replica needs 32 ms per step of each verifier.
    prof = profile(drafter=lambda b, t: 0.002 * b)
    rates = []
    for drafters in (1, 2, 3, 4, 6, 8):
        result = simulate(prof, SimConfig(mode="async", verifiers=2, drafters=drafters, max_num_seqs=16,
                                          adaptive_block=False), closed(32, 96, output=128))
        rates.append(result.tokens_per_s)
        print(f"{drafters} drafters: {result.tokens_per_s:.0f} tokens/s, drafter busy {result.drafter_utilisation:.0%}")
    assert all(later >= 0.99 * earlier for earlier, later in itertools.pairwise(rates))
    assert rates[-1] > 3 * rates[0]


def test_poisson_arrivals_below_capacity_are_all_served():
    rate, output = 20.0, 64
    result = simulate(profile(), SimConfig(mode="plain", max_num_seqs=32),
                      Workload(requests=600, rate=rate, prompt_tokens=Lengths.parse(16), output_tokens=Lengths.parse(output)))
    # Offered load 20 x 64 = 1280 tokens/s, capacity 32 / 10 ms = 3200: the run lasts as long as the arrivals.
    assert result.tokens_per_s == pytest.approx(rate * output, rel=0.1)
    assert result.ttft_p50 < 0.05


def test_trace_replay(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_seconds": 0.0, "prompt_tokens": 10, "output_tokens": 5}\n'
                    '{"arrival_seconds": 1.0, "prompt_ids": [1, 2, 3], "output_ids": [4, 5]}\n')
    trace = load_trace(path)
    assert trace == [TraceRequest(arrival_seconds=0.0, prompt_tokens=10, output_tokens=5),
                     TraceRequest(arrival_seconds=1.0, prompt_tokens=3, output_tokens=2)]
    result = simulate(profile(), SimConfig(mode="plain"), Workload(trace=trace))
    assert result.output_tokens == 7
    assert result.seconds == pytest.approx(1.0 + 2 * 0.010)  # the second request: arrives at 1 s, two passes
    path.write_text('{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 5}\n')  # an older trace's key
    assert load_trace(path) == [TraceRequest(arrival_seconds=0.5, prompt_tokens=10, output_tokens=5)]
    path.write_text('{"arrival_seconds": 0.0, "output_tokens": 5}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: a trace line needs prompt_tokens"):
        load_trace(path)


@pytest.mark.parametrize("spec, error", [
    ("0", "positive"), ("uniform:9:3", "LOW <= HIGH"), ("zipf:3", "bad length spec"), ("abc", "bad length spec"),
])
def test_bad_length_specs_say_what_is_allowed(spec, error):
    with pytest.raises(ValueError, match=error):
        Lengths.parse(spec)


def test_bad_workloads_and_configs_are_refused():
    with pytest.raises(ValueError, match="exactly one of"):
        Workload(concurrency=4, rate=2.0)
    with pytest.raises(ValueError, match="exactly one of"):
        Workload()
    with pytest.raises(ValueError, match="at least one drafter"):
        SimConfig(mode="async", drafters=0)
    with pytest.raises(ValueError, match="at least one verifier"):
        SimConfig(mode="plain", verifiers=0)
    with pytest.raises(ValueError, match="mode must be"):
        SimConfig(mode="eager")


def test_thousands_of_requests_on_dozens_of_replicas_take_seconds():
    prof = profile(drafter=lambda b, t: 0.0002 * b + 0.001, hit_rate=0.7, rpc_seconds=0.0005)
    start = time.perf_counter()
    result = simulate(prof, SimConfig(mode="async", verifiers=24, drafters=12, max_num_seqs=32),
                      Workload(requests=3000, concurrency=768, prompt_tokens=Lengths.parse("uniform:16:512"),
                               output_tokens=Lengths.parse("geometric:128:1024")))
    seconds = time.perf_counter() - start
    print(f"3000 requests, 36 replicas: {seconds:.2f} s of wall time, {result.tokens_per_s:.0f} tokens/s simulated")
    assert result.requests == 3000
    assert seconds < 30


def test_replicas_sharing_one_device_take_turns_and_pay_each_pass_s_fixed_cost():
    """Sync mode, 4 sequences spread 2 + 2 over two replicas, a Draft pass of 3 ms + 1 ms per row:
    on their own devices the parts run side by side (5 ms); on one device they take turns (10 ms),
    where a single replica would have run one pass over all four rows (7 ms)."""
    target = 0.010
    prof = profile(drafter=lambda b, t: 0.003 + 0.001 * b)
    workload = closed(4, 16, output=4096)
    config = {"mode": "sync", "max_num_seqs": 4, "block_size": 8, "adaptive_block": False}
    tau = tau_of(prof.acceptance_per_pos, 8)
    steps = {}
    for name, extra in {"own": {"drafters": 2}, "shared": {"drafters": 2, "drafter_devices": 1},
                        "one": {"drafters": 1}}.items():
        result = simulate(prof, SimConfig(**config, **extra), workload)
        steps[name] = 4 * tau / result.tokens_per_s - target
        print(f"{name}: drafter part of a step {1e3 * steps[name]:.2f} ms")
    assert steps["own"] == pytest.approx(0.005, rel=0.05)
    assert steps["shared"] == pytest.approx(0.010, rel=0.05)
    assert steps["one"] == pytest.approx(0.007, rel=0.05)
    with pytest.raises(ValueError, match="drafter_devices"):
        SimConfig(drafter_devices=-1)


def test_verifiers_with_one_sequence_each_spread_over_the_drafters():
    """16 verifiers of one client each and 4 drafters: each verifier's sequences tie on every
    replica (it knows only its own), and ties go to a random replica, so the drafters share the
    load; first-in-list ties would put every sequence on drafter 0."""
    prof = profile(drafter=lambda b, t: 0.004 * b)
    result = simulate(prof, SimConfig(mode="async", verifiers=16, drafters=4, adaptive_block=False, hit_rate=0.0),
                      closed(16, 160, output=64))
    print(f"drafter busy: mean {result.drafter_utilisation:.0%}, max {result.drafter_utilisation_max:.0%}")
    assert result.drafter_utilisation_max < 1.5 * result.drafter_utilisation


def test_an_overconfident_drafter_gets_the_blocks_its_acceptance_is_worth():
    """The cost model calibrates the drafter's confidence against what was accepted, per bin of
    confidence (`specd.cost_model.Calibration`): a drafter whose confidence falls off far slower
    than its acceptance is given the blocks a drafter that knows its acceptance gets, not longer
    ones that verify rejected tokens. (With one scalar of calibration its passes were 1.15x longer.)"""
    cost = lambda b, t: 0.002 + 0.0004 * t  # noqa: E731 - each verified token costs a fifth of a decode
    acceptance = [0.7 * 0.5 ** i for i in range(8)]
    results = {}
    for name, confidence in {"calibrated": None, "overconfident": [0.9 ** (i + 1) for i in range(8)]}.items():
        prof = profile(target=cost, acceptance=acceptance, **({"confidence_per_pos": confidence} if confidence else {}))
        results[name] = simulate(prof, SimConfig(mode="async", max_num_seqs=4), closed(4, 32, output=128))
        print(f"{name}: tau {results[name].tau:.2f}, pass {1e3 * results[name].target_seconds_per_pass:.2f} ms")
    calibrated, overconfident = results["calibrated"], results["overconfident"]
    assert overconfident.target_seconds_per_pass < 1.05 * calibrated.target_seconds_per_pass
    assert overconfident.tokens_per_s > 0.95 * calibrated.tokens_per_s


def test_block_samples_let_the_cost_model_verify_long_only_where_the_drafter_is_right():
    """Half the blocks are confident and fully accepted, half unconfident and rejected at once:
    per-position acceptance 0.5 either way, but with the samples the cost model sees which is
    which, verifies the good blocks whole and decodes plain on the bad ones — as the engine does."""
    cost = lambda b, t: 0.002 + 0.001 * t  # noqa: E731
    samples = {"confidence": [[0.95] * 8, [0.05] * 8] * 50, "accepted": [8, 0] * 50}
    workload = closed(1, 16, output=512, prompt=1)
    config = SimConfig(mode="async", max_num_seqs=1, explore_every=1000)
    mean = simulate(profile(target=cost, acceptance=[0.5] * 8), config, workload)
    joint = simulate(profile(target=cost, acceptance=[0.5] * 8, block_samples=samples), config, workload)
    print(f"mean model: {mean.tokens_per_s:.0f} tok/s, tau {mean.tau:.2f}; "
          f"samples: {joint.tokens_per_s:.0f} tok/s, tau {joint.tau:.2f}")
    # Good blocks: 9 tokens for a 9-token pass (11 ms); bad ones: 1 token for a 1-token pass (3 ms).
    assert joint.tokens_per_s == pytest.approx((9 + 1) / (0.011 + 0.003), rel=0.06)
    assert joint.tokens_per_s > 1.2 * mean.tokens_per_s


def test_a_replayed_request_that_names_its_prompt_draws_that_prompt_s_blocks():
    """Acceptance is the prompt's: with samples recorded per prompt, a trace of prompt 0 (whose
    blocks are all accepted) commits 9 tokens a step and one of prompt 1 (none accepted) 1; a
    trace that names no prompt draws from both."""
    samples = {"confidence": [[0.9] * 8, [0.9] * 8] * 50, "accepted": [8, 0] * 50, "prompt": [0, 1] * 50}
    prof = profile(acceptance=[0.5] * 8, block_samples=samples)
    config = SimConfig(mode="sync", adaptive_block=False, max_num_seqs=4)

    def run(prompt):
        trace = replayed([[4, 64, prompt]] * 8 if prompt is not None else [[4, 64]] * 8)
        return simulate(prof, config, Workload(requests=8, concurrency=4, trace=trace)).tau

    easy, hard, either = run(0), run(1), run(None)
    assert easy == pytest.approx(9.0, rel=0.05) and hard == pytest.approx(1.0)
    assert hard < either < easy
    with pytest.raises(ProfileError, match="block_samples.prompt"):
        profile(block_samples={**samples, "prompt": [0]})


def test_a_measured_speculating_service_prices_speculative_steps_and_plain_keeps_its_own():
    """With ``serving.speculative`` the speculating verifier's pass is the table times its ratio and
    its step adds its own measured overhead (nothing from the in-process lines); plain decoding
    keeps ``serving.verifier``."""
    serving = {"verifier": {"rows": [1, 16], "overhead_seconds": [0.001, 0.001], "target_scale": [1.0, 1.0]},
               "speculative": {"rows": [1, 16], "overhead_seconds": [0.003, 0.003], "target_scale": [2.0, 2.0]}}
    prof = profile(target=lambda b, t: 0.010, serving=serving, overhead={"step_seconds": 0.5, "seq_seconds": 0.5})
    workload = closed(1, 4, output=4096, prompt=1)
    fast = simulate(prof, SimConfig(mode="async", adaptive_block=False), workload)
    plain = simulate(prof, SimConfig(mode="plain"), workload)
    assert fast.target_seconds_per_pass == pytest.approx(0.020, rel=0.01)
    assert fast.overhead_seconds_per_step == pytest.approx(0.003, rel=0.01)
    assert plain.target_seconds_per_pass == pytest.approx(0.010, rel=0.01)
    assert plain.overhead_seconds_per_step == pytest.approx(0.001, rel=0.01)


def test_sync_deployments_use_the_sync_service_measurement_and_borrow_async_s_without_one():
    """``serving.speculative_sync`` prices sync steps (its pass ratio, its overhead); async keeps
    ``serving.speculative``; a profile without the sync block prices sync with async's."""
    serving = {"verifier": {"rows": [1, 16], "overhead_seconds": [0.001, 0.001], "target_scale": [1.0, 1.0]},
               "speculative": {"rows": [1, 16], "overhead_seconds": [0.003, 0.003], "target_scale": [2.0, 2.0]},
               "speculative_sync": {"rows": [1, 16], "overhead_seconds": [0.005, 0.005], "target_scale": [3.0, 3.0]}}
    workload = closed(1, 4, output=4096, prompt=1)
    both = profile(target=lambda b, t: 0.010, serving=serving)
    sync = simulate(both, SimConfig(mode="sync", adaptive_block=False), workload)
    asynchronous = simulate(both, SimConfig(mode="async", adaptive_block=False), workload)
    assert sync.target_seconds_per_pass == pytest.approx(0.030, rel=0.01)
    assert sync.overhead_seconds_per_step == pytest.approx(0.005, rel=0.01)
    assert asynchronous.target_seconds_per_pass == pytest.approx(0.020, rel=0.01)
    assert asynchronous.overhead_seconds_per_step == pytest.approx(0.003, rel=0.01)
    # A measured blocking Draft wait: sync's Draft round trips cost the table times its ratio.
    serving["speculative_sync"]["draft_scale"] = [3.0, 3.0]
    slow = simulate(profile(target=lambda b, t: 0.010, serving=serving), SimConfig(mode="sync", adaptive_block=False),
                    workload)
    assert slow.draft_wait_seconds_per_call == pytest.approx(3 * sync.draft_wait_seconds_per_call, rel=0.01)
    assert sync.draft_wait_seconds_per_call > 0
    del serving["speculative_sync"]
    borrowed = simulate(profile(target=lambda b, t: 0.010, serving=serving), SimConfig(mode="sync", adaptive_block=False),
                        workload)
    assert borrowed.target_seconds_per_pass == pytest.approx(0.020, rel=0.01)
    assert borrowed.overhead_seconds_per_step == pytest.approx(0.003, rel=0.01)
