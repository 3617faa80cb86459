"""The exact and int8 backends of the Llama-style decoders (model/models/decoder.py: Llama, Qwen2, Qwen3): the
step through csrc/decoder.cpp in one call, the final RMSNorm and the head through csrc/linear.cpp, each op
with one fixed reduction order per output element whatever the batch, as GPT-2's (exact.py).

What the kernels read, packed here once from the model's weights:
- q, k and v as one product (C, (nh + 2 nkv) * hd), its columns the query heads, then the key heads, then
  the value heads, with their biases (Qwen2) or zeros;
- gate and up as one product of interleaved columns (pack_gate_up), which the SwiGLU epilogue ends;
- each RMSNorm's weight in float32 (the QK-norm's, Qwen3, over head_dim);
- RoPE's cos/sin table (rope_table) for every position of the context.
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref

import torch

from model.kernels.exact import (
    _DTYPE_CODE,
    ExactBackend,
    PackedNorm,
    PackedWeight,
    exact_attention_supported,
    step_arguments,
)
from model.kernels.int8 import Int8Backend
from model.kernels.interface import STRUCTS
from model.kernels.library import handle

GATE_UP_RUN = 8  # gate and up columns alternate in runs of this many (csrc/api.h, KV_EPILOGUE_SILU_MUL)


def rope_table(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """(positions, hd) float32: for each position p, cos(p * inv_freq) then sin(p * inv_freq) over the hd / 2
    frequencies. The angles are transformers' float32 products; their cosines and sines are taken in float64
    and rounded once, so every entry is the float32 nearest to them, the same on every machine and at any
    thread count (torch's float32 cos rounds differently in its vector loop and its scalar tail)."""
    angles = torch.arange(positions, dtype=torch.int64).float()[:, None] * inv_freq.float().cpu()[None]  # (P, hd/2)
    wide = angles.double()  # (P, hd/2)
    return torch.cat([wide.cos(), wide.sin()], dim=1).float().contiguous()  # (P, hd)


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: (..., I) -> (..., 2 * GATE_UP_RUN * ceil(I / GATE_UP_RUN)): runs of 8 gate columns and the
    8 up columns of the same outputs in turn, zeros past I."""
    *lead, inner = gate.shape
    runs = -(-inner // GATE_UP_RUN)
    padded = torch.zeros(2, *lead, runs * GATE_UP_RUN, dtype=gate.dtype, device=gate.device)  # (2, ..., runs * 8)
    padded[0, ..., :inner], padded[1, ..., :inner] = gate, up
    by_run = padded.unflatten(-1, (runs, GATE_UP_RUN)).movedim(0, -2)  # (..., runs, 2, 8)
    return by_run.reshape(*lead, runs * 2 * GATE_UP_RUN)  # (..., runs * 16)


class DecoderExactBackend(ExactBackend):
    """The step through csrc/decoder.cpp in one call (DecoderLayer.forward_step, op for op); the final norm
    and the head (the embedding when tied) through csrc/linear.cpp. Reads weights packed here, once: build a
    new one after changing the model's weights, dtype or device."""

    def __init__(self, model) -> None:
        c = model.config
        self.hidden, self.dtype = c.hidden_size, model.dtype
        self.n_head, self.n_kv_head, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.ln_f = PackedNorm.pack(model.model.norm)  # the final RMSNorm, applied by compute_logits
        self.head = self.pack(model.output_weight.t())  # (C, V)
        self.rope = rope_table(model.model.rotary_emb.inv_freq, c.max_position_embeddings)  # (P, hd)
        packed = [self._pack_layer(layer) for layer in model.model.layers]
        layers = (STRUCTS["kv_decoder_layer"] * len(packed))()
        for layer, parts in zip(layers, packed):
            for name, part in parts.items():
                if part is not None:
                    setattr(layer, name, part.params.data_ptr() if isinstance(part, PackedNorm) else part.struct)
        embed = model.model.embed_tokens.weight.detach()
        self._keep = (embed, packed, layers)  # what the struct points to
        self.weight_bytes = self.head.nbytes + sum(
            p.nbytes for parts in packed for p in parts.values() if isinstance(p, PackedWeight)
        )
        self.struct = STRUCTS["kv_decoder"](
            _DTYPE_CODE[self.dtype],
            _DTYPE_CODE[self.dtype],
            len(packed),
            self.hidden,
            self.n_head,
            self.n_kv_head,
            self.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            embed.data_ptr(),
            self.rope.data_ptr(),
            self.rope.shape[0],
            layers,
        )
        self._cache: weakref.ref | None = None  # the cache whose layer addresses `_pointers` holds
        self._pointers = None

    def _pack_layer(self, layer) -> dict[str, PackedWeight | PackedNorm | None]:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = torch.cat([p.weight for p in projections]).t()  # (C, (nh + 2 nkv) * hd)
        qkv_bias = torch.cat([p.bias for p in projections]) if attn.q_proj.bias is not None else None
        return dict(
            input_norm=PackedNorm.pack(layer.input_layernorm),
            qkv=self.pack(qkv, qkv_bias),
            q_norm=PackedNorm.pack(attn.q_norm) if attn.q_norm is not None else None,
            k_norm=PackedNorm.pack(attn.k_norm) if attn.k_norm is not None else None,
            o_proj=self.pack(attn.o_proj.weight.t(), attn.o_proj.bias),
            post_norm=PackedNorm.pack(layer.post_attention_layernorm),
            gate_up=self.pack_gate_up(mlp),
            down=self.pack(mlp.down_proj.weight.t(), mlp.down_proj.bias),
        )

    def pack_gate_up(self, mlp) -> PackedWeight:
        """gate_proj and up_proj as one product for the SwiGLU epilogue: (C, 2 I) with their columns
        interleaved (interleave_gate_up), n_out = 2 I."""
        gate, up = mlp.gate_proj, mlp.up_proj
        inner = gate.weight.shape[0]
        weight = interleave_gate_up(gate.weight.t(), up.weight.t())  # (C, 16 * ceil(I / 8))
        bias = interleave_gate_up(gate.bias, up.bias) if gate.bias is not None else None
        packed = self.pack(weight, bias)
        return dataclasses.replace(packed, n_out=2 * inner)  # y gets I columns; the padding is never stored

    def forward_step(self, step, cache) -> torch.Tensor:
        x = torch.empty((step.num_tokens, self.hidden), dtype=self.dtype, device=step.token_ids.device)  # (N, C)
        failed = handle().kv_decoder_forward(
            ctypes.byref(self.struct),
            self._layer_pointers(cache),
            cache.block_size,
            *step_arguments(step),
            x.data_ptr(),
        )
        if failed:  # checked here, not before every step: the kernels refuse what they lack
            if not exact_attention_supported(self.head_dim, cache.block_size):
                raise ValueError(
                    f"the exact attention needs a head_dim of 8, 16, 32, 64 or 128 and a block_size multiple of "
                    f"8, got {self.head_dim} and {cache.block_size}"
                )
            last = int(step.positions[: step.num_tokens].max()) if step.num_tokens else 0
            if last >= self.rope.shape[0]:
                raise ValueError(f"position {last} is past the model's context of {self.rope.shape[0]}")
            raise RuntimeError("the exact forward refused its arguments (a dtype, head_dim or block size it lacks)")
        return x


class DecoderInt8Backend(Int8Backend, DecoderExactBackend):
    """The decoder's exact step with every product (the head included) on int8 weights (model/kernels/int8.py);
    embeddings, norms, RoPE, attention and the KV cache stay float32."""
