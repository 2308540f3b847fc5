// Paged attention and KV-cache write for the cpu backend.
//
// Attention: the reference (vllm_br/ops/paged_attention.py) gathers K/V into
// padded tensors and runs PyTorch's flash kernel with a mask; at decode shapes
// (a handful of query rows per KV head) that is mostly per-head overhead, and
// prefills pay for the padding. This kernel reads K/V straight from the cache
// blocks through the block table and computes in float32: scores, softmax and
// the PV sum are float32, with one rounding of the output to the model dtype.
//
// Work comes as tiles: up to 16 consecutive query tokens of one request (a
// decode is a tile of one token). Token i of a request with query length q
// and sequence length L sits at position L - q + i and attends the keys at
// positions <= its own (causal), and > position - window with a sliding
// window. A work item is (tile, KV head); its rows are the tile's tokens times
// the G query heads sharing that KV head, so each K row is converted once and
// used by every row. The threads of one OpenMP region (the process's libgomp,
// torch's, so there is one pool) take whole tiles, all their KV heads, from a
// shared atomic counter, and prefetch the next decode tile's K/V while they
// compute the current one.
//
// Layout: the cache is one layer's [num_blocks, num_kv_heads, block_size,
// head_size + head_size_v] view given by its strides (last dim contiguous); K
// is [..., :head_size], V is [..., head_size:].
//
// On CPUs with AMX, bf16 prefill tiles can instead run on AMX tiles
// (attend_amx below, where the caller asks for it): the scores come from
// tile products and the softmax weights are rounded to bf16 for P V.
//
// Vectors are GCC vector extensions: 16 floats (one AVX-512 register, two on
// AVX2) for head sizes that are multiples of 32, else 8. A head is handled in
// chunks of two vectors: a bfloat16 chunk is loaded as 32-bit words whose low
// halves (shifted up) are the even elements and whose masked high halves are
// the odd ones, so converting costs two instructions; queries are stored in
// the same even/odd order, and the PV accumulators are re-interleaved at the
// end.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VLLM_BR_HAVE_AMX 1
#else
#define VLLM_BR_HAVE_AMX 0
#endif

