// attnlab CPU kernel for attnlab.hf: one head of the fused analysis (attnlab/hf/fused_sums.py, variants_with_sums).
//
//   head(q, k, scale, spec_t, iters, check_span, u, pu?, pd?, ph?, ps?, s, e, alpha, beta, cols,
//        dn_rows, sk_rows, stats, js_dnas, js_hnas, js_sinkhorn, hnas, sinkhorn) -> bool
//
// hnas, sinkhorn: those variants are analysed (their factors and sums) whether or not their weights
// are asked for (ph, ps): the statistics come from this pass without writing any weights, and a
// variant's weights, written later by the same call, have the same values (attnlab/hf/lazy_weights.py).
//
// q, k (N, D): the head's queries and keys; scores s = scale q k^T. Returns false, having written
// nothing but s, when check_span and the scores span more than kLinearSpanMax nats (the caller
// computes such a head in log space). Otherwise, with E_ij = exp(s_ij - max_j s_ij) (s and e hold
// s - max and E afterwards), every variant is a diagonal scaling of E (DESIGN.md §2; Eq. numbers of
// "Attention that does not Explain Away"):
//   unas (1)      alpha_u,i E_ij                 alpha_u = 1 / (E 1)
//   dnas (5)      alpha_d,i E_ij beta_d,j        beta_d = 1 / (rho^T E), rho_i = exp(row max - head max),
//                                                alpha_d = 1 / (E beta_d)
//   sinkhorn (10) a_i E_ij b_j                   first round = dnas's; then iters - 1 rounds of
//                                                b = 1 / (a^T E), a = 1 / (E b)
//   hnas (12)     lerp(unas, dnas, u)
// and the outputs are (the layout of attnlab/hf/weights.py's _FusedBuffers, S = spec_t.size(0)):
//   alpha, beta (3, N)   (alpha_u, alpha_d, a), (1, beta_d, b)
//   cols (3, N)          (alpha_u, alpha_d, a)^T E: column masses before the column factor
//   dn_rows (N, 3 + 2S)  E @ [1, beta_d, beta_d ln beta_d, special, beta_d special]
//   sk_rows (N, 2 + S)   E @ [b, b ln b, b special] (when iters > 1)
//   the weights asked for (pu, pd, ph, ps: (N, N), streamed to memory: they are not read again here)
//   stats (N, 10)        0-2 sum_j E_ij s_ij beta_cj (c = unas, dnas, sinkhorn), 3-5 the same with
//                        |i - j| for s, 6 sum_j h ln h of the hnas weights (0 ln 0 = 0), 7-9 for
//                        p = dnas, hnas, sinkhorn and q = unas weights: sum_j p log1p(d) + q log1p(-d),
//                        d = (p - q)/(p + q), twice the Jensen-Shannon divergence in nats without
//                        the cancellation of H(m) - (H(p) + H(q))/2 (when js_<variant>)
// float32, contiguous. Single-threaded: the caller runs one head per thread.
#include "vec_capability.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStats = 10;

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

#if defined(CPU_CAPABILITY_AVX512)
// ln x for x > 0, ~2 ulp: x = 2^e m with m in [1/sqrt2, sqrt2), ln(1 + f) by Cephes' logf polynomial.
// x = 0 gives NaN (callers take max(ln x, ln tiny) with _mm512_max_ps, which returns its second
// operand for NaN). Several times faster than Sleef's 1-ulp version, which dominated this kernel.
inline __m512 fast_log(__m512 x) {
  const __m512 e = _mm512_getexp_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.41421356f)));  // floor(log2(x sqrt2))
  const __m512 f = _mm512_sub_ps(_mm512_scalef_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), e)), _mm512_set1_ps(1.f));
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(3.3333331174e-1f));
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
  __m256 p = _mm256_set1_ps(7.0376836292e-2f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.1514610310e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.1676998740e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.2420140846e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.4249322787e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.6668057665e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.0000714765e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-2.4999993993e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(3.3333331174e-1f));
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
  Vec p(7.0376836292e-2f);
  p = at::vec::fmadd(p, f, Vec(-1.1514610310e-1f));
  p = at::vec::fmadd(p, f, Vec(1.1676998740e-1f));
  p = at::vec::fmadd(p, f, Vec(-1.2420140846e-1f));
  p = at::vec::fmadd(p, f, Vec(1.4249322787e-1f));
  p = at::vec::fmadd(p, f, Vec(-1.6668057665e-1f));
  p = at::vec::fmadd(p, f, Vec(2.0000714765e-1f));
  p = at::vec::fmadd(p, f, Vec(-2.4999993993e-1f));
  p = at::vec::fmadd(p, f, Vec(3.3333331174e-1f));
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

