/* test_tiny_llama.c - tests of the tiny_llama engine: the forward pass against
   a reference, the attention modes and the selection callback, sampling,
   attention over explicit rows on a state without a KV cache, and the SIMD
   kernels against the portable ones to the bit (the loaders: test_loaders.c).

   The full-attention forward is compared with a reference that reads the
   checkpoint file and computes the transformer with plain loops in double
   precision, sharing no code with the engine (test_reference.h).

   greatest's summary line ends the output: "N passed, N failed"; the exit
   status is non-zero if any test failed. */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../tests/greatest.h"
#include "test_support.h"
#include "test_reference.h"

/* ----------------------------------------------------------------------------
   Tests: forward against the reference */

TEST full_forward_matches_the_reference(void)
{
    spec s = small_spec();
    double d;
    /* version 1, shared classifier, GQA 4:2, theta 500000, head size 8 */
    write_spec(tmp_path("ref1.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref1.bin"), 20);
    printf("  v1 GQA: max |diff| %.2e\n", d);
    ASSERT(d >= 0.0 && d < 1e-4);
    /* version 1, own classifier, theta 0 (default), MQA, head size 6 */
    s.dim = 24; s.heads = 4; s.kv_heads = 1; s.shared = 0; s.theta = 0.0f; s.seed = 11;
    write_spec(tmp_path("ref2.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref2.bin"), 20);
    printf("  v1 MQA: max |diff| %.2e\n", d);
    ASSERT(d >= 0.0 && d < 1e-4);
    /* legacy, own classifier, MHA, head size 16, 3 layers */
    s = small_spec();
    s.legacy = 1; s.shared = 0; s.heads = 2; s.kv_heads = 2; s.layers = 3; s.seed = 5;
    write_spec(tmp_path("ref3.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref3.bin"), 20);
    printf("  legacy MHA: max |diff| %.2e\n", d);
    ASSERT(d >= 0.0 && d < 1e-4);
    /* legacy, shared classifier */
    s.shared = 1; s.seed = 9;
    write_spec(tmp_path("ref4.bin"), &s);
    d = max_diff_vs_reference(tmp_path("ref4.bin"), 20);
    printf("  legacy shared: max |diff| %.2e\n", d);
    ASSERT(d >= 0.0 && d < 1e-4);
    PASS();
}

/* ----------------------------------------------------------------------------
   Tests: attention modes */

/* Prefill n_prompt tokens with full attention, then decode n_steps more
   (teacher-forced, the same tokens for every mode) under policy p; the
   logits of every decode step go to out (n_steps * vocab). */
static int run_mode(const tl_model *m, const tl_policy *p, int n_threads, int n_prompt,
                    int n_steps, float *out)
{
    tl_state s;
    char err[TL_ERR_LEN];
    int pos, V = m->config.vocab_size;
    if (tl_build_state(&s, &m->config, n_prompt + n_steps, n_threads, err, sizeof err))
        return -1;
    s.thread_min_work = 0;
    for (pos = 0; pos < n_prompt + n_steps; pos++) {
        int token = (pos * 13 + 5) % V;
        float *logits = tl_forward(m, &s, pos < n_prompt ? NULL : p, token, pos);
        if (!logits) {
            printf("  forward: %s\n", s.err);
            tl_free_state(&s);
            return -1;
        }
        if (pos >= n_prompt)
            memcpy(out + (size_t)(pos - n_prompt) * (size_t)V, logits, (size_t)V * sizeof(float));
    }
    tl_free_state(&s);
    return 0;
}

TEST window_and_oracle_with_full_budget_equal_full(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_policy full, p;
    char err[TL_ERR_LEN];
    int np = 6, ns = 40, sinks;
    size_t n = (size_t)ns * 50;
    float *ref = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    ASSERT(tl_write_random_checkpoint(tmp_path("modes.bin"), &c, 0, 21, err, sizeof err) == 0);
    ASSERT(tl_build_model(&m, tmp_path("modes.bin"), err, sizeof err) == 0);
    tl_default_policy(&full, TL_ATTN_FULL);
    ASSERT(run_mode(&m, &full, 1, np, ns, ref) == 0);
    for (sinks = 0; sinks <= 32; sinks += 4) {
        tl_default_policy(&p, TL_ATTN_WINDOW);
        p.ratio = 1.0f;
        p.n_sink = sinks;
        ASSERT(run_mode(&m, &p, 1, np, ns, got) == 0);
        ASSERT(memcmp(ref, got, n * sizeof(float)) == 0);
        tl_default_policy(&p, TL_ATTN_ORACLE);
        p.ratio = 1.0f;
        p.n_sink = sinks;
        ASSERT(run_mode(&m, &p, 1, np, ns, got) == 0);
        ASSERT(memcmp(ref, got, n * sizeof(float)) == 0);
    }
    /* a real restriction changes the result (so the checks above can fail) */
    tl_default_policy(&p, TL_ATTN_WINDOW);
    p.ratio = 0.1f;
    p.n_sink = 2;
    ASSERT(run_mode(&m, &p, 1, np, ns, got) == 0);
    ASSERT(memcmp(ref, got, n * sizeof(float)) != 0);
    tl_default_policy(&p, TL_ATTN_ORACLE);
    p.ratio = 0.2f;
    p.n_sink = 2;
    ASSERT(run_mode(&m, &p, 1, np, ns, got) == 0);
    ASSERT(memcmp(ref, got, n * sizeof(float)) != 0);
    /* two threads give the same numbers */
    ASSERT(run_mode(&m, &full, 2, np, ns, got) == 0);
    ASSERT(memcmp(ref, got, n * sizeof(float)) == 0);
    tl_free_model(&m);
    free(ref);
    free(got);
    PASS();
}

