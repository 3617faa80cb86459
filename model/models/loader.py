"""Hugging Face checkpoints of the decoder families: config.json and safetensors weights, in one
model.safetensors or in shards listed by model.safetensors.index.json, float32, bfloat16 or float16 on
disk, loaded into the dtype asked for. Every failure is a CheckpointError that names the file, and the
tensor where one is at fault."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model.config import CheckpointError, ConfigError
from model.models.config import Family, ModelConfig
from model.models.decoder import CausalLM
from model.models.registry import config_from_hf, family_for

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"


def read_config(directory: str | Path) -> ModelConfig:
    """The checkpoint's config.json, normalised; CheckpointError naming the file and what is wrong with it."""
    path = Path(directory) / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {directory} is missing {CONFIG_FILE}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {e}") from e
    try:
        return config_from_hf(hf)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files holding the weights: the shards model.safetensors.index.json names, else
    model.safetensors."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from e
        files = [directory / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are not in {directory}: {missing}")
        return files
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    raise CheckpointError(f"checkpoint {directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def read_weights(
    directory: str | Path,
    family: Family,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shapes: dict[str, torch.Size] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under the name of the parameter it loads into, in `dtype` on `device`.
    A tensor that is not all finite in `dtype` (on disk, or overflowing on the way to float16) is refused, and
    one whose shape differs from `shapes`' entry for its name."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = family.checkpoint_name(key)
                    if name is None:
                        continue
                    if name in state:
                        raise CheckpointError(f"{path} holds {key}, which another weight file also holds")
                    tensor = f.get_tensor(key)
                    if shapes is not None and name in shapes and tensor.shape != shapes[name]:
                        raise CheckpointError(
                            f"{path}: tensor {key} has shape {tuple(tensor.shape)}; "
                            f"config.json implies {tuple(shapes[name])}"
                        )
                    if not tensor.is_floating_point():
                        raise CheckpointError(f"{path}: tensor {key} is {tensor.dtype}, not a float type")
                    tensor = tensor.to(dtype)
                    if not torch.isfinite(tensor).all():
                        raise CheckpointError(
                            f"{path}: tensor {key} has non-finite values (inf or NaN) in {dtype} "
                            f"(stored as {f.get_slice(key).get_dtype()})"
                        )
                    state[name] = tensor.to(device)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path} cannot be read as safetensors: {e}") from e
    return state


def load_model(
    directory: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """The checkpoint's network on `device` in `dtype`, in eval mode without gradients. The modules are
    built without memory and take the loaded tensors as their parameters, so nothing is allocated twice."""
    directory = Path(directory)
    config = read_config(directory)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    state = read_weights(directory, family_for(config.architecture), dtype, device, shapes=expected)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a tied head is the embedding matrix, whatever a copy on disk says
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"the weights in {directory} do not match its config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state, assign=True)
    return model.to(device).eval().requires_grad_(False)
