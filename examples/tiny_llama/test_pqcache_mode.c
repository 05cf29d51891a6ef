/* test_pqcache_mode.c - tests of tiny_llama's pqcache mode (tl_pqcache.h:
   the engine driven by pqcache's pqc_driver_prefill / pqc_driver_decode) and
   of the attention modes on the constructed passkey model (make_passkey.c).

   greatest's summary line ends the output: "N passed, N failed"; the exit
   status is non-zero if any test failed. `--quick` runs only the suite
   pqcache_mode, `--cuda` only the suite cuda_tier; greatest's flags follow. */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"
#define TL_PQCACHE_IMPLEMENTATION
#include "tl_pqcache.h"

/* the passkey model's construction and prompt generator */
#define main make_passkey_main
#include "tools/make_passkey.c"
#undef main

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../tests/greatest.h"
#include "test_support.h"

/* ----------------------------------------------------------------------------
   A tiny random model: pqcache with every token selected is full attention */

#define R_PROMPT 300
#define R_STEPS 40

static int random_model(tl_model *m)
{
    tl_config c;
    char err[TL_ERR_LEN];
    memset(&c, 0, sizeof c);
    c.dim = 64; c.hidden_dim = 96; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2;
    c.vocab_size = 50; c.seq_len = 1024; c.shared_classifier = 1; c.rope_theta = 10000.0f;
    if (tl_write_random_checkpoint(tmp_path("random.bin"), &c, 0, 17, err, sizeof err) ||
        tl_build_model(m, tmp_path("random.bin"), err, sizeof err)) {
        printf("  %s\n", err);
        return -1;
    }
    return 0;
}

static int token_at(int pos, int vocab) { return (pos * 13 + 5) % vocab; }

/* full attention, token by token (the engine's ordinary path): the logits of
   the last prompt token, then of every teacher-forced decode step */
static int run_full(const tl_model *m, float *out)
{
    tl_state s;
    char err[TL_ERR_LEN];
    int pos, V = m->config.vocab_size;
    if (tl_build_state(&s, &m->config, R_PROMPT + R_STEPS, 1, err, sizeof err))
        return -1;
    for (pos = 0; pos < R_PROMPT + R_STEPS; pos++) {
        float *logits = tl_forward(m, &s, NULL, token_at(pos, V), pos);
        if (!logits) {
            tl_free_state(&s);
            return -1;
        }
        if (pos >= R_PROMPT - 1)
            memcpy(out + (size_t)(pos - R_PROMPT + 1) * (size_t)V, logits, (size_t)V * sizeof(float));
    }
    tl_free_state(&s);
    return 0;
}

/* the same through the pqcache driver */
static int run_pqcache(const tl_model *m, const tlpq_config *cfg, float *out, tlpq_stats *st)
{
    tlpq lib;
    char err[TL_ERR_LEN];
    int tokens[R_PROMPT], pos, V = m->config.vocab_size;
    float *logits;
    for (pos = 0; pos < R_PROMPT; pos++)
        tokens[pos] = token_at(pos, V);
    if (tlpq_create(&lib, m, R_PROMPT + R_STEPS, cfg, err, sizeof err)) {
        printf("  %s\n", err);
        return -1;
    }
    logits = tlpq_prefill(&lib, tokens, R_PROMPT);
    if (!logits)
        goto fail;
    memcpy(out, logits, (size_t)V * sizeof(float));
    for (pos = R_PROMPT; pos < R_PROMPT + R_STEPS; pos++) {
        logits = tlpq_decode(&lib, token_at(pos, V), pos);
        if (!logits)
            goto fail;
        memcpy(out + (size_t)(pos - R_PROMPT + 1) * (size_t)V, logits, (size_t)V * sizeof(float));
    }
    if (st)
        tlpq_get_stats(&lib, st);
    tlpq_destroy(&lib);
    return 0;
fail:
    printf("  %s\n", lib.err);
    tlpq_destroy(&lib);
    return -1;
}

