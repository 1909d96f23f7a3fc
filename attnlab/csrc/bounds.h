// Bound-shifted column panels, shared by panel_cpu.cpp (DNAS), hnas_cpu.cpp (HNAS) and
// sinkhorn_panels_cpu.cpp (Sinkhorn): a bound
// b_j >= max_i s_ij per column from the norms of q and k, taken before any score, so that one sweep
// x_ij = exp(s_ij - b_j) <= 1 gives a column chunk's sums z_j with no sweep for maxima, and
// c_j = b_j + log z_j is the column's log-sum-exp (Eq. 5's normalizer).
#pragma once
#include "kernel_common.h"

#include <atomic>

namespace {

// Rows x keys of one score tile: 2^16 elements (256 KiB of float) stay in L2 with k_J and v_J. Measured
// on the 2-core Zen 3 machine under load (panel_dnas, CPU time, S = 2048): 2^14 / 2^15 / 2^16 / 2^17
// gave 1.0-1.7 / 1.32-1.38 / 1.20-1.21 / 1.25-1.28x SDPA.
constexpr int64_t kTileElems = 1 << 16;

// b_j >= max over the valid rows i of s_ij = scale q_i.k_j + kb_j, before any score:
// scale (mu.k_j) + |scale| rho |k_j| with mu the valid rows' mean and rho = max_i |q_i - mu| (tight
// when the queries share a large common part), or |scale| max_i |q_i| |k_j| where that is smaller
// (Cauchy-Schwarz both); -inf for a masked column and for every column when no row is valid.
// q (M x D, row stride sq_m), k (N x D, sk_n), kb (N) or null, row_ok (M), bnd (N) out.
template <typename T>
void column_bounds(const T* q, int64_t sq_m, int64_t M, const T* k, int64_t sk_n, int64_t N, int64_t D, T scale,
                   const T* kb, const char* row_ok, T* bnd) {
  const T ninf = -std::numeric_limits<T>::infinity();
  std::vector<double> sum(D, 0.0);
  int64_t valid = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (!row_ok[i]) continue;
    ++valid;
    for (int64_t d = 0; d < D; ++d) sum[d] += q[i * sq_m + d];
  }
  if (valid == 0) {
    std::fill(bnd, bnd + N, ninf);
    return;
  }
  std::vector<T> mu(D);
  for (int64_t d = 0; d < D; ++d) mu[d] = (T)(sum[d] / (double)valid);
  T rho2 = 0, qn2 = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (!row_ok[i]) continue;
    T a = 0, b = 0;
    for (int64_t d = 0; d < D; ++d) {
      const T x = q[i * sq_m + d], y = x - mu[d];
      a += y * y;
      b += x * x;
    }
    rho2 = a > rho2 ? a : rho2;
    qn2 = b > qn2 ? b : qn2;
  }
  // slack for the rounding of the score products and of the bound itself
  const T as = std::abs(scale), rho = std::sqrt(rho2) * T(1.0001), qn = std::sqrt(qn2) * T(1.0001);
  for (int64_t j = 0; j < N; ++j) {
    const T* kj = k + j * sk_n;
    T dot = 0, kn2 = 0;
    for (int64_t d = 0; d < D; ++d) {
      dot += mu[d] * kj[d];
      kn2 += kj[d] * kj[d];
    }
    const T kn = std::sqrt(kn2), b = std::min(scale * dot + as * rho * kn, as * qn * kn);
    bnd[j] = kb && kb[j] == ninf ? ninf : (kb ? b + kb[j] : b);
  }
}

// One row of pass 1: x_j = exp(s_j + kb_j - b_j) (kb null: no key bias) from s (may be x itself),
// z_j += x_j; with h, returns sum_j x_j h_j (else 0). Template flags, not branches in the loop (a
// vectorized loop would load a null kb under a mask: a microcode assist per vector on Zen 3).
template <bool kMasked, bool kRowSum, typename T>
inline T exp_row_step(const T* s, const T* kb, const T* b, const T* h, int64_t cw, T* x, T* z) {
  T acc = 0;
  for (int64_t j = 0; j < cw; ++j) {
    const T e = exp_nonpos(kMasked ? s[j] + kb[j] - b[j] : s[j] - b[j]);  // masked keys: exp(-inf) = 0
    x[j] = e;
    z[j] += e;
    if (kRowSum) acc += e * h[j];
  }
  return acc;
}

