// attnlab CPU kernels for training-size DNAS (Eq. 5) and HNAS (Eq. 12) under autograd: the
// elementwise parts of attnlab/normalizers/fused.py's _SmallDoublyNormalized, one head per task with
// the head's (M, N) panels in cache (M N <= fused.SMALL_SCORES: 64 KiB of float at 128 x 128). The
// matrix products (q k^T, pi v, g v^T, ds k, ds^T q, pi^T g) stay torch's batched BLAS.
//
//   train_dn_forward(s, u, p_u, p, e, scale) -> bool
//       s (BH, M, N): the unscaled scores q k^T, masked entries -inf; overwritten with p_d, DNAS's
//       weights softmax_j(scale s_ij - c_j), c_j = logsumexp_i scale s_ij (an empty column: c = 0).
//       u (BH,) HNAS's weight per head, or absent (DNAS); then p_u (BH, M, N) gets UNAS's weights
//       softmax_j(scale s_ij) and p (BH, M, N) the mix p_u + u (p_d - p_u) (both absent for DNAS).
//       e (BH, M): e_i = sum_j exp(scale s_ij - c_j), so that the column-normalized weights are
//       P_ij = exp(scale s_ij - c_j) = e_i p_d_ij (the backward needs P without a second exponential).
//       A row with no valid key gets zero weights and e_i = 0. Returns false (outputs unspecified)
//       when a score is NaN or +inf (q k^T overflowed): the caller then takes the PyTorch path, whose
//       NaN rule applies.
//   train_dn_backward(dp, p_d, p_u, e, u, grad_u, scale)
//       dp (BH, M, N) = g v^T, overwritten with scale * ds, the gradient of the unscaled scores:
//       ds = u dl(p_d) - P o colsum(u dl(p_d)) + (1 - u) dl(p_u), dl(pi)_ij = pi_ij (dp_ij - sum_j'
//       dp_ij' pi_ij') (the softmax backward; c_j depends on column j); u = 1 and no p_u for DNAS.
//       grad_u (BH,) gets sum_ij dp_ij (p_d_ij - p_u_ij) (HNAS; absent for DNAS).
//
// Per head, forward: pass 1 scales the scores and takes the column maxima (and checks them finite);
// pass 2 the column sums of exp(s - max) (c_j); pass 3, row by row while the row is in L1, UNAS's
// row softmax (HNAS), DNAS's row softmax of s - c and the mix. Backward: pass 1 per row (its two dot
// products, the softmax backwards, the column sums of dl), pass 2 subtracts P o colsum.
#include "kernel_common.h"

#include <atomic>

