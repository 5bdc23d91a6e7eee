// Part of the native CPU kernels (included inside their anonymous namespaces, never on its own): SIMD vectors of f32
// in the machine's own width through GCC's vector extensions (which clang also accepts), and the vector functions
// the kernels use.
//
// A vector is one register: 16 lanes with AVX-512, else 8 (AVX2, and the fallback elsewhere). The kernels size
// their register tiles to that; 16-lane vectors on an AVX2 machine take two registers each and spilled their tiles
// to the stack (the native attention's prefill path was 10x slower for it). The including file includes
// <immintrin.h> first, outside its namespace.

#ifndef PAXKV_CPU_NATIVE_VECTORS_H_
#define PAXKV_CPU_NATIVE_VECTORS_H_

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * 4)));
typedef int32_t IntVec __attribute__((vector_size(kLanes * 4)));
typedef uint16_t HalfVec __attribute__((vector_size(kLanes * 2)));

inline Vec Max(Vec a, Vec b) { return a > b ? a : b; }
// Whether any lane of v exceeds x (a mask test, without a horizontal reduction).
inline bool AnyAbove(Vec v, float x) {
  const IntVec above = v > x;
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)above, (__m512i)above) != 0;
#elif defined(__AVX__)
  return !_mm256_testz_si256((__m256i)above, (__m256i)above);
#else
  for (int64_t j = 0; j < kLanes; ++j) {
    if (above[j]) return true;
  }
  return false;
#endif
}
inline Vec LoadVec(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreVec(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }
// StoreVec without reading p's cache line first (a non-temporal store, weakly ordered: sfence before others read it)
// where p is aligned to a whole vector; elsewhere StoreVec.
inline void StreamVec(float* p, Vec v) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(p) % sizeof(Vec) == 0) return _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
  if (reinterpret_cast<uintptr_t>(p) % sizeof(Vec) == 0) return _mm256_stream_ps(p, (__m256)v);
