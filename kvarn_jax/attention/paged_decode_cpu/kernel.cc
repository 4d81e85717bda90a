// Decode attention over a KVarN paged cache on the CPU: one query token per sequence, fp32, the
// semantics of `attention/reference.py: attend` for rotated tiled caches (pages on their codes,
// the sink, the ring's block holding the query's own block, an optional token not cached yet).
// An XLA FFI handler (jax.ffi), built by `build.py`; docs/kernels.md ("The CPU decode kernel").
//
// Per (sequence, kv head): scores of every part into one buffer, one softmax, then the value
// sums. A tile's key scores and value sums run on its codes, as `schemes/kvarn.py` key_scores and
// value_sums do: a key is (c * scale_chan + zero_chan) * scale_tok, a value
// (c * scale_tok + zero_tok) * scale_chan, so the channel (key) or token (value) scales fold into
// the query or the probabilities and the codes are read once per tile, unpacked to floats in
// registers (AVX-512) or a row at a time.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

float half_to_float(uint16_t h) {
#ifdef __FLT16_MANT_DIG__
  _Float16 v;  // the hardware conversion where there is one (x86 F16C, Arm)
  std::memcpy(&v, &h, sizeof v);
  return static_cast<float>(v);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400u));
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// n values of a float buffer (f16, bf16 or f32) from element `offset`, widened to fp32.
void load_floats(const ffi::AnyBuffer& buf, int64_t offset, int64_t n, float* out) {
  switch (buf.element_type()) {
    case ffi::DataType::F32:
      std::memcpy(out, static_cast<const float*>(buf.untyped_data()) + offset, n * sizeof(float));
      return;
    case ffi::DataType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(buf.untyped_data()) + offset;
      int64_t i = 0;
#if defined(__F16C__)
      // 8 at a time: a scalar conversion merges into its register's upper lanes, which chains the
      // loop's iterations (5x slower)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
      for (; i < n; ++i) out[i] = half_to_float(p[i]);
      return;
    }
    default: {  // BF16 (checked by the handler)
      const uint16_t* p = static_cast<const uint16_t*>(buf.untyped_data()) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
      return;
    }
  }
}

bool is_float(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::F16 || t == ffi::DataType::BF16;
}

// One high-precision store (sink or tail ring) of one side: float rows, or uint8 codes with a
// scale and zero point per token. rows is [S, Hk, n, D], or with parts > 1 one buffer
// [S, parts, Hk, n, D] of which this store is part `part` (the vLLM bridge's rows: sink and ring
// block, K and V, of each row side by side). With `units`, rows is a buffer of units [U, D / ru]
// and row i of (s, h) is the ru units units[s * units_stride + ((part * hk + h) * n + i) * ru + k]
// (the vLLM bridge's rows where they live, in vLLM's blocks).
struct HpStore {
  const ffi::AnyBuffer* rows;
  const ffi::AnyBuffer* scale;  // [S, Hk, n] (int8 only)
  const ffi::AnyBuffer* zero;
  int64_t n;
  bool int8;
  int64_t parts = 1, part = 0;
  const int32_t* units = nullptr;
  int64_t units_stride = 0, ru = 1, num_units = 0;

  // rows [i, i + count) of (sequence slot s, kv head h) as fp32 [count, D]
  void load(int64_t s, int64_t h, int64_t hk, int64_t i, int64_t count, int64_t d, float* out) const {
    const int64_t r0 = ((s * parts + part) * hk + h) * n + i;
    if (units) {
      const int64_t len = d / ru;
      const int32_t* at = units + s * units_stride + (r0 - s * parts * hk * n) * ru;
      for (int64_t k = 0; k < count * ru; ++k, out += len)
        load_floats(*rows, std::clamp<int64_t>(at[k], 0, num_units - 1) * len, len, out);
      return;
    }
    if (!int8) {
      load_floats(*rows, r0 * d, count * d, out);
      return;
    }
    for (int64_t r = r0; r < r0 + count; ++r, out += d) {
      float sc, z;
      load_floats(*scale, r, 1, &sc);
      load_floats(*zero, r, 1, &z);
      const uint8_t* c = static_cast<const uint8_t*>(rows->untyped_data()) + r * d;
      for (int64_t j = 0; j < d; ++j) out[j] = static_cast<float>(c[j]) * sc + z;
    }
  }
};

