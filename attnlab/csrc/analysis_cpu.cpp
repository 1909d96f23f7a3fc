// attnlab CPU kernel for attnlab.hf: the heads of the fused analysis (attnlab/hf/compute/fused_sums.py, variants_with_sums).
//
//   heads(q, k, scale, spec_t, iters, check_span, u, order, pu?, pd?, ph?, ps?, alpha, beta, cols,
//         dn_rows, sk_rows, stats, js_dnas, js_hnas, js_sinkhorn, hnas, sinkhorn, v?, out?, analyse,
//         softmax1?, sparsemax?) -> linear
//
// M maps (every layer's heads of a window) stacked along a first dimension, on torch's intra-op
// threads, one head per thread at a time (`heads` at the end of this file). Per map, as below.
// hnas, sinkhorn: those variants are analysed (their factors and sums) whether or not their weights
// are asked for (ph, ps): the statistics come from this pass without writing any weights, and a
// variant's weights, written later by the same call, have the same values (attnlab/hf/compute/lazy_weights.py).
//
// q, k (N, D): the head's queries and keys; scores s = scale q k^T. Linear head (true): with
// E_ij = exp(s_ij - max_j s_ij) (the thread's scratch s and e hold s - max and E), every variant is a
// diagonal scaling of E (DESIGN.md §2; Eq. numbers of "Attention that does not Explain Away"):
//   unas (1)      alpha_u,i E_ij                 alpha_u = 1 / (E 1)
//   dnas (5)      alpha_d,i E_ij beta_d,j        beta_d = 1 / (rho^T E), rho_i = exp(row max - head max),
//                                                alpha_d = 1 / (E beta_d)
//   sinkhorn (10) a_i E_ij b_j                   first round = dnas's; then iters - 1 rounds of
//                                                b = 1 / (a^T E), a = 1 / (E b)
//   hnas (12)     lerp(unas, dnas, u)
//   softmax1      alpha_u,i r_i E_ij                r_i = 1 / (1 + t_i), t_i = 1 / sum_j exp(s_ij): a null key
// A head is wide when check_span and its scores span more than kLinearSpanMax nats: then the same
// outputs come from log space (analysis_wide.h, its layout: every factor 1) and the result is false.
// The outputs are (the layout of attnlab/hf/compute/fused_sums.py's _FusedBuffers, S = spec_t.size(0)):
//   alpha, beta (3, N)   (alpha_u, alpha_d, a), (1, beta_d, b)
//   cols (3, N)          (alpha_u, alpha_d, a)^T E: column masses before the column factor
//   dn_rows (N, 3 + 2S)  E @ [1, beta_d, beta_d ln beta_d, special, beta_d special]
//   sk_rows (N, 2 + S)   E @ [b, b ln b, b special] (when iters > 1)
//   the weights asked for (pu, pd, ph, ps: (N, N), streamed to memory: they are not read again here)
//   softmax1 (2, N)      optional: ln t_i (t_i = 1 / sum_j exp(s_ij), the null key's odds) and the column
//                        masses of softmax1 = p_u / (1 + t_i) (attnlab/hf/compute/fused_sums.py derives
//                        its other sums from unas': every one is unas' times r_i, or closed-form in r_i)
//   sparsemax (5 + S, N) optional: its column masses and per row its sum, sum p ln p, distance, 2 JSD to
//                        unas and special masses, from the row's support (analysis_sparsemax.h)
//   stats (N, 10)        0-2 sum_j E_ij s_ij beta_cj (c = unas, dnas, sinkhorn), 3-5 the same with
//                        |i - j| for s, 6 sum_j h ln h of the hnas weights (0 ln 0 = 0), 7-9 for
//                        p = dnas, hnas, sinkhorn and q = unas weights: sum_j p log1p(d) + q log1p(-d),
//                        d = (p - q)/(p + q), twice the Jensen-Shannon divergence in nats without
//                        the cancellation of H(m) - (H(p) + H(q))/2 (when js_<variant>)
// float32, contiguous. One head on one thread.
//
// Passes over the head (N x N floats: s and e stay in the L3 cache, a row in L1):
//   score_pass       a block of rows at a time while they are in L2: the scores (register tiles on
//                    AVX-512 with k packed once, tiles.h; BLAS otherwise), their row
//                    maxima, s - max, E and its row sums, DNAS's column sums
//   dnas_pass        dn_rows (one sweep of each row for all its dot products), alpha_u, alpha_d, cols
//   sinkhorn_rounds  the rounds after DNAS's, one row and one column step per sweep
//   row_pass         Sinkhorn's last row step, then per row: the products of the entropies and
//                    distances and the weights asked for; HNAS's terms; each Jensen-Shannon sum
//                    (one sweep each, from L1, so that a sweep's accumulators fit the registers).
// The ratios of the weights to the unas weights are known from the factors (x_v = alpha_v beta_v,j /
// alpha_u, ln x_v likewise), so each logarithm term costs one logarithm: ln m for HNAS (m = h / p_u
// = 1 - u + u x_d) and one per Jensen-Shannon sum (js_terms_x), none on AVX-512, where js_terms_x
// reads a table of chi(ln x) (analysis_vec.h).
#include "analysis_causal.h"
#include "analysis_head.h"
#include "analysis_sparsemax.h"
#include "analysis_wide.h"
#include "kernel_common.h"
#include "tiles.h"

