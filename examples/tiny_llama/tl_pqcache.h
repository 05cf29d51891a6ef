/* tl_pqcache.h - the pqcache attention mode of tiny_llama.

   The engine's forward stages (tiny_llama.h) as the callbacks of pqcache's
   driver (pqcache.h, "Driver"), a pair per phase:

     prefill  pqc_driver_prefill runs the prompt layer by layer (layer-major)
              with tlpq__prefill_qkv and tlpq__prefill_attend. The hidden
              states of all prompt tokens are kept; per layer qkv computes
              every token's query, key and value (tl_layer_qkv_batch: the
              projections as matrix-matrix products over blocks of 128 tokens,
              their rows split over the state's threads), the library stores
              the keys and values and starts that layer's PQ build in the
              background, and attend runs full causal attention over the rows
              the library hands back (tl_attend_prompt's arithmetic: tiled, or
              the decode step's with exact_prefill; chunks of tokens split over
              the threads), then wo, residual and FFN per chunk
              (tl_layer_out_ffn_batch). The RoPE layout handed to the library
              is the model's: interleaved for llama2.c checkpoints, half-split
              (PQC_ROPE_HALF) for Hugging Face models. The last layer's
              attention and FFN only matter for the last token (the logits);
              the other tokens skip them unless all_outputs is set. Keys,
              values and the logits are those of token-by-token full
              attention, to the bit with exact_prefill.
     decode   pqc_driver_decode per token with tlpq__decode_qkv and
              tlpq__decode_attend: qkv of the new token, the library appends
              it, selects sinks + top-k (PQ search) + the recent window,
              gathers those rows through its block cache, and attend runs the
              engine's attention over them (tl_layer_attention with explicit
              rows), wo, residual, FFN. The example's README shows them.

   Hybrid models (Gemma 3): the library serves the global layers; the local,
   sliding-window layers run between them inside the same callbacks, over rings
   of their window that the engine keeps.

   The engine holds no KV cache of its own in this mode: keys and values live
   in the library (tl_build_state_ex with TL_STATE_NO_KV_CACHE).

   Use: in exactly one file, after TINY_LLAMA_IMPLEMENTATION's include,
       #define TL_PQCACHE_IMPLEMENTATION
       #include "tl_pqcache.h"
   The implementation of pqcache.h itself is compiled there too unless
   TL_PQCACHE_NO_LIBRARY_IMPLEMENTATION is defined. Link with -lm -lpthread
   (and -ldl on glibc older than 2.34). */
#ifndef TL_PQCACHE_H
#define TL_PQCACHE_H

#if defined(TL_PQCACHE_IMPLEMENTATION) && !defined(TL_PQCACHE_NO_LIBRARY_IMPLEMENTATION)
#define PQCACHE_IMPLEMENTATION
#endif
#include "../../pqcache.h"
#include "tiny_llama.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library's rule throughout: 0 = the library's default, negative = none. */
typedef struct {
    int pq_m;              /* PQ sub-spaces (divides head_size) */
    int pq_bits;           /* bits per code, 1..8 */
    int iters;             /* k-means iterations; 0 = the adaptive scheduler */
    int n_sink;            /* sink tokens; -1 = none */
    float ratio;           /* budget ratio: attended beyond the sinks = ratio * (n - sinks) */
    int cache_blocks;      /* block-cache blocks per layer and KV head; -1 = none */
    int block_tokens;      /* tokens per block */
    pqc_policy policy;     /* block-cache eviction: PQC_POLICY_LFU (default) or LRU */
    int n_threads;         /* prefill threads and the library's pool workers; default 1 */
    unsigned long long seed; /* k-means seed */
    int all_outputs;       /* 1: run the last layer for every prompt token, not just the last */
    int backend;           /* device tier: PQC_BACKEND_CPU (default), AUTO or CUDA */
    int metric;            /* PQC_METRIC_QUERY (default: codebooks under the observed queries'
                              second moments per band), PQC_METRIC_QUERY_DIAG (their mean
                              square per dim) or PQC_METRIC_L2 (plain PQ) */
    int split;             /* PQC_SPLIT_COMPETE (default), PQC_SPLIT_FIXED, PQC_SPLIT_ADAPTIVE or
                              PQC_SPLIT_FIXED_COMPETE */
    int exact_prefill;     /* 1: the prompt's attention with the decode step's arithmetic, to
                              the bit (tl_state.exact_prefill); 0: tiled, equal to rounding */
    double rerank;         /* each head's PQ top rerank x k scored again exactly (default
                              1.5); -1: the PQ top-k alone (plain PQ) */
    double rerank_max;     /* the most a head's build may raise that to from the observed
                              queries (default 6); -1: none */
} tlpq_config;

/* Called from the prefill after every chunk of tokens: layer (0-based), tokens of
   that layer done so far, tokens to do. */
typedef void (*tlpq_progress_fn)(void *user, int layer, int n_layers, int done, int total);

typedef struct {
    unsigned long long selects;   /* select calls, all layers */
    unsigned long long hits, misses, bytes_h2d, bytes_codes, bytes_d2h, tokens_selected;
    unsigned long long builds, rebuilds;
    int iters_min, iters_max;     /* k-means iterations of the last build, over layers */
    double select_s, fetch_s, build_s, wait_s;
    size_t device_bytes, full_bytes;  /* pqc_cache_memory */
    int window;                   /* the library's recent window */
    /* the split of a decode step at the sequence's current length (n_tokens), as the
       library resolves it: sinks, then the budget beyond them (budget_tokens, or
       ceil(ratio x the rest)) as layer 0's window (at most the rest) and top-k = the
       budget beyond that window; window_min..window_max: the layers' windows (a build
       may lower one, pqc_cache_layer_window) */
    int n_tokens, sinks, step_window, top_k, window_min, window_max;
} tlpq_stats;

