// The CPU kernel of ASDT's adaptive chunk step (titan_ds/optim/core_cpu.py builds and calls it; the arithmetic is
// core.py's eager loop, op for op in fp32, so the two store the same bits: tests/optim/test_core_cpu.py).
//
// A chunk is a run of units (each restarting its quantization blocks) of `lengths`. It is stepped 16K values at a
// time (RANGE work items), each in two passes:
//   pass A: decode the momentum (and the per-coordinate second moment), m = m*b1 + g*(1-b1) -> M;
//           v = v*b2 + (g*g)*(1-b2), stored (encoded) at once, and D = v * inv_bc2
//   pass B: den = (sqrt(D) + eps) * bc1 (per coordinate; the correctly rounded sqrt, as asdt_math.ieee_sqrt) or
//           the unit's denominator; c = M / den, clamped;
//           w = w - (c + wd*w) * lr where the score is > 0 (bf16 weights: rounded to nearest, or stochastically
//           from the generator's own draws, draws16); M encoded into the momentum.
// Work items are 256 elements of one unit (every block size, 256 and 128, divides 256), spread over ATen's
// intra-op threads; a 4-bit state's codes go through a byte-per-code buffer and are packed after the pass (two
// codes share a byte, and a unit may start on either half). Build with -ffp-contract=off: no fused multiply-add
// may merge two of the eager loop's roundings.
#include <torch/extension.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Kind : int64_t { PLAIN_F32 = 0, PLAIN_BF16 = 1, Q8 = 8, Q4 = 4 };

// The code lookups and the update, 16 values at a time where the build targets AVX-512 (-march=native on a CPU
// that has it; the 8-bit decode by byte permutes with VBMI, the 4-bit ones by a register permute, a 16-value map's
// encode by a binary search), else 8 at a time with AVX2 (gathers), else one at a time; the same table values,
// multiplications, divisions and comparisons either way.

// out[k] = qmap[codes[k]] * scale
inline void decode8(float* out, const uint8_t* codes, int64_t n, const float* qmap, float scale) {
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 s16 = _mm512_set1_ps(scale);
  for (; k + 16 <= n; k += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k)));
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_i32gather_ps(idx, qmap, 4), s16));
  }
#endif
#if defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale);
  for (; k + 8 <= n; k += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k)));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_i32gather_ps(qmap, idx, 4), s));
  }
#endif
  for (; k < n; ++k) out[k] = qmap[codes[k]] * scale;
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
// The 8-bit decode without a gather: the 256 code values' four byte planes (plane b holds byte b of every value's
// bit pattern, 256 bytes = 4 registers) are looked up 64 codes at a time with byte permutes (vpermi2b: 128 entries
// from two registers, the codes' top bit picks the half), and the four planes interleaved back into the values.
// The same table values as the gather, times the same scale.
struct Planes8 {
  alignas(64) uint8_t b[4][256];
};

inline void make_planes8(Planes8& p, const float* qmap) {
  for (int c = 0; c < 256; ++c) {
    uint32_t u;
    std::memcpy(&u, qmap + c, 4);
    for (int b = 0; b < 4; ++b) p.b[b][c] = static_cast<uint8_t>(u >> (8 * b));
  }
}

// out[k] = qmap[codes[k]] * scale for k < n rounded down to 64; returns that count
inline int64_t decode8_planes(float* out, const uint8_t* codes, int64_t n, const Planes8& p, float scale) {
  // unpacking interleaves within 128-bit lanes: value 16q + 4l + j must sit at byte 16l + 4q + j
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
      52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
      44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i perm = _mm512_load_si512(order);
  __m512i t[4][4];
  for (int b = 0; b < 4; ++b)
    for (int q = 0; q < 4; ++q) t[b][q] = _mm512_load_si512(p.b[b] + 64 * q);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    const __m512i c = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(codes + k));
    const __mmask64 high = _mm512_movepi8_mask(c);
    __m512i r[4];
    for (int b = 0; b < 4; ++b) {
      r[b] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t[b][0], c, t[b][1]),
                                    _mm512_permutex2var_epi8(t[b][2], c, t[b][3]));
    }
    const __m512i w01lo = _mm512_unpacklo_epi8(r[0], r[1]), w01hi = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i w23lo = _mm512_unpacklo_epi8(r[2], r[3]), w23hi = _mm512_unpackhi_epi8(r[2], r[3]);
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo)), s));
    _mm512_storeu_ps(out + k + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo)), s));
    _mm512_storeu_ps(out + k + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi)), s));
    _mm512_storeu_ps(out + k + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi)), s));
  }
  return k;
}
#endif

// out[k] = qmap[nibble p0 + k] * scale (two codes a byte, the first in the high half)
inline void decode4(float* out, const uint8_t* bytes, int64_t p0, int64_t n, const float* qmap, float scale) {
  int64_t k = 0;
  if (n > 0 && (p0 & 1)) {
    out[0] = qmap[bytes[p0 >> 1] & 0x0F] * scale;
    k = 1;
  }
#if defined(__AVX512F__)
  {
    const __m512 s16 = _mm512_set1_ps(scale), q16 = _mm512_loadu_ps(qmap);  // the 16 codes' values, one register
    const __m512i shifts = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4),
                  low4 = _mm512_set1_epi32(0x0F);
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (; k + 16 <= n; k += 16) {  // nibbles p0+k.. start a byte here
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + ((p0 + k) >> 1)));
      const __m512i wide = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(eight, dup));
      const __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(wide, shifts), low4);
      _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_permutexvar_ps(idx, q16), s16));
    }
  }