// a . b over n elements; N > 0: n is N, known at compile time. Vector lanes accumulate in a
// fixed order and reduce by a fixed tree, so a call's result does not depend on its caller.
template <int N>
inline float dot(const float* a, const float* b, int64_t n = N) {
  if (N > 0) n = N;
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  float acc[4] = {};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int l = 0; l < 4; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// out[d] += sum_i p[i] * rows[i][d] over `count` rows of L floats (L: compile-time length or 0 for
// n): with L known the sums stay in registers across the rows
template <int L>
void weighted_rows(const float* p, const float* rows, int64_t count, int64_t n, float* out) {
  if constexpr (L > 0) {
    float a[L] = {};
    for (int64_t i = 0; i < count; ++i)
      for (int d = 0; d < L; ++d) a[d] += p[i] * rows[i * L + d];
    for (int d = 0; d < L; ++d) out[d] += a[d];
  } else {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t d = 0; d < n; ++d) out[d] += p[i] * rows[i * n + d];
  }
}

// the largest of n floats (-inf for none): 16 lanes, then a tree, so it vectorizes without
// -ffast-math (no NaN reaches it: scores of finite inputs are finite or -inf)
float max_of(const float* x, int64_t n) {
  float m[16];
  for (int l = 0; l < 16; ++l) m[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) m[l] = m[l] > x[i + l] ? m[l] : x[i + l];
  for (; i < n; ++i) m[0] = m[0] > x[i] ? m[0] : x[i];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) m[l] = m[l] > m[l + w] ? m[l] : m[l + w];
  return m[0];
}

// the sum of n floats: 16 lanes, then a tree (a plain loop is one chain of dependent adds)
float sum_of(const float* x, int64_t n) {
  float a[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) a[l] += x[i + l];
  for (; i < n; ++i) a[0] += x[i];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) a[l] += a[l + w];
  return a[0];
}

// x[i] <- exp(x[i] - shift), in a loop the compiler vectorizes (libm's expf is a call per element):
// 2^k * e^r with k = round((x - shift) / ln 2) and r reduced in two steps (ln 2 = hi + lo), e^r a
// degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error below 2e-7). Arguments below -87
// (and -inf: masked positions) give exactly 0.
void exp_shifted(float* x, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] - shift;
    const float vc = v < -87.f ? -87.f : v;
    const float k = (vc * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
    const float r = (vc - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    x[i] = v < -87.f ? 0.f : p * two_k;
  }
}

// codes of bit slot `shift` of n bytes, as floats
void unpack_row(const uint8_t* bytes, int shift, uint8_t mask, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>((bytes[i] >> shift) & mask);
}

#if defined(__AVX512F__)
constexpr int64_t kMaxGroup = 8;  // query heads per kv head the staged products hold (more: plain dots)

