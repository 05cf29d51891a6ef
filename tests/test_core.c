/* Core tests: PQ training, codes, lookup tables, search, top-k, kernels, bad input. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "greatest.h"
#include "synth.h"
#include "test_size.h"
#include "test_util.h"

#include <pthread.h>

/* ----- helpers ----------------------------------------------------------------------- */

static double sqdist(const float *a, const float *b, int d)
{
    double s = 0;
    int i;
    for (i = 0; i < d; i++) s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return s;
}

/* SIMD levels this processor offers, scalar first */
static int simd_levels(pqc_simd *out)
{
    int n = 0;
    pqc_simd best = pqc_cpu_best_simd();
    out[n++] = PQC_SIMD_SCALAR;
    if (best == PQC_SIMD_AVX2 || best == PQC_SIMD_AVX512) out[n++] = PQC_SIMD_AVX2;
    if (best == PQC_SIMD_AVX512) out[n++] = PQC_SIMD_AVX512;
    if (best == PQC_SIMD_NEON) out[n++] = PQC_SIMD_NEON;
    return n;
}

/* ----- basics ------------------------------------------------------------------------ */

TEST version_and_messages(void)
{
    ASSERT_STR_EQ(PQCACHE_VERSION_STRING, pqc_version());
    ASSERT_EQ(PQCACHE_VERSION_MAJOR * 10000u + PQCACHE_VERSION_MINOR * 100u + PQCACHE_VERSION_PATCH,
              pqc_version_number());
    ASSERT_STR_EQ("success", pqc_result_description(PQC_SUCCESS));
    ASSERT_STR_EQ("out of memory", pqc_result_description(PQC_ERROR_OUT_OF_MEMORY));
    ASSERT_STR_EQ("unknown result code", pqc_result_description((pqc_result)-999));
    PASS();
}

TEST half_conversions(void)
{
    static const float vals[] = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 0.333333f, 1e-3f};
    size_t i;
    uint32_t u;
    for (i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        float f = vals[i], h = pqc_f16_to_f32(pqc_f32_to_f16(f)), b = pqc_bf16_to_f32(pqc_f32_to_bf16(f));
        ASSERT_IN_RANGE(f, h, fabsf(f) * 1e-3f + 1e-7f);
        ASSERT_IN_RANGE(f, b, fabsf(f) * 8e-3f);
    }
    /* exhaustive round trip of every finite half value */
    for (u = 0; u < 0x10000u; u++) {
        uint16_t hv = (uint16_t)u;
        if ((hv & 0x7c00u) == 0x7c00u) continue;
        ASSERT_EQ_FMT((unsigned)hv, (unsigned)pqc_f32_to_f16(pqc_f16_to_f32(hv)), "%u");
    }
    ASSERT(isinf(pqc_f16_to_f32(pqc_f32_to_f16(1e6f))));
    ASSERT(isnan(pqc_f16_to_f32(pqc_f32_to_f16(NAN))));
    ASSERT(isnan(pqc_bf16_to_f32(pqc_f32_to_bf16(NAN))));
    ASSERT_EQ(0x3c00u, (unsigned)pqc_f32_to_f16(1.0f));
    ASSERT_EQ(0x3f80u, (unsigned)pqc_f32_to_bf16(1.0f));
    PASS();
}

/* ----- k-means ----------------------------------------------------------------------- */

TEST kmeans_objective_monotone_and_beats_random(void)
{
    synth sy;
    pqc_pq pq, rnd;
    pqc_pq_desc d = tu_pq_desc(4, 6, 12, 7);
    double obj[4 * 13], mse_trained, mse_random;
    pqc_matrix keys;
    int j, it;
    memset(&sy, 0, sizeof sy);
    sy.s = TEST_SIZE(6000, 2000);
    sy.d = 64;
    sy.g = 1;
    sy.n_needles = 3;
    sy.seed = 11;
    ASSERT_EQ(0, synth_make(&sy));
    keys = pqc_matrix_f32(sy.keys, sy.s, 64);
    d.objective = obj;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    for (j = 0; j < 4; j++)
        for (it = 1; it <= 12; it++) ASSERT_LTE(obj[j * 13 + it], obj[j * 13 + it - 1] * (1 + 1e-9) + 1e-9);
    /* at least one sub-space improved substantially over its initialisation */
    ASSERT_LT(obj[12], obj[0]);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_mse(NULL, &pq, &keys, &mse_trained));
    /* the summed sub-space objectives are the mean reconstruction error */
    ASSERT_IN_RANGE(obj[12] + obj[25] + obj[38] + obj[51], mse_trained, mse_trained * 1e-3);
    /* a codebook of random keys (0 iterations, random init) is clearly worse */
    d = tu_pq_desc(4, 6, -1, 7);
    d.init = PQC_INIT_RANDOM;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &rnd));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_mse(NULL, &rnd, &keys, &mse_random));
    ASSERT_LT(mse_trained * 1.2, mse_random);
    pqc_pq_free(&pq);
    pqc_pq_free(&rnd);
    synth_free(&sy);
    PASS();
}

TEST kmeans_few_distinct_keys(void)
{
    /* 3 distinct keys repeated, 16 centroids: no crash, zero error, codes exact */
    float x[30 * 8];
    pqc_pq pq;
    pqc_pq_desc d = tu_pq_desc(2, 4, 5, 1);
    pqc_matrix keys = pqc_matrix_f32(x, 30, 8);
    double mse;
    int i, e, init;
    for (init = 0; init < 2; init++) {
        for (i = 0; i < 30; i++)
            for (e = 0; e < 8; e++) x[i * 8 + e] = (float)((i % 3) * 10 + e);
        d.init = (pqc_init)init;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_mse(NULL, &pq, &keys, &mse));
        ASSERT_IN_RANGE(0.0, mse, 1e-9);
        pqc_pq_free(&pq);
    }
    /* a single key */
    keys.rows = 1;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    pqc_pq_free(&pq);
    PASS();
}

