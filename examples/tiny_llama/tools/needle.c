/* needle.c - needle-in-a-haystack evaluation of the attention modes on the
   constructed passkey model (make_passkey.c).

   For every context length and needle depth it builds the haystack prompt
   with make_passkey's prompt generator, prefills it once with full attention
   (layer-major through pqcache's driver, tl_pqcache.h), and then, for every
   mode, feeds the key token K as a decode step and decodes the n passkey
   tokens greedily, each decode step going through the mode's selection:

     full     every past token
     pqcache  pqc_driver_decode: sinks + window + PQ top-k, via the block cache
     oracle   sinks + window + the exact top-k by attention
     window   sinks + the most recent tokens

   The prefill is shared: pqcache decodes from the library's state, the other
   modes from an engine state holding a copy of the prompt's keys and values
   (decode steps only write positions after the prompt, so one copy serves
   every mode). A cell scores 1 when all n tokens match the passkey.

   Writes an accuracy table, a data file and a gnuplot script for a heatmap
   (one panel per mode). With --compare LEN DEPTH it instead compares the modes
   on one prompt: retrieval, decode speed, pqcache's select and fetch time, hit
   rate, bytes moved, device memory, and next-token agreement and KL against a
   full-attention reference fed the same tokens. */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "../tiny_llama.h"
#define TL_PQCACHE_IMPLEMENTATION
#include "../tl_pqcache.h"

/* the generator's prompt logic (make_prompt) and model constants */
#define main make_passkey_main
#include "make_passkey.c"
#undef main

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NEEDLE_MAX_LIST 16
#define NEEDLE_N_MODES 5
#define NEEDLE_PLAIN 1 /* index of pq-plain in needle_modes */
#define NEEDLE_PQ 2    /* index of pqcache */

/* pq-plain is the pqcache mode with plain PQ: Euclidean codebooks, the fixed
   budget split and the PQ top-k alone (PQC_METRIC_L2, PQC_SPLIT_FIXED, rerank -1),
   on its own library state */
static const tl_attn_mode needle_modes[NEEDLE_N_MODES] = {
    TL_ATTN_FULL, TL_ATTN_PQCACHE, TL_ATTN_PQCACHE, TL_ATTN_ORACLE, TL_ATTN_WINDOW
};
static const char *const needle_names[NEEDLE_N_MODES] = {
    "full", "pq-plain", "pqcache", "oracle", "window"
};

typedef struct {
    const char *checkpoint;
    int lengths[NEEDLE_MAX_LIST], n_lengths;
    double depths[NEEDLE_MAX_LIST];
    int n_depths;
    int use[NEEDLE_N_MODES];      /* modes, in needle_modes order */
    int seeds, first_seed, passkey_len;
    float ratio;
    int n_sink, threads;
    tlpq_config pq;
    const char *out;              /* data file prefix */
    const char *png;
    int long_ctx;                 /* --long: the last two lengths, capped to the model */
    int compare_len, steps;       /* --compare */
    double compare_depth;
} needle_options;

static void needle_usage(void)
{
    fprintf(stderr,
        "usage: needle <passkey.bin> [options]\n"
        "  --lengths L,..   context lengths (default 4096,8192,16384,32768)\n"
        "  --long           add 65536 and 131072 to the lengths (capped to the model's\n"
        "                   positions less the passkey)\n"
        "  --depths D,..    needle depths in percent (default 0,25,50,75,100)\n"
        "  --modes M,..     among full,pq-plain,pqcache,oracle,window (default all five;\n"
        "                   pq-plain: pqcache with plain PQ, Euclidean codebooks, the\n"
        "                   fixed budget split and the PQ top-k alone)\n"
        "  --seeds N        prompts per cell (default 1); --seed S the first (default 1)\n"
        "  --passkey-len n  passkey tokens (default 4)\n"
        "  -b <float>       budget ratio of the selection modes (default 0.1)\n"
        "  -S <int>         sink tokens (default 32)\n"
        "  -j <int>         threads (default 2)\n"
        "  -m -B -T -C -K   pqcache: PQ sub-spaces (2), bits (6), k-means iterations\n"
        "                   (0 = adaptive), cache blocks (32, 0 = none), block tokens (128)\n"
        "  -E <lfu|lru>     pqcache block-cache policy (default lfu)\n"
        "  --out PREFIX     write PREFIX.dat and the gnuplot script PREFIX.gp\n"
        "                   (default build/needle)\n"
        "  --png PATH       the image the script draws (default examples/tiny_llama/needle.png)\n"
        "  --compare LEN DEPTH  compare the modes on one prompt instead of the grid\n"
        "  --steps N        decode steps per mode in --compare (default 64)\n");
}