typedef struct {
    const tl_model *m;
    tlpq_config cfg;
    int max_tokens;
    tl_state s;                   /* the engine's state, no KV cache; its threads (n_threads)
                                     run the prefill's products and attention */
    int n_threads;                /* s's threads and the library's pool workers */
    int chunk;                    /* prefill: tokens per attention chunk */
    float *hidden;                /* (n_hidden, dim) hidden states during a prefill */
    int n_hidden;                 /* prompt tokens of the prefill under way, 0 outside one */
    float *heads;                 /* (TLPQ__CHUNK, q_dim): a chunk's attention outputs */
    float *att;                   /* (n_threads, att_per_part): the chunk's attention scratch */
    size_t att_per_part;
    pqc_runtime *rt;
    pqc_scheduler *sched;
    int borrowed;                 /* rt and sched belong to the tlpq this one was forked from */
    pqc_cache *cache;
    pqc_engine prefill_engine;    /* the callbacks of pqc_driver_prefill */
    pqc_engine decode_engine;     /* and of pqc_driver_decode */
    tlpq_progress_fn progress;
    void *progress_user;
    char err[TL_ERR_LEN];
    /* hybrid models: the library serves the global layers only (its layer i is the
       model's layer gl[i]); the local layers keep their last `window` keys and values in
       rings of the engine's own */
    int n_lib;                    /* the library's layers: the model's global layers */
    int *gl;                      /* (n_lib) model layer of each library layer */
    int *ring_of;                 /* (n_layers) ring of a local layer, -1 for a global one */
    int window;                   /* the local layers' window, 0 without local layers */
    float *ring, *stage;          /* (n_local, 2, window, kv_dim): keys then values, position
                                     pos in row pos % window; a prefill fills stage, then
                                     swaps */
    const void **ring_rows;       /* (n_kv_heads, 2, window): a decode step's row pointers */
    float *lq, *latt;             /* local prefill scratch: a chunk's queries, the attention
                                     of s's threads */
    float *lk, *lv;               /* local prefill: (window - 1 + prompt, kv_dim) */
} tlpq;

void tlpq_default_config(tlpq_config *cfg);
/* max_tokens: positions the sequence may reach (prompt + decode steps). */
int tlpq_create(tlpq *p, const tl_model *m, int max_tokens, const tlpq_config *cfg,
                char *err, size_t errlen);
void tlpq_destroy(tlpq *p);
/* A second sequence over src's tokens so far, as a second request over the same
   document: its cache is a fork of src's (pqc_cache_fork: the stored keys and values
   are shared, not copied, and no PQ build runs), on src's runtime and scheduler, so
   src must outlive it. */
int tlpq_fork(tlpq *dst, tlpq *src, char *err, size_t errlen);
/* Prefills tokens[0..n-1] at positions from the current length on (0 for a new
   sequence) through pqc_driver_prefill. Returns the logits of the last token,
   or NULL with p->err set. */
float *tlpq_prefill(tlpq *p, const int *tokens, int n);
/* One decode step through pqc_driver_decode; pos must be the current length.
   Returns the logits, or NULL with p->err set. */
float *tlpq_decode(tlpq *p, int token, int pos);
/* Copies the stored keys and values of positions 0..n-1 into an engine state's
   KV cache (to start a full-attention reference from the same prefill). A hybrid
   model's local layers hold only their window: n must then be the sequence's
   length, and only the window's positions of those layers are copied (the only
   ones a later step reads). */
int tlpq_copy_kv(tlpq *p, tl_state *dst, int n);
/* Hands the first n stored positions of src (every layer's keys and values) to a
   new dst through pqc_cache_prefill, without running the model: a second
   configuration over the same prompt (its observations are not copied, so a
   query-weighted metric falls back to plain codebooks). dst must be empty; with
   local layers n must be src's length (their windows are copied as they are). */
int tlpq_prefill_from(tlpq *dst, tlpq *src, int n);
void tlpq_get_stats(const tlpq *p, tlpq_stats *st);
/* "m=2 bits=6 T=adaptive ..." */
void tlpq_describe(const tlpq *p, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* TL_PQCACHE_H */

/* ============================================================================
   Implementation */

#if defined(TL_PQCACHE_IMPLEMENTATION) && !defined(TL_PQCACHE_IMPLEMENTED)
#define TL_PQCACHE_IMPLEMENTED

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TLPQ__MAX_THREADS 64
#define TLPQ__CHUNK 128                     /* prefill: tokens per block of the products and
                                               per attention chunk */
#define TLPQ__ATT_FLOATS (16u * 1024u * 1024u) /* attention scratch cap per thread (exact
                                                  prefill: chunks shrink to stay below it) */

/* errors go through the engine's tl__fail (its implementation is in this file) */

/* Every setting the library's default (tlpq_describe says what it resolves to), one thread. */
void tlpq_default_config(tlpq_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->n_threads = 1;
}

/* ----------------------------------------------------------------------------
   Local layers of a hybrid model: the engine's own, over rings of their window */

/* Row of position pos (keys: which 0, values: 1) of ring r in base (p->ring or p->stage). */
static float *tlpq__ring_row(const tlpq *p, float *base, int r, int which, size_t pos)
{
    size_t w = (size_t)p->window;
    return base + (((size_t)r * 2 + (size_t)which) * w + pos % w) * (size_t)p->m->config.kv_dim;
}

/* Local layer l over the prompt's n tokens at pos0, layer-major as the driver runs the
   global ones: keys and values into lk, lv after the window's earlier rows (from the
   ring), attention over the window by chunks, wo, residual and FFN; the window's last
   rows go to the stage. */
