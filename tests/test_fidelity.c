/* Fidelity tests: selection measured against exact attention on hard LLM-like keys
   (bench/hardkeys.h), and the score-aware metric that keeps the rare tokens plain PQ
   loses: the PQ core's metric, the cache's observations, the driver's. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "../bench/hardkeys.h"
#include "greatest.h"
#include "test_util.h"

enum { S = 8192, N_OBS = 16, D = HK_D, G = HK_G };

/* ----- helpers ----------------------------------------------------------------------- */

/* the hard data set `i` (0..3: half-split / interleaved x base 1e4 / 5e5) */
static int make_hard(hardkeys *hk, int i, int unrelated)
{
    memset(hk, 0, sizeof *hk);
    hk->s = S;
    hk->level = HK_HARD;
    hk->layout = i / 2 ? HK_INTERLEAVED : HK_HALF;
    hk->base = i % 2 ? 5e5 : 1e4;
    hk->recency = (hk->layout == HK_HALF) == (hk->base < 1e5) ? 1.0 : 0.0;
    hk->n_obs = N_OBS;
    hk->obs_unrelated = unrelated;
    hk->seed = 500 + (uint64_t)i;
    return hk_make(hk);
}

/* per-dimension mean squared observed query (over every row and head), normalised to a
   mean of 1, plus floor */
static void obs_metric(const hardkeys *hk, float floor_, float *w)
{
    double acc[D], tot = 0;
    int e;
    size_t r;
    for (e = 0; e < D; e++) acc[e] = 0;
    for (r = 0; r < (size_t)hk->n_obs * G; r++)
        for (e = 0; e < D; e++) acc[e] += (double)hk->obs[r * D + e] * hk->obs[r * D + e];
    for (e = 0; e < D; e++) tot += acc[e];
    for (e = 0; e < D; e++) w[e] = (float)(acc[e] * D / tot) + floor_;
}

/* rare tokens in `ref` (n indices) and, of those, in `sel` (m indices) */
static void rare_kept(const hardkeys *hk, const uint32_t *ref, size_t n, const uint32_t *sel, size_t m, int *kept,
                      int *in_ref)
{
    int r;
    size_t i;
    *kept = *in_ref = 0;
    for (r = 0; r < hk->n_rare; r++) {
        int a = 0, b = 0;
        for (i = 0; i < n; i++) a |= ref[i] == hk->rare[r];
        for (i = 0; i < m; i++) b |= sel[i] == hk->rare[r];
        *in_ref += a;
        *kept += a && b;
    }
}

/* attention mass (softmax-sum over the g heads, normalised to 1) on the n indices */
static double mass(const float *p, const uint32_t *idx, size_t n)
{
    double a = 0;
    size_t i;
    for (i = 0; i < n; i++) a += p[idx[i]];
    return a;
}

/* the exact attention of hk's queries (softmax-sum over the g heads) normalised to total
   1 into p[S]; with ex, the exact top-S/10 into it */
static int exact_attention(const hardkeys *hk, pqc_scratch *scr, float *p, uint32_t *ex)
{
    pqc_matrix keys = pqc_matrix_f32(hk->keys, S, D);
    pqc_search_desc sd;
    double tot = 0;
    size_t t;
    if (pqc_exact_scores(NULL, &keys, hk->queries, G, PQC_GQA_SOFTMAX_SUM, scr, p) != PQC_SUCCESS) return 0;
    for (t = 0; t < S; t++) tot += p[t];
    for (t = 0; t < S; t++) p[t] = (float)(p[t] / tot);
    memset(&sd, 0, sizeof sd);
    sd.k = S / 10;
    return !ex || pqc_exact_search(NULL, &keys, hk->queries, G, &sd, scr, ex, NULL) == PQC_SUCCESS;
}

/* ----- the PQ core's metric ---------------------------------------------------------- */

TEST metric_codes_each_key_to_its_weighted_nearest_centroid(void)
{
    enum { N = 1200, DD = 16 };
    float *x = (float *)malloc(sizeof(float) * N * DD), w[DD];
    pqc_pq pq;
    pqc_codes codes;
    pqc_pq_desc d = tu_pq_desc(2, 5, 10, 1);
    pqc_matrix keys;
    uint64_t st = 7;
    size_t t;
    int e, j, c;
    ASSERT(x != NULL);
    for (t = 0; t < (size_t)N * DD; t++) x[t] = hk__normal(&st) * (t % DD < 4 ? 0.2f : 2.0f);
    for (e = 0; e < DD; e++) w[e] = e < 4 ? 50.0f : 0.5f + 0.1f * (float)e;
    d.metric = w;
    keys = pqc_matrix_f32(x, N, DD);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT(pq.metric != NULL && pq.metric != w);
    ASSERT_MEM_EQ(w, pq.metric, sizeof w); /* a copy of the caller's weights */
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, N, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
    for (t = 0; t < N; t++)
        for (j = 0; j < 2; j++) {
            /* brute force in double precision; accept a float-rounding tie */
            double best = 1e300, got = 0;
            for (c = 0; c < pq.ksub; c++) {
                double dd = 0;
                for (e = 0; e < 8; e++) {
                    double df = (double)x[t * DD + (size_t)j * 8 + (size_t)e] - pq.centroids[((size_t)j * pq.ksub + c) * 8 + e];
                    dd += w[j * 8 + e] * df * df;
                }
                if (dd < best) best = dd;
                if ((unsigned)c == pqc_codes_get(&codes, t, j)) got = dd;
            }
            ASSERT_IN_RANGE(best, got, 1e-4 * (1.0 + best));
        }
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    free(x);
    PASS();
}

/* m random symmetric positive definite blocks of n x n: A A^T / n + floor I, A with a
   strong shared direction (correlated dims, as queries have) */
static void spd_blocks(int m, int n, float floor_, uint64_t seed, float *w)
{
    uint64_t st = seed;
    int j, a, b, k;
    float *A = (float *)malloc(sizeof(float) * (size_t)n * n);
    for (j = 0; j < m; j++) {
        for (a = 0; a < n * n; a++) A[a] = hk__normal(&st);
        for (a = 0; a < n; a++) A[(size_t)a * n] = 4.0f * (1.0f + 0.1f * (float)a); /* the shared direction */
        for (a = 0; a < n; a++)
            for (b = 0; b <= a; b++) {
                double acc = 0;
                for (k = 0; k < n; k++) acc += (double)A[(size_t)a * n + k] * A[(size_t)b * n + k];
                w[((size_t)j * n + a) * n + b] = w[((size_t)j * n + b) * n + a] = (float)(acc / n) + (a == b ? floor_ : 0.0f);
            }
    }
    free(A);
}

/* (x_j - c)^T W_j (x_j - c) in double over sub-space j's elements (pqc_pq_dim order) */
static double block_dist(const pqc_pq *pq, const float *w, const float *x, int j, int c)
{
    const float *cc = pq->centroids + ((size_t)j * pq->ksub + (size_t)c) * pq->dsub;
    const float *wj = w + (size_t)j * pq->dsub * pq->dsub;
    double acc = 0;
    int a, b;
    for (a = 0; a < pq->dsub; a++)
        for (b = 0; b < pq->dsub; b++)
            acc += ((double)x[pqc_pq_dim(pq, j, a)] - cc[a]) * wj[(size_t)a * pq->dsub + b] *
                   ((double)x[pqc_pq_dim(pq, j, b)] - cc[b]);
    return acc;
}

/* With metric blocks, each key's code is its nearest centroid under (x - c)^T W_j (x - c),
   in both sub-space layouts, and the residual bytes bound that distance's root. */
TEST metric_blocks_code_each_key_to_its_nearest_centroid_under_the_block(void)
{
    enum { N = 1200, DD = 16, M = 2, DS = DD / M };
    float *x = (float *)malloc(sizeof(float) * N * DD), w[M * DS * DS], scale[M];
    uint8_t *rb = (uint8_t *)malloc((size_t)N * M);
    uint64_t st = 11;
    size_t t;
    int layout, j, c;
    ASSERT(x != NULL && rb != NULL);
    for (t = 0; t < (size_t)N * DD; t++) x[t] = hk__normal(&st) * (t % DD < 4 ? 0.3f : 1.5f);
    spd_blocks(M, DS, 0.05f, 3, w);
    for (layout = 0; layout < 2; layout++) {
        pqc_pq pq;
        pqc_codes codes;
        pqc_pq_desc d = tu_pq_desc(M, 5, 10, 1);
        pqc_matrix keys = pqc_matrix_f32(x, N, DD);
        double obj[M * 11], sum[M] = {0, 0};
        if (layout) d.rope = PQC_ROPE_HALF; /* rope bands: sub-space j gathers from both halves */
        d.metric_blocks = w;
        d.objective = obj;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT_EQ(layout, pq.half_bands);
        ASSERT(pq.mblocks != NULL && pq.mblocks != w && pq.metric == NULL);
        ASSERT_MEM_EQ(w, pq.mblocks, sizeof w); /* a copy of the caller's blocks */
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, N, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
        for (j = 0; j < M; j++) scale[j] = 0.0f;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_residuals(NULL, &pq, &codes, 0, &keys, scale, rb));
        for (t = 0; t < N; t++)
            for (j = 0; j < M; j++) {
                double best = 1e300, got = 0;
                unsigned code = pqc_codes_get(&codes, t, j);
                for (c = 0; c < pq.ksub; c++) {
                    double dd = block_dist(&pq, w, x + t * DD, j, c);
                    if (dd < best) best = dd;
                    if ((unsigned)c == code) got = dd;
                }
                ASSERT_IN_RANGE(best, got, 1e-4 * (1.0 + best)); /* a float-rounding tie at most */
                sum[j] += best / N;
                /* the byte is ceil(root / scale): it bounds the root from above */
                ASSERT(sqrt(got) <= (double)rb[t * M + (size_t)j] * scale[j] * (1.0 + 1e-4) + 1e-6);
                ASSERT(sqrt(got) >= ((double)rb[t * M + (size_t)j] - 1.0) * scale[j] * (1.0 - 1e-4) - 1e-6);
            }
        /* the centroids are the training's, in the keys' space: their error under the
           blocks is the k-means objective's last value less its final update's gain */
        for (j = 0; j < M; j++) {
            ASSERT(sum[j] <= obj[j * 11 + 10] * (1.0 + 1e-3));
            ASSERT(sum[j] >= obj[j * 11 + 10] * 0.8);
        }
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
    }
    free(rb);
    free(x);
    PASS();
}

/* Queries whose dims are correlated: the codebook trained under their second moments as
   blocks errs less on q.k than one trained under the diagonal of the same moments (the
   per-dimension metric) or the Euclidean one, on keys and queries it never saw. */
TEST metric_blocks_serve_correlated_queries_better_than_weights(void)
{
    enum { N = 4000, NQ = 400, DD = 32, M = 4, DS = DD / M };
    float *x = (float *)malloc(sizeof(float) * (N + N) * DD), *q = (float *)malloc(sizeof(float) * NQ * 2 * DD);
    float w[M * DS * DS], diag[DD];
    double err[3] = {0, 0, 0}, mom[DD * DD];
    uint64_t st = 5;
    size_t t, i;
    int mode, a, b, j;
    ASSERT(x != NULL && q != NULL);
    for (t = 0; t < (size_t)2 * N * DD; t++) x[t] = hk__normal(&st);
    /* queries: per sub-space one dominant random direction plus a little noise */
    {
        float u[DD];
        for (a = 0; a < DD; a++) u[a] = hk__normal(&st);
        for (i = 0; i < (size_t)NQ * 2; i++) {
            float s = hk__normal(&st);
            for (a = 0; a < DD; a++) q[i * DD + a] = 3.0f * s * u[a] + 0.3f * hk__normal(&st);
        }
    }
    for (a = 0; a < DD * DD; a++) mom[a] = 0;
    for (i = 0; i < NQ; i++) /* the first half of the queries shapes the metric */
        for (a = 0; a < DD; a++)
            for (b = 0; b < DD; b++) mom[a * DD + b] += (double)q[i * DD + a] * q[i * DD + b] / NQ;
    for (j = 0; j < M; j++)
        for (a = 0; a < DS; a++)
            for (b = 0; b < DS; b++)
                w[((size_t)j * DS + a) * DS + b] = (float)mom[(j * DS + a) * DD + j * DS + b] + (a == b ? 0.01f : 0.0f);
    for (a = 0; a < DD; a++) diag[a] = (float)mom[a * DD + a] + 0.01f;
    for (mode = 0; mode < 3; mode++) { /* Euclidean, weights, blocks */
        pqc_pq pq;
        pqc_codes codes;
        pqc_pq_desc d = tu_pq_desc(M, 6, 12, 2);
        pqc_matrix train = pqc_matrix_f32(x, N, DD), test = pqc_matrix_f32(x + (size_t)N * DD, N, DD);
        float rec[DD];
        if (mode == 1) d.metric = diag;
        if (mode == 2) d.metric_blocks = w;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &train, &pq));
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, N, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &test, &codes));
        for (t = 0; t < N; t++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_decode(&pq, &codes, t, rec));
            for (i = NQ; i < (size_t)2 * NQ; i += 8) { /* the held-out queries */
                double e = 0;
                for (a = 0; a < DD; a++) e += (double)q[i * DD + a] * ((double)x[((size_t)N + t) * DD + a] - rec[a]);
                err[mode] += e * e;
            }
        }
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
    }
    fprintf(stderr, "  mean squared q.k error: Euclidean %.4f, weights %.4f, blocks %.4f\n", err[0] / (N * NQ / 8),
            err[1] / (N * NQ / 8), err[2] / (N * NQ / 8));
    ASSERT(err[2] < 0.5 * err[1]);
    ASSERT(err[2] < 0.5 * err[0]);
    free(x);
    free(q);
    PASS();
}

