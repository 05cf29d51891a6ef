/* tl_mpi.c - tiny_llama with tensor parallelism over MPI: one pqcache per rank.

   Megatron-style tensor parallelism over P ranks (mpirun -np P):
     - rank r holds a contiguous run of KV heads (whole GQA groups) and the
       query heads that read them: the rows of wq, wk, wv for those heads and
       the columns of wo that take their outputs;
     - the FFN's hidden units are split in contiguous runs: rows of w1 and w3,
       columns of w2;
     - the token embedding, the norms and the classifier are replicated;
     - after the attention output projection and after the FFN every rank
       holds a partial sum of the residual update; one MPI_Allreduce (sum)
       completes it. The partial sums are accumulated in double and reduced
       in double, so the split changes the fp32 residual only where two double
       roundings straddle a float rounding boundary (see docs/serving.md).
   Each rank's keys and values live only for its own KV heads: in pqcache mode
   in the rank's own pqc_cache (its own pqc_runtime, pqc_cache_desc.n_kv_heads =
   the rank's KV heads, driven by pqc_driver_prefill / pqc_driver_decode over
   this file's callbacks); in full, window and oracle modes in a host KV cache
   of the rank's heads. Selection is per KV head, so it needs no communication.

   The passkey models have a single KV head; --widen K makes from any model an
   equivalent one (the same function up to float rounding) with K times the
   heads, FFN units and residual width (K
   copies of the residual stream, each copy's heads and units reading their
   own copy, the output projections averaging the copies), so that K ranks
   each hold one copy's heads.

   Usage: see usage() below, or examples/tiny_llama/tools/mpi.mk (make run-mpi,
   make test-mpi). Plain C99 plus MPI; link with -lm -lpthread. */

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* clock_gettime, fdopen: before the first system header */
#endif
#ifndef TL_PQCACHE_NO_LIBRARY_IMPLEMENTATION /* else linked from pqcache_lib.c's object */
#define PQCACHE_IMPLEMENTATION
#endif
#include "../../../pqcache.h"
#define TINY_LLAMA_IMPLEMENTATION
#include "../tiny_llama.h"

#include <math.h>
#include <mpi.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* the rank's state and the tensor-parallel forward */
#include "tl_mpi_engine.h"

/* ----------------------------------------------------------------------------
   Setup */

static void tp_setup(tp *t, int ctx)
{
    int w;
    size_t dim = (size_t)t->c.dim, att;
    t->ctx = ctx;
    t->nthreads = t->o.threads < 1 ? 1 : t->o.threads > TP_MAX_THREADS ? TP_MAX_THREADS : t->o.threads;
    t->x = (float *)tp_alloc(t, dim, sizeof(float));
    t->xb = (float *)tp_alloc(t, dim, sizeof(float));
    t->q = (float *)tp_alloc(t, (size_t)t->qd, sizeof(float));
    t->k = (float *)tp_alloc(t, (size_t)t->nkv * (size_t)t->hs, sizeof(float));
    t->v = (float *)tp_alloc(t, (size_t)t->nkv * (size_t)t->hs, sizeof(float));
    t->ob = (float *)tp_alloc(t, (size_t)t->qd, sizeof(float));
    t->att = (float *)tp_alloc(t, (size_t)t->nq * (size_t)ctx, sizeof(float));
    t->logits = (float *)tp_alloc(t, (size_t)t->c.vocab_size, sizeof(float));
    t->mass = (float *)tp_alloc(t, (size_t)ctx, sizeof(float));
    t->tmp = (float *)tp_alloc(t, (size_t)ctx, sizeof(float));
    t->rcos = (float *)tp_alloc(t, (size_t)t->hs / 2, sizeof(float));
    t->rsin = (float *)tp_alloc(t, (size_t)t->hs / 2, sizeof(float));
    t->part = (double *)tp_alloc(t, dim, sizeof(double));
    t->ppart = (double *)tp_alloc(t, (size_t)TP_CHUNK * dim, sizeof(double));
    t->rope_pos = -1;
    att = (size_t)TP_BLOCK * (size_t)t->nq * (size_t)ctx;
    for (w = 0; w < t->nthreads; w++) {
        t->patt[w] = (float *)tp_alloc(t, att, sizeof(float));
        t->pout[w] = (float *)tp_alloc(t, (size_t)TP_BLOCK * (size_t)t->qd, sizeof(float));
        t->pxb[w] = (float *)tp_alloc(t, dim, sizeof(float));
        t->phb[w] = (float *)tp_alloc(t, (size_t)t->nf, sizeof(float));
        t->phb2[w] = (float *)tp_alloc(t, (size_t)t->nf, sizeof(float));
    }
    t->sel_n = (int *)tp_alloc(t, (size_t)t->c.n_layers * (size_t)t->nkv, sizeof(int));
    t->sel_pos = (uint32_t *)tp_alloc(t, (size_t)t->c.n_layers * (size_t)t->nkv * (size_t)ctx,
                                      sizeof(uint32_t));
    if (t->o.mode == TP_PQCACHE) {
        tp_pqcache_create(t, ctx);
    } else {
        size_t kv = (size_t)t->c.n_layers * (size_t)t->nkv * (size_t)ctx * (size_t)t->hs;
        t->kc = (float *)tp_alloc(t, kv, sizeof(float));
        t->vc = (float *)tp_alloc(t, kv, sizeof(float));
    }
}

