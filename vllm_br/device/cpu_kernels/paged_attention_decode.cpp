// Paged-attention decode for the cpu backend: one query token per request.
//
// The reference (vllm_br/ops/paged_attention.py) gathers every decode's K/V
// into a padded tensor and runs PyTorch's flash kernel, which at decode shapes
// (a handful of query rows per KV head) spends most of its time on per-head
// overhead. This kernel reads K/V straight from the cache blocks through the
// block table, once, and computes in float32: scores, softmax and the PV sum
// are float32, with one rounding of the output to the model dtype.
//
// Layout: the cache is one layer's [num_blocks, num_kv_heads, block_size,
// head_size + head_size_v] view given by its strides (last dim contiguous);
// K is [..., :head_size], V is [..., head_size:]. Query heads h * G .. h * G +
// G - 1 share KV head h. Work is split over (request, KV head) with OpenMP;
// the process's libgomp (torch's) is shared, so there is one thread pool.
//
// Vectors are GCC vector extensions of 8 floats (AVX2 registers; the compiler
// lowers them for whatever -march gives). A head is handled in chunks of 16
// values: a bfloat16 chunk is loaded as 8 32-bit words whose low halves
// (shifted up) are the even elements and whose masked high halves are the odd
// ones, so converting 16 values costs two instructions; the query is stored
// in the same even/odd order, and the PV accumulators are re-interleaved at
// the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 bits_to_float(u32x8 w) {
  f32x8 f;
  std::memcpy(&f, &w, 32);
  return f;
}

// Chunk c (16 values) of a row as (even, odd) float vectors.
inline void load_chunk(const uint16_t* p, f32x8& even, f32x8& odd) {
  u32x8 w;
  std::memcpy(&w, p, 32);
  even = bits_to_float(w << 16);
  odd = bits_to_float(w & 0xFFFF0000u);
}
inline void load_chunk(const float* p, f32x8& even, f32x8& odd) {
  std::memcpy(&even, p, 32);  // fp32 rows are used in plain order
  std::memcpy(&odd, p + 8, 32);
}

// One query head in the chunk order load_chunk produces.
template <typename T>
inline void permute_query(const float* q, int D, float* out) {
  for (int c = 0; c < D / 16; ++c)
    for (int i = 0; i < 8; ++i) {
      if constexpr (sizeof(T) == 2) {
        out[16 * c + i] = q[16 * c + 2 * i];
        out[16 * c + 8 + i] = q[16 * c + 2 * i + 1];
      } else {
        out[16 * c + i] = q[16 * c + i];
        out[16 * c + 8 + i] = q[16 * c + 8 + i];
      }
    }
}

