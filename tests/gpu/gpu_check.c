/* gpu_check.c - runs every kernel of pqcache_kernels.cu on an NVIDIA GPU against plain
 * CPU reference implementations, then times the decode-step selection (LUT + scan +
 * top-k), the K/V gather, the k-means assignment step (its kernel against the
 * cuBLASLt GEMM path, as the library measures them) and the lookup tables of a batch
 * of sequences (the table kernel against one pointer-array cuBLASLt matmul, likewise). Needs an NVIDIA GPU and driver;
 * everything else (NVRTC, cuBLASLt) is dlopen'ed through pqcache.h.
 *
 * Build:  cc -std=c99 -O2 -o build/gpu_check tests/gpu/gpu_check.c -lm -ldl
 * Run:    tests/gpu/check.sh   (builds, runs, prints the summary table)
 *
 * usage: gpu_check [-v] [--quick] [--no-bench] [--no-blaslt] [--cache DIR] [--seed N]
 *   --quick      smaller problem sizes (a fast smoke run)
 *   --no-bench   correctness checks only
 *   --no-blaslt  skip the cuBLASLt sanity check
 *   --cache DIR  compiled-kernel cache directory ("-" disables it)
 * Exit status: 0 all passed, 1 a check failed, 2 no usable GPU (the message says why).
 * Last line: "N passed, N failed".
 *
 * Comparison rules: indices and codes must be exactly equal; float results must agree
 * within 1e-4 relative (the table build and the raw scores are also reported as
 * bit-exact or not, since both sides use the same sequential fmaf / add order).
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <time.h>
#include <errno.h>
#include <sys/stat.h>
#include <sys/types.h>

#define PQCACHE_IMPLEMENTATION
#include "../../pqcache.h"

typedef unsigned long long dptr;

/* ------------------------------------------------------------------------------------ */
/* Globals, options, reporting                                                          */
/* ------------------------------------------------------------------------------------ */

static pqc__cuApi A;
static pqc__cuDev D;
static pqc__cuStream S;
static int g_verbose, g_quick, g_bench = 1, g_blaslt = 1;
static const char *g_cache = "build/kernel-cache";
static uint64_t g_seed = 12345;
static int g_passed, g_failed;

enum {
    K_LUT, K_STATS, K_FINAL, K_SCAN, K_PASS, K_COUNT, K_COMPACT, K_GATHER, K_FILL,
    K_NORMS, K_ASSIGN, K_KM_ASSIGN, K_KM_UPDATE, K_KM_DOTS, K_LUT_SUM, K_N
};
static const char *const knames[K_N] = {
    "pqc_lut_build", "pqc_scan_stats", "pqc_softmax_finalize", "pqc_scan",
    "pqc_topk_pass", "pqc_topk_count", "pqc_topk_compact", "pqc_gather_kv",
    "pqc_cache_fill", "pqc_centroid_norms", "pqc_assign_codes", "pqc_kmeans_assign",
    "pqc_kmeans_update", "pqc_kmeans_assign_dots", "pqc_lut_sum"
};
static pqc__cuFunction F[K_N];

#define SCAN_RAW 0
#define SCAN_SOFTMAX_SUM 1
#define RADIX_BINS 2048
#define TOPK_TILE 4096

static void summary_line(void) { printf("%d passed, %d failed\n", g_passed, g_failed); }

static void fatal(const char *what)
{
    printf("FAIL fatal: %s\n", what);
    ++g_failed;
    summary_line();
    exit(1);
}

#define CU(call)                                                              \
    do {                                                                      \
        pqc__cuResult r_ = (call);                                            \
        if (r_ != 0) {                                                        \
            pqc__cu_check(&A, r_, #call);                                     \
            fatal(A.msg);                                                     \
        }                                                                     \
    } while (0)

/* one check = one pass/fail line */
static int report(int ok, const char *name, const char *detail)
{
    if (ok) {
        ++g_passed;
        if (g_verbose) printf("ok   %s%s%s\n", name, detail[0] ? ": " : "", detail);
    } else {
        ++g_failed;
        printf("FAIL %s: %s\n", name, detail);
    }
    fflush(stdout);
    return ok;
}

/* ------------------------------------------------------------------------------------ */
/* Random numbers                                                                       */
/* ------------------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_unit(uint64_t *s) { return (float)((rng_next(s) >> 40) * (1.0 / 16777216.0)); }
static float rng_gauss(uint64_t *s)
{
    float u = rng_unit(s) + 1e-7f, v = rng_unit(s);
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}
static uint32_t rng_below(uint64_t *s, uint32_t n) { return (uint32_t)(rng_next(s) % n); }

/* ------------------------------------------------------------------------------------ */
/* Device memory and launches                                                           */
/* ------------------------------------------------------------------------------------ */

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) fatal("out of host memory");
    return p;
}

static dptr dalloc(size_t n)
{
    dptr p = 0;
    CU(A.cuMemAlloc_v2(&p, n ? n : 1));
    return p;
}
static void dfree(dptr p)
{
    if (p) CU(A.cuMemFree_v2(p));
}
static void up(dptr d, const void *h, size_t n)
{
    if (n) CU(A.cuMemcpyHtoD_v2(d, h, n));
}
static void down(void *h, dptr d, size_t n)
{
    CU(A.cuStreamSynchronize(S));
    if (n) CU(A.cuMemcpyDtoH_v2(h, d, n));
}
static void dzero(dptr d, size_t n)
{
    CU(A.cuMemsetD8Async(d, 0, n, S));
}
static dptr dupload(const void *h, size_t n)
{
    dptr d = dalloc(n);
    up(d, h, n);
    return d;
}
static void launch(int k, unsigned gx, unsigned gy, unsigned smem, void **params)
{
    if (gx == 0 || gy == 0) return;
    CU(A.cuLaunchKernel(F[k], gx, gy, 1, 256, 1, 1, smem, S, params, NULL));
}

/* Host memory that kernels read directly (pinned + mapped). */
typedef struct { void *h; dptr d; } mapped_t;
static mapped_t mapped_alloc(size_t n)
{
    mapped_t m;
    CU(A.cuMemHostAlloc(&m.h, n ? n : 1,
                        PQC__CU_MEMHOSTALLOC_DEVICEMAP | PQC__CU_MEMHOSTALLOC_PORTABLE));
    CU(A.cuMemHostGetDevicePointer_v2(&m.d, m.h, 0));
    return m;
}
static void mapped_free(mapped_t m) { CU(A.cuMemFreeHost(m.h)); }

static unsigned cdiv(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

/* Blocks of a grid-stride kernel: enough to fill the GPU, at most one per 256 tokens. */
static unsigned stride_grid(int s, int n_kv)
{
    long long want = (4LL * (D.sm_count > 0 ? D.sm_count : 1) + n_kv - 1) / n_kv;
    long long most = (s + 255) / 256;
    if (want < 1) want = 1;
    if (most < 1) most = 1;
    return (unsigned)(want < most ? want : most);
}

/* ------------------------------------------------------------------------------------ */
/* Kernel launch wrappers (the parameter lists of pqcache_kernels.cu)                   */
/* ------------------------------------------------------------------------------------ */

static void k_lut_build(int n_kv, dptr q, long long q_hs, dptr cent, long long c_hs, int g,
                        int m, int K, int d_sub, dptr lut, long long l_hs, dptr lut_sum,
                        long long ls_hs)
{
    int half = 0; /* contiguous sub-spaces (the band layout is checked by the library's tests) */
    void *p[] = { &q, &q_hs, &cent, &c_hs, &g, &m, &K, &d_sub, &half, &lut, &l_hs, &lut_sum, &ls_hs };
    launch(K_LUT, cdiv((long long)m * K, 256), (unsigned)n_kv, 0, p);
}

static unsigned scan_smem(int n_luts, int m, int b, int *use_smem, int force_global)
{
    long long bytes = (long long)n_luts * m * (1 << b) * 4;
    long long limit = D.smem_optin - 8192 > 49152 ? D.smem_optin - 8192 : 49152;
    *use_smem = !force_global && bytes <= limit;
    return *use_smem ? (unsigned)bytes : 0u;
}

static void k_scan_stats(int n_kv, unsigned P, dptr codes, long long code_hs,
                         long long col_stride, int s, int m, int b, dptr lut, long long l_hs,
                         int n_luts, float scale, dptr partial, long long p_hs,
                         int force_global)
{
    int use_smem;
    unsigned smem = scan_smem(n_luts, m, b, &use_smem, force_global);
    void *p[] = { &codes, &code_hs, &col_stride, &s, &m, &b, &lut, &l_hs, &n_luts, &scale,
                  &partial, &p_hs, &use_smem };
    launch(K_STATS, P, (unsigned)n_kv, smem, p);
}

static void k_softmax_finalize(int n_kv, dptr partial, long long p_hs, int n_parts, int n_luts,
                               float scale, dptr stats, long long st_hs)
{
    void *p[] = { &partial, &p_hs, &n_parts, &n_luts, &scale, &stats, &st_hs };
    launch(K_FINAL, 1, (unsigned)n_kv, 0, p);
}

static void k_scan(int n_kv, unsigned P, dptr codes, long long code_hs, long long col_stride,
                   int s, int m, int b, dptr lut, long long l_hs, int n_luts, int mode,
                   dptr stats, long long st_hs, float scale, dptr out, long long o_hs,
                   int force_global)
{
    int use_smem;
    unsigned smem = scan_smem(n_luts, m, b, &use_smem, force_global);
    void *p[] = { &codes, &code_hs, &col_stride, &s, &m, &b, &lut, &l_hs, &n_luts, &mode,
                  &stats, &st_hs, &scale, &out, &o_hs, &use_smem };
    launch(K_SCAN, P, (unsigned)n_kv, smem, p);
}

/* top-k of scores [n_kv][s] (head stride sc_hs): idx [n_kv][k] (head stride idx_hs) */
typedef struct { dptr hist, state, counts; long long counts_hs; } topk_ws;

static topk_ws topk_ws_alloc(int n_kv, int s_max)
{
    topk_ws w;
    long long tiles = (s_max + TOPK_TILE - 1) / TOPK_TILE;
    w.hist = dalloc((size_t)n_kv * RADIX_BINS * 4);
    w.state = dalloc((size_t)n_kv * 16);
    w.counts_hs = 2 * (tiles > 0 ? tiles : 1);
    w.counts = dalloc((size_t)n_kv * (size_t)w.counts_hs * 4);
    dzero(w.hist, (size_t)n_kv * RADIX_BINS * 4);
    dzero(w.state, (size_t)n_kv * 16);
    return w;
}
static void topk_ws_free(topk_ws *w)
{
    dfree(w->hist);
    dfree(w->state);
    dfree(w->counts);
}

static void k_topk(int n_kv, const topk_ws *w, dptr scores, long long sc_hs, int s, int k,
                   dptr idx, long long idx_hs, dptr oscores, long long os_hs)
{
    int pass;
    unsigned P = stride_grid(s, n_kv);
    unsigned tiles = cdiv(s, TOPK_TILE);
    dptr hist = w->hist, state = w->state, counts = w->counts, no_k_head = 0;
    long long c_hs = w->counts_hs;
    for (pass = 0; pass < 3; ++pass) {
        void *p[] = { &scores, &sc_hs, &s, &k, &pass, &hist, &state, &no_k_head };
        launch(K_PASS, P, (unsigned)n_kv, 0, p);
    }
    {
        void *p[] = { &scores, &sc_hs, &s, &k, &state, &counts, &c_hs, &no_k_head };
        launch(K_COUNT, tiles, (unsigned)n_kv, 0, p);
    }
    {
        void *p[] = { &scores, &sc_hs, &s, &k, &state, &counts, &c_hs, &idx, &idx_hs,
                      &oscores, &os_hs, &no_k_head };
        launch(K_COMPACT, tiles, (unsigned)n_kv, 0, p);
    }
}

static void k_gather(int n_kv, dptr idx, long long idx_hs, int n, dptr slots, long long sl_hs,
                     int block_tokens, dptr cache_k, dptr cache_v, long long c_hs, int c_dt,
                     dptr host_k, dptr host_v, long long h_hs, long long host_ld, int h_dt,
                     int d_h, dptr out_k, dptr out_v, long long o_hs, dptr miss)
{
    dptr pre = 0; /* no shared prefix */
    long long pre_hs = 0, split = 0;
    void *p[] = { &idx, &idx_hs, &n, &slots, &sl_hs, &block_tokens, &cache_k, &cache_v, &c_hs,
                  &c_dt, &host_k, &host_v, &h_hs, &pre, &pre, &pre_hs, &split, &host_ld, &h_dt, &d_h,
                  &out_k, &out_v, &o_hs, &miss };
    launch(K_GATHER, cdiv(n, 8), (unsigned)n_kv, 0, p);
}

static void k_cache_fill(int n_kv, dptr blocks, dptr slots, long long list_hs, int n_blocks,
                         int block_tokens, int s, dptr host_k, dptr host_v, long long h_hs,
                         long long host_ld, int dt, int d_h, dptr cache_k, dptr cache_v,
                         long long c_hs)
{
    int row_lo = 0;
    dptr pre = 0; /* no shared prefix */
    long long pre_hs = 0, split = 0;
    void *p[] = { &blocks, &slots, &list_hs, &n_blocks, &block_tokens, &row_lo, &s, &host_k, &host_v,
                  &h_hs, &pre, &pre, &pre_hs, &split, &host_ld, &dt, &d_h, &cache_k, &cache_v, &c_hs };
    launch(K_FILL, cdiv((long long)n_blocks * block_tokens, 8), (unsigned)n_kv, 0, p);
}

static void k_norms(dptr c, int rows, int d, dptr out)
{
    void *p[] = { &c, &rows, &d, &out };
    launch(K_NORMS, cdiv(rows, 256), 1, 0, p);
}

static void k_assign(int n_kv, dptr x, int x_dt, long long x_ld, long long x_hs, int n,
                     dptr cent, dptr cnorm, long long c_hs, long long cn_hs, dptr metric,
                     long long w_hs, int m, int b, int d_sub, int half, dptr codes, long long code_hs,
                     long long col_stride, int t_start, dptr codes_out, long long co_hs)
{
    void *p[] = { &x, &x_dt, &x_ld, &x_hs, &n, &cent, &cnorm, &c_hs, &cn_hs, &metric, &w_hs,
                  &m, &b, &d_sub, &half, &codes, &code_hs, &col_stride, &t_start, &codes_out, &co_hs };
    launch(K_ASSIGN, cdiv((long long)n * m, 8), (unsigned)n_kv, 0, p);
}

static void k_km_assign(int n_sub, dptr x, long long ld, int n, int d, dptr cent, dptr cnorm,
                        int K, dptr assign, dptr sums, dptr counts, dptr min_dist)
{
    void *p[] = { &x, &ld, &n, &d, &cent, &cnorm, &K, &assign, &sums, &counts, &min_dist };
    launch(K_KM_ASSIGN, cdiv(n, 8), (unsigned)n_sub, 0, p);
}

static void k_km_dots(dptr dots, dptr x, long long ld, int n, int d, dptr cnorm, int K, dptr assign,
                      dptr sums, dptr counts, dptr min_dist)
{
    void *p[] = { &dots, &x, &ld, &n, &d, &cnorm, &K, &assign, &sums, &counts, &min_dist };
    launch(K_KM_DOTS, cdiv(n, 8), 1, 0, p);
}

static void k_km_update(dptr cent, dptr sums, dptr counts, int rows, int d)
{
    void *p[] = { &cent, &sums, &counts, &rows, &d };
    launch(K_KM_UPDATE, cdiv((long long)rows * d, 256), 1, 0, p);
}

/* ------------------------------------------------------------------------------------ */
/* CPU references                                                                       */
/* ------------------------------------------------------------------------------------ */

/* order-preserving key; -0 and +0 are the same score */
static uint32_t float_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u << 1) == 0) u = 0;
    return (u & 0x80000000u) ? ~u : (u ^ 0x80000000u);
}
static uint32_t fbits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float ref_f16(uint16_t h)
{
    int sgn = h >> 15, e = (h >> 10) & 31, man = h & 1023;
    float v;
    if (e == 0) v = ldexpf((float)man, -24);
    else if (e == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 1024), e - 25);
    return sgn ? -v : v;
}
static float ref_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float ref_elem(const void *base, long long i, int dt)
{
    if (dt == 0) return ((const float *)base)[i];
    return dt == 1 ? ref_f16(((const uint16_t *)base)[i]) : ref_bf16(((const uint16_t *)base)[i]);
}
/* float -> bf16 / fp16 bits by truncation (test data only) */
static uint16_t to_bf16(float f) { return (uint16_t)(fbits(f) >> 16); }
static uint16_t to_f16(float f)
{
    uint32_t u = fbits(f), sgn = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = (u >> 13) & 0x3ffu;
    if (e >= 31) return (uint16_t)(sgn | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sgn;
        return (uint16_t)(sgn | ((man | 0x400u) >> (1 - e)));
    }
    return (uint16_t)(sgn | ((uint32_t)e << 10) | man);
}