namespace {

typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <typename V>
struct Lanes;
template <>
struct Lanes<f32x8> {
  using U = u32x8;
  static constexpr int W = 8;
};
template <>
struct Lanes<f32x16> {
  using U = u32x16;
  static constexpr int W = 16;
};

inline float hsum(f32x4 v) {
  const f32x4 s = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
  return s[0] + s[1];
}
inline float hsum(f32x8 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3) +
              __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
inline float hsum(f32x16 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The sums of four vectors: three shuffle-and-add rounds instead of four
// separate horizontal sums.
inline void hsum4(const f32x8 (&v)[4], float* out) {
  const f32x8 a = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(v[0], v[1], 4, 5, 6, 7, 12, 13, 14, 15);
  const f32x8 b = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(v[2], v[3], 4, 5, 6, 7, 12, 13, 14, 15);
  const f32x8 c = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
                  __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
  const f32x8 d = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6);
  for (int i = 0; i < 4; ++i) out[i] = d[2 * i];
}
inline void hsum4(const f32x16 (&v)[4], float* out) {
  f32x8 h[4];
  for (int i = 0; i < 4; ++i)
    h[i] = __builtin_shufflevector(v[i], v[i], 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v[i], v[i], 8, 9, 10, 11, 12, 13, 14, 15);
  hsum4(h, out);
}

// One chunk (2 * W values) of a row as two float vectors.
template <typename V>
inline void load_chunk(const uint16_t* p, V& a, V& b) {
  typename Lanes<V>::U w;
  std::memcpy(&w, p, sizeof(w));
  // Even elements: low halves shifted up; odd: high halves masked.
  const typename Lanes<V>::U lo = w << 16, hi = w & 0xFFFF0000u;
  std::memcpy(&a, &lo, sizeof(V));
  std::memcpy(&b, &hi, sizeof(V));
}
template <typename V>
inline void load_chunk(const float* p, V& a, V& b) {  // fp32: plain order
  std::memcpy(&a, p, sizeof(V));
  std::memcpy(&b, p + Lanes<V>::W, sizeof(V));
}

// Stores one chunk as load_chunk reads it: a holds the even elements and b
// the odd ones (bf16, rounded to nearest even like store() below, NaN to
// 0x7FC0), or the first and second halves (fp32).
template <typename V>
inline void store_chunk(uint16_t* p, V a, V b) {
  using U = typename Lanes<V>::U;
  auto rne = [](V v) {
    U u;
    std::memcpy(&u, &v, sizeof(u));
    const U r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return v != v ? U{} + 0x7FC0u : r;
  };
  const U w = rne(a) | (rne(b) << 16);
  std::memcpy(p, &w, sizeof(w));
}
template <typename V>
inline void store_chunk(float* p, V a, V b) {
  std::memcpy(p, &a, sizeof(V));
  std::memcpy(p + Lanes<V>::W, &b, sizeof(V));
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

typedef int32_t i32x16 __attribute__((vector_size(64)));

// exp(x) for x <= 0 (softmax after subtracting the max), 16 lanes at a time:
// Cephes' expf polynomial (about 1 ulp) with the exponent rounded to nearest
// by the float magic-number trick, so every step stays in vector registers.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lo = f32x16{} - 87.0f;
  x = x < lo ? lo : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  f32x16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f32x16 y = f32x16{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// In place: x[j] = exp(x[j] - max) for j < n; returns the sum.
inline float softmax_numerators(float* x, int n) {
  float m = x[0];
  int j = 0;
  if (n >= 16) {
    f32x16 mv;
    std::memcpy(&mv, x, sizeof(mv));
    for (j = 16; j + 16 <= n; j += 16) {
      f32x16 v;
      std::memcpy(&v, x + j, sizeof(v));
      mv = v > mv ? v : mv;
    }
    for (int l = 0; l < 16; ++l) m = mv[l] > m ? mv[l] : m;
  }
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  f32x16 sv = {};
  for (j = 0; j + 16 <= n; j += 16) {
    f32x16 v;
    std::memcpy(&v, x + j, sizeof(v));
    v = exp_nonpositive(v - m);
    std::memcpy(x + j, &v, sizeof(v));
    sv += v;
  }
  float sum = 0.0f;
  if (j < n) {  // the tail through one masked-off vector
    f32x16 v = f32x16{} - 1e30f;
    std::memcpy(&v, x + j, sizeof(float) * (n - j));
    v = exp_nonpositive(v - m);
    std::memcpy(x + j, &v, sizeof(float) * (n - j));
    for (int l = 0; l < n - j; ++l) sum += v[l];
  }
  for (int l = 0; l < 16; ++l) sum += sv[l];
  return sum;
}

// A score row sr[0, len): the softmax numerators of [lo, hi) (the scores
// times `scale` first, through the soft cap when there is one), zeros
// elsewhere. Returns 1 / their sum (0 for an empty range).
inline float softmax_row(float* sr, int lo, int hi, int len, float scale,
                         float soft_cap) {
  std::fill(sr, sr + lo, 0.0f);
  std::fill(sr + hi, sr + len, 0.0f);
  if (hi == lo) return 0.0f;
  if (soft_cap > 0.0f)
    for (int j = lo; j < hi; ++j) sr[j] = std::tanh(sr[j] * scale / soft_cap) * soft_cap;
  else if (scale != 1.0f)
    for (int j = lo; j < hi; ++j) sr[j] *= scale;
  return 1.0f / softmax_numerators(sr + lo, hi - lo);
}

inline int64_t block_id(int32_t b, int32_t num_blocks) {
  return b < 0 ? 0 : (b >= num_blocks ? num_blocks - 1 : b);
}

// Fields of one tile in the int32 [num_tiles, 5] table.
enum { TILE_REQ, TILE_TOKEN, TILE_QUERY_LEN, TILE_FIRST, TILE_TOKENS, TILE_FIELDS };
constexpr int MAX_TILE_TOKENS = 16;
constexpr int MAX_ROWS = 64 * MAX_TILE_TOKENS;

// The attention kernel's arguments, passed by pointer. Python mirrors this
// struct with ctypes (AttentionArgs in paged_attention.py); a unit test
// checks both layouts agree through vllm_br_attention_args_layout.
struct Args {
  const void* q;
  int64_t q_st, q_sh;
  const void* cache;
  int64_t c_sb, c_sh, c_sn;
  const int32_t* bt;
  int64_t bt_st;
  int32_t bt_width, num_blocks;
  const int32_t* seq_lens;
  const int32_t* tiles;
  int32_t num_tiles, num_heads, num_kv_heads, head_size, block_size;
  float scale, soft_cap;
  int32_t window;
  void* out;
  int64_t o_st, o_sh;
  int32_t num_threads;
  int32_t use_amx;  // the AMX path where it applies (bf16, head 64/128/256)
  int32_t dtype_is_bf16;  // else float32
  int32_t head_size_v, max_tile_tokens;
};

// Args' fields in declaration order (for the layout check).
#define VLLM_BR_ATTENTION_ARGS(X)                                                  \
  X(q) X(q_st) X(q_sh) X(cache) X(c_sb) X(c_sh) X(c_sn) X(bt) X(bt_st) X(bt_width) \
  X(num_blocks) X(seq_lens) X(tiles) X(num_tiles) X(num_heads) X(num_kv_heads)      \
  X(head_size) X(block_size) X(scale) X(soft_cap) X(window) X(out) X(o_st) X(o_sh)  \
  X(num_threads) X(use_amx) X(dtype_is_bf16) X(head_size_v) X(max_tile_tokens)

// Key k's row in `base` (one head's K or V in the cache) through a request's
// block-table row btr; shifts, not divisions, where the block size is a power
// of two (bs_shift >= 0, as it is in practice).
template <typename T>
inline const T* key_row(const Args& a, const int32_t* btr, int bs_shift, const T* base,
                        int k) {
  const int bs = a.block_size;
  const int b = bs_shift >= 0 ? k >> bs_shift : k / bs;
  const int i = bs_shift >= 0 ? k & (bs - 1) : k % bs;
  return base + block_id(btr[b], a.num_blocks) * a.c_sb + int64_t(i) * a.c_sn;
}

// The keys [k0, k1) that a tile reads: token t sits at position pos0 + t and
// attends the keys at positions <= its own (and > position - window).
struct TileKeys {
  int pos0, k0, k1;
};
inline TileKeys tile_keys(const Args& a, const int32_t* tile) {
  // A sequence never outgrows its block-table row; clamping (and the block
  // ids) keeps stale padding rows of a graph replay in bounds.
  const int L = std::min(a.seq_lens[tile[TILE_REQ]], a.bt_width * a.block_size);
  const int pos0 = L - tile[TILE_QUERY_LEN] + tile[TILE_FIRST];
  const int hi0 = std::max(pos0 + 1, 0);
  const int k0 = a.window > 0 ? std::max(hi0 - a.window, 0) : 0;
  return {pos0, k0, std::max(pos0 + tile[TILE_TOKENS], 0)};
}

// Fetches a decode tile's K|V, every KV head of keys [k, k1), into L2 with
// software prefetches, a few cache lines per call to step(), so that the
// next tile's K|V arrives while the current one computes (a long batch's
// cache does not fit in L2, so most of it comes from L3 or memory). Measured cache-cold on the 2-core host (see
// benchmarks/attention_kernel.py --layers 30): plain loads of the current
// tile before computing it were 1.7x faster than no streaming; prefetches,
// which retire at once instead of holding the out-of-order window while they
// miss, 1.1x faster again, and spreading them over the previous tile's
// compute 1.05x more. Loads spread the same way were slower than loads up
// front.
template <typename T>
struct KVStream {
  const Args* a;
  int bs_shift;
  const int32_t* btr = nullptr;
  const char* row = nullptr;
  int k = 0, k1 = 0, hh = 0, off = 0, row_bytes = 0;
  const char* row_of(int key, int head) const {
    const T* base = static_cast<const T*>(a->cache) + int64_t(head) * a->c_sh;
    return reinterpret_cast<const char*>(key_row(*a, btr, bs_shift, base, key));
  }
  // Lines left to fetch.
  int64_t lines() const {
    if (k >= k1) return 0;
    const int per_row = (row_bytes + 63) / 64;
    return (int64_t(k1 - k) * a->num_kv_heads - hh) * per_row - off / 64;
  }
  void start(const int32_t* tile) {
    const TileKeys tk = tile_keys(*a, tile);
    btr = a->bt + int64_t(tile[TILE_REQ]) * a->bt_st;
    k = tk.k0;
    k1 = tile[TILE_TOKENS] == 1 ? tk.k1 : k;  // prefill tiles: compute-bound
    hh = off = 0;
    row_bytes = 2 * a->head_size * int(sizeof(T));
    if (k < k1) row = row_of(k, 0);
  }
  void stop() { k = k1 = 0; }
  // State in locals while looping, so that it stays in registers.
  void step(int64_t count) {
    if (k >= k1 || count <= 0) return;
    const char* p = row;
    int kk = k, h = hh, o = off;
    const int heads = a->num_kv_heads, rb = row_bytes;
    const int64_t head_bytes = a->c_sh * int64_t(sizeof(T));
    for (; count > 0; --count) {
      __builtin_prefetch(p + o, 0, 1);  // prefetcht2: into L2
      o += 64;
      if (o < rb) continue;
      o = 0;
      if (++h < heads) {
        p += head_bytes;
        continue;
      }
      h = 0;
      if (++kk >= k1) break;
      p = row_of(kk, 0);
    }
    row = p;
    k = kk;
    hh = h;
    off = o;
  }
};

// One thread's share of the tiles: it takes whole tiles (all KV heads) from
// the shared counter, one at a time like a dynamic schedule, and takes the
// next one before computing the current one so that it can stream the next
// one's K|V meanwhile, spread over the current tile's key steps
// (steps_of(tile) of them, each calling stream.step(per_step)).
template <typename T, typename Item, typename StepsOf>
void take_tiles(const Args& a, std::atomic<int64_t>& next_tile, KVStream<T>& stream,
                Item&& attend_item, StepsOf&& steps_of) {
  auto tile_at = [&](int64_t t) { return a.tiles + t * TILE_FIELDS; };
  int64_t cur = next_tile.fetch_add(1);
  if (cur < a.num_tiles) {  // the first tile has nothing to overlap with
    stream.start(tile_at(cur));
    stream.step(INT64_MAX);
  }
  while (cur < a.num_tiles) {
    const int32_t* tile = tile_at(cur);
    const int64_t nxt = next_tile.fetch_add(1);
    if (nxt < a.num_tiles)
      stream.start(tile_at(nxt));
    else
      stream.stop();
    const int64_t steps = a.num_kv_heads * steps_of(tile);
    const int64_t per_step = steps > 0 ? (stream.lines() + steps - 1) / steps : 0;
    for (int h = 0; h < a.num_kv_heads; ++h) attend_item(tile, h, per_step);
    stream.step(INT64_MAX);  // whatever the estimate left
    cur = nxt;
  }
}

// V: vector type; NC: chunks of 2 * W values per head (compile time, so a K
// row stays in registers while every row of the tile reads it); RG: rows
// accumulated together in the PV pass (their accumulators stay in registers).
template <typename T, typename V, int NC, int RG>
void attend(const Args& a) {
  constexpr int W = Lanes<V>::W;
  constexpr int D = 2 * W * NC;
  const int G = a.num_heads / a.num_kv_heads;
  const T* q = static_cast<const T*>(a.q);
  const T* cache = static_cast<const T*>(a.cache);
  T* out = static_cast<T*>(a.out);
  const int bs = a.block_size;
  const int bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctz(bs) : -1;
  const bool capped = a.soft_cap > 0.0f;
  std::atomic<int64_t> next_tile{0};  // the threads' take_tiles() counter
#pragma omp parallel num_threads(a.num_threads)
  {
    std::vector<float> qf, s;
    std::vector<int> row_lo(MAX_ROWS), row_hi(MAX_ROWS);
    std::vector<float> inv(MAX_ROWS);
    KVStream<T> stream{&a, bs_shift};
    // One (tile, KV head) item; ``per_step`` lines of the next tile's K|V are
    // streamed per key step of the compute loops.
    auto attend_item = [&](const int32_t* tile, int h, int64_t per_step) {
      const int64_t r = tile[TILE_REQ];
      const int nt = tile[TILE_TOKENS];
      const int rows = nt * G;
      const TileKeys tk = tile_keys(a, tile);
      const int pos0 = tk.pos0;
      // Token t attends keys [lo_t, hi_t); the tile reads [k0, k1).
      auto lo_of = [&](int t) {
        const int hi = std::max(pos0 + t + 1, 0);
        return a.window > 0 ? std::max(hi - a.window, 0) : 0;
      };
      const int k0 = tk.k0, k1 = tk.k1;
      const int n = k1 - k0;
      const int64_t tok0 = tile[TILE_TOKEN];
      if (n <= 0) {  // padding rows: zeros, like the reference's masked rows
        for (int t = 0; t < nt; ++t)
          for (int g = 0; g < G; ++g) {
            T* o = out + (tok0 + t) * a.o_st + (int64_t(h) * G + g) * a.o_sh;
            for (int d = 0; d < D; ++d) store(o + d, 0.0f);
          }
        return;
      }
      // Queries (scaled, unless the soft cap needs raw scores) in chunk order.
      qf.resize(static_cast<size_t>(rows) * D);
      const float qmul = capped ? 1.0f : a.scale;
      for (int t = 0; t < nt; ++t)
        for (int g = 0; g < G; ++g) {
          const T* src = q + (tok0 + t) * a.q_st + (int64_t(h) * G + g) * a.q_sh;
          float* dst = qf.data() + static_cast<size_t>(t * G + g) * D;
          for (int c = 0; c < NC; ++c) {
            V qa, qb;
            load_chunk(src + 2 * W * c, qa, qb);
            qa *= qmul;
            qb *= qmul;
            std::memcpy(dst + 2 * W * c, &qa, sizeof(V));
            std::memcpy(dst + 2 * W * c + W, &qb, sizeof(V));
          }
        }
      // Row (t, g) is row t * G + g; its scores are s[row * n + key - k0].
      // One extra row of zeros pads the last PV group.
      s.assign(static_cast<size_t>(rows + 1) * n, 0.0f);
      for (int t = 0; t < nt; ++t)
        for (int g = 0; g < G; ++g) {
          row_lo[t * G + g] = lo_of(t) - k0;
          row_hi[t * G + g] = std::max(pos0 + t + 1, 0) - k0;
        }

      const int32_t* btr = a.bt + r * a.bt_st;
      const T* kbase = cache + int64_t(h) * a.c_sh;
      // Pass 1: scores. A K row in registers, every row that sees that key.
      auto row_at = [&](const T* base, int k) {
        return key_row(a, btr, bs_shift, base, k);
      };
      // One head's K|V of consecutive tokens are a whole token's heads apart:
      // too sparse for the hardware prefetcher, so fetch a few keys ahead.
      // Pass 1 fetches V with K (they are adjacent), so pass 2 reads it from
      // cache.
      constexpr int AHEAD = 12;
      auto prefetch_span = [&](const T* base, int k, int values) {
        const char* p = reinterpret_cast<const char*>(row_at(base, k));
        for (int off = 0; off < int(sizeof(T)) * values; off += 64)
          __builtin_prefetch(p + off);
      };
      auto prefetch = [&](const T* base, int k) { prefetch_span(base, k, D); };
      auto prefetch_kv = [&](int k) { prefetch_span(kbase, k, 2 * D); };
      int k = k0;
      // Four keys at a time where their K rows fit in registers: each row's
      // four dot products share one reduction. Rows that see only some of
      // the four get scores for the others too; softmax zeroes those.
      if constexpr (NC <= 2) {
        for (; k + 4 <= k1; k += 4) {
          stream.step(per_step);
          for (int i = 0; i < 4; ++i)
            if (k + i + AHEAD < k1) prefetch_kv(k + i + AHEAD);
          V ka[4][NC], kb[4][NC];
          for (int i = 0; i < 4; ++i)
            for (int c = 0; c < NC; ++c)
              load_chunk(row_at(kbase, k + i) + 2 * W * c, ka[i][c], kb[i][c]);
          const int t_lo = std::max(0, k - pos0);
          const int t_hi =
              a.window > 0 ? std::min(nt, k + 3 - pos0 + a.window) : nt;
          for (int row = t_lo * G; row < t_hi * G; ++row) {
            const float* qr = qf.data() + static_cast<size_t>(row) * D;
            V sum[4] = {};
            for (int c = 0; c < NC; ++c) {
              V qa, qb;
              std::memcpy(&qa, qr + 2 * W * c, sizeof(V));
              std::memcpy(&qb, qr + 2 * W * c + W, sizeof(V));
              for (int i = 0; i < 4; ++i) sum[i] += ka[i][c] * qa + kb[i][c] * qb;
            }
            hsum4(sum, s.data() + static_cast<size_t>(row) * n + (k - k0));
          }
        }
      }
      for (; k < k1; ++k) {
        stream.step(per_step);
        if (k + AHEAD < k1) prefetch_kv(k + AHEAD);
        const T* kp = row_at(kbase, k);
        V ka[NC], kb[NC];
        for (int c = 0; c < NC; ++c) load_chunk(kp + 2 * W * c, ka[c], kb[c]);
        // Tokens whose window holds key k: pos0 + t >= k and, with a window,
        // pos0 + t - window < k.
        const int t_lo = std::max(0, k - pos0);
        const int t_hi = a.window > 0 ? std::min(nt, k - pos0 + a.window) : nt;
        const int j = k - k0;
        for (int row = t_lo * G; row < t_hi * G; ++row) {
          const float* qr = qf.data() + static_cast<size_t>(row) * D;
          V sum = {};
          for (int c = 0; c < NC; ++c) {
            V qa, qb;
            std::memcpy(&qa, qr + 2 * W * c, sizeof(V));
            std::memcpy(&qb, qr + 2 * W * c + W, sizeof(V));
            sum += ka[c] * qa + kb[c] * qb;
          }
          s[static_cast<size_t>(row) * n + j] = hsum(sum);
        }
      }
      // Softmax per row over its own keys; the rest of the row becomes 0.
      // Scores are scaled already unless capped.
      for (int row = 0; row < rows; ++row)
        inv[row] = softmax_row(s.data() + static_cast<size_t>(row) * n, row_lo[row],
                               std::max(row_hi[row], row_lo[row]), n,
                               capped ? a.scale : 1.0f, a.soft_cap);
      // Pass 2: probabilities times V, RG rows at a time so their
      // accumulators stay in registers while a V row is read once.
      const T* vbase = kbase + D;
      for (int row0 = 0; row0 < rows; row0 += RG) {
        const float* p[RG];
        int lo = n, hi = 0;
        for (int i = 0; i < RG; ++i) {
          const int row = row0 + i < rows ? row0 + i : rows;  // rows: zeros
          p[i] = s.data() + static_cast<size_t>(row) * n;
          if (row < rows) {
            lo = std::min(lo, row_lo[row]);
            hi = std::max(hi, row_hi[row]);
          }
        }
        V acc_a[RG][NC] = {}, acc_b[RG][NC] = {};
        for (int j = lo; j < hi; ++j) {
          const int k = k0 + j;
          stream.step(per_step);
          if (j + AHEAD < hi) prefetch(vbase, k + AHEAD);
          const T* vp = row_at(vbase, k);
          V va[NC], vb[NC];
          for (int c = 0; c < NC; ++c) load_chunk(vp + 2 * W * c, va[c], vb[c]);
          for (int i = 0; i < RG; ++i) {
            const float w = p[i][j];
            for (int c = 0; c < NC; ++c) {
              acc_a[i][c] += w * va[c];
              acc_b[i][c] += w * vb[c];
            }
          }
        }
        for (int i = 0; i < RG && row0 + i < rows; ++i) {
          const int row = row0 + i, t = row / G, g = row % G;
          T* o = out + (tok0 + t) * a.o_st + (int64_t(h) * G + g) * a.o_sh;
          for (int c = 0; c < NC; ++c)
            store_chunk(o + 2 * W * c, acc_a[i][c] * inv[row], acc_b[i][c] * inv[row]);
        }
      }
    };

    // Key steps of a tile and KV head: pass 1 in groups of four keys, pass
    // 2 once per key and row group.
    take_tiles(a, next_tile, stream, attend_item, [&](const int32_t* tile) {
      const TileKeys tk = tile_keys(a, tile);
      const int64_t n = std::max(tk.k1 - tk.k0, 0);
      const int64_t groups = (int64_t(tile[TILE_TOKENS]) * G + RG - 1) / RG;
      return n / 4 + n % 4 + n * groups;
    });
  }
}

#if VLLM_BR_HAVE_AMX
// AMX (bf16 tiles) for bf16 caches, head sizes that are multiples of 64.
// Scores are S^T = K Q^T, so a 16-key group's K chunk is one tile load
// straight from the cache block (its keys are one stride apart) and only the
// small query block is rearranged; the 16x16 score block is transposed back
// into per-row scores for the softmax, which is attend()'s. Then O = P V with
// the bf16 weights loaded as tiles and V rearranged into the tile's pair
// layout (two keys' values interleaved) per 32 keys.

// The process must ask Linux for the AMX register state once; false where it
// refuses (then attend() runs).
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// y[i] = x[i] rounded to bf16 (nearest even), for i < n.
inline void to_bf16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(y + i, k,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, x + i)));
  }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// r[i] (16 dwords each) becomes column i of the 16x16 dword matrix.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // 4x4 transpose of 128-bit lanes
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// NC: 32-value chunks per head (even). All eight tiles are 16 x 64 bytes.
template <int NC>
void attend_amx(const Args& a) {
  constexpr int D = 32 * NC, E = D / 16;  // E: 16-value groups of a head
  static_assert(E % 4 == 0, "P V uses four accumulator tiles per pass");
  const int G = a.num_heads / a.num_kv_heads;
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  const uint16_t* cache = static_cast<const uint16_t*>(a.cache);
  uint16_t* out = static_cast<uint16_t*>(a.out);
  const int bs = a.block_size;
  const int bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctz(bs) : -1;
  const int64_t key_bytes = a.c_sn * int64_t(sizeof(uint16_t));
  std::atomic<int64_t> next_tile{0};
#pragma omp parallel num_threads(a.num_threads)
  {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) {
      cfg.colsb[i] = 64;
      cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    std::vector<float> s;
    std::vector<uint16_t> pb;
    std::vector<uint32_t> vt;  // V in tile pair layout, [ns / 32][E][16][16]
    std::vector<int> row_lo(MAX_ROWS), row_hi(MAX_ROWS);
    std::vector<float> inv(MAX_ROWS);
    alignas(64) uint32_t qt[NC][16][16];
    alignas(64) float ct[2][16][16];
    alignas(64) float ot[E][16][16];
    KVStream<uint16_t> stream{&a, bs_shift};
    // Word w of a tile row: value w / 2 of key 2kp + w % 2 (second register).
    alignas(64) uint16_t idx_lo[32], idx_hi[32];
    for (int w = 0; w < 32; ++w) {
      idx_lo[w] = uint16_t((w % 2) * 32 + w / 2);
      idx_hi[w] = uint16_t((w % 2) * 32 + 16 + w / 2);
    }
    const __m512i perm_lo = _mm512_load_si512(idx_lo);
    const __m512i perm_hi = _mm512_load_si512(idx_hi);

    auto attend_item = [&](const int32_t* tile, int h, int64_t per_step) {
      const int64_t r = tile[TILE_REQ];
      const int nt = tile[TILE_TOKENS];
      const int rows = nt * G;
      const TileKeys tk = tile_keys(a, tile);
      const int pos0 = tk.pos0, k0 = tk.k0, k1 = tk.k1;
      const int64_t tok0 = tile[TILE_TOKEN];
      if (k1 - k0 <= 0) {  // padding rows: zeros, like the reference's masked rows
        for (int t = 0; t < nt; ++t)
          for (int g = 0; g < G; ++g) {
            uint16_t* o = out + (tok0 + t) * a.o_st + (int64_t(h) * G + g) * a.o_sh;
            std::memset(o, 0, sizeof(uint16_t) * D);
          }
        return;
      }
      // Keys from kb0 (16-aligned, so a group stays in one cache block);
      // row_lo excludes the ones before k0.
      const int kb0 = k0 & ~15, m = k1 - kb0, ns = (m + 31) & ~31;
      const int RT = (rows + 15) / 16;
      for (int t = 0; t < nt; ++t) {
        const int hi = std::max(pos0 + t + 1, 0);
        const int lo = a.window > 0 ? std::max(hi - a.window, 0) : 0;
        for (int g = 0; g < G; ++g) {
          row_lo[t * G + g] = lo - kb0;
          row_hi[t * G + g] = hi - kb0;
        }
      }
      s.resize(static_cast<size_t>(RT) * 16 * ns);
      const int32_t* btr = a.bt + r * a.bt_st;
      const uint16_t* kbase = cache + int64_t(h) * a.c_sh;
      auto row_at = [&](const uint16_t* base, int k) {
        return key_row(a, btr, bs_shift, base, k);
      };
      auto prefetch_group = [&](int k) {  // K|V of keys [k, k + 16)
        for (int i = 0; i < 16 && k + i < k1; ++i) {
          const char* p = reinterpret_cast<const char*>(row_at(kbase, k + i));
          for (int off = 0; off < int(sizeof(uint16_t)) * 2 * D; off += 64)
            __builtin_prefetch(p + off);
        }
      };

      // Pass 1: scores, 16 rows x 16 keys per tile product.
      for (int rt = 0; rt < RT; ++rt) {
        for (int c = 0; c < NC; ++c) {  // Q^T of this row tile, chunk c
          __m512i qr[16];
          for (int i = 0; i < 16; ++i) {
            const int row = rt * 16 + i;
            if (row < rows) {
              const int t = row / G, g = row % G;
              qr[i] = _mm512_loadu_si512(q + (tok0 + t) * a.q_st +
                                         (int64_t(h) * G + g) * a.q_sh + 32 * c);
            } else {
              qr[i] = _mm512_setzero_si512();
            }
          }
          transpose16(qr);
          for (int i = 0; i < 16; ++i) _mm512_store_si512(qt[c][i], qr[i]);
        }
        const int live = std::min(16, rows - rt * 16);
        // ct[p][key][row] of group kg into the rows' scores.
        auto scatter = [&](int p, int kg) {
          __m512i sc[16];
          for (int i = 0; i < 16; ++i) sc[i] = _mm512_load_si512(ct[p][i]);
          transpose16(sc);
          for (int i = 0; i < live; ++i)
            _mm512_storeu_si512(s.data() + size_t(rt * 16 + i) * ns + (kg - kb0), sc[i]);
        };
        if constexpr (NC == 2) {
          // Tile registers are not renamed: the query tiles stay in 2 and 3,
          // and groups alternate between accumulators 0/1 and K tiles 4-5/6-7
          // so that a group's loads need not wait for the previous group's
          // products; its scores are read back one group later, when its
          // store has landed.
          _tile_loadd(2, qt[0], 64);
          _tile_loadd(3, qt[1], 64);
          int p = 0;
          for (int kg = kb0; kg < k1; kg += 16, p ^= 1) {
            stream.step(per_step);
            if (rt == 0 && kg + 32 < k1) prefetch_group(kg + 32);
            const uint16_t* kp = row_at(kbase, kg);
            if (p == 0) {
              _tile_zero(0);
              _tile_loadd(4, kp, key_bytes);
              _tile_loadd(5, kp + 32, key_bytes);
              _tile_dpbf16ps(0, 4, 2);
              _tile_dpbf16ps(0, 5, 3);
              _tile_stored(0, ct[0], 64);
            } else {
              _tile_zero(1);
              _tile_loadd(6, kp, key_bytes);
              _tile_loadd(7, kp + 32, key_bytes);
              _tile_dpbf16ps(1, 6, 2);
              _tile_dpbf16ps(1, 7, 3);
              _tile_stored(1, ct[1], 64);
            }
            if (kg > kb0) scatter(p ^ 1, kg - 16);
          }
          scatter(p ^ 1, kb0 + ((m - 1) & ~15));
        } else {
          for (int kg = kb0; kg < k1; kg += 16) {
            stream.step(per_step);
            if (rt == 0 && kg + 32 < k1) prefetch_group(kg + 32);
            const uint16_t* kp = row_at(kbase, kg);
            _tile_zero(0);
            for (int c = 0; c < NC; ++c) {
              _tile_loadd(1, kp + 32 * c, key_bytes);
              _tile_loadd(2, qt[c], 64);
              _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, ct[0], 64);
            scatter(0, kg);
          }
        }
      }
      // Softmax per row over its own keys; the rest of the row becomes 0.
      for (int row = 0; row < rows; ++row) {
        const int lo = std::max(row_lo[row], 0);
        const int hi = std::min(std::max(row_hi[row], lo), m);
        inv[row] = softmax_row(s.data() + static_cast<size_t>(row) * ns, lo, hi, ns,
                               a.scale, a.soft_cap);
      }
      // Pass 2: weights rounded to bf16 (as PyTorch's flash kernel rounds
      // them) times V. V rows outside [k0, k1) are zeros, not read: they
      // may be another sequence's or uninitialised (0 * NaN is NaN).
      // Rows past `rows` in the last row tile stay unset: a tile product's
      // row i reads only row i of P, and those output rows are not stored.
      pb.resize(s.size());
      to_bf16(s.data(), pb.data(), static_cast<int64_t>(rows) * ns);
      vt.resize(static_cast<size_t>(ns / 32) * E * 256);
      const uint16_t* vbase = kbase + D;
      for (int kb = 0; kb < ns; kb += 32) {
        uint32_t* dst = vt.data() + static_cast<size_t>(kb / 32) * E * 256;
        for (int kp = 0; kp < 16; ++kp) {
          stream.step(per_step);
          const int ka = kb0 + kb + 2 * kp;
          const bool in_a = ka >= k0 && ka < k1, in_b = ka + 1 >= k0 && ka + 1 < k1;
          const uint16_t* va = in_a ? row_at(vbase, ka) : nullptr;
          const uint16_t* vb = in_b ? row_at(vbase, ka + 1) : nullptr;
          for (int c = 0; c < NC; ++c) {
            const __m512i x = in_a ? _mm512_loadu_si512(va + 32 * c) : _mm512_setzero_si512();
            const __m512i y = in_b ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (2 * c) * 256 + kp * 16,
                               _mm512_permutex2var_epi16(x, perm_lo, y));
            _mm512_storeu_si512(dst + (2 * c + 1) * 256 + kp * 16,
                               _mm512_permutex2var_epi16(x, perm_hi, y));
          }
        }
      }
      for (int rt = 0; rt < RT; ++rt) {
        const uint16_t* prow = pb.data() + static_cast<size_t>(rt) * 16 * ns;
        for (int eg = 0; eg < E; eg += 4) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int kb = 0; kb < ns; kb += 32) {
            const uint32_t* vtb = vt.data() + (static_cast<size_t>(kb / 32) * E + eg) * 256;
            // Three B registers in turn (tiles are not renamed).
            _tile_loadd(4, prow + kb, ns * int64_t(sizeof(uint16_t)));
            _tile_loadd(5, vtb, 64);
            _tile_loadd(6, vtb + 256, 64);
            _tile_loadd(7, vtb + 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vtb + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
          _tile_stored(0, ot[eg], 64);
          _tile_stored(1, ot[eg + 1], 64);
          _tile_stored(2, ot[eg + 2], 64);
          _tile_stored(3, ot[eg + 3], 64);
        }
        for (int i = 0; i < std::min(16, rows - rt * 16); ++i) {
          const int row = rt * 16 + i, t = row / G, g = row % G;
          uint16_t* o = out + (tok0 + t) * a.o_st + (int64_t(h) * G + g) * a.o_sh;
          const __m512 w = _mm512_set1_ps(inv[row]);
          for (int e = 0; e < E; ++e)
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(o + 16 * e),
                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(ot[e][i]), w)));
        }
      }
    };

    // Key steps of a tile and KV head: per 16-key group and row tile in
    // pass 1, per key pair in the V rearrangement. (Only decode tiles are
    // streamed, and the caller sends this path prefills.)
    take_tiles(a, next_tile, stream, attend_item, [&](const int32_t* tile) {
      const TileKeys tk = tile_keys(a, tile);
      const int64_t n = std::max(tk.k1 - (tk.k0 & ~15), 0);
      const int64_t rts = (int64_t(tile[TILE_TOKENS]) * G + 15) / 16;
      return rts * ((n + 15) / 16) + (n + 31) / 32 * 16;
    });
    _tile_release();
  }
}
#endif

