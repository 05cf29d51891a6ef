/* bench_suite: what the cache keeps of the attention, on a suite it was not built on
   (bench/suitekeys.h), in two parts: the tuning part (defaults and settings are chosen on
   it) and the reported part (the figures to quote; nothing is tuned on it).

   Each data set goes through the public API as an engine would: one cache (1 layer, one
   KV head, 4 query heads, d_h 128), the RoPE layout stated (pq.rope = PQC_ROPE_HALF), the
   prompt's last 32 query rows observed, the keys prefilled, one select with the decode
   queries; every other setting is the library's default unless the row says otherwise.

   Figure: the attention mass on the selected tokens (each query head's softmax over all
   s tokens, summed over the heads, normalised to 1) relative to what exact top-k keeps
   with the same number of tokens (sinks + top-k + window counted together). "oracle" is
   the cache-shaped oracle: the default's sinks and window plus the exact top-k of the
   mid tokens, the same total. Also the codes' bytes per token and KV head, and the
   select time (median of 5 selects).

   Parts: tune = seeds 1-3, report = seeds 101-103, each in the three variants (plain,
   recency, question first) at s tokens; the reported part also has two sets of 4s
   tokens (plain and recency, seed 201).

   usage: bench_suite [--s N] [--part tune|report|both] [--quick] [--settings LIST]
   --quick: s = 8192, one seed per variant, no long sets. LIST: comma-separated row
   numbers (default all). */
#define PQCACHE_IMPLEMENTATION
#include "../pqcache.h"
#include "suitekeys.h"
#include "bench_util.h"

#include <stdio.h>
#include <string.h>

typedef struct setting {
    const char *name;
    int m, bits;            /* 0: the default */
    double recent_share;    /* 0: the default */
    double rerank;          /* 0: the default (1.5), -1: off (the PQ top-k alone) */
    int outliers;
    double residual;
    int no_obs;
    int contiguous;         /* 1: contiguous sub-spaces (the default with a RoPE layout: bands) */
    int split;              /* 0: the default (PQC_SPLIT_COMPETE: with rerank off the window
                               competes with the coded tokens), 1: PQC_SPLIT_FIXED (the window as derived), 2:
                               PQC_SPLIT_ADAPTIVE (the builds may lower each layer's window), 3:
                               PQC_SPLIT_FIXED_COMPETE (every head the same top-k, the window
                               competing) */
} setting;