struct Head {
  int64_t N, S;
  float *s, *e, *alpha, *beta, *cols, *dn, *sk, *stats;
  const float* spec_t;  // (S, N)
  float *pu, *pd, *ph, *ps;
  float u;
  bool js_d, js_h, js_s;
  bool want_h;  // hnas is analysed (its sums), whether or not its weights are written (ph)
};

// s -= row max; e = exp(s); r_i = sum_j e_ij -> dn[:, 0]; beta_d = 1 / sum_i rho_i e_ij
void exp_pass(Head& h, const std::vector<float>& mu, float gmax) {
  const int64_t N = h.N, W = 3 + 2 * h.S;
  float* colsum = h.beta + N;  // beta_d, accumulated then inverted
  std::fill(colsum, colsum + N, 0.f);
  for (int64_t i = 0; i < N; ++i) {
    float* sr = h.s + i * N;
    float* er = h.e + i * N;
    const Vec vmu(mu[i]);
    const float rho = std::exp(mu[i] - gmax);
    const Vec vrho(rho);
    Vec acc(0.f);
    int64_t j = 0;
    for (; j + Vec::size() <= N; j += Vec::size()) {
      const Vec S = Vec::loadu(sr + j) - vmu;
      S.store(sr + j);
      const Vec E = vexp(S);
      E.store(er + j);
      acc = acc + E;
      at::vec::fmadd(E, vrho, Vec::loadu(colsum + j)).store(colsum + j);
    }
    float r = sum_of(acc);
    for (; j < N; ++j) {
      sr[j] -= mu[i];
      er[j] = std::exp(sr[j]);
      r += er[j];
      colsum[j] += rho * er[j];
    }
    h.dn[i * W] = r;
  }
  for (int64_t j = 0; j < N; ++j) colsum[j] = 1.f / colsum[j];
}

// dn_rows[:, 1:] and alpha_u, alpha_d; cols[0:2] = (alpha_u, alpha_d)^T E
void dnas_pass(Head& h) {
  const int64_t N = h.N, S = h.S, W = 3 + 2 * S;
  const float* bd = h.beta + N;
  std::vector<float> blnb(N), bspec(S * N);
  for (int64_t j = 0; j < N; ++j) blnb[j] = bd[j] * std::log(bd[j]);
  for (int64_t c = 0; c < S; ++c)
    for (int64_t j = 0; j < N; ++j) bspec[c * N + j] = bd[j] * h.spec_t[c * N + j];
  float *cu = h.cols, *cd = h.cols + N;
  std::fill(cu, cu + 2 * N, 0.f);
  for (int64_t i = 0; i < N; ++i) {
    const float* er = h.e + i * N;
    float* d = h.dn + i * W;
    d[1] = dot(er, bd, N);
    d[2] = dot(er, blnb.data(), N);
    for (int64_t c = 0; c < S; ++c) {
      d[3 + c] = dot(er, h.spec_t + c * N, N);
      d[3 + S + c] = dot(er, bspec.data() + c * N, N);
    }
    const float au = 1.f / d[0], ad = 1.f / d[1];
    h.alpha[i] = au;
    h.alpha[N + i] = ad;
    axpy(cu, au, er, N);
    axpy(cd, ad, er, N);
  }
}