#endif
#if defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i shifts = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0), low4 = _mm256_set1_epi32(0x0F);
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256 q_lo = _mm256_loadu_ps(qmap), q_hi = _mm256_loadu_ps(qmap + 8);  // the 16 codes' values
  for (; k + 8 <= n; k += 8) {  // nibbles p0+k.. start a byte here
    int32_t four;
    std::memcpy(&four, bytes + ((p0 + k) >> 1), 4);
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), dup));
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(wide, shifts), low4);
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));  // codes 8-15
    const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(q_lo, idx), _mm256_permutevar8x32_ps(q_hi, idx), hi);
    _mm256_storeu_ps(out + k, _mm256_mul_ps(v, s));
  }
#endif
  for (; k < n; ++k) {
    const int64_t p = p0 + k;
    const uint8_t byte = bytes[p >> 1];
    out[k] = qmap[(p & 1) ? (byte & 0x0F) : (byte >> 4)] * scale;
  }
}

// qstate.encode_with: the nearest code of each scaled value x, table[top] + (x >= next[table[top]]), top the
// upper 16 bits of x. One lookup a value here: entry[top] = code | threshold << 8, where the threshold is the
// midpoint's lower 16 bits as key() orders them when the midpoint lies in x's 16-bit bucket, else 0x10000 (never
// reached: the midpoint is above the whole bucket). For x and a midpoint with the same upper bits, x >= midpoint
// exactly when key(x) >= key(midpoint) (core_cpu._tables builds the entries; equal for every finite x).
inline uint32_t key(uint32_t bits) { return (bits & 0x80000000u) ? 0xFFFFu - (bits & 0xFFFFu) : (bits & 0xFFFFu); }

inline uint8_t code_of_bits(uint32_t bits, const uint32_t* entry) {
  const uint32_t e = entry[bits >> 16];
  return static_cast<uint8_t>((e & 0xFF) + (key(bits) >= (e >> 8) ? 1 : 0));
}

inline uint8_t code_of(float q, const uint32_t* entry) {
  uint32_t bits;
  std::memcpy(&bits, &q, 4);
  return code_of_bits(bits, entry);
}

// The nearest code of each value x[k] / scale (the division done here, in register: the same IEEE quotient).
inline void encode(uint8_t* dst, const float* x, float scale, int64_t n, const uint32_t* entry) {
  int64_t k = 0;
#if defined(__AVX512F__)
  {
    const __m512i byte = _mm512_set1_epi32(0xFF), low16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);
    const __m512 s = _mm512_set1_ps(scale);
    for (; k + 16 <= n; k += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x + k), s));
      const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, 16), reinterpret_cast<const int*>(entry), 4);
      const __m512i neg = _mm512_srai_epi32(bits, 31);
      const __m512i kx = _mm512_xor_si512(_mm512_and_si512(bits, low16), _mm512_and_si512(neg, low16));
      // one up where key(x) >= threshold
      const __mmask16 up = _mm512_cmpge_epi32_mask(kx, _mm512_srli_epi32(e, 8));
      const __m512i c = _mm512_mask_add_epi32(_mm512_and_si512(e, byte), up, _mm512_and_si512(e, byte), one);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(c));
    }
  }
#endif
#if defined(__AVX2__)
  const __m256i byte = _mm256_set1_epi32(0xFF), low16 = _mm256_set1_epi32(0xFFFF);
  const __m256 s = _mm256_set1_ps(scale);
  for (; k + 8 <= n; k += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + k), s));
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(entry), _mm256_srli_epi32(bits, 16), 4);
    const __m256i neg = _mm256_srai_epi32(bits, 31);  // all ones where the sign is set
    const __m256i kx = _mm256_xor_si256(_mm256_and_si256(bits, low16), _mm256_and_si256(neg, low16));
    const __m256i up = _mm256_cmpgt_epi32(_mm256_srli_epi32(e, 8), kx);  // threshold > key: no round up
    const __m256i c = _mm256_sub_epi32(_mm256_add_epi32(_mm256_and_si256(e, byte), _mm256_set1_epi32(1)),
                                       _mm256_and_si256(up, _mm256_set1_epi32(1)));
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + k), _mm_packus_epi16(w16, w16));
  }
#endif
  for (; k < n; ++k) dst[k] = code_of(x[k] / scale, entry);
}

// The unsigned 4-bit map is linear (code k is (k+1)/16): its nearest code needs no lookup. y = x*16 (exact:
// a power of two), c = trunc(y), code c - 1, one up where y >= c + 0.5 (the midpoint (2c+1)/32, exact, ties up as
// the table rounds them), clamped to 0..15; y first clamped to [-1, 16] (the codes at the ends, and no integer
// overflow). An inf or a NaN among the 8 takes the table. The same codes as qstate's table: checked once for
// every non-negative float up to 2 (1,073,741,825 floats, none differ); tests/optim/test_core_cpu.py checks 300
// floats either side of every midpoint and code, and random bit patterns.
// Whether the 16-entry code map q is the linear one encode_linear16 computes.
inline bool is_linear16(const float* q, int64_t n) {
  bool linear = n == 16;
  for (int64_t k = 0; linear && k < 16; ++k) linear = q[k] == static_cast<float>(k + 1) / 16.0f;
  return linear;
}

