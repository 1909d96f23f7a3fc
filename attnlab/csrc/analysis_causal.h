// The causal heads of attnlab.hf's analysis (attnlab/hf/compute/streamed.py): every statistic's row sums
// of unas (Eq. 1), causal dnas (Eq. 5 with each column normalized over the prefix of queries, as
// fused.causal / functions.prefix_column_logsumexp) and hnas (Eq. 12) for one layer of one window,
// without writing any weight. Included by analysis_cpu.cpp (the analysis kernel family).
//
//   causal_heads(q (H, N, D), k (H_kv, N, D), scale, softcap, window, u (H), spec_t (S, N),
//                cols (3, H, N), rowsum (3, H, N), entropy (3, H, N), distance (3, H, N),
//                special (3, H, N, S), js (2, H, N), v?, out?, softmax1?) -> redo (H,) bool
//
// Slots 0, 1, 2 = unas, dnas, hnas; js: twice the Jensen-Shannon divergence in nats of dnas and of
// hnas to unas, per row. Query head h reads key head h / (H / H_kv) (grouped-query attention). Key j
// is visible to query i when j <= i and, with window > 0, i - j < window (transformers' sliding
// window); softcap > 0 caps the scores: s <- softcap tanh(s / softcap). redo marks heads the caller
// recomputes on its exact path: a non-finite score, or a row whose causal DNAS mass underflowed. With v
// (H_kv, N, Dv) and out (N, H, Dv), also unas' attention output softmax(s) v, for the capture forward
// (attnlab/hf/compute/causal_forward.py), from the weights of a block of rows while in cache. With
// softmax1 (2, H, N): [0] ln t_i, t_i = 1 / sum_j exp(s_ij) over the visible keys, [1] the column masses
// of softmax1 = p / (1 + t_i) (its other sums follow from unas', attnlab/hf/compute/softmax1_sums.py).
//
// Per head, rows in order (the column states make a head sequential; heads go to torch's threads):
// a block of kCausalRows rows' scores against the keys they see (BLAS), then per row
//   pass A  e_j = exp(s_j - max), DNAS's P_j = exp(s_j - c_j(i)) with c_j(i) the log-sum-exp of column
//           j over queries 0..i, and ln P_j; the sums that are linear in e or P (row sums, distances,
//           special masses, sum P ln P) before the row's normalizers. The column state is Z_j =
//           sum exp(s - M) against the head's reference M (the largest score of its first block), so
//           that P_j = exp(s_j - M) / Z_j and e_j = exp(s_j - M) exp(M - max) take one exponential, while
//           every score lies in [M - 80, M + 30]; from the first row that leaves that band on, each
//           column's running maximum m_j and z_j = sum exp(s - m_j) (causal_cpu.cpp's row_step), which
//           Z_j is with m_j = M
//   pass B  p = e / sum e, p_d = P / sum P, h = (1 - u) p + u p_d: column sums; hnas' entropy (ln h); the
//           Jensen-Shannon terms (p + p_v) chi(ln p_v - ln p) / 2 from the table of analysis_vec.h (no
//           cancellation, exact where p underflows to 0: then the term is p_v ln 2). hnas' linear sums
//           (row sums, distances, special masses, column sums) are (1 - u) unas' + u dnas' (Eq. 12).
// AVX-512 only (the table); elsewhere the op is not built and the caller streams in PyTorch.
#pragma once
#include "kernel_common.h"
#include "analysis_vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kCausalHeads = true;

constexpr int64_t kCausalRows = 32;  // rows per score block: 32 x 8192 floats = 1 MiB

// 2^t = 2^n 2^f (n = round(t)): exp_nonpos' polynomial (kernel_common.h) in f, 2^n by scalef
inline __m512 vexp2(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
constexpr float kLog2e = 1.44269504088896341f;
// exp_nonpos (kernel_common.h) on 16 lanes; 0 below -87
inline __m512 vexp_nonpos(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _mm512_set1_ps(-126.f));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), vexp2(t));
}
// exp(x) for x in [-80, 30] (pass A's reference band): vexp_nonpos without its clamp and flush, which
// change nothing there (the same values, three operations fewer)
inline __m512 vexp_band(__m512 x) { return vexp2(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e))); }