static void pack_code(uint8_t *col, long long t, int b, uint32_t code)
{
    long long bit = t * b;
    int i;
    for (i = 0; i < b; ++i, ++bit)
        if (code >> i & 1u) col[bit >> 3] |= (uint8_t)(1u << (bit & 7));
}
static uint32_t unpack_code(const uint8_t *col, long long t, int b)
{
    long long bit = t * b;
    uint32_t c = 0;
    int i;
    for (i = 0; i < b; ++i, ++bit) c |= (uint32_t)(col[bit >> 3] >> (bit & 7) & 1u) << i;
    return c;
}

/* LUT[h][j][c] = sequential fmaf over e */
static void ref_lut(const float *q, const float *cent, int g, int m, int K, int d_sub, float *lut)
{
    int h, j, c, e, d_h = m * d_sub;
    for (h = 0; h < g; ++h)
        for (j = 0; j < m; ++j)
            for (c = 0; c < K; ++c) {
                float acc = 0.0f;
                for (e = 0; e < d_sub; ++e)
                    acc = fmaf(q[h * d_h + j * d_sub + e], cent[((long long)j * K + c) * d_sub + e], acc);
                lut[((long long)h * m + j) * K + c] = acc;
            }
}
static void ref_scores(const uint8_t *codes, long long col_stride, int s, int m, int b,
                       const float *lut, float *out)
{
    int K = 1 << b, t, j;
    for (t = 0; t < s; ++t) {
        float acc = 0.0f;
        for (j = 0; j < m; ++j) acc += lut[j * K + unpack_code(codes + j * col_stride, t, b)];
        out[t] = acc;
    }
}
/* exp(x), x <= 0, the library's way: clamp at -87.3, reduction by ln 2 in two parts,
   degree-5 polynomial with fused operations */
static float ref_exp(float x)
{
    float n, r, z, y, p2;
    uint32_t u;
    if (!(x > -87.3f)) x = -87.3f;
    n = nearbyintf(x * 1.44269504088896341f);
    r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    z = r * r;
    y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    y = fmaf(y, z, r);
    y = y + 1.0f;
    u = (uint32_t)((int)n + 127) << 23;
    memcpy(&p2, &u, 4);
    return y * p2;
}

/* softmax over tokens per head, summed over heads, in the CPU library's order: Z over 16
   interleaved lanes (lane t % 16) added in order, out = fma(e, 1/Z, out) over heads */
static void ref_softmax_sum(const float *scores /* [g][s] */, int g, int s, float scale,
                            float *out, double *maxz /* [g][2] */)
{
    int h, t, l;
    for (t = 0; t < s; ++t) out[t] = 0.0f;
    for (h = 0; h < g; ++h) {
        const float *x = scores + (long long)h * s;
        float mx = -INFINITY, z = 0.0f, lanes[16] = { 0 }, w;
        for (t = 0; t < s; ++t) if (x[t] > mx) mx = x[t];
        for (t = 0; t < s; ++t) lanes[t & 15] += ref_exp((x[t] - mx) * scale);
        for (l = 0; l < 16; ++l) z += lanes[l];
        w = 1.0f / z;
        for (t = 0; t < s; ++t) out[t] = fmaf(ref_exp((x[t] - mx) * scale), w, out[t]);
        maxz[2 * h] = mx;
        maxz[2 * h + 1] = z;
    }
}

typedef struct { uint32_t key; int idx; } keyidx;
static int cmp_keyidx(const void *a, const void *b)
{
    const keyidx *x = (const keyidx *)a, *y = (const keyidx *)b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}
static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return x < y ? -1 : (x > y);
}
/* the k largest (ties to the lower index), listed in ascending index; returns min(k,s) */
static int ref_topk(const float *sc, int s, int k, int *out)
{
    keyidx *v = (keyidx *)xmalloc((size_t)s * sizeof(keyidx));
    int t, n = k < s ? k : s;
    if (n < 0) n = 0;
    for (t = 0; t < s; ++t) {
        v[t].key = float_key(sc[t]);
        v[t].idx = t;
    }
    qsort(v, (size_t)s, sizeof(keyidx), cmp_keyidx);
    for (t = 0; t < n; ++t) out[t] = v[t].idx;
    qsort(out, (size_t)n, sizeof(int), cmp_int);
    free(v);
    return n;
}

/* nearest centroid: ||c||^2 - 2 x.c, sequential fmaf, ties to the lower index */
/* nearest centroid by ||c||^2 - 2 x.c; with w (d weights, or NULL) by the weighted
   distance: x scaled by w and the weighted norms sum (w c) c */
static int ref_nearest_w(const float *x, const float *cent, int K, int d, const float *w, float *best_out)
{
    int c, e, bi = 0;
    float best = INFINITY;
    for (c = 0; c < K; ++c) {
        float dot = 0.0f, nrm = 0.0f, dist;
        for (e = 0; e < d; ++e) {
            float ce = cent[(long long)c * d + e];
            dot = fmaf(w ? x[e] * w[e] : x[e], ce, dot);
            nrm = fmaf(w ? w[e] * ce : ce, ce, nrm);
        }
        dist = nrm - 2.0f * dot;
        if (c == 0 || dist < best) {
            best = dist;
            bi = c;
        }
    }
    if (best_out) *best_out = best;
    return bi;
}

static int ref_nearest(const float *x, const float *cent, int K, int d, float *best_out)
{
    return ref_nearest_w(x, cent, K, d, NULL, best_out);
}

/* |a - b| <= tol * |b| (+ a tiny absolute floor); NaN only matches NaN */
static int close_rel(double a, double b, double tol)
{
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    if (isinf(a) || isinf(b)) return a == b;
    return fabs(a - b) <= tol * fabs(b) + 1e-30;
}

/* ------------------------------------------------------------------------------------ */
/* Checks: lookup tables, scan, GQA modes, selection                                    */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    int n_kv, g, m, b, d_sub, s, k;
    int codes_kind;   /* 0 random, 1 all tokens one code (full ties), 2 periodic */
    int force_global; /* LUT read from global memory instead of shared */
} scan_case;

