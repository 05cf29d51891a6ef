/* hardkeys.h - hard, LLM-like attention keys and queries for fidelity measurements.

   One KV head (d_h = 128) shared by g = 4 query heads, keys after RoPE, queries at the
   decode position s (the token after the last key). Built to have the properties that make
   selecting tokens by product quantization hard on real models:

   - RoPE at each token's position, base 1e4 or 5e5, in either layout:
       HK_HALF         pair i = dims (i, i + 64)   (the rotate-half convention)
       HK_INTERLEAVED  pair i = dims (2i, 2i + 1)
     Pair i turns by base^(-i/64) radians per position: pair 0 is the fastest.
   - Bands of pairs (pre-RoPE content):
       fast  [0, 24)   topic and token content that RoPE turns into position noise;
       mid   [24, 44)  a content vector shared by every token: the query of a head with a
                       recency component carries the same vector rotated to the decode
                       position, so scores rise for nearby tokens (RoPE's own decay);
       slow  [44, 62)  the topic's identity: barely rotates over a run of tokens;
       retrieval [62, 64)  the two slowest pairs: ordinary tokens hold only faint noise
                       here; the rare tokens' distinctive content lies here.
   - Massive channels: a large bias shared by every token in three coordinates (pairs 30,
     50 and 57, before RoPE).
   - Topics: the sequence is a series of long runs, each on one topic; a token is its
     topic's centre plus noise. The runs make dense clusters.
   - A sink token at position 0 whose key has about three times the ordinary norm, and
     which every query head attends to.
   - Rare tokens (n_rare, 20 per 32K tokens by default) inside ordinary runs, away from the
     ends: the key is that of an ordinary token of the run plus an offset of norm `delta`
     (times 0.75..1) along the distinctive direction in the retrieval pairs, rescaled to the
     norm it had. Their keys have the norm of their neighbours and sit inside the topic's
     cluster: for a small delta, a codebook of 64 or 256 centroids gives them the
     cluster's centroid.
   - Queries: each head looks for the distinctive direction (plus head-specific noise)
     with a strength that makes a rare token score about 5..11 logits above its
     neighbours, whatever delta is; plus noise in every other dimension (which meets the
     topics' and the massive channels' content), the sink direction, and, scaled by
     `recency`, the recency component (heads 0..3 at 1, 0.7, 0.4, 0.2 of it).
   - Observation queries (n_obs per head, optional): the queries of the prompt's last
     tokens, at positions s - n_obs .. s - 1, what an engine has at the end of prefill.
     Each is drawn the way the decode query is, with fresh strengths and noise. With
     obs_unrelated set they look for something else: a random direction in the slow band
     instead of the distinctive direction (the prompt ends on another subject).

   Levels (how close the rare tokens sit to their cluster and how dense the clusters are;
   ordinary tokens' noise in the retrieval pairs has std 0.06 * delta per coordinate):
     HK_EASY    delta 24, 96 topics, runs of 32..256 tokens, loose clusters: the rare keys
                stand out of their clusters (a needle)
     HK_MEDIUM  delta 14, 32 topics, runs of 256..1024 tokens
     HK_HARD    delta 1,  12 topics, runs of 1024..4096 tokens, tight clusters: the rare
                keys lie well inside the spread of their cluster
   (At m = 2, b = 6 the median squared quantization error of a token is 50..75 per
   sub-space, about 3 in the slow half of the interleaved layout at base 5e5: what decides
   is delta^2 against that spread.)

   Everything is a function of the parameters and the seed alone. */
#ifndef PQC_HARDKEYS_H
#define PQC_HARDKEYS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define HK_FN static __attribute__((unused))
#else
#define HK_FN static
#endif

enum { HK_EASY = 0, HK_MEDIUM = 1, HK_HARD = 2 };
enum { HK_HALF = 0, HK_INTERLEAVED = 1 };
enum { HK_D = 128, HK_G = 4, HK_PAIRS = 64 };
enum { HK_FAST_END = 24, HK_MID_END = 44, HK_RET_BEGIN = 62 };

