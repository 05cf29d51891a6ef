/* Sequence-cache tests: token store, selection, block cache, builds, scheduler, driver. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "greatest.h"
#include "synth.h"
#include "test_size.h"
#include "test_util.h"
#include "cache_checksum.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdio.h>

static uint64_t g_rng = 12345;


/* prefill every layer with the same random K/V */
static pqc_result prefill_all(pqc_cache *c, int layers, const float *k, const float *v, size_t n, size_t cols)
{
    int l;
    pqc_matrix km = pqc_matrix_f32(k, n, cols), vm = pqc_matrix_f32(v, n, cols);
    pqc_result r;
    for (l = 0; l < layers; l++)
        if ((r = pqc_cache_prefill(c, l, &km, &vm)) != PQC_SUCCESS) return r;
    return PQC_SUCCESS;
}


TEST sinks_and_window_always_selected(void)
{
    pqc_runtime *rt = tu_cpu_runtime(1);
    pqc_cache_desc cd = tu_cache_desc(2, 2, 4, 16);
    pqc_cache *c;
    pqc_selection sel;
    float *k = tu_normal_rows(&g_rng, 500, 32), *v = tu_normal_rows(&g_rng, 500, 32), q[64];
    int l, h, it, i;
    cd.n_sink = 4;
    cd.window = 8;
    cd.budget_tokens = 20;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 2, k, v, 500, 32));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    for (it = 0; it < 5; it++) {
        for (i = 0; i < 64; i++) q[i] = tu_normal(&g_rng);
        for (l = 0; l < 2; l++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, l, q, &sel));
            for (h = 0; h < 2; h++) {
                const uint32_t *ix = sel.idx + h * sel.capacity;
                uint32_t t;
                ASSERT_EQ((size_t)(4 + 12 + 8), sel.count[h]);
                ASSERT(tu_ascending_unique(ix, sel.count[h]));
                for (t = 0; t < 4; t++) ASSERT(tu_contains(ix, sel.count[h], t));
                for (t = 492 + (uint32_t)it; t < 500 + (uint32_t)it; t++) ASSERT(tu_contains(ix, sel.count[h], t));
            }
        }
        /* a decode step moves the window along */
        for (l = 0; l < 2; l++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, l, k, v));
    }
    ASSERT_EQ((size_t)505, pqc_cache_tokens(c, 1));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

/* pqc_cache_head_plan shows what a select ranks by: with the even split the head's
   top-k, sinks and window add up to its selection, and the coded tokens it selects are
   the top-k of the scores it returns; with the observed split the heads' takes add up
   to the layer's; with re-ranking at a fixed factor the candidates are ceil(1.5 x take),
   calibrated (the default) ceil(f x take) for a factor f in 1.5 .. 6 in steps of 0.1
   (rerank_factor_follows_how_well_the_codebook_ranks). A short score buffer, a head out of range or a NaN query are refused
   and change nothing. */
TEST head_plan_shows_the_scores_and_shares_a_select_uses(void)
{
    static const pqc_split splits[] = { PQC_SPLIT_FIXED, PQC_SPLIT_COMPETE };
    pqc_runtime *rt = tu_cpu_runtime(1);
    float *k = tu_normal_rows(&g_rng, 800, 32), *v = tu_normal_rows(&g_rng, 800, 32), q[64], qo[8 * 64];
    float *sc = (float *)malloc(2 * 800 * sizeof(float));
    int si, h, i;
    for (i = 0; i < 8 * 64; i++) qo[i] = tu_normal(&g_rng) * ((i % 32) < 16 ? 1.0f : 0.1f);
    for (si = 0; si < 4; si++) {
        pqc_cache_desc cd = tu_cache_desc(1, 2, 4, 16);
        pqc_cache *c;
        pqc_selection sel;
        pqc_head_plan pl[2];
        size_t total = 0;
        cd.n_sink = 4;
        cd.split = splits[si % 2];
        if (si >= 2) cd.rerank = 1.5;
        if (si == 2) cd.rerank_max = -1;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(c, 0, qo, 8));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, 800, 32));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        for (i = 0; i < 64; i++) q[i] = tu_normal(&g_rng);
        for (h = 0; h < 2; h++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_head_plan(c, 0, q, h, &pl[h], sc + h * 800, 800));
            ASSERT_EQ((size_t)800, pl[h].tokens);
            ASSERT_EQ((size_t)4, pl[h].sinks);
            ASSERT_EQ(pl[h].tokens - pl[h].sinks - pl[h].window, pl[h].coded); /* every mid token coded */
            ASSERT(pl[h].take > 0 && pl[h].take < pl[h].coded);
            total += pl[h].take;
            if (si < 3) {
                ASSERT_EQ(si == 2 ? (size_t)ceil(1.5 * (double)pl[h].take) : pl[h].take, pl[h].candidates);
            } else {
                int f, on_grid = 0;
                for (f = 15; f <= 60; f++) on_grid |= (size_t)ceil(f / 10.0 * (double)pl[h].take) == pl[h].candidates;
                ASSERT(on_grid);
            }
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        if (si == 0) {
            /* the head's coded tokens: the top-k of its scores (taken before the select:
               a select may start a rebuild, the queries having drifted from those
               observed, which the next call installs) */
            for (h = 0; h < 2; h++) {
                const uint32_t *ix = sel.idx + h * sel.capacity;
                const float *hs = sc + h * 800;
                size_t j, n = 0, above = 0;
                float worst = INFINITY;
                ASSERT_EQ(pl[h].sinks + pl[h].take + pl[h].window, sel.count[h]);
                for (j = 0; j < sel.count[h]; j++)
                    if (ix[j] >= 4 && ix[j] < 4 + pl[h].coded) {
                        n++;
                        if (hs[ix[j] - 4] < worst) worst = hs[ix[j] - 4];
                    }
                ASSERT_EQ(pl[h].take, n);
                for (j = 0; j < pl[h].coded; j++) above += hs[j] > worst;
                ASSERT(above < pl[h].take); /* nothing left out scores above what was taken */
            }
            ASSERT_EQ(pl[0].take, pl[1].take);
        } else {
            size_t even = (size_t)floor(0.1 * (800.0 - 4.0)) - pl[0].window; /* the budget less the window */
            ASSERT_IN_RANGE(2 * even, total, 2);                             /* shared, not grown */
        }
        { /* refusals change nothing */
            pqc_head_plan same = pl[0];
            uint64_t before = (uint64_t)c->layers[0].n_coded * 1000003u + c->layers[0].st.selects;
            ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_head_plan(c, 0, q, 0, &pl[0], sc, 10));
            ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_head_plan(c, 0, q, 2, &pl[0], sc, 800));
            q[3] = NAN;
            ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_cache_head_plan(c, 0, q, 0, &pl[0], sc, 800));
            ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_head_plan(NULL, 0, q, 0, &pl[0], sc, 800));
            ASSERT_MEM_EQ(&same, &pl[0], sizeof same);
            ASSERT_EQ(before, (uint64_t)c->layers[0].n_coded * 1000003u + c->layers[0].st.selects);
        }
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
    }
    pqc_runtime_destroy(rt);
    free(sc);
    free(k);
    free(v);
    PASS();
}

TEST needle_found_after_thousands_of_appends(void)
{
    pqc_runtime *rt = tu_cpu_runtime(1);
    pqc_cache_desc cd = tu_cache_desc(1, 1, 2, 32);
    pqc_cache *c;
    pqc_selection sel;
    size_t n = 3000, t;
    float *k = tu_normal_rows(&g_rng, n, 32), *v = tu_normal_rows(&g_rng, n, 32), dir[32], q[64], nk[32], nv[32];
    int e;
    double nrm = 0;
    for (e = 0; e < 32; e++) {
        dir[e] = tu_normal(&g_rng);
        nrm += dir[e] * dir[e];
    }
    for (e = 0; e < 32; e++) dir[e] = (float)(dir[e] / sqrt(nrm));
    for (e = 0; e < 32; e++) k[1500 * 32 + e] = 12.0f * dir[e]; /* the needle */
    cd.budget_ratio = 0.05;
    cd.rebuild_share = 0.9;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, n, 32));
    for (t = 0; t < 3000; t++) {
        for (e = 0; e < 32; e++) {
            nk[e] = tu_normal(&g_rng);
            nv[e] = tu_normal(&g_rng);
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, nk, nv));
    }
    for (e = 0; e < 32; e++) q[e] = q[32 + e] = 2.0f * dir[e];
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    ASSERT(tu_contains(sel.idx, sel.count[0], 1500));
    /* the budget was respected: 5% of the tokens beyond the sinks, plus the sinks */
    ASSERT_LTE(sel.count[0], (size_t)(32 + ceil(0.05 * (6000 - 32))));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

TEST full_budget_selects_everything_exactly(void)
{
    int dt;
    for (dt = 0; dt < 2; dt++) {
        pqc_runtime *rt = tu_cpu_runtime(2);
        pqc_cache_desc cd = tu_cache_desc(1, 2, 2, 16);
        pqc_cache *c;
        pqc_selection sel;
        pqc_kv_out out;
        size_t n = 700, t;
        float *k = tu_normal_rows(&g_rng, n, 32), *v = tu_normal_rows(&g_rng, n, 32), q[32];
        int h, e;
        const void *sk, *sv;
        cd.budget_ratio = 1.0;
        cd.kv_dtype = dt ? PQC_F16 : PQC_F32;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, n, 32));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, k, v));
        for (e = 0; e < 32; e++) q[e] = tu_normal(&g_rng);
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        out.head_stride = n + 1;
        out.k = (float *)malloc(2 * (n + 1) * 16 * sizeof(float));
        out.v = (float *)malloc(2 * (n + 1) * 16 * sizeof(float));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &out));
        for (h = 0; h < 2; h++) {
            ASSERT_EQ(n + 1, sel.count[h]);
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv(c, 0, h, &sk, &sv, NULL, NULL));
            for (t = 0; t <= n; t++) {
                const float *src = t < n ? k + t * 32 + h * 16 : k + h * 16;
                ASSERT_EQ((uint32_t)t, sel.idx[h * sel.capacity + t]);
                for (e = 0; e < 16; e++) {
                    float want = dt ? pqc_f16_to_f32(pqc_f32_to_f16(src[e])) : src[e];
                    ASSERT_EQ(want, out.k[(h * (n + 1) + t) * 16 + e]);
                }
            }
        }
        free(out.k);
        free(out.v);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
        pqc_runtime_destroy(rt);
        free(k);
        free(v);
    }
    PASS();
}

/* Rows wider than the store's 256-value conversion buffer (d_h 320) are stored as the
   element conversions make them, every value: fp32 rows into fp16 and bf16 stores, fp16
   rows into an fp32 store, prefill and append alike */
TEST wide_rows_stored_as_converted(void)
{
    static const pqc_dtype stores[] = {PQC_F16, PQC_BF16, PQC_F32};
    int si;
    for (si = 0; si < 3; si++) {
        pqc_runtime *rt = tu_cpu_runtime(1);
        pqc_cache_desc cd = tu_cache_desc(1, 1, 1, 320);
        pqc_cache *c;
        pqc_matrix km;
        size_t n = 40, t, e;
        float *k = tu_normal_rows(&g_rng, n + 1, 320);
        uint16_t *kh = (uint16_t *)malloc((n + 1) * 320 * sizeof(uint16_t));
        const void *sk, *sv;
        size_t tokens;
        pqc_dtype dt;
        int in16 = stores[si] == PQC_F32;
        cd.kv_dtype = stores[si];
        for (t = 0; t < (n + 1) * 320; t++) kh[t] = pqc_f32_to_f16(k[t]);
        km.data = in16 ? (const void *)kh : (const void *)k;
        km.dtype = in16 ? PQC_F16 : PQC_F32;
        km.rows = n;
        km.cols = 320;
        km.row_stride = 0;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &km));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, k + n * 320, k + n * 320)); /* fp32 rows at decode */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv(c, 0, 0, &sk, &sv, &tokens, &dt));
        ASSERT_EQ(n + 1, tokens);
        ASSERT_EQ(stores[si], dt);
        for (t = 0; t <= n; t++)
            for (e = 0; e < 320; e++) {
                size_t i = t * 320 + e;
                float x = t < n && in16 ? pqc_f16_to_f32(kh[i]) : k[i];
                if (dt == PQC_F32) {
                    ASSERT_EQ(0, memcmp(&x, (const float *)sk + i, sizeof x));
                } else {
                    uint16_t want = dt == PQC_F16 ? pqc_f32_to_f16(x) : pqc_f32_to_bf16(x);
                    ASSERT_EQ_FMT((unsigned)want, (unsigned)((const uint16_t *)sk)[i], "%u");
                }
            }
        pqc_cache_destroy(c);
        pqc_runtime_destroy(rt);
        free(k);
        free(kh);
    }
    PASS();
}

/* value r of a store of type dt, as fp32 (by the public conversions) */
static float stored_value(const void *s, pqc_dtype dt, size_t r)
{
    if (dt == PQC_F32) return ((const float *)s)[r];
    if (dt == PQC_F16) return pqc_f16_to_f32(((const uint16_t *)s)[r]);
    return pqc_bf16_to_f32(((const uint16_t *)s)[r]);
}

/* A fetch large enough to stream its rows (forced here by lowering the cache's threshold)
   writes what the regular stores write: every store type and width (whole 64-byte lines,
   half lines, neither), an output starting on a line and one a float off it (which the
   streaming levels leave to regular stores), one worker and several, every SIMD level this
   processor has. The values are the stored rows converted, and nothing past a head's
   selected rows is written. */