static void tp_teardown(tp *t)
{
    int w;
    pqc_cache_destroy(t->cache);
    pqc_scheduler_destroy(t->sched);
    pqc_runtime_destroy(t->rt);
    for (w = 0; w < t->nthreads; w++) {
        free(t->patt[w]);
        free(t->pout[w]);
        free(t->pxb[w]);
        free(t->phb[w]);
        free(t->phb2[w]);
    }
    free(t->x); free(t->xb); free(t->q); free(t->k); free(t->v); free(t->ob); free(t->att);
    free(t->logits); free(t->mass); free(t->tmp); free(t->rcos); free(t->rsin); free(t->part);
    free(t->ppart); free(t->sel_n); free(t->sel_pos); free(t->kc); free(t->vc); free(t->hidden);
    free(t->wq); free(t->wk); free(t->wv); free(t->wo); free(t->w1); free(t->w2); free(t->w3);
    free(t->wide);
    tl_free_model(&t->model);
}

/* ----------------------------------------------------------------------------
   Prompt */

typedef struct {
    int *tokens;    /* prompt, then the decode inputs that are forced (random prompts) */
    int n_prompt, n_total;
    int query;      /* passkey: the token fed after the prompt; -1 none */
    int answer[64], n_answer;
} tp_prompt;

/* make_passkey --prompt's output: "prompt LEN t...", "query K", "answer n v...", "needle P" */
static int tp_read_prompt(const char *path, int vocab, tp_prompt *p, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    char word[32];
    int n, i, ok = 1;
    memset(p, 0, sizeof *p);
    p->query = -1;
    if (!f) {
        snprintf(err, errlen, "cannot open the prompt file %s", path);
        return -1;
    }
    if (fscanf(f, "%31s %d", word, &n) != 2 || strcmp(word, "prompt") != 0 || n < 1 || n > (1 << 24)) {
        snprintf(err, errlen, "%s: not a prompt file (it must start with \"prompt LEN\")", path);
        fclose(f);
        return -1;
    }
    p->tokens = (int *)malloc((size_t)n * sizeof(int) + 64 * sizeof(int));
    if (!p->tokens) {
        fclose(f);
        snprintf(err, errlen, "out of memory for %d prompt tokens", n);
        return -1;
    }
    for (i = 0; i < n && ok; i++)
        ok = fscanf(f, "%d", &p->tokens[i]) == 1 && p->tokens[i] >= 0 && p->tokens[i] < vocab;
    if (ok && fscanf(f, "%31s %d", word, &p->query) == 2 && strcmp(word, "query") == 0) {
        ok = p->query >= 0 && p->query < vocab;
        if (ok && fscanf(f, "%31s %d", word, &p->n_answer) == 2 && strcmp(word, "answer") == 0) {
            ok = p->n_answer >= 0 && p->n_answer <= 64;
            for (i = 0; ok && i < p->n_answer; i++)
                ok = fscanf(f, "%d", &p->answer[i]) == 1;
        } else {
            p->n_answer = 0;
        }
    } else if (ok) {
        p->query = -1;
    }
    fclose(f);
    if (!ok) {
        free(p->tokens);
        p->tokens = NULL;
        snprintf(err, errlen, "%s: a token is missing or outside the vocabulary (0..%d)", path, vocab - 1);
        return -1;
    }
    p->n_prompt = p->n_total = n;
    return 0;
}

static int tp_random_prompt(int n, int steps, int vocab, unsigned long long seed, tp_prompt *p)
{
    unsigned long long rng = tl_rng_seed(seed);
    int i;
    memset(p, 0, sizeof *p);
    p->query = -1;
    p->tokens = (int *)malloc((size_t)(n + steps + 1) * sizeof(int));
    if (!p->tokens)
        return -1;
    p->tokens[0] = TL_BOS < vocab ? TL_BOS : 0;
    for (i = 1; i < n + steps + 1; i++)
        p->tokens[i] = (int)(tl_rng_next(&rng) % (unsigned long long)vocab);
    p->n_prompt = n;
    p->n_total = n + steps + 1;
    return 0;
}

/* ----------------------------------------------------------------------------
   Record of a run (rank 0): logits and per global KV head selections per step */