struct CausalLayer {
  const float *q, *k, *u, *spec;
  float *cols, *rowsum, *entropy, *distance, *special, *js;
  int64_t H, R, N, D, S;
  float scale, softcap;
  int64_t window;
  const float* v = nullptr;  // (H_kv, N, Dv): with out, unas' attention output diag(1 / Z) E v (Eq. 1 v)
  float* out = nullptr;      // row i of head h at out + i * ldo + h * Dv
  int64_t Dv = 0, ldo = 0;
  float* s1 = nullptr;  // (2, H, N): softmax1's ln t_i and column masses, when asked for
};

// A score at least this far below the head's reference M, or this far above it, ends the reference
// form (see pass A): exp(s - M) stays a normal float and the column sums far from overflow.
constexpr float kBelowM = 80.f, kAboveM = 30.f;

// The largest and the smallest of x[0..n), n >= 1; mx is NaN when some x is
inline void row_range(const float* x, int64_t n, float& mx, float& mn) {
  __m512 hi = _mm512_set1_ps(-INFINITY), lo = _mm512_set1_ps(INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = j + 16 <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(in, x + j);
    hi = _mm512_mask_max_ps(hi, in, hi, v), lo = _mm512_mask_min_ps(lo, in, lo, v);
    nan |= _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q);
  }
  mx = nan ? NAN : _mm512_reduce_max_ps(hi), mn = _mm512_reduce_min_ps(lo);
}

// One row's pass A sums over its keys, 16 lanes each, before the row's normalizers 1 / sum e, 1 / sum P
struct RowSums {
  __m512 zs, sx, r, pl, de, dp;  // sum e, sum e (s - max), sum P, sum P ln P, sum e (i - j), sum P (i - j)
  __m512 se[8], sp[8];           // sum e t_b, sum P t_b (key mask b)
};

