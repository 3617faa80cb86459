// The library's C interface, declared once. The sources include it; model/kernels/interface.py
// reads it (its enums, structs and prototypes) to give ctypes each function's argument types, each
// struct's fields and each constant, so nothing here is spelled a second time in Python.
//
// The parser is small: one enum constant, struct field or parameter per declarator, each function
// prototype on lines of its own ending in ");", each type one of int, int64_t, float, void or a
// pointer.
#pragma once

#include <cstdint>

// The version of this interface, which the loader checks the library against.
enum { KV_ABI_VERSION = 9 };

// What a product adds after the bias, per output element.
enum {
  KV_EPILOGUE_NONE = 0,      // y = x @ W + b
  KV_EPILOGUE_GELU = 1,      // y = gelu_tanh(x @ W + b)
  KV_EPILOGUE_RESIDUAL = 2,  // y = residual + (x @ W + b)
  KV_EPILOGUE_SILU_MUL = 3,  // SwiGLU: y[o] = silu(gate[o]) * up[o], gate and up from one product (below)
};
// KV_EPILOGUE_SILU_MUL reads a product of 2 * O columns whose gate and up columns are interleaved in runs
// of 8: product columns [16 j, 16 j + 8) are gate columns [8 j, 8 j + 8) and [16 j + 8, 16 j + 16) the up
// columns of the same outputs (zero past O), so that every 8-lane vector pair of a tile holds both halves
// of 8 outputs; y has O = w.n_out / 2 columns.

// The norm a product may apply to each of its input rows first (kv_linear's norm_kind).
enum {
  KV_NORM_LAYER = 0,  // (x - mean) / sqrt(var + eps) * weight + bias (GPT-2)
  KV_NORM_RMS = 1,    // x / sqrt(mean(x^2) + eps) * weight, statistics in float32 (Llama, Qwen); no bias
};

// The element types of the activations, weights and outputs a call reads and writes.
enum {
  KV_DTYPE_F32 = 0,       // float32 everywhere
  KV_DTYPE_BF16 = 1,      // bfloat16 activations, weights and outputs (float32 sums)
  KV_DTYPE_BF16_F32 = 2,  // bfloat16 activations and weights, float32 outputs (a bfloat16 model's logits)
  KV_DTYPE_I8 = 3,        // a KV cache only: int8 keys and values, a float32 scale per (token, head) (attention.cpp)
};

// The longest block an int8 KV cache takes (kv_paged_attention returns -1 past it).
enum { KV_INT8_CACHE_MAX_BLOCK = 256 };

// How a product's weight is stored (model/kernels/exact.py and int8.py pack them).
enum {
  KV_WEIGHT_F32 = 0,         // float32, (groups, 4, K, 16): strips of 16 columns, k-major
  KV_WEIGHT_BF16 = 1,        // bfloat16, the same layout
  KV_WEIGHT_INT8 = 2,        // int8, (groups, 4, K / 4, 16, 4): k in quads; per-column scales
  KV_WEIGHT_BF16_PAIRS = 3,  // bfloat16, (groups, 4, K / 2, 16, 2): k in pairs, for vdpbf16ps
};

// Instruction sets the kernels use (kv_features) or the CPU has (kv_cpu_features), bit by bit.
enum {
  KV_FEATURE_AVX512F = 1,     // AVX-512 F, DQ, BW and VL: 16-lane float32 products
  KV_FEATURE_AVX512BF16 = 2,  // vdpbf16ps for bfloat16 weights
  KV_FEATURE_AVX512VNNI = 4,  // vpdpbusd on 512 bits for int8 weights
  KV_FEATURE_AMX_INT8 = 8,    // AMX tiles (tdpbusd) for int8 weights, granted by the OS to this process
  KV_FEATURE_AVX2 = 16,       // AVX2 and FMA: every path's floor
  KV_FEATURE_AVX_VNNI = 32,   // vpdpbusd on 256 bits (VEX) for int8 weights
};