typedef struct {
    FILE *f;
    int *cnt;            /* gathered: [layer][global head] */
    uint32_t *pos;       /* gathered: [layer][global head][ctx] */
    int *head_bad;       /* check: steps x layers that differ, per global head */
} tp_rec;

/* gathers every rank's selections of this step to rank 0 */
static void tp_gather_sel(tp *t, tp_rec *r)
{
    int L = t->c.n_layers, G = t->c.n_kv_heads, l, p;
    int *counts = NULL, *displs = NULL;
    uint32_t *buf;
    size_t per = (size_t)t->ctx;
    /* [layer][local head] -> sent as [local head][layer] blocks, so ranks' heads concatenate */
    int *cn = (int *)tp_alloc(t, (size_t)L * (size_t)t->nkv, sizeof(int));
    int *gc = t->rank == 0 ? (int *)tp_alloc(t, (size_t)L * (size_t)G, sizeof(int)) : NULL;
    uint32_t *gp = NULL;
    int g;
    buf = (uint32_t *)tp_alloc(t, (size_t)t->nkv * (size_t)L * per, sizeof(uint32_t));
    for (g = 0; g < t->nkv; g++)
        for (l = 0; l < L; l++) {
            cn[g * L + l] = t->sel_n[l * t->nkv + g];
            memcpy(buf + ((size_t)g * (size_t)L + (size_t)l) * per,
                   t->sel_pos + ((size_t)l * (size_t)t->nkv + (size_t)g) * per, per * sizeof(uint32_t));
        }
    if (t->rank == 0) {
        counts = (int *)tp_alloc(t, (size_t)t->size, sizeof(int));
        displs = (int *)tp_alloc(t, (size_t)t->size, sizeof(int));
        for (p = 0; p < t->size; p++) {
            int lo, n;
            tp_share(G, t->size, p, &lo, &n);
            counts[p] = n * L;
            displs[p] = lo * L;
        }
    }
    MPI_Gatherv(cn, t->nkv * L, MPI_INT, gc, counts, displs, MPI_INT, 0, MPI_COMM_WORLD);
    if (t->rank == 0) {
        gp = (uint32_t *)tp_alloc(t, (size_t)G * (size_t)L * per, sizeof(uint32_t));
        for (p = 0; p < t->size; p++) {
            counts[p] *= (int)per;
            displs[p] *= (int)per;
        }
    }
    MPI_Gatherv(buf, t->nkv * L * (int)per, MPI_UNSIGNED, gp, counts, displs, MPI_UNSIGNED, 0,
                MPI_COMM_WORLD);
    if (t->rank == 0) {   /* back to [layer][global head] */
        for (l = 0; l < L; l++)
            for (g = 0; g < G; g++) {
                r->cnt[l * G + g] = gc[g * L + l];
                memcpy(r->pos + ((size_t)l * (size_t)G + (size_t)g) * per,
                       gp + ((size_t)g * (size_t)L + (size_t)l) * per, per * sizeof(uint32_t));
            }
    }
    free(cn); free(gc); free(gp); free(buf); free(counts); free(displs);
}

/* rank 0: writes (save) or compares (check) one step. Returns the mismatching
   (layer, head) selections; *maxdiff gets the largest logit difference. */
static int tp_record_step(tp *t, tp_rec *r, int check, double *maxdiff, int *head_bad)
{
    int L = t->c.n_layers, G = t->c.n_kv_heads, V = t->c.vocab_size, i, bad = 0;
    size_t per = (size_t)t->ctx;
    if (!check) {
        fwrite(t->logits, sizeof(float), (size_t)V, r->f);
        for (i = 0; i < L * G; i++) {
            fwrite(&r->cnt[i], sizeof(int), 1, r->f);
            fwrite(r->pos + (size_t)i * per, sizeof(uint32_t), (size_t)r->cnt[i], r->f);
        }
        return 0;
    } else {
        float *ref = (float *)tp_alloc(t, (size_t)V, sizeof(float));
        int *rc = (int *)tp_alloc(t, (size_t)(L * G), sizeof(int));
        uint32_t *rp = (uint32_t *)tp_alloc(t, (size_t)(L * G) * per, sizeof(uint32_t));
        if (fread(ref, sizeof(float), (size_t)V, r->f) != (size_t)V)
            tp_die(t, "the reference run is shorter than this one");
        for (i = 0; i < V; i++) {
            double d = fabs((double)ref[i] - (double)t->logits[i]);
            if (!(d <= *maxdiff))
                *maxdiff = d != d ? INFINITY : d;
        }
        for (i = 0; i < L * G; i++)
            if (fread(&rc[i], sizeof(int), 1, r->f) != 1 || rc[i] < 0 || (size_t)rc[i] > per ||
                fread(rp + (size_t)i * per, sizeof(uint32_t), (size_t)rc[i], r->f) != (size_t)rc[i])
                tp_die(t, "the reference run's file is damaged or of another model");
        for (i = 0; i < L * G; i++) {
            /* the reference head: the same one, or --sel-ref-head's */
            int j = t->o.sel_ref_head >= 0 ? (i / G) * G + t->o.sel_ref_head : i;
            if (rc[j] != r->cnt[i] ||
                memcmp(rp + (size_t)j * per, r->pos + (size_t)i * per, (size_t)rc[j] * sizeof(uint32_t)) != 0) {
                bad++;
                head_bad[i % G]++;
            }
        }
        free(rc);
        free(ref);
        free(rp);
        return bad;
    }
}