static void check_scan_case(const scan_case *c)
{
    char name[160], msg[512];
    uint64_t rs = g_seed ^ (uint64_t)(c->s * 131 + c->m * 7 + c->b + c->g * 1000);
    int n_kv = c->n_kv, g = c->g, m = c->m, b = c->b, d_sub = c->d_sub, s = c->s;
    int K = 1 << b, d_h = m * d_sub, kv, h, t, j, mode;
    int k = c->k;
    float scale = 1.0f / sqrtf((float)d_h);
    long long col_stride = ((long long)s * b + 7) / 8 + 16;
    long long code_hs = col_stride * m;
    long long lut_hs = (long long)g * m * K;
    size_t ncodes = (size_t)(code_hs * n_kv);
    float *q = (float *)xmalloc(sizeof(float) * (size_t)n_kv * g * d_h);
    float *cent = (float *)xmalloc(sizeof(float) * (size_t)n_kv * m * K * d_sub);
    uint8_t *codes = (uint8_t *)xmalloc(ncodes);
    float *lut_ref = (float *)xmalloc(sizeof(float) * (size_t)(lut_hs * n_kv));
    float *lsum_ref = (float *)xmalloc(sizeof(float) * (size_t)n_kv * m * K);
    float *lut_gpu = (float *)xmalloc(sizeof(float) * (size_t)(lut_hs * n_kv));
    float *lsum_gpu = (float *)xmalloc(sizeof(float) * (size_t)n_kv * m * K);
    float *raw_ref = (float *)xmalloc(sizeof(float) * (size_t)n_kv * g * s);
    float *raw_gpu = (float *)xmalloc(sizeof(float) * (size_t)n_kv * g * s);
    float *sum_ref = (float *)xmalloc(sizeof(float) * (size_t)n_kv * s);
    float *comb_gpu = (float *)xmalloc(sizeof(float) * (size_t)n_kv * s);
    float *soft_ref = (float *)xmalloc(sizeof(float) * (size_t)s);
    double *maxz = (double *)xmalloc(sizeof(double) * 2 * (size_t)g);
    float *stats_gpu = (float *)xmalloc(sizeof(float) * 2 * (size_t)g * n_kv);
    int *idx_ref = (int *)xmalloc(sizeof(int) * (size_t)(s + 1));
    int *idx_gpu = (int *)xmalloc(sizeof(int) * (size_t)n_kv * (s + 1));
    float *osc_gpu = (float *)xmalloc(sizeof(float) * (size_t)n_kv * (s + 1));
    dptr d_q, d_cent, d_codes, d_lut, d_lsum, d_raw, d_comb, d_part, d_stats, d_idx, d_osc;
    unsigned P = stride_grid(s, n_kv);
    topk_ws ws;
    long long ksel = k < s ? k : s;

    snprintf(name, sizeof(name), "scan n_kv=%d g=%d m=%d b=%d d_sub=%d s=%d k=%d codes=%s%s",
             n_kv, g, m, b, d_sub, s, k,
             c->codes_kind == 0 ? "random" : c->codes_kind == 1 ? "constant" : "periodic",
             c->force_global ? " lut=global" : "");

    for (t = 0; t < n_kv * g * d_h; ++t) q[t] = rng_gauss(&rs);
    for (t = 0; t < n_kv * m * K * d_sub; ++t) cent[t] = rng_gauss(&rs) * 0.5f;
    memset(codes, 0, ncodes);
    for (kv = 0; kv < n_kv; ++kv)
        for (j = 0; j < m; ++j)
            for (t = 0; t < s; ++t) {
                uint32_t code = c->codes_kind == 0 ? rng_below(&rs, (uint32_t)K)
                              : c->codes_kind == 1 ? (uint32_t)(kv + j) % (uint32_t)K
                                                   : (uint32_t)((t / 3 + j) % K);
                pack_code(codes + kv * code_hs + j * col_stride, t, b, code);
            }

    /* references */
    for (kv = 0; kv < n_kv; ++kv) {
        float *L = lut_ref + kv * lut_hs;
        ref_lut(q + (long long)kv * g * d_h, cent + (long long)kv * m * K * d_sub, g, m, K,
                d_sub, L);
        for (t = 0; t < m * K; ++t) {
            float acc = 0.0f;
            for (h = 0; h < g; ++h) acc += L[(long long)h * m * K + t];
            lsum_ref[(long long)kv * m * K + t] = acc;
        }
        for (h = 0; h < g; ++h)
            ref_scores(codes + kv * code_hs, col_stride, s, m, b, L + (long long)h * m * K,
                       raw_ref + ((long long)kv * g + h) * s);
        ref_scores(codes + kv * code_hs, col_stride, s, m, b, lsum_ref + (long long)kv * m * K,
                   sum_ref + (long long)kv * s);
    }

    d_q = dupload(q, sizeof(float) * (size_t)n_kv * g * d_h);
    d_cent = dupload(cent, sizeof(float) * (size_t)n_kv * m * K * d_sub);
    d_codes = dupload(codes, ncodes);
    d_lut = dalloc(sizeof(float) * (size_t)(lut_hs * n_kv));
    d_lsum = dalloc(sizeof(float) * (size_t)n_kv * m * K);
    d_raw = dalloc(sizeof(float) * (size_t)n_kv * g * s);
    d_comb = dalloc(sizeof(float) * (size_t)n_kv * s);
    d_part = dalloc(sizeof(float) * 2 * (size_t)g * P * n_kv);
    d_stats = dalloc(sizeof(float) * 2 * (size_t)g * n_kv);
    d_idx = dalloc(sizeof(int) * (size_t)n_kv * (s + 1));
    d_osc = dalloc(sizeof(float) * (size_t)n_kv * (s + 1));
    ws = topk_ws_alloc(n_kv, s);

    /* (a) tables */
    k_lut_build(n_kv, d_q, (long long)g * d_h, d_cent, (long long)m * K * d_sub, g, m, K, d_sub,
                d_lut, lut_hs, d_lsum, (long long)m * K);
    down(lut_gpu, d_lut, sizeof(float) * (size_t)(lut_hs * n_kv));
    down(lsum_gpu, d_lsum, sizeof(float) * (size_t)n_kv * m * K);
    {
        long long i, n = lut_hs * n_kv, bad = -1, diff = 0;
        for (i = 0; i < n; ++i) {
            if (fbits(lut_gpu[i]) != fbits(lut_ref[i])) ++diff;
            if (bad < 0 && !close_rel(lut_gpu[i], lut_ref[i], 1e-4)) bad = i;
        }
        for (i = 0; i < (long long)n_kv * m * K && bad < 0; ++i)
            if (!close_rel(lsum_gpu[i], lsum_ref[i], 1e-4)) bad = n + i;
        if (bad >= 0)
            snprintf(msg, sizeof(msg), "table entry %lld differs", bad);
        else
            snprintf(msg, sizeof(msg), "%s", diff ? "within 1e-4 (not bit-exact)" : "bit-exact");
        if (diff && bad < 0) printf("note %s: LUT %lld entries not bit-exact\n", name, diff);
        report(bad < 0, name, msg);
    }

    /* (b) raw scores of every query head */
    k_scan(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lut, lut_hs, g, SCAN_RAW, 0, 0,
           scale, d_raw, (long long)g * s, c->force_global);
    down(raw_gpu, d_raw, sizeof(float) * (size_t)n_kv * g * s);
    {
        long long i, n = (long long)n_kv * g * s, bad = -1, diff = 0;
        for (i = 0; i < n; ++i) {
            if (fbits(raw_gpu[i]) != fbits(raw_ref[i])) ++diff;
            if (bad < 0 && !close_rel(raw_gpu[i], raw_ref[i], 1e-4)) bad = i;
        }
        if (bad >= 0)
            snprintf(msg, sizeof(msg), "raw score %lld: gpu %.9g cpu %.9g", bad, raw_gpu[bad],
                     raw_ref[bad]);
        else
            snprintf(msg, sizeof(msg), "raw scores %s", diff ? "within 1e-4" : "bit-exact");
        report(bad < 0, name, msg);
    }

    for (mode = 0; mode < 2; ++mode) {
        const char *mname = mode == 0 ? "SUM" : "SOFTMAX_SUM";
        if (mode == 0) {
            k_scan(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lsum, (long long)m * K, 1,
                   SCAN_RAW, 0, 0, scale, d_comb, s, c->force_global);
        } else {
            k_scan_stats(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lut, lut_hs, g, scale,
                         d_part, 2LL * g * P, c->force_global);
            k_softmax_finalize(n_kv, d_part, 2LL * g * P, (int)P, g, scale, d_stats, 2LL * g);
            k_scan(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lut, lut_hs, g,
                   SCAN_SOFTMAX_SUM, d_stats, 2LL * g, scale, d_comb, s, c->force_global);
        }
        /* sentinel fill to see that exactly min(k, s) entries are written */
        CU(A.cuMemsetD32Async(d_idx, 0xdeadbeefu, (size_t)n_kv * (s + 1), S));
        k_topk(n_kv, &ws, d_comb, s, s, k, d_idx, s + 1, d_osc, s + 1);
        down(comb_gpu, d_comb, sizeof(float) * (size_t)n_kv * s);
        down(idx_gpu, d_idx, sizeof(int) * (size_t)n_kv * (s + 1));
        down(osc_gpu, d_osc, sizeof(float) * (size_t)n_kv * (s + 1));
        if (mode == 1) down(stats_gpu, d_stats, sizeof(float) * 2 * (size_t)g * n_kv);

        for (kv = 0; kv < n_kv; ++kv) {
            char nm[260];
            const float *cg = comb_gpu + (long long)kv * s;
            const int *ig = idx_gpu + (long long)kv * (s + 1);
            const float *og = osc_gpu + (long long)kv * (s + 1);
            int ok = 1, n, i, n_exact = 0;
            snprintf(nm, sizeof(nm), "%s %s kv=%d", name, mname, kv);
            msg[0] = '\0';
            if (mode == 0) {
                for (t = 0; t < s && ok; ++t)
                    if (!close_rel(cg[t], sum_ref[(long long)kv * s + t], 1e-4)) {
                        ok = 0;
                        snprintf(msg, sizeof(msg), "combined score %d: gpu %.9g cpu %.9g", t,
                                 cg[t], sum_ref[(long long)kv * s + t]);
                    }
                /* SUM scores are expected bit-exact: compare selections on CPU scores */
                n = ref_topk(sum_ref + (long long)kv * s, s, k, idx_ref);
            } else {
                ref_softmax_sum(raw_ref + (long long)kv * g * s, g, s, scale, soft_ref, maxz);
                for (h = 0; h < g && ok; ++h) {
                    float gm = stats_gpu[(kv * g + h) * 2], gz = stats_gpu[(kv * g + h) * 2 + 1];
                    if (gm != maxz[2 * h] || !close_rel(gz, maxz[2 * h + 1], 1e-5)) {
                        ok = 0;
                        snprintf(msg, sizeof(msg), "head %d: max/Z gpu %.9g/%.9g cpu %.9g/%.9g",
                                 h, gm, gz, maxz[2 * h], maxz[2 * h + 1]);
                    }
                }
                for (t = 0; t < s && ok; ++t) {
                    if (!close_rel(cg[t], soft_ref[t], 1e-4)) {
                        ok = 0;
                        snprintf(msg, sizeof(msg), "combined prob %d: gpu %.9g cpu %.9g", t,
                                 cg[t], soft_ref[t]);
                    }
                    n_exact += fbits(cg[t]) == fbits(soft_ref[t]);
                }
                /* softmax probabilities are not bit-exact: select on the GPU's scores */
                n = ref_topk(cg, s, k, idx_ref);
                /* and against the CPU probabilities: agreement up to near-ties */
                if (ok) {
                    int *alt = (int *)xmalloc(sizeof(int) * (size_t)(s + 1));
                    int na, ia = 0, ib = 0, common = 0;
                    na = ref_topk(soft_ref, s, k, alt);
                    while (ia < na && ib < n) {
                        if (alt[ia] == idx_ref[ib]) { ++common; ++ia; ++ib; }
                        else if (alt[ia] < idx_ref[ib]) ++ia;
                        else ++ib;
                    }
                    if (n > 0 && common < n - (n / 1000 + 2)) {
                        ok = 0;
                        snprintf(msg, sizeof(msg), "selection on CPU probabilities shares only "
                                 "%d of %d indices", common, n);
                    }
                    free(alt);
                }
            }
            if (ok && n != ksel) {
                ok = 0;
                snprintf(msg, sizeof(msg), "reference selected %d, expected %lld", n, ksel);
            }
            for (i = 0; i < n && ok; ++i)
                if (ig[i] != idx_ref[i]) {
                    ok = 0;
                    snprintf(msg, sizeof(msg), "index %d: gpu %d cpu %d", i, ig[i], idx_ref[i]);
                } else if (fbits(og[i]) != fbits(cg[ig[i]])) {
                    ok = 0;
                    snprintf(msg, sizeof(msg), "selected score %d wrong", i);
                }
            if (ok && (uint32_t)ig[n] != 0xdeadbeefu) {
                ok = 0;
                snprintf(msg, sizeof(msg), "wrote past min(k, s)");
            }
            if (ok && mode == 1)
                snprintf(msg, sizeof(msg), "%d selected; %d of %d probabilities bit-exact", n,
                         n_exact, s);
            else if (ok)
                snprintf(msg, sizeof(msg), "%d selected", n);
            report(ok, nm, msg);
        }
    }

    topk_ws_free(&ws);
    dfree(d_q); dfree(d_cent); dfree(d_codes); dfree(d_lut); dfree(d_lsum); dfree(d_raw);
    dfree(d_comb); dfree(d_part); dfree(d_stats); dfree(d_idx); dfree(d_osc);
    free(q); free(cent); free(codes); free(lut_ref); free(lsum_ref); free(lut_gpu);
    free(lsum_gpu); free(raw_ref); free(raw_gpu); free(sum_ref); free(comb_gpu); free(soft_ref);
    free(maxz); free(stats_gpu); free(idx_ref); free(idx_gpu); free(osc_gpu);
}