TEST pqcache_at_budget_1_gives_the_full_attention_logits_exactly(void)
{
    tl_model m;
    tlpq_config cfg;
    tlpq_stats st;
    size_t n = (size_t)(R_STEPS + 1) * 50;
    float *ref = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    int sinks[3] = { -1, 4, 32 }, i, threads;
    unsigned long long want_selected = 0;
    int pos;
    if (!ref || !got || random_model(&m)) {
        free(ref);
        free(got);
        FAILm("no memory or no random model");
    }
    ASSERT(run_full(&m, ref) == 0);
    /* every decode step selects every position: sinks + all coded + window */
    for (pos = R_PROMPT; pos < R_PROMPT + R_STEPS; pos++)
        want_selected += (unsigned long long)(pos + 1) * (unsigned long long)m.config.n_kv_heads *
                         (unsigned long long)m.config.n_layers;
    for (i = 0; i < 3; i++)
        for (threads = 1; threads <= 3; threads += 2) {
            tlpq_default_config(&cfg);
            cfg.ratio = 1.0f;
            cfg.n_sink = sinks[i];
            cfg.n_threads = threads;
            cfg.iters = 5;
            cfg.exact_prefill = 1;   /* the prompt with the decode step's arithmetic */
            memset(got, 0, n * sizeof(float));
            ASSERT(run_pqcache(&m, &cfg, got, &st) == 0);
            ASSERT(memcmp(ref, got, n * sizeof(float)) == 0);
            ASSERT(st.builds == (unsigned long long)m.config.n_layers);   /* PQ was built */
            ASSERT(st.selects == (unsigned long long)(R_STEPS * m.config.n_layers));
            ASSERT(st.tokens_selected == want_selected);
        }
    /* the adaptive scheduler and LRU change nothing at full budget */
    tlpq_default_config(&cfg);
    cfg.ratio = 1.0f;
    cfg.policy = PQC_POLICY_LRU;
    cfg.cache_blocks = 2;
    cfg.block_tokens = 16;
    cfg.exact_prefill = 1;
    ASSERT(run_pqcache(&m, &cfg, got, &st) == 0);
    ASSERT(memcmp(ref, got, n * sizeof(float)) == 0);
    ASSERT(st.hits > 0 && st.misses > 0);
    /* the default, tiled prefill: the prompt's logits and then the decode steps' equal
       to rounding */
    for (threads = 1; threads <= 3; threads += 2) {
        double worst = 0, top = 0;
        size_t e;
        tlpq_default_config(&cfg);
        cfg.ratio = 1.0f;
        cfg.n_threads = threads;
        ASSERT(run_pqcache(&m, &cfg, got, &st) == 0);
        for (e = 0; e < n; e++) {
            worst = fabs((double)got[e] - (double)ref[e]) > worst ? fabs((double)got[e] - (double)ref[e]) : worst;
            top = fabs((double)ref[e]) > top ? fabs((double)ref[e]) : top;
        }
        if (worst > 1e-5 * top)
            printf("  tiled prefill, %d thread(s): logits up to %g differ by up to %g\n", threads, top, worst);
        ASSERT(worst > 0 && worst <= 1e-5 * top);   /* fp32 sums in another order */
    }
    /* a real budget attends fewer tokens and changes the decode logits (the
       prompt's logits come from full attention and stay the same) */
    tlpq_default_config(&cfg);
    cfg.ratio = 0.1f;
    cfg.n_sink = 4;
    cfg.exact_prefill = 1;
    ASSERT(run_pqcache(&m, &cfg, got, &st) == 0);
    ASSERT(memcmp(ref, got, 50 * sizeof(float)) == 0);
    ASSERT(memcmp(ref + 50, got + 50, (n - 50) * sizeof(float)) != 0);
    ASSERT(st.tokens_selected < want_selected / 2);
    ASSERT(st.device_bytes > 0 && st.full_bytes > 0);
    tl_free_model(&m);
    free(ref);
    free(got);
    PASS();
}

/* A hybrid model: the random model's config made Gemma-like (local layers with a
   sliding window and their own RoPE base, a softmax scale, an embedding scale, GeGLU):
   layers local, global, local, so a local layer runs before the library's first layer
   and after its last. */
static int hybrid_model(tl_model *m)
{
    tl_config c;
    char err[TL_ERR_LEN];
    memset(&c, 0, sizeof c);
    c.dim = 64; c.hidden_dim = 96; c.n_layers = 3; c.n_heads = 4; c.n_kv_heads = 2;
    c.vocab_size = 50; c.seq_len = 1024; c.shared_classifier = 1; c.rope_theta = 10000.0f;
    if (tl_write_random_checkpoint(tmp_path("hybrid.bin"), &c, 0, 23, err, sizeof err) ||
        tl_build_model(m, tmp_path("hybrid.bin"), err, sizeof err)) {
        printf("  %s\n", err);
        return -1;
    }
    m->config.sliding_window = 24;
    m->config.rope_theta_local = 500.0f;
    m->config.attn_scale = 0.3f;
    m->config.embed_scale = 1.5f;
    m->config.ffn_act = TL_ACT_GELU_TANH;
    tl_set_layer_local(&m->config, 0, 1);
    tl_set_layer_local(&m->config, 2, 1);
    if (tl_check_config(&m->config, err, sizeof err)) {
        printf("  %s\n", err);
        tl_free_model(m);
        return -1;
    }
    return 0;
}