TEST budget_splits_into_sinks_window_and_top_k(void)
{
    tl_policy p;
    int s, w, k;
    tl_default_policy(&p, TL_ATTN_ORACLE);
    ASSERT_EQ(4, p.n_sink); /* pqcache's default */
    p.n_sink = 32;
    tl_budget(&p, 32768, &s, &w, &k);
    ASSERT(s == 32 && w == 1637 && k == 1637);   /* 0.1 * 32736 = 3273.6 -> 3274 */
    p.mode = TL_ATTN_WINDOW;
    tl_budget(&p, 32768, &s, &w, &k);
    ASSERT(s == 32 && w == 3274 && k == 0);
    tl_budget(&p, 20, &s, &w, &k);
    ASSERT(s == 20 && w == 0 && k == 0);
    p.ratio = 0.0f;
    tl_budget(&p, 100, &s, &w, &k);
    ASSERT(s == 32 && w == 1 && k == 0);
    p.mode = TL_ATTN_ORACLE;
    p.ratio = 1.0f;
    tl_budget(&p, 101, &s, &w, &k);
    ASSERT(s == 32 && w == 35 && k == 34);
    PASS();
}

/* the exact attention mass of every position for KV head g, in double */
static void naive_mass(const tl_model *m, const tl_state *s, int layer, int g, int n, double *mass)
{
    const tl_config *c = &m->config;
    int group = c->n_heads / c->n_kv_heads, j, i, d;
    for (i = 0; i < n; i++)
        mass[i] = 0.0;
    for (j = 0; j < group; j++) {
        int h = g * group + j;
        double max = -1e300, sum = 0.0, *sc = (double *)malloc((size_t)n * sizeof(double));
        for (i = 0; i < n; i++) {
            const float *k = tl_key_row(c, s, layer, i) + g * c->head_size;
            double dot = 0.0;
            for (d = 0; d < c->head_size; d++)
                dot += (double)s->q[h * c->head_size + d] * k[d];
            sc[i] = dot / sqrt((double)c->head_size);
            if (sc[i] > max)
                max = sc[i];
        }
        for (i = 0; i < n; i++)
            sum += exp(sc[i] - max);
        for (i = 0; i < n; i++)
            mass[i] += exp(sc[i] - max) / sum;
        free(sc);
    }
}

TEST window_and_oracle_select_sinks_window_and_the_exact_top_k(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_state s;
    tl_policy p;
    char err[TL_ERR_LEN];
    int pos, g, i, layer = 1, n = 40;
    double mass[64];
    ASSERT(tl_write_random_checkpoint(tmp_path("sel.bin"), &c, 0, 5, err, sizeof err) == 0);
    ASSERT(tl_build_model(&m, tmp_path("sel.bin"), err, sizeof err) == 0);
    ASSERT(tl_build_state(&s, &m.config, 0, 1, err, sizeof err) == 0);
    for (pos = 0; pos < n - 1; pos++)
        ASSERT(tl_forward_layers(&m, &s, NULL, pos % 50, pos) == 0);
    /* the stages by hand up to layer 1's selection at position n - 1 */
    tl_embed(&m, &s, 7);
    tl_layer_qkv(&m, &s, 0, n - 1);
    ASSERT(tl_select(&m, &s, NULL, 0, n - 1) == 0);
    tl_layer_attention(&m, &s, 0, s.lists);
    tl_layer_ffn(&m, &s, 0);
    tl_layer_qkv(&m, &s, layer, n - 1);

    /* window: sinks 0..3, the last 18 (0.5 * 36) */
    tl_default_policy(&p, TL_ATTN_WINDOW);
    p.n_sink = 4;
    p.ratio = 0.5f;
    ASSERT(tl_select(&m, &s, &p, layer, n - 1) == 0);
    for (g = 0; g < c.n_kv_heads; g++) {
        ASSERT(s.lists[g].n == 22 && s.lists[g].k == NULL);
        for (i = 0; i < 4; i++)
            ASSERT(s.lists[g].pos[i] == i);
        for (i = 4; i < 22; i++)
            ASSERT(s.lists[g].pos[i] == 22 + (i - 4));
    }
    /* oracle: sinks, 9 exact top positions of 4..30, window 31..39 */
    p.mode = TL_ATTN_ORACLE;
    ASSERT(tl_select(&m, &s, &p, layer, n - 1) == 0);
    for (g = 0; g < c.n_kv_heads; g++) {
        const tl_kv_list *l = &s.lists[g];
        double min_in = 1e300, max_out = -1e300;
        int chosen[64];
        memset(chosen, 0, sizeof chosen);
        ASSERT(l->n == 4 + 9 + 9);
        for (i = 0; i < l->n; i++) {
            if (i > 0)
                ASSERT(l->pos[i] > l->pos[i - 1]);
            if (l->pos[i] >= 0 && l->pos[i] < n)
                chosen[l->pos[i]] = 1;
        }
        for (i = 0; i < 4; i++)
            ASSERT(chosen[i]);
        for (i = 31; i < 40; i++)
            ASSERT(chosen[i]);
        naive_mass(&m, &s, layer, g, n, mass);
        for (i = 4; i < 31; i++) {
            if (chosen[i] && mass[i] < min_in)
                min_in = mass[i];
            if (!chosen[i] && mass[i] > max_out)
                max_out = mass[i];
        }
        ASSERT(min_in >= max_out - 1e-6);
    }
    tl_free_state(&s);
    tl_free_model(&m);
    PASS();
}

/* A selection callback of the kind a KV-cache library provides: every
   position, with the rows gathered into its own buffer. */
