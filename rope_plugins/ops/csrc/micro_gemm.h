// The prefill's register-tiled GEMM: c[m, 32] (+)= a[m, depth] . b[depth, 32], 8 rows of 32
// accumulators at a time; portable loops, and AVX-512 intrinsics for full blocks where the CPU has them.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_inputs.h"

namespace rope_kernels {

constexpr int64_t kRows = 8;               // accumulator rows of the micro-kernel
constexpr int64_t kColumns = kKeyTile;     // accumulator columns: keys per tile, value dims per step

// c[rows, 32] (+)= a[rows, depth] . b[depth, 32]; rows <= 8; a row-major (lda), b row-major (ldb)
template <int64_t rows>
inline void micro_gemm(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb,
                       float* __restrict c, int64_t ldc, int64_t depth, bool accumulate) {
  float acc[rows][kColumns];
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t j = 0; j < kColumns; ++j) acc[r][j] = accumulate ? c[r * ldc + j] : 0.f;
  }
  for (int64_t k = 0; k < depth; ++k) {
    const float* __restrict b_row = b + k * ldb;
    for (int64_t r = 0; r < rows; ++r) {
      const float a_rk = a[r * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < kColumns; ++j) acc[r][j] += a_rk * b_row[j];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t j = 0; j < kColumns; ++j) c[r * ldc + j] = acc[r][j];
  }
}

#if defined(__AVX512F__)
static_assert(kColumns == 32, "the AVX-512 micro-kernel holds a row as two 16-float halves");

// The full 8-row block in AVX-512 intrinsics (two 16-float halves per row): on the AVX-512
// EPYC this was developed on, faster than GCC's code for the portable loop above, which
// serves the partial blocks and CPUs without AVX-512.
template <>
inline void micro_gemm<kRows>(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb,
                              float* __restrict c, int64_t ldc, int64_t depth, bool accumulate) {
  __m512 low[kRows], high[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    low[r] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
    high[r] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 b_low = _mm512_loadu_ps(b + k * ldb), b_high = _mm512_loadu_ps(b + k * ldb + 16);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 a_rk = _mm512_set1_ps(a[r * lda + k]);
      low[r] = _mm512_fmadd_ps(a_rk, b_low, low[r]);
      high[r] = _mm512_fmadd_ps(a_rk, b_high, high[r]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(c + r * ldc, low[r]);
    _mm512_storeu_ps(c + r * ldc + 16, high[r]);
  }
}
#endif

// c[m, 32] (+)= a[m, depth] . b[depth, 32] for any m, in blocks of 8 rows
inline void gemm_columns(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                         int64_t depth, bool accumulate) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) micro_gemm<kRows>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, depth, accumulate);
  switch (m - r) {
#define ROPE_TAIL(N) \
  case N:            \
    micro_gemm<N>(a + r * lda, lda, b, ldb, c + r * ldc, ldc, depth, accumulate); break;
    ROPE_TAIL(1) ROPE_TAIL(2) ROPE_TAIL(3) ROPE_TAIL(4) ROPE_TAIL(5) ROPE_TAIL(6) ROPE_TAIL(7)
#undef ROPE_TAIL
    default: break;
  }
}

}  // namespace rope_kernels