// iters - 2 Sinkhorn rounds after dnas's and the next column step: b -> beta[2]
void sinkhorn_rounds(Head& h, int64_t iters) {
  const int64_t N = h.N;
  float* b = h.beta + 2 * N;
  for (int64_t j = 0; j < N; ++j) b[j] = 1.f / h.cols[N + j];  // column step after dnas's round
  std::vector<float> acc(N);
  for (int64_t it = 0; it < iters - 2; ++it) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t i = 0; i < N; ++i) {  // row step a_i, then the next column step's sums
      const float* er = h.e + i * N;
      axpy(acc.data(), 1.f / dot(er, b, N), er, N);
    }
    for (int64_t j = 0; j < N; ++j) b[j] = 1.f / acc[j];
  }
}

// The row pass: Sinkhorn's last row step (sk_rows, a, cols[2]) when sinkhorn_final, the weights and
// the stats, one row at a time.
void row_pass(Head& h, bool sinkhorn_final) {
  const int64_t N = h.N, S = h.S, W2 = 2 + S;
  const float* bd = h.beta + N;
  const float* bs = h.beta + 2 * N;
  const float log_tiny = std::log(std::numeric_limits<float>::min());
  std::vector<float> blnb, bspec, idx(N), lbd(N), lbs(N);
  for (int64_t j = 0; j < N; ++j) idx[j] = float(j);
  for (int64_t j = 0; j < N; ++j) {  // ln x of the JS terms: ln(alpha_v / alpha_u) + ln beta_v,j
    lbd[j] = std::log(bd[j]);
    lbs[j] = std::log(bs[j]);
  }
  if (sinkhorn_final) {
    blnb.resize(N);
    bspec.resize(S * N);
    for (int64_t j = 0; j < N; ++j) blnb[j] = bs[j] * std::log(bs[j]);
    for (int64_t c = 0; c < S; ++c)
      for (int64_t j = 0; j < N; ++j) bspec[c * N + j] = bs[j] * h.spec_t[c * N + j];
    std::fill(h.cols + 2 * N, h.cols + 3 * N, 0.f);
  }
  // every row of a (N, N) output starts 64-byte aligned when the first does and N is a multiple of
  // the vector width: then the full vectors of every row can be streamed
  const bool whole = N % Vec::size() == 0;
  const bool st_u = h.pu && whole && aligned(h.pu), st_d = h.pd && whole && aligned(h.pd);
  const bool st_h = h.ph && whole && aligned(h.ph), st_s = h.ps && whole && aligned(h.ps);
  const Vec vu(h.u), vtiny(log_tiny);
  for (int64_t i = 0; i < N; ++i) {
    const float* er = h.e + i * N;
    const float* sr = h.s + i * N;
    if (sinkhorn_final) {  // the last row step normalizes the rows
      float* k = h.sk + i * W2;
      k[0] = dot(er, bs, N);
      k[1] = dot(er, blnb.data(), N);
      for (int64_t c = 0; c < S; ++c) k[2 + c] = dot(er, bspec.data() + c * N, N);
      h.alpha[2 * N + i] = 1.f / k[0];
      axpy(h.cols + 2 * N, 1.f / k[0], er, N);
    }
    const float au = h.alpha[i], ad = h.alpha[N + i], as = h.alpha[2 * N + i];
    const Vec vau(au), vad(ad), vas(as), vi(static_cast<float>(i));
    const Vec lr_d(std::log(ad / au)), lr_s(std::log(as / au)), ln_au(std::log(au));
    Vec a_es_u(0.f), a_es_d(0.f), a_es_s(0.f), a_ed_u(0.f), a_ed_d(0.f), a_ed_s(0.f), a_h(0.f);
    Vec a_jd(0.f), a_jh(0.f), a_js(0.f);
    const int64_t n_vec = N - N % Vec::size();
    int64_t j = 0;
    for (; j < n_vec; j += Vec::size()) {
      const Vec E = Vec::loadu(er + j), Sv = Vec::loadu(sr + j);
      const Vec Bd = Vec::loadu(bd + j), Bs = Vec::loadu(bs + j);
      const Vec D = (Vec::loadu(idx.data() + j) - vi).abs();
      const Vec ES = E * Sv, ED = E * D;
      a_es_u = a_es_u + ES;
      a_es_d = at::vec::fmadd(ES, Bd, a_es_d);
      a_es_s = at::vec::fmadd(ES, Bs, a_es_s);
      a_ed_u = a_ed_u + ED;
      a_ed_d = at::vec::fmadd(ED, Bd, a_ed_d);
      a_ed_s = at::vec::fmadd(ED, Bs, a_ed_s);
      const Vec PU = E * vau, PD = E * Bd * vad, PS = E * Bs * vas;
      const Vec PH = at::vec::fmadd(PD - PU, vu, PU);
      if (h.pu) store(h.pu + i * N + j, PU, st_u);
      if (h.pd) store(h.pd + i * N + j, PD, st_d);
      if (h.ps) store(h.ps + i * N + j, PS, st_s);
      if (h.want_h) {  // ln h = ln pu + ln(h / pu), ln pu = ln alpha_u + s (E = exp(s)): one logarithm
        if (h.ph) store(h.ph + i * N + j, PH, st_h);
        const Vec lnx_h = vlog(PH * vrecip(PU));
        a_h = at::vec::fmadd(PH, at::vec::maximum(Sv + ln_au + lnx_h, vtiny), a_h);  // 0 ln 0 = 0
        if (h.js_h) a_jh = a_jh + js_terms_lnx(PH, PU, lnx_h);
      }
      if (h.js_s) a_js = a_js + js_terms_lnx(PS, PU, lr_s + Vec::loadu(lbs.data() + j));
      if (h.js_d) a_jd = a_jd + js_terms_lnx(PD, PU, lr_d + Vec::loadu(lbd.data() + j));
    }
    float r[kStats] = {sum_of(a_es_u), sum_of(a_es_d), sum_of(a_es_s), sum_of(a_ed_u), sum_of(a_ed_d),
                       sum_of(a_ed_s), sum_of(a_h), sum_of(a_jd), sum_of(a_jh), sum_of(a_js)};
    for (; j < N; ++j) {  // the tail of the row, scalar
      const float E = er[j], Sv = sr[j], D = std::fabs(float(j) - float(i));
      const float ES = E * Sv, ED = E * D;
      r[0] += ES, r[1] += ES * bd[j], r[2] += ES * bs[j];
      r[3] += ED, r[4] += ED * bd[j], r[5] += ED * bs[j];
      const float PU = E * au, PD = E * bd[j] * ad, PS = E * bs[j] * as;
      const float PH = (PD - PU) * h.u + PU;
      if (h.pu) h.pu[i * N + j] = PU;
      if (h.pd) h.pd[i * N + j] = PD;
      if (h.ps) h.ps[i * N + j] = PS;
      if (h.want_h) {
        if (h.ph) h.ph[i * N + j] = PH;
        r[6] += PH * std::max(std::log(PH), log_tiny);
      }
      if (h.js_d) r[7] += js_term(PD, PU, log_tiny);
      if (h.js_h) r[8] += js_term(PH, PU, log_tiny);
      if (h.js_s) r[9] += js_term(PS, PU, log_tiny);
    }
    float* out = h.stats + i * kStats;
    for (int64_t c = 0; c < kStats; ++c) out[c] = r[c];
  }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();  // the streamed weights are visible before the caller reads them
#endif
}