static int tlpq__local_prefill(tlpq *p, int l, size_t pos0, size_t n)
{
    const tl_config *c = &p->m->config;
    size_t kv = (size_t)c->kv_dim, dim = (size_t)c->dim, w = (size_t)p->window, hs = (size_t)c->head_size;
    size_t prior = pos0 < w - 1 ? pos0 : w - 1, b0, nb, i;
    int r = p->ring_of[l], g, parts = p->s.pool ? ((tl__pool *)p->s.pool)->n : 1;
    const float **kp = (const float **)p->ring_rows, **vp = kp + c->n_kv_heads;
    for (i = 0; i < prior; i++) {
        memcpy(p->lk + i * kv, tlpq__ring_row(p, p->ring, r, 0, pos0 - prior + i), kv * sizeof(float));
        memcpy(p->lv + i * kv, tlpq__ring_row(p, p->ring, r, 1, pos0 - prior + i), kv * sizeof(float));
    }
    for (b0 = 0; b0 < n; b0 += nb) {
        size_t cur = prior + b0, base = cur > w - 1 ? cur - (w - 1) : 0;
        tl__causal_job j;
        nb = n - b0 < TLPQ__CHUNK ? n - b0 : TLPQ__CHUNK;
        if (tl_layer_qkv_batch(p->m, &p->s, l, (int)(pos0 + b0), (int)nb, p->hidden + b0 * dim, p->lq,
                               p->lk + cur * kv, p->lv + cur * kv))
            return tl__fail(p->err, sizeof p->err, "local layer %d: out of memory", l);
        for (g = 0; g < c->n_kv_heads; g++) {   /* rows from the window's first on */
            kp[g] = p->lk + base * kv + (size_t)g * hs;
            vp[g] = p->lv + base * kv + (size_t)g * hs;
        }
        j.c = c;
        j.pos0 = (int)(cur - base);
        j.n = (int)nb;
        j.window = (int)w;
        j.q = p->lq;
        j.k = kp;
        j.v = vp;
        j.stride = kv;
        j.att = p->latt;
        j.out = p->heads;
        j.att_per_part = tl_attend_prompt_work(c, p->s.exact_prefill, (TLPQ__CHUNK + parts - 1) / parts,
                                               (int)(w - 1 + TLPQ__CHUNK));
        j.exact = p->s.exact_prefill;
        j.origin = (int)(pos0 - prior + base);   /* lk's row 0 holds position pos0 - prior */
        j.tiles = NULL;
        tl_parallel(&p->s, tl__causal_part, &j);
        if (tl_layer_out_ffn_batch(p->m, &p->s, l, (int)nb, p->hidden + b0 * dim, p->heads))
            return tl__fail(p->err, sizeof p->err, "local layer %d: out of memory", l);
    }
    for (i = prior + n > w ? prior + n - w : 0; i < prior + n; i++) {
        memcpy(tlpq__ring_row(p, p->stage, r, 0, pos0 - prior + i), p->lk + i * kv, kv * sizeof(float));
        memcpy(tlpq__ring_row(p, p->stage, r, 1, pos0 - prior + i), p->lv + i * kv, kv * sizeof(float));
    }
    return 0;
}

/* Local layer l for the token at pos: its key and value into the ring, attention over
   the window's rows in place (ascending positions, as full attention reads them). */
static void tlpq__local_decode(tlpq *p, int l, size_t pos)
{
    const tl_config *c = &p->m->config;
    size_t w = (size_t)p->window, hs = (size_t)c->head_size, first = pos + 1 > w ? pos + 1 - w : 0, i;
    int r = p->ring_of[l], g;
    tl_layer_qkv_rows(p->m, &p->s, l, (int)pos, tlpq__ring_row(p, p->ring, r, 0, pos),
                      tlpq__ring_row(p, p->ring, r, 1, pos));
    for (g = 0; g < c->n_kv_heads; g++) {
        tl_kv_list *lst = &p->s.lists[g];
        const void **rows = p->ring_rows + (size_t)g * 2 * w;
        for (i = first; i <= pos; i++) {
            lst->pos[i - first] = (int)i;
            rows[i - first] = tlpq__ring_row(p, p->ring, r, 0, i) + (size_t)g * hs;
            rows[w + i - first] = tlpq__ring_row(p, p->ring, r, 1, i) + (size_t)g * hs;
        }
        lst->n = (int)(pos + 1 - first);
        lst->k = lst->v = NULL;
        lst->krow = rows;
        lst->vrow = rows + w;
    }
    tl_layer_attention(p->m, &p->s, l, p->s.lists);
    tl_layer_ffn(p->m, &p->s, l);
}

static int tlpq__check_view(tlpq *p, const pqc_kv_view *kv)
{
    const tl_config *c = &p->m->config;
    if (kv->dtype != PQC_F32 || kv->n_kv_heads != c->n_kv_heads || kv->head_dim != c->head_size)
        return tl__fail(p->err, sizeof p->err, "attend: K/V view of %d heads x %d (dtype %d), "
                          "expected %d x %d fp32", kv->n_kv_heads, kv->head_dim, (int)kv->dtype,
                          c->n_kv_heads, c->head_size);
    return 0;
}

/* ----------------------------------------------------------------------------
   Prefill callbacks (pqc_driver_prefill): every prompt token of a layer at once.
   The library's layer lib_layer is the model's gl[lib_layer]; on a hybrid model qkv
   first runs the local layers before it, and the last global layer's attend the local
   layers after it (inside the driver's call, so that a failure there undoes the call). */

/* qkv: the projections as matrix products over blocks of tokens, rows split over s's
   threads */
static int tlpq__prefill_qkv(void *user, int lib_layer, size_t pos0, size_t n, float *q, float *k,
                             float *v)
{
    tlpq *p = (tlpq *)user;
    const tl_config *c = &p->m->config;
    size_t qd = (size_t)c->n_heads * (size_t)c->head_size, kv = (size_t)c->kv_dim, b0, nb;
    int l, layer = p->gl[lib_layer];
    if (n != (size_t)p->n_hidden)
        return tl__fail(p->err, sizeof p->err, "qkv: %zu tokens, expected %d", n, p->n_hidden);
    for (l = lib_layer > 0 ? p->gl[lib_layer - 1] + 1 : 0; l < layer; l++)
        if (tlpq__local_prefill(p, l, pos0, n))
            return -1;
    for (b0 = 0; b0 < n; b0 += nb) {
        nb = n - b0 < TLPQ__CHUNK ? n - b0 : TLPQ__CHUNK;
        if (tl_layer_qkv_batch(p->m, &p->s, layer, (int)(pos0 + b0), (int)nb, p->hidden + b0 * (size_t)c->dim,
                               q + b0 * qd, k + b0 * kv, v + b0 * kv))
            return tl__fail(p->err, sizeof p->err, "qkv: out of memory");
    }
    return 0;
}

