"""Closed-loop load through a running `services.up.Stack`: what `specd bench serve` drives its
deployments with and what `bench profile`'s service calibration (`services.calibrate`) measures
the verifier under, so the two see the same traffic.

A load is C clients, each sending its next request when the last one finished (`run_level`),
through the verifier's OpenAI HTTP API or its gRPC Generate stream (`sender`). The process that
generates it keeps off the cores the services are pinned to (`off_cores`), since its own work
would otherwise slow the very passes being measured.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.client import Completion, grpc_completion, stream_completion
from services.common.config import ServiceConfig
from services.common.server import open_channel
from services.up import Stack, StackConfig, machine_cores, machine_split
from specd._proto.v1 import verifier_pb2_grpc

Send = Callable[[list[int], int], Completion]
"""One request: (prompt ids, max new tokens) -> its completion."""


def run_level(send: Send, pool: list[list[int]], concurrency: int, requests: int,
              max_tokens: int) -> tuple[list[Completion], float, list[str]]:
    """A closed loop of ``concurrency`` clients sending ``requests`` requests in all (request i
    sends ``pool[i % len(pool)]``); the completions come back in the order they were sent, each
    with its prompt's index in the pool, with the seconds the level took and the errors."""
    results, errors = [], []
    lock = threading.Lock()
    next_index = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            try:
                result = send(pool[i % len(pool)], max_tokens)
                result.prompt_index = i % len(pool)
                with lock:
                    results.append((i, result))
            except (OSError, grpc.RpcError) as err:
                with lock:
                    errors.append(str(err))

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as executor:
        for future in [executor.submit(client) for _ in range(concurrency)]:
            future.result()
    results.sort(key=lambda item: item[0])  # the order they were sent
    return [r for _, r in results], time.perf_counter() - start, errors


def deployment_stack(target: str, drafter: str, *, drafters: int, mode: str, lookup: bool = False, pin: bool = False,
                     cores: int | None = None, **rest) -> StackConfig:
    """One verifier with ``drafters`` drafter replicas (0: none) on this machine, as `specd bench
    serve` deploys it and `specd bench profile` calibrates it: the cores split by
    `services.up.machine_split`, as `specd up` splits them."""
    verifier_args, drafter_args, pinned = machine_split(mode, drafters, cores or machine_cores(), pin=pin)
    return StackConfig(target=target, drafter=drafter if drafters else "", drafters=drafters, verifiers=1,
                       trainer=False, mode=mode, pin=pinned, prompt_lookup=lookup,
                       verifier_args=verifier_args, drafter_args=drafter_args, **rest)


def sender(client: str, stack: Stack, model: str, temperature: float = 0.0) -> Send:
    """One streaming request at ``temperature`` (0: greedy) to the stack's first verifier through
    the chosen API: ``"http"`` (OpenAI completions) or ``"grpc"`` (Generate)."""
    if client == "grpc":
        stub = verifier_pb2_grpc.VerifierStub(open_channel(stack.verifiers[0].grpc, ServiceConfig()))
        return lambda prompt, max_tokens: grpc_completion(stub, prompt, max_tokens, temperature=temperature)
    base = stack.verifiers[0].http
    return lambda prompt, max_tokens: stream_completion(
        base, "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature})


@contextlib.contextmanager
def off_cores(cores: set[int | None]) -> Iterator[None]:
    """This process (the load generator, the measuring client) stays off ``cores`` (the
    services') where the machine has others: its work would otherwise slow the very passes
    being measured."""
    mine = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    others = mine - cores
    if not others or others == mine:
        yield
        return
    os.sched_setaffinity(0, others)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def clients_off_verifier_cores(stack: Stack) -> contextlib.AbstractContextManager[None]:
    """`off_cores` for the cores of the stack's verifiers."""
    return off_cores({v.core for v in stack.verifiers})