typedef struct hardkeys {
    /* set by the caller (zero fields take the defaults) */
    size_t s;          /* tokens                                                  */
    int level;         /* HK_EASY, HK_MEDIUM, HK_HARD                             */
    int layout;        /* HK_HALF or HK_INTERLEAVED                               */
    double base;       /* RoPE base; 0 = 10000                                    */
    double recency;    /* strength of the queries' recency component, 0..1        */
    int n_rare;        /* 0 = 20 per 32768 tokens, at least 4                     */
    double delta;      /* the rare tokens' offset; 0 = the level's                */
    int n_obs;         /* observation queries per head (0: none)                  */
    int obs_unrelated; /* 1: they look for another direction (see above)          */
    uint64_t seed;
    /* filled by hk_make */
    int d, g;          /* 128, 4                                                  */
    float *keys;       /* s x d, post-RoPE                                        */
    float *queries;    /* g x d, post-RoPE, at position s                         */
    float *obs;        /* n_obs x g x d: row i at position s - n_obs + i          */
    uint32_t *rare;    /* n_rare ascending token indices                          */
} hardkeys;

typedef struct hk_level {
    const char *name;
    int topics, run_min, run_max;
    float topic_fast, topic_mid, topic_slow; /* std of a topic centre's coordinates      */
    float tok_fast, tok_mid, tok_slow;       /* std of a token's own noise               */
    float delta;                             /* norm of the rare tokens' offset          */
} hk_level;

static const hk_level hk_levels[3] = {
    {"easy", 96, 32, 256, 1.0f, 0.5f, 1.5f, 0.7f, 0.4f, 0.5f, 24.0f},
    {"medium", 32, 256, 1024, 1.0f, 0.5f, 1.5f, 0.7f, 0.3f, 0.3f, 14.0f},
    {"hard", 12, 1024, 4096, 1.0f, 0.5f, 1.5f, 0.7f, 0.3f, 0.15f, 1.0f},
};

HK_FN const char *hk_level_name(int level) { return level >= 0 && level < 3 ? hk_levels[level].name : "?"; }

