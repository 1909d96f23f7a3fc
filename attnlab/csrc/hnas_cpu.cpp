// attnlab CPU kernel: HNAS attention (Eq. 12) with each head's bound-shifted scores written once in
// column panels and read once -- one score product, one exponential per score, one value product.
//
//   panel_hnas(q, k, v, key_bias, row_bias, u, scale, panel_bytes):  (out (BH, M, Dv), done (BH,) bool)
//       q (BH, M, D), k (BH, N, D), v (BH, N, Dv) with contiguous last dims; key_bias (BH, N) and
//       row_bias (BH, M) 0 / -inf or absent; u (BH,) the weight of DNAS in the mix. Rows of invalid
//       queries and rows with no valid key give 0. done[bh] is false where some column's bound was
//       loose (below): that head's rows are left for the caller (held_attend does them exactly).
//
// Per head (both threads on it; the head's M x N panels are its one buffer), with the column bounds
// b_j (bounds.h) and B = max_j b_j:
//   phase A, column chunks of C keys in parallel: x_ij = exp(s_ij - b_j) for the chunk's M x C panel
//       (bound_panel), f_j = 1 / z_j, and while the panel is in cache the row sums
//       td_i += sum_j x_ij f_j  (DNAS: x_ij f_j = exp(s_ij - c_j), Eq. 5) and
//       tu_i += sum_j x_ij h_j  (UNAS: h_j = exp(b_j - B), x_ij h_j = exp(s_ij - B), Eq. 1);
//   phase B, row blocks in parallel: w_ij = x_ij (a_i h_j + b_i f_j) with a_i = (1 - u) / tu_i and
//       b_i = u / td_i (Eq. 12: pi = (1 - u) pi_unas + u pi_dnas), out = w v by BLAS, R x 1024 at a time.
// The held kernel needs its scores three times (a sweep for maxima, one for the row sums, one for the
// weights); here phase A's row sums come from the panel while it is in cache, so the buffer is written
// once and read once. A row whose tu_i or td_i falls below kTiny (its mass > ~46 nats below B, or
// below every column's log-sum-exp) is recomputed from its scores, exactly.
#include "bounds.h"

#include <memory>