/* Full attention token by token over tokens 0..n-1 (token_at), the logits of every
   position into out (n rows). */
static int full_logits(const tl_model *m, int n, float *out)
{
    tl_state s;
    char err[TL_ERR_LEN];
    int pos, V = m->config.vocab_size;
    if (tl_build_state(&s, &m->config, n, 1, err, sizeof err))
        return -1;
    for (pos = 0; pos < n; pos++) {
        float *logits = tl_forward(m, &s, NULL, token_at(pos, V), pos);
        if (!logits) {
            tl_free_state(&s);
            return -1;
        }
        memcpy(out + (size_t)pos * (size_t)V, logits, (size_t)V * sizeof(float));
    }
    tl_free_state(&s);
    return 0;
}

TEST hybrid_model_through_pqcache_is_full_attention_to_the_bit(void)
{
    enum { N = R_PROMPT + R_STEPS, FIRST = 150, SECOND = 150, STEPS1 = 10 };
    tl_model m;
    tlpq lib, fork;
    tlpq_config cfg;
    tlpq_stats st;
    char err[TL_ERR_LEN];
    int tokens[N], pos, V, threads, local, ok = 1;
    float *ref, *logits;
    ASSERT(hybrid_model(&m) == 0);
    V = m.config.vocab_size;
    ASSERT_EQ(24, tl_layer_window(&m.config, 0));
    ASSERT_EQ(0, tl_layer_window(&m.config, 1));
    ref = (float *)malloc((size_t)N * (size_t)V * sizeof(float));
    ASSERT(ref && full_logits(&m, N, ref) == 0);
    for (pos = 0; pos < N; pos++)
        tokens[pos] = token_at(pos, V);
    for (threads = 1; threads <= 3 && ok; threads += 2) {
        /* a prompt in two turns with decode steps between, then decode steps; at budget 1
           every logit is full attention's, to the bit */
        tlpq_default_config(&cfg);
        cfg.ratio = 1.0f;
        cfg.n_threads = threads;
        cfg.iters = 5;
        cfg.exact_prefill = 1;
        ASSERT(tlpq_create(&lib, &m, N, &cfg, err, sizeof err) == 0);
        ASSERT_EQ(1, lib.n_lib);
        ASSERT_EQ(1, lib.gl[0]);
        logits = tlpq_prefill(&lib, tokens, FIRST);
        ok = logits && memcmp(logits, ref + (size_t)(FIRST - 1) * (size_t)V, (size_t)V * sizeof(float)) == 0;
        for (pos = FIRST; ok && pos < FIRST + STEPS1; pos++) {
            logits = tlpq_decode(&lib, tokens[pos], pos);
            ok = logits && memcmp(logits, ref + (size_t)pos * (size_t)V, (size_t)V * sizeof(float)) == 0;
        }
        logits = ok ? tlpq_prefill(&lib, tokens + pos, SECOND) : NULL;   /* the windows carry over */
        ok = logits && memcmp(logits, ref + (size_t)(pos + SECOND - 1) * (size_t)V, (size_t)V * sizeof(float)) == 0;
        pos += SECOND;
        /* a fork decodes as its source does */
        ASSERT(!ok || tlpq_fork(&fork, &lib, err, sizeof err) == 0);
        for (; ok && pos < N; pos++) {
            float *f = tlpq_decode(&fork, tokens[pos], pos);
            logits = tlpq_decode(&lib, tokens[pos], pos);
            ok = logits && f && memcmp(logits, ref + (size_t)pos * (size_t)V, (size_t)V * sizeof(float)) == 0 &&
                 memcmp(f, logits, (size_t)V * sizeof(float)) == 0;
        }
        if (!ok)
            printf("  threads %d, position %d: %s\n", threads, pos, lib.err);
        tlpq_get_stats(&lib, &st);
        ASSERT(!ok || st.selects == (unsigned long long)(STEPS1 + N - FIRST - STEPS1 - SECOND));
        if (ok)
            tlpq_destroy(&fork);
        tlpq_destroy(&lib);
    }
    ASSERT(ok);
    /* a real budget changes the decode logits, and only through the global layer */
    tlpq_default_config(&cfg);
    cfg.ratio = 0.1f;
    cfg.n_sink = 4;
    cfg.exact_prefill = 1;
    ASSERT(tlpq_create(&lib, &m, N, &cfg, err, sizeof err) == 0);
    logits = tlpq_prefill(&lib, tokens, R_PROMPT);
    ASSERT(logits && memcmp(logits, ref + (size_t)(R_PROMPT - 1) * (size_t)V, (size_t)V * sizeof(float)) == 0);
    ok = 0;
    for (pos = R_PROMPT; pos < N && logits; pos++) {
        logits = tlpq_decode(&lib, tokens[pos], pos);
        ok |= logits && memcmp(logits, ref + (size_t)pos * (size_t)V, (size_t)V * sizeof(float)) != 0;
    }
    ASSERT(logits && ok);
    tlpq_destroy(&lib);
    /* the tiled prefill (the default): the full mode's chunked prefill and the pqcache
       mode's layer-major one give the same bits, windows included (a key tile starts at a
       multiple of 128 positions whatever rows are passed, and the sums run in position
       order) */
    {
        tl_state full;
        float *chunk;
        tlpq_default_config(&cfg);
        cfg.ratio = 1.0f;
        cfg.n_threads = 2;
        ASSERT(tl_build_state(&full, &m.config, N, 2, err, sizeof err) == 0);
        chunk = tl_forward_chunk(&m, &full, tokens, R_PROMPT, 0);
        ASSERT(chunk != NULL);
        ASSERT(tlpq_create(&lib, &m, N, &cfg, err, sizeof err) == 0);
        logits = tlpq_prefill(&lib, tokens, R_PROMPT);
        ok = logits && memcmp(logits, chunk, (size_t)V * sizeof(float)) == 0;
        tlpq_destroy(&lib);
        tl_free_state(&full);
        ASSERT(ok);
    }
    /* a model of local layers only leaves the library nothing to serve */
    for (local = 0; local < 3; local++)
        tl_set_layer_local(&m.config, local, 1);
    ASSERT(tlpq_create(&lib, &m, N, &cfg, err, sizeof err) != 0);
    ASSERT(strstr(err, "no full-attention layer") != NULL);
    tl_free_model(&m);
    free(ref);
    PASS();
}

