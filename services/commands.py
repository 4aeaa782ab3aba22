"""The `specd` subcommands the services add: `specd up`, `specd bench serve`, `specd bench chaos`,
`specd bench online` and `specd bench profile` with the services' calibration
(`services.calibrate`) in place of the library's in-process-only one. pyproject.toml declares each
in the entry-point group ``specd.commands`` (`specd.cli.Command`); `specd` imports a module named
here only when its command is the one given.
"""

from __future__ import annotations

from specd.cli import Command

UP = Command(help="run the services on this machine: Redis, trainer, drafters, verifiers", module="services.up")
BENCH_SERVE = Command(help="end to end through the services: plain vs sync vs async D3D, by concurrency",
                      module="services.bench")
BENCH_CHAOS = Command(help="the real services under a seeded fault schedule, and a checker of what must survive it",
                      module="services.chaos.run")
BENCH_ONLINE = Command(help="the real stack on new-domain traffic: the live drafter's tau per domain as the trainer "
                            "distils it, with every gate decision", module="services.online_bench")
BENCH_PROFILE = Command(help="", module="services.calibrate")  # the library's help: the same command, calibrated