static const setting settings[] = {
    {"default", 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"default, nothing observed", 0, 0, 0, 0, 0, 0, 1, 0, 0},
    {"recent_share 0.25", 0, 0, 0.25, 0, 0, 0, 0, 0, 0},
    {"recent_share 0.1", 0, 0, 0.1, 0, 0, 0, 0, 0, 0},
    {"m4 b8", 4, 8, 0, 0, 0, 0, 0, 0, 0},
    {"m4 b8, recent 0.25", 4, 8, 0.25, 0, 0, 0, 0, 0, 0},
    {"m4 b8, recent 0.15", 4, 8, 0.15, 0, 0, 0, 0, 0, 0},
    {"m4 b8, recent 0.1", 4, 8, 0.1, 0, 0, 0, 0, 0, 0},
    {"m4 b6, recent 0.1", 4, 6, 0.1, 0, 0, 0, 0, 0, 0},
    {"m8 b4, recent 0.1", 8, 4, 0.1, 0, 0, 0, 0, 0, 0},
    {"m4 b8, recent 0.05", 4, 8, 0.05, 0, 0, 0, 0, 0, 0},
    {"m4 b8, recent 0.1, rerank 2", 4, 8, 0.1, 2, 0, 0, 0, 0, 0},
    {"m4 b8, recent 0.1, outliers 64", 4, 8, 0.1, 0, 64, 0, 0, 0, 0},
    {"m4 b8, recent 0.1, residual 0.15", 4, 8, 0.1, 0, 0, 0.15, 0, 0, 0},
    {"window only (recent 1, split fixed)", 0, 0, 1.0, 0, 0, 0, 0, 0, 1},
    {"rerank 1.5", 0, 0, 0, 1.5, 0, 0, 0, 0, 0},
    {"rerank 2", 0, 0, 0, 2, 0, 0, 0, 0, 0},
    {"rerank 3", 0, 0, 0, 3, 0, 0, 0, 0, 0},
    {"contiguous sub-spaces", 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"contiguous, nothing observed", 0, 0, 0, 0, 0, 0, 1, 1, 0},
    {"contiguous, rerank 3", 0, 0, 0, 3, 0, 0, 0, 1, 0},
    {"m8 b8 (twice the bytes)", 8, 8, 0, 0, 0, 0, 0, 0, 0},
    {"m16 b8 (four times the bytes)", 16, 8, 0, 0, 0, 0, 0, 0, 0},
    {"fixed window (split fixed)", 0, 0, 0, 0, 0, 0, 0, 0, 1},
    {"rerank 2.5", 0, 0, 0, 2.5, 0, 0, 0, 0, 0},
    {"adaptive split (builds lower windows)", 0, 0, 0, 0, 0, 0, 0, 0, 2},
    {"adaptive split, nothing observed", 0, 0, 0, 0, 0, 0, 1, 0, 2},
    {"default, recent_share 0.3", 0, 0, 0.3, 0, 0, 0, 0, 0, 0},
    {"adaptive split + rerank 2", 0, 0, 0, 2, 0, 0, 0, 0, 2},
    {"adaptive split + rerank 2.5", 0, 0, 0, 2.5, 0, 0, 0, 0, 2},
    {"fixed split, window competes", 0, 0, 0, -1, 0, 0, 0, 0, 3},
    {"the PQ top-k alone (rerank off)", 0, 0, 0, -1, 0, 0, 0, 0, 0},
};
/* sets: 9 in the tuning part, 9 + 2 long ones in the reported part */
enum { N_SETTINGS = sizeof settings / sizeof settings[0], MAX_SETS = 20 };

typedef struct set_spec {
    size_t s;
    int variant;
    uint64_t seed;
} set_spec;

static const char *variant_name(int v) { return v == SK_RECENCY ? "recency" : v == SK_QFIRST ? "question first" : "plain"; }

/* p[t]: softmax-sum attention of the 4 heads over all tokens, normalised to 1 */
static void attention(const suitekeys *k, double *p)
{
    size_t t, s = k->s;
    int h, e;
    for (t = 0; t < s; t++) p[t] = 0;
    for (h = 0; h < HK_G; h++) {
        const float *q = k->queries + (size_t)h * HK_D;
        double mx = -1e300, z = 0;
        for (t = 0; t < s; t++) {
            double v = 0;
            for (e = 0; e < HK_D; e++) v += (double)q[e] * k->keys[t * HK_D + e];
            v /= sqrt((double)HK_D);
            p[s + t] = v; /* scratch: the logits */
            if (v > mx) mx = v;
        }
        for (t = 0; t < s; t++) z += exp(p[s + t] - mx);
        for (t = 0; t < s; t++) p[t] += exp(p[s + t] - mx) / z / HK_G;
    }
}

static int ddesc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x > y ? -1 : x < y;
}

/* mass of the n largest of p[from..to) */
static double top_mass(const double *p, size_t from, size_t to, size_t n, double *tmp)
{
    size_t i;
    double m = 0;
    memcpy(tmp, p + from, (to - from) * sizeof(double));
    qsort(tmp, to - from, sizeof(double), ddesc);
    for (i = 0; i < n && i < to - from; i++) m += tmp[i];
    return m;
}

typedef struct result {
    double kept, ref, oracle, bytes, select_ms;
} result;