/* Blocks that are not symmetric positive definite and finite, blocks with weights, and
   sub-spaces too wide for them are refused, the output untouched; a cache takes none. */
TEST metric_blocks_misuse_is_refused(void)
{
    enum { DD = 8, M = 2, DS = 4 };
    float x[64 * DD], w[M * DS * DS], bad[M * DS * DS], wt[DD];
    pqc_matrix keys;
    pqc_pq out;
    pqc_pq_desc d = tu_pq_desc(M, 3, 2, 1);
    unsigned char want[sizeof out];
    uint64_t st = 9;
    int i, kind;
    for (i = 0; i < 64 * DD; i++) x[i] = hk__normal(&st);
    keys = pqc_matrix_f32(x, 64, DD);
    for (i = 0; i < DD; i++) wt[i] = 1.0f;
    spd_blocks(M, DS, 0.1f, 4, w);
    memset(&out, 0x5a, sizeof out);
    memset(want, 0x5a, sizeof want);
    d.metric_blocks = w;
    d.metric = wt;
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_train(NULL, &d, &keys, &out));
    d.metric = NULL;
    for (kind = 0; kind < 4; kind++) {
        memcpy(bad, w, sizeof w);
        if (kind == 0) bad[DS * DS + 1] += 1.0f;                     /* block 1 not symmetric */
        if (kind == 1) bad[0] = -bad[0];                             /* a negative diagonal entry */
        if (kind == 2) bad[DS * DS + DS + 1] = 0.0f / (float)(kind - 2); /* NaN */
        if (kind == 3)                                               /* positive semidefinite, singular */
            for (i = 0; i < DS * DS; i++) bad[i] = 1.0f;
        d.metric_blocks = bad;
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &out));
        ASSERT(strstr(pqc_last_error(), "metric_blocks") != NULL);
    }
    {
        float wide[1];
        float *xw = (float *)calloc(64 * 512, sizeof(float));
        pqc_matrix kw = pqc_matrix_f32(xw, 64, 512);
        pqc_pq_desc dw = tu_pq_desc(1, 3, 2, 1);
        ASSERT(xw != NULL);
        wide[0] = 1.0f;
        dw.metric_blocks = wide; /* one sub-space of 512 dims: over the blocks' 256 */
        ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &dw, &kw, &out));
        free(xw);
    }
    ASSERT_MEM_EQ(want, &out, sizeof out);
    {
        pqc_cache_desc cd = tu_cache_desc(1, 1, 1, DD);
        pqc_cache *c = NULL;
        cd.pq.metric_blocks = w;
        ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_create(NULL, &cd, &c));
        ASSERT(c == NULL);
    }
    PASS();
}

TEST metric_out_of_range_is_refused(void)
{
    float x[64 * 4], w[4] = {1, 1, 1, 1};
    static const float bad[5] = {0.0f, -1.0f, NAN, INFINITY, 1e-13f};
    pqc_pq pq, before;
    pqc_pq_desc d = tu_pq_desc(2, 2, 10, 1);
    pqc_matrix keys = pqc_matrix_f32(x, 64, 4);
    int i;
    for (i = 0; i < 64 * 4; i++) x[i] = (float)(i % 7) - 3.0f;
    d.metric = w;
    memset(&pq, 0x5a, sizeof pq);
    before = pq;
    for (i = 0; i < 5; i++) {
        w[2] = bad[i]; /* zero, negative, NaN, Inf, and a ratio of 1e13 */
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT(strstr(pqc_last_error(), "metric") != NULL);
        ASSERT_MEM_EQ(&before, &pq, sizeof pq);
    }
    w[2] = 1e-11f; /* within 1e12 of the largest */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    pqc_pq_free(&pq);
    PASS();
}

/* Rope bands over the half-split layout are a permutation of the dims: training, coding,
   decoding and the lookup tables equal those of contiguous sub-spaces on keys, weights
   and queries whose columns are permuted into band order. */
TEST rope_bands_are_the_band_ordered_contiguous_pq(void)
{
    enum { N = 3000, DD = 32, M = 4, HS = DD / (2 * M) };
    float *x = (float *)malloc(sizeof(float) * N * DD), *xp = (float *)malloc(sizeof(float) * N * DD);
    float w[DD], wp[DD], q[2 * DD], qp[2 * DD], lut_a[2 * M * 64], lut_b[2 * M * 64], rec_a[DD], rec_b[DD];
    int perm[DD], j, e, t, seen[DD];
    pqc_pq a, b;
    pqc_codes ca, cb;
    pqc_pq_desc da = tu_pq_desc(M, 6, 10, 1), db = tu_pq_desc(M, 6, 10, 1);
    pqc_matrix ka, kb;
    uint64_t st = 11;
    ASSERT(x && xp);
    da.rope = PQC_ROPE_HALF;
    da.subspaces = PQC_SUBSPACES_ROPE_BANDS;
    da.max_points_per_centroid = 16; /* the sample is drawn too (N > 16 * 64) */
    db.max_points_per_centroid = 16;
    memset(seen, 0, sizeof seen);
    /* element e of band j is dim j*HS + e, then DD/2 + j*HS + (e - HS) */
    for (j = 0; j < M; j++)
        for (e = 0; e < 2 * HS; e++) {
            perm[j * 2 * HS + e] = e < HS ? j * HS + e : DD / 2 + j * HS + (e - HS);
            seen[perm[j * 2 * HS + e]]++;
        }
    for (e = 0; e < DD; e++) ASSERT_EQ(1, seen[e]);
    for (t = 0; t < N * DD; t++) x[t] = hk__normal(&st) * ((t % DD) % (DD / 2) < 4 ? 3.0f : 1.0f);
    for (t = 0; t < N; t++)
        for (e = 0; e < DD; e++) xp[t * DD + e] = x[t * DD + perm[e]];
    for (e = 0; e < DD; e++) w[e] = 0.2f + (float)(e % 5);
    for (e = 0; e < DD; e++) wp[e] = w[perm[e]];
    for (e = 0; e < 2 * DD; e++) q[e] = hk__normal(&st);
    for (e = 0; e < 2 * DD; e++) qp[e] = q[(e / DD) * DD + perm[e % DD]];
    da.metric = w;
    db.metric = wp;
    ka = pqc_matrix_f32(x, N, DD);
    kb = pqc_matrix_f32(xp, N, DD);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &da, &ka, &a));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &db, &kb, &b));
    ASSERT_EQ(1, a.half_bands);
    for (j = 0; j < M; j++)
        for (e = 0; e < 2 * HS; e++) ASSERT_EQ(perm[j * 2 * HS + e], pqc_pq_dim(&a, j, e));
    ASSERT_MEM_EQ(b.centroids, a.centroids, sizeof(float) * M * 64 * 2 * HS);
    ASSERT_MEM_EQ(w, a.metric, sizeof w); /* the caller's weights, by dim */
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&ca, &a, N, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&cb, &b, N, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &a, &ka, &ca));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &b, &kb, &cb));
    for (t = 0; t < N; t++)
        for (j = 0; j < M; j++) ASSERT_EQ(pqc_codes_get(&cb, (size_t)t, j), pqc_codes_get(&ca, (size_t)t, j));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_decode(&a, &ca, 17, rec_a));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_decode(&b, &cb, 17, rec_b));
    for (e = 0; e < DD; e++) ASSERT_EQ(rec_b[e], rec_a[perm[e]]);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_lut(NULL, &a, q, 2, lut_a));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_lut(NULL, &b, qp, 2, lut_b));
    ASSERT_MEM_EQ(lut_b, lut_a, sizeof lut_a);
    pqc_codes_free(&ca);
    pqc_codes_free(&cb);
    pqc_pq_free(&a);
    pqc_pq_free(&b);
    free(x);
    free(xp);
    PASS();
}

TEST rope_layout_misuse_is_refused(void)
{
    float x[64 * 8];
    pqc_pq pq, before;
    pqc_pq_desc d = tu_pq_desc(2, 2, 10, 1);
    pqc_matrix keys = pqc_matrix_f32(x, 64, 8), odd = pqc_matrix_f32(x, 64, 7);
    int i;
    for (i = 0; i < 64 * 8; i++) x[i] = (float)(i % 7) - 3.0f;
    memset(&pq, 0x5a, sizeof pq);
    before = pq;
    d.subspaces = PQC_SUBSPACES_ROPE_BANDS; /* bands without a layout */
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT(strstr(pqc_last_error(), "rope") != NULL);
    d.rope = PQC_ROPE_HALF;
    d.m = 8; /* 8 sub-spaces over 4 pairs */
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &d, &keys, &pq));
    d.m = 7;
    d.subspaces = PQC_SUBSPACES_CONTIGUOUS; /* an odd d_h has no pairs */
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &d, &odd, &pq));
    d.m = 2;
    d.rope = (pqc_rope)3;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &pq));
    d.rope = PQC_ROPE_INTERLEAVED;
    d.subspaces = (pqc_subspaces)3;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &pq));
    d.subspaces = (pqc_subspaces)-1;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_MEM_EQ(&before, &pq, sizeof pq);
    d.subspaces = PQC_SUBSPACES_ROPE_BANDS; /* interleaved bands: the contiguous dims */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_EQ(0, pq.half_bands);
    ASSERT_EQ(5, pqc_pq_dim(&pq, 1, 1));
    pqc_pq_free(&pq);
    PASS();
}

/* pq.subspaces 0 (the default): rope bands where a RoPE layout is stated and m divides the
   pairs, else contiguous; in the PQ core, in a cache's configuration and in its files */
TEST default_subspaces_follow_the_rope_layout(void)
{
    enum { N = 600, DD = 16 };
    uint64_t rng = 5;
    float *x = tu_normal_rows(&rng, N, DD);
    pqc_pq a, b;
    pqc_pq_desc d = tu_pq_desc(4, 4, 3, 1), e;
    pqc_matrix keys = pqc_matrix_f32(x, N, DD);
    pqc_cache_desc cd = tu_cache_desc(1, 1, 2, DD), r, r2;
    pqc_cache *c, *l = NULL;
    char path[512];
    ASSERT(x);
    /* the PQ core: half-split layout, m = 4 over 8 pairs: the bands, bit for bit */
    d.rope = PQC_ROPE_HALF;
    e = d;
    e.subspaces = PQC_SUBSPACES_ROPE_BANDS;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &a));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &e, &keys, &b));
    ASSERT_EQ(1, a.half_bands);
    ASSERT_MEM_EQ(b.centroids, a.centroids, sizeof(float) * 4 * 16 * 4);
    pqc_pq_free(&a);
    pqc_pq_free(&b);
    /* contiguous: asked for, no layout, or m = 16 over 8 pairs (explicit bands refuse it) */
    d.subspaces = PQC_SUBSPACES_CONTIGUOUS;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &a));
    ASSERT_EQ(0, a.half_bands);
    ASSERT_EQ(4, pqc_pq_dim(&a, 1, 0));
    pqc_pq_free(&a);
    d.subspaces = PQC_SUBSPACES_DEFAULT;
    d.rope = PQC_ROPE_NONE;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &a));
    ASSERT_EQ(0, a.half_bands);
    pqc_pq_free(&a);
    d.rope = PQC_ROPE_HALF;
    d.m = 16;
    d.bits = 2;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &a));
    ASSERT_EQ(0, a.half_bands);
    pqc_pq_free(&a);
    d.subspaces = PQC_SUBSPACES_ROPE_BANDS;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_train(NULL, &d, &keys, &a));
    /* a cache's configuration names what it resolved to, and resolves to itself */
    cd.max_tokens = 1024;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(PQC_SUBSPACES_CONTIGUOUS, r.pq.subspaces);
    cd.pq.rope = PQC_ROPE_INTERLEAVED;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(PQC_SUBSPACES_ROPE_BANDS, r.pq.subspaces);
    cd.pq.rope = PQC_ROPE_HALF;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &r));
    ASSERT_EQ(PQC_SUBSPACES_ROPE_BANDS, r.pq.subspaces);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &r, &r2));
    ASSERT_EQ(PQC_SUBSPACES_ROPE_BANDS, r2.pq.subspaces);
    /* files: a cache of bands loads into the default configuration, not into contiguous
       sub-spaces, and a contiguous cache's file still says 0 there (as files before) */
    tu_tmp_path(path, sizeof path, "subspaces_default");
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &keys, &keys));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, path));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &l));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_config(l, &r));
    ASSERT_EQ(PQC_SUBSPACES_ROPE_BANDS, r.pq.subspaces);
    ASSERT_EQ(1, l->layers[0].heads[0].pq.half_bands);
    pqc_cache_destroy(l);
    l = NULL;
    r = cd;
    r.pq.subspaces = PQC_SUBSPACES_CONTIGUOUS;
    ASSERT(pqc_cache_load(NULL, &r, path, &l) != PQC_SUCCESS);
    ASSERT(l == NULL);
    pqc_cache_destroy(c);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &r, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &keys, &keys));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, path));
    {
        long size = 0;
        unsigned char *img = tu_file_image(path, &size);
        uint32_t f9;
        ASSERT(img && size > 12 + 4 * 10);
        memcpy(&f9, img + 12 + 4 * 9, 4); /* "PQCCACHE", version, then the shape's u32s */
        ASSERT_EQ(0u, f9);
        free(img);
    }
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &r, path, &l));
    ASSERT_EQ(0, l->layers[0].heads[0].pq.half_bands);
    pqc_cache_destroy(l);
    pqc_cache_destroy(c);
    remove(path);
    free(x);
    PASS();
}

/* On the hard keys, plain PQ at the default m = 2, b = 6 loses most rare tokens exact
   top-k keeps; weighting the distance by the observed queries keeps every one of them,
   and nearly the mass of exact top-k. */