/* top-k alone on score arrays with ties, signed zeros, infinities, constant data */
static void check_topk_case(int n_kv, int s, int k, int kind)
{
    static const char *const kinds[] = { "random", "few-values", "constant", "specials",
                                         "ascending", "descending" };
    char name[160], msg[256];
    uint64_t rs = g_seed ^ (uint64_t)(s * 7919 + k * 31 + kind);
    float *sc = (float *)xmalloc(sizeof(float) * (size_t)n_kv * s);
    int *ref = (int *)xmalloc(sizeof(int) * (size_t)(s + 1));
    int *got = (int *)xmalloc(sizeof(int) * (size_t)n_kv * (s + 1));
    float *gsc = (float *)xmalloc(sizeof(float) * (size_t)n_kv * (s + 1));
    long long i;
    int kv, rep;
    dptr d_sc, d_idx, d_osc;
    topk_ws ws;
    snprintf(name, sizeof(name), "topk n_kv=%d s=%d k=%d data=%s", n_kv, s, k, kinds[kind]);
    d_sc = dalloc(sizeof(float) * (size_t)n_kv * s + 4);
    d_idx = dalloc(sizeof(int) * (size_t)n_kv * (s + 1));
    d_osc = dalloc(sizeof(float) * (size_t)n_kv * (s + 1));
    ws = topk_ws_alloc(n_kv, s);
    /* twice on the same workspace: the kernels must leave it reusable */
    for (rep = 0; rep < 2; ++rep) {
        int ok = 1;
        for (i = 0; i < (long long)n_kv * s; ++i) {
            float v;
            switch (kind) {
            case 0: v = rng_gauss(&rs) * 10.0f; break;
            case 1: v = (float)rng_below(&rs, 5) - 2.0f; break;
            case 2: v = 0.25f; break;
            case 3: {
                static const float sp[] = { 0.0f, -0.0f, 1.0f, -1.0f, 1e-40f, -1e-40f, 3.5f };
                uint32_t r = rng_below(&rs, 9);
                v = r < 7 ? sp[r] : (r == 7 ? INFINITY : -INFINITY);
                break;
            }
            case 4: v = (float)(i % s) * 0.5f; break;
            default: v = -(float)(i % s); break;
            }
            sc[i] = v;
        }
        up(d_sc, sc, sizeof(float) * (size_t)n_kv * s);
        CU(A.cuMemsetD32Async(d_idx, 0xdeadbeefu, (size_t)n_kv * (s + 1), S));
        k_topk(n_kv, &ws, d_sc, s, s, k, d_idx, s + 1, d_osc, s + 1);
        down(got, d_idx, sizeof(int) * (size_t)n_kv * (s + 1));
        down(gsc, d_osc, sizeof(float) * (size_t)n_kv * (s + 1));
        msg[0] = '\0';
        for (kv = 0; kv < n_kv && ok; ++kv) {
            int n = k > 0 ? ref_topk(sc + (long long)kv * s, s, k, ref) : 0, j;
            const int *g = got + (long long)kv * (s + 1);
            for (j = 0; j < n && ok; ++j)
                if (g[j] != ref[j]) {
                    ok = 0;
                    snprintf(msg, sizeof(msg), "rep %d kv %d: index %d gpu %d cpu %d", rep, kv, j,
                             g[j], ref[j]);
                } else if (fbits(gsc[(long long)kv * (s + 1) + j]) != fbits(sc[(long long)kv * s + ref[j]])) {
                    ok = 0;
                    snprintf(msg, sizeof(msg), "rep %d kv %d: score %d wrong", rep, kv, j);
                }
            if (ok && (uint32_t)g[n] != 0xdeadbeefu) {
                ok = 0;
                snprintf(msg, sizeof(msg), "rep %d kv %d: wrote %s min(k, s) entries", rep, kv,
                         "more than");
            }
        }
        if (!report(ok, name, ok ? (rep ? "workspace reused" : "exact") : msg)) break;
    }
    topk_ws_free(&ws);
    dfree(d_sc); dfree(d_idx); dfree(d_osc);
    free(sc); free(ref); free(got); free(gsc);
}

/* ------------------------------------------------------------------------------------ */
/* Checks: block-cache fill and gather                                                  */
/* ------------------------------------------------------------------------------------ */

static void check_gather_case(int dt, int d_h, int interleaved, int use_cache)
{
    char name[160], msg[256];
    uint64_t rs = g_seed ^ (uint64_t)(dt * 1000 + d_h * 3 + interleaved * 7 + use_cache);
    int n_kv = 2, s = g_quick ? 700 : 5000, block_tokens = 16, n_sel = g_quick ? 90 : 600;
    int n_blocks = (s + block_tokens - 1) / block_tokens, n_slots = 12, es = dt == 0 ? 4 : 2;
    long long host_ld = interleaved ? (long long)n_kv * d_h : d_h;
    long long host_hs = interleaved ? d_h : (long long)s * d_h;
    long long cache_hs = (long long)n_slots * block_tokens * d_h;
    size_t host_bytes = (size_t)n_kv * s * d_h * es;
    mapped_t hk = mapped_alloc(host_bytes), hv = mapped_alloc(host_bytes);
    int *slot_table = (int *)xmalloc(sizeof(int) * (size_t)n_kv * n_blocks);
    int *fill_blocks = (int *)xmalloc(sizeof(int) * (size_t)n_kv * n_slots);
    int *fill_slots = (int *)xmalloc(sizeof(int) * (size_t)n_kv * n_slots);
    int *idx = (int *)xmalloc(sizeof(int) * (size_t)n_kv * n_sel);
    float *ok_k = (float *)xmalloc(sizeof(float) * (size_t)n_kv * n_sel * d_h);
    float *ok_v = (float *)xmalloc(sizeof(float) * (size_t)n_kv * n_sel * d_h);
    unsigned char *cache_h = (unsigned char *)xmalloc((size_t)(cache_hs * n_kv * es));
    unsigned miss[2] = { 0, 0 };
    unsigned miss_ref[2] = { 0, 0 };
    dptr d_slots, d_fb, d_fs, d_idx, d_ck, d_cv, d_ok, d_ov, d_miss;
    int kv, i, e, ok = 1;
    long long t;

    snprintf(name, sizeof(name), "gather dtype=%s d_h=%d layout=%s cache=%s",
             dt == 0 ? "fp32" : dt == 1 ? "fp16" : "bf16", d_h,
             interleaved ? "[token][kv][d_h]" : "[kv][token][d_h]", use_cache ? "yes" : "none");

    for (t = 0; t < (long long)n_kv * s * d_h; ++t) {
        float fk = rng_gauss(&rs), fv = rng_gauss(&rs);
        if (t % 97 == 5) fk = 3e-6f;    /* fp16 subnormal */
        if (t % 131 == 7) fv = -0.0f;
        if (dt == 0) {
            ((float *)hk.h)[t] = fk;
            ((float *)hv.h)[t] = fv;
        } else if (dt == 1) {
            ((uint16_t *)hk.h)[t] = to_f16(fk);
            ((uint16_t *)hv.h)[t] = to_f16(fv);
        } else {
            ((uint16_t *)hk.h)[t] = to_bf16(fk);
            ((uint16_t *)hv.h)[t] = to_bf16(fv);
        }
    }
    /* a different set of cached blocks per head; the partial last block is cached in head 0 */
    for (kv = 0; kv < n_kv; ++kv) {
        int *st = slot_table + (long long)kv * n_blocks;
        for (i = 0; i < n_blocks; ++i) st[i] = -1;
        for (i = 0; i < n_slots; ++i) {
            int blk;
            if (kv == 0 && i == 0) blk = n_blocks - 1;
            else do blk = (int)rng_below(&rs, (uint32_t)n_blocks); while (st[blk] >= 0);
            st[blk] = i;
            fill_blocks[kv * n_slots + i] = blk;
            fill_slots[kv * n_slots + i] = n_slots - 1 - i; /* slots in another order */
            st[blk] = n_slots - 1 - i;
        }
        for (i = 0; i < n_sel; ++i) {
            int tok = i == 0 ? s - 1 : (int)rng_below(&rs, (uint32_t)s);
            idx[kv * n_sel + i] = tok;
            if (!use_cache || st[tok / block_tokens] < 0) ++miss_ref[kv];
        }
    }

    d_slots = dupload(slot_table, sizeof(int) * (size_t)n_kv * n_blocks);
    d_fb = dupload(fill_blocks, sizeof(int) * (size_t)n_kv * n_slots);
    d_fs = dupload(fill_slots, sizeof(int) * (size_t)n_kv * n_slots);
    d_idx = dupload(idx, sizeof(int) * (size_t)n_kv * n_sel);
    d_ck = dalloc((size_t)(cache_hs * n_kv * es));
    d_cv = dalloc((size_t)(cache_hs * n_kv * es));
    d_ok = dalloc(sizeof(float) * (size_t)n_kv * n_sel * d_h);
    d_ov = dalloc(sizeof(float) * (size_t)n_kv * n_sel * d_h);
    d_miss = dalloc(8);
    dzero(d_ck, (size_t)(cache_hs * n_kv * es));
    dzero(d_cv, (size_t)(cache_hs * n_kv * es));
    dzero(d_miss, 8);

    k_cache_fill(n_kv, d_fb, d_fs, n_slots, n_slots, block_tokens, s, hk.d, hv.d, host_hs,
                 host_ld, dt, d_h, d_ck, d_cv, cache_hs);
    /* the filled cache holds exactly the host rows (bytes), untouched rows stay zero */
    down(cache_h, d_ck, (size_t)(cache_hs * n_kv * es));
    for (kv = 0; kv < n_kv && ok; ++kv)
        for (i = 0; i < n_slots && ok; ++i) {
            int blk = fill_blocks[kv * n_slots + i], slot = fill_slots[kv * n_slots + i], r;
            for (r = 0; r < block_tokens && ok; ++r) {
                long long tok = (long long)blk * block_tokens + r;
                const unsigned char *c =
                    cache_h + (kv * cache_hs + ((long long)slot * block_tokens + r) * d_h) * es;
                if (tok < s) {
                    const unsigned char *hsrc =
                        (const unsigned char *)hk.h + (kv * host_hs + tok * host_ld) * es;
                    if (memcmp(c, hsrc, (size_t)d_h * es) != 0) {
                        ok = 0;
                        snprintf(msg, sizeof(msg), "cache_fill: kv %d slot %d row %d differs", kv,
                                 slot, r);
                    }
                } else {
                    for (e = 0; e < d_h * es; ++e)
                        if (c[e]) {
                            ok = 0;
                            snprintf(msg, sizeof(msg), "cache_fill wrote past the sequence end");
                            break;
                        }
                }
            }
        }
    if (!report(ok, name, ok ? "cache_fill exact" : msg)) goto done;

    k_gather(n_kv, d_idx, n_sel, n_sel, use_cache ? d_slots : 0, n_blocks, block_tokens, d_ck,
             d_cv, cache_hs, dt, hk.d, hv.d, host_hs, host_ld, dt, d_h, d_ok, d_ov,
             (long long)n_sel * d_h, d_miss);
    down(ok_k, d_ok, sizeof(float) * (size_t)n_kv * n_sel * d_h);
    down(ok_v, d_ov, sizeof(float) * (size_t)n_kv * n_sel * d_h);
    down(miss, d_miss, 8);
    for (kv = 0; kv < n_kv && ok; ++kv)
        for (i = 0; i < n_sel && ok; ++i) {
            long long tok = idx[kv * n_sel + i];
            for (e = 0; e < d_h; ++e) {
                long long o = ((long long)kv * n_sel + i) * d_h + e;
                const void *bk = (const char *)hk.h + (kv * host_hs + tok * host_ld) * es;
                const void *bv = (const char *)hv.h + (kv * host_hs + tok * host_ld) * es;
                float rk = ref_elem(bk, e, dt), rv = ref_elem(bv, e, dt);
                if (fbits(ok_k[o]) != fbits(rk) || fbits(ok_v[o]) != fbits(rv)) {
                    if (isnan(rk) && isnan(ok_k[o]) && isnan(rv) && isnan(ok_v[o])) continue;
                    ok = 0;
                    snprintf(msg, sizeof(msg), "kv %d row %d (token %lld) elem %d: k %.9g/%.9g "
                             "v %.9g/%.9g", kv, i, tok, e, ok_k[o], rk, ok_v[o], rv);
                    break;
                }
            }
        }
    if (ok && (miss[0] != miss_ref[0] || miss[1] != miss_ref[1])) {
        ok = 0;
        snprintf(msg, sizeof(msg), "miss counts %u/%u, expected %u/%u", miss[0], miss[1],
                 miss_ref[0], miss_ref[1]);
    }
    if (ok) snprintf(msg, sizeof(msg), "exact, %u+%u misses", miss[0], miss[1]);
    report(ok, name, msg);
done:
    dfree(d_slots); dfree(d_fb); dfree(d_fs); dfree(d_idx); dfree(d_ck); dfree(d_cv);
    dfree(d_ok); dfree(d_ov); dfree(d_miss);
    mapped_free(hk);
    mapped_free(hv);
    free(slot_table); free(fill_blocks); free(fill_slots); free(idx); free(ok_k); free(ok_v);
    free(cache_h);
}

/* ------------------------------------------------------------------------------------ */
/* Checks: codes of new keys, centroid norms, k-means                                   */
/* ------------------------------------------------------------------------------------ */

/* The key dim of element e of sub-space j (pqc_sub_dim of the kernels) */
static int sub_dim(int j, int e, int d_sub, int d_h, int half)
{
    int h2 = d_sub / 2;
    if (!half) return j * d_sub + e;
    return e < h2 ? j * h2 + e : d_h / 2 + j * h2 + (e - h2);
}

/* with_norms 2: a weighted metric, its weighted norms given; half: sub-spaces of rope
   bands over the half-split layout */
