/* tl_kernels.h - the projection kernels of tiny_llama and the thread pool
   that runs them: weights as stored (fp32, bf16, fp16, converted exactly to
   fp32), dot products in eight fp32 lanes, AVX2 + F16C versions chosen at
   run time that give the same bits as the portable C, matrix-vector
   (decode) and matrix-matrix (prefill) products with their rows split over
   the run state's worker threads.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file. */
#ifndef TL_KERNELS_H
#define TL_KERNELS_H

/* Runs fn(arg, part, nparts) for part 0 .. nparts-1 on s's threads. */
void tl_parallel(tl_state *s, void (*fn)(void *arg, int part, int nparts), void *arg);

#endif /* TL_KERNELS_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_KERNELS_IMPLEMENTED)
#define TL_KERNELS_IMPLEMENTED

/* ----------------------------------------------------------------------------
   Weights as stored: fp16 and bf16 elements converted exactly to fp32 */

static float tl__half_to_float(unsigned short h)
{
    unsigned int sign = (unsigned int)(h >> 15) << 31, e = (h >> 10) & 31u, mant = h & 0x3FFu, bits;
    float f;
    if (e == 0) {
        f = (float)mant * (1.0f / 16777216.0f);   /* subnormal: mant * 2^-24, exact */
        return sign ? -f : f;
    }
    if (e == 31)
        bits = sign | 0x7F800000u | (mant << 13);
    else
        bits = sign | ((e + 112u) << 23) | (mant << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float tl__bf16_to_float(unsigned short h)
{
    unsigned int bits = (unsigned int)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* element i of a stored vector as fp32 */
static float tl__elem(const void *p, int dtype, size_t i)
{
    unsigned short h;
    float f;
    if (dtype == TL_F32) {
        memcpy(&f, (const unsigned char *)p + i * 4, 4);
        return f;
    }
    memcpy(&h, (const unsigned char *)p + i * 2, 2);
    return dtype == TL_BF16 ? tl__bf16_to_float(h) : tl__half_to_float(h);
}

/* ----------------------------------------------------------------------------
   Math kernels. Loops run over contiguous memory and are written so that a
   compiler vectorises them at -O2 without -ffast-math: the dot product keeps
   eight independent partial sums (no reordering of additions needed). */

static float tl__dot_scalar(const float *a, const float *b, int n)
{
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0, sum;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
        s4 += a[i + 4] * b[i + 4];
        s5 += a[i + 5] * b[i + 5];
        s6 += a[i + 6] * b[i + 6];
        s7 += a[i + 7] * b[i + 7];
    }
    sum = ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7));
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* out += a * x. Blocks of eight are loaded before they are stored, so the
   compiler may vectorise them without proving that out and x do not overlap. */
static void tl__axpy_scalar(float *out, float a, const float *x, int n)
{
    float t[8];
    int i = 0, j;
    for (; i + 8 <= n; i += 8) {
        for (j = 0; j < 8; j++)
            t[j] = out[i + j] + a * x[i + j];
        for (j = 0; j < 8; j++)
            out[i + j] = t[j];
    }
    for (; i < n; i++)
        out[i] += a * x[i];
}


/* ----------------------------------------------------------------------------
   Projection kernels: matrix-vector (decode) and matrix-matrix (prefill)
   products with weights as stored (fp32, bf16, fp16) and fp32 arithmetic.
   Every output is the dot product of one weight row (converted exactly to
   fp32) with the input, summed as tl__dot sums: eight lanes, lane j adding
   the products of elements 8i + j, then ((s0+s4)+(s1+s5))+((s2+s6)+(s3+s7)),
   then the tail. The AVX2 versions (chosen at run time) keep the lanes in a
   vector register and perform the same operations in the same order, so the
   portable and SIMD kernels, and the decode and prefill paths, agree to the
   bit. */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(TINY_LLAMA_NO_SIMD)
#define TL__X86 1
#include <cpuid.h>
#include <immintrin.h>
#define TL__AVX2 __attribute__((target("avx2,f16c")))
#endif

/* the reduction of the eight lanes and the tail, as in tl__dot */
static float tl__finish(const float *lanes, const void *row, int dtype, const float *x, int i, int n)
{
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; i < n; i++)
        sum += tl__elem(row, dtype, (size_t)i) * x[i];
    return sum;
}

#ifdef TL__X86
static int tl__avx2_flag;
static pthread_once_t tl__avx2_once = PTHREAD_ONCE_INIT;

static void tl__avx2_probe(void)
{
    unsigned int a = 0, b = 0, c = 0, d = 0;
    __builtin_cpu_init();
    /* F16C is CPUID leaf 1, ECX bit 29 (not every compiler's cpu_supports names it) */
    tl__avx2_flag = __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) &&
                    (c >> 29 & 1u);
}

static int tl__have_avx2(void)
{
    pthread_once(&tl__avx2_once, tl__avx2_probe);
    return tl__avx2_flag;
}

/* AVX2 with FMA: the prompt's kernels (tiled projections here, attention in tl_prefill.h),
   whose sums need not follow tl__dot's order */
#define TL__FMA __attribute__((target("avx2,fma")))
static int tl__fma_flag;
static pthread_once_t tl__fma_once = PTHREAD_ONCE_INIT;

static void tl__fma_probe(void)
{
    __builtin_cpu_init();
    tl__fma_flag = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int tl__have_fma(void)
{
    pthread_once(&tl__fma_once, tl__fma_probe);
    return tl__fma_flag;
}

/* tl__finish on lanes held in a register: the lanes summed in the same order,
   ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)), in the register (a store and scalar
   reloads of the lanes, and a call, at the end of every row cost a decode
   step a third of its time), then the tail */
TL__AVX2 __attribute__((always_inline)) static inline float tl__finish_v(__m256 v, const void *row, int dtype,
                                                                         const float *x, int i, int n)
{
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    float sum;
    t = _mm_hadd_ps(t, t);
    sum = _mm_cvtss_f32(_mm_hadd_ps(t, t));
    for (; i < n; i++)
        sum += tl__elem(row, dtype, (size_t)i) * x[i];
    return sum;
}

TL__AVX2 static float tl__dot_avx2(const float *a, const float *b, int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    return tl__finish_v(acc, a, TL_F32, b, i, n);
}

TL__AVX2 static void tl__axpy_avx2(float *out, float a, const float *x, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i),
                                                _mm256_mul_ps(av, _mm256_loadu_ps(x + i))));
    for (; i < n; i++)
        out[i] += a * x[i];
}

