// The C++ kernels as one extension module (rope_plugins/ops/native.py builds and loads it).
#include <torch/extension.h>

torch::Tensor decode_attention(
    const torch::Tensor& query, const torch::Tensor& query_scale, const torch::Tensor& query_cos,
    const torch::Tensor& query_sin, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
    const torch::Tensor& seq_lens, const torch::Tensor& window, const torch::Tensor& band_start,
    const torch::Tensor& near_cos, const torch::Tensor& near_sin, const torch::Tensor& far_step_cos,
    const torch::Tensor& far_step_sin, const torch::Tensor& far_offset_cos, const torch::Tensor& far_offset_sin,
    const torch::Tensor& far_table, int64_t step, double scale);

torch::Tensor prefill_attention(const torch::Tensor& near_query, const torch::Tensor& far_query,
                                const torch::Tensor& near_keys_t, const torch::Tensor& far_keys_t,
                                const torch::Tensor& values, int64_t context, int64_t window, int64_t near_origin);

void write_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                 const torch::Tensor& slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "single-pass decode attention on the pre-rotation paged cache");
  m.def("write_cache", &write_cache, "the step's unrotated keys and values into their cache slots");
  m.def("prefill_attention", &prefill_attention, "one-pass prefill attention of one chunk, near and far keys");
}