TEST layer_major_prefill_stores_the_token_by_token_keys_and_values(void)
{
    tl_model m;
    tl_state full, copy, bare;
    tlpq lib;
    tlpq_config cfg;
    char err[TL_ERR_LEN];
    int tokens[R_PROMPT], pos, V, ok = 1;
    float *a, *b;
    if (random_model(&m))
        FAILm("no random model");
    V = m.config.vocab_size;
    for (pos = 0; pos < R_PROMPT; pos++)
        tokens[pos] = token_at(pos, V);
    ASSERT(tl_build_state(&full, &m.config, R_PROMPT, 1, err, sizeof err) == 0);
    ASSERT(tl_build_state(&copy, &m.config, R_PROMPT, 1, err, sizeof err) == 0);
    for (pos = 0; pos < R_PROMPT; pos++)
        ok &= tl_forward_layers(&m, &full, NULL, tokens[pos], pos) == 0;
    ASSERT(ok);
    tlpq_default_config(&cfg);
    cfg.n_threads = 2;
    cfg.all_outputs = 1;
    cfg.exact_prefill = 1;
    ASSERT(tlpq_create(&lib, &m, R_PROMPT, &cfg, err, sizeof err) == 0);
    ASSERT(tlpq_prefill(&lib, tokens, R_PROMPT) != NULL);
    /* the keys and values the library stored are the token-by-token ones */
    ASSERT(tlpq_copy_kv(&lib, &copy, R_PROMPT) == 0);
    a = full.key_cache;
    b = copy.key_cache;
    ASSERT(memcmp(a, b, (size_t)m.config.n_layers * R_PROMPT * (size_t)m.config.kv_dim * sizeof(float)) == 0);
    ASSERT(memcmp(full.value_cache, copy.value_cache,
                 (size_t)m.config.n_layers * R_PROMPT * (size_t)m.config.kv_dim * sizeof(float)) == 0);
    /* the library refuses more than its capacity; bad tokens are refused */
    ASSERT(tlpq_decode(&lib, 1, R_PROMPT) == NULL && lib.err[0]);
    tlpq_destroy(&lib);
    ASSERT(tlpq_create(&lib, &m, R_PROMPT, &cfg, err, sizeof err) == 0);
    tokens[7] = V;
    ASSERT(tlpq_prefill(&lib, tokens, R_PROMPT) == NULL && strstr(lib.err, "vocabulary"));
    tlpq_destroy(&lib);
    cfg.ratio = -1.0f;
    ASSERT(tlpq_create(&lib, &m, R_PROMPT, &cfg, err, sizeof err) != 0);
    /* a state without a KV cache cannot run the ordinary forward */
    ASSERT(tl_build_state_ex(&bare, &m.config, 16, 1, TL_STATE_NO_KV_CACHE, err, sizeof err) == 0);
    ASSERT(bare.key_cache == NULL && tl_forward(&m, &bare, NULL, 1, 0) == NULL);
    tl_free_state(&bare);
    tl_free_state(&full);
    tl_free_state(&copy);
    tl_free_model(&m);
    PASS();
}