/* Blocks of cache rows (decode attention): row r of a block is at rows[r].
   att[j * stride + r] = dot(q + j * hs, rows[r]) * scale for r < nr, j < group,
   each dot as tl__dot sums it; hs a multiple of 8. */
TL__AVX2 static void tl__scores_rows_avx2(const float *q, const float *const *rows, int nr, int group,
                                          int hs, float scale, float *att, size_t stride)
{
    int j, r, i;
    const __m256 sv = _mm256_set1_ps(scale);
    for (j = 0; j < group; j++) {
        const float *qj = q + (size_t)j * (size_t)hs;
        float *a = att + (size_t)j * stride;
        for (r = 0; r + 8 <= nr; r += 8) {   /* eight rows: their lanes reduced together */
            const float *k0 = rows[r], *k1 = rows[r + 1], *k2 = rows[r + 2], *k3 = rows[r + 3];
            const float *k4 = rows[r + 4], *k5 = rows[r + 5], *k6 = rows[r + 6], *k7 = rows[r + 7];
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
            __m256 p04, p15, p26, p37;
            for (i = 0; i < hs; i += 8) {
                __m256 qv = _mm256_loadu_ps(qj + i);
                c0 = _mm256_add_ps(c0, _mm256_mul_ps(qv, _mm256_loadu_ps(k0 + i)));
                c1 = _mm256_add_ps(c1, _mm256_mul_ps(qv, _mm256_loadu_ps(k1 + i)));
                c2 = _mm256_add_ps(c2, _mm256_mul_ps(qv, _mm256_loadu_ps(k2 + i)));
                c3 = _mm256_add_ps(c3, _mm256_mul_ps(qv, _mm256_loadu_ps(k3 + i)));
                c4 = _mm256_add_ps(c4, _mm256_mul_ps(qv, _mm256_loadu_ps(k4 + i)));
                c5 = _mm256_add_ps(c5, _mm256_mul_ps(qv, _mm256_loadu_ps(k5 + i)));
                c6 = _mm256_add_ps(c6, _mm256_mul_ps(qv, _mm256_loadu_ps(k6 + i)));
                c7 = _mm256_add_ps(c7, _mm256_mul_ps(qv, _mm256_loadu_ps(k7 + i)));
            }
            /* per row l0+l4 .. l3+l7 (rows r and r+4 in one register, and so on),
               then ((l0+l4)+(l1+l5)) and ((l2+l6)+(l3+l7)), then their sum: the
               eight scores in order, each summed as tl__finish sums it */
            p04 = _mm256_add_ps(_mm256_permute2f128_ps(c0, c4, 0x20), _mm256_permute2f128_ps(c0, c4, 0x31));
            p15 = _mm256_add_ps(_mm256_permute2f128_ps(c1, c5, 0x20), _mm256_permute2f128_ps(c1, c5, 0x31));
            p26 = _mm256_add_ps(_mm256_permute2f128_ps(c2, c6, 0x20), _mm256_permute2f128_ps(c2, c6, 0x31));
            p37 = _mm256_add_ps(_mm256_permute2f128_ps(c3, c7, 0x20), _mm256_permute2f128_ps(c3, c7, 0x31));
            _mm256_storeu_ps(a + r, _mm256_mul_ps(_mm256_hadd_ps(_mm256_hadd_ps(p04, p15),
                                                                 _mm256_hadd_ps(p26, p37)), sv));
        }
        for (; r < nr; r++) {
            const float *k = rows[r];
            __m256 acc = _mm256_setzero_ps();
            for (i = 0; i < hs; i += 8)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(qj + i), _mm256_loadu_ps(k + i)));
            a[r] = tl__finish_v(acc, qj, TL_F32, k, hs, hs) * scale;
        }
    }
}

/* unrolled, so that an array of sums indexed by the loop lives in registers */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define TL__UNROLL8 _Pragma("GCC unroll 8")
#else
#define TL__UNROLL8
#endif

/* o[c .. c + 8w) += a[r] * rows[r][c .. c + 8w) for r < nr, ascending, with
   w (1 .. 8, a constant where it is called) sums held in registers */
TL__AVX2 __attribute__((always_inline)) static inline void tl__axpys_cols(float *o, const float *a,
                                                                          const float *const *rows, int nr,
                                                                          int c, int w)
{
    __m256 acc[8];
    int r, k;
    TL__UNROLL8
    for (k = 0; k < w; k++)
        acc[k] = _mm256_loadu_ps(o + c + 8 * k);
    for (r = 0; r < nr; r++) {
        __m256 av = _mm256_set1_ps(a[r]);
        const float *v = rows[r] + c;
        TL__UNROLL8
        for (k = 0; k < w; k++)
            acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(av, _mm256_loadu_ps(v + 8 * k)));
    }
    TL__UNROLL8
    for (k = 0; k < w; k++)
        _mm256_storeu_ps(o + c + 8 * k, acc[k]);
}

/* out + j * hs += att[j * stride + r] * rows[r] for r < nr (ascending for
   every element, as row-by-row updates add them), j < group; the sums stay
   in registers for the whole block, eight of them where hs allows (two adds
   a cycle despite their latency). hs a multiple of 8. */
TL__AVX2 static void tl__axpys_rows_avx2(float *out, const float *att, size_t stride,
                                         const float *const *rows, int nr, int group, int hs)
{
    int j, c;
    for (j = 0; j < group; j++) {
        float *o = out + (size_t)j * (size_t)hs;
        const float *a = att + (size_t)j * stride;
        for (c = 0; c + 64 <= hs; c += 64)
            tl__axpys_cols(o, a, rows, nr, c, 8);
        for (; c + 32 <= hs; c += 32)
            tl__axpys_cols(o, a, rows, nr, c, 4);
        for (; c < hs; c += 8)
            tl__axpys_cols(o, a, rows, nr, c, 1);
    }
}

