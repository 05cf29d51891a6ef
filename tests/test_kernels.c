/* Kernel tests: every SIMD variant of the CPU kernels (section 3 of pqcache.h, and the
   top-k's compaction pass) against its scalar reference, called directly over many
   shapes (lengths around the vector widths, odd starts in packed codes, every code
   width, padded centroids, ties), compared bit for bit. Each level the processor offers
   is checked: AVX2 and AVX-512 on x86, NEON on AArch64 (make test-aarch64 runs this
   under qemu-aarch64); with scalar kernels only, the comparisons are skipped. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "greatest.h"

#include <stdio.h>

/* the SIMD levels this processor offers (not scalar) */
static int levels(pqc_simd *out)
{
    int n = 0;
    pqc_simd best = pqc_cpu_best_simd();
    if (best == PQC_SIMD_AVX2 || best == PQC_SIMD_AVX512) out[n++] = PQC_SIMD_AVX2;
    if (best == PQC_SIMD_AVX512) out[n++] = PQC_SIMD_AVX512;
    if (best == PQC_SIMD_NEON) out[n++] = PQC_SIMD_NEON;
    return n;
}

static uint64_t rng_next(uint64_t *st)
{
    uint64_t z = (*st += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in [-1, 1), coarse now and then (ties), -0 or 0 now and then */
static float rng_float(uint64_t *st)
{
    uint64_t r = rng_next(st);
    float f = (float)((double)(r >> 40) / 8388608.0 - 1.0);
    switch (r & 31u) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return (float)((int)(r >> 8 & 7u) - 3) * 0.25f;
    default: return f;
    }
}

static char msg[256];

/* index of the first element (of `size` bytes) where a and b differ, or -1 */
static long first_diff(const void *a, const void *b, size_t count, size_t size)
{
    size_t i;
    for (i = 0; i < count; i++)
        if (memcmp((const char *)a + i * size, (const char *)b + i * size, size) != 0) return (long)i;
    return -1;
}

#define SAME(a, b, count, what)                                                                                        \
    do {                                                                                                               \
        long d_ = first_diff((a), (b), (count), sizeof *(a));                                                          \
        if (d_ >= 0) {                                                                                                 \
            snprintf(msg, sizeof msg, "%s: %s differs from scalar at %ld of %zu", pqc_simd_name(lv), what, d_,         \
                     (size_t)(count));                                                                                 \
            FAILm(msg);                                                                                                \
        }                                                                                                              \
    } while (0)

/* Whether the upper halves of the vector registers are in use (XGETBV 1: the YMM_Hi128
   and ZMM_Hi256 components of XINUSE): 1 set, 0 clear, -1 where the processor cannot
   tell. After an AVX kernel returns through the dispatch they must be clear: left set,
   every SSE instruction after it pays Intel's transition penalty. */
#if PQC__X86
#include <cpuid.h>
static int upper_dirty(void)
{
    unsigned a = 0, b = 0, c = 0, d = 0, lo, hi;
    if (!__get_cpuid_count(0xd, 1, &a, &b, &c, &d) || !(a & 4u)) return -1;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1u));
    (void)hi;
    return (lo & 0x44u) != 0;
}
#else
static int upper_dirty(void) { return -1; }
#endif
#define UPPER_CLEAN(what) UPPER_CLEAN_AT(lv, what)
#define UPPER_CLEAN_AT(l, what)                                                                                        \
    do {                                                                                                               \
        if (upper_dirty() == 1) {                                                                                      \
            snprintf(msg, sizeof msg, "%s: %s left the vector registers' upper halves set", pqc_simd_name(l), what);   \
            FAILm(msg);                                                                                                \
        }                                                                                                              \
    } while (0)

#define NEED_LEVELS(lvs, nl)                                                                                           \
    pqc_simd lvs[3];                                                                                                   \
    int nl = levels(lvs);                                                                                              \
    if (nl == 0) SKIPm("scalar kernels only on this processor (or build)")

/* ----- the levels ------------------------------------------------------------------ */

TEST levels_offered(void)
{
    pqc_runtime_desc d;
    pqc_runtime *rt = NULL;
    pqc_simd best = pqc_cpu_best_simd();
    ASSERT_STR_EQ("neon", pqc_simd_name(PQC_SIMD_NEON));
#if defined(PQCACHE_NO_SIMD)
    ASSERT_EQ(PQC_SIMD_SCALAR, best);
#elif defined(__aarch64__) && !defined(__AARCH64EB__)
    ASSERT_EQ(PQC_SIMD_NEON, best); /* Advanced SIMD: every AArch64 processor */
#elif !defined(__x86_64__) && !defined(__i386__)
    ASSERT_EQ(PQC_SIMD_SCALAR, best);
#endif
    memset(&d, 0, sizeof d);
    d.n_threads = -1;
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(best, pqc_runtime_simd(rt)); /* auto: the best */
    pqc_runtime_destroy(rt);
    d.simd = best;
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(best, pqc_runtime_simd(rt));
    pqc_runtime_destroy(rt);
    d.simd = PQC_SIMD_SCALAR;
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(PQC_SIMD_SCALAR, pqc_runtime_simd(rt));
    pqc_runtime_destroy(rt);
    rt = NULL;
    d.simd = (pqc_simd)(PQC_SIMD_NEON + 1);
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(NULL, rt);
    PASS();
}

/* ----- k-means and lookup tables: dots, assignment, centroid sums ------------------- */

/* k centroids of d dims (some duplicated: tied distances), transposed and padded as the
   library keeps them */
static void centroids(uint64_t *st, int k, int d, int kpad, float *c, float *ct, float *cn)
{
    int i;
    for (i = 0; i < k * d; i++) c[i] = rng_float(st);
    for (i = 1; i < k; i += 5) memcpy(c + (size_t)i * d, c + (size_t)(i - 1) * d, (size_t)d * sizeof(float));
    pqc__transpose_centroids(c, k, d, kpad, ct, cn);
}

TEST dots_bitwise(void)
{
    static const int ks[] = {1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 256};
    static const int ds[] = {1, 2, 3, 4, 5, 8, 16, 24, 64};
    uint64_t st = 11;
    size_t ki, di;
    int li, i;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
            for (di = 0; di < sizeof ds / sizeof ds[0]; di++) {
                int k = ks[ki], d = ds[di], kpad = (k + 15) & ~15;
                float *c = (float *)malloc(sizeof(float) * (size_t)k * d), *ct = (float *)malloc(sizeof(float) * (size_t)kpad * d);
                float *cn = (float *)malloc(sizeof(float) * kpad), x[64], a[272], b[272];
                for (i = 0; i < d; i++) x[i] = rng_float(&st);
                centroids(&st, k, d, kpad, c, ct, cn);
                for (i = 0; i < 272; i++) a[i] = b[i] = 12345.0f; /* nothing written past k */
                pqc__dots_scalar(x, d, ct, kpad, k, a);
                pqc__k_dots(lv, x, d, ct, kpad, k, b);
                UPPER_CLEAN("dots");
                free(c);
                free(ct);
                free(cn);
                SAME(a, b, 272, "dots");
            }
    }
    PASS();
}

/* the tables of g queries at once (four at a time on AVX-512), each as the scalar
   reference makes it alone; rows and outputs strided, nothing written past k */
TEST dots_heads_bitwise(void)
{
    static const int ks[] = {1, 15, 16, 17, 63, 64, 65, 100, 128, 200, 256};
    static const int ds[] = {1, 3, 16, 32, 64};
    enum { XS = 70, DS = 280, G = 9 };
    uint64_t st = 13;
    size_t ki, di;
    int li, i, g, h;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
            for (di = 0; di < sizeof ds / sizeof ds[0]; di++)
                for (g = 1; g <= G; g++) {
                    int k = ks[ki], d = ds[di], kpad = (k + 15) & ~15;
                    float *c = (float *)malloc(sizeof(float) * (size_t)k * d);
                    float *ct = (float *)malloc(sizeof(float) * (size_t)kpad * d);
                    float *cn = (float *)malloc(sizeof(float) * kpad);
                    float x[G * XS], a[G * DS], b[G * DS];
                    for (i = 0; i < G * XS; i++) x[i] = rng_float(&st);
                    centroids(&st, k, d, kpad, c, ct, cn);
                    for (i = 0; i < G * DS; i++) a[i] = b[i] = 12345.0f;
                    for (h = 0; h < g; h++) pqc__dots_scalar(x + h * XS, d, ct, kpad, k, a + h * DS);
                    pqc__k_dots_heads(lv, x, XS, g, d, ct, kpad, k, b, DS);
                    UPPER_CLEAN("dots_heads");
                    free(c);
                    free(ct);
                    free(cn);
                    SAME(a, b, G * DS, "dots of several queries");
                }
    }
    PASS();
}

