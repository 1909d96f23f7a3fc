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
// (attnlab/hf/compute/causal_forward.py), from the exponentials while a block of rows is in L2. With
// softmax1 (2, H, N): [0] ln t_i, t_i = 1 / sum_j exp(s_ij) over the visible keys, [1] the column masses
// of softmax1 = p / (1 + t_i) (its other sums follow from unas', attnlab/hf/compute/softmax1_sums.py).
//
// Per head, rows in order (the column states make a head sequential; heads go to torch's threads):
// a block of kRows rows' scores against the keys they see (BLAS, while in L2), then per row
//   pass A  e_j = exp(s_j - max), and each column's running maximum m_j and sum z_j of the causal
//           prefix (causal_cpu.cpp's row_step): P_j = exp(s_j - c_j(i)) = (s_j > m_j ? 1 : e^{s_j - m_j}) / z_j
//   pass B  p = e / sum e, p_d = P / sum P, h = (1 - u) p + u p_d: column sums, distances, special
//           masses; entropies (unas in closed form, ln p_d = ln P - ln sum P, ln h); the Jensen-Shannon
//           terms (p + p_v) chi(ln p_v - ln p) / 2 from the table of analysis_vec.h (no cancellation,
//           exact where p underflows to 0: then the term is p_v ln 2).
// AVX-512 only (the table); elsewhere the op is not built and the caller streams in PyTorch.
#pragma once
#include "kernel_common.h"
#include "analysis_vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kCausalHeads = true;

constexpr int64_t kCausalRows = 32;  // rows per score block: 32 x 8192 floats = 1 MiB

// exp_nonpos (kernel_common.h) on 16 lanes: 2^n 2^f, the same polynomial, 2^n by scalef; 0 below -87.
inline __m512 vexp_nonpos(__m512 x) {
  const __m512 t =
      _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), _mm512_scalef_ps(p, n));
}

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