#endif

/* the dot product and out += a * x, with the AVX2 versions where the CPU has them
   (the same operations in the same order: the same results to the bit) */
static float tl__dot(const float *a, const float *b, int n)
{
#ifdef TL__X86
    if (tl__have_avx2())
        return tl__dot_avx2(a, b, n);
#endif
    return tl__dot_scalar(a, b, n);
}

static void tl__axpy(float *out, float a, const float *x, int n)
{
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__axpy_avx2(out, a, x, n);
        return;
    }
#endif
    tl__axpy_scalar(out, a, x, n);
}

/* portable: one row (any dtype) with x */
static float tl__dot_row(const void *row, int dtype, const float *x, int n)
{
    float s[8] = { 0, 0, 0, 0, 0, 0, 0, 0 };
    int i = 0, j;
    if (dtype == TL_F32)
        return tl__dot((const float *)row, x, n);
    if (dtype == TL_BF16) {
        const unsigned short *h = (const unsigned short *)row;
        for (; i + 8 <= n; i += 8)
            for (j = 0; j < 8; j++)
                s[j] += tl__bf16_to_float(h[i + j]) * x[i + j];
    } else {
        const unsigned short *h = (const unsigned short *)row;
        for (; i + 8 <= n; i += 8)
            for (j = 0; j < 8; j++)
                s[j] += tl__half_to_float(h[i + j]) * x[i + j];
    }
    return tl__finish(s, row, dtype, x, i, n);
}

#ifdef TL__X86
TL__AVX2 __attribute__((always_inline)) static inline __m256 tl__load8(const void *row, int dtype, int i)
{
    if (dtype == TL_F32)
        return _mm256_loadu_ps((const float *)row + i);
    if (dtype == TL_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)(const void *)((const unsigned short *)row + i))), 16));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)((const unsigned short *)row + i)));
}

/* rows r0 .. r1-1 of w with x, four rows at a time */
#ifndef TL__PREFETCH
#define TL__PREFETCH 512    /* bytes ahead in each weight row */
#endif
#define TL__ROWS4(DT)                                                                       \
    for (; r + 4 <= r1; r += 4) {                                                           \
        const unsigned char *p0 = base + (size_t)r * rb, *p1 = p0 + rb, *p2 = p1 + rb,      \
                            *p3 = p2 + rb;                                                  \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        int i = 0;                                                                          \
        for (; i + 8 <= n; i += 8) {                                                        \
            __m256 xv = _mm256_loadu_ps(x + i);                                             \
            if ((i & 31) == 0) { /* a cache line of each row, ahead of the loads */         \
                size_t ahead = (size_t)i * es + TL__PREFETCH;                               \
                _mm_prefetch((const char *)p0 + ahead, _MM_HINT_T0);                        \
                _mm_prefetch((const char *)p1 + ahead, _MM_HINT_T0);                        \
                _mm_prefetch((const char *)p2 + ahead, _MM_HINT_T0);                        \
                _mm_prefetch((const char *)p3 + ahead, _MM_HINT_T0);                        \
            }                                                                               \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(tl__load8(p0, DT, i), xv));                \
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(tl__load8(p1, DT, i), xv));                \
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(tl__load8(p2, DT, i), xv));                \
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(tl__load8(p3, DT, i), xv));                \
        }                                                                                   \
        out[r] = tl__finish_v(a0, p0, DT, x, i, n);                                         \
        out[r + 1] = tl__finish_v(a1, p1, DT, x, i, n);                                     \
        out[r + 2] = tl__finish_v(a2, p2, DT, x, i, n);                                     \
        out[r + 3] = tl__finish_v(a3, p3, DT, x, i, n);                                     \
    }

TL__AVX2 static void tl__rows_avx2(const tl_mat *w, int n, const float *x, float *out, int r0, int r1)
{
    const unsigned char *base = (const unsigned char *)w->data;
    size_t es = w->dtype == TL_F32 ? 4u : 2u, rb = (size_t)n * es;
    int r = r0;
    if (w->dtype == TL_F32) { TL__ROWS4(TL_F32) }
    else if (w->dtype == TL_BF16) { TL__ROWS4(TL_BF16) }
    else { TL__ROWS4(TL_F16) }
    for (; r < r1; r++)
        out[r] = tl__dot_row(base + (size_t)r * rb, w->dtype, x, n);
}

/* a (fp32, n) with b[0..3]: four dot products sharing the row */
/* a stored row (bf16 or fp16) to fp32, 8 at a time (n / 8 * 8 elements) */
TL__AVX2 static void tl__convert_avx2(const void *row, int dtype, int n, float *dst)
{
    int i;
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, tl__load8(row, dtype, i));
}

/* rows a0, a1 (fp32, n) with b[0..3]: eight dot products, out[4 * r + k] for row r
   and input k, each summed as tl__dot sums */
TL__AVX2 static void tl__dot_2x4_avx2(const float *a0, const float *a1, const float *const *b, int n,
                                      float *out)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x0 = _mm256_loadu_ps(a0 + i), x1 = _mm256_loadu_ps(a1 + i), y;
        y = _mm256_loadu_ps(b[0] + i);
        c00 = _mm256_add_ps(c00, _mm256_mul_ps(x0, y));
        c10 = _mm256_add_ps(c10, _mm256_mul_ps(x1, y));
        y = _mm256_loadu_ps(b[1] + i);
        c01 = _mm256_add_ps(c01, _mm256_mul_ps(x0, y));
        c11 = _mm256_add_ps(c11, _mm256_mul_ps(x1, y));
        y = _mm256_loadu_ps(b[2] + i);
        c02 = _mm256_add_ps(c02, _mm256_mul_ps(x0, y));
        c12 = _mm256_add_ps(c12, _mm256_mul_ps(x1, y));
        y = _mm256_loadu_ps(b[3] + i);
        c03 = _mm256_add_ps(c03, _mm256_mul_ps(x0, y));
        c13 = _mm256_add_ps(c13, _mm256_mul_ps(x1, y));
    }
    out[0] = tl__finish_v(c00, a0, TL_F32, b[0], i, n);
    out[1] = tl__finish_v(c01, a0, TL_F32, b[1], i, n);
    out[2] = tl__finish_v(c02, a0, TL_F32, b[2], i, n);
    out[3] = tl__finish_v(c03, a0, TL_F32, b[3], i, n);
    out[4] = tl__finish_v(c10, a1, TL_F32, b[0], i, n);
    out[5] = tl__finish_v(c11, a1, TL_F32, b[1], i, n);
    out[6] = tl__finish_v(c12, a1, TL_F32, b[2], i, n);
    out[7] = tl__finish_v(c13, a1, TL_F32, b[3], i, n);
}

