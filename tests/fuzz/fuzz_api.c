/* fuzz_api.c - libFuzzer target for the public API of pqcache.h.

   The input is a small program: a header that configures the runtime and the allocator,
   then operations, each an opcode byte followed by the bytes its arguments are drawn
   from. Every argument comes from a table of ordinary values or, for a byte >= 224, a
   table of hostile ones (zero, negative, huge, NaN, Inf, sizes whose products overflow),
   so that most inputs stay on working paths while any field can turn hostile. Past the
   end of the input every byte reads as 0, the first ordinary value.

   Header: byte 0  runtime: bits 0-1 n_threads {-1, 0, 1, 2}; bits 2-3 submit hook
                   {none, none, refuses, runs inline}; bits 4-5 simd {auto, scalar, avx2,
                   avx512}; bit 6 hostile backend settings (and bit 7: an unknown simd)
           byte 1  allocator: bits 0-1 largest request {64 MiB, 1 MiB, 64 KiB, 4 KiB};
                   bits 2-3 injected failure {none, the Nth request, every request from
                   the Nth on, none} (only without worker threads, where the order of
                   requests is fixed)
           byte 2  N;  bytes 3-4  data seed
   Operations: see fz_ops[] at the end.

   Checks (a violation prints "FUZZ CHECK FAILED" and aborts, so libFuzzer keeps the input):
   - a result is PQC_SUCCESS or a negative pqc_result; a failure sets pqc_last_error()
     to a message of its own (a known message is planted before each call);
   - a failed call leaves its objects as they were: tokens of every layer, the window and
     the layer's counters of a cache; the counts of a selection; a scheduler's fit; the
     count and capacity of codes; the output of pqc_pq_train and pqc_cache_create;
   - a call the documentation says must fail (null pointer, unknown dtype, bad shape,
     NaN or Inf, layer out of range, a prompt beyond max_tokens, a selection that is
     unsorted, out of range or larger than its capacity, a size that cannot be allocated)
     fails, and a valid call succeeds unless an allocation failed earlier in the input;
   - results hold: stored rows equal the input rounded to the storage dtype; a selection
     is ascending and holds the sinks and the window; fetched rows equal the stored rows;
     top-k equals a reference top-k of the scores the library reports; PQ training,
     encoding and search give the same bits on the runtime as with rt = NULL (scalar
     kernels); a scheduler's fit stays finite and its iteration counts in range.

   Set FUZZ_API_TRACE=1 to see every operation and checked call of an input on stderr.

   Every allocation of the library goes through a counting allocator: the runtime's
   allocator and, through PQC_MALLOC / PQC_FREE, the default one. It refuses requests
   above a limit drawn from the input, so a hostile size ends as PQC_ERROR_OUT_OF_MEMORY
   instead of a real allocation, and it can fail chosen requests to exercise the
   out-of-memory paths. Sizes the target builds itself are bounded so that one input
   runs in milliseconds. */
#define _POSIX_C_SOURCE 200809L
#include <stddef.h>

static void *fz_dmalloc(size_t n, void *ctx);
static void fz_dfree(void *p, void *ctx);
#define PQC_MALLOC(sz, ctx) fz_dmalloc((sz), (ctx))
#define PQC_FREE(p, ctx) fz_dfree((p), (ctx))
#define PQCACHE_IMPLEMENTATION
#include "../../pqcache.h"
#include "fuzz_util.h"

#include <float.h>
#include <limits.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ---------------------------------------------------------------------------------------
   Bounds of what the target builds itself
   ------------------------------------------------------------------------------------- */
#define FZ_MAX_FLOATS ((size_t)1 << 18)       /* one buffer                           */
#define FZ_MAX_LAYER_FLOATS ((size_t)1 << 17) /* stored elements per layer (K)         */
#define FZ_MAX_BUILD_WORK 4e7                  /* tokens x dims x centroids x iterations */
#define FZ_MAX_TOKENS ((size_t)4096)          /* tokens per layer                     */
#define FZ_MAX_OPS 160
#define FZ_MAX_SEL_CAP ((size_t)8192) /* capacity of a hand-made selection            */
#define FZ_LIVE_LIMIT ((size_t)192 << 20)

/* ---------------------------------------------------------------------------------------
   Failure reports
   ------------------------------------------------------------------------------------- */
static void fz_fail(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "FUZZ CHECK FAILED: fuzz_api: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (last error: \"%s\")\n", pqc_last_error());
    abort();
}

/* ---------------------------------------------------------------------------------------
   The counting allocator
   ------------------------------------------------------------------------------------- */
typedef struct fz_heap {
    pthread_mutex_t mu;
    size_t live;            /* bytes held                                      */
    size_t limit_one;       /* largest request granted                         */
    unsigned long calls;    /* requests in this input                          */
    unsigned long fail_at;  /* injected failure: request number (1-based)      */
    int fail_mode;          /* 0 none, 1 that request, 2 every one from it on   */
    unsigned long failures; /* requests refused in this input                  */
} fz_heap;

static fz_heap g_heap = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0};

static void *fz_heap_alloc(size_t n)
{
    void *p = NULL;
    int refuse;
    pthread_mutex_lock(&g_heap.mu);
    g_heap.calls++;
    refuse = n > g_heap.limit_one || g_heap.live > FZ_LIVE_LIMIT || n > FZ_LIVE_LIMIT - g_heap.live ||
             (g_heap.fail_mode == 1 && g_heap.calls == g_heap.fail_at) ||
             (g_heap.fail_mode == 2 && g_heap.calls >= g_heap.fail_at);
    if (!refuse) {
        p = malloc(n ? n : 1);
        if (p) g_heap.live += malloc_usable_size(p);
    }
    if (!p) g_heap.failures++;
    pthread_mutex_unlock(&g_heap.mu);
    return p;
}

static void fz_heap_free(void *p)
{
    if (!p) return;
    pthread_mutex_lock(&g_heap.mu);
    g_heap.live -= malloc_usable_size(p);
    pthread_mutex_unlock(&g_heap.mu);
    free(p);
}

static unsigned long fz_heap_failures(void)
{
    unsigned long f;
    pthread_mutex_lock(&g_heap.mu);
    f = g_heap.failures;
    pthread_mutex_unlock(&g_heap.mu);
    return f;
}

static void *fz_dmalloc(size_t n, void *ctx)
{
    (void)ctx;
    return fz_heap_alloc(n);
}
static void fz_dfree(void *p, void *ctx)
{
    (void)ctx;
    fz_heap_free(p);
}
static void *fz_ralloc(size_t n, void *user)
{
    (void)user;
    return fz_heap_alloc(n);
}
static void fz_rfree(void *p, void *user)
{
    (void)user;
    fz_heap_free(p);
}

static pqc_allocator g_alloc = {fz_ralloc, fz_rfree, &g_heap};

/* device tiers for pqc_cache_desc.backend */
static void *fzb_alloc(void *ctx, size_t n)
{
    (void)ctx;
    return fz_heap_alloc(n);
}
static void *fzb_alloc_none(void *ctx, size_t n)
{
    (void)ctx;
    (void)n;
    return NULL;
}
static void fzb_free(void *ctx, void *p)
{
    (void)ctx;
    fz_heap_free(p);
}
static int fzb_copy(void *ctx, void *dst, const void *src, size_t n)
{
    (void)ctx;
    memcpy(dst, src, n);
    return 0;
}
static int fzb_sync(void *ctx)
{
    (void)ctx;
    return 0;
}
static pqc_backend g_be_cpu, g_be_own, g_be_nocopy, g_be_noalloc;

/* engine pools for pqc_runtime_desc.submit */
static int fz_submit_refuse(void *user, void (*fn)(void *), void *arg)
{
    (void)user;
    (void)fn;
    (void)arg;
    return 1;
}
static int fz_submit_inline(void *user, void (*fn)(void *), void *arg)
{
    (void)user;
    fn(arg);
    return 0;
}

/* ---------------------------------------------------------------------------------------
   Input reader and value tables
   ------------------------------------------------------------------------------------- */
typedef struct fz {
    const uint8_t *p;
    size_t n, i;
} fz;

static unsigned rd8(fz *f) { return f->i < f->n ? f->p[f->i++] : 0u; }
static unsigned rd16(fz *f)
{
    unsigned a = rd8(f);
    return a | rd8(f) << 8;
}
static int fz_more(const fz *f) { return f->i < f->n; }

#define NT(t) (sizeof(t) / sizeof((t)[0]))
#define HOSTILE 224u
/* set while an operation draws only ordinary values (a desc with many fields would
   otherwise rarely be valid as a whole) */
static int g_ordinary;
static int pick_i(fz *f, const int *ok, size_t nok, const int *bad, size_t nbad)
{
    unsigned b = rd8(f);
    return b < HOSTILE || g_ordinary ? ok[b % nok] : bad[(b - HOSTILE) % nbad];
}
static size_t pick_z(fz *f, const size_t *ok, size_t nok, const size_t *bad, size_t nbad)
{
    unsigned b = rd8(f);
    return b < HOSTILE || g_ordinary ? ok[b % nok] : bad[(b - HOSTILE) % nbad];
}
static double pick_d(fz *f, const double *ok, size_t nok, const double *bad, size_t nbad)
{
    unsigned b = rd8(f);
    return b < HOSTILE || g_ordinary ? ok[b % nok] : bad[(b - HOSTILE) % nbad];
}
#define PICK_I(f, t) pick_i((f), t, NT(t), t##_bad, NT(t##_bad))
#define PICK_Z(f, t) pick_z((f), t, NT(t), t##_bad, NT(t##_bad))
#define PICK_D(f, t) pick_d((f), t, NT(t), t##_bad, NT(t##_bad))

#define ZMAX ((size_t)-1)
static const int t_layers[] = {1, 2, 3, 1};
static const int t_layers_bad[] = {0, -1, 4096, 4097, INT_MAX, INT_MIN, 64};
static const int t_kvh[] = {1, 2, 4, 3};
static const int t_kvh_bad[] = {0, -1, 64, 65, 4096, 4097, INT_MAX};
static const int t_group[] = {1, 2, 4, 3};
static const int t_group_bad[] = {0, -1, 3, INT_MAX, 1 << 20, 4096}; /* raw n_q_heads */
static const int t_dim[] = {8, 4, 16, 32, 2, 1, 64, 6, 12, 128};
static const int t_dim_bad[] = {0, -1, 65536, 65537, INT_MAX, 257, 1024, 4096};
static const int t_dtype[] = {PQC_F32, PQC_F16, PQC_BF16};
static const int t_dtype_bad[] = {3, -1, 100};
static const size_t t_maxt[] = {4096, 0, 300, 1000, 64, 100, 17, 2048};
static const size_t t_maxt_bad[] = {1, 2, 5, 31, 0xfffffff0u, 0xfffffff1u, ZMAX, (size_t)1 << 28};
static const int t_sink[] = {0, 4, -1, 1, 8, 16};
static const int t_sink_bad[] = {INT_MAX, 1000, 4096, 65536, INT_MIN, 255, 256, 257};
static const int t_window[] = {0, 4, 8, 16, 1, 32};
static const int t_window_bad[] = {-1, INT_MAX, 100000, INT_MIN};
static const double t_ratio[] = {0, 0.1, 0.5, 1, 0.25, 2};
static const double t_ratio_bad[] = {NAN, INFINITY, -INFINITY, 1e300, -1, 1e6, 1000001, 1e-300, 4.9e-324, -0.0};
static const size_t t_budget[] = {0, 0, 16, 64, 5, 1000};
static const size_t t_budget_bad[] = {ZMAX, ZMAX / 2, (size_t)1 << 31, 0xffffffffu, (size_t)1 << 53, 1, ZMAX - 1};
static const double t_share[] = {0, 0.5, 0.25, 1, 0.1};
static const double t_share_bad[] = {NAN, -0.1, 1.0000001, INFINITY, 1e-300, -INFINITY};
static const int t_m[] = {0, 1, 2, 4};
static const int t_m_bad[] = {-1, 3, 5, INT_MAX, INT_MIN, 65536};
static const int t_bits[] = {0, 4, 2, 1, 8, 3};
static const int t_bits_bad[] = {9, -1, 32, INT_MAX};
static const int t_iters[] = {1, 2, 3, -1, 0};
static const int t_iters_bad[] = {100001, INT_MAX, INT_MIN, 40};
static const int t_init[] = {PQC_INIT_KMEANSPP, PQC_INIT_RANDOM};
static const int t_init_bad[] = {2, -1};
static const int t_mppc[] = {0, -1, 1, 4};
static const int t_mppc_bad[] = {-2, INT_MAX, INT_MIN};
static const int t_device[] = {0};
static const int t_device_bad[] = {1, 2, -1};
static const int t_bt[] = {0, 4, 16, 1, 3, 64};
static const int t_bt_bad[] = {-1, INT_MAX, 1 << 20, 65536, INT_MIN, 1 << 30};
static const int t_blocks[] = {0, 2, 4, -1, 1, 8};
static const int t_blocks_bad[] = {INT_MAX, 1 << 20, 65536, -2, INT_MIN, 1 << 15, 1 << 16};
static const int t_admit[] = {0, 1, 2};
static const int t_admit_bad[] = {-1, INT_MAX, 100};
static const int t_policy[] = {PQC_POLICY_LFU, PQC_POLICY_LRU};
static const int t_gqa[] = {PQC_GQA_SOFTMAX_SUM, PQC_GQA_SUM};
static const int t_gqa_bad[] = {2, -1};
static const int t_policy_bad[] = {2, -1};
static const double t_rebuild[] = {0, 0.5, 0.1, 1, 2};
static const double t_rebuild_bad[] = {NAN, -1, INFINITY, 1e-300, -0.0};
static const int t_resident[] = {0};
static const int t_resident_bad[] = {1, 2, -1};
static const int t_metric[] = {PQC_METRIC_QUERY, PQC_METRIC_L2, PQC_METRIC_QUERY_DIAG};
static const int t_metric_bad[] = {3, -1, INT_MAX};
static const double t_mfloor[] = {0, 0.01, 1, 1e-6, 1e6};
static const double t_mfloor_bad[] = {-1, NAN, INFINITY, 1e7, -1e-300, 1e-13};
static const int t_observe[] = {0, 1, 4, -1};
static const int t_split[] = {PQC_SPLIT_ADAPTIVE, PQC_SPLIT_FIXED, PQC_SPLIT_COMPETE, PQC_SPLIT_FIXED_COMPETE};
static const int t_split_bad[] = {4, -1};
static const int t_observe_bad[] = {INT_MAX, INT_MIN}; /* both valid: all, none */
static const int t_rope[] = {PQC_ROPE_NONE, PQC_ROPE_HALF, PQC_ROPE_INTERLEAVED, PQC_ROPE_NONE};
static const int t_rope_bad[] = {3, -1};
static const int t_subsp[] = {PQC_SUBSPACES_DEFAULT, PQC_SUBSPACES_ROPE_BANDS, PQC_SUBSPACES_CONTIGUOUS};
static const int t_subsp_bad[] = {3, -1};
static const double t_rerank[] = {0, 2, 1, 1e6, -1};
static const double t_rerank_bad[] = {0.5, -1, NAN, INFINITY, 2e6};
static const int t_outl[] = {0, 4, 1, 64};
static const int t_outl_bad[] = {-1, INT_MAX, INT_MIN};
static const double t_resw[] = {0, 0.15, 1, 1e6};
static const double t_resw_bad[] = {-0.1, NAN, INFINITY, 2e6, 1e-300};
static const float t_smscale[] = {0.0625f, 0.5f, 1.0f, 4.0f};
static const float t_smscale_bad[] = {-1.0f, NAN, INFINITY, 2e6f};

/* what the documentation says about a pq desc's RoPE layout and sub-spaces: 1 = refused */
/* the library's default m for a key of dim dimensions: dim / 32, at least PQC_DEFAULT_M,
   where it divides them (d_h / 2 for rope bands), else PQC_DEFAULT_M, 2 or 1, the first
   that divides them */
static int fz_default_m(long long dim, int subspaces)
{
    long long need = subspaces == PQC_SUBSPACES_ROPE_BANDS && dim % 2 == 0 ? dim / 2 : dim;
    long long wide = dim / 32 > PQC_DEFAULT_M ? dim / 32 : PQC_DEFAULT_M; /* d_h/32, at least the default */
    return need > 0 && need % wide == 0 ? (int)wide
         : need > 0 && need % PQC_DEFAULT_M == 0 ? PQC_DEFAULT_M : need > 0 && need % 2 == 0 ? 2 : 1;
}

static int fz_rope_bad(int rope, int subsp, long long dim, int m_eff)
{
    if (rope < 0 || rope > 2 || subsp < 0 || subsp > 2) return 1; /* 0: bands where they fit, else contiguous */
    if (rope != PQC_ROPE_NONE && dim > 0 && dim % 2) return 1;
    if (subsp == PQC_SUBSPACES_ROPE_BANDS && (rope == PQC_ROPE_NONE || (m_eff > 0 && dim > 0 && (dim / 2) % m_eff)))
        return 1;
    return 0;
}
static const size_t t_rows[] = {16, 1, 2, 3, 5, 8, 31, 32, 33, 64, 65, 100, 128, 129, 200, 256, 300, 500, 70, 40};
static const size_t t_rows_bad[] = {0};
static const float t_special[] = {NAN, INFINITY, -INFINITY, 1e30f, 70000.0f, -70000.0f, 65504.0f, 65520.0f,
                                  1e16f, 2e16f, 1e-45f, -0.0f, FLT_MAX, 3e38f, 1e17f, 65519.0f, 9.99e15f, -1e16f};
static const float t_scale[] = {1.0f, 0.001f, 100.0f, 1e4f, 1e-30f, 3e15f};

/* ---------------------------------------------------------------------------------------
   Deterministic values
   ------------------------------------------------------------------------------------- */
static uint64_t fz_mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float fz_unit(uint64_t *s) { return (float)(fz_mix(s) >> 40) * (1.0f / 16777216.0f) * 4.0f - 2.0f; }

static size_t fz_dsize(int dt) { return dt == PQC_F32 ? 4 : (dt == PQC_F16 || dt == PQC_BF16) ? 2 : 0; }

static void fz_put(unsigned char *p, int dt, float v)
{
    if (dt == PQC_F16) {
        uint16_t h = pqc_f32_to_f16(v);
        memcpy(p, &h, 2);
    } else if (dt == PQC_BF16) {
        uint16_t h = pqc_f32_to_bf16(v);
        memcpy(p, &h, 2);
    } else {
        memcpy(p, &v, 4);
    }
}
static float fz_get(const unsigned char *p, int dt)
{
    uint16_t h;
    float v;
    if (dt == PQC_F32) {
        memcpy(&v, p, 4);
        return v;
    }
    memcpy(&h, p, 2);
    return dt == PQC_F16 ? pqc_f16_to_f32(h) : pqc_bf16_to_f32(h);
}
/* x as the storage dtype holds it */
static float fz_round(float x, int st)
{
    if (st == PQC_F16) return pqc_f16_to_f32(pqc_f32_to_f16(x));
    if (st == PQC_BF16) return pqc_bf16_to_f32(pqc_f32_to_bf16(x));
    return x;
}
static int fz_same(float a, float b) { return !memcmp(&a, &b, sizeof a); }

/* a finite value above this magnitude may be refused by a store of dtype st (fp16 holds
   up to 65504; keys are limited to 1e16) */
static float fz_store_limit(int st) { return st == PQC_F16 ? 65504.0f : 1e16f; }

