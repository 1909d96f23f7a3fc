// The log-space path of attnlab's analysis kernel (analysis_cpu.cpp): a head whose scores span more
// than kLinearSpanMax nats, where exp(s - max) of some entries is not a normal float and the linear
// passes' diagonal scalings of E would lose them. The math of attnlab/hf/compute/layers.py's _layer_log
// (Eq. numbers of "Attention that does not Explain Away"), with t_ij = s_ij + mu_i the scores
// (score_pass leaves s_ij = t_ij - mu_i, e = exp(s) and dn[:, 0] = sum_j e_ij):
//   unas (1)      ln p_ij = s_ij - ln sum_j e_ij
//   dnas (5)      c_j = logsumexp_i t_ij, ln p_ij = t_ij - c_j - logsumexp_j (t_ij - c_j)
//   sinkhorn (10) from dnas's c, iters - 1 rounds of r_i = logsumexp_j (t_ij - c_j),
//                 c_j = logsumexp_i (t_ij - r_i); then rows as dnas's with the last c
//   hnas (12)     lerp(unas, dnas, u)
// Every statistic is summed from the weights themselves (attnlab.stats.engine.row_sums_dict), into
// the linear path's layout with every factor 1, so that attnlab/hf/compute/fused_sums.py's _assemble_sums
// reads them unchanged: alpha = beta = 1, cols[c] the column masses, dn[:, 0], dn[:, 1], sk[:, 0] the
// row sums, dn[:, 2] = sk[:, 1] = 0, the special masses in dn[:, 3:3+S], dn[:, 3+S:], sk[:, 2:], and
// stats 0-2 sum_j p ln p, 3-5 sum_j p |i - j|, 6 sum_j h ln h, 7-9 twice the Jensen-Shannon divergences.
#pragma once
#include "analysis_head.h"
#include "analysis_sparsemax.h"
#include "kernel_common.h"

#include <vector>

namespace {

// c_j = logsumexp_i (s_ij + a_i) over the N rows of s (N x N), two passes: the column maxima, then the
// sums (tmp: N floats of scratch).
inline void col_lse(const float* s, const float* a, int64_t N, float* c, float* tmp) {
  std::fill(c, c + N, -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < N; ++j) c[j] = std::max(c[j], s[i * N + j] + a[i]);
  std::fill(tmp, tmp + N, 0.f);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < N; ++j) tmp[j] += exp_nonpos(s[i * N + j] + a[i] - c[j]);
  for (int64_t j = 0; j < N; ++j) c[j] += std::log(tmp[j]);
}

// logsumexp_j (x_j - c_j) of one row
inline float row_lse(const float* x, const float* c, int64_t N) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < N; ++j) m = std::max(m, x[j] - c[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < N; ++j) sum += exp_nonpos(x[j] - c[j] - m);
  return m + std::log(sum);
}

// The Jensen-Shannon terms p log1p(d) + q log1p(-d), d = (p - q) / (p + q), for weights that may be 0
// or subnormal (js_term's, vectorized): log1p(+-d) as ln(2p / (p + q)) and ln(2q / (p + q)), from
// f = +-d itself while |d| < 0.29 (no cancellation for close rows); a weight of 0 contributes 0, and
// so do both where p + q is below the smallest normal float.
inline Vec js_terms_pq(const Vec& p, const Vec& q) {
  const Vec t = p + q, r = vrecip(t), zero(0.f);
  const Vec d = (p - q) * r, near = d.abs() < Vec(0.29f);
  const Vec la = vlog_near(Vec(2.f) * p * r, d, near), lb = vlog_near(Vec(2.f) * q * r, zero - d, near);
  const Vec terms = Vec::blendv(p * la, zero, p == zero) + Vec::blendv(q * lb, zero, q == zero);
  return Vec::blendv(terms, zero, t < Vec(std::numeric_limits<float>::min()));
}

// x ln x, 0 for x = 0
inline Vec xlogx(const Vec& x) { return Vec::blendv(x * vlog(x), Vec(0.f), x == Vec(0.f)); }

// The sums of one row from its weights (N each; lu, ld, ls their logarithms): entropies' x ln x,
// distances, hnas's h ln h and the Jensen-Shannon terms asked for, into r (kStats).
inline void wide_row_stats(const Head& h, int64_t i, const float* pu, const float* pd, const float* ps,
                           const float* lu, const float* ld, const float* ls, const float* idx, float* r) {
  const int64_t N = h.N, n_vec = N - N % Vec::size();
  const Vec vi(static_cast<float>(i)), vu(h.u);
  Vec acc[kStats];
  for (int64_t c = 0; c < kStats; ++c) acc[c] = Vec(0.f);
  for (int64_t j = 0; j < n_vec; j += Vec::size()) {
    const Vec U = Vec::loadu(pu + j), Dn = Vec::loadu(pd + j), Sk = Vec::loadu(ps + j);
    const Vec D = (Vec::loadu(idx + j) - vi).abs();
    acc[0] = at::vec::fmadd(U, Vec::loadu(lu + j), acc[0]);  // ln p is finite even where p underflows
    acc[1] = at::vec::fmadd(Dn, Vec::loadu(ld + j), acc[1]);
    acc[2] = at::vec::fmadd(Sk, Vec::loadu(ls + j), acc[2]);
    acc[3] = at::vec::fmadd(U, D, acc[3]);
    acc[4] = at::vec::fmadd(Dn, D, acc[4]);
    acc[5] = at::vec::fmadd(Sk, D, acc[5]);
    if (h.want_h) {
      const Vec H = at::vec::fmadd(Dn - U, vu, U);
      acc[6] = acc[6] + xlogx(H);
      if (h.js_h) acc[8] = acc[8] + js_terms_pq(H, U);
    }
    if (h.js_d) acc[7] = acc[7] + js_terms_pq(Dn, U);
    if (h.js_s) acc[9] = acc[9] + js_terms_pq(Sk, U);
  }
  for (int64_t c = 0; c < kStats; ++c) r[c] = sum_of(acc[c]);
  const float log_tiny = std::log(std::numeric_limits<float>::min());
  for (int64_t j = n_vec; j < N; ++j) {  // the tail of the row, scalar
    const float D = std::fabs(float(j) - float(i));
    r[0] += pu[j] * lu[j], r[1] += pd[j] * ld[j], r[2] += ps[j] * ls[j];
    r[3] += pu[j] * D, r[4] += pd[j] * D, r[5] += ps[j] * D;
    const float H = (pd[j] - pu[j]) * h.u + pu[j];
    if (h.want_h) r[6] += H > 0.f ? H * std::log(H) : 0.f;
    if (h.js_d && pd[j] + pu[j] > 0.f) r[7] += js_term(pd[j], pu[j], log_tiny);
    if (h.js_h && H + pu[j] > 0.f) r[8] += js_term(H, pu[j], log_tiny);
    if (h.js_s && ps[j] + pu[j] > 0.f) r[9] += js_term(ps[j], pu[j], log_tiny);
  }
}