static void check_assign_case(int b, int dt, int with_norms, int half)
{
    char name[160], msg[256];
    uint64_t rs = g_seed ^ (uint64_t)(b * 17 + dt * 5 + with_norms);
    int weighted = with_norms == 2;
    int n_kv = 2, m = 4, d_sub = 32, d_h = m * d_sub, K = 1 << b;
    int t_start = 13, n = g_quick ? 40 : 301, s_cap = t_start + n + 5, es = dt == 0 ? 4 : 2;
    long long col_stride = ((long long)s_cap * b + 7) / 8 + 9; /* odd stride on purpose */
    long long code_hs = col_stride * m + 3;
    long long x_ld = d_h + 8;
    size_t ncode = (size_t)(code_hs * n_kv);
    float *cent = (float *)xmalloc(sizeof(float) * (size_t)n_kv * m * K * d_sub);
    float *xf = (float *)xmalloc(sizeof(float) * (size_t)n_kv * n * x_ld);
    unsigned char *xraw = (unsigned char *)xmalloc((size_t)n_kv * n * x_ld * es);
    uint8_t *codes = (uint8_t *)xmalloc(ncode), *codes_ref = (uint8_t *)xmalloc(ncode);
    uint8_t *got = (uint8_t *)xmalloc(ncode);
    uint8_t *cout = (uint8_t *)xmalloc((size_t)n_kv * n * m), *cout_ref;
    float *nrm_gpu = (float *)xmalloc(sizeof(float) * (size_t)n_kv * m * K);
    float *wt = (float *)xmalloc(sizeof(float) * (size_t)n_kv * d_h);
    dptr d_cent, d_x, d_codes, d_cout, d_nrm = 0, d_w = 0;
    int kv, i, j, e, ok = 1;
    long long t;
    cout_ref = (uint8_t *)xmalloc((size_t)n_kv * n * m);

    snprintf(name, sizeof(name), "assign_codes b=%d x=%s norms=%s t_start=%d n=%d%s", b,
             dt == 0 ? "fp32" : dt == 1 ? "fp16" : "bf16",
             weighted ? "weighted" : with_norms ? "given" : "computed",
             t_start, n, half ? " rope-bands" : "");
    for (t = 0; t < (long long)n_kv * m * K * d_sub; ++t) cent[t] = rng_gauss(&rs);
    for (t = 0; t < (long long)n_kv * d_h; ++t) wt[t] = 0.01f + 4.0f * (float)rng_gauss(&rs) * (float)rng_gauss(&rs);
    for (t = 0; t < (long long)n_kv * d_h; ++t) wt[t] = wt[t] < 0.0f ? -wt[t] + 0.01f : wt[t];
    /* duplicate centroid (ties must go to the lower index): c = K-1 copies c = 1 */
    if (K >= 4)
        for (kv = 0; kv < n_kv; ++kv)
            for (j = 0; j < m; ++j)
                memcpy(cent + (((long long)kv * m + j) * K + (K - 1)) * d_sub,
                       cent + (((long long)kv * m + j) * K + 1) * d_sub, sizeof(float) * d_sub);
    for (kv = 0; kv < n_kv; ++kv)
        for (i = 0; i < n; ++i)
            for (e = 0; e < x_ld; ++e) {
                long long o = ((long long)kv * n + i) * x_ld + e;
                float v = rng_gauss(&rs);
                /* some keys sit exactly on the duplicated centroid */
                if (K >= 4 && i % 7 == 3 && e < d_h) {
                    int jj, ee; /* the sub-space element that dim e holds */
                    for (jj = 0; jj < m; ++jj)
                        for (ee = 0; ee < d_sub; ++ee)
                            if (sub_dim(jj, ee, d_sub, d_h, half) == e)
                                v = cent[(((long long)kv * m + jj) * K + (K - 1)) * d_sub + ee];
                }
                if (dt == 0) { ((float *)xraw)[o] = v; xf[o] = v; }
                else if (dt == 1) { uint16_t hb = to_f16(v); ((uint16_t *)xraw)[o] = hb; xf[o] = ref_f16(hb); }
                else { uint16_t hb = to_bf16(v); ((uint16_t *)xraw)[o] = hb; xf[o] = ref_bf16(hb); }
            }
    /* existing codes of tokens < t_start, random bytes in the gaps between columns */
    memset(codes, 0, ncode);
    for (kv = 0; kv < n_kv; ++kv)
        for (j = 0; j < m; ++j)
            for (t = 0; t < t_start; ++t)
                pack_code(codes + kv * code_hs + j * col_stride, t, b, rng_below(&rs, (uint32_t)K));
    memcpy(codes_ref, codes, ncode);
    for (kv = 0; kv < n_kv; ++kv)
        for (i = 0; i < n; ++i)
            for (j = 0; j < m; ++j) {
                float xs[256], ws[256];
                int c;
                for (e = 0; e < d_sub; ++e) {
                    int col = sub_dim(j, e, d_sub, d_h, half);
                    xs[e] = xf[((long long)kv * n + i) * x_ld + col];
                    ws[e] = wt[(long long)kv * d_h + col];
                }
                c = ref_nearest_w(xs, cent + ((long long)kv * m + j) * K * d_sub, K, d_sub,
                                  weighted ? ws : NULL, NULL);
                cout_ref[((long long)kv * n + i) * m + j] = (uint8_t)c;
                pack_code(codes_ref + kv * code_hs + j * col_stride, t_start + i, b, (uint32_t)c);
            }

    d_cent = dupload(cent, sizeof(float) * (size_t)n_kv * m * K * d_sub);
    d_x = dupload(xraw, (size_t)n_kv * n * x_ld * es);
    d_codes = dupload(codes, ncode);
    d_cout = dalloc((size_t)n_kv * n * m);
    if (weighted) { /* the host's weighted norms, as the library uploads them */
        for (kv = 0; kv < n_kv; ++kv)
            for (j = 0; j < m; ++j)
                for (i = 0; i < K; ++i) {
                    const float *cc = cent + (((long long)kv * m + j) * K + i) * d_sub;
                    const float *ww = wt + (long long)kv * d_h;
                    float r = 0.0f;
                    for (e = 0; e < d_sub; ++e) r = fmaf(ww[sub_dim(j, e, d_sub, d_h, half)] * cc[e], cc[e], r);
                    nrm_gpu[((long long)kv * m + j) * K + i] = r;
                }
        d_nrm = dupload(nrm_gpu, sizeof(float) * (size_t)n_kv * m * K);
        d_w = dupload(wt, sizeof(float) * (size_t)n_kv * d_h);
    } else if (with_norms) {
        d_nrm = dalloc(sizeof(float) * (size_t)n_kv * m * K);
        k_norms(d_cent, n_kv * m * K, d_sub, d_nrm);
        down(nrm_gpu, d_nrm, sizeof(float) * (size_t)n_kv * m * K);
        for (i = 0; i < n_kv * m * K && ok; ++i) {
            float r = 0.0f;
            for (e = 0; e < d_sub; ++e)
                r = fmaf(cent[(long long)i * d_sub + e], cent[(long long)i * d_sub + e], r);
            if (fbits(r) != fbits(nrm_gpu[i])) {
                ok = 0;
                snprintf(msg, sizeof(msg), "centroid norm %d: gpu %.9g cpu %.9g", i, nrm_gpu[i], r);
            }
        }
        if (!report(ok, "centroid_norms", ok ? "bit-exact" : msg)) goto done;
    }
    k_assign(n_kv, d_x, dt, x_ld, (long long)n * x_ld, n, d_cent, d_nrm,
             (long long)m * K * d_sub, (long long)m * K, d_w, d_h, m, b, d_sub, half, d_codes, code_hs,
             col_stride, t_start, d_cout, (long long)n * m);
    down(got, d_codes, ncode);
    down(cout, d_cout, (size_t)n_kv * n * m);
    for (i = 0; i < n_kv * n * m && ok; ++i)
        if (cout[i] != cout_ref[i]) {
            ok = 0;
            snprintf(msg, sizeof(msg), "codes_out[%d] = %d, expected %d", i, cout[i], cout_ref[i]);
        }
    for (t = 0; t < (long long)ncode && ok; ++t)
        if (got[t] != codes_ref[t]) {
            ok = 0;
            snprintf(msg, sizeof(msg), "packed byte %lld = 0x%02x, expected 0x%02x", t, got[t],
                     codes_ref[t]);
        }
    report(ok, name, ok ? "codes and packed columns exact" : msg);
done:
    dfree(d_cent); dfree(d_x); dfree(d_codes); dfree(d_cout); dfree(d_nrm); dfree(d_w);
    free(cent); free(xf); free(xraw); free(codes); free(codes_ref); free(got); free(cout);
    free(cout_ref); free(nrm_gpu); free(wt);
}

static void check_kmeans(void)
{
    char msg[256];
    uint64_t rs = g_seed ^ 777u;
    int n_sub = 2, d = 32, K = 64, n = g_quick ? 600 : 6000, i, j, e, c, ok = 1;
    long long ld = (long long)n_sub * d;
    float *x = (float *)xmalloc(sizeof(float) * (size_t)n * ld);
    float *cent = (float *)xmalloc(sizeof(float) * (size_t)n_sub * K * d);
    float *cent2 = (float *)xmalloc(sizeof(float) * (size_t)n_sub * K * d);
    float *sums = (float *)xmalloc(sizeof(float) * (size_t)n_sub * K * d);
    double *sums_ref = (double *)xmalloc(sizeof(double) * (size_t)n_sub * K * d);
    unsigned *counts = (unsigned *)xmalloc(sizeof(unsigned) * (size_t)n_sub * K);
    unsigned *counts_ref = (unsigned *)xmalloc(sizeof(unsigned) * (size_t)n_sub * K);
    int *assign = (int *)xmalloc(sizeof(int) * (size_t)n_sub * n);
    float *mind = (float *)xmalloc(sizeof(float) * (size_t)n_sub * n);
    dptr d_x, d_c, d_n, d_a, d_s, d_cnt, d_md;

    for (i = 0; i < n; ++i)
        for (e = 0; e < ld; ++e) x[(long long)i * ld + e] = rng_gauss(&rs) + (float)(i % 5);
    for (j = 0; j < n_sub; ++j)
        for (c = 0; c < K; ++c)
            for (e = 0; e < d; ++e)
                cent[((long long)j * K + c) * d + e] = x[(long long)((c * 37) % n) * ld + j * d + e];
    memset(sums_ref, 0, sizeof(double) * (size_t)n_sub * K * d);
    memset(counts_ref, 0, sizeof(unsigned) * (size_t)n_sub * K);

    d_x = dupload(x, sizeof(float) * (size_t)n * ld);
    d_c = dupload(cent, sizeof(float) * (size_t)n_sub * K * d);
    d_n = dalloc(sizeof(float) * (size_t)n_sub * K);
    d_a = dalloc(sizeof(int) * (size_t)n_sub * n);
    d_s = dalloc(sizeof(float) * (size_t)n_sub * K * d);
    d_cnt = dalloc(sizeof(unsigned) * (size_t)n_sub * K);
    d_md = dalloc(sizeof(float) * (size_t)n_sub * n);
    dzero(d_s, sizeof(float) * (size_t)n_sub * K * d);
    dzero(d_cnt, sizeof(unsigned) * (size_t)n_sub * K);
    k_norms(d_c, n_sub * K, d, d_n);
    k_km_assign(n_sub, d_x, ld, n, d, d_c, d_n, K, d_a, d_s, d_cnt, d_md);
    down(assign, d_a, sizeof(int) * (size_t)n_sub * n);
    down(sums, d_s, sizeof(float) * (size_t)n_sub * K * d);
    down(counts, d_cnt, sizeof(unsigned) * (size_t)n_sub * K);
    down(mind, d_md, sizeof(float) * (size_t)n_sub * n);

    for (j = 0; j < n_sub && ok; ++j)
        for (i = 0; i < n && ok; ++i) {
            const float *xr = x + (long long)i * ld + j * d;
            float best, xn = 0.0f, md;
            int r = ref_nearest(xr, cent + (long long)j * K * d, K, d, &best);
            for (e = 0; e < d; ++e) xn = fmaf(xr[e], xr[e], xn);
            md = xn + best;
            if (md < 0.0f) md = 0.0f;
            if (assign[j * n + i] != r) {
                ok = 0;
                snprintf(msg, sizeof(msg), "sub %d point %d: assign %d, expected %d", j, i,
                         assign[j * n + i], r);
            } else if (fabsf(mind[j * n + i] - md) > 1e-4f * (xn + 1.0f)) {
                ok = 0;
                snprintf(msg, sizeof(msg), "sub %d point %d: min_dist %.9g, expected %.9g", j, i,
                         mind[j * n + i], md);
            }
            ++counts_ref[j * K + r];
            for (e = 0; e < d; ++e) sums_ref[((long long)j * K + r) * d + e] += xr[e];
        }
    for (i = 0; i < n_sub * K && ok; ++i)
        if (counts[i] != counts_ref[i]) {
            ok = 0;
            snprintf(msg, sizeof(msg), "count %d = %u, expected %u", i, counts[i], counts_ref[i]);
        }
    for (i = 0; i < n_sub * K * d && ok; ++i) {
        /* float atomics add in any order: allow rounding that grows with the count */
        int r = i / d;
        if (fabs(sums[i] - sums_ref[i]) > 1e-4 * fabs(sums_ref[i]) + 1e-5 * counts_ref[r]) {
            ok = 0;
            snprintf(msg, sizeof(msg), "sum %d = %.9g, expected %.9g", i, sums[i], sums_ref[i]);
        }
    }
    if (report(ok, "kmeans_assign", ok ? "assignments, counts exact; sums, distances 1e-4" : msg)) {
        k_km_update(d_c, d_s, d_cnt, n_sub * K, d);
        down(cent2, d_c, sizeof(float) * (size_t)n_sub * K * d);
        for (i = 0; i < n_sub * K * d && ok; ++i) {
            float want = counts[i / d] ? sums[i] / (float)counts[i / d] : cent[i];
            if (fbits(cent2[i]) != fbits(want)) {
                ok = 0;
                snprintf(msg, sizeof(msg), "centroid elem %d = %.9g, expected %.9g", i, cent2[i],
                         want);
            }
        }
        report(ok, "kmeans_update", ok ? "exact" : msg);
    }
    if (ok) {
        /* the GEMM path's argmin from dot products (sub-space 0, dots by sequential fmaf
           like the kernels'): the same assignments and distances as kmeans_assign */
        float *dots = (float *)xmalloc(sizeof(float) * (size_t)n * K);
        int *assign2 = (int *)xmalloc(sizeof(int) * (size_t)n);
        float *mind2 = (float *)xmalloc(sizeof(float) * (size_t)n);
        unsigned *counts2 = (unsigned *)xmalloc(sizeof(unsigned) * (size_t)K);
        dptr d_dots;
        for (i = 0; i < n; ++i)
            for (c = 0; c < K; ++c) {
                float acc = 0.0f;
                for (e = 0; e < d; ++e) acc = fmaf(x[(long long)i * ld + e], cent[(long long)c * d + e], acc);
                dots[(long long)i * K + c] = acc;
            }
        d_dots = dupload(dots, sizeof(float) * (size_t)n * K);
        up(d_c, cent, sizeof(float) * (size_t)n_sub * K * d);
        k_norms(d_c, K, d, d_n);
        dzero(d_s, sizeof(float) * (size_t)K * d);
        dzero(d_cnt, sizeof(unsigned) * (size_t)K);
        k_km_dots(d_dots, d_x, ld, n, d, d_n, K, d_a, d_s, d_cnt, d_md);
        down(assign2, d_a, sizeof(int) * (size_t)n);
        down(counts2, d_cnt, sizeof(unsigned) * (size_t)K);
        down(mind2, d_md, sizeof(float) * (size_t)n);
        for (i = 0; i < n && ok; ++i)
            if (assign2[i] != assign[i] || fbits(mind2[i]) != fbits(mind[i])) {
                ok = 0;
                snprintf(msg, sizeof(msg), "point %d: assign %d, min_dist %.9g; kmeans_assign %d, %.9g", i,
                         assign2[i], mind2[i], assign[i], mind[i]);
            }
        for (i = 0; i < K && ok; ++i)
            if (counts2[i] != counts_ref[i]) {
                ok = 0;
                snprintf(msg, sizeof(msg), "count %d = %u, expected %u", i, counts2[i], counts_ref[i]);
            }
        report(ok, "kmeans_assign_dots", ok ? "assignments, distances, counts as kmeans_assign" : msg);
        dfree(d_dots);
        free(dots); free(assign2); free(mind2); free(counts2);
    }
    dfree(d_x); dfree(d_c); dfree(d_n); dfree(d_a); dfree(d_s); dfree(d_cnt); dfree(d_md);
    free(x); free(cent); free(cent2); free(sums); free(sums_ref); free(counts);
    free(counts_ref); free(assign); free(mind);
}

