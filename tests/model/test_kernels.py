"""The exact kernels, op by op: against a float64 reference (within float32 rounding), and invariant:
a row's result is the same bits whatever else shares its call, where it sits, and how many threads run;
the products on each path the CPU has (AVX2, AVX-512), which give the same bits. The negative controls
show the same comparisons fail for torch's matrix product, so they have teeth."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import kernels
from model.config import GPTConfig
from model.kernels import EPILOGUE_GELU, EPILOGUE_RESIDUAL, PackedNorm, PackedWeight
from model.kv_cache import PagedKVCache, StepBatch
from tests.conftest import CPU_ISAS, forced_isa, isa_params, needs_exact

pytestmark = needs_exact
U = 2.0**-24  # float32 unit roundoff


def rand(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


@pytest.fixture(params=isa_params("avx2", "avx512"))
def isa(request):
    """Each float32 path in turn."""
    with forced_isa(request.param):
        yield request.param


@pytest.fixture(params=[(256, 768), (1024, 256), (40, 200), (256, 8192)], ids=lambda s: f"{s[0]}x{s[1]}")
def layer(request, isa):
    K, O = request.param
    W, b = rand(K, O, scale=0.05, seed=1), rand(O, scale=0.1, seed=2)
    return W, b, PackedWeight.pack(W, b)


@pytest.mark.skipif("avx512" not in CPU_ISAS, reason=f"this CPU lacks avx512 (it has {', '.join(CPU_ISAS)})")
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 100])
def test_linear_avx2_and_avx512_paths_give_the_same_bits(rows):
    """One FMA per k in order on both, 8 lanes a register or 16: the same arithmetic per element."""
    W, b = rand(300, 200, scale=0.05, seed=1), rand(200, scale=0.1, seed=2)
    packed, norm = PackedWeight.pack(W, b), PackedNorm.pack(torch.nn.LayerNorm(300))
    x, res = rand(rows, 300, seed=rows), rand(rows, 200, seed=3)
    results = {}
    for level in ("avx2", "avx512"):
        with forced_isa(level):
            assert kernels.kernel_paths()["float32"] == level
            results[level] = [
                kernels.linear(x, packed, EPILOGUE_GELU, norm=norm),
                kernels.linear(x, packed, EPILOGUE_RESIDUAL, res),
            ]
    for ours, theirs in zip(results["avx2"], results["avx512"]):
        assert torch.equal(ours, theirs), f"max |diff| {(ours - theirs).abs().max():.3g}"


def test_linear_is_within_float32_rounding_of_a_float64_product(layer):
    W, b, packed = layer
    x = rand(37, W.shape[0], seed=3)
    ours = kernels.linear(x, packed).double()
    exact = x.double() @ W.double() + b.double()
    # a sequential sum of K products rounds each partial sum once: |error| <= (K + 1) u sum |x w| + u |b|
    bound = (W.shape[0] + 2) * U * (x.double().abs() @ W.double().abs() + b.double().abs())
    assert ((ours - exact).abs() <= bound).all(), f"max error {(ours - exact).abs().max():.3g}"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 32, 100, 250])
def test_linear_row_is_the_same_bits_in_any_batch(layer, rows):
    W, b, packed = layer
    x = rand(rows, W.shape[0], seed=rows)
    together = kernels.linear(x, packed)
    for i in sorted({0, rows // 2, rows - 1}):
        alone = kernels.linear(x[i : i + 1], packed)
        assert torch.equal(together[i : i + 1], alone), f"row {i} of {rows} differs from itself alone"
    shuffled = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernels.linear(x[shuffled], packed), together[shuffled]), "a row changed with its place"


def test_linear_does_not_depend_on_the_thread_count(layer):
    W, b, packed = layer
    x = rand(19, W.shape[0], seed=4)
    before = kernels.num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            kernels.set_num_threads(threads)
            results.append(kernels.linear(x, packed))
    finally:
        kernels.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_negative_control_torch_matmul_rows_depend_on_the_batch(layer):
    """MKL's one-row and many-row products add in different orders: the test above would fail for them."""
    W, b, _ = layer
    x = rand(64, W.shape[0], seed=5)
    assert not torch.equal(torch.addmm(b, x[:1], W), torch.addmm(b, x, W)[:1])