TEST metric_keeps_the_rare_tokens_plain_pq_loses(void)
{
    pqc_scratch scr;
    float *sc = (float *)malloc(sizeof(float) * S);
    uint32_t *ex = (uint32_t *)malloc(sizeof(uint32_t) * S), *id = (uint32_t *)malloc(sizeof(uint32_t) * S);
    int i, kept_plain = 0, kept_metric = 0, in_ref = 0;
    double gap_max = 0;
    ASSERT(sc && ex && id);
    memset(&scr, 0, sizeof scr);
    for (i = 0; i < 4; i++) {
        hardkeys hk;
        pqc_matrix keys;
        pqc_search_desc sd;
        float w[D];
        double m_exact;
        int mode, kp, r;
        ASSERT_EQ(0, make_hard(&hk, i, 0));
        keys = pqc_matrix_f32(hk.keys, S, D);
        ASSERT(exact_attention(&hk, &scr, sc, ex));
        memset(&sd, 0, sizeof sd);
        sd.k = S / 10;
        m_exact = mass(sc, ex, sd.k);
        obs_metric(&hk, 0.01f, w);
        for (mode = 0; mode < 2; mode++) {
            pqc_pq_desc d = tu_pq_desc(2, 6, 10, 1);
            pqc_pq pq;
            pqc_codes codes;
            if (mode) d.metric = w;
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
            ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, S, NULL));
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
            rare_kept(&hk, ex, sd.k, id, sd.k, &kp, &r);
            if (mode) {
                double gap = m_exact - mass(sc, id, sd.k);
                kept_metric += kp;
                in_ref += r;
                if (gap > gap_max) gap_max = gap;
            } else {
                kept_plain += kp;
            }
            pqc_codes_free(&codes);
            pqc_pq_free(&pq);
        }
        hk_free(&hk);
    }
    fprintf(stderr, "  rare tokens kept of %d: plain %d, metric %d; largest mass gap with the metric %.3f\n", in_ref,
            kept_plain, kept_metric, gap_max);
    ASSERT(in_ref >= 16);
    ASSERT(kept_plain * 2 <= in_ref); /* the data is hard: plain PQ loses most */
    ASSERT_EQ(in_ref, kept_metric);
    ASSERT(gap_max < 0.1);
    pqc_scratch_free(&scr);
    free(sc);
    free(ex);
    free(id);
    PASS();
}

/* ----- the cache's observations ------------------------------------------------------ */

static pqc_cache_desc hard_desc(pqc_metric metric)
{
    pqc_cache_desc cd = tu_cache_desc(1, 1, G, D);
    cd.max_tokens = S + 64;
    cd.pq = tu_pq_desc(0, 0, 10, 1); /* m and bits: the defaults */
    cd.metric = metric;
    return cd;
}

/* a cache of cd over hk: the observations, the prompt, one selection with hk's queries */
static pqc_result open_and_select(const pqc_cache_desc *cd, const hardkeys *hk, pqc_cache **c, pqc_selection *sel)
{
    pqc_matrix km = pqc_matrix_f32(hk->keys, S, D);
    pqc_result r = pqc_cache_create(NULL, cd, c);
    if (r != PQC_SUCCESS) return r;
    if ((r = pqc_cache_observe(*c, 0, hk->obs, N_OBS)) != PQC_SUCCESS || (r = pqc_cache_prefill(*c, 0, &km, &km)) != PQC_SUCCESS ||
        (r = pqc_selection_init(*c, sel)) != PQC_SUCCESS)
        return r;
    return pqc_cache_select(*c, 0, hk->queries, sel);
}

/* sinks + exact top-k of the mid tokens + window, the same shape as sel (head 0) */
static size_t oracle_of(const hardkeys *hk, const pqc_selection *sel, int window, pqc_scratch *scr, uint32_t *out)
{
    size_t n = 0, t, mid_end = S - (size_t)window, take = sel->count[0] - 32 - (size_t)window;
    pqc_matrix mid = pqc_matrix_f32(hk->keys + 32 * D, mid_end - 32, D);
    pqc_search_desc sd;
    memset(&sd, 0, sizeof sd);
    sd.k = take;
    for (t = 0; t < 32; t++) out[n++] = (uint32_t)t;
    if (pqc_exact_search(NULL, &mid, hk->queries, G, &sd, scr, out + n, NULL) != PQC_SUCCESS) return 0;
    for (t = 0; t < take; t++) out[n + t] += 32;
    n += take;
    for (t = mid_end; t < S; t++) out[n++] = (uint32_t)t;
    return n;
}

/* oracle_of as a cache's exact scoring ranks (pqc__select_exact): each query head's
   softmax over the mid tokens, the sinks and the window, the top-k chosen of the mid
   tokens */
static size_t oracle_whole(const hardkeys *hk, const pqc_selection *sel, int window, pqc_scratch *scr, uint32_t *out)
{
    size_t n = 0, t, mid_end = S - (size_t)window, take = sel->count[0] - 32 - (size_t)window;
    pqc_matrix all = pqc_matrix_f32(hk->keys, S, D);
    uint32_t *cand = (uint32_t *)malloc(sizeof(uint32_t) * S);
    pqc_result r;
    if (!cand) return 0;
    for (t = 32; t < mid_end; t++) cand[n++] = (uint32_t)t;
    for (t = 0; t < 32; t++) cand[n++] = (uint32_t)t;
    for (t = mid_end; t < S; t++) cand[n++] = (uint32_t)t;
    for (t = 0; t < 32; t++) out[t] = (uint32_t)t;
    r = pqc__rerank_impl(NULL, &all, hk->queries, G, PQC_GQA_SOFTMAX_SUM, pqc__default_scale(D), cand, S, take, scr,
                         out + 32, NULL, 0, 32 + (size_t)window);
    free(cand);
    if (r != PQC_SUCCESS) return 0;
    for (t = mid_end; t < S; t++) out[32 + take + t - mid_end] = (uint32_t)t;
    return 32 + take + (size_t)window;
}

TEST observed_queries_keep_the_rare_tokens_the_oracle_keeps(void)
{
    pqc_scratch scr;
    uint32_t *orc = (uint32_t *)malloc(sizeof(uint32_t) * S);
    int i, kept[2] = {0, 0}, in_ref = 0;
    ASSERT(orc != NULL);
    memset(&scr, 0, sizeof scr);
    for (i = 0; i < 4; i++) {
        hardkeys hk;
        int mode;
        ASSERT_EQ(0, make_hard(&hk, i, 0));
        for (mode = 0; mode < 2; mode++) {
            pqc_cache_desc cd = hard_desc(mode ? PQC_METRIC_QUERY : PQC_METRIC_L2);
            pqc_cache *c;
            pqc_selection sel;
            size_t n_or;
            int kp, r;
            /* observed in both modes: L2 ignores them */
            ASSERT_EQ(PQC_SUCCESS, open_and_select(&cd, &hk, &c, &sel));
            ASSERT(mode ? c->layers[0].heads[0].pq.mblocks != NULL : c->layers[0].heads[0].pq.mblocks == NULL);
            ASSERT(c->layers[0].heads[0].pq.metric == NULL);
            { /* decode queries like the observed ones: no drift, no rebuild */
                pqc_layer_stats ls;
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
                ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &ls));
                ASSERT_EQ(0, (int)ls.rebuilds);
                ASSERT_EQ(0.0, c->layers[0].qsq[pqc__qsq_part(c) + D]);
            }
            n_or = oracle_of(&hk, &sel, pqc_cache_layer_window(c, 0), &scr, orc);
            ASSERT_EQ(sel.count[0], n_or);
            rare_kept(&hk, orc, n_or, sel.idx, sel.count[0], &kp, &r);
            kept[mode] += kp;
            if (mode) in_ref += r;
            pqc_selection_free(&sel);
            pqc_cache_destroy(c);
        }
        hk_free(&hk);
    }
    fprintf(stderr, "  cache: rare tokens kept of the oracle's %d: L2 %d, observed queries %d\n", in_ref, kept[0],
            kept[1]);
    ASSERT(in_ref >= 16);
    ASSERT(kept[0] * 2 <= in_ref);
    ASSERT_EQ(in_ref, kept[1]);
    pqc_scratch_free(&scr);
    free(orc);
    PASS();
}

/* PQC_METRIC_QUERY (blocks): each head's build gets W_j = C_j / mean diag C_j + floor I
   from the observed queries' second moments over sub-space j's dims, codes every key with
   its nearest centroid under W_j, and keeps the rare tokens the oracle keeps. */
TEST bands_metric_builds_the_observed_blocks(void)
{
    pqc_scratch scr;
    uint32_t *orc = (uint32_t *)malloc(sizeof(uint32_t) * S);
    int i, kept = 0, in_ref = 0;
    ASSERT(orc != NULL);
    memset(&scr, 0, sizeof scr);
    for (i = 0; i < 2; i++) {
        hardkeys hk;
        pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
        pqc_cache *c;
        pqc_selection sel;
        const pqc_pq *pq;
        double *cwc;
        size_t n_or, t;
        int kp, r, j, a, b, bad = 0;
        ASSERT_EQ(0, make_hard(&hk, i, 0));
        ASSERT_EQ(PQC_SUCCESS, open_and_select(&cd, &hk, &c, &sel));
        pq = &c->layers[0].heads[0].pq;
        ASSERT(pq->mblocks != NULL && pq->metric == NULL);
        for (j = 0; j < pq->m; j++) { /* the blocks, from the observations in double */
            enum { MAXS = 64 };
            double cj[MAXS * MAXS], tr = 0.0;
            int ds = pq->dsub;
            ASSERT(ds <= MAXS);
            memset(cj, 0, sizeof cj);
            for (t = 0; t < (size_t)N_OBS * G; t++)
                for (a = 0; a < ds; a++)
                    for (b = 0; b < ds; b++)
                        cj[a * ds + b] += (double)hk.obs[t * D + (size_t)pqc_pq_dim(pq, j, a)] *
                                          (double)hk.obs[t * D + (size_t)pqc_pq_dim(pq, j, b)];
            for (a = 0; a < ds; a++) tr += cj[a * ds + a];
            for (a = 0; a < ds; a++)
                for (b = 0; b < ds; b++) {
                    double want = cj[a * ds + b] * ds / tr + (a == b ? c->d.metric_floor : 0.0);
                    double got = pq->mblocks[((size_t)j * ds + a) * ds + b];
                    ASSERT(fabs(got - want) <= 1e-5 * (fabs(want) + 1.0));
                }
        }
        cwc = (double *)malloc(sizeof(double) * (size_t)pq->m * (size_t)pq->ksub);
        ASSERT(cwc != NULL);
        for (j = 0; j < pq->m; j++) { /* c^T W c of every centroid */
            int ds = pq->dsub, k;
            const float *w = pq->mblocks + (size_t)j * ds * ds;
            for (k = 0; k < pq->ksub; k++) {
                const float *cc = pq->centroids + ((size_t)j * pq->ksub + k) * ds;
                double acc = 0.0;
                for (a = 0; a < ds; a++)
                    for (b = 0; b < ds; b++) acc += cc[a] * (double)w[a * ds + b] * cc[b];
                cwc[(size_t)j * pq->ksub + k] = acc;
            }
        }
        for (t = 0; t < 400; t++) { /* every code the nearest centroid under its block:
                                         (x - c)^T W (x - c) = x^T W x - 2 c^T W x + c^T W c */
            const float *x = hk.keys + (32 + t) * D;
            for (j = 0; j < pq->m; j++) {
                enum { MAXS = 64 };
                int ds = pq->dsub, code = pqc_codes_get(&c->layers[0].heads[0].codes, t, j), k;
                const float *w = pq->mblocks + (size_t)j * ds * ds;
                double best = 1e300, mine = 0.0, xs[MAXS], wx[MAXS], xwx = 0.0;
                ASSERT(ds <= MAXS);
                for (a = 0; a < ds; a++) xs[a] = x[pqc_pq_dim(pq, j, a)];
                for (a = 0; a < ds; a++) {
                    wx[a] = 0.0;
                    for (b = 0; b < ds; b++) wx[a] += (double)w[a * ds + b] * xs[b];
                    xwx += xs[a] * wx[a];
                }
                for (k = 0; k < pq->ksub; k++) {
                    const float *cc = pq->centroids + ((size_t)j * pq->ksub + k) * ds;
                    double q = xwx + cwc[(size_t)j * pq->ksub + k];
                    for (a = 0; a < ds; a++) q -= 2.0 * cc[a] * wx[a];
                    if (k == code) mine = q;
                    best = q < best ? q : best;
                }
                bad += mine > best + 1e-4 * (best + 1.0);
            }
        }
        free(cwc);
        ASSERT_EQ(0, bad);
        n_or = oracle_of(&hk, &sel, pqc_cache_layer_window(c, 0), &scr, orc);
        ASSERT_EQ(sel.count[0], n_or);
        rare_kept(&hk, orc, n_or, sel.idx, sel.count[0], &kp, &r);
        kept += kp;
        in_ref += r;
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
        hk_free(&hk);
    }
    fprintf(stderr, "  cache, metric blocks: rare tokens kept of the oracle's %d: %d\n", in_ref, kept);
    ASSERT(in_ref >= 8);
    ASSERT_EQ(in_ref, kept);
    pqc_scratch_free(&scr);
    free(orc);
    PASS();
}

