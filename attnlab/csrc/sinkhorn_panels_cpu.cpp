// attnlab CPU kernel: Sinkhorn attention (Eq. 10, k rounds) from one head's bound-shifted panels
// (bounds.h), written once and read once per round.
//
//   panel_sinkhorn(q, k, v, key_bias, row_bias, iters, scale, panel_bytes):  (out (BH, M, Dv), done (BH,))
//       q (BH, M, D), k (BH, N, D), v (BH, N, Dv) with contiguous last dims; key_bias (BH, N) and
//       row_bias (BH, M) 0 / -inf or absent; iters >= 1. Rows of invalid queries give 0. done[bh] is
//       false where a column's bound was loose or a row's or a column's sum left the float range:
//       that head is left for the caller (held_attend does it exactly).
//
// With x_ij = exp(s_ij - b_j) held (held_panels: phase A, which also gives the DNAS row sums) and a
// column factor f_j, x_ij f_j = exp(s_ij - c_j) for the current column potential c_j = b_j - log f_j:
//   round 1's row step is phase A's row sums l_i = sum_j x_ij / z_j (f = 1 / z: c = Eq. 5's);
//   a column step is g_j = sum_i x_ij / l_i, then f_j <- (M_valid / N_valid) / g_j (c_j += log of the
//       column mass f_j g_j, re-centred by log(M_valid / N_valid) as held_attend, so c does not drift);
//   a row step is l_i = sum_j x_ij f_j. A round is one pass over the panels in order, each panel's
//       M x cw floats contiguous: its column step, then (from L2) its part of the next row step --
//       the column step needs only that panel's rows, the row step only that panel's new f. (By
//       blocks of rows instead, every block read cw floats from each of N / cw panels: a TLB miss and
//       a new prefetch stream per piece, ~8 GB/s here; in panel order a round runs near memory speed.)
//   the output: out_i = sum_j x_ij f_j v_j / l_i -- one value product by BLAS per chunk with diag(f) v,
//       and the row sums from the same rows while they are in cache.
// held_attend (held_cpu.cpp) reads its buffer once more (its last phase sums each row before it builds
// the weights): here the row normalization is applied after the value product.
#include "bounds.h"

#include <memory>