def test_residual_epilogue_adds_the_product_to_the_residual_exactly(layer):
    W, b, packed = layer
    x, res = rand(9, W.shape[0], seed=6), rand(9, W.shape[1], seed=7)
    assert torch.equal(kernels.linear(x, packed, EPILOGUE_RESIDUAL, res), res + kernels.linear(x, packed))
    inplace = res.clone()
    kernels.linear(x, packed, EPILOGUE_RESIDUAL, inplace, out=inplace)
    assert torch.equal(inplace, res + kernels.linear(x, packed))


def test_gelu_epilogue_is_torch_gelu_within_float32_rounding(layer):
    W, b, packed = layer
    x = rand(9, W.shape[0], seed=8, scale=3.0)
    plain = kernels.linear(x, packed)
    torch.testing.assert_close(
        kernels.linear(x, packed, EPILOGUE_GELU), F.gelu(plain, approximate="tanh"), atol=1e-6, rtol=4e-6
    )


def test_layer_norm_prologue_is_layer_norm_within_float32_rounding_and_row_invariant(isa):
    norm = torch.nn.LayerNorm(200)
    with torch.no_grad():
        norm.weight.copy_(rand(200, seed=9) + 1)
        norm.bias.copy_(rand(200, seed=10))
    W, b = rand(200, 64, scale=0.1, seed=11), rand(64, seed=12)
    packed, ln = PackedWeight.pack(W, b), PackedNorm.pack(norm)
    x = rand(21, 200, seed=13, scale=4) + 2
    ours = kernels.linear(x, packed, norm=ln)
    with torch.no_grad():
        reference = norm(x.double().float()).double() @ W.double() + b.double()
    torch.testing.assert_close(ours.double(), reference, atol=2e-5, rtol=1e-5)
    assert torch.equal(kernels.linear(x[4:5], packed, norm=ln), ours[4:5])