// Pass A of row i over its w visible keys s[0..w) (keys lo .. i): e = exp(s - max) -> e, DNAS's P and
// ln P (Eq. 5, causal: each column over its prefix of queries) -> pv, lp (0 past the row), the column
// state updated, and the row's sums. Reference form (kRef): column j's state is Z_j = sum exp(s - M)
// over its queries so far, against the head's reference M, so that P = exp(s - M) / Z_j needs one
// exponential (e = exp(s - M) exp(M - max)); valid while every score is in [M - kBelowM, M + kAboveM].
// Otherwise per column its running maximum m_j and z_j = sum exp(s - m_j) (causal_cpu.cpp's row_step).
template <bool kRef>
inline void pass_a(const float* s, int64_t w, float mx, float M, float* mj, float* zj, const float* spec,
                   int64_t NP, int64_t S, float base, __m512 lane, float* e, float* pv, float* lp, RowSums& A) {
  const __m512 amx = _mm512_set1_ps(mx), vM = _mm512_set1_ps(M), one = _mm512_set1_ps(1.f),
               zero = _mm512_setzero_ps(), beta = _mm512_set1_ps(kRef ? std::exp(M - mx) : 0.f),
               lo87 = _mm512_set1_ps(-87.f);
  constexpr int64_t V = 16;
  // one vector of keys j .. j + 15; kFull: all of them visible (no lane masks; with kRef every score is
  // in [M - kBelowM, M + kAboveM], so exp(s - M) needs neither vexp_nonpos' clamp nor its flush)
  auto step = [&](int64_t j, __mmask16 in, auto full) {
    constexpr bool kFull = decltype(full)::value;
    const __m512 sv = kFull ? _mm512_loadu_ps(s + j) : _mm512_maskz_loadu_ps(in, s + j);
    const __m512 x = _mm512_sub_ps(sv, amx);
    __m512 ev, pj, lnp;
    if constexpr (kRef) {
      const __m512 xm = _mm512_sub_ps(sv, vM);  // in [-kBelowM, kAboveM]
      const __m512 ea = kFull ? vexp_band(xm) : _mm512_maskz_mov_ps(in, vexp_nonpos(xm));
      ev = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, lo87, _CMP_GE_OQ) & in, ea, beta);  // 0 below -87, as vexp
      const __m512 zn = _mm512_add_ps(_mm512_maskz_loadu_ps(in, zj + j), ea);
      _mm512_mask_storeu_ps(zj + j, in, zn);
      // > 0: zn >= exp(s - M) >= exp(-kBelowM)
      const __m512 zsafe = kFull ? zn : _mm512_mask_blend_ps(in, one, zn);
      pj = _mm512_mul_ps(ea, static_cast<__m512>(vrecip(Vec(zsafe))));  // (a division costs more)
      lnp = _mm512_maskz_sub_ps(in, xm, fast_log(zsafe));  // ln P = (s - M) - ln Z
    } else {
      ev = _mm512_maskz_mov_ps(in, vexp_nonpos(x));
      const __m512 mv = _mm512_maskz_loadu_ps(in, mj + j), zv = _mm512_maskz_loadu_ps(in, zj + j);
      const __m512 d = _mm512_sub_ps(sv, mv);
      const __mmask16 up = _mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ) & in;
      const __m512 ed = vexp_nonpos(_mm512_sub_ps(zero, _mm512_abs_ps(d)));  // e^{-|d|}
      const __m512 zn = _mm512_mask_blend_ps(up, _mm512_add_ps(zv, ed), _mm512_fmadd_ps(zv, ed, one));
      _mm512_mask_storeu_ps(zj + j, in, zn);
      _mm512_mask_storeu_ps(mj + j, up, sv);
      const __m512 zsafe = _mm512_mask_blend_ps(in, one, zn);
      pj = _mm512_maskz_mul_ps(in, _mm512_mask_blend_ps(up, ed, one), static_cast<__m512>(vrecip(Vec(zsafe))));
      lnp = _mm512_maskz_sub_ps(in, _mm512_maskz_mov_ps(~up, d), fast_log(zsafe));  // ln P = s - m - ln z
    }
    _mm512_storeu_ps(e + j, ev);
    _mm512_storeu_ps(pv + j, pj);
    _mm512_storeu_ps(lp + j, lnp);
    A.zs = _mm512_add_ps(A.zs, ev), A.sx = _mm512_fmadd_ps(ev, x, A.sx);
    A.r = _mm512_add_ps(A.r, pj), A.pl = _mm512_fmadd_ps(pj, lnp, A.pl);
    const __m512 dist = _mm512_sub_ps(_mm512_set1_ps(base - float(j)), lane);  // i - (lo + j + lane)
    A.de = _mm512_fmadd_ps(ev, dist, A.de), A.dp = _mm512_fmadd_ps(pj, dist, A.dp);
    for (int64_t b = 0; b < S; ++b) {
      const __m512 t = _mm512_loadu_ps(spec + b * NP + j);
      A.se[b] = _mm512_fmadd_ps(ev, t, A.se[b]), A.sp[b] = _mm512_fmadd_ps(pj, t, A.sp[b]);
    }
  };
  int64_t j = 0;
  for (; j + V <= w; j += V) step(j, __mmask16(0xFFFF), std::true_type{});
  if (j < w) step(j, __mmask16((1u << (w - j)) - 1u), std::false_type{});
}

