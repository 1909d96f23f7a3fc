// attnlab CPU kernel: DNAS attention (Eq. 5) by column panels -- one score product, one exponential
// per score and one value product per head, with a working set of one M x C panel per thread (in
// cache) whatever N is. DNAS's row normalization is linear, so the output can be accumulated over
// column chunks before any row is complete, and a column chunk's log-sum-exp over the queries is
// complete after its own M x C panel.
//
//   panel_dnas(q, k, v, key_bias, row_bias, scale, panel_bytes):  out (BH, M, Dv)
//       q (BH, M, D), k (BH, N, D), v (BH, N, Dv) with contiguous last dims; key_bias (BH, N) and
//       row_bias (BH, M) 0 / -inf (invalid keys and queries take no part) or absent. Rows of invalid
//       queries and rows with no valid key give 0. panel_bytes bounds one thread's M x C panel
//       (C >= 16 whatever it says).
//
// Per head, before any score: b_j >= max_i s_ij from the norms of q and k (column_bounds, bounds.h). Per
// column chunk J (C keys), by tiles of R rows (R C elements, in L2):
//   pass 1: s = scale q k_J^T + key_bias, x_ij = exp(s_ij - b_j) <= 1 kept in the panel, z_j = sum_i x_ij,
//       so c_j = logsumexp_i s_ij = b_j + log z_j (Eq. 5's column normalizer) and
//       P_ij = exp(s_ij - c_j) = x_ij / z_j, DNAS's column-normalized weight;
//   pass 2: acc_i += sum_j x_ij (v_j / z_j) by BLAS, r_i += sum_j x_ij / z_j.
// A chunk where some column's bound is loose (z_j < e^-10: b_j more than 10 nats above c_j, where
// exp(s - b_j) would lose entries that matter) is redone exactly with the maxima of its tiles
// (accumulate_exact). Finally out_i = acc_i / r_i (Eq. 5's row normalization: pi_ij = P_ij / sum_j
// P_ij). A row with r_i below kTiny (its mass lies > ~46 nats below every column's log-sum-exp) is
// recomputed from its scores exactly (rare). Heads go to threads whole; with fewer heads than
// threads x 4 a head's chunks are split in parts with their own accumulators, summed at the end.
#include "bounds.h"