/* cuBLASLt through the loader's table: C = A * B^T, row-major, against the CPU */
static void check_blaslt(void)
{
    char msg[256];
    int M = 64, N = 48, Kd = 32, i, j, e, ok = 1, found = 0;
    uint64_t rs = g_seed ^ 99u;
    float *a = (float *)xmalloc(sizeof(float) * (size_t)M * Kd);
    float *b = (float *)xmalloc(sizeof(float) * (size_t)N * Kd);
    float *c = (float *)xmalloc(sizeof(float) * (size_t)M * N);
    float alpha = 1.0f, beta = 0.0f;
    int ta = PQC__CUBLAS_OP_T, tb = PQC__CUBLAS_OP_N;
    size_t ws_bytes = 1 << 22;
    pqc__cuBlasLtHandle h = NULL;
    pqc__cuBlasLtMatmulDesc desc = NULL;
    pqc__cuBlasLtMatrixLayout la = NULL, lb = NULL, lc = NULL;
    pqc__cuBlasLtMatmulPreference pref = NULL;
    pqc__cuBlasLtHeuristicResult res;
    dptr d_a, d_b, d_c, d_ws;
    pqc__cuBlasStatus st;

    if (!A.lib_blaslt) {
        printf("SKIP cublaslt: %s\n", "cuBLASLt not loaded");
        return;
    }
    for (i = 0; i < M * Kd; ++i) a[i] = rng_gauss(&rs);
    for (i = 0; i < N * Kd; ++i) b[i] = rng_gauss(&rs);
    d_a = dupload(a, sizeof(float) * (size_t)M * Kd);
    d_b = dupload(b, sizeof(float) * (size_t)N * Kd);
    d_c = dalloc(sizeof(float) * (size_t)M * N);
    d_ws = dalloc(ws_bytes);
    /* column-major view: C^T (N x M, ld N) = op(Bcm)^T (N x K) * Acm (K x M) */
    st = A.cublasLtCreate(&h);
    if (st == 0) st = A.cublasLtMatmulDescCreate(&desc, PQC__CUBLAS_COMPUTE_32F_PEDANTIC, PQC__CUDA_R_32F);
    if (st == 0) st = A.cublasLtMatmulDescSetAttribute(desc, PQC__CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    if (st == 0) st = A.cublasLtMatmulDescSetAttribute(desc, PQC__CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (st == 0) st = A.cublasLtMatrixLayoutCreate(&la, PQC__CUDA_R_32F, (uint64_t)Kd, (uint64_t)N, Kd);
    if (st == 0) st = A.cublasLtMatrixLayoutCreate(&lb, PQC__CUDA_R_32F, (uint64_t)Kd, (uint64_t)M, Kd);
    if (st == 0) st = A.cublasLtMatrixLayoutCreate(&lc, PQC__CUDA_R_32F, (uint64_t)N, (uint64_t)M, N);
    if (st == 0) st = A.cublasLtMatmulPreferenceCreate(&pref);
    if (st == 0) st = A.cublasLtMatmulPreferenceSetAttribute(pref, PQC__CUBLASLT_PREF_MAX_WORKSPACE, &ws_bytes, sizeof(ws_bytes));
    if (st == 0) st = A.cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &res, &found);
    if (st == 0 && found < 1) st = -1;
    if (st == 0)
        st = A.cublasLtMatmul(h, desc, &alpha, (const void *)(uintptr_t)d_b, la,
                              (const void *)(uintptr_t)d_a, lb, &beta,
                              (const void *)(uintptr_t)d_c, lc, (void *)(uintptr_t)d_c, lc,
                              &res.algo, (void *)(uintptr_t)d_ws, ws_bytes, S);
    if (st != 0) {
        ok = 0;
        snprintf(msg, sizeof(msg), "cuBLASLt call failed with status %d (found %d)", st, found);
    } else {
        down(c, d_c, sizeof(float) * (size_t)M * N);
        for (i = 0; i < M && ok; ++i)
            for (j = 0; j < N && ok; ++j) {
                double r = 0.0, mag = 0.0;
                for (e = 0; e < Kd; ++e) {
                    r += (double)a[i * Kd + e] * b[j * Kd + e];
                    mag += fabs((double)a[i * Kd + e] * b[j * Kd + e]);
                }
                if (fabs(c[i * N + j] - r) > 1e-4 * mag + 1e-6) {
                    ok = 0;
                    snprintf(msg, sizeof(msg), "C[%d][%d] = %.9g, expected %.9g", i, j,
                             c[i * N + j], r);
                }
            }
    }
    report(ok, "cublaslt sgemm A*B^T", ok ? "within 1e-4" : msg);
    if (pref) A.cublasLtMatmulPreferenceDestroy(pref);
    if (la) A.cublasLtMatrixLayoutDestroy(la);
    if (lb) A.cublasLtMatrixLayoutDestroy(lb);
    if (lc) A.cublasLtMatrixLayoutDestroy(lc);
    if (desc) A.cublasLtMatmulDescDestroy(desc);
    if (h) A.cublasLtDestroy(h);
    dfree(d_a); dfree(d_b); dfree(d_c); dfree(d_ws);
    free(a); free(b); free(c);
}

/* ------------------------------------------------------------------------------------ */
/* Benchmarks                                                                           */
/* ------------------------------------------------------------------------------------ */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : (x > y);
}
static float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof(float), cmp_float);
    return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct { const char *mode; int m, b, s, k; float total_us, scan_us, topk_us; } sel_row;

#define BENCH_REPS 20
static void bench_select(int mode, int m, int b, int s, sel_row *row)
{
    int n_kv = 8, g = 4, d_h = 128, d_sub = d_h / m, K = 1 << b, k = s / 10, rep, i;
    float scale = 1.0f / sqrtf((float)d_h);
    long long col_stride = ((long long)s * b + 7) / 8 + 16, code_hs = col_stride * m;
    long long lut_hs = (long long)g * m * K;
    uint64_t rs = g_seed ^ (uint64_t)(s + m + b);
    size_t ncode = (size_t)(code_hs * n_kv);
    uint8_t *codes = (uint8_t *)xmalloc(ncode);
    float *q = (float *)xmalloc(sizeof(float) * (size_t)n_kv * g * d_h);
    float *cent = (float *)xmalloc(sizeof(float) * (size_t)n_kv * m * K * d_sub);
    float t_tot[BENCH_REPS], t_scan[BENCH_REPS], t_topk[BENCH_REPS];
    unsigned P = stride_grid(s, n_kv);
    dptr d_q, d_c, d_codes, d_lut, d_part, d_stats, d_sc, d_idx;
    topk_ws ws;
    pqc__cuEvent e0, e1, e2;

    for (i = 0; i < (int)ncode; ++i) codes[i] = (uint8_t)rng_next(&rs);
    for (i = 0; i < n_kv * g * d_h; ++i) q[i] = rng_gauss(&rs);
    for (i = 0; i < n_kv * m * K * d_sub; ++i) cent[i] = rng_gauss(&rs);
    d_q = dupload(q, sizeof(float) * (size_t)n_kv * g * d_h);
    d_c = dupload(cent, sizeof(float) * (size_t)n_kv * m * K * d_sub);
    d_codes = dupload(codes, ncode);
    d_lut = dalloc(sizeof(float) * (size_t)(lut_hs * n_kv));
    d_part = dalloc(sizeof(float) * 2 * (size_t)g * P * n_kv);
    d_stats = dalloc(sizeof(float) * 2 * (size_t)g * n_kv);
    d_sc = dalloc(sizeof(float) * (size_t)n_kv * s);
    d_idx = dalloc(sizeof(int) * (size_t)n_kv * k);
    ws = topk_ws_alloc(n_kv, s);
    CU(A.cuEventCreate(&e0, PQC__CU_EVENT_DEFAULT));
    CU(A.cuEventCreate(&e1, PQC__CU_EVENT_DEFAULT));
    CU(A.cuEventCreate(&e2, PQC__CU_EVENT_DEFAULT));

    for (rep = -3; rep < BENCH_REPS; ++rep) {
        float a, bb;
        CU(A.cuEventRecord(e0, S));
        if (mode == SCAN_RAW) { /* GQA sum: one summed table, one scan */
            k_lut_build(n_kv, d_q, (long long)g * d_h, d_c, (long long)m * K * d_sub, g, m, K,
                        d_sub, 0, 0, d_lut, (long long)m * K);
            k_scan(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lut, (long long)m * K, 1,
                   SCAN_RAW, 0, 0, scale, d_sc, s, 0);
        } else {
            k_lut_build(n_kv, d_q, (long long)g * d_h, d_c, (long long)m * K * d_sub, g, m, K,
                        d_sub, d_lut, lut_hs, 0, 0);
            k_scan_stats(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lut, lut_hs, g, scale,
                         d_part, 2LL * g * P, 0);
            k_softmax_finalize(n_kv, d_part, 2LL * g * P, (int)P, g, scale, d_stats, 2LL * g);
            k_scan(n_kv, P, d_codes, code_hs, col_stride, s, m, b, d_lut, lut_hs, g,
                   SCAN_SOFTMAX_SUM, d_stats, 2LL * g, scale, d_sc, s, 0);
        }
        CU(A.cuEventRecord(e1, S));
        k_topk(n_kv, &ws, d_sc, s, s, k, d_idx, k, 0, 0);
        CU(A.cuEventRecord(e2, S));
        CU(A.cuEventSynchronize(e2));
        if (rep < 0) continue;
        CU(A.cuEventElapsedTime(&a, e0, e1));
        CU(A.cuEventElapsedTime(&bb, e1, e2));
        t_scan[rep] = a * 1000.0f;
        t_topk[rep] = bb * 1000.0f;
        t_tot[rep] = (a + bb) * 1000.0f;
    }
    row->mode = mode == SCAN_RAW ? "SUM" : "SOFTMAX_SUM";
    row->m = m;
    row->b = b;
    row->s = s;
    row->k = k;
    row->total_us = median(t_tot, BENCH_REPS);
    row->scan_us = median(t_scan, BENCH_REPS);
    row->topk_us = median(t_topk, BENCH_REPS);
    A.cuEventDestroy_v2(e0);
    A.cuEventDestroy_v2(e1);
    A.cuEventDestroy_v2(e2);
    topk_ws_free(&ws);
    dfree(d_q); dfree(d_c); dfree(d_codes); dfree(d_lut); dfree(d_part); dfree(d_stats);
    dfree(d_sc); dfree(d_idx);
    free(codes); free(q); free(cent);
}