TEST observe_misuse_is_refused_and_changes_nothing(void)
{
    pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
    pqc_cache *c;
    float q[G * D];
    double before[D + 1];
    int i;
    for (i = 0; i < G * D; i++) q[i] = (float)(i % 5) - 2.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_ERROR_BAD_STATE, pqc_cache_observed_mass(c, 0, 0, NULL, NULL)); /* no build yet */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(c, 0, q, 1));
    memcpy(before, c->layers[0].qsq, sizeof before);
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_observe(NULL, 0, q, 1));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_observe(c, 0, NULL, 1));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_observe(c, 1, q, 1));
    ASSERT_EQ(PQC_ERROR_EMPTY, pqc_cache_observe(c, 0, q, 0));
    ASSERT_EQ(PQC_ERROR_CAPACITY, pqc_cache_observe(c, 0, q, (size_t)-1 / 4));
    q[G * D - 1] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_cache_observe(c, 0, q, 1));
    ASSERT_MEM_EQ(before, c->layers[0].qsq, sizeof before);
    ASSERT_EQ(1.0 * G, c->layers[0].qsq[D]); /* rows x heads counted */
    pqc_cache_destroy(c);
    /* settings */
    cd.metric_floor = -1;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
    cd.metric_floor = 0;
    cd.metric = (pqc_metric)3;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
    cd.metric = PQC_METRIC_QUERY; /* blocks: a floor that keeps them positive definite */
    cd.metric_floor = 0.009;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
    ASSERT(strstr(pqc_last_error(), "metric_floor") != NULL);
    cd.metric = PQC_METRIC_QUERY_DIAG; /* (weights take it) */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    pqc_cache_destroy(c);
    cd.metric = PQC_METRIC_QUERY;
    cd.metric_floor = 0.01;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    pqc_cache_destroy(c);
    cd.pq.m = 1; /* sub-spaces over 256 dims: weights, whatever the floor */
    cd.head_dim = 512;
    cd.n_q_heads = cd.n_kv_heads;
    cd.metric_floor = 0.001;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(0, pqc__bands(c));
    ASSERT_EQ((size_t)cd.n_kv_heads * 513, pqc__qsq_part(c));
    pqc_cache_destroy(c);
    cd.pq.metric = q;
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_cache_create(NULL, &cd, &c));
    PASS();
}

/* Settings too small for the type or the range they are used in are refused at create:
   a residual weight that is 0 as a float (the search's type), a metric floor that could
   spread the weights past the PQ core's 1e12. Just inside, a head whose observed queries
   leave a dimension without energy still builds and selects. */
TEST tiny_scoring_settings_are_refused_or_build(void)
{
    pqc_cache_desc cd;
    pqc_cache *c = NULL;
    pqc_selection sel;
    pqc_layer_stats st;
    float *k = (float *)malloc(sizeof(float) * 300 * 16), q[16];
    pqc_matrix km;
    uint64_t rng = 99;
    int i, pass;
    ASSERT(k);
    for (i = 0; i < 300 * 16; i++) k[i] = hk__normal(&rng);
    for (i = 0; i < 16; i++) q[i] = i == 0 ? 0.0f : 1.0f + (float)i; /* dimension 0: no energy */
    km = pqc_matrix_f32(k, 300, 16);
    cd = hard_desc(PQC_METRIC_QUERY_DIAG); /* one layer and KV head, seed 1; smaller here: */
    cd.n_q_heads = 1;
    cd.head_dim = 16;
    cd.max_tokens = 1024;
    cd.n_sink = 4;
    cd.pq.m = 2;
    cd.pq.bits = 4;
    cd.pq.iters = 3;
    cd.residual_weight = 1e-300;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
    ASSERT(strstr(pqc_last_error(), "residual_weight") != NULL);
    ASSERT(c == NULL);
    cd.residual_weight = 0;
    cd.metric_floor = 1e-13;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
    ASSERT(strstr(pqc_last_error(), "metric_floor") != NULL);
    cd.metric_floor = 1e-11 * 16 * 0.99;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
    ASSERT(c == NULL);
    cd.metric = PQC_METRIC_L2; /* no weights: the floor is not used */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    pqc_cache_destroy(c);
    c = NULL;
    for (pass = 0; pass < 3; pass++) { /* the smallest floor of weights, then of blocks; the smallest
                                          float residual weight */
        cd.metric = pass == 1 ? PQC_METRIC_QUERY : PQC_METRIC_QUERY_DIAG;
        cd.metric_floor = pass == 0 ? 1e-11 * 16 : pass == 1 ? 0.01 : 0;
        cd.residual_weight = pass == 2 ? 1e-38 : 0;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(c, 0, q, 1));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &km));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
        ASSERT_EQ(1, (int)st.builds);
        ASSERT(c->layers[0].n_coded > 0);
        ASSERT(pass == 1 ? c->layers[0].heads[0].pq.mblocks != NULL : c->layers[0].heads[0].pq.metric != NULL);
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        ASSERT(sel.count[0] > 0);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
        c = NULL;
    }
    free(k);
    PASS();
}

/* ----- the driver's observations ----------------------------------------------------- */

/* an engine over a hard data set: Q, K and V of token t are those of the data set
   (V = K); the last N_OBS prompt queries are its observation queries */
typedef struct heng {
    const hardkeys *hk;
    size_t obs_from; /* positions [obs_from, obs_from + N_OBS) carry the observation queries */
    int fail_attend;
} heng;
static int heng_qkv(void *u, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    const heng *e = (const heng *)u;
    size_t t;
    (void)layer;
    for (t = 0; t < n; t++) {
        size_t p = pos0 + t;
        const float *qs = p >= e->obs_from && p < e->obs_from + N_OBS ? e->hk->obs + (p - e->obs_from) * G * D
                                                                      : e->hk->queries;
        memcpy(q + t * G * D, qs, sizeof(float) * G * D);
        memcpy(k + t * D, e->hk->keys + p * D, sizeof(float) * D);
        memcpy(v + t * D, e->hk->keys + p * D, sizeof(float) * D);
    }
    return 0;
}
static int heng_attend(void *u, int layer, size_t pos0, size_t n, const float *q, const pqc_kv_view *kv)
{
    (void)pos0;
    (void)n;
    (void)q;
    (void)kv;
    return layer == ((heng *)u)->fail_attend;
}

TEST driver_observes_the_prompt_and_gives_observations_back_on_failure(void)
{
    pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
    pqc_cache *c, *ref;
    pqc_engine e;
    heng en;
    hardkeys hk;
    pqc_selection s1, s2;
    pqc_scratch scr;
    uint32_t *orc = (uint32_t *)malloc(sizeof(uint32_t) * S);
    size_t n_or;
    int kp, r;
    ASSERT(orc != NULL);
    memset(&scr, 0, sizeof scr);
    ASSERT_EQ(0, make_hard(&hk, 3, 0));
    cd.n_layers = 2;
    cd.observe = N_OBS; /* exactly the observation queries (earlier tokens carry the decode query) */
    memset(&e, 0, sizeof e);
    en.hk = &hk;
    en.obs_from = S - N_OBS;
    en.fail_attend = 1; /* layer 0 observes and builds, then layer 1 fails */
    e.user = &en;
    e.qkv = heng_qkv;
    e.attend = heng_attend;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &ref));
    ASSERT_EQ(PQC_ERROR_CALLBACK, pqc_driver_prefill(c, &e, 0, S));
    ASSERT_EQ(0.0, c->layers[0].qsq[D]); /* the observations went back with the tokens */
    en.fail_attend = -1;
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, S));
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(ref, &e, 0, S));
    ASSERT_EQ((double)N_OBS * G, c->layers[0].qsq[D]);
    ASSERT_MEM_EQ(ref->layers[0].qsq, c->layers[0].qsq, sizeof(double) * (D + 1));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &s1));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(ref, &s2));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, hk.queries, &s1));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(ref, 0, hk.queries, &s2));
    ASSERT_EQ(s2.count[0], s1.count[0]);
    ASSERT_MEM_EQ(s2.idx, s1.idx, s1.count[0] * sizeof(uint32_t));
    /* and the observed prompt keeps the rare tokens */
    n_or = oracle_of(&hk, &s1, pqc_cache_layer_window(c, 0), &scr, orc);
    rare_kept(&hk, orc, n_or, s1.idx, s1.count[0], &kp, &r);
    ASSERT(r >= 3);
    ASSERT_EQ(r, kp);
    pqc_selection_free(&s1);
    pqc_selection_free(&s2);
    pqc_cache_destroy(c);
    pqc_cache_destroy(ref);
    pqc_scratch_free(&scr);
    hk_free(&hk);
    free(orc);
    PASS();
}

/* Observations that look elsewhere than decoding does: the first selection loses the
   rare tokens, the cache notices that the decode query's energy lies where its metric
   did not look, and rebuilds in the background with the decode queries' metric. */
TEST drift_rebuild_with(pqc_metric metric)
{
    pqc_cache_desc cd = hard_desc(metric);
    pqc_cache *c;
    pqc_selection sel;
    pqc_layer_stats st;
    pqc_scratch scr;
    hardkeys hk;
    uint32_t *orc = (uint32_t *)malloc(sizeof(uint32_t) * S);
    size_t n_or, part;
    int kp1, kp2, r;
    ASSERT(orc != NULL);
    memset(&scr, 0, sizeof scr);
    ASSERT_EQ(0, make_hard(&hk, 3, 1));
    ASSERT_EQ(PQC_SUCCESS, open_and_select(&cd, &hk, &c, &sel));
    part = pqc__qsq_part(c);
    ASSERT(metric == PQC_METRIC_QUERY ? c->layers[0].heads[0].pq.mblocks != NULL : c->layers[0].heads[0].pq.metric != NULL);
    n_or = oracle_of(&hk, &sel, pqc_cache_layer_window(c, 0), &scr, orc);
    rare_kept(&hk, orc, n_or, sel.idx, sel.count[0], &kp1, &r);
    ASSERT_EQ((double)G, c->layers[0].qsq[part + D]); /* the decode query was counted */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, hk.queries, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ(1, (int)st.rebuilds);
    rare_kept(&hk, orc, n_or, sel.idx, sel.count[0], &kp2, &r);
    fprintf(stderr, "  unrelated observations, %s: rare tokens kept of %d: %d, after the drift rebuild %d\n",
            metric == PQC_METRIC_QUERY ? "blocks" : "weights", r, kp1, kp2);
    ASSERT(r >= 3);
    ASSERT(kp1 * 2 <= r);
    ASSERT_EQ(r, kp2);
    /* the rebuilt metric serves the query: no further drift, no further rebuild */
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, hk.queries, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ(1, (int)st.rebuilds);
    ASSERT_EQ((double)G, c->layers[0].qsq[part + D]);
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    pqc_scratch_free(&scr);
    hk_free(&hk);
    free(orc);
    PASS();
}
TEST drifted_queries_rebuild_the_codebook_with_their_metric(void) { return drift_rebuild_with(PQC_METRIC_QUERY); }
TEST drifted_queries_rebuild_the_weights_with_theirs(void) { return drift_rebuild_with(PQC_METRIC_QUERY_DIAG); }

/* In a driver step the drifted queries count only when the whole step succeeds. */
TEST a_failed_decode_step_leaves_no_drift_behind(void)
{
    pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
    pqc_cache *c;
    pqc_engine e;
    heng en;
    hardkeys hk;
    pqc_layer_stats st;
    const size_t P = S - 8;
    size_t part;
    ASSERT_EQ(0, make_hard(&hk, 3, 1));
    cd.n_layers = 2;
    cd.observe = N_OBS;
    memset(&e, 0, sizeof e);
    en.hk = &hk;
    en.obs_from = P - N_OBS;
    en.fail_attend = -1;
    e.user = &en;
    e.qkv = heng_qkv;
    e.attend = heng_attend;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    part = pqc__qsq_part(c);
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_prefill(c, &e, 0, P));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    en.fail_attend = 1; /* layer 0 selects (and notes the drift), layer 1 fails */
    ASSERT_EQ(PQC_ERROR_CALLBACK, pqc_driver_decode(c, &e, P));
    ASSERT_EQ(0.0, c->layers[0].qsq[part + D]);
    ASSERT_EQ(0.0, c->layers[0].qpend[part]);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ(0, (int)st.rebuilds);
    en.fail_attend = -1;
    ASSERT_EQ(PQC_SUCCESS, pqc_driver_decode(c, &e, P));
    ASSERT_EQ((double)G, c->layers[0].qsq[part + D]);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_stats(c, 0, &st));
    ASSERT_EQ(1, (int)st.rebuilds);
    pqc_cache_destroy(c);
    hk_free(&hk);
    PASS();
}

/* ----- the budget where the mass is --------------------------------------------------- */

/* a cache over two KV heads (keys k2: rows of 2 x D), the observations obs2 observed and
   the keys prefilled */
/* What the cache measures for KV head h of open_two_heads' data, in double precision:
   per kept observation row (the last PQC__OBS_KEEP of N_OBS) and query head of the group,
   the softmax over all S tokens (scale 1/sqrt(D)) summed over the sinks and the window,
   averaged. */
static void observed_mass_ref(const float *k2, const float *obs2, int h, size_t n_sink, size_t window,
                              double *sinks, double *win)
{
    double *sc = (double *)malloc(sizeof(double) * S), acc_s = 0, acc_w = 0;
    int r, hh, e, pairs = 0;
    size_t t;
    *sinks = *win = -1.0;
    if (!sc) return;
    for (r = N_OBS - PQC__OBS_KEEP; r < N_OBS; r++)
        for (hh = 0; hh < G; hh++) {
            const float *q = obs2 + ((size_t)r * 2 + (size_t)h) * G * D + (size_t)hh * D;
            double mx = -INFINITY, z = 0, zs = 0, zw = 0;
            for (t = 0; t < S; t++) {
                const float *k = k2 + (t * 2 + (size_t)h) * D;
                double a = 0;
                for (e = 0; e < D; e++) a += (double)q[e] * (double)k[e];
                sc[t] = a / sqrt((double)D);
                if (sc[t] > mx) mx = sc[t];
            }
            for (t = 0; t < S; t++) {
                double p = exp(sc[t] - mx);
                z += p;
                if (t < n_sink) zs += p;
                else if (t >= S - window) zw += p;
            }
            acc_s += zs / z;
            acc_w += zw / z;
            pairs++;
        }
    *sinks = acc_s / pairs;
    *win = acc_w / pairs;
    free(sc);
}