inline void encode_linear16(uint8_t* dst, const float* x, float scale, int64_t n, const uint32_t* entry) {
  int64_t k = 0;
#if defined(__AVX512F__)
  {
    const __m512 s = _mm512_set1_ps(scale), sixteen = _mm512_set1_ps(16.0f), minus1 = _mm512_set1_ps(-1.0f),
                 half = _mm512_set1_ps(0.5f);
    const __m512i one = _mm512_set1_epi32(1), fifteen = _mm512_set1_epi32(15), zero = _mm512_setzero_si512(),
                  low15 = _mm512_set1_epi32(0x7FFF), special = _mm512_set1_epi32(0x7F7F);
    for (; k + 16 <= n; k += 16) {
      const __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + k), s);
      const __m512i bits = _mm512_castps_si512(q);
      if (_mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_srli_epi32(bits, 16), low15), special)) {
        alignas(64) uint32_t b[16];  // an inf or a NaN: one at a time, from the table
        _mm512_store_si512(reinterpret_cast<__m512i*>(b), bits);
        for (int j = 0; j < 16; ++j) dst[k + j] = code_of_bits(b[j], entry);
        continue;
      }
      const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(q, sixteen), minus1), sixteen);
      const __m512i c = _mm512_cvttps_epi32(y);
      const __mmask16 up = _mm512_cmp_ps_mask(y, _mm512_add_ps(_mm512_cvtepi32_ps(c), half), _CMP_GE_OQ);
      __m512i code = _mm512_mask_add_epi32(_mm512_sub_epi32(c, one), up, _mm512_sub_epi32(c, one), one);
      code = _mm512_min_epi32(_mm512_max_epi32(code, zero), fifteen);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(code));
    }
  }
#endif
#if defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale), sixteen = _mm256_set1_ps(16.0f), minus1 = _mm256_set1_ps(-1.0f),
               half = _mm256_set1_ps(0.5f);
  const __m256i one = _mm256_set1_epi32(1), fifteen = _mm256_set1_epi32(15), zero = _mm256_setzero_si256(),
                low15 = _mm256_set1_epi32(0x7FFF), special = _mm256_set1_epi32(0x7F7F);
  for (; k + 8 <= n; k += 8) {
    const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + k), s);
    const __m256i bits = _mm256_castps_si256(q);
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), low15), special))) {
      alignas(32) uint32_t b[8];  // an inf or a NaN: one at a time, from the table
      _mm256_store_si256(reinterpret_cast<__m256i*>(b), bits);
      for (int j = 0; j < 8; ++j) dst[k + j] = code_of_bits(b[j], entry);
      continue;
    }
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(q, sixteen), minus1), sixteen);
    const __m256i c = _mm256_cvttps_epi32(y);
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_add_ps(_mm256_cvtepi32_ps(c), half), _CMP_GE_OQ));
    __m256i code = _mm256_sub_epi32(_mm256_sub_epi32(c, one), up);  // up is -1 where it rounds up
    code = _mm256_min_epi32(_mm256_max_epi32(code, zero), fifteen);
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + k), _mm_packus_epi16(w16, w16));
  }
#endif
  for (; k < n; ++k) dst[k] = code_of(x[k] / scale, entry);
}

#if defined(__AVX512F__)
// A 16-value map's nearest code, 16 values at a time, by a binary search over its 15 midpoints (`mids`, +inf
// after them): the code is the count of midpoints <= x/scale (qstate's bucketize, right=True, which its table
// gives for every finite value), four rounds of a permute from one register and a comparison. A NaN among the 16
// takes the table. Returns the count of values done (n rounded down to 16).
inline int64_t encode16_search(uint8_t* dst, const float* x, float scale, int64_t n, const float* mids,
                               const uint32_t* entry) {
  const __m512 m = _mm512_loadu_ps(mids), s = _mm512_set1_ps(scale);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + k), s);
    if (_mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q)) {
      alignas(64) float b[16];
      _mm512_store_ps(b, q);
      for (int j = 0; j < 16; ++j) dst[k + j] = code_of(b[j], entry);
      continue;
    }
    __m512i pos = _mm512_setzero_si512();
    for (int step = 8; step >= 1; step >>= 1) {
      const __m512 mid = _mm512_permutexvar_ps(_mm512_add_epi32(pos, _mm512_set1_epi32(step - 1)), m);
      pos = _mm512_mask_add_epi32(pos, _mm512_cmp_ps_mask(q, mid, _CMP_GE_OQ), pos, _mm512_set1_epi32(step));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(pos));
  }
  return k;
}
#endif

// The midpoints of a 16-value code map q as qstate._midpoints computes them (q[i] + (q[i+1] - q[i]) * 0.5 in fp32),
// +inf after the 15th.
inline void midpoints16(float* mids, const float* q) {
  for (int i = 0; i < 15; ++i) mids[i] = q[i] + (q[i + 1] - q[i]) * 0.5f;
  mids[15] = std::numeric_limits<float>::infinity();
}

// The codes of x[0:n) / scale: the linear unsigned 4-bit map arithmetically, another 16-value map by the binary
// search where the build has AVX-512 (`mids16`: its midpoints, else null), an 8-bit map by the table.
inline void encode_map(uint8_t* dst, const float* x, float scale, int64_t n, const uint32_t* entry, bool linear16,
                       const float* mids16) {
  if (linear16) {
    encode_linear16(dst, x, scale, n, entry);
    return;
  }
  int64_t done = 0;
#if defined(__AVX512F__)
  if (mids16) done = encode16_search(dst, x, scale, n, mids16, entry);
#endif
  encode(dst + done, x + done, scale, n - done, entry);
}