TEST kmeans_reproducible(void)
{
    synth sy;
    pqc_pq a, b, c;
    pqc_pq_desc d = tu_pq_desc(4, 5, 6, 99);
    pqc_matrix keys;
    pqc_runtime *r1 = tu_cpu_runtime(-1), *r2 = tu_cpu_runtime(2);
    size_t n;
    memset(&sy, 0, sizeof sy);
    sy.s = 3000;
    sy.d = 32;
    sy.g = 1;
    sy.n_needles = 2;
    sy.seed = 5;
    ASSERT(r1 && r2);
    ASSERT_EQ(0, synth_make(&sy));
    keys = pqc_matrix_f32(sy.keys, sy.s, 32);
    d.max_points_per_centroid = 40; /* forces sampling */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(r1, &d, &keys, &a));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(r2, &d, &keys, &b));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(r2, &d, &keys, &c));
    n = (size_t)a.m * a.ksub * a.dsub * sizeof(float);
    ASSERT_MEM_EQ(a.centroids, b.centroids, n);
    ASSERT_MEM_EQ(a.centroids, c.centroids, n);
    pqc_pq_free(&c);
    d.seed = 100; /* another seed gives another codebook */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(r2, &d, &keys, &c));
    ASSERT(memcmp(a.centroids, c.centroids, n) != 0);
    pqc_pq_free(&a);
    pqc_pq_free(&b);
    pqc_pq_free(&c);
    pqc_runtime_destroy(r1);
    pqc_runtime_destroy(r2);
    synth_free(&sy);
    PASS();
}

TEST half_precision_keys(void)
{
    /* fp16 / bf16 keys with a row stride train to nearly the fp32 result */
    synth sy;
    uint16_t *h16, *b16;
    size_t t, stride = 40; /* 40 elements per row, 32 used */
    int e, dt;
    double m32, mh;
    pqc_pq p32, ph;
    pqc_pq_desc d = tu_pq_desc(2, 4, 8, 3);
    pqc_matrix k32, kh;
    memset(&sy, 0, sizeof sy);
    sy.s = 2000;
    sy.d = 32;
    sy.g = 1;
    sy.seed = 8;
    ASSERT_EQ(0, synth_make(&sy));
    h16 = (uint16_t *)calloc(sy.s * stride, 2);
    b16 = (uint16_t *)calloc(sy.s * stride, 2);
    ASSERT(h16 && b16);
    for (t = 0; t < sy.s; t++)
        for (e = 0; e < 32; e++) {
            h16[t * stride + e] = pqc_f32_to_f16(sy.keys[t * 32 + e]);
            b16[t * stride + e] = pqc_f32_to_bf16(sy.keys[t * 32 + e]);
        }
    k32 = pqc_matrix_f32(sy.keys, sy.s, 32);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &k32, &p32));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_mse(NULL, &p32, &k32, &m32));
    for (dt = 1; dt <= 2; dt++) {
        kh.data = dt == 1 ? (const void *)h16 : (const void *)b16;
        kh.dtype = (pqc_dtype)dt;
        kh.rows = sy.s;
        kh.cols = 32;
        kh.row_stride = stride * 2;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &kh, &ph));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_mse(NULL, &ph, &k32, &mh));
        ASSERT_LT(mh, m32 * 1.10);
        pqc_pq_free(&ph);
    }
    pqc_pq_free(&p32);
    free(h16);
    free(b16);
    synth_free(&sy);
    PASS();
}

/* ----- codes ------------------------------------------------------------------------- */

TEST codes_are_nearest_centroids(void)
{
    synth sy;
    int bits;
    memset(&sy, 0, sizeof sy);
    sy.s = 1500;
    sy.d = 24;
    sy.g = 1;
    sy.seed = 21;
    ASSERT_EQ(0, synth_make(&sy));
    for (bits = 1; bits <= 8; bits++) {
        pqc_pq pq;
        pqc_codes codes;
        pqc_pq_desc d = tu_pq_desc(3, bits, 4, (uint64_t)bits);
        pqc_matrix keys = pqc_matrix_f32(sy.keys, sy.s, 24);
        size_t t;
        int j, c;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, 0, NULL));
        /* encode in two batches to exercise appending at unaligned bit offsets */
        keys.rows = 777;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
        keys.data = sy.keys + 777 * 24;
        keys.rows = sy.s - 777;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
        ASSERT_EQ(sy.s, codes.count);
        ASSERT_EQ((size_t)3 * ((sy.s * (size_t)bits + 7) / 8), pqc_codes_bytes(&codes));
        for (t = 0; t < sy.s; t++)
            for (j = 0; j < 3; j++) {
                /* brute force in double precision; accept a float-rounding tie */
                const float *x = sy.keys + t * 24 + j * 8;
                double best = 1e300, got;
                for (c = 0; c < pq.ksub; c++) {
                    double dd = sqdist(x, pq.centroids + ((size_t)j * pq.ksub + c) * 8, 8);
                    if (dd < best) best = dd;
                }
                got = sqdist(x, pq.centroids + ((size_t)j * pq.ksub + pqc_codes_get(&codes, t, j)) * 8, 8);
                ASSERT_IN_RANGE(best, got, 1e-4 * (1.0 + best));
            }
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
    }
    synth_free(&sy);
    PASS();
}