template <typename T>
bool dispatch(const Args& a) {
#if VLLM_BR_HAVE_AMX
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (a.use_amx && a.block_size % 16 == 0 && amx_ready()) {
      switch (a.head_size) {
        case 64: attend_amx<2>(a); return true;
        case 128: attend_amx<4>(a); return true;
        case 256: attend_amx<8>(a); return true;
        default: break;
      }
    }
  }
#endif
  switch (a.head_size) {
    case 16: attend<T, f32x8, 1, 4>(a); return true;
    case 32: attend<T, f32x16, 1, 4>(a); return true;
    case 48: attend<T, f32x8, 3, 2>(a); return true;
    case 64: attend<T, f32x16, 2, 4>(a); return true;
    case 80: attend<T, f32x8, 5, 2>(a); return true;
    case 96: attend<T, f32x16, 3, 2>(a); return true;
    case 128: attend<T, f32x16, 4, 2>(a); return true;
    case 256: attend<T, f32x16, 8, 1>(a); return true;
    default: return false;
  }
}

template <typename T>
void write_cache(const T* key, int64_t k_st, int64_t k_sh, const T* value,
                 int64_t v_st, int64_t v_sh, const int64_t* slots, int64_t n,
                 T* cache, int64_t c_sb, int64_t c_sh, int64_t c_sn,
                 int32_t num_kv_heads, int32_t head_size, int32_t head_size_v,
                 int32_t block_size, int64_t num_blocks) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0 || slot >= num_blocks * block_size) continue;  // padding
    T* dst = cache + (slot / block_size) * c_sb + (slot % block_size) * c_sn;
    for (int h = 0; h < num_kv_heads; ++h) {
      std::memcpy(dst + h * c_sh, key + i * k_st + h * k_sh,
                  sizeof(T) * head_size);
      std::memcpy(dst + h * c_sh + head_size, value + i * v_st + h * v_sh,
                  sizeof(T) * head_size_v);
    }
  }
}

}  // namespace

