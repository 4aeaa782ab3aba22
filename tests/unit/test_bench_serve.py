"""`specd bench serve --repeats`: how rounds over a noisy machine become one row."""

from __future__ import annotations

import pytest

from services.bench import ServeRow, _median_rounds, _ratios_to_plain, format_table


def _row(deployment: str, concurrency: int, tokens_per_s: float, tau: float = 1.0) -> ServeRow:
    return ServeRow(deployment=deployment, concurrency=concurrency, requests=16, output_tokens=1024,
                    seconds=1024 / tokens_per_s, tokens_per_s=tokens_per_s, ttft_p50=0.01, ttft_p99=0.02,
                    tpot_p50=0.003, tpot_p99=0.004, tau=tau, target_ms=3.0, step_overhead_ms=1.0)


def _round(plain: float, spec: float, tau: float) -> list[ServeRow]:
    rows = [_row("plain", 1, plain), _row("async 1:1", 1, spec, tau)]
    _ratios_to_plain(rows)
    return rows


def test_a_row_is_the_median_round_with_the_median_of_ratios_within_rounds():
    # Round 2 ran on a slow minute: both deployments lost half their speed, the ratio held.
    rounds = [_round(300.0, 150.0, 2.0), _round(150.0, 90.0, 2.5), _round(310.0, 140.0, 2.2)]
    plain, spec = _median_rounds(rounds)
    assert plain.tokens_per_s == 300.0 and plain.runs == [300.0, 150.0, 310.0]
    assert spec.tokens_per_s == 140.0 and spec.tau == 2.2  # the median round's row, whole
    assert spec.runs == [150.0, 90.0, 140.0]
    # Per-round ratios 0.5, 0.6, 0.4516: their median, not 140 / 300.
    assert spec.speedup == pytest.approx(0.5)
    assert "spread" in format_table([plain, spec])


def test_an_even_count_of_rounds_takes_the_lower_middle_one():
    rows = _median_rounds([_round(200.0, 100.0, 2.0), _round(100.0, 80.0, 2.0)])
    assert [r.tokens_per_s for r in rows] == [100.0, 80.0]


def test_one_round_has_no_spread_column():
    rows = _median_rounds([_round(200.0, 100.0, 2.0)])
    assert rows[1].speedup == pytest.approx(0.5) and rows[1].runs == [100.0]
    assert "spread" not in format_table(rows)


def test_each_temperature_is_divided_by_plain_decoding_at_that_temperature():
    rows = [_row("plain", 1, 300.0), _row("async 1:1", 1, 150.0, 2.0),
            _row("plain", 1, 100.0), _row("async 1:1", 1, 90.0, 1.2)]
    rows[2].temperature = rows[3].temperature = 1.0
    _ratios_to_plain(rows)
    assert rows[1].speedup == pytest.approx(0.5) and rows[3].speedup == pytest.approx(0.9)
    # With rounds, a row is matched to the same (deployment, concurrency, temperature) of each round.
    assert [r.temperature for r in _median_rounds([rows, rows])] == [0.0, 0.0, 1.0, 1.0]


def test_plain_and_turn_taking_deployments_get_the_whole_machine_async_ones_split_it():
    from services.bench import DEPLOYMENTS, ServeSettings, stack_config

    by_name = {d.name: d for d in DEPLOYMENTS}
    configs = {name: stack_config(ServeSettings(), d, "t", "d", cores=2) for name, d in by_name.items()}
    for name in ("plain", "lookup", "sync 1:1", "sync 1:1 +lookup"):
        assert not configs[name].pin and configs[name].verifier_args[:2] == ["--threads", "2"], name
    assert configs["sync 1:1"].drafter_args == ["--threads", "2"] and configs["sync 1:1"].drafter == "d"
    # Async: the verifier has both cores for a step without a candidate pass and one beside one;
    # the drafter has the other. Pinned apart only when asked.
    for name in ("async 1:1", "async 1:1 +lookup"):
        assert not configs[name].pin, name
        assert configs[name].verifier_args == ["--threads", "2", "--async-target-threads", "1"], name
        assert configs[name].drafter_args == ["--threads", "2", "--speculate-threads", "1"], name
    assert configs["async 2:1"].verifier_args[-1] == "1" and configs["async 2:1"].drafter_args[-1] == "1"
    pinned = stack_config(ServeSettings(pin=True), by_name["async 1:1"], "t", "d", cores=2)
    assert pinned.pin and "--threads" not in pinned.verifier_args
    assert not stack_config(ServeSettings(pin=True), by_name["sync 1:1"], "t", "d", cores=2).pin
    # A bigger machine: the drafter's share grows with it.
    big = stack_config(ServeSettings(), by_name["async 1:1"], "t", "d", cores=16)
    assert big.verifier_args == ["--threads", "16", "--async-target-threads", "8"] and big.drafter_args[-1] == "8"
    assert [n for n, c in configs.items() if c.prompt_lookup] == [
        "lookup", "sync 1:1 +lookup", "async 1:1 +lookup"]
    assert configs["plain"].drafter == configs["lookup"].drafter == ""  # no drafter processes


def test_processes_that_take_turns_on_the_cores_stop_spinning_soon_plain_alone_keeps_libgomps_default(
        monkeypatch, tmp_path):
    from services.bench import DEPLOYMENTS, ServeSettings, stack_config
    from services.up import Stack
    from specd.threads import SHARED_SPIN_COUNT

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    by_name = {d.name: d for d in DEPLOYMENTS}

    def env(name: str, **extra) -> dict[str, str]:
        config = stack_config(ServeSettings(), by_name[name], "t", "d", cores=2)
        config.workdir = str(tmp_path)
        for key, value in extra.items():
            setattr(config, key, value)
        return Stack(config).service_env()

    for name in ("sync 1:1", "async 1:1", "sync 2:1", "sync 1:1 +lookup"):
        assert env(name)["GOMP_SPINCOUNT"] == str(SHARED_SPIN_COUNT), name
    # One computing process (plain decoding, prompt lookup in the verifier): a user's default.
    assert "GOMP_SPINCOUNT" not in env("plain") and "GOMP_SPINCOUNT" not in env("lookup")
    # The demo's plain verifier beside a lookup verifier takes turns with it.
    assert env("lookup", plain_verifiers=1)["GOMP_SPINCOUNT"] == str(SHARED_SPIN_COUNT)
    # The stack's own config.env wins, and so does a setting the user made.
    assert env("sync 1:1", env={"GOMP_SPINCOUNT": "5"})["GOMP_SPINCOUNT"] == "5"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert "GOMP_SPINCOUNT" not in env("sync 1:1")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert env("sync 1:1")["GOMP_SPINCOUNT"] == "123"