// Head h of the layer; false when it has to be recomputed (see redo above).
inline bool causal_head(const CausalLayer& L, int64_t h) {
  const int64_t N = L.N, D = L.D, S = L.S, V = Vec::size(), NP = N + V;
  const float* q = L.q + h * N * D;
  const float* k = L.k + (h / L.R) * N * D;
  const float uh = L.u[h];
  const int64_t ldE = NP;  // a row of the block's exponentials: keys lo0 .. i1 - 1, then V spare lanes
  std::vector<float> block(kCausalRows * N), eblk(kCausalRows * ldE), pv(NP), lp(NP), zn(NP), m(N, -1e30f),
      z(N, 1.f), zrow(kCausalRows), ob(L.v ? kCausalRows * L.Dv : 0);
  std::vector<float> cu(NP, 0.f), cd(NP, 0.f), ch(NP, 0.f), spec(S * NP, 0.f), c1(L.s1 ? NP : 0, 0.f);
  for (int64_t s = 0; s < S; ++s) std::copy(L.spec + s * N, L.spec + (s + 1) * N, spec.data() + s * NP);
  float lanes[64];
  for (int64_t l = 0; l < V; ++l) lanes[l] = float(l);
  const Vec lane = Vec::loadu(lanes);
  auto out = [&](float* base, int64_t slot) { return base + (slot * L.H + h) * N; };
  SerialBlas serial;
  for (int64_t i0 = 0; i0 < N; i0 += kCausalRows) {
    const int64_t i1 = std::min(N, i0 + kCausalRows);
    const int64_t lo0 = L.window > 0 ? std::max<int64_t>(0, i0 - L.window + 1) : 0, w0 = i1 - lo0;
    gemm_abt(i1 - i0, w0, D, L.scale, q + i0 * D, D, k + lo0 * D, D, 0.f, block.data(), w0);
    if (L.v) std::fill(eblk.begin(), eblk.begin() + (i1 - i0) * ldE, 0.f);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t lo = L.window > 0 ? std::max<int64_t>(0, i - L.window + 1) : 0, w = i - lo + 1;
      float* s = block.data() + (i - i0) * w0 + (lo - lo0);
      float* e = eblk.data() + (i - i0) * ldE + (lo - lo0);  // (wp <= w + V - 1 floats: inside the row)
      if (L.softcap > 0.f) {
        const float c = L.softcap, ic = 1.f / c;
        for (int64_t j = 0; j < w; ++j) s[j] = c * std::tanh(s[j] * ic);
      }
      const float mx = row_max(s, w);
      if (!std::isfinite(mx)) return false;
      // pass A, 16 keys at a time (lanes past the row masked: no column state of a later key changes)
      const __m512 amx = _mm512_set1_ps(mx), one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
      __m512 vzs = zero, vsx = zero, vr = zero;
      float *mj = m.data() + lo, *zj = z.data() + lo;
      const int64_t wp = (w + V - 1) / V * V;
      for (int64_t j = 0; j < wp; j += V) {
        const __mmask16 in = j + V <= w ? __mmask16(0xFFFF) : __mmask16((1u << (w - j)) - 1u);
        const __m512 sv = _mm512_maskz_loadu_ps(in, s + j), x = _mm512_sub_ps(sv, amx);
        const __m512 ev = _mm512_maskz_mov_ps(in, vexp_nonpos(x));
        vzs = _mm512_add_ps(vzs, ev);
        vsx = _mm512_fmadd_ps(ev, x, vsx);
        const __m512 mv = _mm512_maskz_loadu_ps(in, mj + j), zv = _mm512_maskz_loadu_ps(in, zj + j);
        const __m512 d = _mm512_sub_ps(sv, mv);
        const __mmask16 up = _mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ) & in;
        const __m512 ed = vexp_nonpos(_mm512_sub_ps(zero, _mm512_abs_ps(d)));  // e^{-|d|}
        const __m512 zn_ = _mm512_mask_blend_ps(up, _mm512_add_ps(zv, ed), _mm512_fmadd_ps(zv, ed, one));
        const __m512 pj = _mm512_maskz_div_ps(in, _mm512_mask_blend_ps(up, ed, one), zn_);
        _mm512_mask_storeu_ps(zj + j, in, zn_);
        _mm512_mask_storeu_ps(mj + j, up, sv);
        _mm512_storeu_ps(e + j, ev);
        _mm512_storeu_ps(pv.data() + j, pj);
        _mm512_storeu_ps(lp.data() + j, _mm512_maskz_mov_ps(in & ~up, d));  // ln P = lp - ln z
        _mm512_storeu_ps(zn.data() + j, _mm512_mask_blend_ps(in, one, zn_));
        vr = _mm512_add_ps(vr, pj);
      }
      const float zs = _mm512_reduce_add_ps(vzs), sx = _mm512_reduce_add_ps(vsx), r = _mm512_reduce_add_ps(vr);
      if (!(r > 1e-30f) || !std::isfinite(sx)) return false;
      zrow[i - i0] = zs;
      const float lz = std::log(zs), lr = std::log(r), iz = 1.f / zs, ir = 1.f / r;
      const float lnt = -mx - lz;  // softmax1: ln t_i; its weights p / (1 + t_i)
      const Vec vr1(L.s1 ? 1.f / (1.f + std::exp(lnt)) : 0.f);
      const Vec viz(iz), vir(ir), vlz(lz), vlr(lr), vmx(mx), vu(uh), vu1(1.f - uh), tiny(1e-37f);
      Vec rs_u(0.f), rs_d(0.f), rs_h(0.f), di_u(0.f), di_d(0.f), di_h(0.f), en_d(0.f), en_h(0.f), js_d(0.f),
          js_h(0.f);
      Vec sp[3][8];
      for (int64_t a = 0; a < 3; ++a)
        for (int64_t b = 0; b < S; ++b) sp[a][b] = Vec(0.f);
      const float base = float(i - lo);
      for (int64_t j = 0; j < wp; j += V) {  // pass B
        const Vec p = Vec::loadu(e + j) * viz;
        const Vec pd = Vec::loadu(pv.data() + j) * vir;
        const Vec ph = at::vec::fmadd(vu1, p, vu * pd);
        const int64_t c = lo + j;
        (Vec::loadu(cu.data() + c) + p).store(cu.data() + c);
        (Vec::loadu(cd.data() + c) + pd).store(cd.data() + c);
        (Vec::loadu(ch.data() + c) + ph).store(ch.data() + c);
        if (L.s1) at::vec::fmadd(p, vr1, Vec::loadu(c1.data() + c)).store(c1.data() + c);
        rs_u = rs_u + p, rs_d = rs_d + pd, rs_h = rs_h + ph;
        const Vec dist = Vec(base - float(j)) - lane;  // i - (lo + j + lane)
        di_u = at::vec::fmadd(p, dist, di_u), di_d = at::vec::fmadd(pd, dist, di_d);
        di_h = at::vec::fmadd(ph, dist, di_h);
        const Vec sj = j + V <= w ? Vec::loadu(s + j) : Vec::loadu(s + j, w - j);  // (no read past the row)
        const Vec lnp = sj - vmx - vlz;  // ln p (finite in the padded lanes, where p = p_d = h = 0)
        const Vec lnd = Vec::loadu(lp.data() + j) - vlog(Vec::loadu(zn.data() + j)) - vlr;
        const Vec lnh = vlog(at::vec::maximum(ph, tiny));
        en_d = at::vec::fmadd(pd, lnd, en_d), en_h = at::vec::fmadd(ph, lnh, en_h);
        js_d = at::vec::fmadd(p + pd, Vec(half_chi(static_cast<__m512>(lnd - lnp))), js_d);
        js_h = at::vec::fmadd(p + ph, Vec(half_chi(static_cast<__m512>(lnh - lnp))), js_h);
        for (int64_t b = 0; b < S; ++b) {
          const Vec t = Vec::loadu(spec.data() + b * NP + c);
          sp[0][b] = at::vec::fmadd(p, t, sp[0][b]), sp[1][b] = at::vec::fmadd(pd, t, sp[1][b]);
          sp[2][b] = at::vec::fmadd(ph, t, sp[2][b]);
        }
      }
      out(L.rowsum, 0)[i] = sum_of(rs_u), out(L.rowsum, 1)[i] = sum_of(rs_d), out(L.rowsum, 2)[i] = sum_of(rs_h);
      out(L.distance, 0)[i] = sum_of(di_u), out(L.distance, 1)[i] = sum_of(di_d);
      out(L.distance, 2)[i] = sum_of(di_h);
      out(L.entropy, 0)[i] = lz - sx * iz;  // -sum p ln p = ln Z - sum p (s - max)
      out(L.entropy, 1)[i] = -sum_of(en_d), out(L.entropy, 2)[i] = -sum_of(en_h);
      L.js[(0 * L.H + h) * N + i] = sum_of(js_d), L.js[(1 * L.H + h) * N + i] = sum_of(js_h);
      if (L.s1) L.s1[h * N + i] = lnt;
      for (int64_t a = 0; a < 3; ++a)
        for (int64_t b = 0; b < S; ++b) L.special[((a * L.H + h) * N + i) * S + b] = sum_of(sp[a][b]);
    }
    if (L.v) {  // the block's attention output: (E v) / Z row by row, from the exponentials while in L2
      const int64_t ni = i1 - i0, Dv = L.Dv;
      gemm_ab(ni, Dv, w0, eblk.data(), ldE, L.v + ((h / L.R) * N + lo0) * Dv, Dv, ob.data(), Dv);
      for (int64_t r = 0; r < ni; ++r) {
        const float iz = 1.f / zrow[r];
        float* o = L.out + (i0 + r) * L.ldo + h * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = ob[r * Dv + d] * iz;
      }
    }
  }
  std::copy(cu.begin(), cu.begin() + N, out(L.cols, 0));
  std::copy(cd.begin(), cd.begin() + N, out(L.cols, 1));
  std::copy(ch.begin(), ch.begin() + N, out(L.cols, 2));
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