TEST fetch_streams_the_same_rows(void)
{
    static const pqc_dtype stores[] = {PQC_F16, PQC_BF16, PQC_F32};
    static const int dims[] = {128, 24, 20};
    static const pqc_simd levels[] = {PQC_SIMD_AUTO, PQC_SIMD_AVX2, PQC_SIMD_SCALAR};
    const size_t n = 2600, hs = n + 16; /* head_stride: each head's rows start on a line */
    float *k = tu_normal_rows(&g_rng, n, 2 * 128), *v = tu_normal_rows(&g_rng, n, 2 * 128);
    int si, di, li;
    for (li = 0; li < 3; li++)
        for (si = 0; si < 3; si++)
            for (di = 0; di < 3; di++) {
                pqc_runtime *rt = tu_cpu_runtime_simd(li == 0 ? 2 : -1, levels[li]);
                pqc_cache_desc cd;
                pqc_cache *c;
                pqc_selection sel;
                pqc_kv_out o[3];
                unsigned char *mem[3];
                int d = dims[di], h, w, e;
                size_t floats = 2 * 2 * hs * (size_t)d, i, t;
                float q[4 * 128];
                if (!rt) continue; /* a level this processor lacks */
                if (TU_TSAN && li > 0) { /* (no threads to race) */
                    pqc_runtime_destroy(rt);
                    continue;
                }
                cd = tu_cache_desc(1, 2, 4, d);
                cd.kv_dtype = stores[si];
                cd.budget_ratio = 0.9; /* over 4096 rows in all: the fetch's parallel copies */
                cd.pq.bits = 4; /* (the codebooks do not matter here) */
                cd.pq.iters = 1;
                for (e = 0; e < 4 * d; e++) q[e] = tu_normal(&g_rng);
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
                ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, n, 2 * (size_t)d));
                ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
                ASSERT(sel.count[0] + sel.count[1] > 4096);
                for (w = 0; w < 3; w++) { /* 0: streamed, on a line; 1: regular; 2: streamed, a float off */
                    float *b;
                    mem[w] = (unsigned char *)malloc(floats * sizeof(float) + 128);
                    ASSERT(mem[w] != NULL);
                    b = (float *)(void *)(mem[w] + (64 - (uintptr_t)mem[w] % 64)) + (w == 2);
                    for (i = 0; i < floats; i++) b[i] = -7.0f; /* what must stay */
                    o[w].k = b;
                    o[w].v = b + 2 * hs * (size_t)d;
                    o[w].head_stride = hs;
                    c->fetch_stream = w == 1 ? (size_t)-1 : 0;
                    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &o[w]));
                }
                for (h = 0; h < 2; h++) {
                    const void *sk, *sv;
                    pqc_dtype dt;
                    ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv(c, 0, h, &sk, &sv, NULL, &dt));
                    for (i = 0; i < hs; i++) {
                        float wk[128], wv[128];
                        size_t at = ((size_t)h * hs + i) * (size_t)d;
                        for (e = 0; e < d; e++) {
                            wk[e] = wv[e] = -7.0f;
                            if (i < sel.count[h]) { /* the stored row converted */
                                size_t r = (size_t)sel.idx[(size_t)h * sel.capacity + i] * (size_t)d + (size_t)e;
                                wk[e] = stored_value(sk, dt, r);
                                wv[e] = stored_value(sv, dt, r);
                            }
                        }
                        for (w = 0; w < 3; w++) {
                            ASSERT_MEM_EQ(wk, o[w].k + at, (size_t)d * sizeof(float));
                            ASSERT_MEM_EQ(wv, o[w].v + at, (size_t)d * sizeof(float));
                        }
                    }
                }
                for (t = 0; t < 3; t++) free(mem[t]);
                pqc_selection_free(&sel);
                pqc_cache_destroy(c);
                pqc_runtime_destroy(rt);
            }
    free(k);
    free(v);
    PASS();
}

/* Rows by pointer, in every storage dtype: the rows as stored, which converted are the
   rows pqc_cache_fetch gathers, through the same admissions and traffic. */
TEST fetch_rows_match_fetch(void)
{
    static const pqc_dtype dts[3] = { PQC_F32, PQC_F16, PQC_BF16 };
    pqc_runtime *rt = tu_cpu_runtime(1);
    pqc_cache_desc cd = tu_cache_desc(1, 2, 4, 16);
    pqc_cache *a, *b;
    pqc_selection sa, sb;
    pqc_kv_out out;
    pqc_layer_stats st_a, st_b;
    const void *const *const *kr;
    const void *const *const *vr;
    size_t n = 3000, i;
    float *k = tu_normal_rows(&g_rng, n, 32), *v = tu_normal_rows(&g_rng, n, 32), q[64];
    int h, step, e, di;
    cd.budget_ratio = 0.1;
    cd.cache_blocks = 4;
    out.head_stride = n + 8;
    out.k = (float *)malloc(2 * out.head_stride * 16 * sizeof(float));
    out.v = (float *)malloc(2 * out.head_stride * 16 * sizeof(float));
    for (di = 0; di < 3; di++) {
        size_t es = pqc_dtype_size(dts[di]);
        cd.kv_dtype = dts[di];
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &a));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &b));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(a, 1, k, v, n, 32));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(b, 1, k, v, n, 32));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(a, &sa));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(b, &sb));
        for (step = 0; step < 6; step++) {
            for (e = 0; e < 64; e++) q[e] = tu_normal(&g_rng);
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(a, 0, q, &sa));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(b, 0, q, &sb));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(a, 0, &sa, &out));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch_rows(b, 0, &sb, &kr, &vr));
            for (h = 0; h < 2; h++) {
                ASSERT_EQ(sa.count[h], sb.count[h]);
                for (i = 0; i < sb.count[h]; i++) {
                    const float *ka = out.k + (h * out.head_stride + i) * 16, *va = out.v + (h * out.head_stride + i) * 16;
                    const void *ks, *vs;
                    size_t got;
                    /* the rows as stored (in the store, or a block-cache slot's copy) */
                    ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv_part(b, 0, h, sb.idx[h * sb.capacity + i], &ks, &vs, &got));
                    ASSERT(got > 0);
                    ASSERT_MEM_EQ(ks, kr[h][i], 16 * es);
                    ASSERT_MEM_EQ(vs, vr[h][i], 16 * es);
                    for (e = 0; e < 16; e++) {
                        float x = stored_value(kr[h][i], dts[di], (size_t)e);
                        float y = stored_value(vr[h][i], dts[di], (size_t)e);
                        ASSERT_MEM_EQ(&ka[e], &x, sizeof x);
                        ASSERT_MEM_EQ(&va[e], &y, sizeof y);
                    }
                }
            }
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, 0, k + step * 32, v + step * 32));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(b, 0, k + step * 32, v + step * 32));
        }
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(a, 0, &st_a));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(b, 0, &st_b));
        ASSERT_EQ(st_a.hits, st_b.hits); /* the same admissions and the same traffic */
        ASSERT_EQ(st_a.misses, st_b.misses);
        ASSERT_EQ(st_a.bytes_h2d, st_b.bytes_h2d);
        ASSERT_GT(st_a.hits, (uint64_t)0); /* rows from block-cache slots too */
        pqc_selection_free(&sa);
        pqc_selection_free(&sb);
        pqc_cache_destroy(a);
        pqc_cache_destroy(b);
    }
    free(out.k);
    free(out.v);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

/* ----- block cache against a reference model ----- */

/* The documented policy, written out plainly: per-block scores decay by 3/4 a step and
   gain the step's selected tokens; candidates (blocks selected now, except those that
   overlap the sinks or the window, which every tier holds anyway) go in score order;
   a candidate takes a free slot, or evicts the victim (LRU: oldest use; LFU: lowest
   score, then oldest use; never a slot used or admitted this step) when its score beats
   1.5 x the victim's + 1. */
typedef struct ref_cache {
    int slots, admit, lru;
    int block[8];
    uint64_t stamp[8];
    float score[64];
} ref_cache;

static void ref_step(ref_cache *rc, const uint32_t *idx, size_t n, size_t bt, size_t mid_lo, size_t mid_hi, uint64_t step)
{
    int cnt[64] = {0}, a, s, b, nb = (int)((mid_hi + bt - 1) / bt);
    size_t i;
    for (b = 0; b < nb; b++) rc->score[b] *= 0.75f;
    for (i = 0; i < n; i++)
        if (idx[i] >= mid_lo && idx[i] < mid_hi && idx[i] / bt * bt >= mid_lo && (idx[i] / bt + 1) * bt <= mid_hi)
            cnt[idx[i] / bt]++;
    for (b = 0; b < nb; b++) rc->score[b] += (float)cnt[b];
    for (a = 0; a < rc->admit; a++) {
        int best = -1, cached = -1, victim = -1, empty = -1;
        for (b = 0; b < nb; b++)
            if (cnt[b] > 0 && (best < 0 || rc->score[b] > rc->score[best])) best = b;
        if (best < 0) break;
        cnt[best] = 0;
        for (s = 0; s < rc->slots; s++) {
            if (rc->block[s] == best) cached = s;
            if (rc->block[s] < 0 && empty < 0) empty = s;
        }
        if (cached >= 0) continue;
        if (empty >= 0) victim = empty;
        else
            for (s = 0; s < rc->slots; s++) {
                if (rc->stamp[s] == step) continue;
                if (victim < 0) victim = s;
                else if (rc->lru ? rc->stamp[s] < rc->stamp[victim]
                                 : (rc->score[rc->block[s]] < rc->score[rc->block[victim]] ||
                                    (rc->score[rc->block[s]] == rc->score[rc->block[victim]] &&
                                     rc->stamp[s] < rc->stamp[victim])))
                    victim = s;
            }
        if (victim < 0) break;
        if (rc->block[victim] >= 0 && !(rc->score[best] > 1.5f * rc->score[rc->block[victim]] + 1.0f)) continue;
        rc->block[victim] = best;
        rc->stamp[victim] = step;
    }
    for (s = 0; s < rc->slots; s++) { /* hits refresh the use stamp */
        for (i = 0; i < n; i++)
            if (rc->block[s] >= 0 && idx[i] >= mid_lo && idx[i] < mid_hi && (int)(idx[i] / bt) == rc->block[s])
                rc->stamp[s] = step;
    }
}

TEST eviction_orders_match_reference(void)
{
    int pol;
    for (pol = 0; pol < 2; pol++) {
        pqc_runtime *rt = tu_cpu_runtime(-1);
        pqc_cache_desc cd = tu_cache_desc(1, 1, 1, 8);
        pqc_cache *c;
        pqc_selection sel;
        pqc_kv_out out;
        ref_cache rc;
        size_t n = 128, bt = 8, mid_hi;
        float *k = tu_normal_rows(&g_rng, n, 8), *v = tu_normal_rows(&g_rng, n, 8);
        int step, s;
        uint64_t st = 99;
        cd.n_sink = -1;
        cd.window = 4; /* block 15 (tokens 120..127) overlaps the window: never a candidate */
        cd.block_tokens = (int)bt;
        cd.cache_blocks = 4;
        cd.admit_blocks = 4;
        cd.policy = (pqc_policy)pol;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, n, 8));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        out.head_stride = n;
        out.k = (float *)malloc(n * 8 * sizeof(float));
        out.v = (float *)malloc(n * 8 * sizeof(float));
        memset(&rc, 0, sizeof rc);
        rc.slots = 4;
        rc.admit = 4;
        rc.lru = pol;
        for (s = 0; s < 4; s++) rc.block[s] = -1;
        mid_hi = n - 4;
        for (step = 0; step < 60; step++) {
            /* a trace where blocks 2 and 9 stay hot, a warm block drifts slowly and the rest
               flicker: admissions, refusals and evictions all happen */
            size_t cnt = 0, t;
            int32_t got[8], want[8];
            int ng, nw = 0, i, j;
            for (t = 0; t < mid_hi; t++) {
                int b = (int)(t / bt), hot = b == 2 || b == 9 || b == 15, warm = b == (step / 4) % 16;
                uint64_t r = synth__next(&st) % 100;
                if ((hot && r < 55) || (warm && r < 45) || (!hot && !warm && r < 12)) sel.idx[cnt++] = (uint32_t)t;
            }
            sel.idx[cnt++] = (uint32_t)(n - 1);
            sel.count[0] = cnt;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &out));
            ref_step(&rc, sel.idx, cnt, bt, 0, mid_hi, (uint64_t)step + 1);
            ng = pqc_cache_cached_blocks(c, 0, 0, got, 8);
            for (s = 0; s < 4; s++)
                if (rc.block[s] >= 0) want[nw++] = rc.block[s];
            for (i = 1; i < nw; i++)
                for (j = i; j > 0 && want[j - 1] > want[j]; j--) {
                    int32_t tmp = want[j];
                    want[j] = want[j - 1];
                    want[j - 1] = tmp;
                }
            ASSERT_EQ(nw, ng);
            ASSERT_MEM_EQ(want, got, (size_t)nw * sizeof(int32_t));
            /* gathered rows are the stored rows, hit or miss */
            for (t = 0; t < cnt; t++) ASSERT_MEM_EQ(k + sel.idx[t] * 8, out.k + t * 8, 8 * sizeof(float));
        }
        {
            pqc_layer_stats stt;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &stt));
            ASSERT_GT(stt.hits, (uint64_t)0);
            ASSERT_GT(stt.misses, (uint64_t)0);
            ASSERT_EQ((uint64_t)60, stt.fetches);
        }
        free(out.k);
        free(out.v);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
        pqc_runtime_destroy(rt);
        free(k);
        free(v);
    }
    PASS();
}

/* ----- scheduler ----- */

/* ----- a backend of the engine's holds the slots ----- */

/* copies may come from several threads at once (one per KV head): counted under a lock */
typedef struct count_be {
    pthread_mutex_t mu;
    size_t live, copied;
    int fail;
} count_be;
static void *cb_alloc(void *ctx, size_t n)
{
    count_be *b = (count_be *)ctx;
    pthread_mutex_lock(&b->mu);
    b->live++;
    pthread_mutex_unlock(&b->mu);
    return malloc(n);
}
static void cb_free(void *ctx, void *p)
{
    count_be *b = (count_be *)ctx;
    pthread_mutex_lock(&b->mu);
    b->live--;
    pthread_mutex_unlock(&b->mu);
    free(p);
}
static int cb_copy(void *ctx, void *dst, const void *src, size_t n)
{
    count_be *b = (count_be *)ctx;
    int fail;
    pthread_mutex_lock(&b->mu);
    fail = b->fail;
    if (!fail) b->copied += n;
    pthread_mutex_unlock(&b->mu);
    if (fail) return -1;
    memcpy(dst, src, n);
    return 0;
}

TEST engine_backend_holds_the_slots_and_its_copies_are_the_traffic(void)
{
    pqc_runtime *rt = tu_cpu_runtime(2);
    pqc_cache_desc cd = tu_cache_desc(1, 2, 2, 16);
    pqc_backend be;
    count_be cnt;
    pqc_cache *c;
    pqc_selection sel;
    pqc_kv_out out;
    pqc_layer_stats st;
    size_t n = 3000, step, h, i;
    float *k = tu_normal_rows(&g_rng, n + 40, 32), *v = tu_normal_rows(&g_rng, n + 40, 32), q[32];
    int32_t blocks[64];
    memset(&cnt, 0, sizeof cnt);
    pthread_mutex_init(&cnt.mu, NULL);
    memset(&be, 0, sizeof be);
    be.iface.name = "counting";
    be.iface.alloc = cb_alloc;
    be.iface.free = cb_free;
    be.iface.copy_h2d = cb_copy;
    be.ctx = &cnt;
    cd.backend = &be;
    cd.block_tokens = 32;
    cd.cache_blocks = 8;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(2u, cnt.live); /* one slot pool per (layer, head) */
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, n, 32));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    out.head_stride = n + 40;
    out.k = (float *)malloc(2 * out.head_stride * 16 * sizeof(float));
    out.v = (float *)malloc(2 * out.head_stride * 16 * sizeof(float));
    for (i = 0; i < 32; i++) q[i] = tu_normal(&g_rng);
    /* a failing copy (the first fetch admits into empty slots): an error, no statistics,
       and no slot claims rows it does not hold */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    cnt.fail = 1;
    ASSERT_EQ(PQC_ERROR_BACKEND, pqc_cache_fetch(c, 0, &sel, &out));
    ASSERT(strstr(pqc_last_error(), "counting") != NULL);
    ASSERT_EQ(0, pqc_cache_cached_blocks(c, 0, 0, blocks, 64));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ((uint64_t)0, st.hits + st.misses + st.fetches);
    cnt.fail = 0;
    for (step = 0; step < 20; step++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, k + (n + step) * 32, v + (n + step) * 32));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &out));
        for (h = 0; h < 2; h++)
            for (i = 0; i < sel.count[h]; i++) {
                size_t t = sel.idx[h * sel.capacity + i];
                ASSERT_MEM_EQ(k + t * 32 + h * 16, out.k + (h * out.head_stride + i) * 16, 16 * sizeof(float));
            }
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_GT(cnt.copied, (size_t)0);
    ASSERT_GT(st.hits, (uint64_t)0);
    /* bytes host -> device = codes + missed rows + what the backend copied into slots */
    ASSERT_EQ((uint64_t)cnt.copied, st.bytes_h2d - st.bytes_codes - st.misses * 2 * 16 * 4);
    { /* the slots are the engine's memory: no row pointers into them */
        const void *const *const *kr;
        const void *const *const *vr;
        ASSERT_EQ(PQC_ERROR_UNSUPPORTED, pqc_cache_fetch_rows(c, 0, &sel, &kr, &vr));
    }
    free(out.k);
    free(out.v);
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    ASSERT_EQ(0u, cnt.live);
    pthread_mutex_destroy(&cnt.mu);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