namespace {

template <typename T>
bool train_forward_impl(T* s, const T* u, T* pu, T* p, T* e, int64_t BH, int64_t M, int64_t N, T scale) {
  const T ninf = -std::numeric_limits<T>::infinity(), pinf = std::numeric_limits<T>::infinity();
  std::atomic<bool> finite{true};
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> cmax(N), csum(N), c(N);
    for (int64_t bh = begin; bh < end && finite.load(std::memory_order_relaxed); ++bh) {
      T* sh = s + bh * M * N;
      T* cm = cmax.data();
      T* cs = csum.data();
      T* cc = c.data();
      // pass 1: scale (in place), column maxima; a NaN or +inf score is counted in `bad`
      std::fill(cm, cm + N, ninf);
      int64_t bad = 0;
      for (int64_t i = 0; i < M; ++i) {
        T* row = sh + i * N;
        for (int64_t j = 0; j < N; ++j) {
          const T x = row[j] * scale;
          row[j] = x;
          cm[j] = x > cm[j] ? x : cm[j];
          bad += (x < pinf) ? 0 : 1;
        }
      }
      if (bad) {
        finite.store(false, std::memory_order_relaxed);
        break;
      }
      // pass 2: c_j = m_j + log sum_i exp(s_ij - m_j); a column with no valid query: c_j = 0
      for (int64_t j = 0; j < N; ++j) cm[j] = cm[j] == ninf ? T(0) : cm[j];
      std::fill(cs, cs + N, T(0));
      for (int64_t i = 0; i < M; ++i) {
        const T* row = sh + i * N;
        for (int64_t j = 0; j < N; ++j) cs[j] += exp_nonpos(row[j] - cm[j]);
      }
      for (int64_t j = 0; j < N; ++j) cc[j] = cs[j] > T(0) ? cm[j] + std::log(cs[j]) : T(0);
      // pass 3, per row: UNAS's softmax_j(s_ij) (HNAS), DNAS's softmax_j(s_ij - c_j), their mix
      const T uu = u ? u[bh] : T(1);
      for (int64_t i = 0; i < M; ++i) {
        T* row = sh + i * N;
        T* pur = pu ? pu + (bh * M + i) * N : nullptr;
        T* pr = p ? p + (bh * M + i) * N : nullptr;
        const T mu = row_max(row, N);
        if (mu == ninf) {  // no valid key: zero weights
          std::fill(row, row + N, T(0));
          if (pur) std::fill(pur, pur + N, T(0));
          if (pr) std::fill(pr, pr + N, T(0));
          e[bh * M + i] = T(0);
          continue;
        }
        if (pur) {
          T lu = 0;
          for (int64_t j = 0; j < N; ++j) {
            const T y = exp_nonpos(row[j] - mu);
            pur[j] = y;
            lu += y;
          }
          const T inv = T(1) / lu;
          for (int64_t j = 0; j < N; ++j) pur[j] *= inv;
        }
        for (int64_t j = 0; j < N; ++j) row[j] -= cc[j];  // -inf stays -inf (c finite)
        const T md = row_max(row, N);
        T ld = 0;
        for (int64_t j = 0; j < N; ++j) {
          const T x = exp_nonpos(row[j] - md);
          row[j] = x;
          ld += x;
        }
        const T inv = T(1) / ld;
        e[bh * M + i] = ld * std::exp(md);
        if (pr) {
          for (int64_t j = 0; j < N; ++j) {
            const T d = row[j] * inv;
            row[j] = d;
            pr[j] = pur[j] + uu * (d - pur[j]);
          }
        } else {
          for (int64_t j = 0; j < N; ++j) row[j] *= inv;
        }
      }
    }
  });
  return finite.load();
}

template <typename T>
void train_backward_impl(T* dp, const T* pd, const T* pu, const T* e, const T* u, T* grad_u, int64_t BH,
                         int64_t M, int64_t N, T scale) {
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> colsum(N);
    for (int64_t bh = begin; bh < end; ++bh) {
      T* cs = colsum.data();
      std::fill(cs, cs + N, T(0));
      const T uu = u ? u[bh] : T(1), w = T(1) - uu;
      T gu = 0;
      // pass 1: dl = u p_d (dp - a_i), a_i = sum_j dp_ij p_d_ij; colsum += dl; + (1 - u) p_u (dp - b_i)
      for (int64_t i = 0; i < M; ++i) {
        T* g = dp + (bh * M + i) * N;
        const T* d = pd + (bh * M + i) * N;
        T a = 0;
        for (int64_t j = 0; j < N; ++j) a += g[j] * d[j];
        if (pu) {
          const T* un = pu + (bh * M + i) * N;
          T b = 0;
          for (int64_t j = 0; j < N; ++j) b += g[j] * un[j];
          gu += a - b;
          for (int64_t j = 0; j < N; ++j) {
            const T dl = uu * d[j] * (g[j] - a);
            cs[j] += dl;
            g[j] = dl + w * un[j] * (g[j] - b);
          }
        } else {
          for (int64_t j = 0; j < N; ++j) {
            const T dl = d[j] * (g[j] - a);
            cs[j] += dl;
            g[j] = dl;
          }
        }
      }
      // pass 2: ds -= P o colsum(dl), P_ij = e_i p_d_ij; times the scale
      for (int64_t i = 0; i < M; ++i) {
        T* g = dp + (bh * M + i) * N;
        const T* d = pd + (bh * M + i) * N;
        const T ei = e[bh * M + i];
        for (int64_t j = 0; j < N; ++j) g[j] = scale * (g[j] - ei * d[j] * cs[j]);
      }
      if (grad_u) grad_u[bh] = gu;
    }
  });
}

