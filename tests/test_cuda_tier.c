/* CUDA device tier tests: a cache on a CUDA runtime against the same cache on the CPU.
 *
 * Runs wherever a CUDA driver can be opened: on a machine with an NVIDIA GPU, or through
 * the CPU emulator of the driver (tests/cuda_emu, `make test-cuda-emu` points
 * PQC_CUDA_DRIVER_PATH at it). Without either, every test fails: the Makefile only runs
 * this binary with one of them.
 *
 * What must hold: the device tier selects the same tokens as the CPU tier (exactly with
 * the GQA "sum" mode; with softmax-sum the GPU adds the per-head normalisers in another
 * order, so a token at the very top-k boundary may differ), the rows it gathers equal the
 * CPU's bit for bit, statistics add up, growth, rebuilds and multi-turn prefills keep it
 * consistent, device fetches are ordered on the engine's stream, and misuse gets clear
 * result codes. */
/* the k-means GEMM path computes its dot products in chunks of at most this many bytes;
   small here, so that the tests' problems span several chunks and a tail */
#define PQC__KM_DOTS_BYTES ((size_t)48 << 10)
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "greatest.h"
#include "synth.h"
#include "test_util.h"
#include "test_size.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static uint64_t g_rng = 777;

/* The driver the library opens, for the test's own stream and copies. */
typedef int (*stream_create_fn)(void **s, unsigned flags);
typedef int (*stream_sync_fn)(void *s);
typedef int (*stream_destroy_fn)(void *s);
typedef int (*dtoh_fn)(void *dst, unsigned long long src, size_t n);
typedef int (*ctx_retain_fn)(void **ctx, int dev);
typedef int (*ctx_set_fn)(void *ctx);
typedef int (*ctx_sync_fn)(void);
typedef void (*emu_counters_fn)(unsigned long long *out, int reset);
static void *g_drv;
static stream_create_fn p_stream_create;
static stream_sync_fn p_stream_sync;
static stream_destroy_fn p_stream_destroy;
static dtoh_fn p_dtoh;
static ctx_retain_fn p_ctx_retain;
static ctx_set_fn p_ctx_set;
static ctx_sync_fn p_ctx_sync;

static int open_driver(void)
{
    const char *path = getenv("PQC_CUDA_DRIVER_PATH");
    void *sym;
    if (g_drv) return 1;
    g_drv = dlopen(path && path[0] ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!g_drv) return 0;
#define LOAD(var, name, type)                 \
    sym = dlsym(g_drv, name);                 \
    if (!sym) return 0;                       \
    memcpy(&var, &sym, sizeof var);           \
    (void)(type)0
    LOAD(p_stream_create, "cuStreamCreate", stream_create_fn);
    LOAD(p_stream_sync, "cuStreamSynchronize", stream_sync_fn);
    LOAD(p_stream_destroy, "cuStreamDestroy_v2", stream_destroy_fn);
    LOAD(p_dtoh, "cuMemcpyDtoH_v2", dtoh_fn);
    LOAD(p_ctx_retain, "cuDevicePrimaryCtxRetain", ctx_retain_fn);
    LOAD(p_ctx_set, "cuCtxSetCurrent", ctx_set_fn);
    LOAD(p_ctx_sync, "cuCtxSynchronize", ctx_sync_fn);
#undef LOAD
    return 1;
}

/* The cache the tiers are compared on: the base cache (tu_cache_desc) with up to 32,768
   tokens, 20 sink tokens, a budget of 12% of the tokens, a block cache of 6 blocks of 32
   tokens, and PQ with m = 4, seed 3. */
static pqc_cache_desc tier_desc(int layers, int hkv, int hq, int d)
{
    pqc_cache_desc cd = tu_cache_desc(layers, hkv, hq, d);
    cd.max_tokens = 1 << 15;
    cd.n_sink = 20;
    cd.budget_ratio = 0.12;
    cd.block_tokens = 32;
    cd.cache_blocks = 6;
    cd.pq.m = 4;
    cd.pq.seed = 3;
    return cd;
}

/* one head's synthetic keys: n tokens of d dims, 8 needles, one query */
static int synth_head(synth *sy, size_t n, int d, uint64_t seed)
{
    memset(sy, 0, sizeof *sy);
    sy->s = n;
    sy->d = d;
    sy->g = 1;
    sy->n_needles = 8;
    sy->seed = seed;
    return synth_make(sy);
}

/* keys with structure (clusters + needles, synth.h): head h from seed + h */
static float *make_keys(size_t n, int hkv, int d, uint64_t seed)
{
    float *k = (float *)malloc(n * (size_t)hkv * d * sizeof(float));
    int h;
    size_t t;
    for (h = 0; h < hkv; h++) {
        synth sy;
        if (synth_head(&sy, n, d, seed + (uint64_t)h) != 0) {
            free(k);
            return NULL;
        }
        for (t = 0; t < n; t++) memcpy(k + (t * hkv + h) * d, sy.keys + t * d, (size_t)d * sizeof(float));
        synth_free(&sy);
    }
    return k;
}

typedef struct pair {
    pqc_runtime *rc, *rg;
    pqc_cache *cc, *cg; /* CPU, GPU */
    pqc_selection sc, sg;
    float *kc, *vc, *kg, *vg;
    size_t cap;
} pair;

static int pair_open(pair *p, const pqc_cache_desc *cd)
{
    memset(p, 0, sizeof *p);
    p->rc = tu_cpu_runtime(1);
    p->rg = tu_cuda_runtime(1);
    if (!p->rc || !p->rg) return 0;
    if (pqc_cache_create(p->rc, cd, &p->cc) != PQC_SUCCESS) return 0;
    if (pqc_cache_create(p->rg, cd, &p->cg) != PQC_SUCCESS) {
        fprintf(stderr, "GPU cache: %s\n", pqc_last_error());
        return 0;
    }
    if (pqc_selection_init(p->cc, &p->sc) != PQC_SUCCESS || pqc_selection_init(p->cg, &p->sg) != PQC_SUCCESS) return 0;
    p->cap = cd->max_tokens;
    p->kc = (float *)malloc(p->cap * (size_t)cd->n_kv_heads * cd->head_dim * sizeof(float) * 4);
    p->vc = p->kc + p->cap * (size_t)cd->n_kv_heads * cd->head_dim;
    p->kg = p->vc + p->cap * (size_t)cd->n_kv_heads * cd->head_dim;
    p->vg = p->kg + p->cap * (size_t)cd->n_kv_heads * cd->head_dim;
    return p->kc != NULL;
}

static void pair_close(pair *p)
{
    pqc_selection_free(&p->sc);
    pqc_selection_free(&p->sg);
    pqc_cache_destroy(p->cc);
    pqc_cache_destroy(p->cg);
    pqc_runtime_destroy(p->rc);
    pqc_runtime_destroy(p->rg);
    free(p->kc);
}

typedef struct cmp_stats {
    size_t selected, differ, rows_compared, rows_differ;
} cmp_stats;

/* the selections of both caches (sc, sg) compared, and every row selected by both
   (kc/vc, kg/vg) compared bit for bit; 0 when a head's counts differ */
static int selections_compare(pair *p, int d, cmp_stats *st)
{
    int h, nkv = p->sc.n_kv_heads;
    for (h = 0; h < nkv; h++) {
        const uint32_t *a = p->sc.idx + (size_t)h * p->sc.capacity, *b = p->sg.idx + (size_t)h * p->sg.capacity;
        size_t na = p->sc.count[h], nb = p->sg.count[h], i = 0, j = 0;
        if (na != nb) return 0;
        st->selected += na;
        while (i < na && j < nb) { /* merge: rows of tokens selected by both */
            if (a[i] == b[j]) {
                const float *ka = p->kc + ((size_t)h * p->cap + i) * d, *kb = p->kg + ((size_t)h * p->cap + j) * d;
                const float *va = p->vc + ((size_t)h * p->cap + i) * d, *vb = p->vg + ((size_t)h * p->cap + j) * d;
                st->rows_compared++;
                if (memcmp(ka, kb, (size_t)d * sizeof(float)) || memcmp(va, vb, (size_t)d * sizeof(float)))
                    st->rows_differ++;
                i++;
                j++;
            } else if (a[i] < b[j]) {
                st->differ++;
                i++;
            } else {
                j++;
            }
        }
        st->differ += na - i;
    }
    return 1;
}

/* one select + fetch on both caches; selections compared, and every row selected by both
   compared bit for bit */
static int step_compare(pair *p, int layer, const float *q, int d, cmp_stats *st)
{
    pqc_kv_out oc, og;
    if (pqc_cache_select(p->cc, layer, q, &p->sc) != PQC_SUCCESS) return 0;
    if (pqc_cache_select(p->cg, layer, q, &p->sg) != PQC_SUCCESS) {
        fprintf(stderr, "GPU select: %s\n", pqc_last_error());
        return 0;
    }
    oc.k = p->kc;
    oc.v = p->vc;
    oc.head_stride = p->cap;
    og.k = p->kg;
    og.v = p->vg;
    og.head_stride = p->cap;
    if (pqc_cache_fetch(p->cc, layer, &p->sc, &oc) != PQC_SUCCESS) return 0;
    if (pqc_cache_fetch(p->cg, layer, &p->sg, &og) != PQC_SUCCESS) {
        fprintf(stderr, "GPU fetch: %s\n", pqc_last_error());
        return 0;
    }
    return selections_compare(p, d, st);
}

/* the same as step_compare, the GPU cache decoding with pqc_cache_step_device: its
   selection and rows read back from the device */
static int step_compare_dev(pair *p, int layer, const float *q, int d, cmp_stats *st)
{
    pqc_kv_out oc;
    pqc_kv_device dk;
    size_t cnt[16];
    int h, nkv = p->sc.n_kv_heads;
    if (nkv > 16 || pqc_cache_select(p->cc, layer, q, &p->sc) != PQC_SUCCESS) return 0;
    oc.k = p->kc;
    oc.v = p->vc;
    oc.head_stride = p->cap;
    if (pqc_cache_fetch(p->cc, layer, &p->sc, &oc) != PQC_SUCCESS) return 0;
    memset(&dk, 0, sizeof dk);
    if (pqc_cache_step_device(p->cg, layer, q, &dk, cnt) != PQC_SUCCESS) {
        fprintf(stderr, "GPU step: %s\n", pqc_last_error());
        return 0;
    }
    if (pqc_cache_tokens(p->cg, layer) > p->sg.capacity) { /* room for the device's selection */
        pqc_selection_free(&p->sg);
        if (pqc_selection_init(p->cg, &p->sg) != PQC_SUCCESS) return 0;
    }
    for (h = 0; h < nkv; h++) { /* the device's selection and rows, into the sg/kg/vg layout */
        size_t rb = (size_t)d * sizeof(float), hb = dk.head_stride * rb;
        if (cnt[h] > p->sg.capacity || cnt[h] > p->cap) return 0;
        p->sg.count[h] = cnt[h];
        if (!cnt[h]) continue;
        if (p_dtoh(p->sg.idx + (size_t)h * p->sg.capacity, dk.pos + (uint64_t)h * dk.head_stride * 4, cnt[h] * 4) ||
            p_dtoh(p->kg + (size_t)h * p->cap * d, dk.k + (uint64_t)h * hb, cnt[h] * rb) ||
            p_dtoh(p->vg + (size_t)h * p->cap * d, dk.v + (uint64_t)h * hb, cnt[h] * rb))
            return 0;
    }
    return selections_compare(p, d, st);
}

/* reports a comparison: every row both selected is the same, and at most 0.1% of the
   selected tokens differ (boundary ties) */
static enum greatest_test_res cmp_report(const char *what, const cmp_stats *st)
{
    fprintf(stderr, "  %s: %zu tokens selected, %zu differ, %zu rows compared, %zu differ\n", what, st->selected,
            st->differ, st->rows_compared, st->rows_differ);
    ASSERT_EQ(0, st->rows_differ);
    ASSERT(st->rows_compared > 0);
    ASSERT(st->differ * 1000 <= st->selected);
    PASS();
}

static int append_both(pair *p, int layer, const float *k, const float *v)
{
    if (pqc_cache_append(p->cc, layer, k, v) != PQC_SUCCESS) return 0;
    if (pqc_cache_append(p->cg, layer, k, v) != PQC_SUCCESS) {
        fprintf(stderr, "GPU append: %s\n", pqc_last_error());
        return 0;
    }
    return 1;
}

