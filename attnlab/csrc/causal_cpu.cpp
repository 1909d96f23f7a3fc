// attnlab CPU kernel: causal DNAS attention (docs/VARIANTS.md "Causal DNAS") in one pass over the
// scores, in SDPA's loop order -- query blocks outer, key chunks inner, each tile's score product,
// exponentials and value product while the tile is in L2.
//
//   causal_dnas(q, k, v, key_bias, row_bias, scale, floor):  (out (BH, M, Dv), redo (BH,) bool)
//       q (BH, M, D), k (BH, N, D), v (BH, N, Dv) with contiguous last dims; key_bias (BH, N) and
//       row_bias (BH, M) 0 / -inf or absent. Key j is visible to query i when j <= i (top-left
//       aligned, as fused.causal_mask). floor is the log-sum-exp of an empty prefix (LSE_FLOOR).
//       Rows of invalid queries and rows with no visible valid key give 0. redo marks the heads
//       where some row's mass underflowed (every visible weight below e^-87 of its column's prefix):
//       the caller recomputes those exactly (rare).
//
// Causal DNAS normalizes column j over the queries up to i: c_ij = logsumexp_{i' <= i} s_i'j (the
// prefix form of Eq. 5's column normalizer), then P_ij = exp(s_ij - c_ij) and pi_ij = P_ij / sum_j
// P_ij. Going down the rows in order, each column carries its running maximum m_j and sum z_j =
// sum_{i' <= i} exp(s_i'j - m_j) (>= 1: the maximum's own term), so with d = s_ij - m_j:
//   s_ij > m_j: z_j <- z_j e^{-d} + 1, m_j <- s_ij, P_ij = 1 / z_j
//   otherwise:  z_j <- z_j + e^{d},              P_ij = e^{d} / z_j
// one exponential per score, e^{-|d|}, and no pass over a column before its rows are used. The
// column states make a head's query blocks sequential: heads go to threads whole, and with fewer
// heads than threads x 4 the keys of a head are split in parts of equal work (rows >= the part's
// first key), each with its own accumulators, summed at the end.
#include "kernel_common.h"

namespace {

// Query rows x keys of one tile: R x C = 2^16 scores (256 KiB of float) in L2.
constexpr int64_t kRows = 128, kKeys = 512;

template <typename T>
struct CausalProblem {
  const T *q, *k, *v, *kb, *rb;
  int64_t BH, M, N, D, Dv, sq_bh, sq_m, sk_bh, sk_n, sv_bh, sv_n;
  T scale, floor;
};

// One row of a tile against keys j0 .. j0 + lim - 1 (all visible): updates the columns' states m, z
// and writes P into row; returns sum_j P_ij. kMasked adds the key bias kb (-inf: e = 0, no change);
// a template argument, not a branch in the loop: the vectorized loop would load kb under a mask, and
// a masked load from a null pointer costs a microcode assist per vector on Zen 3 (2/3 of the time).
template <bool kMasked, typename T>
inline T row_step(T* __restrict row, const T* __restrict kb, T* __restrict m, T* __restrict z, int64_t lim) {
  T sum = 0;
  for (int64_t j = 0; j < lim; ++j) {
    const T s = kMasked ? row[j] + kb[j] : row[j];
    const T d = s - m[j];
    const T e = exp_nonpos(d > 0 ? -d : d);
    const bool up = d > 0;
    const T zn = up ? z[j] * e + T(1) : z[j] + e;
    const T pv = (up ? T(1) : e) / zn;
    z[j] = zn;
    m[j] = up ? s : m[j];
    row[j] = pv;
    sum += pv;
  }
  return sum;
}

// The causal softmax's accumulators of one head (or part) for HNAS: acc (M x Dv) = sum_j e_ij v_j,
// l (M) = sum_j e_ij, mu (M) the running row maxima (e_ij = exp(s_ij - mu_i)).
template <typename T>
struct Softmax {
  T *acc, *l, *mu;
};

// One row of a tile for the causal softmax: s (lim visible scores, the key bias kb added when
// kMasked) -> e (cw, zero beyond lim) = exp(s - mu_i) with mu_i raised to the row's new maximum, and
// l_i and the row's accumulator acc_i (Dv) rescaled to it first.
template <bool kMasked, typename T>
inline void softmax_row(const T* __restrict s, const T* __restrict kb, int64_t lim, int64_t cw, int64_t Dv,
                        T* __restrict e, T& mu, T& l, T* __restrict acc) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < lim; ++j) e[j] = kMasked ? s[j] + kb[j] : s[j];
  const T t = row_max(e, lim);  // kernel_common.h (vectorized)
  if (t > mu) {  // the new maximum: rescale what was summed at the old one (nothing when it was -inf)
    const T f = mu == ninf ? T(0) : std::exp(mu - t);
    l *= f;
    for (int64_t d = 0; d < Dv; ++d) acc[d] *= f;
    mu = t;
  }
  if (mu == ninf) {  // no valid key yet
    std::fill(e, e + cw, T(0));
    return;
  }
  T sum = 0;
  for (int64_t j = 0; j < lim; ++j) {
    const T x = exp_nonpos(e[j] - mu);  // masked keys: exp(-inf) = 0
    e[j] = x;
    sum += x;
  }
  std::fill(e + lim, e + cw, T(0));
  l += sum;
}