/* a bounded heap block of the target's own */
static void *fz_xalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "fuzz_api: out of memory for %zu bytes of the target's own\n", n);
        abort();
    }
    return p;
}

/* ---------------------------------------------------------------------------------------
   Matrices and float vectors drawn from the input
   ------------------------------------------------------------------------------------- */
typedef struct fz_mat {
    pqc_matrix m;
    unsigned char *buf;
    int bad;       /* a documented reason to fail: dtype, stride, null data, no rows  */
    int nonfinite; /* a NaN or Inf element                                            */
    int huge;      /* a finite element above 1e16 in magnitude                        */
    float maxabs;  /* the largest finite magnitude                                    */
} fz_mat;

static float fz_value(uint64_t *rng, unsigned pattern, float scale, size_t r, size_t c)
{
    switch (pattern % 6) {
    case 0: return fz_unit(rng) * scale;
    case 1: { /* four clusters with a little noise */
        uint64_t s = (uint64_t)(r % 4) * 1000003u + c;
        return (fz_unit(&s) + 0.01f * fz_unit(rng)) * scale;
    }
    case 2: return 0.0f;
    case 3: { /* identical rows */
        uint64_t s = c + 17;
        return fz_unit(&s) * scale;
    }
    case 4: return (float)((int)(fz_mix(rng) % 5) - 2); /* small integers: ties */
    default: return fz_unit(rng) * scale * (float)(r % 7 + 1);
    }
}

static void fz_mat_free(fz_mat *m) { free(m->buf); }

/* rows x cols; hostile: unknown dtype, a stride below the row size, null data */
static void fz_mat_gen(fz *f, uint64_t seed, size_t rows, size_t cols, int hostile, int only_f32, fz_mat *out)
{
    unsigned dsel = rd8(f), flags = rd8(f), vseed = rd8(f), nspec = rd8(f) % 4, i;
    int dt = only_f32 ? PQC_F32 : (dsel < HOSTILE || !hostile) ? t_dtype[dsel % 3] : t_dtype_bad[(dsel - HOSTILE) % 3];
    size_t es = fz_dsize(dt) ? fz_dsize(dt) : 4, rowb = cols * es, stride = 0, eff, bytes, r, c;
    uint64_t rng = seed ^ ((uint64_t)vseed * 0x2545F4914F6CDD1Dull);
    float scale = t_scale[(flags >> 5) % NT(t_scale)];
    memset(out, 0, sizeof *out);
    switch (flags & 7) {
    case 4: stride = rowb; break;
    case 5: stride = rowb + es * (1 + (flags >> 3 & 3)); break;
    case 6: stride = rowb + 1; break; /* rows at odd addresses */
    case 7:
        if (hostile && rowb > 1) {
            stride = rowb - 1;
            out->bad = 1;
        }
        break;
    default: break;
    }
    eff = stride ? stride : rowb;
    bytes = rows ? (rows - 1) * eff + rowb : 16;
    out->buf = (unsigned char *)fz_xalloc(bytes ? bytes : 1);
    memset(out->buf, 0, bytes ? bytes : 1);
    if (!fz_dsize(dt)) out->bad = 1;
    if (rows == 0) out->bad = 1;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++)
            fz_put(out->buf + r * eff + c * es, fz_dsize(dt) ? dt : PQC_F32, fz_value(&rng, flags >> 3, scale, r, c));
    for (i = 0; i < nspec; i++) {
        size_t rr = rd16(f), cc = rd16(f);
        float v = t_special[rd8(f) % NT(t_special)];
        if (rows && cols) fz_put(out->buf + (rr % rows) * eff + (cc % cols) * es, fz_dsize(dt) ? dt : PQC_F32, v);
    }
    if (fz_dsize(dt))
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c++) {
                float v = fz_get(out->buf + r * eff + c * es, dt);
                if (v != v || isinf(v)) out->nonfinite = 1;
                else if (fabsf(v) > out->maxabs) out->maxabs = fabsf(v);
            }
    out->huge = out->maxabs > 1e16f;
    out->m.data = out->buf;
    if (hostile && (flags & 0xf8) == 0xf8) {
        out->m.data = NULL;
        out->bad = 1;
    }
    out->m.dtype = (pqc_dtype)dt;
    out->m.rows = rows;
    out->m.cols = cols;
    out->m.row_stride = stride;
}

/* n fp32 values with a few specials; *nonfinite / *huge as for matrices; the largest
   finite magnitude goes to g_vec_maxabs */
static float g_vec_maxabs;
static float *fz_vec(fz *f, uint64_t seed, size_t n, int *nonfinite, int *huge)
{
    float *v = (float *)fz_xalloc(n * sizeof(float));
    unsigned pat = rd8(f), nspec = rd8(f) % 3, i;
    uint64_t rng = seed ^ ((uint64_t)pat * 0x9E3779B97F4A7C15ull);
    float scale = t_scale[(pat >> 3) % NT(t_scale)];
    size_t j;
    for (j = 0; j < n; j++) v[j] = fz_value(&rng, pat, scale, j / 8, j % 8);
    for (i = 0; i < nspec; i++) {
        size_t at = rd16(f);
        float x = t_special[rd8(f) % NT(t_special)];
        if (n) v[at % n] = x;
    }
    *nonfinite = *huge = 0;
    g_vec_maxabs = 0.0f;
    for (j = 0; j < n; j++) {
        if (v[j] != v[j] || isinf(v[j])) *nonfinite = 1;
        else if (fabsf(v[j]) > g_vec_maxabs) g_vec_maxabs = fabsf(v[j]);
    }
    *huge = g_vec_maxabs > 1e16f;
    return v;
}

/* ---------------------------------------------------------------------------------------
   State of one input
   ------------------------------------------------------------------------------------- */
typedef struct fz_sel {
    pqc_selection s;
    int kind; /* 0 none, 1 made by pqc_selection_init, 2 made here */
} fz_sel;

typedef struct fz_cache {
    pqc_cache *c;
    int rt_null;
    int L, H, Q, D;
    int st;
    size_t es, maxt, sink;
    int blocks, bt;
    int bits, iters; /* of the PQ builds, for bounding their work */
    int zero_copy;
    pqc_cache_desc d; /* as created (a loaded cache takes it) */
    fz_sel sel[2];
} fz_cache;

typedef struct fz_state {
    fz f;
    pqc_runtime *rt;
    uint64_t seed;
    fz_cache cache[2];
    pqc_scheduler *sched;
    int sched_tmin, sched_tmax;
    pqc_pq pq[2];
    pqc_codes codes[2];
    int codes_ok[2];
    pqc_scratch scratch;
    size_t *tok_before; /* scratch for snapshots, [4097] */
} fz_state;

/* A known message is planted before each call; a failing call must replace it. */
static char g_sentinel[2][600];
static int g_armed;
static void fz_arm_with(int which)
{
    if (which == 0) (void)pqc_topk(NULL, NULL, 0, 0, NULL, NULL, NULL);
    else (void)pqc_scheduler_add_kmeans(NULL, 1.0, 1, 1.0);
    g_armed = which;
}
static void fz_arm(void) { fz_arm_with(0); }

static int g_trace; /* FUZZ_API_TRACE set: every checked call and its result go to stderr */

static pqc_result fz_expect(pqc_result r, const char *call)
{
    const char *m;
    if (g_trace) fprintf(stderr, "  %s -> %d%s%s\n", call, (int)r, r ? ": " : "", r ? pqc_last_error() : "");
    if (r > 0 || r < PQC_ERROR_UNSUPPORTED) fz_fail("%s returned %d, which is no pqc_result", call, (int)r);
    if (r == PQC_SUCCESS) return r;
    m = pqc_last_error();
    if (!m || !*m) fz_fail("%s failed (%d) with an empty pqc_last_error()", call, (int)r);
    if (!strcmp(m, g_sentinel[g_armed])) fz_fail("%s failed (%d) without setting pqc_last_error()", call, (int)r);
    if (!pqc_result_description(r) || !*pqc_result_description(r)) fz_fail("no description of result %d", (int)r);
    return r;
}

/* Outcome rules: must_fail, or must succeed unless may_fail or an allocation failed. */
static void fz_outcome(pqc_result r, int must_fail, int may_fail, const char *call)
{
    if (r == PQC_SUCCESS && must_fail) fz_fail("%s succeeded on input it must reject", call);
    if (r != PQC_SUCCESS && !must_fail && !may_fail && fz_heap_failures() == 0)
        fz_fail("%s failed (%d) on valid input with no allocation failure", call, (int)r);
}

/* ----- cache snapshots: what a failed call must leave as it was ----- */
typedef struct fz_snap {
    int window;
    int layer;
    pqc_layer_stats st;
    int have_st;
    size_t *tok;
    int L;
} fz_snap;

static void fz_snap_take(fz_state *S, fz_cache *C, int layer, fz_snap *s)
{
    int l;
    s->window = pqc_cache_window(C->c);
    s->layer = layer;
    s->L = C->L;
    s->tok = S->tok_before;
    for (l = 0; l < C->L && l < 4097; l++) s->tok[l] = pqc_cache_tokens(C->c, l);
    s->have_st = layer >= 0 && layer < C->L && pqc_cache_stats(C->c, layer, &s->st) == PQC_SUCCESS;
}

static void fz_snap_check(fz_cache *C, const fz_snap *s, const char *call, pqc_result r)
{
    int l;
    pqc_layer_stats now;
    if (pqc_cache_window(C->c) != s->window) fz_fail("failed %s (%d) changed the window", call, (int)r);
    for (l = 0; l < s->L && l < 4097; l++)
        if (pqc_cache_tokens(C->c, l) != s->tok[l])
            fz_fail("failed %s (%d) changed the tokens of layer %d: %zu -> %zu", call, (int)r, l, s->tok[l],
                    pqc_cache_tokens(C->c, l));
    if (s->have_st && pqc_cache_stats(C->c, s->layer, &now) == PQC_SUCCESS) {
        if (now.selects != s->st.selects || now.fetches != s->st.fetches || now.hits != s->st.hits ||
            now.misses != s->st.misses || now.tokens_selected != s->st.tokens_selected)
            fz_fail("failed %s (%d) changed the counters of layer %d", call, (int)r, s->layer);
    }
}

/* the slot named; an empty one stands for the other, unless the byte is hostile */
static fz_cache *fz_pick_cache(fz_state *S)
{
    unsigned b = rd8(&S->f);
    fz_cache *C = &S->cache[b & 1];
    return C->c || b >= HOSTILE ? C : &S->cache[(b & 1) ^ 1];
}
static fz_cache *fz_pick_slot(fz_state *S) { return &S->cache[rd8(&S->f) & 1]; }

/* a layer of C; below 128 an empty layer stands for the next one holding tokens (an
   operation on an empty layer is mostly refused, and most inputs prefill few layers) */
static int fz_pick_layer_as(fz *f, const fz_cache *C, int any)
{
    static const int bad[] = {-1, INT_MAX, INT_MIN, 4096};
    unsigned b = rd8(f);
    if (b < HOSTILE) {
        int l = C->L > 0 ? (int)(b % (unsigned)C->L) : 0, i;
        if (b < 128 && C->c && !any)
            for (i = 0; i < C->L && i < 64; i++)
                if (pqc_cache_tokens(C->c, (l + i) % C->L) > 0) return (l + i) % C->L;
        return l;
    }
    if (b == HOSTILE) return C->L; /* one past the last */
    return bad[(b - HOSTILE) % NT(bad)];
}
static int fz_pick_layer(fz *f, const fz_cache *C) { return fz_pick_layer_as(f, C, 0); }

static int fz_layer_ok(const fz_cache *C, int layer) { return C->c && layer >= 0 && layer < C->L; }

/* 1 when a layer of `tokens` tokens is within the target's bounds, builds included */
static int fz_layer_fits(const fz_cache *C, size_t tokens)
{
    size_t cols = (size_t)C->H * (size_t)C->D;
    double work = (double)tokens * (double)cols * (double)(1 << C->bits) * (double)C->iters;
    if (tokens > FZ_MAX_TOKENS || (double)tokens * (double)cols > (double)FZ_MAX_LAYER_FLOATS) return 0;
    return tokens < 64 && tokens < ((size_t)1 << C->bits) + C->sink ? 1 : work <= FZ_MAX_BUILD_WORK;
}

/* ----- a cache's stored rows, as fp32 ----- */
/* The stored rows of one (layer, head), in one part or two (a fork's shared prefix,
   then its own rows), read through pqc_cache_kv_part. */
typedef struct fz_rows {
    const void *k[2], *v[2];
    size_t n0, n;
} fz_rows;

static void fz_rows_get(const fz_cache *C, int layer, int h, fz_rows *R)
{
    size_t n1 = 0;
    memset(R, 0, sizeof *R);
    R->n = pqc_cache_tokens(C->c, layer);
    fz_arm();
    if (fz_expect(pqc_cache_kv_part(C->c, layer, h, 0, &R->k[0], &R->v[0], &R->n0), "pqc_cache_kv_part") != PQC_SUCCESS ||
        (R->n0 < R->n &&
         fz_expect(pqc_cache_kv_part(C->c, layer, h, R->n0, &R->k[1], &R->v[1], &n1), "pqc_cache_kv_part") != PQC_SUCCESS))
        fz_fail("pqc_cache_kv_part failed on a valid head");
    if (R->n0 + n1 != R->n || (R->n0 < R->n && !n1)) fz_fail("pqc_cache_kv_part: parts of %zu + %zu rows for %zu", R->n0, n1, R->n);
}

/* element e of token t's K (which 0) or V (1) row */
static float fz_stored(const fz_cache *C, const fz_rows *R, int which, size_t t, size_t e)
{
    int p = t >= R->n0;
    const void *base = which ? R->v[p] : R->k[p];
    return fz_get((const unsigned char *)base + ((t - (p ? R->n0 : 0)) * (size_t)C->D + e) * C->es, C->st);
}

static void fz_check_fit_finite(fz_state *S, const char *after)
{
    pqc_scheduler_fit fit;
    if (!S->sched) return;
    fit = pqc_scheduler_get_fit(S->sched);
    if (!isfinite(fit.a1) || !isfinite(fit.b1) || !isfinite(fit.a2) || !isfinite(fit.b2) || !isfinite(fit.g2))
        fz_fail("the scheduler's fit is not finite after %s (a1 %g b1 %g a2 %g b2 %g g2 %g)", after, fit.a1, fit.b1,
                fit.a2, fit.b2, fit.g2);
}

/* ---------------------------------------------------------------------------------------
   Selections: validity as the fetch must see it, and what a select must produce
   ------------------------------------------------------------------------------------- */

/* 1 when sel is a selection a fetch on this layer must accept */
static int fz_sel_valid(const fz_cache *C, int layer, const pqc_selection *sel, size_t *max_count)
{
    size_t n = pqc_cache_tokens(C->c, layer), h, i, mc = 0;
    if (!sel || !sel->count || !sel->idx || sel->n_kv_heads != C->H) return 0;
    for (h = 0; h < (size_t)C->H; h++)
        if (sel->count[h] > mc) mc = sel->count[h];
    if (max_count) *max_count = mc < FZ_MAX_SEL_CAP ? mc : FZ_MAX_SEL_CAP;
    for (h = 0; h < (size_t)C->H; h++) {
        size_t cnt = sel->count[h];
        const uint32_t *idx = sel->idx + h * sel->capacity;
        if (cnt > sel->capacity) return 0; /* the indices past the capacity are not the selection's */
        for (i = 0; i < cnt; i++)
            if (idx[i] >= n || (i > 0 && idx[i] <= idx[i - 1])) return 0;
    }
    return 1;
}

static void fz_check_selection(const fz_cache *C, int layer, const pqc_selection *sel, const char *call)
{
    /* the layer's window (an adaptive build may have lowered the cache's); where the window
       competes (PQC_SPLIT_COMPETE or PQC_SPLIT_FIXED_COMPETE, with exact scoring or without)
       its tokens but the last 16 may give their places to coded tokens */
    size_t n = pqc_cache_tokens(C->c, layer), w = (size_t)pqc_cache_layer_window(C->c, layer), h, i;
    size_t sink = C->sink < n ? C->sink : n, mid_end = n > C->sink + w ? n - w : C->sink;
    size_t wstart = mid_end > sink ? mid_end : sink, wcount = n > wstart ? n - wstart : 0, wkept = wcount;
    int competes = C->d.split == PQC_SPLIT_COMPETE || C->d.split == PQC_SPLIT_FIXED_COMPETE;
    if (w < 1) fz_fail("%s: window %zu after a prefill", call, w);
    if (w > (size_t)pqc_cache_window(C->c)) fz_fail("%s: layer window %zu above the cache's %d", call, w, pqc_cache_window(C->c));
    if (competes && wkept > 16) wkept = 16;
    for (h = 0; h < (size_t)C->H; h++) {
        size_t cnt = sel->count[h];
        const uint32_t *idx = sel->idx + h * sel->capacity;
        if (cnt > n || cnt > sel->capacity) fz_fail("%s: head %zu selected %zu of %zu tokens", call, h, cnt, n);
        for (i = 0; i < cnt; i++)
            if (idx[i] >= n || (i > 0 && idx[i] <= idx[i - 1]))
                fz_fail("%s: head %zu entry %zu (%u) out of range or not ascending", call, h, i, (unsigned)idx[i]);
        if (cnt < sink + wcount) fz_fail("%s: head %zu holds %zu tokens, fewer than sinks + window", call, h, cnt);
        for (i = 0; i < sink; i++)
            if (idx[i] != i) fz_fail("%s: head %zu lacks sink %zu", call, h, i);
        for (i = n - wkept; i < n; i++) /* the last wkept entries */
            if (idx[cnt - (n - i)] != i) fz_fail("%s: head %zu lacks window token %zu", call, h, i);
    }
}

/* fetched rows (fp32, head h at base + h*stride*d) against the store */
static void fz_check_fetched(const fz_cache *C, int layer, const pqc_selection *sel, const float *ko, const float *vo,
                             size_t stride, const char *call)
{
    size_t h, i, e, D = (size_t)C->D;
    for (h = 0; h < (size_t)C->H; h++) {
        fz_rows R;
        fz_rows_get(C, layer, (int)h, &R);
        for (i = 0; i < sel->count[h]; i++) {
            size_t t = sel->idx[h * sel->capacity + i];
            for (e = 0; e < D; e++) {
                if (ko && !fz_same(ko[(h * stride + i) * D + e], fz_stored(C, &R, 0, t, e)))
                    fz_fail("%s: head %zu row %zu (token %zu) K[%zu] differs from the store", call, h, i, t, e);
                if (vo && !fz_same(vo[(h * stride + i) * D + e], fz_stored(C, &R, 1, t, e)))
                    fz_fail("%s: head %zu row %zu (token %zu) V[%zu] differs from the store", call, h, i, t, e);
            }
        }
    }
}