// The levels kv_set_isa caps the kernels at, lowest first (KVSERVE_ISA): each allows the ones
// below it and needs the CPU to have its own instruction set. avx512-vnni allows AVX512-BF16 too.
enum {
  KV_ISA_AVX2 = 0,         // AVX2 and FMA
  KV_ISA_AVX_VNNI = 1,     // and AVX-VNNI
  KV_ISA_AVX512 = 2,       // and AVX-512 F, DQ, BW, VL
  KV_ISA_AVX512_VNNI = 3,  // and AVX512-VNNI, AVX512-BF16
  KV_ISA_AMX = 4,          // and AMX int8 tiles
};

// The kernel paths a product runs on (kv_kernel_path).
enum {
  KV_PATH_AVX2 = 0,         // float32 and bfloat16: 8-lane FMA; int8: vpmaddubsw with the sign trick
  KV_PATH_AVX_VNNI = 1,     // int8: vpdpbusd on 256 bits
  KV_PATH_AVX512 = 2,       // float32 and bfloat16: 16-lane FMA
  KV_PATH_AVX512_BF16 = 3,  // bfloat16 in pairs: vdpbf16ps
  KV_PATH_AVX512_VNNI = 4,  // int8: vpdpbusd on 512 bits
  KV_PATH_AMX = 5,          // int8: AMX tiles from 4 rows on, AVX512-VNNI below
};

// One product's packed weight, its float32 bias (zeros where the layer has none) and, for int8,
// its per-output-column scale and offset (128 times the column's sum: the vpdpbusd and AMX paths
// store the activations unsigned, shifted by 128). bias, scale and offset are padded to the groups
// of 64 columns.
struct kv_weight {
  int64_t format;
  int64_t n_in;
  int64_t n_out;
  const void* data;
  const float* bias;
  const float* scale;
  const int32_t* offset;
};

// One block's packed weights and each layer norm's float32 (weight, bias) pair, (2, C).
struct kv_layer {
  const float* ln_1;
  kv_weight c_attn;
  kv_weight attn_proj;
  const float* ln_2;
  kv_weight c_fc;
  kv_weight mlp_proj;
};

// The whole GPT-2 network for kv_forward.
struct kv_model {
  int64_t dtype;
  int64_t cache_dtype;
  int64_t n_layer;
  int64_t n_embd;
  int64_t n_head;
  float eps;
  const void* wte;
  const void* wpe;
  const kv_layer* layers;
};

// One layer of a Llama-style decoder (Llama, Qwen2, Qwen3): each RMSNorm's float32 weight, (C,) or, for
// the QK-norms, (head_dim,) (null: none); q, k and v as one product whose columns are the query heads,
// then the key/value heads' keys, then their values; gate and up as one product interleaved for
// KV_EPILOGUE_SILU_MUL.
struct kv_decoder_layer {
  const float* input_norm;
  kv_weight qkv;
  const float* q_norm;
  const float* k_norm;
  kv_weight o_proj;
  const float* post_norm;
  kv_weight gate_up;
  kv_weight down;
};

// The whole decoder for kv_decoder_forward. rope: (rope_positions, head_dim) float32, for each position
// the cosines of its head_dim / 2 angles, then their sines.
struct kv_decoder {
  int64_t dtype;
  int64_t cache_dtype;
  int64_t n_layer;
  int64_t hidden;
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t intermediate;
  float eps;
  const void* embed;
  const float* rope;
  int64_t rope_positions;
  const kv_decoder_layer* layers;
};