static int parse_list_int(const char *s, int *out, int max, int lo, int hi)
{
    int n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < lo || v > hi || n >= max)
            return -1;
        out[n++] = (int)v;
        s = end;
        if (*s == ',')
            s++;
        else if (*s)
            return -1;
    }
    return n;
}

static int parse_list_double(const char *s, double *out, int max, double lo, double hi)
{
    int n = 0;
    while (*s) {
        char *end;
        double v = strtod(s, &end);
        if (end == s || !(v >= lo && v <= hi) || n >= max)
            return -1;
        out[n++] = v;
        s = end;
        if (*s == ',')
            s++;
        else if (*s)
            return -1;
    }
    return n;
}

static int parse_one_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

static int parse_needle_options(int argc, char **argv, needle_options *o)
{
    int i, j, long_ctx = 0;
    memset(o, 0, sizeof *o);
    o->lengths[0] = 4096; o->lengths[1] = 8192; o->lengths[2] = 16384; o->lengths[3] = 32768;
    o->n_lengths = 4;
    o->depths[0] = 0; o->depths[1] = 25; o->depths[2] = 50; o->depths[3] = 75; o->depths[4] = 100;
    o->n_depths = 5;
    for (j = 0; j < NEEDLE_N_MODES; j++)
        o->use[j] = 1;
    o->seeds = 1;
    o->first_seed = 1;
    o->passkey_len = PK_PASSKEY_LEN;
    o->ratio = 0.1f;
    o->n_sink = 32;
    o->threads = 2;
    tlpq_default_config(&o->pq);
    o->out = "build/needle";
    o->png = "examples/tiny_llama/needle.png";
    o->steps = 64;
    if (argc < 2 || argv[1][0] == '-')
        return -1;
    o->checkpoint = argv[1];
    for (i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--long") == 0) { long_ctx = 1; continue; }
        if (!v)
            return -1;
        i++;
        if (strcmp(a, "--lengths") == 0)
            bad = (o->n_lengths = parse_list_int(v, o->lengths, NEEDLE_MAX_LIST - 2, 16, 1 << 24)) < 1;
        else if (strcmp(a, "--depths") == 0)
            bad = (o->n_depths = parse_list_double(v, o->depths, NEEDLE_MAX_LIST, 0.0, 100.0)) < 1;
        else if (strcmp(a, "--modes") == 0) {
            char buf[128], *tok;
            snprintf(buf, sizeof buf, "%s", v);
            for (j = 0; j < NEEDLE_N_MODES; j++)
                o->use[j] = 0;
            for (tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
                for (j = 0; j < NEEDLE_N_MODES; j++)
                    if (strcmp(tok, needle_names[j]) == 0)
                        o->use[j] = 1;
                for (j = 0; j < NEEDLE_N_MODES; j++)
                    if (strcmp(tok, needle_names[j]) == 0)
                        break;
                if (j == NEEDLE_N_MODES)
                    bad = 1;
            }
        }
        else if (strcmp(a, "--seeds") == 0) bad = parse_one_int(v, 1, 1000, &o->seeds);
        else if (strcmp(a, "--seed") == 0) bad = parse_one_int(v, 0, 1 << 30, &o->first_seed);
        else if (strcmp(a, "--passkey-len") == 0) bad = parse_one_int(v, 1, N_VALUE, &o->passkey_len);
        else if (strcmp(a, "--out") == 0) o->out = v;
        else if (strcmp(a, "--png") == 0) o->png = v;
        else if (strcmp(a, "--steps") == 0) bad = parse_one_int(v, 1, 1 << 20, &o->steps);
        else if (strcmp(a, "--compare") == 0) {
            if (i + 1 >= argc)
                return -1;
            bad = parse_one_int(v, 16, 1 << 24, &o->compare_len) ||
                  parse_list_double(argv[++i], &o->compare_depth, 1, 0.0, 100.0) != 1;
        }
        else if (strcmp(a, "-b") == 0) {
            char *end;
            o->ratio = strtof(v, &end);
            bad = end == v || *end || !(o->ratio > 0.0f && o->ratio <= 1.0f);
        }
        else if (strcmp(a, "-S") == 0) bad = parse_one_int(v, 0, 1 << 20, &o->n_sink);
        else if (strcmp(a, "-j") == 0) bad = parse_one_int(v, 1, 64, &o->threads);
        else if (strcmp(a, "-m") == 0) bad = parse_one_int(v, 1, 1 << 16, &o->pq.pq_m);
        else if (strcmp(a, "-B") == 0) bad = parse_one_int(v, 1, 8, &o->pq.pq_bits);
        else if (strcmp(a, "-T") == 0) bad = parse_one_int(v, 0, 100000, &o->pq.iters);
        else if (strcmp(a, "-C") == 0) { /* -C 0: no block cache (the library's -1) */
            bad = parse_one_int(v, 0, 1 << 20, &o->pq.cache_blocks);
            if (!bad && o->pq.cache_blocks == 0) o->pq.cache_blocks = -1;
        }
        else if (strcmp(a, "-K") == 0) bad = parse_one_int(v, 1, 1 << 20, &o->pq.block_tokens);
        else if (strcmp(a, "-E") == 0) {
            if (strcmp(v, "lfu") == 0) o->pq.policy = PQC_POLICY_LFU;
            else if (strcmp(v, "lru") == 0) o->pq.policy = PQC_POLICY_LRU;
            else bad = 1;
        }
        else
            return -1;
        if (bad) {
            fprintf(stderr, "error: bad value '%s' for %s\n", v, a);
            return -1;
        }
    }
    if (long_ctx) {
        o->lengths[o->n_lengths++] = 65536;
        o->lengths[o->n_lengths++] = 131072;
        o->long_ctx = 1;
    }
    o->pq.n_sink = o->n_sink > 0 ? o->n_sink : -1; /* -S 0: none */
    o->pq.ratio = o->ratio;
    o->pq.n_threads = o->threads;
    return 0;
}

