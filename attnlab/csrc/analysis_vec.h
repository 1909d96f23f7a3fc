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
// ln(2^e (1 + f)) for 1 + f in [1/sqrt2, sqrt2), ~2 ulp: e ln 2 + ln(1 + f) by Cephes' logf polynomial,
// for vlog_near (which hands it f itself near 1); fast_log below takes a table instead.
inline __m512 log_tail(__m512 e, __m512 f) {
  const __m512 p = static_cast<__m512>(log_poly(Vec(f)));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_add_ps(_mm512_add_ps(f, y), _mm512_mul_ps(e, _mm512_set1_ps(0.693359375f)));
}
// ln x for x > 0 by a table (glibc's logf scheme): x = 2^E m, m in [1, 2) (getexp / getmant), k = m's top
// 4 mantissa bits (the permute index), c_k = 1 + (k + 1/2) / 16, r = m fl(1 / c_k) - 1 (one rounding:
// |r| < 1/32 + 1e-7), ln x = E ln 2 + T_k + log1p(r) with T_k = -ln fl(1 / c_k) (so the rounding of 1 / c_k
// cancels) and log1p(r) = r (1 - r/2 + r^2/3 - r^3/4 + r^4/5) (truncation < 2e-10). Absolute error about
// 3e-9 plus the result's rounding; about half the operations of Cephes' polynomial (log_tail), which
// stays for vlog_near. x = 0 gives -inf.
alignas(64) constexpr float kLogInvC[16] = {
    9.696969986e-01f, 9.142857194e-01f, 8.648648858e-01f, 8.205128312e-01f, 7.804877758e-01f, 7.441860437e-01f,
    7.111111283e-01f, 6.808510423e-01f, 6.530612111e-01f, 6.274510026e-01f, 6.037735939e-01f, 5.818181634e-01f,
    5.614035130e-01f, 5.423728824e-01f, 5.245901346e-01f, 5.079365373e-01f};
alignas(64) constexpr float kLogT[16] = {
    3.077162802e-02f, 8.961215615e-02f, 1.451819837e-01f, 1.978257298e-01f, 2.478362024e-01f, 2.954642177e-01f,
    3.409265578e-01f, 3.844117224e-01f, 4.260844290e-01f, 4.660896957e-01f, 5.045560002e-01f, 5.415973067e-01f,
    5.773153305e-01f, 6.118015647e-01f, 6.451380253e-01f, 6.773987412e-01f};
