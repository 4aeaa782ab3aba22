"""The serving loop: requests arriving concurrently decode exactly as a plain batch would."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, autoregressive
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.sampling import SamplingParams
from specd.serving import ContextTooLong, ServingEngine

VOCAB = FLAVOURS["debug"].vocab_size


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


def prompts(num: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(num)
    return [torch.randint(7, VOCAB, (int(n),), generator=generator).tolist() for n in torch.randint(3, 20, (num,), generator=generator)]


def drafter(num_seqs: int) -> D3DDrafter:
    torch.manual_seed(4)
    return D3DDrafter(D3DModel(D3D_FLAVOURS["debug"]).eval(), max_num_seqs=num_seqs)


@pytest.mark.parametrize("mode", ["none", "sync", "async"])
def test_concurrent_requests_equal_plain_greedy(target, mode):
    """More requests than rows, submitted from many threads: each equals its plain greedy output."""
    batch = prompts(10)
    params = [SamplingParams(max_tokens=int(n), temperature=0.0) for n in torch.randint(1, 24, (len(batch),))]
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    config = EngineConfig(max_num_seqs=4, block_size=6, mode="async" if mode == "none" else mode)
    engine = ServingEngine(target, None if mode == "none" else drafter(4), config)
    results = [None] * len(batch)

    def client(i):
        results[i] = engine.generate(batch[i], params[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.shutdown()
    assert results == expected
    if mode != "none":
        assert engine.stats.num_draft_tokens > 0


def test_async_iteration_and_usage(target):
    prompt = prompts(1)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = autoregressive(target, [prompt], params)[0].token_ids
    engine = ServingEngine(target, drafter(2), EngineConfig(max_num_seqs=2, block_size=4))

    async def collect():
        return [delta async for delta in engine.submit(prompt, params)]

    deltas = asyncio.run(collect())
    engine.shutdown()
    assert [t for d in deltas for t in d.token_ids] == expected
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == len(prompt)
    assert sum(last.accepted_lengths) + len(last.accepted_lengths) >= 12  # every pass commits k + 1
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_bad_requests_are_refused_before_queueing(target):
    engine = ServingEngine(target, max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([VOCAB + 5], SamplingParams())
    with pytest.raises(ContextTooLong, match="context is 32"):
        engine.submit([9] * 30, SamplingParams(max_tokens=8))
    assert engine.generate([9, 10, 11], SamplingParams(max_tokens=3)) == autoregressive(
        target, [[9, 10, 11]], SamplingParams(max_tokens=3))[0].token_ids
    engine.shutdown()


def test_cancel_frees_the_row(target):
    """A cancelled request ends with "abort" and its row serves the next request."""
    engine = ServingEngine(target, config=EngineConfig(max_num_seqs=1))
    stream = engine.submit(prompts(1)[0], SamplingParams(max_tokens=400))
    first = next(iter(stream))
    stream.cancel()
    rest = list(stream)
    assert first.finish_reason is None and rest[-1].finish_reason == "abort"
    prompt = [9, 10, 11]
    assert engine.generate(prompt, SamplingParams(max_tokens=5)) == autoregressive(
        target, [prompt], SamplingParams(max_tokens=5))[0].token_ids
    engine.shutdown()


def test_shutdown_drains_queued_requests(target):
    engine = ServingEngine(target, config=EngineConfig(max_num_seqs=1))
    streams = [engine.submit(p, SamplingParams(max_tokens=5)) for p in prompts(3)]
    engine.shutdown(drain=True)
    assert [sum(len(d.token_ids) for d in s) for s in streams] == [5, 5, 5]
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit([9], SamplingParams())


def test_a_pass_covers_only_the_busy_rows(target):
    """One request in an engine of 8 rows: its passes cover one cache row, not eight (idle rows
    would cost padding compute), and the output is still exactly plain decoding."""
    engine = ServingEngine(target, drafter(8), EngineConfig(max_num_seqs=8, block_size=4))
    prompt = prompts(1)[0]
    params = SamplingParams(max_tokens=9)
    assert engine.generate(prompt, params) == autoregressive(target, [prompt], params)[0].token_ids
    assert engine.engine._last_batch.num_seqs == 1
    assert engine.engine.drafter.cache.lengths[1:].eq(0).all()  # the drafter used its first row only
    engine.shutdown()


def test_a_bounded_drain_aborts_what_it_could_not_finish(target):
    engine = ServingEngine(target, config=EngineConfig(max_num_seqs=1))
    long = engine.submit(prompts(1)[0], SamplingParams(max_tokens=4000))
    queued = engine.submit([9, 10], SamplingParams(max_tokens=4))
    next(iter(long))  # it is running
    engine.shutdown(drain=True, timeout=0.2)
    assert list(long)[-1].finish_reason == "abort"
    assert list(queued)[-1].finish_reason == "abort"


def test_a_finished_request_records_its_prompt_and_its_tokens_per_pass(target):
    """The engine's context grows with the output; the request's recorded prompt (its trace) must not."""
    finished = []
    engine = ServingEngine(target, drafter(2), EngineConfig(max_num_seqs=2, block_size=4), on_finish=finished.append)
    prompt = prompts(1)[0]
    deltas = list(engine.submit(prompt, SamplingParams(max_tokens=12)))
    engine.shutdown()
    (record,) = finished
    output = [t for d in deltas for t in d.token_ids]
    assert (record.prompt, record.output) == (prompt, output)
    usage = deltas[-1].usage
    assert 1 <= usage.target_passes <= 12
    assert usage.tokens_per_pass == pytest.approx(len(output) / usage.target_passes)
