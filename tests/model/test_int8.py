"""int8 weights (model/kernels/int8.py, csrc/linear_q8.cpp): the product equals, bit for bit, a plain
torch reference of the same arithmetic; a row's result does not depend on its batch; an int8 model
decodes cached to the same bits as recomputing; and the negative control shows that quantizing the
activations per batch instead of per row would break that. Each on every int8 path the CPU has
(AVX2, AVX-VNNI, AVX512-VNNI, AMX), and every path gives the AVX2 path's bits."""

from __future__ import annotations

import pytest
import torch

from model import kernels
from model.config import GPTConfig
from model.generate import recompute, sequence_cache
from model.kernels import EPILOGUE_GELU, EPILOGUE_RESIDUAL, PackedNorm
from model.kernels.int8 import dequantize, int8_unavailable_reason, pack_int8, quantize_columns
from tests.conftest import EXACT, forced_isa, isa_params, random_model
from tests.model.test_cache_identity import assert_identical_every_step, random_ids

pytestmark = pytest.mark.skipif(
    not EXACT or int8_unavailable_reason() is not None,
    reason=f"the int8 kernels do not run here: {EXACT and int8_unavailable_reason()}",
)


INT8_PATHS = ("avx2", "avx-vnni", "avx512-vnni", "amx")  # the levels that pick each int8 path


@pytest.fixture(params=isa_params(*INT8_PATHS))
def isa(request):
    """Each int8 path in turn."""
    with forced_isa(request.param):
        yield request.param