// lane i of the result: the sum of v[i]'s 16 lanes (16 reductions for the shuffles of ~3)
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], u[4], z[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: 4 vectors' sums over that lane
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Dots of G vectors x[g] with many rows, 16 rows at a time: each row's G accumulators are staged
// per g, and every 16 rows one `hsum16` per g writes out[g * stride + i .. i + 15].
struct Staged {
  __m512 stage[kMaxGroup][16];
  int ns = 0;
  int64_t at = 0;
  void flush(int64_t G, int64_t stride, float* out) {
    if (ns == 16) {
      for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(out + g * stride + at, hsum16(stage[g]));
    } else {
      for (int64_t g = 0; g < G; ++g) {
        for (int i = ns; i < 16; ++i) stage[g][i] = _mm512_setzero_ps();
        float tail[16];
        _mm512_storeu_ps(tail, hsum16(stage[g]));
        std::memcpy(out + g * stride + at, tail, ns * sizeof(float));
      }
    }
    at += ns;
    ns = 0;
  }
  // the G dots of one row (its C vectors in r) with x's G vectors of 16 * C floats
  template <int C>
  void push(const __m512* r, const float* x, int64_t G, int64_t stride, float* out) {
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(r[0], _mm512_loadu_ps(x + g * 16 * C));
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(r[c], _mm512_loadu_ps(x + g * 16 * C + c * 16), acc);
      stage[g][ns] = acc;
    }
    if (++ns == 16) flush(G, stride, out);
  }
  void finish(int64_t G, int64_t stride, float* out) {
    if (ns) flush(G, stride, out);
  }
};

// out[g * stride + i] = x[g] . (codes of row i), for the rows packed `per` to a byte in `rows` byte
// rows of L = 16 * C bytes (row i = byte row i / per, bit slot i % per); x: G vectors of L floats.
// The codes are unpacked in registers.
template <int C>
void code_products(const uint8_t* codes, int64_t rows, int per, int bits, const float* x, int64_t G, int64_t stride,
                   float* out) {
  constexpr int L = 16 * C;
  const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
  Staged st;
  for (int64_t m = 0; m < rows; ++m) {
    __m512i raw[C];
    for (int c = 0; c < C; ++c)
      raw[c] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + m * L + c * 16)));
    for (int j = 0; j < per; ++j) {
      // slot 0 needs no shift and the top slot no mask: bytes widened to 32 bits have no bits above
      const __m128i shift = _mm_cvtsi32_si128(j * bits);
      __m512 code[C];
      for (int c = 0; c < C; ++c) {
        const __m512i v = j == 0 ? raw[c] : _mm512_srl_epi32(raw[c], shift);
        code[c] = _mm512_cvtepi32_ps(j == per - 1 ? v : _mm512_and_si512(v, mask));
      }
      st.push<C>(code, x, G, stride, out);
    }
  }
  st.finish(G, stride, out);
}

// out[g * stride + i] = x[g] . rows[i], for `count` float rows of L = 16 * C floats
template <int C>
void row_products(const float* rows, int64_t count, const float* x, int64_t G, int64_t stride, float* out) {
  constexpr int L = 16 * C;
  Staged st;
  for (int64_t i = 0; i < count; ++i) {
    __m512 r[C];
    for (int c = 0; c < C; ++c) r[c] = _mm512_loadu_ps(rows + i * L + c * 16);
    st.push<C>(r, x, G, stride, out);
  }
  st.finish(G, stride, out);
}
#endif

// out[g * stride + i] = x[g] . rows[i], rows of L floats (L: compile-time length or 0 for n)
template <int L>
void float_products(const float* rows, int64_t count, const float* x, int64_t G, int64_t n, int64_t stride,
                    float* out) {
#if defined(__AVX512F__)
  if constexpr (L > 0 && L % 16 == 0) {
    if (G <= kMaxGroup) return row_products<L / 16>(rows, count, x, G, stride, out);
  }
#endif
  for (int64_t i = 0; i < count; ++i)
    for (int64_t g = 0; g < G; ++g) out[g * stride + i] = dot<L>(x + g * n, rows + i * n, n);
}

