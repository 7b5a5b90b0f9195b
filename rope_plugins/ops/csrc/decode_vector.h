// The decode's P.V in AVX-512 registers, for head sizes in whole 16-float vectors: each value row
// is widened in registers once and added into the sums of a group of the kv head's queries,
// which stay in registers across the chunk (the portable loop keeps them in memory: a load and
// a store per value vector and query). csrc/decode_attention.cpp takes it where the compiler
// targets AVX-512 and its portable loop elsewhere; both compute in float32 and the tests hold
// both to the oracle.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace rope_kernels::avx512 {

constexpr int64_t kLanes = 16;

template <int64_t d>
constexpr bool kServes = d % kLanes == 0;

// 16 cache elements as float32 (bfloat16: float32's upper half; float16: the hardware conversion)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// queries whose P.V sums stay in registers together: 16 of the 32 vector registers
template <int64_t d>
constexpr int64_t kValueGroup = std::clamp<int64_t>(kLanes * kLanes / d, 1, 8);

// out[g] = sum_j weights[g * stride + j] value_j for g < group, j < keys (value_j: d elements after rows[j])
template <int64_t d, typename Element, int64_t group>
inline void sum_values(const void* const* rows, int64_t keys, const float* weights, int64_t stride, float* out) {
  __m512 sums[group][d / kLanes];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d / kLanes; ++i) sums[g][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    const Element* value = static_cast<const Element*>(rows[j]) + d;
    __m512 row[d / kLanes];
    for (int64_t i = 0; i < d / kLanes; ++i) row[i] = load16(value + kLanes * i);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 weight = _mm512_set1_ps(weights[g * stride + j]);
      for (int64_t i = 0; i < d / kLanes; ++i) sums[g][i] = _mm512_fmadd_ps(weight, row[i], sums[g][i]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d / kLanes; ++i) _mm512_storeu_ps(out + g * d + kLanes * i, sums[g][i]);
}

// sum_values for queries_per_kv queries, kValueGroup<d> at a time
template <int64_t d, typename Element>
inline void sum_all_values(const void* const* rows, int64_t keys, const float* weights, int64_t stride,
                           int64_t queries_per_kv, float* out) {
  for (int64_t g = 0; g < queries_per_kv; g += kValueGroup<d>) {
    const float* group_weights = weights + g * stride;
    float* group_out = out + g * d;
    switch (std::min(kValueGroup<d>, queries_per_kv - g)) {
#define ROPE_VALUE_GROUP(N)                                                                      \
  case N:                                                                                        \
    if constexpr (N <= kValueGroup<d>) sum_values<d, Element, N>(rows, keys, group_weights, stride, group_out); \
    break;
      ROPE_VALUE_GROUP(1) ROPE_VALUE_GROUP(2) ROPE_VALUE_GROUP(3) ROPE_VALUE_GROUP(4)
      ROPE_VALUE_GROUP(5) ROPE_VALUE_GROUP(6) ROPE_VALUE_GROUP(7) ROPE_VALUE_GROUP(8)
#undef ROPE_VALUE_GROUP
      default: break;
    }
  }
}

}  // namespace rope_kernels::avx512
#endif