extern "C" {

// The version the Python loader checks the library against, and the kernels' thread pool.
int kv_abi_version();
void kv_set_num_threads(int n);
int kv_num_threads();
void kv_set_spin_us(int64_t microseconds);
int64_t kv_spin_us();

// The instruction sets (csrc/cpu.cpp): what the CPU has, what the kernels may use under the cap, whether
// the CPU has a level (KV_ISA_*), the cap (0, or -1 where the CPU lacks the level: the cap stays), the
// level in force, and the KV_PATH_* a weight format (KV_WEIGHT_*) runs on now (-1: none may).
int64_t kv_cpu_features();
int64_t kv_features();
int kv_cpu_has_isa(int level);
int kv_set_isa(int level);
int kv_isa();
int kv_kernel_path(int format);

// y = epilogue(norm(x) @ W + b) (csrc/linear.cpp, linear_q8.cpp). x: (rows, w.n_in), y: (rows,
// w.n_out), or (rows, w.n_out / 2) for KV_EPILOGUE_SILU_MUL. norm_weight: (K,) float32, a norm of
// norm_kind (KV_NORM_*) applied to each input row first, or null; norm_bias: (K,) for a layer norm.
// residual may be y itself (an in-place x += ...). int8 weights take float32 activations. Returns 0,
// or -1 for a dtype and weight format that do not go together or that this build lacks.
int kv_linear(const kv_weight* w, int dtype, const void* x, int64_t rows, void* y, int epilogue, const void* residual,
              int norm_kind, const float* norm_weight, const float* norm_bias, float norm_eps);

// out[i] = wte[ids[i]] + wpe[positions[i]], or wte[ids[i]] where wpe is null (csrc/embedding.cpp).
int kv_embed(int dtype, const int64_t* ids, const int64_t* positions, int64_t n, const void* wte, const void* wpe,
             int64_t C, void* out);

// In place on each token's row of qkv (tokens, (heads + 2 kv_heads) * head_dim), its query heads then its
// key heads (the values untouched): RMSNorm over each head's head_dim where q_norm / k_norm are given
// (Qwen3's QK-norm), then rotate-half RoPE at the token's position from the float32 table rope
// (rope_positions, head_dim) (csrc/rope.cpp). -1 for a position outside the table or an odd head_dim.
int kv_rope(int dtype, void* qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
            const int64_t* positions, const float* rope, int64_t rope_positions, const float* q_norm,
            const float* k_norm, float eps);

// Writes each token's keys and values to its slot, then attends over its sequence's blocks
// (csrc/attention.cpp). qkv: (tokens, (heads + 2 kv_heads) * head_dim), the query heads, the key heads,
// the value heads; query head h reads key/value head h / (heads / kv_heads) in place. out: (tokens,
// heads * head_dim). Needs head_dim in {8, 16, 32, 64, 128}, block_size % 8 == 0 and kv_heads dividing
// heads: -1 if not. cache_dtype is dtype, or bfloat16 under float32 activations (keys and values
// rounded when written), or int8 under either (quantized when written).
int kv_paged_attention(int dtype, int cache_dtype, const void* qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, void* cache, int64_t block_size, const int64_t* slot_mapping, int64_t seqs,
                       const int32_t* query_start, const int32_t* seq_lens, const int32_t* block_tables,
                       int64_t block_table_stride, const int32_t* seq_rows, float scale, void* out);

// Embeddings and every block of the step (csrc/forward.cpp): x (tokens, C) gets the hidden states
// before ln_f. cache_layers: one pointer per layer, each (num_blocks, 2, heads, block_size * head_dim).
int kv_forward(const kv_model* m, void* const* cache_layers, int64_t block_size, const int64_t* token_ids,
               const int64_t* positions, int64_t tokens, const int64_t* slot_mapping, int64_t seqs,
               const int32_t* query_start, const int32_t* seq_lens, const int32_t* block_tables,
               int64_t block_table_stride, const int32_t* seq_rows, void* x);

// The Llama-style decoder's step (csrc/decoder.cpp), as kv_forward is GPT-2's: x (tokens, hidden) gets
// the hidden states before the final norm. cache_layers: one pointer per layer, each (num_blocks, 2,
// kv_heads, block_size * head_dim).
int kv_decoder_forward(const kv_decoder* m, void* const* cache_layers, int64_t block_size, const int64_t* token_ids,
                       const int64_t* positions, int64_t tokens, const int64_t* slot_mapping, int64_t seqs,
                       const int32_t* query_start, const int32_t* seq_lens, const int32_t* block_tables,
                       int64_t block_table_stride, const int32_t* seq_rows, void* x);

// The greedy pick and log-normalizer of each row of float32 logits (csrc/sampling.cpp).
void kv_greedy(const float* logits, int64_t rows, int64_t V, double* out, int64_t out_stride, float* lse);
// kv_greedy's pick again for the n rows `rows` that a grammar restricts: the first largest logit among the
// tokens bitmask row i allows (bit j % 32 of word j / 32), its logprob against lse; rows kv_greedy found
// non-finite are left as they are.
void kv_greedy_masked(const float* logits, int64_t V, const int64_t* rows, int64_t n, const int32_t* bitmask,
                      int64_t words, double* out, int64_t out_stride, const float* lse);
}