TL__AVX2 static void tl__dot_1x4_avx2(const float *a, const float *const *b, int n, float *out)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 av = _mm256_loadu_ps(a + i);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(av, _mm256_loadu_ps(b[0] + i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(av, _mm256_loadu_ps(b[1] + i)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(av, _mm256_loadu_ps(b[2] + i)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(av, _mm256_loadu_ps(b[3] + i)));
    }
    out[0] = tl__finish_v(a0, a, TL_F32, b[0], i, n);
    out[1] = tl__finish_v(a1, a, TL_F32, b[1], i, n);
    out[2] = tl__finish_v(a2, a, TL_F32, b[2], i, n);
    out[3] = tl__finish_v(a3, a, TL_F32, b[3], i, n);
}

#endif

static void tl__rows(const tl_mat *w, int n, const float *x, float *out, int r0, int r1)
{
    size_t rb = (size_t)n * (w->dtype == TL_F32 ? 4u : 2u);
    int r;
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__rows_avx2(w, n, x, out, r0, r1);
        return;
    }
#endif
    for (r = r0; r < r1; r++)
        out[r] = tl__dot_row((const unsigned char *)w->data + (size_t)r * rb, w->dtype, x, n);
}

static void tl__dot_1x4(const float *a, const float *const *b, int n, float *out);

static void tl__dot_2x4(const float *a0, const float *a1, const float *const *b, int n, float *out)
{
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__dot_2x4_avx2(a0, a1, b, n, out);
        return;
    }
#endif
    tl__dot_1x4(a0, b, n, out);
    tl__dot_1x4(a1, b, n, out + 4);
}

static void tl__dot_1x4(const float *a, const float *const *b, int n, float *out)
{
    int k;
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__dot_1x4_avx2(a, b, n, out);
        return;
    }
#endif
    for (k = 0; k < 4; k++)
        out[k] = tl__dot(a, b[k], n);
}

/* ----------------------------------------------------------------------------
   Worker threads for the projections (one pool per run state)

   A decode step hands the pool a hundred or so jobs of a few hundred
   microseconds each. A thread that sleeps on a condition variable between
   them can wake late (on a virtual machine an idle CPU is handed back to the
   host, and waking it can cost tens of microseconds), leaving the caller to
   run the start of the job alone. So the workers, and the caller waiting for
   them, first poll the job counter for a while (TL_POOL_SPIN_US, 0 to 1e6,
   default 200 microseconds; 0 turns polling off) and only then sleep. */

#define TL__POOL_MAX 63

#if defined(__GNUC__) || defined(__clang__)
#define TL__POOL_POLL 1
#define TL__LOAD(p) __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define TL__STORE(p, v) __atomic_store_n(p, v, __ATOMIC_RELEASE)
#else
#define TL__LOAD(p) (*(p))
#define TL__STORE(p, v) (*(p) = (v))
#endif

typedef struct tl__pool tl__pool;
struct tl__pool {
    int n;                    /* threads including the caller */
    int n_started;
    pthread_t th[TL__POOL_MAX];
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    unsigned long gen;        /* jobs handed out; written under mu */
    int pending, quit;        /* workers still on the job; written under mu */
    double spin_s;            /* how long to poll before sleeping */
    void (*fn)(void *, int, int);
    void *arg;
};

#ifdef TL__POOL_POLL
#if defined(__x86_64__) || defined(__i386__)
#define TL__PAUSE() __builtin_ia32_pause()
#else
#define TL__PAUSE() ((void)0)
#endif
/* what a thread waits for: the caller (seen unused) all workers done, a
   worker a job after generation seen, or the pool's end */
static int tl__pool_ready(tl__pool *p, int caller, unsigned long seen)
{
    if (caller)
        return TL__LOAD(&p->pending) == 0;
    return TL__LOAD(&p->gen) != seen || TL__LOAD(&p->quit);
}

/* poll for it for up to p->spin_s seconds (then the thread sleeps on its
   condition variable, which also covers what arrives in between) */
static void tl__pool_poll(tl__pool *p, int caller, unsigned long seen)
{
    double t0 = 0;
    int i;
    if (p->spin_s <= 0)
        return;
    for (;;) {
        for (i = 0; i < 64; i++) {
            if (tl__pool_ready(p, caller, seen))
                return;
            TL__PAUSE();
        }
        if (t0 == 0)
            t0 = tl_time_s();
        else if (tl_time_s() - t0 > p->spin_s)
            return;
    }
}
#endif