static int prefill_both(pair *p, int layers, const float *k, const float *v, size_t n, size_t cols)
{
    int l;
    pqc_matrix km = pqc_matrix_f32(k, n, cols), vm = pqc_matrix_f32(v, n, cols);
    for (l = 0; l < layers; l++) {
        if (pqc_cache_prefill(p->cc, l, &km, &vm) != PQC_SUCCESS) return 0;
        if (pqc_cache_prefill(p->cg, l, &km, &vm) != PQC_SUCCESS) {
            fprintf(stderr, "GPU prefill: %s\n", pqc_last_error());
            return 0;
        }
    }
    return 1;
}

/* prefill, decode steps, a second prompt (grows the store, re-clusters), more steps */
typedef struct shape {
    int L, hkv, hq, d, m, bits, steps;
    size_t n1, n2;
    int resident; /* codes_resident */
    int observe;  /* queries observed before the prompt: the builds code with a metric
                     (KV head 1's observations are zero: it stays Euclidean); 2: rows
                     that look far back, at tokens of the prompt, and a window of half
                     the budget, which every layer's build lowers */
    int bands;    /* 1: sub-spaces of rope bands over the half-split layout */
    double rerank; /* desc.rerank */
    int outliers;  /* desc.outliers */
    double resid;  /* desc.residual_weight */
    int dstep;     /* the GPU cache decodes with pqc_cache_step_device: 1 always, 2 with
                      select + fetch every third step (the bookkeeping goes back and forth) */
    int lru;       /* desc.policy LRU */
    int compete;   /* desc.split PQC_SPLIT_COMPETE, the default (2: PQC_SPLIT_FIXED_COMPETE),
                      and a window of half the budget (else the default; PQC_SPLIT_ADAPTIVE
                      with observe 2) */
    float scale;   /* desc.softmax_scale */
    int qdiag;     /* desc.metric PQC_METRIC_QUERY_DIAG: weights, not the default's blocks (with observe) */
} shape;
static const shape g_small = { 2, 2, 4, 64, 4, 6, 12, 1500, 1700, 0, 0, 0, 0.0, 0, 0.0, 0, 0, 0, 0.0f, 0 };

/* the same observations on both caches (and on `also`, unless NULL): rows whose energy
   sits in a few dimensions */
static int observe_all(pair *p, pqc_cache *also, int layers, int hkv, int hq, int d)
{
    const size_t rows = 8, qn = (size_t)hq * d;
    float *q = tu_normal_rows(&g_rng, rows, qn);
    size_t i, e;
    int l, g = hq / hkv, ok = q != NULL;
    for (i = 0; ok && i < rows * qn; i++) {
        size_t head = (i % qn) / (size_t)d;
        e = i % (size_t)d;
        q[i] = head / (size_t)g == 1 ? 0.0f : q[i] * (e % 16 == 3 ? 8.0f : 0.5f);
    }
    for (l = 0; ok && l < layers; l++)
        ok = pqc_cache_observe(p->cc, l, q, rows) == PQC_SUCCESS && pqc_cache_observe(p->cg, l, q, rows) == PQC_SUCCESS &&
             (!also || pqc_cache_observe(also, l, q, rows) == PQC_SUCCESS);
    free(q);
    return ok;
}
static int observe_both(pair *p, int layers, int hkv, int hq, int d) { return observe_all(p, NULL, layers, hkv, hq, d); }

/* observations that look far back, at more prompt tokens than the top-k holds: 150 of
   the n prompt tokens, spread evenly from token 50 to 200 before the end, get 6 more in
   dimension 0 of every head, which the observed rows look for */
static int observe_far_both(pair *p, int layers, int hkv, int hq, int d, float *k, size_t n)
{
    const size_t rows = 8, qn = (size_t)hq * d;
    float *q = (float *)calloc(rows * qn, sizeof(float));
    size_t i;
    int l, h, ok = q != NULL && n >= 400;
    for (i = 0; ok && i < 150; i++)
        for (h = 0; h < hkv; h++) k[((50 + (n - 250) * i / 150) * (size_t)hkv + (size_t)h) * d] += 6.0f;
    for (i = 0; ok && i < rows * (size_t)hq; i++) q[i * (size_t)d] = 8.0f;
    for (l = 0; ok && l < layers; l++)
        ok = pqc_cache_observe(p->cc, l, q, rows) == PQC_SUCCESS && pqc_cache_observe(p->cg, l, q, rows) == PQC_SUCCESS;
    free(q);
    return ok;
}

static enum greatest_test_res decode_matches_shape(pqc_gqa gqa, pqc_dtype dt, const shape *sh)
{
    /* the small scenario (PQC_TEST_SIZE=small, the ASan run): half the prompts and steps,
       still a rebuild at the second prompt and blocks admitted */
    const int L = sh->L, hkv = sh->hkv, hq = sh->hq, d = sh->d, steps = TEST_SIZE(sh->steps, (sh->steps + 1) / 2);
    const size_t n1 = TEST_SIZE(sh->n1, sh->n1 / 2), n2 = TEST_SIZE(sh->n2, sh->n2 / 2);
    pqc_cache_desc cd = tier_desc(L, hkv, hq, d);
    pair p;
    cmp_stats st;
    float *k1, *v1, *k2, *v2, *q, *ka, *va;
    int s, l;
    cd.gqa = gqa;
    cd.kv_dtype = dt;
    cd.pq.m = sh->m;
    cd.pq.bits = sh->bits;
    cd.codes_resident = sh->resident;
    cd.rerank = sh->rerank > 0 ? sh->rerank : -1; /* 0: none */
    cd.outliers = sh->outliers;
    cd.residual_weight = sh->resid;
    cd.softmax_scale = sh->scale;
    if (sh->lru) cd.policy = PQC_POLICY_LRU;
    if (sh->observe == 2 && !sh->compete) cd.split = PQC_SPLIT_ADAPTIVE; /* windows the builds lower */
    if (sh->compete == 2) cd.split = PQC_SPLIT_FIXED_COMPETE;
    if (sh->observe == 2 || sh->compete) cd.recent_share = 0.5;
    if (sh->bands) {
        cd.pq.rope = PQC_ROPE_HALF;
        cd.pq.subspaces = PQC_SUBSPACES_ROPE_BANDS;
    }
    if (sh->qdiag) cd.metric = PQC_METRIC_QUERY_DIAG;
    memset(&st, 0, sizeof st);
    ASSERT(pair_open(&p, &cd));
    ASSERT_EQ(1, pqc_cache_on_device(p.cg));
    ASSERT_EQ(0, pqc_cache_on_device(p.cc));
    k1 = make_keys(n1, hkv, d, 11);
    k2 = make_keys(n2, hkv, d, 99);
    v1 = tu_normal_rows(&g_rng, n1, (size_t)hkv * d);
    v2 = tu_normal_rows(&g_rng, n2, (size_t)hkv * d);
    q = tu_normal_rows(&g_rng, (size_t)2 * steps, (size_t)hq * d);
    ka = tu_normal_rows(&g_rng, (size_t)2 * steps * L, (size_t)hkv * d);
    va = tu_normal_rows(&g_rng, (size_t)2 * steps * L, (size_t)hkv * d);
    ASSERT(k1 && k2 && v1 && v2 && q && ka && va);
    if (sh->observe == 1) ASSERT(observe_both(&p, L, hkv, hq, d));
    if (sh->observe == 2) ASSERT(observe_far_both(&p, L, hkv, hq, d, k1, n1));
    ASSERT(prefill_both(&p, L, k1, v1, n1, (size_t)hkv * d));
    if (sh->observe == 2) { /* the builds lower every layer's window alike on both tiers */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(p.cc));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(p.cg));
        for (l = 0; l < L; l++) {
            ASSERT(pqc_cache_layer_window(p.cg, l) < pqc_cache_window(p.cg));
            ASSERT_EQ(pqc_cache_layer_window(p.cc, l), pqc_cache_layer_window(p.cg, l));
        }
    }
    for (s = 0; s < 2 * steps; s++) {
        if (s == steps) ASSERT(prefill_both(&p, L, k2, v2, n2, (size_t)hkv * d)); /* a second turn */
        for (l = 0; l < L; l++) {
            size_t o = ((size_t)s * L + l) * hkv * d;
            ASSERT(append_both(&p, l, ka + o, va + o));
            if (sh->dstep && !(sh->dstep == 2 && s % 3 == 2))
                ASSERT(step_compare_dev(&p, l, q + (size_t)s * hq * d, d, &st));
            else
                ASSERT(step_compare(&p, l, q + (size_t)s * hq * d, d, &st));
        }
    }
    {
        pqc_layer_stats a, b;
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        for (l = 0; l < L; l++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(p.cc, l, &a));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(p.cg, l, &b));
            ASSERT(b.builds >= 1);
            ASSERT_EQ(a.builds, b.builds);
            ASSERT_EQ(a.rebuilds, b.rebuilds);
            if (gqa == PQC_GQA_SUM) ASSERT_EQ(a.hits + a.misses, b.hits + b.misses);
            ASSERT(b.hits > 0); /* blocks of the sinks, the window and admitted ones are device-resident */
            if (st.differ == 0) { /* one admission rule: the same traffic and blocks on both tiers */
                int h;
                ASSERT_EQ(a.hits, b.hits);
                ASSERT_EQ(a.misses, b.misses);
                if ((sh->rerank > 0 || sh->outliers > 0) && sh->dstep) /* exact scoring on the device: candidates' rows too */
                    ASSERT(b.bytes_h2d > a.bytes_h2d && (b.bytes_h2d - a.bytes_h2d) % p.cg->row == 0);
                else
                    ASSERT_EQ(a.bytes_h2d, b.bytes_h2d);
                ASSERT_EQ(a.tokens_selected, b.tokens_selected);
                ASSERT_EQ(a.selects, b.selects);
                for (h = 0; h < hkv; h++) {
                    int32_t ba[64], bb[64];
                    int na = pqc_cache_cached_blocks(p.cc, l, h, ba, 64), nb = pqc_cache_cached_blocks(p.cg, l, h, bb, 64);
                    ASSERT_EQ(na, nb);
                    ASSERT(na > 0);
                    ASSERT_MEM_EQ(ba, bb, (size_t)PQC__MIN(na, 64) * sizeof(int32_t));
                }
            }
        }
        ASSERT(a.rebuilds + b.rebuilds > 0);
    }
    {
        size_t dev = 0, full = 0;
        pqc_cache_memory(p.cg, &dev, &full);
        ASSERT(dev > 0 && full > 0);
    }
    if (sh->observe == 1) /* head 0 codes with a metric, head 1 (zero observations) without */
        for (l = 0; l < L; l++) {
            double a[2], b[2];
            ASSERT(sh->qdiag ? p.cg->layers[l].heads[0].pq.metric != NULL : p.cg->layers[l].heads[0].pq.mblocks != NULL);
            ASSERT(p.cg->layers[l].heads[1].pq.metric == NULL && p.cg->layers[l].heads[1].pq.mblocks == NULL);
            /* the observed attention, measured alike, split the top-k unevenly (evenly
               under the fixed split) */
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_observed_mass(p.cc, l, 0, &a[0], &a[1]));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_observed_mass(p.cg, l, 0, &b[0], &b[1]));
            ASSERT_EQ(a[0], b[0]);
            ASSERT_EQ(a[1], b[1]);
            if (sh->compete == 2) ASSERT_EQ(p.cg->takes[0], p.cg->takes[1]);
            else ASSERT(p.cg->takes[0] != p.cg->takes[1]);
        }
    fprintf(stderr, "  gqa %s, %s: %zu tokens selected, %zu differ, %zu rows compared, %zu differ\n",
            gqa == PQC_GQA_SUM ? "sum" : "softmax-sum", dt == PQC_F16 ? "fp16" : dt == PQC_BF16 ? "bf16" : "fp32", st.selected, st.differ,
            st.rows_compared, st.rows_differ);
    ASSERT_EQ(0, st.rows_differ);
    ASSERT(st.rows_compared > 0);
    if (gqa == PQC_GQA_SUM) ASSERT_EQ(0, st.differ);
    else ASSERT(st.differ * 1000 <= st.selected); /* boundary ties only: at most 0.1% */
    free(k1);
    free(k2);
    free(v1);
    free(v2);
    free(q);
    free(ka);
    free(va);
    pair_close(&p);
    PASS();
}

static enum greatest_test_res decode_matches(pqc_gqa gqa, pqc_dtype dt) { return decode_matches_shape(gqa, dt, &g_small); }

