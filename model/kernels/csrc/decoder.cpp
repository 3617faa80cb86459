// The inference step of the Llama-style decoders (model/models/decoder.py: Llama, Qwen2, Qwen3), in one
// call, as forward.cpp is GPT-2's: embeddings, then every layer as DecoderLayer.forward_step spells it
//   qkv  = RMSNorm(x) @ [Wq Wk Wv] + b           (kv_linear, the norm in its prologue)
//   q, k = RoPE(QK-norm(q, k))                   (kv_rope, in place; keys cached rotated)
//   a    = attention over the paged cache         (kv_paged_attention: writes k and v, grouped-query)
//   x   += a @ Wo + bo                            (kv_linear, residual epilogue, in place)
//   h    = silu(RMSNorm(x) @ Wg) * (.. @ Wu)      (kv_linear: one product, SwiGLU epilogue)
//   x   += h @ Wd + bd                            (kv_linear, residual epilogue, in place)
// each op through the same kernel a Python call reaches, so the arithmetic (and each op's reduction order,
// written in its file) is the ops'; one call spares the step the Python and ctypes overhead of six per layer.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "api.h"

extern "C" {

int kv_decoder_forward(const kv_decoder* m, void* const* cache_layers, int64_t block_size, const int64_t* token_ids,
                       const int64_t* positions, int64_t tokens, const int64_t* slot_mapping, int64_t seqs,
                       const int32_t* query_start, const int32_t* seq_lens, const int32_t* block_tables,
                       int64_t block_table_stride, const int32_t* seq_rows, void* x) {
  const int64_t C = m->hidden, hd = m->head_dim, elem = m->dtype == KV_DTYPE_F32 ? 4 : 2;
  const int64_t qkv_width = (m->heads + 2 * m->kv_heads) * hd, attended_width = m->heads * hd;
  thread_local std::vector<unsigned char> workspace;
  const size_t need = size_t(tokens * (qkv_width + attended_width + m->intermediate) * elem);
  if (workspace.size() < need) workspace.resize(need);
  unsigned char* qkv = workspace.data();
  unsigned char* attended = qkv + tokens * qkv_width * elem;
  unsigned char* hidden = attended + tokens * attended_width * elem;
  const int dtype = int(m->dtype);
  int failed = kv_embed(dtype, token_ids, positions, tokens, m->embed, nullptr, C, x);
  const float scale = float(1.0 / __builtin_sqrt(double(hd)));  // as the Python wrapper computes it
  for (int64_t l = 0; l < m->n_layer && !failed; ++l) {
    const kv_decoder_layer& w = m->layers[l];
    failed |=
        kv_linear(&w.qkv, dtype, x, tokens, qkv, KV_EPILOGUE_NONE, nullptr, KV_NORM_RMS, w.input_norm, nullptr, m->eps);
    failed |= kv_rope(dtype, qkv, tokens, m->heads, m->kv_heads, hd, positions, m->rope, m->rope_positions, w.q_norm,
                      w.k_norm, m->eps);
    if (failed) break;  // a position outside the RoPE table: nothing written to the cache
    failed |= kv_paged_attention(dtype, int(m->cache_dtype), qkv, tokens, m->heads, m->kv_heads, hd, cache_layers[l],
                                 block_size, slot_mapping, seqs, query_start, seq_lens, block_tables,
                                 block_table_stride, seq_rows, scale, attended);
    failed |=
        kv_linear(&w.o_proj, dtype, attended, tokens, x, KV_EPILOGUE_RESIDUAL, x, KV_NORM_RMS, nullptr, nullptr, 0.0f);
    failed |= kv_linear(&w.gate_up, dtype, x, tokens, hidden, KV_EPILOGUE_SILU_MUL, nullptr, KV_NORM_RMS, w.post_norm,
                        nullptr, m->eps);
    failed |=
        kv_linear(&w.down, dtype, hidden, tokens, x, KV_EPILOGUE_RESIDUAL, x, KV_NORM_RMS, nullptr, nullptr, 0.0f);
  }
  return failed ? -1 : 0;
}
}
