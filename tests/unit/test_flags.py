"""Flags from settings dataclasses (`specd.flags`): one default per setting, in its dataclass.

The services parse their config through it with an environment (`parse_config`), the library's
commands without one; a nested dataclass (the verifier's `EngineConfig`) is flattened into flags of
its own field names, which must be the ones the verifier had before it nested it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from services.common.config import ServiceConfig, parse_config
from services.verifier.server import VerifierConfig
from specd import cli
from specd.bench.profile import ProfileSettings
from specd.bench.profile import add_arguments as profile_arguments
from specd.engine import EngineConfig
from specd.flags import add_flags, default_of, from_flags
from specd.plan import planner
from specd.plan.planner import PlanSettings
from specd.sampling import SamplingParams
from specd.train.specopd import SpecOPDConfig


@dataclass(kw_only=True)
class _Inner:
    size: int = field(default=8, metadata={"help": "a size"})
    retry_seconds: float | None = field(default=None, metadata={"help": "none = never"})
    headroom: int | None = field(default=None, metadata={"help": "0 = none", "none": 0})


@dataclass(kw_only=True)
class _Outer(ServiceConfig):
    name: str = field(default="x", metadata={"help": "a name"})
    inner: _Inner = field(default_factory=lambda: _Inner(retry_seconds=2.0))


def _parser(cls: type, env=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_flags(parser, cls, env=env)
    return parser


def test_a_nested_dataclass_is_flattened_with_its_default_instance_defaults():
    config = parse_config(_Outer, [], {})
    assert config.inner == _Inner(retry_seconds=2.0)  # the factory's 2.0, not _Inner's None
    config = parse_config(_Outer, ["--size", "3", "--retry-seconds", "none", "--headroom", "5"],
                          {"SPECD_NAME": "y", "SPECD_SIZE": "4"})
    assert (config.name, config.inner) == ("y", _Inner(size=3, retry_seconds=None, headroom=5))
    assert parse_config(_Outer, [], {"SPECD_SIZE": "4"}).inner.size == 4  # a nested field's variable
    assert parse_config(_Outer, ["--headroom", "0"], {}).inner.headroom is None  # its "none" spelling


def test_optional_fields_parse_none_and_reject_garbage(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_config(_Outer, ["--retry-seconds", "soon"], {}, prog="t")
    assert exited.value.code == 2
    assert "--retry-seconds" in capsys.readouterr().err
    assert parse_config(_Outer, ["--retry-seconds", ""], {}).inner.retry_seconds is None


def test_two_fields_with_one_flag_name_are_refused():
    @dataclass(kw_only=True)
    class Clash:
        size: int = 1
        inner: _Inner = field(default_factory=_Inner)

    with pytest.raises(TypeError, match="--size"):
        _parser(Clash)


def test_from_flags_takes_only_the_dataclass_fields_and_explicit_values_win():
    namespace = argparse.Namespace(size=3, unrelated="z", name="n")
    assert from_flags(_Inner, namespace, headroom=1) == _Inner(size=3, headroom=1)
    assert from_flags(_Outer, namespace).inner == _Inner(size=3, retry_seconds=2.0)


# ---------------------------------------------------------------------------- the verifier
# Its flags before EngineConfig was nested in VerifierConfig: the Helm chart and `specd up` pass them.
VERIFIER_FLAGS = {
    "host", "port", "metrics-port", "auth-token", "tls-cert", "tls-key", "tls-ca", "otlp-endpoint", "drain-seconds",
    "deadline-seconds", "log-level", "model", "tokenizer", "served-model-name", "drafters", "http-host", "http-port",
    "max-num-seqs", "max-waiting", "max-request-bytes", "max-model-len", "block-size", "mode", "candidate-budget",
    "adaptive-block", "selective-drafting", "draft-headroom", "drafter-timeout", "drafter-retry-seconds", "redis-url", "trace-stream",
    "trace-maxlen", "threads", "device", "attention-backend", "cuda-graphs", "tensor-parallel",
    "async-target-threads", "prompt-lookup",
}


def test_the_verifier_keeps_its_flags_and_its_engine_defaults():
    parser = _parser(VerifierConfig, env={})
    flags = {option[2:] for action in parser._actions for option in action.option_strings if option != "-h"}
    assert flags - {"help"} == VERIFIER_FLAGS | {"no-adaptive-block", "no-selective-drafting", "no-cuda-graphs",
                                                  "no-prompt-lookup"}
    config = parse_config(VerifierConfig, ["--model", "m"], {})
    # What main() passed to the engine before: the library's defaults but a 2 s drafter retry,
    # and draft_headroom 0 meaning None (full blocks).
    assert config.engine == EngineConfig(drafter_retry_seconds=2.0)
    assert config.engine.draft_headroom is None


def test_the_verifier_engine_flags_and_variables_reach_the_engine_config(capsys):
    argv = ["--model", "m", "--block-size", "4", "--mode", "sync", "--candidate-budget", "2", "--no-adaptive-block",
            "--draft-headroom", "3", "--max-num-seqs", "32"]
    config = parse_config(VerifierConfig, argv, {"SPECD_DRAFTER_RETRY_SECONDS": "0.5", "SPECD_CUDA_GRAPHS": "1"})
    assert config.engine == EngineConfig(block_size=4, mode="sync", candidate_budget=2, adaptive_block=False,
                                         draft_headroom=3, max_num_seqs=32, drafter_retry_seconds=0.5,
                                         cuda_graphs=True)
    assert parse_config(VerifierConfig, ["--model", "m"], {"SPECD_DRAFT_HEADROOM": "0"}).engine.draft_headroom is None
    for bad in (["--draft-headroom", "-1"], ["--mode", "later"]):
        with pytest.raises(SystemExit) as exited:
            parse_config(VerifierConfig, ["--model", "m", *bad], {})
        assert exited.value.code == 2
    assert "draft_headroom" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the library's commands
def test_specd_commands_take_their_defaults_from_the_settings_dataclasses(monkeypatch):
    monkeypatch.setenv("SPECD_BLOCK_SIZE", "3")  # the library's commands read no environment
    top = cli.parser()
    generate = top.parse_args(["generate", "--model", "m", "--prompt", "hi"])
    assert generate.block_size == EngineConfig().block_size
    sampling = SamplingParams()
    assert (generate.max_tokens, generate.temperature, generate.top_p, generate.top_k, generate.seed) == (
        sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed)
    assert top.parse_args(["prune", "--drafter", "d"]).block_size == EngineConfig().block_size
    opd = top.parse_args(["train", "opd", "--target", "t", "--drafter", "d", "--data", "x", "--out", "o"])
    assert from_flags(SpecOPDConfig, opd, max_context=64) == SpecOPDConfig(max_context=64)
    opd = top.parse_args(["train", "opd", "--target", "t", "--drafter", "d", "--data", "x", "--out", "o",
                          "--anchors", "3", "--branches", "2", "--block-size", "4"])
    assert from_flags(SpecOPDConfig, opd) == SpecOPDConfig(anchors_per_seq=3, branches_per_anchor=2, block_size=4)

    profile = argparse.ArgumentParser()
    profile_arguments(profile)
    args = profile.parse_args([])
    assert (args.block_size, args.context, args.rounds) == (
        default_of(ProfileSettings, "block_size"), default_of(ProfileSettings, "context"),
        default_of(ProfileSettings, "rounds"))


def test_plan_flags_build_the_plan_settings():
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    args = parser.parse_args(["--profile", "p.json", "--gpus", "4", "--concurrency", "8"])
    defaults = PlanSettings(gpus=4, concurrency=8)
    for name in ("block_sizes", "ratios", "trainer_gpus", "gpus_per_drafter", "mode", "max_num_seqs", "requests",
                 "prompt_tokens", "output_tokens", "seed", "rate"):
        assert getattr(args, name) == getattr(defaults, name), name
    assert args.tp_allreduce_us == pytest.approx(defaults.tp_allreduce_seconds * 1e6)
    args = parser.parse_args(["--profile", "p.json", "--gpus", "4", "--rate", "2", "--block-sizes", "4,8",
                              "--ratios", "1:2,1:1"])
    assert (args.block_sizes, args.ratios) == ((4, 8), ("1:2", "1:1"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--profile", "p.json", "--mode", "later"])

