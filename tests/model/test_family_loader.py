"""The decoder families' loader: one safetensors file or shards, float32/bfloat16/float16 on disk, tied or
untied heads; and a CheckpointError naming the file and tensor for each way a checkpoint can be wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from model.checkpoint import CheckpointError  # noqa: E402
from model.models import load_model  # noqa: E402
from tests.model.hf_families import VOCAB, hf_model, save  # noqa: E402

CASE = "qwen2-gqa2-bias-tied"
IDS = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def checkpoint(tmp_path):
    """A float32 single-file checkpoint and the model that wrote it."""
    hf = hf_model(CASE)
    return save(hf, tmp_path / "ckpt"), hf


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        out = model(IDS)
    return getattr(out, "logits", out)


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    hf = hf_model(CASE)
    directory = save(hf, tmp_path / "sharded", max_shard_size="20KB")
    shards = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 2 and not (directory / "model.safetensors").exists()
    ours = load_model(directory)
    for name, param in hf.state_dict().items():
        if name != "lm_head.weight":  # tied: the embedding matrix
            torch.testing.assert_close(ours.state_dict()[name], param, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(logits(ours), logits(hf), atol=1e-4, rtol=0)


@pytest.mark.parametrize("disk_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_disk_loads_in_float32_and_in_its_own_dtype(tmp_path, disk_dtype):
    directory = save(hf_model(CASE).to(disk_dtype), tmp_path / "half")
    on_disk = load_file(str(directory / "model.safetensors"))
    ours = load_model(directory, dtype=torch.float32)
    for name, tensor in on_disk.items():
        assert tensor.dtype == disk_dtype
        torch.testing.assert_close(ours.state_dict()[name], tensor.float(), atol=0, rtol=0, msg=name)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(ours), logits(theirs), atol=1e-4, rtol=0)
    half = load_model(directory, dtype=disk_dtype)
    assert {p.dtype for p in half.parameters()} == {disk_dtype}
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies stay float32
    assert torch.isfinite(logits(half)).all()


def test_untied_head_loads_its_own_matrix(tmp_path):
    hf = hf_model("qwen3-mqa-head_dim-qknorm")
    ours = load_model(save(hf, tmp_path / "untied"))
    assert ours.lm_head is not None
    torch.testing.assert_close(ours.output_weight, hf.lm_head.weight, atol=0, rtol=0)
    assert not torch.equal(ours.output_weight, ours.model.embed_tokens.weight)


def rewrite_weights(directory, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_tied_head_ignores_a_copy_on_disk(checkpoint):
    directory, hf = checkpoint
    rewrite_weights(directory, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])}))
    torch.testing.assert_close(logits(load_model(directory)), logits(hf), atol=1e-4, rtol=0)


def test_llama_rope_buffers_of_old_checkpoints_are_ignored(tmp_path):
    hf = hf_model("llama-mha-untied")
    directory = save(hf, tmp_path / "old-llama")
    rewrite_weights(directory, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    torch.testing.assert_close(logits(load_model(directory)), logits(hf), atol=1e-4, rtol=0)


def test_non_finite_weight_is_refused_naming_the_tensor_and_file(checkpoint):
    directory, _ = checkpoint
    rewrite_weights(directory, lambda t: t["model.layers.1.mlp.down_proj.weight"].view(-1)[7].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(directory)


def test_weight_overflowing_float16_is_refused(checkpoint):
    directory, _ = checkpoint
    rewrite_weights(directory, lambda t: t["model.layers.0.self_attn.q_proj.bias"].fill_(1e6))
    load_model(directory)  # finite in float32
    with pytest.raises(CheckpointError, match=r"q_proj\.bias has non-finite values .* in torch\.float16"):
        load_model(directory, dtype=torch.float16)


def test_missing_shard_is_named(tmp_path):
    directory = save(hf_model(CASE), tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json lists shards .*{shard.name}"):
        load_model(directory)


def test_truncated_weights_file_is_named(checkpoint):
    directory, _ = checkpoint
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{path} cannot be read as safetensors"):
        load_model(directory)


def test_missing_and_misshapen_tensors_are_named(checkpoint):
    directory, _ = checkpoint
    rewrite_weights(directory, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.1\.post_attention_layernorm\.weight'\]"):
        load_model(directory)
    rewrite_weights(directory, lambda t: t.update({"model.layers.1.post_attention_layernorm.weight": torch.ones(5)}))
    with pytest.raises(CheckpointError, match=r"post_attention_layernorm\.weight has shape \(5,\); .* \(48,\)"):
        load_model(directory)


def test_config_problems_are_named_with_the_file(checkpoint):
    directory, _ = checkpoint
    config = json.loads((directory / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "sliding_attention"])
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: use_sliding_window=true"):
        load_model(directory)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="is missing config.json"):
        load_model(directory)