static pqc_result open_two_heads(pqc_split split, double ratio, const float *k2, const float *obs2, pqc_cache **out)
{
    pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
    pqc_matrix km = pqc_matrix_f32(k2, S, 2 * D);
    pqc_result r;
    cd.n_kv_heads = 2;
    cd.n_q_heads = 2 * G;
    cd.split = split;
    cd.budget_ratio = ratio;
    cd.recent_share = 0.5; /* the window as long as the top-k: head 0's attention lies there */
    cd.pq.m = 2;           /* coarse codes, where the split decides what a head keeps */
    cd.pq.bits = 6;
    if ((r = pqc_cache_create(NULL, &cd, out)) != PQC_SUCCESS) return r;
    if ((r = pqc_cache_observe(*out, 0, obs2, N_OBS)) != PQC_SUCCESS ||
        (r = pqc_cache_prefill(*out, 0, &km, &km)) != PQC_SUCCESS)
        pqc_cache_destroy(*out);
    return r;
}

/* Two KV heads that attend differently: head 0's queries carry a strong recency
   component (its attention is spread over many mid tokens and the window), head 1's
   attention is concentrated on a few rare tokens far back. The observed queries measure
   it; the adaptive split moves top-k from head 1 to head 0, and the two heads together
   keep more of their attention than with the even split, every rare token of either
   head's oracle included. */
TEST adaptive_split_gives_the_top_k_to_the_head_that_needs_it(void)
{
    hardkeys hk[2];
    float *k2 = (float *)malloc(sizeof(float) * S * 2 * D), *obs2 = (float *)malloc(sizeof(float) * N_OBS * 2 * G * D);
    float q2[2 * G * D], *p[2];
    pqc_scratch scr;
    uint32_t *orc = (uint32_t *)malloc(sizeof(uint32_t) * S);
    double kept_mass[2] = {0, 0}, sinks, win[2];
    int split, h, kept_rare = 0, ref_rare = 0;
    size_t t, cnt[2][2];
    ASSERT(k2 && obs2 && orc);
    memset(&scr, 0, sizeof scr);
    for (h = 0; h < 2; h++) {
        memset(&hk[h], 0, sizeof hk[h]);
        hk[h].s = S;
        hk[h].level = h ? HK_HARD : HK_EASY;
        hk[h].layout = HK_INTERLEAVED;
        hk[h].base = h ? 1e4 : 5e5;
        hk[h].recency = h ? 0.0 : 1.0;
        hk[h].n_obs = N_OBS;
        hk[h].seed = 77 + (uint64_t)h;
        ASSERT_EQ(0, hk_make(&hk[h]));
        for (t = 0; t < S; t++) memcpy(k2 + (t * 2 + (size_t)h) * D, hk[h].keys + t * D, sizeof(float) * D);
        for (t = 0; t < N_OBS; t++)
            memcpy(obs2 + (t * 2 + (size_t)h) * G * D, hk[h].obs + t * G * D, sizeof(float) * G * D);
        memcpy(q2 + (size_t)h * G * D, hk[h].queries, sizeof(float) * G * D);
        /* head h's exact attention distribution (softmax-sum, normalised to 1) */
        p[h] = (float *)malloc(sizeof(float) * S);
        ASSERT(p[h] != NULL);
        {
            pqc_matrix km = pqc_matrix_f32(hk[h].keys, S, D);
            double tot = 0;
            ASSERT_EQ(PQC_SUCCESS, pqc_exact_scores(NULL, &km, hk[h].queries, G, PQC_GQA_SOFTMAX_SUM, &scr, p[h]));
            for (t = 0; t < S; t++) tot += p[h][t];
            for (t = 0; t < S; t++) p[h][t] = (float)(p[h][t] / tot);
        }
    }
    for (split = 0; split < 2; split++) {
        pqc_cache *c;
        pqc_selection sel;
        ASSERT_EQ(PQC_SUCCESS, open_two_heads(split ? PQC_SPLIT_FIXED : PQC_SPLIT_ADAPTIVE, 0.0, k2, obs2, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q2, &sel));
        for (h = 0; h < 2; h++) {
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_observed_mass(c, 0, h, &sinks, &win[h]));
            ASSERT(sinks >= 0.0 && win[h] >= 0.0 && sinks + win[h] <= 1.0 + 1e-9);
            { /* the measurement itself, against double precision */
                double rs, rw;
                observed_mass_ref(k2, obs2, h, (size_t)c->d.n_sink, (size_t)pqc_cache_layer_window(c, 0), &rs, &rw);
                if (split == 0)
                    fprintf(stderr, "  head %d observed sinks %.6f (double: %.6f), window %.6f (%.6f)\n", h, sinks, rs,
                            win[h], rw);
                ASSERT(fabs(sinks - rs) < 1e-5 && fabs(win[h] - rw) < 1e-5);
            }
            cnt[split][h] = sel.count[h];
            kept_mass[split] += mass(p[h], sel.idx + (size_t)h * sel.capacity, sel.count[h]);
            if (split == 0) { /* every rare token of the head's oracle (same shape) kept */
                pqc_selection one = sel;
                size_t counts1[1], n_or;
                int kp, r;
                one.n_kv_heads = 1;
                one.count = counts1;
                counts1[0] = sel.count[h];
                one.idx = sel.idx + (size_t)h * sel.capacity;
                n_or = oracle_of(&hk[h], &one, pqc_cache_layer_window(c, 0), &scr, orc);
                rare_kept(&hk[h], orc, n_or, one.idx, one.count[0], &kp, &r);
                kept_rare += kp;
                ref_rare += r;
            }
        }
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_observed_mass(c, 0, 2, &sinks, &win[0]));
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_observed_mass(c, 1, 0, &sinks, &win[0]));
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
    }
    fprintf(stderr, "  observed window mass: head 0 %.3f, head 1 %.3f; selected %zu + %zu (adaptive) vs %zu + %zu "
            "(even); attention kept %.3f vs %.3f of 2; rare kept %d of %d\n", win[0], win[1], cnt[0][0], cnt[0][1],
            cnt[1][0], cnt[1][1], kept_mass[0], kept_mass[1], kept_rare, ref_rare);
    ASSERT(win[0] > win[1] + 0.05);
    ASSERT(cnt[0][0] > cnt[0][1] + 100);    /* head 0 takes more */
    ASSERT_EQ(cnt[1][0], cnt[1][1]);        /* the even split */
    ASSERT(cnt[0][0] + cnt[0][1] <= cnt[1][0] + cnt[1][1] + 2);
    ASSERT(kept_mass[0] > kept_mass[1]);
    ASSERT(ref_rare >= 3);
    ASSERT_EQ(ref_rare, kept_rare);
    { /* a budget that covers every token: every head attends every token, split or not */
        pqc_cache *c;
        pqc_selection sel;
        ASSERT_EQ(PQC_SUCCESS, open_two_heads(PQC_SPLIT_ADAPTIVE, 1.0, k2, obs2, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
        for (t = 0; t < 5; t++) /* decode tokens, coded since the measurement */
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, k2 + (S - 1 - t) * 2 * D, k2 + (S - 1 - t) * 2 * D));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q2, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_observed_mass(c, 0, 0, &sinks, &win[0]));
        ASSERT_EQ((size_t)S + 5, sel.count[0]);
        ASSERT_EQ((size_t)S + 5, sel.count[1]);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
    }
    for (h = 0; h < 2; h++) {
        hk_free(&hk[h]);
        free(p[h]);
    }
    pqc_scratch_free(&scr);
    free(k2);
    free(obs2);
    free(orc);
    PASS();
}

/* The window follows the observed attention (PQC_SPLIT_ADAPTIVE with a derived window): at
   its build, a layer whose observed queries look far back gives its window's budget to
   top-k, and a layer whose queries look at the recent tokens keeps its window. The
   selection keeps its size, the tokens that left the window are coded and found, files
   and forks keep the layer's window, and the fixed split, a window set in the desc and a
   prompt without observations keep the window as it was. */
#define WF_N 4000
#define WF_D 32
#define WF_FAR 120
static pqc_result window_cache(const float *k, const float *obs, int split, int window, int observe, pqc_cache **out)
{
    pqc_cache_desc cd = tu_cache_desc(2, 1, 1, WF_D);
    pqc_matrix km = pqc_matrix_f32(k, WF_N, WF_D);
    pqc_result r;
    int l;
    cd.max_tokens = 1 << 14;
    cd.pq.m = 4;
    cd.pq.seed = 3;
    cd.recent_share = 0.5;
    cd.split = (pqc_split)split;
    cd.window = window;
    if ((r = pqc_cache_create(NULL, &cd, out)) != PQC_SUCCESS) return r;
    for (l = 0; l < 2 && r == PQC_SUCCESS; l++) {
        if (observe) r = pqc_cache_observe(*out, l, obs + (size_t)l * 4 * WF_D, 4);
        if (r == PQC_SUCCESS) r = pqc_cache_prefill(*out, l, &km, &km);
    }
    if (r == PQC_SUCCESS) r = pqc_cache_sync(*out);
    if (r != PQC_SUCCESS) pqc_cache_destroy(*out);
    return r;
}

TEST window_follows_the_observed_attention(void)
{
    uint64_t rng = 99;
    float *k = tu_normal_rows(&rng, WF_N, WF_D), obs[2 * 4 * WF_D], q[2][WF_D];
    pqc_cache *c, *d, *f;
    pqc_selection sel, sel2;
    size_t t, i, sinks = 32, budget = 397, n = WF_N; /* ceil(0.1 (4000 - 32)) */
    double s_mass, w_mass;
    char path[512];
    int l, v;
    ASSERT(k != NULL);
    for (i = 0; i < WF_FAR; i++) k[(100 + 30 * i) * WF_D] += 6.0f; /* far back, spread over the mid tokens */
    for (t = WF_N - 200; t < WF_N; t++) k[t * WF_D + 1] += 6.0f;  /* the last 200 */
    memset(q, 0, sizeof q);
    q[0][0] = 8.0f; /* layer 0 looks far back, layer 1 at the recent tokens */
    q[1][1] = 8.0f;
    for (l = 0; l < 2; l++)
        for (i = 0; i < 4; i++)
            for (t = 0; t < WF_D; t++) obs[((size_t)l * 4 + i) * WF_D + t] = q[l][t] + 0.1f * (float)tu_normal(&rng);
    ASSERT_EQ(PQC_SUCCESS, window_cache(k, obs, PQC_SPLIT_ADAPTIVE, 0, 1, &c));
    ASSERT_EQ(199, pqc_cache_window(c)); /* half of the budget */
    ASSERT_EQ(16, pqc_cache_layer_window(c, 0));
    ASSERT_EQ(199, pqc_cache_layer_window(c, 1));
    ASSERT_EQ(0, pqc_cache_layer_window(c, 2));
    ASSERT_EQ(0, pqc_cache_layer_window(NULL, 0));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_observed_mass(c, 0, 0, &s_mass, &w_mass));
    ASSERT(w_mass < 0.01);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_observed_mass(c, 1, 0, &s_mass, &w_mass));
    ASSERT(w_mass > 0.9);
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel2));
    for (v = 0; v < 2; v++) { /* at the prompt's end, then after a few decode tokens */
        for (l = 0; l < 2; l++) {
            size_t w = (size_t)pqc_cache_layer_window(c, l);
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, l, q[l], &sel));
            ASSERT_EQ(sinks + budget, sel.count[0]);
            ASSERT_EQ(n - sinks - w, c->layers[l].n_coded); /* what left the window is coded */
            for (t = n - w; t < n; t++) ASSERT(tu_contains(sel.idx, sel.count[0], (uint32_t)t));
            if (l == 0)
                for (i = 0; i < WF_FAR; i++) ASSERT(tu_contains(sel.idx, sel.count[0], (uint32_t)(100 + 30 * i)));
            else
                for (t = n - 200; t < n - w; t++) ASSERT(tu_contains(sel.idx, sel.count[0], (uint32_t)t));
        }
        for (t = 0; t < 5 && v == 0; t++, n++)
            for (l = 0; l < 2; l++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, l, k + (size_t)(t * 50) * WF_D, k));
        budget = (size_t)ceil(0.1 * (double)(n - sinks));
    }
    /* a file and a fork keep each layer's window and select the same */
    tu_tmp_path(path, sizeof path, "layer_window");
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, path));
    {
        pqc_cache_desc cd;
        pqc_cache_config(c, &cd);
        cd.window = 0; /* as created */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &d));
    }
    remove(path);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(c, &f));
    for (l = 0; l < 2; l++) {
        ASSERT_EQ(pqc_cache_layer_window(c, l), pqc_cache_layer_window(d, l));
        ASSERT_EQ(pqc_cache_layer_window(c, l), pqc_cache_layer_window(f, l));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, l, q[l], &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(d, l, q[l], &sel2));
        ASSERT_EQ(sel.count[0], sel2.count[0]);
        ASSERT_EQ(0, memcmp(sel.idx, sel2.idx, sel.count[0] * sizeof(uint32_t)));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(f, l, q[l], &sel2));
        ASSERT_EQ(0, memcmp(sel.idx, sel2.idx, sel.count[0] * sizeof(uint32_t)));
    }
    pqc_cache_destroy(f);
    pqc_cache_destroy(d);
    pqc_cache_destroy(c);
    /* the fixed split, a window in the desc, no observations: the window stays */
    for (v = 0; v < 3; v++) {
        ASSERT_EQ(PQC_SUCCESS, window_cache(k, obs, v == 0 ? PQC_SPLIT_FIXED : PQC_SPLIT_ADAPTIVE, v == 1 ? 150 : 0,
                                            v != 2, &c));
        for (l = 0; l < 2; l++) {
            ASSERT_EQ(v == 1 ? 150 : 199, pqc_cache_layer_window(c, l));
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, l, q[l], &sel));
            ASSERT_EQ(sinks + 397, sel.count[0]);
        }
        pqc_cache_destroy(c);
    }
    pqc_selection_free(&sel);
    pqc_selection_free(&sel2);
    free(k);
    PASS();
}