HK_FN uint64_t hk__next(uint64_t *st)
{
    uint64_t z = (*st += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
HK_FN double hk__unit(uint64_t *st) { return ((double)(hk__next(st) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
HK_FN float hk__normal(uint64_t *st)
{
    double u = hk__unit(st), v = hk__unit(st);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* v[0..d) = a random unit vector over dimensions [from, to), zero elsewhere */
HK_FN void hk__unit_vec(float *v, int d, int from, int to, uint64_t *st)
{
    double n2 = 0;
    int i;
    memset(v, 0, sizeof(float) * (size_t)d);
    for (i = from; i < to; i++) {
        v[i] = hk__normal(st);
        n2 += (double)v[i] * v[i];
    }
    for (i = 0; i < d; i++) v[i] = (float)(v[i] / sqrt(n2));
}

/* the dimension of coordinate c (0: x, 1: y) of RoPE pair i */
HK_FN int hk_dim(int layout, int pair, int c) { return layout == HK_INTERLEAVED ? 2 * pair + c : pair + c * HK_PAIRS; }

/* std of band b's coordinates (0 fast, 1 mid, 2 slow) for a topic centre / a token */
HK_FN float hk__band(const float *v3, int pair) { return pair < HK_FAST_END ? v3[0] : pair < HK_MID_END ? v3[1] : v3[2]; }

/* rotates pair-space vector p (64 pairs of x, y) to position pos and writes it in layout
   order into out[128] */
HK_FN void hk__rope(const float *p, double pos, double base, int layout, float *out)
{
    int i;
    for (i = 0; i < HK_PAIRS; i++) {
        double th = pos * pow(base, -(double)i / HK_PAIRS), cs = cos(th), sn = sin(th);
        double x = p[2 * i], y = p[2 * i + 1];
        out[hk_dim(layout, i, 0)] = (float)(x * cs - y * sn);
        out[hk_dim(layout, i, 1)] = (float)(x * sn + y * cs);
    }
}

HK_FN void hk_free(hardkeys *hk)
{
    free(hk->keys);
    free(hk->queries);
    free(hk->rare);
    free(hk->obs);
    hk->keys = hk->queries = hk->obs = NULL;
    hk->rare = NULL;
}

/* Fills keys, queries and rare for hk's parameters; returns 0 on success, -1 when memory
   runs out or the parameters are out of range (s < 1024, unknown level or layout). */
HK_FN int hk_make(hardkeys *hk)
{
    const hk_level *lv;
    const int d = HK_D, g = HK_G;
    uint64_t st;
    float *cent = NULL, *pre, *rec, *sinkdir, *dir, *pq, tf[3], tt[3];
    double base = hk->base > 0 ? hk->base : 10000.0;
    double lscale = sqrt((double)d);
    size_t t, run_end = 0;
    double n2sum = 0, deff;
    int i, h, r, topic = 0, nr;
    float sig_ret, delta;
    if (hk->s < 1024 || hk->level < 0 || hk->level > 2 || (hk->layout != HK_HALF && hk->layout != HK_INTERLEAVED) ||
        hk->n_obs < 0 || (size_t)hk->n_obs > hk->s)
        return -1;
    lv = &hk_levels[hk->level];
    nr = hk->n_rare > 0 ? hk->n_rare : (int)((hk->s * 20 + 16384) / 32768);
    if (nr < 4) nr = 4;
    hk->n_rare = nr;
    hk->d = d;
    hk->g = g;
    st = hk->seed * 0x2545F4914F6CDD1Dull + 0x51ED270B27u;
    hk->keys = (float *)malloc(sizeof(float) * hk->s * d);
    hk->queries = (float *)malloc(sizeof(float) * (size_t)g * d);
    hk->rare = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)nr);
    hk->obs = (float *)malloc(sizeof(float) * ((size_t)hk->n_obs * g * d + 1));
    cent = (float *)malloc(sizeof(float) * ((size_t)lv->topics * d + 6 * d));
    if (!hk->keys || !hk->queries || !hk->rare || !hk->obs || !cent) {
        free(cent);
        hk_free(hk);
        return -1;
    }
    pre = cent + (size_t)lv->topics * d; /* one token's pre-RoPE content, pair space */
    rec = pre + d;                       /* the shared recency content (mid band)    */
    sinkdir = rec + d;                   /* the sink's direction (slow band), unit   */
    dir = sinkdir + d;                   /* the distinctive direction, unit          */
    pq = dir + d;                        /* a query in pair space                    */
    tf[0] = lv->topic_fast;
    tf[1] = lv->topic_mid;
    tf[2] = lv->topic_slow;
    tt[0] = lv->tok_fast;
    tt[1] = lv->tok_mid;
    tt[2] = lv->tok_slow;
    delta = hk->delta > 0 ? (float)hk->delta : lv->delta;
    sig_ret = 0.06f * delta; /* ordinary tokens' noise in the retrieval pairs */

    /* topic centres: nothing in the retrieval pairs */
    for (i = 0; i < lv->topics; i++) {
        int p;
        for (p = 0; p < HK_PAIRS; p++) {
            float sd = p >= HK_RET_BEGIN ? 0.0f : hk__band(tf, p);
            cent[(size_t)i * d + 2 * p] = sd * hk__normal(&st);
            cent[(size_t)i * d + 2 * p + 1] = sd * hk__normal(&st);
        }
    }
    /* recency content: unit magnitude, random phase, in every mid pair */
    memset(rec, 0, sizeof(float) * d);
    for (i = HK_FAST_END; i < HK_MID_END; i++) {
        double ph = 6.283185307179586 * hk__unit(&st);
        rec[2 * i] = (float)cos(ph);
        rec[2 * i + 1] = (float)sin(ph);
    }
    /* the sink's direction: a random unit vector over the slow band */
    hk__unit_vec(sinkdir, d, 2 * HK_MID_END, 2 * HK_RET_BEGIN, &st);
    /* the distinctive direction: a random unit vector over the retrieval pairs */
    hk__unit_vec(dir, d, 2 * HK_RET_BEGIN, d, &st);

    /* every token: topic centre + noise + recency content + massive channels, RoPE */
    for (t = 0; t < hk->s; t++) {
        int p;
        if (t == run_end) {
            size_t len = (size_t)lv->run_min + (size_t)(hk__unit(&st) * (lv->run_max - lv->run_min + 1));
            if (len > hk->s / 8 + 1) len = hk->s / 8 + 1;
            run_end = t + len;
            topic = (int)(hk__next(&st) % (uint64_t)lv->topics);
        }
        for (p = 0; p < HK_PAIRS; p++) {
            float sd = p >= HK_RET_BEGIN ? sig_ret : hk__band(tt, p);
            pre[2 * p] = cent[(size_t)topic * d + 2 * p] + sd * hk__normal(&st) + rec[2 * p];
            pre[2 * p + 1] = cent[(size_t)topic * d + 2 * p + 1] + sd * hk__normal(&st) + rec[2 * p + 1];
        }
        pre[2 * 30 + 1] += 6.0f; /* massive channels */
        pre[2 * 50] += 10.0f;
        pre[2 * 57] += 8.0f;
        if (t == 0)
            for (i = 0; i < d; i++) pre[i] += 60.0f * sinkdir[i];
        hk__rope(pre, (double)t, base, hk->layout, hk->keys + t * d);
        if (t > 0)
            for (i = 0; i < d; i++) n2sum += (double)hk->keys[t * d + i] * hk->keys[t * d + i];
    }
    /* rescaling a rare key to its old norm shortens its offset to about deff */
    deff = delta * sqrt(n2sum / (double)(hk->s - 1) / (n2sum / (double)(hk->s - 1) + (double)delta * delta));

    /* rare tokens: spread over [5%, 85%) of the sequence, inside ordinary runs; the offset
       is added after RoPE (what matters is how the key looks from the decode position) */
    for (r = 0; r < nr; r++) {
        size_t pos = (size_t)((double)hk->s * (0.05 + 0.8 * (r + hk__unit(&st)) / nr));
        float *k, off[HK_D];
        double n0 = 0, n1 = 0, u = 0.75 + 0.25 * hk__unit(&st), on = 0;
        if (pos < 32) pos = 32;
        if (pos >= hk->s) pos = hk->s - 1;
        hk->rare[r] = (uint32_t)pos;
        k = hk->keys + pos * d;
        memset(off, 0, sizeof off);
        for (i = 2 * HK_RET_BEGIN; i < d; i++) {
            off[i] = dir[i] + 0.1f * hk__normal(&st);
            on += (double)off[i] * off[i];
        }
        for (i = 0; i < d; i++) n0 += (double)k[i] * k[i];
        for (i = HK_RET_BEGIN; i < HK_PAIRS; i++) {
            k[hk_dim(hk->layout, i, 0)] += (float)(delta * u * off[2 * i] / sqrt(on));
            k[hk_dim(hk->layout, i, 1)] += (float)(delta * u * off[2 * i + 1] / sqrt(on));
        }
        for (i = 0; i < d; i++) n1 += (double)k[i] * k[i];
        for (i = 0; i < d; i++) k[i] = (float)(k[i] * sqrt(n0 / n1));
    }

    /* queries, in pair space at their position, then in layout order: the decode query
       (row -1) and the observation queries */
    for (r = -1; r < hk->n_obs; r++) {
        float *odir = pq + d;
        int unrelated = r >= 0 && hk->obs_unrelated;
        double qpos = r < 0 ? (double)hk->s : (double)(hk->s - (size_t)hk->n_obs + (size_t)r);
        float *qout = r < 0 ? hk->queries : hk->obs + (size_t)r * g * d;
        /* another direction, over the slow band, for unrelated observation queries (drawn
           after the decode query, which stays as it was) */
        if (r == 0) hk__unit_vec(odir, d, 2 * HK_MID_END, 2 * HK_RET_BEGIN, &st);
        for (h = 0; h < g; h++) {
            static const double rec_share[HK_G] = {1.0, 0.7, 0.4, 0.2};
            double a = 9.0 * lscale / deff * (0.8 + 0.4 * hk__unit(&st)); /* strength along dir */
            double cs = 1.3 * (0.7 + 0.6 * hk__unit(&st));                       /* along the sink     */
            double beta = 4.5 * hk->recency * rec_share[h];                       /* recency           */
            float qrot[HK_D], rrot[HK_D];
            for (i = 0; i < d; i++) {
                if (i >= 2 * HK_RET_BEGIN)
                    pq[i] = unrelated ? 0.5f * hk__normal(&st) : (float)(a * (dir[i] + 0.12f * hk__normal(&st)));
                else
                    pq[i] = 0.5f * hk__normal(&st) + (float)(cs * sinkdir[i]) +
                            (unrelated ? (float)(a * odir[i]) : 0.0f);
            }
            /* the recency content as a key at the query's position would hold it */
            hk__rope(rec, qpos, base, hk->layout, rrot);
            /* the rest is post-RoPE already: write it in layout order without rotating */
            hk__rope(pq, 0.0, base, hk->layout, qrot);
            for (i = 0; i < d; i++) qout[(size_t)h * d + i] = qrot[i] + (float)beta * rrot[i];
        }
    }

    /* ascending rare positions (they are generated in order; keep the invariant anyway) */
    for (r = 1; r < nr; r++) {
        int c;
        for (c = r; c > 0 && hk->rare[c - 1] > hk->rare[c]; c--) {
            uint32_t x = hk->rare[c];
            hk->rare[c] = hk->rare[c - 1];
            hk->rare[c - 1] = x;
        }
    }
    free(cent);
    return 0;
}

#endif