TEST assign_bitwise(void)
{
    static const int ks[] = {2, 4, 8, 16, 20, 32, 64, 128, 256};
    static const int ds[] = {1, 2, 3, 5, 8, 16, 24};
    static const size_t ns[] = {1, 2, 3, 4, 5, 7, 8, 9, 33};
    uint64_t st = 12;
    size_t ki, di, ni;
    int li, nan_case;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
            for (di = 0; di < sizeof ds / sizeof ds[0]; di++)
                for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
                    for (nan_case = 0; nan_case < 2; nan_case++) {
                        int k = ks[ki], d = ds[di], kpad = (k + 15) & ~15;
                        size_t n = ns[ni], i;
                        float *c = (float *)malloc(sizeof(float) * (size_t)k * d);
                        float *ct = (float *)malloc(sizeof(float) * (size_t)kpad * d);
                        float *cn = (float *)malloc(sizeof(float) * kpad);
                        float *x = (float *)malloc(sizeof(float) * n * d), va[33], vb[33];
                        uint16_t ia[33], ib[33], ja[33], jb[33];
                        centroids(&st, k, d, kpad, c, ct, cn);
                        for (i = 0; i < n * (size_t)d; i++) x[i] = rng_float(&st);
                        /* a point equal to a duplicated centroid: an exact tie for nearest */
                        if (k > 1) memcpy(x, c, (size_t)d * sizeof(float));
                        if (nan_case) /* centroids whose distance is NaN never win */
                            for (i = 0; i < (size_t)k; i += 3) ct[i] = NAN;
                        pqc__assign_scalar(x, n, d, ct, cn, kpad, k, ia, va);
                        pqc__k_assign(lv, x, n, d, ct, cn, kpad, k, ib, vb);
                        pqc__k_assign(lv, x, n, d, ct, cn, kpad, k, jb, NULL);
                        UPPER_CLEAN("assign");
                        pqc__assign_scalar(x, n, d, ct, cn, kpad, k, ja, NULL);
                        free(c);
                        free(ct);
                        free(cn);
                        free(x);
                        SAME(ia, ib, n, "assign (index)");
                        SAME(va, vb, n, "assign (value)");
                        SAME(ja, jb, n, "assign (index, no values)");
                    }
    }
    PASS();
}

/* One k-means++ round over the points in lanes: every level's distances equal the scalar
   reference's bit for bit, and the reference equals what the assignment's values give
   (xn + the nearest's value, raised to 0, kept where lower): the seeding it replaced. */
TEST seedmin_bitwise(void)
{
    static const int nbs[] = {1, 2, 3, 4, 5, 8, 15, 16};
    static const int ds[] = {1, 2, 3, 5, 8, 16, 31, 32, 33};
    static const size_t ns[] = {1, 15, 16, 17, 63, 64, 65, 100, 130};
    uint64_t st = 31;
    size_t bi, di, ni;
    int li;
    NEED_LEVELS(lv_, nl);
    for (bi = 0; bi < sizeof nbs / sizeof nbs[0]; bi++)
        for (di = 0; di < sizeof ds / sizeof ds[0]; di++)
            for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                int nb = nbs[bi], d = ds[di], kpad = (nb + 15) & ~15;
                size_t n = ns[ni], i;
                float *x = (float *)malloc(sizeof(float) * n * d), *xt = (float *)malloc(sizeof(float) * PQC__SEED_ROUND(n) * d);
                float *c = (float *)malloc(sizeof(float) * (size_t)nb * d), *cg = (float *)malloc(sizeof(float) * (size_t)nb * d);
                float *ct = (float *)malloc(sizeof(float) * (size_t)kpad * d), *cn = (float *)malloc(sizeof(float) * kpad);
                float *xn = (float *)malloc(sizeof(float) * n), *d0 = (float *)malloc(sizeof(float) * n);
                float *da = (float *)malloc(sizeof(float) * n), *db = (float *)malloc(sizeof(float) * n);
                float *val = (float *)malloc(sizeof(float) * n);
                uint16_t *idx = (uint16_t *)malloc(sizeof(uint16_t) * n);
                for (i = 0; i < n * (size_t)d; i++) x[i] = rng_float(&st);
                centroids(&st, nb, d, kpad, c, ct, cn);
                memcpy(x, c, (size_t)d * sizeof(float)); /* a point on a centre: distance 0 (or a rounding below it) */
                pqc__sqnorms_scalar(x, n, d, xn);
                for (i = 1; i < n; i += 4) xn[i] = 0.0f; /* below the true norm: values below 0, raised to it */
                for (i = 0; i < n; i++) /* distances so far: none yet, or lower or higher than this round's */
                    d0[i] = i % 3 == 0 ? INFINITY : (float)(i % 7) * 0.5f;
                pqc__seed_blocks(x, n, d, xt);
                pqc__seed_groups(c, nb, d, cg);
                memcpy(da, d0, n * sizeof(float));
                pqc__seedmin_scalar(x, xt, n, d, c, cg, cn, nb, xn, da);
                pqc__assign_scalar(x, n, d, ct, cn, kpad, nb, idx, val);
                for (i = 0; i < n; i++) {
                    float v = xn[i] + val[i];
                    if (v < 0.0f) v = 0.0f;
                    if (!(v < d0[i])) v = d0[i];
                    if (memcmp(&v, &da[i], sizeof v) != 0) {
                        snprintf(msg, sizeof msg, "scalar seeding round differs from the assignment's at %zu (n %zu d %d nb %d)", i,
                                 n, d, nb);
                        FAILm(msg);
                    }
                }
                for (li = 0; li < nl; li++) {
                    pqc_simd lv = lv_[li];
                    memcpy(db, d0, n * sizeof(float));
                    pqc__k_seedmin(lv, x, xt, n, d, c, cg, cn, nb, xn, db);
                    UPPER_CLEAN("seedmin");
                    SAME(da, db, n, "seeding round");
                }
                free(x);
                free(xt);
                free(c);
                free(cg);
                free(ct);
                free(cn);
                free(xn);
                free(d0);
                free(da);
                free(db);
                free(val);
                free(idx);
            }
    PASS();
}

TEST sqnorms_bitwise(void)
{
    static const int dims[] = {1, 7, 8, 16, 32, 33, 64, 128};
    static const size_t ns[] = {0, 1, 7, 8, 9, 17, 100};
    uint64_t st = 23;
    size_t di, ni, i;
    int li;
    NEED_LEVELS(lv_, nl);
    for (di = 0; di < sizeof dims / sizeof dims[0]; di++)
        for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int d = dims[di];
            size_t n = ns[ni];
            float *x = (float *)malloc(sizeof(float) * (n * (size_t)d + 1)), *a = (float *)malloc(sizeof(float) * (n + 1));
            float *b = (float *)malloc(sizeof(float) * (n + 1));
            const char *bad = NULL;
            for (i = 0; i < n * (size_t)d; i++) x[i] = rng_float(&st) * (i % 11 == 3 ? 1e19f : 1.0f); /* some overflow */
            pqc__sqnorms_scalar(x, n, d, a);
            for (i = 0; i < n && !bad; i++) { /* the reference is the fused chain over the dims */
                float acc = 0.0f;
                int e;
                for (e = 0; e < d; e++) acc = fmaf(x[i * d + e], x[i * d + e], acc);
                if (memcmp(&acc, &a[i], sizeof acc) != 0) bad = "scalar differs from the fused chain";
            }
            for (li = 0; li < nl && !bad; li++) {
                pqc__k_sqnorms(lv_[li], x, n, d, b);
                if (first_diff(a, b, n, sizeof(float)) >= 0) bad = pqc_simd_name(lv_[li]);
                else if (upper_dirty() == 1) bad = "a level left the vector registers' upper halves set";
            }
            free(x);
            free(a);
            free(b);
            if (bad) {
                snprintf(msg, sizeof msg, "sqnorms: %s (d %d, n %zu)", bad, d, n);
                FAILm(msg);
            }
        }
    PASS();
}

TEST accum_bitwise(void)
{
    static const int ds[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 24, 48};
    uint64_t st = 13;
    size_t di, i;
    int li;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (di = 0; di < sizeof ds / sizeof ds[0]; di++) {
            int d = ds[di], k = 7;
            size_t n = 50;
            float *x = (float *)malloc(sizeof(float) * n * d);
            double *sa = (double *)malloc(sizeof(double) * (size_t)k * d), *sb = (double *)malloc(sizeof(double) * (size_t)k * d);
            uint16_t idx[50];
            for (i = 0; i < n * (size_t)d; i++) x[i] = rng_float(&st) * 1e3f;
            for (i = 0; i < n; i++) idx[i] = (uint16_t)(rng_next(&st) % (uint64_t)k);
            for (i = 0; i < (size_t)k * d; i++) sa[i] = sb[i] = (double)rng_float(&st) * 1e-7;
            pqc__accum_scalar(x, n, d, idx, sa);
            pqc__k_accum(lv, x, n, d, idx, sb);
            UPPER_CLEAN("accum");
            free(x);
            if (first_diff(sa, sb, (size_t)k * d, sizeof(double)) >= 0) {
                free(sa);
                free(sb);
                snprintf(msg, sizeof msg, "%s: accum differs from scalar (d = %d)", pqc_simd_name(lv), d);
                FAILm(msg);
            }
            free(sa);
            free(sb);
        }
    }
    PASS();
}

