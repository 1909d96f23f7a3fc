// sparsemax in attnlab's analysis kernel (analysis_cpu.cpp's row pass and analysis_wide.h): one row's
// statistics from its support alone (Martins & Astudillo 2016, Eq. 2: p_j = max(z_j - tau, 0)).
//
// With x_j = s_ij - max_j s_ij <= 0, tau >= -1 (the largest term alone would exceed 1 below it), so the
// support lies among the candidates x_j > -1: usually a few keys. They are sorted decreasingly, k = max{r :
// 1 + r z_(r) > sum_{t <= r} z_(t)}, tau = (sum_{t <= k} z_(t) - 1) / k, and per row
//   out[1] sum_j p, out[2] sum_j p ln p, out[3] sum_j p |i - j|, out[5 + c] sum_j p spec_c,j,
//   out[4] twice the Jensen-Shannon divergence to unas (q_j = au E_ij): over the support the terms
//          p log1p(d) + q log1p(-d), d = (p - q) / (p + q); off it (p = 0) q ln 2 each, summed over those
//          keys (not as 1 - the support's: that difference would lose the small divergences' digits)
// and the column masses sum_i p_ij into out[0]. out: (5 + S, N), row-major; entries per row i at [c * N + i].
#pragma once
#include "analysis_vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kSparsemaxRows = 5;  // out's rows before the S special masses

// Row i: x (N) = s - row max, E (N) its exponentials and au = 1 / sum_j E (unas = au E); spec_t (S, N);
// cand: scratch of N indices.
inline void sparsemax_row(int64_t i, int64_t N, int64_t S, const float* x, const float* E, float au,
                          const float* spec_t, float* out, std::vector<int32_t>& cand) {
  cand.clear();
  double e_out = 0.0;  // sum of E over the keys outside the support (unas' mass there, / au)
  for (int64_t j = 0; j < N; ++j) {
    if (x[j] > -1.f)
      cand.push_back(int32_t(j));
    else
      e_out += E[j];
  }
  std::sort(cand.begin(), cand.end(),
            [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  double cum = 0.0, tau_sum = 0.0;
  int64_t k = 0;
  for (int64_t r = 0; r < int64_t(cand.size()); ++r) {
    const double z = x[cand[r]];
    cum += z;
    if (1.0 + double(r + 1) * z > cum) k = r + 1, tau_sum = cum;
  }
  k = std::max<int64_t>(k, 1);  // (the row maximum, x = 0, is always a candidate and in the support)
  const float tau = float((tau_sum - 1.0) / double(k));
  const float log_tiny = std::log(std::numeric_limits<float>::min());
  double rowsum = 0.0, xlogx = 0.0, dist = 0.0, js = 0.0;
  std::vector<double> sp(S, 0.0);
  for (int64_t r = 0; r < k; ++r) {
    const int32_t j = cand[r];
    const float p = x[j] - tau;
    if (!(p > 0.f)) {
      e_out += E[j];
      continue;
    }
    const float q = au * E[j];
    rowsum += p;
    xlogx += double(p) * std::log(double(p));
    dist += double(p) * std::fabs(double(j) - double(i));
    js += js_term(p, q, log_tiny);
    for (int64_t c = 0; c < S; ++c) sp[c] += double(p) * spec_t[c * N + j];
    out[j] += p;  // column masses (row 0)
  }
  for (int64_t r = k; r < int64_t(cand.size()); ++r) e_out += E[cand[r]];  // candidates outside the support
  js += std::log(2.0) * double(au) * e_out;
  out[1 * N + i] = float(rowsum), out[2 * N + i] = float(xlogx), out[3 * N + i] = float(dist);
  out[4 * N + i] = float(js);
  for (int64_t c = 0; c < S; ++c) out[(kSparsemaxRows + c) * N + i] = float(sp[c]);
}

}  // namespace