#include <atomic>
#include <memory>
#include <vector>

namespace {

// rows per block of the score pass: at most 64, and 2 x 128 KiB of scores and exponentials (in L2)
constexpr int64_t kBlockRows = 64, kBlockFloats = 32768;

// The score pass, a block of rows at a time while they are in L2: s = scale q k^T (BLAS), mu_i = max_j
// s_ij, s -= mu, e = exp(s), r_i = sum_j e_ij -> dn[:, 0], and colsum_j = sum_i exp(mu_i - gmax) e_ij
// (beta_d = 1 / colsum) with a running maximum for gmax; mu (N) the row maxima; with h.out, unas'
// attention output diag(1 / r) E v (Eq. 1 times v), block by block from L2. False when check_span and
// the scores span more than kLinearSpanMax nats (then dn[:, 0], e and the output are valid, beta_d is not).
bool score_pass(Head& h, const float* q, int64_t ldq, const float* k, int64_t ldk, int64_t D, float scale,
                bool check_span, float* mu) {
  const int64_t N = h.N, W = 3 + 2 * h.S;
  float* colsum = h.beta + N;
  std::fill(colsum, colsum + N, 0.f);
  float run = -std::numeric_limits<float>::infinity(), smin = std::numeric_limits<float>::infinity();
  SerialBlas serial;
#if defined(CPU_CAPABILITY_AVX512)
  const bool tiles = ldk < (int64_t(1) << 27);  // the panels' gather offsets fit int32
  const PackedB kp(k, tiles ? ldk : 0, tiles ? N : 0, D);  // k in 32-key panels once per head (tiles.h)
#else
  const bool tiles = false;
#endif
  const int64_t rows = std::max<int64_t>(1, std::min(kBlockRows, kBlockFloats / std::max<int64_t>(N, 1)));
  std::vector<float> inv(rows);  // 1 / row sums of the block
  for (int64_t i0 = 0; i0 < N; i0 += rows) {
    const int64_t R = std::min(rows, N - i0);
    float* sb = h.s + i0 * N;
#if defined(CPU_CAPABILITY_AVX512)
    if (tiles) tiled_packed(R, scale, q + i0 * ldq, ldq, kp, sb, N);
#endif
    if (!tiles) gemm_abt(R, N, D, scale, q + i0 * ldq, ldq, k, ldk, 0.f, sb, N);
    float bmax = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < R; ++r) {
      mu[i0 + r] = row_max(sb + r * N, N);  // kernel_common.h
      if (check_span) smin = std::min(smin, reduce_min(sb + r * N, N));
      bmax = std::max(bmax, mu[i0 + r]);
    }
    if (bmax > run) {  // colsum was relative to exp(run): rescale to the new maximum
      if (i0 > 0) {
        const float f = std::exp(run - bmax);
        for (int64_t j = 0; j < N; ++j) colsum[j] *= f;
      }
      run = bmax;
    }
    for (int64_t r = 0; r < R; ++r) {
      float* sr = sb + r * N;
      float* er = h.e + (i0 + r) * N;
      const float m = mu[i0 + r], rho = std::exp(m - run);
      float sum = 0.f;
      for (int64_t j = 0; j < N; ++j) {  // vectorized by the compiler (exp_nonpos is branch-free)
        const float x = sr[j] - m;
        const float ex = exp_nonpos(x);
        sr[j] = x;
        er[j] = ex;
        sum += ex;
        colsum[j] += rho * ex;
      }
      h.dn[(i0 + r) * W] = sum;
      inv[r] = 1.f / sum;
    }
    if (h.out) {  // unas' attention output for the block's rows, while their E is in L2
#if defined(CPU_CAPABILITY_AVX512)
      tiled_ab(R, h.Dv, N, h.e + i0 * N, N, h.v, h.ldv, h.out + i0 * h.ldo, h.ldo);
#else
      gemm_ab(R, h.Dv, N, h.e + i0 * N, N, h.v, h.ldv, h.out + i0 * h.ldo, h.ldo);
#endif
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < h.Dv; ++c) h.out[(i0 + r) * h.ldo + c] *= inv[r];
    }
  }
  if (check_span && run - smin > kLinearSpanMax) return false;
  for (int64_t j = 0; j < N; ++j) colsum[j] = 1.f / colsum[j];
  return true;
}