// The whole head in log space (mu: the row maxima of the scores; sinkhorn: Sinkhorn is analysed or
// its weights written).
void wide_head(Head& h, const float* mu, int64_t iters, bool sinkhorn) {
  const int64_t N = h.N, S = h.S, W = 3 + 2 * S, W2 = 2 + S;
  std::vector<float> cd(N), cs(N), a(N), tmp(N), idx(N), rows(6 * N);
  float *pu = rows.data(), *pd = pu + N, *ps = pd + N, *lu = ps + N, *ld = lu + N, *ls = ld + N;
  for (int64_t j = 0; j < N; ++j) idx[j] = float(j);
  col_lse(h.s, mu, N, cd.data(), tmp.data());  // dnas's column step: c_j = logsumexp_i t_ij
  const bool rounds = sinkhorn && iters > 1;
  std::copy(cd.begin(), cd.end(), cs.begin());
  for (int64_t it = 1; rounds && it < iters; ++it) {  // t_ij - r_i = s_ij - logsumexp_j (s_ij - c_j)
    for (int64_t i = 0; i < N; ++i) a[i] = -row_lse(h.s + i * N, cs.data(), N);
    col_lse(h.s, a.data(), N, cs.data(), tmp.data());
  }
  std::fill(h.alpha, h.alpha + 3 * N, 1.f);
  std::fill(h.beta, h.beta + 3 * N, 1.f);
  std::fill(h.cols, h.cols + 3 * N, 0.f);
  if (h.s1) std::fill(h.s1 + N, h.s1 + 2 * N, 0.f);
  std::vector<int32_t> cand;
  if (h.sm) std::fill(h.sm, h.sm + N, 0.f);
  std::vector<const float*> spec(S);
  for (int64_t c = 0; c < S; ++c) spec[c] = h.spec_t + c * N;
  for (int64_t i = 0; i < N; ++i) {
    const float* sr = h.s + i * N;
    const float* er = h.e + i * N;
    float* dn = h.dn + i * W;
    const float inv_u = 1.f / dn[0], ln_u = std::log(dn[0]);
    if (h.sm) sparsemax_row(i, N, S, sr, er, inv_u, h.spec_t, h.sm, cand);
    const float rd = row_lse(sr, cd.data(), N), rs = rounds ? row_lse(sr, cs.data(), N) : rd;
    for (int64_t j = 0; j < N; ++j) {  // vectorized by the compiler (exp_nonpos is branch-free)
      lu[j] = sr[j] - ln_u;
      ld[j] = sr[j] - cd[j] - rd;
      ls[j] = sr[j] - cs[j] - rs;
      pu[j] = er[j] * inv_u;
      pd[j] = exp_nonpos(ld[j]);
      ps[j] = exp_nonpos(ls[j]);
    }
    if (h.pu) std::copy(pu, pu + N, h.pu + i * N);
    if (h.pd) std::copy(pd, pd + N, h.pd + i * N);
    if (h.ps) std::copy(ps, ps + N, h.ps + i * N);
    if (h.ph)
      for (int64_t j = 0; j < N; ++j) h.ph[i * N + j] = (pd[j] - pu[j]) * h.u + pu[j];
    float r[kStats];
    wide_row_stats(h, i, pu, pd, ps, lu, ld, ls, idx.data(), r);
    float* out = h.stats + i * kStats;
    for (int64_t c = 0; c < kStats; ++c) out[c] = r[c];
    dn[0] = sum_row(pu, N);  // the row sums (1 up to rounding) and special masses
    dn[1] = sum_row(pd, N);
    dn[2] = 0.f;
    dots(pu, spec.data(), S, N, dn + 3);
    dots(pd, spec.data(), S, N, dn + 3 + S);
    axpy(h.cols, 1.f, pu, N);
    axpy(h.cols + N, 1.f, pd, N);
    if (h.s1) {  // softmax1 = r_i p_u,ij, ln t_i = -mu_i - ln sum_j e_ij (as the linear path)
      h.s1[i] = -mu[i] - ln_u;
      axpy(h.s1 + N, 1.f / (1.f + std::exp(h.s1[i])), pu, N);
    }
    float* sk = h.sk + i * W2;
    sk[0] = sum_row(ps, N);
    sk[1] = 0.f;
    dots(ps, spec.data(), S, N, sk + 2);
    axpy(h.cols + 2 * N, 1.f, ps, N);
  }
}

}  // namespace