static void *tl__pool_main(void *arg)
{
    tl__pool *p = (tl__pool *)((void **)arg)[0];
    int part = (int)(size_t)((void **)arg)[1];
    unsigned long seen = 0;
    free(arg);
    for (;;) {
        void (*fn)(void *, int, int);
        void *a;
#ifdef TL__POOL_POLL
        tl__pool_poll(p, 0, seen);
#endif
        pthread_mutex_lock(&p->mu);
        while (p->gen == seen && !p->quit)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->quit) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        seen = p->gen;
        fn = p->fn;
        a = p->arg;
        pthread_mutex_unlock(&p->mu);
        fn(a, part, p->n);
        pthread_mutex_lock(&p->mu);
        TL__STORE(&p->pending, p->pending - 1);
        if (p->pending == 0)
            pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

static void tl__pool_destroy(tl__pool *p)
{
    int t;
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    TL__STORE(&p->quit, 1);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (t = 0; t < p->n_started; t++)
        pthread_join(p->th[t], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p);
}

/* n threads in all (the caller is part 0); NULL when n < 2 or nothing starts */
static tl__pool *tl__pool_create(int n)
{
    tl__pool *p;
    int t;
    if (n < 2)
        return NULL;
    if (n > TL__POOL_MAX + 1)
        n = TL__POOL_MAX + 1;
    p = (tl__pool *)calloc(1, sizeof *p);
    if (!p)
        return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->spin_s = 200e-6;
    {
        const char *e = getenv("TL_POOL_SPIN_US");   /* 0 .. 1e6; anything else: the default */
        double us = e && *e ? atof(e) : -1.0;
        if (us >= 0.0 && us <= 1e6)
            p->spin_s = us * 1e-6;
    }
    for (t = 1; t < n; t++) {
        void **a = (void **)malloc(2 * sizeof(void *));
        if (!a)
            break;
        a[0] = p;
        a[1] = (void *)(size_t)t;
        if (pthread_create(&p->th[t - 1], NULL, tl__pool_main, a) != 0) {
            free(a);
            break;
        }
        p->n_started = t;
    }
    p->n = p->n_started + 1;
    if (p->n < 2) {
        tl__pool_destroy(p);
        return NULL;
    }
    return p;
}

void tl_parallel(tl_state *s, void (*fn)(void *arg, int part, int nparts), void *arg)
{
    tl__pool *p = (tl__pool *)s->pool;
    if (!p) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    TL__STORE(&p->pending, p->n - 1);
    TL__STORE(&p->gen, p->gen + 1);  /* a worker that sees it takes mu to read fn and arg */
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, p->n);
#ifdef TL__POOL_POLL
    tl__pool_poll(p, 1, 0);
#endif
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* Up to three products sharing the input x (n): out[j] (d[j]) = w[j] x. */
typedef struct {
    int count, n;
    const float *x;
    const tl_mat *w[3];
    float *out[3];
    int d[3];
    long next;                /* the next row to hand out */
} tl__mv_job;

/* rows lo .. hi-1 of the products, counted over all of them */
static void tl__mv_range(const tl__mv_job *j, long lo, long hi)
{
    long base = 0;
    int k;
    for (k = 0; k < j->count; k++) {
        long a = lo > base ? lo : base, b = hi < base + j->d[k] ? hi : base + j->d[k];
        if (a < b)
            tl__rows(j->w[k], j->n, j->x, j->out[k], (int)(a - base), (int)(b - base));
        base += j->d[k];
    }
}

#define TL__MV_BLOCK 64   /* rows a thread takes at a time */

static void tl__mv_part(void *arg, int part, int nparts)
{
    tl__mv_job *j = (tl__mv_job *)arg;
    long total = 0, lo, hi;
    int k;
    for (k = 0; k < j->count; k++)
        total += j->d[k];
#if defined(__GNUC__) || defined(__clang__)
    /* blocks of rows handed out as threads ask: a thread that runs late (a busy
       machine) takes fewer */
    (void)part;
    (void)nparts;
    for (;;) {
        lo = __atomic_fetch_add(&j->next, (long)TL__MV_BLOCK, __ATOMIC_RELAXED);
        if (lo >= total)
            break;
        hi = lo + TL__MV_BLOCK < total ? lo + TL__MV_BLOCK : total;
        tl__mv_range(j, lo, hi);
    }
#else
    /* split the rows of all products in blocks of 4 */
    lo = (total / 4 * part / nparts) * 4;
    hi = part == nparts - 1 ? total : (total / 4 * (part + 1) / nparts) * 4;
    tl__mv_range(j, lo, hi);
#endif
}

static void tl__mv_run(tl_state *s, tl__mv_job *j)
{
    double work = 0;
    int k;
    for (k = 0; k < j->count; k++)
        work += (double)j->d[k] * (double)j->n;
    if (!s->pool || work < 65536.0)
        tl__mv_part(j, 0, 1);
    else
        tl_parallel(s, tl__mv_part, j);
}

/* out (d) = w (d, n) x (n) */
static void tl__mv(tl_state *s, float *out, const float *x, const tl_mat *w, int n, int d)
{
    tl__mv_job j;
    j.next = 0;
    j.count = 1;
    j.n = n;
    j.x = x;
    j.w[0] = w;
    j.out[0] = out;
    j.d[0] = d;
    tl__mv_run(s, &j);
}

/* The FFN's gate, h1 = act(h1) * h3: SiLU, or GELU with tanh (Gemma) */
static void tl__gate(const tl_config *c, float *h1, const float *h3, size_t n)
{
    size_t i;
    if (c->ffn_act == TL_ACT_GELU_TANH) {
        for (i = 0; i < n; i++) {
            float a = h1[i];
            h1[i] = 0.5f * a * (1.0f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a))) * h3[i];
        }
        return;
    }
    for (i = 0; i < n; i++) {
        float a = h1[i];
        h1[i] = a / (1.0f + expf(-a)) * h3[i];   /* silu(w1 x) * w3 x */
    }
}

#ifdef TL__X86
/* y 2^n for whole n (in the normal range), 0 where under is set: the last step of an
   exponential (tl__exp8, tl_prefill.h's tl__pf_exp2) */
TL__FMA static inline __m256 tl__ldexp8(__m256 y, __m256 n, __m256 under)
{
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* exp of 8 arguments up to 88 (a range reduction by ln 2 in two parts and a degree-6
   polynomial, the classic single-precision scheme: within 2 ulp); below -87.3, 0 */
TL__FMA static inline __m256 tl__exp8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), fx, y, z;
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    z = _mm256_mul_ps(x, x);
    y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    return tl__ldexp8(y, fx, under);
}

/* the gate with a vector exp: act(a) = a / (1 + exp(-z)), z = a (SiLU) or 2 sqrt(2/pi)
   (a + 0.044715 a^3) (GELU with tanh: 0.5 (1 + tanh(z/2)) = 1 / (1 + exp(-z))) */