TEST scheduler_recovers_coefficients_and_clips(void)
{
    pqc_scheduler *s;
    pqc_scheduler_desc sd;
    pqc_scheduler_fit f;
    const double a1 = 0.002, b1 = 3e-9, a2 = 0.001, b2 = 2e-7, g2 = 4e-12;
    double tok;
    int T, it;
    memset(&sd, 0, sizeof sd);
    ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(&sd, &s));
    ASSERT_EQ(10, pqc_scheduler_iters(s, 10000, 1)); /* no fit yet: the default */
    for (tok = 1000; tok <= 64000; tok *= 2)
        for (T = 2; T <= 12; T += 5) ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_add_kmeans(s, tok, T, a1 + b1 * tok * T));
    for (tok = 1000; tok <= 128000; tok *= 2) ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_add_compute(s, tok, a2 + b2 * tok + g2 * tok * tok));
    f = pqc_scheduler_get_fit(s);
    ASSERT_IN_RANGE(a1, f.a1, 1e-9);
    ASSERT_IN_RANGE(b1, f.b1, b1 * 1e-6);
    ASSERT_IN_RANGE(a2, f.a2, 1e-9);
    ASSERT_IN_RANGE(b2, f.b2, b2 * 1e-6);
    ASSERT_IN_RANGE(g2, f.g2, g2 * 1e-6);
    for (tok = 4000; tok <= 128000; tok *= 2) {
        double want = (g2 * tok * tok + b2 * tok + a2 - a1) / (b1 * tok);
        it = pqc_scheduler_iters(s, tok, 1);
        if (want < 3) ASSERT_EQ(3, it);
        else if (want > 300) ASSERT_EQ(300, it);
        else ASSERT_EQ((int)want, it);
    }
    ASSERT_EQ(3, pqc_scheduler_iters(s, 10, 1));        /* tiny prompt: clipped low */
    ASSERT_EQ(300, pqc_scheduler_iters(s, 5e7, 1));     /* huge prompt: clipped high */
    ASSERT_LT(pqc_scheduler_iters(s, 64000, 8), pqc_scheduler_iters(s, 64000, 1)); /* 8 heads share 1 worker */
    /* save, load into a fresh scheduler, same answers */
    {
        pqc_scheduler *s2;
        char path[512];
        FILE *fp;
        char buf[1024];
        size_t n;
        /* one file per process: the builds of this test may run side by side */
        tu_tmp_path(path, sizeof path, "sched.txt");
        ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_save(s, path));
        ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(&sd, &s2));
        ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_load(s2, path));
        ASSERT_EQ(pqc_scheduler_iters(s, 32000, 1), pqc_scheduler_iters(s2, 32000, 1));
        fp = fopen(path, "r");
        n = fread(buf, 1, sizeof buf, fp);
        fclose(fp);
        /* corrupted: one digit changed */
        {
            char *p = strstr(buf, "kmeans ") + 7;
            *p = *p == '1' ? '2' : '1';
            fp = fopen(path, "w");
            fwrite(buf, 1, n, fp);
            fclose(fp);
            pqc_scheduler_destroy(s2);
            ASSERT_EQ(PQC_SUCCESS, pqc_scheduler_create(&sd, &s2));
            ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_scheduler_load(s2, path));
            ASSERT_EQ(10, pqc_scheduler_iters(s2, 32000, 1)); /* defaults kept */
            *p = *p == '1' ? '2' : '1';
        }
        /* truncated */
        fp = fopen(path, "w");
        fwrite(buf, 1, n / 2, fp);
        fclose(fp);
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_scheduler_load(s2, path));
        /* foreign */
        fp = fopen(path, "w");
        fputs("P6\n3 3\n255\n", fp);
        fclose(fp);
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_scheduler_load(s2, path));
        ASSERT_EQ(PQC_ERROR_IO, pqc_scheduler_load(s2, "build/does/not/exist"));
        ASSERT_EQ(10, pqc_scheduler_iters(s2, 32000, 1));
        remove(path);
        pqc_scheduler_destroy(s2);
    }
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_add_kmeans(s, -1, 3, 0.1));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_scheduler_add_compute(s, 100, NAN));
    pqc_scheduler_destroy(s);
    PASS();
}

/* ----- asynchronous builds ----- */

TEST async_builds_and_destroy_during_build(void)
{
    pqc_runtime *rt = tu_cpu_runtime(2);
    pqc_cache_desc cd = tu_cache_desc(4, 2, 4, 64);
    pqc_cache *c;
    size_t n = TEST_SIZE(6000, 2000); /* 256 centroids a sub-space: builds that outlast the destroy */
    float *k = tu_normal_rows(&g_rng, n, 128), *v = tu_normal_rows(&g_rng, n, 128), q[256];
    pqc_selection sel;
    pqc_layer_stats st;
    int l, i;
    cd.pq.bits = 8;
    cd.pq.iters = 6;
    /* destroy while the four layers' builds are queued or running */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 4, k, v, n, 128));
    pqc_cache_destroy(c);
    /* and the normal path: the first select of each layer waits for that layer's build */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 4, k, v, n, 128));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    for (i = 0; i < 256; i++) q[i] = tu_normal(&g_rng);
    for (l = 0; l < 4; l++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, l, q, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, l, &st));
        ASSERT_EQ((uint64_t)1, st.builds);
        ASSERT_EQ(6, st.last_iters);
        ASSERT_GT(st.build_s, 0.0);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

TEST growth_waits_for_other_layers_builds(void)
{
    /* a store that grows (here: the first decode step) must not move under the builds
       of other layers that are still running (ASan reports a use after free otherwise) */
    pqc_runtime *rt = tu_cpu_runtime(2);
    pqc_cache_desc cd = tu_cache_desc(3, 1, 1, 64);
    pqc_cache *c;
    size_t n = 1944;
    float *k = tu_normal_rows(&g_rng, n, 64), row[64];
    int l, e, step;
    cd.pq.iters = 200;
    cd.pq.bits = 8;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 3, k, k, n, 64));
    for (step = 0; step < 700; step++) { /* past the store's headroom: it grows at least once */
        for (e = 0; e < 64; e++) row[e] = tu_normal(&g_rng);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, row, row));
    }
    for (l = 1; l < 3; l++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, l, row, row));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(n + 700, pqc_cache_tokens(c, 0));
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    PASS();
}

/* engine pool that defers jobs until the test runs them */
typedef struct deferred {
    void (*fn[64])(void *);
    void *arg[64];
    int n;
} deferred;
static int defer_submit(void *user, void (*fn)(void *), void *arg)
{
    deferred *d = (deferred *)user;
    if (d->n >= 64) return 1;
    d->fn[d->n] = fn;
    d->arg[d->n++] = arg;
    return 0;
}
static int g_fail_big;
static void *big_fail_alloc(size_t n, void *u)
{
    (void)u;
    if (g_fail_big && n > 20000) return NULL;
    return malloc(n);
}

TEST job_error_surfaces_at_next_call(void)
{
    pqc_runtime_desc rd;
    pqc_runtime *rt;
    pqc_cache_desc cd = tu_cache_desc(1, 2, 2, 32);
    pqc_cache *c;
    deferred df;
    pqc_selection sel;
    size_t n = 3000;
    float *k = tu_normal_rows(&g_rng, n, 64), *v = tu_normal_rows(&g_rng, n, 64), q[64];
    int i;
    memset(&df, 0, sizeof df);
    memset(&rd, 0, sizeof rd);
    rd.submit = defer_submit;
    rd.submit_user = &df;
    rd.allocator.alloc = big_fail_alloc;
    rd.allocator.free = tu_free;
#ifdef PQCACHE_NO_THREADS
    ASSERT_EQ(PQC_ERROR_UNSUPPORTED, pqc_runtime_create(&rd, &rt));
    free(k);
    free(v);
    PASS();
#endif
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&rd, &rt));
    cd.pq.bits = 8;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, n, 64));
    ASSERT_EQ(2, df.n); /* one build job per KV head, not run yet */
    g_fail_big = 1;
    for (i = 0; i < df.n; i++) df.fn[i](df.arg[i]);
    g_fail_big = 0;
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    for (i = 0; i < 64; i++) q[i] = tu_normal(&g_rng);
    ASSERT_EQ(PQC_ERROR_JOB_FAILED, pqc_cache_select(c, 0, q, &sel));
    ASSERT(strstr(pqc_last_error(), "PQ build failed") != NULL);
    /* nothing lost: the next call works and attends every token it could not code */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    ASSERT_EQ(n, sel.count[0]);
    ASSERT_EQ(n, pqc_cache_tokens(c, 0));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

TEST multi_turn_codes_then_rebuilds(void)
{
    pqc_runtime *rt = tu_cpu_runtime(1);
    pqc_cache_desc cd = tu_cache_desc(1, 1, 1, 32);
    pqc_cache *c;
    pqc_selection sel;
    pqc_layer_stats st;
    float *k = tu_normal_rows(&g_rng, 4000, 32), *v = tu_normal_rows(&g_rng, 4000, 32), q[32];
    pqc_matrix km, vm;
    int e;
    cd.rebuild_share = 0.3;
    cd.budget_ratio = 0.05;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    km = pqc_matrix_f32(k, 2000, 32);
    vm = pqc_matrix_f32(v, 2000, 32);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ((uint64_t)1, st.builds);
    ASSERT_EQ((uint64_t)0, st.rebuilds);
    /* the next turn: a needle in the new chunk; coded with the old codebook, then rebuilt */
    for (e = 0; e < 32; e++) k[3000 * 32 + e] = (e % 2 ? 9.0f : -9.0f);
    km = pqc_matrix_f32(k + 2000 * 32, 2000, 32);
    vm = pqc_matrix_f32(v + 2000 * 32, 2000, 32);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ((uint64_t)1, st.rebuilds);
    for (e = 0; e < 32; e++) q[e] = (e % 2 ? 1.0f : -1.0f);
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    ASSERT(tu_contains(sel.idx, sel.count[0], 3000));
    ASSERT_EQ((size_t)4000, pqc_cache_tokens(c, 0));
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

TEST batch_matches_individual(void)
{
    pqc_runtime *rt = tu_cpu_runtime(2);
    pqc_cache_desc cd = tu_cache_desc(1, 2, 4, 16);
    pqc_cache *c[3];
    pqc_selection s1[3], s2[3], *sp[3];
    pqc_kv_out o1[3], o2[3];
    const pqc_kv_out *op[3];
    const pqc_selection *cs[3];
    float *q[3];
    const float *cq[3];
    int i, h;
    cd.budget_ratio = 0.2;
    for (i = 0; i < 3; i++) {
        size_t n = 1500 + 300 * (size_t)i;
        float *k = tu_normal_rows(&g_rng, n, 32), *v = tu_normal_rows(&g_rng, n, 32);
        int e;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c[i]));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(c[i], 1, k, v, n, 32));
        free(k);
        free(v);
        q[i] = (float *)malloc(64 * sizeof(float));
        for (e = 0; e < 64; e++) q[i][e] = tu_normal(&g_rng);
        cq[i] = q[i];
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c[i], &s1[i]));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c[i], &s2[i]));
        sp[i] = &s2[i];
        cs[i] = &s2[i];
        o1[i].head_stride = o2[i].head_stride = n;
        o1[i].k = (float *)malloc(2 * n * 16 * sizeof(float));
        o1[i].v = (float *)malloc(2 * n * 16 * sizeof(float));
        o2[i].k = (float *)malloc(2 * n * 16 * sizeof(float));
        o2[i].v = (float *)malloc(2 * n * 16 * sizeof(float));
        op[i] = &o2[i];
    }
    for (i = 0; i < 3; i++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c[i], 0, q[i], &s1[i]));
    ASSERT_EQ(PQC_SUCCESS, pqc_batch_select(c, 3, 0, cq, sp));
    for (i = 0; i < 3; i++)
        for (h = 0; h < 2; h++) {
            ASSERT_EQ(s1[i].count[h], s2[i].count[h]);
            ASSERT_MEM_EQ(s1[i].idx + h * s1[i].capacity, s2[i].idx + h * s2[i].capacity, s1[i].count[h] * 4);
        }
    for (i = 0; i < 3; i++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c[i], 0, &s1[i], &o1[i]));
    /* the block cache state changed after the first fetch; compare gathered rows only */
    ASSERT_EQ(PQC_SUCCESS, pqc_batch_fetch(c, 3, 0, cs, op));
    for (i = 0; i < 3; i++)
        for (h = 0; h < 2; h++)
            ASSERT_MEM_EQ(o1[i].k + h * o1[i].head_stride * 16, o2[i].k + h * o2[i].head_stride * 16,
                          s1[i].count[h] * 16 * sizeof(float));
    for (i = 0; i < 3; i++) {
        pqc_selection_free(&s1[i]);
        pqc_selection_free(&s2[i]);
        free(o1[i].k);
        free(o1[i].v);
        free(o2[i].k);
        free(o2[i].v);
        free(q[i]);
        pqc_cache_destroy(c[i]);
    }
    pqc_runtime_destroy(rt);
    PASS();
}

/* ----- bad input ----- */

