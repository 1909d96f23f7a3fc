// attnlab CPU kernels: log-sum-exp passes and the hybrid (UNAS + DNAS) output pass, without the
// (M, N) score matrix. Each task computes one score panel with BLAS (MKL's sgemm_/dgemm_, shipped in
// libtorch_cpu) into a thread-local buffer and reduces it while it is still in cache.
//
//   col_lse(a, b, row_bias, scale):  c[bh, j] = log sum_i exp(scale * a_i . b_j + row_bias_i)
//       a (BH, M, D), b (BH, N, D), row_bias (BH, M) or empty  ->  c (BH, N); an empty column: -inf.
//       DNAS's column LSE (Eq. 5) is col_lse(q, k); the row LSE of a Sinkhorn half-step (Eq. 10)
//       is col_lse(k, q, -c).
//   mix_attend(q, k, v, key_bias, dnas_bias, u, scale):  out (BH, M, Dv) =
//       (1 - u) softmax_j(s_ij + key_bias_j) v + u softmax_j(s_ij + key_bias_j + dnas_bias_j) v
//       with s = scale q k^T; key_bias (BH, N) 0/-inf (key padding) or empty; u (BH,) -- HNAS
//       (Eq. 12) with dnas_bias = -c; u = 1 gives DNAS or Sinkhorn with its potentials. Rows whose
//       keys are all masked give 0.
//   sinkhorn_round(q, k, c, key_bias, row_bias, scale): the next column potential c' (BH, N) of
//       Sinkhorn (Eq. 10) after a row step with column potentials c (see sinkhorn_round_impl).
//   sinkhorn_attend(q, k, v, key_bias, row_bias, iters, scale): Sinkhorn attention output (BH, M, Dv)
//       with each head's scores held once (see sinkhorn_heads_impl).
//
#include "kernel_common.h"

namespace {

constexpr int64_t kRowBlock = 64;     // rows of a score panel in col_lse
constexpr int64_t kColBlock = 512;    // columns owned by one col_lse task
constexpr int64_t kPanelElems = 1 << 17;  // mix_attend panel budget (rows * N), 512 KiB of float

template <typename T>
void col_lse_impl(const T* a, const T* b, const T* rb, T* out, int64_t BH, int64_t M, int64_t N,
                  int64_t D, int64_t sa_bh, int64_t sa_m, int64_t sb_bh, int64_t sb_n, T scale) {
  const int64_t n_chunks = (N + kColBlock - 1) / kColBlock;
  const T ninf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, BH * n_chunks, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> panel(kRowBlock * kColBlock), run_max(kColBlock), run_sum(kColBlock), blk_max(kColBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_chunks, j0 = (task % n_chunks) * kColBlock;
      const int64_t nj = std::min(kColBlock, N - j0);
      const T* bp = b + bh * sb_bh + j0 * sb_n;
      const T* rbp = rb ? rb + bh * M : nullptr;
      std::fill(run_max.begin(), run_max.begin() + nj, ninf);
      std::fill(run_sum.begin(), run_sum.begin() + nj, T(0));
      for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
        const int64_t ni = std::min(kRowBlock, M - i0);
        gemm_abt(ni, nj, D, scale, a + bh * sa_bh + i0 * sa_m, sa_m, bp, sb_n, T(0), panel.data(), nj);
        std::fill(blk_max.begin(), blk_max.begin() + nj, ninf);
        for (int64_t i = 0; i < ni; ++i) {  // add the row bias; column maxima of the panel
          T* row = panel.data() + i * nj;
          const T bias = rbp ? rbp[i0 + i] : T(0);
          T* bm = blk_max.data();
          for (int64_t j = 0; j < nj; ++j) {
            row[j] += bias;
            bm[j] = row[j] > bm[j] ? row[j] : bm[j];
          }
        }
        T* rm = run_max.data();
        T* rs = run_sum.data();
        T* bm = blk_max.data();
        for (int64_t j = 0; j < nj; ++j) {  // rescale the running sums to the new maxima
          const T m_new = bm[j] > rm[j] ? bm[j] : rm[j];
          const T safe = m_new == ninf ? T(0) : m_new;
          rs[j] *= exp_nonpos(rm[j] - safe);
          rm[j] = m_new;
          bm[j] = safe;
        }
        for (int64_t i = 0; i < ni; ++i) {
          const T* row = panel.data() + i * nj;
          for (int64_t j = 0; j < nj; ++j) rs[j] += exp_nonpos(row[j] - bm[j]);
        }
      }
      T* o = out + bh * N + j0;
      for (int64_t j = 0; j < nj; ++j) o[j] = run_max[j] == ninf ? ninf : run_max[j] + std::log(run_sum[j]);
    }
  });
}

