// Vector helpers of attnlab's analysis kernel (analysis_cpu.cpp): streaming stores, fast logarithms
// and exponentials at the compiled width (AVX512 / AVX2 / ATen's default), the Jensen-Shannon terms,
// and small reductions. Included by analysis_cpu.cpp only (everything sits in an unnamed namespace).
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
// the one copy fast_log (both widths) and vlog1p_small evaluate (fmadd = the ISA's fused multiply-add)
inline Vec log_poly(const Vec& f) {
  Vec p(7.0376836292e-2f);
  p = at::vec::fmadd(p, f, Vec(-1.1514610310e-1f));
  p = at::vec::fmadd(p, f, Vec(1.1676998740e-1f));
  p = at::vec::fmadd(p, f, Vec(-1.2420140846e-1f));
  p = at::vec::fmadd(p, f, Vec(1.4249322787e-1f));
  p = at::vec::fmadd(p, f, Vec(-1.6668057665e-1f));
  p = at::vec::fmadd(p, f, Vec(2.0000714765e-1f));
  p = at::vec::fmadd(p, f, Vec(-2.4999993993e-1f));
  p = at::vec::fmadd(p, f, Vec(3.3333331174e-1f));
  return p;
}

#if defined(CPU_CAPABILITY_AVX512)
// ln x for x > 0, ~2 ulp: x = 2^e m with m in [1/sqrt2, sqrt2), ln(1 + f) by Cephes' logf polynomial.
// x = 0 gives NaN (callers take max(ln x, ln tiny) with _mm512_max_ps, which returns its second
// operand for NaN). Several times faster than Sleef's 1-ulp version, which dominated this kernel.
inline __m512 fast_log(__m512 x) {
  const __m512 e = _mm512_getexp_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.41421356f)));  // floor(log2(x sqrt2))
  const __m512 f = _mm512_sub_ps(_mm512_scalef_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), e)), _mm512_set1_ps(1.f));
  const __m512 p = static_cast<__m512>(log_poly(Vec(f)));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_add_ps(_mm512_add_ps(f, y), _mm512_mul_ps(e, _mm512_set1_ps(0.693359375f)));
}
// max(ln x, floor): 0 ln 0 terms become 0 * floor = 0
inline Vec vlog_floor(const Vec& x, const Vec& floor) {
  return Vec(_mm512_max_ps(fast_log(static_cast<__m512>(x)), static_cast<__m512>(floor)));
}
// max(ln(1 + d), floor) for d >= -1: ln u (u = 1 + d rounded) plus the rounding's first-order
// correction (d - (u - 1)) / u, so that small d keep their relative accuracy.
inline Vec vlog1p_floor(__m512 d, const Vec& floor) {
  const __m512 u = _mm512_add_ps(d, _mm512_set1_ps(1.f));
  const __m512 c = _mm512_mul_ps(_mm512_sub_ps(d, _mm512_sub_ps(u, _mm512_set1_ps(1.f))), _mm512_rcp14_ps(u));
  return Vec(_mm512_max_ps(_mm512_add_ps(fast_log(u), c), static_cast<__m512>(floor)));
}
// p log1p(d) + q log1p(-d), d = (p - q) / (p + q): p ln(2p / (p + q)) + q ln(2q / (p + q)) with
// no cancellation when p ~ q; a zero weight contributes 0 (0 log 0). p + q > 0 (q: unas weights).
inline Vec js_terms(const Vec& p, const Vec& q, const Vec& floor) {
  const __m512 t = static_cast<__m512>(p + q);
  __m512 r = _mm512_rcp14_ps(t);  // 1 / t: one Newton step from 14 bits to ~23
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(t, r, _mm512_set1_ps(2.f)));
  const __m512 d = _mm512_mul_ps(static_cast<__m512>(p - q), r);
  const __m512 nd = _mm512_sub_ps(_mm512_setzero_ps(), d);
  return at::vec::fmadd(p, vlog1p_floor(d, floor), q * vlog1p_floor(nd, floor));
}
#elif defined(CPU_CAPABILITY_AVX2)
// The same ln x as the AVX-512 version for AVX2 (no getexp/scalef): the exponent and mantissa from
// the bits, m in [1, 2) halved (exponent + 1) when above sqrt2, then Cephes' logf polynomial. x = 0
// gives about -88 (a caller's floor ln(tiny) = -87.3 takes over); x > 0 subnormal likewise. Sleef's
// 1-ulp log and log1p (Vectorized::log, ::log1p) took most of this kernel's time on AVX2 machines.
inline __m256 fast_log(__m256 x) {
  const __m256i xi = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.f)));
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.f));
  const __m256 p = static_cast<__m256>(log_poly(Vec(f)));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_add_ps(_mm256_add_ps(f, y), _mm256_mul_ps(e, _mm256_set1_ps(0.693359375f)));
}
// 1 / t: the 12-bit estimate and one Newton step (~23 bits)
inline __m256 recip(__m256 t) {
  const __m256 r = _mm256_rcp_ps(t);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(t, r, _mm256_set1_ps(2.f)));
}
inline Vec vlog_floor(const Vec& x, const Vec& floor) {
  return Vec(_mm256_max_ps(fast_log(static_cast<__m256>(x)), static_cast<__m256>(floor)));
}
inline Vec vlog1p_floor(__m256 d, const Vec& floor) {
  const __m256 u = _mm256_add_ps(d, _mm256_set1_ps(1.f));
  const __m256 c = _mm256_mul_ps(_mm256_sub_ps(d, _mm256_sub_ps(u, _mm256_set1_ps(1.f))), recip(u));
  return Vec(_mm256_max_ps(_mm256_add_ps(fast_log(u), c), static_cast<__m256>(floor)));
}
inline Vec js_terms(const Vec& p, const Vec& q, const Vec& floor) {
  const __m256 d = _mm256_mul_ps(static_cast<__m256>(p - q), recip(static_cast<__m256>(p + q)));
  const __m256 nd = _mm256_sub_ps(_mm256_setzero_ps(), d);
  return at::vec::fmadd(p, vlog1p_floor(d, floor), q * vlog1p_floor(nd, floor));
}
#else
inline Vec vlog_floor(const Vec& x, const Vec& floor) { return at::vec::maximum(x.log(), floor); }
inline Vec js_terms(const Vec& p, const Vec& q, const Vec& floor) {
  const Vec d = (p - q) / (p + q);
  return at::vec::fmadd(p, at::vec::maximum(d.log1p(), floor), q * at::vec::maximum(d.neg().log1p(), floor));
}
#endif
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

