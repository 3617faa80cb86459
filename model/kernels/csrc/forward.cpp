// The inference forward of model/gpt.py, in one call: embeddings, then every decoder block as
// Block.forward_step spells it (ln_1 inside the qkv product, attention over the paged cache, the
// projection added to the residual in place, ln_2 inside the MLP's first product, its projection
// added in place), each op through the same kernel a Python call would reach. One call instead of
// five per block spares the step the Python and ctypes overhead of each op (BENCHMARKS.md); the
// arithmetic is the ops', unchanged.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "api.h"

extern "C" {

int kv_forward(const kv_model* m, void* const* cache_layers, int64_t block_size, const int64_t* token_ids,
               const int64_t* positions, int64_t tokens, const int64_t* slot_mapping, int64_t seqs,
               const int32_t* query_start, const int32_t* seq_lens, const int32_t* block_tables,
               int64_t block_table_stride, const int32_t* seq_rows, void* x) {
  const int64_t C = m->n_embd, elem = m->dtype == KV_DTYPE_F32 ? 4 : 2, hd = C / m->n_head;
  thread_local std::vector<unsigned char> workspace;
  const size_t need = size_t(tokens * 8 * C * elem);  // qkv (3C), attention output (C), MLP hidden (4C)
  if (workspace.size() < need) workspace.resize(need);
  unsigned char* qkv = workspace.data();
  unsigned char* attended = qkv + tokens * 3 * C * elem;
  unsigned char* hidden = attended + tokens * C * elem;
  const int dtype = int(m->dtype);
  int failed = kv_embed(dtype, token_ids, positions, tokens, m->wte, m->wpe, C, x);
  const float scale = float(1.0 / __builtin_sqrt(double(hd)));  // as the Python wrapper computes it
  for (int64_t l = 0; l < m->n_layer && !failed; ++l) {
    const kv_layer& w = m->layers[l];
    failed |= kv_linear(&w.c_attn, dtype, x, tokens, qkv, KV_EPILOGUE_NONE, nullptr, KV_NORM_LAYER, w.ln_1, w.ln_1 + C,
                        m->eps);
    failed |= kv_paged_attention(dtype, int(m->cache_dtype), qkv, tokens, m->n_head, m->n_head, hd, cache_layers[l],
                                 block_size, slot_mapping, seqs, query_start, seq_lens, block_tables,
                                 block_table_stride, seq_rows, scale, attended);
    failed |= kv_linear(&w.attn_proj, dtype, attended, tokens, x, KV_EPILOGUE_RESIDUAL, x, KV_NORM_LAYER, nullptr,
                        nullptr, 0.0f);
    failed |= kv_linear(&w.c_fc, dtype, x, tokens, hidden, KV_EPILOGUE_GELU, nullptr, KV_NORM_LAYER, w.ln_2, w.ln_2 + C,
                        m->eps);
    failed |= kv_linear(&w.mlp_proj, dtype, hidden, tokens, x, KV_EPILOGUE_RESIDUAL, x, KV_NORM_LAYER, nullptr, nullptr,
                        0.0f);
  }
  return failed ? -1 : 0;
}
}
