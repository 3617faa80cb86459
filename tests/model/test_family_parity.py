"""Llama, Qwen2 and Qwen3 checkpoints written by transformers load into our decoder with transformers' logits
and greedy tokens, over the features that tell the families apart."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.layers import Rope, rope_inv_freq  # noqa: E402
from model.models import load_model, read_config  # noqa: E402
from model.models.config import rope_from_hf  # noqa: E402
from tests.conftest import TEST_DEVICE  # noqa: E402
from tests.model.hf_families import CASES, VOCAB, hf_model, save  # noqa: E402

GREEDY_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained directory, the directory)."""
    hf = hf_model(request.param)
    directory = save(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(directory, device=TEST_DEVICE), directory


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, the whole sequence recomputed for each."""
    ids = torch.tensor([prompt], device=TEST_DEVICE)
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)  # (1, T + 1)
    return ids[0, len(prompt) :].tolist()


def test_prompt_logprobs_match_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        theirs = hf(ids).logits.log_softmax(-1)  # (2, 40, V)
        mine = ours(ids.to(TEST_DEVICE)).log_softmax(-1).cpu()  # (2, 40, V)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers_generate(pair):
    hf, ours, _ = pair
    prompt = [5, 17, 99, 3, 64, 7]
    with torch.inference_mode():
        theirs = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=GREEDY_TOKENS,
            min_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        mine = greedy(ours, prompt, GREEDY_TOKENS)
    assert mine == theirs


def test_rope_frequencies_are_transformers_bits(pair):
    hf, ours, _ = pair
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq.cpu(), hf.model.rotary_emb.inv_freq, atol=0, rtol=0)


def test_llama3_rope_scaling_changes_the_low_frequencies():
    """The llama3 case is not default RoPE in disguise: its longest wavelengths are slowed by `factor`, its
    shortest kept, and some in between blended."""
    scaled = rope_from_hf(dict(CASES["llama-gqa3-llama3-rope-biases"][1], max_position_embeddings=128))
    assert scaled.type == "llama3"
    default, inv_freq = rope_inv_freq(Rope(theta=scaled.theta), 16), rope_inv_freq(scaled, 16)
    assert inv_freq[0] == default[0] and inv_freq[-1] == default[-1] / scaled.factor
    assert ((inv_freq > default / scaled.factor) & (inv_freq < default)).any()


def test_old_rope_spelling_reads_as_rope_parameters(tmp_path_factory):
    """`rope_theta` + `rope_scaling` {"type": ...} (configs written before transformers 5) give the same model
    as `rope_parameters`, in ours and in transformers."""
    hf = hf_model("llama-gqa3-llama3-rope-biases")
    directory = save(hf, tmp_path_factory.mktemp("old-rope"))
    new = read_config(directory)
    config = json.loads((directory / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    (directory / "config.json").write_text(json.dumps(config))
    assert read_config(directory) == new
    ids = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(ids).logits
        mine = load_model(directory, device=TEST_DEVICE)(ids.to(TEST_DEVICE)).cpu()
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)


def test_bfloat16_logprobs_match_transformers(pair):
    """In bfloat16 the order of casts matters (RMSNorm's, RoPE's tables): on the CPU, the same bits as
    transformers loading the same checkpoint in bfloat16."""
    _, _, directory = pair
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    ours_model = load_model(directory, device=TEST_DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        theirs = theirs_model(ids).logits.float().log_softmax(-1)  # (2, 40, V)
        mine = ours_model(ids.to(TEST_DEVICE)).float().log_softmax(-1).cpu()  # (2, 40, V)
    tolerance = 0.0 if TEST_DEVICE == "cpu" else 5e-2
    torch.testing.assert_close(mine, theirs, atol=tolerance, rtol=0)