struct State {
  int64_t kind = PLAIN_F32;
  uint8_t* bytes = nullptr;   // quantized: the codes (4-bit: the buffer's packed bytes from byte 0)
  float* f32 = nullptr;       // plain fp32: the chunk's values
  c10::BFloat16* bf16 = nullptr;  // plain bf16: the chunk's values
  int64_t pos0 = 0;           // quantized: the chunk's first value's index in the codes (4-bit: a nibble index)
  float* absmax = nullptr;    // quantized: the chunk's first block scale
  const float* qmap = nullptr;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  std::shared_ptr<Planes8> planes;  // 8-bit: the code map's byte planes (decode8_planes)
#endif
  const uint32_t* entry = nullptr;  // encode()'s entry of each top-16-bit pattern
  int64_t block = 256;
  bool linear16 = false;      // the unsigned 4-bit map, (k+1)/16: encode_linear16
  bool map16 = false;         // a 16-value map: its midpoints in mids16 (encode_map)
  float mids16[16] = {};
  std::vector<int64_t> unit_block0;  // each unit's first block scale, relative to absmax

  // Values i0..i0+n of the chunk (`off` into unit `unit`; n <= 256, starting on a block of the unit) as fp32.
  void read(float* out, int64_t i0, int64_t n, int64_t unit, int64_t off) const {
    if (kind == PLAIN_F32) {
      std::memcpy(out, f32 + i0, n * sizeof(float));
      return;
    }
    if (kind == PLAIN_BF16) {
      for (int64_t k = 0; k < n; ++k) out[k] = static_cast<float>(bf16[i0 + k]);
      return;
    }
    for (int64_t b = 0; b < n; b += block) {
      const int64_t len = std::min(block, n - b);
      const float scale = absmax[unit_block0[unit] + (off + b) / block];
      if (kind == Q8) {
        int64_t done = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
        done = decode8_planes(out + b, bytes + pos0 + i0 + b, len, *planes, scale);
#endif
        decode8(out + b + done, bytes + pos0 + i0 + b + done, len - done, qmap, scale);
      }
      else decode4(out + b, bytes, pos0 + i0 + b, len, qmap, scale);
    }
  }

  // Store vals[0:n) (value i0.. of the chunk, `off` into unit `unit`; n <= 256, starting on a block of the unit):
  // plain: cast; quantized: per block, the absmax clipped at 1e-12 (torchao's scale_tensor), the codes of x/scale
  // (4-bit: into codes4[i0..], packed later).
  void write(const float* vals, int64_t i0, int64_t n, int64_t unit, int64_t off, uint8_t* codes4) {
    if (kind == PLAIN_F32) {
      for (int64_t k = 0; k < n; ++k) f32[i0 + k] = vals[k];
      return;
    }
    if (kind == PLAIN_BF16) {
      for (int64_t k = 0; k < n; ++k) bf16[i0 + k] = c10::BFloat16(vals[k]);
      return;
    }
    for (int64_t b = 0; b < n; b += block) {
      const int64_t len = std::min(block, n - b);
      // the largest |x| as the largest bit pattern of |x| (a NaN's is above every number's: torch.amax
      // propagates a NaN, and torch.clip(min=1e-12) keeps it), an integer max the compiler vectorizes
      const float* x = vals + b;
      uint32_t top_bits = 0;
      for (int64_t k = 0; k < len; ++k) {
        uint32_t u;
        std::memcpy(&u, x + k, 4);
        u &= 0x7FFFFFFFu;
        top_bits = u > top_bits ? u : top_bits;
      }
      float amax;
      std::memcpy(&amax, &top_bits, 4);
      const float scale = amax < 1e-12f ? 1e-12f : amax;
      absmax[unit_block0[unit] + (off + b) / block] = scale;
      encode_map(kind == Q8 ? bytes + pos0 + i0 + b : codes4 + i0 + b, x, scale, len, entry, linear16,
                 map16 ? mids16 : nullptr);
    }
  }

  // 4-bit: pack codes4[i0:i0+n) into the buffer's nibbles pos0+i0.., the other halves of the end bytes kept.
  void pack(const uint8_t* codes4, int64_t i0, int64_t n) {
    if (kind != Q4 || n == 0) return;
    const int64_t first = (pos0 + i0) >> 1, last = (pos0 + i0 + n - 1) >> 1;
    auto one = [&](int64_t byte) {  // an end byte: either half may be outside the range
      const int64_t p_hi = 2 * byte - pos0, p_lo = p_hi + 1;  // chunk indices of the high and low nibbles
      uint8_t out = bytes[byte];
      if (p_hi >= i0 && p_hi < i0 + n) out = static_cast<uint8_t>((out & 0x0F) | (codes4[p_hi] << 4));
      if (p_lo >= i0 && p_lo < i0 + n) out = static_cast<uint8_t>((out & 0xF0) | codes4[p_lo]);
      bytes[byte] = out;
    };
    one(first);
    const uint8_t* c = codes4 - pos0;  // c[2 * byte]: the high nibble's code
    for (int64_t byte = first + 1; byte < last; ++byte) {
      bytes[byte] = static_cast<uint8_t>((c[2 * byte] << 4) | c[2 * byte + 1]);
    }
    if (last != first) one(last);
  }
};

State make_state(int64_t kind, const torch::Tensor& data, int64_t pos0, const torch::Tensor& absmax,
                 const torch::Tensor& qmap, const torch::Tensor& table, const std::vector<int64_t>& lengths) {
  State s;
  s.kind = kind;
  if (kind == PLAIN_F32) {
    TORCH_CHECK(data.scalar_type() == torch::kFloat32 && data.is_contiguous(), "core_cpu: fp32 state expected");
    s.f32 = data.data_ptr<float>();
    return s;
  }
  if (kind == PLAIN_BF16) {
    TORCH_CHECK(data.scalar_type() == torch::kBFloat16 && data.is_contiguous(), "core_cpu: bf16 state expected");
    s.bf16 = reinterpret_cast<c10::BFloat16*>(data.data_ptr());
    return s;
  }
  TORCH_CHECK(kind == Q8 || kind == Q4, "core_cpu: unknown state kind ", kind);
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.is_contiguous(), "core_cpu: uint8 codes expected");
  s.bytes = data.data_ptr<uint8_t>();
  s.pos0 = pos0;
  s.absmax = absmax.data_ptr<float>();
  s.qmap = qmap.data_ptr<float>();
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  if (kind == Q8) {
    TORCH_CHECK(qmap.numel() == 256, "core_cpu: an 8-bit code map has 256 values");
    s.planes = std::make_shared<Planes8>();
    make_planes8(*s.planes, s.qmap);
  }
