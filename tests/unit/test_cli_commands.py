"""`specd up`, `specd bench serve` and the calibrating `specd bench profile` come from the services
through the entry-point group ``specd.commands`` (`specd.cli.Command`): the same names and flags as
when the library built them itself, the services imported only for their own commands, and
`specd bench profile` still there (in-process only) when no services are installed."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from services import bench as services_bench
from services import calibrate, up
from services.chaos import run as chaos_run
from specd import cli
from specd.bench import profile as bench_profile


def subcommand(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[name]
    return parser


def flags(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {option: action.default for action in parser._actions for option in action.option_strings}


def own_flags(add_arguments) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return flags(parser)


def test_the_services_register_their_commands():
    installed = cli.installed_commands()
    assert {path: command.module for path, command in installed.items()} == {
        "up": "services.up", "bench.serve": "services.bench", "bench.chaos": "services.chaos.run",
        "bench.online": "services.online_bench", "bench.profile": "services.calibrate"}


@pytest.mark.parametrize("path, module", [(("up",), up), (("bench", "serve"), services_bench),
                                          (("bench", "profile"), calibrate),
                                          (("bench", "chaos"), chaos_run)])
def test_an_installed_command_has_its_module_s_flags_and_runs_it(path, module):
    for argv in (None, [*path, "--help"]):  # every command's flags, or only the named one's
        command = subcommand(cli.parser(argv), *path)
        assert flags(command) == own_flags(module.add_arguments)
        assert command.get_default("func") is module.run


def test_bench_profile_keeps_the_library_s_flags_and_help():
    assert own_flags(calibrate.add_arguments) == own_flags(bench_profile.add_arguments)
    help_text = subcommand(cli.parser(["bench", "--help"]), "bench").format_help()
    assert "pass costs of the target and D3D drafter" in help_text


def test_other_commands_do_not_import_the_services():
    # A fresh interpreter: this one imported the services above.
    code = ("import sys; from specd import cli; cli.parser(['zoo', 'list']); cli.parser(['bench', 'decode']); "
            "print(sorted(m for m in sys.modules if m.startswith('services')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['services', 'services.commands']"  # the registry only, not a service


def test_without_the_services_bench_profile_is_the_library_s_own(monkeypatch, capsys):
    monkeypatch.setattr(cli, "installed_commands", lambda: {})
    parser = cli.parser(None)
    profile = subcommand(parser, "bench", "profile")
    assert profile.get_default("func") is bench_profile.run
    assert flags(profile) == own_flags(bench_profile.add_arguments)
    with pytest.raises(SystemExit):
        parser.parse_args(["up"])
    assert "invalid choice: 'up'" in capsys.readouterr().err

    measured = []
    monkeypatch.setattr(bench_profile, "measure", lambda args, services=False: measured.append(services) or
                        bench_profile.Measured(profile={}, settings=None, target_dir=None, drafter_dir=None,
                                               drafter=None, pool=[]))
    monkeypatch.setattr(bench_profile, "write", lambda profile, args: 0)
    assert bench_profile.run(parser.parse_args(["bench", "profile", "--quick"])) == 0
    assert measured == [False]  # in-process only ...
    assert "the services are not installed" in capsys.readouterr().err  # ... and it says so


def test_the_services_bench_profile_adds_the_calibration_unless_told_not_to(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_profile, "measure", lambda args, services=False: calls.append(("measure", services)) or
                        bench_profile.Measured(profile={}, settings=None, target_dir="t", drafter_dir="d",
                                               drafter=None, pool=[]))
    monkeypatch.setattr(calibrate, "measure_services", lambda *args, levels: calls.append(("services", levels)))
    monkeypatch.setattr(bench_profile, "write", lambda profile, args: calls.append(("write",)) or 0)
    parser = cli.parser(["bench", "profile"])
    assert calibrate.run(parser.parse_args(["bench", "profile", "--quick"])) == 0
    assert calls == [("measure", True), ("services", calibrate.QUICK_LEVELS), ("write",)]
    calls.clear()
    assert calibrate.run(parser.parse_args(["bench", "profile", "--no-services"])) == 0
    assert calls == [("measure", False), ("write",)]


def test_an_installed_command_that_does_not_load_is_skipped_with_a_warning(monkeypatch, capsys):
    class Broken:
        name, value = "bench.gone", "services.commands:NOT_THERE"

        def load(self):
            raise AttributeError("module 'services.commands' has no attribute 'NOT_THERE'")

    real = cli.entry_points
    monkeypatch.setattr(cli, "entry_points", lambda group: [*real(group=group), Broken()])
    installed = cli.installed_commands()
    assert "bench.gone" not in installed and "up" in installed  # the others still load
    assert "skipping the installed command 'bench.gone'" in capsys.readouterr().err
    parser = cli.parser(["zoo", "list"])  # and the library's own commands still parse
    assert parser.parse_args(["zoo", "list"]).func is not None