// Head h of the layer; false when it has to be recomputed (see redo above).
inline bool causal_head(const CausalLayer& L, int64_t h) {
  const int64_t N = L.N, D = L.D, S = L.S, V = Vec::size(), NP = N + V;
  const float* q = L.q + h * N * D;
  const float* k = L.k + (h / L.R) * N * D;
  const float uh = L.u[h];
  // block: a block's scores, row r at r * ldb (keys lo0 .. i1 - 1, then V spare lanes), each row
  // overwritten by its unas weights in pass B for the output's product P v
  std::vector<float> block(kCausalRows * NP), er(NP), pv(NP), lp(NP), m(N, -1e30f), z(N, 0.f);
  std::vector<float> cu(NP, 0.f), cd(NP, 0.f), spec(S * NP, 0.f), c1(L.s1 ? NP : 0, 0.f);
  for (int64_t s = 0; s < S; ++s) std::copy(L.spec + s * N, L.spec + (s + 1) * N, spec.data() + s * NP);
  float lanes[64];
  for (int64_t l = 0; l < V; ++l) lanes[l] = float(l);
  const __m512 lane = _mm512_loadu_ps(lanes);
  auto out = [&](float* base, int64_t slot) { return base + (slot * L.H + h) * N; };
  float M = -1e30f;   // the head's reference (pass A): the largest score of the first block of rows
  bool ref = true;    // the reference form still holds
  SerialBlas serial;
  for (int64_t i0 = 0; i0 < N; i0 += kCausalRows) {
    const int64_t i1 = std::min(N, i0 + kCausalRows);
    const int64_t lo0 = L.window > 0 ? std::max<int64_t>(0, i0 - L.window + 1) : 0, w0 = i1 - lo0, ldb = w0 + V;
    gemm_abt(i1 - i0, w0, D, L.scale, q + i0 * D, D, k + lo0 * D, D, 0.f, block.data(), ldb);
    if (L.softcap > 0.f) {
      const float c = L.softcap, ic = 1.f / c;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t lo = L.window > 0 ? std::max<int64_t>(0, i - L.window + 1) : 0;
        float* s = block.data() + (i - i0) * ldb + (lo - lo0);
        for (int64_t j = 0; j < i - lo + 1; ++j) s[j] = c * std::tanh(s[j] * ic);
      }
    }
    if (i0 == 0)  // rows 0 .. i1 - 1 see keys 0 .. i1 - 1 at most: the block's largest visible score
      for (int64_t i = 0; i < i1; ++i) {
        const int64_t lo = L.window > 0 ? std::max<int64_t>(0, i - L.window + 1) : 0;
        M = std::max(M, row_max(block.data() + i * ldb + lo, i - lo + 1));
      }
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t lo = L.window > 0 ? std::max<int64_t>(0, i - L.window + 1) : 0, w = i - lo + 1;
      const int64_t wp = (w + V - 1) / V * V;
      float* row = block.data() + (i - i0) * ldb;
      float* s = row + (lo - lo0);  // (s + wp <= row + w0 + V - 1: inside the row)
      float* e = er.data();
      float mx, mn;
      row_range(s, w, mx, mn);
      if (!std::isfinite(mx)) return false;
      if (ref && !(mx <= M + kAboveM && mn >= M - kBelowM)) {
        ref = false;  // per column m_j, z_j from here on: Z_j = sum exp(s - M) is that state with m_j = M
        std::fill(m.begin(), m.begin() + i, M);
      }
      RowSums A;
      A.zs = A.sx = A.r = A.pl = A.de = A.dp = _mm512_setzero_ps();
      for (int64_t b = 0; b < S; ++b) A.se[b] = A.sp[b] = _mm512_setzero_ps();
      const float base = float(i - lo);
      if (L.v) {  // the row's weights outside its keys are 0 for the output's product (pass B writes the rest)
        std::fill(row, s, 0.f);
        if (s + wp < row + w0) std::fill(s + wp, row + w0, 0.f);
      }
      if (ref)
        pass_a<true>(s, w, mx, M, nullptr, z.data() + lo, spec.data() + lo, NP, S, base, lane, e, pv.data(),
                     lp.data(), A);
      else
        pass_a<false>(s, w, mx, M, m.data() + lo, z.data() + lo, spec.data() + lo, NP, S, base, lane, e,
                      pv.data(), lp.data(), A);
      const float zs = _mm512_reduce_add_ps(A.zs), sx = _mm512_reduce_add_ps(A.sx), r = _mm512_reduce_add_ps(A.r);
      if (!(r > 1e-30f) || !std::isfinite(sx)) return false;
      const float lz = std::log(zs), lr = std::log(r), iz = 1.f / zs, ir = 1.f / r, u1 = 1.f - uh;
      const float lnt = -mx - lz;  // softmax1: ln t_i; its weights p / (1 + t_i)
      // pass B: p = e / sum e, p_d = P / sum P, h = (1 - u) p + u p_d: column sums, the hnas entropy and
      // the Jensen-Shannon terms (everything linear in p and p_d came from pass A's sums)
      const Vec vr1(L.s1 ? 1.f / (1.f + std::exp(lnt)) : 0.f);
      const Vec viz(iz), vir(ir), vlr(lr), vk1(mx + lz), vu(uh), vu1(u1), tiny(1e-37f);
      Vec en_h(0.f), js_d(0.f), js_h(0.f);
#pragma GCC unroll 2
      for (int64_t j = 0; j < wp; j += V) {
        const Vec p = Vec::loadu(e + j) * viz;
        const Vec pd = Vec::loadu(pv.data() + j) * vir;
        const Vec ph = at::vec::fmadd(vu1, p, vu * pd);
        const int64_t c = lo + j;
        (Vec::loadu(cu.data() + c) + p).store(cu.data() + c);
        (Vec::loadu(cd.data() + c) + pd).store(cd.data() + c);
        if (L.s1) at::vec::fmadd(p, vr1, Vec::loadu(c1.data() + c)).store(c1.data() + c);
        const Vec sj = j + V <= w ? Vec::loadu(s + j) : Vec::loadu(s + j, w - j);  // (no read past the row)
        if (L.v) p.store(s + j);  // (0 past the row)
        const Vec lnp = sj - vk1;  // ln p (finite in the padded lanes, where p = p_d = h = 0)
        const Vec lnd = Vec::loadu(lp.data() + j) - vlr;
        const Vec lnh = vlog(at::vec::maximum(ph, tiny));
        en_h = at::vec::fmadd(ph, lnh, en_h);
        js_d = at::vec::fmadd(p + pd, Vec(half_chi(static_cast<__m512>(lnd - lnp))), js_d);
        js_h = at::vec::fmadd(p + ph, Vec(half_chi(static_cast<__m512>(lnh - lnp))), js_h);
      }
      const float rs_u = zs * iz, rs_d = r * ir;
      const float di_u = _mm512_reduce_add_ps(A.de) * iz, di_d = _mm512_reduce_add_ps(A.dp) * ir;
      out(L.rowsum, 0)[i] = rs_u, out(L.rowsum, 1)[i] = rs_d, out(L.rowsum, 2)[i] = u1 * rs_u + uh * rs_d;
      out(L.distance, 0)[i] = di_u, out(L.distance, 1)[i] = di_d, out(L.distance, 2)[i] = u1 * di_u + uh * di_d;
      out(L.entropy, 0)[i] = lz - sx * iz;                              // -sum p ln p = ln Z - sum p (s - max)
      out(L.entropy, 1)[i] = lr - _mm512_reduce_add_ps(A.pl) * ir;      // -sum p_d ln p_d = ln r - sum P ln P / r
      out(L.entropy, 2)[i] = -sum_of(en_h);
      L.js[(0 * L.H + h) * N + i] = sum_of(js_d), L.js[(1 * L.H + h) * N + i] = sum_of(js_h);
      if (L.s1) L.s1[h * N + i] = lnt;
      for (int64_t b = 0; b < S; ++b) {
        const float su = _mm512_reduce_add_ps(A.se[b]) * iz, sd = _mm512_reduce_add_ps(A.sp[b]) * ir;
        float* sp = L.special + (h * N + i) * S + b;  // slot a at + a H N S
        sp[0] = su, sp[L.H * N * S] = sd, sp[2 * L.H * N * S] = u1 * su + uh * sd;
      }
    }
    if (L.v)  // the block's attention output P v (Eq. 1), from its weights while they are in cache
      gemm_ab(i1 - i0, L.Dv, w0, block.data(), ldb, L.v + ((h / L.R) * N + lo0) * L.Dv, L.Dv,
              L.out + i0 * L.ldo + h * L.Dv, L.ldo);
  }
  const float u1 = 1.f - uh;
  float *ou = out(L.cols, 0), *od = out(L.cols, 1), *oh = out(L.cols, 2);
  for (int64_t j = 0; j < N; ++j) ou[j] = cu[j], od[j] = cd[j], oh[j] = u1 * cu[j] + uh * cd[j];  // (Eq. 12)
  if (L.s1) std::copy(c1.begin(), c1.begin() + N, L.s1 + (L.H + h) * N);
  return true;
}
#else
constexpr bool kCausalHeads = false;
#endif

