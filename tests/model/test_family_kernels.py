"""The exact kernels the Llama-style decoders add, op by op: RMSNorm in the products' prologue, the SwiGLU
epilogue over interleaved gate/up columns, QK-norm and rotate-half RoPE from float32 tables, grouped-query
attention over a cache that holds only the key/value heads. Each against a torch or float64 reference, each
a row's same bits in any batch, and the products' new code on every path the CPU has giving the AVX2
path's bits (float32, int8) or staying within the bound (bfloat16's AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import kernels
from model.kernels import EPILOGUE_RESIDUAL, EPILOGUE_SILU_MUL, PackedNorm, PackedWeight, interleave_gate_up
from model.kernels.int8 import pack_int8
from model.kv_cache import PagedKVCache, StepBatch
from model.layers import RMSNorm, apply_rotary, rope_inv_freq
from model.layers.rotary import Rope
from model.models import config_from_hf
from tests.conftest import CPU_ISAS, forced_isa, isa_params, needs_exact

pytestmark = needs_exact
U = 2.0**-24  # float32 unit roundoff
PRODUCT_PATHS = ("avx2", "avx512", "avx512-vnni")  # float32: avx2, avx512; bfloat16 and int8 also their own at the last


def rand(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(params=isa_params(*PRODUCT_PATHS))
def isa(request):
    with forced_isa(request.param):
        yield request.param


def rms_norm(dim: int, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * rand(dim, seed=seed))
    return norm


# ---- RMSNorm in the products' prologue --------------------------------------------------------------


@pytest.mark.parametrize("K", [200, 64, 13])
def test_rms_norm_prologue_is_rms_norm_within_float32_rounding_and_row_invariant(isa, K):
    norm, W, b = rms_norm(K, 1), rand(K, 70, scale=0.1, seed=2), rand(70, seed=3)
    packed, rms = PackedWeight.pack(W, b), PackedNorm.pack(norm)
    x = rand(21, K, seed=4, scale=3) + 1
    ours = kernels.linear(x, packed, norm=rms).double()
    with torch.no_grad():
        normed = norm(x.double())  # float64 statistics: the exact RMSNorm
    reference = normed @ W.double() + b.double()
    bound = (K + 4) * U * (normed.abs() @ W.double().abs() + b.double().abs())
    assert ((ours - reference).abs() <= bound).all(), f"max error {(ours - reference).abs().max():.3g}"
    assert torch.equal(kernels.linear(x[5:6], packed, norm=rms).double(), ours[5:6])


def test_rms_norm_prologue_in_bfloat16_rounds_as_transformers_does():
    """x / rms cast to bfloat16, then times the weight, rounded again: through an identity product the
    kernel's normalized rows equal RMSNorm's bfloat16 output within its last bit (torch's mean adds the
    squares in another order), and most are the same bits."""
    K = 96
    norm = rms_norm(K, 5).bfloat16()
    x = (rand(40, K, seed=6, scale=2) + 0.5).bfloat16()
    identity = PackedWeight.pack(torch.eye(K, dtype=torch.bfloat16))
    ours = kernels.linear(x, identity, norm=PackedNorm.pack(norm))
    with torch.no_grad():
        theirs = norm(x)
    spacing = 2.0 ** (torch.floor(torch.log2(theirs.float().abs().clamp_min(1e-30))) - 7)
    assert ((ours.float() - theirs.float()).abs() <= spacing).all()
    assert (ours == theirs).float().mean() > 0.95


# ---- SwiGLU: gate and up in one product -------------------------------------------------------------


def swiglu_weights(K: int, inner: int, seed: int = 0):
    Wg, Wu = rand(K, inner, scale=0.1, seed=seed), rand(K, inner, scale=0.1, seed=seed + 1)
    bg, bu = rand(inner, scale=0.2, seed=seed + 2), rand(inner, scale=0.2, seed=seed + 3)
    return Wg, Wu, bg, bu


def pack_swiglu(Wg, Wu, bg, bu, pack=PackedWeight.pack) -> PackedWeight:
    import dataclasses

    packed = pack(interleave_gate_up(Wg, Wu), interleave_gate_up(bg, bu))
    return dataclasses.replace(packed, n_out=2 * Wg.shape[1])


@pytest.mark.parametrize("inner", [96, 100, 3])
def test_silu_mul_epilogue_is_swiglu_within_float32_rounding(isa, inner):
    K = 80
    Wg, Wu, bg, bu = swiglu_weights(K, inner)
    x = rand(9, K, seed=7, scale=2)
    y = kernels.linear(x, pack_swiglu(Wg, Wu, bg, bu), EPILOGUE_SILU_MUL)
    assert y.shape == (9, inner)
    gate, up = x.double() @ Wg.double() + bg.double(), x.double() @ Wu.double() + bu.double()
    torch.testing.assert_close(y.double(), F.silu(gate) * up, atol=2e-5, rtol=2e-5)


def test_silu_mul_epilogue_rows_are_the_same_bits_in_any_batch_and_on_every_path():
    Wg, Wu, bg, bu = swiglu_weights(120, 100, seed=4)
    x = rand(33, 120, seed=8)
    packed = pack_swiglu(Wg, Wu, bg, bu)
    results = {}
    for level in [lvl for lvl in ("avx2", "avx512") if lvl in CPU_ISAS]:
        with forced_isa(level):
            together = kernels.linear(x, packed, EPILOGUE_SILU_MUL)
            for i in (0, 16, 32):
                assert torch.equal(kernels.linear(x[i : i + 1], packed, EPILOGUE_SILU_MUL), together[i : i + 1])
            results[level] = together
    assert all(torch.equal(r, results["avx2"]) for r in results.values())


@pytest.mark.parametrize("isa", isa_params("avx2", "avx-vnni", "avx512-vnni", "amx"), indirect=True)
def test_int8_silu_mul_epilogue_gives_the_avx2_paths_bits(isa):
    Wg, Wu, bg, bu = swiglu_weights(128, 100, seed=9)
    packed = pack_swiglu(Wg, Wu, bg, bu, pack_int8)
    x = rand(20, 128, seed=10)
    norm = PackedNorm.pack(rms_norm(128, 11))
    here = kernels.linear(x, packed, EPILOGUE_SILU_MUL, norm=norm)
    with forced_isa("avx2"):
        on_avx2 = kernels.linear(x, packed, EPILOGUE_SILU_MUL, norm=norm)
    assert torch.equal(here, on_avx2)
    assert torch.equal(kernels.linear(x[7:8], packed, EPILOGUE_SILU_MUL, norm=norm), here[7:8])


@pytest.mark.parametrize("isa", isa_params("avx2", "avx512", "avx512-vnni"), indirect=True)
def test_bfloat16_silu_mul_epilogue_rounds_each_op_as_a_bfloat16_model_does(isa):
    """gate, up, silu(gate) and the product each rounded to bfloat16, as transformers' bfloat16 MLP: through
    the same products, torch's ops on the kernel's own gate and up columns give the same bits."""
    Wg, Wu, bg, bu = (t.bfloat16() for t in swiglu_weights(64, 40, seed=12))
    x = rand(6, 64, seed=13).bfloat16()
    y = kernels.linear(x, pack_swiglu(Wg, Wu, bg, bu), EPILOGUE_SILU_MUL)
    gate = kernels.linear(x, PackedWeight.pack(Wg, bg))  # (6, 40) bfloat16
    up = kernels.linear(x, PackedWeight.pack(Wu, bu))
    close = F.silu(gate) * up
    assert y.dtype == torch.bfloat16
    spacing = 2.0 ** (torch.floor(torch.log2(close.float().abs().clamp_min(1e-30))) - 7)
    assert ((y.float() - close.float()).abs() <= spacing).all()  # silu's exp is ours, not torch's: a bit at most


# ---- QK-norm and RoPE --------------------------------------------------------------------------------


def rope_case(hd: int, dtype=torch.float32, n_head=3, n_kv=1, seed=0):
    rope = Rope(theta=10000.0)
    table = kernels.rope_table(rope_inv_freq(rope, hd), 300)  # (300, hd)
    positions = torch.tensor([0, 1, 17, 299, 5, 128])
    qkv = rand(6, (n_head + 2 * n_kv) * hd, seed=seed).to(dtype)
    return table, positions, qkv


def reference_rope(x, table, positions, dtype):
    """model.layers.apply_rotary over the same table's cos/sin, cast to the activations' dtype."""
    h = table.shape[1] // 2
    cos, sin = table[positions, :h], table[positions, h:]  # (N, hd/2)
    cos, sin = torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)  # (N, hd)
    return apply_rotary(x, cos, sin)


@pytest.mark.parametrize("hd", [8, 16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rope_is_apply_rotary_bit_for_bit_and_leaves_the_values_alone(hd, dtype):
    """float32: one product per term, no FMA, as torch's; bfloat16: each op rounded, as torch's bfloat16 ops."""
    table, positions, qkv = rope_case(hd, dtype)
    ours = qkv.clone()
    kernels.rope(ours, positions, table, 3, 1)
    heads = qkv.view(6, 5, hd)  # (N, nh + 2 nkv, hd)
    assert torch.equal(ours.view(6, 5, hd)[:, :4], reference_rope(heads[:, :4], table, positions, dtype))
    assert torch.equal(ours.view(6, 5, hd)[:, 4], heads[:, 4])  # the value head


def test_rope_table_is_the_rotation_of_transformers_frequencies():
    inv_freq = rope_inv_freq(Rope(theta=1e6), 64)
    table = kernels.rope_table(inv_freq, 4096)
    angles = torch.arange(4096).double()[:, None] * inv_freq.double()[None]
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], 1), atol=3e-4, rtol=0)
    assert table.dtype == torch.float32 and table.shape == (4096, 64)


def test_qk_norm_then_rope_is_the_attention_layers_projection_within_float32_rounding():
    hd = 32
    table, positions, qkv = rope_case(hd, n_head=2, n_kv=1, seed=3)
    q_norm, k_norm = rms_norm(hd, 14), rms_norm(hd, 15)
    weights = PackedNorm.pack(q_norm).params, PackedNorm.pack(k_norm).params
    ours = qkv.clone()
    kernels.rope(ours, positions, table, 2, 1, *weights, 1e-5)
    heads = qkv.view(6, 4, hd)
    with torch.no_grad():
        q, k = q_norm(heads[:, :2].double()).float(), k_norm(heads[:, 2:3].double()).float()
    expected = [reference_rope(t, table, positions, torch.float32) for t in (q, k)]
    torch.testing.assert_close(ours.view(6, 4, hd)[:, :3], torch.cat(expected, 1), atol=1e-5, rtol=1e-5)
    alone = qkv[3:4].clone()
    kernels.rope(alone, positions[3:4], table, 2, 1, *weights, 1e-5)
    assert torch.equal(alone, ours[3:4])


def test_rope_refuses_a_position_past_its_table():
    table, positions, qkv = rope_case(16)
    with pytest.raises(ValueError, match="outside the table"):
        kernels.rope(qkv, torch.tensor([0, 1, 2, 3, 4, 300]), table, 3, 1)


# ---- grouped-query attention over the paged cache ------------------------------------------------------

GQA = config_from_hf(
    {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
    }
)  # 6 query heads reading 2 key/value heads of 32: groups of 3


def run_gqa(qkv, cache, sequences, block_size=16):
    step = StepBatch.build([([0] * n, start, blocks) for start, n, blocks in sequences], block_size)
    return kernels.paged_attention(qkv, cache.layers[0], step, GQA.num_attention_heads, block_size)


def test_grouped_attention_reads_each_groups_key_value_head_within_float32_rounding_of_float64():
    torch.manual_seed(0)
    N, hd = 50, 32
    cache = PagedKVCache(GQA, 8, 16)
    assert cache.layers[0].shape == (8, 2, 2, 16 * hd)  # only the key/value heads
    qkv = torch.randn(N, (6 + 2 * 2) * hd)
    out = run_gqa(qkv, cache, [(0, N, [6, 1, 3, 0])])
    assert out.shape == (N, 6 * hd)
    q = qkv[:, : 6 * hd].view(N, 6, hd)
    k, v = qkv[:, 6 * hd : 8 * hd].view(N, 2, hd), qkv[:, 8 * hd :].view(N, 2, hd)
    for t in (0, 15, 16, 49):
        for h in range(6):
            g = h // 3
            scores = k[: t + 1, g].double() @ q[t, h].double() / hd**0.5
            ref = scores.softmax(0) @ v[: t + 1, g].double()
            torch.testing.assert_close(out[t, h * hd : (h + 1) * hd].double(), ref, atol=2e-6, rtol=1e-5)
    keys, values = cache.keys_values(0)  # (nb, nkv, hd, bs), (nb, nkv, bs, hd)
    assert torch.equal(keys[6].permute(2, 0, 1), k[:16]) and torch.equal(values[1].transpose(0, 1), v[16:32])


def test_grouped_attention_prefill_row_equals_the_decode_step_and_any_batch():
    torch.manual_seed(1)
    qkv = torch.randn(40, 10 * 32)
    prefill = run_gqa(qkv, PagedKVCache(GQA, 8, 16), [(0, 40, [2, 5, 7])])
    cache = PagedKVCache(GQA, 8, 16)
    decode = torch.cat([run_gqa(qkv[t : t + 1], cache, [(t, 1, [2, 5, 7])]) for t in range(40)])
    assert torch.equal(prefill, decode)
    shared = PagedKVCache(GQA, 12, 16)
    shared.layers[0].fill_(float("nan"))  # what no sequence wrote must count for nothing
    others = torch.randn(25, 10 * 32)
    out = run_gqa(torch.cat([others[:9], qkv, others[9:]]), shared, [(0, 9, [0]), (0, 40, [2, 5, 7]), (3, 16, [9, 10])])
    assert torch.equal(out[9:49], prefill)


@pytest.mark.skipif("avx512" not in CPU_ISAS, reason=f"this CPU lacks avx512 (it has {', '.join(CPU_ISAS)})")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.int8),
        (torch.bfloat16, torch.int8),
    ],
    ids=["f32", "f32-bf16cache", "bf16", "f32-int8cache", "bf16-int8cache"],
)
def test_grouped_attention_gives_the_avx2_paths_bits_on_avx512(head_dim, block_size, dtype, cache_dtype):
    """The 16-lane attention (block sizes of 16s, head_dim of 32s) runs each key's and each output
    dimension's sequence of the 8-lane one: the same bits, prefill and decode, at any length."""
    config = GQA.replace(head_dim=head_dim)
    qkv = rand(70, 10 * head_dim, seed=head_dim + block_size).to(dtype)
    blocks = [5, 0, 3, 7, 1]
    sequences = [(0, 70, blocks)]
    results = {}
    for level in ("avx2", "avx512"):
        with forced_isa(level):
            cache = PagedKVCache(config, 8, block_size, dtype=cache_dtype)
            prefill = run_gqa(qkv[:69], cache, [(0, 69, blocks)], block_size)
            decode = run_gqa(qkv[69:], cache, [(69, 1, blocks)], block_size)
            results[level] = torch.cat([prefill, decode])
            assert torch.equal(
                results[level],
                run_gqa(qkv, PagedKVCache(config, 8, block_size, dtype=cache_dtype), sequences, block_size),
            )
    assert torch.equal(results["avx2"], results["avx512"])
    q = qkv[69, :head_dim].double()  # and both are the attention: query head 0 of the last token, in float64
    keys = as_cached(qkv[:, 6 * head_dim : 7 * head_dim], cache_dtype).double()
    values = as_cached(qkv[:, 8 * head_dim : 9 * head_dim], cache_dtype).double()
    ref = (keys @ q / head_dim**0.5).softmax(0) @ values
    torch.testing.assert_close(
        results["avx512"][69, :head_dim].double(),
        ref,
        atol=1e-2 if dtype == torch.bfloat16 else 2e-6,
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
    )


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """(T, hd): each row as a cache of `cache_dtype` holds it, in float32: rounded to bfloat16, or quantized to
    int8 with its scale max |x| / 127 (round half to even) and widened back."""
    x = x.float()
    if cache_dtype != torch.int8:
        return x.to(cache_dtype).float()
    scale = x.abs().amax(dim=1, keepdim=True) / 127  # (T, 1)
    return torch.round(x / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_an_int8_cache_holds_each_heads_quantized_values_and_attention_reads_them_with_their_scales(dtype):
    """The int8 cache's values are each (token, head)'s round(x / s) with s = max |x| / 127, within s / 2 of x;
    the attention over them is the float64 attention over those dequantized keys and values, within float32
    rounding, for every query head of each group."""
    torch.manual_seed(2)
    N, hd = 40, 32
    cache = PagedKVCache(GQA, 8, 16, dtype=torch.int8)
    assert cache.layers[0].shape == (8, 2, 2, 16 * (hd + 4))  # each head's int8 block, then its 16 scales
    qkv = (torch.randn(N, 10 * hd) * torch.linspace(0.1, 3, 10 * hd)).to(dtype)
    out = run_gqa(qkv, cache, [(0, N, [4, 6, 1])])
    k, v = (qkv[:, a : a + 2 * hd].float().view(N, 2, hd) for a in (6 * hd, 8 * hd))
    keys, values = cache.keys_values(0)  # dequantized: (nb, nkv, hd, bs), (nb, nkv, bs, hd)
    held_k = torch.cat([keys[b].permute(2, 0, 1) for b in (4, 6, 1)])[:N]  # (N, nkv, hd)
    held_v = torch.cat([values[b].transpose(0, 1) for b in (4, 6, 1)])[:N]
    for x, held in ((k, held_k), (v, held_v)):
        step = x.abs().amax(dim=2, keepdim=True) / 127
        assert torch.all((held - x).abs() <= step / 2 * (1 + 1e-5))
        assert torch.equal(held, as_cached(x.reshape(-1, hd), torch.int8).view(N, 2, hd))
    q = qkv[:, : 6 * hd].float().view(N, 6, hd)
    for t in (0, 15, 16, 39):
        for h in range(6):
            g = h // 3
            scores = held_k[: t + 1, g].double() @ q[t, h].double() / hd**0.5
            ref = scores.softmax(0) @ held_v[: t + 1, g].double()
            got = out[t, h * hd : (h + 1) * hd].double()
            tol = 1e-2 if dtype == torch.bfloat16 else 2e-6
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol * 5)


def test_grouped_attention_refuses_key_value_heads_that_do_not_divide_the_query_heads():
    cache = PagedKVCache(GQA.replace(num_attention_heads=4, num_key_value_heads=4), 2, 16)  # 4 kv heads
    step = StepBatch.build([([0] * 3, 0, [0])], 16)
    with pytest.raises(ValueError, match="6 query heads over 4 key/value heads"):
        kernels.paged_attention(torch.randn(3, 14 * 32), cache.layers[0], step, 6, 16)


def test_residual_epilogue_with_an_rms_norm_prologue_adds_in_place():
    W = rand(48, 48, scale=0.1, seed=20)
    packed, norm = PackedWeight.pack(W), PackedNorm.pack(rms_norm(48, 21))
    x, res = rand(5, 48, seed=22), rand(5, 48, seed=23)
    inplace = res.clone()
    kernels.linear(x, packed, EPILOGUE_RESIDUAL, inplace, norm=norm, out=inplace)
    assert torch.equal(inplace, res + kernels.linear(x, packed, norm=norm))
