/* run.c - command-line driver for the tiny_llama engine.

   Loads a llama2.c checkpoint or a Hugging Face model directory, prefills a prompt with full attention, then
   decodes with the chosen attention mode (full, window, oracle, pqcache),
   reporting tokens/second per phase. With -c it runs a full-attention
   reference next to the chosen mode and reports how often the two agree on
   the next token and the mean KL divergence of their distributions.

   generate() drives an engine (prefill, decode, the split it attended over, its
   report): the plain engine runs full, window and oracle on its own KV cache;
   pqcache runs through the library's driver (tl_pqcache.h): the prompt is
   prefilled layer by layer with pqc_driver_prefill, every decode step is a
   pqc_driver_decode (append, select, fetch, attention over the selection). */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"
#define TL_PQCACHE_IMPLEMENTATION
#include "tl_pqcache.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ----------------------------------------------------------------------------
   Options */

typedef struct {
    const char *checkpoint;
    const char *tokenizer;   /* -z */
    const char *input;       /* -i: text with -z, else token ids */
    const char *ids_file;    /* -I: token ids from a file, "-" = stdin */
    const char *logits_out;  /* -o: every step's logits (float32) to this file */
    int synthetic;           /* -P: length of a random prompt */
    int steps;               /* -n: tokens to generate */
    int ctx;                 /* -L: context capacity, 0 = model seq_len */
    float temperature;       /* -t */
    float topp;              /* -p */
    unsigned long long seed; /* -s */
    int threads;             /* -j */
    int compare;             /* -c */
    int quiet;               /* -q */
    tl_policy policy;        /* -a -b -S */
    tlpq_config pq;          /* -m -B -T -C -K -E -D -x (and -b -S -j -s) */
} options;