TEST decode_matches_cpu_sum_fp32(void) { return decode_matches(PQC_GQA_SUM, PQC_F32); }
/* sub-vectors longer than the coding kernel takes (256): new codes are copied instead */
TEST decode_matches_cpu_long_subvectors(void)
{
    static const shape sh = { 1, 1, 2, 512, 1, 4, 6, 500, 700, 0, 0, 0, 0.0, 0, 0.0, 0, 0, 0, 0.0f, 0 };
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}
/* three layers through two code buffers: every select finds its codes prefetched */
TEST decode_matches_cpu_softmax_fp16(void)
{
    shape sh = g_small;
    sh.L = 3;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F16, &sh);
}
/* observed queries: the builds code with a metric, the device codes new tokens with it,
   and the heads share the top-k unevenly (the device's candidates trimmed by score) */
TEST decode_matches_cpu_with_metric(void)
{
    shape sh = g_small;
    sh.observe = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F16, &sh);
}
/* a window the builds lowered (observations that look far back): the tokens that left
   it are coded and selected alike, with select + fetch and with device steps */
TEST decode_matches_cpu_lowered_window(void)
{
    shape sh = g_small;
    sh.observe = 2;
    sh.dstep = 2;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F16, &sh);
}
/* the whole decode step on the device (pqc_cache_step_device): the same selection,
   rows, admissions and statistics as the CPU tier's select + fetch; three layers through
   two code buffers */
TEST device_steps_match_cpu(void)
{
    shape sh = g_small;
    sh.L = 3;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F32, &sh);
}
/* ... with the heads' uneven tops-k (observed queries), the device's top-k per head */
TEST device_steps_match_cpu_with_metric(void)
{
    shape sh = g_small;
    sh.observe = 1;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F16, &sh);
}
/* ... resident codes, LRU, and select + fetch every third step: the bookkeeping moves
   between host and device without losing a block */
TEST device_steps_mixed_with_host_steps(void)
{
    shape sh = g_small;
    sh.resident = 1;
    sh.dstep = 2;
    sh.lru = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_BF16, &sh);
}
/* ... softmax-sum (boundary ties allowed, as for select + fetch) */
TEST device_steps_match_cpu_softmax(void)
{
    shape sh = g_small;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}
/* ... the default shape of the codes (m = 4, b = 8), softmax-sum, observed queries */
TEST device_steps_match_cpu_default_shape(void)
{
    shape sh = g_small;
    sh.m = PQC_DEFAULT_M;
    sh.bits = PQC_DEFAULT_BITS;
    sh.observe = 1;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F16, &sh);
}
/* ... with re-ranking, which the device does too (pqc__gpu_rerank) */
TEST device_steps_with_rerank(void)
{
    shape sh = g_small;
    sh.rerank = 2.0;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F32, &sh);
}
/* ... softmax-sum at a model's scale (not 1/sqrt(d_h)): the search, the device step's
   re-ranking and the observed attention at that scale on both tiers */
TEST device_steps_at_a_models_softmax_scale(void)
{
    shape sh = g_small;
    sh.scale = 0.3f;
    sh.rerank = 2.0;
    sh.observe = 1;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}
/* A decode step on the device tier allocates no host memory once its buffers have grown:
   select and fetch (gathered into host rows, or on the device), and the device step, on
   a fork and its parent. how: 0 select + fetch, 1 select + fetch_device, 2 step_device.
   Inline runtime: every allocation counted is the call's. */
static enum greatest_test_res decode_steps_without_allocating(int how)
{
    const int L = 2, hkv = 2, hq = 4, d = 32, S = 700, STEPS = 50;
    tu_failing fa;
    pqc_runtime *rt;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *c[2] = { NULL, NULL };
    pqc_selection sel[2];
    pqc_kv_out out;
    float *k = tu_normal_rows(&g_rng, (size_t)S + STEPS, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, (size_t)S + STEPS, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, STEPS, (size_t)hq * d), *buf = tu_kv_out(&out, hkv, 2000, d);
    long appends[2], steps[2];
    int l, i;
    pqc_matrix km = pqc_matrix_f32(k, (size_t)S, (size_t)hkv * d), vm = pqc_matrix_f32(v, (size_t)S, (size_t)hkv * d);
    ASSERT(buf != NULL);
    ASSERT((rt = tu_counting_runtime(&fa, 1)) != NULL);
    ASSERT_EQ(PQC_BACKEND_CUDA, pqc_runtime_backend(rt));
    cd.kv_dtype = PQC_F16;
    cd.budget_ratio = 0.2;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c[0]));
    for (l = 0; l < L; l++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c[0], l, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(c[0], &c[1]));
    for (i = 0; i < 2; i++) {
        memset(&sel[i], 0, sizeof sel[i]);
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c[i], &sel[i]));
    }
    ASSERT_EQ(PQC_SUCCESS, tu_counted_steps(c, sel, 2, L, k + (size_t)S * hkv * d, v + (size_t)S * hkv * d,
                                            (size_t)hkv * d, q, (size_t)hq * d, STEPS, 20, how, &out, &fa, appends, steps));
    for (i = 0; i < 2; i++) {
        ASSERT_EQ(0L, steps[i]);
        ASSERT(appends[i] <= 8); /* (growth now and then; one a step would be 40) */
    }
    for (i = 0; i < 2; i++) {
        pqc_selection_free(&sel[i]);
        pqc_cache_destroy(c[i]);
    }
    pqc_runtime_destroy(rt);
    ASSERT_EQ(0L, tu_failing_live(&fa));
    free(k);
    free(v);
    free(q);
    free(buf);
    PASS();
}
TEST decode_steps_without_allocating_host_rows(void) { return decode_steps_without_allocating(0); }
TEST decode_steps_without_allocating_device_rows(void) { return decode_steps_without_allocating(1); }
TEST device_steps_without_allocating(void) { return decode_steps_without_allocating(2); }
TEST decode_matches_cpu_with_metric_softmax(void)
{
    shape sh = g_small;
    sh.observe = 1;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}
/* sub-spaces of rope bands over the half-split layout (the kernels gather each sub-space
   from two runs of dims), with and without a metric (a matrix per band) */
TEST decode_matches_cpu_rope_bands(void)
{
    shape sh = g_small;
    sh.bands = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F16, &sh);
}
TEST decode_matches_cpu_rope_bands_with_metric(void)
{
    shape sh = g_small;
    sh.bands = 1;
    sh.observe = 1;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}
/* the diagonal metric (weights per dim, PQC_METRIC_QUERY_DIAG): the device multiplies
   the key by the weights before the search, as the host does; head 1 (no observations)
   stays Euclidean in the same layer */
TEST decode_matches_cpu_diagonal_metric(void)
{
    shape sh = g_small;
    sh.bands = 1;
    sh.observe = 1;
    sh.qdiag = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F16, &sh);
}
TEST device_steps_match_cpu_diagonal_metric(void)
{
    shape sh = g_small;
    sh.observe = 1;
    sh.qdiag = 1;
    sh.dstep = 1;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}

/* The rows the last device step of the GPU cache scored exactly: head h's count (0 on a
   failed read) and, with list, the entries (token n_sink + e for entry e): the device's PQ
   top-k (or, with outlier lists, their union with the lists), then the window's rivals,
   the sinks and the window's last tokens (pqc__gpu_rerank's rr_ext, counted in rr_next). */
static size_t scored_candidates(const pair *p, size_t h, int32_t *list)
{
    const struct pqc__gpu_tier *u = p->cg->cu;
    int32_t n = 0;
    if (p_dtoh(&n, u->rr_next + h * 4, 4) || n < 0) return 0;
    if (list && n > 0 && p_dtoh(list, u->rr_ext + h * (uint64_t)u->rr_cap * 4, (size_t)n * 4)) return 0;
    return (size_t)n;
}

/* after a device step of layer l with queries q: every head's combined scores of the rows
   it may choose (all but the sinks and the window's last tokens, which join the softmax
   only) equal the host's exact scoring of the same rows (pqc__rerank_impl, as
   pqc__select_exact calls it), bit for bit, and the others are -infinity there (a cache
   whose key rows lie in one store); 0 on a mismatch */
static int rerank_scores_match(pair *p, int l, const float *q, pqc_gqa gqa)
{
    const pqc_cache *c = p->cg;
    const struct pqc__gpu_tier *u = c->cu;
    const pqc__layer *L = &c->layers[l];
    size_t h, i, n, tokens, d = (size_t)c->d.head_dim, nt = L->n_tokens;
    size_t sink = PQC__MIN((size_t)c->d.n_sink, nt), from = PQC__MAX(pqc__mid_end(c, L, nt), sink);
    size_t nf = nt - from + sink - pqc__rivals_of(c, L, nt);
    int ok = 1;
    for (h = 0; ok && h < (size_t)c->d.n_kv_heads; h++) {
        const void *k, *v;
        pqc_dtype dt;
        pqc_matrix km;
        pqc_scratch sc;
        int32_t *cand;
        uint32_t *ci, *idx;
        float *dev, *host;
        if (!(n = scored_candidates(p, h, NULL))) continue;
        cand = (int32_t *)malloc(n * 4);
        ci = (uint32_t *)malloc(n * 4);
        idx = (uint32_t *)malloc(n * 4);
        dev = (float *)malloc(n * 4);
        host = (float *)malloc(n * 4);
        memset(&sc, 0, sizeof sc);
        ok = cand && ci && idx && dev && host && n > nf && scored_candidates(p, h, cand) == n &&
             !p_dtoh(dev, u->rr_comb + h * u->rr_cap * 4, n * 4) &&
             pqc_cache_kv(c, l, (int)h, &k, &v, &tokens, &dt) == PQC_SUCCESS;
        for (i = 0; ok && i < n; i++) ci[i] = (uint32_t)cand[i] + (uint32_t)c->d.n_sink;
        if (ok) {
            memset(&km, 0, sizeof km);
            km.data = k;
            km.rows = tokens;
            km.cols = d;
            km.dtype = dt;
            ok = pqc__rerank_impl(p->rc, &km, q + h * (size_t)c->g * d, c->g, gqa, c->sp.scale, ci, n, n - nf, &sc, idx,
                                  host, 0, nf) == PQC_SUCCESS &&
                 memcmp(dev, host, (n - nf) * 4) == 0;
            for (i = n - nf; ok && i < n; i++) ok = dev[i] < -FLT_MAX;
            if (!ok) fprintf(stderr, "layer %d head %zu: the device's re-ranking scores differ from the host's\n", l, h);
        }
        pqc_scratch_free(&sc);
        free(cand);
        free(ci);
        free(idx);
        free(dev);
        free(host);
    }
    return ok;
}

/* Re-ranking on the device (pqc_rerank_dots, pqc_rerank_combine, a top-k of their scores,
   pqc_take_at) selects what the host's re-ranking of the same device candidates selects,
   bit for bit: each step of the GPU cache selects on the host (pqc_cache_select), then runs
   as a whole on the device with the same queries (pqc_cache_step_device), and the two
   selections are compared, and the device's scores with pqc_rerank's (bit for bit); the
   rows against the CPU tier's as elsewhere, and the bytes moved up against the CPU tier's
   (the candidates' rows the device does not hold come on top). observe: uneven tops-k per
   head; fork: the steps run on a fork, whose key rows lie in two stores. */