// dn_rows[:, 1:] and alpha_u, alpha_d; cols[0:2] = (alpha_u, alpha_d)^T E; with h.s1, softmax1's ln t_i
// = -mu_i - ln sum_j E_ij and column masses (alpha_u r)^T E, r_i = 1 / (1 + t_i) (mu: the row maxima)
void dnas_pass(Head& h, const float* mu) {
  const int64_t N = h.N, S = h.S, W = 3 + 2 * S;
  const float* bd = h.beta + N;
  std::vector<float> blnb(N), bspec(S * N);
  for (int64_t j = 0; j < N; ++j) blnb[j] = bd[j] * std::log(bd[j]);
  for (int64_t c = 0; c < S; ++c)
    for (int64_t j = 0; j < N; ++j) bspec[c * N + j] = bd[j] * h.spec_t[c * N + j];
  std::vector<const float*> w{bd, blnb.data()};  // dn[:, 1], dn[:, 2], then the specials, then bspec
  for (int64_t c = 0; c < S; ++c) w.push_back(h.spec_t + c * N);
  for (int64_t c = 0; c < S; ++c) w.push_back(bspec.data() + c * N);
  float *cu = h.cols, *cd = h.cols + N, *c1 = h.s1 ? h.s1 + N : nullptr;
  std::fill(cu, cu + 2 * N, 0.f);
  if (c1) std::fill(c1, c1 + N, 0.f);
  for (int64_t i = 0; i < N; ++i) {
    const float* er = h.e + i * N;
    float* d = h.dn + i * W;
    dots(er, w.data(), 2 + 2 * S, N, d + 1);
    const float au = 1.f / d[0], ad = 1.f / d[1];
    h.alpha[i] = au;
    h.alpha[N + i] = ad;
    if (c1) {  // softmax1 = r_i p_u,ij: one more product per entry while the row is in L1
      const float lnt = -mu[i] - std::log(d[0]);
      h.s1[i] = lnt;
      const float a1 = au / (1.f + std::exp(lnt));  // exp -> inf: r = 0
      for (int64_t j = 0; j < N; ++j) {
        cu[j] += au * er[j];
        cd[j] += ad * er[j];
        c1[j] += a1 * er[j];
      }
      continue;
    }
    for (int64_t j = 0; j < N; ++j) {
      cu[j] += au * er[j];
      cd[j] += ad * er[j];
    }
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
      axpy(acc.data(), 1.f / dot4(er, b, N), er, N);
    }
    for (int64_t j = 0; j < N; ++j) b[j] = 1.f / acc[j];
  }
}

