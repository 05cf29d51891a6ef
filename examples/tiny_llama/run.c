/* run.c - command-line driver for the tiny_llama engine.

   Loads a llama2.c checkpoint or a Hugging Face model directory, prefills a prompt with full attention, then
   decodes with the chosen attention mode (full, window, oracle, pqcache),
   reporting tokens/second per phase. With -c it runs a full-attention
   reference next to the chosen mode and reports how often the two agree on
   the next token and the mean KL divergence of their distributions.

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

#define PREFILL_CHUNK 256   /* tokens per tl_forward_chunk call (a progress line each) */

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
    tlpq_config pq;          /* -m -B -T -C -E (and -b -S -j -s) */
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
        "  -b <float>  budget ratio (default 0.1): B = ratio * (context - S), so every\n"
        "              selection mode attends over S + B tokens\n"
        "  -S <int>    sink tokens (default 32)\n"
        "  -c          compare with a full-attention reference during decode:\n"
        "              next-token agreement and mean KL(full || mode)\n"
        "  -j <int>    threads (default 1): attention, split over KV heads; pqcache\n"
        "              also splits its prefill over tokens and sizes the library's pool\n"
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

/* prefill progress of the pqcache mode (layer-major) */
typedef struct {
    double t0, last;
    int shown;
} progress_state;

static void prefill_progress(void *user, int layer, int n_layers, int done, int total)
{
    progress_state *ps = (progress_state *)user;
    double now = tl_time_s();
    if (now - ps->last < 0.25 || done >= total)
        return;
    fprintf(stderr, "\rprefill layer %d/%d: %d/%d tokens (%.0f%%), %.1f s   ", layer + 1,
            n_layers, done, total, 100.0 * done / total, now - ps->t0);
    ps->last = now;
    ps->shown = 1;
}