/* ----- scans of packed codes ------------------------------------------------------- */

TEST scan_bitwise(void)
{
    static const size_t ns[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 63, 64, 65, 100, 257};
    static const size_t t0s[] = {0, 1, 2, 3, 5, 8, 17};
    static const int ms[] = {1, 2, 3, 5};
    uint64_t st = 14;
    int li, bits;
    size_t ni, ti, mi;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (bits = 1; bits <= 8; bits++)
            for (mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
                int m = ms[mi], ksub = 1 << bits, i;
                size_t cap = 17 + 257, stride = (cap * (size_t)bits + 7) / 8 + 8, b;
                pqc_codes cd;
                float *lut = (float *)malloc(sizeof(float) * (size_t)m * ksub), oa[257], ob[257];
                memset(&cd, 0, sizeof cd);
                cd.m = m;
                cd.bits = bits;
                cd.count = cd.capacity = cap;
                cd.col_stride = stride;
                cd.data = (unsigned char *)malloc(stride * (size_t)m);
                for (b = 0; b < stride * (size_t)m; b++) cd.data[b] = (unsigned char)rng_next(&st);
                for (i = 0; i < m * ksub; i++) lut[i] = rng_float(&st) * 8.0f;
                for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
                    for (ti = 0; ti < sizeof t0s / sizeof t0s[0]; ti++) {
                        size_t n = ns[ni], t0 = t0s[ti];
                        pqc__scan_scalar(&cd, lut, ksub, t0, n, oa);
                        pqc__k_scan(lv, &cd, lut, ksub, t0, n, ob);
                        UPPER_CLEAN("scan");
                        if (first_diff(oa, ob, n, sizeof(float)) >= 0) {
                            free(lut);
                            free(cd.data);
                            snprintf(msg, sizeof msg, "%s: scan differs from scalar (bits %d, m %d, t0 %zu, n %zu)",
                                     pqc_simd_name(lv), bits, m, t0, n);
                            FAILm(msg);
                        }
                    }
                free(lut);
                free(cd.data);
            }
    }
    PASS();
}

/* ----- the GQA combination: max, exp and sum, axpy --------------------------------- */

static const size_t lens[] = {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 64, 100, 1000};

TEST max_bitwise(void)
{
    uint64_t st = 15;
    size_t ni, i;
    int li, kind;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        /* kinds 0-1: the scores the library makes (finite); on NEON also 2: maxima that
           are zeros of either sign, 3: NaN (never taken), the scalar loop's answers */
        int kinds = lv == PQC_SIMD_NEON ? 4 : 2;
        for (kind = 0; kind < kinds; kind++)
            for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
                size_t n = lens[ni];
                float *x = (float *)malloc(sizeof(float) * (n + 1)), a, b;
                for (i = 0; i < n; i++) {
                    float f = rng_float(&st);
                    switch (kind) {
                    case 0: x[i] = f * 100.0f; break;
                    case 1: x[i] = i % 7 == 3 ? -INFINITY : (float)-(int)(i % 5); break; /* ties, -inf */
                    case 2: x[i] = f <= 0.0f ? f : -f; break;
                    default: x[i] = i % 4 == 1 ? NAN : f; break;
                    }
                }
                a = pqc__max_scalar(x, n);
                b = pqc__k_max(lv, x, n);
                UPPER_CLEAN("max");
                free(x);
                if (memcmp(&a, &b, sizeof a) != 0) {
                    snprintf(msg, sizeof msg, "%s: max differs from scalar (kind %d, n %zu): %g vs %g", pqc_simd_name(lv),
                             kind, n, (double)a, (double)b);
                    FAILm(msg);
                }
            }
    }
    PASS();
}

TEST expsum_bitwise(void)
{
    static const float scales[] = {1.0f, 0.125f, 0.0883883476f, 30.0f};
    uint64_t st = 16;
    size_t ni, i, si;
    int li;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (si = 0; si < sizeof scales / sizeof scales[0]; si++)
            for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
                size_t n = lens[ni];
                float *s = (float *)malloc(sizeof(float) * (n + 1)), *ea = (float *)malloc(sizeof(float) * (n + 1));
                float *eb = (float *)malloc(sizeof(float) * (n + 1)), mx, za, zb;
                /* from the maximum down past the clamp at exp(-87.3); -inf and NaN are
                   clamped there too */
                for (i = 0; i < n; i++) s[i] = rng_float(&st) * (i % 3 == 0 ? 40.0f : 4.0f);
                for (i = 5; i < n; i += 11) s[i] = i % 2 ? -INFINITY : NAN;
                mx = pqc__max_scalar(s, n);
                if (n == 0) mx = 0.0f;
                za = pqc__expsum_scalar(s, n, mx, scales[si], ea);
                zb = pqc__k_expsum(lv, s, n, mx, scales[si], eb);
                UPPER_CLEAN("expsum");
                free(s);
                if (memcmp(&za, &zb, sizeof za) != 0 || first_diff(ea, eb, n, sizeof(float)) >= 0) {
                    free(ea);
                    free(eb);
                    snprintf(msg, sizeof msg, "%s: expsum differs from scalar (scale %g, n %zu)", pqc_simd_name(lv),
                             (double)scales[si], n);
                    FAILm(msg);
                }
                free(ea);
                free(eb);
            }
    }
    PASS();
}

/* exp's reduction rounds x log2(e) to the nearest integer, ties to even (nearbyintf):
   scores whose product lands on a half */
TEST expsum_halfway_bitwise(void)
{
    float s[64], ea[64], eb[64], za, zb;
    size_t n = 0;
    int li, j, tries;
    NEED_LEVELS(lv_, nl);
    s[n++] = 0.0f; /* the maximum */
    for (j = 0; j < 120 && n < 64; j++) {
        float h = -((float)j + 0.5f), x = h / PQC__LOG2E;
        for (tries = 0; tries < 64 && x * PQC__LOG2E != h; tries++)
            x = nextafterf(x, x * PQC__LOG2E > h ? -INFINITY : 0.0f);
        if (x * PQC__LOG2E == h) s[n++] = x;
    }
    ASSERT(n > 40);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        za = pqc__expsum_scalar(s, n, 0.0f, 1.0f, ea);
        zb = pqc__k_expsum(lv, s, n, 0.0f, 1.0f, eb);
        SAME(ea, eb, n, "expsum (halfway)");
        SAME(&za, &zb, 1, "expsum's sum (halfway)");
    }
    PASS();
}

TEST axpy_bitwise(void)
{
    uint64_t st = 17;
    size_t ni, i;
    int li;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
            size_t n = lens[ni];
            float *e = (float *)malloc(sizeof(float) * (n + 1)), *a = (float *)malloc(sizeof(float) * (n + 1));
            float *b = (float *)malloc(sizeof(float) * (n + 1)), w = rng_float(&st) + 1.0f / 3.0f;
            long dif;
            for (i = 0; i < n; i++) {
                e[i] = rng_float(&st);
                a[i] = b[i] = rng_float(&st);
            }
            pqc__axpy_scalar(e, n, w, a);
            pqc__k_axpy(lv, e, n, w, b);
            UPPER_CLEAN("axpy");
            dif = first_diff(a, b, n, sizeof(float));
            free(e);
            free(a);
            free(b);
            if (dif >= 0) {
                snprintf(msg, sizeof msg, "%s: axpy differs from scalar (n %zu)", pqc_simd_name(lv), n);
                FAILm(msg);
            }
        }
    }
    PASS();
}

/* ----- every head in one pass: the heads' scores and the combination -------------- */

/* codes of m sub-spaces, `bits` wide, for cap tokens, random bytes (padding included) */
static void random_codes(pqc_codes *cd, int m, int bits, size_t cap, uint64_t *st)
{
    size_t b;
    memset(cd, 0, sizeof *cd);
    cd->m = m;
    cd->bits = bits;
    cd->count = cd->capacity = cap;
    cd->col_stride = (cap * (size_t)bits + 7) / 8 + 8;
    cd->data = (unsigned char *)malloc(cd->col_stride * (size_t)m);
    for (b = 0; b < cd->col_stride * (size_t)m; b++) cd->data[b] = (unsigned char)rng_next(st);
}

/* The scalar reference scores each head as pqc__scan does from that head's own table,
   with each head's maximum; every level equals it bit for bit (rows and maxima), for
   every code width (8 bits has the vector code), head counts in and out of groups of
   four, odd starts and lengths around the four-token step. */
