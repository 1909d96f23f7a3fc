// attnlab CPU kernels for training-size DNAS (Eq. 5) and HNAS (Eq. 12) under autograd
// (attnlab/normalizers/fused.py, _SmallDoublyNormalized): the whole forward and the whole backward of
// one head per task, its (M, N) panels in cache (M N <= fused.SMALL_SCORES: 64 KiB of float at
// 128 x 128), the six matrix products by BLAS on the task's thread -- one parallel region per pass
// instead of one per torch operation.
//
//   train_dn_forward(q, k, v, mask, u, scale, out, p_d, p_u, e) -> bool
//       q (BH, M, D), k (BH, N, D), v (BH, N, Dv) with contiguous last dims; mask (B, H, M, N) bool
//       (any strides, 0 for broadcast dims; True = may attend) or absent; u (BH,) HNAS's weight per
//       head or absent (DNAS). Writes out (BH, M, Dv) = pi v, p_d (BH, M, N) = DNAS's weights
//       softmax_j(s_ij - c_j) with s = scale q k^T (masked entries -inf) and c_j = logsumexp_i s_ij
//       (an empty column: c = 0), p_u (BH, M, N) = UNAS's softmax_j(s_ij) (HNAS only; absent for
//       DNAS), pi = p_u + u (p_d - p_u) (HNAS) or p_d, and e (BH, M), e_i = sum_j exp(s_ij - c_j), so
//       that the column-normalized weights are P_ij = exp(s_ij - c_j) = e_i p_d_ij (the backward
//       needs P without a second exponential). A row with no valid key gets zero weights, e_i = 0.
//       Returns false (outputs unspecified) when a score is NaN or +inf (q k^T overflowed): the
//       caller then takes the PyTorch path, whose NaN rule applies.
//   train_dn_backward(g, q, k, v, p_d, p_u, e, u, scale, grad_q, grad_k, grad_v, grad_u)
//       g (BH, M, Dv) the output's gradient (contiguous last dim); the rest as the forward wrote it.
//       With dp = g v^T: ds = u dl(p_d) - P o colsum(u dl(p_d)) + (1 - u) dl(p_u), dl(pi)_ij =
//       pi_ij (dp_ij - sum_j' dp_ij' pi_ij') (the softmax backward; c_j depends on column j; u = 1 and
//       no p_u for DNAS); grad_q = scale ds k, grad_k = scale ds^T q, grad_v = pi^T g, and grad_u
//       (BH,) = sum_ij dp_ij (p_d_ij - p_u_ij) (HNAS; absent for DNAS).
//
// Per head, forward: s by BLAS into p_d's panel; pass 1 masks and takes the column maxima (and checks
// them finite); pass 2 the column sums of exp(s - max) (c_j); pass 3, row by row while the row is in
// L1, UNAS's row softmax (HNAS), DNAS's row softmax of s - c and the mix; out = pi v by BLAS.
// Backward: dp by BLAS into a scratch panel; pass 1 per row (its two dot products, the softmax
// backwards, the column sums of dl, the mix pi for grad_v); pass 2 subtracts P o colsum and scales;
// then the three gradient products.
#include "kernel_common.h"

#include <atomic>

namespace {

// Row-major C (m x n, ldc) = A^T B with A (k x m, lda) and B (k x n, ldb): C^T = B^T A (column-major).
inline void gemm_atb(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                     float* c, int64_t ldc) {
  const int M = (int)n, N = (int)m, K = (int)k, LDA = (int)ldb, LDB = (int)lda, LDC = (int)ldc;
  const float one = 1.f, zero = 0.f;
  sgemm_("N", "T", &M, &N, &K, &one, b, &LDA, a, &LDB, &zero, c, &LDC);
}
inline void gemm_atb(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b,
                     int64_t ldb, double* c, int64_t ldc) {
  const int M = (int)n, N = (int)m, K = (int)k, LDA = (int)ldb, LDB = (int)lda, LDC = (int)ldc;
  const double one = 1.0, zero = 0.0;
  dgemm_("N", "T", &M, &N, &K, &one, b, &LDA, a, &LDB, &zero, c, &LDC);
}

// Operands of one call; strides in elements. Heads bh = b H + h; the mask's strides (ms_*) may be 0.
template <typename T>
struct TrainProblem {
  const T *q, *k, *v, *u;
  const bool* mask;
  int64_t BH, H, M, N, D, Dv, sq_bh, sq_m, sk_bh, sk_n, sv_bh, sv_n, ms_b, ms_h, ms_m, ms_n;
  T scale;
};

// out[j] = exp(x[j] - m) for a row whose maximum is m (out may be x); returns their sum
template <typename T>
T exp_shifted(const T* x, T* out, int64_t N, T m) {
  T sum = 0;
  for (int64_t j = 0; j < N; ++j) {
    const T y = exp_nonpos(x[j] - m);
    out[j] = y;
    sum += y;
  }
  return sum;
}

// masked entries of head bh's scores (M x N, row-major) -> -inf
template <typename T>
void apply_mask(const TrainProblem<T>& p, int64_t bh, T* s) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const bool* mh = p.mask + (bh / p.H) * p.ms_b + (bh % p.H) * p.ms_h;
  for (int64_t i = 0; i < p.M; ++i) {
    const bool* mr = mh + i * p.ms_m;
    T* row = s + i * p.N;
    if (p.ms_n == 0) {
      if (!mr[0]) std::fill(row, row + p.N, ninf);
    } else if (p.ms_n == 1) {
      for (int64_t j = 0; j < p.N; ++j) row[j] = mr[j] ? row[j] : ninf;
    } else {
      for (int64_t j = 0; j < p.N; ++j) row[j] = mr[j * p.ms_n] ? row[j] : ninf;
    }
  }
}

