// Float32 matrix products of attnlab's analysis kernel (analysis_cpu.cpp) on AVX-512; other builds use
// BLAS. MKL runs AVX2 kernels on AMD's CPUs and packs for large problems; a head's scores (K = D, k
// packed once per head) and its attention output come in 64-row blocks, where register tiles of 8
// rows x 32 columns (16 zmm accumulators, one broadcast of A and two loads of B per 16 FMAs) reach
// about twice MKL's speed (512 x 512 x 32: 0.087 ms against 0.173 ms on Zen 5, docs/BENCHMARKS.md).
// The attention kernels keep BLAS: routed through these tiles (B packed per call), DNAS went from
// ~1.0x to 1.2-1.3x SDPA at S = 1024-4096.
//   C (m x n) = alpha A (m x k) B^T (B: n x k)   tiled_packed: B packed by PackedB
//   C (m x n) = A (m x k) B (k x n)              tiled_ab:     B's rows read in place
#pragma once
#include "vec_capability.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace {

// The first n of 16 lanes
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// C[r, 0:32] = alpha sum_kk A[r, kk] B(kk, 0:32) for ROWS rows; B's row kk at b + kk * ldb, its lanes
// m0, m1 (the columns that exist)
template <int ROWS>
inline void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float alpha, float* c,
                 int64_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K; ++kk) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + kk * ldb), b1 = _mm512_maskz_loadu_ps(m1, b + kk * ldb + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + kk]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  for (int r = 0; r < ROWS; ++r) {  // C is written, never read
    _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_mul_ps(acc[r][0], va));
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_mul_ps(acc[r][1], va));
  }
}

// Rows [0, m) against one 32-column chunk of B: 8 at a time, then the rest
inline void tile_rows(int64_t m, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float alpha,
                      float* c, int64_t ldc, __mmask16 m0, __mmask16 m1) {
  int64_t r = 0;
  for (; r + 8 <= m; r += 8) tile<8>(a + r * lda, lda, b, ldb, K, alpha, c + r * ldc, ldc, m0, m1);
  const float* ar = a + r * lda;
  float* cr = c + r * ldc;
  switch (m - r) {
    case 7: tile<7>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    case 6: tile<6>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    case 5: tile<5>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    case 4: tile<4>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    case 3: tile<3>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    case 2: tile<2>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    case 1: tile<1>(ar, lda, b, ldb, K, alpha, cr, ldc, m0, m1); break;
    default: break;
  }
}

// Rows per block: a block's rows of A stay in L2 while every column chunk passes over them.
constexpr int64_t kTileRowBlock = 256;

// B (n x k, row stride ldb < 2^27: the gather's offsets) in panels of 32 rows, each k x 32 (rows past
// n are 0): panel p, element (kk, c) = B[32 p + c, kk] at data[32 p k + 32 kk + c]; 64-byte aligned.
struct PackedB {
  std::unique_ptr<float, void (*)(void*)> data{nullptr, std::free};
  int64_t n = 0, k = 0;
  PackedB(const float* b, int64_t ldb, int64_t n_, int64_t k_) : n(n_), k(k_) {
    const int64_t floats = std::max<int64_t>((n + 31) / 32 * 32 * k, 16);  // a multiple of 16: 64 bytes
    data.reset(static_cast<float*>(std::aligned_alloc(64, floats * sizeof(float))));
    if (!data) throw std::bad_alloc();
    float* panels = data.get();
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(ldb)));
    for (int64_t j0 = 0; j0 < n; j0 += 16) {  // 16 rows of B at a time, one gathered column each
      const __mmask16 m = first_lanes(n - j0);
      float* out = panels + (j0 / 32) * 32 * k + j0 % 32;
      for (int64_t kk = 0; kk < k; ++kk)
        _mm512_store_ps(out + 32 * kk, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, rows, b + j0 * ldb + kk, 4));
    }
    if (n % 32 && n % 32 <= 16)  // the last panel's second half
      for (int64_t kk = 0; kk < k; ++kk) _mm512_store_ps(panels + (n / 32) * 32 * k + 32 * kk + 16, _mm512_setzero_ps());
  }
};

// C (m x n) = alpha A P^T, P packed by PackedB
inline void tiled_packed(int64_t m, float alpha, const float* a, int64_t lda, const PackedB& p, float* c,
                         int64_t ldc) {
  for (int64_t i0 = 0; i0 < m; i0 += kTileRowBlock) {
    const int64_t rows = std::min(kTileRowBlock, m - i0);
    for (int64_t j0 = 0; j0 < p.n; j0 += 32)
      tile_rows(rows, a + i0 * lda, lda, p.data.get() + j0 * p.k, 32, p.k, alpha, c + i0 * ldc + j0, ldc,
                first_lanes(p.n - j0), first_lanes(p.n - j0 - 16));
  }
}

inline void tiled_ab(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                     float* c, int64_t ldc) {
  for (int64_t i0 = 0; i0 < m; i0 += kTileRowBlock) {
    const int64_t rows = std::min(kTileRowBlock, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += 32)
      tile_rows(rows, a + i0 * lda, lda, b + j0, ldb, k, 1.f, c + i0 * ldc + j0, ldc, first_lanes(n - j0),
                first_lanes(n - j0 - 16));
  }
}

}  // namespace
#endif
