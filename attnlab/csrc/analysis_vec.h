// Vector helpers of attnlab's analysis kernel (analysis_cpu.cpp): streaming stores, a fast logarithm
// at the compiled width (AVX512 / AVX2 / ATen's default), the Jensen-Shannon terms, and small
// reductions and dot products. Included by analysis_cpu.cpp only (everything sits in an unnamed namespace).
#pragma once
#include "vec_capability.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;

// Store a full vector; non-temporal when the address allows it (weights go to memory, not cache).
inline void store(float* p, const Vec& v, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  if (stream) {
    _mm512_stream_ps(p, static_cast<__m512>(v));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (stream) {
    _mm256_stream_ps(p, static_cast<__m256>(v));
    return;
  }
#endif
  v.store(p);
}

inline float sum_of(const Vec& v) {
  float buf[Vec::size()];
  v.store(buf);
  float s = 0.f;
  for (int64_t k = 0; k < Vec::size(); ++k) s += buf[k];
  return s;
}

// Cephes' logf polynomial P(f), ln(1 + f) = f - f^2 / 2 + f^3 P(f) for f in [1/sqrt2 - 1, sqrt2 - 1]:
// the one copy log_tail (both widths) evaluates (fmadd = the ISA's fused multiply-add). Estrin's
// scheme: a chain of 4 dependent products instead of Horner's 9.
inline Vec log_poly(const Vec& f) {
  const Vec f2 = f * f, f4 = f2 * f2;
  const Vec q0 = at::vec::fmadd(Vec(-2.4999993993e-1f), f, Vec(3.3333331174e-1f));
  const Vec q1 = at::vec::fmadd(Vec(-1.6668057665e-1f), f, Vec(2.0000714765e-1f));
  const Vec q2 = at::vec::fmadd(Vec(-1.2420140846e-1f), f, Vec(1.4249322787e-1f));
  const Vec q3 = at::vec::fmadd(Vec(-1.1514610310e-1f), f, Vec(1.1676998740e-1f));
  const Vec r0 = at::vec::fmadd(q1, f2, q0), r1 = at::vec::fmadd(q3, f2, q2);
  return at::vec::fmadd(at::vec::fmadd(Vec(7.0376836292e-2f), f4, r1), f4, r0);
}

#if defined(CPU_CAPABILITY_AVX512)
// ln x for x > 0, ~2 ulp: x = 2^e (1 + f) with 1 + f in [1/sqrt2, sqrt2), ln x = e ln 2 + ln(1 + f)
// by Cephes' logf polynomial (log_tail). Several times faster than Sleef's 1-ulp version, which
// dominated this kernel. x = 0 gives NaN (the callers' arguments are > 0).
inline __m512 log_tail(__m512 e, __m512 f) {
  const __m512 p = static_cast<__m512>(log_poly(Vec(f)));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_add_ps(_mm512_add_ps(f, y), _mm512_mul_ps(e, _mm512_set1_ps(0.693359375f)));
}
inline __m512 fast_log(__m512 x) {
  const __m512 e = _mm512_getexp_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.41421356f)));  // floor(log2(x sqrt2))
  const __m512 f = _mm512_sub_ps(_mm512_scalef_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), e)), _mm512_set1_ps(1.f));
  return log_tail(e, f);
}
// ln x, where `near` (then x = 1 + f_near in [1/sqrt2, sqrt2)) from f_near itself: no rounding of 1 + f
inline Vec vlog_near(const Vec& x, const Vec& f_near, const Vec& near) {
  const __m512 xx = static_cast<__m512>(x);
  const __mmask16 k = _mm512_movepi32_mask(_mm512_castps_si512(static_cast<__m512>(near)));
  const __m512 e = _mm512_getexp_ps(_mm512_mul_ps(xx, _mm512_set1_ps(1.41421356f)));
  const __m512 f = _mm512_sub_ps(_mm512_scalef_ps(xx, _mm512_sub_ps(_mm512_setzero_ps(), e)), _mm512_set1_ps(1.f));
  return Vec(log_tail(_mm512_mask_mov_ps(e, k, _mm512_setzero_ps()),
                      _mm512_mask_mov_ps(f, k, static_cast<__m512>(f_near))));
}
#elif defined(CPU_CAPABILITY_AVX2)
// The same ln x as the AVX-512 version for AVX2 (no getexp/scalef): the exponent and mantissa from
// the bits, m in [1, 2) halved (exponent + 1) when above sqrt2, then Cephes' logf polynomial. x = 0
// gives about -88; x > 0 subnormal likewise. Sleef's 1-ulp log and log1p (Vectorized::log, ::log1p)
// took most of this kernel's time on AVX2 machines.
inline __m256 log_tail(__m256 e, __m256 f) {
  const __m256 p = static_cast<__m256>(log_poly(Vec(f)));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_add_ps(_mm256_add_ps(f, y), _mm256_mul_ps(e, _mm256_set1_ps(0.693359375f)));
}
// x = 2^e (1 + f), 1 + f in [1/sqrt2, sqrt2)
inline void log_split(__m256 x, __m256& e, __m256& f) {
  const __m256i xi = _mm256_castps_si256(x);
  e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.f)));
  f = _mm256_sub_ps(m, _mm256_set1_ps(1.f));
}
inline __m256 fast_log(__m256 x) {
  __m256 e, f;
  log_split(x, e, f);
  return log_tail(e, f);
}
inline Vec vlog_near(const Vec& x, const Vec& f_near, const Vec& near) {
  __m256 e, f;
  log_split(static_cast<__m256>(x), e, f);
  const __m256 k = static_cast<__m256>(near);
  return Vec(log_tail(_mm256_andnot_ps(k, e), _mm256_blendv_ps(f, static_cast<__m256>(f_near), k)));
}
// 1 / t: the 12-bit estimate and one Newton step (~23 bits)
inline __m256 recip(__m256 t) {
  const __m256 r = _mm256_rcp_ps(t);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(t, r, _mm256_set1_ps(2.f)));
}
#else
inline Vec vlog_near(const Vec& x, const Vec& f_near, const Vec& near) {
  return Vec::blendv(x.log(), f_near.log1p(), near);
}
#endif
// The scalar Jensen-Shannon terms p log1p(d) + q log1p(-d), d = (p - q) / (p + q), of a row's tail:
// p ln(2p / (p + q)) + q ln(2q / (p + q)); a zero weight contributes 0 (0 log 0).
inline float js_term(float p, float q, float log_tiny) {
  const float d = (p - q) / (p + q);
  return p * std::max(std::log1p(d), log_tiny) + q * std::max(std::log1p(-d), log_tiny);
}