#endif
  TORCH_CHECK(table.scalar_type() == torch::kInt32 && table.numel() == 65536, "core_cpu: 65536 int32 entries expected");
  s.entry = reinterpret_cast<const uint32_t*>(table.data_ptr<int32_t>());
  s.block = kind == Q8 ? 256 : 128;
  s.linear16 = kind == Q4 && is_linear16(s.qmap, qmap.numel());
  s.map16 = qmap.numel() == 16;
  if (s.map16) midpoints16(s.mids16, s.qmap);
  s.unit_block0.resize(lengths.size());
  int64_t at = 0;
  for (size_t u = 0; u < lengths.size(); ++u) {
    s.unit_block0[u] = at;
    at += (lengths[u] + s.block - 1) / s.block;
  }
  return s;
}

struct Item {
  int64_t i0, n, unit, off;
};

std::vector<Item> items_of(const std::vector<int64_t>& lengths) {
  std::vector<Item> items;
  int64_t i0 = 0;
  for (size_t u = 0; u < lengths.size(); ++u) {
    for (int64_t off = 0; off < lengths[u]; off += 256) {
      items.push_back({i0 + off, std::min<int64_t>(256, lengths[u] - off), static_cast<int64_t>(u), off});
    }
    i0 += lengths[u];
  }
  return items;
}

// Values i0..i0+n of an fp32 or bf16 tensor as fp32: the tensor's own (fp32) or converted into `buf`.
inline const float* as_f32(float* buf, bool bf16, const void* base, int64_t i0, int64_t n) {
  if (!bf16) return static_cast<const float*>(base) + i0;
  const c10::BFloat16* src = static_cast<const c10::BFloat16*>(base) + i0;
  for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<float>(src[k]);
  return buf;
}

// The fp32 gradient as the step reads it: times `scale` (ZeRO-3's unscale and clip factor, folded into this read:
// each product rounded to fp32 as `g.mul_(scale)` would store it, so the step is bit for bit the one after that
// pass, without the pass over the gradient and without writing it). `scaled`: false when the factor is 1.
inline const float* grad_f32(float* buf, bool bf16, const void* base, int64_t i0, int64_t n, bool scaled,
                             float scale) {
  if (!scaled) return as_f32(buf, bf16, base, i0, n);
  const float* src = static_cast<const float*>(base) + i0;  // (fp32 only: the caller refuses a scaled bf16 one)
  for (int64_t k = 0; k < n; ++k) buf[k] = src[k] * scale;
  return buf;
}

// ---------------------------------------------------------------------------------------------- the torch seam
// The only place this file reads ATen's internals (titan_ds/torch_compat.py: the torch versions it was checked on,
// and the switch that keeps bf16 weights off the kernel elsewhere; tests/test_torch_compat.py: the canary): a CPU
// generator's mt19937 engine, leased (under the generator's lock) as its plain state, advanced here as n calls of
// its operator() would advance it, and stored back.
struct EngineLease {
  std::unique_lock<std::mutex> lock;
  at::CPUGeneratorImpl* gen = nullptr;
  at::mt19937_data_pod data;
};

inline void lease_engine(EngineLease& lease, at::Generator& generator) {
  lease.lock = std::unique_lock<std::mutex>(generator.mutex());
  lease.gen = at::check_generator<at::CPUGeneratorImpl>(generator);
  lease.data = lease.gen->engine().data();
  TORCH_CHECK(lease.data.seeded_ && lease.data.left_ > 0 && lease.data.left_ <= 624 && lease.data.next_ <= 624,
              "core_cpu: the generator's mt19937 state is not valid");
}

inline void return_engine(EngineLease& lease) {
  at::mt19937 advanced;
  advanced.set_data(lease.data);
  lease.gen->set_engine(advanced);
}

// n draws of at::mt19937 (what CPUGeneratorImpl::random() returns), each kept mod 2^16 (torch.randint(0, 2**16)),
// from the engine's state `d`, which is advanced as n calls of the engine's operator() advance it: the engine's
// algorithm (MT19937: a twist of the 624 words, then the tempering of each) with the tempering done for a run of
// words at a time.
void draws16(at::mt19937_data_pod& d, uint16_t* out, int64_t n) {
  constexpr int N = 624, M = 397;
  constexpr uint32_t MATRIX_A = 0x9908b0dfu, UMASK = 0x80000000u, LMASK = 0x7fffffffu;
  uint32_t* st = d.state_.data();
  auto twist = [&](uint32_t u, uint32_t v) { return (((u & UMASK) | (v & LMASK)) >> 1) ^ ((v & 1u) ? MATRIX_A : 0u); };
  while (n > 0) {
    if (d.left_ == 1) {  // operator() would twist at its next call, then draw word 0
      for (int i = 0; i < N - M; ++i) st[i] = st[i + M] ^ twist(st[i], st[i + 1]);
      for (int i = N - M; i < N - 1; ++i) st[i] = st[i + M - N] ^ twist(st[i], st[i + 1]);
      st[N - 1] = st[M - 1] ^ twist(st[N - 1], st[0]);
      d.left_ = N + 1;
      d.next_ = 0;
    }
    const int64_t take = std::min<int64_t>(n, d.left_ - 1);
    const uint32_t* src = st + d.next_;
    for (int64_t k = 0; k < take; ++k) {
      uint32_t y = src[k];
      y ^= (y >> 11);
      y ^= (y << 7) & 0x9d2c5680u;
      y ^= (y << 15) & 0xefc60000u;
      y ^= (y >> 18);
      out[k] = static_cast<uint16_t>(y & 0xFFFFu);
    }
    out += take;
    n -= take;
    d.next_ += static_cast<uint32_t>(take);
    d.left_ -= static_cast<int>(take);
  }
}