/* ----- lookup tables and search ------------------------------------------------------ */

TEST lut_scores_equal_reconstructed_dots(void)
{
    synth sy;
    pqc_pq pq;
    pqc_codes codes;
    pqc_pq_desc d = tu_pq_desc(4, 6, 5, 2);
    pqc_search_desc sd;
    pqc_matrix keys;
    float *scores, rec[64];
    size_t t;
    int e;
    memset(&sy, 0, sizeof sy);
    sy.s = 2000;
    sy.d = 64;
    sy.g = 1;
    sy.n_needles = 2;
    sy.seed = 4;
    ASSERT_EQ(0, synth_make(&sy));
    keys = pqc_matrix_f32(sy.keys, sy.s, 64);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, sy.s, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
    scores = (float *)malloc(sy.s * sizeof(float));
    memset(&sd, 0, sizeof sd);
    sd.gqa = PQC_GQA_SUM;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_scores(NULL, &pq, &codes, sy.queries, 1, &sd, NULL, scores));
    for (t = 0; t < sy.s; t++) {
        double ref = 0;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_decode(&pq, &codes, t, rec));
        for (e = 0; e < 64; e++) ref += (double)rec[e] * sy.queries[e];
        ASSERT_IN_RANGE(ref, scores[t], 1e-4 * (1.0 + fabs(ref)));
    }
    free(scores);
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    synth_free(&sy);
    PASS();
}

typedef struct ref_item {
    float s;
    uint32_t i;
} ref_item;
static int ref_cmp(const void *a, const void *b)
{
    const ref_item *x = (const ref_item *)a, *y = (const ref_item *)b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}
static int u32_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : (x > y);
}

/* sort-based reference top-k: k indices ascending, ties to the lower index */
static void ref_topk(const float *s, size_t n, size_t k, uint32_t *out)
{
    ref_item *it = (ref_item *)malloc(n * sizeof *it);
    size_t i;
    for (i = 0; i < n; i++) {
        it[i].s = s[i];
        it[i].i = (uint32_t)i;
    }
    qsort(it, n, sizeof *it, ref_cmp);
    for (i = 0; i < k; i++) out[i] = it[i].i;
    qsort(out, k, sizeof *out, u32_cmp);
    free(it);
}

TEST topk_matches_sort_reference(void)
{
    size_t sizes[] = {1, 2, 17, 1000, 20011, 40000}; /* the last two sampled and bracketed */
    uint64_t st = 77;
    size_t si;
    pqc_scratch scr;
    memset(&scr, 0, sizeof scr);
    for (si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si], ks[5], ki, i;
        float *s = (float *)malloc(n * sizeof(float)), *vals = (float *)malloc(n * sizeof(float));
        uint32_t *got = (uint32_t *)malloc(n * sizeof(uint32_t)), *ref = (uint32_t *)malloc(n * sizeof(uint32_t));
        int dist;
        ks[0] = 1;
        ks[1] = n / 10 + 1;
        ks[2] = n / 2 + 1;
        ks[3] = n > 1 ? n - 1 : 1;
        ks[4] = n;
        for (dist = 0; dist < 6; dist++) {
            for (i = 0; i < n; i++) {
                switch (dist) {
                case 0: s[i] = synth__normal(&st); break;                       /* continuous */
                case 1: s[i] = (float)(synth__next(&st) % 7) - 3.0f; break;     /* heavy ties */
                case 2: s[i] = 1.5f; break;                                     /* all equal */
                case 3: s[i] = (i % 2 ? -1.0f : 1.0f) * (float)(i % 13) * 1e-30f; break; /* signs, tiny */
                case 4: /* a narrow range (the scores of one search), a few keys apart at most */
                    s[i] = 1e-4f * (1.0f + 0.5f * (float)(synth__next(&st) % 1000000) * 1e-6f) +
                           (float)(synth__next(&st) % 3) * 1e-12f;
                    break;
                default: /* every magnitude and both infinities */
                    s[i] = i % 97 == 0 ? (i % 2 ? -INFINITY : INFINITY)
                                       : (i % 2 ? -1.0f : 1.0f) * ldexpf(1.0f, (int)(synth__next(&st) % 250) - 125);
                }
            }
            for (ki = 0; ki < 5; ki++) {
                size_t k = ks[ki];
                pqc_simd lv[3];
                int nl = simd_levels(lv), li;
                if (k == 0 || k > n) continue;
                ref_topk(s, n, k, ref);
                for (li = 0; li <= nl; li++) { /* the best level (no runtime), then each level */
                    pqc_runtime *rt = li == nl ? NULL : tu_cpu_runtime_simd(-1, lv[li]);
                    ASSERT(li == nl || rt != NULL);
                    ASSERT_EQ(PQC_SUCCESS, pqc_topk(rt, s, n, k, &scr, got, vals));
                    pqc_runtime_destroy(rt);
                    ASSERT_MEM_EQ(ref, got, k * sizeof(uint32_t));
                    for (i = 0; i < k; i++) ASSERT_EQ(s[got[i]], vals[i]);
                }
            }
        }
        free(s);
        free(vals);
        free(got);
        free(ref);
    }
    pqc_scratch_free(&scr);
    PASS();
}