TEST scan_heads_bitwise(void)
{
    static const size_t ns[] = {0, 1, 3, 4, 5, 7, 8, 17, 100, 257};
    static const size_t t0s[] = {0, 1, 3, 17};
    static const int ms[] = {1, 2, 3, 5}, gs[] = {1, 2, 3, 4, 5, 8, 12};
    uint64_t st = 21;
    int li, bits, nl;
    size_t ni, ti, mi, gi;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (bits = 1; bits <= 8; bits++)
        for (mi = 0; mi < sizeof ms / sizeof ms[0]; mi++)
            for (gi = 0; gi < sizeof gs / sizeof gs[0]; gi++) {
                int m = ms[mi], g = gs[gi], ksub = 1 << bits, i, h;
                size_t cap = 17 + 257, tl = (size_t)m * (size_t)ksub;
                pqc_codes cd;
                float *lut = (float *)malloc(sizeof(float) * tl * (size_t)g), *il = (float *)malloc(sizeof(float) * tl * (size_t)g);
                float *oa = (float *)malloc(sizeof(float) * 257 * (size_t)g), *ob = (float *)malloc(sizeof(float) * 257 * (size_t)g);
                float one[257], ma[12], mb[12];
                const char *bad = NULL;
                random_codes(&cd, m, bits, cap, &st);
                for (i = 0; i < (int)tl * g; i++) lut[i] = rng_float(&st) * 8.0f;
                for (h = 0; h < g; h++)
                    for (i = 0; i < (int)tl; i++) il[(size_t)i * (size_t)g + (size_t)h] = lut[(size_t)h * tl + (size_t)i];
                for (ni = 0; ni < sizeof ns / sizeof ns[0] && !bad; ni++)
                    for (ti = 0; ti < sizeof t0s / sizeof t0s[0] && !bad; ti++) {
                        size_t n = ns[ni], t0 = t0s[ti];
                        for (h = 0; h < g; h++) ma[h] = -INFINITY;
                        pqc__scan_heads_scalar(&cd, il, ksub, g, t0, n, oa, n, ma);
                        for (h = 0; h < g && !bad; h++) {
                            float x = -INFINITY;
                            pqc__scan_scalar(&cd, lut + (size_t)h * tl, ksub, t0, n, one);
                            x = n ? pqc__max_scalar(one, n) : x;
                            if (first_diff(one, oa + (size_t)h * n, n, sizeof(float)) >= 0) bad = "scalar rows differ from pqc__scan";
                            else if (memcmp(&x, &ma[h], sizeof x) != 0) bad = "scalar maximum differs from pqc__max";
                        }
                        for (li = 0; li < nl && !bad; li++) {
                            pqc_simd lv = lv_[li];
                            for (h = 0; h < g; h++) mb[h] = -INFINITY;
                            memset(ob, 0xff, sizeof(float) * n * (size_t)g);
                            pqc__k_scan_heads(lv, &cd, il, ksub, g, t0, n, ob, n, mb);
                            UPPER_CLEAN("scan_heads");
                            if (first_diff(oa, ob, n * (size_t)g, sizeof(float)) >= 0 ||
                                first_diff(ma, mb, (size_t)g, sizeof(float)) >= 0)
                                bad = pqc_simd_name(lv);
                        }
                        if (bad) snprintf(msg, sizeof msg, "scan_heads: %s (bits %d, m %d, g %d, t0 %zu, n %zu)", bad, bits, m,
                                          g, t0, n);
                    }
                free(lut);
                free(il);
                free(oa);
                free(ob);
                free(cd.data);
                if (bad) FAILm(msg);
            }
    PASS();
}

/* The lane sum (the products' normaliser) adds as expsum adds its exponentials: over
   expsum's own exponentials it gives expsum's sum */
TEST lanesum_is_expsums_order(void)
{
    uint64_t st = 23;
    size_t ni, i;
    for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
        size_t n = lens[ni];
        float *s = (float *)malloc(sizeof(float) * (n + 1)), *e = (float *)malloc(sizeof(float) * (n + 1)), z, a;
        for (i = 0; i < n; i++) s[i] = rng_float(&st) * 20.0f;
        z = pqc__expsum_scalar(s, n, n ? pqc__max_scalar(s, n) : 0.0f, 0.3f, e);
        a = pqc__lanesum_scalar(e, n);
        free(s);
        free(e);
        if (memcmp(&a, &z, sizeof a) != 0) {
            snprintf(msg, sizeof msg, "lanesum %g against expsum's %g (n %zu)", (double)a, (double)z, n);
            FAILm(msg);
        }
    }
    PASS();
}

/* The product of token t's table entries under head h (sub-spaces ascending, from 1), as
   the scan of exponentials makes it: the code read as pqc_codes_get does */
static float heads_product(const pqc_codes *cd, const float *il, int ksub, int g, int h, size_t t)
{
    float a = 1.0f;
    int j;
    for (j = 0; j < cd->m; j++)
        a *= il[((size_t)j * (size_t)ksub + pqc_codes_get(cd, t, j)) * (size_t)g + (size_t)h];
    return a;
}

/* Four heads' products and their sums: the scalar reference's rows are each token's
   product taken alone (heads_product), its sums the rows' lane sums; every level equals
   it bit for bit, over odd starts and lengths around the eight-token step, the x86
   kernels' chunks of offsets (4096 / m tokens, a multiple of 16: 1024 at m = 4, 816 at
   m = 5, 256 at m = 16) and sub-space counts, up to one past the most that the chunks
   take (257: the scalar reference) */
TEST scan_products_bitwise(void)
{
    static const size_t ns[] = {0, 1, 7, 8, 9, 15, 16, 17, 24, 100, 257, 1032, 2100};
    static const size_t t0s[] = {0, 1, 17};
    static const int ms[] = {1, 2, 3, 4, 5, 16, 257};
    uint64_t st = 24;
    int li, nl;
    size_t ni, ti, mi;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
        int m = ms[mi], ksub = 256, i, h;
        size_t cap = 17 + 2100, tl = (size_t)m * (size_t)ksub, t;
        pqc_codes cd;
        float *el = (float *)malloc(sizeof(float) * tl * 4);
        float *oa = (float *)malloc(sizeof(float) * 2100 * 4), *ob = (float *)malloc(sizeof(float) * 2100 * 4);
        float za[4], zb[4];
        const char *bad = NULL;
        random_codes(&cd, m, 8, cap, &st);
        for (i = 0; i < (int)tl * 4; i++) el[i] = rng_float(&st) * 0.5f + 0.5f;
        for (ni = 0; ni < sizeof ns / sizeof ns[0] && !bad; ni++)
            for (ti = 0; ti < sizeof t0s / sizeof t0s[0] && !bad; ti++) {
                size_t n = ns[ni], t0 = t0s[ti];
                pqc__scan_products_scalar(&cd, el, ksub, t0, n, oa, n, za);
                for (h = 0; h < 4 && !bad; h++) {
                    float z = pqc__lanesum_scalar(oa + (size_t)h * n, n);
                    for (t = 0; t < n; t++) {
                        float x = heads_product(&cd, el, ksub, 4, h, t0 + t);
                        if (memcmp(&x, oa + (size_t)h * n + t, sizeof x) != 0) bad = "scalar rows differ from the products";
                    }
                    if (!bad && memcmp(&z, &za[h], sizeof z) != 0) bad = "scalar sum differs from the lane sum";
                }
                for (li = 0; li < nl && !bad; li++) {
                    pqc_simd lv = lv_[li];
                    memset(ob, 0xff, sizeof(float) * n * 4);
                    pqc__k_scan_products(lv, &cd, el, ksub, t0, n, ob, n, zb);
                    UPPER_CLEAN("scan_products");
                    if (first_diff(oa, ob, n * 4, sizeof(float)) >= 0 || first_diff(za, zb, 4, sizeof(float)) >= 0)
                        bad = pqc_simd_name(lv);
                }
                if (bad) snprintf(msg, sizeof msg, "scan_products: %s (m %d, t0 %zu, n %zu)", bad, m, t0, n);
            }
        free(el);
        free(oa);
        free(ob);
        free(cd.data);
        if (bad) FAILm(msg);
    }
    PASS();
}