// n draws of `generator` as torch.randint(0, 2**16, (n,), generator=generator) takes them (the canary tests'
// entry to the seam; the step draws the same way, one sub-range at a time).
torch::Tensor generator_draws16(at::Generator generator, int64_t n) {
  TORCH_CHECK(n >= 0, "core_cpu: a count of draws >= 0 expected");
  EngineLease lease;
  lease_engine(lease, generator);
  std::vector<uint16_t> words(n);
  draws16(lease.data, words.data(), n);
  return_engine(lease);
  auto out = torch::empty({n}, torch::kInt32);
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t k = 0; k < n; ++k) o[k] = words[k];
  return out;
}
// ------------------------------------------------------------------------------------------ end of the torch seam

// fp32 values x[0:n) into bf16, as ATen's float -> bfloat16 conversion stores them (round to nearest even, a NaN
// as 0xFFFF), or, where noise is given, stochastically rounded as asdt_math.stochastic_round: a finite value's bit
// pattern plus its 16-bit draw, the low half cut off (infinities and NaNs not rounded).
inline void to_bf16(c10::BFloat16* dst, const float* x, const uint16_t* noise, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t k = 0; k < n; ++k) {
    uint32_t b;
    std::memcpy(&b, x + k, 4);
    const bool finite = (b & 0x7F800000u) != 0x7F800000u;
    const bool nan = !finite && (b & 0x007FFFFFu) != 0;
    uint32_t r;
    if (noise) r = finite ? (b + noise[k]) >> 16 : b >> 16;
    else r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;  // an infinity stays one: its low half is 0
    out[k] = nan ? static_cast<uint16_t>(0xFFFF) : static_cast<uint16_t>(r);
  }
}

// Pass B's arithmetic for the n values of one work item: the new weights into nb (which may be wb itself: each
// value is read before it is written), the count of changed values returned. Eight values at a time with AVX2
// where the build targets it, the rest one at a time; the same IEEE operations in the same order either way
// (division, comparisons that are false for NaN as the scalar ternaries are, a blend for each select).
inline int64_t update(float* nb, const float* wb, const float* Mi, const float* Di, const float* gb, int64_t n,
                      bool coord, float pun, float feps, bool clip, float lo_clip, float hi_clip, float fwd, float flr,
                      bool grad_weight) {
  int64_t k = 0, changed = 0;
#if defined(__AVX512F__)
  {
    const __m512 vp = _mm512_set1_ps(pun), ve = _mm512_set1_ps(feps), vlo = _mm512_set1_ps(lo_clip),
                 vhi = _mm512_set1_ps(hi_clip), vwd = _mm512_set1_ps(fwd), vlr = _mm512_set1_ps(flr),
                 zero = _mm512_setzero_ps();
    for (; k + 16 <= n; k += 16) {
      const __m512 den = coord ? _mm512_mul_ps(_mm512_add_ps(_mm512_sqrt_ps(_mm512_loadu_ps(Di + k)), ve), vp) : vp;
      __m512 c = _mm512_div_ps(_mm512_loadu_ps(Mi + k), den);
      if (clip) {  // a NaN compares false: it stays (torch.clamp)
        c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(c, vlo, _CMP_LT_OQ), vlo);
        c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(c, vhi, _CMP_GT_OQ), vhi);
      }
      const __m512 wi = _mm512_loadu_ps(wb + k);
      const __m512 score = grad_weight ? _mm512_abs_ps(_mm512_mul_ps(_mm512_loadu_ps(gb + k), wi)) : _mm512_abs_ps(c);
      const __mmask16 changes = _mm512_cmp_ps_mask(score, zero, _CMP_GT_OQ);
      const __m512 d = _mm512_mul_ps(_mm512_add_ps(c, _mm512_mul_ps(vwd, wi)), vlr);
      _mm512_storeu_ps(nb + k, _mm512_mask_sub_ps(wi, changes, wi, d));
      changed += __builtin_popcount(static_cast<unsigned>(changes));
    }
  }
#endif
#if defined(__AVX2__)
  const __m256 vp = _mm256_set1_ps(pun), ve = _mm256_set1_ps(feps), vlo = _mm256_set1_ps(lo_clip),
               vhi = _mm256_set1_ps(hi_clip), vwd = _mm256_set1_ps(fwd), vlr = _mm256_set1_ps(flr),
               zero = _mm256_setzero_ps(), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (; k + 8 <= n; k += 8) {
    const __m256 den = coord ? _mm256_mul_ps(_mm256_add_ps(_mm256_sqrt_ps(_mm256_loadu_ps(Di + k)), ve), vp) : vp;
    __m256 c = _mm256_div_ps(_mm256_loadu_ps(Mi + k), den);
    if (clip) {
      c = _mm256_blendv_ps(c, vlo, _mm256_cmp_ps(c, vlo, _CMP_LT_OQ));
      c = _mm256_blendv_ps(c, vhi, _mm256_cmp_ps(c, vhi, _CMP_GT_OQ));
    }
    const __m256 wi = _mm256_loadu_ps(wb + k);
    const __m256 score = grad_weight ? _mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(gb + k), wi), absmask)
                                     : _mm256_and_ps(c, absmask);
    const __m256 changes = _mm256_cmp_ps(score, zero, _CMP_GT_OQ);
    const __m256 d = _mm256_mul_ps(_mm256_add_ps(c, _mm256_mul_ps(vwd, wi)), vlr);
    _mm256_storeu_ps(nb + k, _mm256_blendv_ps(wi, _mm256_sub_ps(wi, d), changes));
    changed += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(changes)));
  }
