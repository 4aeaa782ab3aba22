"""The real model: specd's SmolLM2-135M (the zoo's ``smollm2-135m``) against transformers'
LlamaForCausalLM on the same converted checkpoint, through specd's own batched, cached passes
(ragged prefill, then decode steps) and through its plain greedy decoding and chat template."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from specd import zoo
from specd.batch import ForwardBatch
from specd.data import parse_chat
from specd.data.chat import ChatTemplate
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.llama import LlamaForCausalLM
from specd.models.loading import load_model
from specd.sampling import SamplingParams
from specd.tree import TokenTree

pytestmark = pytest.mark.zoo

DECODE_STEPS = 32


@pytest.fixture(scope="module")
def directory():
    return zoo.ensure("smollm2-135m")


@pytest.fixture(scope="module")
def ours(directory):
    model = load_model(directory)
    assert isinstance(model, LlamaForCausalLM)
    return model.eval()


@pytest.fixture(scope="module")
def theirs(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(directory):
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def chat_prompts(directory, tokenizer):
    """Two held-out chats of each of the zoo's four domains, in SmolLM2's own template."""
    template = ChatTemplate.from_dir(directory)
    prompts = []
    for items in zoo.heldout().values():
        chats = [messages for messages in (_messages(item.prompt) for item in items) if messages]
        for messages in chats[:2]:
            prompts.append(tokenizer.encode(template.render(messages)).ids[-160:])
    assert len(prompts) == 8
    return prompts


def _messages(text: str) -> list[dict]:
    try:
        return parse_chat(text)
    except ValueError:  # a code head, not a chat: give it to the model as a user turn
        return [{"role": "user", "content": text}]


def test_the_chat_template_renders_what_transformers_renders(directory):
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    template = ChatTemplate.from_dir(directory)
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]):
        for add in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert template.render(messages, add_generation_prompt=add) == expected
    assert template.render([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>system\nYou are a helpful")


def test_ragged_prefill_and_decode_logits_match_transformers(ours, theirs, chat_prompts):
    prompts = chat_prompts[:4]
    # transformers' own greedy continuation and its logits at every step, one prompt at a time.
    expected_tokens, expected_logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            expected_tokens.append(out.sequences[0, len(prompt):].tolist())
            expected_logits.append(torch.cat(out.logits))  # [steps, vocab]: step 0 is the prefill's last
    # specd: one ragged prefill of all four, then decode steps fed transformers' tokens.
    worst = 0.0
    with torch.inference_mode():
        cache = ours.new_cache(len(prompts), capacity=256)
        feed = [list(p) for p in prompts]
        for step in range(DECODE_STEPS):
            trees = [TokenTree.chain(tokens, int(length)) for tokens, length in zip(feed, cache.lengths)]
            batch = ForwardBatch.from_trees(trees, cache.lengths)
            logits = ours(batch, cache)
            cache.commit(batch, [list(range(t.num_nodes)) for t in trees])
            last = logits[torch.arange(len(prompts)), batch.last_index()]
            for b in range(len(prompts)):
                worst = max(worst, float((last[b] - expected_logits[b][step]).abs().max()))
            feed = [[tokens[step]] for tokens in expected_tokens]
    print(f"SmolLM2 ragged prefill + {DECODE_STEPS} decode steps: max |logit diff| = {worst:.2e}")
    assert worst <= 1e-4


def test_greedy_text_equals_transformers_greedy_text(ours, theirs, tokenizer, chat_prompts):
    max_tokens = 48
    ours_out = autoregressive(ours, chat_prompts, SamplingParams(max_tokens=max_tokens))
    with torch.inference_mode():
        for prompt, generation in zip(chat_prompts, ours_out):
            expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert tokenizer.decode(generation.token_ids) == tokenizer.decode(expected)


def _drafter(method: str, target, num_seqs: int):
    """The drafter of a bench decode method, for SmolLM2: n-gram, or a D3D / DFlash-style drafter
    built as the zoo builds them (the target's first layer, frozen embedding and head, an
    FR-Spec vocabulary) but untrained — losslessness may not depend on a drafter's quality."""
    if method == "ngram":
        return NgramDrafter(vocab_size=target.config.vocab_size)
    from specd.drafters.d3d import D3DDrafter
    from specd.drafters.dflash import DFlashDrafter
    from specd.drafters.hybrid import LookupHybridDrafter
    from specd.models.d3d import D3DModel
    from specd.train.drafter import init_from_target
    from specd.zoo import shared_drafter_config

    torch.manual_seed(0)
    config = shared_drafter_config(target.config, num_hidden_layers=1, draft_vocab_size=4096,
                                   mask_token_id=2, reads_target=method == "dflash")
    model = D3DModel(config)
    model.set_draft_vocab(list(range(4096)))
    assert init_from_target(model, target, layers_from=[0])
    model.eval()
    if method == "dflash":
        return DFlashDrafter(model, max_num_seqs=num_seqs)
    if method.startswith("d3d-lookup"):
        return LookupHybridDrafter(D3DDrafter(model, max_num_seqs=num_seqs))
    return D3DDrafter(model, max_num_seqs=num_seqs)