void check_panels(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.sizes() == like.sizes() &&
                  t.scalar_type() == like.scalar_type(),
              name, " must be a contiguous (BH, M, N) tensor like s");
}
void check_vector(const at::Tensor& t, const char* name, int64_t n, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.size(0) == n && t.scalar_type() == like.scalar_type(),
              name, " must be a contiguous vector of ", n, " entries of the scores' dtype");
}
void check_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_contiguous() && t.numel() == like.size(0) * like.size(1) &&
                  t.scalar_type() == like.scalar_type(),
              name, " must be contiguous with BH * M entries of the scores' dtype");
}

bool train_dn_forward(at::Tensor& s, const c10::optional<at::Tensor>& u, const c10::optional<at::Tensor>& p_u,
                      const c10::optional<at::Tensor>& p, at::Tensor& e, double scale) {
  TORCH_CHECK(s.dim() == 3 && s.is_contiguous(), "s must be a contiguous (BH, M, N) tensor");
  const int64_t BH = s.size(0), M = s.size(1), N = s.size(2);
  const bool hybrid = u.has_value();
  TORCH_CHECK(p_u.has_value() == hybrid && p.has_value() == hybrid, "p_u and p go with u (HNAS)");
  if (hybrid) {
    check_vector(*u, "u", BH, s);
    check_panels(*p_u, "p_u", s);
    check_panels(*p, "p", s);
  }
  check_rows(e, "e", s);
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "train_dn_forward", [&] {
    ok = train_forward_impl<scalar_t>(s.data_ptr<scalar_t>(), hybrid ? u->data_ptr<scalar_t>() : nullptr,
                                      hybrid ? p_u->data_ptr<scalar_t>() : nullptr,
                                      hybrid ? p->data_ptr<scalar_t>() : nullptr, e.data_ptr<scalar_t>(),
                                      BH, M, N, (scalar_t)scale);
  });
  return ok;
}

void train_dn_backward(at::Tensor& dp, const at::Tensor& p_d, const c10::optional<at::Tensor>& p_u,
                       const at::Tensor& e, const c10::optional<at::Tensor>& u,
                       const c10::optional<at::Tensor>& grad_u, double scale) {
  TORCH_CHECK(dp.dim() == 3 && dp.is_contiguous(), "dp must be a contiguous (BH, M, N) tensor");
  const int64_t BH = dp.size(0), M = dp.size(1), N = dp.size(2);
  const bool hybrid = u.has_value();
  TORCH_CHECK(p_u.has_value() == hybrid && grad_u.has_value() == hybrid, "p_u and grad_u go with u (HNAS)");
  check_panels(p_d, "p_d", dp);
  check_rows(e, "e", dp);
  if (hybrid) {
    check_panels(*p_u, "p_u", dp);
    check_vector(*u, "u", BH, dp);
    check_vector(*grad_u, "grad_u", BH, dp);
  }
  AT_DISPATCH_FLOATING_TYPES(dp.scalar_type(), "train_dn_backward", [&] {
    train_backward_impl<scalar_t>(dp.data_ptr<scalar_t>(), p_d.data_ptr<scalar_t>(),
                                  hybrid ? p_u->data_ptr<scalar_t>() : nullptr, e.data_ptr<scalar_t>(),
                                  hybrid ? u->data_ptr<scalar_t>() : nullptr,
                                  hybrid ? grad_u->data_ptr<scalar_t>() : nullptr, BH, M, N, (scalar_t)scale);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("train_dn_forward(Tensor(a!) s, Tensor? u, Tensor(b!)? p_u, Tensor(c!)? p, Tensor(d!) e, "
        "float scale) -> bool");
  m.def("train_dn_backward(Tensor(a!) dp, Tensor p_d, Tensor? p_u, Tensor e, Tensor? u, Tensor(b!)? grad_u, "
        "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("train_dn_forward", &train_dn_forward);
  m.impl("train_dn_backward", &train_dn_backward);
}