static void usage(void)
{
    fprintf(stderr,
        "usage: tiny_llama <checkpoint.bin | model directory> [options]\n"
        "  a model directory holds a Hugging Face checkpoint: config.json and\n"
        "  model.safetensors (or model.safetensors.index.json and its shards);\n"
        "  prompts and output are then token ids (tools/hf_tokens.py converts text)\n"
        "  -z <path>   tokenizer.bin (llama2.c format): -i is then text and the\n"
        "              output is printed as text\n"
        "  -i <str>    prompt: text with -z, else token ids, e.g. -i \"1 2 3\"\n"
        "  -I <path>   instead of -i: token ids from a file (\"-\" = standard input)\n"
        "  -o <path>   write the logits of every step (prefill, then each decode\n"
        "              step) to this file, vocab_size float32 values per step\n"
        "  -P <int>    instead of -i: a prompt of this many random token ids (seeded)\n"
        "  -n <int>    tokens to generate (default 64); the first comes from the\n"
        "              prefill, each further one costs a decode step\n"
        "  -L <int>    context capacity (default: the model's seq_len)\n"
        "  -t <float>  temperature (default 1.0; 0 = greedy)\n"
        "  -p <float>  top-p (default 0.9; 0 or 1 = off)\n"
        "  -s <int>    random seed (default 42)\n"
        "  -a <mode>   attention for decode steps (the prompt always uses full):\n"
        "                full     every past token\n"
        "                window   S sink tokens + the most recent B tokens\n"
        "                oracle   sinks + the most recent B/2 + the exact top B/2 by\n"
        "                         attention probability (per KV head)\n"
        "                pqcache  sinks + the recent window + the top-k by PQ score,\n"
        "                         through the pqcache library's driver (the prompt is\n"
        "                         prefilled layer by layer, full attention)\n"
        "  -b <float>  budget ratio (default 0.1; pqcache: above 0): B = ratio *\n"
        "              (context - S), so every selection mode attends over S + B tokens\n"
        "  -S <int>    sink tokens (default 4, the library's; 0 = none)\n"
        "  -c          compare with a full-attention reference during decode:\n"
        "              next-token agreement and mean KL(full || mode)\n"
        "  -j <int>    threads (default 1): the projections' rows, a decode step's\n"
        "              attention over KV heads, the prompt's over tokens; pqcache also\n"
        "              sizes the library's pool (its PQ builds) with it\n"
        "  -q          quiet: print no tokens, only the report\n"
        "  -x          prefill with the decode step's arithmetic: the prompt's logits\n"
        "              equal token by token's to the bit (default: tiled matrix\n"
        "              products, equal to rounding and several times faster)\n"
        "pqcache options:\n"
        "  -m <int>    PQ sub-spaces, divides the head size (default: the library's, 4)\n"
        "  -B <int>    bits per PQ code, 1..8 (default: the library's, 8)\n"
        "  -T <int>    k-means iterations (default 0 = the adaptive scheduler)\n"
        "  -C <int>    block-cache blocks per layer and KV head (default 32; 0 = none)\n"
        "  -K <int>    tokens per block (default 128)\n"
        "  -E <lfu|lru> block-cache eviction policy (default lfu)\n"
        "  -D <cpu|auto|cuda> pqcache's device tier: the CPU (default), a CUDA GPU\n"
        "              when one is usable, or a CUDA GPU (an error without one)\n");
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

static int parse_float(const char *s, float lo, float hi, float *out)
{
    char *end;
    float v = strtof(s, &end);
    if (end == s || *end != '\0' || !(v >= lo && v <= hi))
        return -1;
    *out = v;
    return 0;
}

static int parse_options(int argc, char **argv, options *o)
{
    int i, seed = 42;
    memset(o, 0, sizeof *o);
    o->steps = 64;
    o->temperature = 1.0f;
    o->topp = 0.9f;
    o->threads = 1;
    tl_default_policy(&o->policy, TL_ATTN_FULL);
    tlpq_default_config(&o->pq);
    if (argc < 2 || argv[1][0] == '-')
        return -1;
    o->checkpoint = argv[1];
    for (i = 2; i < argc; i++) {
        const char *flag = argv[i], *val;
        int bad = 0;
        if (flag[0] != '-' || flag[1] == '\0' || flag[2] != '\0')
            return -1;
        if (flag[1] == 'c') { o->compare = 1; continue; }
        if (flag[1] == 'q') { o->quiet = 1; continue; }
        if (flag[1] == 'x') { o->pq.exact_prefill = 1; continue; }
        if (i + 1 >= argc)
            return -1;
        val = argv[++i];
        switch (flag[1]) {
        case 'z': o->tokenizer = val; break;
        case 'i': o->input = val; break;
        case 'I': o->ids_file = val; break;
        case 'o': o->logits_out = val; break;
        case 'P': bad = parse_int(val, 1, 1 << 30, &o->synthetic); break;
        case 'n': bad = parse_int(val, 1, 1 << 30, &o->steps); break;
        case 'L': bad = parse_int(val, 1, 1 << 30, &o->ctx); break;
        case 't': bad = parse_float(val, 0.0f, 100.0f, &o->temperature); break;
        case 'p': bad = parse_float(val, 0.0f, 1.0f, &o->topp); break;
        case 's': bad = parse_int(val, 0, 2147483647, &seed); break;
        case 'j': bad = parse_int(val, 1, 64, &o->threads); break;
        case 'b': bad = parse_float(val, 0.0f, 1.0f, &o->policy.ratio); break;
        case 'S': bad = parse_int(val, 0, 1 << 30, &o->policy.n_sink); break;
        case 'm': bad = parse_int(val, 1, 1 << 16, &o->pq.pq_m); break;
        case 'B': bad = parse_int(val, 1, 8, &o->pq.pq_bits); break;
        case 'T': bad = parse_int(val, 0, 100000, &o->pq.iters); break;
        case 'C': /* -C 0: no block cache (the library's -1) */
            bad = parse_int(val, 0, 1 << 20, &o->pq.cache_blocks);
            if (!bad && o->pq.cache_blocks == 0) o->pq.cache_blocks = -1;
            break;
        case 'K': bad = parse_int(val, 1, 1 << 20, &o->pq.block_tokens); break;
        case 'D':
            if (strcmp(val, "cpu") == 0) o->pq.backend = PQC_BACKEND_CPU;
            else if (strcmp(val, "auto") == 0) o->pq.backend = PQC_BACKEND_AUTO;
            else if (strcmp(val, "cuda") == 0) o->pq.backend = PQC_BACKEND_CUDA;
            else bad = 1;
            break;
        case 'E':
            if (strcmp(val, "lfu") == 0) o->pq.policy = PQC_POLICY_LFU;
            else if (strcmp(val, "lru") == 0) o->pq.policy = PQC_POLICY_LRU;
            else bad = 1;
            break;
        case 'a':
            if (strcmp(val, "full") == 0) o->policy.mode = TL_ATTN_FULL;
            else if (strcmp(val, "window") == 0) o->policy.mode = TL_ATTN_WINDOW;
            else if (strcmp(val, "oracle") == 0) o->policy.mode = TL_ATTN_ORACLE;
            else if (strcmp(val, "pqcache") == 0) o->policy.mode = TL_ATTN_PQCACHE;
            else bad = 1;
            break;
        default: return -1;
        }
        if (bad) {
            fprintf(stderr, "error: bad value '%s' for %s\n", val, flag);
            return -1;
        }
    }
    o->seed = (unsigned long long)seed;
    o->pq.n_sink = o->policy.n_sink > 0 ? o->policy.n_sink : -1; /* -S 0: none */
    o->pq.ratio = o->policy.ratio;
    o->pq.n_threads = o->threads;
    o->pq.seed = o->seed;
    return 0;
}

/* ----------------------------------------------------------------------------
   Prompt */

/* Token ids from "1 2 3" (spaces, commas or newlines between them). */
static int parse_ids(const char *s, int vocab_size, int *tokens, int cap, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        long v;
        if (*s == ' ' || *s == ',' || *s == '\t' || *s == '\n') {
            s++;
            continue;
        }
        v = strtol(s, &end, 10);
        if (end == s || v < 0 || v >= vocab_size) {
            fprintf(stderr, "error: bad token id near '%.20s' (vocabulary 0..%d)\n",
                    s, vocab_size - 1);
            return -1;
        }
        if (*n >= cap)
            return -1;
        tokens[(*n)++] = (int)v;
        s = end;
    }
    return 0;
}