/* ----------------------------------------------------------------------------
   The README's excerpt of tl_pqcache.h is its code: every chunk of a ```c block (its
   lines between blank lines) is a run of consecutive lines of the header, indentation
   and trailing spaces aside. Both files are found next to this one (__FILE__, as the
   build names it from the repository root). */

/* The lines of text (modified in place), each without its leading and trailing blanks. */
static int split_lines(char *text, char **lines, int cap)
{
    int n = 0;
    char *s = text;
    while (*s && n < cap) {
        char *e = strchr(s, '\n'), *t;
        if (e)
            *e = '\0';
        while (*s == ' ' || *s == '\t')
            s++;
        for (t = s + strlen(s); t > s && (t[-1] == ' ' || t[-1] == '\t' || t[-1] == '\r'); t--)
            t[-1] = '\0';
        lines[n++] = s;
        if (!e)
            break;
        s = e + 1;
    }
    return n;
}

static char *read_beside(const char *name)
{
    char path[1024];
    const char *slash = strrchr(__FILE__, '/');
    size_t len = 0;
    char *text;
    snprintf(path, sizeof path, "%.*s%s", slash ? (int)(slash - __FILE__ + 1) : 0, __FILE__, name);
    text = (char *)read_file(path, &len);
    if (text)
        text[len] = '\0';
    else
        printf("  cannot read %s\n", path);
    return text;
}

/* Whether lines[0..n-1] are consecutive lines of src[0..n_src-1]. */
static int found_in(char **src, int n_src, char **lines, int n)
{
    int i, j;
    for (i = 0; i + n <= n_src; i++) {
        for (j = 0; j < n && strcmp(src[i + j], lines[j]) == 0; j++)
            ;
        if (j == n)
            return 1;
    }
    return 0;
}

#define EXCERPT_LINES 4096

TEST readme_excerpt_is_the_code_of_tl_pqcache_h(void)
{
    char *readme = read_beside("README.md"), *header = read_beside("tl_pqcache.h");
    char **rl = (char **)malloc(EXCERPT_LINES * sizeof(char *));
    char **hl = (char **)malloc(EXCERPT_LINES * sizeof(char *));
    int n_r, n_h, i, in_block = 0, start = -1, chunks = 0, bad = 0;
    ASSERT(readme && header && rl && hl);
    n_r = split_lines(readme, rl, EXCERPT_LINES);
    n_h = split_lines(header, hl, EXCERPT_LINES);
    ASSERT(n_r < EXCERPT_LINES && n_h < EXCERPT_LINES);
    for (i = 0; i < n_r; i++) {
        int fence = strncmp(rl[i], "```", 3) == 0;
        if (!in_block) {
            in_block = strcmp(rl[i], "```c") == 0;
            continue;
        }
        if (fence || rl[i][0] == '\0') {   /* a chunk ends */
            if (start >= 0 && !found_in(hl, n_h, rl + start, i - start)) {
                printf("  README.md line %d: this chunk is not in tl_pqcache.h:\n    %s\n", start + 1, rl[start]);
                bad++;
            }
            chunks += start >= 0;
            start = -1;
            in_block = !fence;
        } else if (start < 0) {
            start = i;
        }
    }
    ASSERT_EQ(0, bad);
    ASSERT(chunks >= 6);   /* the cache, the callbacks, a decode step, qkv and attend */
    free(readme);
    free(header);
    free(rl);
    free(hl);
    PASS();
}

/* ----------------------------------------------------------------------------
   The passkey model */

#define PK_TEST_LEN 2048