static void fz_sel_release(fz_sel *s)
{
    if (s->kind == 1) pqc_selection_free(&s->s);
    else if (s->kind == 2) {
        free(s->s.count);
        free(s->s.idx);
    }
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------------------------------
   Cache operations
   ------------------------------------------------------------------------------------- */
static void op_cache_create(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_slot(S);
    unsigned strict = rd8(f); /* below 160: every field ordinary */
    pqc_cache_desc d;
    pqc_cache *sentinel = (pqc_cache *)&g_sentinel, *out = sentinel;
    unsigned qb, bsel, rsel;
    long long q;
    int must_fail = 0, m_eff, bits_eff, blocks, bt, Q;
    size_t es;
    double slot_bytes;
    pqc_result r;
    memset(&d, 0, sizeof d);
    g_ordinary = strict < 160;
    d.n_layers = PICK_I(f, t_layers);
    d.n_kv_heads = PICK_I(f, t_kvh);
    qb = rd8(f);
    if (qb < HOSTILE || g_ordinary) q = (long long)d.n_kv_heads * t_group[qb % NT(t_group)];
    else q = t_group_bad[(qb - HOSTILE) % NT(t_group_bad)];
    d.n_q_heads = q > INT_MAX ? INT_MAX : q < INT_MIN ? INT_MIN : (int)q;
    d.head_dim = PICK_I(f, t_dim);
    d.kv_dtype = (pqc_dtype)PICK_I(f, t_dtype);
    d.max_tokens = PICK_Z(f, t_maxt);
    d.n_sink = PICK_I(f, t_sink);
    d.window = PICK_I(f, t_window);
    d.budget_ratio = PICK_D(f, t_ratio);
    d.budget_tokens = PICK_Z(f, t_budget);
    d.recent_share = PICK_D(f, t_share);
    d.pq.m = PICK_I(f, t_m);
    d.pq.bits = PICK_I(f, t_bits);
    d.pq.iters = PICK_I(f, t_iters);
    d.pq.init = (pqc_init)PICK_I(f, t_init);
    d.pq.max_points_per_centroid = PICK_I(f, t_mppc);
    d.pq.seed = rd8(f);
    d.pq.device = PICK_I(f, t_device);
    d.gqa = (pqc_gqa)PICK_I(f, t_gqa);
    d.block_tokens = PICK_I(f, t_bt);
    d.cache_blocks = PICK_I(f, t_blocks);
    d.admit_blocks = PICK_I(f, t_admit);
    d.policy = (pqc_policy)PICK_I(f, t_policy);
    d.rebuild_share = PICK_D(f, t_rebuild);
    d.codes_resident = PICK_I(f, t_resident);
    d.metric = (pqc_metric)PICK_I(f, t_metric);
    d.metric_floor = PICK_D(f, t_mfloor);
    d.observe = PICK_I(f, t_observe);
    d.split = (pqc_split)PICK_I(f, t_split);
    d.pq.rope = (pqc_rope)PICK_I(f, t_rope);
    d.pq.subspaces = (pqc_subspaces)PICK_I(f, t_subsp);
    d.rerank = PICK_D(f, t_rerank);
    d.outliers = PICK_I(f, t_outl);
    d.residual_weight = PICK_D(f, t_resw);
    bsel = rd8(f);
    if (bsel & 1) d.scheduler = S->sched;
    switch ((bsel >> 1) & 7) {
    case 1: d.backend = &g_be_cpu; break;
    case 2: d.backend = &g_be_own; break;
    case 3: d.backend = bsel >= HOSTILE && !g_ordinary ? &g_be_nocopy : NULL; break;
    case 4: d.backend = bsel >= HOSTILE && !g_ordinary ? &g_be_noalloc : NULL; break;
    default: break;
    }
    rsel = rd8(f);
    /* the softmax scale from rsel's high bits: the default for most inputs (0..23), else
       one of the model scales, or (hostile inputs) one the library refuses */
    if ((rsel >> 3) >= 28 && !g_ordinary) d.softmax_scale = t_smscale_bad[((rsel >> 3) - 28) % NT(t_smscale_bad)];
    else if ((rsel >> 3) >= 24) d.softmax_scale = t_smscale[((rsel >> 3) - 24) % NT(t_smscale)];
    g_ordinary = 0;

    /* what the documentation says must fail */
    Q = d.n_q_heads == 0 ? d.n_kv_heads : d.n_q_heads;
    es = fz_dsize(d.kv_dtype);
    m_eff = d.pq.m == 0 ? fz_default_m(d.head_dim, (int)d.pq.subspaces) : d.pq.m;
    bits_eff = d.pq.bits == 0 ? PQC_DEFAULT_BITS : d.pq.bits;
    blocks = d.cache_blocks == 0 ? 32 : d.cache_blocks < 0 ? 0 : d.cache_blocks;
    bt = d.block_tokens == 0 ? 128 : d.block_tokens;
    if (d.n_layers <= 0 || d.n_kv_heads <= 0 || d.head_dim <= 0 || Q <= 0 || Q % d.n_kv_heads || !es) must_fail = 1;
    if (d.budget_ratio != d.budget_ratio || d.budget_ratio < 0 || d.recent_share != d.recent_share ||
        d.recent_share < 0 || d.recent_share > 1 || d.rebuild_share != d.rebuild_share || d.window < 0 ||
        d.block_tokens < 0 || (int)d.policy < 0 || (int)d.policy > 1 || (int)d.gqa < 0 ||
        (int)d.gqa > 1)
        must_fail = 1;
    if (bits_eff < 1 || bits_eff > 8 || m_eff < 1 || (d.head_dim > 0 && (m_eff > d.head_dim || d.head_dim % m_eff)))
        must_fail = 1;
    if (d.pq.device != 0 || d.codes_resident < 0 || d.codes_resident > 1) must_fail = 1;
    if ((int)d.metric < 0 || (int)d.metric > 2 || d.metric_floor != d.metric_floor || d.metric_floor < 0 ||
        d.metric_floor > 1e6 || (int)d.split < 0 || (int)d.split > 3)
        must_fail = 1;
    if (d.pq.iters > 100000 || (int)d.pq.init < 0 || (int)d.pq.init > 1)
        must_fail = 1;
    if (fz_rope_bad((int)d.pq.rope, (int)d.pq.subspaces, d.head_dim, m_eff)) must_fail = 1;
    /* (a negative rerank, outliers or residual_weight is off, as every "none") */
    if (!(d.rerank <= 0 || (d.rerank >= 1 && d.rerank <= 1e6)) || d.outliers > (1 << 24) ||
        !(d.residual_weight <= 1e6) || (d.residual_weight > 0 && !((float)d.residual_weight > 0)))
        must_fail = 1;
    if (!(d.softmax_scale >= 0.0f && d.softmax_scale <= 1e6f)) must_fail = 1;
    /* the query metric's floor against the PQ core's weight spread (1e12) */
    if (((int)d.metric == 0 || (int)d.metric == 2) && d.head_dim > 0 &&
        (d.metric_floor == 0 ? 0.01 : d.metric_floor) < 1e-11 * d.head_dim)
        must_fail = 1;
    /* metric blocks (the query metric where sub-spaces have at most 256 dims): a floor
       that keeps them positive definite */
    if ((int)d.metric == 0 && m_eff > 0 && d.head_dim / m_eff <= 256 && (d.metric_floor == 0 ? 1.0 : d.metric_floor) < 0.01)
        must_fail = 1;
    if (d.backend == &g_be_nocopy || (d.backend == &g_be_noalloc && blocks > 0)) must_fail = 1;
    /* a block-cache slot array the allocator cannot grant (the sizes are exact in double
       up to 2^53, and anything beyond the request limit fails) */
    slot_bytes = (double)bt * 2.0 * (double)(d.head_dim > 0 ? d.head_dim : 0) * (double)es * (double)blocks;
    if (!must_fail && blocks > 0 && d.backend != &g_be_noalloc && slot_bytes > (double)g_heap.limit_one)
        must_fail = 1;

    fz_arm();
    r = fz_expect(pqc_cache_create((rsel & 7) == 7 ? NULL : S->rt, &d, &out), "pqc_cache_create");
    if (r == PQC_SUCCESS && must_fail)
        fz_fail("pqc_cache_create accepted an invalid or unallocatable desc (layers %d kv %d q %d dim %d dtype %d "
                "blocks %d block_tokens %d)",
                d.n_layers, d.n_kv_heads, d.n_q_heads, d.head_dim, (int)d.kv_dtype, d.cache_blocks, d.block_tokens);
    if (r != PQC_SUCCESS) {
        if (out != sentinel) fz_fail("failed pqc_cache_create wrote its output");
        return;
    }
    if (!out || out == sentinel) fz_fail("pqc_cache_create succeeded without an output");
    pqc_cache_destroy(C->c);
    C->c = out;
    C->d = d;
    C->rt_null = (rsel & 7) == 7;
    C->L = d.n_layers;
    C->H = d.n_kv_heads;
    C->Q = Q;
    C->D = d.head_dim;
    C->st = d.kv_dtype;
    C->es = es;
    C->maxt = d.max_tokens ? d.max_tokens : (size_t)1 << 20;
    C->sink = d.n_sink == 0 ? PQC_DEFAULT_N_SINK : d.n_sink < 0 ? 0 : (size_t)d.n_sink;
    C->blocks = blocks;
    C->bt = bt;
    C->bits = bits_eff;
    /* iterations a build may run: pq.iters, or with none given the scheduler's choice,
       at most its t_max (10 without one) */
    C->iters = d.pq.iters > 0 ? d.pq.iters : d.pq.iters < 0 ? 1 : d.scheduler && S->sched_tmax > 10 ? S->sched_tmax : 10;
    C->zero_copy = d.backend == NULL || d.backend == &g_be_cpu; /* rows by pointer, as stored */
    /* a window given stays (at most max_tokens); 0 is derived at the first prefill */
    if (d.window == 0 ? pqc_cache_window(C->c) != 0 : pqc_cache_window(C->c) < 1 || pqc_cache_window(C->c) > d.window)
        fz_fail("a new cache's window is %d for a desc's %d", pqc_cache_window(C->c), d.window);
    if (pqc_cache_on_device(C->c)) fz_fail("a cache on a CPU runtime reports a device tier");
}

static void op_cache_destroy(fz_state *S)
{
    fz_cache *C = fz_pick_slot(S);
    pqc_cache_destroy(C->c);
    C->c = NULL;
}

/* A cache made from slot P's (a fork, a loaded copy) into slot C: with C == P it is
   dropped again; else C's cache is destroyed and C takes P's shape, keeping its own
   selections. */
static void fz_slot_put(fz_cache *C, const fz_cache *P, pqc_cache *out)
{
    fz_sel s0 = C->sel[0], s1 = C->sel[1];
    if (C == P) {
        pqc_cache_destroy(out);
        return;
    }
    pqc_cache_destroy(C->c);
    *C = *P;
    C->sel[0] = s0;
    C->sel[1] = s1;
    C->c = out;
}

/* a fork of one slot's cache into a slot (its own: the child is dropped again, the
   parent stays); the slot it replaces is destroyed first */
static void op_fork(fz_state *S)
{
    fz *f = &S->f;
    unsigned which = rd8(f);
    fz_cache *P = &S->cache[which & 1], *C = &S->cache[(which >> 1) & 1];
    pqc_cache *sentinel = (pqc_cache *)&g_sentinel, *out = sentinel;
    pqc_result r;
    int l, uneven = 0;
    if (!P->c) {
        fz_arm();
        if (fz_expect(pqc_cache_fork(NULL, &out), "pqc_cache_fork(NULL)") == PQC_SUCCESS || out != sentinel)
            fz_fail("pqc_cache_fork of a null cache succeeded or wrote its output");
        return;
    }
    for (l = 1; l < P->L; l++) uneven |= pqc_cache_tokens(P->c, l) != pqc_cache_tokens(P->c, 0);
    fz_arm();
    r = fz_expect(pqc_cache_fork(P->c, &out), "pqc_cache_fork");
    if (r == PQC_SUCCESS && uneven) fz_fail("pqc_cache_fork between layers of unequal length succeeded");
    if (r != PQC_SUCCESS) {
        if (out != sentinel) fz_fail("failed pqc_cache_fork wrote its output");
        return;
    }
    if (!out || out == sentinel) fz_fail("pqc_cache_fork succeeded without an output");
    for (l = 0; l < P->L; l++)
        if (pqc_cache_tokens(out, l) != pqc_cache_tokens(P->c, l) || pqc_cache_window(out) != pqc_cache_window(P->c))
            fz_fail("a fork holds %zu tokens of layer %d, its parent %zu", pqc_cache_tokens(out, l), l,
                    pqc_cache_tokens(P->c, l));
    fz_slot_put(C, P, out);
}

/* one scratch file per process, for cache files */
static const char *fz_file(void)
{
    return fz_scratch_path("fuzz_api", "cache.pqc");
}

/* A save changes a cache as pqc_cache_sync does (it installs every finished build, and
   the builds that fall due start at its end), and nothing more: two forks of the cache
   take the same steps (an append to every layer, a select of each), one is saved and the
   other synced after the second step, and they select alike at every step. */
static void fz_check_save_as_sync(fz_state *S, fz_cache *P)
{
    const char *path = fz_file();
    pqc_cache *tw[2] = { NULL, NULL };
    pqc_selection sel[2];
    float *q = NULL, *kv = NULL;
    size_t n0 = pqc_cache_tokens(P->c, 0), qn = (size_t)P->Q * (size_t)P->D, kn = (size_t)P->H * (size_t)P->D, i;
    int l, t, step, ok = 1, forked;
    (void)S;
    if (n0 == 0 || n0 + 4 > P->maxt || P->L > 4 || qn > 4096 || (double)P->L * (double)(n0 + 4) * P->H * P->D > 2e6)
        return;
    for (l = 0; l < P->L; l++)
        if (pqc_cache_tokens(P->c, l) != n0 || !fz_layer_fits(P, n0 + 4)) return;
    memset(sel, 0, sizeof sel);
    q = (float *)fz_xalloc(sizeof(float) * qn);
    kv = (float *)fz_xalloc(sizeof(float) * 2 * kn);
    for (t = 0; t < 2 && ok; t++) /* (the fuzzer checks forks elsewhere: one refused ends the check) */
        ok = pqc_cache_fork(P->c, &tw[t]) == PQC_SUCCESS && pqc_selection_init(tw[t], &sel[t]) == PQC_SUCCESS;
    forked = ok;
    for (step = 0; step < 4 && ok; step++) {
        for (i = 0; i < 2 * kn; i++) kv[i] = 0.5f * (float)sin(1.3 * (double)i + 0.7 * (double)step + (double)n0);
        for (i = 0; i < qn; i++) q[i] = (float)cos(0.9 * (double)i + 1.1 * (double)step);
        for (l = 0; l < P->L && ok; l++) {
            pqc_result ra, rb;
            ra = pqc_cache_append(tw[0], l, kv, kv + kn);
            rb = pqc_cache_append(tw[1], l, kv, kv + kn);
            if (ra != PQC_SUCCESS || rb != PQC_SUCCESS) ok = 0;
        }
        if (ok && step == 1) {
            pqc_result ra = pqc_cache_save(tw[0], path), rb = pqc_cache_sync(tw[1]);
            remove(path);
            if (ra != PQC_SUCCESS || rb != PQC_SUCCESS) ok = 0;
        }
        for (l = 0; l < P->L && ok; l++) {
            size_t h;
            if (pqc_cache_select(tw[0], l, q, &sel[0]) != PQC_SUCCESS || pqc_cache_select(tw[1], l, q, &sel[1]) != PQC_SUCCESS) {
                ok = 0;
                break;
            }
            for (h = 0; h < (size_t)P->H; h++)
                if (sel[0].count[h] != sel[1].count[h] ||
                    memcmp(sel[0].idx + h * sel[0].capacity, sel[1].idx + h * sel[1].capacity, sel[0].count[h] * sizeof(uint32_t)))
                    fz_fail("a saved cache selects otherwise than its synced twin (step %d, layer %d, head %zu)", step, l, h);
        }
    }
    /* the steps are valid calls: they fail only where an allocation was refused */
    if (!ok && forked && fz_heap_failures() == 0) fz_fail("the twins of a saved cache failed a step: %s", pqc_last_error());
    for (t = 0; t < 2; t++) {
        pqc_selection_free(&sel[t]);
        pqc_cache_destroy(tw[t]);
    }
    free(q);
    free(kv);
}

/* a slot's cache saved and loaded into a slot (its own: the loaded cache is compared,
   then dropped again; another: the cache it replaces is destroyed first), on the host
   tier by mapping the file, which is unlinked at once (the mapping keeps the rows).
   The loaded cache holds what was saved and selects what the saved one selects. */
static void op_save_load(fz_state *S)
{
    fz *f = &S->f;
    unsigned which = rd8(f);
    fz_cache *P = &S->cache[which & 1], *C = &S->cache[(which >> 1) & 1];
    pqc_cache *sentinel = (pqc_cache *)&g_sentinel, *out = sentinel;
    const char *path = fz_file();
    pqc_result r;
    int l;
    if (!P->c) {
        fz_arm();
        if (fz_expect(pqc_cache_save(NULL, path), "pqc_cache_save(NULL)") == PQC_SUCCESS)
            fz_fail("pqc_cache_save of a null cache succeeded");
        return;
    }
    fz_arm();
    r = fz_expect(pqc_cache_save(P->c, path), "pqc_cache_save");
    fz_outcome(r, 0, 0, "pqc_cache_save");
    if (r != PQC_SUCCESS) {
        remove(path);
        return;
    }
    fz_arm();
    r = fz_expect(pqc_cache_load(P->rt_null ? NULL : S->rt, &P->d, path, &out), "pqc_cache_load");
    remove(path);
    fz_outcome(r, 0, 0, "pqc_cache_load");
    if (r != PQC_SUCCESS) {
        if (out != sentinel) fz_fail("failed pqc_cache_load wrote its output");
        return;
    }
    if (!out || out == sentinel) fz_fail("pqc_cache_load succeeded without an output");
    if (pqc_cache_window(out) != pqc_cache_window(P->c))
        fz_fail("a loaded cache's window is %d, the saved one's %d", pqc_cache_window(out), pqc_cache_window(P->c));
    for (l = 0; l < P->L; l++)
        if (pqc_cache_tokens(out, l) != pqc_cache_tokens(P->c, l))
            fz_fail("a loaded cache holds %zu tokens of layer %d, the saved one %zu", pqc_cache_tokens(out, l), l,
                    pqc_cache_tokens(P->c, l));
    if (pqc_cache_tokens(out, 0) > 0 && (size_t)P->Q * (size_t)P->D <= 4096) { /* one select on each */
        float *q = (float *)malloc(sizeof(float) * (size_t)P->Q * (size_t)P->D + 1);
        pqc_selection a, b;
        size_t i, h;
        for (i = 0; q && i < (size_t)P->Q * (size_t)P->D; i++) q[i] = (float)sin(0.7 * (double)i + (double)S->seed);
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        fz_arm();
        if (q && pqc_selection_init(P->c, &a) == PQC_SUCCESS && pqc_selection_init(out, &b) == PQC_SUCCESS &&
            pqc_cache_select(P->c, 0, q, &a) == PQC_SUCCESS && pqc_cache_select(out, 0, q, &b) == PQC_SUCCESS)
            for (h = 0; h < (size_t)P->H; h++)
                if (a.count[h] != b.count[h] ||
                    memcmp(a.idx + h * a.capacity, b.idx + h * b.capacity, a.count[h] * sizeof(uint32_t)))
                    fz_fail("a loaded cache selects otherwise than the saved one (head %zu: %zu and %zu tokens)", h,
                            a.count[h], b.count[h]);
        pqc_selection_free(&a);
        pqc_selection_free(&b);
        free(q);
    }
    fz_check_save_as_sync(S, P);
    fz_slot_put(C, P, out);
}

static void op_prefill(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    int layer = fz_pick_layer_as(f, C, 1), must_fail = 0, may_fail = 0, huge_rows = 0;
    unsigned mode = rd8(f);
    size_t cols, rows, vrows, tok = 0, h, t, e;
    fz_mat K, V;
    fz_snap snap;
    pqc_result r;
    if (!C->c) {
        fz_arm();
        if (fz_expect(pqc_cache_prefill(NULL, 0, NULL, NULL), "pqc_cache_prefill(NULL)") == PQC_SUCCESS)
            fz_fail("pqc_cache_prefill on a null cache succeeded");
        return;
    }
    cols = (size_t)C->H * (size_t)C->D;
    rows = PICK_Z(f, t_rows);
    if (mode >= HOSTILE) {
        static const int dc[] = {1, -1, 0};
        int k = dc[mode % 3];
        cols = k == 0 ? 0 : k > 0 ? cols + 1 : cols - 1;
        must_fail = 1;
    }
    if (!fz_layer_ok(C, layer)) must_fail = 1;
    else tok = pqc_cache_tokens(C->c, layer);
    if ((mode & 0x70) == 0x70 && fz_layer_ok(C, layer)) {
        /* a row count beyond max_tokens, over a one-row buffer: rejected before any read */
        static const size_t extra[] = {1, 2, 1000};
        size_t left = C->maxt > tok ? C->maxt - tok : 0;
        unsigned k = (mode >> 1) & 3;
        rows = k == 3 ? ZMAX - (tok ? tok - 1 : 0) : left + extra[k % 3];
        if (rows <= left) rows = ZMAX;
        huge_rows = 1;
        must_fail = 1;
    } else {
        if (cols && rows > FZ_MAX_FLOATS / cols) rows = FZ_MAX_FLOATS / cols;
        if (fz_layer_ok(C, layer) && !must_fail)
            while (rows > 0 && !fz_layer_fits(C, tok + rows)) rows /= 2;
        if (rows == 0 && (mode & 0x0f) != 0x0f) return; /* nothing the target can build */
    }
    vrows = rows;
    if ((mode & 0x0f) == 0x0e && !huge_rows) {
        vrows = rows + 1;
        must_fail = 1;
    }
    fz_mat_gen(f, S->seed, huge_rows ? 1 : rows, cols, 1, 0, &K);
    fz_mat_gen(f, S->seed + 1, huge_rows ? 1 : vrows, cols, 1, 0, &V);
    K.m.rows = rows;
    V.m.rows = huge_rows ? rows : vrows;
    if (rows == 0 || K.bad || V.bad || K.nonfinite || V.nonfinite) must_fail = 1;
    if (K.maxabs > fz_store_limit(C->st) || V.maxabs > fz_store_limit(C->st)) may_fail = 1;
    if (fz_layer_ok(C, layer) && rows > C->maxt - (tok < C->maxt ? tok : C->maxt)) must_fail = 1;
    if (fz_layer_ok(C, layer)) fz_snap_take(S, C, layer, &snap);
    fz_arm();
    r = fz_expect(pqc_cache_prefill(C->c, layer, &K.m, &V.m), "pqc_cache_prefill");
    fz_outcome(r, must_fail, may_fail, "pqc_cache_prefill");
    if (!fz_layer_ok(C, layer)) goto done;
    if (r != PQC_SUCCESS) {
        fz_snap_check(C, &snap, "pqc_cache_prefill", r);
        goto done;
    }
    if (pqc_cache_tokens(C->c, layer) != tok + rows)
        fz_fail("pqc_cache_prefill of %zu rows: %zu -> %zu tokens", rows, tok, pqc_cache_tokens(C->c, layer));
    if (snap.window ? pqc_cache_window(C->c) != snap.window : pqc_cache_window(C->c) < 1)
        fz_fail("pqc_cache_prefill: window %d -> %d", snap.window, pqc_cache_window(C->c));
    /* the new rows, as the storage dtype holds them */
    for (h = 0; h < (size_t)C->H; h++) {
        fz_rows R;
        size_t kes = fz_dsize(K.m.dtype), ves = fz_dsize(V.m.dtype);
        size_t ks = K.m.row_stride ? K.m.row_stride : cols * kes, vs = V.m.row_stride ? V.m.row_stride : cols * ves;
        fz_rows_get(C, layer, (int)h, &R);
        for (t = 0; t < rows; t++)
            for (e = 0; e < (size_t)C->D; e++) {
                float ek = fz_round(fz_get(K.buf + t * ks + (h * C->D + e) * kes, K.m.dtype), C->st);
                float ev = fz_round(fz_get(V.buf + t * vs + (h * C->D + e) * ves, V.m.dtype), C->st);
                if (!fz_same(fz_stored(C, &R, 0, tok + t, e), ek) || !fz_same(fz_stored(C, &R, 1, tok + t, e), ev))
                    fz_fail("pqc_cache_prefill stored head %zu token %zu element %zu as K %g V %g, not K %g V %g "
                            "(input dtypes %d %d, storage %d)",
                            h, tok + t, e, (double)fz_stored(C, &R, 0, tok + t, e), (double)fz_stored(C, &R, 1, tok + t, e),
                            (double)ek, (double)ev, (int)K.m.dtype, (int)V.m.dtype, C->st);
            }
    }
done:
    fz_mat_free(&K);
    fz_mat_free(&V);
}

static void op_append(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    int layer = fz_pick_layer(f, C), must_fail = 0, may_fail = 0, nf1, hg1, nf2, hg2;
    unsigned mode = rd8(f);
    size_t n, tok = 0, h, e;
    float *k, *v;
    fz_snap snap;
    pqc_result r;
    if (!C->c) return;
    n = (size_t)C->H * (size_t)C->D;
    if (n > FZ_MAX_FLOATS) return;
    k = fz_vec(f, S->seed + 2, n, &nf1, &hg1);
    if (g_vec_maxabs > fz_store_limit(C->st)) may_fail = 1;
    v = fz_vec(f, S->seed + 3, n, &nf2, &hg2);
    if (g_vec_maxabs > fz_store_limit(C->st)) may_fail = 1;
    if (nf1 || nf2) must_fail = 1;
    if (hg1 || hg2) may_fail = 1;
    if (mode >= HOSTILE) must_fail = 1; /* a null K or V */
    if (!fz_layer_ok(C, layer)) must_fail = 1;
    else {
        tok = pqc_cache_tokens(C->c, layer);
        if (tok == 0 || tok + 1 > C->maxt) must_fail = 1;
        if (!fz_layer_fits(C, tok + 1)) {
            free(k);
            free(v);
            return;
        }
        fz_snap_take(S, C, layer, &snap);
    }
    fz_arm();
    r = fz_expect(pqc_cache_append(C->c, layer, mode >= HOSTILE && (mode & 1) ? NULL : k,
                                   mode >= HOSTILE && !(mode & 1) ? NULL : v),
                  "pqc_cache_append");
    fz_outcome(r, must_fail, may_fail, "pqc_cache_append");
    if (fz_layer_ok(C, layer)) {
        if (r != PQC_SUCCESS) fz_snap_check(C, &snap, "pqc_cache_append", r);
        else {
            if (pqc_cache_tokens(C->c, layer) != tok + 1) fz_fail("pqc_cache_append did not add one token");
            if (pqc_cache_window(C->c) != snap.window) fz_fail("pqc_cache_append changed the window");
            for (h = 0; h < (size_t)C->H; h++) {
                fz_rows R;
                fz_rows_get(C, layer, (int)h, &R);
                for (e = 0; e < (size_t)C->D; e++)
                    if (!fz_same(fz_stored(C, &R, 0, tok, e), fz_round(k[h * C->D + e], C->st)) ||
                        !fz_same(fz_stored(C, &R, 1, tok, e), fz_round(v[h * C->D + e], C->st)))
                        fz_fail("pqc_cache_append stored head %zu element %zu wrongly", h, e);
            }
        }
    }
    free(k);
    free(v);
}

static void fz_sel_make(fz_cache *C, fz_sel *s)
{
    pqc_result r;
    int must_fail = !C->c, l;
    size_t most = 0;
    fz_sel_release(s);
    for (l = 0; C->c && l < C->L; l++)
        if (pqc_cache_tokens(C->c, l) > most) most = pqc_cache_tokens(C->c, l);
    fz_arm();
    r = fz_expect(pqc_selection_init(C->c, &s->s), "pqc_selection_init");
    fz_outcome(r, must_fail, 1, "pqc_selection_init"); /* its size is the library's to choose */
    if (r != PQC_SUCCESS) {
        memset(s, 0, sizeof *s);
        return;
    }
    s->kind = 1;
    if (s->s.n_kv_heads != C->H || s->s.capacity < most || !s->s.count || !s->s.idx || !s->s.owned)
        fz_fail("pqc_selection_init: %d heads, capacity %zu, owned %d (cache: %d heads, %zu tokens)", s->s.n_kv_heads,
                s->s.capacity, s->s.owned, C->H, most);
}

static void op_sel_init(fz_state *S)
{
    fz_cache *C = fz_pick_cache(S);
    fz_sel_make(C, &C->sel[rd8(&S->f) & 1]);
}

/* the selection named; an empty one stands for the other or, failing that, a new one,
   unless the byte is hostile */
static fz_sel *fz_pick_sel(fz *f, fz_cache *C)
{
    unsigned b = rd8(f);
    fz_sel *s = &C->sel[b & 1];
    if (s->kind || b >= HOSTILE || !C->c) return s;
    if (C->sel[(b & 1) ^ 1].kind) return &C->sel[(b & 1) ^ 1];
    fz_sel_make(C, s);
    return s;
}

/* a selection built by hand: any head count, capacity, counts and indices */
static void op_sel_hand(fz_state *S)
{
    static const size_t caps[] = {16, 1, 2, 4, 64, 0, 300, 1000};
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    fz_sel *s = &C->sel[rd8(f) & 1];
    unsigned hb = rd8(f), cb = rd8(f), fill = rd8(f);
    int nh = C->c ? C->H : 1;
    size_t cap, tokens = C->c ? pqc_cache_tokens(C->c, 0) : 0, h, i, nalloc;
    uint64_t rng = S->seed ^ fill;
    if (hb >= HOSTILE) nh = (int)(hb % 4) - 1; /* -1 .. 2 */
    cap = cb >= HOSTILE ? tokens + (cb & 1) : caps[cb % NT(caps)];
    if (cap > FZ_MAX_SEL_CAP) cap = FZ_MAX_SEL_CAP;
    if ((double)(nh > 0 ? nh : 1) * (double)cap > (double)FZ_MAX_FLOATS) return;
    fz_sel_release(s);
    nalloc = nh > 0 ? (size_t)nh : 1;
    s->kind = 2;
    s->s.n_kv_heads = nh;
    s->s.capacity = cap;
    s->s.count = (size_t *)fz_xalloc(nalloc * sizeof(size_t));
    s->s.idx = (uint32_t *)fz_xalloc(nalloc * (cap ? cap : 1) * sizeof(uint32_t));
    for (h = 0; h < nalloc; h++) {
        unsigned k = rd8(f);
        size_t cnt;
        uint32_t *idx = s->s.idx + h * cap;
        static const size_t bad[] = {1, 100, ZMAX, 0};
        if (k < HOSTILE) cnt = k % 3 == 0 ? cap : k % 3 == 1 ? cap / 2 : (tokens < cap ? tokens : cap);
        else cnt = (k & 3) == 3 ? cap * 2 : cap + bad[k & 3]; /* more than the capacity */
        s->s.count[h] = cnt;
        /* ascending from a stride; then the fill mode damages it */
        for (i = 0; i < cap; i++) idx[i] = (uint32_t)(i * (1 + (fill & 3)));
        switch ((fill >> 2) & 7) {
        case 5:
            if (cap > 1) idx[fz_mix(&rng) % cap] = idx[0]; /* duplicate or unsorted */
            break;
        case 6:
            if (cap) idx[cap - 1] = (uint32_t)tokens; /* one past the end */
            break;
        case 7:
            if (cap) idx[fz_mix(&rng) % cap] = UINT32_MAX;
            break;
        default: break;
        }
    }
    if (nh <= 0) s->s.count[0] = 0;
}

/* damages a selection in place within its allocation */
static void op_sel_tamper(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    fz_sel *s = &C->sel[rd8(f) & 1];
    unsigned what = rd8(f), hh = rd8(f);
    size_t pos = rd16(f), h, nh;
    if (!s->kind || s->s.n_kv_heads <= 0 || !s->s.count) return;
    nh = (size_t)s->s.n_kv_heads;
    h = hh % nh;
    switch (what % 5) {
    case 0: s->s.count[h] = s->s.capacity + 1 + (what >> 3); break;
    case 1: s->s.count[h] = pos; break;
    case 2:
        if (s->s.capacity) s->s.idx[h * s->s.capacity + pos % s->s.capacity] = (uint32_t)rd16(f);
        break;
    case 3: s->s.capacity = s->s.capacity ? pos % s->s.capacity : 0; break; /* smaller: stays inside */
    default:
        if (s->s.capacity > 1) {
            uint32_t *idx = s->s.idx + h * s->s.capacity, t = idx[0];
            idx[0] = idx[1];
            idx[1] = t;
        }
        break;
    }
}

static void op_select(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    int layer = fz_pick_layer(f, C), must_fail = 0, may_fail = 0, nf, hg;
    fz_sel *s = fz_pick_sel(f, C);
    unsigned mode = rd8(f);
    size_t nq, n = 0, *counts = NULL, h;
    float *q;
    fz_snap snap;
    pqc_result r;
    if (!C->c) return;
    nq = (size_t)C->Q * (size_t)C->D;
    if (nq > FZ_MAX_FLOATS) return;
    q = fz_vec(f, S->seed + 4, nq, &nf, &hg);
    if (nf) must_fail = 1;
    if (hg) may_fail = 1;
    if (mode >= HOSTILE) must_fail = 1;
    if (!s->s.idx || !s->s.count || s->s.n_kv_heads != C->H) must_fail = 1;
    if (!fz_layer_ok(C, layer)) must_fail = 1;
    else {
        n = pqc_cache_tokens(C->c, layer);
        if (n == 0 || (n > s->s.capacity && !s->s.owned)) must_fail = 1;
        if (n > s->s.capacity && s->s.owned) may_fail = 1; /* it grows, if memory allows */
        fz_snap_take(S, C, layer, &snap);
    }
    if (s->s.count && s->s.n_kv_heads > 0) {
        counts = (size_t *)fz_xalloc((size_t)s->s.n_kv_heads * sizeof(size_t));
        memcpy(counts, s->s.count, (size_t)s->s.n_kv_heads * sizeof(size_t));
    }
    fz_arm();
    r = fz_expect(pqc_cache_select(C->c, layer, mode >= HOSTILE && (mode & 1) ? NULL : q,
                                   mode >= HOSTILE && !(mode & 1) ? NULL : &s->s),
                  "pqc_cache_select");
    fz_outcome(r, must_fail, may_fail, "pqc_cache_select");
    if (r != PQC_SUCCESS) {
        if (fz_layer_ok(C, layer)) fz_snap_check(C, &snap, "pqc_cache_select", r);
        if (counts)
            for (h = 0; h < (size_t)s->s.n_kv_heads; h++)
                if (s->s.count[h] != counts[h]) fz_fail("failed pqc_cache_select (%d) changed the selection", (int)r);
    } else {
        pqc_layer_stats st;
        fz_check_selection(C, layer, &s->s, "pqc_cache_select");
        if (pqc_cache_stats(C->c, layer, &st) != PQC_SUCCESS || st.selects != snap.st.selects + 1)
            fz_fail("pqc_cache_select did not count the select");
    }
    free(counts);
    free(q);
}

static void op_fetch(fz_state *S, int rows_only)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    int layer = fz_pick_layer(f, C), must_fail = 0, valid;
    fz_sel *s = fz_pick_sel(f, C);
    unsigned mode = rd8(f);
    size_t maxc = 0, stride, bytes;
    float *ko = NULL, *vo = NULL;
    pqc_kv_out out;
    const void *const *const *krows = NULL;
    const void *const *const *vrows = NULL;
    fz_snap snap;
    pqc_result r;
    const char *call = rows_only ? "pqc_cache_fetch_rows" : "pqc_cache_fetch";
    if (!C->c) return;
    valid = fz_layer_ok(C, layer) && fz_sel_valid(C, layer, &s->s, &maxc);
    if (!valid) must_fail = 1;
    stride = maxc + (mode >> 4 & 3);
    if (mode >= HOSTILE) {
        if (rows_only || (mode & 3) == 3) must_fail = 1; /* null outputs */
        else if (maxc > 1) { /* (a stride of 0 would be raised to 1 below: enough for 1 row) */
            stride = maxc - 1; /* too small */
            must_fail = 1;
        }
    }
    if (rows_only && !C->zero_copy) must_fail = 1;
    if (stride == 0) stride = 1;
    if ((double)stride * C->H * C->D > (double)FZ_MAX_FLOATS) return;
    bytes = stride * (size_t)C->H * (size_t)C->D * sizeof(float);
    if (!rows_only) {
        ko = (float *)fz_xalloc(bytes);
        vo = (float *)fz_xalloc(bytes);
    }
    out.k = mode >= HOSTILE && (mode & 3) == 3 ? NULL : ko;
    out.v = vo;
    out.head_stride = stride;
    if (fz_layer_ok(C, layer)) fz_snap_take(S, C, layer, &snap);
    fz_arm();
    if (rows_only)
        r = fz_expect(pqc_cache_fetch_rows(C->c, layer, &s->s, mode >= HOSTILE ? NULL : &krows, &vrows), call);
    else r = fz_expect(pqc_cache_fetch(C->c, layer, &s->s, &out), call);
    /* an empty layer holds nothing to fetch: refusing it (out of order) is the library's choice */
    fz_outcome(r, must_fail, fz_layer_ok(C, layer) && pqc_cache_tokens(C->c, layer) == 0, call);
    if (r != PQC_SUCCESS) {
        if (fz_layer_ok(C, layer)) fz_snap_check(C, &snap, call, r);
    } else if (!rows_only) {
        fz_check_fetched(C, layer, &s->s, ko, vo, stride, call);
    } else {
        size_t h, i, e;
        for (h = 0; h < (size_t)C->H; h++) {
            fz_rows R;
            fz_rows_get(C, layer, (int)h, &R);
            for (i = 0; i < s->s.count[h]; i++) {
                size_t t = s->s.idx[h * s->s.capacity + i];
                const unsigned char *kr = (const unsigned char *)krows[h][i], *vr = (const unsigned char *)vrows[h][i];
                for (e = 0; e < (size_t)C->D; e++)
                    if (!fz_same(fz_get(kr + e * C->es, C->st), fz_stored(C, &R, 0, t, e)) ||
                        !fz_same(fz_get(vr + e * C->es, C->st), fz_stored(C, &R, 1, t, e)))
                        fz_fail("pqc_cache_fetch_rows: head %zu row %zu (token %zu) differs from the store", h, i, t);
            }
        }
    }
    free(ko);
    free(vo);
}