static enum greatest_test_res rerank_on_device(pqc_gqa gqa, pqc_dtype dt, double rerank, int outliers, int observe,
                                               int fork)
{
    const int L = 2, hkv = 2, hq = 8, d = 64, steps = TEST_SIZE(6, 3);
    const size_t n1 = TEST_SIZE(1500, 800);
    pqc_cache_desc cd = tier_desc(L, hkv, hq, d);
    pqc_cache_desc pd;
    pair p;
    cmp_stats st;
    pqc_cache *pc = NULL; /* the same cache without re-ranking, on the device tier */
    pqc_selection ps;
    float *k1, *v1, *q, *ka, *va;
    uint32_t *host;
    size_t hcount[2], rows = 0, moved = 0, host_rows = 0, cand_rows = 0;
    int s, l, h;
    cd.gqa = gqa;
    cd.kv_dtype = dt;
    cd.rerank = rerank > 0 ? rerank : -1; /* 0: none */
    cd.outliers = outliers;
    /* plain k-means: under the query metric a decode query unlike the observed ones may
       start a rebuild, which the second call of a step would then install */
    cd.metric = PQC_METRIC_L2;
    pd = cd;
    pd.rerank = -1;
    pd.outliers = 0;
    memset(&st, 0, sizeof st);
    ASSERT(pair_open(&p, &cd));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(p.rg, &pd, &pc));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(pc, &ps));
    k1 = make_keys(n1, hkv, d, 21);
    v1 = tu_normal_rows(&g_rng, n1, (size_t)hkv * d);
    q = tu_normal_rows(&g_rng, (size_t)steps, (size_t)hq * d);
    ka = tu_normal_rows(&g_rng, (size_t)steps * L, (size_t)hkv * d);
    va = tu_normal_rows(&g_rng, (size_t)steps * L, (size_t)hkv * d);
    host = (uint32_t *)malloc((size_t)hkv * cd.max_tokens * sizeof(uint32_t));
    ASSERT(k1 && v1 && q && ka && va && host);
    if (observe) ASSERT(observe_all(&p, pc, L, hkv, hq, d));
    ASSERT(prefill_both(&p, L, k1, v1, n1, (size_t)hkv * d));
    { /* re-ranking takes part: the PQ top-k alone selects otherwise */
        pqc_matrix km = pqc_matrix_f32(k1, n1, (size_t)hkv * d), vm = pqc_matrix_f32(v1, n1, (size_t)hkv * d);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(pc, 0, &km, &vm));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(pc, 0, q, &ps));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(p.cg, 0, q, &p.sg));
        for (h = 0; h < hkv; h++)
            moved += ps.count[h] != p.sg.count[h] ||
                     memcmp(ps.idx + (size_t)h * ps.capacity, p.sg.idx + (size_t)h * p.sg.capacity, ps.count[h] * 4) != 0;
        pqc_selection_free(&ps);
        pqc_cache_destroy(pc);
    }
    if (fork) { /* both caches decode on as forks; the parents stay */
        pqc_cache *fc = NULL, *fg = NULL;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p.cc, &fc));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p.cg, &fg));
        pqc_cache_destroy(p.cc);
        pqc_cache_destroy(p.cg);
        p.cc = fc;
        p.cg = fg;
    }
    for (s = 0; s < steps; s++)
        for (l = 0; l < L; l++) {
            size_t o = ((size_t)s * L + l) * hkv * d;
            const float *qs = q + (size_t)s * hq * d;
            pqc_layer_stats a, b, ac, bc;
            size_t differ = st.differ;
            ASSERT(append_both(&p, l, ka + o, va + o));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(p.cg, l, qs, &p.sg));
            for (h = 0; h < hkv; h++) {
                hcount[h] = p.sg.count[h];
                memcpy(host + (size_t)h * cd.max_tokens, p.sg.idx + (size_t)h * p.sg.capacity, hcount[h] * 4);
            }
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(p.cg, l, &a));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(p.cc, l, &ac));
            ASSERT(step_compare_dev(&p, l, qs, d, &st));
            if (!fork) ASSERT(rerank_scores_match(&p, l, qs, gqa));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(p.cg, l, &b));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(p.cc, l, &bc));
            if (st.differ == differ) { /* the same selection: the device moved what the CPU tier's
                                          select + fetch counts, plus the candidates' rows it
                                          read from host memory */
                uint64_t extra = (b.bytes_h2d - a.bytes_h2d) - (bc.bytes_h2d - ac.bytes_h2d), all = 0;
                for (h = 0; h < hkv; h++) all += scored_candidates(&p, (size_t)h, NULL);
                ASSERT_EQ(0, extra % p.cg->row);
                ASSERT(extra / p.cg->row <= all);
                host_rows += (size_t)(extra / p.cg->row);
                cand_rows += (size_t)all;
            }
            if (s > 0) ASSERT_EQ(a.device_waits, b.device_waits); /* the step waited for nothing (the
                                                                      first one grows buffers) */
            for (h = 0; h < hkv; h++) {
                ASSERT_EQ(hcount[h], p.sg.count[h]);
                ASSERT_MEM_EQ(host + (size_t)h * cd.max_tokens, p.sg.idx + (size_t)h * p.sg.capacity, hcount[h] * 4);
                rows += hcount[h];
            }
        }
    fprintf(stderr, "  %s, %s, rerank %g, outliers %d%s: %zu rows selected alike on host and device; against the CPU tier %zu of %zu differ; "
            "%zu of %zu candidates' rows read from host memory\n",
            gqa == PQC_GQA_SUM ? "sum" : "softmax-sum", dt == PQC_F16 ? "fp16" : dt == PQC_BF16 ? "bf16" : "fp32", rerank,
            outliers, fork ? ", a fork" : "", rows, st.differ, st.selected, host_rows, cand_rows);
    ASSERT(rows > 0);
    ASSERT(host_rows > 0 && host_rows < cand_rows); /* the rows the device holds are read there */
    ASSERT_EQ(0, st.rows_differ);
    ASSERT(st.differ * 1000 <= st.selected);
    ASSERT(moved > 0);
    free(k1);
    free(v1);
    free(q);
    free(ka);
    free(va);
    free(host);
    pair_close(&p);
    PASS();
}
TEST device_rerank_matches_host_softmax_fp16(void) { return rerank_on_device(PQC_GQA_SOFTMAX_SUM, PQC_F16, 2.5, 0, 1, 0); }
TEST device_rerank_matches_host_sum_fork(void) { return rerank_on_device(PQC_GQA_SUM, PQC_BF16, 2.0, 0, 0, 1); }
/* candidates covering every coded token (the device's top-k of all of them) */
TEST device_rerank_matches_host_every_token(void) { return rerank_on_device(PQC_GQA_SOFTMAX_SUM, PQC_F32, 1e6, 16, 0, 0); }
/* outlier lists merged with the candidates on the device (pqc_rerank_merge): with
   re-ranking, and alone (the PQ top-k and the lists scored exactly) */
TEST device_rerank_with_outlier_lists(void) { return rerank_on_device(PQC_GQA_SOFTMAX_SUM, PQC_F16, 2.0, 16, 1, 0); }
TEST device_outlier_lists_alone(void) { return rerank_on_device(PQC_GQA_SUM, PQC_F32, 0.0, 24, 0, 1); }

/* exact scoring on the host of the device's candidates: re-ranked (the device's top
   2 x k, trimmed per head by score under the adaptive split), and with outlier lists */
TEST decode_matches_cpu_rerank(void)
{
    shape sh = g_small;
    sh.rerank = 2.0;
    sh.observe = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F16, &sh);
}
TEST decode_matches_cpu_outliers(void)
{
    shape sh = g_small;
    sh.outliers = 16;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F32, &sh);
}
TEST decode_matches_cpu_rerank_outliers_resident(void)
{
    shape sh = g_small;
    sh.rerank = 3.0;
    sh.outliers = 16;
    sh.resident = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_BF16, &sh);
}
/* residual-aware scoring: the host searches for the device tier */
TEST decode_matches_cpu_residual_scoring(void)
{
    shape sh = g_small;
    sh.resid = 0.15;
    sh.observe = 1;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F16, &sh);
}
/* the window competing with the coded tokens (PQC_SPLIT_COMPETE): its rivals scored and
   chosen on the device in device steps (pqc_rival_cands, pqc_rerank_dots, pqc_rival_stats,
   pqc_rival_scores, pqc_select_admit), the host's select + fetch every third step */
TEST decode_matches_cpu_window_competes(void)
{
    shape sh = g_small;
    sh.compete = 1;
    sh.observe = 1;
    sh.dstep = 2;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F16, &sh);
}
/* ... the summed query, every step on the device: the same selections bit for bit */
TEST device_steps_window_competes_sum(void)
{
    shape sh = g_small;
    sh.compete = 1;
    sh.dstep = 1;
    return decode_matches_shape(PQC_GQA_SUM, PQC_F32, &sh);
}
/* ... with every head the same top-k (PQC_SPLIT_FIXED_COMPETE, the split of caches over
   slices of the heads), softmax-sum over fp16 keys, observed, every step on the device */
TEST device_steps_fixed_split_window_competes(void)
{
    shape sh = g_small;
    sh.compete = 2;
    sh.observe = 1;
    sh.dstep = 1;
    sh.steps = 6;
    return decode_matches_shape(PQC_GQA_SOFTMAX_SUM, PQC_F16, &sh);
}
/* A cache saved from the host tier loads onto the device tier (sinks, window, codebooks
   and codes go to the GPU as after a build) and decodes as the host cache goes on. */
TEST cache_file_loads_onto_the_device(void)
{
    const int L = 2, hkv = 2, hq = 4, d = 64, steps = 8;
    pqc_cache_desc cd = tier_desc(L, hkv, hq, d);
    pair p;
    cmp_stats st;
    float *k1 = make_keys(1500, hkv, d, 11), *v1 = tu_normal_rows(&g_rng, 1500, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, (size_t)2 * steps, (size_t)hq * d), *ka = tu_normal_rows(&g_rng, (size_t)2 * steps * L, (size_t)hkv * d);
    char path[512];
    int s, l;
    tu_tmp_path(path, sizeof path, "cuda_cache");
    cd.kv_dtype = PQC_F16;
    cd.rerank = 2;
    cd.outliers = 8;
    memset(&st, 0, sizeof st);
    ASSERT(k1 && v1 && q && ka);
    ASSERT(pair_open(&p, &cd));
    ASSERT(prefill_both(&p, L, k1, v1, 1500, (size_t)hkv * d));
    for (s = 0; s < steps; s++)
        for (l = 0; l < L; l++) {
            size_t o = ((size_t)s * L + l) * hkv * d;
            ASSERT(append_both(&p, l, ka + o, ka + o));
            ASSERT(step_compare(&p, l, q + (size_t)s * hq * d, d, &st));
        }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(p.cc, path));
    pqc_cache_destroy(p.cg);
    p.cg = NULL;
    if (pqc_cache_load(p.rg, &cd, path, &p.cg) != PQC_SUCCESS) fprintf(stderr, "load: %s\n", pqc_last_error());
    ASSERT(p.cg != NULL);
    ASSERT_EQ(1, pqc_cache_on_device(p.cg));
    for (s = steps; s < 2 * steps; s++)
        for (l = 0; l < L; l++) {
            size_t o = ((size_t)s * L + l) * hkv * d;
            ASSERT(append_both(&p, l, ka + o, ka + o));
            ASSERT(step_compare(&p, l, q + (size_t)s * hq * d, d, &st));
        }
    CHECK_CALL(cmp_report("loaded onto the device", &st));
    remove(path);
    pair_close(&p);
    free(k1);
    free(v1);
    free(q);
    free(ka);
    PASS();
}
/* Prefix sharing on the device tier: the parent after its first fork (its stores became
   the shared prefix), then the child alone after the parent is gone, both against a CPU
   cache that never shared; codes resident, so the device codes tokens of the shared
   prefix and of its own rows. */
TEST fork_on_the_device_matches_cpu(void)
{
    const int L = 2, hkv = 2, hq = 4, d = 64, steps = 90;
    pqc_cache_desc cd = tier_desc(L, hkv, hq, d);
    pair p;
    cmp_stats st;
    pqc_cache *child = NULL;
    float *k1 = make_keys(1500, hkv, d, 13), *v1 = tu_normal_rows(&g_rng, 1500, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, (size_t)steps, (size_t)hq * d), *ka = tu_normal_rows(&g_rng, (size_t)steps * L, (size_t)hkv * d);
    int s, l;
    size_t own, shared;
    cd.kv_dtype = PQC_F16;
    cd.codes_resident = 1;
    memset(&st, 0, sizeof st);
    ASSERT(k1 && v1 && q && ka);
    ASSERT(pair_open(&p, &cd));
    ASSERT(prefill_both(&p, L, k1, v1, 1500, (size_t)hkv * d));
    for (s = 0; s < steps; s++) {
        if (s == 4) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p.cg, &child));
            ASSERT_EQ(1, pqc_cache_on_device(child));
            pqc_cache_host_memory(child, &own, &shared);
            ASSERT(shared > own);
        }
        if (s == 40) { /* the parent goes; the child goes on over the shared prefix */
            pqc_cache_destroy(p.cg);
            p.cg = child;
            child = NULL;
        }
        for (l = 0; l < L; l++) {
            size_t o = ((size_t)s * L + l) * hkv * d;
            ASSERT(append_both(&p, l, ka + o, ka + o));
            if (child) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(child, l, ka + o, ka + o));
            ASSERT(step_compare(&p, l, q + (size_t)s * hq * d, d, &st));
        }
    }
    CHECK_CALL(cmp_report("forks on the device", &st));
    pair_close(&p);
    free(k1);
    free(v1);
    free(q);
    free(ka);
    PASS();
}

/* every layer's codes resident in device memory */
TEST decode_matches_cpu_sum_bf16_resident(void)
{
    shape sh = g_small;
    sh.resident = 1;
    sh.L = 3; /* three layers, three code buffers */
    return decode_matches_shape(PQC_GQA_SUM, PQC_BF16, &sh);
}