void check(const at::Tensor& t, std::initializer_list<int64_t> shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes().equals(shape), "head: ", name,
              " must be a contiguous float32 tensor of shape ", at::IntArrayRef(shape), ", got ", t.sizes());
}

float* out_ptr(const c10::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check(*t, {N, N}, name);
  return t->data_ptr<float>();
}

bool head(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& spec_t, int64_t iters,
          bool check_span, double u, const c10::optional<at::Tensor>& pu, const c10::optional<at::Tensor>& pd,
          const c10::optional<at::Tensor>& ph, const c10::optional<at::Tensor>& ps, const at::Tensor& s,
          const at::Tensor& e, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& cols,
          const at::Tensor& dn_rows, const at::Tensor& sk_rows, const at::Tensor& stats, bool js_dnas,
          bool js_hnas, bool js_sinkhorn, bool hnas, bool sinkhorn) {
  const int64_t N = q.size(0), S = spec_t.size(0);
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && k.size(0) == N && k.size(1) == q.size(1) &&
                  q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat,
              "head: q and k must be float32 (N, D)");
  check(spec_t, {S, N}, "spec_t");
  check(s, {N, N}, "s");
  check(e, {N, N}, "e");
  check(alpha, {3, N}, "alpha");
  check(beta, {3, N}, "beta");
  check(cols, {3, N}, "cols");
  check(dn_rows, {N, 3 + 2 * S}, "dn_rows");
  check(sk_rows, {N, 2 + S}, "sk_rows");
  check(stats, {N, kStats}, "stats");
  Head h{N, S, s.data_ptr<float>(), e.data_ptr<float>(), alpha.data_ptr<float>(), beta.data_ptr<float>(),
         cols.data_ptr<float>(), dn_rows.data_ptr<float>(), sk_rows.data_ptr<float>(), stats.data_ptr<float>(),
         spec_t.data_ptr<float>(), out_ptr(pu, N, "pu"), out_ptr(pd, N, "pd"), out_ptr(ph, N, "ph"),
         out_ptr(ps, N, "ps"), float(u), js_dnas, js_hnas, js_sinkhorn, hnas || (ph.has_value() && ph->defined())};
  TORCH_CHECK(!js_hnas || h.want_h, "head: js_hnas needs hnas");
  at::Tensor s_ = s;
  at::addmm_out(s_, s, q, k.t(), /*beta=*/0, /*alpha=*/scale);  // scores (BLAS)
  std::vector<float> mu(N);
  for (int64_t i = 0; i < N; ++i) mu[i] = reduce_max(h.s + i * N, N);
  const float gmax = *std::max_element(mu.begin(), mu.end());
  if (check_span && gmax - reduce_min(h.s, N * N) > kLinearSpanMax) return false;
  exp_pass(h, mu, gmax);
  dnas_pass(h);
  std::fill(h.beta, h.beta + N, 1.f);
  const bool rounds = (sinkhorn || (ps.has_value() && ps->defined())) && iters > 1;
  if (rounds) {
    sinkhorn_rounds(h, iters);
  } else {  // sinkhorn with one round is dnas
    std::copy(h.alpha + N, h.alpha + 2 * N, h.alpha + 2 * N);
    std::copy(h.beta + N, h.beta + 2 * N, h.beta + 2 * N);
    std::copy(h.cols + N, h.cols + 2 * N, h.cols + 2 * N);
  }
  row_pass(h, rounds);
  return true;
}

}  // namespace

TORCH_LIBRARY(attnlab_hf, m) {
  m.def("head(Tensor q, Tensor k, float scale, Tensor spec_t, int iters, bool check_span, float u, "
        "Tensor(a!)? pu, Tensor(b!)? pd, Tensor(c!)? ph, Tensor(d!)? ps, Tensor(e!) s, Tensor(f!) e, "
        "Tensor(g!) alpha, Tensor(h!) beta, Tensor(i!) cols, Tensor(j!) dn_rows, Tensor(k!) sk_rows, "
        "Tensor(l!) stats, bool js_dnas, bool js_hnas, bool js_sinkhorn, bool hnas, bool sinkhorn) -> bool");
}

TORCH_LIBRARY_IMPL(attnlab_hf, CPU, m) { m.impl("head", &head); }