#endif
  for (; k < n; ++k) {
    const float den = coord ? (std::sqrt(Di[k]) + feps) * pun : pun;
    float c = Mi[k] / den;
    if (clip) {  // torch.clamp: NaN stays NaN
      c = c < lo_clip ? lo_clip : c;
      c = c > hi_clip ? hi_clip : c;
    }
    const float wi = wb[k];
    const float score = grad_weight ? std::fabs(gb[k] * wi) : std::fabs(c);
    const bool changes = score > 0.0f;
    float d = fwd * wi;
    d = c + d;
    d = d * flr;
    nb[k] = changes ? wi - d : wi;
    changed += changes;
  }
  return changed;
}

// Items per sub-range: pass A and pass B run over 64 work items (16K values) at a time, so M
// and D (fp32, 128 KiB together) stay in the core's cache between the passes.
constexpr int64_t RANGE = 64;

// One chunk's step, in place. Returns the count of changed elements. `per_unit`: each unit's bc1 (a second moment
// per coordinate: v_kind >= 0, with `inv_bc2`) or its denominator (v_kind < 0). `codes4`: a byte per value of the
// chunk when a state is 4-bit. The new weights are stored in w: fp32, or bf16 rounded to nearest, or, with
// `generator` (a CPU generator), stochastically: its draws as torch.randint(0, 2**16, (n,), generator=generator)
// makes them, one per value in order, from its leased mt19937 engine (the torch seam above).
int64_t step(torch::Tensor w, const torch::Tensor& g, std::vector<int64_t> lengths,
             int64_t m_kind, torch::Tensor m_data, int64_t m_pos0, torch::Tensor m_absmax, torch::Tensor m_qmap,
             torch::Tensor m_table,
             int64_t v_kind, torch::Tensor v_data, int64_t v_pos0, torch::Tensor v_absmax, torch::Tensor v_qmap,
             torch::Tensor v_table,
             torch::Tensor inv_bc2, torch::Tensor per_unit, torch::Tensor codes4,
             double b1, double omb1, double b2, double omb2, double eps, double lr, double wd, bool clip,
             double clip_value, bool grad_weight, std::optional<at::Generator> generator, double grad_scale) {
  const int64_t n = g.numel();
  TORCH_CHECK(g.is_contiguous() && w.is_contiguous() && w.numel() == n, "core_cpu: contiguous chunk expected");
  const bool w_bf16 = w.scalar_type() == torch::kBFloat16, g_bf16 = g.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(w_bf16 || w.scalar_type() == torch::kFloat32, "core_cpu: fp32 or bf16 weights expected");
  TORCH_CHECK(g_bf16 || g.scalar_type() == torch::kFloat32, "core_cpu: fp32 or bf16 gradients expected");
  const float gscale = static_cast<float>(grad_scale);
  const bool scaled = gscale != 1.0f;
  TORCH_CHECK(!(scaled && g_bf16), "core_cpu: a gradient scale is folded into fp32 gradients only");
  State m = make_state(m_kind, m_data, m_pos0, m_absmax, m_qmap, m_table, lengths);
  const bool coord = v_kind >= 0;
  State v;
  if (coord) v = make_state(v_kind, v_data, v_pos0, v_absmax, v_qmap, v_table, lengths);
  const auto items = items_of(lengths);
  const int64_t n_items = static_cast<int64_t>(items.size());
  const void* gp = g.data_ptr();
  float* wf32 = w_bf16 ? nullptr : w.data_ptr<float>();
  c10::BFloat16* wbf = w_bf16 ? reinterpret_cast<c10::BFloat16*>(w.data_ptr()) : nullptr;
  const float* ib = coord ? inv_bc2.data_ptr<float>() : nullptr;
  const float* pu = per_unit.data_ptr<float>();
  uint8_t* c4 = codes4.numel() ? codes4.data_ptr<uint8_t>() : nullptr;
  const float fb1 = static_cast<float>(b1), fomb1 = static_cast<float>(omb1);
  const float fb2 = static_cast<float>(b2), fomb2 = static_cast<float>(omb2);
  const float feps = static_cast<float>(eps), flr = static_cast<float>(lr), fwd = static_cast<float>(wd);
  const float lo_clip = static_cast<float>(-clip_value), hi_clip = static_cast<float>(clip_value);
  std::vector<float> Mbuf(RANGE * 256), Dbuf(RANGE * 256);
  float* Mp = Mbuf.data();
  float* Dp = Dbuf.data();
  std::vector<int64_t> counts(n_items, 0);
  const bool sr = generator.has_value() && w_bf16;
  EngineLease lease;
  std::vector<uint16_t> noise(sr ? RANGE * 256 : 0);
  if (sr) lease_engine(lease, *generator);
  for (int64_t r = 0; r < n_items; r += RANGE) {
    const int64_t e = std::min(n_items, r + RANGE);
    const int64_t base = items[r].i0, len = items[e - 1].i0 + items[e - 1].n - base;
    at::parallel_for(r, e, 16, [&](int64_t lo, int64_t hi) {  // pass A
      float gbuf[256], mb[256], vb[256];
      for (int64_t it = lo; it < hi; ++it) {
        const Item& t = items[it];
        const float* gb = grad_f32(gbuf, g_bf16, gp, t.i0, t.n, scaled, gscale);
        m.read(mb, t.i0, t.n, t.unit, t.off);
        float* Mo = Mp + (t.i0 - base);
        for (int64_t k = 0; k < t.n; ++k) Mo[k] = mb[k] * fb1 + gb[k] * fomb1;
        if (coord) {
          v.read(vb, t.i0, t.n, t.unit, t.off);
          const float ibu = ib[t.unit];
          float* Do = Dp + (t.i0 - base);
          for (int64_t k = 0; k < t.n; ++k) {
            vb[k] = vb[k] * fb2 + (gb[k] * gb[k]) * fomb2;
            Do[k] = vb[k] * ibu;
          }
          v.write(vb, t.i0, t.n, t.unit, t.off, c4);
        }
      }
    });
    if (coord) v.pack(c4, base, len);
    if (sr) draws16(lease.data, noise.data(), len);  // randint(0, 2**16) keeps random() mod 2^16
    at::parallel_for(r, e, 16, [&](int64_t lo, int64_t hi) {  // pass B
      float gbuf[256], wbuf[256], nbuf[256];
      for (int64_t it = lo; it < hi; ++it) {
        const Item& t = items[it];
        const float* gb = grad_weight ? grad_f32(gbuf, g_bf16, gp, t.i0, t.n, scaled, gscale) : nullptr;
        const float* wb = as_f32(wbuf, w_bf16, w_bf16 ? static_cast<const void*>(wbf) : wf32, t.i0, t.n);
        // the new weights: in place (fp32), else (bf16) staged in nbuf
        float* nb = w_bf16 ? nbuf : wf32 + t.i0;
        const float* Mi = Mp + (t.i0 - base);
        const float* Di = Dp + (t.i0 - base);
        const int64_t changed = update(nb, wb, Mi, Di, gb, t.n, coord, pu[t.unit], feps, clip, lo_clip, hi_clip,
                                       fwd, flr, grad_weight);
        if (w_bf16) to_bf16(wbf + t.i0, nb, sr ? noise.data() + (t.i0 - base) : nullptr, t.n);
        m.write(Mi, t.i0, t.n, t.unit, t.off, c4);
        counts[it] = changed;
      }
    });
    m.pack(c4, base, len);
  }
  if (sr) return_engine(lease);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

// Each unit's sum of squared gradients in fp64, added to sq[u] (the per-unit second moment's first pass, for a
// chunk of several whole units): torch.segment_reduce(g.double() ** 2, "sum") sums each segment in order from 0,
// and so does this (a float's square is exact in fp64, and no -ffast-math lets the compiler reorder the sum).
void unit_sumsq(const torch::Tensor& g, std::vector<int64_t> lengths, torch::Tensor sq) {
  TORCH_CHECK(g.is_contiguous() && sq.scalar_type() == torch::kFloat64 && sq.is_contiguous() &&
              sq.numel() == static_cast<int64_t>(lengths.size()), "core_cpu: unit_sumsq arguments");
  const bool g_bf16 = g.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(g_bf16 || g.scalar_type() == torch::kFloat32, "core_cpu: fp32 or bf16 gradients expected");
  std::vector<int64_t> starts(lengths.size() + 1, 0);
  for (size_t u = 0; u < lengths.size(); ++u) starts[u + 1] = starts[u] + lengths[u];
  TORCH_CHECK(starts.back() == g.numel(), "core_cpu: the units' lengths do not sum to the chunk's");
  const void* gp = g.data_ptr();
  double* out = sq.data_ptr<double>();
  at::parallel_for(0, static_cast<int64_t>(lengths.size()), 64, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      double acc = 0.0;
      if (g_bf16) {
        const c10::BFloat16* x = static_cast<const c10::BFloat16*>(gp) + starts[u];
        for (int64_t k = 0; k < lengths[u]; ++k) {
          const double d = static_cast<double>(static_cast<float>(x[k]));
          acc = acc + d * d;
        }
      } else {
        const float* x = static_cast<const float*>(gp) + starts[u];
        for (int64_t k = 0; k < lengths[u]; ++k) {
          const double d = static_cast<double>(x[k]);
          acc = acc + d * d;
        }
      }
      out[u] = out[u] + acc;
    }
  });
}