def rand(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def quantize_rows(x: torch.Tensor, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: scale max|x| / 127, x * (127 / max) to nearest
    even. per_row=False: one scale for the whole batch (the negative control)."""
    amax = x.abs().amax(dim=1, keepdim=True) if per_row else x.abs().amax().expand(x.shape[0], 1)  # (N, 1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv).clamp(-127, 127), amax / 127  # (N, K), (N, 1)


def reference(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, per_row: bool = True) -> torch.Tensor:
    """float(sum_k qx qw) * (sx * sw) + b, the sums exact in int64."""
    qw, sw = quantize_columns(W)
    qx, sx = quantize_rows(x, per_row)
    acc = qx.long() @ qw.long()  # (N, O), exact
    return acc.float() * (sx * sw[None]) + b


@pytest.fixture(
    params=[(256, 768), (768, 2304), (40, 200), (3072, 768), (30, 70), (64, 576)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def weights(request):
    """Shapes of 2 to 36 groups of 64 columns; 576 columns are 9 groups, which two threads share in halves."""
    K, O = request.param
    return rand(K, O, scale=0.05, seed=1), rand(O, scale=0.1, seed=2)


@pytest.fixture
def layer(weights, isa):
    W, b = weights
    return W, b, pack_int8(W, b)


def test_packing_keeps_the_quantized_weights(weights):
    W, b = weights
    packed = pack_int8(W, b)
    q, scale = quantize_columns(W)
    assert torch.equal(dequantize(packed), q.float() * scale)
    assert ((dequantize(packed) - W).abs() <= scale / 2 + 1e-7).all()


def test_int8_linear_is_the_reference_arithmetic_bit_for_bit(layer):
    W, b, packed = layer
    x = rand(13, W.shape[0], seed=3)
    assert torch.equal(kernels.linear(x, packed), reference(x, W, b))


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 100, 250])
def test_int8_row_is_the_same_bits_in_any_batch(layer, rows):
    W, b, packed = layer
    x = rand(rows, W.shape[0], seed=rows)
    together = kernels.linear(x, packed)
    for i in sorted({0, rows // 2, rows - 1}):
        assert torch.equal(kernels.linear(x[i : i + 1], packed), together[i : i + 1]), f"row {i} of {rows} differs"
    shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernels.linear(x[shuffled], packed), together[shuffled]), "a row changed with its place"


def test_negative_control_per_batch_activation_scales_depend_on_the_batch(weights):
    """Quantizing activations with one scale per batch (per tensor) makes a row's result depend on the
    other rows: the comparison above has teeth."""
    W, b = weights
    x = rand(8, W.shape[0], seed=5)
    x[3] *= 10  # a row with larger values sets the batch's scale
    assert not torch.equal(reference(x[:1], W, b, per_row=False), reference(x, W, b, per_row=False)[:1])
    assert torch.equal(reference(x[:1], W, b), reference(x, W, b)[:1])


def test_int8_epilogues_and_layer_norm_prologue(layer):
    W, b, packed = layer
    K, O = W.shape
    x, res = rand(9, K, seed=6, scale=3.0) + 1, rand(9, O, seed=7)
    plain = kernels.linear(x, packed)
    assert torch.equal(kernels.linear(x, packed, EPILOGUE_RESIDUAL, res), res + plain)
    torch.testing.assert_close(
        kernels.linear(x, packed, EPILOGUE_GELU),
        torch.nn.functional.gelu(plain, approximate="tanh"),
        atol=1e-6,
        rtol=4e-6,
    )
    norm = torch.nn.LayerNorm(K)
    normed = kernels.linear(x, packed, norm=PackedNorm.pack(norm))
    with torch.no_grad():
        torch.testing.assert_close(normed, reference(norm(x), W, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.linear(x[2:3], packed, norm=PackedNorm.pack(norm)), normed[2:3])


def test_a_row_with_a_nan_gives_nan_outputs_and_leaves_the_others_alone(layer):
    W, b, packed = layer
    x = rand(4, W.shape[0], seed=8)
    x[1, 5] = float("nan")
    y = kernels.linear(x, packed)
    assert y[1].isnan().all()
    assert torch.equal(y[[0, 2, 3]], kernels.linear(x[[0, 2, 3]], packed))


@pytest.mark.parametrize("n_embd, n_head", [(64, 4), (128, 2)], ids=["hd16", "hd64"])
def test_int8_model_cached_decode_is_bit_identical_to_recompute(isa, n_embd, n_head):
    config = GPTConfig(vocab_size=300, n_positions=256, n_embd=n_embd, n_layer=3, n_head=n_head)
    model = random_model(config, seed=1).prepare_for_inference("exact", quantization="int8")
    assert (model.kernels, model.quantization) == ("exact", "int8")
    assert assert_identical_every_step(model, random_ids(120, 300), prompt_len=20) == 101


def test_int8_model_stays_close_to_float32(default_model, default_tokenizer):
    from model.checkpoint import DEFAULT_CHECKPOINT, load_model
    from tests.model.test_cache_identity import SONNET

    int8 = load_model(DEFAULT_CHECKPOINT, quantization="int8")
    ids = torch.tensor([default_tokenizer.encode(SONNET)[:200]])
    with torch.no_grad():
        ref = default_model(ids)[0].log_softmax(-1)  # (T, V), the float32 model through torch
    cache, blocks = sequence_cache(int8, 200)
    step_logits = []
    for t in (50, 120, 199):
        step_logits.append(recompute(int8, cache, ids[0, : t + 1].tolist(), blocks)[0].log_softmax(-1))
    ours = torch.stack(step_logits)
    want = ref[[50, 120, 199]]
    kl = (want.exp() * (want - ours)).sum(-1)
    assert (kl < 0.02).all(), f"KL {kl}"
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 2 / 3


@pytest.mark.parametrize("rows", [1, 4, 15, 16, 17, 33, 70])
def test_every_int8_path_gives_the_avx2_paths_bits(layer, isa, rows):
    """The int32 sums are exact and every path ends each output in the same float sequence, so each
    path's outputs equal the AVX2 path's bit for bit (from 4 rows on, AMX tiles where they run)."""
    W, b, packed = layer
    x = rand(rows, W.shape[0], seed=rows, scale=2.0)
    residual = rand(rows, W.shape[1], seed=7)
    norm = PackedNorm.pack(torch.nn.LayerNorm(W.shape[0]))

    def products():
        return (
            kernels.linear(x, packed),
            kernels.linear(x, packed, EPILOGUE_GELU, norm=norm),
            kernels.linear(x, packed, EPILOGUE_RESIDUAL, residual.clone(), norm=norm),
        )

    assert kernels.kernel_paths()["int8"] == isa
    here = products()
    with forced_isa("avx2"):
        assert kernels.kernel_paths()["int8"] == "avx2"
        on_avx2 = products()
    for name, ours, theirs in zip(("plain", "gelu, norm", "residual, norm"), here, on_avx2):
        diff = (ours - theirs).abs().max()
        assert torch.equal(ours, theirs), f"{isa} and avx2 differ ({name}): max |diff| {diff:.3g}"


def test_int8_model_logits_are_the_avx2_paths_bits(isa):
    config = GPTConfig(vocab_size=300, n_positions=256, n_embd=128, n_layer=2, n_head=2)
    model = random_model(config, seed=3).prepare_for_inference("exact", quantization="int8")
    assert model.kernel_isa == isa
    ids = random_ids(40, 300)
    cache, blocks = sequence_cache(model, len(ids))
    here = recompute(model, cache, ids, blocks)
    with forced_isa("avx2"):
        on_avx2 = recompute(model, cache, ids, blocks)
    assert torch.equal(here, on_avx2)


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["float32", "int8"])
def test_a_bfloat16_kv_cache_under_float32_decodes_cached_to_the_bits_of_recompute(isa, quantization):
    config = GPTConfig(vocab_size=300, n_positions=256, n_embd=128, n_layer=2, n_head=2)
    model = random_model(config, seed=2).prepare_for_inference("exact", quantization=quantization)
    assert assert_identical_every_step(model, random_ids(90, 300), prompt_len=20, cache_dtype=torch.bfloat16) == 71