/* ----------------------------------------------------------------------------
   Command line */

static void usage(void)
{
    fprintf(stderr,
        "usage: mpirun -np P tiny_llama_mpi MODEL.bin [options]\n"
        "  tensor parallel over P ranks: each holds its KV heads (and their query heads), its\n"
        "  share of the FFN units and, in pqcache mode, its own pqc_cache over its KV heads\n"
        "  --prompt-file F  a prompt from make_passkey --prompt (query and answer: a passkey run)\n"
        "  --random N       a random prompt of N tokens; decode inputs are random too\n"
        "  --seed S         random prompt and k-means seed (default 1)\n"
        "  --widen K        run the model with K copies of every head and FFN unit (default 1)\n"
        "  -a MODE          full, window, oracle or pqcache (default pqcache)\n"
        "  -n STEPS         decode steps (default 16)\n"
        "  -t THREADS       threads per rank (default 1)\n"
        "  -b RATIO         budget ratio (default 0.1; >= 1 attends to everything)\n"
        "  -S SINKS         sink tokens (default 32)\n"
        "  -m M, -B BITS    PQ sub-spaces and bits (default 2, 6)\n"
        "  -T ITERS         k-means iterations (default 0: the adaptive scheduler)\n"
        "  -C BLOCKS        block-cache blocks per layer and KV head (default 32, -1 none)\n"
        "  --split S        fixed-compete, fixed, adaptive or compete (default fixed-compete: every\n"
        "                   head the same top-k, the window competing in each; see docs/serving.md)\n"
        "  --metric M       query, diag or l2 (default query)\n"
        "  --save F         rank 0 writes every decode step's logits and per-head selections\n"
        "  --check F        compare with a --save file: logits within --tol, selections\n"
        "  --tol X          largest logit difference allowed by --check (default 1e-4)\n"
        "  --same-sel       --check fails unless every selection is identical\n"
        "  --sel-only       --check compares the selections only, not the logits\n"
        "  --sel-ref-head H --check compares every KV head's selection with the reference's head H\n"
        "                   (a widened model's copies of one head)\n"
        "  --vs-engine      rank 0 also runs tiny_llama.h's own tl_forward (full attention) over\n"
        "                   the same tokens and fails unless the decode logits agree within --tol\n"
        "  -q               quiet: only the summary\n");
}