/* The one-pass combination equals each head's axpy in turn onto zeros, at every level */
TEST combine_bitwise(void)
{
    static const int gs[] = {1, 2, 3, 4, 7, 8};
    uint64_t st = 22;
    size_t ni, i, gi;
    int li, h, nl;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (gi = 0; gi < sizeof gs / sizeof gs[0]; gi++)
        for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
            size_t n = lens[ni], es = n + 3;
            int g = gs[gi];
            float *e = (float *)malloc(sizeof(float) * (es * (size_t)g + 1)), *a = (float *)malloc(sizeof(float) * (n + 1));
            float *b = (float *)malloc(sizeof(float) * (n + 1)), *c = (float *)malloc(sizeof(float) * (n + 1)), w[8];
            const char *bad = NULL;
            for (i = 0; i < es * (size_t)g; i++) e[i] = fabsf(rng_float(&st));
            for (h = 0; h < g; h++) w[h] = 1.0f / (fabsf(rng_float(&st)) * 1000.0f + 1.0f);
            memset(a, 0, sizeof(float) * n);
            for (h = 0; h < g; h++) pqc__axpy_scalar(e + (size_t)h * es, n, w[h], a);
            pqc__combine_scalar(e, es, g, n, w, b);
            if (first_diff(a, b, n, sizeof(float)) >= 0) bad = "scalar differs from the heads' axpy";
            for (li = 0; li < nl && !bad; li++) {
                pqc__k_combine(lv_[li], e, es, g, n, w, c);
                if (first_diff(b, c, n, sizeof(float)) >= 0) bad = pqc_simd_name(lv_[li]);
                else if (upper_dirty() == 1) bad = "a level left the vector registers' upper halves set";
            }
            free(e);
            free(a);
            free(b);
            free(c);
            if (bad) {
                snprintf(msg, sizeof msg, "combine: %s (g %d, n %zu)", bad, g, n);
                FAILm(msg);
            }
        }
    PASS();
}

/* ----- exact scores: row dots ------------------------------------------------------ */

TEST rowdots_bitwise(void)
{
    static const int ds[] = {1, 3, 4, 8, 15, 16, 17, 31, 32, 33, 48, 64, 100, 128};
    uint64_t st = 18;
    size_t di, i;
    int li;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (di = 0; di < sizeof ds / sizeof ds[0]; di++) {
            int d = ds[di];
            size_t n = 13, stride = (size_t)d + 3;
            float *q = (float *)malloc(sizeof(float) * d), *rows = (float *)malloc(sizeof(float) * n * stride);
            float a[13], b[13];
            long dif;
            for (i = 0; i < (size_t)d; i++) q[i] = rng_float(&st);
            for (i = 0; i < n * stride; i++) rows[i] = rng_float(&st) * 3.0f;
            pqc__rowdots_scalar(q, rows, n, stride, d, a);
            pqc__k_rowdots(lv, q, rows, n, stride, d, b);
            UPPER_CLEAN("rowdots");
            dif = first_diff(a, b, n, sizeof(float));
            free(q);
            free(rows);
            if (dif >= 0) {
                snprintf(msg, sizeof msg, "%s: rowdots differs from scalar (d %d)", pqc_simd_name(lv), d);
                FAILm(msg);
            }
        }
    }
    PASS();
}

/* ----- exact scores: keys converted and checked --------------------------------------- */

/* fp16 and bf16 rows to fp32 at every level equal the scalar conversion (finite values,
   subnormals, infinities; NaN payloads are not part of the contract: such keys are refused) */
TEST halfrow_bitwise(void)
{
    uint64_t st = 23;
    size_t ni, i;
    int li, ti, nl;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (ti = 0; ti < 2; ti++)
        for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
            size_t n = lens[ni];
            pqc_dtype t = ti ? PQC_BF16 : PQC_F16;
            uint16_t *h = (uint16_t *)malloc(sizeof(uint16_t) * (n + 1));
            float *a = (float *)malloc(sizeof(float) * (n + 1)), *b = (float *)malloc(sizeof(float) * (n + 1));
            const char *bad = NULL;
            for (i = 0; i < n; i++) {
                uint16_t v = (uint16_t)rng_next(&st);
                if ((v & 0x7c00u) == 0x7c00u && t == PQC_F16) v &= 0xfc00u; /* infinities, not NaN */
                if ((v & 0x7f80u) == 0x7f80u && t == PQC_BF16) v &= 0xff80u;
                h[i] = v;
            }
            pqc__halfrow_scalar(h, t, n, a);
            for (i = 0; i < n && !bad; i++) {
                float r = t == PQC_F16 ? pqc_f16_to_f32(h[i]) : pqc_bf16_to_f32(h[i]);
                if (memcmp(&r, &a[i], sizeof r) != 0) bad = "scalar differs from the element conversion";
            }
            for (li = 0; li < nl && !bad; li++) {
                pqc__k_halfrow(lv_[li], h, t, n, b);
                if (first_diff(a, b, n, sizeof(float)) >= 0) bad = pqc_simd_name(lv_[li]);
                else if (upper_dirty() == 1) bad = "a level left the vector registers' upper halves set";
            }
            free(h);
            free(a);
            free(b);
            if (bad) {
                snprintf(msg, sizeof msg, "halfrow: %s (%s, n %zu)", bad, ti ? "bf16" : "fp16", n);
                FAILm(msg);
            }
        }
    PASS();
}

/* fp32 rows to fp16 and bf16 at every level equal the scalar conversion, byte for byte:
   random bit patterns of every magnitude (subnormal, normal, past fp16's range,
   infinities, NaNs with payloads), ties to even in both formats, and the largest finite
   fp16 and the first value that rounds past it */
TEST narrow_bitwise(void)
{
    static const float edge[] = {65504.0f, 65519.996f, 65520.0f, -65520.0f, 1.0009765625f /* 1 + 2^-10 */,
                                 1.00048828125f /* a tie: 1 + 2^-11 */, 1.00146484375f /* 1 + 3 * 2^-11 */,
                                 5.9604645e-08f /* fp16's smallest subnormal */, 2.9802322e-08f /* half of it */,
                                 0.0f, -0.0f, 1e-40f, -1e-40f, 3.3895314e38f};
    uint64_t st = 29;
    size_t ni, i;
    int li, ti, nl;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (ti = 0; ti < 2; ti++)
        for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
            size_t n = lens[ni];
            pqc_dtype t = ti ? PQC_BF16 : PQC_F16;
            float *x = (float *)malloc(sizeof(float) * (n + 1));
            uint16_t *a = (uint16_t *)malloc(sizeof(uint16_t) * (n + 1)), *b = (uint16_t *)malloc(sizeof(uint16_t) * (n + 1));
            const char *bad = NULL;
            for (i = 0; i < n; i++) {
                uint32_t u = (uint32_t)rng_next(&st);
                switch (i % 5) {
                case 4: /* bf16's ties and the values beside them: low halves 0x7fff, 0x8000, 0x8001 */
                    u = (u & 0xffff0000u) | (0x7fffu + (uint32_t)(i / 5) % 3u);
                    if ((u & 0x7f800000u) == 0x7f800000u) u &= 0xbfffffffu;
                    memcpy(&x[i], &u, 4);
                    break;
                case 0: x[i] = edge[(i / 5) % (sizeof edge / sizeof edge[0])]; break;
                case 1: x[i] = rng_float(&st) * 1e-3f; break;
                case 2: /* exponents around fp16's range: subnormal to past its largest */
                    u = (u & 0x807fffffu) | ((uint32_t)(100 + (u >> 23) % 48) << 23);
                    memcpy(&x[i], &u, 4);
                    break;
                default: memcpy(&x[i], &u, 4); /* any pattern, NaNs and infinities among them */
                }
                if (n > 40 && i == n / 2) { /* a NaN with a payload, and an infinity */
                    u = 0x7fa00001u;
                    memcpy(&x[i], &u, 4);
                    x[i - 1] = -INFINITY;
                }
            }
            pqc__narrow_scalar(x, t, n, a);
            for (i = 0; i < n && !bad; i++) {
                uint16_t r = t == PQC_F16 ? pqc_f32_to_f16(x[i]) : pqc_f32_to_bf16(x[i]);
                if (r != a[i]) bad = "scalar differs from the element conversion";
            }
            for (li = 0; li < nl && !bad; li++) {
                pqc__k_narrow(lv_[li], x, t, n, b);
                if (first_diff(a, b, n, sizeof(uint16_t)) >= 0) bad = pqc_simd_name(lv_[li]);
                else if (upper_dirty() == 1) bad = "a level left the vector registers' upper halves set";
            }
            free(x);
            free(a);
            free(b);
            if (bad) {
                snprintf(msg, sizeof msg, "narrow: %s (%s, n %zu)", bad, ti ? "bf16" : "fp16", n);
                FAILm(msg);
            }
        }
    PASS();
}

/* n stored key rows of d values in [-4, 4) (fp32, fp16 or bf16), stride bytes apart */
static void key_rows(uint64_t *st, unsigned char *rows, size_t n, size_t stride, int d, pqc_dtype t)
{
    size_t i, e;
    for (i = 0; i < n; i++)
        for (e = 0; e < (size_t)d; e++) {
            float v = rng_float(st) * 4.0f;
            uint16_t h = t == PQC_F16 ? pqc_f32_to_f16(v) : pqc_f32_to_bf16(v);
            if (t == PQC_F32) memcpy(rows + i * stride + 4 * e, &v, 4);
            else memcpy(rows + i * stride + 2 * e, &h, 2);
        }
}