// Accumulates acc (M x Dv) and r (M) of head bh over the keys [ja, jb) for every row i >= ja; with sm
// (kHnas) also the causal softmax's, its exponentials through etile.
template <bool kHnas, typename T>
void sweep(const CausalProblem<T>& p, int64_t bh, int64_t ja, int64_t jb, const char* row_ok, T* acc, T* r,
           std::vector<T>& tile, std::vector<T>& m, std::vector<T>& z, const Softmax<T>& sm = {},
           std::vector<T>* etile = nullptr) {
  const int64_t M = p.M, Dv = p.Dv;
  const T* q = p.q + bh * p.sq_bh;
  const T* k = p.k + bh * p.sk_bh;
  const T* v = p.v + bh * p.sv_bh;
  const T* kb = p.kb ? p.kb + bh * p.N : nullptr;
  std::fill(m.begin(), m.begin() + (jb - ja), p.floor);  // the empty prefix: e^floor, as the reference
  std::fill(z.begin(), z.begin() + (jb - ja), T(1));
  for (int64_t i0 = ja; i0 < M; i0 += kRows) {
    const int64_t ni = std::min(kRows, M - i0), jend = std::min(jb, i0 + ni);
    for (int64_t j0 = ja; j0 < jend; j0 += kKeys) {
      const int64_t cw = std::min(kKeys, jend - j0);
      T* x = tile.data();
      gemm_abt(ni, cw, p.D, p.scale, q + i0 * p.sq_m, p.sq_m, k + j0 * p.sk_n, p.sk_n, T(0), x, cw);
      for (int64_t i = 0; i < ni; ++i) {
        T* row = x + i * cw;
        const int64_t gi = i0 + i, lim = std::min(cw, gi - j0 + 1);  // keys j <= gi
        if (!row_ok[gi] || lim <= 0) {
          std::fill(row, row + cw, T(0));
          if constexpr (kHnas) std::fill(etile->data() + i * cw, etile->data() + (i + 1) * cw, T(0));
          continue;
        }
        if constexpr (kHnas) {  // before row_step overwrites the scores with P
          T* e = etile->data() + i * cw;
          T* ai = sm.acc + gi * Dv;
          if (kb) softmax_row<true>(row, kb + j0, lim, cw, Dv, e, sm.mu[gi], sm.l[gi], ai);
          else softmax_row<false>(row, kb, lim, cw, Dv, e, sm.mu[gi], sm.l[gi], ai);
        }
        T* mj = m.data() + (j0 - ja);
        T* zj = z.data() + (j0 - ja);
        r[gi] += kb ? row_step<true>(row, kb + j0, mj, zj, lim) : row_step<false>(row, kb, mj, zj, lim);
        std::fill(row + lim, row + cw, T(0));
      }
      gemm_ab(ni, Dv, cw, x, cw, v + j0 * p.sv_n, p.sv_n, acc + i0 * Dv, Dv, T(1));
      if constexpr (kHnas)  // the causal softmax's value product
        gemm_ab(ni, Dv, cw, etile->data(), cw, v + j0 * p.sv_n, p.sv_n, sm.acc + i0 * Dv, Dv, T(1));
    }
  }
}

