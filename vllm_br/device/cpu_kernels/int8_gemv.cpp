// int8-weight GEMMs of a few rows (decode of one or a few sequences) for the
// cpu backend, on AVX2+FMA or AVX-512 hosts:
//
// - vllm_br_gemv_w8_bf16: bf16 activations times int8 weights with a float32
//   scale per output row (W8A16, GPTQ int8): out[m, n] = bf16(scale[n] *
//   sum_k x[m, k] * q[n, k] (+ bias[n])). The int8 values and the bf16
//   activations are exact in float32, so the only roundings are the float32
//   sums and the final bf16.
// - vllm_br_gemv_i8i8: int8 x int8 summed exactly in int32 (W8A8). Both sides
//   are widened to int16 and multiplied pairwise into int32 (vpmaddwd: two
//   products of at most 2^14 each, no saturation), unlike vpmaddubsw, whose
//   saturating int16 pair sums make oneDNN's int8 GEMM wrong without VNNI.
//
// At one to four rows a GEMM is a pass over the weight, so its speed is how
// fast the weight streams in: each thread reads a contiguous run of whole
// weight rows front to back, prefetching ahead, one byte per weight element
// (half the bytes of bf16). Built where the compiler targets AVX2 and FMA
// (-march=native); elsewhere vllm_br_gemv_w8_max_rows() is 0.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#define VLLM_BR_W8 1
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

#if defined(VLLM_BR_W8)
using vllm_br_bf16::to_bf16;
using vllm_br_bf16::to_float;

