/* bench_fidelity: how much of the attention that matters PQ selection keeps, measured
   against exact attention on hard LLM-like keys (bench/hardkeys.h).

   Data sets: difficulty (easy, medium, hard) x RoPE layout (half-split, interleaved) x
   RoPE base (1e4, 5e5); one KV head, 4 query heads (GQA), d_h 128, s tokens. Half of the
   data sets have queries with a strong recency component (half-split with base 1e4 and
   interleaved with base 5e5), the others none.

   Reference: exact attention, each query head's softmax(q.k / sqrt(d_h)) over all s tokens,
   summed over the 4 heads (softmax-sum GQA) and normalised to total 1. That distribution
   is the "attention mass" below.

   Techniques (each PQ setting m, b with k-means++, 10 Lloyd iterations, seed 1):
      plain     Euclidean k-means and coding (PQC_METRIC_L2)
      q-metric  the score-aware metric: k-means and coding weigh each dimension by the
                mean squared query observed at the end of the prompt (16 observation
                queries per head, bench/hardkeys.h), normalised, plus the default floor
                0.01 (pqc_cache_observe, PQC_METRIC_QUERY: the library's default)
      q-unrel   the same metric from observation queries that look for something else
                (obs_unrelated): what the metric costs when the prompt's end does not
                predict the decode query
      q-drift   q-unrel, after the cache noticed the drift: the first select finds the
                decode query's energy where the metric did not look and rebuilds with the
                decode query's metric; the figures are those of the select after that
                rebuild (search path: the codebook trained with the decode query's metric)
      bands / q-bands  sub-spaces of rope bands (pqc_pq_desc.subspaces), Euclidean / with
                the metric and the RoPE layout stated
      q-rerank2 q-metric, then the PQ top 2k scored again with the exact keys and the best
                k kept (pqc_search_desc.rerank, pqc_cache_desc.rerank = 2)
      q-outl    q-metric plus an exact list of 64 tokens per head, those of largest
                metric-weighted residual, merged with the PQ top-k and scored exactly
                (pqc_cache_desc.outliers = 64; the search path builds the same list)
      q-rr2+outl  both
      q-resid   q-metric with residual-aware scoring: each token's two residual norms
                (one byte per sub-space, under the metric, pqc_pq_residuals) and each
                head's score plus 0.15 x sum_j |q_j| |r_j| (the query's norm under the
                inverse metric; pqc_cache_desc.residual_weight = 0.15)

   1. Search path: pqc_pq_train + pqc_pq_encode + pqc_pq_search (softmax-sum, k = s/10)
      for each setting, against exact top-k (pqc_exact_search, same k):
        B/tok       bytes per token per KV head: codes m*b/8 plus the centroids
                    (2^b * d_h floats) spread over the s tokens
        recall      |selection and exact top-k| / k
        mass sel    attention mass on the selected tokens (of total 1)
        mass ref    attention mass on the exact top-k tokens
        gap         mass ref - mass sel
        rare        rare tokens kept by the selection / rare tokens in the exact top-k
        train, search  median of --reps runs, ns per token
   2. Cache path: a pqc_cache (1 layer, 1 KV head, 4 query heads, d_h 128, default budget
      0.1: 32 sinks, window = the default recent_share of the budget, top-k the rest), the observation
      queries observed, the keys prefilled, pqc_cache_sync, one pqc_cache_select with the
      queries. Compared with a cache-shaped
      oracle: the same sinks and window plus the exact top-k (softmax-sum over the same mid
      tokens the cache searches) of the same size. Columns as above; recall is over the
      top-k part (the mid tokens); B/tok spreads the centroids over the coded tokens.
   3. Per data set: the mass on the sink token, the 32 sinks, the rare tokens and the
      recent window; what exact top-k and the oracle hold.
   4. A summary per difficulty (means over the four data sets of each level), also
      written to --out (default build/fidelity.dat) for bench/fidelity.gp.
   5. Heads sharing a budget: the 12 data sets as the 12 KV heads of one cache (48 query
      heads), observed and selected once with the even split (PQC_SPLIT_FIXED) and once
      with the adaptive split, once with the window competing (PQC_SPLIT_COMPETE) and once
      with both the even split and the window competing (PQC_SPLIT_FIXED_COMPETE): per
      head the attention the observed queries paid to its sinks and window
      (pqc_cache_observed_mass), its top-k and the mass it kept; and the rare tokens kept
      of each head's oracle of the same shape.
   (Random k-means initialisation instead of k-means++ was measured too, with no
   consistent difference on these keys; it is no longer a setting here.)

   usage: bench_fidelity [--s N] [--reps R] [--threads T] [--out FILE] [--quick]
   --quick: s = 8192 and reps 1 unless given. */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "hardkeys.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

enum { N_SETTINGS = 17, N_LEVELS = 3, N_SETS = 12, N_SINK = 32, MAXREPS = 31, N_OBS = 16 };
/* bands: sub-spaces of rope bands (pqc_pq_desc.subspaces), Euclidean; q-bands: the same
   with the metric, the RoPE layout stated (the cache then ties the weights within pairs) */