#endif
  StoreVec(p, v);
}
// Orders this thread's StreamVec stores before its later ones (the work item's end, before others read them).
inline void FenceStreams() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}
inline IntVec LoadIntVec(const int32_t* p) {
  IntVec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// rows transposed in place: lane j of rows[i] trades places with lane i of rows[j]. With AVX-512 in 64 shuffles (pairs
// of rows, then of pairs of lanes, then 128-bit quarters twice); a VGATHERDPS for each vector out had taken 3% of a
// prompt's attention.
inline void TransposeLanes(Vec (&rows)[kLanes]) {
#if defined(__AVX512F__)
  __m512 pairs[16], quads[16];
  for (int i = 0; i < 16; i += 2) {  // quarter q of pairs[i]: lanes 4q, 4q + 1 of rows i, i + 1 (of [i + 1]: 4q + 2, 3)
    pairs[i] = _mm512_unpacklo_ps((__m512)rows[i], (__m512)rows[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_ps((__m512)rows[i], (__m512)rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quarter q of quads[i + k]: rows i to i + 3 at lane 4q + k
    for (int k = 0; k < 2; ++k) {
      const __m512d first = _mm512_castps_pd(pairs[i + k]), second = _mm512_castps_pd(pairs[i + k + 2]);
      quads[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(first, second));
      quads[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(first, second));
    }
  }
  for (int k = 0; k < 4; ++k) {  // lane 4q + k of every row: quarter q of quads[k], [4 + k], [8 + k], [12 + k]
    const __m512 low01 = _mm512_shuffle_f32x4(quads[k], quads[4 + k], 0x44);  // quarters 0, 1 of each
    const __m512 high01 = _mm512_shuffle_f32x4(quads[k], quads[4 + k], 0xEE);  // 2, 3
    const __m512 low23 = _mm512_shuffle_f32x4(quads[8 + k], quads[12 + k], 0x44);
    const __m512 high23 = _mm512_shuffle_f32x4(quads[8 + k], quads[12 + k], 0xEE);
    rows[k] = (Vec)_mm512_shuffle_f32x4(low01, low23, 0x88);  // quarter 0 of all four
    rows[4 + k] = (Vec)_mm512_shuffle_f32x4(low01, low23, 0xDD);
    rows[8 + k] = (Vec)_mm512_shuffle_f32x4(high01, high23, 0x88);
    rows[12 + k] = (Vec)_mm512_shuffle_f32x4(high01, high23, 0xDD);
  }
#else
  for (int64_t i = 0; i < kLanes; ++i) {
    for (int64_t j = i + 1; j < kLanes; ++j) {
      const float lane = rows[i][j];
      rows[i][j] = rows[j][i];
      rows[j][i] = lane;
    }
  }
#endif
}

// One value as f32 (bf16 bits: the high half of an f32).
inline float LoadValue(const float* p) { return *p; }
inline float LoadValue(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float value;
  __builtin_memcpy(&value, &bits, sizeof(value));
  return value;
}

// Broadcasting, and kLanes bf16 or int8 values widened to f32 (exactly), by intrinsics on AVX2 and AVX-512: GCC's
// generic spellings compile to an add before each broadcast and to a widening through the narrower registers (on a
// Xeon with AVX-512, the blocked matmul's 30 SmolLM2 f32 MLPs at 32 rows took 42 ms with them, 36 with the
// intrinsics).
inline Vec LoadValues(const float* p) { return LoadVec(p); }
#if defined(__AVX2__) && !defined(__AVX512F__)
inline Vec Splat(float x) { return (Vec)_mm256_set1_ps(x); }
inline Vec LoadValues(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (Vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline Vec LoadValues(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
#elif defined(__AVX512F__)
inline Vec Splat(float x) { return (Vec)_mm512_set1_ps(x); }
inline Vec LoadValues(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (Vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline Vec LoadValues(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
#else
inline Vec Splat(float x) { return Vec{} + x; }
inline Vec LoadValues(const uint16_t* p) {
  HalfVec half;
  __builtin_memcpy(&half, p, sizeof(half));
  const IntVec bits = __builtin_convertvector(half, IntVec) << 16;
  Vec value;
  __builtin_memcpy(&value, &bits, sizeof(value));
  return value;
}
inline Vec LoadValues(const int8_t* p) {
  typedef int8_t ByteVec __attribute__((vector_size(kLanes)));
  ByteVec bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, Vec);
}
#endif

// a * b + c rounded once, spelled out: the compiler contracts `a * b + c` into one fused multiply-add in some
// instantiations of a template and not in others, so a result would depend on the tile height that computed it.
inline Vec MultiplyAdd(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  for (int64_t i = 0; i < kLanes; ++i) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return c;
#endif
}

// Two bf16 values of one weight column, contraction rows 2k (low half) and 2k + 1 (high half): the bf16 panel layout's
// element, whose kLanes-long vectors are what AVX-512 BF16's VDPBF16PS multiplies.
struct Bf16Pair {
  uint32_t bits;
};
inline Vec LoadValues(const Bf16Pair* p) {  // kLanes pairs as they are (the bits, not values)
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// acc + x_high * w_high + x_low * w_low, lane by lane over kLanes pairs of bf16 (x and w each hold a Bf16Pair per
// lane), rounded after each add, the high pair first: VDPBF16PS where the CPU has it (which also treats denormal
// inputs and sums as zero), else the same adds spelled out. Products of two bf16 are exact in f32.
inline Vec DotPairs(Vec acc, Vec x, Vec w) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return (Vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)w);
#else
  IntVec x_bits, w_bits;
  __builtin_memcpy(&x_bits, &x, sizeof(x));
  __builtin_memcpy(&w_bits, &w, sizeof(w));
  auto high = [](IntVec bits) {
    const IntVec masked = bits & static_cast<int32_t>(0xFFFF0000u);
    Vec value;
    __builtin_memcpy(&value, &masked, sizeof(value));
    return value;
  };
  auto low = [](IntVec bits) {
    const IntVec shifted = bits << 16;
    Vec value;
    __builtin_memcpy(&value, &shifted, sizeof(value));
    return value;
  };
  return MultiplyAdd(low(x_bits), low(w_bits), MultiplyAdd(high(x_bits), high(w_bits), acc));
#endif
}

// f32 to bf16 bits, rounded to nearest even (a NaN stays a NaN): what jnp's astype(bfloat16) gives.
inline uint16_t RoundToBf16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// kLanes bf16 pairs as the 32-bit lanes of an integer vector.
typedef uint32_t PairBits __attribute__((vector_size(kLanes * 4)));

// Two lanes-long f32 vectors rounded to bf16 (nearest even; finite inputs) and paired: low's in each lane's low half.
// With AVX-512 BF16 by VCVTNE2PS2BF16 (the halves side by side) and a word permute: the same bits for normal inputs
// (checked on every output of a 2048-token prompt's attention); a denormal input may come out as zero, which
// DotPairs's VDPBF16PS, the pairs' only reader, takes it as anyway.
inline Vec PackPairs(Vec low, Vec high) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh((__m512)high, (__m512)low);  // [low's 16 | high's 16]
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (Vec)_mm512_castsi512_ps(_mm512_permutexvar_epi16(interleave, halves));
#else
  PairBits low_bits, high_bits;
  __builtin_memcpy(&low_bits, &low, sizeof(low));
  __builtin_memcpy(&high_bits, &high, sizeof(high));
  low_bits = (low_bits + 0x7FFFu + ((low_bits >> 16) & 1u)) >> 16;
  high_bits = (high_bits + 0x7FFFu + ((high_bits >> 16) & 1u)) & 0xFFFF0000u;
  const PairBits pairs = low_bits | high_bits;
  Vec out;
  __builtin_memcpy(&out, &pairs, sizeof(out));
  return out;
#endif
}

// The 32 bits at p (a pair, as stored) in every lane, moved without arithmetic.
inline Vec SplatBits(const void* p) {
  uint32_t bits;
  __builtin_memcpy(&bits, p, sizeof(bits));
  const PairBits splat = PairBits{} + bits;
  Vec out;
  __builtin_memcpy(&out, &splat, sizeof(out));
  return out;
}

// n f32 values rounded to bf16 (nearest even) into to[0, n), where adjacent ones form Bf16Pairs (2k low, 2k + 1
// high): VCVTNEPS2BF16 a vector at a time where the CPU has it (it flushes denormals, as VDPBF16PS then would),
// RoundToBf16 for the rest.
inline void RoundToBf16s(const float* from, int64_t n, uint16_t* to) {
  int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (; k + kLanes <= n; k += kLanes) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(from + k));
    __builtin_memcpy(to + k, &rounded, sizeof(rounded));
  }
#endif
  for (; k < n; ++k) to[k] = RoundToBf16(from[k]);
}

// kVecs vectors of pairs (first[d], second[d]) for d in [0, kVecs * kLanes): two value rows interleaved.
template <int64_t kVecs>
inline void InterleaveRows(const uint16_t* first, const uint16_t* second, Vec* pairs) {
#if defined(__AVX512BW__)
  if constexpr (kVecs % 2 == 0) {
    const __m512i low_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                               38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high_index = _mm512_add_epi16(low_index, _mm512_set1_epi16(16));
    for (int64_t c = 0; c < kVecs; c += 2) {
      const __m512i a = _mm512_loadu_si512(first + c * kLanes), b = _mm512_loadu_si512(second + c * kLanes);
      pairs[c] = (Vec)_mm512_castsi512_ps(_mm512_permutex2var_epi16(a, low_index, b));
      pairs[c + 1] = (Vec)_mm512_castsi512_ps(_mm512_permutex2var_epi16(a, high_index, b));
    }
    return;
  }
#endif
  for (int64_t c = 0; c < kVecs; ++c) {
    HalfVec a, b;
    __builtin_memcpy(&a, first + c * kLanes, sizeof(a));
    __builtin_memcpy(&b, second + c * kLanes, sizeof(b));
    const PairBits bits = __builtin_convertvector(a, PairBits) | (__builtin_convertvector(b, PairBits) << 16);
    __builtin_memcpy(&pairs[c], &bits, sizeof(bits));
  }
}

// e^r for |r| <= ln2 / 2: a degree-7 polynomial (e's Taylor coefficients), for any GCC vector V of f32.
template <typename V>
inline V ExpPolynomial(V r) {
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// e^r for |r| <= ln2 / 2 to within 2.9e-6 of itself, for weights that are then rounded to bf16 (2^-9): a degree-4
// polynomial with 1 as its constant term (so e^0 is exactly 1), the other coefficients fitted to e^r's relative error
// over the interval (least squares, reweighted until the largest errors level out; 2.9e-6 checked at 400,001 points
// in f32 arithmetic). Three multiply-adds fewer than ExpPolynomial.
template <typename V>
inline V ExpPolynomialForBf16(V r) {
  V p = V{} + 0.041513845324516296f;
  p = p * r + 0.16787473857402802f;
  p = p * r + 0.5000301599502563f;
  p = p * r + 0.9999668598175049f;
  return p * r + 1.0f;
}

// ln2 in two parts: the first has few enough bits that n * kLn2High is exact for the n that e^x meets.
constexpr float kLn2High = 0.693145751953125f;
constexpr float kLn2Low = 1.428606765330187e-6f;

// e^x for x <= 0, lane by lane, for any GCC vector V of f32 with IV its int32 vector: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by ExpPolynomial (ExpPolynomialForBf16 with kForBf16), 2^n put into the exponent bits. Below
// -87 (where e^x leaves f32's normal range) it gives e^-87, which beside the row's maximum weight of 1 is nothing;
// masked weights are zeroed by the caller.
template <typename V, typename IV, bool kForBf16 = false>
inline V ExpOf(V x) {
  const V floor_value = V{} - 87.0f;
  x = x < floor_value ? floor_value : x;
  const V scaled = x * 1.44269504088896341f;  // x / ln2
  const IV n = __builtin_convertvector(scaled + (scaled < V{} ? V{} - 0.5f : V{} + 0.5f), IV);
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * kLn2High) - nf * kLn2Low;
  const V p = kForBf16 ? ExpPolynomialForBf16(r) : ExpPolynomial(r);
  const IV bits = (n + 127) << 23;
  V two_to_n;
  __builtin_memcpy(&two_to_n, &bits, sizeof(two_to_n));
  return p * two_to_n;
}

#if defined(__AVX512F__)
// ExpOf's arithmetic with AVX-512's rounding (VRNDSCALEPS) and 2^n scaling (VSCALEFPS) in place of the conversions
// to and from int32 and the exponent bits: 13 instructions against about 19, in the softmax that takes a fifth of a
// prefill chunk's attention. n rounds half to even, not away from zero, so a tie takes the other n; e^x is as exact
// either way. A NaN stays NaN (VMAXPS returns its second operand).
template <bool kForBf16>
inline Vec ExpWith(Vec x) {
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-87.0f), (__m512)x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec r =
      (Vec)_mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), clamped));
  return (Vec)_mm512_scalef_ps((__m512)(kForBf16 ? ExpPolynomialForBf16(r) : ExpPolynomial(r)), n);
}
#else
template <bool kForBf16>
inline Vec ExpWith(Vec x) {
  return ExpOf<Vec, IntVec, kForBf16>(x);
}
#endif
// e^x for x <= 0 (see ExpOf), to f32's precision.
inline Vec Exp(Vec x) { return ExpWith<false>(x); }
// e^x for x <= 0 to within 2.9e-6 of itself, for softmax weights that are rounded to bf16 next: on a 2-core Zen 4 a
// 2048-token prompt's attention over a bf16 pool took 17.8 ms a SmolLM2 layer against 18.5 with Exp.
inline Vec ExpForBf16(Vec x) { return ExpWith<true>(x); }

// v's lanes in another order: GCC and clang spell the builtin differently ($CXX may be either).
#if defined(__clang__)
#define PAXKV_PERMUTE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define PAXKV_PERMUTE(v, ...) __builtin_shuffle(v, IntVec{__VA_ARGS__})
#endif

// Lanes of a and b (indices 0 to kLanes - 1 from a, then b's) in the order given.
#if defined(__clang__)
#define PAXKV_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PAXKV_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, IntVec{__VA_ARGS__})
#endif

#if defined(__AVX512F__)
// The sum of v's lanes, by halving (four shuffles and adds, not a chain of sixteen).
inline float HorizontalSum(Vec v) {
  v += PAXKV_PERMUTE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += PAXKV_PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += PAXKV_PERMUTE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += PAXKV_PERMUTE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The largest of v's lanes, by halving.
inline float HorizontalMax(Vec v) {
  v = Max(v, PAXKV_PERMUTE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = Max(v, PAXKV_PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = Max(v, PAXKV_PERMUTE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = Max(v, PAXKV_PERMUTE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// The sums of the lanes of v[0], ..., v[15] as one vector (lane s: the sum of v[s]'s lanes), by a butterfly: each
// level adds the halves of pairs of vectors, 15 pairs of two shuffles and an add in all, against 16 x 8 operations
// for sixteen HorizontalSums. Each output lane sums only its own input's lanes.
//
// SumEachLaneOfHalves starts one level in: u[k]'s lanes 0-7 are partial sums of input 2k, lanes 8-15 of input 2k + 1.
inline Vec SumEachLaneOfHalves(const Vec u[8]) {
  Vec w[4], z[2];
  for (int m = 0; m < 4; ++m) {  // 4 lanes each for v[4m], ..., v[4m + 3]
    w[m] = PAXKV_SHUFFLE2(u[2 * m], u[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           PAXKV_SHUFFLE2(u[2 * m], u[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int n = 0; n < 2; ++n) {  // 2 lanes each for v[8n], ..., v[8n + 7]
    z[n] = PAXKV_SHUFFLE2(w[2 * n], w[2 * n + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           PAXKV_SHUFFLE2(w[2 * n], w[2 * n + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return PAXKV_SHUFFLE2(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PAXKV_SHUFFLE2(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline Vec SumEachLane(const Vec v[kLanes]) {
  Vec u[8];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: 8 partial sums of v[2k]; lanes 8-15: of v[2k + 1]
    u[k] = PAXKV_SHUFFLE2(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PAXKV_SHUFFLE2(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  return SumEachLaneOfHalves(u);
}

// 256 bits from each of two places side by side: [low's 16 bf16 | high's 16 bf16].
inline Vec JoinHalves(const uint16_t* low, const uint16_t* high) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
  return (Vec)_mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}
#else
// The sum of v's lanes, by halving (three shuffles and adds).
inline float HorizontalSum(Vec v) {
  v += PAXKV_PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += PAXKV_PERMUTE(v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += PAXKV_PERMUTE(v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

// The largest of v's lanes, by halving.
inline float HorizontalMax(Vec v) {
  v = Max(v, PAXKV_PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = Max(v, PAXKV_PERMUTE(v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = Max(v, PAXKV_PERMUTE(v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}

// The sums of the lanes of v[0], ..., v[7] as one vector (lane s: the sum of v[s]'s lanes), by the same butterfly
// in three levels (7 pairs of two shuffles and an add).
inline Vec SumEachLane(const Vec v[kLanes]) {
  Vec u[4], w[2];
  for (int k = 0; k < 4; ++k) {  // lanes 0-3: 4 partial sums of v[2k]; lanes 4-7: of v[2k + 1]
    u[k] = PAXKV_SHUFFLE2(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           PAXKV_SHUFFLE2(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int m = 0; m < 2; ++m) {  // 2 lanes each for v[4m], ..., v[4m + 3]
    w[m] = PAXKV_SHUFFLE2(u[2 * m], u[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           PAXKV_SHUFFLE2(u[2 * m], u[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return PAXKV_SHUFFLE2(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) + PAXKV_SHUFFLE2(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

#endif  // PAXKV_CPU_NATIVE_VECTORS_H_