/* attend: causal attention over every row the library holds (tl_attend_prompt's
   arithmetic: tiled, or the decode step's with exact_prefill), by chunks of tokens split
   over s's threads, then wo, residual and FFN per chunk. Nothing reads the other
   tokens' outputs of the model's last layer: there it runs for the last token alone,
   unless all_outputs is set. */
static int tlpq__prefill_attend(void *user, int lib_layer, size_t pos0, size_t n, const float *q,
                                const pqc_kv_view *kv)
{
    tlpq *p = (tlpq *)user;
    const tl_config *c = &p->m->config;
    size_t qd = (size_t)c->n_heads * (size_t)c->head_size, dim = (size_t)c->dim, first, c0, nb;
    int g, l, layer = p->gl[lib_layer];
    tl__causal_job j;
    tl_prefill_tiles tiles = { NULL, NULL, 0 };
    if (tlpq__check_view(p, kv) != 0)
        return -1;
    if (kv->pos != NULL || n != (size_t)p->n_hidden)
        return tl__fail(p->err, sizeof p->err, "attend: unexpected prefill view");
    for (g = 0; g < c->n_kv_heads; g++)
        if (kv->count[g] != pos0 + n)
            return tl__fail(p->err, sizeof p->err, "attend: head %d has %zu rows, expected %zu", g,
                            kv->count[g], pos0 + n);
    memset(&j, 0, sizeof j);   /* window 0, origin 0: rows from position 0 on */
    j.c = c;
    j.k = (const float *const *)kv->k;
    j.v = (const float *const *)kv->v;
    j.stride = (size_t)c->head_size;
    if (!p->s.exact_prefill) {   /* the tiled path: the rows packed once for every chunk */
        if (tl_prefill_tiles_init(&tiles, c, (int)(pos0 + n)))
            return tl__fail(p->err, sizeof p->err, "attend: out of memory");
        tl_prefill_pack(c, j.k, j.v, j.stride, 0, (int)(pos0 + n), &tiles);
        j.tiles = &tiles;
    }
    j.att = p->att;
    j.out = p->heads;
    j.att_per_part = p->att_per_part;
    j.exact = p->s.exact_prefill;
    first = !p->cfg.all_outputs && layer == c->n_layers - 1 ? n - 1 : 0;
    for (c0 = first; c0 < n; c0 += nb) {
        nb = n - c0 < (size_t)p->chunk ? n - c0 : (size_t)p->chunk;
        j.pos0 = (int)(pos0 + c0);
        j.n = (int)nb;
        j.q = q + c0 * qd;
        tl_parallel(&p->s, tl__causal_part, &j);
        if (tl_layer_out_ffn_batch(p->m, &p->s, layer, (int)nb, p->hidden + c0 * dim, p->heads)) {
            tl_prefill_tiles_free(&tiles);
            return tl__fail(p->err, sizeof p->err, "attend: out of memory");
        }
        if (p->progress)
            p->progress(p->progress_user, layer, c->n_layers, (int)(c0 + nb - first), (int)(n - first));
    }
    tl_prefill_tiles_free(&tiles);
    for (l = layer + 1; lib_layer == p->n_lib - 1 && l < c->n_layers; l++)
        if (tlpq__local_prefill(p, l, pos0, n))
            return -1;
    return 0;
}

/* ----------------------------------------------------------------------------
   Decode callbacks (pqc_driver_decode): the new token, one layer at a time. On a hybrid
   model the local layers run where the prefill's do. */

/* qkv: the new token's query, key (after RoPE) and value; the library appends k, v */
static int tlpq__decode_qkv(void *user, int lib_layer, size_t pos, size_t n, float *q, float *k, float *v)
{
    tlpq *p = (tlpq *)user;
    const tl_config *c = &p->m->config;
    int l, layer = p->gl[lib_layer];   /* the model's layer */
    if (n != 1)
        return tl__fail(p->err, sizeof p->err, "qkv: %zu tokens in a decode step", n);
    for (l = lib_layer > 0 ? p->gl[lib_layer - 1] + 1 : 0; l < layer; l++)
        tlpq__local_decode(p, l, pos);
    tl_layer_qkv_rows(p->m, &p->s, layer, (int)pos, k, v);
    memcpy(q, p->s.q, (size_t)c->n_heads * (size_t)c->head_size * sizeof(float));
    return 0;
}

/* attend: per KV head, the positions and rows the library selected */
static int tlpq__decode_attend(void *user, int lib_layer, size_t pos, size_t n, const float *q,
                               const pqc_kv_view *kv)
{
    tlpq *p = (tlpq *)user;
    const tl_config *c = &p->m->config;
    int g, l, layer = p->gl[lib_layer];
    if (tlpq__check_view(p, kv) != 0)
        return -1;
    if (n != 1 || kv->pos == NULL)
        return tl__fail(p->err, sizeof p->err, "attend: unexpected decode view");
    for (g = 0; g < c->n_kv_heads; g++) {
        tl_kv_list *lst = &p->s.lists[g];
        size_t i, cnt = kv->count[g];
        if (cnt > (size_t)p->s.ctx)
            return tl__fail(p->err, sizeof p->err, "attend: %zu rows selected", cnt);
        for (i = 0; i < cnt; i++)
            lst->pos[i] = (int)kv->pos[g][i];
        lst->n = (int)cnt;
        lst->k = (const float *)kv->k[g];
        lst->v = (const float *)kv->v[g];
        lst->krow = kv->krows ? kv->krows[g] : NULL;   /* rows in place: no copy */
        lst->vrow = kv->vrows ? kv->vrows[g] : NULL;
    }
    memcpy(p->s.q, q, (size_t)c->n_heads * (size_t)c->head_size * sizeof(float));
    tl_layer_attention(p->m, &p->s, layer, p->s.lists);   /* attention, wo, residual */
    tl_layer_ffn(p->m, &p->s, layer);
    for (l = layer + 1; lib_layer == p->n_lib - 1 && l < c->n_layers; l++)
        tlpq__local_decode(p, l, pos);
    return 0;
}