TEST bad_inputs_leave_cache_intact(void)
{
    pqc_runtime *rt = tu_cpu_runtime(1);
    pqc_cache_desc cd = tu_cache_desc(2, 2, 4, 16);
    pqc_cache *c;
    pqc_selection sel;
    float *k = tu_normal_rows(&g_rng, 300, 32), *v = tu_normal_rows(&g_rng, 300, 32), q[64], row[32];
    pqc_matrix km = pqc_matrix_f32(k, 300, 32), vm = pqc_matrix_f32(v, 300, 32);
    int i;
    cd.max_tokens = 400;
    for (i = 0; i < 64; i++) q[i] = tu_normal(&g_rng);
    {
        pqc_cache_desc bad = cd;
        bad.pq.m = 3;
        ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_create(rt, &bad, &c));
        bad = cd;
        bad.pq.bits = 12;
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(rt, &bad, &c));
        bad = cd;
        bad.n_q_heads = 5;
        ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_create(rt, &bad, &c));
        ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_create(rt, NULL, &c));
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_append(c, 0, k, v)); /* append before prefill */
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_select(c, 0, q, &sel));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_prefill(c, 2, &km, &vm));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_prefill(c, -1, &km, &vm));
    km.cols = 16;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_prefill(c, 0, &km, &vm));
    km.cols = 32;
    vm.rows = 299;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_prefill(c, 0, &km, &vm));
    vm.rows = 300;
    k[77] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_cache_prefill(c, 0, &km, &vm));
    k[77] = 0.5f;
    ASSERT_EQ((size_t)0, pqc_cache_tokens(c, 0)); /* nothing stored by the failures */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &vm));
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_prefill(c, 0, &km, &vm)); /* 600 > 400 */
    ASSERT_EQ((size_t)300, pqc_cache_tokens(c, 0));
    q[5] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_cache_select(c, 0, q, &sel));
    q[5] = 1.0f;
    memcpy(row, k, sizeof row);
    row[3] = INFINITY;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_cache_append(c, 0, row, v));
    ASSERT_EQ((size_t)300, pqc_cache_tokens(c, 0));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_append(c, 0, NULL, v));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    {
        pqc_kv_out out;
        out.head_stride = 10; /* too small for the selection */
        out.k = (float *)malloc(2 * 400 * 16 * sizeof(float));
        out.v = (float *)malloc(2 * 400 * 16 * sizeof(float));
        ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_fetch(c, 0, &sel, &out));
        out.head_stride = 400;
        sel.idx[1] = sel.idx[0]; /* unsorted / duplicate */
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_fetch(c, 0, &sel, &out));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(c, 0, &sel, &out));
        free(out.k);
        free(out.v);
    }
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    PASS();
}

/* ----- driver ----- */

typedef struct toy {
    int layers, d, fail_at;
    size_t last_count;
    int checked;
    double acc;
    pqc_dtype st;   /* the cache's storage */
    int by_pointer; /* decode views whose rows came by pointer */
    int want_dtype; /* -1: any; else the dtype pointer rows must come in */
} toy;

static float toy_val(int layer, size_t pos, int i, int which)
{
    uint64_t s = (uint64_t)layer * 1000003u + pos * 7919u + (uint64_t)i * 31u + (uint64_t)which;
    return (float)((double)(synth__next(&s) % 2001) / 1000.0 - 1.0);
}

static int toy_qkv(void *u, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    toy *t = (toy *)u;
    size_t i;
    int e;
    for (i = 0; i < n; i++)
        for (e = 0; e < t->d; e++) {
            q[i * 2 * t->d + e] = toy_val(layer, pos0 + i, e, 0);
            q[i * 2 * t->d + t->d + e] = toy_val(layer, pos0 + i, e, 1);
            k[i * t->d + e] = toy_val(layer, pos0 + i, e, 2);
            v[i * t->d + e] = toy_val(layer, pos0 + i, e, 3);
        }
    return 0;
}

/* a value as the cache's storage keeps it */
static float toy_stored(const toy *t, float x)
{
    return t->st == PQC_F16 ? pqc_f16_to_f32(pqc_f32_to_f16(x)) : t->st == PQC_BF16 ? pqc_bf16_to_f32(pqc_f32_to_bf16(x)) : x;
}

static int toy_attend(void *u, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv)
{
    toy *t = (toy *)u;
    size_t i, es = pqc_dtype_size(kv->dtype);
    int e;
    (void)q;
    if (layer == t->fail_at) return 1;
    t->last_count = kv->count[0];
    if (kv->krows) { /* by pointer: in the dtype the engine said it reads */
        t->by_pointer++;
        if (t->want_dtype >= 0 && kv->dtype != (pqc_dtype)t->want_dtype) return 4;
    } else if (kv->pos && kv->dtype != PQC_F32) { /* gathered decode rows: fp32 */
        return 4;
    }
    /* every handed row equals what qkv produced for its position, as stored (rows
       gathered, or by pointer when the engine accepts that) */
    for (i = 0; i < kv->count[0]; i++) {
        size_t p = kv->pos ? kv->pos[0][i] : i;
        const void *row = kv->krows ? kv->krows[0][i] : (const char *)kv->k[0] + i * t->d * es;
        const void *vrow = kv->vrows ? kv->vrows[0][i] : (const char *)kv->v[0] + i * t->d * es;
        if (p >= pos0 + n) return 2;
        for (e = 0; e < t->d; e++)
            if (stored_value(row, kv->dtype, (size_t)e) != toy_stored(t, toy_val(layer, p, e, 2)) ||
                stored_value(vrow, kv->dtype, (size_t)e) != toy_stored(t, toy_val(layer, p, e, 3)))
                return 3;
        t->checked++;
    }
    return 0;
}

/* The toy engine over 2 layers of 8 dimensions (one KV head, two query heads), its
   rows stored as st; the engine's other fields 0 (defaults, as for every desc). */
static void toy_engine(toy *t, pqc_engine *e, pqc_dtype st)
{
    memset(t, 0, sizeof *t);
    memset(e, 0, sizeof *e);
    t->layers = 2;
    t->d = 8;
    t->fail_at = -1;
    t->st = st;
    t->want_dtype = -1;
    e->user = t;
    e->qkv = toy_qkv;
    e->attend = toy_attend;
}

/* The driver over a toy engine, with fp32, fp16 and bf16 storage: decode rows gathered
   (fp32), or by pointer where the engine accepts them (accepts_row_pointers 1: fp32
   storage only; 2: as stored, the view's dtype the storage's). */
static enum greatest_test_res driver_runs_both_algorithms_in(pqc_dtype st)
{
    pqc_runtime *rt = tu_cpu_runtime(1);
    pqc_cache_desc cd = tu_cache_desc(2, 1, 2, 8);
    pqc_cache *c;
    pqc_engine e;
    toy t;
    size_t pos;
    int ptr_expected = 0;
    toy_engine(&t, &e, st);
    cd.budget_ratio = 1.0;
    cd.kv_dtype = st;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_driver_decode(c, &e, 0));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, 400));
    ASSERT_EQ((size_t)400, t.last_count);
    for (pos = 400; pos < 424; pos++) {
        /* the ways of handing the rows over: gathered, fp32 pointers, stored pointers */
        e.accepts_row_pointers = pos % 4 == 1 ? 1 : pos % 4 == 2 ? 2 : 0;
        t.want_dtype = e.accepts_row_pointers == 2 ? (int)st : (int)PQC_F32;
        /* the gather streamed (the V rows start on a line where pos + 1 is even) */
        c->fetch_stream = pos % 4 == 3 ? 0 : PQC__FETCH_STREAM_BYTES;
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos));
        ASSERT_EQ(pos + 1, t.last_count); /* budget 1: every token */
        /* by pointer on every layer where the engine reads the storage's dtype */
        if (e.accepts_row_pointers == 2 || (e.accepts_row_pointers == 1 && st == PQC_F32)) ptr_expected += 2;
        ASSERT_EQ(ptr_expected, t.by_pointer);
    }
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_driver_decode(c, &e, 999));
    t.fail_at = 1;
    ASSERT_EQ(PQC_ERROR_CALLBACK, pqc_driver_decode(c, &e, 424));
    ASSERT_GT(t.checked, 5000);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    PASS();
}
/* The driver's decode steps allocate nothing once its buffers have grown (its view's
   pointers on the stack, its undo record the cache's), rows gathered or by pointer.
   Inline runtime: every allocation counted is the step's. */
TEST driver_decode_steps_without_allocating(void)
{
    tu_failing fa;
    pqc_runtime *rt;
    pqc_cache_desc cd = tu_cache_desc(2, 1, 2, 8);
    pqc_cache *c;
    pqc_engine e;
    toy t;
    size_t pos;
    long grown = 0;
    ASSERT((rt = tu_counting_runtime(&fa, 0)) != NULL);
    toy_engine(&t, &e, PQC_F16);
    cd.kv_dtype = PQC_F16;
    cd.budget_ratio = 0.2; /* a search each step */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, 400));
    for (pos = 400; pos < 480; pos++) {
        long before = fa.calls;
        e.accepts_row_pointers = pos % 2 ? 2 : 0;
        ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, pos));
        if (pos >= 440) grown += fa.calls - before;
    }
    ASSERT(t.by_pointer > 0);
    ASSERT_EQ(0L, grown);
    pqc_cache_destroy(c);
    pqc_runtime_destroy(rt);
    ASSERT_EQ(0L, tu_failing_live(&fa));
    PASS();
}
TEST driver_runs_both_algorithms(void) { return driver_runs_both_algorithms_in(PQC_F32); }
TEST driver_runs_both_algorithms_fp16_rows(void) { return driver_runs_both_algorithms_in(PQC_F16); }
TEST driver_runs_both_algorithms_bf16_rows(void) { return driver_runs_both_algorithms_in(PQC_BF16); }

/* A saved cache loads back and decodes exactly as the original: every later selection and
   gather of both caches is equal (every other step the loaded cache's rows by pointer,
   as stored, in its mapped file too). With the default settings (fp16 storage), and with
   re-ranking, exact lists and residual-aware scoring on fp32 storage. */
/* whether two selections of hkv heads hold the same tokens */
static int same_selection(const pqc_selection *a, const pqc_selection *b, int hkv)
{
    int h;
    for (h = 0; h < hkv; h++)
        if (a->count[h] != b->count[h] ||
            memcmp(a->idx + (size_t)h * a->capacity, b->idx + (size_t)h * b->capacity, a->count[h] * 4) != 0)
            return 0;
    return 1;
}

/* The factor recomputed from outside: for each kept observed row (the last 4), the head's
   exact top-take coded tokens by the attention its query heads pay them (softmax over the
   coded tokens, summed), their ranks in the head's PQ scores (pqc_cache_head_plan with
   that row as the query), and the smallest factor of 1.5, 1.6, .. 6 whose PQ top
   ceil(f x take) holds 0.998 of that attention on average over the rows. */
static double rerank_factor_of(pqc_cache *c, const float *k, const float *obs, int h, size_t take, size_t coded)
{
    const int hkv = 2, hq = 4, g = 2, d = 32;
    double acc[46] = {0}, f = 6.0;
    float *ps = (float *)malloc(coded * sizeof(float));
    double *w = (double *)malloc(2 * coded * sizeof(double)), *dot = w + coded;
    size_t *above = (size_t *)malloc(coded * sizeof(size_t)), t, u, i;
    char *top = (char *)malloc(coded);
    int r, j, e, fi;
    for (r = 4; r < 8; r++) {
        const float *q = obs + (size_t)r * hq * d + (size_t)h * g * d;
        pqc_head_plan pl;
        double tm = 0.0;
        if (pqc_cache_head_plan(c, 0, obs + (size_t)r * hq * d, h, &pl, ps, coded) != PQC_SUCCESS || pl.coded != coded)
            return -1.0;
        for (t = 0; t < coded; t++) {
            w[t] = 0.0;
            above[t] = 0;
            top[t] = 0;
        }
        for (j = 0; j < g; j++) { /* query head j's softmax over the coded tokens */
            double mx = -INFINITY, z = 0.0;
            for (t = 0; t < coded; t++) {
                dot[t] = 0.0;
                for (e = 0; e < d; e++) dot[t] += (double)q[j * d + e] * (double)k[(4 + t) * (size_t)hkv * d + (size_t)h * d + e];
                mx = dot[t] > mx ? dot[t] : mx;
            }
            for (t = 0; t < coded; t++) z += exp((dot[t] - mx) / sqrt((double)d));
            for (t = 0; t < coded; t++) w[t] += exp((dot[t] - mx) / sqrt((double)d)) / z;
        }
        for (i = 0; i < take; i++) { /* the exact top-take, one at a time */
            size_t best = coded;
            for (t = 0; t < coded; t++)
                if (!top[t] && (best == coded || w[t] > w[best])) best = t;
            top[best] = 1;
            tm += w[best];
        }
        for (t = 0; t < coded; t++)
            if (top[t])
                for (u = 0; u < coded; u++) above[t] += ps[u] > ps[t];
        for (fi = 0; fi < 46; fi++) {
            double kept = 0.0, cand = ceil((1.5 + fi * 0.1) * (double)take);
            for (t = 0; t < coded; t++)
                if (top[t] && (double)above[t] < cand) kept += w[t];
            acc[fi] += kept / tm / 4.0;
        }
    }
    for (fi = 0; fi < 46; fi++)
        if (acc[fi] >= 0.998) {
            f = 1.5 + fi * 0.1;
            break;
        }
    free(ps);
    free(w);
    free(above);
    free(top);
    return f;
}

/* the factor behind a head's candidates: the f of 1.5, 1.6, .. with ceil(f x take) of
   them (the first, the steps being coarser than a token), or -1 */
static double factor_of(const pqc_head_plan *pl)
{
    int f;
    for (f = 15; f <= 60; f++)
        if ((size_t)ceil(f / 10.0 * (double)pl->take) == pl->candidates) return f / 10.0;
    return -1.0;
}

/* Re-ranking per head: a build with observed queries gives each head the smallest factor
   (steps of 0.1 from rerank up to rerank_max) whose PQ candidates hold 0.998 of the exact
   top-k's attention on those queries, as recomputed here from the head's own PQ scores;
   a head whose keys its codebook holds exactly keeps rerank, one of spread keys gets
   more; rerank_max caps it and negative turns it off; a saved and loaded cache and a
   fork keep the factors and select alike. */
TEST rerank_factor_follows_how_well_the_codebook_ranks(void)
{
    const int hkv = 2, hq = 4, d = 32, n = 2000;
    float *k = tu_normal_rows(&g_rng, (size_t)n, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, (size_t)n, (size_t)hkv * d);
    float *obs = tu_normal_rows(&g_rng, 8, (size_t)hq * d), *few = tu_normal_rows(&g_rng, 6, (size_t)d);
    float *sc = (float *)malloc((size_t)n * sizeof(float));
    char path[512];
    int mode, h, t;
    tu_tmp_path(path, sizeof path, "rerank_factor");
    for (t = 0; t < n; t++) /* head 1: six keys, which its 64 centroids per sub-space hold exactly */
        memcpy(k + (size_t)t * hkv * d + d, few + (size_t)(t % 6) * d, (size_t)d * sizeof(float));
    for (mode = 0; mode < 3; mode++) {
        pqc_cache_desc cd = tu_cache_desc(1, hkv, hq, d);
        pqc_cache *c, *b, *f;
        pqc_head_plan pl[2], pb;
        cd.n_sink = 4;
        cd.pq.m = 8;                /* 6 bytes of codes: a ranking that needs some checking */
        cd.pq.bits = 6;
        cd.split = PQC_SPLIT_FIXED; /* each head's take: the budget less the window */
        cd.rerank = 0;              /* the default, 1.5 */
        cd.rerank_max = mode == 0 ? 0 : mode == 1 ? 2.0 : -1;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(c, 0, obs, 8));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(c, 1, k, v, (size_t)n, (size_t)hkv * d));
        for (h = 0; h < hkv; h++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_head_plan(c, 0, obs, h, &pl[h], sc, (size_t)n));
            ASSERT(pl[h].take > 0 && pl[h].take < pl[h].coded);
        }
        ASSERT_EQ(1.5, factor_of(&pl[1])); /* held exactly: ranked right */
        if (mode == 0) {
            double want = rerank_factor_of(c, k, obs, 0, pl[0].take, pl[0].coded);
            pqc_selection sa, sb;
            ASSERT(want > 2.5 && want < 6.0); /* spread keys: the ranking needs checking, within the cap */
            ASSERT_IN_RANGE(want, factor_of(&pl[0]), 0.101);
            ASSERT_EQ(1.5, rerank_factor_of(c, k, obs, 1, pl[1].take, pl[1].coded));
            /* saved and loaded, and forked: the same candidates and selections */
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, path));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &b));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(c, &f));
            ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sa));
            ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sb));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, obs + 4 * hq * d, &sa));
            for (t = 0; t < 2; t++) {
                pqc_cache *o = t ? f : b;
                for (h = 0; h < hkv; h++) {
                    ASSERT_EQ(PQC_SUCCESS, pqc_cache_head_plan(o, 0, obs, h, &pb, sc, (size_t)n));
                    ASSERT_EQ(pl[h].candidates, pb.candidates);
                }
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(o, 0, obs + 4 * hq * d, &sb));
                ASSERT(same_selection(&sa, &sb, hkv));
            }
            pqc_selection_free(&sa);
            pqc_selection_free(&sb);
            pqc_cache_destroy(f);
            pqc_cache_destroy(b);
            remove(path);
        } else if (mode == 1) {
            ASSERT(factor_of(&pl[0]) > 1.5 && factor_of(&pl[0]) <= 2.0); /* capped */
        } else {
            ASSERT_EQ(1.5, factor_of(&pl[0])); /* none: every head rerank */
        }
        pqc_cache_destroy(c);
    }
    free(k);
    free(v);
    free(obs);
    free(few);
    free(sc);
    PASS();
}