typedef struct {
    float *k, *v;
    int calls;
} gather_ctx;

static int gather_all(void *user, const tl_model *m, tl_state *s, int layer, int pos,
                      tl_kv_list *lists)
{
    gather_ctx *gc = (gather_ctx *)user;
    const tl_config *c = &m->config;
    int g, i, hs = c->head_size;
    for (g = 0; g < c->n_kv_heads; g++) {
        float *k = gc->k + (size_t)g * (size_t)s->ctx * (size_t)hs;
        float *v = gc->v + (size_t)g * (size_t)s->ctx * (size_t)hs;
        for (i = 0; i <= pos; i++) {
            lists[g].pos[i] = i;
            memcpy(k + (size_t)i * (size_t)hs, tl_key_row(c, s, layer, i) + g * hs,
                   (size_t)hs * sizeof(float));
            memcpy(v + (size_t)i * (size_t)hs, tl_value_row(c, s, layer, i) + g * hs,
                   (size_t)hs * sizeof(float));
        }
        lists[g].n = pos + 1;
        lists[g].k = k;
        lists[g].v = v;
    }
    gc->calls++;
    return 0;
}

TEST callback_mode_needs_a_callback_and_gathering_every_row_equals_full(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_policy p, full;
    tl_state s;
    gather_ctx gc;
    char err[TL_ERR_LEN];
    int np = 5, ns = 20;
    size_t n = (size_t)ns * 50;
    float *ref = (float *)malloc(n * sizeof(float)), *got = (float *)malloc(n * sizeof(float));
    tl_default_policy(&p, TL_ATTN_CALLBACK);
    ASSERT(tl_check_policy(&p, err, sizeof err) != 0);
    ASSERT(strcmp(err, "callback mode without a selection callback") == 0);
    ASSERT(tl_write_random_checkpoint(tmp_path("pq.bin"), &c, 0, 8, err, sizeof err) == 0);
    ASSERT(tl_build_model(&m, tmp_path("pq.bin"), err, sizeof err) == 0);
    ASSERT(tl_build_state(&s, &m.config, 0, 1, err, sizeof err) == 0);
    ASSERT(tl_forward(&m, &s, &p, 1, 0) == NULL);
    ASSERT(strcmp(s.err, "callback mode without a selection callback") == 0);
    /* pqcache is its driver's (tl_pqcache.h), not a selection */
    tl_default_policy(&full, TL_ATTN_PQCACHE);
    ASSERT(tl_check_policy(&full, err, sizeof err) != 0 && strstr(err, "tl_pqcache.h") != NULL);
    ASSERT(tl_forward(&m, &s, &full, 1, 0) == NULL && strstr(s.err, "tl_pqcache.h") != NULL);
    tl_free_state(&s);
    /* with a callback that gathers every row, the result is full attention */
    gc.k = (float *)malloc((size_t)(np + ns) * (size_t)m.config.kv_dim * sizeof(float));
    gc.v = (float *)malloc((size_t)(np + ns) * (size_t)m.config.kv_dim * sizeof(float));
    gc.calls = 0;
    p.select = gather_all;
    p.select_user = &gc;
    ASSERT(tl_check_policy(&p, err, sizeof err) == 0);
    tl_default_policy(&full, TL_ATTN_FULL);
    ASSERT(run_mode(&m, &full, 1, np, ns, ref) == 0);
    ASSERT(run_mode(&m, &p, 1, np, ns, got) == 0);
    ASSERT(gc.calls == ns * m.config.n_layers);
    ASSERT(memcmp(ref, got, n * sizeof(float)) == 0);
    /* policy checks */
    tl_default_policy(&p, TL_ATTN_ORACLE);
    p.ratio = 1.5f;
    ASSERT(tl_check_policy(&p, err, sizeof err) != 0);
    p.ratio = 0.1f;
    p.n_sink = -1;
    ASSERT(tl_check_policy(&p, err, sizeof err) != 0);
    free(gc.k); free(gc.v); free(ref); free(got);
    tl_free_model(&m);
    PASS();
}

TEST forward_rejects_bad_tokens_and_positions(void)
{
    tl_config c = gen_config();
    tl_model m;
    tl_state s;
    char err[TL_ERR_LEN];
    ASSERT(tl_write_random_checkpoint(tmp_path("bad.bin"), &c, 0, 2, err, sizeof err) == 0);
    ASSERT(tl_build_model(&m, tmp_path("bad.bin"), err, sizeof err) == 0);
    ASSERT(tl_build_state(&s, &m.config, 8, 1, err, sizeof err) == 0);
    ASSERT(s.ctx == 8);
    ASSERT(tl_forward(&m, &s, NULL, 50, 0) == NULL && strstr(s.err, "vocabulary"));
    ASSERT(tl_forward(&m, &s, NULL, -1, 0) == NULL);
    ASSERT(tl_forward(&m, &s, NULL, 1, 8) == NULL && strstr(s.err, "context"));
    ASSERT(tl_forward(&m, &s, NULL, 1, 7) != NULL);
    tl_free_state(&s);
    tl_free_model(&m);
    PASS();
}

/* ----------------------------------------------------------------------------
   Tests: sampling */

/* counts[t] += how often t is drawn in n samples from logits {0, 0, log 2, log 4} */
static void draw_counts(tl_sampler *sp, int n, int counts[4])
{
    float logits[4];
    int i;
    for (i = 0; i < n; i++) {
        int t;
        logits[0] = 0.0f; logits[1] = 0.0f; /* the sampler may overwrite them */
        logits[2] = (float)log(2.0); logits[3] = (float)log(4.0);
        t = tl_sample(sp, logits);
        if (t >= 0 && t < 4)
            counts[t]++;
    }
}