namespace {

// Rows of one value product in pass 2 (R2 x C of the panel): fewer, larger BLAS calls than the tiles.
constexpr int64_t kValueRows = 1024;

template <typename T>
struct PanelProblem {
  const T *q, *k, *v, *kb, *rb;
  T* out;
  int64_t BH, M, N, D, Dv, sq_bh, sq_m, sk_bh, sk_n, sv_bh, sv_n;
  T scale;
};

// Scratch of one thread: the panel (M x C), tile statistics, scaled values.
template <typename T>
struct PanelScratch {
  std::vector<T> panel, m, z, f, vf, cm, total;
  PanelScratch(int64_t M, int64_t C, int64_t nt, int64_t Dv)
      : panel(M * C), m(nt * C), z(nt * C), f(C), vf(C * Dv), cm(C), total(C) {}
};

// vf (cw x Dv) = diag(f) v_J: the values of a chunk scaled by the columns' factors.
template <typename T>
void scale_values(const T* f, const T* vJ, int64_t sv_n, int64_t cw, int64_t Dv, T* vf) {
  for (int64_t j = 0; j < cw; ++j)
    for (int64_t d = 0; d < Dv; ++d) vf[j * Dv + d] = f[j] * vJ[j * sv_n + d];
}

// acc (ni x Dv) += x (ni x cw) vf by BLAS, r (ni) += x f: pass 2 on ni rows of the panel.
template <typename T>
void add_products(const T* x, int64_t ni, int64_t cw, const T* f, const T* vf, int64_t Dv, T* acc, T* r) {
  gemm_ab(ni, Dv, cw, x, cw, vf, Dv, acc, Dv, T(1));
  for (int64_t i = 0; i < ni; ++i) {
    const T* row = x + i * cw;
    T s = 0;
    for (int64_t j = 0; j < cw; ++j) s += row[j] * f[j];
    r[i] += s;
  }
}

// accumulate's exact form: each tile shifted by its own column maxima m_tj (one more sweep over the
// tile, and v scaled per tile by f_tj = exp(m_tj - c_j)). Accumulates acc (M x Dv) and r (M) over the
// column chunks of [ja, jb) of head bh, writing the columns' log-sum-exp into c (N, this head's).
template <typename T>
void accumulate_exact(const PanelProblem<T>& p, int64_t bh, int64_t ja, int64_t jb, int64_t C, int64_t R,
                const char* row_ok, T* acc, T* r, T* c, PanelScratch<T>& w) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t M = p.M, Dv = p.Dv, nt = (M + R - 1) / R;
  const T* q = p.q + bh * p.sq_bh;
  const T* k = p.k + bh * p.sk_bh;
  const T* v = p.v + bh * p.sv_bh;
  const T* kb = p.kb ? p.kb + bh * p.N : nullptr;
  for (int64_t j0 = ja; j0 < jb; j0 += C) {
    const int64_t cw = std::min(C, jb - j0);
    // pass 1: scores of the tile, tile column maxima, x = exp(s - m), tile column sums
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t i0 = t * R, ni = std::min(R, M - i0);
      T* x = w.panel.data() + i0 * cw;
      gemm_abt(ni, cw, p.D, p.scale, q + i0 * p.sq_m, p.sq_m, k + j0 * p.sk_n, p.sk_n, T(0), x, cw);
      T* m = w.m.data() + t * cw;
      T* z = w.z.data() + t * cw;
      std::fill(m, m + cw, ninf);
      std::fill(z, z + cw, T(0));
      for (int64_t i = 0; i < ni; ++i) {
        T* row = x + i * cw;
        if (kb)
          for (int64_t j = 0; j < cw; ++j) row[j] += kb[j0 + j];
        if (!row_ok[i0 + i]) continue;
        for (int64_t j = 0; j < cw; ++j) m[j] = row[j] > m[j] ? row[j] : m[j];
      }
      T* safe = w.f.data();
      for (int64_t j = 0; j < cw; ++j) safe[j] = m[j] == ninf ? T(0) : m[j];
      for (int64_t i = 0; i < ni; ++i) {
        T* row = x + i * cw;
        if (!row_ok[i0 + i]) {
          std::fill(row, row + cw, T(0));
          continue;
        }
        for (int64_t j = 0; j < cw; ++j) {
          const T e = exp_nonpos(row[j] - safe[j]);  // exp(-inf) = 0: masked keys
          row[j] = e;
          z[j] += e;
        }
      }
    }
    // c_j over the tiles
    T* cm = w.cm.data();
    T* total = w.total.data();
    std::fill(cm, cm + cw, ninf);
    std::fill(total, total + cw, T(0));
    for (int64_t t = 0; t < nt; ++t) {
      const T* m = w.m.data() + t * cw;
      for (int64_t j = 0; j < cw; ++j) cm[j] = m[j] > cm[j] ? m[j] : cm[j];
    }
    for (int64_t t = 0; t < nt; ++t) {
      const T* m = w.m.data() + t * cw;
      const T* z = w.z.data() + t * cw;
      for (int64_t j = 0; j < cw; ++j) total[j] += z[j] * exp_nonpos(m[j] == ninf ? ninf : m[j] - cm[j]);
    }
    for (int64_t j = 0; j < cw; ++j) c[j0 + j] = cm[j] == ninf ? ninf : cm[j] + std::log(total[j]);
    // pass 2: acc += x diag(f) v_J, r += x f, tile by tile
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t i0 = t * R, ni = std::min(R, M - i0);
      const T* m = w.m.data() + t * cw;
      T* f = w.f.data();
      bool any = false;
      for (int64_t j = 0; j < cw; ++j) {
        f[j] = m[j] == ninf ? T(0) : exp_nonpos(m[j] - c[j0 + j]);
        any = any || m[j] != ninf;
      }
      if (!any) continue;
      scale_values(f, v + j0 * p.sv_n, p.sv_n, cw, Dv, w.vf.data());
      add_products(w.panel.data() + i0 * cw, ni, cw, f, w.vf.data(), Dv, acc + i0 * Dv, r + i0);
    }
  }
}