static tl_model g_pk, g_pkh;  /* the passkey model and its harder variant */
static int g_pk_ok, g_pkh_ok;

static int passkey_model(void)
{
    Model pm;
    char err[TL_ERR_LEN];
    if (g_pk_ok)
        return 0;
    model_build(&pm, 4096);
    if (model_write(&pm, tmp_path("passkey.bin"))) {
        model_free(&pm);
        return -1;
    }
    model_free(&pm);
    if (tl_build_model(&g_pk, tmp_path("passkey.bin"), err, sizeof err)) {
        printf("  %s\n", err);
        return -1;
    }
    g_pk_ok = 1;
    return 0;
}

/* The harder variant (make_passkey --hard), 8192 positions */
static int passkey_hard_model(void)
{
    Model pm;
    char err[TL_ERR_LEN];
    int rc = 0;
    if (g_pkh_ok)
        return 0;
    pk_vocab = PK_HARD_VOCAB;
    model_build(&pm, 8192);
    pk_vocab = PK_VOCAB;
    if (model_write(&pm, tmp_path("passkey_hard.bin")))
        rc = -1;
    model_free(&pm);
    if (rc == 0 && tl_build_model(&g_pkh, tmp_path("passkey_hard.bin"), err, sizeof err)) {
        printf("  %s\n", err);
        rc = -1;
    }
    g_pkh_ok = rc == 0;
    return rc;
}

/* Prefills a haystack (needle at depth%) and decodes the passkey greedily in
   one mode: 1 if all tokens match, 0 if not, -1 on error. The prompt is
   prefilled token by token with full attention, except for pqcache whose
   prefill goes through the driver (layer-major, also full attention). m: the
   model (its vocabulary picks the variant's fillers); cfg: pqcache's
   configuration (NULL: the defaults at this ratio). */
static int retrieve_on(const tl_model *m, tl_attn_mode mode, int len, double depth, float ratio,
                       int *first, const tlpq_config *base)
{
    int n = PK_PASSKEY_LEN, query, answer[N_VALUE], i, pos, tok, ok = 1;
    int *toks = (int *)malloc((size_t)len * sizeof(int));
    char err[TL_ERR_LEN];
    tl_state s;
    tlpq lib;
    tl_policy pol;
    float *logits = NULL;
    memset(&s, 0, sizeof s);
    memset(&lib, 0, sizeof lib);
    if (!toks || pk_use_vocab(m->config.vocab_size)) {
        free(toks);
        return -1;
    }
    make_prompt(len, depth, 7, n, toks, &query, answer);
    pk_vocab = PK_VOCAB;
    tl_default_policy(&pol, mode);
    pol.n_sink = 32; /* the window and oracle baselines: the 32 sinks these grids were written for */
    pol.ratio = ratio;
    if (mode == TL_ATTN_PQCACHE) {
        tlpq_config cfg;
        if (base)
            cfg = *base;
        else
            tlpq_default_config(&cfg);
        cfg.ratio = ratio;
        if (tlpq_create(&lib, m, len + n, &cfg, err, sizeof err) ||
            !tlpq_prefill(&lib, toks, len)) {
            printf("  %s %s\n", err, lib.err);
            ok = -1;
        }
    } else {
        if (tl_build_state(&s, &m->config, len + n, 1, err, sizeof err))
            ok = -1;
        for (pos = 0; ok >= 0 && pos < len; pos++)
            if (tl_forward_layers(m, &s, NULL, toks[pos], pos))
                ok = -1;
    }
    for (i = 0, tok = query; ok >= 0 && i < n; i++) {
        logits = mode == TL_ATTN_PQCACHE ? tlpq_decode(&lib, tok, len + i)
                                         : tl_forward(m, &s, &pol, tok, len + i);
        if (!logits) {
            ok = -1;
            break;
        }
        tok = tl_argmax(logits, m->config.vocab_size);
        if (i == 0 && first)
            *first = tok;
        if (tok != answer[i])
            ok = 0;
    }
    if (mode == TL_ATTN_PQCACHE)
        tlpq_destroy(&lib);
    else
        tl_free_state(&s);
    free(toks);
    return ok;
}

static int retrieve(tl_attn_mode mode, int len, double depth, float ratio, int *first)
{
    return retrieve_on(&g_pk, mode, len, depth, ratio, first, NULL);
}

static const double g_depths[5] = { 0, 25, 50, 75, 100 };

