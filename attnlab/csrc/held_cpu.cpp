// attnlab CPU kernel: DNAS (Eq. 5), HNAS (Eq. 12) and Sinkhorn (Eq. 10) attention with each head's
// scores computed once and held -- one score product, one exponential per score and one value
// product per head, the floor of these variants (SDPA does the same work for UNAS).
//
//   held_attend(q, k, v, key_bias, row_bias, u, iters, scale, budget_bytes):  out (BH, M, Dv)
//       q (BH, M, D), k (BH, N, D), v (BH, N, Dv) with contiguous last dims; key_bias (BH, N) and
//       row_bias (BH, M) 0 / -inf (invalid keys and queries take no part) or absent; u (BH,) the
//       HNAS weight (then iters must be 1) or absent (DNAS for iters = 1, Sinkhorn beyond). Rows of
//       invalid queries and rows with no valid key give 0. A group of heads is held at a time in
//       one buffer of at most budget_bytes (at least one head: the caller checks that M N fits).
//
// A head is cut into blocks of R rows (R N <= kHeldPanel elements). Per block b:
//   phase 1 (scores): E_ij = exp(s_ij - m_bj), m_bj = max over the block's valid rows of s_ij, written
//       over the scores, and the block's column sums z_bj = sum_i E_ij;
//   the column potential c_j = logsumexp_i s_ij = log sum_b z_bj exp(m_bj - c*) + c*;
//   Sinkhorn rounds: with F_bj = exp(m_bj - c_j - phi_b) (phi_b its block maximum, so F <= 1),
//       E_ij F_bj = exp(s_ij - c_j - phi_b), so the row step is l_i = sum_j E_ij F_bj and the column
//       mass sum_i pi_ij = sum_b F_bj sum_{i in b} E_ij / l_i: products only, no exponential per
//       score; then c_j += log(mass_j) - log(M_valid / N_valid) (re-centred, no drift);
//   last phase: pi_ij = E_ij F_bj / l_i (DNAS, Sinkhorn); HNAS mixes in UNAS's row with
//       h_bj = exp(m_bj - max_j m_bj): pi = E_ij ((1 - u) h_bj / sum E h + u F_bj / sum E F);
//       then out = pi v for the block by BLAS while pi is in cache.
// Every factor is <= 1, so a row sum below kTiny means the row's mass sits far below its block's
// maximum (float32: ~87 nats): that row is recomputed from its scores, exactly (rare).
#include "kernel_common.h"

#include <memory>

namespace {

// Elements of one row block (R * N): 1 MiB of float, in L2/L3. Measured at S = 2048 (CPU time, 2
// threads): 2^15 / 2^16 / 2^17 / 2^18 elements gave DNAS 1.62 / 1.48 / 1.30 / 1.25x SDPA -- the BLAS
// calls' packing of k and v is shared by more rows.
constexpr int64_t kHeldPanel = 1 << 18;
// A block's scores and weights go through the score product, the exponentials and the value product
// in column tiles of R x CT <= 2^16 elements (256 KiB of float, in L2), as panel_cpu.cpp's tiles.
constexpr int64_t kHeldTile = 1 << 16;

template <typename T>
struct HeldProblem {
  const T *q, *k, *v, *kb, *rb, *u;
  T* out;
  int64_t BH, M, N, D, Dv, sq_bh, sq_m, sk_bh, sk_n, sv_bh, sv_n, iters;
  T scale;
};

// The scores of query row i of head bh, s_j + key_bias_j, into x (N).
template <typename T>
void row_scores(const HeldProblem<T>& p, int64_t bh, int64_t i, T* x) {
  row_scores(p.q + bh * p.sq_bh + i * p.sq_m, p.k + bh * p.sk_bh, p.sk_n, p.N, p.D, p.scale,
             p.kb ? p.kb + bh * p.N : nullptr, x);
}

template <typename T>
void held_impl(const HeldProblem<T>& p, int64_t budget_elems) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t M = p.M, N = p.N;
  const int64_t R = std::max<int64_t>(1, std::min<int64_t>(256, kHeldPanel / N));
  const int64_t nb = (M + R - 1) / R;
  const int64_t CT = std::min<int64_t>(N, std::max<int64_t>(64, kHeldTile / R));  // column tile width
  const int64_t head = M * N;
  const int64_t threads = at::get_num_threads();
  // heads held at once: within the budget, and no more than give every thread a few blocks (the
  // fewer, the more of the group stays in the last-level cache)
  int64_t G = std::max<int64_t>(1, std::min<int64_t>(p.BH, budget_elems / std::max<int64_t>(head, 1)));
  G = std::min<int64_t>(G, std::max<int64_t>(1, (4 * threads + nb - 1) / nb));
  HeldBuffer<T> held(G * head);  // not zeroed: phase 1 writes every valid row
  std::vector<T> bmax(G * nb * N), bsum(G * nb * N), c(G * N), phi(G * nb), recentre(G);
  std::vector<char> row_ok(G * M);