template <typename T>
bool train_forward_impl(const TrainProblem<T>& p, T* out, T* pd, T* pu, T* e) {
  const T ninf = -std::numeric_limits<T>::infinity(), pinf = std::numeric_limits<T>::infinity();
  const int64_t M = p.M, N = p.N;
  std::atomic<bool> finite{true};
  at::parallel_for(0, p.BH, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> cmax(N), csum(N), c(N), mix(pu ? M * N : 0);
    for (int64_t bh = begin; bh < end && finite.load(std::memory_order_relaxed); ++bh) {
      T* sh = pd + bh * M * N;
      T* cm = cmax.data();
      T* cs = csum.data();
      T* cc = c.data();
      gemm_abt(M, N, p.D, p.scale, p.q + bh * p.sq_bh, p.sq_m, p.k + bh * p.sk_bh, p.sk_n, T(0), sh, N);
      if (p.mask) apply_mask(p, bh, sh);
      // pass 1: column maxima; a NaN or +inf score is counted in `bad`
      std::fill(cm, cm + N, ninf);
      int64_t bad = 0;
      for (int64_t i = 0; i < M; ++i) {
        const T* row = sh + i * N;
        for (int64_t j = 0; j < N; ++j) {
          const T x = row[j];
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
      const T uu = p.u ? p.u[bh] : T(1);
      for (int64_t i = 0; i < M; ++i) {
        T* row = sh + i * N;
        T* pur = pu ? pu + (bh * M + i) * N : nullptr;
        T* mr = pu ? mix.data() + i * N : nullptr;
        const T mu = row_max(row, N);
        if (mu == ninf) {  // no valid key: zero weights
          std::fill(row, row + N, T(0));
          if (pur) std::fill(pur, pur + N, T(0));
          if (mr) std::fill(mr, mr + N, T(0));
          e[bh * M + i] = T(0);
          continue;
        }
        if (pur) {
          const T inv = T(1) / exp_shifted(row, pur, N, mu);
          for (int64_t j = 0; j < N; ++j) pur[j] *= inv;
        }
        for (int64_t j = 0; j < N; ++j) row[j] -= cc[j];  // -inf stays -inf (c finite)
        const T md = row_max(row, N);
        const T ld = exp_shifted(row, row, N, md);  // in place
        const T inv = T(1) / ld;
        e[bh * M + i] = ld * std::exp(md);
        if (mr) {
          for (int64_t j = 0; j < N; ++j) {
            const T d = row[j] * inv;
            row[j] = d;
            mr[j] = pur[j] + uu * (d - pur[j]);
          }
        } else {
          for (int64_t j = 0; j < N; ++j) row[j] *= inv;
        }
      }
      gemm_ab(M, p.Dv, N, pu ? mix.data() : sh, N, p.v + bh * p.sv_bh, p.sv_n, out + bh * M * p.Dv, p.Dv);
    }
  });
  return finite.load();
}

template <typename T>
void train_backward_impl(const TrainProblem<T>& p, const T* g, int64_t sg_bh, int64_t sg_m, const T* pd,
                         const T* pu, const T* e, T* gq, T* gk, T* gv, T* gu) {
  const int64_t M = p.M, N = p.N, D = p.D, Dv = p.Dv;
  at::parallel_for(0, p.BH, 1, [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::vector<T> colsum(N), dpb(M * N), mix(pu ? M * N : 0);
    for (int64_t bh = begin; bh < end; ++bh) {
      T* cs = colsum.data();
      T* dp = dpb.data();
      const T* gh = g + bh * sg_bh;
      const T* vh = p.v + bh * p.sv_bh;
      gemm_abt(M, N, Dv, T(1), gh, sg_m, vh, p.sv_n, T(0), dp, N);  // dp = g v^T
      std::fill(cs, cs + N, T(0));
      const T uu = p.u ? p.u[bh] : T(1), w = T(1) - uu;
      T gsum = 0;
      // pass 1: dl = u p_d (dp - a_i), a_i = sum_j dp_ij p_d_ij; colsum += dl; + (1 - u) p_u (dp - b_i)
      for (int64_t i = 0; i < M; ++i) {
        T* gr = dp + i * N;
        const T* d = pd + (bh * M + i) * N;
        T a = 0;
        for (int64_t j = 0; j < N; ++j) a += gr[j] * d[j];
        if (pu) {
          const T* un = pu + (bh * M + i) * N;
          T* mr = mix.data() + i * N;
          T b = 0;
          for (int64_t j = 0; j < N; ++j) b += gr[j] * un[j];
          gsum += a - b;
          for (int64_t j = 0; j < N; ++j) {
            const T dl = uu * d[j] * (gr[j] - a);
            cs[j] += dl;
            gr[j] = dl + w * un[j] * (gr[j] - b);
            mr[j] = un[j] + uu * (d[j] - un[j]);
          }
        } else {
          for (int64_t j = 0; j < N; ++j) {
            const T dl = d[j] * (gr[j] - a);
            cs[j] += dl;
            gr[j] = dl;
          }
        }
      }
      // pass 2: ds -= P o colsum(dl), P_ij = e_i p_d_ij; times the scale
      for (int64_t i = 0; i < M; ++i) {
        T* gr = dp + i * N;
        const T* d = pd + (bh * M + i) * N;
        const T ei = e[bh * M + i];
        for (int64_t j = 0; j < N; ++j) gr[j] = p.scale * (gr[j] - ei * d[j] * cs[j]);
      }
      if (gu) gu[bh] = gsum;
      const T* pi = pu ? mix.data() : pd + bh * M * N;
      gemm_atb(N, Dv, M, pi, N, gh, sg_m, gv + bh * N * Dv, Dv);               // grad_v = pi^T g
      gemm_ab(M, D, N, dp, N, p.k + bh * p.sk_bh, p.sk_n, gq + bh * M * D, D);  // grad_q = ds k
      gemm_atb(N, D, M, dp, N, p.q + bh * p.sq_bh, p.sq_m, gk + bh * N * D, D); // grad_k = ds^T q
    }
  });
}

void check_like(const at::Tensor& t, const char* name, at::IntArrayRef sizes, const at::Tensor& like) {
  TORCH_CHECK(t.is_contiguous() && t.sizes() == sizes && t.scalar_type() == like.scalar_type(), name,
              " must be a contiguous tensor of shape ", sizes, " and q's dtype");
}

// The problem of a call: q, k, v (BH, L, D) with contiguous last dims, of one dtype; the mask
// (B, H, M, N) bool with B H = BH.
template <typename T>
TrainProblem<T> problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& u, double scale) {
  TrainProblem<T> p{};
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.u = u.has_value() ? u->data_ptr<T>() : nullptr;
  p.BH = q.size(0), p.M = q.size(1), p.N = k.size(1), p.D = q.size(2), p.Dv = v.size(2);
  p.sq_bh = q.stride(0), p.sq_m = q.stride(1), p.sk_bh = k.stride(0), p.sk_n = k.stride(1);
  p.sv_bh = v.stride(0), p.sv_n = v.stride(1);
  p.H = 1;
  if (mask.has_value()) {
    p.mask = mask->data_ptr<bool>();
    p.H = mask->size(1);
    p.ms_b = mask->stride(0), p.ms_h = mask->stride(1), p.ms_m = mask->stride(2), p.ms_n = mask->stride(3);
  }
  p.scale = (T)scale;
  return p;
}