/* ----------------------------------------------------------------------------
   Life cycle */

void tlpq_destroy(tlpq *p)
{
    pqc_cache_destroy(p->cache);
    if (!p->borrowed) {
        pqc_scheduler_destroy(p->sched);
        pqc_runtime_destroy(p->rt);
    }
    free(p->hidden);
    free(p->heads);
    free(p->att);
    free(p->gl);
    free(p->ring_of);
    free(p->ring);
    free(p->stage);
    free((void *)p->ring_rows);
    free(p->lq);
    free(p->latt);
    free(p->lk);
    free(p->lv);
    tl_free_state(&p->s);
    memset(p, 0, sizeof *p);
}

/* The layer map of a hybrid model (every layer global otherwise) and the local layers'
   rings and prefill scratch. */
static int tlpq__layers_init(tlpq *p, char *err, size_t errlen)
{
    const tl_config *c = &p->m->config;
    int l, n_local = 0, parts = p->n_threads;
    size_t w, kv = (size_t)c->kv_dim, qd = (size_t)c->n_heads * (size_t)c->head_size, ring;
    p->gl = (int *)malloc((size_t)c->n_layers * sizeof(int));
    p->ring_of = (int *)malloc((size_t)c->n_layers * sizeof(int));
    if (!p->gl || !p->ring_of)
        return tl__fail(err, errlen, "pqcache: out of memory");
    for (l = 0; l < c->n_layers; l++) {
        p->ring_of[l] = tl_layer_window(c, l) > 0 ? n_local++ : -1;
        if (p->ring_of[l] < 0)
            p->gl[p->n_lib++] = l;
    }
    if (p->n_lib == 0)
        return tl__fail(err, errlen, "pqcache: every layer of this model attends to a sliding window; "
                        "there is no full-attention layer for the library to serve");
    if (n_local == 0)
        return 0;
    p->window = c->sliding_window;
    w = (size_t)p->window;
    ring = (size_t)n_local * 2 * w * kv;
    p->ring = (float *)calloc(ring, sizeof(float));
    p->stage = (float *)calloc(ring, sizeof(float));
    p->ring_rows = (const void **)calloc((size_t)c->n_kv_heads * 2 * w, sizeof(void *));
    p->lq = (float *)malloc((size_t)TLPQ__CHUNK * qd * sizeof(float));
    p->latt = (float *)malloc((size_t)parts * tl_attend_prompt_work(c, p->s.exact_prefill,
                              (TLPQ__CHUNK + parts - 1) / parts, (int)(w - 1 + TLPQ__CHUNK)) * sizeof(float));
    if (!p->ring || !p->stage || !p->ring_rows || !p->lq || !p->latt)
        return tl__fail(err, errlen, "pqcache: out of memory for the local layers' windows");
    return 0;
}

/* The engine side of a tlpq: its state (and threads), the prefill's scratch, the
   callbacks of each phase. */
static int tlpq__engine_init(tlpq *p, const tl_model *m, int max_tokens, const tlpq_config *cfg,
                             char *err, size_t errlen)
{
    const tl_config *c = &m->config;
    int parts;

    memset(p, 0, sizeof *p);
    if (max_tokens < 1 || max_tokens > c->seq_len)
        return tl__fail(err, errlen, "pqcache: %d positions (the model holds 1..%d)",
                          max_tokens, c->seq_len);
    if (!(cfg->ratio >= 0.0f))
        return tl__fail(err, errlen, "pqcache: the budget ratio must be positive (0: the library's)");
    p->m = m;
    p->cfg = *cfg;
    p->max_tokens = max_tokens;
    p->n_threads = cfg->n_threads < 1 ? 1 : cfg->n_threads > TLPQ__MAX_THREADS ?
                   TLPQ__MAX_THREADS : cfg->n_threads;
    if (tl_build_state_ex(&p->s, c, max_tokens, p->n_threads, TL_STATE_NO_KV_CACHE, err, errlen))
        return -1;
    p->s.exact_prefill = cfg->exact_prefill != 0;
    parts = p->s.pool ? ((tl__pool *)p->s.pool)->n : 1;
    for (p->chunk = TLPQ__CHUNK;; p->chunk /= 2) {   /* the exact prefill's scratch grows with
                                                      the context: fewer tokens per chunk */
        p->att_per_part = tl_attend_prompt_work(c, p->s.exact_prefill, (p->chunk + parts - 1) / parts,
                                                max_tokens);
        if (p->att_per_part <= TLPQ__ATT_FLOATS || p->chunk <= parts)
            break;
    }
    p->heads = (float *)malloc((size_t)TLPQ__CHUNK * (size_t)c->n_heads * (size_t)c->head_size *
                               sizeof(float));
    p->att = (float *)malloc((size_t)parts * p->att_per_part * sizeof(float));
    if (!p->heads || !p->att) {
        tlpq_destroy(p);
        return tl__fail(err, errlen, "pqcache: out of memory for the prefill's attention");
    }
    if (tlpq__layers_init(p, err, errlen)) {
        tlpq_destroy(p);
        return -1;
    }
    p->prefill_engine.user = p;
    p->prefill_engine.qkv = tlpq__prefill_qkv;
    p->prefill_engine.attend = tlpq__prefill_attend;
    p->decode_engine.user = p;
    p->decode_engine.qkv = tlpq__decode_qkv;
    p->decode_engine.attend = tlpq__decode_attend;
    p->decode_engine.accepts_row_pointers = 1;   /* attend may read the rows in place */
    return 0;
}