/* fp32, fp16 and bf16 rows scored in one pass (convert, check, dot) give at every level the
   bits of the scalar reference, which is the conversion, the range check and the row
   dots one after another; the first row that cannot be ranked is found wherever it lies */
TEST keydots_bitwise(void)
{
    static const int dims[] = {8, 16, 32, 48, 128, 136};
    static const size_t counts[] = {1, 5, 64};
    uint64_t st = 25;
    size_t di, ci, i, e;
    int li, nl, ti, pad, bi;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (ti = 0; ti < 3; ti++)
        for (di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
                for (pad = 0; pad <= 6; pad += 6)
                    for (bi = 0; bi < 6; bi++) { /* no bad value, then one in a row of its own */
                        pqc_dtype t = ti == 2 ? PQC_F32 : ti ? PQC_BF16 : PQC_F16;
                        int d = dims[di];
                        size_t es = t == PQC_F32 ? 4 : 2;
                        size_t n = counts[ci], stride = (size_t)d * es + (size_t)pad, bad_row = n, want, got;
                        unsigned char *rows = (unsigned char *)malloc(stride * n + 4);
                        float *q = (float *)malloc(sizeof(float) * (size_t)d), *row = (float *)malloc(sizeof(float) * (size_t)d);
                        float *a = (float *)malloc(sizeof(float) * n), *b = (float *)malloc(sizeof(float) * n);
                        const char *fail = NULL;
                        for (e = 0; e < (size_t)d; e++) q[e] = rng_float(&st);
                        key_rows(&st, rows, n, stride, d, t);
                        if (bi > 0 && t == PQC_F32) { /* the same cases in fp32: the limit itself is fine */
                            float v = bi == 1 ? INFINITY : bi == 2 ? NAN : bi == 3 ? -1e17f
                                    : bi == 4 ? -PQC__KEY_LIMIT : nextafterf(PQC__KEY_LIMIT, INFINITY);
                            size_t at = (size_t)(rng_next(&st) % n);
                            if (bi != 4) bad_row = at;
                            memcpy(rows + at * stride + 4 * (size_t)(rng_next(&st) % (uint64_t)d), &v, 4);
                        } else if (bi > 0) { /* Inf, NaN, (bf16) a finite value past the key limit, the
                                         largest magnitude within it (fine), the next one up */
                            uint16_t h = bi == 1 ? (t == PQC_F16 ? 0x7c00u : 0x7f80u)
                                       : bi == 2 ? (t == PQC_F16 ? 0xfe00u : 0xffc0u)
                                       : bi == 3 ? (t == PQC_F16 ? 0xfc00u : pqc_f32_to_bf16(-1e17f))
                                       : bi == 4 ? (t == PQC_F16 ? 0xfbffu : 0xda0eu) /* -65504, -bf16(1e16) rounded down */
                                                 : (t == PQC_F16 ? 0x7c00u : 0x5a0fu);
                            size_t at = (size_t)(rng_next(&st) % n);
                            if (bi != 4) bad_row = at;
                            memcpy(rows + at * stride + 2 * (size_t)(rng_next(&st) % (uint64_t)d), &h, 2);
                        }
                        want = pqc__keydots_scalar(q, rows, stride, t, n, d, PQC__KEY_LIMIT, row, a);
                        if (want != bad_row) fail = "scalar misses the row that cannot be ranked";
                        for (i = 0; i < n && !fail; i++) {
                            float r;
                            if (t == PQC_F32) memcpy(row, rows + i * stride, sizeof(float) * (size_t)d);
                            else pqc__halfrow_scalar(rows + i * stride, t, (size_t)d, row);
                            pqc__rowdots_scalar(q, row, 1, (size_t)d, d, &r);
                            if (memcmp(&r, &a[i], sizeof r)) fail = "scalar differs from convert + row dots";
                        }
                        for (li = 0; li < nl && !fail; li++) {
                            got = pqc__k_keydots(lv_[li], q, rows, stride, t, n, d, PQC__KEY_LIMIT, row, b);
                            if (got != want || first_diff(a, b, n, sizeof(float)) >= 0) fail = pqc_simd_name(lv_[li]);
                            else if (upper_dirty() == 1) fail = "a level left the vector registers' upper halves set";
                        }
                        free(rows);
                        free(q);
                        free(row);
                        free(a);
                        free(b);
                        if (fail) {
                            snprintf(msg, sizeof msg, "keydots: %s (%s, d %d, n %zu, pad %d, bad %d)", fail,
                                     ti == 2 ? "fp32" : ti ? "bf16" : "fp16", d, n, pad, bi);
                            FAILm(msg);
                        }
                    }
    PASS();
}

/* every head's dots with scattered stored rows (fp32, fp16, bf16; padded strides; rows
   picked out of order and repeated, or all of them in order) give at every level the
   bits of the scalar reference, which is the conversion, the range check and each head's
   row dot one after another; with the check on, the first picked row that cannot be
   ranked is found and the call stops there (with it off, rows are finite: the cache's) */
TEST gatherdots_bitwise(void)
{
    static const int dims[] = {8, 16, 48, 128, 136};
    static const int heads[] = {1, 3, 4, 5, 8};
    enum { ROWS = 40 };
    uint64_t st = 26;
    size_t di, i, e;
    int li, nl, ti, hi, bi, h;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (ti = 0; ti < 3; ti++)
        for (di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (hi = 0; hi < (int)(sizeof heads / sizeof heads[0]); hi++)
                for (bi = 0; bi < 8; bi++) { /* 0-3: all rows fine (1, 3: check off; 1: every row in
                                                order); 4-7: a bad value in a picked row, check on */
                    pqc_dtype t = ti == 2 ? PQC_F32 : ti ? PQC_BF16 : PQC_F16;
                    int d = dims[di], g = heads[hi], check = bi != 1 && bi != 3;
                    size_t es = t == PQC_F32 ? 4 : 2, stride = (size_t)d * es + (size_t)(bi == 1 || bi == 2 || bi == 5 ? 12 : 0);
                    size_t n = bi == 1 ? ROWS : 23, want, got, bad_at = n;
                    unsigned char *rows = (unsigned char *)malloc(stride * ROWS + 4);
                    uint32_t idx[ROWS];
                    float *q = (float *)malloc(sizeof(float) * (size_t)d * (size_t)g);
                    float *row = (float *)malloc(sizeof(float) * (size_t)d);
                    float *a = (float *)calloc((size_t)g * ROWS, sizeof(float));
                    float *b = (float *)calloc((size_t)g * ROWS, sizeof(float));
                    const char *fail = NULL;
                    for (e = 0; e < (size_t)d * (size_t)g; e++) q[e] = rng_float(&st);
                    key_rows(&st, rows, ROWS, stride, d, t);
                    for (i = 0; i < n; i++) idx[i] = (uint32_t)(rng_next(&st) % ROWS); /* any order, repeats */
                    if (bi >= 4) { /* an infinity, a NaN or a value past the key limit in one picked row */
                        size_t at = (size_t)(rng_next(&st) % n), col = (size_t)(rng_next(&st) % (uint64_t)d);
                        if (t == PQC_F32) {
                            float v = bi == 4 ? INFINITY : bi % 2 ? NAN : -1e17f;
                            memcpy(rows + idx[at] * stride + 4 * col, &v, 4);
                        } else {
                            uint16_t hv = bi == 4 ? (t == PQC_F16 ? 0x7c00u : 0x7f80u)
                                        : bi % 2 ? (t == PQC_F16 ? 0xfe00u : 0xffc0u)
                                                 : (t == PQC_F16 ? 0xfc00u : pqc_f32_to_bf16(-1e17f));
                            memcpy(rows + idx[at] * stride + 2 * col, &hv, 2);
                        }
                        for (i = 0; i < n && bad_at == n; i++) /* the first pick of that row */
                            if (idx[i] == idx[at]) bad_at = i;
                    }
                    want = pqc__gatherdots_scalar(q, g, rows, stride, t, bi == 1 ? NULL : idx, n, d, check,
                                                  PQC__KEY_LIMIT, row, a, ROWS);
                    if (want != (check ? bad_at : n)) fail = "scalar misses the row that cannot be ranked";
                    for (i = 0; i < want && !fail; i++)
                        for (h = 0; h < g && !fail; h++) {
                            float r;
                            const unsigned char *src = rows + (bi == 1 ? i : idx[i]) * stride;
                            if (t == PQC_F32) memcpy(row, src, sizeof(float) * (size_t)d);
                            else pqc__halfrow_scalar(src, t, (size_t)d, row);
                            pqc__rowdots_scalar(q + (size_t)h * (size_t)d, row, 1, (size_t)d, d, &r);
                            if (memcmp(&r, &a[(size_t)h * ROWS + i], sizeof r)) fail = "scalar differs from convert + row dots";
                        }
                    for (li = 0; li < nl && !fail; li++) {
                        memset(b, 0, sizeof(float) * (size_t)g * ROWS);
                        got = pqc__k_gatherdots(lv_[li], q, g, rows, stride, t, bi == 1 ? NULL : idx, n, d, check,
                                                PQC__KEY_LIMIT, row, b, ROWS);
                        for (h = 0; h < g && !fail; h++)
                            if (first_diff(a + (size_t)h * ROWS, b + (size_t)h * ROWS, want, sizeof(float)) >= 0)
                                fail = pqc_simd_name(lv_[li]);
                        if (got != want) fail = pqc_simd_name(lv_[li]);
                        else if (upper_dirty() == 1) fail = "a level left the vector registers' upper halves set";
                    }
                    free(rows);
                    free(q);
                    free(row);
                    free(a);
                    free(b);
                    if (fail) {
                        snprintf(msg, sizeof msg, "gatherdots: %s (%s, d %d, g %d, case %d)", fail,
                                 ti == 2 ? "fp32" : ti ? "bf16" : "fp16", d, g, bi);
                        FAILm(msg);
                    }
                }
    PASS();
}

/* the range check of keys gives the scalar answer at every level: one value past the
   limit, an infinity or a NaN anywhere in the row fails it */
TEST within_bitwise(void)
{
    static const float odd[] = {1e17f, -1e17f, 1e16f, -1e16f, INFINITY, -INFINITY, NAN, 0.0f, -0.0f};
    uint64_t st = 24;
    size_t ni, i, oi, pos;
    int li, nl;
    pqc_simd lv_[3];
    nl = levels(lv_);
    for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++) {
        size_t n = lens[ni];
        float *x = (float *)malloc(sizeof(float) * (n + 1));
        for (i = 0; i < n; i++) x[i] = rng_float(&st) * 1e15f;
        for (oi = 0; oi < sizeof odd / sizeof odd[0]; oi++)
            for (pos = 0; pos < n; pos += 1 + n / 7) {
                float keep = x[pos];
                int a;
                x[pos] = odd[oi];
                a = pqc__within(x, n, PQC__KEY_LIMIT);
                if (a != (fabsf(odd[oi]) <= PQC__KEY_LIMIT)) {
                    free(x);
                    FAILm("scalar range check misses a value");
                }
                for (li = 0; li < nl; li++)
                    if (pqc__k_within(lv_[li], x, n, PQC__KEY_LIMIT) != a || upper_dirty() == 1) {
                        snprintf(msg, sizeof msg, "within: %s differs or leaves the upper halves set (n %zu, value %g at %zu)", pqc_simd_name(lv_[li]), n,
                                 (double)odd[oi], pos);
                        free(x);
                        FAILm(msg);
                    }
                x[pos] = keep;
            }
        free(x);
    }
    PASS();
}

/* Exact softmax-sum scores (every head in one pass over the keys) equal the head-by-head
   combination of the scalar kernels, for fp32 (aligned and not), fp16 and bf16 keys */
TEST exact_heads_equal_head_by_head(void)
{
    const size_t n = 203, d = 40, odd = d * 4 + 2; /* odd: a row stride off float boundaries */
    const int g = 4;
    uint64_t st = 25;
    float *kf = (float *)malloc(sizeof(float) * n * d), q[4 * 40], *got = (float *)malloc(sizeof(float) * n);
    float *want = (float *)malloc(sizeof(float) * n), *hs = (float *)malloc(sizeof(float) * n);
    uint16_t *kh = (uint16_t *)malloc(sizeof(uint16_t) * n * d);
    unsigned char *kb = (unsigned char *)malloc(odd * n);
    pqc_simd lvs[4];
    int nl = 0, li, h, ki;
    size_t i;
    lvs[nl++] = PQC_SIMD_SCALAR;
    nl += levels(lvs + 1);
    for (i = 0; i < (size_t)g * d; i++) q[i] = rng_float(&st) * 3.0f;
    for (ki = 0; ki < 4; ki++) {
        pqc_matrix k;
        pqc_dtype t = ki < 2 ? PQC_F32 : ki == 2 ? PQC_F16 : PQC_BF16;
        memset(&k, 0, sizeof k);
        for (i = 0; i < n * d; i++) {
            float v = rng_float(&st) * 2.0f;
            kh[i] = t == PQC_F16 ? pqc_f32_to_f16(v) : pqc_f32_to_bf16(v);
            kf[i] = t == PQC_F16 ? pqc_f16_to_f32(kh[i]) : t == PQC_BF16 ? pqc_bf16_to_f32(kh[i]) : v;
        }
        for (i = 0; i < n; i++) memcpy(kb + i * odd, kf + i * d, d * sizeof(float));
        memset(want, 0, sizeof(float) * n);
        for (h = 0; h < g; h++) {
            float mx, z;
            pqc__rowdots_scalar(q + (size_t)h * d, kf, n, d, (int)d, hs);
            mx = pqc__max_scalar(hs, n);
            z = pqc__expsum_scalar(hs, n, mx, 1.0f / sqrtf((float)d), hs);
            pqc__axpy_scalar(hs, n, 1.0f / z, want);
        }
        k.data = ki == 0 ? (const void *)kf : ki == 1 ? (const void *)kb : (const void *)kh;
        k.row_stride = ki == 1 ? odd : 0;
        k.dtype = t;
        k.rows = n;
        k.cols = d;
        for (li = 0; li < nl; li++) {
            pqc_runtime_desc rd;
            pqc_runtime *rt = NULL;
            pqc_scratch scr;
            pqc_result r;
            memset(&rd, 0, sizeof rd);
            rd.n_threads = -1;
            rd.simd = lvs[li];
            ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&rd, &rt));
            memset(&scr, 0, sizeof scr);
            r = pqc_exact_scores(rt, &k, q, g, PQC_GQA_SOFTMAX_SUM, &scr, got);
            pqc_scratch_free(&scr);
            pqc_runtime_destroy(rt);
            ASSERT_EQ(PQC_SUCCESS, r);
            if (first_diff(want, got, n, sizeof(float)) >= 0) {
                snprintf(msg, sizeof msg, "exact softmax-sum (%s keys) at %s differs from head by head",
                         ki == 0 ? "fp32" : ki == 1 ? "fp32 odd stride" : ki == 2 ? "fp16" : "bf16", pqc_simd_name(lvs[li]));
                FAILm(msg);
            }
        }
    }
    free(kf);
    free(kh);
    free(kb);
    free(got);
    free(want);
    free(hs);
    PASS();
}