/* ----------------------------------------------------------------------------
   One prompt: the shared prefill and the decode of every mode */

typedef struct {
    int len, needle, query, answer[N_VALUE], n;
    int *tokens;
} needle_prompt;

static int needle_make_prompt(needle_prompt *p, int len, double depth, int seed, int n)
{
    p->len = len;
    p->n = n;
    p->tokens = (int *)malloc((size_t)len * sizeof(int));
    if (!p->tokens)
        return -1;
    p->needle = make_prompt(len, depth, (uint64_t)seed, n, p->tokens, &p->query, p->answer);
    return 0;
}

/* KL(p || q) of the softmax distributions of two logit vectors */
static double needle_kl(const float *p_logits, const float *q_logits, int n)
{
    double mp = p_logits[0], mq = q_logits[0], sp = 0.0, sq = 0.0, kl = 0.0;
    int i;
    for (i = 1; i < n; i++) {
        if (p_logits[i] > mp) mp = p_logits[i];
        if (q_logits[i] > mq) mq = q_logits[i];
    }
    for (i = 0; i < n; i++) {
        sp += exp((double)p_logits[i] - mp);
        sq += exp((double)q_logits[i] - mq);
    }
    for (i = 0; i < n; i++) {
        double a = (double)p_logits[i] - mp - log(sp), b = (double)q_logits[i] - mq - log(sq);
        kl += exp(a) * (a - b);
    }
    return kl > 0.0 ? kl : 0.0;
}

typedef struct {
    int ok;                /* all passkey tokens right */
    int got[N_VALUE];
    int steps;
    double decode_s;
    int agree;             /* with the reference (compare only) */
    double kl_sum;
    int attended;          /* tokens per KV head at the last step */
    tlpq_stats st;         /* pqcache */
} needle_result;

/* Feeds the query token and decodes `steps` tokens greedily under one mode.
   ref (may be NULL) is a full-attention reference fed the same tokens. */