// out[g * stride + i] = x[g] . (codes of row i): `code_products` where it compiles for L, else a
// row of codes unpacked at a time and one dot per (row, g). L: the compile-time row length or 0.
template <int L>
void products(const uint8_t* codes, int64_t rows, int per, int bits, const float* x, int64_t G, int64_t n,
              int64_t stride, float* row, float* out) {
#if defined(__AVX512F__)
  if constexpr (L > 0 && L % 16 == 0) {
    if (G <= kMaxGroup) return code_products<L / 16>(codes, rows, per, bits, x, G, stride, out);
  }
#endif
  const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1);
  for (int64_t m = 0; m < rows; ++m)
    for (int j = 0; j < per; ++j) {
      unpack_row(codes + m * n, j * bits, mask, n, row);
      for (int64_t g = 0; g < G; ++g) out[g * stride + m * per + j] = dot<L>(x + g * n, row, n);
    }
}

struct Tile {  // a page tile whose scores are in the buffer from `offset`
  int64_t block, tile, offset;
};

// Everything one call reads, with its sizes: B rows, Hq / Hk query / kv heads (G = Hq / Hk per
// group), head_dim D, N pages of R tiles of T tokens, M block-table columns, S sequence slots.
struct Call {
  const float* q;
  const int32_t *tables, *lens, *seq_ids;
  const uint8_t *k_codes, *v_codes;
  const ffi::AnyBuffer *k_scale_chan, *k_zero_chan, *k_scale_tok, *v_scale_chan, *v_scale_tok, *v_zero_tok;
  HpStore sink[2], tail[2];
  const float *new_k, *new_v;
  float* out;
  float scale;
  int64_t window, k_bits, v_bits, bs, paged_from;
  bool has_new;
  int64_t B, Hq, Hk, G, D, N, R, T, M, S, sink_len, tail_blocks;
};

// One (sequence, kv head) pair at a time, with its own scratch. KD, KT: D and T when known at
// compile time (0: read from the call).
template <int KD, int KT>
struct Rows {
  const Call& c;
  const int64_t D, T, cap;  // cap: positions a row can score
  std::vector<float> s, qs, qz, chan, zero, tok, tz, row, ps, acc, prod, den, hk, hv;
  std::vector<Tile> tiles;

  explicit Rows(const Call& call)
      : c(call), D(KD ? KD : call.D), T(KT ? KT : call.T), cap(call.M * call.bs + call.sink_len + call.bs + 1),
        s(call.G * cap), qs(call.G * D), qz(call.G), chan(D), zero(D), tok(T), tz(T), row(std::max(D, T)),
        ps(call.G * T), acc(call.G * D), prod(call.G * std::max({D, T, call.sink_len + call.bs + 1})), den(call.G),
        hk((call.sink_len + call.bs + 1) * D), hv((call.sink_len + call.bs + 1) * D) {
    tiles.reserve(call.M * call.R);
  }