TEST sampler_is_greedy_at_temperature_0_and_draws_by_probability_within_top_p(void)
{
    tl_sampler sp;
    float logits[4];
    int i, counts[4] = { 0, 0, 0, 0 };
    unsigned long long a = tl_rng_seed(5), b = tl_rng_seed(5);
    ASSERT(tl_rng_next(&a) == tl_rng_next(&b));
    ASSERT(tl_build_sampler(&sp, 4, 0.0f, 0.9f, 1) == 0);
    logits[0] = 0.1f; logits[1] = 2.0f; logits[2] = -1.0f; logits[3] = 1.9f;
    ASSERT(tl_sample(&sp, logits) == 1);
    tl_free_sampler(&sp);
    /* temperature 1, no top-p: probabilities 1/8, 1/8, 1/4, 1/2 */
    ASSERT(tl_build_sampler(&sp, 4, 1.0f, 1.0f, 1) == 0);
    draw_counts(&sp, 8000, counts);
    ASSERT(counts[3] > 3700 && counts[3] < 4300);
    ASSERT(counts[2] > 1750 && counts[2] < 2250);
    ASSERT(counts[0] > 800 && counts[0] < 1200);
    tl_free_sampler(&sp);
    /* top-p 0.6: only tokens 3 (0.5) and 2 (0.25) */
    ASSERT(tl_build_sampler(&sp, 4, 1.0f, 0.6f, 2) == 0);
    memset(counts, 0, sizeof counts);
    draw_counts(&sp, 3000, counts);
    ASSERT(counts[0] == 0 && counts[1] == 0);
    ASSERT(counts[3] > 1800 && counts[3] < 2200);
    tl_free_sampler(&sp);
    /* top-p tiny: always the most likely */
    ASSERT(tl_build_sampler(&sp, 4, 1.0f, 1e-6f, 3) == 0);
    for (i = 0; i < 100; i++) {
        logits[0] = 0.0f; logits[1] = 3.0f; logits[2] = 0.5f; logits[3] = 2.9f;
        ASSERT(tl_sample(&sp, logits) == 1);
    }
    tl_free_sampler(&sp);
    PASS();
}

/* ----------------------------------------------------------------------------
   Tests: explicit rows */

/* A state without the host KV cache has no rows to point at (tl_key_row and
   tl_value_row give NULL, tl_select refuses it), and attention over explicit
   rows (krow, vrow) on it gives the logits of full attention over the host
   cache exactly. */
TEST explicit_rows_need_no_host_kv_cache(void)
{
    spec sp = small_spec();
    tl_model m;
    tl_state full, bare;
    tl_policy pol;
    char err[TL_ERR_LEN];
    const tl_config *c;
    enum { N = 12 };
    float *keys = NULL, *vals = NULL;
    const void **krow = NULL, **vrow = NULL;
    int pos, l, g, i, same = 1;
    size_t row;

    ASSERT(write_spec(tmp_path("rows.bin"), &sp) == 0);
    if (tl_build_model(&m, tmp_path("rows.bin"), err, sizeof err) != 0) {
        printf("  %s\n", err);
        FAILm("the checkpoint does not load");
    }
    c = &m.config;
    ASSERT(tl_build_state(&full, c, N, 1, err, sizeof err) == 0);
    ASSERT(tl_build_state_ex(&bare, c, N, 1, TL_STATE_NO_KV_CACHE, err, sizeof err) == 0);
    ASSERT(bare.key_cache == NULL && bare.value_cache == NULL);
    ASSERT(tl_key_row(c, &bare, 0, 0) == NULL && tl_value_row(c, &bare, 1, 3) == NULL);
    ASSERT(tl_key_row(c, &full, 1, 3) == full.key_cache + (size_t)(N + 3) * (size_t)c->kv_dim);
    tl_default_policy(&pol, TL_ATTN_WINDOW);
    bare.err[0] = '\0';
    ASSERT(tl_select(&m, &bare, NULL, 0, 0) != 0 && strstr(bare.err, "no KV cache") != NULL);
    ASSERT(tl_select(&m, &bare, &pol, 0, 0) != 0);

    row = (size_t)c->kv_dim;
    keys = (float *)calloc((size_t)c->n_layers * N * row, sizeof(float));
    vals = (float *)calloc((size_t)c->n_layers * N * row, sizeof(float));
    krow = (const void **)calloc((size_t)c->n_kv_heads * N, sizeof(void *));
    vrow = (const void **)calloc((size_t)c->n_kv_heads * N, sizeof(void *));
    ASSERT(keys && vals && krow && vrow);
    for (pos = 0; keys && vals && krow && vrow && pos < N; pos++) {
        int token = (pos * 7 + 3) % c->vocab_size;
        float *want = tl_forward(&m, &full, NULL, token, pos), *got;
        if (!want) {
            printf("  forward: %s\n", full.err);
            same = 0;
            break;
        }
        tl_embed(&m, &bare, token);
        for (l = 0; l < c->n_layers; l++) {
            float *k = keys + ((size_t)l * N) * row, *v = vals + ((size_t)l * N) * row;
            tl_layer_qkv_rows(&m, &bare, l, pos, k + (size_t)pos * row, v + (size_t)pos * row);
            for (g = 0; g < c->n_kv_heads; g++) {
                tl_kv_list *lst = &bare.lists[g];
                for (i = 0; i <= pos; i++) {
                    lst->pos[i] = i;
                    krow[g * N + i] = k + (size_t)i * row + (size_t)g * (size_t)c->head_size;
                    vrow[g * N + i] = v + (size_t)i * row + (size_t)g * (size_t)c->head_size;
                }
                lst->n = pos + 1;
                lst->k = lst->v = NULL;
                lst->krow = krow + g * N;
                lst->vrow = vrow + g * N;
            }
            tl_layer_attention(&m, &bare, l, bare.lists);
            tl_layer_ffn(&m, &bare, l);
        }
        got = tl_classify(&m, &bare);
        same &= memcmp(want, got, (size_t)c->vocab_size * sizeof(float)) == 0;
    }
    ASSERT(same);
    free(keys);
    free(vals);
    free(krow);
    free(vrow);
    tl_free_state(&full);
    tl_free_state(&bare);
    tl_free_model(&m);
    PASS();
}