/* The window competes (PQC_SPLIT_COMPETE, the default): in one layer, KV head 0's
   queries look at 300 tokens far back, more than its top-k of 198 holds, and KV head 1's
   at the last 200 tokens. Every step, head 0 gives its window (all but the last 16
   tokens) to the far tokens and head 1 keeps its window, each within the same budget as
   the fixed split, for the product form of softmax-sum (8-bit codes), its other form
   (6-bit codes), the summed query, residual-aware scoring and re-ranking (the rivals
   join the exactly scored candidates); a decode step, a fork and a file select the same.
   The fixed split cannot: head 0 keeps at most 198 of the far tokens; nor can the
   adaptive split with re-ranking, whose window no build lowers here (the cache observed
   no queries). */
#define WC_N 4000
#define WC_D 32
#define WC_FAR 300
static pqc_result compete_cache(const float *k, int split, int bits, pqc_gqa gqa, double rerank, double resid,
                                pqc_cache **out)
{
    pqc_cache_desc cd = tu_cache_desc(1, 2, 4, WC_D);
    pqc_matrix km = pqc_matrix_f32(k, WC_N, 2 * WC_D);
    pqc_result r;
    cd.max_tokens = 1 << 14;
    cd.pq.m = 4;
    cd.pq.bits = bits;
    cd.pq.seed = 3;
    cd.recent_share = 0.5;
    cd.split = (pqc_split)split;
    cd.gqa = gqa;
    cd.rerank = rerank > 0 ? rerank : -1; /* 0: none */
    cd.residual_weight = resid;
    if ((r = pqc_cache_create(NULL, &cd, out)) != PQC_SUCCESS) return r;
    if ((r = pqc_cache_prefill(*out, 0, &km, &km)) == PQC_SUCCESS) r = pqc_cache_sync(*out);
    if (r != PQC_SUCCESS) pqc_cache_destroy(*out);
    return r;
}
static int wc_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x > y ? -1 : x < y;
}
static size_t far_kept(const pqc_selection *sel)
{
    size_t i, kept = 0;
    for (i = 0; i < WC_FAR; i++) kept += (size_t)tu_contains(sel->idx, sel->count[0], (uint32_t)(100 + 12 * i));
    return kept;
}
static enum greatest_test_res compete_checks(const pqc_selection *sel, size_t n)
{
    size_t t, h;
    for (h = 0; h < 2; h++) {
        const uint32_t *ix = sel->idx + h * sel->capacity;
        ASSERT_EQ((size_t)32 + (size_t)ceil(0.1 * (double)(n - 32)), sel->count[h]); /* the fixed split's budget */
        ASSERT(tu_ascending_unique(ix, sel->count[h]));
        for (t = 0; t < 32; t++) ASSERT(tu_contains(ix, sel->count[h], (uint32_t)t));
        for (t = n - 16; t < n; t++) ASSERT(tu_contains(ix, sel->count[h], (uint32_t)t));
    }
    ASSERT_EQ((size_t)WC_FAR, far_kept(sel));
    for (t = WC_N - 200; t < n; t++) ASSERT(tu_contains(sel->idx + sel->capacity, sel->count[1], (uint32_t)t));
    PASS();
}
TEST window_competes_for_each_heads_budget(void)
{
    uint64_t rng = 41;
    float *k = tu_normal_rows(&rng, WC_N, 2 * WC_D), q[4 * WC_D];
    pqc_cache *c, *d, *f;
    pqc_selection sel, sel2;
    pqc_cache_desc cd;
    size_t t, i;
    char path[512];
    int v;
    ASSERT(k != NULL);
    for (i = 0; i < WC_FAR; i++) k[(100 + 12 * i) * 2 * WC_D] += 10.0f;         /* head 0: far back */
    for (t = WC_N - 200; t < WC_N; t++) k[t * 2 * WC_D + WC_D + 1] += 10.0f; /* head 1: the last 200 */
    memset(q, 0, sizeof q);
    q[0] = q[WC_D] = 8.0f;                 /* KV head 0's two query heads */
    q[2 * WC_D + 1] = q[3 * WC_D + 1] = 8.0f; /* KV head 1's */
    for (v = 0; v < 5; v++) {
        ASSERT_EQ(PQC_SUCCESS, compete_cache(k, PQC_SPLIT_COMPETE, v == 1 ? 6 : 8,
                                             v == 2 ? PQC_GQA_SUM : PQC_GQA_SOFTMAX_SUM, v == 4 ? 2.0 : 0.0,
                                             v == 3 ? 0.15 : 0.0, &c));
        ASSERT_EQ(199, pqc_cache_layer_window(c, 0)); /* no build lowers it */
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel2));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        CHECK_CALL(compete_checks(&sel, WC_N));
        for (t = 0; t < 3; t++) /* decode: the window moves, the tokens that leave it are coded */
            ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, k + (size_t)(200 + t) * 2 * WC_D, k));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        CHECK_CALL(compete_checks(&sel, WC_N + 3));
        /* a fork and a file select the same */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_fork(c, &f));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(f, 0, q, &sel2));
        for (i = 0; i < 2; i++) {
            ASSERT_EQ(sel.count[i], sel2.count[i]);
            ASSERT_EQ(0, memcmp(sel.idx + i * sel.capacity, sel2.idx + i * sel2.capacity, sel.count[i] * 4));
        }
        tu_tmp_path(path, sizeof path, "compete");
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_save(c, path));
        pqc_cache_config(c, &cd);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_load(NULL, &cd, path, &d));
        remove(path);
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(d, 0, q, &sel2));
        for (i = 0; i < 2; i++) {
            ASSERT_EQ(sel.count[i], sel2.count[i]);
            ASSERT_EQ(0, memcmp(sel.idx + i * sel.capacity, sel2.idx + i * sel2.capacity, sel.count[i] * 4));
        }
        pqc_cache_destroy(d);
        pqc_cache_destroy(f);
        pqc_cache_destroy(c);
        pqc_selection_free(&sel);
        pqc_selection_free(&sel2);
    }
    /* the fixed split, and the adaptive one with re-ranking: the same budget, the window
       kept, at most the top-k of far tokens */
    for (v = 0; v < 2; v++) {
        ASSERT_EQ(PQC_SUCCESS, compete_cache(k, v ? PQC_SPLIT_ADAPTIVE : PQC_SPLIT_FIXED, 8, PQC_GQA_SOFTMAX_SUM,
                                             v ? 2.0 : 0.0, 0.0, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        ASSERT_EQ((size_t)32 + 397, sel.count[0]);
        ASSERT(far_kept(&sel) <= 198);
        for (t = WC_N - 199; t < WC_N; t++) ASSERT(tu_contains(sel.idx, sel.count[0], (uint32_t)t));
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
    }
    free(k);
    PASS();
}

/* What the window's rivals are scored with: against a reference made from the public
   search (the coded tokens' PQ scores) and exact dots in double (the rivals', and under
   softmax-sum the sinks' and the last 16 tokens', which count in each head's softmax:
   one query head finds the window's tokens, so that most of its softmax is theirs), the
   chosen top-k + rivals of one head are the reference's: all of them for the summed
   query, all but at most two (rounding at the boundary) for softmax-sum, in its product
   form (8-bit codes) and head by head (6-bit). */
TEST window_rivals_score_as_coded_tokens(void)
{
    enum { N = 3000, D = 32, G = 2 };
    uint64_t rng = 77;
    float *k = tu_normal_rows(&rng, N, D), *q = tu_normal_rows(&rng, G, D), *ps = (float *)malloc(sizeof(float) * N);
    double *sc = (double *)malloc(sizeof(double) * N), *srt = (double *)malloc(sizeof(double) * N);
    pqc_cache_desc cd = tu_cache_desc(1, 1, G, D);
    pqc_matrix km = pqc_matrix_f32(k, N, D);
    pqc_selection sel;
    pqc_scratch scr;
    pqc_cache *c;
    size_t t0;
    int v, h, e;
    ASSERT(k && q && ps && sc && srt);
    memset(&scr, 0, sizeof scr);
    for (e = 0; e < D; e++) q[e] *= 0.6f, q[D + e] *= 0.6f;
    /* query head 1 finds the window's tokens: most of its softmax is theirs */
    for (t0 = N - 1400; t0 < N; t0++) k[t0 * D + 5] += 2.0f;
    q[D + 5] = 2.0f;
    for (v = 0; v < 3; v++) {
        pqc__layer *L;
        pqc__head *H;
        size_t n = N, coded, from, nx, take, kk, t, i, got = 0, sink = 32;
        double thr;
        pqc_search_desc sd;
        cd.pq.m = 4;
        cd.pq.bits = v == 2 ? 6 : 8; /* 6: softmax-sum head by head (pqc__combine) */
        cd.recent_share = 0.5;
        cd.split = PQC_SPLIT_COMPETE;
        cd.gqa = v ? PQC_GQA_SOFTMAX_SUM : PQC_GQA_SUM;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &km));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
        L = &c->layers[0];
        H = &L->heads[0];
        coded = L->n_coded;
        from = sink + coded;
        nx = n - from - 16;
        take = (size_t)ceil(0.1 * (double)(n - sink));
        take -= (size_t)pqc_cache_window(c);
        kk = take + nx;
        ASSERT(nx > 100 && coded > kk);
        ASSERT_EQ(sink + kk + 16, sel.count[0]);
        for (t = 0; t < n; t++) sc[t] = 0.0;
        memset(&sd, 0, sizeof sd);
        sd.gqa = PQC_GQA_SUM;
        sd.count = coded;
        if (v == 0) { /* summed query: the PQ scores of the summed query, the rivals' dots summed */
            ASSERT_EQ(PQC_SUCCESS, pqc_pq_scores(NULL, &H->pq, &H->codes, q, G, &sd, &scr, ps));
            for (t = 0; t < coded; t++) sc[sink + t] = ps[t];
            for (t = from; t < from + nx; t++)
                for (h = 0; h < G; h++)
                    for (e = 0; e < D; e++) sc[t] += (double)q[h * D + e] * k[t * D + e];
        } else { /* softmax-sum over the coded tokens, the rivals, the sinks and the last 16 */
            for (h = 0; h < G; h++) {
                double mx = -1e300, z = 0.0, *lg = srt;
                ASSERT_EQ(PQC_SUCCESS, pqc_pq_scores(NULL, &H->pq, &H->codes, q + h * D, 1, &sd, &scr, ps));
                for (t = 0; t < n; t++) {
                    double a = 0.0;
                    if (t >= sink && t < from) a = ps[t - sink];
                    else
                        for (e = 0; e < D; e++) a += (double)q[h * D + e] * k[t * D + e];
                    lg[t] = a / sqrt((double)D);
                    if (lg[t] > mx) mx = lg[t];
                }
                for (t = 0; t < n; t++) z += exp(lg[t] - mx);
                for (t = 0; t < n; t++) sc[t] += exp(lg[t] - mx) / z;
            }
        }
        for (i = 0, t = sink; t < from + nx; t++) srt[i++] = sc[t];
        qsort(srt, i, sizeof(double), wc_desc);
        thr = srt[kk - 1];
        for (t = sink; t < from + nx; t++)
            if (sc[t] >= thr) got += (size_t)tu_contains(sel.idx, sel.count[0], (uint32_t)t);
        if (v == 0) ASSERT_EQ(kk, got);
        else ASSERT(got + 2 >= kk);
        pqc_selection_free(&sel);
        pqc_cache_destroy(c);
    }
    pqc_scratch_free(&scr);
    free(k);
    free(q);
    free(ps);
    free(sc);
    free(srt);
    PASS();
}

/* A top-k of 2 per head leaves no floor (a quarter of 2 is 0): when the observed
   attention of one head sits on four tokens and the other's is spread thin, the split
   gives the first head the layer's whole top-k and the second none, which must select
   sinks and window for it, not fail (found by the API fuzzer through the driver). */
TEST adaptive_split_may_give_a_head_no_top_k(void)
{
    enum { N = 600, DH = 16 };
    float *k = (float *)malloc(sizeof(float) * N * 2 * DH), obs[4 * 2 * DH], q[2 * DH];
    pqc_cache_desc cd;
    pqc_cache *c;
    pqc_selection sel;
    pqc_matrix km;
    uint64_t st = 5;
    size_t t, w;
    int r, e;
    ASSERT(k != NULL);
    for (t = 0; t < (size_t)N * 2 * DH; t++) k[t] = 0.1f * hk__normal(&st);
    for (t = 0; t < 4; t++) /* head 1: four tokens its queries find */
        for (e = 0; e < DH; e++) k[((100 + 150 * t) * 2 + 1) * DH + (size_t)e] = e == 0 ? 4.0f : 0.0f;
    memset(obs, 0, sizeof obs);
    for (r = 0; r < 4; r++) obs[(r * 2 + 1) * DH] = 8.0f; /* head 0's queries are zero: uniform */
    memcpy(q, obs, sizeof q);
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 1;
    cd.n_kv_heads = 2;
    cd.n_q_heads = 2;
    cd.head_dim = DH;
    cd.n_sink = 4;
    cd.budget_tokens = 4; /* window 2, top-k 2 per head */
    cd.recent_share = 0.5;
    cd.pq.bits = 4;
    cd.pq.iters = 3;
    km = pqc_matrix_f32(k, N, 2 * DH);
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(c, 0, obs, 4));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &km));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, q, &sel));
    w = (size_t)pqc_cache_layer_window(c, 0);
    ASSERT_EQ((size_t)2, w);
    ASSERT_EQ((size_t)4 + w, sel.count[0]);     /* head 0: sinks and window */
    ASSERT_EQ((size_t)4 + w + 4, sel.count[1]); /* head 1: the layer's 4, its own 4 tokens */
    for (t = 0; t < 4; t++) {
        size_t i, hit = 0;
        for (i = 0; i < sel.count[1]; i++) hit += sel.idx[sel.capacity + i] == 100 + 150 * t;
        ASSERT_EQ((size_t)1, hit);
    }
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    free(k);
    PASS();
}