// (BH, L, D) with a contiguous last dim and rows at least D apart (a BLAS leading dimension)
void check_rows_apart(const at::Tensor& t, const char* name) {
  check_3d(t, name);
  TORCH_CHECK(t.stride(1) >= t.size(2), name, "'s rows must not overlap (stride(1) >= size(2))");
}

void check_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& u) {
  check_rows_apart(q, "q");
  check_rows_apart(k, "k");
  check_rows_apart(v, "v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k, v must have one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  v.size(1) == k.size(1) && q.size(2) > 0 && v.size(2) > 0,
              "q (BH, M, D), k (BH, N, D), v (BH, N, Dv) must match, with D, Dv > 0");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(0) * mask->size(1) == q.size(0) &&
                    mask->size(2) == q.size(1) && mask->size(3) == k.size(1),
                "mask must be a (B, H, M, N) bool tensor with B H = BH");
  }
  if (u.has_value()) check_like(*u, "u", {q.size(0)}, q);
}

bool train_dn_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& u, double scale,
                      at::Tensor& out, at::Tensor& p_d, const c10::optional<at::Tensor>& p_u, at::Tensor& e) {
  check_operands(q, k, v, mask, u);
  const int64_t BH = q.size(0), M = q.size(1), N = k.size(1);
  TORCH_CHECK(p_u.has_value() == u.has_value(), "p_u goes with u (HNAS)");
  check_like(out, "out", {BH, M, v.size(2)}, q);
  check_like(p_d, "p_d", {BH, M, N}, q);
  if (p_u.has_value()) check_like(*p_u, "p_u", {BH, M, N}, q);
  check_like(e, "e", {BH, M}, q);
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "train_dn_forward", [&] {
    ok = train_forward_impl<scalar_t>(problem<scalar_t>(q, k, v, mask, u, scale), out.data_ptr<scalar_t>(),
                                      p_d.data_ptr<scalar_t>(), data_or_null<scalar_t>(p_u.value_or(at::Tensor())),
                                      e.data_ptr<scalar_t>());
  });
  return ok;
}