// The codes encode() or encode_linear16() gives each value of x / scale (a byte each), as State::write picks
// them for the code map qmap (the tests compare them with qstate's table over many floats).
torch::Tensor encode_codes(const torch::Tensor& x, double scale, const torch::Tensor& qmap, const torch::Tensor& table) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && table.numel() == 65536,
              "core_cpu: encode_codes arguments");
  auto out = torch::empty({x.numel()}, torch::kUInt8);
  const float* q = qmap.data_ptr<float>();
  const bool linear16 = is_linear16(q, qmap.numel());
  float mids16[16];
  if (qmap.numel() == 16) midpoints16(mids16, q);
  const auto* entry = reinterpret_cast<const uint32_t*>(table.data_ptr<int32_t>());
  encode_map(out.data_ptr<uint8_t>(), x.data_ptr<float>(), static_cast<float>(scale), x.numel(), entry, linear16,
             qmap.numel() == 16 ? mids16 : nullptr);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("unit_sumsq", &unit_sumsq, "each unit's sum of squared gradients, fp64, in order");
  mod.def("encode_codes", &encode_codes, "the kernel's codes of x / scale (tests)");
  mod.def("generator_draws16", &generator_draws16, "torch.randint(0, 2**16, (n,), generator=g) (tests)");
  mod.def("step", &step, "ASDT's adaptive step of one chunk (titan_ds/optim/core.py's eager loop, bit for bit)");
}