static int needle_decode(const tl_model *m, tl_attn_mode mode, const needle_options *o,
                         tlpq *lib, tl_state *s, tl_state *ref, const needle_prompt *pr,
                         int steps, needle_result *res)
{
    const tl_config *c = &m->config;
    tl_policy pol;
    int i, tok = pr->query, V = c->vocab_size;
    memset(res, 0, sizeof *res);
    tl_default_policy(&pol, mode);
    pol.ratio = o->ratio;
    pol.n_sink = o->n_sink;
    res->ok = 1;
    for (i = 0; i < steps; i++) {
        int pos = pr->len + i, next;
        double t0 = tl_time_s();
        float *logits = mode == TL_ATTN_PQCACHE ? tlpq_decode(lib, tok, pos)
                                                : tl_forward(m, s, &pol, tok, pos);
        res->decode_s += tl_time_s() - t0;
        if (!logits) {
            fprintf(stderr, "error: %s decode at %d: %s\n", tl_mode_name(mode), pos,
                    mode == TL_ATTN_PQCACHE ? lib->err : s->err);
            return -1;
        }
        next = tl_argmax(logits, V);
        if (ref) {
            float *rl = tl_forward(m, ref, NULL, tok, pos);
            if (!rl) {
                fprintf(stderr, "error: reference decode: %s\n", ref->err);
                return -1;
            }
            res->agree += tl_argmax(rl, V) == next;
            res->kl_sum += needle_kl(rl, logits, V);
        }
        if (i < pr->n) {
            res->got[i] = next;
            if (next != pr->answer[i])
                res->ok = 0;
        }
        tok = next;
    }
    res->steps = steps;
    if (mode == TL_ATTN_PQCACHE) {
        tlpq_get_stats(lib, &res->st);
        res->attended = res->st.selects ? (int)(res->st.tokens_selected /
                        (res->st.selects * (unsigned long long)c->n_kv_heads)) : 0;
    } else {
        int sk, w, k;
        tl_budget(&pol, pr->len + steps, &sk, &w, &k);
        res->attended = mode == TL_ATTN_FULL ? pr->len + steps : sk + w + k;
    }
    return 0;
}

/* The shared prefill: through the library (the pqcache mode's state), then a
   copy of the keys and values into the engine states of the other modes. The
   PQ builds are waited for, so that decode times do not include them.
   plain (may be NULL): pq-plain's library state, given the same keys and values
   (tlpq_prefill_from: no second forward pass; plain PQ needs no observations). */
