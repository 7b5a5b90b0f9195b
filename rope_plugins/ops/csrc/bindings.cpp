// The C++ kernels as one extension module (rope_plugins/ops/native.py builds and loads it).
#include <torch/extension.h>

torch::Tensor decode_attention(
    const torch::Tensor& query, const torch::Tensor& query_scale, const torch::Tensor& query_cos,
    const torch::Tensor& query_sin, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
    const torch::Tensor& seq_lens, const torch::Tensor& window, const torch::Tensor& band_start,
    const torch::Tensor& near_cos, const torch::Tensor& near_sin, const torch::Tensor& far_step_cos,
    const torch::Tensor& far_step_sin, const torch::Tensor& far_offset_cos, const torch::Tensor& far_offset_sin,
    const torch::Tensor& far_table, int64_t step, double scale);

torch::Tensor prefill_attention(const torch::Tensor& query, const torch::Tensor& query_scale,
                                const torch::Tensor& near_cos, const torch::Tensor& near_sin,
                                const torch::Tensor& far_cos, const torch::Tensor& far_sin,
                                const torch::Tensor& near_keys_t, const torch::Tensor& far_keys_t,
                                const torch::Tensor& values, int64_t context, int64_t window, int64_t near_origin,
                                double scale);

void write_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                 const torch::Tensor& slots);

torch::Tensor cache_key_tiles(const torch::Tensor& kv_cache, const torch::Tensor& block_ids, int64_t first,
                              int64_t count, const torch::Tensor& cos, const torch::Tensor& sin, int64_t origin,
                              int64_t tiles);
torch::Tensor cache_values(const torch::Tensor& kv_cache, const torch::Tensor& block_ids, int64_t seq_len);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "single-pass decode attention on the pre-rotation paged cache");
  m.def("write_cache", &write_cache, "the step's unrotated keys and values into their cache slots");
  m.def("cache_key_tiles", &cache_key_tiles, "one sequence's keys from the paged cache as turned key tiles");
  m.def("cache_values", &cache_values, "one sequence's values from the paged cache as [kv, seq_len, d]");
  m.def("prefill_attention", &prefill_attention, "one-pass prefill attention of one chunk, near and far keys");
}