TEST needles_always_retrieved(void)
{
    uint64_t seed;
    for (seed = 1; seed <= (uint64_t)TEST_SIZE(4, 1); seed++) {
        synth sy;
        pqc_pq pq;
        pqc_codes codes;
        pqc_pq_desc d = tu_pq_desc(2, 6, 8, seed);
        pqc_search_desc sd;
        pqc_matrix keys;
        uint32_t *idx;
        int gq;
        memset(&sy, 0, sizeof sy);
        sy.s = TEST_SIZE(20000, 4000);
        sy.d = 128;
        sy.g = 4;
        sy.n_needles = 5;
        sy.seed = seed;
        ASSERT_EQ(0, synth_make(&sy));
        keys = pqc_matrix_f32(sy.keys, sy.s, 128);
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, sy.s, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
        memset(&sd, 0, sizeof sd);
        sd.k = 64; /* far below s/10: the needles must rank at the very top */
        idx = (uint32_t *)malloc(sd.k * sizeof(uint32_t));
        for (gq = 0; gq < 2; gq++) {
            sd.gqa = (pqc_gqa)gq;
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, sy.queries, 4, &sd, NULL, idx, NULL));
            ASSERT_IN_RANGE(1.0, pqc_recall(sy.needles, 5, idx, sd.k), 1e-12);
        }
        free(idx);
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
        synth_free(&sy);
    }
    PASS();
}

TEST exact_search_matches_reference(void)
{
    synth sy;
    pqc_search_desc sd;
    pqc_matrix keys;
    float *sc;
    uint32_t *idx, *ref;
    size_t t;
    int e, h;
    memset(&sy, 0, sizeof sy);
    sy.s = 3000;
    sy.d = 40;
    sy.g = 3;
    sy.n_needles = 2;
    sy.seed = 12;
    ASSERT_EQ(0, synth_make(&sy));
    keys = pqc_matrix_f32(sy.keys, sy.s, 40);
    sc = (float *)malloc(sy.s * sizeof(float));
    idx = (uint32_t *)malloc(300 * sizeof(uint32_t));
    ref = (uint32_t *)malloc(300 * sizeof(uint32_t));
    /* softmax-sum scores against a double-precision reference */
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_scores(NULL, &keys, sy.queries, 3, PQC_GQA_SOFTMAX_SUM, NULL, sc));
    {
        double *p = (double *)calloc(sy.s, sizeof(double));
        for (h = 0; h < 3; h++) {
            double mx = -1e300, z = 0;
            double *s = (double *)malloc(sy.s * sizeof(double));
            for (t = 0; t < sy.s; t++) {
                s[t] = 0;
                for (e = 0; e < 40; e++) s[t] += (double)sy.queries[h * 40 + e] * sy.keys[t * 40 + e];
                s[t] /= sqrt(40.0);
                if (s[t] > mx) mx = s[t];
            }
            for (t = 0; t < sy.s; t++) z += exp(s[t] - mx);
            for (t = 0; t < sy.s; t++) p[t] += exp(s[t] - mx) / z;
            free(s);
        }
        for (t = 0; t < sy.s; t++) ASSERT_IN_RANGE(p[t], sc[t], 1e-5 + 1e-4 * p[t]);
        free(p);
    }
    memset(&sd, 0, sizeof sd);
    sd.k = 300;
    sd.gqa = PQC_GQA_SUM;
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_scores(NULL, &keys, sy.queries, 3, PQC_GQA_SUM, NULL, sc));
    ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &keys, sy.queries, 3, &sd, NULL, idx, NULL));
    ref_topk(sc, sy.s, 300, ref);
    ASSERT_MEM_EQ(ref, idx, 300 * sizeof(uint32_t));
    ASSERT_IN_RANGE(1.0, pqc_recall(sy.needles, 2, idx, 300), 1e-12);
    free(sc);
    free(idx);
    free(ref);
    synth_free(&sy);
    PASS();
}

/* ----- SIMD and threads agree exactly ------------------------------------------------ */