int tlpq_fork(tlpq *dst, tlpq *src, char *err, size_t errlen)
{
    if (tlpq__engine_init(dst, src->m, src->max_tokens, &src->cfg, err, errlen))
        return -1;
    dst->rt = src->rt;
    dst->sched = src->sched;
    dst->borrowed = 1;
    if (src->ring)   /* the local layers' windows, as src holds them */
        memcpy(dst->ring, src->ring, (size_t)(src->m->config.n_layers - src->n_lib) * 2 * (size_t)src->window *
                                         (size_t)src->m->config.kv_dim * sizeof(float));
    if (pqc_cache_fork(src->cache, &dst->cache) != PQC_SUCCESS) {
        tl__fail(err, errlen, "pqcache fork: %s", pqc_last_error());
        tlpq_destroy(dst);
        return -1;
    }
    return 0;
}

int tlpq_create(tlpq *p, const tl_model *m, int max_tokens, const tlpq_config *cfg,
                char *err, size_t errlen)
{
    const tl_config *c = &m->config;
    pqc_runtime_desc rd;
    pqc_scheduler_desc sd;
    pqc_cache_desc cd;
    pqc_result r;

    if (tlpq__engine_init(p, m, max_tokens, cfg, err, errlen))
        return -1;
    memset(&rd, 0, sizeof rd);
    rd.n_threads = p->n_threads;
    rd.backend = cfg->backend;
    if ((r = pqc_runtime_create(&rd, &p->rt)) != PQC_SUCCESS) {
        tl__fail(err, errlen, "pqcache runtime: %s", pqc_last_error());
        tlpq_destroy(p);
        return -1;
    }
    if (cfg->iters == 0) {
        memset(&sd, 0, sizeof sd);
        sd.parallel = (double)p->n_threads;
        if ((r = pqc_scheduler_create(&sd, &p->sched)) != PQC_SUCCESS) {
            tl__fail(err, errlen, "pqcache scheduler: %s", pqc_last_error());
            tlpq_destroy(p);
            return -1;
        }
    }
    memset(&cd, 0, sizeof cd);
    cd.n_layers = p->n_lib;   /* the global layers: every layer of a model without local ones */
    cd.n_kv_heads = c->n_kv_heads;
    cd.n_q_heads = c->n_heads;
    cd.head_dim = c->head_size;
    cd.kv_dtype = PQC_F32;
    cd.max_tokens = (size_t)max_tokens;
    cd.n_sink = cfg->n_sink;
    cd.budget_ratio = (double)cfg->ratio;
    cd.pq.m = cfg->pq_m;
    cd.pq.bits = cfg->pq_bits;
    cd.pq.iters = cfg->iters;
    cd.pq.seed = cfg->seed;
    /* llama2.c's RoPE: pair i = dims (2i, 2i+1); Hugging Face models' rotate_half:
       pair i = dims (i, i + head_dim/2) */
    cd.pq.rope = c->rope_layout == TL_ROPE_HALF ? PQC_ROPE_HALF : PQC_ROPE_INTERLEAVED;
    cd.block_tokens = cfg->block_tokens;
    cd.cache_blocks = cfg->cache_blocks;
    cd.policy = cfg->policy;
    cd.metric = (pqc_metric)cfg->metric;
    cd.split = (pqc_split)cfg->split;
    cd.rerank = cfg->rerank;
    cd.rerank_max = cfg->rerank_max;
    cd.softmax_scale = tl_attn_scale(c); /* the model's (Gemma: query_pre_attn_scalar^-0.5) */
    cd.scheduler = p->sched;
    if ((r = pqc_cache_create(p->rt, &cd, &p->cache)) != PQC_SUCCESS) {
        tl__fail(err, errlen, "pqcache: %s", pqc_last_error());
        tlpq_destroy(p);
        return -1;
    }
    return 0;
}

/* ----------------------------------------------------------------------------
   Prefill and decode */

float *tlpq_prefill(tlpq *p, const int *tokens, int n)
{
    const tl_config *c = &p->m->config;
    size_t pos0 = pqc_cache_tokens(p->cache, 0), dim = (size_t)c->dim;
    pqc_result r;
    int t;
    p->err[0] = '\0';
    if (n < 1 || pos0 + (size_t)n > (size_t)p->max_tokens) {
        tl__fail(p->err, sizeof p->err, "prefill of %d tokens at %zu: capacity is %d",
                   n, pos0, p->max_tokens);
        return NULL;
    }
    for (t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= c->vocab_size) {
            tl__fail(p->err, sizeof p->err, "token %d is outside the vocabulary (0..%d)",
                       tokens[t], c->vocab_size - 1);
            return NULL;
        }
    free(p->hidden);
    free(p->lk);
    free(p->lv);
    p->lk = p->lv = NULL;
    p->hidden = (float *)malloc((size_t)n * dim * sizeof(float));
    if (p->window) {   /* the local layers' keys and values: the window's earlier rows, the prompt's */
        p->lk = (float *)malloc(((size_t)p->window - 1 + (size_t)n) * (size_t)c->kv_dim * sizeof(float));
        p->lv = (float *)malloc(((size_t)p->window - 1 + (size_t)n) * (size_t)c->kv_dim * sizeof(float));
    }
    if (!p->hidden || (p->window && (!p->lk || !p->lv))) {
        tl__fail(p->err, sizeof p->err, "out of memory for %d hidden states", n);
        return NULL;
    }
    for (t = 0; t < n; t++) {
        tl_embed(p->m, &p->s, tokens[t]);
        memcpy(p->hidden + (size_t)t * dim, p->s.x, dim * sizeof(float));
    }
    p->n_hidden = n;
    r = pqc_driver_prefill(p->cache, &p->prefill_engine, pos0, (size_t)n);
    p->n_hidden = 0;
    if (r != PQC_SUCCESS) {
        if (!p->err[0])
            tl__fail(p->err, sizeof p->err, "pqcache prefill: %s", pqc_last_error());
        return NULL;
    }
    if (p->window) {   /* the local layers' windows as the prompt left them */
        float *t = p->ring;
        p->ring = p->stage;
        p->stage = t;
    }
    memcpy(p->s.x, p->hidden + (size_t)(n - 1) * dim, dim * sizeof(float));
    free(p->hidden);
    free(p->lk);
    free(p->lv);
    p->hidden = p->lk = p->lv = NULL;
    return tl_classify(p->m, &p->s);
}

