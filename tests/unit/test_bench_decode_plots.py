"""`specd bench decode`'s plots: a run without plain decoding (``--methods`` leaving ``ar`` out,
as an acceptance run at a fixed block does) has no speedup to plot, and still writes the rest."""

from __future__ import annotations

from specd.bench.decode import DecodeRow, DecodeSettings, plot


def _row(method: str, domain: str, tau: float) -> DecodeRow:
    return DecodeRow(method=method, domain=domain, temperature=0.0, batch=16, block=16, tau=tau,
                     acceptance_per_pos=[0.5, 0.2], hit_rate=0.0, tokens=128, seconds=1.0, tokens_per_second=128.0,
                     overhead_ms_per_step=1.0, target_passes=64, threads=2, speedup=float("nan"))


def test_a_run_without_plain_decoding_writes_the_acceptance_plots_and_no_speedup_plot(tmp_path):
    settings = DecodeSettings(methods=("ngram", "d3d-sync"), batch_sizes=(16,), block_sizes=(16,),
                              domains=("code", "math"))
    rows = [_row(m, d, 1.5) for m in settings.methods for d in settings.domains]
    names = sorted(p.name for p in plot(rows, settings, tmp_path))
    assert names == ["acceptance_per_position.png", "tau_per_domain.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in names)
    # With plain decoding in the run, the speedup plot is there too.
    for row in rows:
        row.speedup = 1.2
    rows.append(_row("ar", "code", 1.0))
    settings.methods = ("ar", *settings.methods)
    assert "speedup_vs_batch.png" in {p.name for p in plot(rows, settings, tmp_path)}