inline float hsum(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float f) { *p = f; }
inline void store(uint16_t* p, float f) {  // round to nearest even, like torch
  if (std::isnan(f)) {
    *p = 0x7FC0;
    return;
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  *p = static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' expf
// polynomial (about 1 ulp); unlike std::exp it vectorises.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

inline int64_t block_id(int32_t b, int32_t num_blocks) {
  return b < 0 ? 0 : (b >= num_blocks ? num_blocks - 1 : b);
}

struct Args {
  const void* q;
  int64_t q_st, q_sh;
  const void* cache;
  int64_t c_sb, c_sh, c_sn;
  const int32_t* bt;
  int64_t bt_st;
  int32_t bt_width, num_blocks;
  const int32_t* seq_lens;
  const int64_t* req_idx;
  const int64_t* tok_idx;
  int32_t num_decodes, num_heads, num_kv_heads, head_size, block_size;
  float scale, soft_cap;
  int32_t window;
  void* out;
  int64_t o_st, o_sh;
  int32_t num_threads;
};

// NC = head_size / 16 chunks, a compile-time count so a K row stays in
// registers while every query head of the group reads it.
template <typename T, int NC>
void decode(const Args& a) {
  constexpr int D = 16 * NC;
  const int G = a.num_heads / a.num_kv_heads;
  const T* q = static_cast<const T*>(a.q);
  const T* cache = static_cast<const T*>(a.cache);
  T* out = static_cast<T*>(a.out);
  const int64_t items = static_cast<int64_t>(a.num_decodes) * a.num_kv_heads;
  const int bs = a.block_size;
#pragma omp parallel num_threads(a.num_threads)
  {
    std::vector<float> qf(static_cast<size_t>(G) * D), s, acc(G * D);
    std::vector<float> tmp(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int i = static_cast<int>(it / a.num_kv_heads);
      const int h = static_cast<int>(it % a.num_kv_heads);
      const int64_t r = a.req_idx ? a.req_idx[i] : i;
      const int64_t tok = a.tok_idx ? a.tok_idx[i] : i;
      // A sequence never outgrows its block-table row; clamping (and the
      // block ids) keeps stale padding rows of a graph replay in bounds.
      const int L = std::min(a.seq_lens[r], a.bt_width * bs);
      const int start = (a.window > 0 && L > a.window) ? L - a.window : 0;
      const int n = L > start ? L - start : 0;
      T* o = out + tok * a.o_st + static_cast<int64_t>(h) * G * a.o_sh;
      if (n == 0) {  // padding row: zeros, like the reference's masked rows
        for (int g = 0; g < G; ++g)
          for (int d = 0; d < D; ++d) store(o + g * a.o_sh + d, 0.0f);
        continue;
      }
      const bool capped = a.soft_cap > 0.0f;
      const float qmul = capped ? 1.0f : a.scale;  // else folded into q
      const T* qh = q + tok * a.q_st + static_cast<int64_t>(h) * G * a.q_sh;
      for (int g = 0; g < G; ++g) {
        for (int d = 0; d < D; ++d) tmp[d] = to_float(qh[g * a.q_sh + d]) * qmul;
        permute_query<T>(tmp.data(), D, qf.data() + g * D);
      }
      s.resize(static_cast<size_t>(G) * n);
      std::fill(acc.begin(), acc.end(), 0.0f);

      const int32_t* row = a.bt + r * a.bt_st;
      const int b0 = start / bs, b1 = (L - 1) / bs;
      // Pass 1: scores. K row in registers, every query head of the group.
      for (int b = b0; b <= b1; ++b) {
        const T* base = cache + block_id(row[b], a.num_blocks) * a.c_sb +
                        h * a.c_sh;
        const int t0 = b == b0 ? start - b * bs : 0;
        const int t1 = b == b1 ? L - b * bs : bs;
        for (int t = t0; t < t1; ++t) {
          const T* k = base + t * a.c_sn;
          f32x8 ke[NC], ko[NC];
          for (int c = 0; c < NC; ++c) load_chunk(k + 16 * c, ke[c], ko[c]);
          const int j = b * bs + t - start;
          for (int g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            f32x8 sum = {};
            for (int c = 0; c < NC; ++c) {
              f32x8 qe, qo;
              std::memcpy(&qe, qg + 16 * c, 32);
              std::memcpy(&qo, qg + 16 * c + 8, 32);
              sum += ke[c] * qe + ko[c] * qo;
            }
            s[g * n + j] = hsum(sum);
          }
        }
      }
      // Softmax per query head.
      float denom[64];
      for (int g = 0; g < G; ++g) {
        float* sg = s.data() + g * n;
        if (capped)
          for (int j = 0; j < n; ++j)
            sg[j] = std::tanh(sg[j] * a.scale / a.soft_cap) * a.soft_cap;
        float m = sg[0];
        for (int j = 1; j < n; ++j) m = sg[j] > m ? sg[j] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < n; ++j) {
          sg[j] = exp_nonpositive(sg[j] - m);
          sum += sg[j];
        }
        denom[g] = sum;
      }
      // Pass 2: probabilities times V, one query head at a time so its
      // accumulator stays in registers over the whole sequence.
      for (int g = 0; g < G; ++g) {
        f32x8 ae[NC] = {}, ao[NC] = {};
        const float* pg = s.data() + g * n;
        for (int b = b0; b <= b1; ++b) {
          const T* base = cache + block_id(row[b], a.num_blocks) * a.c_sb +
                          h * a.c_sh + D;
          const int t0 = b == b0 ? start - b * bs : 0;
          const int t1 = b == b1 ? L - b * bs : bs;
          for (int t = t0; t < t1; ++t) {
            const T* v = base + t * a.c_sn;
            const float p = pg[b * bs + t - start];
            for (int c = 0; c < NC; ++c) {
              f32x8 ve, vo;
              load_chunk(v + 16 * c, ve, vo);
              ae[c] += p * ve;
              ao[c] += p * vo;
            }
          }
        }
        const float inv = 1.0f / denom[g];
        T* og = o + g * a.o_sh;
        for (int c = 0; c < NC; ++c)
          for (int e = 0; e < 8; ++e) {
            if constexpr (sizeof(T) == 2) {
              store(og + 16 * c + 2 * e, ae[c][e] * inv);
              store(og + 16 * c + 2 * e + 1, ao[c][e] * inv);
            } else {
              store(og + 16 * c + e, ae[c][e] * inv);
              store(og + 16 * c + 8 + e, ao[c][e] * inv);
            }
          }
      }
    }
  }
}

template <typename T>
bool dispatch(const Args& a) {
  switch (a.head_size) {
    case 16: decode<T, 1>(a); return true;
    case 32: decode<T, 2>(a); return true;
    case 48: decode<T, 3>(a); return true;
    case 64: decode<T, 4>(a); return true;
    case 80: decode<T, 5>(a); return true;
    case 96: decode<T, 6>(a); return true;
    case 128: decode<T, 8>(a); return true;
    case 256: decode<T, 16>(a); return true;
    default: return false;
  }
}

}  // namespace

extern "C" {
// Returns 1 when it ran, 0 for a shape it does not handle (nothing written):
// head_size_v must equal head_size, which must be one of the sizes above, and
// at most 64 query heads may share a KV head.
int vllm_br_paged_attention_decode(
    int32_t dtype_is_bf16, const void* q, int64_t q_st, int64_t q_sh,
    const void* cache, int64_t c_sb, int64_t c_sh, int64_t c_sn,
    const int32_t* bt, int64_t bt_st, int32_t bt_width, int32_t num_blocks,
    const int32_t* seq_lens, const int64_t* req_idx, const int64_t* tok_idx,
    int32_t num_decodes, int32_t num_heads, int32_t num_kv_heads,
    int32_t head_size, int32_t head_size_v, int32_t block_size, float scale,
    float soft_cap, int32_t window, void* out, int64_t o_st, int64_t o_sh,
    int32_t num_threads) {
  if (head_size_v != head_size || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64)
    return 0;
  const Args a{q,        q_st,      q_sh,       cache,     c_sb,
               c_sh,     c_sn,      bt,         bt_st,     bt_width,
               num_blocks, seq_lens, req_idx,   tok_idx,   num_decodes,
               num_heads, num_kv_heads, head_size, block_size, scale,
               soft_cap, window,    out,        o_st,      o_sh,
               num_threads};
  return dtype_is_bf16 ? dispatch<uint16_t>(a) : dispatch<float>(a);
}
}
