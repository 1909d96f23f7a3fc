// The one head of attnlab's analysis kernel (analysis_cpu.cpp): its buffers and flags, shared by the
// linear passes (analysis_cpu.cpp) and the log-space path of wide heads (analysis_wide.h).
#pragma once
#include "analysis_vec.h"

namespace {

constexpr int64_t kStats = 10;  // columns of stats (analysis_cpu.cpp's header)

struct Head {
  int64_t N, S;
  float *s, *e, *alpha, *beta, *cols, *dn, *sk, *stats;
  const float* spec_t;  // (S, N)
  float *pu, *pd, *ph, *ps;
  float u;
  bool js_d, js_h, js_s;
  bool want_h;  // hnas is analysed (its sums), whether or not its weights are written (ph)
  const float* v = nullptr;  // (N, Dv), row stride ldv: the values, when the attention output is asked for
  int64_t ldv = 0, Dv = 0;
  float* out = nullptr;  // (N, Dv), row stride ldo: softmax(s) v (unas' output), written by the score pass
  int64_t ldo = 0;
  // (2, N) softmax1 (exp(s_ij) / (1 + sum_j exp(s_ij)) = r_i p_u,ij): [0] ln t_i, t_i = 1 / sum_j exp(s_ij)
  // (so r_i = 1 / (1 + t_i)), [1] its column masses sum_i r_i p_u,ij; nullptr: not asked for
  float* s1 = nullptr;
  // (5 + S, N) sparsemax's sums from its support (analysis_sparsemax.h); nullptr: not asked for
  float* sm = nullptr;
};

}  // namespace