static enum greatest_test_res save_load_resumes(int rich)
{
    const int L = 2, hkv = 2, hq = 4, d = 32;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *a, *b;
    pqc_selection sa, sb;
    pqc_kv_out oa, ob;
    float *k = tu_normal_rows(&g_rng, 900, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, 900, (size_t)hkv * d), *q = tu_normal_rows(&g_rng, 64, (size_t)hq * d);
    float *obs = tu_normal_rows(&g_rng, 8, (size_t)hq * d), *bufa, *bufb;
    char path[512];
    int l, s;
    size_t t, rows = 0;
    tu_tmp_path(path, sizeof path, "cache_file_%d", rich);
    cd.kv_dtype = rich ? PQC_F32 : PQC_F16;
    cd.n_sink = 4;
    cd.budget_ratio = 0.2;
    if (rich) {
        cd.rerank = 2;
        cd.outliers = 8;
        cd.residual_weight = 0.15;
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
    for (l = 0; l < L; l++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(a, l, obs, 8));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(a, L, k, v, 700, (size_t)hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(a, &sa));
    for (s = 0; s < 20; s++) /* decode: tokens leave the window and are coded */
        for (l = 0; l < L; l++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, l, k + (size_t)(700 + s) * hkv * d, v + (size_t)(700 + s) * hkv * d));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(a, l, q + (size_t)s * hq * d, &sa));
        }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &b));
    ASSERT_EQ(pqc_cache_window(a), pqc_cache_window(b));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(b, &sb));
    bufa = tu_kv_out(&oa, hkv, 1000, d);
    bufb = tu_kv_out(&ob, hkv, 1000, d);
    ASSERT(bufa && bufb);
    for (s = 20; s < 60; s++) /* both go on alike */
        for (l = 0; l < L; l++) {
            const float *kk = k + (size_t)(700 + s) * hkv * d, *vv = v + (size_t)(700 + s) * hkv * d;
            int h;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, l, kk, vv));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(b, l, kk, vv));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(a, l, q + (size_t)s * hq * d, &sa));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(b, l, q + (size_t)s * hq * d, &sb));
            for (h = 0; h < hkv; h++) {
                ASSERT_EQ(sa.count[h], sb.count[h]);
                ASSERT_MEM_EQ(sa.idx + (size_t)h * sa.capacity, sb.idx + (size_t)h * sb.capacity, sa.count[h] * 4);
                rows += sa.count[h];
            }
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(a, l, &sa, &oa));
            if (s % 2) { /* the loaded cache's rows by pointer, as stored (in the mapped file
                            too): converted, the rows the original gathers */
                const void *const *const *kr;
                const void *const *const *vr;
                int e;
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch_rows(b, l, &sb, &kr, &vr));
                for (h = 0; h < hkv; h++)
                    for (t = 0; t < sa.count[h]; t++)
                        for (e = 0; e < d; e++) {
                            float x = stored_value(kr[h][t], cd.kv_dtype, (size_t)e);
                            float y = stored_value(vr[h][t], cd.kv_dtype, (size_t)e);
                            size_t o = ((size_t)h * 1000 + t) * d + (size_t)e;
                            ASSERT_MEM_EQ(oa.k + o, &x, 4);
                            ASSERT_MEM_EQ(oa.v + o, &y, 4);
                        }
                continue;
            }
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(b, l, &sb, &ob));
            for (h = 0; h < hkv; h++)
                for (t = 0; t < sa.count[h]; t++) {
                    size_t o = ((size_t)h * 1000 + t) * d;
                    ASSERT_MEM_EQ(oa.k + o, ob.k + o, (size_t)d * 4);
                    ASSERT_MEM_EQ(oa.v + o, ob.v + o, (size_t)d * 4);
                }
        }
    ASSERT(rows > 1000);
    { /* a rebuild later happens alike too */
        pqc_layer_stats x, y;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(a, 0, &x));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(b, 0, &y));
        ASSERT_EQ(x.selects, 60u);
        ASSERT_EQ(y.selects, 40u); /* statistics restart at zero */
    }
    pqc_selection_free(&sa);
    pqc_selection_free(&sb);
    pqc_cache_destroy(a);
    pqc_cache_destroy(b);
    remove(path);
    free(k);
    free(v);
    free(q);
    free(obs);
    free(bufa);
    free(bufb);
    PASS();
}
TEST save_load_resumes_decoding(void) { return save_load_resumes(0); }
TEST save_load_resumes_with_exact_scoring(void) { return save_load_resumes(1); }

/* ----- the model's softmax scale ----- */

/* Every cache of the scale tests sees the same calls: observed queries, a prefill of 600
   tokens, then `steps` decode steps (append, select); keep holds each step's selection,
   per KV head its count then cap indices. */
static pqc_result scale_run(pqc_cache *c, const float *k, const float *v, const float *q, const float *obs, int steps,
                            uint32_t *keep, size_t cap)
{
    const int hkv = c->d.n_kv_heads, hq = c->d.n_q_heads, d = c->d.head_dim;
    pqc_matrix km = pqc_matrix_f32(k, 600, (size_t)hkv * d), vm = pqc_matrix_f32(v, 600, (size_t)hkv * d);
    pqc_selection sel;
    pqc_result r;
    int s, h;
    if ((r = pqc_cache_observe(c, 0, obs, 8)) != PQC_SUCCESS || (r = pqc_cache_prefill(c, 0, &km, &vm)) != PQC_SUCCESS)
        return r;
    if ((r = pqc_selection_init(c, &sel)) != PQC_SUCCESS) return r;
    for (s = 0; s < steps && r == PQC_SUCCESS; s++) {
        const float *kk = k + (size_t)(600 + s) * hkv * d, *vv = v + (size_t)(600 + s) * hkv * d;
        if ((r = pqc_cache_append(c, 0, kk, vv)) == PQC_SUCCESS &&
            (r = pqc_cache_select(c, 0, q + (size_t)s * hq * d, &sel)) == PQC_SUCCESS) {
            uint32_t *o = keep + (size_t)s * hkv * (cap + 1);
            for (h = 0; h < hkv; h++, o += cap + 1) {
                o[0] = (uint32_t)sel.count[h];
                memcpy(o + 1, sel.idx + (size_t)h * sel.capacity, sel.count[h] * 4);
            }
        }
    }
    pqc_selection_free(&sel);
    return r;
}

/* A cache at softmax_scale s selects what a cache at the default 1/sqrt(d_h) selects on
   keys multiplied by s sqrt(d_h): with d_h = 16 and s = 1 that is 4, a power of two, so
   every dot, centroid and distance of the second cache is 4 times the first's exactly
   and the softmax arguments (dots x scale) are the same floats. Step by step, with the
   window competing (PQC_SPLIT_COMPETE) and with exact scoring (re-ranking, outlier
   lists, the adaptive window from observed attention); and the default scale on the
   same keys selects otherwise. */
static enum greatest_test_res scale_selects_as_scaled_keys(int exact)
{
    enum { HKV = 2, HQ = 4, D = 16, N = 640, STEPS = 40, CAP = 640 };
    pqc_cache_desc cd = tu_cache_desc(1, HKV, HQ, D), got;
    pqc_cache *a, *b, *c;
    float *k = tu_normal_rows(&g_rng, N, (size_t)HKV * D), *v = tu_normal_rows(&g_rng, N, (size_t)HKV * D);
    float *q = tu_normal_rows(&g_rng, STEPS, (size_t)HQ * D), *obs = tu_normal_rows(&g_rng, 8, (size_t)HQ * D);
    float *k4 = (float *)malloc(sizeof(float) * N * HKV * D);
    size_t per = (size_t)STEPS * HKV * (CAP + 1), i;
    uint32_t *sa = (uint32_t *)calloc(per, 4), *sb = (uint32_t *)calloc(per, 4), *sc = (uint32_t *)calloc(per, 4);
    int s, differ = 0;
    ASSERT(k4 && sa && sb && sc);
    for (i = 0; i < (size_t)N * HKV * D; i++) k4[i] = 4.0f * k[i];
    cd.kv_dtype = PQC_F32;
    cd.n_sink = 4;
    cd.budget_ratio = 0.1;
    if (exact) {
        cd.rerank = 2;
        cd.outliers = 8;
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &got));
    ASSERT_EQ(0.25f, got.softmax_scale); /* 0: 1/sqrt(16) */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &b));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    cd.softmax_scale = 1.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(a, &got));
    ASSERT_EQ(1.0f, got.softmax_scale);
    ASSERT_EQ(PQC_SUCCESS, scale_run(a, k, v, q, obs, STEPS, sa, CAP));
    ASSERT_EQ(PQC_SUCCESS, scale_run(b, k4, v, q, obs, STEPS, sb, CAP));
    ASSERT_EQ(PQC_SUCCESS, scale_run(c, k, v, q, obs, STEPS, sc, CAP));
    for (s = 0; s < STEPS; s++) {
        size_t o = (size_t)s * HKV * (CAP + 1);
        ASSERT_MEM_EQm("the scale selects as the scaled keys do", sa + o, sb + o, HKV * (CAP + 1) * 4);
        ASSERT(sa[o] > 4 && sa[o] < 200);
        differ += memcmp(sa + o, sc + o, HKV * (CAP + 1) * 4) != 0;
    }
    ASSERT(differ > 0); /* the default scale ranks the same keys otherwise */
    pqc_cache_destroy(a);
    pqc_cache_destroy(b);
    pqc_cache_destroy(c);
    free(k);
    free(k4);
    free(v);
    free(q);
    free(obs);
    free(sa);
    free(sb);
    free(sc);
    PASS();
}
TEST softmax_scale_selects_as_scaled_keys(void) { return scale_selects_as_scaled_keys(0); }
TEST softmax_scale_selects_as_scaled_keys_exact_scoring(void) { return scale_selects_as_scaled_keys(1); }

/* Three tokens and two heads where the scale decides (d_h 4: default 0.5): head 0's dots
   10, 9.5, 0, head 1's -10, 1, 2. Softmax-sum at 0.5 ranks token 1 first (both heads pay
   it some attention); at 4 each head's attention is nearly all on its best token, and
   token 2 (head 1's) leads, then token 0 (head 0's). pqc_exact_search at either scale is
   a softmax-sum taken here in double; a bad scale is refused. */
TEST softmax_scale_changes_the_ranking_across_heads(void)
{
    static const float keys[3 * 4] = {10, -10, 0, 0, 9.5f, 1, 0, 0, 0, 2, 0, 0};
    static const float q[2 * 4] = {1, 0, 0, 0, 0, 1, 0, 0};
    static const float bad[] = {-1.0f, 2e6f, 0.0f, 0.0f};
    pqc_matrix km = pqc_matrix_f32(keys, 3, 4);
    pqc_search_desc sd;
    uint32_t idx[2];
    float sc[2], scales[2] = {0.0f, 4.0f};
    int t, h, j, i;
    memset(&sd, 0, sizeof sd);
    sd.k = 1;
    for (j = 0; j < 2; j++) {
        double ref[3] = {0, 0, 0}, s = scales[j] > 0 ? scales[j] : 0.5;
        int best = 0;
        for (h = 0; h < 2; h++) {
            double z = 0, x[3];
            for (t = 0; t < 3; t++) z += (x[t] = exp(s * (keys[t * 4 + h] - (h ? 2.0 : 10.0))));
            for (t = 0; t < 3; t++) ref[t] += x[t] / z;
        }
        for (t = 1; t < 3; t++)
            if (ref[t] > ref[best]) best = t;
        sd.softmax_scale = scales[j];
        ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &km, q, 2, &sd, NULL, idx, sc));
        ASSERT_EQ((uint32_t)best, idx[0]);
        ASSERT_IN_RANGE(ref[best], sc[0], 1e-5);
        ASSERT_EQ(j == 0 ? 1u : 2u, idx[0]);
    }
    sd.k = 2; /* at 4: tokens 0 and 2, at the default 1 and 2 */
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &km, q, 2, &sd, NULL, idx, NULL));
    ASSERT(idx[0] == 0 && idx[1] == 2);
    sd.softmax_scale = 0.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &km, q, 2, &sd, NULL, idx, NULL));
    ASSERT(idx[0] == 1 && idx[1] == 2);
    sd.gqa = PQC_GQA_SUM; /* the sum of dots has no scale: 1 and 2 at any */
    sd.softmax_scale = 4.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &km, q, 2, &sd, NULL, idx, NULL));
    ASSERT(idx[0] == 1 && idx[1] == 2);
    sd.gqa = PQC_GQA_SOFTMAX_SUM;
    for (i = 0; i < 4; i++) {
        pqc_cache_desc cd = tu_cache_desc(1, 1, 2, 4);
        pqc_cache *c = NULL;
        sd.softmax_scale = i == 2 ? nanf("") : i == 3 ? (float)INFINITY : bad[i];
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_exact_search(NULL, &km, q, 2, &sd, NULL, idx, NULL));
        cd.softmax_scale = sd.softmax_scale;
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
        ASSERT(c == NULL);
        ASSERTm(pqc_last_error(), strstr(pqc_last_error(), "softmax_scale") != NULL);
    }
    PASS();
}

/* A cache file keeps a scale other than the default (format version 4) and a load whose
   desc leaves softmax_scale 0 takes it, a fork of that cache too, and decodes on as the
   saved cache; a desc's own scale wins over the file's. A cache at the default scale
   writes version 3, the format before the scale was saved, and such a file loads at
   1/sqrt(d_h). */