namespace {

// Rows per value product.
constexpr int64_t kOutRows = 256;

template <typename T>
struct SinkhornProblem {
  const T *q, *k, *v, *kb, *rb;
  T* out;
  int64_t BH, M, N, D, Dv, sq_bh, sq_m, sk_bh, sk_n, sv_bh, sv_n, iters;
  T scale;
};

// One head; false where it is left to the caller.
template <typename T>
bool sinkhorn_head(const SinkhornProblem<T>& p, int64_t bh, int64_t C, T* held, std::vector<T>& part) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t M = p.M, N = p.N, Dv = p.Dv, nc = (N + C - 1) / C, threads = at::get_num_threads();
  const T* kb = p.kb ? p.kb + bh * N : nullptr;
  std::vector<char> row_ok(M);
  int64_t m_valid = 0, n_valid = 0;
  for (int64_t i = 0; i < M; ++i) {
    row_ok[i] = !(p.rb && p.rb[bh * M + i] == ninf);
    m_valid += row_ok[i];
  }
  for (int64_t j = 0; j < N; ++j) n_valid += !(kb && kb[j] == ninf);
  std::vector<T> bnd(N), f(N), c(N), l(M), w(M);
  const T* q = p.q + bh * p.sq_bh;
  const T* k = p.k + bh * p.sk_bh;
  column_bounds(q, p.sq_m, M, k, p.sk_n, N, p.D, p.scale, kb, row_ok.data(), bnd.data());
  T* o = p.out + bh * M * Dv;
  if (row_max(bnd.data(), N) == ninf) {  // no valid key or no valid query: every row 0
    std::fill(o, o + M * Dv, T(0));
    return true;
  }
  if (!held_panels(q, p.sq_m, M, k, p.sk_n, N, p.D, p.scale, kb, row_ok.data(), bnd.data(), C, held, f.data(),
                   c.data(), (const T*)nullptr, part))
    return false;
  auto gather_rows = [&] {  // l_i = the threads' parts of a row step
    for (int64_t i = 0; i < M; ++i) {
      T s = 0;
      for (int64_t t = 0; t < threads; ++t) s += part[t * 2 * M + i];
      l[i] = s;
    }
  };
  gather_rows();
  const T rc = T(m_valid) / T(n_valid);
  auto rows_ok = [&] {
    for (int64_t i = 0; i < M; ++i)
      if (row_ok[i] && !(l[i] > kTiny<T> && std::isfinite(l[i]))) return false;
    return true;
  };
  // Rounds 2..iters, panel by panel (each panel's M x cw floats are contiguous: read in order, then
  // once more from L2): the column step g_j = sum_i x_ij w_i (w_i = 1 / l_i on valid rows), f_j =
  // rc / g_j, then, unless it is the last round (the value pass takes that row step), the next row
  // step's part sum_{j in J} x_ij f_j into the thread's row sums.
  for (int64_t round = 1; round < p.iters; ++round) {
    if (!rows_ok()) return false;
    for (int64_t i = 0; i < M; ++i) w[i] = row_ok[i] && l[i] > kTiny<T> ? T(1) / l[i] : T(0);
    const bool row_step = round + 1 < p.iters;
    if (row_step) std::fill(part.begin(), part.end(), T(0));
    std::atomic<bool> bad{false};
    at::parallel_for(0, nc, 1, [&](int64_t begin, int64_t end) {
      T* lt = part.data() + at::get_thread_num() * 2 * M;
      std::vector<T> gj(C);
      for (int64_t J = begin; J < end; ++J) {
        const int64_t j0 = J * C, cw = std::min(C, N - j0);
        const T* x = held + j0 * M;
        std::fill(gj.begin(), gj.begin() + cw, T(0));
        for (int64_t i = 0; i < M; ++i) {
          const T* row = x + i * cw;
          const T wi = w[i];
          for (int64_t j = 0; j < cw; ++j) gj[j] += row[j] * wi;
        }
        T* fj = f.data() + j0;
        for (int64_t j = 0; j < cw; ++j) {
          if (fj[j] == T(0)) continue;  // a masked column
          fj[j] = rc / gj[j];
          if (!(std::isfinite(fj[j]) && fj[j] > T(0))) bad = true;
        }
        if (row_step) add_row_dots(x, M, cw, fj, lt);  // bounds.h
      }
    });
    if (bad) return false;
    if (row_step) gather_rows();
  }
  // out = diag(1 / l) x diag(f) v, with l from the same rows (the last row step)
  std::vector<T> vf(N * Dv);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t d = 0; d < Dv; ++d) vf[j * Dv + d] = f[j] * p.v[bh * p.sv_bh + j * p.sv_n + d];
  std::fill(l.begin(), l.end(), T(0));
  at::parallel_for(0, (M + kOutRows - 1) / kOutRows, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t i0 = blk * kOutRows, ni = std::min(kOutRows, M - i0);
      for (int64_t j0 = 0; j0 < N; j0 += C) {
        const int64_t cw = std::min(C, N - j0);
        const T* x = held + j0 * M + i0 * cw;
        gemm_ab(ni, Dv, cw, x, cw, vf.data() + j0 * Dv, Dv, o + i0 * Dv, Dv, j0 == 0 ? T(0) : T(1));
        add_row_dots(x, ni, cw, f.data() + j0, l.data() + i0);
      }
    }
  });
  if (!rows_ok()) return false;
  for (int64_t i = 0; i < M; ++i) {
    T* oi = o + i * Dv;
    const T inv = row_ok[i] ? T(1) / l[i] : T(0);
    for (int64_t d = 0; d < Dv; ++d) oi[d] = row_ok[i] ? oi[d] * inv : T(0);
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> panel_sinkhorn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const c10::optional<at::Tensor>& key_bias,
                                                  const c10::optional<at::Tensor>& row_bias, int64_t iters,
                                                  double scale, int64_t panel_bytes) {
  const QKVSizes z = check_qkv(q, k, v);
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  auto out = at::zeros({z.BH, z.M, z.Dv}, q.options());
  auto done = at::ones({z.BH}, q.options().dtype(at::kBool));
  if (z.BH == 0 || z.M == 0 || z.N == 0 || z.Dv == 0) return {out, done};
  const at::Tensor kb = operand(key_bias, q.scalar_type()), rb = operand(row_bias, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "panel_sinkhorn", [&] {
    SinkhornProblem<scalar_t> p{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                data_or_null<scalar_t>(kb), data_or_null<scalar_t>(rb), out.data_ptr<scalar_t>(),
                                z.BH, z.M, z.N, z.D, z.Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                v.stride(0), v.stride(1), iters, (scalar_t)scale};
    const int64_t C = panel_keys(z.M, z.N, panel_bytes / (int64_t)sizeof(scalar_t));
    HeldBuffer<scalar_t> held(z.M * z.N);
    std::vector<scalar_t> part(at::get_num_threads() * 2 * z.M);
    bool* d = done.data_ptr<bool>();
    for (int64_t bh = 0; bh < z.BH; ++bh) d[bh] = sinkhorn_head(p, bh, C, held.get(), part);
  });
  return {out, done};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("panel_sinkhorn(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, int iters, "
        "float scale, int panel_bytes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("panel_sinkhorn", &panel_sinkhorn); }
