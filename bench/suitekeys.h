/* suitekeys.h - a second family of LLM-like attention keys, built apart from hardkeys.h
   and split in two: a tuning part (settings and defaults are chosen on it) and a reported
   part (figures are quoted from it, nothing is tuned on it).

   One KV head (d_h 128) shared by 4 query heads, half-split RoPE (pair i = dims i, i + 64,
   turning by base^(-i/64) per position), base 5e5, keys after RoPE, queries at the decode
   position s. Every coordinate below is a pre-RoPE pair coordinate.
   - A bias: a few massive channels in slow pairs, shared by every token.
   - Topics: runs of 64..512 tokens, each on one of `topics` topics; a token is its topic's
     centre plus noise, both in every pair (content and noise everywhere, not in bands).
   - A sink at position 0 with about three times an ordinary key's norm.
   - n_rel relevant tokens (8 by default) anywhere but the ends; each adds a distinctive
     direction of its own over the slowest `slow_share` of the pairs (a fifth; a half for
     the recency variant).
   - The decode query of each head looks for all the relevant tokens at once (the sum of
     their directions), plus the sink, plus noise in every coordinate strong enough that
     attention spreads over thousands of tokens; after RoPE's turn over the distance the
     relevant tokens rank anywhere from the tens to the tens of thousands.
   - SK_RECENCY: the queries also carry a content vector every key shares (mid pairs),
     turned to the decode position: scores rise for nearby tokens.
   - Observation queries (n_obs per head at positions s - n_obs .. s - 1): drawn the way
     the decode query is, with fresh noise (the question ends the prompt); SK_QFIRST: they
     look only at the sink and the current topic (the question came first).
   Everything is a function of the parameters and the seed. */
#ifndef PQC_SUITEKEYS_H
#define PQC_SUITEKEYS_H

#include "hardkeys.h"

enum { SK_PLAIN = 0, SK_RECENCY = 1, SK_QFIRST = 2 };

typedef struct suitekeys {
    /* set by the caller (zero: the default) */
    size_t s;
    int variant;        /* SK_PLAIN, SK_RECENCY, SK_QFIRST */
    int topics;         /* 0 = 48 */
    int n_rel;          /* 0 = 8 */
    int n_obs;          /* 0 = 32 */
    double noise;       /* the queries' noise per coordinate; 0 = 3 */
    uint64_t seed;
    /* filled by sk_make */
    float *keys;        /* s x 128 */
    float *queries;     /* 4 x 128 */
    float *obs;         /* n_obs x 4 x 128 */
    uint32_t *rel;      /* n_rel ascending */
} suitekeys;

HK_FN void sk_free(suitekeys *k)
{
    free(k->keys);
    free(k->queries);
    free(k->obs);
    free(k->rel);
    k->keys = k->queries = k->obs = NULL;
    k->rel = NULL;
}

/* pair-space query of one head: rel directions (strength a), the sink (strength b), the
   topic centre (strength c), the recency vector (strength r), noise (std n) */
HK_FN void sk__query(float *q, const float *reldir, int n_rel, float a, const float *sink, float b,
                     const float *topic, float c, const float *rec, float r, float n, uint64_t *st)
{
    int i, j;
    for (i = 0; i < HK_D; i++) {
        double v = 0;
        for (j = 0; j < n_rel; j++) v += a * reldir[(size_t)j * HK_D + i];
        v += b * sink[i] + c * topic[i] + r * rec[i] + n * hk__normal(st);
        q[i] = (float)v;
    }
}