// ln(1 + f) for f in [1/sqrt2 - 1, sqrt2 - 1] by the polynomial of fast_log with no exponent, from f
// itself (not from 1 + f rounded: with -fassociative-math no rounding correction survives).
inline Vec vlog1p_small(const Vec& f) {
  const Vec p = log_poly(f);
  const Vec z = f * f;
  return f + at::vec::fmadd(Vec(-0.5f), z, p * f * z);
}

// js_terms(p, q) when ln x, x = p / q, is known (from the variants' factors: no logarithm per entry):
// with m = (p + q) / 2 and d = (p - q) / (p + q), p log1p(d) + q log1p(-d) = m [ln(1 - d^2) + d ln x].
// Both terms are O(d^2) for close rows and an error in ln x counts d times: no cancellation.
// ln(1 - d^2): the polynomial of -d^2 while d^2 < 0.29, else the logarithm of 4 p q / (p + q)^2
// (accurate where 1 - d^2 is small); where even that underflows (one weight under ~1e-20 of the
// other) the terms are (p + q) ln 2 to float precision.
inline Vec js_terms_lnx(const Vec& p, const Vec& q, const Vec& lnx) {
  const Vec t = p + q, r = vrecip(t);
  const Vec d = (p - q) * r, d2 = d * d;
  const Vec u2 = Vec(4.f) * p * q * r * r;
  const Vec near = d2 < Vec(0.29f);
  const Vec L = Vec::blendv(vlog(u2), vlog1p_small(Vec(0.f) - d2), near);
  const Vec terms = Vec(0.5f) * t * at::vec::fmadd(d, lnx, L);
  const Vec apart = (u2 < Vec(1e-20f)) & (d2 >= Vec(0.29f));
  return Vec::blendv(terms, t * Vec(0.69314718f), apart);
}

inline bool aligned(const float* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (sizeof(float) * Vec::size()) == 0;
}

constexpr float kLinearSpanMax = 60.f;  // = attnlab.hf.weights.LINEAR_SPAN_MAX

#if defined(CPU_CAPABILITY_AVX512)
// exp x for x <= 0 (Cephes' expf polynomial, ~1 ulp; below -87 it flushes toward 0).
inline Vec vexp(const Vec& xv) {
  const __m512 x = static_cast<__m512>(xv);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return Vec(_mm512_scalef_ps(y, n));
}
#else
inline Vec vexp(const Vec& x) { return x.exp(); }
#endif

inline float reduce_max(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}
inline float reduce_min(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, x, n);
}

// sum_j x_j y_j
inline float dot(const float* x, const float* y, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(x + j), Vec::loadu(y + j), acc);
  float r = sum_of(acc);
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
