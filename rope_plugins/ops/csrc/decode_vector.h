// The decode's two inner loops in AVX-512 registers, for head sizes in whole 32-float halves:
// scores of a run of keys, and P.V. Keys and values are widened and turned in registers (no
// scratch row), each key's partial dot products for all the queries of its kv head are kept as
// vectors and 16 keys' are summed at once by a transpose (one horizontal sum per key would
// cost more than the dot product), and P.V keeps its sums in registers across the chunk.
// csrc/decode_attention.cpp takes these where the compiler targets AVX-512 and the portable
// loops there elsewhere; both compute in float32 and the tests hold both to the oracle.
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
constexpr bool kServes = d % (2 * kLanes) == 0;  // the rotation pairs whole vectors of each half

// 16 cache elements as float32 (bfloat16: float32's upper half; float16: the hardware conversion)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// a key row in registers, turned by the angle of cos / sin [d/2] (raw when cos is null)
template <int64_t d, typename Element>
inline void load_key(const Element* row, const float* cos, const float* sin, __m512 (&key)[d / kLanes]) {
  constexpr int64_t halves = d / (2 * kLanes);
  for (int64_t i = 0; i < d / kLanes; ++i) key[i] = load16(row + kLanes * i);
  if (cos == nullptr) return;
  for (int64_t i = 0; i < halves; ++i) {
    const __m512 c = _mm512_loadu_ps(cos + kLanes * i), s = _mm512_loadu_ps(sin + kLanes * i);
    const __m512 first = key[i], second = key[i + halves];
    key[i] = _mm512_fmsub_ps(first, c, _mm512_mul_ps(second, s));
    key[i + halves] = _mm512_fmadd_ps(second, c, _mm512_mul_ps(first, s));
  }
}

// lane k of the result: the sum of the 16 lanes of vector k of partials [16][16]. Pairs, then
// quadruples, are summed within 128-bit lanes, then across them.
inline __m512 transpose_sum(const float* partials) {
  __m512 pairs[8], quads[4], octets[2];
  for (int k = 0; k < 8; ++k) {
    const __m512 a = _mm512_loadu_ps(partials + 2 * k * kLanes), b = _mm512_loadu_ps(partials + (2 * k + 1) * kLanes);
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(pairs[2 * k]), b = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)  // 128-bit lanes 0 + 1 and 2 + 3 of each quadruple
    octets[k] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * k], quads[2 * k + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * k], quads[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], 0x88),
                       _mm512_shuffle_f32x4(octets[0], octets[1], 0xDD));
}

// scores[g * stride + k] = queries[g] . key k for k < count <= 16 and g < queries_per_kv: key k's
// row rows[k], turned by angle(k) (a {cos, sin} pair; {null, null}: raw). partials: [queries_per_kv, 16, 16].
template <int64_t d, typename Element, typename Angle>
inline void score_keys(const void* const* rows, int64_t count, const float* queries, int64_t queries_per_kv,
                       Angle angle, float* partials, float* scores, int64_t stride) {
  __m512 key[d / kLanes];
  for (int64_t k = 0; k < count; ++k) {
    const auto [cos, sin] = angle(k);
    load_key<d>(static_cast<const Element*>(rows[k]), cos, sin, key);
    for (int64_t g = 0; g < queries_per_kv; ++g) {
      const float* query = queries + g * d;
      __m512 sum = _mm512_mul_ps(key[0], _mm512_loadu_ps(query));
      for (int64_t i = 1; i < d / kLanes; ++i) sum = _mm512_fmadd_ps(key[i], _mm512_loadu_ps(query + kLanes * i), sum);
      _mm512_storeu_ps(partials + (g * kLanes + k) * kLanes, sum);
    }
  }
  // rows count .. 15 of partials hold whatever was there: they reach only lanes not stored
  const __mmask16 stored = static_cast<__mmask16>((1u << count) - 1);
  for (int64_t g = 0; g < queries_per_kv; ++g)
    _mm512_mask_storeu_ps(scores + g * stride, stored, transpose_sum(partials + g * kLanes * kLanes));
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