@pytest.fixture(scope="module")
def plain_greedy(ours, chat_prompts):
    """Plain greedy decoding's 32 tokens for the last ``num_seqs`` chat prompts, decoded together
    once per batch size (every method is compared with the same reference)."""
    outputs = {}

    def of(num_seqs: int) -> list[list[int]]:
        if num_seqs not in outputs:
            generations = autoregressive(ours, chat_prompts[-num_seqs:], SamplingParams(max_tokens=32))
            outputs[num_seqs] = [g.token_ids for g in generations]
        return outputs[num_seqs]

    return of


@pytest.mark.parametrize("method", ["ngram", "dflash", "d3d-sync", "d3d-async", "d3d-lookup", "d3d-lookup-async"])
@pytest.mark.parametrize("num_seqs", [1, 8])
def test_speculative_greedy_output_equals_plain_greedy_output(ours, chat_prompts, plain_greedy, method, num_seqs):
    """Every bench decode method on ragged chat prompts, at batch 1 and 8. Blocks are verified at
    full length every step (no cost model to turn a poor drafter off), so verification runs the
    few-row products and, at 8 x 9 rows, F.linear, while plain decoding runs the one-row path:
    their rounding differs, their greedy output must not."""
    prompts = chat_prompts[-num_seqs:]
    params = SamplingParams(max_tokens=32)
    expected = plain_greedy(num_seqs)
    mode = "async" if method.endswith("async") else "sync"
    engine = SpeculativeEngine(ours, _drafter(method, ours, num_seqs),
                               EngineConfig(max_num_seqs=num_seqs, block_size=8, mode=mode, adaptive_block=False))
    assert [g.token_ids for g in engine.generate(prompts, params)] == expected
    engine.close()
    assert engine.stats.num_draft_tokens > 0  # it did verify drafts


def test_bench_serve_sends_the_held_out_prompts_in_smollm2s_own_template(directory, tokenizer):
    from services.bench import prompts

    pool = prompts(str(directory), max_prompt_tokens=96)
    heldout = zoo.heldout()
    assert len(pool) == len(heldout) * min(len(items) for items in heldout.values())
    assert all(0 < len(p) <= 96 and max(p) < tokenizer.get_vocab_size() for p in pool)
    # Domains interleaved; a chat ends at SmolLM2's assistant turn, in its tokenizer's ids (the tiny
    # zoo's ids would decode to other text), and a short one keeps the template's system turn.
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in pool[: len(heldout)]]
    chats = [t for t, items in zip(texts, heldout.values()) if "<|im_start|>assistant" in items[0].prompt]
    assert chats and all(t.endswith("<|im_start|>assistant\n") for t in chats)
    decoded = [tokenizer.decode(p, skip_special_tokens=False) for p in pool]
    short_chats = [t for p, t in zip(pool, decoded) if len(p) < 96 and t.endswith("<|im_start|>assistant\n")]
    assert short_chats and all(t.startswith("<|im_start|>system\n") for t in short_chats)