float *tlpq_decode(tlpq *p, int token, int pos)
{
    const tl_config *c = &p->m->config;
    pqc_result r;
    p->err[0] = '\0';
    if (token < 0 || token >= c->vocab_size) {
        tl__fail(p->err, sizeof p->err, "token %d is outside the vocabulary (0..%d)",
                   token, c->vocab_size - 1);
        return NULL;
    }
    if (pos < 1 || pos >= p->max_tokens || (size_t)pos != pqc_cache_tokens(p->cache, 0)) {
        tl__fail(p->err, sizeof p->err, "decode at position %d: the sequence holds %zu "
                   "of at most %d", pos, pqc_cache_tokens(p->cache, 0), p->max_tokens);
        return NULL;
    }
    tl_embed(p->m, &p->s, token);
    r = pqc_driver_decode(p->cache, &p->decode_engine, (size_t)pos);
    if (r != PQC_SUCCESS) {
        if (!p->err[0])
            tl__fail(p->err, sizeof p->err, "pqcache decode: %s", pqc_last_error());
        return NULL;
    }
    return tl_classify(p->m, &p->s);
}

/* The fp32 key and value rows 0..n-1 the library stores for (layer l, KV head h), row
   pos at + pos * head_size; -1 when it holds no such rows. */
static int tlpq__stored_rows(const tlpq *p, int l, int h, int n, const float **k, const float **v)
{
    const void *kp = NULL, *vp = NULL;
    size_t tokens = 0;
    pqc_dtype dt = PQC_F32;
    if (pqc_cache_kv(p->cache, l, h, &kp, &vp, &tokens, &dt) != PQC_SUCCESS || dt != PQC_F32 ||
        tokens < (size_t)n || (n > 0 && (!kp || !vp)))
        return -1;
    *k = (const float *)kp;
    *v = (const float *)vp;
    return 0;
}

/* The local layers' windows at length n into dst's KV cache (n must be the length). */
static int tlpq__copy_rings(tlpq *p, tl_state *dst, int n)
{
    const tl_config *c = &p->m->config;
    int l, pos;
    if ((size_t)n != pqc_cache_tokens(p->cache, 0))
        return tl__fail(p->err, sizeof p->err, "copy of %d positions: the local layers hold the window of "
                        "the sequence's %zu", n, pqc_cache_tokens(p->cache, 0));
    for (l = 0; l < c->n_layers; l++)
        for (pos = n > p->window ? n - p->window : 0; p->ring_of[l] >= 0 && pos < n; pos++) {
            memcpy(tl_key_row(c, dst, l, pos), tlpq__ring_row(p, p->ring, p->ring_of[l], 0, (size_t)pos),
                   (size_t)c->kv_dim * sizeof(float));
            memcpy(tl_value_row(c, dst, l, pos), tlpq__ring_row(p, p->ring, p->ring_of[l], 1, (size_t)pos),
                   (size_t)c->kv_dim * sizeof(float));
        }
    return 0;
}

int tlpq_copy_kv(tlpq *p, tl_state *dst, int n)
{
    const tl_config *c = &p->m->config;
    int i, l, h, pos, hs = c->head_size;
    if (n > dst->ctx || !dst->key_cache)
        return tl__fail(p->err, sizeof p->err, "copy of %d positions into a state of %d%s",
                          n, dst->ctx, dst->key_cache ? "" : " without a KV cache");
    if (p->window && tlpq__copy_rings(p, dst, n))
        return -1;
    for (i = 0; i < p->n_lib; i++)
        for (h = 0, l = p->gl[i]; h < c->n_kv_heads; h++) {
            const float *k = NULL, *v = NULL;
            if (tlpq__stored_rows(p, i, h, n, &k, &v))
                return tl__fail(p->err, sizeof p->err, "pqcache holds no fp32 rows 0..%d "
                                  "of layer %d head %d", n - 1, l, h);
            for (pos = 0; pos < n; pos++) {
                memcpy(tl_key_row(c, dst, l, pos) + (size_t)h * (size_t)hs, k + (size_t)pos * (size_t)hs,
                       (size_t)hs * sizeof(float));
                memcpy(tl_value_row(c, dst, l, pos) + (size_t)h * (size_t)hs, v + (size_t)pos * (size_t)hs,
                       (size_t)hs * sizeof(float));
            }
        }
    return 0;
}