/* The whole of a file ("-" = standard input) as a string; NULL on failure. */
static char *read_text(const char *path)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    size_t len = 0, cap = 4096, got;
    char *buf;
    if (!f) {
        fprintf(stderr, "error: cannot open %s\n", path);
        return NULL;
    }
    buf = (char *)malloc(cap + 1);
    while (buf && (got = fread(buf + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            char *nb = cap < ((size_t)1 << 30) ? (char *)realloc(buf, 2 * cap + 1) : NULL;
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    if (f != stdin)
        fclose(f);
    if (!buf) {
        fprintf(stderr, "error: %s is too large or memory ran out\n", path);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

static int *build_prompt(const options *o, const tl_tokenizer *tok, int vocab_size, int *n)
{
    char *text = o->ids_file ? read_text(o->ids_file) : NULL;
    size_t cap;
    int *tokens;
    int i;
    *n = 0;
    if (o->ids_file && !text)
        return NULL;
    cap = o->synthetic > 0 ? (size_t)o->synthetic :
          (text ? strlen(text) : o->input ? strlen(o->input) : 0) + 3;
    tokens = (int *)malloc(cap * sizeof(int));
    if (!tokens) {
        free(text);
        fprintf(stderr, "error: out of memory for the prompt\n");
        return NULL;
    }
    if (text) {
        int bad = parse_ids(text, vocab_size, tokens, (int)cap, n);
        free(text);
        if (bad) {
            free(tokens);
            return NULL;
        }
    }
    if (o->synthetic > 0) {
        unsigned long long rng = tl_rng_seed(o->seed ^ 0x5EEDull);
        for (i = 0; i < o->synthetic; i++)
            tokens[i] = (int)(tl_rng_next(&rng) % (unsigned long long)vocab_size);
        *n = o->synthetic;
    } else if (o->ids_file) {
        /* read above */
    } else if (tok) {
        if (tl_encode(tok, o->input ? o->input : "", 1, 0, tokens, n) != 0) {
            fprintf(stderr, "error: cannot encode the prompt (out of memory)\n");
            free(tokens);
            return NULL;
        }
    } else if (o->input && parse_ids(o->input, vocab_size, tokens, (int)cap, n) != 0) {
        free(tokens);
        return NULL;
    }
    if (*n == 0)
        tokens[(*n)++] = TL_BOS;   /* an empty prompt starts a sequence */
    return tokens;
}

static void print_token(const options *o, const tl_tokenizer *tok, int prev, int token)
{
    if (o->quiet || (tok && (token == TL_BOS || token == TL_EOS)))
        return;
    if (tok)
        tl_print_piece(stdout, tl_decode(tok, prev, token));
    else
        printf("%d ", token);
    fflush(stdout);
}

/* ----------------------------------------------------------------------------
   Comparison with the full-attention reference */

static double log_sum_exp(const float *x, int n)
{
    double max = x[0], sum = 0.0;
    int i;
    for (i = 1; i < n; i++)
        if (x[i] > max)
            max = x[i];
    for (i = 0; i < n; i++)
        sum += exp((double)x[i] - max);
    return max + log(sum);
}

/* KL(p || q) of the softmax distributions of two logit vectors */
static double kl_divergence(const float *p_logits, const float *q_logits, int n)
{
    double lp = log_sum_exp(p_logits, n), lq = log_sum_exp(q_logits, n), kl = 0.0;
    int i;
    for (i = 0; i < n; i++) {
        double a = (double)p_logits[i] - lp, b = (double)q_logits[i] - lq;
        kl += exp(a) * (a - b);
    }
    return kl > 0.0 ? kl : 0.0;
}

/* ----------------------------------------------------------------------------
   Engines: what generate() drives. The plain engine runs the modes full, window and
   oracle on its own KV cache; pqcache runs through the library's driver (tl_pqcache.h). */

typedef struct engine engine;
struct engine {
    const char *name;         /* the mode, as the report names it */
    const char *prefill_how;  /* the prefill line's words after "full attention" */
    /* the logits of the prompt's last token, of a decode step; NULL with err set */
    float *(*prefill)(engine *e, const int *tokens, int n);
    float *(*decode)(engine *e, int token, int pos);
    /* the keys and values of positions 0..n-1 into a state's KV cache (-c's reference) */
    int (*copy_kv)(engine *e, tl_state *dst, int n);
    /* what the last decode step attended over, for the decode line: "<mode>, ..." */
    void (*split)(engine *e, int n_ctx, char *buf, size_t len);
    void (*report)(engine *e, int n_prompt, int decoded);   /* lines of its own */
    void (*destroy)(engine *e);
    const char *err;
    int progress_shown;       /* the prefill printed a progress line */
    const options *o;
    const tl_model *m;
    tl_state s;               /* plain */
    tlpq lib;                 /* pqcache */
    double t0, last;          /* prefill progress */
};

/* A prefill's end: its progress line cleared, unless it failed (the error follows it). */
static float *end_progress(engine *e, float *logits)
{
    if (logits && e->progress_shown)
        fprintf(stderr, "\r%70s\r", "");
    return logits;
}

/* prefill progress, layer-major (the plain modes' tl_forward_chunk and the pqcache
   mode's driver alike) */
static void prefill_progress(void *user, int layer, int n_layers, int done, int total)
{
    engine *e = (engine *)user;
    double now = tl_time_s();
    if (now - e->last < 0.25 || done >= total)
        return;
    fprintf(stderr, "\rprefill layer %d/%d: %d/%d tokens (%.0f%%), %.1f s   ", layer + 1,
            n_layers, done, total, 100.0 * done / total, now - e->t0);
    e->last = now;
    e->progress_shown = 1;
}

/* the whole prompt in one call: layer by layer, its keys and values packed once per
   layer for the tiled attention */
static float *plain_prefill(engine *e, const int *tokens, int n)
{
    float *logits;
    e->t0 = e->last = tl_time_s();
    e->s.progress = prefill_progress;
    e->s.progress_user = e;
    logits = tl_forward_chunk(e->m, &e->s, tokens, n, 0);
    e->s.progress = NULL;
    return end_progress(e, logits);
}

static float *plain_decode(engine *e, int token, int pos)
{
    return tl_forward(e->m, &e->s, &e->o->policy, token, pos);
}

static int plain_copy_kv(engine *e, tl_state *dst, int n)
{
    const tl_config *c = &e->m->config;
    size_t bytes = (size_t)n * (size_t)c->kv_dim * sizeof(float);
    int l;
    for (l = 0; l < c->n_layers; l++) {
        memcpy(tl_key_row(c, dst, l, 0), tl_key_row(c, &e->s, l, 0), bytes);
        memcpy(tl_value_row(c, dst, l, 0), tl_value_row(c, &e->s, l, 0), bytes);
    }
    return 0;
}

static void plain_split(engine *e, int n_ctx, char *buf, size_t len)
{
    int sink, window, topk;
    tl_budget(&e->o->policy, n_ctx, &sink, &window, &topk);
    if (e->o->policy.mode == TL_ATTN_FULL)
        snprintf(buf, len, "full, context %d", n_ctx);
    else
        snprintf(buf, len, "%s: %d sinks + %d window + %d top-k of %d at the last step", e->name, sink, window,
                 topk, n_ctx);
}

static void plain_report(engine *e, int n_prompt, int decoded)
{
    (void)e;
    (void)n_prompt;
    (void)decoded;
}

static void plain_destroy(engine *e) { tl_free_state(&e->s); }

static float *pq_prefill(engine *e, const int *tokens, int n)
{
    e->t0 = e->last = tl_time_s();
    e->lib.progress = prefill_progress;
    e->lib.progress_user = e;
    return end_progress(e, tlpq_prefill(&e->lib, tokens, n));
}

static float *pq_decode(engine *e, int token, int pos) { return tlpq_decode(&e->lib, token, pos); }

static int pq_copy_kv(engine *e, tl_state *dst, int n) { return tlpq_copy_kv(&e->lib, dst, n); }

/* the split as the library resolved it (tlpq_stats) */
static void pq_split(engine *e, int n_ctx, char *buf, size_t len)
{
    tlpq_stats st;
    char windows[80] = "";
    (void)n_ctx;
    tlpq_get_stats(&e->lib, &st);
    if (st.window_min < st.window_max)
        snprintf(windows, sizeof windows, "; the layers' windows %d-%d", st.window_min, st.window_max);
    snprintf(buf, len, "pqcache: %d sinks + %d window + %d top-k of %d at the last step%s", st.sinks,
             st.step_window, st.top_k, st.n_tokens, windows);
}

static void pq_report(engine *e, int n_prompt, int decoded)
{
    const tl_config *c = &e->m->config;
    const tlpq *lib = &e->lib;
    tlpq_stats st;
    double steps = decoded > 0 ? (double)decoded : 1.0;
    unsigned long long looked;
    char desc[200];
    tlpq_describe(lib, desc, sizeof desc);
    fprintf(stderr, "pqcache: %s\n", desc);
    tlpq_get_stats(lib, &st);
    looked = st.hits + st.misses;
    if (pqc_runtime_backend_note(lib->rt)[0])
        fprintf(stderr, "pqcache: %s\n", pqc_runtime_backend_note(lib->rt));
    fprintf(stderr, "pqcache: PQ builds %llu (%llu rebuilds), T = %d..%d iterations, build %.3f s "
            "(worker time), decode waited %.3f s for builds\n", st.builds, st.rebuilds,
            st.iters_min, st.iters_max, st.build_s, st.wait_s);
    fprintf(stderr, "pqcache: select %.1f us/token, fetch %.1f us/token (all %d layers%s); "
            "%.0f tokens attended per KV head and layer on average (window %d)\n",
            1e6 * st.select_s / steps, 1e6 * st.fetch_s / steps, lib->n_lib,
            lib->n_lib < c->n_layers ? " it serves: the global ones" : "",
            st.selects ? (double)st.tokens_selected / ((double)st.selects * c->n_kv_heads) : 0.0,
            st.window);
    fprintf(stderr, "pqcache: block cache hit rate %.1f%% (%llu of %llu selected mid tokens); "
            "h2d %.1f KB/token (codes %.1f KB), d2h %.1f KB/token\n",
            looked ? 100.0 * (double)st.hits / (double)looked : 0.0, st.hits, looked,
            (double)st.bytes_h2d / steps / 1024.0, (double)st.bytes_codes / steps / 1024.0,
            (double)st.bytes_d2h / steps / 1024.0);
    fprintf(stderr, "pqcache: device tier %.2f MB vs full KV cache %.2f MB (%.1f%%) at %d tokens\n",
            (double)st.device_bytes / 1048576.0, (double)st.full_bytes / 1048576.0,
            st.full_bytes ? 100.0 * (double)st.device_bytes / (double)st.full_bytes : 0.0,
            n_prompt + decoded);
}

static void pq_destroy(engine *e) { tlpq_destroy(&e->lib); }

/* The engine of o's mode, for sequences of up to ctx positions. */
static int open_engine(engine *e, const options *o, const tl_model *m, int ctx, char *err, size_t errlen)
{
    int pq = o->policy.mode == TL_ATTN_PQCACHE;
    memset(e, 0, sizeof *e);
    e->o = o;
    e->m = m;
    e->name = tl_mode_name(o->policy.mode);
    e->prefill_how = pq ? ", layer-major through pqc_driver_prefill" : "";
    e->prefill = pq ? pq_prefill : plain_prefill;
    e->decode = pq ? pq_decode : plain_decode;
    e->copy_kv = pq ? pq_copy_kv : plain_copy_kv;
    e->split = pq ? pq_split : plain_split;
    e->report = pq ? pq_report : plain_report;
    e->destroy = pq ? pq_destroy : plain_destroy;
    e->err = pq ? e->lib.err : e->s.err;
    if (pq)
        return tlpq_create(&e->lib, m, ctx, &o->pq, err, errlen);
    if (tl_build_state(&e->s, &m->config, ctx, o->threads, err, errlen))
        return -1;
    e->s.exact_prefill = o->pq.exact_prefill;
    return 0;
}

/* ----------------------------------------------------------------------------
   Generation: the prompt's prefill is step 0, each further step a decode step */

/* -c: a full-attention reference from the same prefill, fed the mode's tokens */
typedef struct {
    tl_state s;
    int agree;       /* steps where both pick the same most likely token */
    double kl_sum;   /* KL(reference || mode) summed over the steps */
    double t;        /* seconds in its decode steps */
} reference;

static int reference_open(reference *r, const options *o, const tl_config *c, int ctx, char *err,
                          size_t errlen)
{
    if (tl_build_state(&r->s, c, ctx, o->threads, err, errlen))
        return -1;
    r->s.exact_prefill = o->pq.exact_prefill;   /* prefilled as the mode is (its keys, values) */
    return 0;
}

static int reference_step(reference *r, const tl_model *m, int token, int pos, const float *logits)
{
    int V = m->config.vocab_size;
    double t0 = tl_time_s();
    float *ref_logits = tl_forward(m, &r->s, NULL, token, pos);
    r->t += tl_time_s() - t0;
    if (!ref_logits) {
        fprintf(stderr, "\nerror: %s\n", r->s.err);
        return -1;
    }
    r->agree += tl_argmax(ref_logits, V) == tl_argmax(logits, V);
    r->kl_sum += kl_divergence(ref_logits, logits, V);
    return 0;
}

static int generate(const options *o, const tl_model *m, const tl_tokenizer *tok,
                    const int *prompt, int n_prompt)
{
    const tl_config *c = &m->config;
    int V = c->vocab_size, ctx = n_prompt + o->steps - 1, step, token = prompt[n_prompt - 1];
    int next, decoded = 0, rc = 1;
    engine e;
    reference ref;
    tl_sampler sampler;
    FILE *dump = NULL;
    float *logits;
    double t0, t_prefill = 0.0, t_decode = 0.0;
    char err[TL_ERR_LEN], split[200];

    memset(&ref, 0, sizeof ref);
    memset(&sampler, 0, sizeof sampler);
    if (open_engine(&e, o, m, ctx, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    if (o->compare && reference_open(&ref, o, c, ctx, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        goto done;
    }
    if (tl_build_sampler(&sampler, V, o->temperature, o->topp, o->seed)) {
        fprintf(stderr, "error: out of memory\n");
        goto done;
    }
    if (o->logits_out && !(dump = fopen(o->logits_out, "wb"))) {
        fprintf(stderr, "error: cannot write %s\n", o->logits_out);
        goto done;
    }
    for (step = 0; step < o->steps; step++) {
        if (step > 0 && tok && (token == TL_BOS || token == TL_EOS))
            break;
        t0 = tl_time_s();
        logits = step == 0 ? e.prefill(&e, prompt, n_prompt) : e.decode(&e, token, n_prompt + step - 1);
        *(step == 0 ? &t_prefill : &t_decode) += tl_time_s() - t0;
        if (!logits) {
            fprintf(stderr, "\nerror: %s\n", e.err);
            goto done;
        }
        if (o->compare && step == 0 && e.copy_kv(&e, &ref.s, n_prompt) != 0) {
            fprintf(stderr, "error: %s\n", e.err);
            goto done;
        }
        if (dump && fwrite(logits, sizeof(float), (size_t)V, dump) != (size_t)V) {
            fprintf(stderr, "%serror: cannot write %s\n", step ? "\n" : "", o->logits_out);
            goto done;
        }
        if (o->compare && step > 0 && reference_step(&ref, m, token, n_prompt + step - 1, logits) != 0)
            goto done;
        next = tl_sample(&sampler, logits);   /* the reference, too, goes on with the mode's token */
        print_token(o, tok, token, next);
        token = next;
        decoded += step > 0;
    }
    if (!o->quiet)
        printf("\n");
    e.split(&e, n_prompt + decoded, split, sizeof split);
    fprintf(stderr, "prefill: %d tokens in %.3f s, %.1f tok/s (full attention%s)\n", n_prompt, t_prefill,
            t_prefill > 0 ? n_prompt / t_prefill : 0.0, e.prefill_how);
    fprintf(stderr, "decode:  %d steps in %.3f s, %.1f tok/s (%s)\n", decoded, t_decode,
            t_decode > 0 ? decoded / t_decode : 0.0, split);
    e.report(&e, n_prompt, decoded);
    if (o->compare && decoded > 0)
        fprintf(stderr, "compare: next-token agreement %.2f%% (%d/%d), mean KL(full || %s) "
                "%.6f nats; reference %.1f tok/s\n", 100.0 * ref.agree / decoded, ref.agree, decoded, e.name,
                ref.kl_sum / decoded, ref.t > 0 ? decoded / ref.t : 0.0);
    rc = 0;
done:
    if (dump && fclose(dump) != 0 && rc == 0) {
        fprintf(stderr, "error: cannot write %s\n", o->logits_out);
        rc = 1;
    }
    tl_free_sampler(&sampler);
    tl_free_state(&ref.s);
    e.destroy(&e);
    return rc;
}

/* ----------------------------------------------------------------------------
   Main */

/* The prompt and the tokens to generate fit the context (-L, the model's seq_len). */
static int check_context(const options *o, const tl_config *c, int n_prompt)
{
    int ctx = o->ctx ? o->ctx : c->seq_len;
    if (ctx > c->seq_len) {
        fprintf(stderr, "error: context %d exceeds the model's seq_len %d\n", ctx, c->seq_len);
        return 1;
    }
    if (n_prompt + o->steps - 1 > ctx) {
        fprintf(stderr, "error: prompt (%d) + generated tokens (%d) need %d positions; "
                "the context holds %d (see -L and the model's seq_len)\n",
                n_prompt, o->steps, n_prompt + o->steps - 1, ctx);
        return 1;
    }
    return 0;
}

static void print_model(const tl_model *m)
{
    const tl_config *c = &m->config;
    if (!m->layers)
        return;
    fprintf(stderr, "model: %s, %d layers, dim %d, %d heads (%d KV) of %d, hidden %d, vocab %d, "
            "%s weights (%.2f GB read per token)%s\n", tl_arch_name(c->arch), c->n_layers, c->dim,
            c->n_heads, c->n_kv_heads, c->head_size, c->hidden_dim, c->vocab_size,
            tl_dtype_name(c->wtype), tl_weight_bytes_per_token(m) / 1e9,
            c->shared_classifier ? ", tied embeddings" : "");
    fprintf(stderr, "rope: theta %.9g", (double)c->rope_theta);
    if (c->rope_scaling == TL_ROPE_SCALING_LINEAR)
        fprintf(stderr, ", linear factor %.9g", (double)c->rope_factor);
    else if (c->rope_scaling == TL_ROPE_SCALING_LLAMA3)
        fprintf(stderr, ", llama3 factor %.9g low_freq_factor %.9g high_freq_factor %.9g original %d",
                (double)c->rope_factor, (double)c->rope_low_freq_factor,
                (double)c->rope_high_freq_factor, c->rope_orig_ctx);
    fprintf(stderr, "\n");
    if (c->sliding_window > 0) {
        int l, n_local = 0;
        for (l = 0; l < c->n_layers; l++)
            n_local += tl_layer_window(c, l) > 0;
        fprintf(stderr, "layers: %d local (window %d, rope theta %.9g), %d global:", n_local, c->sliding_window,
                (double)(c->rope_theta_local > 0.0f ? c->rope_theta_local : c->rope_theta), c->n_layers - n_local);
        for (l = 0; l < c->n_layers; l++)
            if (tl_layer_window(c, l) == 0)
                fprintf(stderr, " %d", l);
        fprintf(stderr, "\n");
    }
}

int main(int argc, char **argv)
{
    options o;
    tl_model model;
    tl_tokenizer tok;
    char err[TL_ERR_LEN];
    int *prompt, n_prompt = 0, rc;

    if (parse_options(argc, argv, &o) != 0) {
        usage();
        return 1;
    }
    if (o.policy.mode == TL_ATTN_PQCACHE && !(o.policy.ratio > 0.0f)) {
        fprintf(stderr, "error: pqcache needs a budget ratio above 0 (-b)\n");
        return 1;
    }
    if (o.policy.mode != TL_ATTN_PQCACHE && tl_check_policy(&o.policy, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);   /* pqcache is the library's driver, not tl_select */
        return 1;
    }
    if ((o.input != NULL) + (o.synthetic > 0) + (o.ids_file != NULL) > 1) {
        fprintf(stderr, "error: -i, -I and -P exclude each other\n");
        return 1;
    }
    if (tl_build_model(&model, o.checkpoint, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    if (!o.quiet || model.layers)
        print_model(&model);
    if (o.tokenizer &&
        tl_build_tokenizer(&tok, o.tokenizer, model.config.vocab_size, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        tl_free_model(&model);
        return 1;
    }
    prompt = build_prompt(&o, o.tokenizer ? &tok : NULL, model.config.vocab_size, &n_prompt);
    if (!prompt) {
        rc = 1;
    } else {
        if (!o.quiet && o.input) {   /* echo the prompt */
            int i;
            for (i = 0; i < n_prompt; i++)
                print_token(&o, o.tokenizer ? &tok : NULL, i ? prompt[i - 1] : -1, prompt[i]);
        }
        rc = check_context(&o, &model.config, n_prompt) ||
             generate(&o, &model, o.tokenizer ? &tok : NULL, prompt, n_prompt);
    }
    free(prompt);
    if (o.tokenizer)
        tl_free_tokenizer(&tok);
    tl_free_model(&model);
    return rc;
}