// One row block per task: s = scale q k^T + key_bias (rows x N) by BLAS; per row, with m the row
// maximum, x_j = exp(s_j - m) and the per-key g_j = exp(dnas_bias_j - max dnas_bias):
//   UNAS weights x_j / sum x,  DNAS weights x_j g_j / sum x g  (softmax_j(s_j + dnas_bias_j)),
// so the mixed row is x_j ((1 - u) / sum x + u g_j / sum x g): one exponential per score. When
// sum x g underflows (the row's DNAS mass sits far below its UNAS maximum) the row is redone with
// its own DNAS maximum. Then out = W v by BLAS.
template <typename T>
void mix_attend_impl(const T* q, const T* k, const T* v, const T* kb, const T* db, const T* u, T* out,
                     int64_t BH, int64_t M, int64_t N, int64_t D, int64_t Dv, int64_t sq_bh, int64_t sq_m,
                     int64_t sk_bh, int64_t sk_n, int64_t sv_bh, int64_t sv_n, T scale) {
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(64, kPanelElems / std::max<int64_t>(N, 1)));
  const int64_t n_blocks = (M + rows - 1) / rows;
  const T ninf = -std::numeric_limits<T>::infinity();
  std::vector<T> g(BH * N);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const T* d = db + bh * N;
      T mx = row_max(d, N);
      mx = mx == ninf ? T(0) : mx;
      T* gp = g.data() + bh * N;
      for (int64_t j = 0; j < N; ++j) gp[j] = exp_nonpos(d[j] - mx);
    }
  });
  at::parallel_for(0, BH * n_blocks, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> s(rows * N), e(N), acc(rows * Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_blocks, i0 = (task % n_blocks) * rows;
      const int64_t ni = std::min(rows, M - i0);
      const T* kbp = kb ? kb + bh * N : nullptr;
      const T* dbp = db + bh * N;
      const T* gp = g.data() + bh * N;
      const T* qb = q + bh * sq_bh + i0 * sq_m;
      const T* kp = k + bh * sk_bh;
      const T uu = u[bh];
      gemm_abt(ni, N, D, scale, qb, sq_m, kp, sk_n, T(0), s.data(), N);
      for (int64_t i = 0; i < ni; ++i) {
        T* sr = s.data() + i * N;
        if (kbp) for (int64_t j = 0; j < N; ++j) sr[j] += kbp[j];
        const T m1 = row_max(sr, N);
        if (m1 == ninf) {  // every key masked: a zero row
          std::fill(sr, sr + N, T(0));
          continue;
        }
        T l1 = 0, t = 0;
        for (int64_t j = 0; j < N; ++j) {
          const T x = exp_nonpos(sr[j] - m1);
          sr[j] = x;
          l1 += x;
          t += x * gp[j];
        }
        const T a1 = (T(1) - uu) / l1;
        if (t > kTiny<T> || uu == T(0)) {
          const T a2 = uu == T(0) ? T(0) : uu / t;
          for (int64_t j = 0; j < N; ++j) sr[j] *= a1 + a2 * gp[j];
          continue;
        }
        // rare: recompute this row's scores and take the DNAS part with its own maximum
        T* er = e.data();
        gemm_abt(1, N, D, scale, qb + i * sq_m, sq_m, kp, sk_n, T(0), er, N);
        T m2 = ninf;
        for (int64_t j = 0; j < N; ++j) {
          er[j] += dbp[j] + (kbp ? kbp[j] : T(0));
          m2 = er[j] > m2 ? er[j] : m2;
        }
        T l2 = 0;
        for (int64_t j = 0; j < N; ++j) {
          er[j] = exp_nonpos(er[j] - m2);
          l2 += er[j];
        }
        const T a2 = uu / l2;
        for (int64_t j = 0; j < N; ++j) sr[j] = a1 * sr[j] + a2 * er[j];
      }
      gemm_ab(ni, Dv, N, s.data(), N, v + bh * sv_bh, sv_n, acc.data(), Dv);
      T* o = out + (bh * M + i0) * Dv;
      std::memcpy(o, acc.data(), sizeof(T) * ni * Dv);
    }
  });
}