typedef struct { float miss_gbs, miss_us, hit_gbs, hit_us, memcpy_gbs; int s, k; } gather_row;

static void bench_gather(gather_row *row)
{
    int n_kv = 8, d_h = 128, s = g_quick ? 4096 : 32768, k = s / 10, block_tokens = 128, i, rep;
    int n_blocks = s / block_tokens;
    size_t host_bytes = (size_t)n_kv * s * d_h * 2, copy_bytes = host_bytes;
    mapped_t hk = mapped_alloc(host_bytes), hv = mapped_alloc(host_bytes);
    int *idx = (int *)xmalloc(sizeof(int) * (size_t)n_kv * k);
    int *slots = (int *)xmalloc(sizeof(int) * (size_t)n_blocks);
    int *blocks = (int *)xmalloc(sizeof(int) * (size_t)n_blocks);
    float tm[BENCH_REPS], th[BENCH_REPS], tc[BENCH_REPS];
    uint64_t rs = g_seed ^ 4242u;
    dptr d_idx, d_slots, d_blocks, d_ck, d_cv, d_ok, d_ov, d_copy;
    pqc__cuEvent e0, e1;
    double bytes = (double)n_kv * k * d_h * 2 * 2; /* K and V rows read */

    memset(hk.h, 0x3c, host_bytes);
    memset(hv.h, 0x3c, host_bytes);
    for (i = 0; i < n_kv * k; ++i) idx[i] = (int)rng_below(&rs, (uint32_t)s);
    for (i = 0; i < n_kv; ++i) qsort(idx + (long long)i * k, (size_t)k, sizeof(int), cmp_int);
    for (i = 0; i < n_blocks; ++i) { slots[i] = i; blocks[i] = i; }
    d_idx = dupload(idx, sizeof(int) * (size_t)n_kv * k);
    d_slots = dupload(slots, sizeof(int) * (size_t)n_blocks);
    d_blocks = dupload(blocks, sizeof(int) * (size_t)n_blocks);
    d_ck = dalloc(host_bytes);
    d_cv = dalloc(host_bytes);
    d_ok = dalloc(sizeof(float) * (size_t)n_kv * k * d_h);
    d_ov = dalloc(sizeof(float) * (size_t)n_kv * k * d_h);
    d_copy = dalloc(copy_bytes);
    k_cache_fill(n_kv, d_blocks, d_slots, 0, n_blocks, block_tokens, s, hk.d, hv.d,
                 (long long)s * d_h, d_h, 1, d_h, d_ck, d_cv, (long long)s * d_h);
    CU(A.cuEventCreate(&e0, PQC__CU_EVENT_DEFAULT));
    CU(A.cuEventCreate(&e1, PQC__CU_EVENT_DEFAULT));
    for (rep = -2; rep < BENCH_REPS; ++rep) {
        float a;
        /* every row a miss: read from mapped pinned host memory */
        CU(A.cuEventRecord(e0, S));
        k_gather(n_kv, d_idx, k, k, 0, 0, block_tokens, 0, 0, 0, 1, hk.d, hv.d,
                 (long long)s * d_h, d_h, 1, d_h, d_ok, d_ov, (long long)k * d_h, 0);
        CU(A.cuEventRecord(e1, S));
        CU(A.cuEventSynchronize(e1));
        CU(A.cuEventElapsedTime(&a, e0, e1));
        if (rep >= 0) tm[rep] = a;
        /* every row a hit: read from the device block cache */
        CU(A.cuEventRecord(e0, S));
        k_gather(n_kv, d_idx, k, k, d_slots, 0, block_tokens, d_ck, d_cv, (long long)s * d_h, 1,
                 hk.d, hv.d, (long long)s * d_h, d_h, 1, d_h, d_ok, d_ov, (long long)k * d_h, 0);
        CU(A.cuEventRecord(e1, S));
        CU(A.cuEventSynchronize(e1));
        CU(A.cuEventElapsedTime(&a, e0, e1));
        if (rep >= 0) th[rep] = a;
        /* reference: one bulk pinned host -> device copy */
        CU(A.cuEventRecord(e0, S));
        CU(A.cuMemcpyHtoDAsync_v2(d_copy, hk.h, copy_bytes, S));
        CU(A.cuEventRecord(e1, S));
        CU(A.cuEventSynchronize(e1));
        CU(A.cuEventElapsedTime(&a, e0, e1));
        if (rep >= 0) tc[rep] = a;
    }
    row->s = s;
    row->k = k;
    row->miss_us = median(tm, BENCH_REPS) * 1000.0f;
    row->hit_us = median(th, BENCH_REPS) * 1000.0f;
    row->miss_gbs = (float)(bytes / (row->miss_us * 1e3));
    row->hit_gbs = (float)(bytes / (row->hit_us * 1e3));
    row->memcpy_gbs = (float)((double)copy_bytes / (median(tc, BENCH_REPS) * 1e6));
    A.cuEventDestroy_v2(e0);
    A.cuEventDestroy_v2(e1);
    dfree(d_idx); dfree(d_slots); dfree(d_blocks); dfree(d_ck); dfree(d_cv); dfree(d_ok);
    dfree(d_ov); dfree(d_copy);
    mapped_free(hk);
    mapped_free(hv);
    free(idx); free(slots); free(blocks);
}

/* k-means assignment through the library: a CUDA runtime times its kernel and its
   cuBLASLt GEMM path the first time it meets a shape class (4 Lloyd steps, the faster
   of two runs each) and keeps the faster; this reports those figures */
typedef struct { int n, d, k, measured, gemm; float ms_kernel, ms_gemm; char note[120]; } km_row;

static void bench_kmeans(pqc_runtime *rt, int n, int d, int k, km_row *row)
{
    uint64_t rs = g_seed ^ 4242u;
    float *x = (float *)xmalloc(sizeof(float) * (size_t)n * d);
    float *c = (float *)xmalloc(sizeof(float) * (size_t)k * d);
    pqc__km_class cls;
    char err[256];
    pqc_result r;
    int i;
    memset(row, 0, sizeof *row);
    row->n = n;
    row->d = d;
    row->k = k;
    for (i = 0; i < n * d; ++i) x[i] = rng_gauss(&rs) + (float)((i / d) % 7);
    for (i = 0; i < k; ++i) memcpy(c + (size_t)i * d, x + (size_t)((i * 131) % n) * d, sizeof(float) * (size_t)d);
    r = pqc__cuda_lloyd(rt, x, (size_t)n, d, k, 4, c, NULL, err, sizeof err);
    if (r != PQC_SUCCESS) {
        report(0, "kmeans bench", err);
    } else if (pqc__cuda_kmeans_choice(rt, (size_t)n, d, k, &cls)) {
        row->measured = 1;
        row->gemm = cls.gemm;
        row->ms_kernel = cls.ms_kernel;
        row->ms_gemm = cls.ms_gemm;
    } else {
        snprintf(row->note, sizeof row->note, "not measured (PQC_KMEANS_GEMM set, or no cuBLASLt)");
    }
    free(x);
    free(c);
}

/* The lookup tables of a batch of sequences: pqc_batch_select over ns sequences on one
   CUDA runtime (one layer, 8 KV heads x 4 query heads, d_h 128, m 2, 8 bits). The
   runtime times the table kernel against one pointer-array cuBLASLt matmul for the
   whole batch on the first four batches of the shape class and keeps the faster; this
   reports those figures and the batch's select time afterwards (median, wall clock:
   each sequence's select reads its top-k back). */
typedef struct { int ns, measured, gemm; float ms_kernel, ms_gemm; double batch_us; char note[120]; } lb_row;

static double wall_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void bench_lut_batch(pqc_runtime *rt, int ns, lb_row *row)
{
    enum { HKV = 8, HQ = 32, DH = 128 };
    size_t n = g_quick ? 1024 : 4096, i;
    uint64_t rs = g_seed ^ 777u, gb = 0, kb = 0;
    pqc_cache_desc cd;
    pqc_cache **cs = (pqc_cache **)xmalloc(sizeof(pqc_cache *) * (size_t)ns);
    pqc_selection *sel = (pqc_selection *)xmalloc(sizeof(pqc_selection) * (size_t)ns);
    pqc_selection **ps = (pqc_selection **)xmalloc(sizeof(pqc_selection *) * (size_t)ns);
    const float **qs = (const float **)xmalloc(sizeof(float *) * (size_t)ns);
    float *kv = (float *)xmalloc(sizeof(float) * n * HKV * DH), *q = (float *)xmalloc(sizeof(float) * (size_t)ns * HQ * DH);
    float t[BENCH_REPS];
    pqc__batch_class cls;
    pqc_matrix km;
    int s, rep, made = 0, ok = 1;
    memset(row, 0, sizeof *row);
    memset(&cls, 0, sizeof cls);
    row->ns = ns;
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 1;
    cd.n_kv_heads = HKV;
    cd.n_q_heads = HQ;
    cd.head_dim = DH;
    cd.max_tokens = n + 16;
    cd.n_sink = 16;
    cd.budget_ratio = 0.1;
    cd.block_tokens = 32;
    cd.cache_blocks = 16;
    cd.pq.m = 2;
    cd.pq.bits = 8;
    cd.pq.iters = 4;
    for (i = 0; i < n * HKV * DH; ++i) kv[i] = rng_gauss(&rs);
    for (i = 0; i < (size_t)ns * HQ * DH; ++i) q[i] = rng_gauss(&rs);
    km = pqc_matrix_f32(kv, n, (size_t)HKV * DH);
    for (s = 0; s < ns && ok; ++s, ++made) {
        ok = pqc_cache_create(rt, &cd, &cs[s]) == PQC_SUCCESS;
        if (ok) ok = pqc_selection_init(cs[s], &sel[s]) == PQC_SUCCESS;
        else cs[s] = NULL, --made;
        if (ok) ok = pqc_cache_prefill(cs[s], 0, &km, &km) == PQC_SUCCESS && pqc_cache_sync(cs[s]) == PQC_SUCCESS;
        ps[s] = &sel[s];
        qs[s] = q + (size_t)s * HQ * DH;
    }
    for (rep = 0; rep < 4 + BENCH_REPS && ok; ++rep) {
        double t0 = wall_s();
        ok = pqc_batch_select(cs, ns, 0, qs, ps) == PQC_SUCCESS;
        if (rep >= 4) t[rep - 4] = (float)(wall_s() - t0);
    }
    if (!ok) {
        char msg[300];
        snprintf(msg, sizeof msg, "%d sequences: %.250s", ns, pqc_last_error());
        report(0, "batched tables bench", msg);
    } else {
        row->batch_us = 1e6 * median(t, BENCH_REPS);
        if (pqc__cuda_lut_choice(rt, HQ / HKV, DH / 2, 256, (size_t)ns * HKV * 2, &cls, &gb, &kb) && cls.tries == 4 &&
            !cls.failed) {
            row->measured = 1;
            row->gemm = cls.gemm;
            row->ms_kernel = cls.ms[0] < cls.ms[2] ? cls.ms[0] : cls.ms[2];
            row->ms_gemm = cls.ms[1] < cls.ms[3] ? cls.ms[1] : cls.ms[3];
        } else {
            snprintf(row->note, sizeof row->note, "not measured (PQC_LUT_GEMM set, no cuBLASLt, or a matmul failed)");
        }
    }
    for (s = 0; s < made; ++s) {
        pqc_selection_free(&sel[s]);
        pqc_cache_destroy(cs[s]);
    }
    free(cs);
    free(sel);
    free(ps);
    free(qs);
    free(kv);
    free(q);
}

/* ------------------------------------------------------------------------------------ */
/* Main                                                                                 */
/* ------------------------------------------------------------------------------------ */