  void pair(int64_t b, int64_t h) {
    const int64_t G = c.G, Hk = c.Hk, Hq = c.Hq, bs = c.bs, M = c.M, R = c.R;
    const int kper = static_cast<int>(8 / c.k_bits), vper = static_cast<int>(8 / c.v_bits);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t len = std::clamp<int64_t>(c.lens[b], 0, M * bs);
    const int64_t sid = std::clamp<int64_t>(c.seq_ids[b], 0, c.S - 1);
    const int64_t lo = c.window > 0 ? std::max<int64_t>(len - c.window, 0) : 0;  // positions [lo, len) are seen
    const int64_t own = c.has_new ? len / bs : std::max<int64_t>((len - 1) / bs, 0);
    const int64_t page_lo = std::max(lo, c.sink_len < bs ? c.sink_len : int64_t{0});
    const float* qh = c.q + (b * Hq + h * G) * D;
    int64_t n = 0;  // scores so far, per query head
    tiles.clear();
    // ---- pages: whole blocks before the query's own, tiles holding a seen position
    for (int64_t j = c.paged_from / bs; j < std::min(own, M); ++j) {
      const int64_t blk = std::clamp<int64_t>(c.tables[b * M + j], 0, c.N - 1);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t p0 = j * bs + r * T;
        if (p0 + T <= page_lo || p0 >= len) continue;
        const int64_t t_idx = (blk * Hk + h) * R + r;
        load_floats(*c.k_scale_chan, t_idx * D, D, chan.data());
        load_floats(*c.k_zero_chan, t_idx * D, D, zero.data());
        load_floats(*c.k_scale_tok, t_idx * T, T, tok.data());
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t d = 0; d < D; ++d) qs[g * D + d] = qh[g * D + d] * chan[d];
          qz[g] = dot<KD>(qh + g * D, zero.data(), D);
        }
        const uint8_t* codes = c.k_codes + t_idx * (T * c.k_bits / 8) * D;
        products<KD>(codes, T / kper, kper, static_cast<int>(c.k_bits), qs.data(), G, D, T, row.data(), prod.data());
        // positions [page_lo, len) are read: a tile's are a contiguous range of it
        const int64_t t_lo = std::clamp<int64_t>(page_lo - p0, 0, T), t_hi = std::clamp<int64_t>(len - p0, 0, T);
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * cap + n;
          const float* pg = prod.data() + g * T;
          for (int64_t t = 0; t < T; ++t) sg[t] = (pg[t] + qz[g]) * tok[t] * c.scale;
          for (int64_t t = 0; t < t_lo; ++t) sg[t] = neg_inf;
          for (int64_t t = t_hi; t < T; ++t) sg[t] = neg_inf;
        }
        tiles.push_back({blk, r, n});
        n += T;
      }
    }
    // ---- the sink and the ring's block: the rows a position reads, a contiguous range of each
    // (sink rows [lo, len) below sink_len; ring rows of positions [max(lo, sink_len), len) in the
    // query's own block), loaded once as floats for both products; then the token not cached yet,
    // as one more row: the same sums in the same order as after writing it (its position is the
    // last), so a step that passes it gives the bits of one that writes it first
    const int64_t s_lo = std::min(lo, c.sink_len), ns = std::max<int64_t>(std::min(len, c.sink_len) - s_lo, 0);
    const int64_t base = own * bs, ring = (own % c.tail_blocks) * bs;
    const int64_t r_lo = std::clamp<int64_t>(std::max(lo, c.sink_len) - base, 0, bs);
    const int64_t nr = std::max<int64_t>(std::clamp<int64_t>(len - base, 0, bs) - r_lo, 0);
    c.sink[0].load(sid, h, Hk, s_lo, ns, D, hk.data());
    c.sink[1].load(sid, h, Hk, s_lo, ns, D, hv.data());
    c.tail[0].load(sid, h, Hk, ring + r_lo, nr, D, hk.data() + ns * D);
    c.tail[1].load(sid, h, Hk, ring + r_lo, nr, D, hv.data() + ns * D);
    const int64_t hp_from = n, hp_rows = ns + nr + (c.has_new ? 1 : 0);
    if (c.has_new) {
      std::memcpy(hk.data() + (ns + nr) * D, c.new_k + (b * Hk + h) * D, D * sizeof(float));
      std::memcpy(hv.data() + (ns + nr) * D, c.new_v + (b * Hk + h) * D, D * sizeof(float));
    }
    float_products<KD>(hk.data(), hp_rows, qh, G, D, cap, s.data() + n);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < hp_rows; ++i) s[g * cap + n + i] *= c.scale;
    n += hp_rows;
    // ---- one softmax over all parts (a row that sees nothing gets 0)
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * cap;
      float mx = max_of(sg, n);
      if (!std::isfinite(mx)) mx = 0.f;
      exp_shifted(sg, n, mx);
      den[g] = sum_of(sg, n);
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    // ---- value sums of the page tiles, on their codes
    for (const Tile& tl : tiles) {
      const int64_t t_idx = (tl.block * Hk + h) * R + tl.tile;
      load_floats(*c.v_scale_chan, t_idx * D, D, chan.data());
      load_floats(*c.v_scale_tok, t_idx * T, T, tok.data());
      load_floats(*c.v_zero_tok, t_idx * T, T, tz.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* p = s.data() + g * cap + tl.offset;
        for (int64_t t = 0; t < T; ++t) ps[g * T + t] = p[t] * tok[t];
        qz[g] = dot<KT>(p, tz.data(), T);  // sum_t p[t] * zero_tok[t]
      }
      const uint8_t* codes = c.v_codes + t_idx * (D * c.v_bits / 8) * T;
      products<KT>(codes, D / vper, vper, static_cast<int>(c.v_bits), ps.data(), G, T, D, row.data(), prod.data());
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += (prod[g * D + d] + qz[g]) * chan[d];
    }
    // ---- the sink's, ring's and new token's values
    for (int64_t g = 0; g < G; ++g)
      weighted_rows<KD>(s.data() + g * cap + hp_from, hv.data(), hp_rows, D, acc.data() + g * D);
    for (int64_t g = 0; g < G; ++g) {
      const float inv = den[g] > 0.f ? 1.f / den[g] : 1.f;
      float* og = c.out + (b * Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) og[d] = acc[g * D + d] * inv;
    }
  }
};