// The Jensen-Shannon terms of one row's whole vectors (n_vec entries) of a variant v against unas,
// from the factors: p_u = alpha_u e_ij, x = p_v / p_u = c beta_j with c = alpha_v / alpha_u, ln x =
// ln c + ln beta_j (lb)
inline float js_sweep(const float* er, float au, float c, const float* b, const float* lb, int64_t n_vec) {
  const Vec vau(au), vc(c), lc(std::log(c));
  Vec acc(0.f);
  for (int64_t j = 0; j < n_vec; j += Vec::size())
    acc = acc + js_terms_x(Vec::loadu(er + j) * vau, vc * Vec::loadu(b + j), lc + Vec::loadu(lb + j));
  return sum_of(acc);
}

// The row pass: Sinkhorn's last row step (sk_rows, a, cols[2]) when sinkhorn_final, the weights and
// the stats, one row at a time; each row is swept a few times from L1 (so that one sweep's
// accumulators and constants fit the vector registers).
void row_pass(Head& h, bool sinkhorn_final) {
  const int64_t N = h.N, S = h.S, W2 = 2 + S;
  const float* bd = h.beta + N;
  const float* bs = h.beta + 2 * N;
  const float log_tiny = std::log(std::numeric_limits<float>::min());
  std::vector<float> blnb, bspec, idx(N), lbd(N), lbs(N);
  std::vector<const float*> w;
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
    w = {bs, blnb.data()};
    for (int64_t c = 0; c < S; ++c) w.push_back(bspec.data() + c * N);
    std::fill(h.cols + 2 * N, h.cols + 3 * N, 0.f);
  }
  // every row of a (N, N) output starts 64-byte aligned when the first does and N is a multiple of
  // the vector width: then the full vectors of every row can be streamed
  const bool whole = N % Vec::size() == 0;
  const bool st_u = h.pu && whole && aligned(h.pu), st_d = h.pd && whole && aligned(h.pd);
  const bool st_h = h.ph && whole && aligned(h.ph), st_s = h.ps && whole && aligned(h.ps);
  const int64_t n_vec = N - N % Vec::size();
  std::vector<int32_t> cand;
  if (h.sm) {
    cand.reserve(N);
    std::fill(h.sm, h.sm + N, 0.f);  // sparsemax's column masses
  }
  for (int64_t i = 0; i < N; ++i) {
    const float* er = h.e + i * N;
    const float* sr = h.s + i * N;
    if (h.sm)  // from its support, among the keys within 1 of the row maximum
      sparsemax_row(i, N, S, sr, er, h.alpha[i], h.spec_t, h.sm, cand);
    if (sinkhorn_final) {  // the last row step normalizes the rows
      float* kr = h.sk + i * W2;
      dots(er, w.data(), 2 + S, N, kr);
      h.alpha[2 * N + i] = 1.f / kr[0];
      axpy(h.cols + 2 * N, 1.f / kr[0], er, N);
    }
    const float au = h.alpha[i], ad = h.alpha[N + i], as = h.alpha[2 * N + i];
    float r[kStats] = {};
    {  // sweep 1: entropy and distance products, the weights asked for
      const Vec vau(au), vad(ad), vas(as), vi(static_cast<float>(i));
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), a4(0.f), a5(0.f);
      for (int64_t j = 0; j < n_vec; j += Vec::size()) {
        const Vec E = Vec::loadu(er + j), Sv = Vec::loadu(sr + j);
        const Vec Bd = Vec::loadu(bd + j), Bs = Vec::loadu(bs + j);
        const Vec D = (Vec::loadu(idx.data() + j) - vi).abs();
        const Vec ES = E * Sv, ED = E * D;
        a0 = a0 + ES;
        a1 = at::vec::fmadd(ES, Bd, a1);
        a2 = at::vec::fmadd(ES, Bs, a2);
        a3 = a3 + ED;
        a4 = at::vec::fmadd(ED, Bd, a4);
        a5 = at::vec::fmadd(ED, Bs, a5);
        const Vec PU = E * vau, PD = E * Bd * vad;
        if (h.pu) store(h.pu + i * N + j, PU, st_u);
        if (h.pd) store(h.pd + i * N + j, PD, st_d);
        if (h.ps) store(h.ps + i * N + j, E * Bs * vas, st_s);
        if (h.ph) store(h.ph + i * N + j, at::vec::fmadd(PD - PU, Vec(h.u), PU), st_h);
      }
      r[0] = sum_of(a0), r[1] = sum_of(a1), r[2] = sum_of(a2);
      r[3] = sum_of(a3), r[4] = sum_of(a4), r[5] = sum_of(a5);
    }
    // the ratios to the unas weights: x_v = p_v / p_u = (alpha_v / alpha_u) beta_v,j, ln x_v
    const float cd = ad / au, cs = as / au;
    if (h.want_h) {  // sweep 2: hnas, h = p_u m with m = (1 - u) + u x_d; ln h = ln alpha_u + s + ln m, so
      // sum h ln h = ln alpha_u sum h + alpha_u ((1 - u) sum E s + u c_d sum E s beta_d) + sum h ln m: only
      // the last sum is taken here (the others are sweep 1's; a linear head's E is a normal float, > 0)
      const Vec vau(au), vcd(cd), vu(h.u), v1u(1.f - h.u);
      Vec a_h(0.f), a_jh(0.f);
      for (int64_t j = 0; j < n_vec; j += Vec::size()) {
        const Vec PU = Vec::loadu(er + j) * vau;
        const Vec m = at::vec::fmadd(vu * vcd, Vec::loadu(bd + j), v1u);
        const Vec lnm = vlog(m);
        a_h = at::vec::fmadd(PU * m, lnm, a_h);
        if (h.js_h) a_jh = a_jh + js_terms_x(PU, m, lnm);
      }
      r[6] = sum_of(a_h), r[8] = sum_of(a_jh);
    }
    if (h.js_d) r[7] = js_sweep(er, au, cd, bd, lbd.data(), n_vec);  // sweep 3: dnas's Jensen-Shannon terms
    if (h.js_s) r[9] = js_sweep(er, au, cs, bs, lbs.data(), n_vec);  // sweep 4: sinkhorn's
    for (int64_t j = n_vec; j < N; ++j) {  // the tail of the row, scalar
      const float E = er[j], Sv = sr[j], D = std::fabs(float(j) - float(i));
      const float ES = E * Sv, ED = E * D;
      r[0] += ES, r[1] += ES * bd[j], r[2] += ES * bs[j];
      r[3] += ED, r[4] += ED * bd[j], r[5] += ED * bs[j];
      const float PU = E * au, PD = E * bd[j] * ad, PS = E * bs[j] * as;
      const float PH = (PD - PU) * h.u + PU;
      if (h.pu) h.pu[i * N + j] = PU;
      if (h.pd) h.pd[i * N + j] = PD;
      if (h.ps) h.ps[i * N + j] = PS;
      if (h.ph) h.ph[i * N + j] = PH;
      if (h.want_h) r[6] += PH * std::log1p(h.u * (cd * bd[j] - 1.f));  // h ln m, m = 1 + u (x_d - 1)
      if (h.js_d) r[7] += js_term(PD, PU, log_tiny);
      if (h.js_h) r[8] += js_term(PH, PU, log_tiny);
      if (h.js_s) r[9] += js_term(PS, PU, log_tiny);
    }
    if (h.want_h) {  // the rest of sum h ln h (sweep 2), from sweep 1's sums of E s and E s beta_d
      const float* dn = h.dn + i * (3 + 2 * S);  // E 1, E beta_d, ... (dnas_pass)
      const float sum_h = (1.f - h.u) * au * dn[0] + h.u * ad * dn[1];
      r[6] += std::log(au) * sum_h + au * ((1.f - h.u) * r[0] + h.u * cd * r[1]);
    }
    float* out = h.stats + i * kStats;
    for (int64_t c = 0; c < kStats; ++c) out[c] = r[c];
  }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();  // the streamed weights are visible before the caller reads them
