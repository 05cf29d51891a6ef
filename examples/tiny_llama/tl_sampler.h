/* tl_sampler.h - the next token from the logits for tiny_llama: greedy,
   temperature and top-p sampling, and the random generator they use.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file. */
#ifndef TL_SAMPLER_H
#define TL_SAMPLER_H

/* ----------------------------------------------------------------------------
   Sampling */

typedef struct {
    int index;
    float prob;
} tl_prob_index;

typedef struct {
    int vocab_size;
    float temperature;    /* 0: greedy */
    float topp;           /* nucleus; <= 0 or >= 1: off */
    unsigned long long rng;
    tl_prob_index *buf;
} tl_sampler;

unsigned long long tl_rng_seed(unsigned long long seed);
unsigned long long tl_rng_next(unsigned long long *state);
float tl_rng_float(unsigned long long *state);   /* uniform in [0, 1) */
int tl_argmax(const float *x, int n);
int tl_build_sampler(tl_sampler *sp, int vocab_size, float temperature, float topp,
                     unsigned long long seed);
void tl_free_sampler(tl_sampler *sp);
/* Picks the next token; overwrites logits with probabilities. */
int tl_sample(tl_sampler *sp, float *logits);

#endif /* TL_SAMPLER_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_SAMPLER_IMPLEMENTED)
#define TL_SAMPLER_IMPLEMENTED

/* ----------------------------------------------------------------------------
   Sampling */

unsigned long long tl_rng_seed(unsigned long long seed)
{
    /* splitmix64 finaliser: spreads any seed into a non-zero xorshift state */
    unsigned long long z = seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z ? z : 0x2545F4914F6CDD1Dull;
}

unsigned long long tl_rng_next(unsigned long long *state)
{
    /* xorshift64* */
    unsigned long long x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

float tl_rng_float(unsigned long long *state)
{
    return (float)(tl_rng_next(state) >> 40) / 16777216.0f;
}

int tl_argmax(const float *x, int n)
{
    int i, best = 0;
    for (i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

int tl_build_sampler(tl_sampler *sp, int vocab_size, float temperature, float topp,
                     unsigned long long seed)
{
    sp->vocab_size = vocab_size;
    sp->temperature = temperature;
    sp->topp = topp;
    sp->rng = tl_rng_seed(seed);
    sp->buf = (tl_prob_index *)malloc((size_t)vocab_size * sizeof(tl_prob_index));
    return sp->buf ? 0 : -1;
}

void tl_free_sampler(tl_sampler *sp)
{
    free(sp->buf);
    sp->buf = NULL;
}

static int tl__by_prob_desc(const void *a, const void *b)
{
    float pa = ((const tl_prob_index *)a)->prob, pb = ((const tl_prob_index *)b)->prob;
    return pa > pb ? -1 : pa < pb ? 1 : 0;
}

int tl_sample(tl_sampler *sp, float *logits)
{
    int n = sp->vocab_size, i, m = 0;
    float coin, cum = 0.0f;
    if (sp->temperature == 0.0f)
        return tl_argmax(logits, n);
    for (i = 0; i < n; i++)
        logits[i] /= sp->temperature;
    tl_softmax(logits, n);
    coin = tl_rng_float(&sp->rng);
    if (sp->topp <= 0.0f || sp->topp >= 1.0f || n < 2) {
        for (i = 0; i < n; i++) {
            cum += logits[i];
            if (coin < cum)
                return i;
        }
        return n - 1;   /* rounding */
    }
    /* Nucleus: the fewest most-likely tokens whose mass exceeds topp. A token
       below (1 - topp) / (n - 1) can never be needed (all the others together
       would already exceed topp), so only the rest is sorted. */
    {
        float floor_p = (1.0f - sp->topp) / (float)(n - 1), total = 0.0f, r;
        int last;
        for (i = 0; i < n; i++)
            if (logits[i] >= floor_p) {
                sp->buf[m].index = i;
                sp->buf[m].prob = logits[i];
                m++;
            }
        if (m == 0)
            return tl_argmax(logits, n);
        qsort(sp->buf, (size_t)m, sizeof(tl_prob_index), tl__by_prob_desc);
        last = m - 1;
        for (i = 0; i < m; i++) {
            total += sp->buf[i].prob;
            if (total > sp->topp) {
                last = i;
                break;
            }
        }
        r = coin * total;
        cum = 0.0f;
        for (i = 0; i <= last; i++) {
            cum += sp->buf[i].prob;
            if (r < cum)
                return sp->buf[i].index;
        }
        return sp->buf[last].index;
    }
}

#endif /* TL_SAMPLER implementation */