static int tp_parse(int argc, char **argv, tp_opts *o, char *err, size_t errlen)
{
    int i;
    memset(o, 0, sizeof *o);
    o->widen = 1;
    o->steps = 16;
    o->threads = 1;
    o->seed = 1;
    o->mode = TP_PQCACHE;
    o->n_sink = 32;
    o->pq_m = 2;
    o->pq_bits = 6;
    o->cache_blocks = 32;
    o->split = PQC_SPLIT_FIXED_COMPETE;
    o->metric = PQC_METRIC_QUERY;
    o->ratio = 0.1f;
    o->tol = 1e-4;
    o->sel_ref_head = -1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        int takes = 1;
        if (a[0] != '-') {
            if (o->model) {
                snprintf(err, errlen, "two models given (%s, %s)", o->model, a);
                return -1;
            }
            o->model = a;
            continue;
        }
        if (!strcmp(a, "-q")) { o->quiet = 1; continue; }
        if (!strcmp(a, "--same-sel")) { o->same_sel = 1; continue; }
        if (!strcmp(a, "--sel-only")) { o->sel_only = 1; continue; }
        if (!strcmp(a, "--vs-engine")) { o->vs_engine = 1; continue; }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return 1;
        if (!v) {
            snprintf(err, errlen, "option %s needs a value", a);
            return -1;
        }
#define TP_INT(name, field, lo, hi) \
        else if (!strcmp(a, name)) { long x = strtol(v, &end, 10); \
            if (*v == '\0' || *end != '\0' || x < (lo) || x > (hi)) { \
                snprintf(err, errlen, "%s %s: expected an integer in %ld..%ld", a, v, (long)(lo), (long)(hi)); \
                return -1; } o->field = (int)x; }
        if (0) {}
        TP_INT("--widen", widen, 1, 64)
        TP_INT("--random", random_len, 1, 1 << 24)
        TP_INT("-n", steps, 1, 1 << 20)
        TP_INT("-t", threads, 1, TP_MAX_THREADS)
        TP_INT("-S", n_sink, 0, 1 << 24)
        TP_INT("-m", pq_m, 1, 1024)
        TP_INT("-B", pq_bits, 1, 8)
        TP_INT("-T", iters, 0, 1000)
        TP_INT("-C", cache_blocks, -1, 1 << 20)
        TP_INT("--sel-ref-head", sel_ref_head, 0, 1 << 20)
        else if (!strcmp(a, "--prompt-file")) o->prompt_file = v;
        else if (!strcmp(a, "--save")) o->save = v;
        else if (!strcmp(a, "--check")) o->check = v;
        else if (!strcmp(a, "--seed")) {
            o->seed = strtoull(v, &end, 10);
            if (*v == '\0' || *end != '\0') { snprintf(err, errlen, "--seed %s: not a number", v); return -1; }
        } else if (!strcmp(a, "-b") || !strcmp(a, "--tol")) {
            double x = strtod(v, &end);
            if (*v == '\0' || *end != '\0' || !(x > 0.0) || x > 1e30) {
                snprintf(err, errlen, "%s %s: expected a positive number", a, v);
                return -1;
            }
            if (a[1] == 'b') o->ratio = (float)x; else o->tol = x;
        } else if (!strcmp(a, "-a")) {
            if (!strcmp(v, "full")) o->mode = TP_FULL;
            else if (!strcmp(v, "window")) o->mode = TP_WINDOW;
            else if (!strcmp(v, "oracle")) o->mode = TP_ORACLE;
            else if (!strcmp(v, "pqcache")) o->mode = TP_PQCACHE;
            else { snprintf(err, errlen, "-a %s: expected full, window, oracle or pqcache", v); return -1; }
        } else if (!strcmp(a, "--split")) {
            if (!strcmp(v, "fixed")) o->split = PQC_SPLIT_FIXED;
            else if (!strcmp(v, "fixed-compete")) o->split = PQC_SPLIT_FIXED_COMPETE;
            else if (!strcmp(v, "adaptive")) o->split = PQC_SPLIT_ADAPTIVE;
            else if (!strcmp(v, "compete")) o->split = PQC_SPLIT_COMPETE;
            else {
                snprintf(err, errlen, "--split %s: expected fixed-compete, fixed, adaptive or compete", v);
                return -1;
            }
        } else if (!strcmp(a, "--metric")) {
            if (!strcmp(v, "query")) o->metric = PQC_METRIC_QUERY;
            else if (!strcmp(v, "diag")) o->metric = PQC_METRIC_QUERY_DIAG;
            else if (!strcmp(v, "l2")) o->metric = PQC_METRIC_L2;
            else { snprintf(err, errlen, "--metric %s: expected query, diag or l2", v); return -1; }
        } else {
            snprintf(err, errlen, "unknown option %s", a);
            return -1;
        }
#undef TP_INT
        i += takes;
    }
    if (!o->model) {
        snprintf(err, errlen, "no model given");
        return -1;
    }
    if ((o->prompt_file != NULL) == (o->random_len > 0)) {
        snprintf(err, errlen, "give exactly one of --prompt-file and --random");
        return -1;
    }
    if (o->save && o->check) {
        snprintf(err, errlen, "--save and --check exclude each other");
        return -1;
    }
    return 0;
}

/* rank 0: tiny_llama.h's own forward (full attention, token by token) over the
   run's inputs; the largest difference from the logits of the decode steps */
static double tp_vs_engine(tp *t, const tp_prompt *pr, const int *inputs, const float *logits, int steps)
{
    tl_state s;
    tl_policy pol;
    char err[TL_ERR_LEN];
    double maxd = 0.0;
    int pos, i, V = t->c.vocab_size;
    if (tl_build_state(&s, &t->model.config, pr->n_prompt + steps, 1, err, sizeof err) != 0)
        tp_die(t, "--vs-engine: %s", err);
    tl_default_policy(&pol, TL_ATTN_FULL);
    for (pos = 0; pos < pr->n_prompt + steps; pos++) {
        int tok = pos < pr->n_prompt ? pr->tokens[pos] : inputs[pos - pr->n_prompt];
        const float *lg = tl_forward(&t->model, &s, &pol, tok, pos);
        if (!lg)
            tp_die(t, "--vs-engine: %s", s.err);
        if (pos >= pr->n_prompt)
            for (i = 0; i < V; i++) {
                double d = fabs((double)lg[i] - (double)logits[(size_t)(pos - pr->n_prompt) * (size_t)V + (size_t)i]);
                if (!(d <= maxd))
                    maxd = d != d ? INFINITY : d;
            }
    }
    tl_free_state(&s);
    return maxd;
}

