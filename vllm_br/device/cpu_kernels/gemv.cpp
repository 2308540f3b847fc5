// bfloat16 GEMMs of a few rows (decode of one or a few sequences) for the cpu
// backend: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32 sums, one
// rounding to bfloat16.
//
// At one to four rows a GEMM is a pass over the weight: one multiply-add per
// weight element and row, so its speed is how fast the weight streams in from
// L3 or memory. oneDNN's packed kernels (packed_linear.py) read the weight in
// their blocked order with compute between the loads and reach 13-24 GB/s
// on the 2-core development host; here each thread reads a contiguous run of
// whole weight rows front to back, prefetching well ahead, with AVX512-BF16's
// pairwise dot product (vdpbf16ps: two bf16 products summed into a float32
// lane, exact products) as the only arithmetic.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a
// host); elsewhere vllm_br_gemv_bf16 reports that it did not run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

#if defined(__AVX512BF16__)
typedef float f32x16 __attribute__((vector_size(64)));

using vllm_br_bf16::to_bf16;
using vllm_br_bf16::to_float;

// Lane sums of four vectors.
inline void hsum4(const f32x16 (&v)[4], float* out) {
  for (int j = 0; j < 4; ++j) out[j] = _mm512_reduce_add_ps((__m512)v[j]);
}

constexpr int ROWS_PER_STEP = 4;  // weight rows read together
// Rows ahead that are prefetched: the stream is fetched about 18 KB (SmolLM2's
// 576-wide rows) ahead of the loads; without it this kernel was no faster
// than oneDNN's packed one at one row and 1.3-1.9x slower at two and four.
constexpr int PREFETCH_ROWS = 16;

// Rows [n0, n1) of the output, for M input rows.
template <int M>
void gemv_range(const uint16_t* x, int64_t x_st, const uint16_t* w,
                int64_t w_st, int n0, int n1, int k, const uint16_t* bias,
                uint16_t* out, int64_t o_st) {
  const int full = k / 32, rem = k % 32;
  const __mmask32 tail = rem ? static_cast<__mmask32>((1u << rem) - 1) : 0;
  for (int n = n0; n < n1; n += ROWS_PER_STEP) {
    const int cnt = std::min(ROWS_PER_STEP, n1 - n);
    const uint16_t* wr[ROWS_PER_STEP];
    for (int j = 0; j < ROWS_PER_STEP; ++j)  // a short last step repeats a row
      wr[j] = w + int64_t(n + std::min(j, cnt - 1)) * w_st;
    f32x16 acc[M][ROWS_PER_STEP] = {};
    for (int c = 0; c < full; ++c) {
      __m512bh wv[ROWS_PER_STEP];
      for (int j = 0; j < ROWS_PER_STEP; ++j) {
        wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + 32 * c);
        // Past the last row this is a hint about an address, never a fault.
        _mm_prefetch(reinterpret_cast<const char*>(wr[j] + 32 * c +
                                                   PREFETCH_ROWS * w_st),
                     _MM_HINT_T0);
      }
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_st + 32 * c);
        for (int j = 0; j < ROWS_PER_STEP; ++j)
          acc[m][j] = (f32x16)_mm512_dpbf16_ps((__m512)acc[m][j], wv[j], xv);
      }
    }
    if (rem) {  // masked loads read zeros past the row's end
      __m512bh wv[ROWS_PER_STEP];
      for (int j = 0; j < ROWS_PER_STEP; ++j)
        wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr[j] + 32 * full);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv =
            (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * x_st + 32 * full);
        for (int j = 0; j < ROWS_PER_STEP; ++j)
          acc[m][j] = (f32x16)_mm512_dpbf16_ps((__m512)acc[m][j], wv[j], xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      float sums[ROWS_PER_STEP];
      hsum4(acc[m], sums);
      for (int j = 0; j < cnt; ++j)
        out[m * o_st + n + j] =
            to_bf16(bias ? sums[j] + to_float(bias[n + j]) : sums[j]);
    }
  }
}

template <int M>
void gemv(const uint16_t* x, int64_t x_st, const uint16_t* w, int64_t w_st,
          int n, int k, const uint16_t* bias, uint16_t* out, int64_t o_st,
          int num_threads) {
  // Each thread a contiguous share of the weight rows (whole steps).
  const int steps = (n + ROWS_PER_STEP - 1) / ROWS_PER_STEP;
#pragma omp parallel num_threads(num_threads)
  {
    int t = 0, nt = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int s0 = int(int64_t(steps) * t / nt);
    const int s1 = int(int64_t(steps) * (t + 1) / nt);
    const int n0 = s0 * ROWS_PER_STEP, n1 = std::min(n, s1 * ROWS_PER_STEP);
    if (n0 < n1) gemv_range<M>(x, x_st, w, w_st, n0, n1, k, bias, out, o_st);
  }
}
#endif

}  // namespace

extern "C" {
// The most input rows vllm_br_gemv_bf16 takes; 0 where it is not built.
int vllm_br_gemv_max_rows() {
#if defined(__AVX512BF16__)
  return 4;
#else
  return 0;
#endif
}

// out [m, n] (row stride o_st) = x [m, k] (row stride x_st) times w [n, k]
// (row stride w_st) transposed, plus bias [n] if not null; all bfloat16 with
// unit stride along k / n. Returns 1 when it ran, 0 when not (nothing
// written): m outside 1..vllm_br_gemv_max_rows().
int vllm_br_gemv_bf16(const void* x, int64_t x_st, int32_t m, const void* w,
                      int64_t w_st, int32_t n, int32_t k, const void* bias,
                      void* out, int64_t o_st, int32_t num_threads) {
#if defined(__AVX512BF16__)
  auto xp = static_cast<const uint16_t*>(x);
  auto wp = static_cast<const uint16_t*>(w);
  auto bp = static_cast<const uint16_t*>(bias);
  auto op = static_cast<uint16_t*>(out);
  switch (m) {
    case 1: gemv<1>(xp, x_st, wp, w_st, n, k, bp, op, o_st, num_threads); return 1;
    case 2: gemv<2>(xp, x_st, wp, w_st, n, k, bp, op, o_st, num_threads); return 1;
    case 3: gemv<3>(xp, x_st, wp, w_st, n, k, bp, op, o_st, num_threads); return 1;
    case 4: gemv<4>(xp, x_st, wp, w_st, n, k, bp, op, o_st, num_threads); return 1;
    default: return 0;
  }
#else
  (void)x, (void)x_st, (void)m, (void)w, (void)w_st, (void)n, (void)k;
  (void)bias, (void)out, (void)o_st, (void)num_threads;
  return 0;
#endif
}
}