def test_bfloat16_linear_sums_in_float32():
    W, b = rand(256, 128, scale=0.05, seed=14).bfloat16(), rand(128, seed=15).bfloat16()
    x = rand(11, 256, seed=16).bfloat16()
    packed = PackedWeight.pack(W, b)
    ours = kernels.linear(x, packed)
    assert ours.dtype == torch.bfloat16
    exact = x.double() @ W.double() + b.double()
    # float32 sums, one rounding to bfloat16 at the end (half a bfloat16 unit, 2^-9 relative)
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert torch.equal(kernels.linear(x[3:4], packed), ours[3:4])
    logits = kernels.linear(x, packed, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert ((logits.double() - exact).abs() <= 300 * U * (x.double().abs() @ W.double().abs() + 1)).all()


def test_embedding_is_the_sum_of_the_two_rows():
    wte, wpe = rand(50, 40, seed=17), rand(20, 40, seed=18)
    ids, pos = torch.tensor([3, 49, 0, 3]), torch.tensor([0, 19, 5, 7])
    assert torch.equal(kernels.embed(ids, pos, wte, wpe), wte[ids] + wpe[pos])


# ---- attention ------------------------------------------------------------------------------------

CONFIG = GPTConfig(vocab_size=64, n_positions=256, n_embd=64, n_layer=1, n_head=2)  # head_dim 32


def attention_reference(q, keys, values, position):
    """One head of one token in float64: softmax over keys 0..position. q: (hd,), keys/values: (T, hd)."""
    scores = keys[: position + 1].double() @ q.double() * q.shape[0] ** -0.5
    return scores.softmax(0) @ values[: position + 1].double()


def run_attention(qkv, cache, sequences, block_size=16):
    """sequences: (first position, number of new tokens, block ids) per sequence, tokens back to back."""
    step = StepBatch.build([([0] * n, start, blocks) for start, n, blocks in sequences], block_size)
    return kernels.paged_attention(qkv, cache.layers[0], step, CONFIG.n_head, block_size)


def test_attention_is_within_float32_rounding_of_float64():
    torch.manual_seed(0)
    cache = PagedKVCache(CONFIG, 20, 16)
    qkv = torch.randn(70, 3 * CONFIG.n_embd)
    out = run_attention(qkv, cache, [(0, 70, [7, 3, 12, 0, 19])])  # one sequence, blocks out of order
    k, v = qkv[:, 64:128].view(70, 2, 32), qkv[:, 128:].view(70, 2, 32)
    for t in (0, 1, 15, 16, 40, 69):
        for h in range(2):
            ref = attention_reference(qkv[t, 32 * h : 32 * h + 32], k[:, h], v[:, h], t)
            torch.testing.assert_close(out[t, 32 * h : 32 * h + 32].double(), ref, atol=2e-6, rtol=1e-5)


def read_cache(cache: PagedKVCache, layer: int, block_ids: list[int], length: int):
    """The first `length` positions of a sequence held in `block_ids`: keys, values (nh, length, hd)."""
    keys, values = cache.keys_values(layer)
    index = torch.tensor(block_ids)
    k = keys[index].permute(1, 0, 3, 2).reshape(cache.n_head, -1, cache.head_dim)  # (nh, n_blocks * bs, hd)
    v = values[index].permute(1, 0, 2, 3).reshape(cache.n_head, -1, cache.head_dim)  # (nh, n_blocks * bs, hd)
    return k[:, :length], v[:, :length]


def test_attention_keys_and_values_land_in_their_blocks():
    torch.manual_seed(0)
    cache = PagedKVCache(CONFIG, 8, 16)
    qkv = torch.randn(20, 3 * CONFIG.n_embd)
    run_attention(qkv, cache, [(0, 20, [5, 2])])
    k, v = read_cache(cache, 0, [5, 2], 20)  # (nh, 20, hd)
    assert torch.equal(k, qkv[:, 64:128].view(20, 2, 32).transpose(0, 1))
    assert torch.equal(v, qkv[:, 128:].view(20, 2, 32).transpose(0, 1))


def test_attention_prefill_row_equals_the_decode_step_at_its_position():
    torch.manual_seed(1)
    qkv = torch.randn(45, 3 * CONFIG.n_embd)
    blocks = [4, 1, 6]
    prefill = run_attention(qkv, PagedKVCache(CONFIG, 8, 16), [(0, 45, blocks)])
    cache = PagedKVCache(CONFIG, 8, 16)
    decode = torch.cat([run_attention(qkv[t : t + 1], cache, [(t, 1, blocks)]) for t in range(45)])
    assert torch.equal(prefill, decode)


def test_attention_row_is_the_same_bits_in_any_batch():
    torch.manual_seed(2)
    qkv = torch.randn(30, 3 * CONFIG.n_embd)
    alone_cache = PagedKVCache(CONFIG, 40, 16)
    run_attention(qkv[:29], alone_cache, [(0, 29, [9, 10])])
    alone = run_attention(qkv[29:], alone_cache, [(29, 1, [9, 10])])
    shared = PagedKVCache(CONFIG, 40, 16)
    shared.layers[0].fill_(float("nan"))  # what no sequence wrote must count for nothing
    run_attention(qkv[:29], shared, [(0, 29, [9, 10])])
    others = torch.randn(50, 3 * CONFIG.n_embd)
    batch = torch.cat([others[:20], qkv[29:], others[20:]])
    out = run_attention(batch, shared, [(0, 20, [0, 1]), (29, 1, [9, 10]), (5, 30, [2, 3, 4])])
    assert torch.equal(out[20:21], alone)


def test_attention_ignores_nan_past_the_sequence_end():
    torch.manual_seed(3)
    qkv = torch.randn(10, 3 * CONFIG.n_embd)
    clean = run_attention(qkv, PagedKVCache(CONFIG, 4, 16), [(0, 10, [1])])
    dirty_cache = PagedKVCache(CONFIG, 4, 16)
    dirty_cache.layers[0].fill_(float("nan"))
    dirty = run_attention(qkv, dirty_cache, [(0, 10, [1])])
    assert torch.equal(clean, dirty)


# ---- the ops left to torch ----------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_samplers_torch_ops_give_a_row_the_same_bits_in_any_batch(rows, threads):
    """logsumexp (the stock path's normalizer), softmax and cumsum (the sampled rows' CDF), argmax:
    torch's own, checked for the property our kernels guarantee instead of rerouted."""
    x = rand(32, 8192, scale=4.0, seed=rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops = {
            "logsumexp": lambda t: torch.logsumexp(t, dim=-1),
            "softmax": lambda t: t.softmax(dim=-1),
            "cumsum": lambda t: t.softmax(dim=-1).double().cumsum(dim=-1),
            "argmax": lambda t: t.argmax(dim=-1),
        }
        for name, op in ops.items():
            batch = op(x[:rows])
            for i in sorted({0, rows - 1}):
                assert torch.equal(op(x[i : i + 1]), batch[i : i + 1]), f"{name}: row {i} of {rows}"
    finally:
        torch.set_num_threads(before)


def test_the_greedy_kernel_picks_the_first_maximum_and_normalizes_in_float32_rounding():
    x = rand(5, 1000, scale=3.0, seed=21)
    x[2, 10] = x[2, 900] = 50.0  # a tie: the first index wins, as torch.argmax
    out, lse = torch.zeros(5, 3, dtype=torch.float64), torch.zeros(5)
    kernels.greedy(x, out, lse)
    assert out[:, 0].long().tolist() == x.argmax(-1).tolist()
    torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), atol=1e-5, rtol=1e-6)
    assert torch.equal(out[:, 1], (x.gather(1, x.argmax(-1, keepdim=True))[:, 0] - lse).double())
    assert out[:, 2].tolist() == [1.0] * 5
    one_out, one_lse = torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1)
    kernels.greedy(x[3:4], one_out, one_lse)
    assert torch.equal(one_out, out[3:4]) and torch.equal(one_lse, lse[3:4])
    x[1, 5] = float("nan")
    kernels.greedy(x, out, lse)
    assert out[1, 2] == 0.0 and out[0, 2] == 1.0