TEST softmax_scale_is_saved_and_loaded(void)
{
    enum { HKV = 2, HQ = 4, D = 16, N = 640, STEPS = 20, CAP = 640 };
    pqc_cache_desc cd = tu_cache_desc(1, HKV, HQ, D), got;
    pqc_cache *a, *b, *f, *c;
    float *k = tu_normal_rows(&g_rng, N, (size_t)HKV * D), *v = tu_normal_rows(&g_rng, N, (size_t)HKV * D);
    float *q = tu_normal_rows(&g_rng, 2 * STEPS, (size_t)HQ * D), *obs = tu_normal_rows(&g_rng, 8, (size_t)HQ * D);
    char path[512], path3[512];
    unsigned char *img;
    long size;
    uint32_t ver;
    pqc_selection sa, sb;
    int s;
    tu_tmp_path(path, sizeof path, "scale_v4");
    tu_tmp_path(path3, sizeof path3, "scale_v3");
    cd.kv_dtype = PQC_F32;
    cd.n_sink = 4;
    {
        uint32_t *keep = (uint32_t *)calloc((size_t)STEPS * HKV * (CAP + 1), 4);
        ASSERT(keep);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c)); /* the default scale */
        ASSERT_EQ(PQC_SUCCESS, scale_run(c, k, v, q, obs, STEPS, keep, CAP));
        cd.softmax_scale = 0.75f;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
        ASSERT_EQ(PQC_SUCCESS, scale_run(a, k, v, q, obs, STEPS, keep, CAP));
        free(keep);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, path3));
    ASSERT((img = tu_file_image(path, &size)) != NULL);
    memcpy(&ver, img + 8, 4);
    ASSERT_EQ(4u, ver);
    free(img);
    ASSERT((img = tu_file_image(path3, &size)) != NULL);
    memcpy(&ver, img + 8, 4);
    ASSERT_EQ(3u, ver);
    free(img);
    cd.softmax_scale = 0.0f; /* the file's */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &b));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(b, &got));
    ASSERT_EQ(0.75f, got.softmax_scale);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(b, &f));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(f, &got));
    ASSERT_EQ(0.75f, got.softmax_scale);
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(a, &sa));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(b, &sb));
    for (s = STEPS; s < 2 * STEPS; s++) { /* the saved cache and the loaded one go on alike */
        const float *kk = k + (size_t)(600 + s) * HKV * D, *vv = v + (size_t)(600 + s) * HKV * D;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, 0, kk, vv));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(b, 0, kk, vv));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(a, 0, q + (size_t)s * HQ * D, &sa));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(b, 0, q + (size_t)s * HQ * D, &sb));
        ASSERT(same_selection(&sa, &sb, HKV));
    }
    pqc_selection_free(&sa);
    pqc_selection_free(&sb);
    pqc_cache_destroy(f);
    pqc_cache_destroy(b);
    cd.softmax_scale = 2.0f; /* the desc's own */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &b));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(b, &got));
    ASSERT_EQ(2.0f, got.softmax_scale);
    pqc_cache_destroy(b);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path3, &b));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(b, &got));
    ASSERT_EQ(2.0f, got.softmax_scale);
    pqc_cache_destroy(b);
    cd.softmax_scale = 0.0f; /* a file of the earlier format: 1/sqrt(d_h) */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path3, &b));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(b, &got));
    ASSERT_EQ(0.25f, got.softmax_scale);
    pqc_cache_destroy(b);
    pqc_cache_destroy(a);
    pqc_cache_destroy(c);
    remove(path);
    remove(path3);
    free(k);
    free(v);
    free(q);
    free(obs);
    PASS();
}

/* The load's check of stored K/V rows from their bits: fp16 Inf or NaN at any position
   (the four-at-a-time part and the tail), bf16 beyond the key limit, fp32 NaN. */
TEST stored_rows_check_finds_every_bad_value(void)
{
    uint16_t h[11];
    float f[5] = {1, -2, 3e10f, 0, 5};
    int i, j;
    for (j = 0; j < 11; j++) h[j] = 0x7bffu; /* 65504, the largest finite fp16 */
    ASSERT(pqc__stored_ok(h, PQC_F16, 11));
    for (i = 0; i < 11; i++) {
        uint16_t bad[3] = {0x7c00u, 0xfc00u, 0x7e01u}; /* +Inf, -Inf, NaN */
        for (j = 0; j < 3; j++) {
            uint16_t keep = h[i];
            h[i] = bad[j];
            ASSERT_FALSE(pqc__stored_ok(h, PQC_F16, 11));
            h[i] = keep;
        }
    }
    for (j = 0; j < 11; j++) h[j] = 0x5b00u; /* bf16 2^55 = 3.6e16 > the key limit 1e16 */
    ASSERT_FALSE(pqc__stored_ok(h, PQC_BF16, 11));
    for (j = 0; j < 11; j++) h[j] = 0x4000u; /* bf16 2 */
    ASSERT(pqc__stored_ok(h, PQC_BF16, 11));
    ASSERT(pqc__stored_ok(f, PQC_F32, 5));
    f[3] = NAN;
    ASSERT_FALSE(pqc__stored_ok(f, PQC_F32, 5));
    PASS();
}

/* Damaged, truncated, foreign and mismatched files are refused; *out stays as it was. */
/* A file whose checksum is right (the checksum guards against damage, not against a
   crafted file) but whose drift state names a coded count beyond any size is refused. */
TEST save_load_refuses_a_crafted_drift_state(void)
{
    pqc_cache_desc cd = tu_cache_desc(1, 2, 2, 16);
    pqc_cache *a, *b = (pqc_cache *)&cd;
    float *k = tu_normal_rows(&g_rng, 300, 32), *v = tu_normal_rows(&g_rng, 300, 32);
    char path[512];
    unsigned char *img, pat[40], *at = NULL;
    long size = 0, i;
    const double bad[] = { 1e200, 0.5, 1e9 }; /* beyond any size, not whole, beyond max_tokens */
    int j;
    const pqc__layer *L;
    tu_tmp_path(path, sizeof path, "cache_drift");
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(a, 1, k, v, 300, 32));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(a));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    ASSERT((img = tu_file_image(path, &size)) != NULL);
    /* the layer's counts (u64 tokens, coded, trained, generation, step), two u32, then the
       observation sums, whose last two doubles are the drift flags */
    L = &a->layers[0];
    {
        uint64_t w[5];
        w[0] = L->n_tokens;
        w[1] = L->n_coded;
        w[2] = L->n_trained;
        w[3] = L->gen;
        w[4] = L->step;
        for (j = 0; j < 40; j++) pat[j] = (unsigned char)(w[j / 8] >> (8 * (j % 8)));
    }
    for (i = 0; i + 40 <= size && !at; i++)
        if (!memcmp(img + i, pat, 40)) at = img + i;
    ASSERT(at != NULL);
    at += 40 + 4 + 4 + 8 * (2 * pqc__qsq_part(a) + 1); /* the coded count at the last drift rebuild + 1 */
    for (j = 0; j < (int)(sizeof bad / sizeof bad[0]); j++) {
        uint64_t h;
        int e;
        memcpy(at, &bad[j], 8);
        h = cache_file_checksum(img, (size_t)size - 8);
        for (e = 0; e < 8; e++) img[size - 8 + e] = (unsigned char)(h >> (8 * e));
        ASSERT(tu_file_write(path, img, (size_t)size));
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_cache_load(NULL, &cd, path, &b));
        ASSERTm(pqc_last_error(), strstr(pqc_last_error(), "drift state") != NULL);
        ASSERT(b == (pqc_cache *)&cd);
    }
    remove(path);
    free(img);
    free(k);
    free(v);
    pqc_cache_destroy(a);
    PASS();
}

TEST save_load_refuses_bad_files(void)
{
    pqc_cache_desc cd = tu_cache_desc(1, 2, 2, 16), other;
    pqc_cache *a, *b = (pqc_cache *)&cd;
    float *k = tu_normal_rows(&g_rng, 300, 32), *v = tu_normal_rows(&g_rng, 300, 32);
    char path[512], bad[512];
    unsigned char *img;
    long size = 0, i;
    tu_tmp_path(path, sizeof path, "cache_good");
    tu_tmp_path(bad, sizeof bad, "cache_bad");
    cd.n_sink = 4;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(a, 1, k, v, 300, 32));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    ASSERT((img = tu_file_image(path, &size)) != NULL);
    for (i = 0; i <= size; i += i < 200 ? 1 : 997) { /* truncations, and a trailing byte at the end */
        img[size] = 1;
        ASSERT(tu_file_write(bad, img, (size_t)(i == size ? size + 1 : i)));
        ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_cache_load(NULL, &cd, bad, &b));
        ASSERT(b == (pqc_cache *)&cd);
    }
    for (i = 0; i < size; i += i < 200 ? 1 : 499) { /* a flipped bit */
        pqc_result r;
        img[i] ^= 4;
        ASSERT(tu_file_write(bad, img, (size_t)size));
        r = pqc_cache_load(NULL, &cd, bad, &b);
        ASSERT(r == PQC_ERROR_BAD_FILE || (i < 72 && r == PQC_ERROR_BAD_SHAPE)); /* the header's settings */
        ASSERT(b == (pqc_cache *)&cd);
        img[i] ^= 4;
    }
    other = cd; /* other settings */
    other.pq.m = 4;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_load(NULL, &other, path, &b));
    other = cd;
    other.kv_dtype = PQC_F16;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_cache_load(NULL, &other, path, &b));
    other = cd;
    other.max_tokens = 100; /* the file holds 300 tokens */
    ASSERT_EQ(PQC_ERROR_BAD_FILE, pqc_cache_load(NULL, &other, path, &b));
    ASSERT(b == (pqc_cache *)&cd);
    ASSERT_EQ(PQC_ERROR_IO, pqc_cache_load(NULL, &cd, tu_tmp_dir(), &b)); /* a directory */
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_load(NULL, NULL, path, &b));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_save(a, NULL));
    ASSERT_EQ(PQC_ERROR_IO, pqc_cache_save(a, tu_tmp_dir()));
    ASSERT(b == (pqc_cache *)&cd);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &b)); /* the good file still loads */
    pqc_cache_destroy(b);
    pqc_cache_destroy(a);
    remove(path);
    remove(bad);
    free(img);
    free(k);
    free(v);
    PASS();
}


/* ----- prefix sharing ----- */

/* Cache b selects and fetches for one layer what reference a did (sa, oa). */
static enum greatest_test_res same_step(pqc_cache *b, int l, const float *q, const pqc_selection *sa,
                                        pqc_selection *sb, const pqc_kv_out *oa, const pqc_kv_out *ob, int d)
{
    int h;
    size_t t;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(b, l, q, sb));
    for (h = 0; h < sa->n_kv_heads; h++) {
        ASSERT_EQ(sa->count[h], sb->count[h]);
        ASSERT_MEM_EQ(sa->idx + (size_t)h * sa->capacity, sb->idx + (size_t)h * sb->capacity, sa->count[h] * 4);
    }
    if (pqc_cache_tokens(b, l) % 2) { /* every other step the rows by pointer, as stored
                                         (across a fork's shared prefix, in a mapped file) */
        const void *const *const *kr;
        const void *const *const *vr;
        pqc_cache_desc cfg;
        int e;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(b, &cfg));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch_rows(b, l, sb, &kr, &vr));
        for (h = 0; h < sa->n_kv_heads; h++)
            for (t = 0; t < sa->count[h]; t++)
                for (e = 0; e < d; e++) {
                    float x = stored_value(kr[h][t], cfg.kv_dtype, (size_t)e);
                    float y = stored_value(vr[h][t], cfg.kv_dtype, (size_t)e);
                    size_t o = ((size_t)h * oa->head_stride + t) * (size_t)d + (size_t)e;
                    ASSERT_MEM_EQ(oa->k + o, &x, 4);
                    ASSERT_MEM_EQ(oa->v + o, &y, 4);
                }
        PASS();
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(b, l, sb, ob));
    for (h = 0; h < sa->n_kv_heads; h++)
        for (t = 0; t < sa->count[h]; t++) {
            size_t o = ((size_t)h * oa->head_stride + t) * (size_t)d;
            ASSERT_MEM_EQ(oa->k + o, ob->k + o, (size_t)d * 4);
            ASSERT_MEM_EQ(oa->v + o, ob->v + o, (size_t)d * 4);
        }
    PASS();
}

/* A family of forks (a fork of a fork, a second fork after the parent appended, the
   parent destroyed first, a rebuild across the shared prefix, a fork saved to a file)
   decodes exactly like one cache that never shared anything. rich: 0 plain (fp16), 1
   exact scoring and residual scoring (fp32), 2 exact scoring over fp16 rows of an odd
   width (a fork scores copies of its candidates' rows, 66 bytes each: the copies' index
   array must not follow them off its alignment) */