namespace {

// Phase B's rows per block and keys per value product.
constexpr int64_t kHnasRows = 64, kHnasKeys = 1024;

template <typename T>
struct HnasProblem {
  const T *q, *k, *v, *kb, *rb, *u;
  T* out;
  int64_t BH, M, N, D, Dv, sq_bh, sq_m, sk_bh, sk_n, sv_bh, sv_n;
  T scale;
};

// Row i of head bh exactly (exact_mix_row): pi = u softmax_j(s_ij - c_j) + (1 - u) softmax_j(s_ij),
// out_i = pi v.
template <typename T>
void exact_hnas_row(const HnasProblem<T>& p, int64_t bh, int64_t i, const T* c, T uu, T* x, T* y, T* o) {
  row_scores(p.q + bh * p.sq_bh + i * p.sq_m, p.k + bh * p.sk_bh, p.sk_n, p.N, p.D, p.scale,
             p.kb ? p.kb + bh * p.N : nullptr, x);
  exact_mix_row(x, y, c, p.N, uu);
  gemm_ab(1, p.Dv, p.N, x, p.N, p.v + bh * p.sv_bh, p.sv_n, o, p.Dv);
}

// One head; false where a column's bound was loose (nothing written to its rows then).
template <typename T>
bool hnas_head(const HnasProblem<T>& p, int64_t bh, int64_t C, T* held, std::vector<T>& part) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t M = p.M, N = p.N, Dv = p.Dv, threads = at::get_num_threads();
  const T* q = p.q + bh * p.sq_bh;
  const T* k = p.k + bh * p.sk_bh;
  const T* kb = p.kb ? p.kb + bh * N : nullptr;
  const T uu = p.u[bh];
  std::vector<char> row_ok(M);
  for (int64_t i = 0; i < M; ++i) row_ok[i] = !(p.rb && p.rb[bh * M + i] == ninf);
  std::vector<T> bnd(N), h(N), f(N), c(N);
  column_bounds(q, p.sq_m, M, k, p.sk_n, N, p.D, p.scale, kb, row_ok.data(), bnd.data());
  const T B = row_max(bnd.data(), N);
  T* o = p.out + bh * M * Dv;
  if (B == ninf) {  // no valid key or no valid query: every row 0
    std::fill(o, o + M * Dv, T(0));
    return true;
  }
  for (int64_t j = 0; j < N; ++j) h[j] = exp_nonpos(bnd[j] - B);  // bnd = -inf: 0
  // phase A: panels, column factors, per-thread row sums (td, tu) in part (threads x 2M)
  if (!held_panels(q, p.sq_m, M, k, p.sk_n, N, p.D, p.scale, kb, row_ok.data(), bnd.data(), C, held, f.data(),
                   c.data(), h.data(), part))
    return false;
  std::vector<T> a1(M), a2(M);
  std::vector<int64_t> exact;  // rows from their scores (rare)
  for (int64_t i = 0; i < M; ++i) {
    T td = 0, tu = 0;
    for (int64_t t = 0; t < threads; ++t) {
      td += part[t * 2 * M + i];
      tu += part[t * 2 * M + M + i];
    }
    a1[i] = a2[i] = T(0);
    if (!row_ok[i]) continue;
    const bool ok_d = uu == T(0) || td > kTiny<T>, ok_u = uu == T(1) || tu > kTiny<T>;
    if (!(ok_d && ok_u)) {
      exact.push_back(i);
      continue;
    }
    a2[i] = uu == T(0) ? T(0) : uu / td;
    a1[i] = uu == T(1) ? T(0) : (T(1) - uu) / tu;
  }
  // phase B: w = x (a h + b f) by blocks of rows and keys, out += w v
  const int64_t nr = (M + kHnasRows - 1) / kHnasRows;
  at::parallel_for(0, nr, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> w(kHnasRows * (kHnasKeys + C));
    for (int64_t rb = begin; rb < end; ++rb) {
      const int64_t i0 = rb * kHnasRows, ni = std::min(kHnasRows, M - i0);
      for (int64_t g0 = 0; g0 < N; ) {  // a group of whole chunks, about kHnasKeys keys
        int64_t g1 = g0;
        while (g1 < N && g1 - g0 < kHnasKeys) g1 = std::min(N, g1 + C);
        const int64_t gw = g1 - g0;
        for (int64_t j0 = g0; j0 < g1; j0 += C) {
          const int64_t cw = std::min(C, N - j0);
          const T* x = held + j0 * M + i0 * cw;
          const T* hj = h.data() + j0;
          const T* fj = f.data() + j0;
          for (int64_t i = 0; i < ni; ++i) {
            const T a = a1[i0 + i], b = a2[i0 + i];
            const T* row = x + i * cw;
            T* wr = w.data() + i * gw + (j0 - g0);
            for (int64_t j = 0; j < cw; ++j) wr[j] = row[j] * (a * hj[j] + b * fj[j]);
          }
        }
        gemm_ab(ni, Dv, gw, w.data(), gw, p.v + bh * p.sv_bh + g0 * p.sv_n, p.sv_n, o + i0 * Dv, Dv,
                g0 == 0 ? T(0) : T(1));
        g0 = g1;
      }
    }
  });
  std::vector<T> x(N), y(N);
  for (const int64_t i : exact) exact_hnas_row(p, bh, i, c.data(), uu, x.data(), y.data(), o + i * Dv);
  return true;
}

std::tuple<at::Tensor, at::Tensor> panel_hnas(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const c10::optional<at::Tensor>& key_bias,
                                              const c10::optional<at::Tensor>& row_bias, const at::Tensor& u,
                                              double scale, int64_t panel_bytes) {
  const QKVSizes z = check_qkv(q, k, v);
  TORCH_CHECK(u.dim() == 1 && u.size(0) == z.BH, "u must be (BH,)");
  auto out = at::zeros({z.BH, z.M, z.Dv}, q.options());
  auto done = at::ones({z.BH}, q.options().dtype(at::kBool));
  if (z.BH == 0 || z.M == 0 || z.N == 0 || z.Dv == 0) return {out, done};
  const at::Tensor kb = operand(key_bias, q.scalar_type()), rb = operand(row_bias, q.scalar_type()),
                   uu = u.contiguous().to(q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "panel_hnas", [&] {
    HnasProblem<scalar_t> p{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                           data_or_null<scalar_t>(kb), data_or_null<scalar_t>(rb), uu.data_ptr<scalar_t>(),
                           out.data_ptr<scalar_t>(), z.BH, z.M, z.N, z.D, z.Dv, q.stride(0), q.stride(1),
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1), (scalar_t)scale};
    const int64_t C = panel_keys(z.M, z.N, panel_bytes / (int64_t)sizeof(scalar_t));
    HeldBuffer<scalar_t> held(z.M * z.N);
    std::vector<scalar_t> part(at::get_num_threads() * 2 * z.M);
    bool* d = done.data_ptr<bool>();
    for (int64_t bh = 0; bh < z.BH; ++bh) d[bh] = hnas_head(p, bh, C, held.get(), part);
  });
  return {out, done};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("panel_hnas(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, Tensor u, float scale, "
        "int panel_bytes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("panel_hnas", &panel_hnas); }
