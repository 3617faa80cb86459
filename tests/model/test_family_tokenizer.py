"""A decoder family's tokenizer read as transformers reads it (model.checkpoint.load_tokenizer): the ids of a
prompt with its special tokens, the text of ids without them (whole and streamed), the EOS ids of both config
files, the chat template and its special tokens' texts; compared with transformers' AutoTokenizer on tiny
checkpoints made here."""

from __future__ import annotations

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from model.checkpoint import CheckpointError, load_tokenizer  # noqa: E402
from tests.model.family_checkpoints import EXTRA_ROWS, family_checkpoint  # noqa: E402

TEXTS = [
    "To be, or not to be",
    " leading space and  two spaces\n\nnew lines",
    "世界你好，莎士比亚。 Emoji 🤖🎭 and naïve café.",
    "special tokens in text: <|im_end|> and <|eot_id|> stay special",
    "",
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def auto_tokenizer(directory):
    return transformers.AutoTokenizer.from_pretrained(directory)


def test_prompt_ids_are_transformers_with_and_without_special_tokens(checkpoint):
    ours, theirs = load_tokenizer(checkpoint), auto_tokenizer(checkpoint)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=True) == theirs(text)["input_ids"], text
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text


def test_text_leaves_special_tokens_out_whole_and_streamed(checkpoint):
    ours, theirs = load_tokenizer(checkpoint), auto_tokenizer(checkpoint)
    for text in TEXTS:
        ids = theirs(text + "<|im_end|><|eot_id|>")["input_ids"]
        expected = theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special=True) == expected
        stream = ours.stream(skip_special=True)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == expected


def test_eos_ids_are_config_and_generation_config_ids_and_texts_are_tokenizer_configs(checkpoint):
    ours, theirs = load_tokenizer(checkpoint), auto_tokenizer(checkpoint)
    generation = transformers.GenerationConfig.from_pretrained(checkpoint)
    assert set(ours.eos_token_ids) == set(generation.eos_token_id) and len(ours.eos_token_ids) == 2
    assert ours.eos_token_ids[0] == json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert ours.chat_template == theirs.chat_template


def test_ids_past_the_tokenizers_up_to_the_models_vocabulary_decode_to_nothing(checkpoint):
    """Qwen's embedding has more rows than its tokenizer has ids: a sampled padding id is no error."""
    ours = load_tokenizer(checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    assert ours.vocab_size == vocab
    own = ours.hf.get_vocab_size(with_added_tokens=True)
    assert vocab == own + EXTRA_ROWS["qwen3" if "qwen3" in checkpoint.name else "llama"]
    assert all(ours.decode([i]) == "" and ours.token_bytes(i) == b"" for i in range(own, vocab))


@pytest.fixture
def llama_copy(tmp_path_factory):
    return family_checkpoint("llama", tmp_path_factory.mktemp("llama-copy"))


def set_tokenizer(directory, post_processor: bool, **settings) -> None:
    """The Llama checkpoint's tokenizer.json with or without its BOS-adding post-processor, and these
    tokenizer_config.json keys changed (None: removed)."""
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    if not post_processor:
        tokenizer["post_processor"] = None
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(settings)
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.mark.parametrize(
    "post_processor, add_bos_token",
    [(True, True), (True, False), (True, None), (False, None), (False, False)],
    ids=["adds-and-config-says-add", "adds-and-config-says-not", "adds-config-silent", "none", "none-config-says-not"],
)
def test_a_bos_is_added_as_transformers_adds_it_and_never_twice(llama_copy, post_processor, add_bos_token):
    """tokenizer.json's post-processor decides where it has one, as transformers 5 reads a checkpoint."""
    set_tokenizer(llama_copy, post_processor, add_bos_token=add_bos_token)
    ids = load_tokenizer(llama_copy).encode(TEXTS[0], add_special_tokens=True)
    assert ids == auto_tokenizer(llama_copy)(TEXTS[0])["input_ids"]
    assert ids.count(load_tokenizer(llama_copy).bos_token_id) == post_processor


def test_without_a_post_processor_add_bos_token_adds_the_bos(llama_copy):
    """A tokenizer.json that adds nothing, and tokenizer_config.json's add_bos_token true: the BOS is added, as
    transformers 4's Llama tokenizers did (transformers 5 ignores the key when tokenizer.json is there)."""
    set_tokenizer(llama_copy, post_processor=False, add_bos_token=True)
    tokenizer = load_tokenizer(llama_copy)
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=True)
    assert ids[0] == tokenizer.bos_token_id and ids[1:] == tokenizer.encode(TEXTS[0])


def test_add_bos_token_naming_a_token_not_in_the_vocabulary_is_refused_naming_it(llama_copy):
    set_tokenizer(llama_copy, post_processor=False, add_bos_token=True, bos_token="<s>")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: add_bos_token is true, but its bos_token '<s>'"):
        load_tokenizer(llama_copy)


def test_chat_template_jinja_and_special_tokens_map_are_read_as_transformers_reads_them(llama_copy):
    """The chat template of chat_template.jinja wins over tokenizer_config.json's; special_tokens_map.json names
    the BOS where tokenizer_config.json does not."""
    set_tokenizer(llama_copy, post_processor=True, bos_token=None)
    (llama_copy / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<|begin_of_text|>"}}))
    (llama_copy / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    ours, theirs = load_tokenizer(llama_copy), auto_tokenizer(llama_copy)
    assert ours.chat_template == theirs.chat_template == (llama_copy / "chat_template.jinja").read_text()
    assert ours.bos_token == theirs.bos_token == "<|begin_of_text|>"


def test_without_eos_ids_in_either_config_the_tokenizer_configs_eos_token_ends_a_sequence(llama_copy):
    for name in ("config.json", "generation_config.json"):
        config = json.loads((llama_copy / name).read_text())
        config.pop("eos_token_id", None)
        (llama_copy / name).write_text(json.dumps(config))
    tokenizer = load_tokenizer(llama_copy)
    assert tokenizer.eos_token_ids == (tokenizer.hf.token_to_id("<|eot_id|>"),)


def test_a_gpt2_checkpoint_without_tokenizer_config_is_unchanged(tiny_checkpoint, tmp_path):
    """No tokenizer_config.json: no BOS, <|endoftext|> from config.json ends a sequence (GPT-2's checkpoints)."""
    directory = tmp_path / "gpt2"
    shutil.copytree(tiny_checkpoint, directory)
    tokenizer = load_tokenizer(directory)
    assert tokenizer.encode(TEXTS[0], add_special_tokens=True) == tokenizer.encode(TEXTS[0])
    assert tokenizer.bos_token is None and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.hf.post_processor is None