// out_i = acc_i / r_i, with sm (HNAS, weight u): u acc_i / r_i + (1 - u) sacc_i / l_i; 0 for invalid rows
// and rows with no visible valid key; true when a row with a valid key has r_i <= kTiny where DNAS
// enters (its weights underflowed). l_i >= 1 there (the row maximum's own term).
template <typename T>
bool finalize(const CausalProblem<T>& p, int64_t bh, const char* row_ok, const T* acc, const T* r, T* o,
              const Softmax<T>* sm = nullptr, T u = T(1)) {
  const T ninf = -std::numeric_limits<T>::infinity();
  int64_t first = 0;  // the first valid key
  if (p.kb)
    while (first < p.N && p.kb[bh * p.N + first] == ninf) ++first;
  bool redo = false;
  for (int64_t i = 0; i < p.M; ++i) {
    T* oi = o + i * p.Dv;
    const bool any = row_ok[i] && first < p.N && first <= i;
    std::fill(oi, oi + p.Dv, T(0));
    if (!any) continue;
    if (u != T(0)) {
      if (!(r[i] > kTiny<T>)) {
        redo = true;
        continue;
      }
      const T w = u / r[i];
      for (int64_t d = 0; d < p.Dv; ++d) oi[d] = acc[i * p.Dv + d] * w;
    }
    if (sm && u != T(1)) {
      const T w = (T(1) - u) / sm->l[i];
      for (int64_t d = 0; d < p.Dv; ++d) oi[d] += sm->acc[i * p.Dv + d] * w;
    }
  }
  return redo;
}

// Merges one part's causal softmax b into another's, a (both of M rows), at their common maximum per row.
template <typename T>
void merge_softmax(const Softmax<T>& a, const Softmax<T>& b, int64_t M, int64_t Dv) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < M; ++i) {
    if (b.mu[i] == ninf) continue;  // the part saw no valid key of this row
    const T mu = std::max(a.mu[i], b.mu[i]);
    const T fa = a.mu[i] == ninf ? T(0) : std::exp(a.mu[i] - mu), fb = std::exp(b.mu[i] - mu);
    a.l[i] = a.l[i] * fa + b.l[i] * fb;
    for (int64_t d = 0; d < Dv; ++d) a.acc[i * Dv + d] = a.acc[i * Dv + d] * fa + b.acc[i * Dv + d] * fb;
    a.mu[i] = mu;
  }
}

// The softmax state of n rows x Dv (HNAS) in one buffer: acc, l, mu (-inf: no key seen)
template <typename T>
struct SoftmaxBuffer {
  std::vector<T> data;
  int64_t M = 0, Dv = 0;
  void reset(int64_t rows, int64_t dv) {
    M = rows, Dv = dv;
    data.assign(rows * (dv + 2), T(0));
    std::fill(data.begin() + rows * (dv + 1), data.end(), -std::numeric_limits<T>::infinity());
  }
  Softmax<T> view() { return {data.data(), data.data() + M * Dv, data.data() + M * (Dv + 1)}; }
};