@pytest.mark.parametrize("with_drafter", [True, False])
def test_the_verifier_service_with_prompt_lookup_returns_plain_greedy_output(directory, ours, chat_prompts, tmp_path,
                                                                              with_drafter):
    """`--prompt-lookup` beside a drafter service (`LookupHybridDrafter` over the remote pool),
    and alone (n-gram speculation): through gRPC, every block verified (no cost model), the
    output is plain greedy decoding's and the verifier did verify drafted tokens; the stack's
    plain verifier gives the same output without drafting."""
    from services.client import metrics
    from services.common.config import ServiceConfig
    from services.common.server import open_channel
    from services.up import Stack, StackConfig, stack_ports
    from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
    from specd.models.loading import save_model

    drafter = ""
    if with_drafter:
        save_model(_drafter("d3d-sync", ours, 2).model, tmp_path / "drafter")
        drafter = str(tmp_path / "drafter")
    prompts = chat_prompts[:2]
    expected = [g.token_ids for g in autoregressive(ours, prompts, SamplingParams(max_tokens=24))]
    config = StackConfig(target=str(directory), drafter=drafter, **stack_ports(), trainer=False, block_size=8,
                         max_num_seqs=2, mode="sync", prompt_lookup=True, plain_verifiers=1,
                         verifier_args=["--no-adaptive-block"])
    with Stack(config) as stack:
        if with_drafter:
            stack.wait_drafting()
        for verifier in (stack.verifiers[0], stack.plain[0]):
            stub = verifier_pb2_grpc.VerifierStub(open_channel(verifier.grpc, ServiceConfig()))
            for prompt, want in zip(prompts, expected):
                request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                       params=common_pb2.SamplingParams(max_tokens=24))
                assert [t for m in stub.Generate(request, timeout=300) for t in m.token_ids] == want
        assert metrics(stack.verifiers[0].http)["specd:spec_decode_num_draft_tokens_total"] > 0
        # The comparison verifier of the same stack decodes plainly: prompt lookup is not its.
        assert metrics(stack.plain[0].http).get("specd:spec_decode_num_draft_tokens_total", 0.0) == 0


def test_async_services_are_lossless_through_grpc_and_openai_and_survive_a_killed_drafter(
        directory, ours, tokenizer, chat_prompts, tmp_path):
    """The services' integration properties on SmolLM2, deployed as `specd bench serve` deploys
    async D3D (the machine shared, `services.up.machine_split`): concurrent greedy requests through
    the `openai` client, streaming and not, answer the stack's plain verifier's text and
    in-process greedy decoding's; then ``kill -9`` of the drafter during concurrent gRPC streams
    loses no request and changes no output (the verifier carries on plainly)."""
    import openai

    from services.client import metrics
    from services.common.config import ServiceConfig
    from services.common.server import open_channel
    from services.load import deployment_stack
    from services.up import Stack, stack_ports
    from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
    from specd.models.loading import save_model

    save_model(_drafter("d3d-async", ours, 4).model, tmp_path / "drafter")
    prompts, max_tokens = chat_prompts[:6], 24
    expected = [g.token_ids for g in autoregressive(ours, prompts, SamplingParams(max_tokens=max_tokens))]
    stops = set(ours.config.stop_token_ids)
    # HTTP answers stop at the model's stop token (gRPC only where asked): compare up to it.
    texts = [tokenizer.decode(ids[:next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))],
                              skip_special_tokens=True) for ids in expected]
    config = dataclasses.replace(
        deployment_stack(str(directory), str(tmp_path / "drafter"), drafters=1, mode="async", cores=2,
                         **stack_ports(), block_size=8, max_num_seqs=8),
        plain_verifiers=1)
    assert "--async-target-threads" in config.verifier_args
    with Stack(config) as stack:
        stack.wait_drafting()
        model = Path(directory).name

        def complete(url: str, prompt: list[int], stream: bool) -> str:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            if not stream:
                return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0).choices[0].text
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True)
            return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

        for stream in (False, True):
            with ThreadPoolExecutor(len(prompts)) as pool:
                spec = list(pool.map(lambda p: complete(stack.verifiers[0].http, p, stream), prompts))
                plain = list(pool.map(lambda p: complete(stack.plain[0].http, p, stream), prompts))
            assert spec == plain == texts, f"stream={stream}"
        assert metrics(stack.verifiers[0].http)["specd:spec_decode_num_draft_tokens_total"] > 0

        stub = verifier_pb2_grpc.VerifierStub(open_channel(stack.verifiers[0].grpc, ServiceConfig()))
        started = threading.Event()

        def generate(prompt: list[int]) -> list[int]:
            request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                   params=common_pb2.SamplingParams(max_tokens=max_tokens))
            tokens = []
            for message in stub.Generate(request, timeout=300):
                tokens.extend(message.token_ids)
                started.set()
            return tokens

        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(generate, p) for p in prompts]
            assert started.wait(120)
            stack.kill("drafter-0")
            assert [f.result() for f in futures] == expected
        assert generate(prompts[0]) == expected[0]  # after the fault: still served, still exact