static enum greatest_test_res forks_decode_like_unshared(int rich)
{
    enum { NC = 6 }; /* ref, a, b (fork of a), c (2nd fork of a), e (fork of b), f (loaded from e's file) */
    const int L = 2, hkv = 2, hq = 4, d = rich == 2 ? 33 : 32, S = 700, STEPS = 120;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *cs[NC] = { NULL, NULL, NULL, NULL, NULL, NULL };
    pqc_selection sel[NC];
    pqc_kv_out out[NC];
    float *k = tu_normal_rows(&g_rng, (size_t)S + STEPS, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, (size_t)S + STEPS, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, STEPS, (size_t)hq * d), *obs = tu_normal_rows(&g_rng, 8, (size_t)hq * d), *buf[NC];
    char path[512];
    int l, s, i;
    pqc_layer_stats st;
    tu_tmp_path(path, sizeof path, "fork_file_%d", rich);
    cd.kv_dtype = rich == 1 ? PQC_F32 : PQC_F16;
    cd.n_sink = 4;
    cd.budget_ratio = 0.2;
    cd.rebuild_share = 0.05; /* rebuilds during the run, over the shared prefix and own rows */
    if (rich) {
        cd.rerank = 2;
        cd.outliers = 8;
        cd.residual_weight = rich == 1 ? 0.15 : 0.0;
    }
    if (rich == 2) cd.pq.m = 3; /* 3 x 11 dims */
    for (i = 0; i < 2; i++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &cs[i]));
        for (l = 0; l < L; l++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(cs[i], l, obs, 8));
        ASSERT_EQ(PQC_SUCCESS, prefill_all(cs[i], L, k, v, (size_t)S, (size_t)hkv * d));
    }
    for (i = 0; i < NC; i++) {
        ASSERT((buf[i] = tu_kv_out(&out[i], hkv, 2000, d)) != NULL);
        memset(&sel[i], 0, sizeof sel[i]);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cs[0], &sel[0]));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cs[1], &sel[1]));
    for (s = 0; s < STEPS; s++) {
        if (s == 20) { /* the first fork: a's stores become the shared prefix */
            size_t own, shared;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(cs[1], &cs[2]));
            ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cs[2], &sel[2]));
            ASSERT_EQ(pqc_cache_tokens(cs[1], 1), pqc_cache_tokens(cs[2], 1));
            pqc_cache_host_memory(cs[2], &own, &shared);
            ASSERT(shared >= (size_t)2 * L * hkv * (S + 20) * d * 2);
            ASSERT(own < shared); /* own rows: room for a few hundred appended tokens */
        }
        if (s == 40) { /* a second fork of a (its rows since the first are copied), a fork of b */
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(cs[1], &cs[3]));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(cs[2], &cs[4]));
            ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cs[3], &sel[3]));
            ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cs[4], &sel[4]));
        }
        if (s == 60) { /* the parent goes first; e, saved and loaded, goes on as f */
            const void *kp, *vp;
            size_t n;
            pqc_dtype dt;
            pqc_cache_destroy(cs[1]);
            cs[1] = NULL;
            ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_kv(cs[4], 0, 0, &kp, &vp, &n, &dt));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(cs[4], path));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &cs[5]));
            ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(cs[5], &sel[5]));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv(cs[5], 0, 0, &kp, &vp, &n, &dt));
            { /* the fork's rows, part by part, are the loaded cache's */
                size_t from = 0, cnt, parts = 0;
                const void *kq, *vq;
                for (;; parts++) {
                    ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv_part(cs[4], 0, 0, from, &kq, &vq, &cnt));
                    if (!cnt) break;
                    ASSERT_MEM_EQ((const char *)kp + from * d * pqc_dtype_size(cd.kv_dtype), kq, cnt * d * pqc_dtype_size(cd.kv_dtype));
                    ASSERT_MEM_EQ((const char *)vp + from * d * pqc_dtype_size(cd.kv_dtype), vq, cnt * d * pqc_dtype_size(cd.kv_dtype));
                    from += cnt;
                }
                ASSERT_EQ(n, from);
                ASSERT_EQ(2u, parts);
            }
        }
        for (l = 0; l < L; l++) {
            const float *kk = k + (size_t)(S + s) * hkv * d, *vv = v + (size_t)(S + s) * hkv * d;
            for (i = 0; i < NC; i++)
                if (cs[i]) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(cs[i], l, kk, vv));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(cs[0], l, q + (size_t)s * hq * d, &sel[0]));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(cs[0], l, &sel[0], &out[0]));
            for (i = 1; i < NC; i++)
                if (cs[i]) CHECK_CALL(same_step(cs[i], l, q + (size_t)s * hq * d, &sel[0], &sel[i], &out[0], &out[i], d));
        }
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(cs[4], 0, &st));
    ASSERT(st.rebuilds >= 1); /* e re-clustered its view: shared prefix and own rows */
    for (i = 0; i < NC; i++) {
        pqc_selection_free(&sel[i]);
        pqc_cache_destroy(cs[i]);
        free(buf[i]);
    }
    remove(path);
    free(k);
    free(v);
    free(q);
    free(obs);
    PASS();
}
TEST forks_decode_like_unshared_caches(void) { return forks_decode_like_unshared(0); }
TEST forks_decode_like_unshared_caches_exact_scoring(void) { return forks_decode_like_unshared(1); }
TEST forks_decode_like_unshared_caches_exact_scoring_odd_rows(void) { return forks_decode_like_unshared(2); }

/* A decode step (append, select, fetch, or one batch select and fetch for both caches)
   allocates nothing once the buffers have grown, on caches whose keys lie in two parts
   (a fork, and its parent since the fork): a step's encoding, the fetch's counters and
   a batch's results use the stack; the window's exact dots (the default split's
   rivals), and with exact scoring the copies of the candidates' rows (across the shared
   prefix and their own), lie in the head's scratch. Appends grow the stores and codes
   now and then, by half or more. Inline runtime: every allocation counted is the
   call's. */
static enum greatest_test_res decode_steps_without_allocating(int exact)
{
    const int L = 2, hkv = 2, hq = 4, d = 33, S = 600, STEPS = 100, BATCH = 10;
    tu_failing fa;
    pqc_runtime *rt;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *c[2] = { NULL, NULL };
    pqc_selection sel[2];
    pqc_kv_out out[2];
    const size_t n = (size_t)S + STEPS + BATCH;
    float *k = tu_normal_rows(&g_rng, n, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, n, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, STEPS + BATCH, (size_t)hq * d);
    float *buf = tu_kv_out(&out[0], hkv, 1000, d), *buf2 = tu_kv_out(&out[1], hkv, 1000, d);
    long appends[2], steps[2], batch = 0;
    int l, i, s;
    ASSERT(buf != NULL && buf2 != NULL);
    ASSERT((rt = tu_counting_runtime(&fa, 0)) != NULL);
    cd.kv_dtype = PQC_F16;
    cd.n_sink = 4;
    cd.budget_ratio = 0.2;
    if (exact) {
        cd.rerank = 2;
        cd.outliers = 8;
    }
    cd.pq.m = 3;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &c[0]));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(c[0], L, k, v, (size_t)S, (size_t)hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(c[0], &c[1]));
    for (i = 0; i < 2; i++) {
        memset(&sel[i], 0, sizeof sel[i]);
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c[i], &sel[i]));
    }
    /* (the first steps grow the scratch with the candidates, which the split adds row
       copies to) */
    ASSERT_EQ(PQC_SUCCESS, tu_counted_steps(c, sel, 2, L, k + (size_t)S * hkv * d, v + (size_t)S * hkv * d,
                                            (size_t)hkv * d, q, (size_t)hq * d, STEPS, 30, 0, &out[0], &fa, appends, steps));
    for (l = 0; l < L; l++) /* the coded tokens run past the shared prefix */
        for (i = 0; i < 2; i++) ASSERT(c[i]->layers[l].n_coded + (size_t)cd.n_sink > c[i]->pn);
    for (i = 0; i < 2; i++) {
        ASSERT_EQ(0L, steps[i]);
        ASSERT(appends[i] <= 8); /* (one a step would be 60) */
    }
    for (s = 0; s < BATCH; s++) /* then both caches in one batch select and one batch fetch */
        for (l = 0; l < L; l++) {
            const size_t t = (size_t)S + STEPS + s;
            const float *qs[2];
            pqc_selection *sp[2];
            const pqc_selection *cs[2];
            const pqc_kv_out *op[2];
            long before;
            for (i = 0; i < 2; i++) {
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c[i], l, k + t * hkv * d, v + t * hkv * d));
                qs[i] = q + (size_t)(STEPS + s) * hq * d;
                sp[i] = &sel[i];
                cs[i] = &sel[i];
                op[i] = &out[i];
            }
            before = fa.calls;
            ASSERT_EQ(PQC_SUCCESS, pqc_batch_select(c, 2, l, qs, sp));
            ASSERT_EQ(PQC_SUCCESS, pqc_batch_fetch(c, 2, l, cs, op));
            batch += fa.calls - before;
        }
    ASSERT_EQ(0L, batch);
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
    free(buf2);
    PASS();
}
TEST decode_steps_without_allocating_default(void) { return decode_steps_without_allocating(0); }
TEST decode_steps_without_allocating_exact_scoring(void) { return decode_steps_without_allocating(1); }

/* 8 children over a 32K prefix: the family holds the prefix once (at most 1.2x one
   cache holding it), and a child decodes like a cache that never shared. */
/* Caches over slices of a model's KV heads (tensor-parallel ranks), each told its first
   head, train the codebooks of one cache over every head and select what it selects:
   with the fixed split, and with the fixed split whose window competes (a window of 64,
   48 rivals a head, some of which win: its selection differs from the fixed split's). */
static enum greatest_test_res head_slices(pqc_split split)
{
    const int d = 32, n = 900, hkv = 3;
    pqc_runtime *rt = NULL;
    pqc_runtime_desc rd;
    pqc_cache_desc cd;
    pqc_cache *all = NULL, *part[3] = { NULL, NULL, NULL };
    pqc_selection sa, sp;
    float *k = tu_normal_rows(&g_rng, (size_t)n, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, (size_t)n, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, 1, (size_t)hkv * d), *obs = tu_normal_rows(&g_rng, 8, (size_t)hkv * d);
    float *os = (float *)malloc(8 * (size_t)d * sizeof(float));
    float *ks = (float *)malloc((size_t)n * d * sizeof(float) * 2), *vs = ks + (size_t)n * d;
    int h, t, sliced_same = 0;
    memset(&rd, 0, sizeof rd);
    rd.n_threads = 1;
    ASSERT(k && v && q && obs && os && ks);
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&rd, &rt));
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 1;
    cd.n_kv_heads = hkv;
    cd.n_q_heads = hkv;
    cd.head_dim = d;
    cd.max_tokens = 2048;
    cd.budget_ratio = 0.1;
    cd.split = split;
    cd.window = split == PQC_SPLIT_FIXED_COMPETE ? 64 : 0;
    cd.rerank = -1; /* the window competes with the PQ scores alone */
    cd.pq.m = 4;
    cd.pq.bits = 5;
    cd.pq.iters = 5;
    cd.pq.seed = 9;
    {
        pqc_matrix km = pqc_matrix_f32(k, (size_t)n, (size_t)hkv * d), vm = pqc_matrix_f32(v, (size_t)n, (size_t)hkv * d);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &all));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(all, 0, obs, 8));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(all, 0, &km, &vm));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(all));
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(all, &sa));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(all, 0, q, &sa));
    if (split == PQC_SPLIT_FIXED_COMPETE) { /* the window competed: some rival lost its place */
        pqc_cache_desc fd = cd;
        pqc_cache *fixed = NULL;
        pqc_matrix km = pqc_matrix_f32(k, (size_t)n, (size_t)hkv * d), vm = pqc_matrix_f32(v, (size_t)n, (size_t)hkv * d);
        int differ = 0;
        fd.split = PQC_SPLIT_FIXED;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &fd, &fixed));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(fixed, 0, obs, 8));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(fixed, 0, &km, &vm));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(fixed, &sp));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(fixed, 0, q, &sp));
        for (h = 0; h < hkv; h++) {
            ASSERT_EQ(sp.count[h], sa.count[h]);
            differ += memcmp(sp.idx + (size_t)h * sp.capacity, sa.idx + (size_t)h * sa.capacity,
                             sa.count[h] * sizeof(uint32_t)) != 0;
        }
        pqc_selection_free(&sp);
        pqc_cache_destroy(fixed);
        ASSERT(differ > 0);
    }
    for (h = 0; h < hkv; h++) { /* one cache per head, as ranks of one head each */
        pqc_cache_desc pd = cd;
        pqc_matrix km, vm;
        const pqc_pq *a, *b;
        for (t = 0; t < n; t++) {
            memcpy(ks + (size_t)t * d, k + ((size_t)t * hkv + h) * d, (size_t)d * sizeof(float));
            memcpy(vs + (size_t)t * d, v + ((size_t)t * hkv + h) * d, (size_t)d * sizeof(float));
        }
        for (t = 0; t < 8; t++) memcpy(os + (size_t)t * d, obs + ((size_t)t * hkv + h) * d, (size_t)d * sizeof(float));
        km = pqc_matrix_f32(ks, (size_t)n, (size_t)d);
        vm = pqc_matrix_f32(vs, (size_t)n, (size_t)d);
        pd.n_kv_heads = 1;
        pd.n_q_heads = 1;
        pd.first_kv_head = h;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &pd, &part[h]));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(part[h], 0, os, 8));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(part[h], 0, &km, &vm));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(part[h]));
        a = &all->layers[0].heads[h].pq;
        b = &part[h]->layers[0].heads[0].pq;
        ASSERT_EQ(a->ksub, b->ksub);
        ASSERT_MEM_EQ(a->centroids, b->centroids, (size_t)a->m * a->ksub * a->dsub * sizeof(float));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(part[h], &sp));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(part[h], 0, q + (size_t)h * d, &sp));
        ASSERT_EQ(sa.count[h], sp.count[0]);
        ASSERT_MEM_EQ(sa.idx + (size_t)h * sa.capacity, sp.idx, sp.count[0] * sizeof(uint32_t));
        pqc_selection_free(&sp);
        if (h > 0) { /* the same slice without its first head trains other codebooks */
            pqc_cache *other = NULL;
            pd.first_kv_head = 0;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &pd, &other));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(other, 0, os, 8));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(other, 0, &km, &vm));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(other));
            sliced_same += !memcmp(other->layers[0].heads[0].pq.centroids, a->centroids,
                                   (size_t)a->m * a->ksub * a->dsub * sizeof(float));
            pqc_cache_destroy(other);
        }
    }
    ASSERT_EQ(0, sliced_same);
    cd.first_kv_head = -1;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(rt, &cd, &part[0]));
    for (h = 0; h < hkv; h++) pqc_cache_destroy(part[h]);
    pqc_selection_free(&sa);
    pqc_cache_destroy(all);
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    free(q);
    free(obs);
    free(os);
    free(ks);
    PASS();
}
TEST head_slices_build_like_one_cache(void) { return head_slices(PQC_SPLIT_FIXED); }
TEST head_slices_build_like_one_cache_window_competes(void) { return head_slices(PQC_SPLIT_FIXED_COMPETE); }

TEST forks_hold_the_prefix_once(void)
{
    enum { NCH = 8 };
    const int S = TEST_SIZE(32768, 4096), STEPS = TEST_SIZE(16, 6);
    const int L = 2, hkv = 2, hq = 4, d = 128;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *p, *one, *ch[NCH];
    pqc_selection s1, sc;
    pqc_kv_out o1, oc;
    float *k = tu_normal_rows(&g_rng, (size_t)S + STEPS * NCH, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, (size_t)S + STEPS * NCH, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, STEPS, (size_t)hq * d), *b1, *bc;
    size_t own, shared, total, one_own, one_shared;
    int i, s, l;
    cd.kv_dtype = PQC_F16;
    cd.pq.iters = 2;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &p));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &one));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(p, L, k, v, S, (size_t)hkv * d));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(one, L, k, v, S, (size_t)hkv * d));
    for (i = 0; i < NCH; i++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p, &ch[i]));
    /* each child decodes its own continuation; the unshared cache that of child 0 */
    b1 = tu_kv_out(&o1, hkv, 8192, d);
    bc = tu_kv_out(&oc, hkv, 8192, d);
    ASSERT(b1 && bc);
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(one, &s1));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(ch[0], &sc));
    for (s = 0; s < STEPS; s++)
        for (l = 0; l < L; l++) {
            for (i = 0; i < NCH; i++) {
                size_t t = (size_t)S + (size_t)i * STEPS + (size_t)s;
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(ch[i], l, k + t * hkv * d, v + t * hkv * d));
                if (i == 0) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(one, l, k + t * hkv * d, v + t * hkv * d));
            }
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(one, l, q + (size_t)s * hq * d, &s1));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(one, l, &s1, &o1));
            CHECK_CALL(same_step(ch[0], l, q + (size_t)s * hq * d, &s1, &sc, &o1, &oc, d));
        }
    pqc_cache_host_memory(one, &one_own, &one_shared);
    ASSERT_EQ(0u, one_shared);
    pqc_cache_host_memory(p, &own, &shared);
    ASSERT(shared >= (size_t)2 * L * hkv * S * d * 2); /* K and V of the prefix */
    total = own + shared;
    for (i = 0; i < NCH; i++) {
        size_t o2, s2;
        pqc_cache_host_memory(ch[i], &o2, &s2);
        ASSERT_EQ(shared, s2); /* one prefix */
        total += o2;
    }
    fprintf(stderr, "    prefix sharing: 1 + %d caches over %d tokens hold %.1f MB, one cache %.1f MB (%.3fx)\n", NCH, S,
            (double)total / 1e6, (double)one_own / 1e6, (double)total / (double)one_own);
    /* nine unshared caches would hold 9x; at 4K tokens (the small size) each child's own
       window, codes and block cache weigh more against the prefix than at 32K */
    ASSERT((double)total <= TEST_SIZE(1.2, 3.0) * (double)one_own);
    pqc_selection_free(&s1);
    pqc_selection_free(&sc);
    pqc_cache_destroy(one);
    pqc_cache_destroy(p);
    for (i = 0; i < NCH; i++) pqc_cache_destroy(ch[i]);
    free(k);
    free(v);
    free(q);
    free(b1);
    free(bc);
    PASS();
}

