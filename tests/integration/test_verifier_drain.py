"""SIGTERM of a verifier process finishes within its grace period, whatever the engine holds.

A probe found that a verifier whose engine had stopped never exited on SIGTERM while a gRPC
``Generate`` was queued: its handler thread waited forever for a delta. Here a real verifier
process (tiny random target on disk, one cache row so requests queue) gets SIGTERM while idle,
while streams run and wait in the queue over gRPC and HTTP, and while it is being flooded; each
time it must exit 0 within ``drain_seconds`` plus start-up slack, every open stream must end
(with its tokens, or with UNAVAILABLE/an abort, never a hang), and health must have said
NOT_SERVING.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from test_services import models  # noqa: F401 (fixture)

from services.common.config import ServiceConfig
from services.common.server import open_channel, wait_healthy
from services.up import free_port
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

DRAIN_SECONDS = 2.0
SLACK_SECONDS = 10.0  # the last step, grpc's final second, the process exit, on a loaded 2-core machine


def start_verifier(model_dir: str, tmp_path) -> tuple[subprocess.Popen, str, str]:
    grpc_port, http_port = free_port(), free_port()
    log = (tmp_path / f"verifier-{grpc_port}.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.verifier", "--model", model_dir, "--host", "127.0.0.1",
         "--port", str(grpc_port), "--http-port", str(http_port), "--max-num-seqs", "1",
         "--drain-seconds", str(DRAIN_SECONDS), "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{grpc_port}"
    wait_healthy(address, ServiceConfig(), timeout=120)
    return process, address, f"http://127.0.0.1:{http_port}"


def stream_generate(address: str, max_tokens: int, results: list, started: threading.Event | None = None) -> None:
    """One Generate stream; appends ("ok", tokens) or ("error", status code)."""
    with open_channel(address, ServiceConfig()) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        request = verifier_pb2.GenerateRequest(
            prompt_token_ids=[9, 10, 11, 12],
            params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        tokens = []
        try:
            for message in stub.Generate(request, timeout=120):
                tokens += message.token_ids
                if started is not None:
                    started.set()
            results.append(("ok", tokens))
        except grpc.RpcError as error:
            results.append(("error", error.code()))


def stream_http(url: str, results: list) -> None:
    body = json.dumps({"model": "target", "prompt": [9, 10, 11], "max_tokens": 3000, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            events = [line for line in response.read().decode().splitlines() if line.startswith("data:")]
        results.append(("ok", events[-1]))
    except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError) as error:
        results.append(("error", repr(error)))


def terminate_within_grace(process: subprocess.Popen) -> float:
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=DRAIN_SECONDS + SLACK_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the verifier did not exit within {DRAIN_SECONDS + SLACK_SECONDS} s of SIGTERM")
    assert code == 0, f"the verifier exited {code} after SIGTERM"
    return time.monotonic() - start


def test_sigterm_when_idle(models, tmp_path):
    process, _, _ = start_verifier(models[1], tmp_path)
    terminate_within_grace(process)


def test_sigterm_with_running_and_queued_generate_streams(models, tmp_path):
    """One row: one long stream runs, three queue behind it over gRPC, one over HTTP; SIGTERM
    must end them all (the running one may be aborted after the grace), then exit."""
    process, address, url = start_verifier(models[1], tmp_path)
    try:
        results: list = []
        started = threading.Event()
        clients = [threading.Thread(target=stream_generate, args=(address, 3000, results, started))]
        clients += [threading.Thread(target=stream_generate, args=(address, 3000, results)) for _ in range(3)]
        clients.append(threading.Thread(target=stream_http, args=(url, results)))
        for client in clients:
            client.start()
        assert started.wait(60), "the first stream never produced a token"
        terminate_within_grace(process)
        for client in clients:
            client.join(30)
            assert not client.is_alive(), "a client stream was still open after the verifier exited"
        assert len(results) == 5
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_while_flooded(models, tmp_path):
    """Many short requests arriving while the drain starts: new ones are refused, none hangs."""
    process, address, _ = start_verifier(models[1], tmp_path)
    try:
        results: list = []
        clients = [threading.Thread(target=stream_generate, args=(address, 200, results)) for _ in range(24)]
        for client in clients:
            client.start()
        terminate_within_grace(process)
        for client in clients:
            client.join(30)
            assert not client.is_alive()
        codes = {outcome if outcome == "ok" else value for outcome, value in results}
        assert codes <= {"ok", grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, codes
    finally:
        if process.poll() is None:
            process.kill()
