// The matrix products of attnlab's analysis kernel (analysis_cpu.cpp's score_pass) on AVX-512, a block
// of rows at a time: the scores s = scale q k^T and the attention output diag(1 / r) E v. MKL's sgemm
// takes ~0.18 ms for a 512 x 512 x 32 head on AMD's Zen 5 (its AVX2 kernels, and packing that a K of
// 32 does not pay back); these register tiles of 8 rows x 32 columns, with k packed once per head,
// take about half of that. Other builds use BLAS (gemm_abt, gemm_ab).
#pragma once
#include "vec_capability.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cstdlib>

namespace {

// s[r, j0:j0+32] = scale sum_d q[r, d] kp[d, 0:32] for ROWS rows (kp: one packed panel of 32 keys,
// D x 32; m0, m1: the valid keys of its two 16-wide halves)
template <int ROWS>
inline void score_tile(const float* q, int64_t ldq, const float* kp, int64_t D, __m512 scale, float* s,
                       int64_t lds, __mmask16 m0, __mmask16 m1) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 b0 = _mm512_load_ps(kp + d * 32), b1 = _mm512_load_ps(kp + d * 32 + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(q[r * ldq + d]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_mask_storeu_ps(s + r * lds, m0, _mm512_mul_ps(acc[r][0], scale));
    _mm512_mask_storeu_ps(s + r * lds + 16, m1, _mm512_mul_ps(acc[r][1], scale));
  }
}

template <int ROWS>
void score_rows(const float* q, int64_t ldq, const float* kp, int64_t N, int64_t D, __m512 scale, float* s,
                int64_t lds) {
  for (int64_t j0 = 0; j0 < N; j0 += 32) {
    const int64_t n = N - j0;
    const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
    score_tile<ROWS>(q, ldq, kp + j0 * D, D, scale, s + j0, lds, m0, m1);
  }
}

// k (N x D, row stride ldk) packed into panels of 32 keys, each D x 32 (keys past N are 0): panel p,
// element (d, c) = k[32 p + c, d], at kp[(32 p) D + 32 d + c]; 64-byte aligned
struct KeyPanels {
  float* data = nullptr;
  int64_t size = 0;
  ~KeyPanels() { std::free(data); }
  void pack(const float* k, int64_t ldk, int64_t N, int64_t D) {
    const int64_t need = (N + 31) / 32 * 32 * D;
    if (need == 0) return;
    if (need > size) {
      std::free(data);
      data = static_cast<float*>(std::aligned_alloc(64, need * sizeof(float)));
      TORCH_CHECK(data, "head: out of memory for the key panels");
      size = need;
    }
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(ldk)));
    for (int64_t j0 = 0; j0 < N; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, N - j0);
      const __mmask16 m = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      float* out = data + (j0 / 32) * 32 * D + j0 % 32;
      for (int64_t d = 0; d < D; ++d)
        _mm512_store_ps(out + 32 * d, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, rows, k + j0 * ldk + d, 4));
    }
    if (N % 32 && N % 32 <= 16)  // the last panel's second half
      for (int64_t d = 0; d < D; ++d)
        _mm512_store_ps(data + (N / 32) * 32 * D + 32 * d + 16, _mm512_setzero_ps());
  }
};

// s (R x N, row stride lds) = scale q k^T for R rows of q (row stride ldq), kp: KeyPanels::pack of k
inline void score_block(int64_t R, int64_t N, int64_t D, float scale, const float* q, int64_t ldq,
                        const float* kp, float* s, int64_t lds) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) score_rows<8>(q + r * ldq, ldq, kp, N, D, vs, s + r * lds, lds);
  const float* qr = q + r * ldq;
  float* sr = s + r * lds;
  switch (R - r) {
    case 7: score_rows<7>(qr, ldq, kp, N, D, vs, sr, lds); break;
    case 6: score_rows<6>(qr, ldq, kp, N, D, vs, sr, lds); break;
    case 5: score_rows<5>(qr, ldq, kp, N, D, vs, sr, lds); break;
    case 4: score_rows<4>(qr, ldq, kp, N, D, vs, sr, lds); break;
    case 3: score_rows<3>(qr, ldq, kp, N, D, vs, sr, lds); break;
    case 2: score_rows<2>(qr, ldq, kp, N, D, vs, sr, lds); break;
    case 1: score_rows<1>(qr, ldq, kp, N, D, vs, sr, lds); break;
    default: break;
  }
}

// o[r, c0:c0+32] = inv[r] sum_j e[r, j] v[j, c0:c0+32] for ROWS rows (m0, m1: the valid columns of the
// two 16-wide halves)
template <int ROWS>
inline void output_tile(const float* e, int64_t lde, const float* v, int64_t ldv, int64_t N, const float* inv,
                        float* o, int64_t ldo, __mmask16 m0, __mmask16 m1) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < N; ++j) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, v + j * ldv), b1 = _mm512_maskz_loadu_ps(m1, v + j * ldv + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(e[r * lde + j]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 w = _mm512_set1_ps(inv[r]);
    _mm512_mask_storeu_ps(o + r * ldo, m0, _mm512_mul_ps(acc[r][0], w));
    _mm512_mask_storeu_ps(o + r * ldo + 16, m1, _mm512_mul_ps(acc[r][1], w));
  }
}

template <int ROWS>
void output_rows(const float* e, int64_t lde, const float* v, int64_t ldv, int64_t N, int64_t Dv, const float* inv,
                 float* o, int64_t ldo) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
    const int64_t n = Dv - c0;
    const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
    output_tile<ROWS>(e, lde, v + c0, ldv, N, inv, o + c0, ldo, m0, m1);
  }
}

// o (R x Dv, row stride ldo) = diag(inv) e v for R rows of e (R x N, row stride lde) and v (N x Dv, ldv)
inline void output_block(int64_t R, int64_t N, int64_t Dv, const float* e, int64_t lde, const float* v, int64_t ldv,
                         const float* inv, float* o, int64_t ldo) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) output_rows<8>(e + r * lde, lde, v, ldv, N, Dv, inv + r, o + r * ldo, ldo);
  const float* er = e + r * lde;
  float* orow = o + r * ldo;
  switch (R - r) {
    case 7: output_rows<7>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    case 6: output_rows<6>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    case 5: output_rows<5>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    case 4: output_rows<4>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    case 3: output_rows<3>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    case 2: output_rows<2>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    case 1: output_rows<1>(er, lde, v, ldv, N, Dv, inv + r, orow, ldo); break;
    default: break;
  }
}

}  // namespace
#endif
