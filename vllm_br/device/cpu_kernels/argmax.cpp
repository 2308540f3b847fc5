// Greedy sampling on the host: the index of the first maximum of each
// float32 row of logits, as torch.argmax gives it (a NaN counts as the
// maximum, so the first NaN wins). torch's CPU argmax and max(dim) reductions
// read a [64, 49152] batch at well under the memory's speed; here each
// thread takes whole rows and reads each once, keeping per lane the maximum
// and its first column (and whether any NaN is there).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

int64_t argmax_row(const float* x, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Per lane: the largest value and the first column holding it (strict >
  // keeps the first); a column index fits int32 for any vocabulary.
  f32x16 mv = f32x16{} + neg_inf;
  i32x16 mi = {}, nan = {};
  i32x16 col = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16, col += 16) {
    f32x16 v;
    std::memcpy(&v, x + j, sizeof(v));
    nan |= v != v;
    const i32x16 gt = v > mv;
    mv = gt ? v : mv;
    mi = gt ? col : mi;
  }
  float m = neg_inf;
  int64_t best = 0;
  bool any_nan = false;
  for (int l = 0; l < 16; ++l) {
    any_nan |= nan[l] != 0;
    if (mv[l] > m || (mv[l] == m && mi[l] < best)) {
      m = mv[l];
      best = mi[l];
    }
  }
  for (; j < n; ++j) {
    any_nan |= std::isnan(x[j]);
    if (x[j] > m) {
      m = x[j];
      best = j;
    }
  }
  if (any_nan) {  // rare: the first NaN wins, as in torch
    for (j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  return best;
}

}  // namespace

extern "C" {

// out[r] = argmax of row r of x ([rows, cols], row stride ``stride``).
int vllm_br_argmax_f32(const float* x, int64_t rows, int64_t cols,
                       int64_t stride, int64_t* out, int32_t num_threads) {
  if (rows < 0 || cols <= 0) return 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, cols);
  return 1;
}
}