// u (BH) or null: HNAS with weight u[bh] (causal_hnas), else DNAS.
template <typename T>
void causal_impl(const CausalProblem<T>& p, const T* u, T* out, bool* redo) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t M = p.M, N = p.N, Dv = p.Dv, BH = p.BH;
  const int64_t threads = at::get_num_threads();
  const int64_t P = (BH >= 4 * threads || BH % threads == 0)
                        ? 1
                        : std::min<int64_t>((N + kKeys - 1) / kKeys, (4 * threads + BH - 1) / BH);
  std::vector<char> row_ok(BH * M);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t i = 0; i < M; ++i) row_ok[bh * M + i] = !(p.rb && p.rb[bh * M + i] == ninf);
  // one task's sweep: DNAS's accumulators, and the softmax's when u is given
  auto run = [&](int64_t bh, int64_t ja, int64_t jb, T* acc, T* r, std::vector<T>& tile, std::vector<T>& m,
                 std::vector<T>& z, SoftmaxBuffer<T>* sm, std::vector<T>& etile) {
    if (u) sweep<true>(p, bh, ja, jb, row_ok.data() + bh * M, acc, r, tile, m, z, sm->view(), &etile);
    else sweep<false>(p, bh, ja, jb, row_ok.data() + bh * M, acc, r, tile, m, z);
  };
  // a head's output from its accumulators (sm: its softmax state when u is given)
  auto finish = [&](int64_t bh, const T* acc, const T* r, SoftmaxBuffer<T>* sm) {
    const Softmax<T> view = u ? sm->view() : Softmax<T>{};
    redo[bh] = finalize(p, bh, row_ok.data() + bh * M, acc, r, out + bh * M * Dv, u ? &view : nullptr,
                        u ? u[bh] : T(1));
  };
  if (P == 1) {
    at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
      SerialBlas serial;
      std::vector<T> tile(kRows * kKeys), etile(u ? kRows * kKeys : 0), m(N), z(N), acc(M * Dv), r(M);
      SoftmaxBuffer<T> sm;
      for (int64_t bh = begin; bh < end; ++bh) {
        std::fill(acc.begin(), acc.end(), T(0));
        std::fill(r.begin(), r.end(), T(0));
        if (u) sm.reset(M, Dv);
        run(bh, 0, N, acc.data(), r.data(), tile, m, z, &sm, etile);
        finish(bh, acc.data(), r.data(), &sm);
      }
    });
    return;
  }
  // parts of equal work: key j costs the M - j rows that see it
  std::vector<int64_t> cut(P + 1, N);
  cut[0] = 0;
  double total = 0;
  for (int64_t j = 0; j < N; ++j) total += (double)std::max<int64_t>(M - j, 0);
  double run_work = 0;
  for (int64_t j = 0, part = 1; j < N && part < P; ++j) {
    run_work += (double)std::max<int64_t>(M - j, 0);
    if (run_work >= total * (double)part / (double)P) cut[part++] = j + 1;
  }
  std::vector<T> acc(BH * P * M * Dv, T(0)), r(BH * P * M, T(0));
  std::vector<SoftmaxBuffer<T>> sms(u ? BH * P : 0);
  for (auto& sm : sms) sm.reset(M, Dv);
  at::parallel_for(0, BH * P, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> tile(kRows * kKeys), etile(u ? kRows * kKeys : 0), m(N), z(N);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P, part = task % P;
      if (cut[part] < cut[part + 1])
        run(bh, cut[part], cut[part + 1], acc.data() + task * M * Dv, r.data() + task * M, tile, m, z,
            u ? &sms[task] : nullptr, etile);
    }
  });
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      T* a0 = acc.data() + bh * P * M * Dv;
      T* r0 = r.data() + bh * P * M;
      for (int64_t part = 1; part < P; ++part) {
        for (int64_t e = 0; e < M * Dv; ++e) a0[e] += a0[part * M * Dv + e];
        for (int64_t i = 0; i < M; ++i) r0[i] += r0[part * M + i];
        if (u) merge_softmax(sms[bh * P].view(), sms[bh * P + part].view(), M, Dv);
      }
      finish(bh, a0, r0, u ? &sms[bh * P] : nullptr);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> causal_run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const c10::optional<at::Tensor>& key_bias,
                                              const c10::optional<at::Tensor>& row_bias,
                                              const c10::optional<at::Tensor>& u, double scale, double floor) {
  const QKVSizes z = check_qkv(q, k, v);
  if (u.has_value()) TORCH_CHECK(u->dim() == 1 && u->size(0) == z.BH, "u must be (BH,)");
  auto out = at::zeros({z.BH, z.M, z.Dv}, q.options());
  auto redo = at::zeros({z.BH}, q.options().dtype(at::kBool));
  if (z.BH == 0 || z.M == 0 || z.N == 0 || z.Dv == 0) return {out, redo};
  const at::Tensor kb = operand(key_bias, q.scalar_type()), rb = operand(row_bias, q.scalar_type());
  const at::Tensor uu = u.has_value() ? u->contiguous().to(q.scalar_type()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attend", [&] {
    CausalProblem<scalar_t> p{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              data_or_null<scalar_t>(kb), data_or_null<scalar_t>(rb), z.BH, z.M, z.N, z.D,
                              z.Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                              v.stride(1), (scalar_t)scale, (scalar_t)floor};
    causal_impl<scalar_t>(p, data_or_null<scalar_t>(uu), out.data_ptr<scalar_t>(), redo.data_ptr<bool>());
  });
  return {out, redo};
}

std::tuple<at::Tensor, at::Tensor> causal_dnas(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const c10::optional<at::Tensor>& key_bias,
                                               const c10::optional<at::Tensor>& row_bias, double scale,
                                               double floor) {
  return causal_run(q, k, v, key_bias, row_bias, c10::nullopt, scale, floor);
}

std::tuple<at::Tensor, at::Tensor> causal_hnas(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const c10::optional<at::Tensor>& key_bias,
                                               const c10::optional<at::Tensor>& row_bias, const at::Tensor& u,
                                               double scale, double floor) {
  return causal_run(q, k, v, key_bias, row_bias, u, scale, floor);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("causal_dnas(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, float scale, "
        "float floor) -> (Tensor, Tensor)");
  m.def("causal_hnas(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, Tensor u, float scale, "
        "float floor) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("causal_dnas", &causal_dnas);
  m.impl("causal_hnas", &causal_hnas);
}