  // F_bj = exp(m_bj - c_j - phi_b) into f (N); returns phi_b, or -inf when the block has no valid entry
  auto column_factors = [&](int64_t h, int64_t blk, T* f) {
    const T* m = bmax.data() + (h * nb + blk) * N;
    const T* cp = c.data() + h * N;
    T ph = ninf;
    for (int64_t j = 0; j < N; ++j) {
      const T d = m[j] == ninf ? ninf : m[j] - cp[j];
      f[j] = d;
      ph = d > ph ? d : ph;
    }
    if (ph == ninf) return ph;
    for (int64_t j = 0; j < N; ++j) f[j] = exp_nonpos(f[j] - ph);  // exp(-inf) = 0
    return ph;
  };

  for (int64_t g0 = 0; g0 < p.BH; g0 += G) {
    const int64_t gh = std::min(G, p.BH - g0);
    // phase 1: scores, block column maxima, E = exp(s - m), block column sums
    at::parallel_for(0, gh * nb, 1, [&](int64_t begin, int64_t end) {
      SerialBlas serial;
      std::vector<T> safe(N), tile(R * CT);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / nb, blk = task % nb, bh = g0 + h, i0 = blk * R;
        const int64_t ni = std::min(R, M - i0);
        T* e = held.get() + h * head + i0 * N;
        T* m = bmax.data() + (h * nb + blk) * N;
        T* z = bsum.data() + (h * nb + blk) * N;
        std::fill(m, m + N, ninf);
        std::fill(z, z + N, T(0));
        const T* kb = p.kb ? p.kb + bh * N : nullptr;
        for (int64_t i = 0; i < ni; ++i) row_ok[h * M + i0 + i] = !(p.rb && p.rb[bh * M + i0 + i] == ninf);
        for (int64_t j0 = 0; j0 < N; j0 += CT) {  // column tiles of R x CT, each in L2 for its passes
          const int64_t cw = std::min(CT, N - j0);
          // the products into an L2 scratch tile first: BLAS's first pass over its output (beta = 0)
          // would otherwise touch the cold held buffer (8 % of HNAS's time in perf, see hnas_cpu.cpp)
          gemm_abt(ni, cw, p.D, p.scale, p.q + bh * p.sq_bh + i0 * p.sq_m, p.sq_m,
                   p.k + bh * p.sk_bh + j0 * p.sk_n, p.sk_n, T(0), tile.data(), cw);
          T* mt = m + j0;
          for (int64_t i = 0; i < ni; ++i) {
            T* row = tile.data() + i * cw;
            if (kb) for (int64_t j = 0; j < cw; ++j) row[j] += kb[j0 + j];
            if (!row_ok[h * M + i0 + i]) continue;
            for (int64_t j = 0; j < cw; ++j) mt[j] = row[j] > mt[j] ? row[j] : mt[j];
          }
          T* sp = safe.data();
          for (int64_t j = 0; j < cw; ++j) sp[j] = mt[j] == ninf ? T(0) : mt[j];
          T* zt = z + j0;
          for (int64_t i = 0; i < ni; ++i) {
            if (!row_ok[h * M + i0 + i]) continue;
            const T* row = tile.data() + i * cw;
            T* er = e + i * N + j0;
            for (int64_t j = 0; j < cw; ++j) {
              const T x = exp_nonpos(row[j] - sp[j]);
              er[j] = x;
              zt[j] += x;
            }
          }
        }
      }
    });
    // c_j = logsumexp over the blocks; the re-centring constant log(M_valid / N_valid) per head
    at::parallel_for(0, gh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        for (int64_t j = 0; j < N; ++j) {
          T cm = ninf;
          for (int64_t b = 0; b < nb; ++b) cm = std::max(cm, bmax[(h * nb + b) * N + j]);
          T total = 0;
          if (cm != ninf)
            for (int64_t b = 0; b < nb; ++b)
              total += bsum[(h * nb + b) * N + j] * exp_nonpos(bmax[(h * nb + b) * N + j] - cm);
          c[h * N + j] = cm == ninf ? ninf : cm + std::log(total);
        }
        int64_t m_valid = 0, n_valid = 0;
        for (int64_t i = 0; i < M; ++i) m_valid += row_ok[h * M + i] ? 1 : 0;
        const T* kb = p.kb ? p.kb + (g0 + h) * N : nullptr;
        for (int64_t j = 0; j < N; ++j) n_valid += (kb && kb[j] == ninf) ? 0 : 1;
        recentre[h] = (m_valid > 0 && n_valid > 0) ? std::log(T(m_valid) / T(n_valid)) : T(0);
      }
    });
    // Sinkhorn rounds: row step, then column step, in products on the held E
    for (int64_t round = 1; round < p.iters; ++round) {
      at::parallel_for(0, gh * nb, 1, [&](int64_t begin, int64_t end) {
        SerialBlas serial;
        std::vector<T> f(N), acc(N), x(N);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t h = task / nb, blk = task % nb, bh = g0 + h, i0 = blk * R;
          const int64_t ni = std::min(R, M - i0);
          T* mass = bsum.data() + (h * nb + blk) * N;  // this block's column mass, sum_{i in b} pi_ij
          std::fill(mass, mass + N, T(0));
          if (column_factors(h, blk, f.data()) == ninf) continue;
          std::fill(acc.begin(), acc.end(), T(0));
          for (int64_t i = 0; i < ni; ++i) {
            if (!row_ok[h * M + i0 + i]) continue;
            const T* e = held.get() + h * head + (i0 + i) * N;
            const T* fp = f.data();
            T l = 0;
            for (int64_t j = 0; j < N; ++j) l += e[j] * fp[j];
            if (l > kTiny<T>) {
              const T inv = T(1) / l;
              T* a = acc.data();
              for (int64_t j = 0; j < N; ++j) a[j] += e[j] * inv;
              continue;
            }
            row_scores(p, bh, i0 + i, x.data());  // rare: this row from its scores, exactly
            exact_row(x.data(), c.data() + h * N, N);
            for (int64_t j = 0; j < N; ++j) mass[j] += x[j];
          }
          for (int64_t j = 0; j < N; ++j) mass[j] += f[j] * acc[j];
        }
      });
      at::parallel_for(0, gh * N, 1024, [&](int64_t begin, int64_t end) {
        for (int64_t idx = begin; idx < end; ++idx) {
          const int64_t h = idx / N, j = idx % N;
          T total = 0;
          for (int64_t b = 0; b < nb; ++b) total += bsum[(h * nb + b) * N + j];
          c[idx] = total > T(0) ? c[idx] + std::log(total) - recentre[h] : ninf;
        }
      });
    }
    // last phase: each row's coefficients (DNAS / Sinkhorn, or HNAS's mix), then by column tiles the
    // weights w (R x CT, in L2) and out += w v by BLAS
    at::parallel_for(0, gh * nb, 1, [&](int64_t begin, int64_t end) {
      SerialBlas serial;
      std::vector<T> f(N), hu(N), x(N), y(N), w(R * CT), a1(R), a2(R);
      std::vector<T> exact;  // rows recomputed from their scores (rare): R_exact x N
      std::vector<int64_t> exact_at(R);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / nb, blk = task % nb, bh = g0 + h, i0 = blk * R;
        const int64_t ni = std::min(R, M - i0);
        const T* e = held.get() + h * head + i0 * N;  // read only: no write-back of the held buffer
        T* o = p.out + (bh * M + i0) * p.Dv;
        if (column_factors(h, blk, f.data()) == ninf) {  // no valid entry in the block: zero rows
          std::fill(o, o + ni * p.Dv, T(0));
          continue;
        }
        const T uu = p.u ? p.u[bh] : T(1);
        if (p.u) {
          const T* m = bmax.data() + (h * nb + blk) * N;
          const T mb = row_max(m, N);
          for (int64_t j = 0; j < N; ++j) hu[j] = exp_nonpos(m[j] - mb);  // m = -inf: 0
        }
        const T* cp = c.data() + h * N;
        exact.clear();
        for (int64_t i = 0; i < ni; ++i) {
          exact_at[i] = -1;
          a1[i] = a2[i] = T(0);
          if (!row_ok[h * M + i0 + i]) continue;
          const T* row = e + i * N;
          const T* fp = f.data();
          const T* hp = hu.data();
          T td = 0, tu = 0;
          if (p.u) {
            for (int64_t j = 0; j < N; ++j) {
              td += row[j] * fp[j];
              tu += row[j] * hp[j];
            }
          } else {
            for (int64_t j = 0; j < N; ++j) td += row[j] * fp[j];
          }
          const bool ok_d = uu == T(0) || td > kTiny<T>;
          const bool ok_u = !p.u || uu == T(1) || tu > kTiny<T>;
          if (ok_d && ok_u) {
            a2[i] = uu == T(0) ? T(0) : uu / td;
            a1[i] = (!p.u || uu == T(1)) ? T(0) : (T(1) - uu) / tu;
            continue;
          }
          // rare: the row from its scores, exactly: softmax_j(s - c) and, for HNAS, softmax_j(s)
          exact_at[i] = (int64_t)(exact.size() / N);
          exact.resize(exact.size() + N);
          T* wr = exact.data() + exact_at[i] * N;
          row_scores(p, bh, i0 + i, x.data());
          if (p.u)
            exact_mix_row(x.data(), y.data(), cp, N, uu);
          else
            exact_row(x.data(), cp, N);
          std::copy(x.begin(), x.end(), wr);
        }
        for (int64_t j0 = 0; j0 < N; j0 += CT) {
          const int64_t cw = std::min(CT, N - j0);
          const T* fp = f.data() + j0;
          const T* hp = hu.data() + j0;
          for (int64_t i = 0; i < ni; ++i) {
            const T* row = e + i * N + j0;
            T* wr = w.data() + i * cw;
            if (exact_at[i] >= 0) {
              std::copy(exact.data() + exact_at[i] * N + j0, exact.data() + exact_at[i] * N + j0 + cw, wr);
            } else if (a1[i] == T(0) && a2[i] == T(0)) {
              std::fill(wr, wr + cw, T(0));
            } else if (a1[i] == T(0)) {
              const T b = a2[i];
              for (int64_t j = 0; j < cw; ++j) wr[j] = row[j] * (b * fp[j]);
            } else {
              const T a = a1[i], b = a2[i];
              for (int64_t j = 0; j < cw; ++j) wr[j] = row[j] * (a * hp[j] + b * fp[j]);
            }
          }
          gemm_ab(ni, p.Dv, cw, w.data(), cw, p.v + bh * p.sv_bh + j0 * p.sv_n, p.sv_n, o, p.Dv,
                  j0 == 0 ? T(0) : T(1));
        }
      }
    });
  }
}

