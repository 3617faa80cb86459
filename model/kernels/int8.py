"""int8 weights: per-output-column symmetric quantization, made at load from a float checkpoint, and
the backend that runs them (csrc/linear_q8.cpp: AVX2, AVX-VNNI, AVX512-VNNI or AMX, whichever the CPU
has and KVSERVE_ISA allows; every path gives the same bits).

Each product's weight column o gets scale[o] = max_k |W[k][o]| / 127 and W8[k][o] = round(W / scale)
(nearest even), the tied head included (a column per vocabulary entry). Activations are quantized in
the kernel, per token row, by that row's own max |x|, so they stay row-local: a token's logits do not
depend on the batch, and cached equals uncached bit for bit, as with the float kernels. Embeddings,
layer norms, attention and the KV cache stay float32.
"""

from __future__ import annotations

import torch

from model.kernels.exact import GROUP, STRIP, ExactBackend, PackedWeight
from model.kernels.interface import WEIGHT_INT8
from model.kernels.library import handle, unavailable_reason

QUANTIZATIONS = ("int8",)


def int8_unavailable_reason() -> str | None:
    """Why the int8 kernels cannot run here (the exact kernels do not build or load: every CPU they load
    on has an int8 path), or None."""
    if handle() is None:
        return f"the exact kernels do not run here: {unavailable_reason()}"
    return None


def quantize_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: (in, out) float. Returns int8 (in, out) and float32 scales (out,): symmetric, per column."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=0)  # (out,)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (out,)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)  # (in, out)
    return q, scale


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """weight: (in, out) float, quantized per column and packed for csrc/linear_q8.cpp:
    (groups, 4, in / 4, 16, 4) int8, k in quads of 4, zero past `in` and `out`."""
    n_in, n_out = weight.shape
    q, scale = quantize_columns(weight)
    groups, quads = -(-n_out // GROUP), -(-n_in // 4)
    padded = torch.zeros(quads * 4, groups * GROUP, dtype=torch.int8)  # (in padded, out padded)
    padded[:n_in, :n_out] = q
    packed = padded.view(quads, 4, groups, GROUP // STRIP, STRIP).permute(2, 3, 0, 4, 1).contiguous()
    cols = groups * GROUP
    scales = torch.zeros(cols, dtype=torch.float32)
    scales[:n_out] = scale
    offset = (128 * padded.sum(dim=0, dtype=torch.int32)).to(torch.int32)  # (out padded,)
    b = torch.zeros(cols, dtype=torch.float32)
    if bias is not None:
        b[:n_out] = bias.detach().float()
    return PackedWeight(packed, b, n_in, n_out, WEIGHT_INT8, scales, offset)


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The float32 (in, out) weight an int8 PackedWeight stands for: W8 * scale (for tests and quality)."""
    groups, strips, quads, strip, four = packed.weight.shape
    q = packed.weight.permute(2, 4, 0, 1, 3).reshape(quads * four, groups * strips * strip)  # (in padded, out padded)
    return (q.float() * packed.scale)[: packed.n_in, : packed.n_out]


class Int8Backend(ExactBackend):
    """The exact backend's step with every product (the head included) on int8 weights. With another exact
    backend after it in the bases (model/kernels/decoder.py's DecoderInt8Backend), that backend's step."""

    quantization = "int8"

    def __init__(self, model) -> None:
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise ValueError(
                f"int8 weights are quantized from a float32 model on the CPU, got {model.dtype} on "
                f"{model.device} (use --dtype float32)"
            )
        why = int8_unavailable_reason()
        if why is not None:
            raise RuntimeError(f"the int8 kernels do not run here: {why}")
        super().__init__(model)

    @staticmethod
    def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        return pack_int8(weight, bias)