void train_dn_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& p_d, const c10::optional<at::Tensor>& p_u, const at::Tensor& e,
                       const c10::optional<at::Tensor>& u, double scale, at::Tensor& grad_q, at::Tensor& grad_k,
                       at::Tensor& grad_v, const c10::optional<at::Tensor>& grad_u) {
  check_operands(q, k, v, c10::nullopt, u);
  const int64_t BH = q.size(0), M = q.size(1), N = k.size(1), D = q.size(2), Dv = v.size(2);
  check_rows_apart(g, "g");
  TORCH_CHECK(g.scalar_type() == q.scalar_type() && g.size(0) == BH && g.size(1) == M && g.size(2) == Dv,
              "g must be (BH, M, Dv) of q's dtype");
  TORCH_CHECK(p_u.has_value() == u.has_value() && grad_u.has_value() == u.has_value(),
              "p_u and grad_u go with u (HNAS)");
  check_like(p_d, "p_d", {BH, M, N}, q);
  if (p_u.has_value()) check_like(*p_u, "p_u", {BH, M, N}, q);
  check_like(e, "e", {BH, M}, q);
  check_like(grad_q, "grad_q", {BH, M, D}, q);
  check_like(grad_k, "grad_k", {BH, N, D}, q);
  check_like(grad_v, "grad_v", {BH, N, Dv}, q);
  if (grad_u.has_value()) check_like(*grad_u, "grad_u", {BH}, q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "train_dn_backward", [&] {
    train_backward_impl<scalar_t>(problem<scalar_t>(q, k, v, c10::nullopt, u, scale), g.data_ptr<scalar_t>(),
                                  g.stride(0), g.stride(1), p_d.data_ptr<scalar_t>(),
                                  data_or_null<scalar_t>(p_u.value_or(at::Tensor())), e.data_ptr<scalar_t>(),
                                  grad_q.data_ptr<scalar_t>(), grad_k.data_ptr<scalar_t>(),
                                  grad_v.data_ptr<scalar_t>(), data_or_null<scalar_t>(grad_u.value_or(at::Tensor())));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("train_dn_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? u, float scale, Tensor(a!) out, "
        "Tensor(b!) p_d, Tensor(c!)? p_u, Tensor(d!) e) -> bool");
  m.def("train_dn_backward(Tensor g, Tensor q, Tensor k, Tensor v, Tensor p_d, Tensor? p_u, Tensor e, Tensor? u, "
        "float scale, Tensor(a!) grad_q, Tensor(b!) grad_k, Tensor(c!) grad_v, Tensor(d!)? grad_u) -> ()");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("train_dn_forward", &train_dn_forward);
  m.impl("train_dn_backward", &train_dn_backward);
}
