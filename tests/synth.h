/* synth.h - synthetic attention keys that look like an LLM's, for tests and benchmarks.

   Keys (s x d, fp32) are built like post-RoPE attention keys:
   - clustered content: each token draws one of `clusters` random centres plus noise;
   - a few large-magnitude channels (a fixed handful of dims scaled up, as real models show);
   - RoPE: pair i = dims (2i, 2i+1) rotated by position * base^(-2i/d), base 10000;
   - planted needles: n_needles tokens whose (post-RoPE) key is one distinctive direction
     of large norm.
   Queries (g x d): for each head the needles' common direction plus head-specific noise,
   so the needles are the true top scores and a selector must find them.
   Everything is a function of the seed alone. */
#ifndef PQC_SYNTH_H
#define PQC_SYNTH_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define SYNTH_FN static __attribute__((unused))
#else
#define SYNTH_FN static
#endif

typedef struct synth {
    size_t s;
    int d, g, n_needles, clusters;
    uint64_t seed;
    float *keys;       /* s x d */
    float *queries;    /* g x d */
    uint32_t *needles; /* ascending token indices */
} synth;

SYNTH_FN uint64_t synth__next(uint64_t *st)
{
    uint64_t z = (*st += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
SYNTH_FN double synth__unit(uint64_t *st) { return ((double)(synth__next(st) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
SYNTH_FN float synth__normal(uint64_t *st)
{
    double u = synth__unit(st), v = synth__unit(st);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

SYNTH_FN void synth_free(synth *sy)
{
    free(sy->keys);
    free(sy->queries);
    free(sy->needles);
    sy->keys = sy->queries = NULL;
    sy->needles = NULL;
}

/* Fills keys, queries and needles for sy->{s, d, g, n_needles, seed}; returns 0 on success. */
SYNTH_FN int synth_make(synth *sy)
{
    uint64_t st = sy->seed * 0x2545F4914F6CDD1Dull + 1;
    int nc = sy->clusters > 0 ? sy->clusters : 32, d = sy->d, i, h, c;
    size_t t;
    float *cent = (float *)malloc(sizeof(float) * (size_t)nc * d);
    float *dir = (float *)malloc(sizeof(float) * (size_t)d);
    sy->keys = (float *)malloc(sizeof(float) * sy->s * d);
    sy->queries = (float *)malloc(sizeof(float) * (size_t)sy->g * d);
    sy->needles = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(sy->n_needles > 0 ? sy->n_needles : 1));
    if (!cent || !dir || !sy->keys || !sy->queries || !sy->needles) {
        free(cent);
        free(dir);
        synth_free(sy);
        return -1;
    }
    for (i = 0; i < nc * d; i++) cent[i] = synth__normal(&st);
    for (t = 0; t < sy->s; t++) {
        float *k = sy->keys + t * d;
        int cl = (int)(synth__next(&st) % (uint64_t)nc);
        for (i = 0; i < d; i++) k[i] = cent[cl * d + i] + 0.5f * synth__normal(&st);
        /* outlier channels */
        k[3 % d] *= 6.0f;
        k[(d / 2 + 1) % d] *= 4.0f;
        k[(d - 5 + d) % d] *= 5.0f;
    }
    /* the needles' common direction: unit, spread over the low-frequency half */
    {
        double nrm = 0.0;
        for (i = 0; i < d; i++) {
            dir[i] = i >= d / 2 ? synth__normal(&st) : 0.1f * synth__normal(&st);
            nrm += (double)dir[i] * dir[i];
        }
        for (i = 0; i < d; i++) dir[i] = (float)(dir[i] / sqrt(nrm));
    }
    /* RoPE on every key */
    for (t = 0; t < sy->s; t++) {
        float *k = sy->keys + t * d;
        for (i = 0; i < d / 2; i++) {
            double th = (double)t * pow(10000.0, -2.0 * i / d);
            float a = k[2 * i], b = k[2 * i + 1], cs = (float)cos(th), sn = (float)sin(th);
            k[2 * i] = a * cs - b * sn;
            k[2 * i + 1] = a * sn + b * cs;
        }
    }
    for (i = 0; i < sy->n_needles; i++) {
        /* spread over the sequence, away from the ends; set after RoPE: a needle is a key
           that, at the current decode position, points along the query */
        uint32_t pos = (uint32_t)((double)sy->s * (0.05 + 0.9 * (i + synth__unit(&st)) / sy->n_needles));
        float *k;
        int e;
        if (pos >= sy->s) pos = (uint32_t)sy->s - 1;
        k = sy->keys + (size_t)pos * d;
        sy->needles[i] = pos;
        for (e = 0; e < d; e++) k[e] = 24.0f * dir[e] + 0.3f * synth__normal(&st);
    }
    for (h = 0; h < sy->g; h++) {
        float *q = sy->queries + (size_t)h * d;
        for (i = 0; i < d; i++) q[i] = 2.0f * dir[i] + 0.05f * synth__normal(&st);
    }
    /* sort needles ascending (tiny insertion sort) */
    for (i = 1; i < sy->n_needles; i++)
        for (c = i; c > 0 && sy->needles[c - 1] > sy->needles[c]; c--) {
            uint32_t tmp = sy->needles[c];
            sy->needles[c] = sy->needles[c - 1];
            sy->needles[c - 1] = tmp;
        }
    free(cent);
    free(dir);
    return 0;
}

#endif