/* observed queries: refused when bad, and then nothing changes */
static void op_observe(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    int layer = fz_pick_layer(f, C), must_fail = 0, may_fail = 0, nf = 0, hg = 0;
    unsigned mode = rd8(f);
    size_t rows = mode % 5, nq, qlen = 0;
    double *before = NULL;
    float *q = NULL;
    pqc_result r;
    if (!C->c) return;
    nq = (size_t)C->Q * (size_t)C->D;
    if (rows * nq > FZ_MAX_FLOATS) return;
    if (rows) q = fz_vec(f, S->seed + 9, rows * nq, &nf, &hg);
    if (rows == 0 || nf || mode >= HOSTILE) must_fail = 1;
    if (hg) may_fail = 1;
    if (!fz_layer_ok(C, layer)) must_fail = 1;
    else {
        qlen = pqc__qsq_len(C->c);
        before = (double *)fz_xalloc(qlen * sizeof(double));
        memcpy(before, C->c->layers[layer].qsq, qlen * sizeof(double));
    }
    fz_arm();
    r = fz_expect(pqc_cache_observe(C->c, layer, mode >= HOSTILE ? NULL : q, rows), "pqc_cache_observe");
    fz_outcome(r, must_fail, may_fail, "pqc_cache_observe");
    if (r != PQC_SUCCESS && before && memcmp(before, C->c->layers[layer].qsq, qlen * sizeof(double)))
        fz_fail("failed pqc_cache_observe changed the observations");
    free(before);
    free(q);
}