#endif
}

void check(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.sizes().equals(shape), "heads: ", name,
              " must be a contiguous ", dtype, " tensor of shape ", shape, ", got ", t.scalar_type(), " ",
              t.sizes());
}

float* out_ptr(const c10::optional<at::Tensor>& t, int64_t M, int64_t N, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check(*t, {M, N, N}, at::kFloat, name);
  return t->data_ptr<float>();
}

// Each map's bound on its score span, 2 scale max_i |q_i| max_j |k_j| (|s_ij| <= scale |q_i| |k_j|): a map
// whose bound is at most kLinearSpanMax skips the exact check (chk 0); the maps in order of decreasing
// bound (a wide head costs several linear ones: started last, it would leave the other threads idle).
void span_order(const at::Tensor& q, const at::Tensor& k, const double* scale, std::vector<int64_t>& ord,
                std::vector<char>& chk) {
  const int64_t M = q.size(0), N = q.size(1), D = q.size(2);
  std::vector<double> bound(M);
  auto max_norm = [N, D](const float* x, int64_t ld) {
    float best = 0.f;
    for (int64_t i = 0; i < N; ++i) {
      float sq = 0.f;
      for (int64_t d = 0; d < D; ++d) sq += x[i * ld + d] * x[i * ld + d];  // vectorized by the compiler
      best = std::max(best, sq);
    }
    return std::sqrt(double(best));
  };
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      bound[m] = 2.0 * scale[m] * max_norm(q.data_ptr<float>() + m * q.stride(0), q.stride(1)) *
                 max_norm(k.data_ptr<float>() + m * k.stride(0), k.stride(1));
  });
  for (int64_t m = 0; m < M; ++m) {
    ord[m] = m;
    chk[m] = !(bound[m] <= kLinearSpanMax);  // NaN: checked
  }
  std::stable_sort(ord.begin(), ord.end(), [&](int64_t a, int64_t b) { return bound[a] > bound[b]; });
}