/* ----------------------------------------------------------------------------
   Projection kernels: the SIMD versions (where the CPU has them) against the
   portable dot products, to the bit, for every stored type and for lengths
   with and without a tail */

static unsigned long long g_kseed = 12345;

static unsigned kernel_rand(void)
{
    g_kseed = g_kseed * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(g_kseed >> 33);
}

/* a random normal number of the type: bf16, fp16 (exponents near 1) or fp32 */
static void random_elems(void *dst, int dtype, int count)
{
    int i;
    for (i = 0; i < count; i++) {
        unsigned r = kernel_rand();
        if (dtype == TL_BF16)
            ((unsigned short *)dst)[i] = (unsigned short)((r & 0x8000u) | ((120u + r % 10u) << 7) | (r >> 8 & 0x7fu));
        else if (dtype == TL_F16)
            ((unsigned short *)dst)[i] = (unsigned short)((r & 0x8000u) | ((10u + r % 10u) << 10) | (r >> 8 & 0x3ffu));
        else
            ((float *)dst)[i] = ((float)(r % 20001u) - 10000.0f) / 7919.0f;
    }
}

TEST projection_kernels_equal_the_portable_dot_products_to_the_bit(void)
{
    static const int lens[] = { 8, 13, 64, 71, 2053 };
    static const int types[] = { TL_F32, TL_BF16, TL_F16 };
    int li, ti, r, k;
    for (li = 0; li < 5; li++)
        for (ti = 0; ti < 3; ti++) {
            int n = lens[li], dt = types[ti], rows = 7;
            size_t es = dt == TL_F32 ? 4u : 2u;
            unsigned char *w = (unsigned char *)malloc((size_t)rows * (size_t)n * es);
            float *x = (float *)malloc((size_t)n * 5 * sizeof(float)), *out = (float *)malloc((size_t)rows * sizeof(float));
            float *row32 = (float *)malloc((size_t)n * sizeof(float));
            tl_mat m;
            if (!w || !x || !out || !row32) {
                free(w); free(x); free(out); free(row32);
            }
            ASSERT(w && x && out && row32);
            random_elems(w, dt, rows * n);
            random_elems(x, TL_F32, 5 * n);
            m.data = w;
            m.dtype = dt;
            tl__rows(&m, n, x, out, 0, rows);   /* four rows at a time, then three */
            for (r = 0; r < rows; r++) {
                const unsigned char *row = w + (size_t)r * (size_t)n * es;
                float want;
                for (k = 0; k < n; k++)
                    row32[k] = tl__elem(row, dt, (size_t)k);
                want = tl__dot_scalar(row32, x, n);
                ASSERT(memcmp(&out[r], &want, sizeof want) == 0);
                ASSERT(out[r] == tl__dot_row(row, dt, x, n));
            }
            {   /* the prefill products: two rows with four inputs, one row with four */
                const float *b[4];
                float o8[8], o4[4], a1[4096];
                for (k = 0; k < 4; k++)
                    b[k] = x + (size_t)(k + 1) * (size_t)n;
                for (k = 0; k < n; k++)
                    a1[k] = tl__elem(w + (size_t)n * es, dt, (size_t)k);
                for (k = 0; k < n; k++)
                    row32[k] = tl__elem(w, dt, (size_t)k);
                tl__dot_2x4(row32, a1, b, n, o8);
                tl__dot_1x4(row32, b, n, o4);
                for (k = 0; k < 4; k++) {
                    float w0 = tl__dot_scalar(row32, b[k], n), w1 = tl__dot_scalar(a1, b[k], n);
                    ASSERT(memcmp(&o8[k], &w0, sizeof w0) == 0);
                    ASSERT(memcmp(&o8[4 + k], &w1, sizeof w1) == 0);
                    ASSERT(memcmp(&o4[k], &w0, sizeof w0) == 0);
                    ASSERT(tl__dot(row32, b[k], n) == w0);
                }
            }
            free(w); free(x); free(out); free(row32);
        }
    PASS();
}

/* The prompt's projections (tl__mm_multi): the tiled products against sums in double
   for every shape part of the kernels (rows in panels of 6 and their rest, tokens in
   blocks of 16 and 8 and their rest, widths with and without a multiple of 8), weights
   as stored; the same bits whether the matrices go together or one by one, and on one
   thread or two (each output's sum runs over k in order whoever computes it). */