at::Tensor held_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& key_bias, const c10::optional<at::Tensor>& row_bias,
                       const c10::optional<at::Tensor>& u, int64_t iters, double scale, int64_t budget_bytes) {
  const QKVSizes z = check_qkv(q, k, v);
  const int64_t BH = z.BH, M = z.M, N = z.N, D = z.D, Dv = z.Dv;
  TORCH_CHECK(iters >= 1, "iters must be >= 1");
  TORCH_CHECK(!u.has_value() || iters == 1, "u (HNAS) needs iters = 1");
  auto out = at::empty({BH, M, Dv}, q.options());
  if (BH == 0 || M == 0 || N == 0) return out.zero_();
  const at::Tensor kb = operand(key_bias, q.scalar_type()), rb = operand(row_bias, q.scalar_type()),
                   uu = operand(u, q.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "held_attend", [&] {
    HeldProblem<scalar_t> p{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            data_or_null<scalar_t>(kb), data_or_null<scalar_t>(rb), data_or_null<scalar_t>(uu),
                            out.data_ptr<scalar_t>(), BH, M, N, D, Dv, q.stride(0), q.stride(1), k.stride(0),
                            k.stride(1), v.stride(0), v.stride(1), iters, (scalar_t)scale};
    held_impl<scalar_t>(p, budget_bytes / (int64_t)sizeof(scalar_t));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("held_attend(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? row_bias, Tensor? u, int iters, "
        "float scale, int budget_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("held_attend", &held_attend); }