// One head: its passes (the file's header) on the scratch in h (without `analyse`, the score pass and
// its attention output alone); false for a wide head.
bool run_head(Head& h, const float* q, int64_t ldq, const float* k, int64_t ldk, int64_t D, float scale,
              bool check_span, int64_t iters, bool sinkhorn_analysed, bool analyse, float* mu) {
  const int64_t N = h.N;
  const bool linear = score_pass(h, q, ldq, k, ldk, D, scale, check_span, mu);
  if (!analyse) return linear;  // the attention output alone
  if (!linear) {
    wide_head(h, mu, iters, sinkhorn_analysed);  // analysis_wide.h
    return false;
  }
  dnas_pass(h, mu);
  std::fill(h.beta, h.beta + N, 1.f);
  const bool rounds = sinkhorn_analysed && iters > 1;
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

// The M maps (heads) of a window, taken in `order` by torch's intra-op threads: each thread takes the
// next map until none is left (so a wide head, several linear ones' work, started first does not leave
// the others idle at the end), on its own scratch for s and e. q, k (M, N, D) with unit stride along D;
// scale (M) float64, u (M) float64; check_span (M) bool and order (M) int64, a permutation of the maps,
// or both None: from each map's bound on its score span (span_order);
// every output is the per-map layout of the file's header stacked over M; v, out (M, N, Dv), unit
// stride along Dv: with v, out receives unas' attention output softmax(s) v (in place of the model's
// own attention, attnlab/hf/compute/fused_forward.py); analyse=False: that output alone (the score pass; the
// other outputs are left as they are). Returns bool (M): linear.
at::Tensor heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& scale, const at::Tensor& spec_t,
                 int64_t iters, const c10::optional<at::Tensor>& check_span, const at::Tensor& u,
                 const c10::optional<at::Tensor>& order,
                 const c10::optional<at::Tensor>& pu, const c10::optional<at::Tensor>& pd,
                 const c10::optional<at::Tensor>& ph, const c10::optional<at::Tensor>& ps, const at::Tensor& alpha,
                 const at::Tensor& beta, const at::Tensor& cols, const at::Tensor& dn_rows, const at::Tensor& sk_rows,
                 const at::Tensor& stats, bool js_dnas, bool js_hnas, bool js_sinkhorn, bool hnas, bool sinkhorn,
                 const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& out, bool analyse,
                 const c10::optional<at::Tensor>& softmax1, const c10::optional<at::Tensor>& sparsemax) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes().equals(q.sizes()) && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat,
              "heads: q and k must be float32 (M, N, D) of one shape, got ", q.sizes(), " and ", k.sizes());
  const int64_t M = q.size(0), N = q.size(1), D = q.size(2), S = spec_t.size(0);
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous(), kc = k.stride(2) == 1 ? k : k.contiguous();
  check(scale, {M}, at::kDouble, "scale");
  check(u, {M}, at::kDouble, "u");
  check(spec_t, {S, N}, at::kFloat, "spec_t");
  check(alpha, {M, 3, N}, at::kFloat, "alpha");
  check(beta, {M, 3, N}, at::kFloat, "beta");
  check(cols, {M, 3, N}, at::kFloat, "cols");
  check(dn_rows, {M, N, 3 + 2 * S}, at::kFloat, "dn_rows");
  check(sk_rows, {M, N, 2 + S}, at::kFloat, "sk_rows");
  check(stats, {M, N, kStats}, at::kFloat, "stats");
  float *w_u = out_ptr(pu, M, N, "pu"), *w_d = out_ptr(pd, M, N, "pd");
  float *w_h = out_ptr(ph, M, N, "ph"), *w_s = out_ptr(ps, M, N, "ps");
  const bool want_h = hnas || w_h, sinkhorn_analysed = sinkhorn || w_s;
  const bool attend = v.has_value() && v->defined();
  TORCH_CHECK(attend == (out.has_value() && out->defined()), "heads: v and out go together");
  TORCH_CHECK(analyse || (attend && !w_u && !w_d && !w_h && !w_s), "heads: analyse=False is for the attention "
              "output alone (v and out, no weights)");
  if (attend) {
    TORCH_CHECK(v->dim() == 3 && v->size(0) == M && v->size(1) == N && v->scalar_type() == at::kFloat &&
                    v->stride(2) == 1,
                "heads: v must be float32 (M, N, Dv) with unit stride along Dv, got ", v->sizes());
    TORCH_CHECK(out->sizes().equals(v->sizes()) && out->scalar_type() == at::kFloat && out->stride(2) == 1,
                "heads: out must be float32 of v's shape ", v->sizes(), " with unit stride along Dv, got ",
                out->sizes());
  }
  TORCH_CHECK(!js_hnas || want_h, "heads: js_hnas needs hnas");
  const bool with_s1 = softmax1.has_value() && softmax1->defined();
  if (with_s1) check(*softmax1, {M, 2, N}, at::kFloat, "softmax1");
  const bool with_sm = sparsemax.has_value() && sparsemax->defined();
  if (with_sm) check(*sparsemax, {M, kSparsemaxRows + S, N}, at::kFloat, "sparsemax");
  const double* sc = scale.data_ptr<double>();
  std::vector<int64_t> ord(M);
  std::vector<char> chk(M);
  const bool given = order.has_value() && order->defined();
  TORCH_CHECK(given == (check_span.has_value() && check_span->defined()), "heads: order and check_span go together");
  if (given) {
    check(*order, {M}, at::kLong, "order");
    check(*check_span, {M}, at::kBool, "check_span");
    std::copy(order->data_ptr<int64_t>(), order->data_ptr<int64_t>() + M, ord.begin());
    std::copy(check_span->data_ptr<bool>(), check_span->data_ptr<bool>() + M, chk.begin());
    std::vector<bool> seen(M, false);
    for (int64_t i = 0; i < M; ++i) {
      TORCH_CHECK(ord[i] >= 0 && ord[i] < M && !seen[ord[i]], "heads: order must be a permutation of 0..", M - 1);
      seen[ord[i]] = true;
    }
  } else {
    span_order(qc, kc, sc, ord, chk);
  }
  at::Tensor linear = at::ones({M}, at::kBool);
  bool* lin = linear.data_ptr<bool>();
  const double* uu = u.data_ptr<double>();
  const int64_t W = 3 + 2 * S, NN = N * N;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), M), 1, [&](int64_t, int64_t) {
    std::unique_ptr<float[]> s(new float[NN]), e(new float[NN]);  // uninitialized: the score pass writes them
    std::vector<float> mu(N);
    for (int64_t i = next++; i < M; i = next++) {
      const int64_t m = ord[i];
      auto at_map = [m](float* p, int64_t size) { return p ? p + m * size : nullptr; };
      Head h{N, S, s.get(), e.get(), alpha.data_ptr<float>() + m * 3 * N, beta.data_ptr<float>() + m * 3 * N,
             cols.data_ptr<float>() + m * 3 * N, dn_rows.data_ptr<float>() + m * N * W,
             sk_rows.data_ptr<float>() + m * N * (2 + S), stats.data_ptr<float>() + m * N * kStats,
             spec_t.data_ptr<float>(), at_map(w_u, NN), at_map(w_d, NN), at_map(w_h, NN), at_map(w_s, NN),
             float(uu[m]), js_dnas, js_hnas, js_sinkhorn, want_h};
      if (with_s1) h.s1 = softmax1->data_ptr<float>() + m * 2 * N;
      if (with_sm) h.sm = sparsemax->data_ptr<float>() + m * (kSparsemaxRows + S) * N;
      if (attend) {
        h.v = v->data_ptr<float>() + m * v->stride(0), h.ldv = v->stride(1), h.Dv = v->size(2);
        h.out = out->data_ptr<float>() + m * out->stride(0), h.ldo = out->stride(1);
      }
      lin[m] = run_head(h, qc.data_ptr<float>() + m * qc.stride(0), qc.stride(1),
                        kc.data_ptr<float>() + m * kc.stride(0), kc.stride(1), D, float(sc[m]), chk[m], iters,
                        sinkhorn_analysed, analyse, mu.data());
    }
  });
  return linear;
}

}  // namespace