static void report_pqcache(const tlpq *lib, const tl_config *c, int n_prompt, int decoded)
{
    tlpq_stats st;
    double steps = decoded > 0 ? (double)decoded : 1.0;
    unsigned long long looked = 0;
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

static void copy_prefix(const tl_config *c, tl_state *dst, const tl_state *src, int n_pos)
{
    int l;
    size_t bytes = (size_t)n_pos * (size_t)c->kv_dim * sizeof(float);
    for (l = 0; l < c->n_layers; l++) {
        memcpy(tl_key_row(c, dst, l, 0), tl_key_row(c, src, l, 0), bytes);
        memcpy(tl_value_row(c, dst, l, 0), tl_value_row(c, src, l, 0), bytes);
    }
}

/* ----------------------------------------------------------------------------
   Generation */

static int generate(const options *o, const tl_model *m, const tl_tokenizer *tok,
                    const int *prompt, int n_prompt)
{
    const tl_config *c = &m->config;
    tl_state s, ref;
    tlpq lib;
    progress_state ps;
    int pq = o->policy.mode == TL_ATTN_PQCACHE;
    tl_sampler sampler;
    char err[TL_ERR_LEN];
    FILE *dump = NULL;
    float *logits = NULL, *ref_logits;
    double t0, t_prefill, t_decode = 0.0, t_ref = 0.0, last_report, kl_sum = 0.0;
    int ctx = o->ctx ? o->ctx : c->seq_len, pos, token, next, step, agree = 0;
    int decoded = 0, progress = 0, rc = 1, sink, window, topk, wmin = 0, wmax = 0;
    char wtext[80] = "";

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
    ctx = n_prompt + o->steps - 1;   /* no need to allocate more */
    memset(&s, 0, sizeof s);
    memset(&lib, 0, sizeof lib);
    if (pq ? tlpq_create(&lib, m, ctx, &o->pq, err, sizeof err)
           : tl_build_state(&s, c, ctx, o->threads, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    s.exact_prefill = o->pq.exact_prefill;
    if (o->compare && tl_build_state(&ref, c, ctx, o->threads, err, sizeof err)) {
        fprintf(stderr, "error: %s\n", err);
        if (pq)
            tlpq_destroy(&lib);
        else
            tl_free_state(&s);
        return 1;
    }
    if (o->compare)
        ref.exact_prefill = o->pq.exact_prefill;
    if (tl_build_sampler(&sampler, c->vocab_size, o->temperature, o->topp, o->seed)) {
        fprintf(stderr, "error: out of memory\n");
        goto done;
    }
    if (o->logits_out && !(dump = fopen(o->logits_out, "wb"))) {
        fprintf(stderr, "error: cannot write %s\n", o->logits_out);
        goto done_sampler;
    }

    /* prefill: full attention, logits only for the last prompt token */
    t0 = last_report = tl_time_s();
    if (pq) {   /* layer-major through the library's driver */
        ps.t0 = ps.last = t0;
        ps.shown = 0;
        lib.progress = prefill_progress;
        lib.progress_user = &ps;
        logits = tlpq_prefill(&lib, prompt, n_prompt);
        progress = ps.shown;
        if (!logits) {
            fprintf(stderr, "\nerror: %s\n", lib.err);
            goto done_sampler;
        }
    }
    for (pos = 0; !pq && pos < n_prompt; pos += PREFILL_CHUNK) {
        /* chunks of tokens: the projections run as matrix-matrix products */
        int nb = n_prompt - pos < PREFILL_CHUNK ? n_prompt - pos : PREFILL_CHUNK;
        double now;
        logits = tl_forward_chunk(m, &s, prompt + pos, nb, pos);
        now = tl_time_s();
        if (!logits) {
            fprintf(stderr, "\nerror: %s\n", s.err);
            goto done_sampler;
        }
        if (now - last_report >= 0.25 && pos + nb < n_prompt) {
            fprintf(stderr, "\rprefill %d/%d tokens (%.0f%%), %.1f tok/s   ", pos + nb,
                    n_prompt, 100.0 * (pos + nb) / n_prompt, (pos + nb) / (now - t0));
            last_report = now;
            progress = 1;
        }
    }
    t_prefill = tl_time_s() - t0;
    if (progress)
        fprintf(stderr, "\r%70s\r", "");
    if (o->compare && pq && tlpq_copy_kv(&lib, &ref, n_prompt) != 0) {
        fprintf(stderr, "error: %s\n", lib.err);
        goto done_sampler;
    }
    if (o->compare && !pq)
        copy_prefix(c, &ref, &s, n_prompt);

    if (dump && fwrite(logits, sizeof(float), (size_t)c->vocab_size, dump) != (size_t)c->vocab_size) {
        fprintf(stderr, "error: cannot write %s\n", o->logits_out);
        goto done_sampler;
    }
    token = tl_sample(&sampler, logits);
    print_token(o, tok, prompt[n_prompt - 1], token);

    /* decode: each step feeds the last token and samples the next */
    for (step = 1; step < o->steps; step++) {
        pos = n_prompt + step - 1;
        if (tok && (token == TL_BOS || token == TL_EOS))
            break;
        t0 = tl_time_s();
        logits = pq ? tlpq_decode(&lib, token, pos) : tl_forward(m, &s, &o->policy, token, pos);
        t_decode += tl_time_s() - t0;
        if (!logits) {
            fprintf(stderr, "\nerror: %s\n", pq ? lib.err : s.err);
            goto done_sampler;
        }
        if (dump && fwrite(logits, sizeof(float), (size_t)c->vocab_size, dump) != (size_t)c->vocab_size) {
            fprintf(stderr, "\nerror: cannot write %s\n", o->logits_out);
            goto done_sampler;
        }
        if (o->compare) {
            t0 = tl_time_s();
            ref_logits = tl_forward(m, &ref, NULL, token, pos);
            t_ref += tl_time_s() - t0;
            if (!ref_logits) {
                fprintf(stderr, "\nerror: %s\n", ref.err);
                goto done_sampler;
            }
            agree += tl_argmax(ref_logits, c->vocab_size) == tl_argmax(logits, c->vocab_size);
            kl_sum += kl_divergence(ref_logits, logits, c->vocab_size);
        }
        next = tl_sample(&sampler, logits);   /* both continue with the mode's token */
        print_token(o, tok, token, next);
        token = next;
        decoded++;
    }
    if (!o->quiet)
        printf("\n");

    /* report */
    fprintf(stderr, "prefill: %d tokens in %.3f s, %.1f tok/s (full attention%s)\n",
            n_prompt, t_prefill, t_prefill > 0 ? n_prompt / t_prefill : 0.0,
            pq ? ", layer-major through pqc_driver_prefill" : "");
    tl_budget(&o->policy, n_prompt + decoded, &sink, &window, &topk);
    if (pq) {   /* the library's split: window fixed at the prefill (each layer's at most
                   the cache's: a build may lower it), top-k the rest; layer 0's shown */
        int n_ctx = n_prompt + decoded, mid, l;
        double budget;
        sink = o->policy.n_sink < n_ctx ? o->policy.n_sink : n_ctx;
        mid = n_ctx - sink;
        budget = ceil((double)o->policy.ratio * mid);
        window = pqc_cache_layer_window(lib.cache, 0);
        for (l = 0, wmin = wmax = window; l < lib.n_lib; l++) {
            int w = pqc_cache_layer_window(lib.cache, l);
            wmin = w < wmin ? w : wmin;
            wmax = w > wmax ? w : wmax;
        }
        topk = budget > window ? (int)budget - window : 0;
        if (window > mid)
            window = mid;
        snprintf(wtext, sizeof wtext, "; the layers' windows %d-%d", wmin, wmax);
    }
    fprintf(stderr, "decode:  %d steps in %.3f s, %.1f tok/s (%s", decoded, t_decode,
            t_decode > 0 ? decoded / t_decode : 0.0, tl_mode_name(o->policy.mode));
    if (o->policy.mode == TL_ATTN_FULL)
        fprintf(stderr, ", context %d)\n", n_prompt + decoded);
    else
        fprintf(stderr, ": %d sinks + %d window + %d top-k of %d at the last step%s)\n",
                sink, window, topk, n_prompt + decoded, wmin < wmax ? wtext : "");
    if (pq) {
        char desc[200];
        tlpq_describe(&lib, desc, sizeof desc);
        fprintf(stderr, "pqcache: %s\n", desc);
        report_pqcache(&lib, c, n_prompt, decoded);
    }
    if (o->compare && decoded > 0)
        fprintf(stderr, "compare: next-token agreement %.2f%% (%d/%d), mean KL(full || %s) "
                "%.6f nats; reference %.1f tok/s\n", 100.0 * agree / decoded, agree,
                decoded, tl_mode_name(o->policy.mode), kl_sum / decoded,
                t_ref > 0 ? decoded / t_ref : 0.0);
    rc = 0;
done_sampler:
    tl_free_sampler(&sampler);
    if (dump && fclose(dump) != 0 && rc == 0) {
        fprintf(stderr, "error: cannot write %s\n", o->logits_out);
        rc = 1;
    }
done:
    if (o->compare)
        tl_free_state(&ref);
    if (pq)
        tlpq_destroy(&lib);
    else
        tl_free_state(&s);
    return rc;
}

/* ----------------------------------------------------------------------------
   Main */

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
    {   /* pqcache runs through the library's driver, not a selection callback */
        tl_policy check = o.policy;
        if (check.mode == TL_ATTN_PQCACHE)
            check.mode = TL_ATTN_FULL;
        if (tl_check_policy(&check, err, sizeof err)) {
            fprintf(stderr, "error: %s\n", err);
            return 1;
        }
        if (o.policy.mode == TL_ATTN_PQCACHE && !(o.policy.ratio > 0.0f)) {
            fprintf(stderr, "error: pqcache needs a budget ratio above 0 (-b)\n");
            return 1;
        }
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
        rc = generate(&o, &model, o.tokenizer ? &tok : NULL, prompt, n_prompt);
    }
    free(prompt);
    if (o.tokenizer)
        tl_free_tokenizer(&tok);
    tl_free_model(&model);
    return rc;
}