/* fetch_device on the engine's own stream: the rows read back equal the CPU cache's */
TEST device_fetch_on_engine_stream(void)
{
    const int L = 1, hkv = 2, hq = 2, d = 32;
    const size_t n = 900;
    pqc_cache_desc cd = tier_desc(L, hkv, hq, d);
    pqc_runtime *rc, *rg;
    pqc_cache *cc, *cg;
    pqc_selection sc, sg;
    pqc_kv_out oc;
    pqc_kv_device dk;
    void *stream = NULL, *ctx = NULL;
    float *k = make_keys(n, hkv, d, 5), *v = tu_normal_rows(&g_rng, n, (size_t)hkv * d), *q = tu_normal_rows(&g_rng, 1, (size_t)hq * d);
    float *kc = (float *)malloc(2 * n * hkv * d * sizeof(float)), *row = (float *)malloc((size_t)d * sizeof(float));
    pqc_matrix km = pqc_matrix_f32(k, n, (size_t)hkv * d), vm = pqc_matrix_f32(v, n, (size_t)hkv * d);
    int h;
    size_t i;
    cd.gqa = PQC_GQA_SUM;
    ASSERT(open_driver());
    rc = tu_cpu_runtime(1);
    rg = tu_cuda_runtime(1);
    ASSERT(rc && rg);
    ASSERT_EQ(0, p_ctx_retain(&ctx, 0));
    ASSERT_EQ(0, p_ctx_set(ctx));
    ASSERT_EQ(0, p_stream_create(&stream, 1));
    cd.cuda_stream = stream;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rc, &cd, &cc));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rg, &cd, &cg));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cc, &sc));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cg, &sg));
    ASSERT_EQ(PQC_ERROR_UNSUPPORTED, pqc_cache_fetch_device(cc, 0, &sc, &dk)); /* a CPU cache */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(cc, 0, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(cg, 0, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(cc));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(cg));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(cc, 0, q, &sc));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(cg, 0, q, &sg));
    oc.k = kc;
    oc.v = kc + n * hkv * d;
    oc.head_stride = n;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(cc, 0, &sc, &oc));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch_device(cg, 0, &sg, &dk));
    ASSERT(dk.k != 0 && dk.v != 0 && dk.head_stride >= sg.count[0]);
    ASSERT_EQ(0, p_ctx_set(ctx));
    ASSERT_EQ(0, p_stream_sync(stream));
    for (h = 0; h < hkv; h++) {
        ASSERT_EQ(sc.count[h], sg.count[h]);
        ASSERT_MEM_EQ(sc.idx + (size_t)h * sc.capacity, sg.idx + (size_t)h * sg.capacity, sc.count[h] * 4);
        for (i = 0; i < sg.count[h]; i++) {
            size_t off = (((size_t)h * dk.head_stride + i) * d) * sizeof(float);
            ASSERT_EQ(0, p_dtoh(row, dk.k + off, (size_t)d * sizeof(float)));
            ASSERT_MEM_EQ(kc + ((size_t)h * n + i) * d, row, (size_t)d * sizeof(float));
            ASSERT_EQ(0, p_dtoh(row, dk.v + off, (size_t)d * sizeof(float)));
            ASSERT_MEM_EQ(kc + n * hkv * d + ((size_t)h * n + i) * d, row, (size_t)d * sizeof(float));
        }
    }
    pqc_selection_free(&sc);
    pqc_selection_free(&sg);
    pqc_cache_destroy(cc);
    pqc_cache_destroy(cg);
    ASSERT_EQ(0, p_ctx_set(ctx));
    p_stream_destroy(stream);
    pqc_runtime_destroy(rc);
    pqc_runtime_destroy(rg);
    free(k);
    free(v);
    free(q);
    free(kc);
    free(row);
    PASS();
}

/* the driver hands device rows to an engine that takes them */
typedef struct toy {
    int d, hkv, hq, device_views, host_views;
    size_t rows;
    int glance; /* device views: only wait for the device once per step, at the last layer
                   (as an engine reading its logits), instead of reading every row */
    int layers;
} toy;
static float toy_val(int layer, size_t pos, int i, int which)
{
    uint64_t s = (uint64_t)pos * 1315423911u + (uint64_t)layer * 2654435761u + (uint64_t)i * 97u + (uint64_t)which;
    return (float)((int)(synth__next(&s) % 2001) - 1000) / 250.0f;
}
static int toy_qkv(void *u, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    toy *t = (toy *)u;
    size_t p;
    int i;
    for (p = 0; p < n; p++) {
        for (i = 0; i < t->hq * t->d; i++) q[p * t->hq * t->d + i] = toy_val(layer, pos0 + p, i, 0);
        for (i = 0; i < t->hkv * t->d; i++) {
            k[p * t->hkv * t->d + i] = toy_val(layer, pos0 + p, i, 1);
            v[p * t->hkv * t->d + i] = toy_val(layer, pos0 + p, i, 2);
        }
    }
    return 0;
}
static int toy_attend(void *u, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv)
{
    toy *t = (toy *)u;
    (void)layer;
    (void)pos0;
    (void)n;
    (void)q;
    if (kv->on_device) {
        float row[64];
        uint32_t tok;
        size_t i;
        t->device_views++;
        if (t->glance) {
            t->rows += kv->count[0];
            return layer == t->layers - 1 ? p_ctx_sync() != 0 : 0;
        }
        for (i = 0; i < kv->count[0]; i++) { /* every row readable and equal to the stored K */
            unsigned long long a = (unsigned long long)(uintptr_t)kv->k[0] + i * (size_t)t->d * sizeof(float);
            /* the tokens are device addresses too */
            if (p_dtoh(&tok, (unsigned long long)(uintptr_t)kv->pos[0] + i * 4, 4) != 0) return 1;
            if (p_dtoh(row, a, (size_t)t->d * sizeof(float)) != 0) return 1;
            if (row[0] != toy_val(layer, tok, 0, 1)) return 1;
        }
        t->rows += kv->count[0];
    } else {
        t->host_views++;
    }
    return 0;
}

TEST driver_hands_device_rows(void)
{
    toy t;
    pqc_engine e;
    pqc_cache_desc cd = tier_desc(2, 2, 4, 32);
    pqc_runtime *rg = tu_cuda_runtime(1);
    pqc_cache *c = NULL;
    size_t pos;
    ASSERT(rg && open_driver());
    memset(&t, 0, sizeof t);
    t.d = 32;
    t.hkv = 2;
    t.hq = 4;
    memset(&e, 0, sizeof e);
    e.user = &t;
    e.qkv = toy_qkv;
    e.attend = toy_attend;
    e.accepts_device_kv = 1;
    cd.pq.m = 2;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rg, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, 700));
    for (pos = 700; pos < 706; pos++) ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos));
    ASSERT_EQ(2, t.host_views);    /* prefill: two layers over the host store */
    ASSERT_EQ(12, t.device_views); /* decode: 6 steps x 2 layers */
    ASSERT(t.rows > 0);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rg);
    PASS();
}

/* What the host does to the device during decode, counted by the stand-in driver: with
   device rows a step waits for nothing (the engine's own wait for its logits aside) and
   copies nothing up but each layer's queries and tops-k, and nothing down; with host rows
   it waits once per layer, for the rows (the engine needs them before the next layer).
   With the test shape (m = 2, resident codes), with the library's default configuration
   (every setting but the shape left to pqc_cache_resolve: m = 4 b = 8, softmax-sum,
   observed queries, codes where the tier keeps them by default, re-ranking 1.5), and
   with re-ranking 2.5 (defaults 2); with re-ranking each head's candidate count goes up
   with its top-k, in the same copy. */
static enum greatest_test_res never_wait(int defaults)
{
    toy t;
    pqc_engine e;
    pqc_cache_desc cd = tier_desc(2, 2, 4, 32);
    pqc_runtime *rg = tu_cuda_runtime(1);
    pqc_cache *c = NULL;
    emu_counters_fn counters;
    unsigned long long n[4];
    const unsigned long long steps = 6, L = 2, up = (4 * 32 * 4 + (defaults == 1 || defaults == 2 ? 2 : 1) * 2 * 4) * L; /* per step */
    size_t pos = 700, i;
    pqc_layer_stats st, st0, st1;
    void *sym;
    ASSERT(rg && open_driver());
    sym = dlsym(g_drv, "pqc_emu_counters");
    if (!sym) SKIPm("the driver is not the stand-in: nothing counts its calls");
    memcpy(&counters, &sym, sizeof counters);
    memset(&t, 0, sizeof t);
    t.d = 32;
    t.hkv = 2;
    t.hq = 4;
    t.glance = 1;
    t.layers = 2;
    memset(&e, 0, sizeof e);
    e.user = &t;
    e.qkv = toy_qkv;
    e.attend = toy_attend;
    e.accepts_device_kv = 1;
    if (defaults) {
        memset(&cd, 0, sizeof cd);
        cd.n_layers = 2;
        cd.n_kv_heads = 2;
        cd.n_q_heads = 4;
        cd.head_dim = 32;
        if (defaults == 2) cd.rerank = 2.5;
        if (defaults == 3) { /* the window competing: its rivals scored on the device */
            cd.split = PQC_SPLIT_COMPETE;
            cd.rerank = -1;
            cd.recent_share = 0.5;
        }
    } else {
        cd.pq.m = 2;
        cd.codes_resident = 1;
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rg, &cd, &c));
    if (defaults) {
        pqc_cache_desc got;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(c, &got));
        ASSERT_EQ(PQC_DEFAULT_M, got.pq.m);
        ASSERT_EQ(PQC_DEFAULT_BITS, got.pq.bits);
        ASSERT_EQ(PQC_GQA_SOFTMAX_SUM, got.gqa);
        ASSERT_EQ(defaults == 2 ? 2.5 : defaults == 3 ? -1.0 : PQC_DEFAULT_RERANK, got.rerank);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, pos));
    for (i = 0; i < 2; i++) ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos++)); /* first steps set up */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st0));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 1, &st1));
    counters(n, 1);
    for (i = 0; i < steps; i++) ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos++));
    counters(n, 1);
    fprintf(stderr, "  device rows, %llu steps x %llu layers: %llu waits (the engine's %llu), %llu bytes up in %llu copies, %llu down\n",
            steps, L, n[0], steps, n[1], n[3], n[2]);
    ASSERT_EQ(steps, n[0]);      /* the engine's own, one per step */
    ASSERT_EQ(steps * up, n[1]); /* queries and tops-k: no index round trips */
    ASSERT_EQ(steps * L * 2, n[3]);
    ASSERT_EQ(0, n[2]);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 1, &st)); /* counted on the device */
    ASSERT(st.hits + st.misses > 0);
    ASSERT_EQ(st.selects, st.fetches);
    ASSERT_EQ(st1.device_waits, st.device_waits); /* the library's own count agrees: none */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ(st0.device_waits, st.device_waits);
    /* host rows */
    e.accepts_device_kv = 0;
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos++));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st0));
    counters(n, 1);
    for (i = 0; i < steps; i++) ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos++));
    counters(n, 1);
    fprintf(stderr, "  host rows, %llu steps x %llu layers: %llu waits, %llu bytes up in %llu copies, %llu down\n", steps, L,
            n[0], n[1], n[3], n[2]);
    ASSERT_EQ(steps * L, n[0]);
    ASSERT_EQ(steps * up, n[1]);
    ASSERT(n[2] > 0);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ(steps, st.device_waits - st0.device_waits); /* one per step at this layer */
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rg);
    PASS();
}
TEST device_steps_never_wait(void) { return never_wait(0); }
TEST device_steps_never_wait_default_configuration(void) { return never_wait(1); }
TEST device_steps_never_wait_with_rerank(void) { return never_wait(2); }
TEST device_steps_never_wait_window_competes(void) { return never_wait(3); }

TEST misuse_gets_result_codes(void)
{
    pqc_runtime_desc d;
    pqc_runtime *rt = NULL;
    pqc_cache_desc cd = tier_desc(1, 2, 2, 32);
    pqc_runtime *rg = tu_cuda_runtime(1);
    pqc_cache *c = NULL;
    pqc_selection sel;
    float q[64];
    ASSERT(rg);
    memset(&d, 0, sizeof d);
    d.backend = PQC_BACKEND_CUDA;
    d.cuda_device = 5000;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_runtime_create(&d, &rt));
    d.cuda_device = 9; /* no such device */
    ASSERT_EQ(PQC_ERROR_NO_DEVICE, pqc_runtime_create(&d, &rt));
    ASSERT(strstr(pqc_last_error(), "no CUDA device 9") != NULL);
    d.backend = PQC_BACKEND_AUTO; /* AUTO falls back and says why */
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(PQC_BACKEND_CPU, pqc_runtime_backend(rt));
    ASSERT(strstr(pqc_runtime_backend_note(rt), "no CUDA device 9") != NULL);
    pqc_runtime_destroy(rt);
    ASSERT_EQ(PQC_BACKEND_CUDA, pqc_runtime_backend(rg));
    ASSERT(strstr(pqc_runtime_backend_note(rg), "compute capability") != NULL);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rg, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    memset(q, 0, sizeof q);
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_select(c, 0, q, &sel)); /* nothing stored yet */
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rg);
    PASS();
}