// Vectors of the widest ISA built: LANES float32 / int32 lanes.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int LANES = 16;
typedef __m512 vf;
typedef __m512i vi;
inline vf load_w_f32(const int8_t* p) {  // LANES int8 -> float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf zero_f() { return _mm512_setzero_ps(); }
inline vf set1_f(float v) { return _mm512_set1_ps(v); }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
// 2 * LANES int8 widened to int16
inline vi load_w_i16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vi load_i16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline vi madd_add(vi acc, vi a, vi b) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}
inline vi zero_i() { return _mm512_setzero_si512(); }
inline int32_t hsum_i(vi v) { return _mm512_reduce_add_epi32(v); }
#else
constexpr int LANES = 8;
typedef __m256 vf;
typedef __m256i vi;
inline vf load_w_f32(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf zero_f() { return _mm256_setzero_ps(); }
inline vf set1_f(float v) { return _mm256_set1_ps(v); }
inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vi load_w_i16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi load_i16(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline vi madd_add(vi acc, vi a, vi b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
inline vi zero_i() { return _mm256_setzero_si256(); }
inline int32_t hsum_i(vi v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

constexpr int MAX_ROWS = 4;
// Weight rows read together: enough independent sums to hide the FMA
// latency, few enough that M * R accumulators stay in registers on AVX2.
template <int M>
constexpr int rows_per_step() { return M <= 2 ? 4 : 2; }
// Bytes of weight rows ahead that are prefetched.
constexpr int PREFETCH_BYTES = 8192;

inline void prefetch(const int8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// The weight-only kernel on rows [n0, n1); xf: M rows of k float32. Each
// row has `groups` scales (row stride `groups`), one per k / groups inputs:
// either one group (per channel: the sum is scaled once) or groups whose
// size is a multiple of LANES (each group's vector sums scaled and added).
template <int M>
void w8_range(const float* xf, int k, const int8_t* w, int64_t w_st,
              const float* scale, const uint16_t* scale_bf16, int groups,
              const uint16_t* bias, uint16_t* out, int64_t o_st, int n0,
              int n1) {
  constexpr int R = rows_per_step<M>();
  auto scale_of = [&](int row, int g) {
    const int64_t i = int64_t(row) * groups + g;
    return scale ? scale[i] : to_float(scale_bf16[i]);
  };
  const int group_size = k / groups;
  const int full = groups > 1 ? k : k / LANES * LANES;
  const int span = groups > 1 ? group_size : full;  // inputs per scale step
  for (int n = n0; n < n1; n += R) {
    const int cnt = std::min(R, n1 - n);
    const int8_t* wr[R];
    for (int j = 0; j < R; ++j)  // a short last step repeats a row
      wr[j] = w + int64_t(n + std::min(j, cnt - 1)) * w_st;
    vf total[M][R];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < R; ++j) total[m][j] = zero_f();
    for (int g0 = 0; g0 < full; g0 += span) {
      vf acc[M][R];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < R; ++j) acc[m][j] = zero_f();
      for (int c = g0; c < g0 + span; c += LANES) {
        vf wv[R];
        for (int j = 0; j < R; ++j) {
          wv[j] = load_w_f32(wr[j] + c);
          if ((c & 63) == 0) prefetch(wr[j] + c + PREFETCH_BYTES);
        }
        for (int m = 0; m < M; ++m) {
          const vf xv = load_f32(xf + int64_t(m) * k + c);
          for (int j = 0; j < R; ++j) acc[m][j] = fmadd(wv[j], xv, acc[m][j]);
        }
      }
      if (groups > 1) {
        vf sv[R];
        for (int j = 0; j < R; ++j)
          sv[j] = set1_f(scale_of(n + std::min(j, cnt - 1), g0 / group_size));
        for (int m = 0; m < M; ++m)
          for (int j = 0; j < R; ++j) total[m][j] = fmadd(acc[m][j], sv[j], total[m][j]);
      } else {
        for (int m = 0; m < M; ++m)
          for (int j = 0; j < R; ++j) total[m][j] = acc[m][j];
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < cnt; ++j) {
        float s = hsum(total[m][j]);
        if (groups == 1) {  // the tail, then the row's one scale
          for (int c = full; c < k; ++c)
            s += xf[int64_t(m) * k + c] * static_cast<float>(wr[j][c]);
          s *= scale_of(n + j, 0);
        }
        if (bias) s += to_float(bias[n + j]);
        out[m * o_st + n + j] = to_bf16(s);
      }
    }
  }
}

// The exact int8 x int8 kernel on rows [n0, n1); xi: M rows of k int16.
template <int M>
void i8i8_range(const int16_t* xi, int k, const int8_t* w, int64_t w_st,
                int32_t* out, int64_t o_st, int n0, int n1) {
  constexpr int R = rows_per_step<M>();
  constexpr int STEP = 2 * LANES;  // int16 lanes per vector
  const int full = k / STEP * STEP;
  for (int n = n0; n < n1; n += R) {
    const int cnt = std::min(R, n1 - n);
    const int8_t* wr[R];
    for (int j = 0; j < R; ++j)
      wr[j] = w + int64_t(n + std::min(j, cnt - 1)) * w_st;
    vi acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < R; ++j) acc[m][j] = zero_i();
    for (int c = 0; c < full; c += STEP) {
      vi wv[R];
      for (int j = 0; j < R; ++j) {
        wv[j] = load_w_i16(wr[j] + c);
        if ((c & 63) == 0) prefetch(wr[j] + c + PREFETCH_BYTES);
      }
      for (int m = 0; m < M; ++m) {
        const vi xv = load_i16(xi + int64_t(m) * k + c);
        for (int j = 0; j < R; ++j) acc[m][j] = madd_add(acc[m][j], wv[j], xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < cnt; ++j) {
        int32_t s = hsum_i(acc[m][j]);
        for (int c = full; c < k; ++c)
          s += int32_t(xi[int64_t(m) * k + c]) * int32_t(wr[j][c]);
        out[m * o_st + n + j] = s;
      }
    }
  }
}

// Rows [0, n) split among threads in whole steps of 4 rows (a multiple of
// every step size), each a contiguous share of the weight.
template <typename F>
void parallel_rows(int n, int num_threads, F body) {
  const int steps = (n + 3) / 4;
#pragma omp parallel num_threads(num_threads)
  {
    int t = 0, nt = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int n0 = int(int64_t(steps) * t / nt) * 4;
    const int n1 = std::min(n, int(int64_t(steps) * (t + 1) / nt) * 4);
    if (n0 < n1) body(n0, n1);
  }
}
#endif

}  // namespace

extern "C" {
// The most input rows the int8-weight kernels take; 0 where not built.
int vllm_br_gemv_w8_max_rows() {
#if defined(VLLM_BR_W8)
  return MAX_ROWS;
#else
  return 0;
#endif
}

// The group sizes (k / groups, where groups > 1) the weight-only kernel takes
// are multiples of this.
int vllm_br_gemv_w8_group_multiple() {
#if defined(VLLM_BR_W8)
  return LANES;
#else
  return 0;
#endif
}

// out [m, n] bf16 (row stride o_st) = x [m, k] bf16 (row stride x_st) times
// the int8 weight w [n, k] (row stride w_st) dequantized and transposed: each
// weight times its scale, scale [n, groups] (float32, or bf16 where
// scale_is_bf16) for groups of k / groups inputs; plus bias [n] (bf16) if not
// null. Returns 1 when it ran, 0 when not (nothing written): m outside
// 1..max rows, or groups that do not divide k into multiples of
// vllm_br_gemv_w8_group_multiple().
int vllm_br_gemv_w8_bf16(const void* x, int64_t x_st, int32_t m, const void* w,
                         int64_t w_st, int32_t n, int32_t k, const void* scale,
                         int32_t scale_is_bf16, int32_t groups, const void* bias,
                         void* out, int64_t o_st, int32_t num_threads) {
#if defined(VLLM_BR_W8)
  if (m < 1 || m > MAX_ROWS || groups < 1) return 0;
  if (groups > 1 && (k % groups || (k / groups) % LANES)) return 0;
  auto xp = static_cast<const uint16_t*>(x);
  std::vector<float> xf(size_t(m) * k);  // the rows once in float32
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < k; ++c) xf[size_t(i) * k + c] = to_float(xp[i * x_st + c]);
  auto wp = static_cast<const int8_t*>(w);
  auto sp = scale_is_bf16 ? nullptr : static_cast<const float*>(scale);
  auto sb = scale_is_bf16 ? static_cast<const uint16_t*>(scale) : nullptr;
  auto bp = static_cast<const uint16_t*>(bias);
  auto op = static_cast<uint16_t*>(out);
  const float* xv = xf.data();
  parallel_rows(n, num_threads, [&](int n0, int n1) {
    switch (m) {
      case 1: w8_range<1>(xv, k, wp, w_st, sp, sb, groups, bp, op, o_st, n0, n1); break;
      case 2: w8_range<2>(xv, k, wp, w_st, sp, sb, groups, bp, op, o_st, n0, n1); break;
      case 3: w8_range<3>(xv, k, wp, w_st, sp, sb, groups, bp, op, o_st, n0, n1); break;
      default: w8_range<4>(xv, k, wp, w_st, sp, sb, groups, bp, op, o_st, n0, n1); break;
    }
  });
  return 1;
#else
  (void)x, (void)x_st, (void)m, (void)w, (void)w_st, (void)n, (void)k;
  (void)scale, (void)scale_is_bf16, (void)groups, (void)bias, (void)out, (void)o_st, (void)num_threads;
  return 0;
#endif
}

// out [m, n] int32 (row stride o_st) = x [m, k] int8 (row stride x_st) times
// the int8 weight w [n, k] (row stride w_st) transposed, summed exactly in
// int32. Returns 1 when it ran, 0 when not (m outside 1..max rows).
int vllm_br_gemv_i8i8(const void* x, int64_t x_st, int32_t m, const void* w,
                      int64_t w_st, int32_t n, int32_t k, void* out, int64_t o_st,
                      int32_t num_threads) {
#if defined(VLLM_BR_W8)
  if (m < 1 || m > MAX_ROWS) return 0;
  auto xp = static_cast<const int8_t*>(x);
  std::vector<int16_t> xi(size_t(m) * k);
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < k; ++c) xi[size_t(i) * k + c] = xp[i * x_st + c];
  auto wp = static_cast<const int8_t*>(w);
  auto op = static_cast<int32_t*>(out);
  const int16_t* xv = xi.data();
  parallel_rows(n, num_threads, [&](int n0, int n1) {
    switch (m) {
      case 1: i8i8_range<1>(xv, k, wp, w_st, op, o_st, n0, n1); break;
      case 2: i8i8_range<2>(xv, k, wp, w_st, op, o_st, n0, n1); break;
      case 3: i8i8_range<3>(xv, k, wp, w_st, op, o_st, n0, n1); break;
      default: i8i8_range<4>(xv, k, wp, w_st, op, o_st, n0, n1); break;
    }
  });
  return 1;
#else
  (void)x, (void)x_st, (void)m, (void)w, (void)w_st, (void)n, (void)k;
  (void)out, (void)o_st, (void)num_threads;
  return 0;
#endif
}
}
