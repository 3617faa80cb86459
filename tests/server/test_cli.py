"""`python -m server`: flags and refusal of an incomplete checkpoint."""
from __future__ import annotations

from model.checkpoint import DEFAULT_CHECKPOINT
from server.__main__ import main, parse_args


def test_defaults_follow_the_brief():
    args = parse_args([])
    assert (args.checkpoint, args.host, args.port, args.device, args.dtype) == (
        DEFAULT_CHECKPOINT, "127.0.0.1", 8000, "auto", "float32")


def test_flags_parse():
    args = parse_args(["--checkpoint", "x", "--max-batch", "4", "--max-waiting", "9", "--port", "0"])
    assert (str(args.checkpoint), args.max_batch, args.max_waiting, args.port) == ("x", 4, 9, 0)


def test_an_incomplete_checkpoint_exits_2_with_a_message(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["--checkpoint", str(tmp_path)]) == 2
    assert "missing model.safetensors, tokenizer.json" in capsys.readouterr().err