/* device memory running out, at creation and in the middle of a decode: a result code,
   nothing lost, and the next call works again (needs the stand-in driver's failure
   switch; skipped on a real GPU) */
typedef void (*fail_fn)(long n);
TEST device_allocation_failure(void)
{
    fail_fn fail;
    void *sym;
    const int hkv = 2, hq = 2, d = 32;
    const size_t n = 800;
    pqc_cache_desc cd = tier_desc(1, hkv, hq, d);
    pqc_runtime *rg, *rc;
    pqc_cache *c = NULL, *ref = NULL;
    pqc_selection sel, sref;
    float *k, *v, *q;
    pqc_matrix km, vm;
    long at;
    ASSERT(open_driver());
    sym = dlsym(g_drv, "pqc_emu_fail_alloc_after");
    if (!sym) SKIPm("needs the stand-in driver");
    memcpy(&fail, &sym, sizeof fail);
    k = make_keys(n, hkv, d, 21);
    v = tu_normal_rows(&g_rng, n, (size_t)hkv * d);
    q = tu_normal_rows(&g_rng, 1, (size_t)hq * d);
    km = pqc_matrix_f32(k, n, (size_t)hkv * d);
    vm = pqc_matrix_f32(v, n, (size_t)hkv * d);
    cd.gqa = PQC_GQA_SUM;
    rg = tu_cuda_runtime(1);
    rc = tu_cpu_runtime(1);
    ASSERT(rg && rc);
    for (at = 0; at < 12; at++) { /* each allocation of the creation fails once */
        fail(at);
        c = NULL;
        if (pqc_cache_create(rg, &cd, &c) != PQC_SUCCESS) {
            ASSERT(c == NULL);
            ASSERT(strstr(pqc_last_error(), "OUT_OF_MEMORY") != NULL);
        } else {
            pqc_cache_destroy(c);
        }
    }
    fail(-1);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rg, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rc, &cd, &ref));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(ref, &sref));
    fail(0); /* the first prefill allocates the slot pools: nothing is stored */
    ASSERT_EQ(PQC_ERROR_BACKEND, pqc_cache_prefill(c, 0, &km, &vm));
    ASSERT_EQ(0, pqc_cache_tokens(c, 0));
    fail(-1);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(ref, 0, &km, &vm));
    fail(0); /* the first select allocates its score buffers */
    ASSERT_EQ(PQC_ERROR_BACKEND, pqc_cache_select(c, 0, q, &sel));
    ASSERT(strstr(pqc_last_error(), "cuMemAlloc") != NULL);
    fail(-1);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(ref, 0, q, &sref));
    ASSERT_EQ(sref.count[0], sel.count[0]);
    ASSERT_MEM_EQ(sref.idx, sel.idx, sel.count[0] * 4);
    {
        pqc_kv_device dk;
        pqc_kv_out oc, og;
        int h;
        size_t rows = n * hkv * d;
        float *buf = (float *)malloc(4 * rows * sizeof(float));
        ASSERT(buf);
        oc.k = buf;
        oc.v = buf + rows;
        og.k = buf + 2 * rows;
        og.v = buf + 3 * rows;
        oc.head_stride = og.head_stride = n;
        fail(0); /* the first fetch allocates its gather buffers, after admitting blocks */
        ASSERT_EQ(PQC_ERROR_BACKEND, pqc_cache_fetch_device(c, 0, &sel, &dk));
        fail(-1);
        /* the blocks that fetch admitted were never filled: the next fetch must not read them */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &og));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(ref, 0, &sref, &oc));
        for (h = 0; h < hkv; h++) {
            ASSERT_MEM_EQ(oc.k + (size_t)h * n * d, og.k + (size_t)h * n * d, sel.count[h] * d * sizeof(float));
            ASSERT_MEM_EQ(oc.v + (size_t)h * n * d, og.v + (size_t)h * n * d, sel.count[h] * d * sizeof(float));
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch_device(c, 0, &sel, &dk));
        free(buf);
    }
    pqc_selection_free(&sel);
    pqc_selection_free(&sref);
    pqc_cache_destroy(c);
    pqc_cache_destroy(ref);
    pqc_runtime_destroy(rg);
    pqc_runtime_destroy(rc);
    free(k);
    free(v);
    free(q);
    PASS();
}

/* a runtime created with the environment variable `name` set to `value` (NULL: unset)
   and restored afterwards (the runtime reads it when it opens CUDA) */
static pqc_runtime *make_rt_env(const char *name, const char *value, int n_threads)
{
    pqc_runtime *rt;
    char *old = getenv(name) ? strdup(getenv(name)) : NULL;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
    rt = tu_cuda_runtime(n_threads);
    if (old) setenv(name, old, 1);
    else unsetenv(name);
    free(old);
    return rt;
}

/* a cache of one layer whose builds run their k-means on the runtime's GPU finds the
   needles of head 0 (7 of 8 at least); 0 on success */
static int device_cache_finds_needles(pqc_runtime *rg, pqc_runtime *rc)
{
    const int d = 64, hkv = 2, hq = 2, n = 1200;
    pqc_cache_desc cd = tier_desc(1, hkv, hq, d);
    pqc_cache *c;
    pqc_selection sel;
    float *k = make_keys((size_t)n, hkv, d, 13), *v = tu_normal_rows(&g_rng, (size_t)n, (size_t)hkv * d), *q;
    pqc_matrix kk = pqc_matrix_f32(k, (size_t)n, (size_t)hkv * d), vv = pqc_matrix_f32(v, (size_t)n, (size_t)hkv * d);
    pqc_layer_stats st;
    synth s0;
    int found = 0, h, j, bad = 0;
    cd.pq.device = 1;
    cd.pq.m = 2;
    cd.pq.bits = 5;
    cd.pq.iters = 3;
    if (rc && pqc_cache_create(rc, &cd, &c) != PQC_ERROR_NO_DEVICE) bad = 1;
    if (bad || pqc_cache_create(rg, &cd, &c) != PQC_SUCCESS) {
        free(k);
        free(v);
        return 1;
    }
    if (pqc_selection_init(c, &sel) != PQC_SUCCESS || pqc_cache_prefill(c, 0, &kk, &vv) != PQC_SUCCESS) bad = 2;
    /* head 0's query and needles: the synth behind make_keys(., ., ., 13) */
    if (!bad && synth_head(&s0, (size_t)n, d, 13) != 0) bad = 3;
    if (!bad) {
        q = (float *)calloc((size_t)hq * d, sizeof(float));
        for (h = 0; h < hq; h++) memcpy(q + (size_t)h * d, s0.queries, (size_t)d * sizeof(float));
        if (pqc_cache_select(c, 0, q, &sel) != PQC_SUCCESS) bad = 4;
        for (j = 0; !bad && j < 8; j++) found += pqc_recall(s0.needles + j, 1, sel.idx, sel.count[0]) > 0;
        if (!bad && pqc_cache_stats(c, 0, &st) != PQC_SUCCESS) bad = 5;
        fprintf(stderr, "  cache with GPU-trained codebooks: %d of 8 needles selected\n", found);
        if (!bad && (st.builds != 1 || found < 7)) bad = 6;
        synth_free(&s0);
        free(q);
        pqc_selection_free(&sel);
    }
    pqc_cache_destroy(c);
    free(k);
    free(v);
    return bad;
}

/* codebooks trained on the GPU (pq.device): as good as the CPU's, and a cache whose
   builds run there still finds the needles. The assignment by its kernel (the GEMM
   path has tests of its own below). */
TEST device_kmeans(void)
{
    const int d = 64;
    const size_t n = 1200;
    pqc_runtime *rg = make_rt_env("PQC_KMEANS_GEMM", "0", 1), *rc = tu_cpu_runtime(1);
    pqc_pq_desc pd;
    pqc_pq a, b;
    pqc_matrix km;
    double oa[2 * 9], ob[2 * 9];
    synth sy;
    int j;
    ASSERT(rg && rc);
    ASSERT_EQ(0, synth_head(&sy, n, d, 41));
    km = pqc_matrix_f32(sy.keys, n, (size_t)d);
    memset(&pd, 0, sizeof pd);
    pd.m = 2;
    pd.bits = 6;
    pd.iters = 8;
    pd.seed = 9;
    pd.objective = oa;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(rc, &pd, &km, &a));
    pd.objective = ob;
    pd.device = 1;
    ASSERT_EQ(PQC_ERROR_NO_DEVICE, pqc_pq_train(rc, &pd, &km, &b)); /* a CPU runtime */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(rg, &pd, &km, &b));
    for (j = 0; j < 2; j++) {
        fprintf(stderr, "  sub-space %d: k-means objective after 8 iterations, CPU %.5f, GPU %.5f (init %.5f, %.5f)\n", j,
                oa[j * 9 + 8], ob[j * 9 + 8], oa[j * 9], ob[j * 9]);
        ASSERT_EQ(oa[j * 9], ob[j * 9]);                /* the same seeding */
        ASSERT(ob[j * 9 + 8] < 0.8 * ob[j * 9]);        /* the GPU iterations do their job */
        ASSERT(ob[j * 9 + 8] <= 1.01 * oa[j * 9 + 8]);  /* and as well as the CPU's */
    }
    pqc_pq_free(&a);
    pqc_pq_free(&b);
    synth_free(&sy);
    ASSERT_EQ(0, device_cache_finds_needles(rg, rc));
    pqc_runtime_destroy(rg);
    pqc_runtime_destroy(rc);
    PASS();
}

/* the stand-in driver is also the stand-in cuBLASLt, whose GEMMs give the kernels' bits */
static int on_emulator(void) { return open_driver() && dlsym(g_drv, "pqc_emu_fail_alloc_after") != NULL; }

/* GPU k-means of 2 sub-spaces, 64 centroids each, 6 iterations (objectives after each) */
typedef struct km_run { pqc_pq pq; double obj[2 * 7]; } km_run;
static pqc_result km_train(pqc_runtime *rt, const pqc_matrix *km, km_run *r)
{
    pqc_pq_desc pd;
    memset(&pd, 0, sizeof pd);
    memset(r, 0, sizeof *r);
    pd.m = 2;
    pd.bits = 6;
    pd.iters = 6;
    pd.seed = 5;
    pd.objective = r->obj;
    pd.device = 1;
    return pqc_pq_train(rt, &pd, km, &r->pq);
}

/* a and b trained from the same seeding: on the stand-in bit for bit; on a GPU the
   GEMM adds in another order (and the sums are atomics), so the final objectives agree
   within 1e-3 relative */
static int km_same(const km_run *a, const km_run *b, int exact)
{
    int j;
    size_t bytes = (size_t)a->pq.m * a->pq.ksub * a->pq.dsub * sizeof(float);
    if (a->obj[0] != b->obj[0] || a->obj[7] != b->obj[7]) return 0; /* the same seeding */
    if (exact) return memcmp(a->pq.centroids, b->pq.centroids, bytes) == 0 && memcmp(a->obj, b->obj, sizeof a->obj) == 0;
    for (j = 0; j < 2; j++) {
        double x = a->obj[j * 7 + 6], y = b->obj[j * 7 + 6];
        if (fabs(x - y) > 1e-3 * fabs(x)) return 0;
    }
    return 1;
}

/* the assignment step as a cuBLASLt GEMM (forced by PQC_KMEANS_GEMM=1) trains the same
   codebooks as the kernel, and a cache built with it finds its needles; unforced, the
   runtime measures both once per shape class and remembers its choice */