def test_the_masked_greedy_kernel_is_torchs_argmax_of_the_allowed_tokens():
    """A grammar row's pick over its bitmask: the first maximum among the allowed tokens, as torch's argmax of
    the row with the others at -inf (the sampler's torch path), and logit - lse in float32; other rows and
    non-finite rows untouched; no allowed token, or only -inf ones, gives index 0 as torch's argmax does."""
    V, words = 1000, (1000 + 31) // 32
    x = rand(6, V, scale=3.0, seed=22)
    x[4, :] = float("-inf")
    x[5, 7] = float("nan")
    allowed = torch.rand(6, V, generator=torch.Generator().manual_seed(23)) < 0.3  # (6, V)
    allowed[1, x[1].argmax()] = False  # the free pick forbidden
    allowed[1, 640] = allowed[1, 990] = True
    x[1, 640] = x[1, 990] = 20.0  # a tie among the allowed: the first wins
    allowed[3] = False  # nothing allowed
    allowed[1, 999] = True  # the last token, in the bitmask's last, partly used word
    bits = torch.zeros(6, words * 32, dtype=torch.bool)
    bits[:, :V] = allowed
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    bitmask = ((bits.view(6, words, 32).long() * weights).sum(-1)).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)  # (6, words), bit j % 32
    out, lse = torch.zeros(6, 3, dtype=torch.float64), torch.zeros(6)
    kernels.greedy(x, out, lse)
    free = out.clone()
    rows = torch.tensor([1, 2, 3, 4, 5])
    kernels.greedy_masked(x, rows, bitmask[rows], out, lse)
    scores = x.masked_fill(~allowed, float("-inf"))
    want = scores.argmax(-1)
    assert out[0].equal(free[0]) and out[5].equal(free[5])  # not a grammar row; a NaN row
    assert out[1:4, 0].long().tolist() == want[1:4].tolist() and out[1, 0] == 640 and out[3, 0] == 0
    assert torch.equal(out[1:4, 1], (x[1:4].gather(1, want[1:4, None])[:, 0] - lse[1:4]).double())
    assert out[4, 2] == 0.0  # all -inf: not finite, left as the greedy kernel wrote it


def test_a_bfloat16_cache_under_float32_activations_is_the_float32_kernel_over_rounded_keys_and_values():
    torch.manual_seed(3)
    qkv = torch.randn(40, 3 * CONFIG.n_embd)
    sequences = [(0, 30, [3, 1]), (0, 10, [6])]
    narrow = PagedKVCache(CONFIG, 8, 16, dtype=torch.bfloat16)
    out = run_attention(qkv, narrow, sequences)
    rounded = qkv.clone()
    rounded[:, CONFIG.n_embd :] = qkv[:, CONFIG.n_embd :].bfloat16().float()  # keys and values as the cache holds them
    wide = PagedKVCache(CONFIG, 8, 16)
    assert torch.equal(out, run_attention(rounded, wide, sequences))
    assert torch.equal(narrow.layers[0].float(), wide.layers[0])
    assert not torch.equal(out, run_attention(qkv, PagedKVCache(CONFIG, 8, 16), sequences))  # the rounding shows
