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

#if defined(CPU_CAPABILITY_AVX512)
// chi(t) / 2 / t^2 on 16 intervals of |t| in [0, 24), 1.5 wide, each a degree-7 polynomial in the
// position u in [0, 1) within the interval (row n: the coefficients of u^n, interval by interval),
// where chi(t) = t tanh(t / 2) - 2 ln cosh(t / 2) = (1 + d) ln(1 + d) + (1 - d) ln(1 - d), d = tanh(t / 2):
// fitted by scripts/fit_js_table.py (Chebyshev interpolation in 40-digit arithmetic, then float32);
// max relative error of chi 3.5e-7 over [0, 24), 1.4e-9 for the constant 2 ln 2 beyond.
alignas(64) constexpr float kChiTable[8][16] = {
    {1.250000000e-01f, 9.693138301e-02f, 5.580913275e-02f, 3.124237992e-02f, 1.877321489e-02f, 1.223908272e-02f, 8.542138152e-03f, 6.284176838e-03f, 4.812967498e-03f, 3.803167725e-03f, 3.080632305e-03f, 2.545990748e-03f, 2.139342250e-03f, 1.822872087e-03f, 1.571762259e-03f, 1.369179576e-03f},
    {-4.710860253e-07f, -4.471610859e-02f, -3.322080523e-02f, -1.720618270e-02f, -8.769980632e-03f, -4.785138648e-03f, -2.826816402e-03f, -1.791545539e-03f, -1.202473883e-03f, -8.449960151e-04f, -6.160959019e-04f, -4.629011964e-04f, -3.565557708e-04f, -2.804415999e-04f, -2.245374199e-04f, -1.825572690e-04f},
    {-3.514741361e-02f, -3.977493849e-03f, 9.581233375e-03f, 5.946332123e-03f, 2.828570083e-03f, 1.352761989e-03f, 6.912849494e-04f, 3.809523769e-04f, 2.248877427e-04f, 1.407183881e-04f, 9.239142673e-05f, 6.311823381e-05f, 4.456851821e-05f, 3.235844997e-05f, 2.405753912e-05f, 1.825571781e-05f},
    {-5.901800250e-05f, 1.121053286e-02f, -2.125064639e-04f, -1.373928273e-03f, -7.151309401e-04f, -3.194371238e-04f, -1.459093182e-04f, -7.108568389e-05f, -3.719258530e-05f, -2.078977377e-05f, -1.230727776e-05f, -7.648322935e-06f, -4.951561550e-06f, -3.318707968e-06f, -2.291169267e-06f, -1.622723971e-06f},
    {8.954201825e-03f, -3.575792070e-03f, -1.186220557e-03f, 1.424871734e-04f, 1.400962210e-04f, 6.443751772e-05f, 2.749539999e-05f, 1.213376527e-05f, 5.700564543e-06f, 2.864977205e-06f, 1.533682166e-06f, 8.680769952e-07f, 5.155305871e-07f, 3.190331483e-07f, 2.045431273e-07f, 1.352161974e-07f},
    {-1.315240661e-04f, -6.836670800e-04f, 6.149308174e-04f, 4.156465366e-05f, -1.867675564e-05f, -1.087794408e-05f, -4.602306035e-06f, -1.899148856e-06f, -8.167770034e-07f, -3.732900211e-07f, -1.818427506e-07f, -9.405739121e-08f, -5.133161451e-08f, -2.935994914e-08f, -1.749164724e-08f, -1.079715783e-08f},
    {-2.388326917e-03f, 8.019696688e-04f, -1.636258821e-04f, -2.362364830e-05f, 8.329717502e-07f, 1.419588102e-06f, 6.434034390e-07f, 2.576398970e-07f, 1.040994064e-07f, 4.409938725e-08f, 1.982014908e-08f, 9.461073702e-09f, 4.778614393e-09f, 2.539551014e-09f, 1.411708528e-09f, 8.163966170e-10f},
    {7.039380725e-04f, -1.816912263e-04f, 2.023811430e-05f, 4.185162197e-06f, 1.566197909e-07f, -1.097607907e-07f, -5.739215325e-08f, -2.301960400e-08f, -8.988296329e-09f, -3.624544220e-09f, -1.539846806e-09f, -6.930369056e-10f, -3.300790752e-10f, -1.656799975e-10f, -8.718496758e-11f, -4.784759394e-11f},
};
// chi(t) / 2 from the table: |t| -> interval (permutes of the coefficient rows) and position, Horner;
// 2 ln 2 / 2 where |t| >= 24
inline __m512 half_chi(__m512 t) {
  const __m512 a = _mm512_abs_ps(t), y = _mm512_mul_ps(a, _mm512_set1_ps(1.f / 1.5f));
  const __m512i i = _mm512_min_epi32(_mm512_cvttps_epi32(y), _mm512_set1_epi32(15));
  const __m512 u = _mm512_sub_ps(y, _mm512_cvtepi32_ps(i));
  __m512 g = _mm512_permutexvar_ps(i, _mm512_load_ps(kChiTable[7]));
  for (int n = 6; n >= 0; --n) g = _mm512_fmadd_ps(g, u, _mm512_permutexvar_ps(i, _mm512_load_ps(kChiTable[n])));
  const __m512 c = _mm512_mul_ps(_mm512_mul_ps(a, a), g);
  return _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(24.f), _CMP_GE_OQ), _mm512_set1_ps(0.69314718f));
}
// The Jensen-Shannon terms p log1p(d) + q log1p(-d) (js_term) for p = q x when ln x is known (from the
// variants' factors): (p + q) chi(ln x) / 2, chi even in ln x and O(ln^2 x) for close rows with the
// table's relative accuracy: no cancellation, no logarithm.
inline Vec js_terms_x(const Vec& q, const Vec& x, const Vec& lnx) {
  const __m512 qq = static_cast<__m512>(q);
  return Vec(_mm512_mul_ps(_mm512_fmadd_ps(qq, static_cast<__m512>(x), qq), half_chi(static_cast<__m512>(lnx))));
}
#else
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
#endif

inline bool aligned(const float* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (sizeof(float) * Vec::size()) == 0;
}

constexpr float kLinearSpanMax = 60.f;  // = attnlab.hf.compute.weights.LINEAR_SPAN_MAX

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
