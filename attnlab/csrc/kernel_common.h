// Shared by attnlab's CPU kernels (attnlab_cpu.cpp, held_cpu.cpp): BLAS products on row-major panels,
// the branch-free exponential, row reductions, and the operand helpers of the operator wrappers.
#pragma once
#include "vec_capability.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <cstdlib>
#if defined(__linux__)
#include <sys/mman.h>
#elif defined(_WIN32)
#include <malloc.h>
#endif
#include <vector>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
// MKL's per-thread thread count (C interface); weak, so a BLAS without it still links.
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace {

// BLAS inside a task runs on the task's thread: MKL would otherwise start its own threads under
// at::parallel_for's, and two levels of threads on the same cores run ~3x slower.
struct SerialBlas {
  int previous = 0;
  SerialBlas() {
    if (MKL_Set_Num_Threads_Local) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~SerialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
  }
};


// Row-major C (m x n, ldc) = alpha * A (m x k, lda) * B^T (B: n x k, ldb) [+ beta C], via the
// column-major BLAS: C^T = B A^T.
inline void gemm_abt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                     const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int M = (int)n, N = (int)m, K = (int)k, LDA = (int)ldb, LDB = (int)lda, LDC = (int)ldc;
  sgemm_("T", "N", &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
}
inline void gemm_abt(int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                     const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  const int M = (int)n, N = (int)m, K = (int)k, LDA = (int)ldb, LDB = (int)lda, LDC = (int)ldc;
  dgemm_("T", "N", &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
}
// Row-major C (m x n) = A (m x k, lda) * B (k x n, ldb) [+ beta C]: C^T = B^T A^T.
inline void gemm_ab(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                    int64_t ldb, float* c, int64_t ldc, float beta = 0.f) {
  const int M = (int)n, N = (int)m, K = (int)k, LDA = (int)ldb, LDB = (int)lda, LDC = (int)ldc;
  const float one = 1.f;
  sgemm_("N", "N", &M, &N, &K, &one, b, &LDA, a, &LDB, &beta, c, &LDC);
}
inline void gemm_ab(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b,
                    int64_t ldb, double* c, int64_t ldc, double beta = 0.0) {
  const int M = (int)n, N = (int)m, K = (int)k, LDA = (int)ldb, LDB = (int)lda, LDC = (int)ldc;
  const double one = 1.0;
  dgemm_("N", "N", &M, &N, &K, &one, b, &LDA, a, &LDB, &beta, c, &LDC);
}

// exp(x) for x <= 0 (every argument here is shifted by a max), branch-free so the loops vectorize:
// 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by a degree-6 polynomial (rel. error ~2e-7);
// below -87 the result is 0, which also covers -inf.
inline float exp_nonpos(float x) {
  float t = x * 1.44269504088896341f;
  t = t < -126.f ? -126.f : t;
  const float n = __builtin_rintf(t);  // round to nearest
  const float f = t - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += (int32_t)n << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return x < -87.f ? 0.f : r;
}
inline double exp_nonpos(double x) { return std::exp(x); }

// max_j x_j (-inf for n = 0), vectorized; no fast-math assumption that values are finite.
template <typename T>
inline T row_max(const T* x, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  return at::vec::reduce_all<T>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}

// x_j <- exp(x_j - max_k x_k) in place; returns 1 / sum_j of them, or 0 for a row with no finite
// entry (every key masked), left as it was.
template <typename T>
inline T exp_row(T* x, int64_t n) {
  const T m = row_max(x, n);
  if (m == -std::numeric_limits<T>::infinity()) return T(0);
  T l = 0;
  for (int64_t j = 0; j < n; ++j) {
    const T e = exp_nonpos(x[j] - m);
    x[j] = e;
    l += e;
  }
  return T(1) / l;
}

// One Sinkhorn row step on a row x_j = s_ij - c_j (overwritten): acc_j += x_ij / l_i with
// x_ij = exp(s_ij - c_j - m_i), l_i = sum_j x_ij (see sinkhorn_round_impl).
template <typename T>
inline void add_row_step(T* x, int64_t n, T* acc) {
  const T inv = exp_row(x, n);
  if (inv == T(0)) return;
  for (int64_t j = 0; j < n; ++j) acc[j] += x[j] * inv;
}

// The scores of one query row q_i (D) against k (N x D, row stride sk_n): x_j = scale q_i.k_j + kb_j
// (kb null: no key bias), by BLAS -- the kernels' rare exact paths for one row.
template <typename T>
void row_scores(const T* qi, const T* k, int64_t sk_n, int64_t N, int64_t D, T scale, const T* kb, T* x) {
  gemm_abt(1, N, D, scale, qi, D, k, sk_n, T(0), x, N);
  if (kb)
    for (int64_t j = 0; j < N; ++j) x[j] += kb[j];
}

// softmax_j(x_j - c_j) in place (c_j = -inf marks a column without valid entries): DNAS's row from
// its scores. All 0, and false, when no entry is valid.
template <typename T>
bool exact_row(T* x, const T* c, int64_t n) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) x[j] = c[j] == ninf ? ninf : x[j] - c[j];
  const T inv = exp_row(x, n);
  for (int64_t j = 0; j < n; ++j) x[j] = inv == T(0) ? T(0) : x[j] * inv;
  return inv != T(0);
}