inline __m512 fast_log(__m512 x) {
  const __m512 E = _mm512_getexp_ps(x);
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
  const __m512i k = _mm512_srli_epi32(_mm512_castps_si512(m), 19);  // (the permutes read its low 4 bits)
  const __m512 r = _mm512_fmsub_ps(m, _mm512_permutexvar_ps(k, _mm512_load_ps(kLogInvC)), _mm512_set1_ps(1.f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 a = _mm512_fmadd_ps(r, _mm512_set1_ps(-0.5f), _mm512_set1_ps(1.f));
  const __m512 b = _mm512_fmadd_ps(r, _mm512_set1_ps(-0.25f), _mm512_set1_ps(1.f / 3.f));
  const __m512 q = _mm512_fmadd_ps(r2, _mm512_fmadd_ps(r2, _mm512_set1_ps(0.2f), b), a);
  const __m512 y = _mm512_fmadd_ps(r, q, _mm512_permutexvar_ps(k, _mm512_load_ps(kLogT)));
  return _mm512_fmadd_ps(E, _mm512_set1_ps(0.693359375f), _mm512_fmadd_ps(E, _mm512_set1_ps(-2.12194440e-4f), y));
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
// chi(t) / 2 / t^2 on 32 intervals of |t| in [0, 24), 0.75 wide, each a degree-5 polynomial in the
// position u in [0, 1) within the interval (row n: the coefficients of u^n, interval by interval; the
// permutes read a row as two registers of 16), where
// chi(t) = t tanh(t / 2) - 2 ln cosh(t / 2) = (1 + d) ln(1 + d) + (1 - d) ln(1 - d), d = tanh(t / 2):
// fitted by scripts/fit_js_table.py (Chebyshev interpolation in 40-digit arithmetic, then float32);
// max relative error of chi 2.9e-7 over [0, 24), and beyond, where half_chi reads it at 23.99 (chi(t) =
// 2 ln 2 - O(t e^-t) there: 2 ln 2 to 2e-9). (16 intervals of
// degree 7, 3.5e-7, took two more lookups and two more products a term.)
alignas(64) constexpr float kChiTable[6][32] = {
    {1.250000149e-01f, 1.167292371e-01f, 9.693138301e-02f, 7.474653423e-02f, 5.580913648e-02f, 4.151015729e-02f, 3.124237992e-02f, 2.396399900e-02f, 1.877321489e-02f, 1.501416322e-02f, 1.223908272e-02f, 1.014848333e-02f, 8.542138152e-03f, 7.284897380e-03f, 6.284176838e-03f, 5.475459620e-03f, 4.812967498e-03f, 4.263635725e-03f, 3.803167725e-03f, 3.413418541e-03f, 3.080632305e-03f, 2.794234315e-03f, 2.545990748e-03f, 2.329415176e-03f, 2.139342250e-03f, 1.971618272e-03f, 1.822872087e-03f, 1.690345118e-03f, 1.571762259e-03f, 1.465233858e-03f, 1.369179576e-03f, 1.282270183e-03f},
    {-7.817130836e-07f, -1.556295529e-02f, -2.235782705e-02f, -2.107840776e-02f, -1.661047339e-02f, -1.211421471e-02f, -8.603098802e-03f, -6.105019245e-03f, -4.384989850e-03f, -3.206686117e-03f, -2.392568626e-03f, -1.821439946e-03f, -1.413407852e-03f, -1.116269501e-03f, -8.957726532e-04f, -7.291940856e-04f, -6.012368831e-04f, -5.014334456e-04f, -4.224980075e-04f, -3.592731082e-04f, -3.080479219e-04f, -2.661106701e-04f, -2.314505982e-04f, -2.025564318e-04f, -1.782778854e-04f, -1.577291696e-04f, -1.402207999e-04f, -1.252106886e-04f, -1.122687027e-04f, -1.010505948e-04f, -9.127863450e-05f, -8.272710693e-05f},
    {-8.779671043e-03f, -5.942482501e-03f, -9.972817497e-04f, 1.813462586e-03f, 2.396157477e-03f, 2.028326737e-03f, 1.486683381e-03f, 1.032956410e-03f, 7.071346627e-04f, 4.858793691e-04f, 3.381824936e-04f, 2.394753974e-04f, 1.728177303e-04f, 1.271168585e-04f, 9.523668996e-05f, 7.259332051e-05f, 5.622136450e-05f, 4.417972377e-05f, 3.517935329e-05f, 2.835071791e-05f, 2.309774572e-05f, 1.900524694e-05f, 1.577950388e-05f, 1.320963838e-05f, 1.114210227e-05f, 9.463622519e-06f, 8.089597941e-06f, 6.956116067e-06f, 6.014376595e-06f, 5.226744179e-06f, 4.563924904e-06f, 4.002919923e-06f},
    {-4.171516412e-05f, 1.661470393e-03f, 1.414855826e-03f, 4.933820455e-04f, -3.024346734e-05f, -1.783207699e-04f, -1.721946173e-04f, -1.294767717e-04f, -8.935958613e-05f, -5.985925964e-05f, -3.989516699e-05f, -2.678188139e-05f, -1.822345257e-05f, -1.260766203e-05f, -8.879625966e-06f, -6.367529295e-06f, -4.646601610e-06f, -3.447442168e-06f, -2.597666480e-06f, -1.985613835e-06f, -1.537931439e-06f, -1.205704052e-06f, -9.558101510e-07f, -7.654800811e-07f, -6.188280963e-07f, -5.046137517e-07f, -4.147758261e-07f, -3.434594475e-07f, -2.863611144e-07f, -2.402821906e-07f, -2.028201180e-07f, -1.721525535e-07f},
    {6.346264272e-04f, 1.257786935e-04f, -2.521589922e-04f, -1.901604701e-04f, -6.686616689e-05f, -7.306507086e-06f, 9.838335245e-06f, 1.123273705e-05f, 8.698310012e-06f, 5.995490028e-06f, 3.959884452e-06f, 2.582982006e-06f, 1.688527163e-06f, 1.114785050e-06f, 7.463831366e-07f, 5.078343861e-07f, 3.514236084e-07f, 2.473458096e-07f, 1.769881806e-07f, 1.286538520e-07f, 9.491696318e-08f, 7.100400268e-08f, 5.380391954e-08f, 4.125972808e-08f, 3.199147613e-08f, 2.505998786e-08f, 1.981707243e-08f, 1.580932540e-08f, 1.271549710e-08f, 1.030518604e-08f, 8.411245034e-09f, 6.911093919e-09f},
    {-8.321730274e-05f, -7.966830890e-05f, 7.560936865e-06f, 2.432469410e-05f, 1.244837313e-05f, 3.738432497e-06f, 3.909137547e-07f, -4.765473420e-07f, -5.363223181e-07f, -4.093629116e-07f, -2.783026218e-07f, -1.811580717e-07f, -1.162792955e-07f, -7.466017138e-08f, -4.832395106e-08f, -3.166528018e-08f, -2.105539565e-08f, -1.422294549e-08f, -9.763572173e-09f, -6.809963260e-09f, -4.823672572e-09f, -3.467377274e-09f, -2.527325682e-09f, -1.866321542e-09f, -1.395102811e-09f, -1.054781817e-09f, -8.059682921e-10f, -6.219535997e-10f, -4.843874746e-10f, -3.805022408e-10f, -3.013063687e-10f, -2.403945931e-10f},
};
// chi(t) / 2 from the table: |t| -> interval (two-register permutes of the coefficient rows) and
// position, Horner. |t| is capped at 23.99, in the last interval (a NaN stays NaN): no compare and blend
// for the constant beyond
inline __m512 half_chi(__m512 t) {
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(23.99f), _mm512_abs_ps(t));
  const __m512 y = _mm512_mul_ps(a, _mm512_set1_ps(1.f / 0.75f));
  const __m512i i = _mm512_cvttps_epi32(y);
  const __m512 u = _mm512_sub_ps(y, _mm512_cvtepi32_ps(i));
  auto row = [&](int n) {
    return _mm512_permutex2var_ps(_mm512_load_ps(kChiTable[n]), i, _mm512_load_ps(kChiTable[n] + 16));
  };
  __m512 g = row(5);
  for (int n = 4; n >= 0; --n) g = _mm512_fmadd_ps(g, u, row(n));
  return _mm512_mul_ps(_mm512_mul_ps(a, a), g);
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
