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
#include "analysis_vec.h"

#include <vector>

namespace {

constexpr int64_t kStats = 10;

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