// Pass 1 of a column chunk of cw keys (k_J: cw x D, row stride sk_n; kb_J or null; bnd_J its bounds),
// by tiles of R rows: x (M x cw, leading dimension cw) = exp(scale q k_J^T + kb_J - b_J), rows of
// invalid queries 0, and z (cw) its column sums. b (cw): scratch for the finite shifts. With tile
// (R x cw scratch, kept in L2) the products go there first, so that BLAS's first pass over its output
// stays in cache when x is fresh memory; with h (cw) and rs (M), rs_i += sum_j x_ij h_j.
template <typename T>
void bound_panel(const T* q, int64_t sq_m, int64_t M, const T* kJ, int64_t sk_n, int64_t cw, int64_t D, T scale,
                 const T* kbJ, const T* bndJ, const char* row_ok, int64_t R, T* x, T* z, T* b,
                 T* tile = nullptr, const T* h = nullptr, T* rs = nullptr) {
  const T ninf = -std::numeric_limits<T>::infinity();
  std::fill(z, z + cw, T(0));
  for (int64_t j = 0; j < cw; ++j) b[j] = bndJ[j] == ninf ? T(0) : bndJ[j];
  for (int64_t i0 = 0; i0 < M; i0 += R) {
    const int64_t ni = std::min(R, M - i0);
    T* xt = x + i0 * cw;
    T* st = tile ? tile : xt;
    gemm_abt(ni, cw, D, scale, q + i0 * sq_m, sq_m, kJ, sk_n, T(0), st, cw);
    for (int64_t i = 0; i < ni; ++i) {
      T* row = xt + i * cw;
      const T* s = st + i * cw;
      if (!row_ok[i0 + i]) {
        std::fill(row, row + cw, T(0));
        continue;
      }
      const T sum = kbJ ? (h ? exp_row_step<true, true>(s, kbJ, b, h, cw, row, z)
                             : exp_row_step<true, false>(s, kbJ, b, h, cw, row, z))
                        : (h ? exp_row_step<false, true>(s, kbJ, b, h, cw, row, z)
                             : exp_row_step<false, false>(s, kbJ, b, h, cw, row, z));
      if (rs) rs[i0 + i] += sum;
    }
  }
}

// After bound_panel: f_j = 1 / z_j (so x_ij f_j = exp(s_ij - c_j)) and c_j = b_j + log z_j; masked
// columns f = 0, c = -inf. Returns true when some column's bound is loose (z_j < e^-10: b_j more than
// 10 nats above c_j, where exp(s - b_j) would lose entries that matter): then f and c are not set.
template <typename T>
bool chunk_factors(const T* bndJ, const T* b, const T* z, int64_t cw, T* f, T* cJ) {
  const T ninf = -std::numeric_limits<T>::infinity(), zmin = std::exp(T(-10));
  bool loose = false;
  for (int64_t j = 0; j < cw; ++j) {
    if (bndJ[j] == ninf) {  // a masked column, or no valid row
      f[j] = T(0);
      cJ[j] = ninf;
    } else if (!(z[j] >= zmin) || !std::isfinite(b[j])) {
      loose = true;
    } else {
      f[j] = T(1) / z[j];
      cJ[j] = b[j] + std::log(z[j]);
    }
  }
  return loose;
}

// Keys per chunk for panels of at most elems elements of M rows: >= 16, a multiple of 16 below N.
inline int64_t panel_keys(int64_t M, int64_t N, int64_t elems) {
  int64_t C = std::min<int64_t>(N, std::max<int64_t>(16, elems / std::max<int64_t>(M, 1)));
  if (C < N) C = std::max<int64_t>(16, C / 16 * 16);
  return C;
}

// rs_i += sum_j x_ij f_j for the n rows of a panel's piece x (n x cw, leading dimension cw): a row
// step's part from one column chunk (held_panels, panel_sinkhorn's rounds and value pass).
template <typename T>
inline void add_row_dots(const T* x, int64_t n, int64_t cw, const T* f, T* rs) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + i * cw;
    T s = 0;
    for (int64_t j = 0; j < cw; ++j) s += row[j] * f[j];
    rs[i] += s;
  }
}

// Phase A of the held panels (hnas_cpu.cpp, sinkhorn_panels_cpu.cpp): one head's column chunks of C
// keys in parallel, chunk J's panel x (M x cw) at held + j0 M (chunk-major), its score tiles through an
// L2 scratch tile first (with BLAS writing straight into the fresh buffer, perf put 8 % of HNAS's time
// in MKL's pass over its output); f, c (N) the column factors and log-sum-exps (chunk_factors); part
// (threads x 2M, zeroed here) gets each thread's row sums td_i = sum_j x_ij f_j (its first M, taken
// while the chunk's panel is in cache) and, with h (N), tu_i = sum_j x_ij h_j (its next M, taken in the
// exponential sweep). False when some column's bound is loose (then nothing else is valid).
template <typename T>
bool held_panels(const T* q, int64_t sq_m, int64_t M, const T* k, int64_t sk_n, int64_t N, int64_t D, T scale,
                 const T* kb, const char* row_ok, const T* bnd, int64_t C, T* held, T* f, T* c, const T* h,
                 std::vector<T>& part) {
  const int64_t nc = (N + C - 1) / C, R = std::max<int64_t>(8, std::min<int64_t>(M, kTileElems / C));
  std::fill(part.begin(), part.end(), T(0));
  std::atomic<bool> loose{false};
  at::parallel_for(0, nc, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    T* td = part.data() + at::get_thread_num() * 2 * M;
    std::vector<T> z(C), b(C), tile(R * C);
    for (int64_t J = begin; J < end && !loose; ++J) {
      const int64_t j0 = J * C, cw = std::min(C, N - j0);
      T* x = held + j0 * M;
      bound_panel(q, sq_m, M, k + j0 * sk_n, sk_n, cw, D, scale, kb ? kb + j0 : nullptr, bnd + j0, row_ok, R, x,
                  z.data(), b.data(), tile.data(), h ? h + j0 : nullptr, h ? td + M : nullptr);
      if (chunk_factors(bnd + j0, b.data(), z.data(), cw, f + j0, c + j0)) {
        loose = true;
        break;
      }
      add_row_dots(x, M, cw, f + j0, td);
    }
  });
  return !loose;
}

}  // namespace