// HNAS's row from its scores x (overwritten; y: scratch of n): u softmax_j(x_j - c_j) + (1 - u)
// softmax_j(x_j) (Eq. 12).
template <typename T>
void exact_mix_row(T* x, T* y, const T* c, int64_t n, T u) {
  std::copy(x, x + n, y);
  exact_row(x, c, n);
  const T inv = exp_row(y, n);
  for (int64_t j = 0; j < n; ++j) x[j] = u * x[j] + (inv == T(0) ? T(0) : (T(1) - u) * y[j] * inv);
}

// Memory for held scores (one head's M x N: 64 MiB at 4096 tokens): from 4 MiB on, 2 MiB aligned and
// marked for transparent huge pages (madvise; a hint the OS may ignore). With 4 KiB pages a fresh buffer
// costs ~16,000 page faults (12-15 ms a call here) and the panel passes a TLB miss per page.
template <typename T>
struct HeldBuffer {
#if defined(_WIN32)
  std::unique_ptr<T[], void (*)(void*)> data{nullptr, _aligned_free};
#else
  std::unique_ptr<T[], void (*)(void*)> data{nullptr, std::free};
#endif
  explicit HeldBuffer(int64_t n) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t need = std::max<size_t>(size_t(n) * sizeof(T), 1);
    const bool huge = need >= 2 * kHuge;  // smaller buffers: cache-line aligned, as they are
    const size_t align = huge ? kHuge : 64, bytes = (need + align - 1) / align * align;
#if defined(_WIN32)
    void* raw = _aligned_malloc(bytes, align);
#else
    void* raw = nullptr;
    if (posix_memalign(&raw, align, bytes) != 0) raw = nullptr;
#endif
    TORCH_CHECK(raw != nullptr, "attnlab: cannot allocate ", bytes, " bytes of held scores");
#ifdef MADV_HUGEPAGE
    if (huge) madvise(raw, bytes, MADV_HUGEPAGE);
#endif
    data.reset(static_cast<T*>(raw));
  }
  T* get() const { return data.get(); }
};

// Floor under which a row's sum is recomputed from the scores (see mix_attend_impl, held_cpu.cpp).
template <typename T> constexpr T kTiny = T(1e-20);
template <> constexpr double kTiny<double> = 1e-280;

// An optional operand as a contiguous tensor of the kernel's dtype (undefined when absent), and its
// data pointer (nullptr when absent).
at::Tensor operand(const c10::optional<at::Tensor>& t, at::ScalarType dtype) {
  return t.has_value() ? t->contiguous().to(dtype) : at::Tensor();
}
template <typename T>
T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

void check_3d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be (BH, L, D) with a contiguous last dim");
}

// Sizes of q (BH, M, D), k (BH, N, D), v (BH, N, Dv), checked: 3-d with a contiguous last dim, one
// dtype, matching sizes (the held and panel kernels' operands).
struct QKVSizes {
  int64_t BH, M, N, D, Dv;
};
QKVSizes check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_3d(q, "q");
  check_3d(k, "k");
  check_3d(v, "v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k, v must have one dtype");
  const QKVSizes z{q.size(0), q.size(1), k.size(1), q.size(2), v.size(2)};
  TORCH_CHECK(k.size(0) == z.BH && v.size(0) == z.BH && v.size(1) == z.N && k.size(2) == z.D,
              "shapes of q, k, v differ");
  return z;
}

}  // namespace