/* ----- top-k: the compaction pass, and the whole selection ------------------------- */

/* the level's compaction pass; 0 where the level has none (the scalar one runs) */
static int bracket_at(pqc_simd lv, const float *s, size_t n, float lo, float hi, size_t *na, float *cs, size_t *nc)
{
#if PQC__X86
    if (lv == PQC_SIMD_AVX512) {
        pqc__bracket_avx512(s, n, lo, hi, na, cs, nc);
        return 1;
    }
    if (lv == PQC_SIMD_AVX2) {
        pqc__bracket_avx2(s, n, lo, hi, na, cs, nc);
        return 1;
    }
#endif
#if PQC__NEON
    if (lv == PQC_SIMD_NEON) {
        pqc__bracket_neon(s, n, lo, hi, na, cs, nc);
        return 1;
    }
#endif
    (void)lv, (void)s, (void)n, (void)lo, (void)hi, (void)na, (void)cs, (void)nc;
    return 0;
}

/* the compaction pass, the take pass and the keys pass of each level against the scalar
   ones */
TEST bracket_bitwise(void)
{
    static const float bounds[][2] = {{-0.25f, 0.25f}, {0.0f, 0.0f}, {-INFINITY, 0.5f}, {0.5f, INFINITY},
                                      {-INFINITY, INFINITY}, {2.0f, 3.0f}, {-0.0f, 0.75f}};
    uint64_t st = 19;
    size_t ni, bi, i;
    int li, ran = 0;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++)
            for (bi = 0; bi < sizeof bounds / sizeof bounds[0]; bi++) {
                size_t n = lens[ni], na = 0, nc = 0, nb = 0, ncb = 0, ta = 0, tb = 0, need, w;
                float *s = (float *)malloc(sizeof(float) * (n + 1)), *cs = (float *)malloc(sizeof(float) * (n + 16));
                float *csb = (float *)malloc(sizeof(float) * (n + 16));
                float *va = (float *)malloc(sizeof(float) * (n + 1));
                uint32_t *ia = (uint32_t *)malloc(sizeof(uint32_t) * (n + 1));
                uint32_t *ib = (uint32_t *)malloc(sizeof(uint32_t) * (n + 1));
                uint32_t thr = pqc__fkey(bounds[bi][0] == -INFINITY ? bounds[bi][1] : bounds[bi][0]);
                int bad;
                for (i = 0; i < n; i++) s[i] = rng_float(&st); /* ties at the bounds: 0, -0, multiples of 1/4 */
                pqc__bracket_scalar(s, n, bounds[bi][0], bounds[bi][1], &na, cs, &nc);
                if (bracket_at(lv, s, n, bounds[bi][0], bounds[bi][1], &nb, csb, &ncb)) ran++;
                else {
                    nb = na;
                    ncb = nc;
                    memcpy(csb, cs, nc * sizeof *cs);
                }
                bad = na != nb || nc != ncb || first_diff(cs, csb, nc, sizeof *cs) >= 0;
                /* the take pass at a threshold of the bound's key, taking none, some and
                   every tie */
                for (w = 0; w < 3 && !bad; w++) {
                    size_t eqs = 0;
                    for (i = 0; i < n; i++) eqs += pqc__fkey(s[i]) == thr;
                    need = w == 0 ? 0 : w == 1 ? eqs / 2 : eqs;
                    uint32_t *ic;
                    float *vc;
                    ta = pqc__topk_take(PQC_SIMD_SCALAR, s, n, thr, need, n, ia, va);
                    /* the level's pass into buffers of exactly the entries it takes (the
                       sanitizer builds catch a store past them) */
                    ic = (uint32_t *)malloc(sizeof(uint32_t) * (ta ? ta : 1));
                    vc = (float *)malloc(sizeof(float) * (ta ? ta : 1));
                    tb = pqc__topk_take(lv, s, n, thr, need, ta, ic, vc);
                    bad = ta != tb || first_diff(ia, ic, ta, sizeof *ia) >= 0 ||
                          first_diff(va, vc, ta, sizeof *va) >= 0;
                    free(ic);
                    free(vc);
                }
                if (!bad && n > 0) { /* the keys, and their extremes, against pqc__fkey's */
                    uint32_t lo = 0xffffffffu, hi = 0, lob, hib;
                    for (i = 0; i < n; i++) {
                        ia[i] = pqc__fkey(s[i]);
                        lo = ia[i] < lo ? ia[i] : lo;
                        hi = ia[i] > hi ? ia[i] : hi;
                    }
                    pqc__topk_keys(lv, s, n, ib, &lob, &hib);
                    bad = lo != lob || hi != hib || first_diff(ia, ib, n, sizeof *ia) >= 0;
                }
                free(s);
                free(cs);
                free(csb);
                free(va);
                free(ia);
                free(ib);
                if (bad) {
                    snprintf(msg, sizeof msg, "%s: compaction, take or keys differ from scalar (n %zu, bounds %zu)",
                             pqc_simd_name(lv), n, bi);
                    FAILm(msg);
                }
            }
    }
    if (!ran) SKIPm("no level here has its own compaction pass");
    PASS();
}