// Accumulates acc (M x Dv) and r (M) over the column chunks of [ja, jb) of head bh with the column
// bounds bnd (N, this head's), writing the columns' log-sum-exp into c (N, this head's); a chunk
// with a loose bound goes to accumulate_exact.
template <typename T>
void accumulate(const PanelProblem<T>& p, int64_t bh, int64_t ja, int64_t jb, int64_t C, int64_t R,
                const char* row_ok, const T* bnd, T* acc, T* r, T* c, PanelScratch<T>& w) {
  const int64_t M = p.M, Dv = p.Dv;
  const T* k = p.k + bh * p.sk_bh;
  const T* v = p.v + bh * p.sv_bh;
  for (int64_t j0 = ja; j0 < jb; j0 += C) {
    const int64_t cw = std::min(C, jb - j0);
    T *z = w.z.data(), *b = w.cm.data(), *f = w.f.data();
    // pass 1: x = exp(s - b) in the panel, z = its column sums
    bound_panel(p.q + bh * p.sq_bh, p.sq_m, M, k + j0 * p.sk_n, p.sk_n, cw, p.D, p.scale,
                p.kb ? p.kb + bh * p.N + j0 : nullptr, bnd + j0, row_ok, R, w.panel.data(), z, b);
    if (chunk_factors(bnd + j0, b, z, cw, f, c + j0)) {
      accumulate_exact(p, bh, j0, j0 + cw, C, R, row_ok, acc, r, c, w);
      continue;
    }
    // pass 2: acc += x diag(f) v_J, r += x f
    scale_values(f, v + j0 * p.sv_n, p.sv_n, cw, Dv, w.vf.data());
    for (int64_t i0 = 0; i0 < M; i0 += kValueRows)
      add_products(w.panel.data() + i0 * cw, std::min(kValueRows, M - i0), cw, f, w.vf.data(), Dv, acc + i0 * Dv,
                   r + i0);
  }
}

// out_i = acc_i / r_i; invalid rows 0; rows with r_i <= kTiny from their scores, exactly.
template <typename T>
void finalize(const PanelProblem<T>& p, int64_t bh, const char* row_ok, const T* acc, const T* r,
              const T* c, T* o) {
  const int64_t N = p.N, Dv = p.Dv;
  std::vector<T> x;
  for (int64_t i = 0; i < p.M; ++i) {
    T* oi = o + i * Dv;
    if (!row_ok[i]) {
      std::fill(oi, oi + Dv, T(0));
      continue;
    }
    if (r[i] > kTiny<T>) {
      const T inv = T(1) / r[i];
      for (int64_t d = 0; d < Dv; ++d) oi[d] = acc[i * Dv + d] * inv;
      continue;
    }
    // rare: softmax_j(s_ij - c_j) from the row's scores (all 0 when no key is valid)
    x.resize(N);
    row_scores(p.q + bh * p.sq_bh + i * p.sq_m, p.k + bh * p.sk_bh, p.sk_n, N, p.D, p.scale,
               p.kb ? p.kb + bh * N : nullptr, x.data());
    if (!exact_row(x.data(), c, N)) {
      std::fill(oi, oi + Dv, T(0));
      continue;
    }
    gemm_ab(1, Dv, N, x.data(), N, p.v + bh * p.sv_bh, p.sv_n, oi, Dv);
  }
}