// ln x and 1 / t on whole vectors: the fast versions above where they exist, else ATen's
inline Vec vlog(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(fast_log(static_cast<__m512>(x)));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(fast_log(static_cast<__m256>(x)));
#else
  return x.log();
#endif
}
inline Vec vrecip(const Vec& t) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 tt = static_cast<__m512>(t);
  const __m512 r = _mm512_rcp14_ps(tt);
  return Vec(_mm512_mul_ps(r, _mm512_fnmadd_ps(tt, r, _mm512_set1_ps(2.f))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(recip(static_cast<__m256>(t)));
#else
  return Vec(1.f) / t;
#endif
}

// The Jensen-Shannon terms p log1p(d) + q log1p(-d) (js_term) for p = q x when ln x is known (from the
// variants' factors): with m = (p + q) / 2 and d = (p - q) / (p + q) = (x - 1) / (x + 1), they are
// m [ln(1 - d^2) + d ln x]. Both terms are O(d^2) for close rows and an error in ln x counts d times:
// no cancellation. ln(1 - d^2), one logarithm: of 1 + f with f = -d^2 itself while d^2 < 0.29 (no
// rounding of 1 - d^2), else of 4 x / (1 + x)^2 (accurate as d^2 -> 1); where that is under 1e-20
// (one weight under ~1e-20 of the other) the terms are (p + q) ln 2 to float precision.
inline Vec js_terms_x(const Vec& q, const Vec& x, const Vec& lnx) {
  const Vec one(1.f), r = vrecip(x + one);
  const Vec d = (x - one) * r, d2 = d * d;
  const Vec u2 = Vec(4.f) * x * r * r;
  const Vec L = vlog_near(u2, Vec(0.f) - d2, d2 < Vec(0.29f));
  const Vec t = q * (x + one);  // p + q
  const Vec terms = Vec(0.5f) * t * at::vec::fmadd(d, lnx, L);
  return Vec::blendv(terms, t * Vec(0.69314718f), u2 < Vec(1e-20f));  // one weight << the other
}

inline bool aligned(const float* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (sizeof(float) * Vec::size()) == 0;
}

constexpr float kLinearSpanMax = 60.f;  // = attnlab.hf.weights.LINEAR_SPAN_MAX

inline float reduce_min(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, x, n);
}
inline float sum_row(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x, n);
}

// out_c = sum_j x_j w_c,j for K rows w_c in one sweep over x (K accumulators)
template <int K>
inline void dots_k(const float* x, const float* const* w, int64_t n, float* out) {
  Vec acc[K];
  for (int c = 0; c < K; ++c) acc[c] = Vec(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec X = Vec::loadu(x + j);
    for (int c = 0; c < K; ++c) acc[c] = at::vec::fmadd(X, Vec::loadu(w[c] + j), acc[c]);
  }
  for (int c = 0; c < K; ++c) {
    float r = sum_of(acc[c]);
    for (int64_t t = j; t < n; ++t) r += x[t] * w[c][t];
    out[c] = r;
  }
}
// out_c = sum_j x_j w_c,j for the n_w rows w_c, four at a time
inline void dots(const float* x, const float* const* w, int64_t n_w, int64_t n, float* out) {
  for (; n_w >= 4; n_w -= 4, w += 4, out += 4) dots_k<4>(x, w, n, out);
  if (n_w == 3) dots_k<3>(x, w, n, out);
  if (n_w == 2) dots_k<2>(x, w, n, out);
  if (n_w == 1) dots_k<1>(x, w, n, out);
}
// sum_j x_j y_j with four independent accumulators (the FMA latency, not its throughput, bounds one)
inline float dot4(const float* x, const float* y, int64_t n) {
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  constexpr int64_t W = Vec::size();
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    a0 = at::vec::fmadd(Vec::loadu(x + j), Vec::loadu(y + j), a0);
    a1 = at::vec::fmadd(Vec::loadu(x + j + W), Vec::loadu(y + j + W), a1);
    a2 = at::vec::fmadd(Vec::loadu(x + j + 2 * W), Vec::loadu(y + j + 2 * W), a2);
    a3 = at::vec::fmadd(Vec::loadu(x + j + 3 * W), Vec::loadu(y + j + 3 * W), a3);
  }
  for (; j + W <= n; j += W) a0 = at::vec::fmadd(Vec::loadu(x + j), Vec::loadu(y + j), a0);
  float r = sum_of((a0 + a1) + (a2 + a3));
  for (; j < n; ++j) r += x[j] * y[j];
  return r;
}

// acc_j += a x_j
inline void axpy(float* acc, float a, const float* x, int64_t n) {
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size())
    at::vec::fmadd(va, Vec::loadu(x + j), Vec::loadu(acc + j)).store(acc + j);
  for (; j < n; ++j) acc[j] += a * x[j];
}

}  // namespace