// One Sinkhorn round (Eq. 10) in potentials: given column potentials c, the row step
// r_i = logsumexp_j (s_ij - c_j) and the next column step c'_j = logsumexp_i (s_ij - r_i), from one
// score panel per task. With x_ij = exp(s_ij - c_j - m_i) (m_i the row maximum) and l_i = sum_j x_ij,
// pi_ij = x_ij / l_i is the row-normalized matrix and c'_j = c_j + log sum_i pi_ij: one exponential
// per score, no second maximum. When c is the previous column step's potential, every column of the
// column-normalized matrix sums to 1 and every row of it to at most N, so sum_i pi_ij >= 1/N: the
// column sums cannot underflow. Invalid keys (key_bias -inf) and queries (row_bias -inf) take no
// part; a column with no valid query gets -inf. Partial column sums per thread, added at the end.
template <typename T>
void sinkhorn_round_impl(const T* q, const T* k, const T* c, const T* kb, const T* rb, T* out, int64_t BH,
                         int64_t M, int64_t N, int64_t D, int64_t sq_bh, int64_t sq_m, int64_t sk_bh,
                         int64_t sk_n, T scale) {
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(64, kPanelElems / std::max<int64_t>(N, 1)));
  const int64_t n_blocks = (M + rows - 1) / rows;
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t n_threads = at::get_num_threads();
  std::vector<T> partial(n_threads * BH * N, T(0));
  at::parallel_for(0, BH * n_blocks, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> s(rows * N);
    T* acc_base = partial.data() + at::get_thread_num() * BH * N;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_blocks, i0 = (task % n_blocks) * rows;
      const int64_t ni = std::min(rows, M - i0);
      const T* cp = c + bh * N;
      const T* kbp = kb ? kb + bh * N : nullptr;
      T* acc = acc_base + bh * N;
      gemm_abt(ni, N, D, scale, q + bh * sq_bh + i0 * sq_m, sq_m, k + bh * sk_bh, sk_n, T(0), s.data(), N);
      for (int64_t i = 0; i < ni; ++i) {
        if (rb && rb[bh * M + i0 + i] == ninf) continue;
        T* sr = s.data() + i * N;
        if (kbp) {
          for (int64_t j = 0; j < N; ++j) sr[j] += kbp[j] - cp[j];
        } else {
          for (int64_t j = 0; j < N; ++j) sr[j] -= cp[j];
        }
        add_row_step(sr, N, acc);
      }
    }
  });
  at::parallel_for(0, BH * N, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      T total = 0;
      for (int64_t t = 0; t < n_threads; ++t) total += partial[t * BH * N + idx];
      out[idx] = total > T(0) ? c[idx] + std::log(total) : ninf;
    }
  });
}