TEST kmeans_gemm_matches_kernel(void)
{
    const int d = 64;
    const size_t n = 600;
    pqc_runtime *rk = make_rt_env("PQC_KMEANS_GEMM", "0", 1), *rgm = make_rt_env("PQC_KMEANS_GEMM", "1", 1);
    pqc_runtime *ra = make_rt_env("PQC_KMEANS_GEMM", NULL, 1);
    float *x;
    pqc_matrix km;
    km_run a, b, c;
    pqc__km_class cls;
    int exact = on_emulator(), j;
    ASSERT(rk && rgm && ra);
    if (strstr(pqc_runtime_backend_note(rgm), "k-means GEMM forced") == NULL) {
        pqc_runtime_destroy(rk);
        pqc_runtime_destroy(rgm);
        pqc_runtime_destroy(ra);
        SKIPm("no cuBLASLt (set PQC_CUBLASLT_PATH)");
    }
    ASSERT(strstr(pqc_runtime_backend_note(rk), "k-means GEMM off") != NULL);
    x = make_keys(n, 1, d, 55);
    km = pqc_matrix_f32(x, n, (size_t)d);
    ASSERT_EQ(PQC_SUCCESS, km_train(rk, &km, &a));
    ASSERT_EQ(PQC_SUCCESS, km_train(rgm, &km, &b));
    for (j = 0; j < 2; j++)
        fprintf(stderr, "  sub-space %d: objective %.6f -> kernel %.6f, GEMM %.6f\n", j, a.obj[j * 7], a.obj[j * 7 + 6],
                b.obj[j * 7 + 6]);
    ASSERT(a.obj[6] < 0.9 * a.obj[0]);
    ASSERT(km_same(&a, &b, exact));
    /* forced runtimes measure nothing */
    ASSERT_EQ(0, pqc__cuda_kmeans_choice(rgm, n, d / 2, 64, &cls));
    ASSERT_EQ(0, pqc__cuda_kmeans_choice(ra, n, d / 2, 64, &cls));
    ASSERT_EQ(PQC_SUCCESS, km_train(ra, &km, &c)); /* 7 assignment steps: measures on 4 */
    ASSERT_EQ(1, pqc__cuda_kmeans_choice(ra, n, d / 2, 64, &cls));
    { /* a class stored again (two builds that measured it side by side) keeps one entry */
        pqc__km_class again = cls;
        int classes = ra->cu->km_n;
        pqc__km_store(ra->cu, &again);
        ASSERT_EQ(classes, ra->cu->km_n);
        ASSERT_EQ(1, pqc__cuda_kmeans_choice(ra, n, d / 2, 64, &cls));
        ASSERT_EQ(again.gemm, cls.gemm);
    }
    ASSERT_EQ(1, pqc__cuda_kmeans_choice(ra, 1024, d / 2, 64, &cls)); /* the same class: n 513..1024 */
    ASSERT_EQ(0, pqc__cuda_kmeans_choice(ra, 512, d / 2, 64, &cls));
    ASSERT_EQ(0, pqc__cuda_kmeans_choice(ra, n, d / 2, 32, &cls));
    fprintf(stderr, "  measured: kernel %.3f ms, GEMM %.3f ms per step: %s\n", cls.ms_kernel, cls.ms_gemm,
            cls.gemm ? "GEMM" : "kernel");
    ASSERT(cls.ms_kernel >= 0.0f && cls.ms_gemm >= 0.0f);
    ASSERT_EQ(cls.gemm, cls.ms_gemm < cls.ms_kernel);
    ASSERT(km_same(&a, &c, exact));
    pqc_pq_free(&a.pq);
    pqc_pq_free(&b.pq);
    pqc_pq_free(&c.pq);
    ASSERT_EQ(0, device_cache_finds_needles(rgm, NULL));
    pqc_runtime_destroy(rk);
    pqc_runtime_destroy(rgm);
    pqc_runtime_destroy(ra);
    free(x);
    PASS();
}

/* several builds of one shape class on the pool at once, the runtime measuring (the
   choice is shared under the runtime's lock): the class is measured once, and on the
   stand-in the cache selects what a cache built by the kernel selects */
TEST kmeans_gemm_concurrent_builds(void)
{
    const int d = 64, hkv = 4, hq = 4;
    const size_t n = 700;
    pqc_runtime *ra = make_rt_env("PQC_KMEANS_GEMM", NULL, 4), *rk = make_rt_env("PQC_KMEANS_GEMM", "0", 1);
    pqc_cache_desc cd = tier_desc(1, hkv, hq, d);
    pqc_cache *ca = NULL, *ck = NULL;
    float *k = make_keys(n, hkv, d, 77), *v = tu_normal_rows(&g_rng, n, (size_t)hkv * d);
    pqc_matrix kk = pqc_matrix_f32(k, n, (size_t)hkv * d), vv = pqc_matrix_f32(v, n, (size_t)hkv * d);
    pqc__km_class cls;
    pqc_layer_stats sa, sk;
    ASSERT(ra && rk);
    cd.pq.device = 1;
    cd.pq.m = 2;
    cd.pq.bits = 5;
    cd.pq.iters = 4;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(ra, &cd, &ca));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rk, &cd, &ck));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(ca, 0, &kk, &vv));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(ck, 0, &kk, &vv));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(ca));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(ck));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(ca, 0, &sa));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(ck, 0, &sk));
    ASSERT_EQ(1, (int)sa.builds);
    ASSERT_EQ(1, (int)sk.builds);
    if (on_emulator()) { /* the same codebooks, so the same selections */
        pqc_selection xa, xk;
        float *q = tu_normal_rows(&g_rng, 1, (size_t)hq * d);
        int h;
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(ca, &xa));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(ck, &xk));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(ca, 0, q, &xa));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(ck, 0, q, &xk));
        for (h = 0; h < hkv; h++) {
            ASSERT_EQ(xk.count[h], xa.count[h]);
            ASSERT_MEM_EQ(xk.idx + (size_t)h * xk.capacity, xa.idx + (size_t)h * xa.capacity, xa.count[h] * sizeof(xa.idx[0]));
        }
        pqc_selection_free(&xa);
        pqc_selection_free(&xk);
        free(q);
    }
    if (strstr(pqc_runtime_backend_note(ra), "no cuBLASLt") == NULL)
        ASSERT_EQ(1, pqc__cuda_kmeans_choice(ra, 256, d / 2, 32, &cls) + pqc__cuda_kmeans_choice(ra, 512, d / 2, 32, &cls) +
                         pqc__cuda_kmeans_choice(ra, 1024, d / 2, 32, &cls));
    pqc_cache_destroy(ca);
    pqc_cache_destroy(ck);
    pqc_runtime_destroy(ra);
    pqc_runtime_destroy(rk);
    free(k);
    free(v);
    PASS();
}

/* without cuBLASLt (PQC_CUBLASLT_PATH naming a missing file), or with every matmul
   failing, the GEMM path falls back to the kernel: builds succeed with its results */
typedef void (*lt_fail_fn)(long n);

/* The stand-in's cuBLASLt fails the matmul after the next n (n < 0: none); 0 where the
   driver is not the stand-in. */
static int lt_fail_after(long n)
{
    void *sym = open_driver() ? dlsym(g_drv, "pqc_emu_blaslt_fail_after") : NULL;
    lt_fail_fn fail;
    if (!sym) return 0;
    memcpy(&fail, &sym, sizeof fail);
    fail(n);
    return 1;
}

TEST kmeans_gemm_falls_back(void)
{
    const int d = 64;
    const size_t n = 600;
    pqc_runtime *rk = make_rt_env("PQC_KMEANS_GEMM", "0", 1), *rn;
    char *old = getenv("PQC_CUBLASLT_PATH") ? strdup(getenv("PQC_CUBLASLT_PATH")) : NULL;
    float *x = make_keys(n, 1, d, 55);
    pqc_matrix km = pqc_matrix_f32(x, n, (size_t)d);
    km_run a, b;
    int exact = on_emulator();
    long at;
    ASSERT(rk);
    ASSERT_EQ(PQC_SUCCESS, km_train(rk, &km, &a));
    setenv("PQC_CUBLASLT_PATH", "build/no-such-dir/libcublasLt.so.13", 1);
    rn = make_rt_env("PQC_KMEANS_GEMM", "1", 1);
    if (old) setenv("PQC_CUBLASLT_PATH", old, 1);
    else unsetenv("PQC_CUBLASLT_PATH");
    ASSERT(rn != NULL);
    ASSERT(strstr(pqc_runtime_backend_note(rn), "no cuBLASLt") != NULL);
    ASSERT(strstr(pqc_runtime_backend_note(rn), "no-such-dir") != NULL);
    ASSERT_EQ(PQC_SUCCESS, km_train(rn, &km, &b));
    ASSERT(km_same(&a, &b, exact));
    pqc_pq_free(&b.pq);
    pqc_runtime_destroy(rn);
    if (on_emulator() && old) { /* the stand-in's cuBLASLt: the first matmul, then one in the middle, fails */
        rn = make_rt_env("PQC_KMEANS_GEMM", "1", 1);
        ASSERT(rn != NULL);
        ASSERT(strstr(pqc_runtime_backend_note(rn), "k-means GEMM forced") != NULL);
        for (at = 0; at < 20; at += 11) {
            ASSERT(lt_fail_after(at));
            ASSERT_EQ(PQC_SUCCESS, km_train(rn, &km, &b));
            lt_fail_after(-1);
            ASSERT(km_same(&a, &b, 1));
            pqc_pq_free(&b.pq);
        }
        pqc_runtime_destroy(rn);
    }
    pqc_pq_free(&a.pq);
    pqc_runtime_destroy(rk);
    free(old);
    free(x);
    PASS();
}

/* How a batch test runs: PQC_LUT_GEMM for the runtime (NULL: unset, the runtime times
   both paths), the GQA mode, RoPE-band sub-spaces, decode steps (each appends a token to
   every sequence between batches), the stand-in's cuBLASLt failing its n-th matmul (-1:
   never); out: the batches whose tables each path built. */
typedef struct batch_opts {
    const char *lut_gemm;
    int gqa, bands, steps, layers;
    long lt_fail_at;
    int approx; /* selections within 97% of the CPU tier's (a real GPU's matmul), not equal */
    unsigned long long gemm_batches, kernel_batches;
} batch_opts;

/* several sequences on one CUDA runtime, selected and fetched in parallel on the pool,
   against the same on the CPU tier: selections and rows equal, every step and layer */
static enum greatest_test_res batch_matches(batch_opts *o)
{
    enum { NS = 3 };
    const int hkv = 2, hq = 4, d = 32;
    const size_t n = 1100;
    pqc_cache_desc cd = tier_desc(o->layers, hkv, hq, d);
    pqc_runtime *rg, *rc = tu_cpu_runtime(1);
    pqc_cache *cg[NS], *cc[NS];
    pqc_selection sg[NS], sc[NS];
    pqc_kv_out og[NS], oc[NS];
    const float *qs[NS];
    pqc_selection *psg[NS], *psc[NS];
    const pqc_selection *cpsg[NS], *cpsc[NS];
    const pqc_kv_out *pog[NS], *poc[NS];
    float *k[NS], *v, *q, *buf;
    size_t rows = (n + (size_t)o->steps) * hkv * d;
    int i, h, l, step;
    char *old = getenv("PQC_KMEANS_GEMM") ? strdup(getenv("PQC_KMEANS_GEMM")) : NULL;
    setenv("PQC_KMEANS_GEMM", "0", 1); /* the builds' k-means: no matmuls (the failure counter is the tables') */
    rg = make_rt_env("PQC_LUT_GEMM", o->lut_gemm, 2);
    if (old) setenv("PQC_KMEANS_GEMM", old, 1);
    else unsetenv("PQC_KMEANS_GEMM");
    free(old);
    cd.gqa = (pqc_gqa)o->gqa;
    if (o->bands) {
        cd.pq.rope = PQC_ROPE_HALF;
        cd.pq.subspaces = PQC_SUBSPACES_ROPE_BANDS;
    }
    ASSERT(rg && rc);
    v = tu_normal_rows(&g_rng, n + (size_t)o->steps, (size_t)hkv * d);
    q = tu_normal_rows(&g_rng, NS * ((size_t)o->steps + 1), (size_t)hq * d);
    buf = (float *)malloc(4 * NS * rows * sizeof(float));
    ASSERT(v && q && buf);
    for (i = 0; i < NS; i++) {
        k[i] = make_keys(n + (size_t)o->steps, hkv, d, 100 + (uint64_t)i * 7);
        ASSERT(k[i]);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rg, &cd, &cg[i]));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rc, &cd, &cc[i]));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cg[i], &sg[i]));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cc[i], &sc[i]));
        for (l = 0; l < o->layers; l++) {
            pqc_matrix km = pqc_matrix_f32(k[i], n, (size_t)hkv * d), vm = pqc_matrix_f32(v, n, (size_t)hkv * d);
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(cg[i], l, &km, &vm));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(cc[i], l, &km, &vm));
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(cg[i])); /* the codebooks, before the first batch */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(cc[i]));
        psg[i] = &sg[i];
        psc[i] = &sc[i];
        cpsg[i] = &sg[i];
        cpsc[i] = &sc[i];
        og[i].k = buf + (size_t)i * 4 * rows;
        og[i].v = og[i].k + rows;
        oc[i].k = og[i].v + rows;
        oc[i].v = oc[i].k + rows;
        og[i].head_stride = oc[i].head_stride = n + (size_t)o->steps;
        pog[i] = &og[i];
        poc[i] = &oc[i];
    }
    if (o->lt_fail_at >= 0) ASSERT(lt_fail_after(o->lt_fail_at));
    for (step = 0; step <= o->steps; step++) {
        for (i = 0; i < NS; i++)
            qs[i] = q + ((size_t)step * NS + (size_t)i) * hq * d;
        for (l = 0; l < o->layers; l++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_batch_select(cg, NS, l, qs, psg));
            ASSERT_EQ(PQC_SUCCESS, pqc_batch_select(cc, NS, l, qs, psc));
            ASSERT_EQ(PQC_SUCCESS, pqc_batch_fetch(cg, NS, l, cpsg, pog));
            ASSERT_EQ(PQC_SUCCESS, pqc_batch_fetch(cc, NS, l, cpsc, poc));
            for (i = 0; i < NS; i++)
                for (h = 0; h < hkv; h++) {
                    size_t cnt = sc[i].count[h], hs = n + (size_t)o->steps;
                    ASSERT_EQ(cnt, sg[i].count[h]);
                    if (o->approx) { /* a real GPU's matmul adds in its own order: near-ties may swap */
                        ASSERT(pqc_recall(sc[i].idx + (size_t)h * sc[i].capacity, cnt,
                                          sg[i].idx + (size_t)h * sg[i].capacity, cnt) >= 0.97);
                        continue;
                    }
                    ASSERT_MEM_EQ(sc[i].idx + (size_t)h * sc[i].capacity, sg[i].idx + (size_t)h * sg[i].capacity, cnt * 4);
                    ASSERT_MEM_EQ(oc[i].k + (size_t)h * hs * d, og[i].k + (size_t)h * hs * d, cnt * d * sizeof(float));
                    ASSERT_MEM_EQ(oc[i].v + (size_t)h * hs * d, og[i].v + (size_t)h * hs * d, cnt * d * sizeof(float));
                }
        }
        if (step == o->steps) break;
        for (i = 0; i < NS; i++) /* the next token of every layer */
            for (l = 0; l < o->layers; l++) {
                const float *kr = k[i] + (n + (size_t)step) * hkv * d, *vr = v + (n + (size_t)step) * hkv * d;
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(cg[i], l, kr, vr));
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(cc[i], l, kr, vr));
            }
    }
    if (o->lt_fail_at >= 0) lt_fail_after(-1);
    o->gemm_batches = rg->cu && rg->cu->batch ? rg->cu->batch->gemm_batches : 0;
    o->kernel_batches = rg->cu && rg->cu->batch ? rg->cu->batch->kernel_batches : 0;
    for (i = 0; i < NS; i++) {
        pqc_selection_free(&sg[i]);
        pqc_selection_free(&sc[i]);
        pqc_cache_destroy(cg[i]);
        pqc_cache_destroy(cc[i]);
        free(k[i]);
    }
    pqc_runtime_destroy(rg);
    pqc_runtime_destroy(rc);
    free(v);
    free(q);
    free(buf);
    PASS();
}