TORCH_LIBRARY(attnlab_hf, m) {
  m.def("heads(Tensor q, Tensor k, Tensor scale, Tensor spec_t, int iters, Tensor? check_span, Tensor u, "
        "Tensor? order, Tensor(a!)? pu, Tensor(b!)? pd, Tensor(c!)? ph, Tensor(d!)? ps, Tensor(e!) alpha, "
        "Tensor(f!) beta, Tensor(g!) cols, Tensor(h!) dn_rows, Tensor(i!) sk_rows, Tensor(j!) stats, "
        "bool js_dnas, bool js_hnas, bool js_sinkhorn, bool hnas, bool sinkhorn, Tensor? v=None, "
        "Tensor(m!)? out=None, bool analyse=True, Tensor(n!)? softmax1=None, Tensor(o!)? sparsemax=None) "
        "-> Tensor");
  m.def("causal_heads(Tensor q, Tensor k, float scale, float softcap, int window, Tensor u, Tensor spec_t, "
        "Tensor(a!) cols, Tensor(b!) rowsum, Tensor(c!) entropy, Tensor(d!) distance, Tensor(e!) special, "
        "Tensor(f!) js, Tensor? v=None, Tensor(g!)? out=None, Tensor(h!)? softmax1=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_hf, CPU, m) {
  m.impl("heads", &heads);
  m.impl("causal_heads", &causal_heads);
}