TEST simd_matches_scalar(void)
{
    pqc_simd lv[3];
    int nl = simd_levels(lv), li, bits, gq;
    synth sy;
    memset(&sy, 0, sizeof sy);
    sy.s = TEST_SIZE(4099, 515); /* not a multiple of 16; twice the 256 centroids of 8 bits */
    sy.d = 48;
    sy.g = 3;
    sy.n_needles = 2;
    sy.seed = 31;
    ASSERT_EQ(0, synth_make(&sy));
    if (nl == 1) {
        synth_free(&sy);
        SKIPm("no SIMD level on this processor");
    }
    for (bits = 1; bits <= 8; bits++) {
        pqc_pq pq[3];
        pqc_codes codes[3];
        float *sc[3];
        uint32_t *ix[3];
        pqc_matrix keys = pqc_matrix_f32(sy.keys, sy.s, 48);
        pqc_pq_desc d = tu_pq_desc(bits == 8 ? 2 : 3, bits, 4, 17);
        pqc_search_desc sd;
        memset(&sd, 0, sizeof sd);
        sd.k = TEST_SIZE(410, 52);
        for (li = 0; li < nl; li++) {
            pqc_runtime *rt = tu_cpu_runtime_simd(-1, lv[li]);
            ASSERT(rt);
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(rt, &d, &keys, &pq[li]));
            ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes[li], &pq[li], 0, NULL));
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(rt, &pq[li], &keys, &codes[li]));
            sc[li] = (float *)malloc(sy.s * sizeof(float) * 2);
            ix[li] = (uint32_t *)malloc(sd.k * sizeof(uint32_t) * 2);
            for (gq = 0; gq < 2; gq++) {
                sd.gqa = (pqc_gqa)gq;
                /* odd sub-range start exercises unaligned packed codes */
                sd.first = gq ? 3 : 0;
                sd.count = gq ? sy.s - 3 : 0;
                ASSERT_EQ(PQC_SUCCESS, pqc_pq_scores(rt, &pq[li], &codes[li], sy.queries, 3, &sd, NULL, sc[li] + gq * sy.s));
                ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(rt, &pq[li], &codes[li], sy.queries, 3, &sd, NULL, ix[li] + gq * sd.k, NULL));
                if (gq == 0) { /* the search (softmax-sum at 8 bits: the heads' rows made in
                                  its scores, head 0's combined in place) chooses the top-k
                                  of the scores */
                    uint32_t *tk = (uint32_t *)malloc(sd.k * sizeof(uint32_t));
                    ASSERT(tk);
                    ASSERT_EQ(PQC_SUCCESS, pqc_topk(rt, sc[li], sy.s, sd.k, NULL, tk, NULL));
                    ASSERT_MEM_EQ(tk, ix[li], sd.k * sizeof(uint32_t));
                    free(tk);
                }
            }
            pqc_runtime_destroy(rt);
            if (li > 0) {
                size_t cb = (size_t)pq[0].m * pq[0].ksub * pq[0].dsub * sizeof(float);
                int j;
                ASSERT_MEM_EQ(pq[0].centroids, pq[li].centroids, cb);
                for (j = 0; j < codes[0].m; j++)
                    ASSERT_MEM_EQ(codes[0].data + j * codes[0].col_stride, codes[li].data + j * codes[li].col_stride,
                                  (sy.s * (size_t)bits + 7) / 8);
                /* bit-identical kernels: scores equal exactly (tolerance stated as 0) */
                ASSERT_MEM_EQ(sc[0], sc[li], sy.s * sizeof(float) + (sy.s - 3) * sizeof(float));
                ASSERT_MEM_EQ(ix[0], ix[li], 2 * sd.k * sizeof(uint32_t));
            }
        }
        for (li = 0; li < nl; li++) {
            pqc_pq_free(&pq[li]);
            pqc_codes_free(&codes[li]);
            free(sc[li]);
            free(ix[li]);
        }
    }
    /* exact path as well */
    {
        float *e[3];
        pqc_matrix keys = pqc_matrix_f32(sy.keys, sy.s, 48);
        for (li = 0; li < nl; li++) {
            pqc_runtime *rt = tu_cpu_runtime_simd(-1, lv[li]);
            e[li] = (float *)malloc(sy.s * sizeof(float));
            ASSERT_EQ(PQC_SUCCESS, pqc_exact_scores(rt, &keys, sy.queries, 3, PQC_GQA_SOFTMAX_SUM, NULL, e[li]));
            pqc_runtime_destroy(rt);
            if (li) ASSERT_MEM_EQ(e[0], e[li], sy.s * sizeof(float));
        }
        for (li = 0; li < nl; li++) free(e[li]);
    }
    synth_free(&sy);
    PASS();
}

/* Softmax-sum of 8-bit codes (two or more heads) takes each head's exponentials as
   products of per-sub-space tables: every level makes the same bits, each score is the
   exponentials' of the sums (pqc__scan_heads + pqc__softmax_rows) to a few units in the
   last place, and the selection is theirs; with four heads, three (padded to the scan's
   group of four) and eight (two groups). Queries whose sub-spaces' best entries add up far beyond any
   token's score leave the products too small: those searches take the exponentials of
   the sums, bit for bit. */
static void sums_softmax(pqc_simd simd, const pqc_pq *pq, const pqc_codes *codes, const float *q, int g, size_t n,
                         float *rows, float *out)
{
    size_t tl = (size_t)pq->m * pq->ksub, i;
    float *lut = (float *)malloc(sizeof(float) * tl * 16), *il = lut + tl * 8, mx[8], w[8];
    int h;
    pqc_pq_lut(NULL, pq, q, g, lut);
    for (h = 0; h < g; h++) {
        for (i = 0; i < tl; i++) il[i * (size_t)g + (size_t)h] = lut[(size_t)h * tl + i];
        mx[h] = -INFINITY;
    }
    pqc__k_scan_heads(simd, codes, il, pq->ksub, g, 0, n, rows, n, mx);
    pqc__softmax_rows(simd, rows, n, g, mx, 1.0f / sqrtf((float)pq->dim), w, out);
    free(lut);
}