enum { T_PLAIN, T_METRIC, T_UNREL, T_DRIFT, T_BANDS, T_QBANDS, T_RERANK, T_OUTL, T_RROUT, T_RESID, N_TECH };
#define IS_BANDS(t) ((t) == T_BANDS || (t) == T_QBANDS)
#define RERANK 2.0  /* q-rerank2: the PQ top 2k scored again with the exact keys */
#define OUTLIERS 64 /* q-outl: the exact list of each head (desc.outliers)      */
#define RESID 0.15f /* q-resid: residual-aware scoring's weight (desc.residual_weight) */

typedef struct setting {
    const char *name;
    int m, bits, tech;
} setting;

/* ordered by bytes per token */
static const setting settings[N_SETTINGS] = {
    {"m2b6 plain", 2, 6, T_PLAIN},   {"m2b6 q-metric", 2, 6, T_METRIC}, {"m2b6 q-unrel", 2, 6, T_UNREL},
    {"m2b6 q-drift", 2, 6, T_DRIFT}, {"m2b6 bands", 2, 6, T_BANDS}, {"m2b6 q-bands", 2, 6, T_QBANDS},
    {"m2b6 q-rerank2", 2, 6, T_RERANK}, {"m2b6 q-outl", 2, 6, T_OUTL}, {"m2b6 q-rr2+outl", 2, 6, T_RROUT},
    {"m2b6 q-resid", 2, 6, T_RESID},
    {"m2b8 plain", 2, 8, T_PLAIN},   {"m2b8 q-metric", 2, 8, T_METRIC}, {"m4b8 plain", 4, 8, T_PLAIN},
    {"m4b8 q-metric", 4, 8, T_METRIC}, {"m16b4 plain", 16, 4, T_PLAIN}, {"m16b4 q-metric", 16, 4, T_METRIC},
    {"m8b8 plain", 8, 8, T_PLAIN},
};

/* the library's weights for observation queries obs (n rows of g x d): mean squared query
   per dimension over the mean over dimensions, plus the default floor 0.01 */
static void obs_metric(const float *obs, size_t n, float *w)
{
    double acc[HK_D], tot = 0;
    size_t r;
    int e;
    for (e = 0; e < HK_D; e++) acc[e] = 0;
    for (r = 0; r < n * HK_G; r++)
        for (e = 0; e < HK_D; e++) acc[e] += (double)obs[r * HK_D + e] * obs[r * HK_D + e];
    for (e = 0; e < HK_D; e++) tot += acc[e];
    for (e = 0; e < HK_D; e++) w[e] = (float)(acc[e] * HK_D / tot + 0.01);
}

/* what one selection achieved against its reference */
typedef struct result {
    double bytes, recall, mass, mass_ref, train_ns, search_ns;
    int rare_kept, rare_ref;
} result;

typedef struct dataset {
    char name[40];
    int level, layout, recency;
    double base;
    int n_rare;
    size_t window, k, k_mid;
    double m_sink, m_sinks, m_rare, m_window, m_exact, m_oracle, exact_ns;
    int rare_exact, rare_oracle;
    result search[N_SETTINGS], cache[N_SETTINGS];
} dataset;

static void die(const char *what)
{
    fprintf(stderr, "bench_fidelity: %s: %s\n", what, pqc_last_error());
    exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (!p) {
        fprintf(stderr, "bench_fidelity: out of memory\n");
        exit(1);
    }
    return p;
}

/* mark[t] = v for the n indices */
static void mark(unsigned char *m, const uint32_t *idx, size_t n, unsigned char v)
{
    size_t i;
    for (i = 0; i < n; i++) m[idx[i]] = v;
}

static double mass_of(const double *p, const uint32_t *idx, size_t n)
{
    double a = 0;
    size_t i;
    for (i = 0; i < n; i++) a += p[idx[i]];
    return a;
}

/* rare tokens in the reference (ref[t] != 0) and, of those, in the selection */
static void rare_count(const hardkeys *hk, const unsigned char *ref, const unsigned char *sel, int *kept, int *in_ref)
{
    int r;
    *kept = *in_ref = 0;
    for (r = 0; r < hk->n_rare; r++) {
        uint32_t t = hk->rare[r];
        if (!ref[t]) continue;
        (*in_ref)++;
        if (sel[t]) (*kept)++;
    }
}

static double overlap(const unsigned char *ref, const uint32_t *idx, size_t n)
{
    size_t i, c = 0;
    for (i = 0; i < n; i++) c += ref[idx[i]] != 0;
    return (double)c;
}

static double bytes_per_token(const setting *st, size_t tokens)
{
    double b = st->m * st->bits / 8.0 + (double)((size_t)1 << st->bits) * HK_D * sizeof(float) / (double)tokens;
    if (st->tech == T_OUTL || st->tech == T_RROUT) b += 16.0 * OUTLIERS / (double)tokens; /* 2 lists of 2 x OUTLIERS */
    if (st->tech == T_RESID) b += st->m + 4.0 * st->m / (double)tokens; /* a byte per sub-space, the scales */
    return b;
}