static const char *tp_mode_name(tp_mode m)
{
    return m == TP_FULL ? "full" : m == TP_WINDOW ? "window" : m == TP_ORACLE ? "oracle" : "pqcache";
}

static double tp_mb(double b) { return b / (1024.0 * 1024.0); }

int main(int argc, char **argv)
{
    tp t;
    tp_prompt pr;
    tp_rec rec;
    char err[512];
    int rc, step, pos, token, ctx, n_dec, bad_sel = 0, got[64], n_got = 0, i;
    double t0, t_prefill, t_decode, maxdiff = 0.0;
    unsigned long long mem[6], *all = NULL;
    int *inputs = NULL;
    float *run_logits = NULL;

    memset(&t, 0, sizeof t);
    memset(&rec, 0, sizeof rec);
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
        fprintf(stderr, "tiny_llama_mpi: MPI_Init failed\n");
        return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &t.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &t.size);
    rc = tp_parse(argc, argv, &t.o, err, sizeof err);
    if (rc != 0) {
        if (t.rank == 0) {
            if (rc < 0)
                fprintf(stderr, "tiny_llama_mpi: error: %s\n", err);
            usage();
        }
        MPI_Finalize();
        return rc < 0 ? 1 : 0;
    }
    if (tl_build_model(&t.model, t.o.model, err, sizeof err) != 0)
        tp_fail_all(&t, err);
    if (t.model.layers || !t.model.w.wq || !t.model.w.wk || !t.model.w.wv || !t.model.w.wo || !t.model.w.w1 ||
        !t.model.w.w2 || !t.model.w.w3 || !t.model.w.token_embedding || !t.model.w.wcls ||
        !t.model.w.rms_att || !t.model.w.rms_ffn || !t.model.w.rms_final ||
        t.model.config.head_size * t.model.config.n_heads != t.model.config.dim)
        tp_fail_all(&t, "the tensor-parallel engine runs llama2.c checkpoints (fp32 weights) only");
    if (t.o.widen > 1) {
        tp_widen(&t, t.o.widen);
    } else {
        t.c = t.model.config;
        t.w = t.model.w;
    }
    if (t.c.head_size > 1024)
        tp_fail_all(&t, "head size above 1024 is not supported");
    tp_slice(&t);
    if (t.nkv > 256)
        tp_fail_all(&t, "more than 256 KV heads per rank are not supported");
    if (t.o.sel_ref_head >= t.c.n_kv_heads)
        tp_fail_all(&t, "--sel-ref-head is not a KV head of the model");
    if (t.o.prompt_file) {
        if (tp_read_prompt(t.o.prompt_file, t.c.vocab_size, &pr, err, sizeof err) != 0)
            tp_fail_all(&t, err);
    } else if (tp_random_prompt(t.o.random_len, t.o.steps, t.c.vocab_size, t.o.seed, &pr) != 0) {
        tp_fail_all(&t, "out of memory for the prompt");
    }
    ctx = pr.n_prompt + t.o.steps;
    if (t.o.vs_engine && (t.o.widen > 1 || t.o.mode != TP_FULL))
        tp_fail_all(&t, "--vs-engine compares full attention on the model as stored (no --widen)");
    if (ctx > t.c.seq_len) {
        snprintf(err, sizeof err, "the prompt (%d) and %d decode steps need %d positions, the model "
                 "holds %d", pr.n_prompt, t.o.steps, ctx, t.c.seq_len);
        tp_fail_all(&t, err);
    }
    tp_setup(&t, ctx);
    t.hidden = (float *)tp_alloc(&t, (size_t)pr.n_prompt, (size_t)t.c.dim * sizeof(float));
    if (t.rank == 0) {
        rec.cnt = (int *)tp_alloc(&t, (size_t)t.c.n_layers * (size_t)t.c.n_kv_heads, sizeof(int));
        rec.head_bad = (int *)tp_alloc(&t, (size_t)t.c.n_kv_heads, sizeof(int));
        rec.pos = (uint32_t *)tp_alloc(&t, (size_t)t.c.n_layers * (size_t)t.c.n_kv_heads * (size_t)ctx,
                                       sizeof(uint32_t));
        if (t.o.save || t.o.check) {
            rec.f = fopen(t.o.save ? t.o.save : t.o.check, t.o.save ? "wb" : "rb");
            if (!rec.f)
                tp_die(&t, "cannot open %s", t.o.save ? t.o.save : t.o.check);
        }
        if (!t.o.quiet)
            printf("tiny_llama_mpi: %d rank%s x %d thread%s, model dim %d, %d layers, %d heads / %d KV heads "
                   "(head %d), FFN %d%s; %s, prompt %d tokens, %d decode steps\n",
                   t.size, t.size == 1 ? "" : "s", t.nthreads, t.nthreads == 1 ? "" : "s", t.c.dim,
                   t.c.n_layers, t.c.n_heads, t.c.n_kv_heads, t.hs, t.c.hidden_dim,
                   t.o.widen > 1 ? " (widened)" : "", tp_mode_name(t.o.mode), pr.n_prompt, t.o.steps);
    }

    /* prefill */
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = tl_time_s();
    if (t.o.mode == TP_PQCACHE) {
        size_t dim = (size_t)t.c.dim;
        for (i = 0; i < pr.n_prompt; i++)
            memcpy(t.hidden + (size_t)i * dim, t.w.token_embedding + (size_t)pr.tokens[i] * dim,
                   dim * sizeof(float));
        t.prefill_n = pr.n_prompt;
        if (pqc_driver_prefill(t.cache, &t.eng, 0, (size_t)pr.n_prompt) != PQC_SUCCESS)
            tp_die(&t, "prefill: %s", t.err[0] ? t.err : pqc_last_error());
        t.prefill_n = 0;
    } else {
        tp_host_prefill(&t, pr.tokens, pr.n_prompt);
    }
    memcpy(t.x, t.hidden + (size_t)(pr.n_prompt - 1) * (size_t)t.c.dim, (size_t)t.c.dim * sizeof(float));
    tp_classify(&t);
    if (t.o.mode == TP_PQCACHE && pqc_cache_sync(t.cache) != PQC_SUCCESS)
        tp_die(&t, "pqcache build: %s", pqc_last_error());
    MPI_Barrier(MPI_COMM_WORLD);
    t_prefill = tl_time_s() - t0;

    /* decode: the passkey query then greedy tokens, or the random stream */
    token = pr.query >= 0 ? pr.query : pr.tokens[pr.n_prompt];
    n_dec = t.o.steps;
    if (t.o.vs_engine && t.rank == 0) {
        inputs = (int *)tp_alloc(&t, (size_t)n_dec, sizeof(int));
        run_logits = (float *)tp_alloc(&t, (size_t)n_dec * (size_t)t.c.vocab_size, sizeof(float));
    }
    t0 = tl_time_s();
    for (step = 0; step < n_dec; step++) {
        pos = pr.n_prompt + step;
        memcpy(t.x, t.w.token_embedding + (size_t)token * (size_t)t.c.dim, (size_t)t.c.dim * sizeof(float));
        if (t.o.mode == TP_PQCACHE) {
            if (pqc_driver_decode(t.cache, &t.eng, (size_t)pos) != PQC_SUCCESS)
                tp_die(&t, "decode at %d: %s", pos, t.err[0] ? t.err : pqc_last_error());
        } else {
            tp_host_decode(&t, pos);
        }
        tp_classify(&t);
        if (inputs) {
            inputs[step] = token;
            memcpy(run_logits + (size_t)step * (size_t)t.c.vocab_size, t.logits,
                   (size_t)t.c.vocab_size * sizeof(float));
        }
        if (t.o.save || t.o.check) {
            tp_gather_sel(&t, &rec);
            if (t.rank == 0)
                bad_sel += tp_record_step(&t, &rec, t.o.check != NULL, &maxdiff, rec.head_bad);
        }
        /* the next input: rank 0 decides, every rank follows */
        if (t.rank == 0)
            token = pr.query >= 0 ? tl_argmax(t.logits, t.c.vocab_size) : pr.tokens[pos + 1];
        MPI_Bcast(&token, 1, MPI_INT, 0, MPI_COMM_WORLD);
        if (pr.query >= 0 && n_got < pr.n_answer)
            got[n_got++] = token;
    }
    MPI_Barrier(MPI_COMM_WORLD);
    t_decode = tl_time_s() - t0;

    /* per-rank memory */
    {
        size_t dev = 0, full = 0, own = 0, shared = 0;
        size_t tokens = (size_t)pr.n_prompt + (size_t)n_dec;
        mem[0] = (unsigned long long)((size_t)t.c.n_layers * (size_t)t.nkv * tokens * (size_t)t.hs * 2 *
                                      sizeof(float));   /* K/V rows held */
        if (t.cache) {
            pqc_cache_memory(t.cache, &dev, &full);
            pqc_cache_host_memory(t.cache, &own, &shared);
        } else {
            own = (size_t)2 * (size_t)t.c.n_layers * (size_t)t.nkv * (size_t)t.ctx * (size_t)t.hs * sizeof(float);
        }
        mem[1] = own;
        mem[2] = dev;
        mem[3] = full;
        mem[4] = (unsigned long long)t.kv0;
        mem[5] = (unsigned long long)t.nkv;
        if (t.rank == 0)
            all = (unsigned long long *)tp_alloc(&t, (size_t)t.size * 6, sizeof(unsigned long long));
        MPI_Gather(mem, 6, MPI_UNSIGNED_LONG_LONG, all, 6, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
    }
    if (t.rank == 0) {
        int p, retrieved = pr.n_answer > 0 && n_got >= pr.n_answer;
        for (i = 0; i < pr.n_answer && i < n_got; i++)
            if (got[i] != pr.answer[i])
                retrieved = 0;
        {
            double host = 0, dev = 0;
            for (p = 0; p < t.size; p++) {
                const unsigned long long *a = all + (size_t)p * 6;
                host += (double)a[0];
                dev += (double)a[2];
                if (t.cache)
                    printf("rank %d: KV heads %llu..%llu of %d: host K/V %.2f MB (pqc_cache_host_memory %.2f MB), "
                           "device tier %.2f MB (pqc_cache_memory; full K/V %.2f MB)\n", p, a[4], a[4] + a[5] - 1,
                           t.c.n_kv_heads, tp_mb((double)a[0]), tp_mb((double)a[1]), tp_mb((double)a[2]),
                           tp_mb((double)a[3]));
                else
                    printf("rank %d: KV heads %llu..%llu of %d: host K/V %.2f MB (%.2f MB allocated for the "
                           "context), no device tier (%s attention on the host)\n", p, a[4], a[4] + a[5] - 1,
                           t.c.n_kv_heads, tp_mb((double)a[0]), tp_mb((double)a[1]), tp_mode_name(t.o.mode));
            }
            if (t.cache)
                printf("all %d rank%s: host K/V %.2f MB, device tier %.2f MB\n", t.size, t.size == 1 ? "" : "s",
                       tp_mb(host), tp_mb(dev));
        }
        printf("prefill %d tokens: %.2f s; decode %d tokens: %.2f s, %.2f tok/s (%d rank%s x %d thread%s)\n",
               pr.n_prompt, t_prefill, n_dec, t_decode, t_decode > 0 ? n_dec / t_decode : 0.0, t.size,
               t.size == 1 ? "" : "s", t.nthreads, t.nthreads == 1 ? "" : "s");
        if (t.cache) {
            pqc_layer_stats ls;
            double sel_s = 0, fetch_s = 0, wait_s = 0;
            unsigned long long builds = 0, rebuilds = 0, hits = 0, misses = 0;
            int l;
            for (l = 0; l < t.c.n_layers; l++)
                if (pqc_cache_stats(t.cache, l, &ls) == PQC_SUCCESS) {
                    sel_s += ls.select_s;
                    fetch_s += ls.fetch_s;
                    wait_s += ls.wait_s;
                    builds += ls.builds;
                    rebuilds += ls.rebuilds;
                    hits += ls.hits;
                    misses += ls.misses;
                }
            printf("pqcache (rank 0): select %.1f us/token, fetch %.1f us/token, block cache hit rate "
                   "%.1f%%, builds %llu, rebuilds %llu, waited %.3f s for builds\n",
                   1e6 * sel_s / n_dec, 1e6 * fetch_s / n_dec,
                   hits + misses ? 100.0 * (double)hits / (double)(hits + misses) : 0.0, builds, rebuilds, wait_s);
        }
        if (pr.n_answer > 0) {
            printf("passkey: expected");
            for (i = 0; i < pr.n_answer; i++)
                printf(" %d", pr.answer[i]);
            printf(", got");
            for (i = 0; i < n_got && i < pr.n_answer; i++)
                printf(" %d", got[i]);
            printf(": %s\n", retrieved ? "retrieved" : "NOT retrieved");
        }
        if (t.o.check) {
            printf("check: max |logit - reference| %.3g (tolerance %.3g); selections differing from the "
                   "reference: %d of %d (step, layer, KV head)\n", maxdiff, t.o.tol, bad_sel,
                   n_dec * t.c.n_layers * t.c.n_kv_heads);
            printf("check: differing selections per KV head (%d steps x %d layers each):", n_dec, t.c.n_layers);
            for (i = 0; i < t.c.n_kv_heads; i++)
                printf(" %d", rec.head_bad[i]);
            printf("\n");
        }
        if (rec.f)
            fclose(rec.f);
    }
    rc = 0;
    if (inputs) {
        double d = tp_vs_engine(&t, &pr, inputs, run_logits, n_dec);
        printf("vs-engine: max |logit - tiny_llama.h tl_forward| %.3g (tolerance %.3g)\n", d, t.o.tol);
        if (!(d <= t.o.tol))
            rc = 2;
    }
    if (t.rank == 0 && t.o.check && rc == 0 && ((!t.o.sel_only && !(maxdiff <= t.o.tol)) || (t.o.same_sel && bad_sel > 0)))
        rc = 2;
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    free(all);
    free(inputs);
    free(run_logits);
    free(rec.cnt);
    free(rec.pos);
    free(rec.head_bad);
    free(pr.tokens);
    tp_teardown(&t);
    MPI_Finalize();
    return rc;
}