/* the radix select's compaction at each level (pqc__topk_bin: the level's pass, then the
   scalar rest) against the scalar loop: keys of one digit moved to the front in place */
TEST topk_bin_bitwise(void)
{
    static const int shifts[] = {1, 3, 8, 11, 14, 21, 31};
    uint64_t st = 29;
    size_t ni, si, i;
    int li;
    NEED_LEVELS(lv_, nl);
    for (li = 0; li < nl; li++)
        for (ni = 0; ni < sizeof lens / sizeof lens[0]; ni++)
            for (si = 0; si < sizeof shifts / sizeof shifts[0]; si++) {
                size_t n = lens[ni], na = 0, nb;
                int shift = shifts[si];
                uint32_t *a = (uint32_t *)malloc(sizeof(uint32_t) * (n + 1));
                uint32_t *c = (uint32_t *)malloc(sizeof(uint32_t) * (n + 1));
                uint32_t base = (uint32_t)rng_next(&st), b = (uint32_t)(rng_next(&st) % 4), one = 1u << shift;
                int bad;
                for (i = 0; i < n; i++) /* digits 0-4, some keys just below base (wrapping) */
                    a[i] = base + (uint32_t)(rng_next(&st) % 5) * one + (uint32_t)(rng_next(&st) % one) -
                           (uint32_t)(i % 7 == 0);
                memcpy(c, a, n * sizeof *a);
                for (i = 0; i < n; i++)
                    if (((a[i] - base) >> shift) == b) a[na++] = a[i];
                nb = pqc__topk_bin(lv_[li], c, n, base, shift, b);
                bad = na != nb || first_diff(a, c, na, sizeof *a) >= 0;
                free(a);
                free(c);
                if (bad) {
                    snprintf(msg, sizeof msg, "%s: the digit's compaction differs from scalar (n %zu, shift %d)",
                             pqc_simd_name(lv_[li]), n, shift);
                    FAILm(msg);
                }
            }
    PASS();
}

/* pqc__topk_thresh at k = n (the select asks for it when it needs every score inside its
   bracket): the smallest key, and all of its ties */
TEST thresh_takes_everything(void)
{
    uint64_t st = 23;
    size_t n, i;
    for (n = 1; n <= 300; n += 13) {
        float *s = (float *)malloc(sizeof(float) * n);
        uint32_t *keys = (uint32_t *)malloc(sizeof(uint32_t) * n), mn = 0xffffffffu, thr;
        size_t ties = 0, need;
        for (i = 0; i < n; i++) s[i] = rng_float(&st);
        for (i = 0; i < n; i++) mn = pqc__fkey(s[i]) < mn ? pqc__fkey(s[i]) : mn;
        for (i = 0; i < n; i++) ties += pqc__fkey(s[i]) == mn;
        pqc__topk_thresh(PQC_SIMD_SCALAR, s, n, n, keys, &thr, &need);
        free(s);
        free(keys);
        ASSERT_EQ(mn, thr);
        ASSERT_EQ(ties, need);
    }
    PASS();
}

TEST select_bitwise(void)
{
    static const size_t ks[] = {1, 7, 100, 2000, 10000, 19999};
    const size_t n = 20000; /* past 4 * PQC__SAMPLE: the sampled bracket runs */
    uint64_t st = 20;
    size_t i, ki;
    int li, dist;
    float *s, *va, *vb;
    uint32_t *ia, *ib;
    void *scr;
    NEED_LEVELS(lv_, nl);
    s = (float *)malloc(sizeof(float) * n);
    va = (float *)malloc(sizeof(float) * n);
    vb = (float *)malloc(sizeof(float) * n);
    ia = (uint32_t *)malloc(sizeof(uint32_t) * n);
    ib = (uint32_t *)malloc(sizeof(uint32_t) * n);
    scr = malloc(pqc__select_scratch(n));
    for (li = 0; li < nl; li++) {
        pqc_simd lv = lv_[li];
        for (dist = 0; dist < 2; dist++) {
            for (i = 0; i < n; i++) s[i] = dist ? (float)(rng_next(&st) % 9u) : rng_float(&st);
            for (ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
                size_t k = ks[ki];
                pqc__select(PQC_SIMD_SCALAR, s, n, k, scr, ia, va);
                pqc__select(lv, s, n, k, scr, ib, vb);
                UPPER_CLEAN("select");
                if (first_diff(ia, ib, k, sizeof *ia) >= 0 || first_diff(va, vb, k, sizeof *va) >= 0) {
                    snprintf(msg, sizeof msg, "%s: top-k differs from scalar (k %zu, dist %d)", pqc_simd_name(lv), k, dist);
                    FAILm(msg);
                }
            }
        }
    }
    free(s);
    free(va);
    free(vb);
    free(ia);
    free(ib);
    free(scr);
    PASS();
}

SUITE(kernels)
{
    RUN_TEST(levels_offered);
    RUN_TEST(dots_bitwise);
    RUN_TEST(dots_heads_bitwise);
    RUN_TEST(assign_bitwise);
    RUN_TEST(seedmin_bitwise);
    RUN_TEST(sqnorms_bitwise);
    RUN_TEST(accum_bitwise);
    RUN_TEST(scan_bitwise);
    RUN_TEST(max_bitwise);
    RUN_TEST(expsum_bitwise);
    RUN_TEST(expsum_halfway_bitwise);
    RUN_TEST(axpy_bitwise);
    RUN_TEST(scan_heads_bitwise);
    RUN_TEST(lanesum_is_expsums_order);
    RUN_TEST(scan_products_bitwise);
    RUN_TEST(combine_bitwise);
    RUN_TEST(rowdots_bitwise);
    RUN_TEST(halfrow_bitwise);
    RUN_TEST(narrow_bitwise);
    RUN_TEST(within_bitwise);
    RUN_TEST(keydots_bitwise);
    RUN_TEST(gatherdots_bitwise);
    RUN_TEST(exact_heads_equal_head_by_head);
    RUN_TEST(bracket_bitwise);
    RUN_TEST(topk_bin_bitwise);
    RUN_TEST(thresh_takes_everything);
    RUN_TEST(select_bitwise);
}

#ifndef PQC_TEST_UNITY /* tests/test_lib.c holds every suite in one program */
GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(kernels);
    GREATEST_MAIN_END();
}
#endif
