// The vectorisable math of the C++ kernels, each written once: widening a cache row to float32,
// exp, the rotation, the dot product and the online-softmax step.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace rope_kernels {

// exp(x) for x <= 0 (-inf included, giving 0), in a form compilers vectorise: x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by Cephes' degree-5 polynomial (within 2 ulp), times 2^n from its bits.
#pragma omp declare simd
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float exp_r = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : exp_r * two_n;
}

// The largest of scores[0 .. count) and `floor`. A max reduction is not vectorised by GCC
// (NaN order), so 16 running maxima are kept lane by lane, elementwise, and folded at the end.
inline float max_of(const float* __restrict scores, int64_t count, float floor) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, floor);
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], scores[j + l]);
  }
  for (; j < count; ++j) lanes[0] = std::max(lanes[0], scores[j]);
  // folded in halves (4 dependent steps, not 16: the fold is paid once per row and key step)
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < width; ++l) lanes[l] = std::max(lanes[l], lanes[l + width]);
  }
  return lanes[0];
}

// The factor by which what a row has summed under `running_max` is rescaled to `maximum`: 1
// without the exp where the maximum did not move, as it mostly does not once a row has begun.
inline float rescaling(float running_max, float maximum) {
  return maximum == running_max ? 1.f : exp_nonpositive(running_max - maximum);
}

// scores[j] = exp(scores[j] - maximum) for j < count (maximum at least every score); returns their sum.
inline float exponentiate(float* __restrict scores, int64_t count, float maximum) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < count; ++j) {
    const float p = exp_nonpositive(scores[j] - maximum);
    scores[j] = p;
    total += p;
  }
  return total;
}

// one cache element as float32 (exact), in a form `omp simd` loops vectorise
template <typename Element>
inline float to_float(Element x) {
  if constexpr (std::is_same_v<Element, c10::BFloat16>) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
  } else {
    return static_cast<float>(x);
  }
}

// out[0 .. count) = the cache elements as float32. bfloat16 is float32's upper half, so widening
// is a shift (exact, and vectorised to two instructions per 16 elements); float16 goes through
// c10's conversion (exact too).
template <typename Element>
inline void widen(const Element* __restrict row, float* __restrict out, int64_t count) {
  if constexpr (std::is_same_v<Element, c10::BFloat16>) {
    const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) out[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) out[i] = to_float(row[i]);
  }
}

// A cache row as float32: a float32 row in place, a 16-bit one widened into `buffer`.
template <typename Element>
inline const float* as_floats(const Element* row, float* buffer, int64_t count) {
  if constexpr (std::is_same_v<Element, float>) {
    return row;
  } else {
    widen(row, buffer, count);
    return buffer;
  }
}

// out = factor R(sign angle) x for the pairs (i, i + half), angle given by its cos and sin; x
// float32 or a 16-bit cache row, widened as it is read.
template <typename Element>
inline void rotate(const Element* __restrict x, const float* __restrict cos, const float* __restrict sin,
                   float* __restrict out, int64_t half, float factor = 1.f, float sign = 1.f) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float first = factor * to_float(x[i]), second = factor * to_float(x[i + half]), s = sign * sin[i];
    out[i] = first * cos[i] - second * s;
    out[i + half] = second * cos[i] + first * s;
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < d; ++i) total += a[i] * b[i];
  return total;
}

// One online-softmax step of a row over scores[0 .. count): they become exp(score - max) under
// the row's new running max, and running_sum takes in their sum. Returns the factor by which
// what the row has already summed must be rescaled (0 on its first step).
inline float softmax_step(float* __restrict scores, int64_t count, float& running_max, float& running_sum) {
  const float maximum = max_of(scores, count, running_max);
  const float correction = rescaling(running_max, maximum);
  running_sum = running_sum * correction + exponentiate(scores, count, maximum);
  running_max = maximum;
  return correction;
}

}  // namespace rope_kernels