TEST prompt_projections_equal_the_sums_to_rounding(void)
{
    static const int widths[] = { 8, 13, 64, 71, 576 };
    static const int tokens[] = { 1, 5, 8, 13, 16, 17, 40 };
    static const int types[] = { TL_F32, TL_BF16, TL_F16 };
    static const int rows[3] = { 7, 16, 25 };
    tl_state one, two;
    int wi, ti, ty, i, r, t, k, cases = 0;
    double worst = 0;
    memset(&one, 0, sizeof one);
    memset(&two, 0, sizeof two);
    two.pool = tl__pool_create(2);
    two.n_threads = 2;
    for (wi = 0; wi < 5; wi++)
        for (ti = 0; ti < 7; ti++)
            for (ty = 0; ty < 3; ty++) {
                int n = widths[wi], nt = tokens[ti], dt = types[ty], ok = 1;
                size_t es = dt == TL_F32 ? 4u : 2u;
                unsigned char *w[3];
                float *x = (float *)malloc((size_t)nt * (size_t)n * sizeof(float)), *out[3], *sep[3], *par[3];
                tl_mat m[3];
                const tl_mat *mp[3];
                for (i = 0; i < 3; i++) {
                    w[i] = (unsigned char *)malloc((size_t)rows[i] * (size_t)n * es);
                    out[i] = (float *)malloc((size_t)nt * (size_t)rows[i] * sizeof(float));
                    sep[i] = (float *)malloc((size_t)nt * (size_t)rows[i] * sizeof(float));
                    par[i] = (float *)malloc((size_t)nt * (size_t)rows[i] * sizeof(float));
                    ok &= w[i] && out[i] && sep[i] && par[i];
                }
                ok &= x != NULL;
                if (ok) {
                    random_elems(x, TL_F32, nt * n);
                    for (i = 0; i < 3; i++) {
                        random_elems(w[i], dt, rows[i] * n);
                        m[i].data = w[i];
                        m[i].dtype = dt;
                        mp[i] = &m[i];
                    }
                    ok = tl__mm_multi(&one, x, nt, n, 3, mp, out, rows) == 0 &&
                         tl__mm_multi(&two, x, nt, n, 3, mp, par, rows) == 0;
                    for (i = 0; i < 3 && ok; i++)
                        ok = tl__mm(&one, sep[i], x, nt, &m[i], n, rows[i]) == 0;
                }
                for (i = 0; i < 3 && ok; i++) {
                    size_t bytes = (size_t)nt * (size_t)rows[i] * sizeof(float);
                    if (memcmp(out[i], sep[i], bytes) != 0 || memcmp(out[i], par[i], bytes) != 0) {
                        printf("  width %d, %d tokens, type %d, matrix %d\n", n, nt, dt, i);
                        ok = 0;
                        break;
                    }
                    for (t = 0; t < nt; t++)
                        for (r = 0; r < rows[i]; r++) {
                            double want = 0, mag = 0, err;
                            for (k = 0; k < n; k++) {
                                double p = (double)tl__elem(w[i] + (size_t)r * (size_t)n * es, dt, (size_t)k) *
                                           (double)x[(size_t)t * (size_t)n + (size_t)k];
                                want += p;
                                mag += fabs(p);
                            }
                            err = fabs((double)out[i][(size_t)t * (size_t)rows[i] + (size_t)r] - want) / (mag + 1e-30);
                            if (!(err <= 1e-6)) {
                                printf("  width %d, %d tokens, type %d, matrix %d, token %d, row %d: error %g\n", n,
                                       nt, dt, i, t, r, err);
                                ok = 0;
                            }
                            worst = err > worst ? err : worst;
                        }
                }
                free(x);
                for (i = 0; i < 3; i++) {
                    free(w[i]); free(out[i]); free(sep[i]); free(par[i]);
                }
                if (!ok) {
                    tl_free_state(&one);
                    tl_free_state(&two);
                    FAILm("the prompt's projections differ from the sums, or between their orders");
                }
                cases++;
            }
    tl_free_state(&one);
    tl_free_state(&two);
    printf("  %d cases, largest difference %.2g of the sum of magnitudes\n", cases, worst);
    ASSERT_EQ(5 * 7 * 3, cases);
    PASS();
}

/* Decode attention over the host cache (every head the same positions, read
   together for the heads of a thread) and over rows given one by one, for
   head sizes that use each part of the kernels and lengths with partial
   blocks, against the portable loops: scores by tl__dot_scalar, tl_softmax,
   then out += a * v row by row. All to the bit. */
