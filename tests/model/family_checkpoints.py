"""Tiny random checkpoints of the decoder families with a tokenizer, as the published ones are laid out: a
Llama one whose tokenizer adds a BOS (tokenizer.json's post-processor, add_bos_token in tokenizer_config.json)
and a Qwen3 one whose does not,
each with its own chat template, special tokens, several EOS ids and, for Qwen3, an embedding with more rows
than its tokenizer has ids. Written by transformers' own classes (save_pretrained), so transformers loads them.

The weights are drawn wider than transformers' initialisation (std 0.2, norm weights 1 ± 0.2), so that greedy
choices are not near-ties and torch's kernels pick the same tokens as transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, processors

from model.tokenizer import train_tokenizer
from tests.conftest import TINY_TEXT

# The texts of the special tokens (not the published ids: the tokenizer here is tiny).
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Templates in each family's layout, written for these tests.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAPE = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
FAMILIES = {
    # name -> (transformers class, its config keys, special tokens, tokenizer_config.json keys)
    "llama": ("LlamaForCausalLM", dict(rope_theta=5e5, tie_word_embeddings=True), LLAMA_SPECIALS, {}),
    "qwen3": ("Qwen3ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=False), QWEN_SPECIALS, {}),
}
EXTRA_ROWS = {"llama": 0, "qwen3": 37}  # Qwen's embedding is larger than its tokenizer


def tokenizer_with(specials: list[str]):
    """A byte-level BPE of the test text, with the family's special tokens after its own ids."""
    tokenizer = train_tokenizer([TINY_TEXT], vocab_size=400)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def family_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """The family's tiny checkpoint in `directory`: config.json, model.safetensors, generation_config.json,
    tokenizer.json and tokenizer_config.json."""
    import transformers
    from transformers.utils import logging

    class_name, keys, specials, _ = FAMILIES[family]
    hf_tokenizer = tokenizer_with(specials).hf
    ids = {t: hf_tokenizer.token_to_id(t) for t in specials}
    vocab = hf_tokenizer.get_vocab_size(with_added_tokens=True) + EXTRA_ROWS[family]
    if family == "llama":
        bos, eos, config_eos, generation_eos = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<|eot_id|>"
        settings = dict(add_bos_token=True, chat_template=LLAMA_TEMPLATE)
    else:
        bos, eos, config_eos, generation_eos = None, "<|im_end|>", "<|im_end|>", "<|endoftext|>"
        settings = dict(add_bos_token=False, chat_template=QWEN_TEMPLATE)
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=vocab,
        bos_token_id=None if bos is None else ids[bos],
        eos_token_id=ids[config_eos],
        **SHAPE,
        **keys,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.2)
    model.generation_config.eos_token_id = [ids[config_eos], ids[generation_eos]]
    logging.disable_progress_bar()
    model.save_pretrained(directory)
    if bos is not None:  # as Llama 3's tokenizer.json: its post-processor puts the BOS before a prompt
        hf_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", special_tokens=[(bos, ids[bos])]
        )
    hf_tokenizer.save(str(directory / "tokenizer.json"))
    settings.update(
        bos_token=bos,
        eos_token=eos,
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=SHAPE["max_position_embeddings"],
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return directory