/* ----- re-ranking and the outlier list ------------------------------------------------- */

/* Re-ranking every row is the exact search: the candidates are all the tokens, so the
   softmax over them is the exact one, bit for bit (softmax-sum). Through pqc_rerank (idx overwriting the candidates)
   and through pqc_pq_search with a rerank factor that covers every coded token. */
TEST rerank_over_every_row_is_the_exact_search(void)
{
    hardkeys hk;
    pqc_scratch scr;
    pqc_matrix keys;
    uint32_t *ex = (uint32_t *)malloc(sizeof(uint32_t) * S), *id = (uint32_t *)malloc(sizeof(uint32_t) * S);
    float *exs = (float *)malloc(sizeof(float) * S), *ids = (float *)malloc(sizeof(float) * S);
    int gq;
    size_t t;
    ASSERT(ex && id && exs && ids);
    memset(&scr, 0, sizeof scr);
    ASSERT_EQ(0, make_hard(&hk, 1, 0));
    keys = pqc_matrix_f32(hk.keys, S, D);
    for (gq = 0; gq < 2; gq++) {
        pqc_search_desc sd;
        pqc_pq_desc d = tu_pq_desc(2, 6, 10, 1);
        pqc_pq pq;
        pqc_codes codes;
        double rc;
        memset(&sd, 0, sizeof sd);
        sd.k = S / 10;
        sd.gqa = (pqc_gqa)gq;
        ASSERT_EQ(PQC_SUCCESS, pqc_exact_search(NULL, &keys, hk.queries, G, &sd, &scr, ex, exs));
        for (t = 0; t < S; t++) id[t] = (uint32_t)t;
        ASSERT_EQ(PQC_SUCCESS, pqc_rerank(NULL, &keys, hk.queries, G, sd.gqa, id, S, sd.k, &scr, id, ids));
        rc = pqc_recall(ex, sd.k, id, sd.k);
        for (t = 1; t < sd.k; t++) ASSERT(id[t] > id[t - 1]);
        if (gq == PQC_GQA_SOFTMAX_SUM) { /* the same dots and softmax: the same bits */
            ASSERT_EQ(1.0, rc);
            ASSERT_MEM_EQ(ex, id, sd.k * sizeof(uint32_t));
            ASSERT_MEM_EQ(exs, ids, sd.k * sizeof(float));
        } else {
            ASSERT(rc >= 0.999); /* the heads' dots summed, not the summed query's dot */
        }
        /* the PQ core with a factor covering every token */
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, S, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
        sd.rerank = 1e6;
        sd.keys = &keys;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
        ASSERT(pqc_recall(ex, sd.k, id, sd.k) >= 0.999);
        /* a factor of 1 re-orders nothing it did not find: a subset of the plain search */
        sd.rerank = 1;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
        sd.rerank = 0;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, ex, NULL));
        ASSERT_EQ(1.0, pqc_recall(ex, sd.k, id, sd.k));
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
    }
    hk_free(&hk);
    pqc_scratch_free(&scr);
    free(ex);
    free(id);
    free(exs);
    free(ids);
    PASS();
}

TEST rerank_misuse_is_refused(void)
{
    float k[4 * 8], q[2 * 8], out_s[2];
    uint32_t cand[4] = {0, 1, 2, 3}, bad_order[3] = {0, 2, 2}, beyond[2] = {1, 4}, idx[4];
    pqc_matrix km, narrow;
    pqc_pq_desc d = tu_pq_desc(2, 1, 10, 1);
    pqc_pq pq;
    pqc_codes codes;
    pqc_search_desc sd;
    int i;
    for (i = 0; i < 32; i++) k[i] = (float)((i * 7) % 11) - 5.0f;
    km = pqc_matrix_f32(k, 4, 8);
    narrow = pqc_matrix_f32(k, 4, 4);
    for (i = 0; i < 16; i++) q[i] = (float)((i * 3) % 5) - 2.0f;
    ASSERT_EQ(PQC_SUCCESS, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SOFTMAX_SUM, cand, 4, 2, NULL, idx, out_s));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_rerank(NULL, NULL, q, 2, PQC_GQA_SUM, cand, 4, 2, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, NULL, 4, 2, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_EMPTY, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, cand, 0, 1, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, cand, 4, 5, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, cand, 4, 0, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_rerank(NULL, &km, q, 0, PQC_GQA_SUM, cand, 4, 2, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_rerank(NULL, &km, q, 2, (pqc_gqa)7, cand, 4, 2, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, bad_order, 3, 2, NULL, idx, NULL));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, beyond, 2, 1, NULL, idx, NULL));
    q[3] = NAN;
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, cand, 4, 2, NULL, idx, NULL));
    q[3] = 0.0f;
    k[9] = INFINITY; /* row 1 */
    ASSERT_EQ(PQC_ERROR_NON_FINITE, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, cand, 4, 2, NULL, idx, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_rerank(NULL, &km, q, 2, PQC_GQA_SUM, cand + 2, 2, 1, NULL, idx, NULL)); /* row 1 unread */
    ASSERT(idx[0] == 2 || idx[0] == 3);
    k[9] = 1.0f;
    /* the PQ core's re-ranked search */
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &km, &pq));
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, 4, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &km, &codes));
    memset(&sd, 0, sizeof sd);
    sd.k = 2;
    sd.rerank = 2;
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_search(NULL, &pq, &codes, q, 2, &sd, NULL, idx, NULL)); /* no keys */
    sd.keys = &narrow;
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_search(NULL, &pq, &codes, q, 2, &sd, NULL, idx, NULL));
    narrow = pqc_matrix_f32(k, 3, 8); /* fewer rows than coded tokens */
    ASSERT_EQ(PQC_ERROR_BAD_SHAPE, pqc_pq_search(NULL, &pq, &codes, q, 2, &sd, NULL, idx, NULL));
    sd.keys = &km;
    sd.rerank = 0.5;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, q, 2, &sd, NULL, idx, NULL));
    sd.rerank = NAN;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, q, 2, &sd, NULL, idx, NULL));
    sd.rerank = 3;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, q, 2, &sd, NULL, idx, NULL));
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    { /* the cache's settings */
        pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
        pqc_cache *c = NULL;
        double bad[4] = {0.5, 0.999, NAN, 2e6};
        pqc_cache_desc got;
        for (i = 0; i < 4; i++) {
            cd.rerank = bad[i];
            ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
            ASSERT(c == NULL);
        }
        cd.rerank = 0;
        cd.outliers = (1 << 24) + 1;
        ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
        ASSERT(c == NULL);
        cd.rerank = -1; /* negative: none, as everywhere */
        cd.outliers = -1;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &got));
        ASSERT_EQ(-1, got.rerank); /* off, written as -1 so that it resolves to itself */
        ASSERT_EQ(0, got.outliers);
    }
    PASS();
}

/* The cache's exact scoring on the hard data sets: re-ranking the PQ top 2k and the exact
   list each keep every rare token the cache-shaped oracle keeps and at least the mass of
   the plain selection; a factor covering every coded token selects the oracle itself. */
TEST rerank_and_outliers_keep_what_the_oracle_keeps(void)
{
    pqc_scratch scr;
    uint32_t *orc = (uint32_t *)malloc(sizeof(uint32_t) * S);
    float *p = (float *)malloc(sizeof(float) * S);
    double m[4] = {0, 0, 0, 0};
    int i, kept[4] = {0, 0, 0, 0}, in_ref = 0;
    ASSERT(orc && p);
    memset(&scr, 0, sizeof scr);
    for (i = 0; i < 4; i++) {
        hardkeys hk;
        size_t t;
        int mode;
        ASSERT_EQ(0, make_hard(&hk, i, 0));
        ASSERT(exact_attention(&hk, &scr, p, NULL));
        for (mode = 0; mode < 5; mode++) { /* plain, rerank 2, outlier list, both, rerank all */
            pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
            pqc_cache *c;
            pqc_selection sel;
            size_t n_or;
            int kp, r;
            cd.rerank = mode == 1 || mode == 3 ? 2.0 : mode == 4 ? 1e6 : -1.0;
            cd.outliers = mode == 2 || mode == 3 ? 64 : 0;
            cd.split = PQC_SPLIT_ADAPTIVE; /* one window rule for every mode (exact scoring's) */
            ASSERT_EQ(PQC_SUCCESS, open_and_select(&cd, &hk, &c, &sel));
            n_or = oracle_of(&hk, &sel, pqc_cache_layer_window(c, 0), &scr, orc);
            ASSERT_EQ(sel.count[0], n_or);
            if (cd.outliers) ASSERT_EQ(64, (int)c->layers[0].heads[0].n_outliers);
            rare_kept(&hk, orc, n_or, sel.idx, sel.count[0], &kp, &r);
            if (mode == 4) { /* ranked as the cache's exact scoring ranks */
                size_t same = 0;
                ASSERT_EQ(n_or, oracle_whole(&hk, &sel, pqc_cache_layer_window(c, 0), &scr, orc));
                rare_kept(&hk, orc, n_or, sel.idx, sel.count[0], &kp, &r);
                for (t = 0; t < n_or; t++) same += orc[t] == sel.idx[t];
                ASSERT(same + 2 >= n_or); /* the oracle, but for a rounding tie */
                ASSERT_EQ(r, kp);
            } else {
                kept[mode] += kp;
                m[mode] += mass(p, sel.idx, sel.count[0]);
            }
            if (mode == 0) in_ref += r;
            pqc_selection_free(&sel);
            pqc_cache_destroy(c);
        }
        hk_free(&hk);
    }
    fprintf(stderr, "  rare tokens kept of the oracle's %d: plain %d, rerank 2 %d, outlier list %d, both %d; "
            "mass %.3f %.3f %.3f %.3f\n", in_ref, kept[0], kept[1], kept[2], kept[3], m[0] / 4, m[1] / 4, m[2] / 4, m[3] / 4);
    ASSERT(in_ref >= 16);
    for (i = 1; i < 4; i++) {
        ASSERT_EQ(in_ref, kept[i]);
        ASSERT(m[i] >= m[0] - 1e-9);
    }
    ASSERT(m[1] > m[0] + 0.03); /* re-ranking recovers mass the codes lose */
    pqc_scratch_free(&scr);
    free(orc);
    free(p);
    PASS();
}

/* The outlier list holds the tokens the codebook serves worst: the build's list beats every
   unlisted token's residual; a token coded later whose residual beats the list joins it;
   tokens given back leave it. */
TEST outliers_are_the_worst_served_tokens(void)
{
    hardkeys hk;
    pqc_cache_desc cd = hard_desc(PQC_METRIC_L2);
    pqc_cache *c;
    pqc__head *H;
    pqc_matrix km;
    float row[D], far[D], *res = (float *)malloc(sizeof(float) * S);
    unsigned char *listed = (unsigned char *)calloc(S, 1);
    float lo = INFINITY, hi = 0;
    size_t t, n, before;
    int e, w;
    ASSERT(res && listed);
    ASSERT_EQ(0, make_hard(&hk, 2, 0));
    km = pqc_matrix_f32(hk.keys, S, D);
    cd.outliers = 32;
    cd.max_tokens = 2 * S;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &km));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(c));
    H = &c->layers[0].heads[0];
    n = H->codes.count;
    ASSERT(n > 1000);
    ASSERT_EQ(32, (int)H->n_outliers);
    ASSERT_EQ(32, (int)H->n_outliers_build);
    for (t = 0; t < H->n_outliers; t++) {
        ASSERT(t == 0 || H->outliers[t] > H->outliers[t - 1]);
        listed[H->outliers[t]] = 1;
    }
    for (t = 0; t < n; t++) {
        double a = 0;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_decode(&H->pq, &H->codes, t, row));
        for (e = 0; e < D; e++) {
            double r = hk.keys[(32 + t) * D + e] - row[e];
            a += r * r;
        }
        res[t] = (float)a;
        if (listed[t] && res[t] < lo) lo = res[t];
        if (!listed[t] && res[t] > hi) hi = res[t];
    }
    ASSERT(lo >= hi * (1 - 1e-4f));
    ASSERT_IN_RANGE(lo, H->outlier_thr, 1e-3f * lo);
    /* a served-badly token appended: once it leaves the window and is coded, it is listed */
    for (e = 0; e < D; e++) far[e] = (e % 7 == 0 ? 40.0f : 0.0f) * (e % 2 ? -1.0f : 1.0f);
    before = H->n_outliers;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, far, far));
    w = pqc_cache_layer_window(c, 0);
    for (e = 0; e < w + 1; e++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, hk.keys + (size_t)(100 + e) * D, row));
    {
        pqc_selection sel;
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, hk.queries, &sel));
        pqc_selection_free(&sel);
    }
    ASSERT(H->n_outliers > before);
    ASSERT(H->n_outliers <= 64);
    {
        int found = 0;
        for (t = before; t < H->n_outliers; t++) found |= H->outliers[t] == (uint32_t)(S - 32);
        ASSERT(found);
    }
    /* giving the tokens back takes them off the list: it is what a cache that never coded
       them holds (the same prompt, then ordinary tokens until the same tokens are coded) */
    pqc__codes_truncate(c, 0, S - 32);
    {
        pqc_cache *b;
        pqc_selection sel;
        pqc__head *HB;
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &b));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(b, 0, &km, &km));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_sync(b));
        for (e = 0; e < w; e++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(b, 0, hk.keys + (size_t)(100 + e) * D, row));
        ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(b, &sel));
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(b, 0, hk.queries, &sel));
        pqc_selection_free(&sel);
        HB = &b->layers[0].heads[0];
        ASSERT_EQ((size_t)(S - 32), HB->codes.count);
        ASSERT_EQ(HB->n_outliers, H->n_outliers);
        ASSERT_EQ(HB->n_outliers_build, H->n_outliers_build);
        ASSERT_MEM_EQ(HB->outliers, H->outliers, H->n_outliers * sizeof(uint32_t));
        ASSERT(H->n_outliers > H->n_outliers_build); /* tokens coded since the build are listed too */
        pqc_cache_destroy(b);
    }
    pqc_cache_destroy(c);
    hk_free(&hk);
    free(res);
    free(listed);
    PASS();
}

