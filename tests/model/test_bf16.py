"""bfloat16 products (csrc/linear_bf16.cpp with AVX512-BF16, else widened to float32 in registers on
AVX-512 or AVX2, csrc/linear.cpp): within bfloat16 rounding of a float64 product, and a row's bits do
not depend on its batch, on every path the CPU has; the AVX2 and AVX-512 paths give the same bits, the
AVX512-BF16 one other bits within the same bound; torch's own bfloat16 product is the negative control."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.kernels import PackedNorm, PackedWeight
from model.kernels.interface import WEIGHT_BF16, WEIGHT_BF16_PAIRS
from tests.conftest import CPU_ISAS, forced_isa, isa_params, needs_exact

pytestmark = needs_exact
BF16_PATHS = {"avx2": "avx2", "avx512": "avx512", "avx512-vnni": "avx512-bf16"}  # level -> the path it picks here


def rand(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(params=isa_params(*BF16_PATHS))
def isa(request):
    """Each bfloat16 path in turn, by the level that picks it."""
    with forced_isa(request.param):
        yield request.param


@pytest.fixture(params=[(768, 2304), (3072, 768), (37, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def weights(request):
    K, O = request.param
    return rand(K, O, scale=0.05, seed=1).bfloat16(), rand(O, scale=0.1, seed=2).bfloat16()


@pytest.fixture
def layer(weights, isa):
    W, b = weights
    return W, b, PackedWeight.pack(W, b)


def test_bfloat16_weights_use_vdpbf16ps_where_the_level_allows_it(layer, isa):
    assert kernels.kernel_paths()["bfloat16"] == BF16_PATHS[isa]
    assert layer[2].format == (WEIGHT_BF16_PAIRS if BF16_PATHS[isa] == "avx512-bf16" else WEIGHT_BF16)


def products(x: torch.Tensor, packed: PackedWeight) -> list[torch.Tensor]:
    norm = PackedNorm.pack(torch.nn.LayerNorm(x.shape[1]))
    plain, normed = kernels.linear(x, packed), kernels.linear(x, packed, norm=norm)
    return [plain, normed, kernels.linear(x, packed, out_dtype=torch.float32)]


@pytest.mark.skipif("avx512" not in CPU_ISAS, reason=f"this CPU lacks avx512 (it has {', '.join(CPU_ISAS)})")
def test_avx2_and_avx512_paths_give_the_same_bits(weights):
    """Both widen the weights to float32 and add one FMA per k in order: the same arithmetic."""
    W, b = weights
    x = rand(13, W.shape[0], seed=4).bfloat16()
    results = {}
    for level in ("avx2", "avx512"):
        with forced_isa(level):
            results[level] = products(x, PackedWeight.pack(W, b))
    for ours, theirs in zip(results["avx2"], results["avx512"]):
        assert torch.equal(ours, theirs), f"max |diff| {(ours.float() - theirs.float()).abs().max():.3g}"


@pytest.mark.skipif("avx512-vnni" not in CPU_ISAS, reason=f"this CPU lacks avx512-vnni (it has {', '.join(CPU_ISAS)})")
def test_a_bfloat16_pairs_weight_is_refused_where_the_level_forbids_vdpbf16ps(weights):
    """The cap reaches the kernels: a weight packed for vdpbf16ps does not run under avx2."""
    W, b = weights
    x = rand(2, W.shape[0], seed=5).bfloat16()
    with forced_isa("avx512-vnni"):
        packed = PackedWeight.pack(W, b)
    if packed.format != WEIGHT_BF16_PAIRS:
        pytest.skip("this CPU lacks AVX512-BF16")
    with forced_isa("avx2"), pytest.raises(TypeError, match="do not go together"):
        kernels.linear(x, packed)


def test_bfloat16_product_is_within_float32_sums_of_float64(layer):
    """On every path: the AVX512-BF16 one differs from the others in the last bits (vdpbf16ps adds each
    pair's odd product first and flushes subnormals), within the same bound."""
    W, b, packed = layer
    x = rand(9, W.shape[0], seed=3).bfloat16()
    ours = kernels.linear(x, packed, out_dtype=torch.float32).double()
    exact = x.double() @ W.double() + b.double()
    bound = (W.shape[0] + 2) * 2.0**-24 * (x.double().abs() @ W.double().abs() + b.double().abs()) + 1e-30
    assert ((ours - exact).abs() <= bound).all(), f"max error {(ours - exact).abs().max():.3g}"


@pytest.mark.parametrize("rows", [1, 2, 6, 7, 32, 250])
def test_bfloat16_row_is_the_same_bits_in_any_batch(layer, rows):
    W, b, packed = layer
    norm = PackedNorm.pack(torch.nn.LayerNorm(W.shape[0]))
    x = rand(rows, W.shape[0], seed=rows).bfloat16()
    for kwargs in ({}, {"norm": norm}, {"out_dtype": torch.float32}):
        together = kernels.linear(x, packed, **kwargs)
        for i in sorted({0, rows // 2, rows - 1}):
            assert torch.equal(kernels.linear(x[i : i + 1], packed, **kwargs), together[i : i + 1]), (
                f"row {i} of {rows} differs ({kwargs})"
            )


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif(
    "amx_bf16" not in cpu_flags(),
    reason="torch's bfloat16 product depends on the batch where "
    "oneDNN runs it on AMX tiles; on this CPU (no AMX) every probed row kept its bits in any batch",
)
def test_negative_control_torch_bfloat16_matmul_rows_depend_on_the_batch():
    """On a CPU with AMX, torch's bfloat16 product gives the first 7 rows other bits alone than among 64.
    (On an AMD EPYC with AVX512-BF16 and no AMX, torch's kernel kept every probed row's bits: the control
    is a property of torch's kernel for the CPU, not of ours, so it runs where that kernel is the AMX one.)"""
    W = rand(768, 2304, scale=0.05, seed=1).bfloat16()
    x = rand(64, 768, seed=5).bfloat16()
    assert not torch.equal(x[:7] @ W, (x @ W)[:7])