static void op_sync(fz_state *S)
{
    fz_cache *C = fz_pick_cache(S);
    pqc_result r;
    fz_arm();
    r = fz_expect(pqc_cache_sync(C->c), "pqc_cache_sync");
    fz_outcome(r, C->c == NULL, 0, "pqc_cache_sync");
}

static void op_info(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    unsigned what = rd8(f);
    int layer = fz_pick_layer(f, C), head = (int)rd8(f) - 2;
    pqc_result r;
    if (!C->c) return;
    if ((what >> 4) == 15) { /* observed attention: measured or BAD_STATE, shares in [0, 1] */
        double sk = -1, wn = -1;
        fz_arm();
        r = fz_expect(pqc_cache_observed_mass(C->c, layer, head, &sk, &wn), "pqc_cache_observed_mass");
        if (r == PQC_SUCCESS && (!fz_layer_ok(C, layer) || head < 0 || head >= C->H))
            fz_fail("pqc_cache_observed_mass accepted a bad layer or head");
        if (r == PQC_SUCCESS && !(sk >= 0 && wn >= 0 && sk + wn <= 1.0 + 1e-6))
            fz_fail("pqc_cache_observed_mass: shares %g and %g", sk, wn);
        if (r != PQC_SUCCESS && r != PQC_ERROR_BAD_STATE && r != PQC_ERROR_OUT_OF_RANGE)
            fz_fail("pqc_cache_observed_mass: unexpected result %d", (int)r);
        return;
    }
    switch (what % 6) {
    case 0: {
        pqc_layer_stats st;
        fz_arm();
        r = fz_expect(pqc_cache_stats(C->c, layer, (what & 8) ? NULL : &st), "pqc_cache_stats");
        fz_outcome(r, !fz_layer_ok(C, layer) || (what & 8), 0, "pqc_cache_stats");
        if (r == PQC_SUCCESS && (st.hits + st.misses < st.hits || st.bytes_codes > st.bytes_h2d))
            fz_fail("pqc_cache_stats: inconsistent counters");
        break;
    }
    case 1: {
        size_t dev = 1, full = 1, want = 0;
        int l;
        pqc_cache_memory(C->c, (what & 8) ? NULL : &dev, (what & 16) ? NULL : &full);
        for (l = 0; l < C->L; l++) want += pqc_cache_tokens(C->c, l) * (size_t)C->H * 2 * (size_t)C->D * C->es;
        if (!(what & 16) && full != want) fz_fail("pqc_cache_memory: full K/V bytes %zu, expected %zu", full, want);
        break;
    }
    case 2: {
        const void *k = NULL, *v = NULL;
        size_t tokens = 0;
        pqc_dtype dt = PQC_F32;
        int ok = fz_layer_ok(C, layer) && head >= 0 && head < C->H;
        if (ok) { /* a fork's rows in two parts are refused: read them part by part */
            fz_rows R;
            fz_rows_get(C, layer, head, &R);
            ok = R.n0 == R.n;
        }
        fz_arm();
        r = fz_expect(pqc_cache_kv(C->c, layer, head, (what & 8) ? NULL : &k, (what & 16) ? NULL : &v, &tokens, &dt),
                      "pqc_cache_kv");
        fz_outcome(r, !ok, 0, "pqc_cache_kv");
        if (r == PQC_SUCCESS && (tokens != pqc_cache_tokens(C->c, layer) || (int)dt != C->st))
            fz_fail("pqc_cache_kv: tokens or dtype wrong");
        break;
    }
    case 3: {
        int32_t blocks[70];
        int max = (int)(what >> 3) % 70 - 2, n, i;
        int ok = fz_layer_ok(C, layer) && head >= 0 && head < C->H;
        size_t nblk = ok ? (pqc_cache_tokens(C->c, layer) + (size_t)C->bt - 1) / (size_t)C->bt : 0;
        n = pqc_cache_cached_blocks(C->c, layer, head, max > 0 ? blocks : NULL, max);
        if (!ok && n != 0) fz_fail("pqc_cache_cached_blocks of a bad layer or head returned %d", n);
        if (n < 0 || n > C->blocks) fz_fail("pqc_cache_cached_blocks returned %d of %d slots", n, C->blocks);
        for (i = 0; max > 0 && i < n && i < max; i++)
            if (blocks[i] < 0 || (size_t)blocks[i] >= nblk || (i > 0 && blocks[i] <= blocks[i - 1]))
                fz_fail("pqc_cache_cached_blocks: entry %d (%d) out of range or not ascending", i, (int)blocks[i]);
        break;
    }
    case 4: {
        pqc_kv_device dk;
        fz_arm();
        r = fz_expect(pqc_cache_fetch_device(C->c, layer, &C->sel[0].s, (what & 8) ? NULL : &dk),
                      "pqc_cache_fetch_device");
        if (r == PQC_SUCCESS) fz_fail("pqc_cache_fetch_device succeeded without a CUDA device tier");
        break;
    }
    default:
        if (pqc_cache_tokens(C->c, layer) != 0 && !fz_layer_ok(C, layer))
            fz_fail("pqc_cache_tokens of a bad layer is not 0");
        if (pqc_cache_tokens(NULL, 0) != 0 || pqc_cache_window(NULL) != 0) fz_fail("null cache queries not 0");
        break;
    }
}

static void op_report(fz_state *S)
{
    static const double tok[] = {4096, 1, 100, 32768, 0.5};
    static const double tok_bad[] = {0, -1, NAN, INFINITY, -INFINITY, 1e200, 1e300, DBL_MAX, 4.9e-324};
    static const double sec[] = {0.01, 0.001, 0.1, 1, 0};
    static const double sec_bad[] = {NAN, INFINITY, -1, 1e9, 1000000001, 1e200, -0.0};
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    int layer = fz_pick_layer(f, C);
    double t = PICK_D(f, tok), s = PICK_D(f, sec);
    int must_fail;
    pqc_result r;
    pqc_scheduler_fit before;
    if (!C->c) return;
    before = pqc_scheduler_get_fit(S->sched);
    must_fail = !fz_layer_ok(C, layer);
    fz_arm();
    r = fz_expect(pqc_cache_report_compute(C->c, layer, t, s), "pqc_cache_report_compute");
    if (r == PQC_SUCCESS && must_fail) fz_fail("pqc_cache_report_compute accepted a bad layer");
    if (r != PQC_SUCCESS && S->sched) {
        pqc_scheduler_fit now = pqc_scheduler_get_fit(S->sched);
        if (memcmp(&now, &before, sizeof now)) fz_fail("failed pqc_cache_report_compute changed the scheduler's fit");
    }
    fz_check_fit_finite(S, "pqc_cache_report_compute");
}

/* ----- the driver, over a small engine ----- */
typedef struct fz_engine {
    fz_cache *C;
    uint64_t seed;
    int fail_qkv, fail_attend; /* layer whose callback fails, or -1 */
    int special_layer;         /* layer whose K gets a special value, or -1 */
    float special;
    int decode;
    float *last_k; /* the K the last qkv call produced (decode: one token) */
    size_t last_k_n;
    size_t pos0, n;
    int row_pointers; /* the engine's accepts_row_pointers */
} fz_engine;

static int fz_qkv(void *user, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    fz_engine *E = (fz_engine *)user;
    size_t nq = n * (size_t)E->C->Q * E->C->D, nk = n * (size_t)E->C->H * E->C->D, i;
    uint64_t s = E->seed ^ ((uint64_t)layer << 40) ^ pos0;
    if (layer < 0 || layer >= E->C->L) fz_fail("qkv callback: layer %d", layer);
    if (layer == E->fail_qkv) return 1;
    for (i = 0; i < nq; i++) q[i] = fz_unit(&s);
    for (i = 0; i < nk; i++) {
        k[i] = fz_unit(&s);
        v[i] = fz_unit(&s);
    }
    if (layer == E->special_layer && nk) k[nk / 2] = E->special;
    if (E->decode && nk <= E->last_k_n) memcpy(E->last_k, k, nk * sizeof(float));
    return 0;
}

static volatile float g_sink;

static int fz_attend(void *user, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv)
{
    fz_engine *E = (fz_engine *)user;
    const fz_cache *C = E->C;
    size_t h, i, e, tokens = pqc_cache_tokens(C->c, layer), D = (size_t)C->D;
    float acc = 0.0f;
    (void)q;
    if (layer == E->fail_attend) return 1;
    if (!kv || kv->n_kv_heads != C->H || kv->head_dim != C->D || !kv->count)
        fz_fail("attend callback: view of %d heads x %d dims", kv ? kv->n_kv_heads : -1, kv ? kv->head_dim : -1);
    if (pos0 != E->pos0 || n != E->n)
        fz_fail("attend callback: positions %zu+%zu, expected %zu+%zu", pos0, n, E->pos0, E->n);
    for (h = 0; h < (size_t)C->H; h++) {
        size_t cnt = kv->count[h];
        const uint32_t *pos = kv->pos ? kv->pos[h] : NULL;
        if (!E->decode) {
            size_t es = fz_dsize(kv->dtype);
            if (cnt != tokens || pos || kv->krows)
                fz_fail("prefill view: head %zu has %zu of %zu tokens", h, cnt, tokens);
            for (i = 0; i < cnt * D; i++) acc += fz_get((const unsigned char *)kv->k[h] + i * es, kv->dtype);
            for (i = 0; i < cnt * D; i++) acc += fz_get((const unsigned char *)kv->v[h] + i * es, kv->dtype);
            /* row t is token t's, as pqc_cache_kv_part reads the stores (a fork's or a
               mapped cache's lie in two parts) */
            for (i = 0; i < cnt; i += e) {
                const void *pk, *pv;
                if (pqc_cache_kv_part(C->c, layer, (int)h, i, &pk, &pv, &e) != PQC_SUCCESS || e == 0 || e > cnt - i)
                    fz_fail("prefill view: pqc_cache_kv_part of head %zu at token %zu", h, i);
                if (memcmp(pk, (const unsigned char *)kv->k[h] + i * D * es, e * D * es) ||
                    memcmp(pv, (const unsigned char *)kv->v[h] + i * D * es, e * D * es))
                    fz_fail("prefill view: head %zu rows %zu..%zu are not those tokens' rows", h, i, i + e - 1);
            }
            continue;
        }
        /* gathered rows come in fp32; rows by pointer as stored where the engine reads
           the storage's dtype (accepts_row_pointers 2), else only from fp32 storage */
        if ((int)kv->dtype != (kv->krows ? C->st : (int)PQC_F32) || !pos || cnt == 0 || cnt > tokens ||
            (kv->krows && !(E->row_pointers == 2 || (E->row_pointers && C->st == PQC_F32))))
            fz_fail("decode view: head %zu has %zu rows of %zu tokens (dtype %d)", h, cnt, tokens, (int)kv->dtype);
        for (i = 0; i < cnt; i++) {
            size_t es = fz_dsize(kv->dtype);
            const unsigned char *kr = kv->krows ? (const unsigned char *)kv->krows[h][i] : (const unsigned char *)kv->k[h] + i * D * es;
            const unsigned char *vr = kv->vrows ? (const unsigned char *)kv->vrows[h][i] : (const unsigned char *)kv->v[h] + i * D * es;
            if (pos[i] >= tokens || (i > 0 && pos[i] <= pos[i - 1]))
                fz_fail("decode view: head %zu position %zu (%u) bad", h, i, (unsigned)pos[i]);
            for (e = 0; e < D; e++) acc += fz_get(kr + e * es, kv->dtype) + fz_get(vr + e * es, kv->dtype);
        }
        /* the token just appended is attended, with the K the engine gave, as stored */
        if (pos[cnt - 1] != tokens - 1) fz_fail("decode view: head %zu lacks the new token", h);
        {
            size_t es = fz_dsize(kv->dtype);
            const unsigned char *kr = kv->krows ? (const unsigned char *)kv->krows[h][cnt - 1]
                                                : (const unsigned char *)kv->k[h] + (cnt - 1) * D * es;
            for (e = 0; e < D; e++)
                if (!fz_same(fz_get(kr + e * es, kv->dtype), fz_round(E->last_k[h * D + e], C->st)))
                    fz_fail("decode view: head %zu new token's K[%zu] is %g, engine gave %g", h, e,
                            (double)fz_get(kr + e * es, kv->dtype), (double)E->last_k[h * D + e]);
        }
    }
    g_sink = acc;
    return 0;
}

static void fz_engine_setup(fz_state *S, fz_cache *C, fz_engine *E, pqc_engine *pe, int decode)
{
    fz *f = &S->f;
    unsigned a = rd8(f), b = rd8(f), sp = rd8(f);
    memset(E, 0, sizeof *E);
    E->C = C;
    E->seed = S->seed ^ 0xABCDEFull;
    E->fail_qkv = a >= HOSTILE ? (int)(a % 4) : -1;
    E->fail_attend = b >= HOSTILE ? (int)(b % 4) : -1;
    E->special_layer = sp >= HOSTILE ? (int)(sp % 4) : -1;
    E->special = t_special[sp % NT(t_special)];
    E->decode = decode;
    E->last_k_n = (size_t)C->H * C->D;
    E->last_k = (float *)fz_xalloc(E->last_k_n * sizeof(float));
    memset(pe, 0, sizeof *pe);
    pe->user = E;
    pe->qkv = fz_qkv;
    pe->attend = fz_attend;
    /* rows by pointer: 0 never, 1 from fp32 storage, 2 as stored, 3 (any other non-zero
       value) as 1 */
    E->row_pointers = pe->accepts_row_pointers = (int)(a & 3);
}

static int fz_engine_clean(const fz_engine *E)
{
    int clean = 1, l;
    for (l = 0; l < E->C->L; l++)
        if (l == E->fail_qkv || l == E->fail_attend) clean = 0;
    if (E->special_layer >= 0 && E->special_layer < E->C->L &&
        (E->special != E->special || isinf(E->special) || fabsf(E->special) > fz_store_limit(E->C->st)))
        clean = 0;
    return clean;
}

/* ----- a failed driver call: the counts it must leave, and a save that must load ----- */

/* what each layer holds: tokens, coded and trained tokens, codebook generation and the
   heads' code and outlier counts, folded into one value per layer */
static uint64_t fz_layer_counts(const pqc_cache *c, int l)
{
    const pqc__layer *L = &c->layers[l];
    uint64_t h = 0xcbf29ce484222325ull;
    int hd;
#define FZ_FOLD(x) (h = (h ^ (uint64_t)(x)) * 0x100000001B3ull)
    FZ_FOLD(L->n_tokens);
    FZ_FOLD(L->n_coded);
    FZ_FOLD(L->n_trained);
    FZ_FOLD(L->gen);
    FZ_FOLD(pqc__layer_window_set(L));
    for (hd = 0; hd < c->d.n_kv_heads; hd++) {
        FZ_FOLD(L->heads[hd].codes.count);
        FZ_FOLD(L->heads[hd].n_outliers);
        FZ_FOLD(L->heads[hd].n_outliers_build);
    }
#undef FZ_FOLD
    return h;
}

/* After a failed driver call: every layer's counts as before the call (counts[]), and a
   save of the cache loads. */
static void fz_check_driver_failure(fz_state *S, fz_cache *C, const uint64_t *counts, const char *call, pqc_result r)
{
    const char *path = fz_file();
    pqc_cache *out = NULL;
    pqc_result rs;
    int l;
    for (l = 0; l < C->L; l++)
        if (fz_layer_counts(C->c, l) != counts[l])
            fz_fail("failed %s (%d) changed the counts of layer %d (tokens %zu, coded %zu)", call, (int)r, l,
                    C->c->layers[l].n_tokens, C->c->layers[l].n_coded);
    if (pqc_cache_tokens(C->c, 0) == 0 || (double)C->L * (double)pqc_cache_tokens(C->c, 0) * C->H * C->D > 2e6) return;
    fz_arm();
    rs = fz_expect(pqc_cache_save(C->c, path), "pqc_cache_save after a failed driver call");
    if (rs == PQC_SUCCESS) {
        fz_arm();
        rs = fz_expect(pqc_cache_load(C->rt_null ? NULL : S->rt, &C->d, path, &out), "pqc_cache_load after a failed driver call");
        pqc_cache_destroy(out);
    }
    remove(path);
    /* a file the cache wrote is never refused; anything else only where an allocation was */
    if (rs == PQC_ERROR_BAD_FILE || rs == PQC_ERROR_BAD_SHAPE || (rs != PQC_SUCCESS && fz_heap_failures() == 0))
        fz_fail("after failed %s (%d), a save of the cache did not load: %d (%s)", call, (int)r, (int)rs, pqc_last_error());
}

static void op_driver_prefill(fz_state *S)
{
    static const size_t ns[] = {16, 1, 2, 64, 100, 40, 200, 33};
    static const size_t ns_bad[] = {0, ZMAX, ZMAX / 2, (size_t)1 << 40};
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    unsigned pb = rd8(f);
    size_t n = PICK_Z(f, ns), pos0, per_tok, *before, l;
    uint64_t *counts;
    fz_engine E;
    pqc_engine pe;
    int must_fail = 0, may_fail = 0, big = 0;
    pqc_result r;
    if (!C->c) return;
    fz_engine_setup(S, C, &E, &pe, 0);
    pos0 = pqc_cache_tokens(C->c, 0);
    if (pb >= HOSTILE) {
        pos0 = pb & 1 ? pos0 + 1 : (pos0 ? pos0 - 1 : 5);
        must_fail = 1;
    }
    per_tok = ((size_t)C->Q + 2 * (size_t)C->H) * C->D;
    if (n == 0 || n > C->maxt || pos0 + n > C->maxt) must_fail = 1;
    if (n >= ZMAX / 2 || n == (size_t)1 << 40) big = 1;
    if (!big) {
        /* keep what the engine writes and the layers store within the target's bounds */
        for (l = 0; l < (size_t)C->L && !must_fail; l++)
            if (!fz_layer_fits(C, pqc_cache_tokens(C->c, (int)l) + n)) n = 0;
        if (n && (double)n * per_tok > (double)FZ_MAX_FLOATS) n = 0;
        if (n == 0 && !must_fail) {
            free(E.last_k);
            return;
        }
    }
    if (C->L > 64 || (double)C->L * (double)(pqc_cache_tokens(C->c, 0) + n) * C->H * C->D > 2e6) {
        free(E.last_k);
        return;
    }
    before = (size_t *)fz_xalloc((size_t)C->L * sizeof(size_t));
    for (l = 0; l < (size_t)C->L; l++) {
        before[l] = pqc_cache_tokens(C->c, (int)l);
        if (before[l] + n > C->maxt || before[l] != before[0]) may_fail = 1;
    }
    if (!fz_engine_clean(&E)) may_fail = 1;
    counts = (uint64_t *)fz_xalloc((size_t)C->L * sizeof(uint64_t));
    for (l = 0; l < (size_t)C->L; l++) counts[l] = fz_layer_counts(C->c, (int)l);
    E.pos0 = pos0;
    E.n = n;
    fz_arm();
    r = fz_expect(pqc_driver_prefill(C->c, &pe, pos0, n), "pqc_driver_prefill");
    fz_outcome(r, must_fail, may_fail, "pqc_driver_prefill");
    if (r == PQC_SUCCESS)
        for (l = 0; l < (size_t)C->L; l++)
            if (pqc_cache_tokens(C->c, (int)l) != before[l] + n) fz_fail("pqc_driver_prefill: layer %zu tokens", l);
    if (r != PQC_SUCCESS) fz_check_driver_failure(S, C, counts, "pqc_driver_prefill", r);
    fz_check_fit_finite(S, "pqc_driver_prefill");
    free(counts);
    free(before);
    free(E.last_k);
}