TL__FMA static void tl__gate_avx2(const tl_config *c, float *h1, const float *h3, size_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f), k0 = _mm256_set1_ps(-1.5957691216057308f);
    const __m256 k1 = _mm256_set1_ps(0.044715f);
    int gelu = c->ffn_act == TL_ACT_GELU_TANH;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(h1 + i), z;
        if (gelu)
            z = _mm256_mul_ps(k0, _mm256_fmadd_ps(_mm256_mul_ps(k1, a), _mm256_mul_ps(a, a), a));
        else
            z = _mm256_sub_ps(_mm256_setzero_ps(), a);
        z = _mm256_div_ps(a, _mm256_add_ps(one, tl__exp8(z)));
        _mm256_storeu_ps(h1 + i, _mm256_mul_ps(z, _mm256_loadu_ps(h3 + i)));
    }
    tl__gate(c, h1 + i, h3 + i, n - i);
}
#endif

typedef struct {
    const tl_config *c;
    float *h1;
    const float *h3;
    size_t n;
    int fast;
} tl__gate_job;

static void tl__gate_part(void *arg, int part, int nparts)
{
    const tl__gate_job *j = (const tl__gate_job *)arg;
    size_t i0 = j->n * (size_t)part / (size_t)nparts, i1 = j->n * (size_t)(part + 1) / (size_t)nparts;
#ifdef TL__X86
    if (j->fast) {
        tl__gate_avx2(j->c, j->h1 + i0, j->h3 + i0, i1 - i0);
        return;
    }
#endif
    tl__gate(j->c, j->h1 + i0, j->h3 + i0, i1 - i0);
}

/* the gate of a prompt chunk over the threads; tiled (not exact_prefill), with the vector
   exp (equal to rounding), else tl__gate's arithmetic */
static void tl__gate_run(tl_state *s, const tl_config *c, float *h1, const float *h3, size_t n)
{
    tl__gate_job j;
    j.c = c;
    j.h1 = h1;
    j.h3 = h3;
    j.n = n;
    j.fast = 0;
#ifdef TL__X86
    j.fast = !s->exact_prefill && tl__have_fma();
#endif
    tl_parallel(s, tl__gate_part, &j);
}

/* s's scratch buffer slot (0 .. TL_SCRATCH_SLOTS-1) of at least n floats, its contents
   undefined; NULL when memory runs out (the slot's previous buffer stays) */
static float *tl__scratch(tl_state *s, int slot, size_t n)
{
    if (s->scratch_n[slot] < n) {
        float *p = (float *)realloc(s->scratch[slot], n * sizeof(float));
        if (!p)
            return NULL;
        s->scratch[slot] = p;
        s->scratch_n[slot] = n;
    }
    return s->scratch[slot];
}
#define TL__SCRATCH_XT 0   /* tl__mm: x transposed      */
#define TL__SCRATCH_MM 1   /* tl__mm: the threads' rows */
#define TL__SCRATCH_XN 2   /* the batched stages' own   */
#define TL__SCRATCH_TMP 3
#define TL__SCRATCH_H1 4
#define TL__SCRATCH_H3 5

/* Matrix-matrix: out[i] (t, d[i]) = x (t, n) w[i]^T for t tokens and up to TL__MM_MAX
   matrices that share x (one call: their rows split over the threads together).
   Exact (tl_state.exact_prefill, or no AVX2 + FMA): each output is tl__dot's sum, so the
   prompt's projections equal the decode step's to the bit; each thread converts its rows
   to fp32 once and multiplies them with every token (one pass too).
   Otherwise tiled: x transposed once (by the threads) into blocks of 16 tokens (block b
   holds element k of token 16b + e at ((b n + k) 16 + e), tokens past t zero), then blocks
   of 6 weight rows x 16 tokens accumulated in registers over the whole of n (FMA), equal
   to rounding. */
#define TL__MM_MAX 3
typedef struct {
    int count;                /* matrices, 1 .. TL__MM_MAX */
    const tl_mat *ws[TL__MM_MAX];
    float *outs[TL__MM_MAX];
    int ds[TL__MM_MAX], dsum; /* their rows, and the sum */
    int n, t, tp;
    const float *x;
    float *buf;               /* nparts * 6 * (n + tp) floats: rows converted to fp32,
                                 and the tiled path's output block */
    float *xt;                /* tiled: x transposed in blocks of 16 tokens */
} tl__mm_job;

/* row r of w as fp32: the stored floats, or a conversion into buf */
static const float *tl__row_f32(const tl_mat *w, int n, int r, float *buf)
{
    size_t rb = (size_t)n * (w->dtype == TL_F32 ? 4u : 2u);
    const unsigned char *row = (const unsigned char *)w->data + (size_t)r * rb;
    int i = 0;
    if (w->dtype == TL_F32)
        return (const float *)(const void *)row;
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__convert_avx2(row, w->dtype, n, buf);
        i = n / 8 * 8;
    }
#endif
    for (; i < n; i++)
        buf[i] = tl__elem(row, w->dtype, (size_t)i);
    return buf;
}

/* rows r0 .. r1-1 of matrix i (converted to fp32 once, two at a time) against every
   token by tl__dot's sums */
static void tl__mm_exact_rows(const tl__mm_job *j, int i, int r0, int r1, float *buf)
{
    const tl_mat *w = j->ws[i];
    float *out = j->outs[i];
    size_t n = (size_t)j->n, d = (size_t)j->ds[i];
    int r, t, k;
    for (r = r0; r < r1; r += 2) {
        int two = r + 1 < r1;
        const float *a0 = tl__row_f32(w, j->n, r, buf);
        const float *a1 = two ? tl__row_f32(w, j->n, r + 1, buf + n) : NULL;
        for (t = 0; t + 4 <= j->t; t += 4) {
            const float *b[4];
            float o[8];
            for (k = 0; k < 4; k++)
                b[k] = j->x + (size_t)(t + k) * n;
            if (two) {
                tl__dot_2x4(a0, a1, b, j->n, o);
                for (k = 0; k < 4; k++) {
                    out[(size_t)(t + k) * d + (size_t)r] = o[k];
                    out[(size_t)(t + k) * d + (size_t)r + 1] = o[4 + k];
                }
            } else {
                tl__dot_1x4(a0, b, j->n, o);
                for (k = 0; k < 4; k++)
                    out[(size_t)(t + k) * d + (size_t)r] = o[k];
            }
        }
        for (; t < j->t; t++) {
            out[(size_t)t * d + (size_t)r] = tl__dot(a0, j->x + (size_t)t * n, j->n);
            if (two)
                out[(size_t)t * d + (size_t)r + 1] = tl__dot(a1, j->x + (size_t)t * n, j->n);
        }
    }
}