TEST softmax_products_match_exponentials(void)
{
    pqc_simd lv[3];
    int nl = simd_levels(lv), li, gi;
    synth sy;
    pqc_pq pq;
    pqc_codes codes;
    pqc_matrix keys;
    pqc_pq_desc d = tu_pq_desc(4, 8, 3, 19);
    pqc_search_desc sd;
    size_t n, k, t;
    float *sc[3], *rows, *ref, *q;
    uint32_t *ix, *rx;
    memset(&sy, 0, sizeof sy);
    sy.s = TEST_SIZE(4099, 1030);
    sy.d = 64;
    sy.g = 4;
    sy.n_needles = 2;
    sy.seed = 37;
    ASSERT_EQ(0, synth_make(&sy));
    n = sy.s;
    k = n / 10;
    keys = pqc_matrix_f32(sy.keys, n, 64);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, 0, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
    for (li = 0; li < nl; li++) sc[li] = (float *)malloc(n * sizeof(float));
    rows = (float *)malloc(8 * n * sizeof(float));
    ref = (float *)malloc(n * sizeof(float));
    q = (float *)malloc(8 * 64 * sizeof(float));
    ix = (uint32_t *)malloc(2 * k * sizeof(uint32_t));
    rx = ix + k;
    memset(&sd, 0, sizeof sd);
    sd.gqa = PQC_GQA_SOFTMAX_SUM;
    sd.k = k;
    for (gi = 0; gi < 6; gi++) {
        const int g = gi < 2 ? 8 : gi < 4 ? 4 : 3, big = gi & 1;
        float worst = 0.0f, el[8192], w[24];
        /* the four synthetic heads, then scaled copies of them */
        for (t = 0; t < 8 * 64; t++) q[t] = sy.queries[t % 256] * (t < 256 ? 1.0f : 1.25f) * (big ? 4000.0f : 1.0f);
        for (li = 0; li < nl; li++) {
            pqc_runtime *rt = tu_cpu_runtime_simd(-1, lv[li]);
            ASSERT(rt);
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_scores(rt, &pq, &codes, q, g, &sd, NULL, sc[li]));
            pqc_runtime_destroy(rt);
            if (li) ASSERT_MEM_EQ(sc[0], sc[li], n * sizeof(float));
        }
        { /* the products stand for the ordinary queries only, and are what the search gave */
            float lut[8192];
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_lut(NULL, &pq, q, g, lut));
            ASSERT_EQ(!big, pqc__pq_softmax_products(lv[0], &pq, &codes, g, 0, n, 0.125f, lut, el, w, rows, NULL, 0, 0,
                                                     NULL, ref));
            if (!big) ASSERT_MEM_EQ(sc[0], ref, n * sizeof(float));
        }
        { /* rivals (a cache's competing window tokens) and tokens in the softmax only: every
             level scores them bit for bit alike, in either form */
            enum { NX = 37, NF = 11 };
            float *xd = (float *)malloc(sizeof(float) * (size_t)g * (NX + NF)), *xo[3];
            int h, e;
            ASSERT(xd != NULL);
            for (h = 0; h < g; h++)
                for (t = 0; t < NX + NF; t++) {
                    float a = 0.0f;
                    for (e = 0; e < 64; e++) a += q[h * 64 + e] * sy.keys[(t * 97 % n) * 64 + (size_t)e];
                    xd[(size_t)h * (NX + NF) + t] = a;
                }
            for (li = 0; li < nl; li++) {
                pqc_runtime *rt = tu_cpu_runtime_simd(-1, lv[li]);
                ASSERT(rt);
                xo[li] = (float *)malloc(sizeof(float) * (n + NX + NF));
                ASSERT(xo[li] != NULL);
                ASSERT_EQ(PQC_SUCCESS, pqc__pq_search_x(rt, &pq, &codes, q, g, &sd, xd, NX, NF, NULL, NULL, NULL, xo[li]));
                pqc_runtime_destroy(rt);
                if (li) ASSERT_MEM_EQ(xo[0], xo[li], (n + NX + NF) * sizeof(float));
            }
            for (t = 0; t < n; t++) /* the rivals join each head's softmax: the coded tokens' scores fall */
                ASSERT(xo[0][t] <= sc[0][t] * 1.00001f);
            for (li = 0; li < nl; li++) free(xo[li]);
            free(xd);
        }
        sums_softmax(lv[0], &pq, &codes, q, g, n, rows, ref);
        if (big) {
            ASSERT_MEM_EQ(ref, sc[0], n * sizeof(float));
            continue;
        }
        for (t = 0; t < n; t++) {
            float e = fabsf(sc[0][t] - ref[t]) / ref[t];
            worst = e > worst ? e : worst;
        }
        ASSERT(worst > 0.0f);   /* the two ways round differently */
        ASSERT(worst < 2e-6f); /* by a few units in the last place */
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, q, g, &sd, NULL, ix, NULL));
        ref_topk(ref, n, k, rx);
        ASSERT_MEM_EQ(rx, ix, k * sizeof(uint32_t));
    }
    for (li = 0; li < nl; li++) free(sc[li]);
    free(rows);
    free(ref);
    free(q);
    free(ix);
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    synth_free(&sy);
    PASS();
}

TEST forced_simd_beyond_cpu_is_refused(void)
{
    pqc_runtime_desc d;
    pqc_runtime *rt = NULL;
    memset(&d, 0, sizeof d);
    d.simd = (pqc_simd)9;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(NULL, rt);
    if (pqc_cpu_best_simd() != PQC_SIMD_AVX512) {
        d.simd = PQC_SIMD_AVX512;
        ASSERT_EQ(PQC_ERROR_UNSUPPORTED, pqc_runtime_create(&d, &rt));
        ASSERT_EQ(NULL, rt);
    }
    /* the x86 levels and NEON exclude each other */
    d.simd = pqc_cpu_best_simd() == PQC_SIMD_NEON ? PQC_SIMD_AVX2 : PQC_SIMD_NEON;
    ASSERT_EQ(PQC_ERROR_UNSUPPORTED, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(NULL, rt);
    ASSERT(strstr(pqc_last_error(), pqc_simd_name(d.simd)) != NULL);
    PASS();
}

TEST cuda_absence_is_a_clean_fallback(void)
{
    pqc_cuda_info ci;
    pqc_runtime_desc d;
    pqc_runtime *rt = NULL;
    if (pqc_cuda_probe(&ci) == PQC_SUCCESS) SKIPm("a CUDA device is present here");
    ASSERT(strlen(ci.message) > 0);
    ASSERT_EQ(0, ci.available);
    memset(&d, 0, sizeof d);
    d.backend = PQC_BACKEND_CUDA; /* asked for explicitly: an error the caller sees */
    ASSERT_EQ(PQC_ERROR_NO_DEVICE, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(NULL, rt);
    ASSERT(strstr(pqc_last_error(), "CUDA backend requested but unavailable") != NULL);
    d.backend = PQC_BACKEND_AUTO; /* falls back to the CPU and says why */
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&d, &rt));
    ASSERT_EQ(PQC_BACKEND_CPU, pqc_runtime_backend(rt));
    ASSERT(strstr(pqc_runtime_backend_note(rt), "CUDA unavailable") != NULL);
    ASSERT(strstr(pqc_runtime_backend_note(rt), "running on the CPU") != NULL);
    pqc_runtime_destroy(rt);
    d.backend = 7;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_runtime_create(&d, &rt));
    PASS();
}