extern "C" {
// 1 where the attention kernel can take its AMX path (compiled for a CPU
// with AMX, and Linux grants the tile state), else 0.
int vllm_br_attention_has_amx() {
#if VLLM_BR_HAVE_AMX
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

// Returns 1 when it ran, 0 for a shape it does not handle (nothing written):
// head_size_v must equal head_size, which must be one of the sizes above, at
// most 64 query heads may share a KV head, and a tile holds at most 16 tokens.
// With use_amx, bf16 heads of 64, 128 or 256 take the AMX path where the CPU
// has it: measured faster for prefill tiles, slower for decodes (see
// benchmarks/ANALYSIS.md), so the caller asks for it per tile set.
int vllm_br_paged_attention(const Args* args) {
  const Args& a = *args;
  if (a.head_size_v != a.head_size || a.num_kv_heads <= 0 ||
      a.num_heads % a.num_kv_heads != 0 || a.num_heads / a.num_kv_heads > 64 ||
      a.max_tile_tokens > MAX_TILE_TOKENS)
    return 0;
  return a.dtype_is_bf16 ? dispatch<uint16_t>(a) : dispatch<float>(a);
}

// Writes sizeof(Args) and then each field's offset, in declaration order,
// into out (up to n values); returns the number of fields.
int32_t vllm_br_attention_args_layout(int64_t* out, int32_t n) {
  int32_t i = 0;
  if (i < n) out[i] = int64_t(sizeof(Args));
  ++i;
#define VLLM_BR_OFFSET(field)                                       \
  if (i < n) out[i] = int64_t(offsetof(Args, field));               \
  ++i;
  VLLM_BR_ATTENTION_ARGS(VLLM_BR_OFFSET)
#undef VLLM_BR_OFFSET
  return i - 1;
}

// K/V rows of n tokens into their flat slots; negative slots are padding.
// Returns 0 (nothing written) for an element size it does not handle.
int vllm_br_reshape_and_cache(int32_t elem_size, const void* key, int64_t k_st,
                              int64_t k_sh, const void* value, int64_t v_st,
                              int64_t v_sh, const int64_t* slots, int64_t n,
                              void* cache, int64_t c_sb, int64_t c_sh,
                              int64_t c_sn, int32_t num_kv_heads,
                              int32_t head_size, int32_t head_size_v,
                              int32_t block_size, int64_t num_blocks) {
  if (elem_size == 2)
    write_cache(static_cast<const uint16_t*>(key), k_st, k_sh,
                static_cast<const uint16_t*>(value), v_st, v_sh, slots, n,
                static_cast<uint16_t*>(cache), c_sb, c_sh, c_sn, num_kv_heads,
                head_size, head_size_v, block_size, num_blocks);
  else if (elem_size == 4)
    write_cache(static_cast<const float*>(key), k_st, k_sh,
                static_cast<const float*>(value), v_st, v_sh, slots, n,
                static_cast<float*>(cache), c_sb, c_sh, c_sn, num_kv_heads,
                head_size, head_size_v, block_size, num_blocks);
  else
    return 0;
  return 1;
}
}
