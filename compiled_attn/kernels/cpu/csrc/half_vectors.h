// The AVX2 build's 8-float vectors (kernel_math.h includes this after the cache formats' loaders). Without AVX-512
// a v16 is no machine type: GCC keeps a v16 that lives across a loop (a running sum, a row held in registers) in
// memory, copied through the stack and general registers at every step (the vector path's V sums ran at a tenth of
// their FMA rate). The hot loops of such a build use 8-float halves (v8f, one AVX2 register) instead, most of them
// summing the lanes of the v16 each stands for in its order (the vector path's scores take key16's order).
#pragma once

#if !defined(__AVX512F__)
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef int16_t i16x8 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

static inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }
static inline v8f loadf8(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
static inline void storef8(float* p, v8f v) { std::memcpy(p, &v, 32); }

// 8 IEEE half-precision bit patterns -> float32 (half_to_float's conversion, 8 lanes).
static inline v8f half8_to_float(u16x8 w) {
  v8f f;
#if defined(__F16C__)
  __m128i x;
  std::memcpy(&x, &w, 16);
  const __m256 r = _mm256_cvtph_ps(x);
  std::memcpy(&f, &r, 32);
#else
  u32x8 x = __builtin_convertvector(w, u32x8);
  u32x8 bits = ((x & 0x8000) << 16) | ((x & 0x7fff) << 13);
  std::memcpy(&f, &bits, 32);
  f = f * 5.192296858534828e+33f;
#endif
  return f;
}

// 8 stored elements -> float32: the loaders' values (L::load), 8 lanes.
template <class L> static inline v8f load8(const typename L::T* p);
template <> inline v8f load8<F32>(const float* p) { return loadf8(p); }
template <> inline v8f load8<BF16>(const uint16_t* p) {
  u16x8 x;
  std::memcpy(&x, p, 16);
  const u32x8 w = __builtin_convertvector(x, u32x8) << 16;
  v8f f;
  std::memcpy(&f, &w, 32);
  return f;
}
template <> inline v8f load8<F16>(const uint16_t* p) {
  u16x8 x;
  std::memcpy(&x, p, 16);
  return half8_to_float(x);
}
template <> inline v8f load8<E5M2>(const uint8_t* p) {
  u8x8 x;
  std::memcpy(&x, p, 8);
  return half8_to_float(__builtin_convertvector(x, u16x8) << 8);
}
template <> inline v8f load8<E4M3>(const uint8_t* p) {
  i8x8 x;
  std::memcpy(&x, p, 8);
  return half8_to_float((u16x8)(__builtin_convertvector(x, i16x8) << 7) & 0xBF80);
}

// Keeps x in a register for all its uses: GCC folds a loaded vector into every FMA that uses it (a memory operand,
// so one load per product), which left the AVX2 loops that reuse a vector load-bound.
static inline void in_register(v8f& x) {
#if defined(__AVX__)
  asm("" : "+x"(x));
#endif
}

// 16 stored elements of a key row -> two float32 vectors, in the order the AVX2 scores keep the queries in
// (key16_order): a bf16 row is one 32-byte load split into its even and odd elements (a shift and a mask, no
// widening shuffles), other formats their first and last 8.
template <class L> static inline void key16(const typename L::T* p, v8f (&k)[2]) {
  if constexpr (std::is_same<L, BF16>::value) {
    u32x8 x;
    std::memcpy(&x, p, 32);
    const u32x8 even = x << 16, odd = x & 0xFFFF0000u;
    std::memcpy(&k[0], &even, 32);
    std::memcpy(&k[1], &odd, 32);
  } else {
    k[0] = load8<L>(p), k[1] = load8<L>(p + 8);
  }
}

// Where element i of a row (of a multiple of 16) lies in key16's order.
template <class L> static inline int64_t key16_order(int64_t i) {
  if constexpr (std::is_same<L, BF16>::value) return i / 16 * 16 + i % 2 * 8 + i % 16 / 2;
  return i;
}

// 16 sums in key16's order (lo: its first 8 lanes, hi: its last 8) times mul, stored in element order at o.
template <class L> static inline void store16_in_order(float* o, v8f lo, v8f hi, v8f mul) {
  if constexpr (std::is_same<L, BF16>::value) {
    storef8(o, __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11) * mul);
    storef8(o + 8, __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15) * mul);
  } else {
    storef8(o, lo * mul), storef8(o + 8, hi * mul);
  }
}