/* ----- bad input --------------------------------------------------------------------- */

TEST bad_inputs(void)
{
    float x[64 * 16] = {0}, q[16] = {0};
    pqc_pq pq, untouched;
    pqc_codes codes;
    pqc_pq_desc d;
    pqc_search_desc sd;
    pqc_matrix keys = pqc_matrix_f32(x, 64, 16);
    uint32_t idx[100];
    size_t i;
    for (i = 0; i < 64 * 16; i++) x[i] = (float)((i * 37) % 11) - 5.0f;
    for (i = 0; i < 16; i++) q[i] = 1.0f;
    memset(&untouched, 0xAB, sizeof untouched);
    pq = untouched;
    d = tu_pq_desc(3, 4, 3, 1); /* 3 does not divide 16 */
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_MEM_EQ(&untouched, &pq, sizeof pq);
    ASSERT(strstr(pqc_last_error(), "does not divide") != NULL);
    d = tu_pq_desc(2, 9, 3, 1);
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &pq));
    d = tu_pq_desc(2, -1, 3, 1);
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &pq));
    d = tu_pq_desc(2, 4, 3, 1);
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_train(NULL, &d, NULL, &pq));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_train(NULL, &d, &keys, NULL));
    keys.rows = 0;
    ASSERT_EQ(PQC_ERROR_EMPTY, pqc_pq_train(NULL, &d, &keys, &pq));
    keys.rows = 64;
    keys.row_stride = 8; /* shorter than a row */
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &d, &keys, &pq));
    keys.row_stride = 0;
    keys.dtype = (pqc_dtype)7;
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_train(NULL, &d, &keys, &pq));
    keys.dtype = PQC_F32;
    x[100] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_pq_train(NULL, &d, &keys, &pq));
    x[100] = INFINITY;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_pq_train(NULL, &d, &keys, &pq));
    x[100] = 1.0f;
    { /* rows off float boundaries are copied before the check; those on them are read
         where they are: the same refusal either way */
        static unsigned char raw[sizeof x + 1];
        pqc_matrix off = keys;
        float bad = NAN;
        memcpy(raw + 1, x, sizeof x);
        memcpy(raw + 1 + 100 * sizeof(float), &bad, sizeof bad);
        off.data = raw + 1;
        ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_pq_train(NULL, &d, &off, &pq));
    }
    ASSERT_MEM_EQ(&untouched, &pq, sizeof pq);

    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, 0, NULL));
    memset(&sd, 0, sizeof sd);
    sd.k = 5;
    ASSERT_EQ(PQC_ERROR_EMPTY, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, idx, NULL)); /* nothing coded */
    x[5] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_pq_encode(NULL, &pq, &keys, &codes));
    ASSERT_EQ((size_t)0, codes.count); /* nothing appended */
    x[5] = 0.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
    keys.cols = 8;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_encode(NULL, &pq, &keys, &codes));
    keys.cols = 16;
    ASSERT_EQ((size_t)64, codes.count);
    sd.k = 65; /* k > s */
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, idx, NULL));
    sd.k = 0;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, idx, NULL));
    sd.k = 5;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, q, 0, &sd, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_search(NULL, &pq, &codes, NULL, 1, &sd, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, NULL, NULL));
    sd.first = 60;
    sd.count = 10;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, idx, NULL));
    sd.first = sd.count = 0;
    q[3] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_exact_search(NULL, &keys, q, 1, &sd, NULL, idx, NULL));
    q[3] = 1.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, q, 1, &sd, NULL, idx, NULL));
    {
        float s3[3] = {1.0f, NAN, 2.0f};
        ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_topk(NULL, s3, 3, 1, NULL, idx, NULL));
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_topk(NULL, s3, 3, 4, NULL, idx, NULL));
        ASSERT_EQ(PQC_ERROR_EMPTY, pqc_topk(NULL, s3, 0, 1, NULL, idx, NULL));
    }
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_decode(&pq, &codes, 64, q));
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    PASS();
}