TEST attention_kernels_equal_the_portable_loops_to_the_bit(void)
{
    static const int head_sizes[] = { 8, 24, 64, 96, 128 };
    static const int lens[] = { 1, 7, 8, 33, 70 };
    int hi, li, threads;
    for (hi = 0; hi < 5; hi++)
        for (li = 0; li < 5; li++)
            for (threads = 1; threads <= 2; threads++) {
                tl_model m;
                tl_state st;
                tl__attn_job jobs[2];
                tl_config *c = &m.config;
                char err[TL_ERR_LEN];
                int n = lens[li], hs = head_sizes[hi], g, i, j, e, t, same_cache = 1, same_rows = 1;
                float *att = NULL, *want = NULL, *rows_k = NULL, *rows_v = NULL;
                float scale = 1.0f / sqrtf((float)hs);
                memset(&m, 0, sizeof m);
                c->n_layers = 2; c->n_heads = 8; c->n_kv_heads = 4; c->head_size = hs;
                c->dim = c->n_heads * hs; c->hidden_dim = 16; c->vocab_size = 16; c->seq_len = 128;
                c->rope_theta = 10000.0f; c->arch = TL_ARCH_LLAMA; c->rope_layout = TL_ROPE_HALF;
                ASSERT(tl_check_config(c, err, sizeof err) == 0);
                if (tl_build_state(&st, c, n, threads, err, sizeof err) != 0) {
                    printf("  %s\n", err);
                    FAILm("the run state cannot be built");
                }
                random_elems(st.key_cache, TL_F32, c->n_layers * n * c->kv_dim);
                random_elems(st.value_cache, TL_F32, c->n_layers * n * c->kv_dim);
                random_elems(st.q, TL_F32, c->q_dim);
                att = (float *)malloc((size_t)n * sizeof(float));
                want = (float *)calloc((size_t)c->q_dim, sizeof(float));
                rows_k = (float *)malloc((size_t)c->n_kv_heads * (size_t)n * (size_t)hs * sizeof(float));
                rows_v = (float *)malloc((size_t)c->n_kv_heads * (size_t)n * (size_t)hs * sizeof(float));
                if (!att || !want || !rows_k || !rows_v) {
                    free(att); free(want); free(rows_k); free(rows_v);
                    tl_free_state(&st);
                }
                ASSERT(att && want && rows_k && rows_v);
                for (g = 0; g < c->n_kv_heads; g++)          /* the portable loops, layer 1 */
                    for (j = 0; j < c->n_heads / c->n_kv_heads; j++) {
                        int h = g * (c->n_heads / c->n_kv_heads) + j;
                        for (i = 0; i < n; i++)
                            att[i] = tl__dot_scalar(st.q + (size_t)h * (size_t)hs,
                                                    tl_key_row(c, &st, 1, i) + (size_t)g * (size_t)hs, hs) * scale;
                        tl_softmax(att, n);
                        for (i = 0; i < n; i++)
                            for (e = 0; e < hs; e++)
                                want[(size_t)h * (size_t)hs + (size_t)e] +=
                                    att[i] * tl_value_row(c, &st, 1, i)[(size_t)g * (size_t)hs + (size_t)e];
                    }
                for (g = 0; g < c->n_kv_heads; g++) {         /* every head: positions 0 .. n-1 */
                    for (i = 0; i < n; i++)
                        st.lists[g].pos[i] = i;
                    st.lists[g].n = n;
                    st.lists[g].k = st.lists[g].v = NULL;
                    st.lists[g].krow = st.lists[g].vrow = NULL;
                }
                for (t = 0; t < threads; t++) {
                    jobs[t].m = &m;
                    jobs[t].s = &st;
                    jobs[t].layer = 1;
                    jobs[t].g0 = c->n_kv_heads * t / threads;
                    jobs[t].g1 = c->n_kv_heads * (t + 1) / threads;
                    jobs[t].lists = st.lists;
                }
                if (threads > 1 && st.pool)
                    tl_parallel(&st, tl__attn_part, jobs);   /* the state's pool */
                else
                    for (t = 0; t < threads; t++)
                        tl__attn_worker(&jobs[t]);
                same_cache = memcmp(st.xb, want, (size_t)c->q_dim * sizeof(float)) == 0;
                memset(st.xb, 0, (size_t)c->q_dim * sizeof(float));
                for (g = 0; g < c->n_kv_heads; g++) {         /* the same rows, copied out per head */
                    float *kg = rows_k + (size_t)g * (size_t)n * (size_t)hs, *vg = rows_v + (size_t)g * (size_t)n * (size_t)hs;
                    for (i = 0; i < n; i++) {
                        memcpy(kg + (size_t)i * (size_t)hs, tl_key_row(c, &st, 1, i) + (size_t)g * (size_t)hs, (size_t)hs * sizeof(float));
                        memcpy(vg + (size_t)i * (size_t)hs, tl_value_row(c, &st, 1, i) + (size_t)g * (size_t)hs, (size_t)hs * sizeof(float));
                    }
                    st.lists[g].k = kg;
                    st.lists[g].v = vg;
                }
                for (t = 0; t < threads; t++)
                    tl__attn_worker(&jobs[t]);
                same_rows = memcmp(st.xb, want, (size_t)c->q_dim * sizeof(float)) == 0;
                if (!same_cache || !same_rows)
                    printf("  head size %d, %d rows, %d thread(s): cache %s, rows %s\n", hs, n, threads,
                           same_cache ? "same" : "DIFFERENT", same_rows ? "same" : "DIFFERENT");
                ASSERT(same_cache && same_rows);
                free(att); free(want); free(rows_k); free(rows_v);
                tl_free_state(&st);
            }
    PASS();
}

/* The prompt's tiled attention (tl_attend_prefill, its SIMD and portable kernels) against
   tl_attend_causal: the same function in another order, so equal to rounding. Head sizes
   with and without a multiple of 8, groups of 1 to 4 query heads, blocks that start at 0
   or later, windows shorter and longer than a key tile, and scores up to about +-60 so that
   the running maximum moves (the online softmax's rescaling). */
