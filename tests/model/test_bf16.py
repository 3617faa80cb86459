"""bfloat16 products (csrc/linear_bf16.cpp with AVX512-BF16, else widened to float32): within bfloat16
rounding of a float64 product, and a row's bits do not depend on its batch; torch's own bfloat16
product is the negative control."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.kernels import PackedNorm, PackedWeight
from model.kernels.exact import bf16_pairs_available
from model.kernels.interface import WEIGHT_BF16, WEIGHT_BF16_PAIRS
from tests.conftest import needs_exact

pytestmark = needs_exact


def rand(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(params=[(768, 2304), (3072, 768), (37, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def layer(request):
    K, O = request.param
    W, b = rand(K, O, scale=0.05, seed=1).bfloat16(), rand(O, scale=0.1, seed=2).bfloat16()
    return W, b, PackedWeight.pack(W, b)


def test_bfloat16_weights_use_vdpbf16ps_where_the_cpu_has_it(layer):
    assert layer[2].format == (WEIGHT_BF16_PAIRS if bf16_pairs_available() else WEIGHT_BF16)


def test_bfloat16_product_is_within_float32_sums_of_float64(layer):
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