static int needle_prefill(const tl_model *m, const needle_options *o, const needle_prompt *pr,
                          int positions, tlpq *lib, tlpq *plain, tl_state *s, tl_state *ref,
                          double *secs)
{
    char err[TL_ERR_LEN];
    double t0 = tl_time_s();
    if (tlpq_create(lib, m, positions, &o->pq, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return -1;
    }
    if (!tlpq_prefill(lib, pr->tokens, pr->len)) {
        fprintf(stderr, "error: prefill: %s\n", lib->err);
        return -1;
    }
    if (pqc_cache_sync(lib->cache) != PQC_SUCCESS) { /* decode times without the builds */
        fprintf(stderr, "error: PQ build: %s\n", pqc_last_error());
        return -1;
    }
    *secs = tl_time_s() - t0;
    if (plain) {
        tlpq_config pc = o->pq;
        pc.metric = PQC_METRIC_L2;
        pc.split = PQC_SPLIT_FIXED;
        pc.rerank = -1;
        if (tlpq_create(plain, m, positions, &pc, err, sizeof err)) {
            fprintf(stderr, "error: %s\n", err);
            return -1;
        }
        if (tlpq_prefill_from(plain, lib, pr->len) || pqc_cache_sync(plain->cache) != PQC_SUCCESS) {
            fprintf(stderr, "error: prefill (pq-plain): %s\n", plain->err[0] ? plain->err : pqc_last_error());
            return -1;
        }
    }
    if ((s && tlpq_copy_kv(lib, s, pr->len)) || (ref && tlpq_copy_kv(lib, ref, pr->len))) {
        fprintf(stderr, "error: %s\n", lib->err);
        return -1;
    }
    return 0;
}

/* ----------------------------------------------------------------------------
   --compare: the modes side by side on one prompt */

static int needle_compare(const tl_model *m, const needle_options *o)
{
    const tl_config *c = &m->config;
    needle_prompt pr;
    tl_state s, ref;
    tlpq lib, plain, second;
    char err[TL_ERR_LEN], desc[200];
    double prefill_s = 0.0, full_tps = 0.0, pq_tps = 0.0, fork_s = 0.0;
    int j, i, positions, steps = o->steps, rc = 1, all_ok = 1;

    if (steps < o->passkey_len)
        steps = o->passkey_len;
    positions = o->compare_len + steps;
    if (positions > c->seq_len) {
        fprintf(stderr, "error: %d positions exceed the model's %d\n", positions, c->seq_len);
        return 1;
    }
    if (needle_make_prompt(&pr, o->compare_len, o->compare_depth, o->first_seed, o->passkey_len))
        return 1;
    memset(&lib, 0, sizeof lib);
    memset(&plain, 0, sizeof plain);
    memset(&second, 0, sizeof second);
    if (tl_build_state(&s, c, positions, o->threads, err, sizeof err) ||
        tl_build_state(&ref, c, positions, o->threads, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    printf("passkey retrieval: %d-token haystack, needle at %g%% (position %d), passkey of %d "
           "tokens:", pr.len, o->compare_depth, pr.needle, pr.n);
    for (i = 0; i < pr.n; i++)
        printf(" %d", pr.answer[i]);
    printf("\nselection modes attend over %d sinks + a budget of %g of the rest; each mode feeds "
           "the key %d and decodes %d tokens greedily\n", o->n_sink, (double)o->ratio, pr.query, steps);
    if (needle_prefill(m, o, &pr, positions, &lib, o->use[NEEDLE_PLAIN] ? &plain : NULL, &s, &ref,
                       &prefill_s))
        goto done;
    if (o->use[NEEDLE_PQ]) { /* a second request over the same document, before the first decodes */
        double t0 = tl_time_s();
        if (tlpq_fork(&second, &lib, err, sizeof err)) {
            fprintf(stderr, "error: %s\n", err);
            goto done;
        }
        fork_s = tl_time_s() - t0;
    }
    tlpq_describe(&lib, desc, sizeof desc);
    printf("prefill: %d tokens in %.2f s, %.0f tok/s (full attention, layer-major through "
           "pqc_driver_prefill, shared by the modes)\npqcache: %s\n\n", pr.len, prefill_s,
           pr.len / prefill_s, desc);
    printf("%-8s %-9s %9s %8s %9s %9s %7s %11s %17s %10s %9s\n", "mode", "passkey", "decode",
           "attended", "select", "fetch", "hit", "h2d", "device / full", "agreement", "KL");
    printf("%-8s %-9s %9s %8s %9s %9s %7s %11s %17s %10s %9s\n", "", "", "tok/s", "per head",
           "us/tok", "us/tok", "rate", "KB/tok", "KV memory (MB)", "vs full", "nats");
    for (j = 0; j < NEEDLE_N_MODES; j++) {
        tl_attn_mode mode = needle_modes[j];
        needle_result r;
        char sel[16] = "-", fet[16] = "-", hit[16] = "-", h2d[16] = "-", mem[32] = "-";
        if (!o->use[j])
            continue;
        if (needle_decode(m, mode, o, j == NEEDLE_PLAIN ? &plain : &lib, &s, &ref, &pr, steps, &r))
            goto done;
        all_ok &= r.ok || mode == TL_ATTN_WINDOW || j == NEEDLE_PLAIN; /* expected to miss */
        if (mode == TL_ATTN_PQCACHE) {
            unsigned long long looked = r.st.hits + r.st.misses;
            snprintf(sel, sizeof sel, "%.1f", 1e6 * r.st.select_s / r.steps);
            snprintf(fet, sizeof fet, "%.1f", 1e6 * r.st.fetch_s / r.steps);
            snprintf(hit, sizeof hit, "%.1f%%", looked ? 100.0 * (double)r.st.hits / (double)looked : 0.0);
            snprintf(h2d, sizeof h2d, "%.1f", (double)r.st.bytes_h2d / r.steps / 1024.0);
            snprintf(mem, sizeof mem, "%.2f / %.2f", (double)r.st.device_bytes / 1048576.0,
                     (double)r.st.full_bytes / 1048576.0);
        }
        printf("%-8s %-9s %9.1f %8d %9s %9s %7s %11s %17s %9.2f%% %9.6f\n", needle_names[j],
               r.ok ? "retrieved" : "MISSED", r.decode_s > 0 ? r.steps / r.decode_s : 0.0,
               r.attended, sel, fet, hit, h2d, mem, 100.0 * r.agree / r.steps, r.kl_sum / r.steps);
        if (mode == TL_ATTN_FULL)
            full_tps = r.decode_s > 0 ? r.steps / r.decode_s : 0.0;
        if (j != NEEDLE_PLAIN && mode == TL_ATTN_PQCACHE) {
            pq_tps = r.decode_s > 0 ? r.steps / r.decode_s : 0.0;
            printf("         select + fetch over all %d layers; h2d = missed rows + admitted blocks "
                   "+ codes (%.1f KB/tok)\n", c->n_layers, (double)r.st.bytes_codes / r.steps / 1024.0);
            printf("         device tier (sinks, window, block cache, codebooks, one layer's codes) "
                   "= %.1f%% of the full KV cache\n", r.st.full_bytes ?
                   100.0 * (double)r.st.device_bytes / (double)r.st.full_bytes : 0.0);
            printf("         k-means T = %d..%d, %llu builds + %llu rebuilds, PQ build %.3f s (worker time), "
                   "decode waited %.3f s for builds\n", r.st.iters_min, r.st.iters_max, r.st.builds - r.st.rebuilds,
                   r.st.rebuilds, r.st.build_s, r.st.wait_s);
        }
        if (!r.ok) {
            printf("         decoded");
            for (i = 0; i < pr.n; i++)
                printf(" %d", r.got[i]);
            printf(" instead of the passkey (0 = <unk>: the needle was not attended)\n");
        }
    }
    if (full_tps > 0.0 && pq_tps > 0.0)
        printf("\npqcache decodes %.1fx as fast as full attention at %d tokens, attending %.1f%% "
               "of them\n", pq_tps / full_tps, pr.len, 100.0 * (o->n_sink + o->ratio *
               (pr.len - o->n_sink)) / pr.len);
    if (second.cache) { /* the second request asks again, from the shared prefix */
        needle_result r;
        size_t own1, shared1, own2, shared2;
        if (needle_decode(m, TL_ATTN_PQCACHE, o, &second, &s, NULL, &pr, steps, &r))
            goto done;
        pqc_cache_host_memory(lib.cache, &own1, &shared1);
        pqc_cache_host_memory(second.cache, &own2, &shared2);
        printf("\nsecond request over the same document, from a fork of the first's prefix "
               "(pqc_cache_fork):\n  passkey %s, decode %.1f tok/s; the fork took %.2f ms, and saved the "
               "prefill and PQ builds (%.2f s)\n", r.ok ? "retrieved" : "MISSED",
               r.decode_s > 0 ? r.steps / r.decode_s : 0.0, 1e3 * fork_s, prefill_s);
        printf("  host memory: the shared document %.1f MB once, the first request's own %.1f MB, "
               "the second's %.1f MB\n", (double)shared1 / 1048576.0, (double)own1 / 1048576.0,
               (double)own2 / 1048576.0);
        all_ok &= r.ok;
    }
    if (!all_ok)
        printf("\na mode that should retrieve the passkey missed it\n");
    rc = all_ok ? 0 : 2;
done:
    tlpq_destroy(&second); /* before lib: it runs on lib's runtime */
    tlpq_destroy(&lib);
    tlpq_destroy(&plain);
    tl_free_state(&s);
    tl_free_state(&ref);
    free(pr.tokens);
    return rc;
}

/* ----------------------------------------------------------------------------
   The grid */

static int write_plot(const needle_options *o, const double *acc, int n_modes_used,
                      const int *mode_of_panel)
{
    char path[1024];
    FILE *f;
    int p, li, di;
    snprintf(path, sizeof path, "%s.dat", o->out);
    f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s\n", path);
        return -1;
    }
    fprintf(f, "# needle retrieval accuracy (exact match of all passkey tokens)\n"
               "# one block per mode: depth_index length_index depth_percent length accuracy\n");
    for (p = 0; p < n_modes_used; p++) {
        int j = mode_of_panel[p];
        fprintf(f, "# mode %s\n", needle_names[j]);
        for (li = 0; li < o->n_lengths; li++) {
            for (di = 0; di < o->n_depths; di++)
                fprintf(f, "%d %d %g %d %.4f\n", di, li, o->depths[di], o->lengths[li],
                        acc[((size_t)j * NEEDLE_MAX_LIST + (size_t)li) * NEEDLE_MAX_LIST + (size_t)di]);
            fprintf(f, "\n");
        }
        fprintf(f, "\n");
    }
    fclose(f);

    snprintf(path, sizeof path, "%s.gp", o->out);
    f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s\n", path);
        return -1;
    }
    fprintf(f, "# gnuplot script written by needle: gnuplot %s\n", path);
    fprintf(f, "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
               "    set terminal pngcairo size %d,420 font 'sans,10'\n"
               "} else {\n"
               "    set terminal png size %d,420\n"
               "}\n", 330 * n_modes_used + 60, 330 * n_modes_used + 60);
    fprintf(f, "set output '%s'\n", o->png);
    fprintf(f, "set multiplot layout 1,%d title 'needle in a haystack: passkey retrieval "
               "(budget %g, %d sinks)'\n", n_modes_used, (double)o->ratio, o->n_sink);
    fprintf(f, "set palette defined (0 '#c0392b', 0.5 '#f1c40f', 1 '#27ae60')\n"
               "set cbrange [0:1]\nset xrange [-0.5:%g]\nset yrange [-0.5:%g]\n"
               "set xlabel 'needle depth (%%)'\nset ylabel 'context length'\nunset colorbox\n"
               "set tics scale 0\n", o->n_depths - 0.5, o->n_lengths - 0.5);
    fprintf(f, "set xtics (");
    for (di = 0; di < o->n_depths; di++)
        fprintf(f, "%s'%g' %d", di ? ", " : "", o->depths[di], di);
    fprintf(f, ")\nset ytics (");
    for (li = 0; li < o->n_lengths; li++)
        fprintf(f, "%s'%dK' %d", li ? ", " : "", o->lengths[li] / 1024, li);
    fprintf(f, ")\n");
    for (p = 0; p < n_modes_used; p++) {
        fprintf(f, "set title '%s'\n", needle_names[mode_of_panel[p]]);
        if (p == n_modes_used - 1)
            fprintf(f, "set colorbox\nset cblabel 'accuracy'\n");
        fprintf(f, "plot '%s.dat' index %d using 1:2:5 with image notitle, \\\n"
                   "     '' index %d using 1:2:(sprintf('%%.0f%%%%', 100*$5)) with labels notitle\n",
                o->out, p, p);
        if (p == 0)
            fprintf(f, "unset ylabel\n");
    }
    fprintf(f, "unset multiplot\n");
    fclose(f);
    return 0;
}

static int needle_grid(const tl_model *m, const needle_options *o)
{
    const tl_config *c = &m->config;
    static double acc[NEEDLE_N_MODES * NEEDLE_MAX_LIST * NEEDLE_MAX_LIST];
    int li, di, j, t, panel[NEEDLE_N_MODES], n_panels = 0, need_state = 0, steps = o->passkey_len;
    double t_start = tl_time_s(), t_prefill = 0.0, t_decode[NEEDLE_N_MODES];
    char desc[200];

    for (j = 0; j < NEEDLE_N_MODES; j++) {
        t_decode[j] = 0.0;
        if (o->use[j]) {
            panel[n_panels++] = j;
            if (needle_modes[j] != TL_ATTN_PQCACHE)
                need_state = 1;
        }
    }
    for (li = 0; li < o->n_lengths; li++)
        if (o->lengths[li] + steps > c->seq_len || o->lengths[li] < o->passkey_len + 2) {
            fprintf(stderr, "error: a length of %d does not fit the model (%d + %d positions of "
                    "%d)\n", o->lengths[li], o->lengths[li], steps, c->seq_len);
            return 1;
        }
    memset(acc, 0, sizeof acc);
    for (li = 0; li < o->n_lengths; li++) {
        int len = o->lengths[li];
        tl_state s;
        char err[TL_ERR_LEN];
        memset(&s, 0, sizeof s);
        if (need_state && tl_build_state(&s, c, len + steps, o->threads, err, sizeof err)) {
            fprintf(stderr, "error: %s\n", err);
            return 1;
        }
        for (di = 0; di < o->n_depths; di++)
            for (t = 0; t < o->seeds; t++) {
                needle_prompt pr;
                tlpq lib, plain;
                double ps = 0.0;
                memset(&lib, 0, sizeof lib);
                memset(&plain, 0, sizeof plain);
                if (needle_make_prompt(&pr, len, o->depths[di], o->first_seed + t, o->passkey_len))
                    return 1;
                if (needle_prefill(m, o, &pr, len + steps, &lib, o->use[NEEDLE_PLAIN] ? &plain : NULL,
                                   need_state ? &s : NULL, NULL, &ps))
                    return 1;
                t_prefill += ps;
                fprintf(stderr, "%6d tokens, depth %5.1f%%, seed %d: prefill %6.2f s;", len,
                        o->depths[di], o->first_seed + t, ps);
                for (j = 0; j < NEEDLE_N_MODES; j++) {
                    needle_result r;
                    if (!o->use[j])
                        continue;
                    if (needle_decode(m, needle_modes[j], o, j == NEEDLE_PLAIN ? &plain : &lib, &s, NULL,
                                      &pr, steps, &r))
                        return 1;
                    t_decode[j] += r.decode_s;
                    acc[((size_t)j * NEEDLE_MAX_LIST + (size_t)li) * NEEDLE_MAX_LIST + (size_t)di] +=
                        (double)r.ok / o->seeds;
                    fprintf(stderr, " %s %s", needle_names[j], r.ok ? "ok" : "MISS");
                }
                fprintf(stderr, "\n");
                if (li == 0 && di == 0 && t == 0)
                    tlpq_describe(&lib, desc, sizeof desc);
                tlpq_destroy(&lib);
                tlpq_destroy(&plain);
                free(pr.tokens);
            }
        tl_free_state(&s);
    }

    printf("needle in a haystack: exact match of all %d passkey tokens, %d prompt%s per cell\n"
           "selection modes: %d sinks + budget %g of the rest; pqcache: %s\n\n",
           o->passkey_len, o->seeds, o->seeds == 1 ? "" : "s", o->n_sink, (double)o->ratio, desc);
    printf("%-8s %7s", "mode", "length");
    for (di = 0; di < o->n_depths; di++)
        printf(" %5g%%", o->depths[di]);
    printf("   mean\n");
    for (t = 0; t < n_panels; t++) {
        double sum_mode = 0.0;
        j = panel[t];
        for (li = 0; li < o->n_lengths; li++) {
            double sum = 0.0;
            printf("%-8s %7d", li == 0 ? needle_names[j] : "", o->lengths[li]);
            for (di = 0; di < o->n_depths; di++) {
                double a = acc[((size_t)j * NEEDLE_MAX_LIST + (size_t)li) * NEEDLE_MAX_LIST + (size_t)di];
                printf(" %6.2f", a);
                sum += a;
            }
            printf(" %6.2f\n", sum / o->n_depths);
            sum_mode += sum;
        }
        printf("%-8s %7s %*s %6.2f   (decode %.2f s in all)\n", "", "all", 7 * o->n_depths, "",
               sum_mode / (o->n_depths * o->n_lengths), t_decode[j]);
    }
    printf("\nprefill %.1f s in all (once per prompt, shared by the modes); total %.1f s\n",
           t_prefill, tl_time_s() - t_start);
    if (write_plot(o, acc, n_panels, panel) == 0)
        printf("wrote %s.dat and %s.gp (gnuplot %s.gp draws %s)\n", o->out, o->out, o->out, o->png);
    return 0;
}

int main(int argc, char **argv)
{
    needle_options o;
    tl_model m;
    char err[TL_ERR_LEN];
    int rc;
    if (parse_needle_options(argc, argv, &o)) {
        needle_usage();
        return 1;
    }
    if (tl_build_model(&m, o.checkpoint, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    if (pk_use_vocab(m.config.vocab_size)) {
        fprintf(stderr, "error: %s is not a passkey model (vocabulary %d, expected %d or %d); "
                "write it with make_passkey\n", o.checkpoint, m.config.vocab_size, PK_VOCAB,
                PK_HARD_VOCAB);
        tl_free_model(&m);
        return 1;
    }
    if (o.long_ctx) { /* a model of 131072 positions holds a prompt of 131072 - n */
        int li, room = m.config.seq_len - o.passkey_len;
        for (li = o.n_lengths - 2; li < o.n_lengths; li++)
            if (o.lengths[li] > room) o.lengths[li] = room;
    }
    rc = o.compare_len > 0 ? needle_compare(&m, &o) : needle_grid(&m, &o);
    tl_free_model(&m);
    return rc;
}