/* Returns 0, or -1 when memory runs out or s < 4096. */
HK_FN int sk_make(suitekeys *k)
{
    const int d = HK_D, g = HK_G;
    const double base = 5e5;
    int topics = k->topics > 0 ? k->topics : 48, nrel = k->n_rel > 0 ? k->n_rel : 8;
    int nobs = k->n_obs > 0 ? k->n_obs : 32, slow0, i, j, h, topic = 0, last_topic = 0;
    float noise = (float)(k->noise > 0 ? k->noise : 3.0), *cent, *bias, *sink, *rec, *reldir, *pre;
    size_t t, run_end = 0;
    uint64_t st = k->seed * 0x9E3779B97F4A7C15ull + 0x7A11EDull;
    if (k->s < 4096) return -1;
    k->n_rel = nrel;
    k->n_obs = nobs;
    k->keys = (float *)malloc(sizeof(float) * k->s * d);
    k->queries = (float *)malloc(sizeof(float) * (size_t)g * d);
    k->obs = (float *)malloc(sizeof(float) * (size_t)nobs * g * d);
    k->rel = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)nrel);
    cent = (float *)malloc(sizeof(float) * ((size_t)topics + (size_t)nrel + 5) * d);
    if (!k->keys || !k->queries || !k->obs || !k->rel || !cent) {
        free(cent);
        sk_free(k);
        return -1;
    }
    bias = cent + (size_t)topics * d;
    sink = bias + d;
    rec = sink + d;
    pre = rec + d;
    reldir = pre + d;
    /* pair space: coordinate 2i + c of pair i; hk__rope turns it and writes the layout */
    for (i = 0; i < topics * d; i++) cent[i] = 0.7f * hk__normal(&st);
    memset(bias, 0, sizeof(float) * 3 * d);
    bias[2 * 40] = 6.0f;
    bias[2 * 50] = 8.0f;
    bias[2 * 58 + 1] = 7.0f;
    hk__unit_vec(sink, d, 0, d, &st);
    for (i = 2 * 24; i < 2 * 44; i++) rec[i] = 0.8f * hk__normal(&st);
    slow0 = k->variant == SK_RECENCY ? HK_PAIRS / 2 : HK_PAIRS - HK_PAIRS / 5;
    for (j = 0; j < nrel; j++) hk__unit_vec(reldir + (size_t)j * d, d, 2 * slow0, d, &st);
    /* relevant positions: distinct, ascending, away from the first and last 5% */
    for (j = 0; j < nrel; j++) {
        size_t lo = k->s / 20, span = k->s - 2 * lo;
        uint32_t p;
        int dup;
        do {
            p = (uint32_t)(lo + hk__next(&st) % span);
            for (dup = 0, i = 0; i < j; i++) dup |= k->rel[i] == p;
        } while (dup);
        k->rel[j] = p;
    }
    for (j = 1; j < nrel; j++) /* insertion sort */
        for (i = j; i > 0 && k->rel[i - 1] > k->rel[i]; i--) {
            uint32_t x = k->rel[i];
            k->rel[i] = k->rel[i - 1];
            k->rel[i - 1] = x;
        }
    for (t = 0; t < k->s; t++) {
        if (t >= run_end) {
            topic = (int)(hk__next(&st) % (uint64_t)topics);
            run_end = t + 64 + (size_t)(hk__next(&st) % 449);
        }
        for (i = 0; i < d; i++)
            pre[i] = bias[i] + cent[(size_t)topic * d + i] + 0.4f * hk__normal(&st) +
                     (k->variant == SK_RECENCY ? rec[i] : 0.0f);
        if (t == 0) {
            double n2 = 0;
            for (i = 0; i < d; i++) n2 += (double)pre[i] * pre[i];
            for (i = 0; i < d; i++) pre[i] = bias[i] + (float)(3.0 * sqrt(n2)) * sink[i];
        }
        for (j = 0; j < nrel; j++)
            if (k->rel[j] == t)
                for (i = 0; i < d; i++) pre[i] += 6.0f * reldir[(size_t)j * d + i];
        hk__rope(pre, (double)t, base, HK_HALF, k->keys + t * d);
        last_topic = topic;
    }
    for (h = 0; h < g; h++) {
        uint64_t hs = st + (uint64_t)h * 0x1234567ull;
        float a = 1.6f + 0.2f * (float)h, r = k->variant == SK_RECENCY ? 1.0f - 0.25f * (float)h : 0.0f;
        sk__query(pre, reldir, nrel, a, sink, 1.2f, cent + (size_t)last_topic * d, 0.0f, rec, r, noise, &hs);
        hk__rope(pre, (double)k->s, base, HK_HALF, k->queries + (size_t)h * d);
        for (i = 0; i < nobs; i++) {
            float *o = k->obs + ((size_t)i * g + (size_t)h) * d;
            if (k->variant == SK_QFIRST)
                sk__query(pre, reldir, nrel, 0.0f, sink, 1.2f, cent + (size_t)last_topic * d, 0.6f, rec, 0.0f, noise,
                          &hs);
            else
                sk__query(pre, reldir, nrel, a, sink, 1.2f, cent + (size_t)last_topic * d, 0.0f, rec, r, noise, &hs);
            hk__rope(pre, (double)(k->s - (size_t)nobs + (size_t)i), base, HK_HALF, o);
        }
    }
    free(cent);
    return 0;
}

#endif