TEST batch_on_device_matches_cpu(void)
{
    batch_opts o = { NULL, PQC_GQA_SOFTMAX_SUM, 0, 0, 1, -1, 0, 0, 0 };
    CHECK_CALL(batch_matches(&o));
    if (on_emulator()) /* the stand-in's timer reads 0: the first batch of the class timed the kernel */
        ASSERT_EQ(1ull, o.kernel_batches);
    PASS();
}

/* The lookup tables of the whole batch in one cuBLASLt matmul (PQC_LUT_GEMM=1): every
   batch of every layer and step builds them so, and the selections and rows are the CPU
   tier's (to the bit on the stand-in, whose matmul adds in the kernel's order; 97% of
   the selections on a GPU): per-head tables (softmax), summed ones (sum), RoPE-band
   sub-spaces. PQC_LUT_GEMM=0 leaves each sequence to its kernel. */
TEST batch_tables_in_one_matmul(void)
{
    batch_opts o = { "1", PQC_GQA_SOFTMAX_SUM, 0, 3, 2, -1, 0, 0, 0 };
    o.approx = !on_emulator();
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(8ull, o.gemm_batches); /* (3 steps + 1) x 2 layers */
    ASSERT_EQ(0ull, o.kernel_batches);
    o.gqa = PQC_GQA_SUM;
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(8ull, o.gemm_batches);
    o.bands = 1;
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(8ull, o.gemm_batches);
    o.gqa = PQC_GQA_SOFTMAX_SUM;
    o.lut_gemm = "0";
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(0ull, o.gemm_batches + o.kernel_batches);
    PASS();
}

/* Timing decides after four batches of a class (kernel, matmul, kernel, matmul), and a
   failing matmul leaves the kernel to each sequence, with the same results. */
TEST batch_tables_measured_and_falls_back(void)
{
    batch_opts o = { NULL, PQC_GQA_SOFTMAX_SUM, 0, 3, 2, -1, 0, 0, 0 };
    if (!on_emulator()) SKIPm("the stand-in's cuBLASLt: its timer reads 0, and it can fail a matmul");
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(2ull, o.gemm_batches); /* timed: batches 2 and 4; then the tie keeps the kernel */
    ASSERT_EQ(2ull, o.kernel_batches);
    o.lut_gemm = "1";
    o.lt_fail_at = 2; /* the third matmul: this class goes back to the kernel */
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(2ull, o.gemm_batches);
    o.lt_fail_at = 0;
    CHECK_CALL(batch_matches(&o));
    ASSERT_EQ(0ull, o.gemm_batches);
    PASS();
}

/* the compiled kernels are cached on disk (directories created as needed) and the next
   runtime loads them instead of compiling */
/* Damages every kernel image in dir (two bytes at offset 40 of each file); 0 when it
   holds none. */
static int damage_images(const char *dir)
{
    char cmd[600], file[400];
    FILE *f, *img;
    int n = 0;
    snprintf(cmd, sizeof cmd, "ls %s", dir);
    f = popen(cmd, "r");
    if (!f) return 0;
    while (fgets(file, sizeof file, f)) {
        file[strcspn(file, "\n")] = 0;
        snprintf(cmd, sizeof cmd, "%s/%s", dir, file);
        if (!(img = fopen(cmd, "r+b"))) continue;
        fseek(img, 40, SEEK_SET);
        fputc(0x5a, img);
        fputc(0xa5, img);
        fclose(img);
        n++;
    }
    pclose(f);
    return n;
}

/* A kernel cache of its own: a damaged image is dropped and compiled again, and the image
   compiled is loaded from then on. Where the other tests share a kernel cache
   (PQC_TEST_KERNEL_CACHE, filled by then), its images are copied in and damaged, so that
   NVRTC compiles once here; else a fresh cache compiles, loads, and is damaged. */
TEST kernel_cache_reused(void)
{
    pqc_runtime_desc d;
    pqc_runtime *rt = NULL;
    char dir[160], cmd[1000];
    const char *shared = getenv("PQC_TEST_KERNEL_CACHE");
    int copied = 0;
    snprintf(dir, sizeof dir, "build/kernel-cache-test-%ld/a/b", (long)getpid());
    memset(&d, 0, sizeof d);
    d.backend = PQC_BACKEND_CUDA;
    d.cuda_kernel_cache = dir;
    if (shared && strlen(shared) < 400) {
        snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s/*.cubin %s/ 2>/dev/null", dir, shared, dir);
        copied = system(cmd) == 0 && damage_images(dir) > 0;
    }
    if (!copied) { /* a fresh cache: compiled, then loaded */
        ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
        ASSERT(strstr(pqc_runtime_backend_note(rt), "compiled by NVRTC") != NULL);
        pqc_runtime_destroy(rt);
        ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
        ASSERT(strstr(pqc_runtime_backend_note(rt), "from the kernel cache") != NULL);
        pqc_runtime_destroy(rt);
        ASSERT(damage_images(dir) > 0);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt)); /* the damaged image is dropped */
    ASSERT_EQ(PQC_BACKEND_CUDA, pqc_runtime_backend(rt));
    ASSERT(strstr(pqc_runtime_backend_note(rt), "compiled by NVRTC") != NULL);
    pqc_runtime_destroy(rt);
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt)); /* and the new one kept */
    ASSERT(strstr(pqc_runtime_backend_note(rt), "from the kernel cache") != NULL);
    pqc_runtime_destroy(rt);
    snprintf(cmd, sizeof cmd, "rm -rf build/kernel-cache-test-%ld", (long)getpid());
    ASSERT_EQ(0, system(cmd));
    PASS();
}

SUITE(cuda_tier)
{
    RUN_TEST(misuse_gets_result_codes);
    RUN_TEST(kernel_cache_reused);
    RUN_TEST(decode_matches_cpu_sum_fp32);
    RUN_TEST(decode_matches_cpu_softmax_fp16);
    RUN_TEST(decode_matches_cpu_sum_bf16_resident);
    RUN_TEST(decode_matches_cpu_long_subvectors);
    RUN_TEST(decode_matches_cpu_with_metric);
    RUN_TEST(decode_matches_cpu_lowered_window);
    RUN_TEST(decode_matches_cpu_with_metric_softmax);
    RUN_TEST(device_steps_match_cpu);
    RUN_TEST(device_steps_match_cpu_with_metric);
    RUN_TEST(device_steps_mixed_with_host_steps);
    RUN_TEST(device_steps_match_cpu_softmax);
    RUN_TEST(device_steps_match_cpu_default_shape);
    RUN_TEST(device_steps_with_rerank);
    RUN_TEST(device_steps_at_a_models_softmax_scale);
    RUN_TEST(decode_steps_without_allocating_host_rows);
    RUN_TEST(decode_steps_without_allocating_device_rows);
    RUN_TEST(device_steps_without_allocating);
    RUN_TEST(device_rerank_matches_host_softmax_fp16);
    RUN_TEST(device_rerank_matches_host_sum_fork);
    RUN_TEST(device_rerank_matches_host_every_token);
    RUN_TEST(device_rerank_with_outlier_lists);
    RUN_TEST(device_outlier_lists_alone);
    RUN_TEST(decode_matches_cpu_rope_bands);
    RUN_TEST(decode_matches_cpu_rope_bands_with_metric);
    RUN_TEST(decode_matches_cpu_diagonal_metric);
    RUN_TEST(device_steps_match_cpu_diagonal_metric);
    RUN_TEST(decode_matches_cpu_rerank);
    RUN_TEST(fork_on_the_device_matches_cpu);
    RUN_TEST(decode_matches_cpu_outliers);
    RUN_TEST(decode_matches_cpu_rerank_outliers_resident);
    RUN_TEST(decode_matches_cpu_residual_scoring);
    RUN_TEST(decode_matches_cpu_window_competes);
    RUN_TEST(device_steps_window_competes_sum);
    RUN_TEST(device_steps_fixed_split_window_competes);
    RUN_TEST(cache_file_loads_onto_the_device);
    RUN_TEST(device_fetch_on_engine_stream);
    RUN_TEST(driver_hands_device_rows);
    RUN_TEST(device_steps_never_wait);
    RUN_TEST(device_steps_never_wait_default_configuration);
    RUN_TEST(device_steps_never_wait_with_rerank);
    RUN_TEST(device_steps_never_wait_window_competes);
    RUN_TEST(device_allocation_failure);
    RUN_TEST(device_kmeans);
    RUN_TEST(kmeans_gemm_matches_kernel);
    RUN_TEST(kmeans_gemm_concurrent_builds);
    RUN_TEST(kmeans_gemm_falls_back);
    RUN_TEST(batch_on_device_matches_cpu);
    RUN_TEST(batch_tables_in_one_matmul);
    RUN_TEST(batch_tables_measured_and_falls_back);
}

GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    /* held open for the whole run: the library's own dlclose then leaves the driver
       loaded, so leak checks see its allocations with their names */
    if (!open_driver()) fprintf(stderr, "no CUDA driver could be opened (set PQC_CUDA_DRIVER_PATH)\n");
    {
        static const char *const nvrtc[] = { "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so",
                                             "/usr/local/cuda/lib64/libnvrtc.so.13", "/usr/local/cuda/lib64/libnvrtc.so.12" };
        const char *env = getenv("PQC_NVRTC_PATH");
        size_t i, found = env && dlopen(env, RTLD_NOW | RTLD_LOCAL);
        for (i = 0; !found && i < sizeof nvrtc / sizeof nvrtc[0]; i++) found = dlopen(nvrtc[i], RTLD_NOW | RTLD_LOCAL) != NULL;
        if (!found) { /* the kernels cannot be built: nothing here can run */
            printf("SKIP cuda_tier: NVRTC not found (set PQC_NVRTC_PATH)\n0 passed, 0 failed, 11 skipped\n");
            return 0;
        }
    }
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(cuda_tier);
    GREATEST_MAIN_END();
}