static int run_setting(const suitekeys *k, const setting *st, const double *p, double *tmp, result *out)
{
    pqc_cache_desc cd;
    pqc_cache *c = NULL;
    pqc_selection sel;
    pqc_matrix km;
    size_t i, n = 0, window, sinks;
    double t[5], mass = 0;
    int rep;
    memset(&cd, 0, sizeof cd);
    cd.n_layers = 1;
    cd.n_kv_heads = 1;
    cd.n_q_heads = HK_G;
    cd.head_dim = HK_D;
    cd.max_tokens = k->s + 16;
    cd.pq.rope = PQC_ROPE_HALF;
    cd.pq.m = st->m;
    cd.pq.bits = st->bits;
    cd.recent_share = st->recent_share;
    cd.rerank = st->rerank;
    cd.outliers = st->outliers;
    cd.residual_weight = st->residual;
    if (st->contiguous) cd.pq.subspaces = PQC_SUBSPACES_CONTIGUOUS;
    cd.split = (pqc_split)st->split;
    km = pqc_matrix_f32(k->keys, k->s, HK_D);
    if (pqc_cache_create(NULL, &cd, &c) != PQC_SUCCESS ||
        (!st->no_obs && pqc_cache_observe(c, 0, k->obs, (size_t)k->n_obs) != PQC_SUCCESS) ||
        pqc_cache_prefill(c, 0, &km, &km) != PQC_SUCCESS || pqc_cache_sync(c) != PQC_SUCCESS ||
        pqc_selection_init(c, &sel) != PQC_SUCCESS) {
        fprintf(stderr, "bench_suite: %s: %s\n", st->name, pqc_last_error());
        pqc_cache_destroy(c);
        return -1;
    }
    for (rep = 0; rep < 5; rep++) { /* the first select is measured; the median of 5 is its time */
        t[rep] = now();
        if (pqc_cache_select(c, 0, k->queries, &sel) != PQC_SUCCESS) {
            fprintf(stderr, "bench_suite: select: %s\n", pqc_last_error());
            pqc_selection_free(&sel);
            pqc_cache_destroy(c);
            return -1;
        }
        t[rep] = 1e3 * (now() - t[rep]);
        if (rep == 0) {
            n = sel.count[0];
            for (i = 0; i < n; i++) mass += p[sel.idx[i]];
        }
    }
    out->select_ms = median(t, 5);
    out->kept = mass;
    out->ref = top_mass(p, 0, k->s, n, tmp);
    {
        pqc_cache_desc r;
        pqc_cache_config(c, &r);
        out->bytes = (double)r.pq.m * r.pq.bits / 8.0 + (r.residual_weight > 0 ? r.pq.m : 0);
        /* the oracle: sinks and window as this cache has them, exact top-k of the mid tokens */
        sinks = r.n_sink > 0 ? (size_t)r.n_sink : 0;
        window = (size_t)pqc_cache_layer_window(c, 0);
        if (sinks + window < n && sinks + window < k->s) {
            double o = 0;
            for (i = 0; i < sinks; i++) o += p[i];
            for (i = k->s - window; i < k->s; i++) o += p[i];
            o += top_mass(p, sinks, k->s - window, n - sinks - window, tmp);
            out->oracle = o;
        } else {
            out->oracle = mass;
        }
    }
    pqc_selection_free(&sel);
    pqc_cache_destroy(c);
    return 0;
}