template <typename T>
void panel_impl(const PanelProblem<T>& p, int64_t panel_elems) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t M = p.M, N = p.N, Dv = p.Dv, BH = p.BH;
  const int64_t C = panel_keys(M, N, panel_elems);
  const int64_t R = std::max<int64_t>(8, std::min<int64_t>(M, kTileElems / C));
  const int64_t nt = (M + R - 1) / R, nc = (N + C - 1) / C;
  const int64_t threads = at::get_num_threads();
  // parts per head: 1 when the heads alone keep every thread busy, else split the chunks
  const int64_t P = (BH >= 4 * threads || BH % threads == 0)
                        ? 1
                        : std::min<int64_t>(nc, (4 * threads + BH - 1) / BH);
  std::vector<char> row_ok(BH * M);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t i = 0; i < M; ++i) row_ok[bh * M + i] = !(p.rb && p.rb[bh * M + i] == ninf);
  std::vector<T> c(BH * N), bnd(BH * N);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      column_bounds(p.q + bh * p.sq_bh, p.sq_m, M, p.k + bh * p.sk_bh, p.sk_n, N, p.D, p.scale,
                    p.kb ? p.kb + bh * N : nullptr, row_ok.data() + bh * M, bnd.data() + bh * N);
  });
  if (P == 1) {
    at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
      SerialBlas serial;
      PanelScratch<T> w(M, C, nt, Dv);
      std::vector<T> acc(M * Dv), r(M);
      for (int64_t bh = begin; bh < end; ++bh) {
        std::fill(acc.begin(), acc.end(), T(0));
        std::fill(r.begin(), r.end(), T(0));
        accumulate(p, bh, 0, N, C, R, row_ok.data() + bh * M, bnd.data() + bh * N, acc.data(), r.data(),
                   c.data() + bh * N, w);
        finalize(p, bh, row_ok.data() + bh * M, acc.data(), r.data(), c.data() + bh * N, p.out + bh * M * Dv);
      }
    });
    return;
  }
  std::vector<T> acc(BH * P * M * Dv, T(0)), r(BH * P * M, T(0));
  at::parallel_for(0, BH * P, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    PanelScratch<T> w(M, C, nt, Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P, part = task % P;
      const int64_t ja = (nc * part / P) * C, jb = std::min(N, (nc * (part + 1) / P) * C);
      if (ja >= jb) continue;
      accumulate(p, bh, ja, jb, C, R, row_ok.data() + bh * M, bnd.data() + bh * N, acc.data() + task * M * Dv,
                 r.data() + task * M, c.data() + bh * N, w);
    }
  });
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      T* a0 = acc.data() + bh * P * M * Dv;
      T* r0 = r.data() + bh * P * M;
      for (int64_t part = 1; part < P; ++part) {
        const T* a = a0 + part * M * Dv;
        const T* rp = r0 + part * M;
        for (int64_t e = 0; e < M * Dv; ++e) a0[e] += a[e];
        for (int64_t i = 0; i < M; ++i) r0[i] += rp[i];
      }
      finalize(p, bh, row_ok.data() + bh * M, a0, r0, c.data() + bh * N, p.out + bh * M * Dv);
    }
  });
}

at::Tensor panel_dnas(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& key_bias, const c10::optional<at::Tensor>& row_bias,
                      double scale, int64_t panel_bytes) {
  const QKVSizes z = check_qkv(q, k, v);
  const int64_t BH = z.BH, M = z.M, N = z.N, D = z.D, Dv = z.Dv;
  auto out = at::empty({BH, M, Dv}, q.options());
  if (BH == 0 || M == 0 || N == 0) return out.zero_();
  const at::Tensor kb = operand(key_bias, q.scalar_type()), rb = operand(row_bias, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "panel_dnas", [&] {
    PanelProblem<scalar_t> p{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                             data_or_null<scalar_t>(kb), data_or_null<scalar_t>(rb), out.data_ptr<scalar_t>(),
                             BH, M, N, D, Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                             v.stride(1), (scalar_t)scale};
    panel_impl<scalar_t>(p, panel_bytes / (int64_t)sizeof(scalar_t));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("panel_dnas(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, float scale, "
        "int panel_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("panel_dnas", &panel_dnas); }
