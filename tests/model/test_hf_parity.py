"""Hugging Face GPT-2 checkpoints load into our model with equal logits, and ours load into theirs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model  # noqa: E402
from model.generate import generate, prefill, sequence_cache  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from tests.conftest import TEST_DEVICE  # noqa: E402


@pytest.fixture(scope="module")
def hf_random_dir(tmp_path_factory, tiny_tokenizer):
    torch.manual_seed(3)
    config = transformers.GPT2Config(
        vocab_size=tiny_tokenizer.vocab_size,
        n_positions=96,
        n_embd=48,
        n_layer=2,
        n_head=4,
        eos_token_id=tiny_tokenizer.eos_token_id,
        bos_token_id=tiny_tokenizer.eos_token_id,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    directory = tmp_path_factory.mktemp("hf-gpt2")
    hf.save_pretrained(directory)
    tiny_tokenizer.save(directory / "tokenizer.json")
    return directory, hf


def test_hf_saved_gpt2_loads_with_equal_logits(hf_random_dir):
    """Both of our forwards: the reference (B, T) one and the inference step, through its kernels."""
    directory, hf = hf_random_dir
    ours = load_model(directory, device=TEST_DEVICE)
    ids = torch.randint(0, ours.config.vocab_size, (2, 50))
    with torch.inference_mode():
        theirs = hf(ids).logits
        torch.testing.assert_close(ours(ids.to(TEST_DEVICE)).cpu(), theirs, atol=1e-5, rtol=0)
        for row in range(2):  # a prompt in two chunks: the logits of the last token of each
            cache, blocks = sequence_cache(ours, 50)
            for start, end in ((0, 10), (10, 50)):
                last = prefill(ours, cache, ids[row, start:end].tolist(), blocks, start)
                torch.testing.assert_close(last[0].cpu(), theirs[row, end - 1], atol=1e-5, rtol=0)


def test_our_greedy_generation_equals_hf_generate(hf_random_dir, tiny_tokenizer):
    directory, hf = hf_random_dir
    ours = load_model(directory, device=TEST_DEVICE)
    prompt = tiny_tokenizer.encode("To be, or not")
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    mine = [s.token_id for s in generate(ours, tiny_tokenizer, prompt, params)]
    with torch.inference_mode():
        theirs = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
            pad_token_id=tiny_tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()
    assert mine == theirs


def test_default_checkpoint_loads_into_transformers_with_equal_logits(
    default_checkpoint, default_model, default_tokenizer
):
    hf = transformers.GPT2LMHeadModel.from_pretrained(default_checkpoint).eval()
    text = "HAMLET:\nTo be, or not to be, that is the question."
    ids = torch.tensor([default_tokenizer.encode(text)])
    with torch.inference_mode():
        theirs = hf(ids).logits
        torch.testing.assert_close(default_model(ids.to(TEST_DEVICE)).cpu(), theirs, atol=1e-4, rtol=0)
        cache, blocks = sequence_cache(default_model, ids.shape[1])
        last = prefill(default_model, cache, ids[0].tolist(), blocks)
        torch.testing.assert_close(last[0].cpu(), theirs[0, -1], atol=1e-4, rtol=0)