at::Tensor causal_heads(const at::Tensor& q, const at::Tensor& k, double scale, double softcap, int64_t window,
                        const at::Tensor& u, const at::Tensor& spec_t, at::Tensor& cols, at::Tensor& rowsum,
                        at::Tensor& entropy, at::Tensor& distance, at::Tensor& special, at::Tensor& js,
                        const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& out,
                        const std::optional<at::Tensor>& softmax1) {
  TORCH_CHECK(kCausalHeads, "causal_heads: built without AVX-512 (the caller streams in PyTorch)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  q.is_contiguous() && k.is_contiguous() && q.size(1) == k.size(1) && q.size(2) == k.size(2) &&
                  k.size(0) > 0 && q.size(0) % k.size(0) == 0,
              "causal_heads: q (H, N, D) and k (H_kv, N, D) must be contiguous float32 with H a multiple of H_kv, "
              "got ", q.sizes(), " and ", k.sizes());
  const int64_t H = q.size(0), N = q.size(1), S = spec_t.size(0);
  TORCH_CHECK(S <= 8 && spec_t.dim() == 2 && spec_t.size(1) == N && spec_t.is_contiguous() &&
                  spec_t.scalar_type() == at::kFloat, "causal_heads: spec_t must be float32 (S <= 8, N), got ",
              spec_t.sizes());
  TORCH_CHECK(u.dim() == 1 && u.size(0) == H && u.is_contiguous() && u.scalar_type() == at::kFloat,
              "causal_heads: u must be float32 (H,)");
  for (const at::Tensor* t : {&cols, &rowsum, &entropy, &distance})
    TORCH_CHECK(t->sizes().equals({3, H, N}) && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "causal_heads: outputs must be float32 (3, H, N), got ", t->sizes());
  TORCH_CHECK(special.sizes().equals({3, H, N, S}) && special.is_contiguous(), "causal_heads: special (3, H, N, S)");
  TORCH_CHECK(js.sizes().equals({2, H, N}) && js.is_contiguous(), "causal_heads: js (2, H, N)");
  const bool with_s1 = softmax1.has_value() && softmax1->defined();
  TORCH_CHECK(!with_s1 || (softmax1->sizes().equals({2, H, N}) && softmax1->is_contiguous() &&
                           softmax1->scalar_type() == at::kFloat), "causal_heads: softmax1 float32 (2, H, N)");
  at::Tensor redo = at::zeros({H}, at::kBool);
#if defined(CPU_CAPABILITY_AVX512)
  CausalLayer L{q.data_ptr<float>(), k.data_ptr<float>(), u.data_ptr<float>(), spec_t.data_ptr<float>(),
                cols.data_ptr<float>(), rowsum.data_ptr<float>(), entropy.data_ptr<float>(),
                distance.data_ptr<float>(), special.data_ptr<float>(), js.data_ptr<float>(),
                H, H / k.size(0), N, q.size(2), S, float(scale), float(softcap), window};
  if (with_s1) L.s1 = softmax1->data_ptr<float>();
  const bool attend = v.has_value() && v->defined();
  TORCH_CHECK(attend == (out.has_value() && out->defined()), "causal_heads: v and out go together");
  if (attend) {
    TORCH_CHECK(v->dim() == 3 && v->size(0) == k.size(0) && v->size(1) == N && v->is_contiguous() &&
                    v->scalar_type() == at::kFloat, "causal_heads: v must be contiguous float32 (H_kv, N, Dv), got ",
                v->sizes());
    TORCH_CHECK(out->dim() == 3 && out->size(0) == N && out->size(1) == H && out->size(2) == v->size(2) &&
                    out->stride(2) == 1 && out->stride(1) == v->size(2) && out->scalar_type() == at::kFloat,
                "causal_heads: out must be float32 (N, H, Dv) with heads adjacent, got ", out->sizes());
    L.v = v->data_ptr<float>(), L.out = out->data_ptr<float>(), L.Dv = v->size(2), L.ldo = out->stride(0);
  }
  bool* bad = redo.data_ptr<bool>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) bad[h] = !causal_head(L, h);
  });
#endif
  return redo;
}

}  // namespace