// Sinkhorn attention (Eq. 10) of whole heads: one head per task, its scores s = scale q k^T + biases
// (M x N) held in a thread buffer -- one score product per head instead of one per pass -- then, in
// potentials: c_j = logsumexp_i s_ij; iters - 1 rounds as in sinkhorn_round_impl (row step
// x_ij = exp(s_ij - c_j - m_i), l_i = sum_j x_ij; column step c'_j = c_j + log sum_i x_ij / l_i);
// finally the rows softmax_j(s_ij - c_j) in place and out = W v. Invalid keys (key_bias -inf) and
// queries (row_bias -inf) take no part; a query row with no valid key gives 0. The caller bounds
// threads * M * N (attnlab/normalizers.py, SINKHORN_HEAD_BYTES).
template <typename T>
void sinkhorn_heads_impl(const T* q, const T* k, const T* v, const T* kb, const T* rb, T* out, int64_t BH,
                         int64_t M, int64_t N, int64_t D, int64_t Dv, int64_t sq_bh, int64_t sq_m,
                         int64_t sk_bh, int64_t sk_n, int64_t sv_bh, int64_t sv_n, int64_t iters, T scale) {
  const T ninf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> s(M * N), c(N), cmax(N), acc(N);
    std::vector<char> row_ok(M);
    for (int64_t bh = begin; bh < end; ++bh) {
      const T* kbp = kb ? kb + bh * N : nullptr;
      const T* rbp = rb ? rb + bh * M : nullptr;
      gemm_abt(M, N, D, scale, q + bh * sq_bh, sq_m, k + bh * sk_bh, sk_n, T(0), s.data(), N);
      // column step 1: c_j = logsumexp over valid i of s_ij (running max over rows, then sums)
      std::fill(cmax.begin(), cmax.end(), ninf);
      for (int64_t i = 0; i < M; ++i) {
        T* sr = s.data() + i * N;
        row_ok[i] = !(rbp && rbp[i] == ninf);
        if (kbp) for (int64_t j = 0; j < N; ++j) sr[j] += kbp[j];
        if (!row_ok[i]) continue;
        T* cm = cmax.data();
        for (int64_t j = 0; j < N; ++j) cm[j] = sr[j] > cm[j] ? sr[j] : cm[j];
      }
      for (int64_t j = 0; j < N; ++j) cmax[j] = cmax[j] == ninf ? T(0) : cmax[j];
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t i = 0; i < M; ++i) {
        if (!row_ok[i]) continue;
        const T* sr = s.data() + i * N;
        T* a = acc.data();
        const T* cm = cmax.data();
        for (int64_t j = 0; j < N; ++j) a[j] += exp_nonpos(sr[j] - cm[j]);
      }
      for (int64_t j = 0; j < N; ++j) c[j] = acc[j] > T(0) ? cmax[j] + std::log(acc[j]) : T(0);
      // Re-centring: each round's column step targets column sums M_valid / N_valid instead of 1, a
      // per-head constant log(M_valid / N_valid) that the row softmax cancels; without it c drifts
      // by ln(M/N) per round and float32 loses digits over many rounds.
      int64_t m_valid = 0, n_valid = 0;
      for (int64_t i = 0; i < M; ++i) m_valid += row_ok[i] ? 1 : 0;
      for (int64_t j = 0; j < N; ++j) n_valid += (kbp && kbp[j] == ninf) ? 0 : 1;
      const T recentre = (m_valid > 0 && n_valid > 0) ? std::log(T(m_valid) / T(n_valid)) : T(0);
      // rounds: row step, then column step, on the held scores
      for (int64_t round = 1; round < iters; ++round) {
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t i = 0; i < M; ++i) {
          if (!row_ok[i]) continue;
          const T* sr = s.data() + i * N;
          T* x = cmax.data();  // scratch row: the held scores stay as they are
          const T* cp = c.data();
          for (int64_t j = 0; j < N; ++j) x[j] = sr[j] - cp[j];
          add_row_step(x, N, acc.data());
        }
        for (int64_t j = 0; j < N; ++j) c[j] = acc[j] > T(0) ? c[j] + std::log(acc[j]) - recentre : T(0);
      }
      // the last row step: softmax_j(s_ij - c_j), in place; rows with no valid key: 0
      for (int64_t i = 0; i < M; ++i) {
        T* sr = s.data() + i * N;
        const T* cp = c.data();
        for (int64_t j = 0; j < N; ++j) sr[j] -= cp[j];
        const T inv = row_ok[i] ? exp_row(sr, N) : T(0);
        if (inv == T(0)) {
          std::fill(sr, sr + N, T(0));
          continue;
        }
        for (int64_t j = 0; j < N; ++j) sr[j] *= inv;
      }
      gemm_ab(M, Dv, N, s.data(), N, v + bh * sv_bh, sv_n, out + bh * M * Dv, Dv);
    }
  });
}

