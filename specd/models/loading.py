"""Load and save models in Hugging Face layout: ``config.json`` + safetensors (+ tokenizer).

The directory layout is Hugging Face's, so the same code loads a tiny zoo model on a laptop and
Qwen3-8B (sharded, ``model.safetensors.index.json``) on a GPU box. Weight names are data:
each architecture mirrors Hugging Face module names, and ``HF_RENAMES`` holds the exceptions.
Weights are created on the meta device and assigned from the file, so nothing is initialised
twice and an 8B model never sits in memory in two copies.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specd.models import d3d, llama, qwen3, qwen3_next, sparse

# model_type in config.json -> the module that implements it (config_class + model class).
ARCHITECTURES: dict[str, tuple[type, type[nn.Module]]] = {
    "qwen3": (qwen3.Qwen3Config, qwen3.Qwen3ForCausalLM),
    "llama": (llama.LlamaConfig, llama.LlamaForCausalLM),
    "specd_d3d": (d3d.D3DConfig, d3d.D3DModel),
    "qwen3_next": (qwen3_next.Qwen3NextConfig, qwen3_next.Qwen3NextForCausalLM),
    "specd_sparse": (sparse.SparseConfig, sparse.SparseForCausalLM),
}

# Hugging Face parameter name -> ours, where they differ (none yet: modules mirror HF names).
HF_RENAMES: dict[str, str] = {}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message says what to do."""


def read_config(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelLoadError(
            f"model directory {str(directory)!r} does not exist; build the zoo with "
            "`specd zoo build` and see `specd zoo list` for paths"
        )
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{str(directory)!r} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path} is not valid JSON: {err}") from err


def architecture(hf_config: dict[str, Any]) -> tuple[type, type[nn.Module]]:
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={hf_config.get('architectures')}); specd supports: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{str(directory)!r} has no model.safetensors nor model.safetensors.index.json")


def load_model(
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
) -> nn.Module:
    """Build the architecture named in ``config.json`` and load its weights, in eval mode, with
    attention run by ``attention_backend`` (`specd.models.attention`; a property of the machine,
    not of the checkpoint, so it is chosen here rather than stored in ``config.json``)."""
    directory = Path(directory)
    hf_config = read_config(directory)
    config_class, model_class = architecture(hf_config)
    try:
        config = config_class.from_hf(hf_config)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{directory / 'config.json'}: {err}") from err
    dtype = dtype or DTYPES.get(config.torch_dtype, torch.float32)
    with torch.device("meta"):
        model = model_class(config)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                ours = HF_RENAMES.get(name, name)
                if ours in expected:
                    tensor = f.get_tensor(name)  # ids (a drafting vocabulary) stay integers
                    state[ours] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for alias in _tied_weights(model):
        state.pop(alias, None)
        expected.pop(alias, None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{directory}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    if hasattr(model, "set_attention_backend"):
        model.set_attention_backend(attention_backend)
    return model.eval()


def _tied_weights(model: nn.Module) -> dict[str, str]:
    """State-dict name -> the name it aliases, for weights stored once: a tied LM head, and
    whatever the model declares (`D3DModel.tied_weights`)."""
    tied = dict(model.tied_weights()) if hasattr(model, "tied_weights") else {}
    if getattr(model.config, "tie_word_embeddings", False):
        tied["lm_head.weight"] = "model.embed_tokens.weight"
    return tied


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (how weight files are identified when they move)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def save_model(model: nn.Module, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (tied weights stored once)."""
    if getattr(model, "tp_size", 1) > 1:
        raise ValueError(
            f"this {type(model).__name__} is tensor-parallel (rank {model.tp_rank} of {model.tp_size}) and holds "
            f"only its share of the weights; save the whole model (load it without tensor_parallel) instead"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = model.config.to_hf()
    hf["dtype"] = hf["torch_dtype"]
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for alias in _tied_weights(model):
        state.pop(alias, None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
