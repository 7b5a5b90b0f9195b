// The contract between the Python planner and the C++ kernels: the shared constants, each
// kernel's inputs as one struct (built once per step in rope_plugins/ops/native.py, as vLLM's
// CPU attention packs its AttentionInput), and every entry point bindings.cpp exposes.
//
// Rows follow the planner's rule (rope_plugins/attention/planner.py): a query at position m
// scores a key at n <= m as
//   m - n < window : (R(m theta) q) . (R(n theta) k_n)       the near band, plain RoPE (the window
//                                                             is the query's own: see PrefillInputs)
//   otherwise      : (R(far(m) theta) q) . (R(far(n) theta) k_n)  far angles (ReRoPE: far(n) = 0, keys raw)
// with q scaled by its row's query factor (log-n x the method's factor) and the softmax scale.
#pragma once

// ATen, not <torch/extension.h>: the kernels need tensors only, and the extension header
// (pybind11, PyTorch's C++ frontend) would be compiled again in every file. bindings.cpp alone
// includes PyTorch's Python binding header.
#include <ATen/ATen.h>

namespace rope_kernels {

// Keys per tile: the prefill's key tiles and its micro-kernel's columns. It is the Triton
// kernels' tile too (planner.KEY_TILE; rope_plugins/ops/native.py checks they agree).
constexpr int64_t kKeyTile = 32;
// Keys per decode work item; the far step (far_offset tables' rows, planner.DECODE_FAR_STEP)
// must divide it.
constexpr int64_t kDecodeChunk = 512;

// Every decode row of one step (one query each, at m = seq_len - 1): the same for every layer.
struct DecodeInputs {
  at::Tensor query_scale;  // [R] float32: log-n x the method's factor
  at::Tensor query_cos;    // [R, 2, d/2] float32: the near angle m theta, then the far angle
  at::Tensor query_sin;
  at::Tensor block_table;  // [R, nb] int64
  at::Tensor seq_lens;     // [R] int64
  at::Tensor window;       // [R] int64
  at::Tensor band_start;   // [R] int64: the key position of near_cos' first column
  at::Tensor near_cos;     // [R, W, d/2]: the band keys' n theta (empty without a band)
  at::Tensor near_sin;
  at::Tensor far_step_cos;  // [U, S / step, d/2]: far angles of keys 0, step, 2 step, ... per far rule
  at::Tensor far_step_sin;
  at::Tensor far_offset_cos;  // [U, step, d/2]: far angles of keys 0 .. step - 1
  at::Tensor far_offset_sin;
  at::Tensor far_table;  // [R] int64: the row's far rule; -1: old keys read raw
};

// One prefill row's chunk of L queries at positions context .. context + L - 1: the same for every layer.
struct PrefillInputs {
  at::Tensor query_scale;  // [L] float32: log-n x the method's factor
  at::Tensor near_cos;     // [L, d/2]: each query's near angle
  at::Tensor near_sin;
  at::Tensor far_cos;  // [L, d/2]: each query's far angle
  at::Tensor far_sin;
  at::Tensor near_from;  // [L] int64: each query's first near key, m - window(m) + 1 (the window follows
                            // the query in dual-chunk attention); keys before it are far
  int64_t context = 0;      // tokens cached before the chunk
  bool banded = false;      // near keys given: false when every key is far
  int64_t near_origin = 0;  // near key tiles start here (a multiple of kKeyTile at or before the first near key)
  bool matrix_tiles = false;  // scores and P.V on AMX tiles in bfloat16 parts (csrc/matrix_tiles.h)
  bool rounded_once = false;  // on the tiles, each operand rounded once to bfloat16 (stock vLLM's arithmetic)
};

// `body(Element{})` for the cache's element type: float, c10::BFloat16, c10::Half or an fp8
// format (the kernels widen narrower keys and values to float32 as they read them; an fp8
// cache's per-tensor scales are its callers': they fold into the query's scale and the output).
template <typename Body>
auto with_cache_type(const at::Tensor& kv_cache, const char* name, Body body) {
  TORCH_CHECK(kv_cache.stride(3) == 1, name, ": the cache's last dim must be contiguous");
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    case at::kFloat8_e4m3fn: return body(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return body(c10::Float8_e5m2{});
    default:
      TORCH_CHECK(false, name, ": a float32, bfloat16, float16 or fp8 cache, not ", kv_cache.scalar_type());
  }
}

}  // namespace rope_kernels

// query [R, H, d] unrotated, unscaled; kv_cache [blocks, kv, bs, 2d] (last dim contiguous). Returns [R, H, d].
// rounded_once: the far queries rounded once to bfloat16 against a bfloat16 cache's raw keys
// (ReRoPE's old keys), where they are otherwise two bfloat16 parts.
at::Tensor decode_attention(const rope_kernels::DecodeInputs& rows, const at::Tensor& query,
                               const at::Tensor& kv_cache, double scale, bool rounded_once);

// query [L, H, d] unrotated, unscaled (any token and head strides); near_keys / far_keys
// [kv, tiles, d, kKeyTile] (cache_key_tiles); values [kv, >= seq_len, d]. Returns [L, H, d].
// Whether prefill_attention can take matrix_tiles: built for a CPU with AMX
// and granted its tile state.
bool matrix_tiles_ready();

at::Tensor prefill_attention(const rope_kernels::PrefillInputs& row, const at::Tensor& query,
                                const at::Tensor& near_keys, const at::Tensor& far_keys,
                                const at::Tensor& values, double scale);

void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const at::Tensor& slots, double key_scale, double value_scale);

at::Tensor cache_key_tiles(const at::Tensor& kv_cache, const at::Tensor& block_ids, int64_t first,
                              int64_t count, const at::Tensor& cos, const at::Tensor& sin, int64_t origin,
                              int64_t tiles);

at::Tensor cache_values(const at::Tensor& kv_cache, const at::Tensor& block_ids, int64_t seq_len);