int tlpq_prefill_from(tlpq *dst, tlpq *src, int n)
{
    const tl_config *c = &src->m->config;
    size_t hs = (size_t)c->head_size, kvd = hs * (size_t)c->n_kv_heads;
    float *kb = NULL, *vb = NULL;
    int l, h, pos, rc = 0;
    if (dst->m != src->m || n < 1 || n > dst->max_tokens || pqc_cache_tokens(dst->cache, 0) != 0)
        return tl__fail(dst->err, sizeof dst->err, "prefill_from: %d positions into a cache of %d "
                        "(it must be empty and of the same model)", n, dst->max_tokens);
    if (src->window && (size_t)n != pqc_cache_tokens(src->cache, 0))
        return tl__fail(dst->err, sizeof dst->err, "prefill_from: %d positions of %zu; the local layers hold "
                        "the window of the sequence's length", n, pqc_cache_tokens(src->cache, 0));
    kb = (float *)malloc((size_t)n * kvd * sizeof(float));
    vb = (float *)malloc((size_t)n * kvd * sizeof(float));
    if (!kb || !vb) {
        rc = tl__fail(dst->err, sizeof dst->err, "prefill_from: out of memory");
        goto done;
    }
    if (src->window)
        memcpy(dst->ring, src->ring, (size_t)(c->n_layers - src->n_lib) * 2 * (size_t)src->window * kvd *
                                         sizeof(float));
    for (l = 0; l < src->n_lib && rc == 0; l++) {
        pqc_matrix km, vm;
        pqc_result r;
        for (h = 0; h < c->n_kv_heads; h++) {
            const float *k = NULL, *v = NULL;
            if (tlpq__stored_rows(src, l, h, n, &k, &v)) {
                rc = tl__fail(dst->err, sizeof dst->err, "prefill_from: the source holds no fp32 "
                              "rows 0..%d of layer %d head %d", n - 1, l, h);
                goto done;
            }
            for (pos = 0; pos < n; pos++) {
                memcpy(kb + (size_t)pos * kvd + (size_t)h * hs, k + (size_t)pos * hs, hs * sizeof(float));
                memcpy(vb + (size_t)pos * kvd + (size_t)h * hs, v + (size_t)pos * hs, hs * sizeof(float));
            }
        }
        memset(&km, 0, sizeof km);
        km.data = kb;
        km.dtype = PQC_F32;
        km.rows = (size_t)n;
        km.cols = kvd;
        vm = km;
        vm.data = vb;
        if ((r = pqc_cache_prefill(dst->cache, l, &km, &vm)) != PQC_SUCCESS)
            rc = tl__fail(dst->err, sizeof dst->err, "prefill_from, layer %d: %s", l, pqc_last_error());
    }
done:
    free(kb);
    free(vb);
    return rc;
}

/* tlpq_stats' split, from the resolved configuration (pqc_cache_config) and the layers'
   windows */
static void tlpq__split(const tlpq *p, tlpq_stats *st)
{
    pqc_cache_desc r;
    size_t n = pqc_cache_tokens(p->cache, 0), mid;
    double budget;
    int l, w0;
    if (pqc_cache_config(p->cache, &r) != PQC_SUCCESS)
        return;
    st->n_tokens = (int)n;
    st->sinks = r.n_sink < 0 ? 0 : (size_t)r.n_sink < n ? r.n_sink : (int)n;
    mid = n - (size_t)st->sinks;
    budget = r.budget_tokens ? (double)r.budget_tokens : ceil(r.budget_ratio * (double)mid);
    budget = budget < (double)mid ? budget : (double)mid;
    st->window_min = st->window_max = pqc_cache_layer_window(p->cache, 0);
    for (l = 1; l < p->n_lib; l++) {
        int w = pqc_cache_layer_window(p->cache, l);
        st->window_min = w < st->window_min ? w : st->window_min;
        st->window_max = w > st->window_max ? w : st->window_max;
    }
    w0 = pqc_cache_layer_window(p->cache, 0);
    st->top_k = budget > (double)w0 ? (int)budget - w0 : 0;
    st->step_window = (size_t)w0 < mid ? w0 : (int)mid;
}

void tlpq_get_stats(const tlpq *p, tlpq_stats *st)
{
    int l;
    memset(st, 0, sizeof *st);
    st->iters_min = 1 << 30;
    for (l = 0; l < p->n_lib; l++) {
        pqc_layer_stats ls;
        if (pqc_cache_stats(p->cache, l, &ls) != PQC_SUCCESS)
            continue;
        st->selects += ls.selects;
        st->hits += ls.hits;
        st->misses += ls.misses;
        st->bytes_h2d += ls.bytes_h2d;
        st->bytes_codes += ls.bytes_codes;
        st->bytes_d2h += ls.bytes_d2h;
        st->tokens_selected += ls.tokens_selected;
        st->builds += ls.builds;
        st->rebuilds += ls.rebuilds;
        st->select_s += ls.select_s;
        st->fetch_s += ls.fetch_s;
        st->build_s += ls.build_s;
        st->wait_s += ls.wait_s;
        if (ls.last_iters < st->iters_min)
            st->iters_min = ls.last_iters;
        if (ls.last_iters > st->iters_max)
            st->iters_max = ls.last_iters;
    }
    if (st->iters_min > st->iters_max)
        st->iters_min = st->iters_max;
    pqc_cache_memory(p->cache, &st->device_bytes, &st->full_bytes);
    st->window = pqc_cache_window(p->cache);
    tlpq__split(p, st);
}

/* What the library resolved the configuration to (pqc_cache_config), not what was asked. */
void tlpq_describe(const tlpq *p, char *buf, size_t len)
{
    char iters[32];
    pqc_cache_desc r;
    if (pqc_cache_config(p->cache, &r) != PQC_SUCCESS) {
        snprintf(buf, len, "(no cache)");
        return;
    }
    if (r.pq.iters > 0)
        snprintf(iters, sizeof iters, "%d", r.pq.iters);
    else
        snprintf(iters, sizeof iters, "adaptive");
    snprintf(buf, len, "m=%d bits=%d T=%s, %s metric, %s split, %d sinks, ratio %g, window %d, %d blocks of %d "
             "(%s), %d thread%s", r.pq.m, r.pq.bits, iters,
             r.metric == PQC_METRIC_L2 ? "L2" : r.metric == PQC_METRIC_QUERY_DIAG ? "query (diagonal)" : "query",
             r.split == PQC_SPLIT_FIXED            ? "fixed"
             : r.split == PQC_SPLIT_ADAPTIVE       ? "adaptive"
             : r.split == PQC_SPLIT_FIXED_COMPETE ? "fixed, competing"
                                                  : "competing",
             r.n_sink < 0 ? 0 : r.n_sink, r.budget_ratio, r.window,
             r.cache_blocks < 0 ? 0 : r.cache_blocks, r.block_tokens,
             r.policy == PQC_POLICY_LRU ? "LRU" : "LFU", p->n_threads,
             p->n_threads == 1 ? "" : "s");
}

#endif /* TL_PQCACHE_IMPLEMENTATION */