static void op_driver_decode(fz_state *S)
{
    fz *f = &S->f;
    fz_cache *C = fz_pick_cache(S);
    unsigned pb = rd8(f);
    size_t pos, *before, l;
    uint64_t *counts;
    fz_engine E;
    pqc_engine pe;
    int must_fail = 0, may_fail = 0;
    pqc_result r;
    if (!C->c || C->L > 64 || (double)C->L * (double)(pqc_cache_tokens(C->c, 0) + 1) * C->H * C->D > 2e6) return;
    if ((double)C->Q * C->D + 2.0 * C->H * C->D * (double)(pqc_cache_tokens(C->c, 0) + 2) > (double)FZ_MAX_FLOATS)
        return;
    fz_engine_setup(S, C, &E, &pe, 1);
    pos = pqc_cache_tokens(C->c, 0);
    if (pb >= HOSTILE) {
        pos = pb & 1 ? pos + 1 : (pos ? pos - 1 : 0);
        must_fail = 1;
    }
    if (pos == 0) must_fail = 1;
    before = (size_t *)fz_xalloc((size_t)C->L * sizeof(size_t));
    for (l = 0; l < (size_t)C->L; l++) {
        before[l] = pqc_cache_tokens(C->c, (int)l);
        if (before[l] == 0 || before[l] + 1 > C->maxt) may_fail = 1;
        if (before[l] != before[0]) may_fail = 1; /* layers of different lengths: no one position */
        if (!fz_layer_fits(C, before[l] + 1)) {
            free(before);
            free(E.last_k);
            return;
        }
    }
    if ((double)C->maxt * C->H * 4.0 > (double)g_heap.limit_one) may_fail = 1; /* its selection */
    if (!fz_engine_clean(&E)) may_fail = 1;
    counts = (uint64_t *)fz_xalloc((size_t)C->L * sizeof(uint64_t));
    for (l = 0; l < (size_t)C->L; l++) counts[l] = fz_layer_counts(C->c, (int)l);
    E.pos0 = pos;
    E.n = 1;
    fz_arm();
    r = fz_expect(pqc_driver_decode(C->c, &pe, pos), "pqc_driver_decode");
    fz_outcome(r, must_fail, may_fail, "pqc_driver_decode");
    if (r == PQC_SUCCESS)
        for (l = 0; l < (size_t)C->L; l++)
            if (pqc_cache_tokens(C->c, (int)l) != before[l] + 1) fz_fail("pqc_driver_decode: layer %zu tokens", l);
    if (r != PQC_SUCCESS) fz_check_driver_failure(S, C, counts, "pqc_driver_decode", r);
    free(counts);
    free(before);
    free(E.last_k);
}

/* ----- batches over both cache slots ----- */
static void op_batch(fz_state *S, int fetch)
{
    fz *f = &S->f;
    unsigned nb = rd8(f), w0 = rd8(f) & 1, w1 = rd8(f) & 1, arr = rd8(f);
    int n = nb < HOSTILE ? (int)(nb % 2) + 1 : (int)(nb % 3) - 1; /* 1, 2; hostile -1..1 */
    int layer = (int)(rd8(f) % 3), must_fail = 0, i;
    pqc_cache *caches[2];
    fz_cache *C[2];
    fz_sel *sel[2];
    pqc_selection *sp[2];
    const pqc_selection *csp[2];
    float *q[2] = {NULL, NULL}, *ko[2] = {NULL, NULL}, *vo[2] = {NULL, NULL};
    const float *cq[2] = {NULL, NULL};
    pqc_kv_out out[2];
    const pqc_kv_out *op[2];
    size_t stride[2] = {1, 1};
    pqc_result r;
    C[0] = &S->cache[0];
    C[1] = &S->cache[1];
    sel[0] = &C[0]->sel[w0];
    sel[1] = &C[1]->sel[w1];
    if (n <= 0) must_fail = 1;
    for (i = 0; i < 2; i++) {
        int nf = 0, hg = 0;
        caches[i] = C[i]->c;
        sp[i] = &sel[i]->s;
        csp[i] = &sel[i]->s;
        op[i] = &out[i];
        memset(&out[i], 0, sizeof out[i]);
        if (i >= n) continue;
        if (!C[i]->c || !fz_layer_ok(C[i], layer)) {
            must_fail = 1;
            continue;
        }
        if (i == 1 && C[1]->rt_null != C[0]->rt_null) must_fail = 1;
        if (!fetch) {
            size_t nq = (size_t)C[i]->Q * C[i]->D, tok = pqc_cache_tokens(C[i]->c, layer);
            if (nq > FZ_MAX_FLOATS) goto out;
            q[i] = fz_vec(f, S->seed + 7 + (uint64_t)i, nq, &nf, &hg);
            cq[i] = q[i];
            if (nf || !sel[i]->s.idx || !sel[i]->s.count || sel[i]->s.n_kv_heads != C[i]->H || tok == 0 ||
                (tok > sel[i]->s.capacity && !sel[i]->s.owned))
                must_fail = 1;
        } else {
            size_t mc = 0;
            if (!fz_sel_valid(C[i], layer, &sel[i]->s, &mc)) must_fail = 1;
            stride[i] = mc ? mc : 1;
            if ((double)stride[i] * C[i]->H * C[i]->D > (double)FZ_MAX_FLOATS) goto out;
            ko[i] = (float *)fz_xalloc(stride[i] * (size_t)C[i]->H * C[i]->D * sizeof(float));
            vo[i] = (float *)fz_xalloc(stride[i] * (size_t)C[i]->H * C[i]->D * sizeof(float));
            out[i].k = ko[i];
            out[i].v = vo[i];
            out[i].head_stride = stride[i];
        }
    }
    if (arr >= HOSTILE) must_fail = 1; /* null arrays */
    {
        /* hostile: one of the arrays null */
        int h = arr >= HOSTILE, no_caches = h && (arr & 1), no_q = h && (arr & 2), no_out = h && !(arr & 3);
        fz_arm();
        if (!fetch)
            r = fz_expect(pqc_batch_select(no_caches ? NULL : caches, n, layer, no_q ? NULL : cq, no_out ? NULL : sp),
                          "pqc_batch_select");
        else
            r = fz_expect(pqc_batch_fetch(no_caches ? NULL : caches, n, layer, no_q ? NULL : csp, no_out ? NULL : op),
                          "pqc_batch_fetch");
    }
    fz_outcome(r, must_fail, 1, fetch ? "pqc_batch_fetch" : "pqc_batch_select");
    if (r == PQC_SUCCESS)
        for (i = 0; i < n && i < 2; i++) {
            if (!fetch) fz_check_selection(C[i], layer, &sel[i]->s, "pqc_batch_select");
            else fz_check_fetched(C[i], layer, &sel[i]->s, ko[i], vo[i], stride[i], "pqc_batch_fetch");
        }
out:
    for (i = 0; i < 2; i++) {
        free(q[i]);
        free(ko[i]);
        free(vo[i]);
    }
}

/* ---------------------------------------------------------------------------------------
   PQ core
   ------------------------------------------------------------------------------------- */
typedef struct fz_si {
    float s;
    uint32_t i;
} fz_si;
static int fz_cmp_si(const void *a, const void *b)
{
    const fz_si *x = (const fz_si *)a, *y = (const fz_si *)b;
    if (x->s > y->s) return -1;
    if (x->s < y->s) return 1;
    return x->i < y->i ? -1 : x->i > y->i;
}
static int fz_cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}
/* the k best of n scores (higher first, ties to the lower index), ascending */
static void fz_ref_topk(const float *s, size_t n, size_t k, uint32_t *out)
{
    fz_si *a = (fz_si *)fz_xalloc(n * sizeof *a);
    size_t i;
    for (i = 0; i < n; i++) {
        a[i].s = s[i];
        a[i].i = (uint32_t)i;
    }
    qsort(a, n, sizeof *a, fz_cmp_si);
    for (i = 0; i < k; i++) out[i] = a[i].i;
    qsort(out, k, sizeof *out, fz_cmp_u32);
    free(a);
}
static void fz_check_topk(const char *call, const float *scores, size_t n, size_t k, size_t offset, const uint32_t *idx,
                          const float *out_scores)
{
    uint32_t *ref = (uint32_t *)fz_xalloc(k * sizeof(uint32_t));
    size_t i;
    fz_ref_topk(scores, n, k, ref);
    for (i = 0; i < k; i++) {
        if (idx[i] != ref[i] + offset)
            fz_fail("%s: entry %zu of the top-%zu of %zu is %u, the reference has %u (scores %g vs %g)", call, i, k, n,
                    (unsigned)idx[i], (unsigned)(ref[i] + offset),
                    idx[i] >= offset && idx[i] - offset < n ? (double)scores[idx[i] - offset] : 0.0,
                    (double)scores[ref[i]]);
        if (out_scores && !fz_same(out_scores[i], scores[ref[i]]))
            fz_fail("%s: score %zu is %g, not the score %g of its token", call, i, (double)out_scores[i],
                    (double)scores[ref[i]]);
    }
    free(ref);
}

static int fz_pq_ok(const pqc_pq *pq) { return pq->m > 0 && pq->centroids != NULL; }

static void op_pq_train(fz_state *S)
{
    fz *f = &S->f;
    unsigned slot = rd8(f) & 1, flags = rd8(f);
    int dim = PICK_I(f, t_dim);
    size_t rows = PICK_Z(f, t_rows), cols, nobj = 0, cells;
    pqc_pq_desc d;
    pqc_pq out, ref;
    fz_mat K;
    double *obj = NULL, *obj2 = NULL;
    float *blocks = NULL;
    int must_fail = 0, m_eff, bits_eff, it_eff, use_null = (flags & 1) != 0;
    pqc_result r;
    unsigned char pattern[sizeof(pqc_pq)];
    memset(&d, 0, sizeof d);
    d.m = PICK_I(f, t_m);
    d.bits = PICK_I(f, t_bits);
    d.iters = PICK_I(f, t_iters);
    d.init = (pqc_init)PICK_I(f, t_init);
    d.max_points_per_centroid = PICK_I(f, t_mppc);
    d.seed = rd8(f);
    d.device = PICK_I(f, t_device);
    d.rope = (pqc_rope)PICK_I(f, t_rope);
    d.subspaces = (pqc_subspaces)PICK_I(f, t_subsp);
    if (dim == INT_MAX || dim == 65537) cols = 65537; /* too wide: rejected before any work */
    else cols = dim > 0 ? (size_t)dim : 0;
    if (cols && rows > FZ_MAX_LAYER_FLOATS / cols) rows = FZ_MAX_LAYER_FLOATS / cols;
    if (cols > 65536) rows = 1;
    if (rows == 0) rows = 1;
    m_eff = d.m == 0 ? fz_default_m((long long)cols, (int)d.subspaces) : d.m;
    bits_eff = d.bits == 0 ? PQC_DEFAULT_BITS : d.bits;
    it_eff = d.iters == 0 ? 10 : d.iters < 0 ? 0 : d.iters;
    /* bound the k-means work: rows x 2^bits x dim x iterations */
    if (bits_eff >= 1 && bits_eff <= 8 && it_eff <= 100000 &&
        (double)rows * (double)(1 << bits_eff) * (double)cols * (it_eff + 1) > 3e7)
        return;
    fz_mat_gen(f, S->seed + 11, rows, cols, 1, 0, &K);
    if (cols == 0 || cols > 65536 || K.bad || K.nonfinite) must_fail = 1;
    if (m_eff < 1 || (cols && (size_t)m_eff > cols) || (cols && cols % (size_t)m_eff) || bits_eff < 1 || bits_eff > 8 ||
        it_eff > 100000 || (int)d.init < 0 || (int)d.init > 1 || d.device != 0)
        must_fail = 1;
    if (cols > 0 && cols <= 65536 && fz_rope_bad((int)d.rope, (int)d.subspaces, (long long)cols, m_eff)) must_fail = 1;
    if ((flags & 8) && m_eff >= 1 && cols > 0 && cols <= 65536 && cols % (size_t)m_eff == 0 &&
        cols * (cols / (size_t)m_eff) <= ((size_t)1 << 18)) {
        /* metric blocks: symmetric positive definite (diagonally dominant), or broken */
        size_t ds = cols / (size_t)m_eff, j, a, b;
        unsigned kind = rd8(f), x = 2463534242u ^ (kind * 2654435761u);
        kind %= 5;
        blocks = (float *)fz_xalloc((size_t)m_eff * ds * ds * sizeof(float));
        for (j = 0; j < (size_t)m_eff; j++) /* entries from the byte's xorshift, not the input */
            for (a = 0; a < ds; a++)
                for (b = 0; b <= a; b++) {
                    float v;
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    v = a == b ? (float)(ds + 1 + (x & 7)) : (float)((int)(x % 3) - 1);
                    blocks[(j * ds + a) * ds + b] = blocks[(j * ds + b) * ds + a] = v;
                }
        if (kind == 1 && ds > 1) blocks[1] += 1.0f;         /* not symmetric */
        if (kind == 2) blocks[0] = -blocks[0];              /* not positive definite */
        if (kind == 3) blocks[(size_t)(m_eff - 1) * ds * ds] = NAN;
        if ((kind == 1 && ds > 1) || kind == 2 || kind == 3 || ds > 256) must_fail = 1;
        if (kind == 4) d.metric = blocks;                   /* weights and blocks: one metric, not both */
        if (kind == 4) must_fail = 1;
        d.metric_blocks = blocks;
    }
    if (!must_fail && (flags & 2)) {
        nobj = (size_t)m_eff * (size_t)(it_eff + 1);
        obj = (double *)fz_xalloc(nobj * sizeof(double));
        obj2 = (double *)fz_xalloc(nobj * sizeof(double));
        d.objective = obj;
    }
    memset(pattern, 0xA5, sizeof pattern);
    memcpy(&out, pattern, sizeof out);
    fz_arm();
    r = fz_expect(pqc_pq_train(use_null ? NULL : S->rt, &d, &K.m, &out), "pqc_pq_train");
    fz_outcome(r, must_fail, K.huge, "pqc_pq_train");
    if (r != PQC_SUCCESS) {
        if (memcmp(&out, pattern, sizeof out)) fz_fail("failed pqc_pq_train (%d) wrote its output", (int)r);
        goto done;
    }
    if (out.dim != (int)cols || out.m != m_eff || out.bits != bits_eff || out.ksub != 1 << bits_eff ||
        out.dsub != (int)cols / m_eff || !out.centroids)
        fz_fail("pqc_pq_train: dim %d m %d bits %d ksub %d dsub %d", out.dim, out.m, out.bits, out.ksub, out.dsub);
    cells = (size_t)out.m * out.ksub * out.dsub;
    {
        size_t i;
        for (i = 0; i < cells; i++)
            if (!isfinite(out.centroids[i])) fz_fail("pqc_pq_train: centroid value %zu is not finite", i);
    }
    if (obj) {
        size_t j, t;
        /* the objective is computed from expanded distances (|x|^2 - 2 x.c + |c|^2, each a
           float sum over a sub-space), so a value is exact only to a few ulps of |x|^2:
           a point that sits on its centroid may count 0 at one iteration and a rounding
           residue at the next. A rise beyond that bound is a defect. */
        double slack = 8.0 * FLT_EPSILON * (double)out.dsub * (double)K.maxabs * (double)K.maxabs;
        for (j = 0; j < (size_t)m_eff; j++)
            for (t = 0; t < (size_t)it_eff + 1; t++) {
                double o = obj[j * (it_eff + 1) + t];
                if (!(o >= 0) || !isfinite(o)) fz_fail("pqc_pq_train: objective %zu of sub-space %zu is %g", t, j, o);
                if (t > 0 && o > obj[j * (it_eff + 1) + t - 1] * (1.0 + 1e-6) + slack + 1e-30)
                    fz_fail("pqc_pq_train: the objective of sub-space %zu rose at iteration %zu: %.17g -> %.17g", j, t,
                            obj[j * (it_eff + 1) + t - 1], o);
            }
    }
    /* the same bits with the scalar kernels inline */
    if (!use_null && (flags & 4)) {
        d.objective = obj2;
        fz_arm();
        if (fz_expect(pqc_pq_train(NULL, &d, &K.m, &ref), "pqc_pq_train(NULL)") == PQC_SUCCESS) {
            if (memcmp(ref.centroids, out.centroids, cells * sizeof(float)))
                fz_fail("pqc_pq_train: centroids differ between the runtime (%s) and rt = NULL",
                        pqc_simd_name(pqc_runtime_simd(S->rt)));
            if (obj && memcmp(obj, obj2, nobj * sizeof(double)))
                fz_fail("pqc_pq_train: objectives differ between the runtime and rt = NULL");
            pqc_pq_free(&ref);
        } else if (fz_heap_failures() == 0) {
            fz_fail("pqc_pq_train with rt = NULL failed where the runtime succeeded");
        }
    }
    /* codes that belong to the old PQ stay (a mismatch the search must reject) */
    pqc_pq_free(&S->pq[slot]);
    S->pq[slot] = out;
done:
    free(obj);
    free(obj2);
    free(blocks);
    fz_mat_free(&K);
}

static const size_t t_cap[] = {0, 1, 64, 100, 1000, 63, 65};
static const size_t t_cap_bad[] = {ZMAX,           ZMAX / 2,       ZMAX / 8,           ZMAX / 8 + 1, ZMAX - 15,
                                   (size_t)1 << 61, (size_t)1 << 62, (size_t)1 << 40,    (size_t)1 << 32,
                                   ZMAX / 3 + 1,   ZMAX / 6 + 1,   (ZMAX - 7) / 8 + 1, ZMAX / 5};

/* bytes the codes of `cap` tokens need, in double: m * ceil(cap * bits / 8) */
static double fz_codes_bytes(int m, int bits, size_t cap) { return (double)m * ((double)cap * bits / 8.0 + 16.0); }

