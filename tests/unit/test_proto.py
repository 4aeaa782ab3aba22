"""The checked-in gRPC stubs are what `make proto` generates from proto/specd/v1 today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = {p.name: p.read_text() for p in generate.generate(tmp_path)}
    checked_in = ROOT / "specd" / "_proto" / "v1"
    stale = [name for name, text in fresh.items() if (checked_in / name).read_text() != text]
    missing = sorted(set(fresh) - {p.name for p in checked_in.iterdir()})
    assert not missing and not stale, f"stubs out of date: {missing or stale}; run `make proto`"