/* the part's share of the matrices' rows, taken together: rows() for each matrix it
   meets, with the part's buffer (every output is one row's sum, whoever computes it) */
static void tl__mm_split(const tl__mm_job *j, int part, int nparts,
                         void (*rows)(const tl__mm_job *, int, int, int, float *))
{
    int a = (int)((long)j->dsum * part / nparts), b = (int)((long)j->dsum * (part + 1) / nparts), i, off = 0;
    float *buf = j->buf + (size_t)part * 6 * ((size_t)j->n + (size_t)j->tp);
    for (i = 0; i < j->count; off += j->ds[i], i++) {
        int r0 = a > off ? a - off : 0, r1 = b - off < j->ds[i] ? b - off : j->ds[i];
        if (r1 > r0)
            rows(j, i, r0, r1, buf);
    }
}

static void tl__mm_part(void *arg, int part, int nparts)
{
    tl__mm_split((const tl__mm_job *)arg, part, nparts, tl__mm_exact_rows);
}

#ifdef TL__X86
/* The register block of the prompt's kernels (the projections here, the attention's
   scores and weighted values in tl_prefill.h): o (mr rows at stride os, 8 nv columns) =
   (add: o +) the sum over k < n of a[i as + k] x b[16 k ..], b packed 16 columns wide
   (nv 1: its first 8 only), mr 1..6; mr, nv and add are constants where it is inlined */
TL__FMA __attribute__((always_inline)) static inline void tl__fma_6x16(const float *a, size_t as, const float *b,
                                                                    int n, int mr, int nv, int add, float *o,
                                                                    size_t os)
{
    __m256 acc[6][2];
    int i, k;
    TL__UNROLL8
    for (i = 0; i < 6; i++)
        if (i < mr) {
            acc[i][0] = add ? _mm256_loadu_ps(o + (size_t)i * os) : _mm256_setzero_ps();
            acc[i][1] = add && nv > 1 ? _mm256_loadu_ps(o + (size_t)i * os + 8) : _mm256_setzero_ps();
        }
    for (k = 0; k < n; k++) {
        const float *bk = b + (size_t)k * 16;
        __m256 b0 = _mm256_loadu_ps(bk), b1 = nv > 1 ? _mm256_loadu_ps(bk + 8) : b0;
        TL__UNROLL8
        for (i = 0; i < 6; i++)
            if (i < mr) {
                __m256 w = _mm256_broadcast_ss(a + (size_t)i * as + k);
                acc[i][0] = _mm256_fmadd_ps(w, b0, acc[i][0]);
                if (nv > 1)
                    acc[i][1] = _mm256_fmadd_ps(w, b1, acc[i][1]);
            }
    }
    TL__UNROLL8
    for (i = 0; i < 6; i++)
        if (i < mr) {
            _mm256_storeu_ps(o + (size_t)i * os, acc[i][0]);
            if (nv > 1)
                _mm256_storeu_ps(o + (size_t)i * os + 8, acc[i][1]);
        }
}

/* o (mr rows at stride os, ncol columns, a multiple of 8) (add: +)= a (mr rows at stride
   as, n long) b, b in blocks of n x 16 columns bs floats apart: tl__fma_6x16 over the
   blocks, mr a constant (in a function with int c and a, as, b, bs, n, ncol, o, os in
   scope) */
#define TL__FMA_BLOCKS(mr, add)                                                              \
    for (c = 0; c < ncol; c += 16) {                                                         \
        const float *bb_ = b + (size_t)(c / 16) * bs;                                        \
        if (c + 16 <= ncol)                                                                  \
            tl__fma_6x16(a, as, bb_, n, mr, 2, add, o + c, os);                              \
        else                                                                                 \
            tl__fma_6x16(a, as, bb_, n, mr, 1, add, o + c, os);                              \
    }

/* a block of rows of a (mr of them, 1..6) through TL__FMA_BLOCKS */
#define TL__FMA_ROWS(mr, add)                         \
    switch (mr) {                                     \
    case 6: TL__FMA_BLOCKS(6, add); break;            \
    case 5: TL__FMA_BLOCKS(5, add); break;            \
    case 4: TL__FMA_BLOCKS(4, add); break;            \
    case 3: TL__FMA_BLOCKS(3, add); break;            \
    case 2: TL__FMA_BLOCKS(2, add); break;            \
    default: TL__FMA_BLOCKS(1, add); break;           \
    }

/* x's rows u0 .. u0+7 (u0 a multiple of 8; rows stride apart), elements 0 .. n/8*8-1,
   into xt's blocks of 16 rows (element k of row u at ((u/16) n + k) 16 + u%16): 8 x 8
   blocks transposed in registers. The projections' tokens here, the keys of the prompt's
   attention in tl_prefill.h (the same layout) */