at::Tensor col_lse(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& row_bias,
                   double scale) {
  check_3d(a, "a");
  check_3d(b, "b");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "a and b must have one dtype");
  const int64_t BH = a.size(0), M = a.size(1), N = b.size(1), D = a.size(2);
  auto out = at::empty({BH, N}, a.options());
  const at::Tensor rb = operand(row_bias, a.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "col_lse", [&] {
    col_lse_impl<scalar_t>(a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
                           data_or_null<scalar_t>(rb), out.data_ptr<scalar_t>(), BH,
                           M, N, D, a.stride(0), a.stride(1), b.stride(0), b.stride(1), (scalar_t)scale);
  });
  return out;
}

at::Tensor mix_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& key_bias, const at::Tensor& dnas_bias,
                      const at::Tensor& u, double scale) {
  check_3d(q, "q");
  check_3d(k, "k");
  check_3d(v, "v");
  const int64_t BH = q.size(0), M = q.size(1), N = k.size(1), D = q.size(2), Dv = v.size(2);
  auto out = at::empty({BH, M, Dv}, q.options());
  const at::Tensor kb = operand(key_bias, q.scalar_type()), db = operand(dnas_bias, q.scalar_type()),
                   uu = operand(u, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mix_attend", [&] {
    mix_attend_impl<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              data_or_null<scalar_t>(kb), db.data_ptr<scalar_t>(),
                              uu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), BH, M, N, D, Dv,
                              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              (scalar_t)scale);
  });
  return out;
}

at::Tensor sinkhorn_round(const at::Tensor& q, const at::Tensor& k, const at::Tensor& c,
                          const c10::optional<at::Tensor>& key_bias, const c10::optional<at::Tensor>& row_bias,
                          double scale) {
  check_3d(q, "q");
  check_3d(k, "k");
  const int64_t BH = q.size(0), M = q.size(1), N = k.size(1), D = q.size(2);
  auto out = at::empty({BH, N}, q.options());
  const at::Tensor cc = operand(c, q.scalar_type()), kb = operand(key_bias, q.scalar_type()),
                   rb = operand(row_bias, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sinkhorn_round", [&] {
    sinkhorn_round_impl<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), cc.data_ptr<scalar_t>(),
                                  data_or_null<scalar_t>(kb),
                                  data_or_null<scalar_t>(rb), out.data_ptr<scalar_t>(), BH,
                                  M, N, D, q.stride(0), q.stride(1), k.stride(0), k.stride(1), (scalar_t)scale);
  });
  return out;
}

at::Tensor sinkhorn_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& key_bias, const c10::optional<at::Tensor>& row_bias,
                           int64_t iters, double scale) {
  check_3d(q, "q");
  check_3d(k, "k");
  check_3d(v, "v");
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  const int64_t BH = q.size(0), M = q.size(1), N = k.size(1), D = q.size(2), Dv = v.size(2);
  auto out = at::empty({BH, M, Dv}, q.options());
  const at::Tensor kb = operand(key_bias, q.scalar_type()), rb = operand(row_bias, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "sinkhorn_attend", [&] {
    sinkhorn_heads_impl<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                  data_or_null<scalar_t>(kb),
                                  data_or_null<scalar_t>(rb), out.data_ptr<scalar_t>(), BH,
                                  M, N, D, Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                                  v.stride(1), iters, (scalar_t)scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(attnlab, m) {
  m.def("col_lse(Tensor a, Tensor b, Tensor? row_bias, float scale) -> Tensor");
  m.def("sinkhorn_round(Tensor q, Tensor k, Tensor c, Tensor? key_bias, Tensor? row_bias, float scale) -> Tensor");
  m.def("sinkhorn_attend(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, int iters, float scale) -> Tensor");
  m.def("mix_attend(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor dnas_bias, Tensor u, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("col_lse", &col_lse);
  m.impl("mix_attend", &mix_attend);
  m.impl("sinkhorn_round", &sinkhorn_round);
  m.impl("sinkhorn_attend", &sinkhorn_attend);
}