static void op_codes_init(fz_state *S)
{
    fz *f = &S->f;
    unsigned cs = rd8(f) & 1, ps = rd8(f), how = rd8(f);
    size_t cap = PICK_Z(f, t_cap);
    pqc_pq *pq = &S->pq[ps & 1];
    pqc_codes *codes = &S->codes[cs];
    int must_fail = !fz_pq_ok(pq);
    pqc_result r;
    const pqc_allocator *a = (how & 1) ? &g_alloc : NULL;
    if (S->codes_ok[cs]) pqc_codes_free(codes);
    S->codes_ok[cs] = 0;
    if (fz_pq_ok(pq) && cap && fz_codes_bytes(pq->m, pq->bits, cap) > (double)g_heap.limit_one) must_fail = 1;
    fz_arm();
    r = fz_expect(pqc_codes_init(codes, (how & 0xf0) == 0xf0 ? NULL : pq, cap, a), "pqc_codes_init");
    if ((how & 0xf0) == 0xf0) must_fail = 1;
    fz_outcome(r, must_fail, 0, "pqc_codes_init");
    if (r != PQC_SUCCESS) {
        memset(codes, 0, sizeof *codes);
        return;
    }
    if (codes->m != pq->m || codes->bits != pq->bits || codes->count != 0 || codes->capacity < cap)
        fz_fail("pqc_codes_init: m %d bits %d count %zu capacity %zu for %zu", codes->m, codes->bits, codes->count,
                codes->capacity, cap);
    S->codes_ok[cs] = 1;
}

static void op_codes_reserve(fz_state *S)
{
    fz *f = &S->f;
    unsigned cs = rd8(f) & 1;
    size_t cap = PICK_Z(f, t_cap);
    pqc_codes *codes = &S->codes[cs], before = *codes;
    int must_fail = !S->codes_ok[cs];
    pqc_result r;
    if (S->codes_ok[cs] && cap > codes->capacity &&
        fz_codes_bytes(codes->m, codes->bits, cap) > (double)g_heap.limit_one)
        must_fail = 1;
    fz_arm();
    r = fz_expect(pqc_codes_reserve(codes, cap), "pqc_codes_reserve");
    fz_outcome(r, must_fail, 0, "pqc_codes_reserve");
    if (r != PQC_SUCCESS) {
        if (memcmp(&before, codes, sizeof before)) fz_fail("failed pqc_codes_reserve (%d) changed the codes", (int)r);
        return;
    }
    if (codes->capacity < cap || codes->count != before.count)
        fz_fail("pqc_codes_reserve: capacity %zu for %zu", codes->capacity, cap);
    {
        /* the codes already there survive the move */
        size_t t;
        int j;
        for (t = 0; t < codes->count && t < 64; t++)
            for (j = 0; j < codes->m; j++)
                if (pqc_codes_get(codes, t, j) >= (1u << codes->bits)) fz_fail("pqc_codes_get out of range");
    }
}

static void op_pq_encode(fz_state *S)
{
    fz *f = &S->f;
    unsigned ps = rd8(f) & 1, cs = rd8(f) & 1, flags = rd8(f);
    pqc_pq *pq = &S->pq[ps];
    pqc_codes *codes = &S->codes[cs], fresh;
    size_t rows = PICK_Z(f, t_rows), cols, before, t;
    fz_mat K;
    int must_fail = 0, j;
    pqc_result r;
    if (!fz_pq_ok(pq) || !S->codes_ok[cs]) return;
    cols = (size_t)pq->dim + (flags >= HOSTILE ? 1 : 0);
    if (rows > FZ_MAX_LAYER_FLOATS / cols) rows = FZ_MAX_LAYER_FLOATS / cols;
    if (rows == 0) return;
    if (codes->count + rows > (size_t)1 << 20) return;
    if ((double)rows * (1 << pq->bits) * (double)cols > 3e7) return;
    fz_mat_gen(f, S->seed + 12, rows, cols, 1, 0, &K);
    if (flags >= HOSTILE || K.bad || K.nonfinite || codes->m != pq->m || codes->bits != pq->bits) must_fail = 1;
    before = codes->count;
    fz_arm();
    r = fz_expect(pqc_pq_encode((flags & 1) ? NULL : S->rt, pq, &K.m, codes), "pqc_pq_encode");
    fz_outcome(r, must_fail, K.huge, "pqc_pq_encode");
    if (r != PQC_SUCCESS) {
        if (codes->count != before) fz_fail("failed pqc_pq_encode (%d) changed the code count", (int)r);
        fz_mat_free(&K);
        return;
    }
    if (codes->count != before + rows)
        fz_fail("pqc_pq_encode: %zu -> %zu codes for %zu rows", before, codes->count, rows);
    if (pqc_codes_bytes(codes) != (size_t)codes->m * ((codes->count * (size_t)codes->bits + 7) / 8))
        fz_fail("pqc_codes_bytes is not m * ceil(count * bits / 8)");
    /* the same codes from the scalar kernels inline; a decode is its centroids */
    if (pqc_codes_init(&fresh, pq, rows, &g_alloc) == PQC_SUCCESS) {
        if (pqc_pq_encode(NULL, pq, &K.m, &fresh) == PQC_SUCCESS) {
            for (t = 0; t < rows; t++)
                for (j = 0; j < pq->m; j++)
                    if (pqc_codes_get(&fresh, t, j) != pqc_codes_get(codes, before + t, j))
                        fz_fail("pqc_pq_encode: token %zu sub-space %d codes differ between the runtime and rt = NULL",
                                t, j);
        }
        pqc_codes_free(&fresh);
    }
    {
        float *rec = (float *)fz_xalloc((size_t)pq->dim * sizeof(float));
        size_t e, tt = before + (flags >> 1) % rows;
        fz_arm();
        if (fz_expect(pqc_pq_decode(pq, codes, tt, rec), "pqc_pq_decode") != PQC_SUCCESS)
            fz_fail("pqc_pq_decode of a coded token failed");
        for (j = 0; j < pq->m; j++)
            for (e = 0; e < (size_t)pq->dsub; e++)
                if (!fz_same(rec[pqc_pq_dim(pq, j, (int)e)], /* element e of sub-space j is that dim */
                             pq->centroids[((size_t)j * pq->ksub + pqc_codes_get(codes, tt, j)) * pq->dsub + e]))
                    fz_fail("pqc_pq_decode is not the centroid of the code");
        fz_arm();
        if (fz_expect(pqc_pq_decode(pq, codes, codes->count + (flags >> 4), rec), "pqc_pq_decode") == PQC_SUCCESS)
            fz_fail("pqc_pq_decode past the codes succeeded");
        free(rec);
    }
    fz_mat_free(&K);
}

static void op_pq_search(fz_state *S)
{
    static const int gs[] = {1, 2, 4, 3};
    static const int gs_bad[] = {0, -1, 1025, 1024};
    static const size_t ks[] = {1, 5, 16, 2, 100};
    static const size_t ks_bad[] = {0, ZMAX, 1u << 31};
    fz *f = &S->f;
    unsigned ps = rd8(f) & 1, cs = rd8(f) & 1, flags = rd8(f), fb = rd8(f), cb = rd8(f);
    pqc_pq *pq = &S->pq[ps];
    pqc_codes *codes = &S->codes[cs];
    int g = PICK_I(f, gs), must_fail = 0, nf, hg, gqa = (int)(flags >> 1 & 1);
    size_t k = PICK_Z(f, ks), first, count, cnt_eff, nq;
    pqc_search_desc sd;
    float *q, *scores = NULL, *all = NULL, *scores2 = NULL;
    uint32_t *idx, *idx2 = NULL;
    pqc_result r;
    if (!fz_pq_ok(pq) || !S->codes_ok[cs] || codes->count == 0) return;
    first = fb < HOSTILE ? (fb & 1 ? codes->count / 2 : 0) : (fb & 1 ? codes->count + 1 : codes->count);
    count = cb < HOSTILE ? (cb & 1 ? 0 : (codes->count - (first < codes->count ? first : codes->count)) / 2 + 1)
                         : (cb & 1 ? ZMAX : codes->count + 1);
    if (flags >= HOSTILE) gqa = (flags & 1) ? 2 : -1;
    memset(&sd, 0, sizeof sd);
    sd.k = k;
    sd.gqa = (pqc_gqa)gqa;
    sd.first = first;
    sd.count = count;
    cnt_eff = count ? count : (first < codes->count ? codes->count - first : 0);
    if (codes->m != pq->m || codes->bits != pq->bits || g <= 0 || g > 1024 || gqa < 0 || gqa > 1 || cnt_eff == 0 ||
        first > codes->count || cnt_eff > codes->count - first || k == 0 || k > cnt_eff)
        must_fail = 1;
    nq = (size_t)(g > 0 ? g : 1) * (size_t)pq->dim;
    if (nq > FZ_MAX_FLOATS) return;
    q = fz_vec(f, S->seed + 13, nq, &nf, &hg);
    if (nf) must_fail = 1;
    /* k entries for a valid search; one for a search that must fail, which writes none */
    idx = (uint32_t *)fz_xalloc((must_fail ? 1 : k) * sizeof(uint32_t));
    if (flags & 8) scores = (float *)fz_xalloc((must_fail ? 1 : k) * sizeof(float));
    fz_arm();
    r = fz_expect(pqc_pq_search((flags & 4) ? NULL : S->rt, pq, codes, q, g, &sd, (flags & 16) ? &S->scratch : NULL,
                                idx, scores),
                  "pqc_pq_search");
    fz_outcome(r, must_fail, hg, "pqc_pq_search");
    if (r == PQC_SUCCESS) {
        all = (float *)fz_xalloc(cnt_eff * sizeof(float));
        fz_arm();
        if (fz_expect(pqc_pq_scores((flags & 4) ? NULL : S->rt, pq, codes, q, g, &sd, NULL, all), "pqc_pq_scores") !=
            PQC_SUCCESS) {
            if (fz_heap_failures() == 0) fz_fail("pqc_pq_scores failed where pqc_pq_search succeeded");
        } else {
            size_t i;
            for (i = 0; i < cnt_eff; i++)
                if (all[i] != all[i]) fz_fail("pqc_pq_scores: score %zu is NaN", i);
            fz_check_topk("pqc_pq_search", all, cnt_eff, k, first, idx, scores);
        }
        if (!(flags & 4)) {
            idx2 = (uint32_t *)fz_xalloc(k * sizeof(uint32_t));
            scores2 = (float *)fz_xalloc(k * sizeof(float));
            if (pqc_pq_search(NULL, pq, codes, q, g, &sd, NULL, idx2, scores2) == PQC_SUCCESS &&
                (memcmp(idx, idx2, k * sizeof(uint32_t)) || (scores && memcmp(scores, scores2, k * sizeof(float)))))
                fz_fail("pqc_pq_search: results differ between the runtime (%s) and rt = NULL",
                        pqc_simd_name(pqc_runtime_simd(S->rt)));
        }
    }
    free(q);
    free(idx);
    free(idx2);
    free(scores);
    free(scores2);
    free(all);
}

static void op_pq_misc(fz_state *S)
{
    fz *f = &S->f;
    unsigned ps = rd8(f) & 1, what = rd8(f);
    pqc_pq *pq = &S->pq[ps];
    pqc_result r;
    switch (what % 4) {
    case 0: { /* codes_get anywhere: 0 outside, a code inside */
        pqc_codes *codes = &S->codes[what >> 2 & 1];
        size_t t = rd16(f);
        int j = (int)rd8(f) - 2;
        unsigned v = pqc_codes_get(codes, t, j);
        if ((t >= codes->count || j < 0 || j >= codes->m) && v != 0) fz_fail("pqc_codes_get outside the codes: %u", v);
        if (codes->bits > 0 && codes->bits <= 8 && v >= (1u << codes->bits)) fz_fail("pqc_codes_get: %u too large", v);
        (void)pqc_codes_get(NULL, t, j);
        break;
    }
    case 1: { /* mse of fresh keys */
        size_t rows = PICK_Z(f, t_rows);
        fz_mat K;
        double mse = -1;
        if (!fz_pq_ok(pq)) return;
        if (rows > FZ_MAX_LAYER_FLOATS / (size_t)pq->dim) rows = FZ_MAX_LAYER_FLOATS / (size_t)pq->dim;
        if (rows == 0 || (double)rows * (1 << pq->bits) * pq->dim > 3e7) return;
        fz_mat_gen(f, S->seed + 14, rows, (size_t)pq->dim, 1, 0, &K);
        fz_arm();
        r = fz_expect(pqc_pq_mse((what & 4) ? NULL : S->rt, pq, &K.m, &mse), "pqc_pq_mse");
        fz_outcome(r, K.bad || K.nonfinite, K.huge, "pqc_pq_mse");
        if (r == PQC_SUCCESS && !(mse >= 0)) fz_fail("pqc_pq_mse: %g", mse);
        fz_mat_free(&K);
        break;
    }
    case 2: { /* lookup tables */
        static const int gs[] = {1, 2, 4};
        static const int gs_bad[] = {0, -1, 1025};
        int g = PICK_I(f, gs), nf, hg;
        float *q, *lut;
        size_t nq;
        if (!fz_pq_ok(pq)) return;
        nq = (size_t)(g > 0 ? g : 1) * (size_t)pq->dim;
        if (nq > FZ_MAX_FLOATS || (size_t)(g > 0 ? g : 1) * pq->m * pq->ksub > FZ_MAX_FLOATS) return;
        q = fz_vec(f, S->seed + 15, nq, &nf, &hg);
        lut = (float *)fz_xalloc((size_t)(g > 0 ? g : 1) * pq->m * pq->ksub * sizeof(float));
        fz_arm();
        r = fz_expect(pqc_pq_lut(S->rt, pq, q, g, lut), "pqc_pq_lut");
        fz_outcome(r, nf || g <= 0 || g > 1024, hg, "pqc_pq_lut");
        free(q);
        free(lut);
        break;
    }
    default: { /* recall */
        uint32_t truth[4] = {1, 5, 9, 30}, got[5] = {0, 1, 9, 30, 31};
        double rc = pqc_recall(truth, 4, got, 5);
        if (rc != 0.75) fz_fail("pqc_recall: %g, expected 0.75", rc);
        if (pqc_recall(NULL, 0, got, 5) != 1.0 || pqc_recall(truth, 4, NULL, 0) != 0.0)
            fz_fail("pqc_recall edge cases");
        break;
    }
    }
}

static void op_exact(fz_state *S)
{
    static const int gs[] = {1, 2, 4, 3};
    static const int gs_bad[] = {0, -1, 1025};
    static const size_t ks[] = {1, 5, 16, 2, 100};
    static const size_t ks_bad[] = {0, ZMAX};
    fz *f = &S->f;
    unsigned flags = rd8(f);
    int dim = PICK_I(f, t_dim), g = PICK_I(f, gs), gqa = (int)(flags & 1), must_fail = 0, nf, hg;
    size_t rows = PICK_Z(f, t_rows), k = PICK_Z(f, ks), cols, nq;
    fz_mat K;
    float *q, *all, *sc = NULL, *sc2 = NULL;
    uint32_t *idx, *idx2 = NULL;
    pqc_search_desc sd;
    pqc_result r;
    if (dim <= 0 || dim > 4096) return;
    cols = (size_t)dim;
    if (rows > FZ_MAX_LAYER_FLOATS / cols) rows = FZ_MAX_LAYER_FLOATS / cols;
    if (rows == 0) return;
    nq = (size_t)(g > 0 ? g : 1) * cols;
    if (nq > FZ_MAX_FLOATS) return;
    if (flags >= HOSTILE) gqa = (flags & 2) ? 2 : -1;
    fz_mat_gen(f, S->seed + 16, rows, cols, 1, 0, &K);
    q = fz_vec(f, S->seed + 17, nq, &nf, &hg);
    memset(&sd, 0, sizeof sd);
    sd.k = k;
    sd.gqa = (pqc_gqa)gqa;
    if (K.bad || nf || g <= 0 || g > 1024 || gqa < 0 || gqa > 1 || k == 0 || k > rows) must_fail = 1;
    idx = (uint32_t *)fz_xalloc((k && k <= rows ? k : 1) * sizeof(uint32_t));
    if (flags & 4) sc = (float *)fz_xalloc((k && k <= rows ? k : 1) * sizeof(float));
    all = (float *)fz_xalloc(rows * sizeof(float));
    fz_arm();
    r = fz_expect(pqc_exact_search((flags & 8) ? NULL : S->rt, &K.m, q, g, &sd, (flags & 16) ? &S->scratch : NULL, idx,
                                   sc),
                  "pqc_exact_search");
    fz_outcome(r, must_fail, hg || K.huge || K.nonfinite, "pqc_exact_search");
    if (r == PQC_SUCCESS) {
        size_t i;
        if (K.nonfinite) fz_fail("pqc_exact_search ranked keys holding NaN or Inf");
        fz_arm();
        if (fz_expect(pqc_exact_scores((flags & 8) ? NULL : S->rt, &K.m, q, g, (pqc_gqa)gqa, NULL, all),
                      "pqc_exact_scores") == PQC_SUCCESS) {
            for (i = 0; i < rows; i++)
                if (all[i] != all[i]) fz_fail("pqc_exact_search succeeded though score %zu is NaN", i);
            fz_check_topk("pqc_exact_search", all, rows, k, 0, idx, sc);
        } else if (fz_heap_failures() == 0) {
            fz_fail("pqc_exact_scores failed where pqc_exact_search succeeded");
        }
        if (!(flags & 8)) {
            idx2 = (uint32_t *)fz_xalloc(k * sizeof(uint32_t));
            sc2 = (float *)fz_xalloc(k * sizeof(float));
            if (pqc_exact_search(NULL, &K.m, q, g, &sd, NULL, idx2, sc2) == PQC_SUCCESS &&
                (memcmp(idx, idx2, k * sizeof(uint32_t)) || (sc && memcmp(sc, sc2, k * sizeof(float)))))
                fz_fail("pqc_exact_search: results differ between the runtime (%s) and rt = NULL",
                        pqc_simd_name(pqc_runtime_simd(S->rt)));
        }
    }
    fz_mat_free(&K);
    free(q);
    free(all);
    free(idx);
    free(idx2);
    free(sc);
    free(sc2);
}

static void op_topk(fz_state *S)
{
    static const size_t ns[] = {100, 1, 2, 5, 1000, 8193, 9000, 20000, 31};
    static const size_t ns_bad[] = {0};
    static const size_t ks[] = {1, 2, 10, 0x7fffffff /* n */, 0x7ffffffe /* n/2 */, 0x7ffffffd /* n-1 */};
    static const size_t ks_bad[] = {0, 0x7ffffffc /* n+1 */, ZMAX};
    fz *f = &S->f;
    unsigned flags = rd8(f), pat = rd8(f), nspec = rd8(f) % 6, i;
    size_t n = PICK_Z(f, ns), k = PICK_Z(f, ks), j;
    float *s, *sc = NULL;
    uint32_t *idx;
    uint64_t rng = S->seed ^ pat;
    int has_nan = 0, must_fail = 0;
    pqc_result r;
    if (k == 0x7fffffff) k = n;
    else if (k == 0x7ffffffe) k = n / 2;
    else if (k == 0x7ffffffd) k = n ? n - 1 : 0;
    else if (k == 0x7ffffffc) k = n + 1;
    s = (float *)fz_xalloc((n ? n : 1) * sizeof(float));
    for (j = 0; j < n; j++) {
        switch (pat % 5) {
        case 0: s[j] = fz_unit(&rng); break;
        case 1: s[j] = (float)(fz_mix(&rng) % 4); break; /* many ties */
        case 2: s[j] = (fz_mix(&rng) & 1) ? 0.0f : -0.0f; break;
        case 3: s[j] = (float)j * ((pat & 8) ? 1.0f : -1.0f); break;
        default: s[j] = fz_unit(&rng) * 1e38f; break;
        }
    }
    for (i = 0; i < nspec; i++) {
        size_t at = rd16(f);
        float v = t_special[rd8(f) % NT(t_special)];
        if (n) s[at % n] = v;
    }
    for (j = 0; j < n; j++)
        if (s[j] != s[j]) has_nan = 1;
    if (n == 0 || k == 0 || k > n || has_nan) must_fail = 1;
    idx = (uint32_t *)fz_xalloc((k && k <= n ? k : 1) * sizeof(uint32_t));
    if (flags & 1) sc = (float *)fz_xalloc((k && k <= n ? k : 1) * sizeof(float));
    fz_arm_with(1);
    r = fz_expect(pqc_topk((flags & 2) ? NULL : S->rt, s, n, k, (flags & 4) ? &S->scratch : NULL, idx, sc), "pqc_topk");
    fz_outcome(r, must_fail, 0, "pqc_topk");
    if (r == PQC_SUCCESS) fz_check_topk("pqc_topk", s, n, k, 0, idx, sc);
    free(s);
    free(idx);
    free(sc);
}