TEST prompt_attention_tiles_equal_the_causal_loops_to_rounding(void)
{
    static const int head_sizes[] = { 8, 12, 64, 256 };
    static const int groups[] = { 1, 3, 4 };
    static const int starts[] = { 0, 5, 100 };
    static const int lens[] = { 1, 7, 70 };
    static const int windows[] = { 0, 5, 100 };
    int hi, gi, si, li, wi, simd, cases = 0;
    double worst = 0;
    for (hi = 0; hi < 4; hi++)
        for (gi = 0; gi < 3; gi++)
            for (si = 0; si < 3; si++)
                for (li = 0; li < 3; li++)
                    for (wi = 0; wi < 3; wi++) {
                        tl_config cfg;
                        int hs = head_sizes[hi], group = groups[gi], pos0 = starts[si], n = lens[li];
                        int window = windows[wi], rows = pos0 + n, nkv = 2, g, i;
                        size_t qd, stride, nq, nkvf;
                        float *q, *kv, *want, *got, *work, *att, big = hi == 1 && li == 2 ? 8.0f : 1.0f;
                        const float *kp[2], *vp[2];
                        memset(&cfg, 0, sizeof cfg);
                        cfg.n_kv_heads = nkv;
                        cfg.n_heads = nkv * group;
                        cfg.head_size = hs;
                        qd = (size_t)cfg.n_heads * (size_t)hs;
                        stride = (size_t)nkv * (size_t)hs;
                        nq = (size_t)n * qd;
                        nkvf = (size_t)rows * stride;
                        q = (float *)malloc(nq * sizeof(float));
                        kv = (float *)malloc(2 * nkvf * sizeof(float));
                        want = (float *)malloc(nq * sizeof(float));
                        got = (float *)malloc(nq * sizeof(float));
                        work = (float *)malloc(tl_attend_prefill_work(&cfg) * sizeof(float));
                        att = (float *)malloc((size_t)n * (size_t)cfg.n_heads * (size_t)rows * sizeof(float));
                        if (!q || !kv || !want || !got || !work || !att) {
                            free(q); free(kv); free(want); free(got); free(work); free(att);
                            FAILm("out of memory");
                        }
                        random_elems(q, TL_F32, (int)nq);
                        random_elems(kv, TL_F32, (int)(2 * nkvf));
                        for (i = 0; i < (int)nq; i++)
                            q[i] *= big;   /* scores up to about +-60 at head size 12 */
                        for (g = 0; g < nkv; g++) {
                            kp[g] = kv + (size_t)g * (size_t)hs;
                            vp[g] = kv + nkvf + (size_t)g * (size_t)hs;
                        }
                        tl_attend_causal(&cfg, pos0, n, q, kp, vp, stride, window, att, want);
                        for (simd = 0; simd <= 1; simd++) {
                            double err = 0;
                            memset(got, 0xff, nq * sizeof(float));   /* NaN: every output written */
                            tl__attend_prefill_ex(&cfg, pos0, n, q, kp, vp, stride, window, work, got, simd, 0, NULL);
                            {   /* the rows packed once (tl_prefill_pack): the same bits */
                                tl_prefill_tiles tiles;
                                float *got2 = (float *)malloc(nq * sizeof(float));
                                int same;
                                if (!got2 || tl_prefill_tiles_init(&tiles, &cfg, rows)) {
                                    free(got2); free(q); free(kv); free(want); free(got); free(work); free(att);
                                    FAILm("out of memory");
                                }
                                tl_prefill_pack(&cfg, kp, vp, stride, 0, rows, &tiles);
                                tl__attend_prefill_ex(&cfg, pos0, n, q, kp, vp, stride, window, work, got2, simd, 0,
                                                      &tiles);
                                same = memcmp(got2, got, nq * sizeof(float)) == 0;
                                tl_prefill_tiles_free(&tiles);
                                free(got2);
                                if (!same) {
                                    printf("  head size %d, group %d, pos0 %d, n %d, window %d, %s\n", hs, group, pos0,
                                           n, window, simd ? "SIMD" : "portable");
                                    free(q); free(kv); free(want); free(got); free(work); free(att);
                                    FAILm("the attention over packed tiles differs from the tile-by-tile packing");
                                }
                            }
                            for (i = 0; i < (int)nq; i++) {
                                double d = fabs((double)got[i] - (double)want[i]);
                                err = d > err || d != d ? (d != d ? 1e30 : d) : err;
                            }
                            /* a score of about 60 holds rounding errors about 60x larger */
                            if (err > (big > 1.0f ? 1e-5 : 2e-6)) {
                                printf("  head size %d, group %d, pos0 %d, n %d, window %d, %s: max error %g\n", hs,
                                       group, pos0, n, window, simd ? "SIMD" : "portable", err);
                                free(q); free(kv); free(want); free(got); free(work); free(att);
                                FAILm("the tiled attention differs from tl_attend_causal beyond rounding");
                            }
                            worst = big == 1.0f && err > worst ? err : worst;
                            cases++;
                        }
                        free(q); free(kv); free(want); free(got); free(work); free(att);
                    }
    printf("  %d cases, largest difference %.2g at scores of about +-3\n", cases, worst);
    ASSERT_EQ(4 * 3 * 3 * 3 * 3 * 2, cases);
    PASS();
}

/* ----------------------------------------------------------------------------
   Main */

SUITE(forward)
{
    RUN_TEST(full_forward_matches_the_reference);
    RUN_TEST(forward_rejects_bad_tokens_and_positions);
    RUN_TEST(explicit_rows_need_no_host_kv_cache);
}

SUITE(attention_modes)
{
    RUN_TEST(window_and_oracle_with_full_budget_equal_full);
    RUN_TEST(budget_splits_into_sinks_window_and_top_k);
    RUN_TEST(window_and_oracle_select_sinks_window_and_the_exact_top_k);
    RUN_TEST(callback_mode_needs_a_callback_and_gathering_every_row_equals_full);
}

SUITE(sampling)
{
    RUN_TEST(sampler_is_greedy_at_temperature_0_and_draws_by_probability_within_top_p);
}

SUITE(kernels)
{
    RUN_TEST(projection_kernels_equal_the_portable_dot_products_to_the_bit);
    RUN_TEST(prompt_projections_equal_the_sums_to_rounding);
    RUN_TEST(attention_kernels_equal_the_portable_loops_to_the_bit);
    RUN_TEST(prompt_attention_tiles_equal_the_causal_loops_to_rounding);
}

GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    if (make_test_dir("tiny_llama_test") != 0) {
        printf("cannot create a temporary directory\n0 passed, 1 failed\n");
        return 1;
    }
    RUN_SUITE(forward);
    RUN_SUITE(attention_modes);
    RUN_SUITE(sampling);
    RUN_SUITE(kernels);
    remove_test_dir();
    GREATEST_MAIN_END();
}