static void *h_alloc(size_t n, void *u) { (void)u; return malloc(n); }
static void h_free(void *p, void *u) { (void)u; free(p); }
static const char *h_getenv(const char *n, void *u) { (void)u; return getenv(n); }
static int h_mkdir(const char *p, void *u)
{
    (void)u;
    return mkdir(p, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

int main(int argc, char **argv)
{
    pqc__cuHost host;
    pqc__cuModule mod = NULL;
    char log[8192];
    int st, i, from_cache = 0;
    sel_row rows[8];
    int n_rows = 0;
    gather_row grow;
    km_row krows[4];
    int n_krows = 0;
    lb_row lrows[2];
    int n_lrows = 0;
    char km_note[700] = "";

    for (i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "-v")) g_verbose = 1;
        else if (!strcmp(argv[i], "--quick")) g_quick = 1;
        else if (!strcmp(argv[i], "--no-bench")) g_bench = 0;
        else if (!strcmp(argv[i], "--no-blaslt")) g_blaslt = 0;
        else if (!strcmp(argv[i], "--cache") && i + 1 < argc) g_cache = argv[++i];
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) g_seed = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: %s [-v] [--quick] [--no-bench] [--no-blaslt] [--cache DIR] "
                            "[--seed N]\n", argv[0]);
            return 2;
        }
    }

    host.alloc = h_alloc;
    host.free = h_free;
    host.get_env = h_getenv;
    host.make_dir = h_mkdir;
    host.user = NULL;
    pqc__cu_api_init(&A, &host);
    st = pqc__cu_load(&A, g_blaslt);
    if (st != PQC__CU_OK) {
        printf("gpu_check needs an NVIDIA GPU with its driver: %s\n", A.msg);
        return 2;
    }
    st = pqc__cu_device_open(&A, 0, &D);
    if (st != PQC__CU_OK) {
        printf("gpu_check needs an NVIDIA GPU with its driver: %s\n", A.msg);
        return 2;
    }
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB, driver %d, NVRTC %d.%d from %s%s%s\n",
           D.name, D.cc_major, D.cc_minor, D.sm_count, (double)D.total_mem / (1 << 30),
           A.driver_version, A.nvrtc_major, A.nvrtc_minor, A.nvrtc_path,
           A.lib_blaslt ? ", cuBLASLt " : "", A.lib_blaslt ? A.blaslt_path : "");
    if (!D.can_map_host) printf("note: device cannot map host memory; gather checks will fail\n");

    /* compile (or load from the cache), twice: the second must come from the cache */
    {
        int pass;
        for (pass = 0; pass < 2; ++pass) {
            st = pqc__cu_build_module(&A, &D, pqc__kernel_source, g_cache, &mod, &from_cache,
                                      log, sizeof(log));
            if (st != PQC__CU_OK) {
                printf("FAIL build module: %s\n%s\n", A.msg, log);
                ++g_failed;
                summary_line();
                return 1;
            }
            if (log[0]) printf("NVRTC log:\n%s\n", log);
            if (pass == 0) {
                printf("kernels: %s (cache %s)\n", from_cache ? "loaded from the disk cache"
                                                              : "compiled with NVRTC", g_cache);
                CU(A.cuModuleUnload(mod));
            }
        }
        report(strcmp(g_cache, "-") == 0 || from_cache, "module cache",
               from_cache ? "second build served from the disk cache" : "cache disabled or unwritable");
    }
    st = pqc__cu_get_functions(&A, mod, knames, F, K_N);
    if (st != PQC__CU_OK) fatal(A.msg);
    if (D.smem_optin - 8192 > 49152) { /* dynamic + static shared memory must fit the opt-in */
        CU(A.cuFuncSetAttribute(F[K_SCAN], PQC__CU_FUNC_ATTR_MAX_DYNAMIC_SMEM, D.smem_optin - 8192));
        CU(A.cuFuncSetAttribute(F[K_STATS], PQC__CU_FUNC_ATTR_MAX_DYNAMIC_SMEM, D.smem_optin - 8192));
    }
    CU(A.cuStreamCreate(&S, PQC__CU_STREAM_NON_BLOCKING));

    /* ---- correctness ---- */
    {
        static const scan_case full[] = {
            { 2, 4, 2, 8, 64, 70001, 7000, 0, 0 },
            { 3, 7, 4, 6, 32, 4099, 820, 0, 0 },
            { 1, 1, 1, 1, 128, 1000, 100, 0, 0 },
            { 2, 9, 8, 4, 16, 5000, 1000, 0, 0 },
            { 2, 4, 16, 8, 8, 3000, 600, 0, 0 },   /* 64 KiB of tables: opt-in shared memory */
            { 2, 4, 16, 8, 8, 3000, 600, 0, 1 },   /* tables read from global memory */
            { 2, 4, 4, 8, 32, 9000, 900, 1, 0 },   /* every token the same code: all ties */
            { 2, 4, 4, 3, 32, 9001, 1801, 2, 0 },  /* periodic codes: many ties */
            { 1, 4, 2, 8, 64, 1, 1, 0, 0 },        /* a single token */
            { 1, 4, 2, 8, 64, 300, 400, 0, 0 }     /* k > s */
        };
        static const scan_case quick[] = {
            { 2, 4, 2, 8, 64, 3001, 300, 0, 0 },
            { 2, 9, 4, 5, 32, 1500, 300, 0, 0 },
            { 1, 2, 16, 8, 8, 900, 90, 0, 0 },
            { 1, 2, 16, 8, 8, 900, 90, 0, 1 },
            { 2, 4, 4, 8, 32, 2000, 200, 1, 0 },
            { 1, 4, 4, 3, 32, 2001, 401, 2, 0 },
            { 1, 4, 2, 8, 64, 1, 1, 0, 0 },
            { 1, 4, 2, 8, 64, 300, 400, 0, 0 }
        };
        const scan_case *cases = g_quick ? quick : full;
        int nc = g_quick ? (int)(sizeof(quick) / sizeof(quick[0]))
                         : (int)(sizeof(full) / sizeof(full[0]));
        for (i = 0; i < nc; ++i) check_scan_case(&cases[i]);
    }
    {
        int kind;
        int big = g_quick ? 20000 : (1 << 20);
        for (kind = 0; kind < 6; ++kind) {
            check_topk_case(2, g_quick ? 5000 : 131072, g_quick ? 500 : 13107, kind);
            check_topk_case(1, 4097, 1, kind);
        }
        check_topk_case(1, big, big / 5, 0);      /* k = s/5 at 1M tokens */
        check_topk_case(1, big, big / 10, 1);
        check_topk_case(3, 4096, 4096, 0);        /* k = s */
        check_topk_case(1, 4095, 4094, 3);        /* k = s - 1 */
        check_topk_case(2, 1, 1, 0);
        check_topk_case(1, 100, 0, 0);            /* k = 0 writes nothing */
    }
    {
        int dt;
        for (dt = 0; dt < 3; ++dt) {
            check_gather_case(dt, 128, 0, 1);
            check_gather_case(dt, 68, 1, 1);  /* odd row size (scalar path), interleaved */
            check_gather_case(dt, 128, 1, 0); /* no cache: every row from host memory */
        }
    }
    check_assign_case(8, 0, 1, 0);
    check_assign_case(8, 2, 0, 0);
    check_assign_case(6, 1, 1, 0);
    check_assign_case(5, 0, 0, 0);
    check_assign_case(6, 1, 2, 0);
    check_assign_case(8, 0, 2, 0);
    check_assign_case(3, 2, 1, 0);
    check_assign_case(1, 0, 1, 0);
    check_assign_case(6, 0, 1, 1);
    check_assign_case(6, 1, 2, 1);
    check_kmeans();
    if (g_blaslt) check_blaslt();

    /* ---- benchmarks ---- */
    if (g_bench) {
        static const int sizes[2] = { 32768, 131072 };
        int si, mi, mode;
        for (si = 0; si < 2; ++si)
            for (mi = 0; mi < 2; ++mi)
                for (mode = 1; mode >= 0; --mode)
                    bench_select(mode, mi == 0 ? 2 : 4, 8, g_quick ? sizes[si] / 8 : sizes[si],
                                 &rows[n_rows++]);
        bench_gather(&grow);
        {
            pqc_runtime_desc rd;
            pqc_runtime *rt = NULL;
            int ni, di;
            memset(&rd, 0, sizeof rd);
            rd.n_threads = 1;
            rd.backend = PQC_BACKEND_CUDA;
            rd.cuda_kernel_cache = strcmp(g_cache, "-") ? g_cache : NULL;
            if (pqc_runtime_create(&rd, &rt) != PQC_SUCCESS) {
                report(0, "kmeans bench runtime", pqc_last_error());
            } else {
                snprintf(km_note, sizeof km_note, "%s", pqc_runtime_backend_note(rt));
                for (ni = 0; ni < 2; ++ni)
                    for (di = 0; di < 2; ++di)
                        bench_kmeans(rt, g_quick ? (ni ? 1024 : 512) : (ni ? 131072 : 32768), di ? 128 : 64, 256,
                                     &krows[n_krows++]);
                for (ni = 0; ni < 2; ++ni)
                    bench_lut_batch(rt, g_quick ? (ni ? 4 : 2) : (ni ? 32 : 8), &lrows[n_lrows++]);
                pqc_runtime_destroy(rt);
                CU(A.cuCtxSetCurrent(D.ctx)); /* the runtime leaves no context current */
            }
        }

        printf("\n== decode-step selection per layer: 8 KV heads x 4 query heads, d_h 128, "
               "k = s/10, median of %d ==\n", BENCH_REPS);
        printf("%-12s %2s %2s %7s %6s %10s %10s %10s %14s\n", "GQA mode", "m", "b", "s", "k",
               "total_us", "lut+scan", "top-k", "ns/token/head");
        for (i = 0; i < n_rows; ++i)
            printf("%-12s %2d %2d %7d %6d %10.1f %10.1f %10.1f %14.3f\n", rows[i].mode, rows[i].m,
                   rows[i].b, rows[i].s, rows[i].k, rows[i].total_us, rows[i].scan_us,
                   rows[i].topk_us, rows[i].total_us * 1000.0 / ((double)rows[i].s * 8));
        printf("\n== K/V gather: 8 KV heads, s %d, k %d rows per head, fp16 K+V -> fp32 ==\n",
               grow.s, grow.k);
        printf("misses from mapped pinned host memory: %8.1f us  %7.2f GB/s\n", grow.miss_us,
               grow.miss_gbs);
        printf("hits from the device block cache:      %8.1f us  %7.2f GB/s\n", grow.hit_us,
               grow.hit_gbs);
        printf("cuMemcpyHtoD from pinned memory:                  %7.2f GB/s\n", grow.memcpy_gbs);
        printf("gather misses / pinned memcpy bandwidth:          %7.2f\n",
               grow.miss_gbs / grow.memcpy_gbs);
        printf("\n== k-means assignment step (one Lloyd step, as the library measures it: faster of 2) ==\n");
        if (km_note[0]) printf("runtime: %s\n", km_note);
        printf("%8s %4s %4s %12s %12s %8s  %s\n", "n", "d", "k", "kernel_ms", "gemm_ms", "speedup", "library uses");
        for (i = 0; i < n_krows; ++i) {
            if (!krows[i].measured) {
                printf("%8d %4d %4d  %s\n", krows[i].n, krows[i].d, krows[i].k, krows[i].note);
                continue;
            }
            printf("%8d %4d %4d %12.3f %12.3f %8.2f  %s\n", krows[i].n, krows[i].d, krows[i].k, krows[i].ms_kernel,
                   krows[i].ms_gemm, krows[i].ms_gemm > 0.0f ? krows[i].ms_kernel / krows[i].ms_gemm : 0.0,
                   krows[i].gemm ? "cuBLASLt GEMM + argmin" : "kernel");
        }
        printf("\n== lookup tables of a batch (pqc_batch_select; 8 KV x 4 query heads, d_h 128, m 2, 8 bits; "
               "as the library measures them: faster of 2) ==\n");
        printf("%5s %12s %12s %8s  %-24s %14s\n", "seqs", "kernel_ms", "gemm_ms", "speedup", "library uses",
               "batch_select_us");
        for (i = 0; i < n_lrows; ++i) {
            if (!lrows[i].measured) {
                printf("%5d  %s\n", lrows[i].ns, lrows[i].note);
                continue;
            }
            printf("%5d %12.4f %12.4f %8.2f  %-24s %14.1f\n", lrows[i].ns, lrows[i].ms_kernel, lrows[i].ms_gemm,
                   lrows[i].ms_gemm > 0.0f ? lrows[i].ms_kernel / lrows[i].ms_gemm : 0.0,
                   lrows[i].gemm ? "one cuBLASLt matmul" : "kernel per sequence", lrows[i].batch_us);
        }
        printf("\n== targets ==\n");
        for (i = 0; i < n_rows; ++i)
            if (rows[i].s == 131072)
                printf("select per layer at 128K, %-11s m=%d b=%d: %8.1f us  (target <= 50 us: %s)\n", rows[i].mode,
                       rows[i].m, rows[i].b, rows[i].total_us, rows[i].total_us <= 50.0f ? "met" : "NOT met");
        if (isfinite(grow.miss_gbs) && isfinite(grow.memcpy_gbs) && grow.memcpy_gbs > 0.0f)
            printf("miss gather at %.0f%% of pinned host-to-device bandwidth  (target >= 80%%: %s)\n",
                   100.0 * grow.miss_gbs / grow.memcpy_gbs, grow.miss_gbs >= 0.8f * grow.memcpy_gbs ? "met" : "NOT met");
        else
            printf("miss gather vs pinned bandwidth: no timing (the events measured nothing)\n");
        printf("\n");
    }

    CU(A.cuStreamDestroy_v2(S));
    CU(A.cuModuleUnload(mod));
    pqc__cu_device_close(&A, &D);
    pqc__cu_unload(&A);
    summary_line();
    return g_failed ? 1 : 0;
}