/* ---------------------------------------------------------------------------------------
   Scheduler
   ------------------------------------------------------------------------------------- */
static const double t_stok[] = {4096, 100, 32768, 131072, 1e6, 0.5, 1};
static const double t_stok_bad[] = {0, -1, NAN, INFINITY, -INFINITY, 1e200, 1e300, DBL_MAX, 4.9e-324, 1e-300, -0.0};
static const double t_ssec[] = {0.001, 0.01, 0.1, 1, 0, 1e-6};
static const double t_ssec_bad[] = {NAN, INFINITY, -1, 1e9, 1000000001, 1e200, -0.0, 4.9e-324, -INFINITY};
static const int t_sit[] = {10, 1, 3, 100, 0};
static const int t_sit_bad[] = {-1, INT_MAX, INT_MIN};

static int fz_fit_same(const pqc_scheduler_fit *a, const pqc_scheduler_fit *b) { return !memcmp(a, b, sizeof *a); }
static int fz_same_d(double a, double b) { return !memcmp(&a, &b, sizeof a); }

static void op_sched(fz_state *S)
{
    static const int tmin[] = {0, 1, 3, 5};
    static const int tmin_bad[] = {-1, INT_MAX, INT_MIN};
    static const int tmax[] = {0, 10, 300, 2, 50};
    static const int tmax_bad[] = {-1, INT_MAX};
    static const int tdef[] = {0, 5, 10, 1};
    static const int tdef_bad[] = {-1, INT_MAX};
    static const double par[] = {0, 1, 2, 0.5};
    static const double par_bad[] = {NAN, INFINITY, -1, 1e300, -0.0, 4.9e-324};
    static const double coef[] = {1e-3, 1e-9, 0, -1e-3, 2e-6, 3e-12};
    static const double coef_bad[] = {NAN, INFINITY, -INFINITY, 1e300, 1e9, -1e9, 1e9 * 1.0000001, 4.9e-324};
    static const int nsmp[] = {1, 5, 2};
    static const int nsmp_bad[] = {0, -1, INT_MAX};
    fz *f = &S->f;
    unsigned what = rd8(f);
    pqc_scheduler_fit before, after;
    pqc_result r;
    int must_fail = 0;
    if (!S->sched || what % 6 == 0) {
        pqc_scheduler_desc d;
        pqc_scheduler *s = (pqc_scheduler *)&g_sentinel;
        int tmi, tma, tde;
        memset(&d, 0, sizeof d);
        d.t_min = PICK_I(f, tmin);
        d.t_max = PICK_I(f, tmax);
        d.t_default = PICK_I(f, tdef);
        d.parallel = PICK_D(f, par);
        if (rd8(f) & 1) d.allocator = g_alloc;
        tmi = d.t_min ? d.t_min : 3;
        tma = d.t_max ? d.t_max : 300;
        tde = d.t_default ? d.t_default : 10;
        must_fail = tmi < 0 || tma < tmi || tma > 100000 || tde < 0 || tde > 100000 || !(d.parallel >= 0) ||
                    d.parallel < 0; /* iterations beyond the PQ core's limit are refused up front */
        if (S->sched) return; /* caches may hold it: one scheduler per input */
        fz_arm();
        r = fz_expect(pqc_scheduler_create(&d, &s), "pqc_scheduler_create");
        fz_outcome(r, must_fail, 0, "pqc_scheduler_create");
        if (r != PQC_SUCCESS) {
            if (s != (pqc_scheduler *)&g_sentinel) fz_fail("failed pqc_scheduler_create wrote its output");
            return;
        }
        S->sched = s;
        S->sched_tmin = tmi;
        S->sched_tmax = tma;
        return;
    }
    before = pqc_scheduler_get_fit(S->sched);
    switch (what % 6) {
    case 1: {
        double t = PICK_D(f, t_stok), s = PICK_D(f, t_ssec);
        int it = PICK_I(f, t_sit);
        must_fail = !(t > 0) || it < 0 || !(s >= 0);
        fz_arm();
        r = fz_expect(pqc_scheduler_add_kmeans(S->sched, t, it, s), "pqc_scheduler_add_kmeans");
        fz_outcome(r, must_fail, 1, "pqc_scheduler_add_kmeans");
        break;
    }
    case 2: {
        double t = PICK_D(f, t_stok), s = PICK_D(f, t_ssec);
        must_fail = !(t > 0) || !(s >= 0);
        fz_arm();
        r = fz_expect(pqc_scheduler_add_compute(S->sched, t, s), "pqc_scheduler_add_compute");
        fz_outcome(r, must_fail, 1, "pqc_scheduler_add_compute");
        break;
    }
    case 3: {
        static const int jobs[] = {8, 1, 2, 32};
        static const int jobs_bad[] = {0, -1, INT_MAX, INT_MIN};
        double t = PICK_D(f, t_stok);
        int j = PICK_I(f, jobs), it = pqc_scheduler_iters(S->sched, t, j);
        if (t > 0 && (it < S->sched_tmin || it > S->sched_tmax))
            fz_fail("pqc_scheduler_iters(%g tokens, %d jobs) = %d, outside [%d, %d]", t, j, it, S->sched_tmin,
                    S->sched_tmax);
        return;
    }
    case 4: {
        pqc_scheduler_fit fit;
        memset(&fit, 0, sizeof fit);
        fit.a1 = PICK_D(f, coef);
        fit.b1 = PICK_D(f, coef);
        fit.a2 = PICK_D(f, coef);
        fit.b2 = PICK_D(f, coef);
        fit.g2 = PICK_D(f, coef);
        fit.n1 = PICK_I(f, nsmp);
        fit.n2 = PICK_I(f, nsmp);
        must_fail = !(fit.b1 > 0) || fit.n1 < 1 || fit.n2 < 1 || fit.a1 != fit.a1 || fit.a2 != fit.a2 ||
                    fit.b2 != fit.b2 || fit.g2 != fit.g2;
        fz_arm();
        r = fz_expect(pqc_scheduler_set_fit(S->sched, (what & 0x80) && what >= HOSTILE ? NULL : &fit),
                      "pqc_scheduler_set_fit");
        if ((what & 0x80) && what >= HOSTILE) must_fail = 1;
        fz_outcome(r, must_fail, 1, "pqc_scheduler_set_fit");
        if (r == PQC_SUCCESS) {
            /* each line is the one set, until measured samples determine it with at least as
               many samples behind it */
            int set1, set2;
            after = pqc_scheduler_get_fit(S->sched);
            set1 = fz_same_d(after.a1, fit.a1) && fz_same_d(after.b1, fit.b1) && after.n1 == fit.n1;
            set2 = fz_same_d(after.a2, fit.a2) && fz_same_d(after.b2, fit.b2) && fz_same_d(after.g2, fit.g2) &&
                   after.n2 == fit.n2;
            if ((!set1 && after.n1 < fit.n1) || (!set2 && after.n2 < fit.n2))
                fz_fail("pqc_scheduler_get_fit (%.17g %.17g %.17g %.17g %.17g %d %d) is neither the fit just set "
                        "(%.17g %.17g %.17g %.17g %.17g %d %d) nor one measured from as many samples",
                        after.a1, after.b1, after.a2, after.b2, after.g2, after.n1, after.n2, fit.a1, fit.b1, fit.a2,
                        fit.b2, fit.g2, fit.n1, fit.n2);
        }
        break;
    }
    default: {
        pqc_scheduler_fit g = pqc_scheduler_get_fit(NULL);
        if (g.n1 || g.n2 || g.b1 != 0) fz_fail("pqc_scheduler_get_fit(NULL) is not empty");
        fz_arm();
        if (fz_expect(pqc_scheduler_add_compute(NULL, 1, 1), "pqc_scheduler_add_compute(NULL)") == PQC_SUCCESS)
            fz_fail("pqc_scheduler_add_compute(NULL) succeeded");
        return;
    }
    }
    after = pqc_scheduler_get_fit(S->sched);
    if (r != PQC_SUCCESS && !fz_fit_same(&before, &after))
        fz_fail("a failed scheduler call (%d) changed the fit", (int)r);
    fz_check_fit_finite(S, "a scheduler call");
}

/* ---------------------------------------------------------------------------------------
   Conversions
   ------------------------------------------------------------------------------------- */
static void op_convert(fz_state *S)
{
    fz *f = &S->f;
    uint16_t h = (uint16_t)rd16(f);
    uint32_t bits = (uint32_t)rd16(f) | (uint32_t)rd16(f) << 16;
    float x, y;
    memcpy(&x, &bits, 4);
    y = pqc_f16_to_f32(h);
    if (y == y && pqc_f32_to_f16(y) != h) fz_fail("fp16 %04x -> %g -> %04x", h, (double)y, pqc_f32_to_f16(y));
    if (y != y && ((h & 0x7c00) != 0x7c00 || !(h & 0x3ff))) fz_fail("fp16 %04x became NaN", h);
    y = pqc_bf16_to_f32(h);
    if (y == y && pqc_f32_to_bf16(y) != h) fz_fail("bf16 %04x -> %g -> %04x", h, (double)y, pqc_f32_to_bf16(y));
    y = pqc_f16_to_f32(pqc_f32_to_f16(x));
    if (x != x && y == y) fz_fail("fp16 of NaN is %g", (double)y);
    if (x == x) {
        if (fabsf(x) < 65520.0f && !isfinite(y)) fz_fail("fp16 of %g overflowed", (double)x);
        if (fabsf(x) >= 65520.0f && !isinf(y)) fz_fail("fp16 of %g is finite (%g)", (double)x, (double)y);
        if (isfinite(y) && fabsf(y - x) > fabsf(x) * (1.0f / 2048.0f) + 6e-8f)
            fz_fail("fp16 of %g is %g, too far", (double)x, (double)y);
    }
    y = pqc_bf16_to_f32(pqc_f32_to_bf16(x));
    if (x != x && y == y) fz_fail("bf16 of NaN is %g", (double)y);
    if (isfinite(x) && isfinite(y) && fabsf(y - x) > fabsf(x) * (1.0f / 256.0f) + 1e-40f)
        fz_fail("bf16 of %g is %g", (double)x, (double)y);
    {
        int dt = (int)(bits % 7) - 2;
        if (pqc_dtype_size((pqc_dtype)dt) != fz_dsize(dt)) fz_fail("pqc_dtype_size(%d)", dt);
    }
}

/* ---------------------------------------------------------------------------------------
   The program
   ------------------------------------------------------------------------------------- */
static void op_fetch_copy(fz_state *S) { op_fetch(S, 0); }
static void op_fetch_rows(fz_state *S) { op_fetch(S, 1); }
static void op_batch_select(fz_state *S) { op_batch(S, 0); }
static void op_batch_fetch(fz_state *S) { op_batch(S, 1); }

typedef void (*fz_op)(fz_state *S);
static const fz_op fz_ops[] = {
    op_cache_create,  /*  0 */
    op_prefill,       /*  1 */
    op_append,        /*  2 */
    op_sel_init,      /*  3 */
    op_select,        /*  4 */
    op_fetch_copy,    /*  5 */
    op_fetch_rows,    /*  6 */
    op_sync,          /*  7 */
    op_info,          /*  8 */
    op_report,        /*  9 */
    op_driver_prefill,/* 10 */
    op_driver_decode, /* 11 */
    op_batch_select,  /* 12 */
    op_batch_fetch,   /* 13 */
    op_sel_hand,      /* 14 */
    op_sel_tamper,    /* 15 */
    op_cache_destroy, /* 16 */
    op_pq_train,      /* 17 */
    op_codes_init,    /* 18 */
    op_codes_reserve, /* 19 */
    op_pq_encode,     /* 20 */
    op_pq_search,     /* 21 */
    op_pq_misc,       /* 22 */
    op_exact,         /* 23 */
    op_topk,          /* 24 */
    op_sched,         /* 25 */
    op_convert,       /* 26 */
    op_observe,       /* 27 */
    op_fork,          /* 28 */
    op_save_load,     /* 29 */
};

static size_t g_tok_scratch[4097];

static void fz_init_once(void)
{
    static int done;
    if (done) return;
    done = 1;
    g_trace = getenv("FUZZ_API_TRACE") != NULL;
    fz_arm_with(0);
    snprintf(g_sentinel[0], sizeof g_sentinel[0], "%s", pqc_last_error());
    fz_arm_with(1);
    snprintf(g_sentinel[1], sizeof g_sentinel[1], "%s", pqc_last_error());
    if (!strcmp(g_sentinel[0], g_sentinel[1]) || !g_sentinel[0][0]) {
        fprintf(stderr, "fuzz_api: the planted messages are not distinct\n");
        abort();
    }
    g_be_cpu = pqc_backend_cpu(&g_alloc);
    memset(&g_be_own, 0, sizeof g_be_own);
    g_be_own.iface.name = "fuzz";
    g_be_own.iface.alloc = fzb_alloc;
    g_be_own.iface.free = fzb_free;
    g_be_own.iface.copy_h2d = fzb_copy;
    g_be_own.iface.synchronize = fzb_sync;
    g_be_nocopy = g_be_own;
    g_be_nocopy.iface.copy_h2d = NULL;
    g_be_noalloc = g_be_own;
    g_be_noalloc.iface.alloc = fzb_alloc_none;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const size_t limits[] = {(size_t)64 << 20, (size_t)1 << 20, (size_t)64 << 10, (size_t)4 << 10};
    static const int threads[] = {-1, 0, 1, 2};
    fz_state S;
    pqc_runtime_desc rd;
    unsigned b0, b1, b2, ops = 0;
    int i, deterministic;
    size_t live0;
    pqc_result r;

    fz_init_once();
    memset(&S, 0, sizeof S);
    S.f.p = data;
    S.f.n = size;
    S.tok_before = g_tok_scratch;
    b0 = rd8(&S.f);
    b1 = rd8(&S.f);
    b2 = rd8(&S.f);
    S.seed = rd16(&S.f) * 0x9E3779B97F4A7C15ull + 1;

    pthread_mutex_lock(&g_heap.mu);
    live0 = g_heap.live;
    g_heap.calls = 0;
    g_heap.failures = 0;
    g_heap.limit_one = limits[b1 & 3];
    g_heap.fail_mode = 0;
    pthread_mutex_unlock(&g_heap.mu);

    memset(&rd, 0, sizeof rd);
    rd.n_threads = threads[b0 & 3];
    if ((b0 >> 2 & 3) == 2) rd.submit = fz_submit_refuse;
    if ((b0 >> 2 & 3) == 3) rd.submit = fz_submit_inline;
    rd.simd = (pqc_simd)(b0 >> 4 & 3);
    rd.allocator = g_alloc;
    if (b0 & 0x40) {
        static const int be[] = {PQC_BACKEND_CPU, PQC_BACKEND_AUTO, PQC_BACKEND_CUDA, 3, -1};
        rd.backend = be[b2 % NT(be)];
        rd.cuda_device = (int)(b2 >> 4) - 1;
        rd.cuda_kernel_cache = "-";
        if (b0 & 0x80) rd.simd = (pqc_simd)((b2 & 1) ? 7 : -1);
    }
    S.rt = (pqc_runtime *)&g_sentinel;
    fz_arm();
    r = fz_expect(pqc_runtime_create(&rd, &S.rt), "pqc_runtime_create");
    if (r != PQC_SUCCESS) {
        if (S.rt != (pqc_runtime *)&g_sentinel) fz_fail("failed pqc_runtime_create wrote its output");
        if (((int)rd.simd == PQC_SIMD_AUTO || (int)rd.simd == PQC_SIMD_SCALAR) && !(b0 & 0x40) &&
            fz_heap_failures() == 0)
            fz_fail("pqc_runtime_create failed (%d) for a plain CPU runtime", (int)r);
        /* the plain runtime */
        memset(&rd, 0, sizeof rd);
        rd.n_threads = threads[b0 & 3];
        rd.allocator = g_alloc;
        fz_arm();
        if (fz_expect(pqc_runtime_create(&rd, &S.rt), "pqc_runtime_create") != PQC_SUCCESS) {
            if (fz_heap_failures() == 0) fz_fail("pqc_runtime_create of a default runtime failed");
            S.rt = NULL; /* every call takes rt = NULL */
        }
    }
    if (pqc_runtime_backend(S.rt) == PQC_BACKEND_CUDA) {
        /* a GPU machine: this target covers the CPU tier only */
        pqc_runtime_destroy(S.rt);
        memset(&rd, 0, sizeof rd);
        rd.n_threads = threads[b0 & 3];
        rd.allocator = g_alloc;
        if (pqc_runtime_create(&rd, &S.rt) != PQC_SUCCESS) fz_fail("pqc_runtime_create of a default runtime failed");
    }
    /* injected failures only where the order of requests is fixed */
    deterministic = rd.n_threads == -1 || rd.submit != NULL;
    if (deterministic && (b1 >> 2 & 3) && (b1 >> 2 & 3) != 3) {
        pthread_mutex_lock(&g_heap.mu);
        g_heap.fail_mode = (int)(b1 >> 2 & 3);
        g_heap.fail_at = g_heap.calls + 1 + b2;
        pthread_mutex_unlock(&g_heap.mu);
    }

    while (fz_more(&S.f) && ops++ < FZ_MAX_OPS) {
        unsigned op = rd8(&S.f);
        if (g_trace) fprintf(stderr, "op %u at byte %zu\n", op % (unsigned)NT(fz_ops), S.f.i - 1);
        fz_ops[op % NT(fz_ops)](&S);
        fz_check_fit_finite(&S, "an operation");
    }

    for (i = 0; i < 2; i++) {
        pqc_cache_destroy(S.cache[i].c);
        fz_sel_release(&S.cache[i].sel[0]);
        fz_sel_release(&S.cache[i].sel[1]);
        pqc_pq_free(&S.pq[i]);
        if (S.codes_ok[i]) pqc_codes_free(&S.codes[i]);
    }
    pqc_scratch_free(&S.scratch);
    pqc_scheduler_destroy(S.sched);
    pqc_runtime_destroy(S.rt);
    pthread_mutex_lock(&g_heap.mu);
    g_heap.fail_mode = 0;
    if (g_heap.live != live0) {
        size_t held = g_heap.live - live0;
        pthread_mutex_unlock(&g_heap.mu);
        fz_fail("%zu bytes of the library's allocations were not freed", held);
    }
    pthread_mutex_unlock(&g_heap.mu);
    return 0;
}