// The eight sums of a[i][j] (four rows i, two key rows j), lane 2 i + j.
static inline v8f hsum8(const v8f (&a)[4][2]) {
  v8f x[4];
  for (int i = 0; i < 4; ++i)  // row i: [key 0 lanes 0-3 + 4-7, key 1 lanes 0-3 + 4-7]
    x[i] = __builtin_shufflevector(a[i][0], a[i][1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[i][0], a[i][1], 4, 5, 6, 7, 12, 13, 14, 15);
  // rows 0, 1: [r0k0 (2), r1k0 (2), r0k1 (2), r1k1 (2)] as pairs of lanes summed
  const v8f y01 = __builtin_shufflevector(x[0], x[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                  __builtin_shufflevector(x[0], x[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f y23 = __builtin_shufflevector(x[2], x[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                  __builtin_shufflevector(x[2], x[3], 2, 3, 10, 11, 6, 7, 14, 15);
  // lanes of y01: r0k0 r0k0 r1k0 r1k0 r0k1 r0k1 r1k1 r1k1 -> [r0k0 r0k1 r1k0 r1k1 r2k0 r2k1 r3k0 r3k1]
  return __builtin_shufflevector(y01, y23, 0, 4, 2, 6, 8, 12, 10, 14) +
         __builtin_shufflevector(y01, y23, 1, 5, 3, 7, 9, 13, 11, 15);
}

// hsum4 of four v16 given as halves (a[i][0]: lanes 0-7 of vector i, a[i][1]: lanes 8-15): the same tree of sums.
static inline v4f hsum4_halves(const v8f (&a)[4][2]) {
  const v8f s0 = a[0][0] + a[0][1], s1 = a[1][0] + a[1][1], s2 = a[2][0] + a[2][1], s3 = a[3][0] + a[3][1];
  const v8f x01 = __builtin_shufflevector(s0, s1, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(s0, s1, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f x23 = __builtin_shufflevector(s2, s3, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(s2, s3, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8f y = __builtin_shufflevector(x01, x23, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(x01, x23, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y, y, 0, 2, 4, 6) + __builtin_shufflevector(y, y, 1, 3, 5, 7);
}

// hsum of a v16 given as halves: the same tree.
static inline float hsum_halves(v8f lo, v8f hi) {
  const v8f a = lo + hi;
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// vexp's arithmetic on 8 lanes (the same bits lane by lane).
static inline v8f vexp8(v8f x) {
  x = x < -87.0f ? splat8(-87.0f) : x;
  const v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  v8f r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8f q = splat8(8.312533609569073e-3f);
  q = q * r + 4.189012572169304e-2f;
  q = q * r + 1.6667114198207855e-1f;
  q = q * r + 4.99992311000824e-1f;
  const v8f y = q * (r * r) + (r + 1.0f);
  const i32x8 e = (__builtin_convertvector(n, i32x8) + 127) << 23;
  v8f s;
  std::memcpy(&s, &e, 32);
  return y * s;
}

// The first n (may be <= 0; at most 8 used) of p's floats, `fill` in the other lanes.
static inline v8f load_first8(const float* p, int64_t n, float fill) {
  if (n >= 8) return loadf8(p);
  float x[8];
  for (int64_t i = 0; i < 8; ++i) x[i] = i < n ? p[i] : fill;
  return loadf8(x);
}
#endif

// The build's own vector for lane-by-lane loops (a v16 with AVX-512, else a v8f): the same arithmetic per lane.
#if defined(__AVX512F__)
typedef v16 vnat;
static inline vnat loadn(const float* p) { return loadf(p); }
static inline vnat splatn(float x) { return splat(x); }
static inline void storen(float* p, vnat v) { storef(p, v); }
#else
typedef v8f vnat;
static inline vnat loadn(const float* p) { return loadf8(p); }
static inline vnat splatn(float x) { return splat8(x); }
static inline void storen(float* p, vnat v) { storef8(p, v); }
#endif
constexpr int64_t kNat = sizeof(vnat) / sizeof(float);
