"""The checked-in gRPC stubs are what `make proto` generates from proto/specd/v1 today, and the
verifier fills the messages' renamed fields."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

from services.verifier.server import _response
from specd._proto.v1 import verifier_pb2
from specd.serving import Delta, Usage

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



def test_usage_tokens_per_pass_keeps_field_number_4_and_carries_the_engines_figure():
    """Renamed from mean_accepted_length: same number and type, so old and new peers read each other."""
    assert verifier_pb2.Usage.DESCRIPTOR.fields_by_name["tokens_per_pass"].number == 4
    assert verifier_pb2.Usage(tokens_per_pass=2.5).SerializeToString() == bytes([4 << 3 | 5]) + struct.pack("<f", 2.5)
    usage = Usage(prompt_tokens=3, completion_tokens=10, target_passes=4, tokens_per_pass=2.5)
    message = _response("r", Delta(request_id="r", token_ids=[1, 2], finish_reason="stop", usage=usage))
    assert (message.usage.completion_tokens, message.usage.target_passes, message.usage.tokens_per_pass) == (10, 4, 2.5)