TEST passkey_full_attention_retrieves_it_at_every_depth_2k(void)
{
    int d;
    if (passkey_model())
        FAILm("no passkey model");
    for (d = 0; d < 5; d++) {
        int r = retrieve(TL_ATTN_FULL, PK_TEST_LEN, g_depths[d], 0.1f, NULL);
        if (r != 1)
            printf("  full attention, depth %g%%: %d\n", g_depths[d], r);
        ASSERT(r == 1);
    }
    PASS();
}

TEST passkey_window_misses_it_outside_sinks_and_window_2k(void)
{
    int d, first = -1;
    if (passkey_model())
        FAILm("no passkey model");
    /* 32 sinks + the last 0.1 * (2048 - 32) = 202 tokens: the needle is seen at
       0% (it sits in the sinks) and 100% (in the window), nowhere between */
    for (d = 0; d < 5; d++) {
        int inside = g_depths[d] == 0.0 || g_depths[d] == 100.0;
        int r = retrieve(TL_ATTN_WINDOW, PK_TEST_LEN, g_depths[d], 0.1f, &first);
        if (r != inside)
            printf("  window, depth %g%%: %d\n", g_depths[d], r);
        ASSERT(r == inside);
        if (!inside)
            ASSERT(first == TOK_UNK);   /* "not found", not some other value */
    }
    /* a budget that reaches the needle at 75% finds it */
    ASSERT(retrieve(TL_ATTN_WINDOW, PK_TEST_LEN, 75.0, 0.3f, NULL) == 1);
    PASS();
}

TEST passkey_pqcache_and_oracle_retrieve_it_at_budget_0_1_2k(void)
{
    int d;
    if (passkey_model())
        FAILm("no passkey model");
    for (d = 0; d < 5; d++) {
        int rp = retrieve(TL_ATTN_PQCACHE, PK_TEST_LEN, g_depths[d], 0.1f, NULL);
        int ro = retrieve(TL_ATTN_ORACLE, PK_TEST_LEN, g_depths[d], 0.1f, NULL);
        if (rp != 1 || ro != 1)
            printf("  depth %g%%: pqcache %d, oracle %d\n", g_depths[d], rp, ro);
        ASSERT(rp == 1);
        ASSERT(ro == 1);
    }
    /* with a smaller budget still: 1/50 */
    ASSERT(retrieve(TL_ATTN_PQCACHE, PK_TEST_LEN, 50.0, 0.02f, NULL) == 1);
    PASS();
}

/* The harder variant at 4K: full attention and the default pqcache (codebooks
   weighted by the observed queries, the default split) retrieve the passkey at
   every depth; plain PQ (Euclidean codebooks, fixed split, m=2 b=6: 1.5 bytes
   per token, the PQ top-k alone) loses it wherever it is outside the sinks and the
   window. (Plain PQ
   at the default's 4 bytes, m=4 b=8, keeps it at 25% and loses it at 50% and 75%.) */
TEST harder_passkey_full_and_pqcache_retrieve_it_plain_pq_loses_it_4k(void)
{
    tlpq_config plain;
    int d;
    if (passkey_hard_model())
        FAILm("no harder passkey model");
    tlpq_default_config(&plain);
    plain.metric = PQC_METRIC_L2;
    plain.split = PQC_SPLIT_FIXED;
    plain.pq_m = 2;
    plain.pq_bits = 6;
    plain.rerank = -1;
    for (d = 0; d < 5; d++) {
        int inside = g_depths[d] == 0.0 || g_depths[d] == 100.0;
        int rf = retrieve_on(&g_pkh, TL_ATTN_FULL, 4096, g_depths[d], 0.1f, NULL, NULL);
        int rp = retrieve_on(&g_pkh, TL_ATTN_PQCACHE, 4096, g_depths[d], 0.1f, NULL, NULL);
        int rl = retrieve_on(&g_pkh, TL_ATTN_PQCACHE, 4096, g_depths[d], 0.1f, NULL, &plain);
        if (rf != 1 || rp != 1 || rl != inside)
            printf("  depth %g%%: full %d, pqcache %d, plain PQ %d\n", g_depths[d], rf, rp, rl);
        ASSERT(rf == 1);
        ASSERT(rp == 1);
        ASSERT(rl == inside);
    }
    PASS();
}

/* ----------------------------------------------------------------------------
   Main */

/* The CUDA device tier against the CPU tier over a whole teacher-forced decode at budget
   0.1: the same tokens attended, so the same logits. Needs a CUDA driver (a GPU, or the
   CPU stand-in through PQC_CUDA_DRIVER_PATH); skipped without one. */