/* create runtime, train, encode, search, tear down; returns the first failure */
static pqc_result pipeline(tu_failing *fa, const synth *sy, int threads)
{
    pqc_runtime_desc rd;
    pqc_runtime *rt = NULL;
    pqc_pq pq;
    pqc_codes codes;
    pqc_pq_desc d = tu_pq_desc(4, 5, 3, 9);
    pqc_search_desc sd;
    pqc_scratch scr;
    pqc_matrix keys = pqc_matrix_f32(sy->keys, sy->s, (size_t)sy->d);
    uint32_t idx[50];
    pqc_result r;
    memset(&rd, 0, sizeof rd);
    rd.n_threads = threads;
    rd.allocator.alloc = tu_fail_alloc;
    rd.allocator.free = tu_fail_free;
    rd.allocator.user = fa;
    memset(&scr, 0, sizeof scr);
    memset(&sd, 0, sizeof sd);
    sd.k = 50;
    d.max_points_per_centroid = 20;
    if ((r = pqc_runtime_create(&rd, &rt)) != PQC_SUCCESS) return r;
    if ((r = pqc_pq_train(rt, &d, &keys, &pq)) != PQC_SUCCESS) goto out_rt;
    if ((r = pqc_codes_init(&codes, &pq, 0, NULL)) != PQC_SUCCESS) goto out_pq;
    if ((r = pqc_pq_encode(rt, &pq, &keys, &codes)) != PQC_SUCCESS) goto out_codes;
    if ((r = pqc_pq_search(rt, &pq, &codes, sy->queries, sy->g, &sd, &scr, idx, NULL)) != PQC_SUCCESS) goto out_codes;
    if ((r = pqc_exact_search(rt, &keys, sy->queries, sy->g, &sd, &scr, idx, NULL)) != PQC_SUCCESS) goto out_codes;
out_codes:
    pqc_codes_free(&codes);
    pqc_scratch_free(&scr);
out_pq:
    pqc_pq_free(&pq);
out_rt:
    pqc_runtime_destroy(rt);
    return r;
}

TEST allocation_failure_at_every_allocation(void)
{
    synth sy;
    tu_failing fa;
    int threads;
    memset(&sy, 0, sizeof sy);
    sy.s = 700;
    sy.d = 16;
    sy.g = 2;
    sy.seed = 3;
    ASSERT_EQ(0, synth_make(&sy));
    pthread_mutex_init(&fa.mu, NULL);
    for (threads = -1; threads <= 2; threads += 3) {
        long n, total;
        fa.calls = 0;
        fa.fail_at = -1;
        fa.live = 0;
        ASSERT_EQ(PQC_SUCCESS, pipeline(&fa, &sy, threads));
        ASSERT_EQ(0L, fa.live);
        total = fa.calls;
        ASSERT_GT(total, 5L);
        for (n = 0; n < total; n++) {
            pqc_result r;
            fa.calls = 0;
            fa.fail_at = n;
            fa.live = 0;
            r = pipeline(&fa, &sy, threads);
            ASSERT_EQ_FMT((int)PQC_ERROR_OUT_OF_MEMORY, (int)r, "%d");
            ASSERT_EQ_FMT(0L, fa.live, "%ld");
        }
    }
    pthread_mutex_destroy(&fa.mu);
    synth_free(&sy);
    PASS();
}

/* ----- engine-owned pool ------------------------------------------------------------- */

static int inline_submit(void *user, void (*fn)(void *), void *arg)
{
    (*(int *)user)++;
    fn(arg);
    return 0;
}

TEST engine_job_callback(void)
{
    synth sy;
    pqc_runtime_desc rd;
    pqc_runtime *rt;
    pqc_pq a, b;
    pqc_pq_desc d = tu_pq_desc(4, 4, 3, 5);
    pqc_matrix keys;
    int calls = 0;
    memset(&sy, 0, sizeof sy);
    sy.s = 500;
    sy.d = 16;
    sy.g = 1;
    sy.seed = 2;
    ASSERT_EQ(0, synth_make(&sy));
    keys = pqc_matrix_f32(sy.keys, sy.s, 16);
    memset(&rd, 0, sizeof rd);
    rd.submit = inline_submit;
    rd.submit_user = &calls;
    rd.n_threads = 2;
#ifdef PQCACHE_NO_THREADS
    /* without the library's locks, jobs cannot go to another pool: said, not ignored */
    ASSERT_EQ(PQC_ERROR_UNSUPPORTED, pqc_runtime_create(&rd, &rt));
    ASSERT(strstr(pqc_last_error(), "PQCACHE_NO_THREADS") != NULL);
    synth_free(&sy);
    PASS();
#endif
    ASSERT_EQ(PQC_SUCCESS, pqc_runtime_create(&rd, &rt));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(rt, &d, &keys, &a));
    ASSERT_GT(calls, 0);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &b));
    ASSERT_MEM_EQ(a.centroids, b.centroids, (size_t)4 * 16 * 4 * sizeof(float));
    pqc_pq_free(&a);
    pqc_pq_free(&b);
    pqc_runtime_destroy(rt);
    synth_free(&sy);
    PASS();
}

SUITE(core)
{
    RUN_TEST(version_and_messages);
    RUN_TEST(half_conversions);
    RUN_TEST(kmeans_objective_monotone_and_beats_random);
    RUN_TEST(kmeans_few_distinct_keys);
    RUN_TEST(kmeans_reproducible);
    RUN_TEST(half_precision_keys);
    RUN_TEST(codes_are_nearest_centroids);
    RUN_TEST(lut_scores_equal_reconstructed_dots);
    RUN_TEST(topk_matches_sort_reference);
    RUN_TEST(needles_always_retrieved);
    RUN_TEST(exact_search_matches_reference);
    RUN_TEST(simd_matches_scalar);
    RUN_TEST(softmax_products_match_exponentials);
    RUN_TEST(forced_simd_beyond_cpu_is_refused);
    RUN_TEST(cuda_absence_is_a_clean_fallback);
    RUN_TEST(bad_inputs);
    RUN_TEST(allocation_failure_at_every_allocation);
    RUN_TEST(engine_job_callback);
}

#ifndef PQC_TEST_UNITY /* tests/test_lib.c holds every suite in one program */
GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(core);
    GREATEST_MAIN_END();
}
#endif