/* the search path's exact list: the OUTLIERS tokens of largest (metric-weighted) residual */
static void worst_served(pqc_runtime *rt, const pqc_pq *pq, const pqc_codes *codes, const float *keys, size_t s,
                         pqc_scratch *scr, float *res, uint32_t *out)
{
    float dec[HK_D];
    size_t t;
    int e;
    for (t = 0; t < s; t++) {
        double a = 0;
        if (pqc_pq_decode(pq, codes, t, dec)) die("decode");
        for (e = 0; e < HK_D; e++) {
            double r = keys[t * HK_D + e] - dec[e];
            a += (pq->metric ? pq->metric[e] : 1.0) * r * r;
        }
        res[t] = (float)a;
    }
    if (pqc_topk(rt, res, s, OUTLIERS, scr, out, NULL)) die("outliers");
}

static void print_rule(int n)
{
    while (n-- > 0) putchar('-');
    putchar('\n');
}

int main(int argc, char **argv)
{
    size_t s = 32768, k, t;
    int reps = 3, threads = 1, quick = 0, s_set = 0, reps_set = 0, i, di, si, r;
    const char *out_path = "build/fidelity.dat";
    pqc_runtime_desc rd;
    pqc_runtime *rt;
    pqc_scratch scr;
    dataset *sets;
    double *p, tt[MAXREPS], t_all = now();
    float *sc;
    uint32_t *exact_idx, *idx, *oracle, *merged, outl[OUTLIERS];
    uint8_t *resb;
    float rscale[2];
    unsigned char *in_ref, *in_sel;
    float *all_k, *all_obs, *all_q, *all_p; /* section 5: every data set as a head */
    hardkeys *all_hk;
    FILE *f;

    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--s") && i + 1 < argc) {
            s = (size_t)strtoull(argv[++i], NULL, 10);
            s_set = 1;
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
            reps_set = 1;
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            out_path = argv[++i];
        } else if (!strcmp(argv[i], "--quick")) {
            quick = 1;
        } else {
            fprintf(stderr, "usage: %s [--s N] [--reps R] [--threads T] [--out FILE] [--quick]\n", argv[0]);
            return 2;
        }
    }
    if (quick && !s_set) s = 8192;
    if (quick && !reps_set) reps = 1;
    if (s < 4096 || s > ((size_t)1 << 24) || reps < 1 || reps > MAXREPS || threads < 1) {
        fprintf(stderr, "bench_fidelity: bad arguments (s in 4096..16M, reps in 1..%d, threads >= 1)\n", MAXREPS);
        return 2;
    }
    k = s / 10;

    memset(&rd, 0, sizeof rd);
    rd.n_threads = threads > 1 ? threads - 1 : -1; /* the caller is one of the threads */
    if (pqc_runtime_create(&rd, &rt) != PQC_SUCCESS) die("runtime");
    memset(&scr, 0, sizeof scr);
    sets = (dataset *)xcalloc(N_SETS, sizeof *sets);
    p = (double *)xcalloc(s, sizeof *p);
    sc = (float *)xcalloc(s, sizeof *sc);
    exact_idx = (uint32_t *)xcalloc(s, sizeof *exact_idx);
    idx = (uint32_t *)xcalloc(s, sizeof *idx);
    merged = (uint32_t *)xcalloc(s + OUTLIERS, sizeof *merged);
    resb = (uint8_t *)xcalloc(s, 2);
    oracle = (uint32_t *)xcalloc(s, sizeof *oracle);
    in_ref = (unsigned char *)xcalloc(s, 1);
    in_sel = (unsigned char *)xcalloc(s, 1);
    all_k = (float *)xcalloc(s * N_SETS * HK_D, sizeof(float));
    all_obs = (float *)xcalloc((size_t)N_OBS * N_SETS * HK_G * HK_D, sizeof(float));
    all_q = (float *)xcalloc((size_t)N_SETS * HK_G * HK_D, sizeof(float));
    all_p = (float *)xcalloc(s * N_SETS, sizeof(float));
    all_hk = (hardkeys *)xcalloc(N_SETS, sizeof *all_hk);

    printf("bench_fidelity: pqcache %s, simd %s, threads %d, s = %zu, k = s/10 = %zu, d_h 128, 1 KV head, "
           "4 query heads (softmax-sum), %d observation queries per head, reps %d\n",
           pqc_version(), pqc_simd_name(pqc_runtime_simd(rt)), threads, s, k, N_OBS, reps);
    fflush(stdout);

    for (di = 0; di < N_SETS; di++) {
        dataset *ds = &sets[di];
        hardkeys hk, hu;
        pqc_matrix keys = pqc_matrix_f32(NULL, 0, 0);
        float w_obs[HK_D], w_unrel[HK_D], w_dec[HK_D];
        pqc_search_desc sd;
        double tot = 0, t_set = now();

        ds->level = di / 4;
        ds->layout = (di / 2) % 2;
        ds->base = di % 2 ? 5e5 : 1e4;
        ds->recency = (ds->layout == HK_HALF) == (ds->base < 1e5);
        snprintf(ds->name, sizeof ds->name, "%s %s %s%s", hk_level_name(ds->level), ds->layout == HK_HALF ? "half" : "intl",
                ds->base < 1e5 ? "1e4" : "5e5", ds->recency ? " rec" : "");
        memset(&hk, 0, sizeof hk);
        hk.s = s;
        hk.level = ds->level;
        hk.layout = ds->layout;
        hk.base = ds->base;
        hk.recency = ds->recency ? 1.0 : 0.0;
        hk.seed = 1000 + (uint64_t)di;
        hk.n_obs = N_OBS;
        hu = hk;
        hu.obs_unrelated = 1;
        if (hk_make(&hk) || hk_make(&hu) || memcmp(hk.keys, hu.keys, sizeof(float) * s * HK_D) != 0) {
            fprintf(stderr, "bench_fidelity: cannot make data set %s\n", ds->name);
            return 1;
        }
        obs_metric(hk.obs, N_OBS, w_obs);
        obs_metric(hu.obs, N_OBS, w_unrel);
        obs_metric(hk.queries, 1, w_dec);
        ds->n_rare = hk.n_rare;
        ds->k = k;
        keys = pqc_matrix_f32(hk.keys, s, HK_D);

        /* the reference distribution */
        if (pqc_exact_scores(rt, &keys, hk.queries, HK_G, PQC_GQA_SOFTMAX_SUM, &scr, sc)) die("exact scores");
        for (t = 0; t < s; t++) tot += sc[t];
        for (t = 0; t < s; t++) p[t] = sc[t] / tot;
        memset(&sd, 0, sizeof sd);
        sd.k = k;
        sd.gqa = PQC_GQA_SOFTMAX_SUM;
        for (r = 0; r < reps; r++) {
            double t0 = now();
            if (pqc_exact_search(rt, &keys, hk.queries, HK_G, &sd, &scr, exact_idx, NULL)) die("exact search");
            tt[r] = now() - t0;
        }
        ds->exact_ns = median(tt, reps) * 1e9 / (double)s;
        memset(in_ref, 0, s);
        mark(in_ref, exact_idx, k, 1);
        ds->m_exact = mass_of(p, exact_idx, k);
        ds->m_sink = p[0];
        for (t = 0; t < N_SINK; t++) ds->m_sinks += p[t];
        for (r = 0; r < hk.n_rare; r++) ds->m_rare += p[hk.rare[r]];
        memset(in_sel, 1, s);
        rare_count(&hk, in_ref, in_sel, &r, &ds->rare_exact);

        /* 1. search path */
        for (si = 0; si < N_SETTINGS; si++) {
            const setting *st = &settings[si];
            result *res = &ds->search[si];
            pqc_pq_desc pd;
            pqc_pq pq;
            pqc_codes codes;
            memset(&pd, 0, sizeof pd);
            pd.m = st->m;
            pd.bits = st->bits;
            pd.iters = 10;
            pd.seed = 1;
            pd.metric = st->tech == T_PLAIN || st->tech == T_BANDS ? NULL : st->tech == T_UNREL ? w_unrel
                      : st->tech == T_DRIFT ? w_dec : w_obs;
            if (IS_BANDS(st->tech)) {
                pd.rope = ds->layout == HK_HALF ? PQC_ROPE_HALF : PQC_ROPE_INTERLEAVED;
                pd.subspaces = PQC_SUBSPACES_ROPE_BANDS;
            }
            for (r = 0; r < reps; r++) {
                double t0 = now();
                if (pqc_pq_train(rt, &pd, &keys, &pq)) die("train");
                tt[r] = now() - t0;
                if (r + 1 < reps) pqc_pq_free(&pq);
            }
            res->train_ns = median(tt, reps) * 1e9 / (double)s;
            if (pqc_codes_init(&codes, &pq, s, NULL) || pqc_pq_encode(rt, &pq, &keys, &codes)) die("encode");
            if (st->tech == T_OUTL || st->tech == T_RROUT) worst_served(rt, &pq, &codes, hk.keys, s, &scr, sc, outl);
            if (st->tech == T_RESID) {
                rscale[0] = rscale[1] = 0;
                if (pqc_pq_residuals(rt, &pq, &codes, 0, &keys, rscale, resb)) die("residuals");
            }
            for (r = 0; r < reps; r++) {
                double t0 = now();
                if (st->tech == T_OUTL || st->tech == T_RROUT) {
                    /* the PQ candidates merged with the exact list, scored exactly */
                    pqc_search_desc wd = sd;
                    size_t a = 0, b = 0, nm = 0;
                    wd.k = st->tech == T_RROUT ? (size_t)(RERANK * (double)k) : k;
                    if (pqc_pq_search(rt, &pq, &codes, hk.queries, HK_G, &wd, &scr, idx, NULL)) die("search");
                    while (a < wd.k || b < OUTLIERS) {
                        uint32_t x = a < wd.k ? idx[a] : 0xffffffffu, y = b < OUTLIERS ? outl[b] : 0xffffffffu;
                        merged[nm++] = x <= y ? x : y;
                        a += x <= y;
                        b += y <= x;
                    }
                    if (pqc_rerank(rt, &keys, hk.queries, HK_G, PQC_GQA_SOFTMAX_SUM, merged, nm, k, &scr, idx, NULL))
                        die("rerank");
                } else if (st->tech == T_RESID) {
                    pqc_search_desc wd = sd;
                    wd.residuals = resb;
                    wd.residual_scale = rscale;
                    wd.residual_weight = RESID;
                    if (pqc_pq_search(rt, &pq, &codes, hk.queries, HK_G, &wd, &scr, idx, NULL)) die("search");
                } else if (st->tech == T_RERANK) {
                    pqc_search_desc wd = sd;
                    wd.rerank = RERANK;
                    wd.keys = &keys;
                    if (pqc_pq_search(rt, &pq, &codes, hk.queries, HK_G, &wd, &scr, idx, NULL)) die("search");
                } else if (pqc_pq_search(rt, &pq, &codes, hk.queries, HK_G, &sd, &scr, idx, NULL)) {
                    die("search");
                }
                tt[r] = now() - t0;
            }
            res->search_ns = median(tt, reps) * 1e9 / (double)s;
            res->bytes = bytes_per_token(st, s);
            res->recall = pqc_recall(exact_idx, k, idx, k);
            res->mass = mass_of(p, idx, k);
            res->mass_ref = ds->m_exact;
            memset(in_sel, 0, s);
            mark(in_sel, idx, k, 1);
            rare_count(&hk, in_ref, in_sel, &res->rare_kept, &res->rare_ref);
            pqc_codes_free(&codes);
            pqc_pq_free(&pq);
        }

        /* 2. cache path */
        for (si = 0; si < N_SETTINGS; si++) {
            const setting *st = &settings[si];
            result *res = &ds->cache[si];
            pqc_cache_desc cd;
            pqc_cache *c;
            pqc_selection sel;
            size_t cnt, w, mid_end, take, n_or = 0;
            memset(&cd, 0, sizeof cd);
            cd.n_layers = 1;
            cd.n_kv_heads = 1;
            cd.n_q_heads = HK_G;
            cd.head_dim = HK_D;
            cd.max_tokens = s + 64;
            cd.pq.m = st->m;
            cd.pq.bits = st->bits;
            cd.pq.iters = 10;
            cd.pq.seed = 1;
            cd.metric = st->tech == T_PLAIN || st->tech == T_BANDS ? PQC_METRIC_L2 : PQC_METRIC_QUERY;
            if (st->tech == T_RERANK || st->tech == T_RROUT) cd.rerank = RERANK;
            if (st->tech == T_OUTL || st->tech == T_RROUT) cd.outliers = OUTLIERS;
            if (st->tech == T_RESID) cd.residual_weight = RESID;
            /* the settings compared at one shape of the budget: the window stays as derived
               (bench_suite measures the default, whose builds may lower it) */
            cd.split = PQC_SPLIT_FIXED;
            if (IS_BANDS(st->tech)) {
                cd.pq.rope = ds->layout == HK_HALF ? PQC_ROPE_HALF : PQC_ROPE_INTERLEAVED;
                cd.pq.subspaces = PQC_SUBSPACES_ROPE_BANDS;
            }
            if (pqc_cache_create(rt, &cd, &c)) die("cache create");
            if (pqc_cache_observe(c, 0, st->tech == T_UNREL || st->tech == T_DRIFT ? hu.obs : hk.obs, N_OBS))
                die("observe");
            if (pqc_cache_prefill(c, 0, &keys, &keys)) die("prefill");
            if (pqc_cache_sync(c)) die("build");
            if (pqc_selection_init(c, &sel) || pqc_cache_select(c, 0, hk.queries, &sel)) die("select");
            if (st->tech == T_DRIFT) {
                pqc_layer_stats ls;
                if (pqc_cache_sync(c) || pqc_cache_select(c, 0, hk.queries, &sel) || pqc_cache_stats(c, 0, &ls))
                    die("select after the drift");
                if (ls.rebuilds != 1) fprintf(stderr, "bench_fidelity: %s: %d drift rebuilds\n", ds->name, (int)ls.rebuilds);
            }
            cnt = sel.count[0];
            w = (size_t)pqc_cache_layer_window(c, 0);
            mid_end = s - w;
            if (cnt < N_SINK + w || sel.idx[0] != 0 || sel.idx[N_SINK - 1] != N_SINK - 1) {
                fprintf(stderr, "bench_fidelity: unexpected selection shape (%zu tokens, window %zu)\n", cnt, w);
                return 1;
            }
            take = cnt - N_SINK - w;
            if (si == 0) {
                /* the oracle: sinks + exact top-`take` of the mid tokens + window */
                pqc_matrix mid = pqc_matrix_f32(hk.keys + (size_t)N_SINK * HK_D, mid_end - N_SINK, HK_D);
                pqc_search_desc od = sd;
                od.k = take;
                for (t = 0; t < N_SINK; t++) oracle[n_or++] = (uint32_t)t;
                if (take > 0 && pqc_exact_search(rt, &mid, hk.queries, HK_G, &od, &scr, oracle + n_or, NULL))
                    die("oracle");
                for (t = 0; t < take; t++) oracle[n_or + t] += N_SINK;
                n_or += take;
                for (t = mid_end; t < s; t++) oracle[n_or++] = (uint32_t)t;
                ds->window = w;
                ds->k_mid = take;
                ds->m_oracle = mass_of(p, oracle, n_or);
                for (t = mid_end; t < s; t++) ds->m_window += p[t];
            } else if (take != ds->k_mid || w != ds->window) {
                fprintf(stderr, "bench_fidelity: the budget changed between settings\n");
                return 1;
            }
            memset(in_ref, 0, s);
            mark(in_ref, oracle, N_SINK + take + w, 1);
            if (si == 0) {
                memset(in_sel, 1, s);
                rare_count(&hk, in_ref, in_sel, &r, &ds->rare_oracle);
            }
            memset(in_sel, 0, s);
            mark(in_sel, sel.idx, cnt, 1);
            res->bytes = bytes_per_token(st, mid_end - N_SINK);
            res->recall = take ? overlap(in_ref, sel.idx + N_SINK, take) / (double)take : 1.0;
            res->mass = mass_of(p, sel.idx, cnt);
            res->mass_ref = ds->m_oracle;
            rare_count(&hk, in_ref, in_sel, &res->rare_kept, &res->rare_ref);
            pqc_selection_free(&sel);
            pqc_cache_destroy(c);
        }
        /* in_ref holds the oracle now; the next data set rebuilds it */
        fprintf(stderr, "bench_fidelity: %-20s done in %.1f s\n", ds->name, now() - t_set);
        for (t = 0; t < s; t++) {
            memcpy(all_k + (t * N_SETS + (size_t)di) * HK_D, hk.keys + t * HK_D, sizeof(float) * HK_D);
            all_p[(size_t)di * s + t] = (float)p[t];
        }
        for (t = 0; t < N_OBS; t++)
            memcpy(all_obs + (t * N_SETS + (size_t)di) * HK_G * HK_D, hk.obs + t * HK_G * HK_D, sizeof(float) * HK_G * HK_D);
        memcpy(all_q + (size_t)di * HK_G * HK_D, hk.queries, sizeof(float) * HK_G * HK_D);
        free(hk.keys); /* the rare positions stay for section 5 */
        hk.keys = NULL;
        all_hk[di] = hk;
        hk_free(&hu);
    }

    /* ---- 5. heads sharing a budget ---- */
    {
        double m_kept[4] = {0, 0, 0, 0}, win[N_SETS], snk[N_SETS], mh[4][N_SETS];
        size_t cnt[4][N_SETS];
        int rk[4] = {0, 0, 0, 0}, rr[4] = {0, 0, 0, 0}, sp;
        pqc_matrix km = pqc_matrix_f32(all_k, s, (size_t)N_SETS * HK_D);
        static const char *split_name[4] = {"even", "adaptive", "competing", "even, competing"};
        for (sp = 0; sp < 4; sp++) {
            pqc_cache_desc cd;
            pqc_cache *c;
            pqc_selection sel;
            size_t w;
            double t0 = now();
            memset(&cd, 0, sizeof cd);
            cd.n_layers = 1;
            cd.n_kv_heads = N_SETS;
            cd.n_q_heads = N_SETS * HK_G;
            cd.head_dim = HK_D;
            cd.max_tokens = s + 64;
            cd.pq.iters = 10;
            cd.pq.seed = 1;
            cd.split = sp == 0   ? PQC_SPLIT_FIXED
                       : sp == 1 ? PQC_SPLIT_ADAPTIVE
                       : sp == 2 ? PQC_SPLIT_COMPETE
                                 : PQC_SPLIT_FIXED_COMPETE;
            if (pqc_cache_create(rt, &cd, &c) || pqc_cache_observe(c, 0, all_obs, N_OBS) ||
                pqc_cache_prefill(c, 0, &km, &km) || pqc_cache_sync(c) || pqc_selection_init(c, &sel) ||
                pqc_cache_select(c, 0, all_q, &sel))
                die("section 5");
            w = (size_t)pqc_cache_layer_window(c, 0);
            for (di = 0; di < N_SETS; di++) {
                const uint32_t *ix = sel.idx + (size_t)di * sel.capacity;
                size_t cn = sel.count[di], take = cn - N_SINK - w, n_or = 0, u;
                const hardkeys *hh = &all_hk[di];
                pqc_search_desc od;
                float *kd = (float *)xcalloc(s * HK_D, sizeof(float));
                pqc_matrix mid;
                if (sp < 2 && pqc_cache_observed_mass(c, 0, di, &snk[di], &win[di])) die("observed mass");
                cnt[sp][di] = take;
                mh[sp][di] = 0;
                for (u = 0; u < cn; u++) mh[sp][di] += all_p[(size_t)di * s + ix[u]];
                m_kept[sp] += mh[sp][di];
                /* the head's oracle of the same shape */
                for (t = 0; t < s; t++) memcpy(kd + t * HK_D, all_k + (t * N_SETS + (size_t)di) * HK_D, sizeof(float) * HK_D);
                mid = pqc_matrix_f32(kd + (size_t)N_SINK * HK_D, s - w - N_SINK, HK_D);
                memset(&od, 0, sizeof od);
                od.k = take;
                for (t = 0; t < N_SINK; t++) oracle[n_or++] = (uint32_t)t;
                if (take > 0 && pqc_exact_search(rt, &mid, all_q + (size_t)di * HK_G * HK_D, HK_G, &od, &scr, oracle + n_or, NULL))
                    die("oracle");
                for (t = 0; t < take; t++) oracle[n_or + t] += N_SINK;
                n_or += take;
                for (t = s - w; t < s; t++) oracle[n_or++] = (uint32_t)t;
                memset(in_ref, 0, s);
                mark(in_ref, oracle, n_or, 1);
                memset(in_sel, 0, s);
                mark(in_sel, ix, cn, 1);
                rare_count(hh, in_ref, in_sel, &r, &i);
                rk[sp] += r;
                rr[sp] += i;
                free(kd);
            }
            fprintf(stderr, "bench_fidelity: heads sharing a budget, %s split, done in %.1f s\n", split_name[sp],
                    now() - t0);
            pqc_selection_free(&sel);
            pqc_cache_destroy(c);
        }
        printf("\nHeads sharing a budget: the 12 data sets as the KV heads of one cache, the same total top-k\n");
        printf("%-20s %9s %9s %9s %9s %9s %9s %9s %9s\n", "head (data set)", "obs sinks", "obs wind", "top-k", "top-k",
               "mass", "mass", "mass", "mass even");
        printf("%-20s %9s %9s %9s %9s %9s %9s %9s %9s\n", "", "", "", "even", "adaptive", "even", "adaptive", "competing",
               "competing");
        print_rule(102);
        for (di = 0; di < N_SETS; di++)
            printf("%-20s %9.3f %9.3f %9zu %9zu %9.3f %9.3f %9.3f %9.3f\n", sets[di].name, snk[di], win[di], cnt[0][di],
                   cnt[1][di], mh[0][di], mh[1][di], mh[2][di], mh[3][di]);
        printf("%-20s %9s %9s %9s %9s %9.3f %9.3f %9.3f %9.3f  (of %d)\n", "total", "", "", "", "", m_kept[0],
               m_kept[1], m_kept[2], m_kept[3], N_SETS);
        printf("rare tokens kept of the heads' oracles: even %d/%d, adaptive %d/%d, competing %d/%d, even and "
               "competing %d/%d\n",
               rk[0], rr[0], rk[1], rr[1], rk[2], rr[2], rk[3], rr[3]);
    }
    for (di = 0; di < N_SETS; di++) hk_free(&all_hk[di]);
    free(all_k);
    free(all_obs);
    free(all_q);
    free(all_p);
    free(all_hk);

    /* ---- tables ---- */
    printf("\nData sets: attention mass (exact softmax-sum over all %zu tokens, total 1)\n", s);
    printf("%-20s %4s %7s %7s %7s %7s %8s %10s %7s %10s %9s\n", "data set", "rare", "m sink", "m sinks", "m rare",
           "window", "m window", "m exact-k", "rare in", "m oracle", "exact");
    printf("%-20s %4s %7s %7s %7s %7s %8s %10s %7s %10s %9s\n", "", "", "(t=0)", "(32)", "", "tokens", "", "", "exact-k",
           "", "ns/tok");
    print_rule(106);
    for (di = 0; di < N_SETS; di++) {
        const dataset *ds = &sets[di];
        printf("%-20s %4d %7.3f %7.3f %7.3f %7zu %8.3f %10.3f %3d/%-3d %10.3f %9.2f\n", ds->name, ds->n_rare, ds->m_sink,
               ds->m_sinks, ds->m_rare, ds->window, ds->m_window, ds->m_exact, ds->rare_exact, ds->n_rare, ds->m_oracle,
               ds->exact_ns);
    }

    printf("\nSearch path: pqc_pq_search, k = %zu, against exact top-k (mass ref = exact top-k's mass)\n", k);
    printf("%-20s %-14s %6s %7s %8s %8s %7s %7s %10s %10s\n", "data set", "setting", "B/tok", "recall", "mass sel",
           "mass ref", "gap", "rare", "train", "search");
    printf("%-20s %-14s %6s %7s %8s %8s %7s %7s %10s %10s\n", "", "", "", "@k", "", "", "", "kept", "ns/tok", "ns/tok");
    print_rule(106);
    for (di = 0; di < N_SETS; di++) {
        for (si = 0; si < N_SETTINGS; si++) {
            const result *res = &sets[di].search[si];
            printf("%-20s %-14s %6.2f %7.3f %8.3f %8.3f %7.3f %3d/%-3d %10.1f %10.2f\n", sets[di].name, settings[si].name,
                   res->bytes, res->recall, res->mass, res->mass_ref, res->mass_ref - res->mass, res->rare_kept,
                   res->rare_ref, res->train_ns, res->search_ns);
        }
        if (di + 1 < N_SETS) putchar('\n');
    }

    printf("\nCache path: pqc_cache_select (budget 0.1: %d sinks + top-%zu + window %zu, the window fixed: PQC_SPLIT_FIXED), "
           "against the cache-shaped oracle\n",
           N_SINK, sets[0].k_mid, sets[0].window);
    printf("(mass ref = the oracle's mass; recall over the top-k part)\n");
    printf("%-20s %-14s %6s %7s %8s %8s %7s %7s\n", "data set", "setting", "B/tok", "recall", "mass sel", "mass ref", "gap",
           "rare");
    printf("%-20s %-14s %6s %7s %8s %8s %7s %7s\n", "", "", "", "top-k", "", "", "", "kept");
    print_rule(84);
    for (di = 0; di < N_SETS; di++) {
        for (si = 0; si < N_SETTINGS; si++) {
            const result *res = &sets[di].cache[si];
            printf("%-20s %-14s %6.2f %7.3f %8.3f %8.3f %7.3f %3d/%-3d\n", sets[di].name, settings[si].name, res->bytes,
                   res->recall, res->mass, res->mass_ref, res->mass_ref - res->mass, res->rare_kept, res->rare_ref);
        }
        if (di + 1 < N_SETS) putchar('\n');
    }

    /* ---- summary per level, and the plot data ---- */
    f = fopen(out_path, "w");
    if (!f) fprintf(stderr, "bench_fidelity: cannot write %s; the summary is printed only\n", out_path);
    if (f) {
        fprintf(f, "# bench_fidelity, s = %zu, k = %zu: means over the 4 data sets of each level\n", s, k);
        fprintf(f, "# blocks (gnuplot index i = path*30 + level*10 + technique): path 0 search, 1 cache;\n");
        fprintf(f, "# level 0 easy, 1 medium, 2 hard; technique 0 plain, 1 q-metric, 2 q-unrel, 3 q-drift,\n"
                   "# 4 bands, 5 q-bands, 6 q-rerank2, 7 q-outl, 8 q-rr2+outl, 9 q-resid\n");
        fprintf(f, "# columns: bytes_per_token mass_sel mass_ref mass_recall(sel/ref) recall rare_kept rare_ref setting\n");
    }
    printf("\nSummary: means over the 4 data sets of each level (mass recall = mass sel / mass ref;\n"
           "target: every rare token of the reference kept and mass gap <= 0.05)\n");
    printf("%-6s %-7s %-14s %6s %7s %8s %8s %7s %8s %7s %10s %10s\n", "path", "level", "setting", "B/tok", "recall",
           "mass sel", "mass ref", "gap", "mass rec", "rare", "train", "search");
    print_rule(108);
    for (i = 0; i < 2; i++) {
        int lv, te;
        for (lv = 0; lv < N_LEVELS; lv++) {
            for (te = 0; te < N_TECH; te++) {
                for (si = 0; si < N_SETTINGS; si++) {
                    double b = 0, rc = 0, ms = 0, mr = 0, tn = 0, sn = 0;
                    int kept = 0, ref = 0;
                    if (settings[si].tech != te) continue;
                    for (di = lv * 4; di < lv * 4 + 4; di++) {
                        const result *res = i == 0 ? &sets[di].search[si] : &sets[di].cache[si];
                        b += res->bytes / 4;
                        rc += res->recall / 4;
                        ms += res->mass / 4;
                        mr += res->mass_ref / 4;
                        tn += sets[di].search[si].train_ns / 4;
                        sn += sets[di].search[si].search_ns / 4;
                        kept += res->rare_kept;
                        ref += res->rare_ref;
                    }
                    printf("%-6s %-7s %-14s %6.2f %7.3f %8.3f %8.3f %7.3f %8.3f %3d/%-3d", i ? "cache" : "search",
                           hk_level_name(lv), settings[si].name, b, rc, ms, mr, mr - ms, ms / mr, kept, ref);
                    if (i == 0) printf(" %10.1f %10.2f", tn, sn);
                    printf("\n");
                    if (f)
                        fprintf(f, "%.4f %.4f %.4f %.4f %.4f %d %d \"%s\"\n", b, ms, mr, ms / mr, rc, kept, ref,
                                settings[si].name);
                }
                if (f) fprintf(f, "\n\n");
            }
        }
        if (i == 0) putchar('\n');
    }
    if (f) {
        if (fclose(f)) fprintf(stderr, "bench_fidelity: error writing %s\n", out_path);
        else printf("\nwrote %s\n", out_path);
    }
    printf("total %.1f s\n", now() - t_all);

    free(sets);
    free(p);
    free(sc);
    free(exact_idx);
    free(idx);
    free(merged);
    free(resb);
    free(oracle);
    free(in_ref);
    free(in_sel);
    pqc_scratch_free(&scr);
    pqc_runtime_destroy(rt);
    return 0;
}