typedef struct fork_worker {
    pqc_cache *c;
    const float *k, *v, *q;
    int steps, hkv, hq, d, L;
    pqc_result res;
    size_t selected;
} fork_worker;

static void *fork_worker_run(void *arg)
{
    fork_worker *w = (fork_worker *)arg;
    pqc_selection sel;
    int s, l, h;
    w->res = pqc_selection_init(w->c, &sel);
    for (s = 0; w->res == PQC_SUCCESS && s < w->steps; s++)
        for (l = 0; l < w->L && w->res == PQC_SUCCESS; l++) {
            w->res = pqc_cache_append(w->c, l, w->k + (size_t)s * w->hkv * w->d, w->v + (size_t)s * w->hkv * w->d);
            if (w->res == PQC_SUCCESS) w->res = pqc_cache_select(w->c, l, w->q + (size_t)s * w->hq * w->d, &sel);
            for (h = 0; w->res == PQC_SUCCESS && h < w->hkv; h++) w->selected += sel.count[h];
        }
    pqc_selection_free(&sel);
    pqc_cache_destroy(w->c); /* the last one frees the shared prefix */
    return NULL;
}

/* Children decode and are destroyed on their own threads while the parent goes away on
   another (runtime with a pool: builds run there too). */
TEST forks_live_on_other_threads(void)
{
    enum { NW = 4 };
    const int L = 2, hkv = 2, hq = 4, d = 32, S = 600, STEPS = 40;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_runtime *rt = tu_cpu_runtime(2);
    pqc_cache *p;
    pthread_t th[NW];
    fork_worker w[NW];
    float *k = tu_normal_rows(&g_rng, (size_t)S + STEPS, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, (size_t)S + STEPS, (size_t)hkv * d);
    float *q = tu_normal_rows(&g_rng, STEPS, (size_t)hq * d);
    int i;
    ASSERT(rt);
    cd.rebuild_share = 0.05;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(rt, &cd, &p));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(p, L, k, v, S, (size_t)hkv * d));
    for (i = 0; i < NW; i++) {
        memset(&w[i], 0, sizeof w[i]);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p, &w[i].c));
        w[i].k = k + (size_t)S * hkv * d;
        w[i].v = v + (size_t)S * hkv * d;
        w[i].q = q;
        w[i].steps = STEPS;
        w[i].hkv = hkv;
        w[i].hq = hq;
        w[i].d = d;
        w[i].L = L;
        ASSERT_EQ(0, pthread_create(&th[i], NULL, fork_worker_run, &w[i]));
    }
    pqc_cache_destroy(p);
    for (i = 0; i < NW; i++) {
        ASSERT_EQ(0, pthread_join(th[i], NULL));
        ASSERT_EQ(PQC_SUCCESS, w[i].res);
        ASSERT_EQ(w[0].selected, w[i].selected); /* the same continuation selects alike */
        ASSERT(w[i].selected > (size_t)STEPS * L * hkv * 50);
    }
    pqc_runtime_destroy(rt);
    free(k);
    free(v);
    free(q);
    PASS();
}

/* A fork between the layers of a step, or of nothing, and null arguments. */
TEST fork_misuse_is_refused(void)
{
    const int L = 2, hkv = 1, d = 16;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hkv, d);
    pqc_cache *p, *c = NULL, *e = NULL;
    float *k = tu_normal_rows(&g_rng, 300, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, 300, (size_t)hkv * d);
    pqc_matrix km = pqc_matrix_f32(k, 300, (size_t)hkv * d), vm = pqc_matrix_f32(v, 300, (size_t)hkv * d);
    size_t own, shared;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &p));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_fork(NULL, &c));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_fork(p, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p, &e)); /* of an empty cache: an empty cache */
    ASSERT_EQ(0u, pqc_cache_tokens(e, 0));
    pqc_cache_host_memory(e, &own, &shared);
    ASSERT_EQ(0u, shared);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(e, 0, &km, &vm)); /* and it works */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(p, 0, &km, &vm));
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_fork(p, &c));
    ASSERT(c == NULL);
    ASSERT(strstr(pqc_last_error(), "between decode steps") != NULL);
    pqc_cache_host_memory(p, &own, &shared);
    ASSERT_EQ(0u, shared); /* nothing shared yet */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(p, 1, &km, &vm));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(p, &c));
    {
        const void *kp, *vp;
        size_t cnt;
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_kv_part(c, 0, 0, 301, &kp, &vp, &cnt));
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_kv_part(c, 0, 1, 0, &kp, &vp, &cnt));
        ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_kv_part(c, 0, 0, 0, NULL, &vp, &cnt));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv_part(c, 1, 0, 300, &kp, &vp, &cnt));
        ASSERT_EQ(0u, cnt);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_kv_part(c, 1, 0, 10, &kp, &vp, &cnt));
        ASSERT_EQ(290u, cnt);
        ASSERT_MEM_EQ(k + 10 * d, kp, 290 * d * 4);
        ASSERT_MEM_EQ(v + 10 * d, vp, 290 * d * 4);
    }
    pqc_cache_destroy(c);
    pqc_cache_destroy(e);
    pqc_cache_destroy(p);
    free(k);
    free(v);
    PASS();
}

/* A loaded cache maps its file on the host tier (the rows are its shared prefix, the
   pages the file's), forks share the mapping, and a file whose layers hold different
   lengths (saved between the layers of a step) is copied instead; all select alike. */
/* What a file mapped by a loaded cache survives (docs/usage.md, "Save and resume"): a new file
   renamed over its name (pqc_cache_save does that) leaves the cache reading the rows it
   loaded; truncating it kills the process that reads a row past the new end with SIGBUS
   (here a child process: fetch and save read the rows). */
TEST mapped_file_survives_rename_over_and_truncation_is_sigbus(void)
{
    const int L = 2, hkv = 2, hq = 4, d = 32;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *a, *z, *m;
    pqc_selection sa, sm;
    pqc_kv_out oa, om;
    float *k = tu_normal_rows(&g_rng, 300, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, 300, (size_t)hkv * d), *q = tu_normal_rows(&g_rng, 4, (size_t)hq * d);
    float *bufa = tu_kv_out(&oa, hkv, 400, d), *bufm = tu_kv_out(&om, hkv, 400, d);
    char path[512], other[512];
    size_t own, shared;
    pid_t pid;
    int l, s, st = 0;
    tu_tmp_path(path, sizeof path, "map_rename");
    tu_tmp_path(other, sizeof other, "map_resave");
    ASSERT(bufa && bufm);
    cd.kv_dtype = PQC_F16;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(a, L, k, v, 300, (size_t)hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &m));
    pqc_cache_host_memory(m, &own, &shared);
    ASSERT(shared > 0); /* mapped */
    /* another cache saved under the same name: renamed over it */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &z));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(z, L, v, k, 300, (size_t)hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(z, path));
    pqc_cache_destroy(z);
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(a, &sa));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(m, &sm));
    for (s = 0; s < 4; s++)
        for (l = 0; l < L; l++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(a, l, q + (size_t)s * hq * d, &sa));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(a, l, &sa, &oa));
            CHECK_CALL(same_step(m, l, q + (size_t)s * hq * d, &sa, &sm, &oa, &om, d));
        }
    pqc_selection_free(&sm);
    pqc_cache_destroy(m);
    /* truncation, in a child */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    fflush(NULL);
    pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        pqc_cache *c = NULL;
        pqc_selection sc;
        signal(SIGBUS, SIG_DFL); /* not a sanitizer's handler: the plain outcome */
        if (pqc_cache_load(NULL, &cd, path, &c) != PQC_SUCCESS || pqc_selection_init(c, &sc) != PQC_SUCCESS) _exit(3);
        if (truncate(path, 0) != 0) _exit(4);
        for (l = 0; l < L; l++)
            if (pqc_cache_select(c, l, q, &sc) != PQC_SUCCESS || pqc_cache_fetch(c, l, &sc, &oa) != PQC_SUCCESS) _exit(5);
        (void)pqc_cache_save(c, other);
        _exit(0); /* survived: not what the documentation says */
    }
    ASSERT_EQ(pid, waitpid(pid, &st, 0));
    ASSERTm("the child reading rows of a truncated mapped file was not killed by SIGBUS",
            WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS);
    remove(path);
    remove(other);
    pqc_selection_free(&sa);
    pqc_cache_destroy(a);
    free(k);
    free(v);
    free(q);
    free(bufa);
    free(bufm);
    PASS();
}

TEST loaded_cache_maps_its_file(void)
{
    const int L = 2, hkv = 2, hq = 4, d = 32;
    pqc_cache_desc cd = tu_cache_desc(L, hkv, hq, d);
    pqc_cache *a, *b, *e, *f;
    pqc_selection sa, sb;
    pqc_kv_out oa, ob;
    float *k = tu_normal_rows(&g_rng, 400, (size_t)hkv * d), *v = tu_normal_rows(&g_rng, 400, (size_t)hkv * d), *q = tu_normal_rows(&g_rng, 40, (size_t)hq * d);
    float *bufa = tu_kv_out(&oa, hkv, 500, d), *bufb = tu_kv_out(&ob, hkv, 500, d);
    char path[512];
    size_t own, shared;
    long bytes;
    int l, s;
    tu_tmp_path(path, sizeof path, "map_file");
    ASSERT(bufa && bufb);
    cd.kv_dtype = PQC_F16;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &a));
    ASSERT_EQ(PQC_SUCCESS, prefill_all(a, L, k, v, 300, (size_t)hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, 0, k + (size_t)300 * hkv * d, v + (size_t)300 * hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path)); /* layer 0 holds one token more */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &b));
    pqc_cache_host_memory(b, &own, &shared);
    ASSERT_EQ(0u, shared); /* copied */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, 1, k + (size_t)300 * hkv * d, v + (size_t)300 * hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(b, 1, k + (size_t)300 * hkv * d, v + (size_t)300 * hkv * d));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(a, path));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &e));
    {
        FILE *fp = fopen(path, "rb");
        ASSERT(fp);
        fseek(fp, 0, SEEK_END);
        bytes = ftell(fp);
        fclose(fp);
    }
    pqc_cache_host_memory(e, &own, &shared);
    ASSERT_EQ((size_t)bytes, shared); /* mapped: the file's pages */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(e, &f));
    pqc_cache_host_memory(f, &own, &shared);
    ASSERT_EQ((size_t)bytes, shared);
    pqc_cache_destroy(e);
    remove(path); /* the mapping outlives the name */
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(a, &sa));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(b, &sb));
    for (s = 0; s < 30; s++)
        for (l = 0; l < L; l++) {
            const float *kk = k + (size_t)(301 + s) * hkv * d, *vv = v + (size_t)(301 + s) * hkv * d;
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(a, l, kk, vv));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(b, l, kk, vv));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(f, l, kk, vv));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(a, l, q + (size_t)s * hq * d, &sa));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_fetch(a, l, &sa, &oa));
            CHECK_CALL(same_step(b, l, q + (size_t)s * hq * d, &sa, &sb, &oa, &ob, d));
            CHECK_CALL(same_step(f, l, q + (size_t)s * hq * d, &sa, &sb, &oa, &ob, d));
        }
    pqc_selection_free(&sa);
    pqc_selection_free(&sb);
    pqc_cache_destroy(a);
    pqc_cache_destroy(b);
    pqc_cache_destroy(f);
    free(k);
    free(v);
    free(q);
    free(bufa);
    free(bufb);
    PASS();
}

SUITE(cache)
{
    RUN_TEST(forks_decode_like_unshared_caches);
    RUN_TEST(head_plan_shows_the_scores_and_shares_a_select_uses);
    RUN_TEST(forks_decode_like_unshared_caches_exact_scoring);
    RUN_TEST(forks_decode_like_unshared_caches_exact_scoring_odd_rows);
    RUN_TEST(decode_steps_without_allocating_default);
    RUN_TEST(decode_steps_without_allocating_exact_scoring);
    RUN_TEST(forks_hold_the_prefix_once);
    RUN_TEST(forks_live_on_other_threads);
    RUN_TEST(fork_misuse_is_refused);
    RUN_TEST(loaded_cache_maps_its_file);
    RUN_TEST(mapped_file_survives_rename_over_and_truncation_is_sigbus);
    RUN_TEST(save_load_resumes_decoding);
    RUN_TEST(rerank_factor_follows_how_well_the_codebook_ranks);
    RUN_TEST(save_load_resumes_with_exact_scoring);
    RUN_TEST(softmax_scale_selects_as_scaled_keys);
    RUN_TEST(softmax_scale_selects_as_scaled_keys_exact_scoring);
    RUN_TEST(softmax_scale_changes_the_ranking_across_heads);
    RUN_TEST(softmax_scale_is_saved_and_loaded);
    RUN_TEST(save_load_refuses_bad_files);
    RUN_TEST(save_load_refuses_a_crafted_drift_state);
    RUN_TEST(stored_rows_check_finds_every_bad_value);
    RUN_TEST(sinks_and_window_always_selected);
    RUN_TEST(needle_found_after_thousands_of_appends);
    RUN_TEST(full_budget_selects_everything_exactly);
    RUN_TEST(eviction_orders_match_reference);
    RUN_TEST(wide_rows_stored_as_converted);
    RUN_TEST(fetch_rows_match_fetch);
    RUN_TEST(fetch_streams_the_same_rows);
    RUN_TEST(engine_backend_holds_the_slots_and_its_copies_are_the_traffic);
    RUN_TEST(scheduler_recovers_coefficients_and_clips);
    RUN_TEST(async_builds_and_destroy_during_build);
    RUN_TEST(growth_waits_for_other_layers_builds);
    RUN_TEST(job_error_surfaces_at_next_call);
    RUN_TEST(multi_turn_codes_then_rebuilds);
    RUN_TEST(batch_matches_individual);
    RUN_TEST(bad_inputs_leave_cache_intact);
    RUN_TEST(driver_runs_both_algorithms);
    RUN_TEST(driver_decode_steps_without_allocating);
    RUN_TEST(driver_runs_both_algorithms_fp16_rows);
    RUN_TEST(driver_runs_both_algorithms_bf16_rows);
    RUN_TEST(head_slices_build_like_one_cache);
    RUN_TEST(head_slices_build_like_one_cache_window_competes);
}

#ifndef PQC_TEST_UNITY /* tests/test_lib.c holds every suite in one program */
GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(cache);
    GREATEST_MAIN_END();
}
#endif