int main(int argc, char **argv)
{
    size_t s = 32768;
    int quick = 0, part = 2, i, j, n_sets = 0, want[N_SETTINGS];
    set_spec sets[MAX_SETS];
    int is_report[MAX_SETS];
    for (j = 0; j < N_SETTINGS; j++) want[j] = 1;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--s") && i + 1 < argc) s = (size_t)strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--part") && i + 1 < argc) {
            i++;
            part = !strcmp(argv[i], "tune") ? 0 : !strcmp(argv[i], "report") ? 1 : 2;
        } else if (!strcmp(argv[i], "--settings") && i + 1 < argc) {
            char *p = argv[++i];
            for (j = 0; j < N_SETTINGS; j++) want[j] = 0;
            while (*p) {
                long v = strtol(p, &p, 10);
                if (v >= 0 && v < N_SETTINGS) want[v] = 1;
                if (*p == ',') p++;
                else if (*p) break;
            }
        } else {
            fprintf(stderr, "usage: bench_suite [--s N] [--part tune|report|both] [--quick] [--settings LIST]\n");
            return 2;
        }
    }
    if (quick) s = 8192;
    {
        int v, sd, p;
        for (p = 0; p < 2; p++) {
            if (part != 2 && part != p) continue;
            for (v = 0; v < 3; v++)
                for (sd = 0; sd < (quick ? 1 : 3); sd++) {
                    sets[n_sets].s = s;
                    sets[n_sets].variant = v;
                    sets[n_sets].seed = (uint64_t)((p ? 101 : 1) + sd);
                    is_report[n_sets++] = p;
                }
            if (p == 1 && !quick)
                for (v = 0; v < 2; v++) {
                    sets[n_sets].s = 4 * s;
                    sets[n_sets].variant = v;
                    sets[n_sets].seed = 201;
                    is_report[n_sets++] = 1;
                }
        }
    }
    printf("bench_suite: mass kept / exact top-k's at the same total budget (budget ratio 0.1)\n");
    {
        static result res[MAX_SETS][N_SETTINGS];
        for (i = 0; i < n_sets; i++) {
            suitekeys k;
            double *p, *tmp, top10;
            memset(&k, 0, sizeof k);
            k.s = sets[i].s;
            k.variant = sets[i].variant;
            k.seed = sets[i].seed;
            if (sk_make(&k) != 0) return 1;
            p = (double *)malloc(sizeof(double) * 2 * k.s);
            tmp = (double *)malloc(sizeof(double) * k.s);
            if (!p || !tmp) return 1;
            attention(&k, p);
            top10 = top_mass(p, 0, k.s, k.s / 10, tmp);
            printf("set %d (%s part): s %zu, %s, seed %llu; exact top-10%% holds %.3f, the sink %.3f\n", i,
                   is_report[i] ? "reported" : "tuning", k.s, variant_name(k.variant), (unsigned long long)k.seed,
                   top10, p[0]);
            for (j = 0; j < N_SETTINGS; j++)
                if (want[j] && run_setting(&k, &settings[j], p, tmp, &res[i][j]) != 0) return 1;
            free(p);
            free(tmp);
            sk_free(&k);
            fflush(stdout);
        }
        for (part = 0; part < 2; part++) {
            int any = 0;
            for (i = 0; i < n_sets; i++) any |= is_report[i] == part;
            if (!any) continue;
            printf("\n%s part: kept / exact top-k (oracle / exact top-k), per variant and long sets\n",
                   part ? "REPORTED" : "TUNING");
            printf("%-36s %5s %16s %16s %16s %16s %8s\n", "setting", "B/tok", "plain", "recency", "question first",
                   "4s tokens", "ms");
            for (j = 0; j < N_SETTINGS; j++) {
                double sum[4] = {0, 0, 0, 0}, osum[4] = {0, 0, 0, 0}, ms = 0, bytes = 0;
                int cnt[4] = {0, 0, 0, 0}, c;
                if (!want[j]) continue;
                for (i = 0; i < n_sets; i++) {
                    if (is_report[i] != part) continue;
                    c = sets[i].s > s ? 3 : sets[i].variant;
                    sum[c] += res[i][j].kept / res[i][j].ref;
                    osum[c] += res[i][j].oracle / res[i][j].ref;
                    cnt[c]++;
                    ms += res[i][j].select_ms;
                    bytes = res[i][j].bytes;
                }
                printf("%-36s %5.2f", settings[j].name, bytes);
                for (c = 0; c < 4; c++) {
                    if (cnt[c]) printf("   %.3f (%.3f)", sum[c] / cnt[c], osum[c] / cnt[c]);
                    else printf(" %16s", "-");
                }
                printf(" %8.2f\n", ms / (cnt[0] + cnt[1] + cnt[2] + cnt[3]));
            }
        }
    }
    return 0;
}