/* ----- residual-aware scoring -------------------------------------------------------- */

/* The residual bytes: each is the sub-space's residual norm under the codebook's metric,
   in steps of the scale, rounded up; a given scale caps at 255. */
TEST residual_bytes_hold_each_sub_space_residual_norm(void)
{
    hardkeys hk;
    pqc_pq_desc d = tu_pq_desc(2, 6, 10, 1);
    pqc_pq pq;
    pqc_codes codes;
    pqc_matrix keys;
    float w[D], scale[2] = {0, 0}, half[2], row[D];
    uint8_t *rb = (uint8_t *)malloc(2 * S), *rb2 = (uint8_t *)malloc(2 * S);
    size_t t;
    int j, e, top[2] = {0, 0}, capped = 0;
    ASSERT(rb && rb2);
    ASSERT_EQ(0, make_hard(&hk, 0, 0));
    keys = pqc_matrix_f32(hk.keys, S, D);
    obs_metric(&hk, 0.01f, w);
    d.metric = w;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
    ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, S, NULL));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_residuals(NULL, &pq, &codes, 0, &keys, scale, rb));
    ASSERT(scale[0] > 0 && scale[1] > 0);
    for (t = 0; t < S; t++) {
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_decode(&pq, &codes, t, row));
        for (j = 0; j < 2; j++) {
            double a = 0, n;
            for (e = 0; e < 64; e++) {
                int dim = pqc_pq_dim(&pq, j, e);
                double r = hk.keys[t * D + (size_t)dim] - row[dim];
                a += w[dim] * r * r;
            }
            n = sqrt(a) / scale[j];
            ASSERT(rb[t * 2 + (size_t)j] >= n - 1e-3 && rb[t * 2 + (size_t)j] <= n + 1 + 1e-3);
            top[j] |= rb[t * 2 + (size_t)j] == 255;
        }
    }
    ASSERT(top[0] && top[1]); /* the largest norm is the top step */
    /* a given, finer scale: rows [100, 200) against it, capped at 255 */
    half[0] = scale[0] / 2;
    half[1] = scale[1] / 2;
    keys = pqc_matrix_f32(hk.keys + 100 * D, 100, D);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_residuals(NULL, &pq, &codes, 100, &keys, half, rb2));
    ASSERT_EQ(scale[0] / 2, half[0]);
    for (t = 0; t < 100; t++)
        for (j = 0; j < 2; j++) {
            int want = 2 * rb[(100 + t) * 2 + (size_t)j];
            int got = rb2[t * 2 + (size_t)j];
            ASSERT(got <= 255 && got >= (want > 255 ? 255 : want) - 2 && got <= want);
            capped += got == 255;
        }
    /* misuse */
    ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_residuals(NULL, &pq, &codes, 0, &keys, NULL, rb2));
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_residuals(NULL, &pq, &codes, S - 50, &keys, half, rb2));
    half[1] = NAN;
    ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_residuals(NULL, &pq, &codes, 0, &keys, half, rb2));
    pqc_codes_free(&codes);
    pqc_pq_free(&pq);
    hk_free(&hk);
    free(rb);
    free(rb2);
    (void)capped;
    PASS();
}

/* On the hard data sets the search with residual-aware scoring (weight 0.15) keeps every
   rare token of exact top-k, and the mass stays within 0.01 of the search without it
   (the weighted bound adds little where the metric already serves the queries); bad
   settings are refused. */
TEST residual_aware_search_keeps_the_rare_tokens(void)
{
    pqc_scratch scr;
    float *sc = (float *)malloc(sizeof(float) * S);
    uint32_t *ex = (uint32_t *)malloc(sizeof(uint32_t) * S), *id = (uint32_t *)malloc(sizeof(uint32_t) * S);
    uint8_t *rb = (uint8_t *)malloc(2 * S);
    int i, kept = 0, in_ref = 0;
    double worst = 0;
    ASSERT(sc && ex && id && rb);
    memset(&scr, 0, sizeof scr);
    for (i = 0; i < 4; i++) {
        hardkeys hk;
        pqc_matrix keys;
        pqc_search_desc sd;
        pqc_pq_desc d = tu_pq_desc(2, 6, 10, 1);
        pqc_pq pq;
        pqc_codes codes;
        float w[D], scale[2] = {0, 0};
        double m0, m1;
        int kp, r;
        ASSERT_EQ(0, make_hard(&hk, i, 0));
        keys = pqc_matrix_f32(hk.keys, S, D);
        ASSERT(exact_attention(&hk, &scr, sc, ex));
        memset(&sd, 0, sizeof sd);
        sd.k = S / 10;
        obs_metric(&hk, 0.01f, w);
        d.metric = w;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_train(NULL, &d, &keys, &pq));
        ASSERT_EQ(PQC_SUCCESS, pqc_codes_init(&codes, &pq, S, NULL));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_encode(NULL, &pq, &keys, &codes));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_residuals(NULL, &pq, &codes, 0, &keys, scale, rb));
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
        m0 = mass(sc, id, sd.k);
        sd.residuals = rb;
        sd.residual_scale = scale;
        sd.residual_weight = 0.15f;
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
        m1 = mass(sc, id, sd.k);
        if (m0 - m1 > worst) worst = m0 - m1;
        rare_kept(&hk, ex, sd.k, id, sd.k, &kp, &r);
        kept += kp;
        in_ref += r;
        if (i == 0) { /* misuse */
            sd.residual_weight = 0;
            ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
            sd.residual_weight = NAN;
            ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
            sd.residual_weight = 0.15f;
            sd.residual_scale = NULL;
            ASSERT_EQ(PQC_ERROR_INVALID_ARGUMENT, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
            scale[1] = -1;
            sd.residual_scale = scale;
            ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_pq_search(NULL, &pq, &codes, hk.queries, G, &sd, &scr, id, NULL));
        }
        pqc_codes_free(&codes);
        pqc_pq_free(&pq);
        hk_free(&hk);
    }
    fprintf(stderr, "  residual-aware: rare kept %d of %d, largest mass loss %.4f\n", kept, in_ref, worst);
    ASSERT(in_ref >= 16);
    ASSERT_EQ(in_ref, kept);
    ASSERT(worst < 0.01);
    { /* the cache's setting */
        pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
        pqc_cache *c = NULL;
        double bad[3] = {INFINITY, NAN, 2e6};
        pqc_cache_desc got;
        for (i = 0; i < 3; i++) {
            cd.residual_weight = bad[i];
            ASSERT_EQ(PQC_ERROR_OUT_OF_RANGE, pqc_cache_create(NULL, &cd, &c));
            ASSERT(c == NULL);
        }
        cd.residual_weight = -0.1; /* negative: off */
        ASSERT_EQ(PQC_SUCCESS, pqc_cache_resolve(NULL, &cd, &got));
        ASSERT_EQ(0, got.residual_weight);
    }
    pqc_scratch_free(&scr);
    free(sc);
    free(ex);
    free(id);
    free(rb);
    PASS();
}

/* The cache keeps each head's residual bytes as the PQ core computes them (the build's,
   then tokens coded later against the build's scale) and its selection is the core's
   residual-aware search over them. */
TEST cache_residual_scoring_is_the_core_search(void)
{
    hardkeys hk;
    pqc_cache_desc cd = hard_desc(PQC_METRIC_QUERY);
    pqc_cache *c;
    pqc__head *H;
    pqc_selection sel;
    pqc_matrix km;
    pqc_search_desc sd;
    uint8_t *rb = (uint8_t *)malloc(2 * S);
    uint32_t *id = (uint32_t *)malloc(sizeof(uint32_t) * S);
    float sc2[2];
    size_t n, t, take;
    int e;
    ASSERT(rb && id);
    ASSERT_EQ(0, make_hard(&hk, 3, 0));
    km = pqc_matrix_f32(hk.keys, S, D);
    cd.residual_weight = 0.15;
    cd.max_tokens = 2 * S;
    cd.split = PQC_SPLIT_ADAPTIVE; /* the coded tokens' top-k alone (no window competing) */
    cd.pq.m = 2; /* two residual bytes per token below */
    cd.pq.bits = 6;
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_create(NULL, &cd, &c));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_observe(c, 0, hk.obs, N_OBS));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_prefill(c, 0, &km, &km));
    for (e = 0; e < 40; e++) ASSERT_EQ(PQC_SUCCESS, pqc_cache_append(c, 0, hk.keys + (size_t)(200 + e) * D, hk.keys));
    ASSERT_EQ(PQC_SUCCESS, pqc_selection_init(c, &sel));
    ASSERT_EQ(PQC_SUCCESS, pqc_cache_select(c, 0, hk.queries, &sel));
    H = &c->layers[0].heads[0];
    n = H->codes.count;
    ASSERT(n > c->layers[0].n_trained); /* some tokens coded after the build */
    /* the build's bytes, then the later ones against the build's scale */
    sc2[0] = sc2[1] = 0;
    km = pqc_matrix_f32(hk.keys + 32 * D, c->layers[0].n_trained, D);
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_residuals(NULL, &H->pq, &H->codes, 0, &km, sc2, rb));
    ASSERT_EQ(sc2[0], H->rscale[0]);
    ASSERT_EQ(sc2[1], H->rscale[1]);
    ASSERT_MEM_EQ(rb, H->rq, c->layers[0].n_trained * 2);
    for (t = c->layers[0].n_trained; t < n; t++) {
        const float *kr = 32 + t < S ? hk.keys + (32 + t) * D : hk.keys + (200 + (32 + t - S)) * D;
        km = pqc_matrix_f32(kr, 1, D);
        ASSERT_EQ(PQC_SUCCESS, pqc_pq_residuals(NULL, &H->pq, &H->codes, t, &km, sc2, rb + t * 2));
        ASSERT_MEM_EQ(rb + t * 2, H->rq + t * 2, 2);
    }
    /* the selection's top-k part is the core's residual-aware search */
    take = sel.count[0] - 32 - (size_t)pqc_cache_layer_window(c, 0) - (c->layers[0].n_tokens - (size_t)pqc_cache_layer_window(c, 0) - 32 - n);
    memset(&sd, 0, sizeof sd);
    sd.k = take;
    sd.count = n;
    sd.residuals = H->rq;
    sd.residual_scale = H->rscale;
    sd.residual_weight = 0.15f;
    ASSERT_EQ(PQC_SUCCESS, pqc_pq_search(NULL, &H->pq, &H->codes, hk.queries, G, &sd, NULL, id, NULL));
    for (t = 0; t < take; t++) ASSERT_EQ(id[t] + 32, sel.idx[32 + t]);
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    hk_free(&hk);
    free(rb);
    free(id);
    PASS();
}

SUITE(fidelity)
{
    RUN_TEST(metric_codes_each_key_to_its_weighted_nearest_centroid);
    RUN_TEST(metric_out_of_range_is_refused);
    RUN_TEST(metric_blocks_code_each_key_to_its_nearest_centroid_under_the_block);
    RUN_TEST(metric_blocks_serve_correlated_queries_better_than_weights);
    RUN_TEST(metric_blocks_misuse_is_refused);
    RUN_TEST(rope_bands_are_the_band_ordered_contiguous_pq);
    RUN_TEST(rope_layout_misuse_is_refused);
    RUN_TEST(default_subspaces_follow_the_rope_layout);
    RUN_TEST(metric_keeps_the_rare_tokens_plain_pq_loses);
    RUN_TEST(observed_queries_keep_the_rare_tokens_the_oracle_keeps);
    RUN_TEST(bands_metric_builds_the_observed_blocks);
    RUN_TEST(observe_misuse_is_refused_and_changes_nothing);
    RUN_TEST(tiny_scoring_settings_are_refused_or_build);
    RUN_TEST(driver_observes_the_prompt_and_gives_observations_back_on_failure);
    RUN_TEST(drifted_queries_rebuild_the_codebook_with_their_metric);
    RUN_TEST(drifted_queries_rebuild_the_weights_with_theirs);
    RUN_TEST(a_failed_decode_step_leaves_no_drift_behind);
    RUN_TEST(adaptive_split_gives_the_top_k_to_the_head_that_needs_it);
    RUN_TEST(adaptive_split_may_give_a_head_no_top_k);
    RUN_TEST(window_follows_the_observed_attention);
    RUN_TEST(window_competes_for_each_heads_budget);
    RUN_TEST(window_rivals_score_as_coded_tokens);
    RUN_TEST(rerank_over_every_row_is_the_exact_search);
    RUN_TEST(rerank_misuse_is_refused);
    RUN_TEST(rerank_and_outliers_keep_what_the_oracle_keeps);
    RUN_TEST(outliers_are_the_worst_served_tokens);
    RUN_TEST(residual_bytes_hold_each_sub_space_residual_norm);
    RUN_TEST(residual_aware_search_keeps_the_rare_tokens);
    RUN_TEST(cache_residual_scoring_is_the_core_search);
}

#ifndef PQC_TEST_UNITY /* tests/test_lib.c holds every suite in one program */
GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    RUN_SUITE(fidelity);
    GREATEST_MAIN_END();
}
#endif