TL__FMA static void tl__transpose8_avx2(const float *x0, size_t stride, int n, float *xt, int u0)
{
    int k;
    for (k = 0; k + 8 <= n; k += 8) {
        __m256 r0 = _mm256_loadu_ps(x0 + k), r1 = _mm256_loadu_ps(x0 + stride + k);
        __m256 r2 = _mm256_loadu_ps(x0 + 2 * stride + k), r3 = _mm256_loadu_ps(x0 + 3 * stride + k);
        __m256 r4 = _mm256_loadu_ps(x0 + 4 * stride + k), r5 = _mm256_loadu_ps(x0 + 5 * stride + k);
        __m256 r6 = _mm256_loadu_ps(x0 + 6 * stride + k), r7 = _mm256_loadu_ps(x0 + 7 * stride + k);
        __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
        __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
        __m256 v0 = _mm256_shuffle_ps(t0, t2, 0x44), v1 = _mm256_shuffle_ps(t0, t2, 0xee);
        __m256 v2 = _mm256_shuffle_ps(t1, t3, 0x44), v3 = _mm256_shuffle_ps(t1, t3, 0xee);
        __m256 v4 = _mm256_shuffle_ps(t4, t6, 0x44), v5 = _mm256_shuffle_ps(t4, t6, 0xee);
        __m256 v6 = _mm256_shuffle_ps(t5, t7, 0x44), v7 = _mm256_shuffle_ps(t5, t7, 0xee);
        float *o = xt + ((size_t)(u0 / 16) * (size_t)n + (size_t)k) * 16 + (size_t)(u0 % 16);
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(v0, v4, 0x20));
        _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(v1, v5, 0x20));
        _mm256_storeu_ps(o + 2 * 16, _mm256_permute2f128_ps(v2, v6, 0x20));
        _mm256_storeu_ps(o + 3 * 16, _mm256_permute2f128_ps(v3, v7, 0x20));
        _mm256_storeu_ps(o + 4 * 16, _mm256_permute2f128_ps(v0, v4, 0x31));
        _mm256_storeu_ps(o + 5 * 16, _mm256_permute2f128_ps(v1, v5, 0x31));
        _mm256_storeu_ps(o + 6 * 16, _mm256_permute2f128_ps(v2, v6, 0x31));
        _mm256_storeu_ps(o + 7 * 16, _mm256_permute2f128_ps(v3, v7, 0x31));
    }
}

/* tokens [u0, u1) of x (t x n; u0 a multiple of 16) into xt: eight at a time in
   registers, the rest one by one; tokens past t zero */
TL__FMA static void tl__mm_transpose(const float *x, int t, int n, int u0, int u1, float *xt)
{
    int u = u0, v, k, kv = n / 8 * 8;
    for (; u + 8 <= u1 && u + 8 <= t; u += 8)
        tl__transpose8_avx2(x + (size_t)u * (size_t)n, (size_t)n, n, xt, u);
    for (v = u0; v < u1; v++) {
        float *dst = xt + (size_t)(v / 16) * 16 * (size_t)n + (size_t)(v % 16);
        for (k = v < u ? kv : 0; k < n; k++)
            dst[(size_t)k * 16] = v < t ? x[(size_t)v * (size_t)n + (size_t)k] : 0.0f;
    }
}

/* rows r0 .. r1-1 of matrix i by 6 (converted to fp32 once) against every token, into a
   6 x tp buffer, then into its output's columns */
TL__FMA static void tl__mm_tiled_rows(const tl__mm_job *j, int i, int r0, int r1, float *buf)
{
    const tl_mat *w = j->ws[i];
    int n = j->n, ncol = j->tp, d = j->ds[i], r, e, c, t;
    size_t as = (size_t)n, os = (size_t)j->tp, bs = 16 * (size_t)n;
    float *o = buf + 6 * as, *out = j->outs[i];
    const float *b = j->xt;
    for (r = r0; r < r1; r += 6) {
        int mr = r1 - r < 6 ? r1 - r : 6;
        const float *a = w->dtype == TL_F32 ? (const float *)w->data + (size_t)r * as : buf;
        if (w->dtype != TL_F32)
            for (e = 0; e < mr; e++)
                tl__row_f32(w, n, r + e, buf + (size_t)e * as);
        TL__FMA_ROWS(mr, 0);
        for (t = 0; t < j->t; t++)
            for (e = 0; e < mr; e++)
                out[(size_t)t * (size_t)d + (size_t)(r + e)] = o[(size_t)e * os + (size_t)t];
    }
}

TL__FMA static void tl__mm_tiled_part(void *arg, int part, int nparts)
{
    tl__mm_split((const tl__mm_job *)arg, part, nparts, tl__mm_tiled_rows);
}

/* x's tokens by blocks of 16, split over the threads */
TL__FMA static void tl__mm_transpose_part(void *arg, int part, int nparts)
{
    const tl__mm_job *j = (const tl__mm_job *)arg;
    int blocks = (j->t + 15) / 16;
    int b0 = (int)((long)blocks * part / nparts), b1 = (int)((long)blocks * (part + 1) / nparts);
    if (b1 > b0)
        tl__mm_transpose(j->x, j->t, j->n, 16 * b0, 16 * b1, j->xt);
}
#endif

/* out[i] (t, d[i]) = x (t, n) w[i]^T for count (1 .. TL__MM_MAX) matrices; 0, or -1 when
   memory runs out */
static int tl__mm_multi(tl_state *s, const float *x, int t, int n, int count, const tl_mat *const *w,
                        float *const *out, const int *d)
{
    tl__mm_job j;
    int parts = s->pool ? ((tl__pool *)s->pool)->n : 1, i;
    memset(&j, 0, sizeof j);
    j.count = count;
    j.n = n;
    j.t = t;
    j.tp = (t + 7) / 8 * 8;
    j.x = x;
    j.buf = tl__scratch(s, TL__SCRATCH_MM, (size_t)parts * 6 * ((size_t)n + (size_t)j.tp));
    if (!j.buf)
        return -1;
    for (i = 0; i < count; i++) {
        j.ws[i] = w[i];
        j.outs[i] = out[i];
        j.ds[i] = d[i];
        j.dsum += d[i];
    }
#ifdef TL__X86
    if (!s->exact_prefill && tl__have_fma()) {
        j.xt = tl__scratch(s, TL__SCRATCH_XT, (size_t)n * (size_t)((t + 15) / 16 * 16));
        if (!j.xt)
            return -1;
        tl_parallel(s, tl__mm_transpose_part, &j);
        tl_parallel(s, tl__mm_tiled_part, &j);
        return 0;
    }
#endif
    tl_parallel(s, tl__mm_part, &j);
    return 0;
}

/* out (t, d) = x (t, n) w^T */
static int tl__mm(tl_state *s, float *out, const float *x, int t, const tl_mat *w, int n, int d)
{
    return tl__mm_multi(s, x, t, n, 1, &w, &out, &d);
}

#endif /* TL_KERNELS implementation */
