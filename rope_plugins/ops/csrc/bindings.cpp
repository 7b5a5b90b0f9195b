// The C++ kernels as one extension module (rope_plugins/ops/native.py builds and loads it): the
// entry points and input structs of attention_inputs.h, and the constants Python checks against.
#include <torch/python.h>

#include "attention_inputs.h"

namespace py = pybind11;
using rope_kernels::DecodeInputs;
using rope_kernels::PrefillInputs;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("KEY_TILE") = rope_kernels::kKeyTile;
  m.attr("DECODE_CHUNK") = rope_kernels::kDecodeChunk;
  m.def("matrix_tiles_ready", &matrix_tiles_ready, "built with AMX and granted its tile state by the OS");
  py::class_<DecodeInputs>(m, "DecodeInputs")
      .def(py::init<>())
      .def_readwrite("query_scale", &DecodeInputs::query_scale)
      .def_readwrite("query_cos", &DecodeInputs::query_cos)
      .def_readwrite("query_sin", &DecodeInputs::query_sin)
      .def_readwrite("block_table", &DecodeInputs::block_table)
      .def_readwrite("seq_lens", &DecodeInputs::seq_lens)
      .def_readwrite("window", &DecodeInputs::window)
      .def_readwrite("band_start", &DecodeInputs::band_start)
      .def_readwrite("near_cos", &DecodeInputs::near_cos)
      .def_readwrite("near_sin", &DecodeInputs::near_sin)
      .def_readwrite("far_step_cos", &DecodeInputs::far_step_cos)
      .def_readwrite("far_step_sin", &DecodeInputs::far_step_sin)
      .def_readwrite("far_offset_cos", &DecodeInputs::far_offset_cos)
      .def_readwrite("far_offset_sin", &DecodeInputs::far_offset_sin)
      .def_readwrite("far_table", &DecodeInputs::far_table);
  py::class_<PrefillInputs>(m, "PrefillInputs")
      .def(py::init<>())
      .def_readwrite("query_scale", &PrefillInputs::query_scale)
      .def_readwrite("near_cos", &PrefillInputs::near_cos)
      .def_readwrite("near_sin", &PrefillInputs::near_sin)
      .def_readwrite("far_cos", &PrefillInputs::far_cos)
      .def_readwrite("far_sin", &PrefillInputs::far_sin)
      .def_readwrite("context", &PrefillInputs::context)
      .def_readwrite("near_from", &PrefillInputs::near_from)
      .def_readwrite("banded", &PrefillInputs::banded)
      .def_readwrite("near_origin", &PrefillInputs::near_origin)
      .def_readwrite("matrix_tiles", &PrefillInputs::matrix_tiles)
      .def_readwrite("rounded_once", &PrefillInputs::rounded_once);
  m.def("decode_attention", &decode_attention, "single-pass decode attention on the pre-rotation paged cache");
  m.def("write_cache", &write_cache, "the step's unrotated keys and values into their cache slots");
  m.def("cache_key_tiles", &cache_key_tiles, "one sequence's keys from the paged cache as turned key tiles");
  m.def("cache_values", &cache_values, "one sequence's values from the paged cache as [kv, seq_len, d]");
  m.def("prefill_attention", &prefill_attention, "one-pass prefill attention of one chunk, near and far keys");
}