// Pairs go to XLA's CPU threads when there is work enough: each thread (the caller's too) takes the
// next pair until none is left, and the caller returns once every taken pair is done. A task the
// pool starts late finds none and ends; the state it shares lives as long as it does.
constexpr int64_t kTokensPerThread = 1024;  // cached tokens x kv heads per thread, at least (~50 us of work)

template <int KD, int KT>
void run(const Call& c, ffi::ThreadPool& pool, int64_t max_threads) {
  const int64_t pairs = c.B * c.Hk;
  int64_t tokens = 0;
  for (int64_t b = 0; b < c.B; ++b) tokens += std::clamp<int64_t>(c.lens[b], 0, c.M * c.bs) * c.Hk;
  int64_t threads = std::min({pool.num_threads() + 1, pairs, tokens / kTokensPerThread + 1});
  if (max_threads > 0) threads = std::min(threads, max_threads);
  if (threads <= 1) {
    Rows<KD, KT> rows(c);
    for (int64_t p = 0; p < pairs; ++p) rows.pair(p / c.Hk, p % c.Hk);
    return;
  }
  struct Shared {
    explicit Shared(const Call& call, int64_t n) : call(call), n(n) {}
    const Call call;
    const int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>(c, pairs);
  auto work = [shared] {
    Shared& sh = *shared;
    std::unique_ptr<Rows<KD, KT>> rows;  // made once a pair is taken: a late task allocates nothing
    for (int64_t p; (p = sh.next.fetch_add(1)) < sh.n;) {
      if (!rows) rows = std::make_unique<Rows<KD, KT>>(sh.call);
      rows->pair(p / sh.call.Hk, p % sh.call.Hk);
      if (sh.done.fetch_add(1) + 1 == sh.n) {
        std::lock_guard<std::mutex> lock(sh.mu);
        sh.cv.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(work)(work));  // a copy each: Schedule takes it by value
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == shared->n; });
}

template <int KD>
void run_d(const Call& c, ffi::ThreadPool& pool, int64_t max_threads) {
  switch (c.T) {
    case 32: return run<KD, 32>(c, pool, max_threads);
    case 64: return run<KD, 64>(c, pool, max_threads);
    case 128: return run<KD, 128>(c, pool, max_threads);
    default: return run<KD, 0>(c, pool, max_threads);
  }
}

ffi::Error Decode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                  ffi::Buffer<ffi::S32> seq_ids, ffi::AnyBuffer k_codes, ffi::AnyBuffer k_scale_chan,
                  ffi::AnyBuffer k_zero_chan, ffi::AnyBuffer k_scale_tok, ffi::AnyBuffer v_codes,
                  ffi::AnyBuffer v_scale_chan, ffi::AnyBuffer v_scale_tok, ffi::AnyBuffer v_zero_tok,
                  ffi::AnyBuffer sink_k, ffi::AnyBuffer sink_v, ffi::AnyBuffer tail_k, ffi::AnyBuffer tail_v,
                  ffi::Buffer<ffi::S32> hp_units,
                  ffi::AnyBuffer sink_k_scale, ffi::AnyBuffer sink_k_zero, ffi::AnyBuffer sink_v_scale,
                  ffi::AnyBuffer sink_v_zero, ffi::AnyBuffer tail_k_scale, ffi::AnyBuffer tail_k_zero,
                  ffi::AnyBuffer tail_v_scale, ffi::AnyBuffer tail_v_zero, ffi::Buffer<ffi::F32> new_k,
                  ffi::Buffer<ffi::F32> new_v, ffi::ResultBuffer<ffi::F32> out, float scale, int64_t window,
                  int64_t k_bits, int64_t v_bits, int64_t block_size, int64_t paged_from, int64_t has_new,
                  int64_t hp_parts, int64_t max_threads) {
  const auto qd = q.dimensions();
  const auto kd = k_codes.dimensions();
  const auto vd = v_codes.dimensions();
  const auto sd = sink_k.dimensions();
  const auto td = tail_k.dimensions();
  // hp_parts 4: the rows' sink and one-block ring (K, V, K, V) side by side, passed as all four
  // stores: sink_k [S, 4, Hk, n, D]; or (hp_parts -4) sink_k a buffer of units [U, D / ru] and
  // hp_units [S, 4 * Hk * n * ru] their indices (block_size rows a part)
  const bool joined = hp_parts == 4, by_units = hp_parts == -4;
  const size_t hp_rank = joined ? 5 : by_units ? 2 : 4;
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || sd.size() != hp_rank || td.size() != hp_rank ||
      tables.dimensions().size() != 2 || hp_units.dimensions().size() != 2 || (hp_parts != 1 && !joined && !by_units))
    return ffi::Error::InvalidArgument("kvarn cpu decode: unexpected ranks");
  Call c{};
  c.B = qd[0], c.Hq = qd[1], c.D = qd[2];
  c.N = kd[0], c.Hk = kd[1], c.R = kd[2];
  c.T = vd[4];
  c.M = tables.dimensions()[1];
  c.S = by_units ? hp_units.dimensions()[0] : sd[0];
  c.sink_len = by_units ? block_size : sd[hp_rank - 2];
  const int64_t tail_len = by_units ? block_size : td[hp_rank - 2];
  c.bs = block_size;
  if (c.Hk <= 0 || c.Hq % c.Hk || c.T * c.R != c.bs || kd[3] * 8 != c.T * k_bits || kd[4] != c.D ||
      vd[3] * 8 != c.D * v_bits || tail_len % c.bs || c.S <= 0 || !is_float(k_scale_chan.element_type()) ||
      k_codes.element_type() != ffi::DataType::U8 || v_codes.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("kvarn cpu decode: inconsistent shapes or dtypes");
  c.G = c.Hq / c.Hk, c.tail_blocks = tail_len / c.bs;
  const bool hp_int8 = sink_k.element_type() == ffi::DataType::U8;
  c.sink[0] = {&sink_k, &sink_k_scale, &sink_k_zero, c.sink_len, hp_int8};
  c.sink[1] = {&sink_v, &sink_v_scale, &sink_v_zero, c.sink_len, hp_int8};
  c.tail[0] = {&tail_k, &tail_k_scale, &tail_k_zero, tail_len, hp_int8};
  c.tail[1] = {&tail_v, &tail_v_scale, &tail_v_zero, tail_len, hp_int8};
  if (joined) {
    if (hp_int8 || sd[1] != 4 || sd[2] != c.Hk)
      return ffi::Error::InvalidArgument("kvarn cpu decode: joined sink and ring rows must be float [S, 4, Hk, n, D]");
    HpStore* stores[4] = {&c.sink[0], &c.sink[1], &c.tail[0], &c.tail[1]};
    for (int p = 0; p < 4; ++p) stores[p]->parts = 4, stores[p]->part = p;
  }
  if (by_units) {
    const int64_t per = hp_units.dimensions()[1], rows = 4 * c.Hk * block_size;
    if (hp_int8 || per % rows || sd[1] * (per / rows) != c.D)
      return ffi::Error::InvalidArgument("kvarn cpu decode: the units of the sink and ring rows do not make rows of head_dim");
    HpStore* stores[4] = {&c.sink[0], &c.sink[1], &c.tail[0], &c.tail[1]};
    for (int p = 0; p < 4; ++p) {
      HpStore& st = *stores[p];
      st.parts = 4, st.part = p, st.units = hp_units.typed_data(), st.units_stride = per, st.ru = per / rows;
      st.num_units = sd[0];
    }
  }
  c.q = q.typed_data();
  c.tables = tables.typed_data(), c.lens = lens.typed_data(), c.seq_ids = seq_ids.typed_data();
  c.k_codes = static_cast<const uint8_t*>(k_codes.untyped_data());
  c.v_codes = static_cast<const uint8_t*>(v_codes.untyped_data());
  c.k_scale_chan = &k_scale_chan, c.k_zero_chan = &k_zero_chan, c.k_scale_tok = &k_scale_tok;
  c.v_scale_chan = &v_scale_chan, c.v_scale_tok = &v_scale_tok, c.v_zero_tok = &v_zero_tok;
  c.new_k = new_k.typed_data(), c.new_v = new_v.typed_data();
  c.out = out->typed_data();
  c.scale = scale, c.window = window, c.k_bits = k_bits, c.v_bits = v_bits, c.paged_from = paged_from;
  c.has_new = has_new != 0;
  switch (c.D) {
    case 64: run_d<64>(c, pool, max_threads); break;
    case 128: run_d<128>(c, pool, max_threads); break;
    case 256: run_d<256>(c, pool, max_threads); break;
    default: run_d<0>(c, pool, max_threads);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvarnDecodeCpu, Decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's CPU threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, Hq, D], rotated
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block tables [B, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sequence slots [B]
                                  .Arg<ffi::AnyBuffer>()          // key codes [N, Hk, R, T*kb/8, D]
                                  .Arg<ffi::AnyBuffer>()          // key scale_chan [N, Hk, R, D]
                                  .Arg<ffi::AnyBuffer>()          // key zero_chan
                                  .Arg<ffi::AnyBuffer>()          // key scale_tok [N, Hk, R, T]
                                  .Arg<ffi::AnyBuffer>()          // value codes [N, Hk, R, D*vb/8, T]
                                  .Arg<ffi::AnyBuffer>()          // value scale_chan
                                  .Arg<ffi::AnyBuffer>()          // value scale_tok
                                  .Arg<ffi::AnyBuffer>()          // value zero_tok
                                  .Arg<ffi::AnyBuffer>()          // sink k [S, Hk, sink_len, D]
                                  .Arg<ffi::AnyBuffer>()          // sink v
                                  .Arg<ffi::AnyBuffer>()          // tail k [S, Hk, tail_len, D]
                                  .Arg<ffi::AnyBuffer>()          // tail v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sink and ring rows' units (hp_parts -4)
                                  .Arg<ffi::AnyBuffer>()          // int8 sink/tail scales and zeros
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new k [B, Hk, D] (or [1, 1, D])
                                  .Arg<ffi::Buffer<ffi::F32>>()   // new v
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, Hq, D], rotated frame
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("k_bits")
                                  .Attr<int64_t>("v_bits")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("paged_from")
                                  .Attr<int64_t>("has_new")
                                  .Attr<int64_t>("hp_parts")       // 1; 4 or -4: the bridge's rows
                                  .Attr<int64_t>("max_threads"));  // 0: as the work and XLA's pool allow