TEST pqcache_on_the_cuda_device_tier_decodes_like_the_cpu_tier(void)
{
    tl_model m;
    tlpq_config cfg;
    tlpq_stats st;
    pqc_runtime_desc rd;
    pqc_runtime *rt = NULL;
    float *a, *b;
    int V, i, j, agree = 0;
    double maxd = 0.0;
    memset(&rd, 0, sizeof rd);
    rd.backend = PQC_BACKEND_CUDA;
    if (pqc_runtime_create(&rd, &rt) != PQC_SUCCESS) {
        printf("  skipped: %s\n", pqc_last_error());
        SKIP();
    }
    pqc_runtime_destroy(rt);
    ASSERT(random_model(&m) == 0);
    V = m.config.vocab_size;
    a = (float *)malloc((size_t)(R_STEPS + 1) * (size_t)V * sizeof(float));
    b = (float *)malloc((size_t)(R_STEPS + 1) * (size_t)V * sizeof(float));
    ASSERT(a && b);
    tlpq_default_config(&cfg);
    cfg.iters = 6;
    cfg.n_sink = 8;
    cfg.block_tokens = 16;
    cfg.cache_blocks = 4;
    ASSERT(a && b && run_pqcache(&m, &cfg, a, NULL) == 0);
    cfg.backend = PQC_BACKEND_CUDA;
    ASSERT(a && b && run_pqcache(&m, &cfg, b, &st) == 0);
    for (i = 0; i <= R_STEPS; i++) {
        int ia = 0, ib = 0;
        for (j = 0; j < V; j++) {
            double dd = fabs((double)a[i * V + j] - (double)b[i * V + j]);
            if (dd > maxd) maxd = dd;
            if (a[i * V + j] > a[i * V + ia]) ia = j;
            if (b[i * V + j] > b[i * V + ib]) ib = j;
        }
        agree += ia == ib;
    }
    printf("  %d of %d next tokens agree, max logit difference %.3g, hit rate %.1f%%\n", agree,
           R_STEPS + 1, maxd, st.hits + st.misses ? 100.0 * (double)st.hits / (double)(st.hits + st.misses) : 0.0);
    ASSERT(agree == R_STEPS + 1);
    ASSERT(maxd <= 1e-4);
    ASSERT(st.selects > 0 && st.hits > 0);
    free(a);
    free(b);
    tl_free_model(&m);
    PASS();
}

SUITE(pqcache_mode)
{
    RUN_TEST(pqcache_at_budget_1_gives_the_full_attention_logits_exactly);
    RUN_TEST(layer_major_prefill_stores_the_token_by_token_keys_and_values);
    RUN_TEST(hybrid_model_through_pqcache_is_full_attention_to_the_bit);
    RUN_TEST(readme_excerpt_is_the_code_of_tl_pqcache_h);
}

SUITE(passkey)
{
    RUN_TEST(passkey_full_attention_retrieves_it_at_every_depth_2k);
    RUN_TEST(passkey_window_misses_it_outside_sinks_and_window_2k);
    RUN_TEST(passkey_pqcache_and_oracle_retrieve_it_at_budget_0_1_2k);
    RUN_TEST(harder_passkey_full_and_pqcache_retrieve_it_plain_pq_loses_it_4k);
}

SUITE(cuda_tier)
{
    RUN_TEST(pqcache_on_the_cuda_device_tier_decodes_like_the_cpu_tier);
}

GREATEST_MAIN_DEFS();

/* `--quick` runs only the library-level tests (used under the sanitizers, where the
   passkey prefills take minutes); `--cuda` only the CUDA device tier's. Either comes
   first; greatest's own flags may follow. */
int main(int argc, char **argv)
{
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int cuda_only = argc > 1 && strcmp(argv[1], "--cuda") == 0;
    if (quick || cuda_only) {   /* greatest parses the rest */
        argv[1] = argv[0];
        argv++;
        argc--;
    }
    GREATEST_MAIN_BEGIN();
    if (make_test_dir("tiny_llama_pq") != 0) {
        printf("cannot create a temporary directory\n0 passed, 1 failed\n");
        return 1;
    }
    if (cuda_only)
        RUN_SUITE(cuda_tier);
    else
        RUN_SUITE(pqcache_mode);
    if (!quick && !cuda_only)
        RUN_SUITE(passkey);
    if (g_pk_ok)
        tl_free_model(&g_pk);
    if (g_pkh_ok)
        tl_free_model(&g_pkh);
    remove_test_dir();
    GREATEST_MAIN_END();
}
