/* tiny_llama.h - a small Llama-architecture inference engine in plain C.

   The example engine of pqcache. It loads llama2.c checkpoints (fp32), runs
   the transformer one token at a time on the CPU and splits every layer into
   stages, so that the attention of a decode step can run over an explicit
   subset of the past tokens (sinks + recent window + top-k): the subset a
   KV-cache selection library such as pqcache chooses.

   Use
     In exactly one C (or C++) file:
         #define TINY_LLAMA_IMPLEMENTATION
         #include "tiny_llama.h"
     Other files include it without the macro and get the declarations.
     Link with -lm -lpthread. Needs POSIX (mmap, clock_gettime, pthreads).

   Model
     RMSNorm (eps 1e-5), rotary embeddings (RoPE) with llama2.c's interleaved
     pairs: pair i of a head is dims (2i, 2i+1), rotated by the angle
     pos * theta^(-2i/head_size); grouped-query attention (query head h uses
     KV head h / (n_heads / n_kv_heads)); SwiGLU FFN w2(silu(w1 x) * w3 x);
     optional classifier shared with the token embedding.

   Checkpoints (llama2.c formats, little-endian, fp32 weights, row-major
   matrices of shape (out, in))
     legacy   7 int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads,
              vocab_size, seq_len. A negative vocab_size means the file has
              its own classifier matrix. Weights, each per-layer tensor
              stored for all layers one after the other:
                token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3,
                rms_final, two RoPE tables of seq_len * head_size / 2 floats
                (not used here: RoPE is computed), wcls (if not shared).
     version 1  a 256-byte header:
                offset  0  uint32 magic 0x616b3432 ("ak42")
                offset  4  int32  version (only 1, fp32, is supported)
                offset  8  7 int32, the same config as the legacy header
                           (vocab_size always positive)
                offset 36  uint8  shared_classifier (0 or 1)
                offset 40  float32 rope_theta (a pqcache extension; 0 means
                           10000, so files written by llama2.c read as usual)
                all other bytes zero.
              Weights in the order of llama2.c's version1_export (export.py):
                rms_att, rms_ffn, rms_final, token_embedding, wq, wk, wv, wo,
                w1, w2, w3, wcls (if not shared).
     Every header field is checked and the file size must match the size the
     header implies exactly; a bad file gives an error message, not a crash.

   Forward pass, split in stages (see "Forward stages" below)
     tl_embed -> per layer { tl_layer_qkv -> tl_select -> tl_layer_attention
     -> tl_layer_ffn } -> tl_classify. tl_forward runs them all.
     The host KV cache keeps llama2.c's layout:
         key_cache[layer][pos][kv_dim], value_cache likewise,
     and a head's key for a position is head_size contiguous floats at
     tl_key_row(c, s, layer, pos) + kv_head * head_size.

   Attention selection (decode steps; prefill always uses full attention)
     full     every past position
     window   n_sink sink tokens + the most recent `budget` tokens
     oracle   sinks + recent window + the exact top-k positions by true
              attention (per KV head: the softmax probabilities of the query
              heads that share it, summed), window and top-k each half of the
              budget
     pqcache  filled in by a selection callback (tl_policy.select); the
              command line instead drives the stages from pqcache's own
              driver (tl_pqcache.h), using tl_layer_qkv_rows,
              tl_attend_causal (a layer-major prefill over the library's
              rows), tl_layer_attn_out and tl_layer_attention with explicit
              rows, on a state without a KV cache (tl_build_state_ex)
     budget = round(ratio * (context - n_sink)); see tl_budget.

   Errors: functions that can fail return 0 on success and non-zero on
   failure, with a message in the caller's buffer (or tl_state.err).
*/
#ifndef TINY_LLAMA_H
#define TINY_LLAMA_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TL_MAGIC 0x616b3432u     /* "ak42" in llama2.c's versioned header */
#define TL_HEADER_V1_SIZE 256
#define TL_HEADER_LEGACY_SIZE 28
#define TL_DEFAULT_ROPE_THETA 10000.0f
#define TL_RMS_EPS 1e-5f
#define TL_BOS 1                 /* llama2.c tokenizer: beginning of sequence */
#define TL_EOS 2                 /* end of sequence */
#define TL_ERR_LEN 256           /* a good size for error buffers */

/* ----------------------------------------------------------------------------
   Model */

typedef struct {
    int dim;               /* transformer width */
    int hidden_dim;        /* FFN inner width */
    int n_layers;
    int n_heads;           /* query heads */
    int n_kv_heads;        /* key/value heads, divides n_heads */
    int vocab_size;        /* positive (the legacy sign is in shared_classifier) */
    int seq_len;           /* longest context the model supports */
    int shared_classifier; /* 1: logits use token_embedding; 0: own wcls */
    float rope_theta;      /* RoPE base */
    int version;           /* header kind: 0 legacy, 1 versioned */
    int head_size;         /* derived: dim / n_heads */
    int kv_dim;            /* derived: n_kv_heads * head_size */
} tl_config;

typedef struct {
    const float *token_embedding; /* (vocab_size, dim) */
    const float *rms_att;         /* (n_layers, dim) */
    const float *rms_ffn;         /* (n_layers, dim) */
    const float *rms_final;       /* (dim) */
    const float *wq;              /* (n_layers, n_heads * head_size, dim) */
    const float *wk;              /* (n_layers, kv_dim, dim) */
    const float *wv;              /* (n_layers, kv_dim, dim) */
    const float *wo;              /* (n_layers, dim, n_heads * head_size) */
    const float *w1;              /* (n_layers, hidden_dim, dim) */
    const float *w2;              /* (n_layers, dim, hidden_dim) */
    const float *w3;              /* (n_layers, hidden_dim, dim) */
    const float *wcls;            /* (vocab_size, dim) */
} tl_weights;

typedef struct {
    tl_config config;
    tl_weights w;
    void *map;        /* the mmapped checkpoint */
    size_t map_size;
} tl_model;

/* Reads and validates a header. `data` holds the first min(file_size, 256)
   bytes of a file of `file_size` bytes. On success fills *c and the byte
   offset where the weights start. */
int tl_parse_header(const unsigned char *data, size_t data_len, size_t file_size,
                    tl_config *c, size_t *weights_offset, char *err, size_t errlen);
/* Checks a config's sizes and fills head_size and kv_dim. */
int tl_check_config(tl_config *c, char *err, size_t errlen);
/* Bytes a checkpoint with this config and header kind must have; 0 if the
   size does not fit in size_t. */
size_t tl_checkpoint_size(const tl_config *c, int version);
/* Maps the checkpoint at path, which must be a regular file (a pipe, device
   or directory is refused without reading it), and checks its header. */
int tl_build_model(tl_model *m, const char *path, char *err, size_t errlen);
void tl_free_model(tl_model *m);
/* Writes a checkpoint with random weights (seeded): version 1 (legacy = 0)
   or a legacy header (legacy = 1, which cannot hold rope_theta). The same
   config and seed give the same model in both formats. */
int tl_write_random_checkpoint(const char *path, const tl_config *c, int legacy,
                               unsigned long long seed, char *err, size_t errlen);

/* ----------------------------------------------------------------------------
   Run state and attention selection */

/* The positions one KV head attends over in one layer. */
typedef struct {
    int n;            /* number of positions */
    int *pos;         /* n positions, ascending */
    const float *k;   /* NULL: keys are read from the host cache at pos[i];
                         else n rows of head_size floats, row i for pos[i] */
    const float *v;   /* the same for values (NULL iff k is NULL) */
    const void *const *krow; /* not NULL: row i's key is at krow[i] (head_size floats);
                                takes precedence over k (a KV-cache library's rows) */
    const void *const *vrow; /* the same for values */
} tl_kv_list;

typedef struct {
    int ctx;                  /* positions the cache holds (<= seq_len) */
    float *x;                 /* residual stream (dim) */
    float *xb, *xb2;          /* scratch (dim) */
    float *hb, *hb2;          /* FFN scratch (hidden_dim) */
    float *q;                 /* current query, after RoPE (n_heads * head_size) */
    float *att;               /* attention weights (n_heads, ctx) */
    float *logits;            /* (vocab_size) */
    float *key_cache;         /* (n_layers, ctx, kv_dim), keys after RoPE */
    float *value_cache;       /* (n_layers, ctx, kv_dim) */
    float *rope_cos, *rope_sin; /* (head_size / 2) for position rope_pos */
    int rope_pos;
    tl_kv_list *lists;        /* (n_kv_heads): what tl_select chose */
    int *list_pos;            /* (n_kv_heads, ctx): storage for lists[].pos */
    float *mass;              /* (ctx) oracle scratch */
    float *select_tmp;        /* (ctx) oracle scratch */
    int n_threads;            /* threads for attention, split over KV heads */
    int thread_min_work;      /* attended rows per layer below which 1 thread */
    char err[TL_ERR_LEN];     /* message of the last failed forward */
} tl_state;

/* ctx: positions to hold; 0 (or more than seq_len) means seq_len.
   n_threads < 1 means 1. */
int tl_build_state(tl_state *s, const tl_config *c, int ctx, int n_threads,
                   char *err, size_t errlen);
/* TL_STATE_NO_KV_CACHE: a state without the host KV cache (key_cache and
   value_cache are NULL), for an engine whose keys and values live in a
   KV-cache library: it runs tl_layer_qkv_rows and attends over lists with
   explicit rows; tl_layer_qkv, tl_select and tl_forward cannot use it. */
#define TL_STATE_NO_KV_CACHE 1
int tl_build_state_ex(tl_state *s, const tl_config *c, int ctx, int n_threads, int flags,
                      char *err, size_t errlen);
void tl_free_state(tl_state *s);
/* Key / value row (kv_dim floats) of a layer and position in the cache;
   NULL for a state without the host KV cache (TL_STATE_NO_KV_CACHE). */
float *tl_key_row(const tl_config *c, const tl_state *s, int layer, int pos);
float *tl_value_row(const tl_config *c, const tl_state *s, int layer, int pos);

typedef enum {
    TL_ATTN_FULL = 0,
    TL_ATTN_WINDOW,
    TL_ATTN_ORACLE,
    TL_ATTN_PQCACHE
} tl_attn_mode;

/* A selection callback (how a KV-cache library plugs in). Called after
   tl_layer_qkv(layer, pos): the cache holds positions 0..pos, the new key and
   value included, and the query is in s->q. Fill lists[0 .. n_kv_heads-1]:
   lists[g].pos has room for s->ctx positions; set k = v = NULL to have the
   rows read from the host cache, or point them at gathered rows. Return 0,
   or non-zero with a message in s->err. */
typedef int (*tl_select_fn)(void *user, const tl_model *m, tl_state *s,
                            int layer, int pos, tl_kv_list *lists);

typedef struct {
    tl_attn_mode mode;
    int n_sink;            /* sink tokens (default 32) */
    float ratio;           /* budget as a fraction of the context (default 0.1) */
    tl_select_fn select;   /* TL_ATTN_PQCACHE: the library's selection */
    void *select_user;
} tl_policy;

void tl_default_policy(tl_policy *p, tl_attn_mode mode);
const char *tl_mode_name(tl_attn_mode mode);
int tl_check_policy(const tl_policy *p, char *err, size_t errlen);
/* Splits a context of n_ctx positions (the current token included) into
   sinks, recent window and top-k. window mode spends the whole budget on the
   window, so every selection mode attends over the same number of tokens. */
void tl_budget(const tl_policy *p, int n_ctx, int *n_sink, int *n_window, int *n_topk);

/* ----------------------------------------------------------------------------
   Forward stages. Preconditions (checked by tl_forward, not here):
   0 <= token < vocab_size, 0 <= pos < s->ctx, 0 <= layer < n_layers. */

/* (a) x = token_embedding[token] */
void tl_embed(const tl_model *m, tl_state *s, int token);
/* (b) xb = rmsnorm(x); q = wq xb; k, v = wk xb, wv xb written to the cache at
   pos; RoPE on q and k. */
void tl_layer_qkv(const tl_model *m, tl_state *s, int layer, int pos);
/* (b) with the key and value (kv_dim floats each, after RoPE for k) written
   to k and v instead of the cache; the query goes to s->q as above. */
void tl_layer_qkv_rows(const tl_model *m, tl_state *s, int layer, int pos, float *k, float *v);
/* Fills s->lists for the policy (NULL = full attention). */
int tl_select(const tl_model *m, tl_state *s, const tl_policy *p, int layer, int pos);
/* (c) every query head attends over its KV head's list; x += wo * heads. */
void tl_layer_attention(const tl_model *m, tl_state *s, int layer, const tl_kv_list *lists);
/* The second half of (c): x += wo * xb, xb holding the heads' outputs. */
void tl_layer_attn_out(const tl_model *m, tl_state *s, int layer);
/* Causal attention of a block of n tokens at positions pos0 .. pos0+n-1 (the
   first half of (c) for many tokens at once, as in a layer-major prefill).
   q: (n, n_heads * head_size) queries after RoPE. Key and value rows of KV
   head g for position i are at k[g] + i * stride and v[g] + i * stride, for
   i = 0 .. pos0+n-1; token t attends over 0 .. pos0+t. Writes the heads'
   outputs to out (n, n_heads * head_size). att is scratch of
   n * n_heads * (pos0 + n) floats. Each key and value row is read once for
   the whole block; per token the arithmetic is that of tl_layer_attention
   over positions 0 .. pos0+t, so the results are the same to the bit. */
void tl_attend_causal(const tl_config *c, int pos0, int n, const float *q,
                      const float *const *k, const float *const *v, size_t stride,
                      float *att, float *out);
/* (d) x += w2(silu(w1 rmsnorm(x)) * w3 rmsnorm(x)) */
void tl_layer_ffn(const tl_model *m, tl_state *s, int layer);
/* (e) logits = wcls rmsnorm(x); returns s->logits */
float *tl_classify(const tl_model *m, tl_state *s);

/* All stages but the classifier; 0 or -1 with s->err set. */
int tl_forward_layers(const tl_model *m, tl_state *s, const tl_policy *p, int token, int pos);
/* The whole forward; returns s->logits, or NULL with s->err set. */
float *tl_forward(const tl_model *m, tl_state *s, const tl_policy *p, int token, int pos);

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
void tl_softmax(float *x, int n);
int tl_build_sampler(tl_sampler *sp, int vocab_size, float temperature, float topp,
                     unsigned long long seed);
void tl_free_sampler(tl_sampler *sp);
/* Picks the next token; overwrites logits with probabilities. */
int tl_sample(tl_sampler *sp, float *logits);

/* ----------------------------------------------------------------------------
   Tokenizer (llama2.c's tokenizer.bin: int32 max_token_length, then per
   token: float32 score, int32 length, the bytes) */

typedef struct {
    const char *str;
    int id;
} tl_token_index;

typedef struct {
    int vocab_size;
    int max_token_length;
    char **vocab;
    float *scores;
    tl_token_index *sorted;        /* vocab sorted by string, for lookups */
    char byte_pieces[512];         /* byte b as a string at 2 * b */
} tl_tokenizer;

/* Reads vocab_size (at least 3) tokens from path, which must be a regular
   file (a pipe, device or directory is refused without reading it). */
int tl_build_tokenizer(tl_tokenizer *t, const char *path, int vocab_size,
                       char *err, size_t errlen);
void tl_free_tokenizer(tl_tokenizer *t);
/* tokens needs room for strlen(text) + 3 ids. Returns 0, or -1 (no tokens)
   when memory runs out or the tokenizer has fewer than 3 tokens (the ids of
   <s> and </s> are TL_BOS and TL_EOS), which tl_build_tokenizer refuses. */
int tl_encode(const tl_tokenizer *t, const char *text, int bos, int eos,
              int *tokens, int *n_tokens);
/* The text of `token`, which follows `prev`. */
const char *tl_decode(const tl_tokenizer *t, int prev, int token);
/* Prints a piece, skipping lone control bytes. */
void tl_print_piece(FILE *f, const char *piece);

/* Monotonic clock in seconds. */
double tl_time_s(void);

#ifdef __cplusplus
}
#endif

#endif /* TINY_LLAMA_H */

/* ============================================================================
   Implementation */

#if defined(TINY_LLAMA_IMPLEMENTATION) && !defined(TINY_LLAMA_IMPLEMENTED)
#define TINY_LLAMA_IMPLEMENTED

#if !defined(_POSIX_C_SOURCE) && !defined(__cplusplus)
#define _POSIX_C_SOURCE 200809L
#endif

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ----------------------------------------------------------------------------
   Utilities: errors, checked arithmetic, byte access, time */

static int tl__fail(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (err && errlen > 0) {
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* a * b, clearing *ok on overflow */
static size_t tl__mul(size_t a, size_t b, int *ok)
{
    if (a != 0 && b > (size_t)-1 / a) {
        *ok = 0;
        return 0;
    }
    return a * b;
}

static size_t tl__add(size_t a, size_t b, int *ok)
{
    if (b > (size_t)-1 - a) {
        *ok = 0;
        return 0;
    }
    return a + b;
}

/* Header fields are little-endian; so are the weights, read in place. */
static unsigned int tl__u32(const unsigned char *p)
{
    return (unsigned int)p[0] | (unsigned int)p[1] << 8 |
           (unsigned int)p[2] << 16 | (unsigned int)p[3] << 24;
}

static int tl__i32(const unsigned char *p)
{
    unsigned int u = tl__u32(p);
    int v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static float tl__f32(const unsigned char *p)
{
    unsigned int u = tl__u32(p);
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static void tl__put_u32(unsigned char *p, unsigned int v)
{
    p[0] = (unsigned char)(v & 0xff);
    p[1] = (unsigned char)(v >> 8 & 0xff);
    p[2] = (unsigned char)(v >> 16 & 0xff);
    p[3] = (unsigned char)(v >> 24 & 0xff);
}

static void tl__put_i32(unsigned char *p, int v)
{
    unsigned int u;
    memcpy(&u, &v, sizeof u);
    tl__put_u32(p, u);
}

double tl_time_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ----------------------------------------------------------------------------
   Checkpoint layout: the tensors, their sizes and their order in each format */

enum {
    TL__EMB, TL__RMS_ATT, TL__RMS_FFN, TL__RMS_FINAL, TL__WQ, TL__WK, TL__WV,
    TL__WO, TL__W1, TL__W2, TL__W3, TL__ROPE_TABLES, TL__WCLS, TL__N_TENSORS
};

/* llama2.c's version1_export */
static const int tl__order_v1[] = {
    TL__RMS_ATT, TL__RMS_FFN, TL__RMS_FINAL, TL__EMB, TL__WQ, TL__WK, TL__WV,
    TL__WO, TL__W1, TL__W2, TL__W3, TL__WCLS
};
/* llama2.c's legacy_export */
static const int tl__order_legacy[] = {
    TL__EMB, TL__RMS_ATT, TL__WQ, TL__WK, TL__WV, TL__WO, TL__RMS_FFN, TL__W1,
    TL__W2, TL__W3, TL__RMS_FINAL, TL__ROPE_TABLES, TL__WCLS
};

/* Floats of one layer's slice of a tensor (the whole tensor if not per layer);
   *layers is how many slices there are. */
static size_t tl__tensor_slice(const tl_config *c, int id, int *layers, int *ok)
{
    size_t dim = (size_t)c->dim, hidden = (size_t)c->hidden_dim;
    size_t kv = (size_t)c->kv_dim, vocab = (size_t)c->vocab_size;
    *layers = c->n_layers;
    switch (id) {
    case TL__RMS_ATT: case TL__RMS_FFN: return dim;
    case TL__WQ: case TL__WO: return tl__mul(dim, dim, ok);
    case TL__WK: case TL__WV: return tl__mul(kv, dim, ok);
    case TL__W1: case TL__W2: case TL__W3: return tl__mul(hidden, dim, ok);
    default: break;
    }
    *layers = 1;
    switch (id) {
    case TL__EMB: return tl__mul(vocab, dim, ok);
    case TL__RMS_FINAL: return dim;
    case TL__ROPE_TABLES: return tl__mul((size_t)c->seq_len, (size_t)c->head_size, ok);
    case TL__WCLS: return c->shared_classifier ? 0 : tl__mul(vocab, dim, ok);
    default: return 0;
    }
}

static size_t tl__tensor_floats(const tl_config *c, int id, int *ok)
{
    int layers;
    size_t slice = tl__tensor_slice(c, id, &layers, ok);
    return tl__mul(slice, (size_t)layers, ok);
}

static const int *tl__order(int version, int *n)
{
    if (version == 0) {
        *n = (int)(sizeof tl__order_legacy / sizeof tl__order_legacy[0]);
        return tl__order_legacy;
    }
    *n = (int)(sizeof tl__order_v1 / sizeof tl__order_v1[0]);
    return tl__order_v1;
}

size_t tl_checkpoint_size(const tl_config *c, int version)
{
    int ok = 1, i, n;
    const int *order = tl__order(version, &n);
    size_t floats = 0;
    for (i = 0; i < n; i++)
        floats = tl__add(floats, tl__tensor_floats(c, order[i], &ok), &ok);
    floats = tl__add(tl__mul(floats, sizeof(float), &ok),
                     version == 0 ? TL_HEADER_LEGACY_SIZE : TL_HEADER_V1_SIZE, &ok);
    return ok ? floats : 0;
}

/* ----------------------------------------------------------------------------
   Checkpoint: header parsing and validation */

int tl_check_config(tl_config *c, char *err, size_t errlen)
{
    const char *names[7] = { "dim", "hidden_dim", "n_layers", "n_heads",
                             "n_kv_heads", "vocab_size", "seq_len" };
    int vals[7];
    int i;
    vals[0] = c->dim; vals[1] = c->hidden_dim; vals[2] = c->n_layers;
    vals[3] = c->n_heads; vals[4] = c->n_kv_heads; vals[5] = c->vocab_size;
    vals[6] = c->seq_len;
    for (i = 0; i < 7; i++)
        if (vals[i] <= 0)
            return tl__fail(err, errlen, "%s is %d, must be positive", names[i], vals[i]);
    if (c->dim % c->n_heads != 0)
        return tl__fail(err, errlen, "dim %d is not a multiple of n_heads %d", c->dim, c->n_heads);
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0)
        return tl__fail(err, errlen, "n_heads %d is not a multiple of n_kv_heads %d",
                        c->n_heads, c->n_kv_heads);
    c->head_size = c->dim / c->n_heads;
    if (c->head_size % 2 != 0)
        return tl__fail(err, errlen, "head size %d (dim / n_heads) is odd; RoPE needs pairs",
                        c->head_size);
    c->kv_dim = c->n_kv_heads * c->head_size;
    if (c->shared_classifier != 0 && c->shared_classifier != 1)
        return tl__fail(err, errlen, "shared_classifier is %d, must be 0 or 1", c->shared_classifier);
    /* the negation rejects NaN as well */
    if (!(c->rope_theta > 0.0f && c->rope_theta <= 3.0e38f))
        return tl__fail(err, errlen, "rope_theta %g is not a positive finite number",
                        (double)c->rope_theta);
    return 0;
}

static int tl__check_size(const tl_config *c, size_t file_size, const char *kind,
                          char *err, size_t errlen)
{
    size_t want = tl_checkpoint_size(c, c->version);
    if (want == 0)
        return tl__fail(err, errlen, "%s header: the sizes it gives overflow", kind);
    if (file_size != want)
        return tl__fail(err, errlen,
                        "%s header: the config needs a file of %zu bytes, the file has %zu (%s)",
                        kind, want, file_size, file_size < want ? "truncated" : "trailing bytes");
    return 0;
}

static void tl__read_dims(const unsigned char *p, tl_config *c)
{
    c->dim = tl__i32(p);
    c->hidden_dim = tl__i32(p + 4);
    c->n_layers = tl__i32(p + 8);
    c->n_heads = tl__i32(p + 12);
    c->n_kv_heads = tl__i32(p + 16);
    c->vocab_size = tl__i32(p + 20);
    c->seq_len = tl__i32(p + 24);
}

int tl_parse_header(const unsigned char *data, size_t data_len, size_t file_size,
                    tl_config *c, size_t *weights_offset, char *err, size_t errlen)
{
    char why[TL_ERR_LEN];
    size_t i;
    memset(c, 0, sizeof *c);
    if (data_len > file_size)
        data_len = file_size;
    if (data_len < 4)
        return tl__fail(err, errlen, "file of %zu bytes is too small to be a checkpoint", file_size);

    if (tl__u32(data) == TL_MAGIC) {
        int version;
        float theta;
        if (data_len < TL_HEADER_V1_SIZE)
            return tl__fail(err, errlen, "truncated header: a versioned checkpoint starts "
                            "with %d header bytes, the file has %zu", TL_HEADER_V1_SIZE, file_size);
        version = tl__i32(data + 4);
        if (version != 1)
            return tl__fail(err, errlen, "checkpoint version %d is not supported "
                            "(only version 1, fp32 weights)", version);
        tl__read_dims(data + 8, c);
        c->version = 1;
        c->shared_classifier = data[36];
        theta = tl__f32(data + 40);
        for (i = 37; i < TL_HEADER_V1_SIZE; i++)
            if ((i < 40 || i >= 44) && data[i] != 0)
                return tl__fail(err, errlen, "corrupted header: padding byte %zu is 0x%02x, "
                                "not zero", i, data[i]);
        if (theta < 0.0f || theta != theta)
            return tl__fail(err, errlen, "header rope_theta %g is invalid", (double)theta);
        c->rope_theta = theta == 0.0f ? TL_DEFAULT_ROPE_THETA : theta;
        if (tl_check_config(c, why, sizeof why))
            return tl__fail(err, errlen, "version 1 header: %s", why);
        if (tl__check_size(c, file_size, "version 1", err, errlen))
            return -1;
        *weights_offset = TL_HEADER_V1_SIZE;
        return 0;
    }

    /* no magic: a legacy header, or not a checkpoint at all */
    if (data_len < TL_HEADER_LEGACY_SIZE)
        return tl__fail(err, errlen, "not a checkpoint: no 'ak42' magic and only %zu bytes, "
                        "less than a legacy header", file_size);
    tl__read_dims(data, c);
    c->version = 0;
    c->rope_theta = TL_DEFAULT_ROPE_THETA;
    c->shared_classifier = 1;
    if (c->vocab_size < 0 && c->vocab_size != -2147483647 - 1) {
        c->vocab_size = -c->vocab_size;
        c->shared_classifier = 0;
    }
    if (tl_check_config(c, why, sizeof why) ||
        tl__check_size(c, file_size, "legacy", why, sizeof why))
        return tl__fail(err, errlen, "not a checkpoint: magic 0x%08x is not 'ak42' "
                        "(0x%08x), and as a legacy header: %s", tl__u32(data), TL_MAGIC, why);
    *weights_offset = TL_HEADER_LEGACY_SIZE;
    return 0;
}

/* ----------------------------------------------------------------------------
   Checkpoint: loading with mmap */

static void tl__map_weights(tl_model *m, const float *p)
{
    const tl_config *c = &m->config;
    const float *at[TL__N_TENSORS];
    int i, n, ok = 1;
    const int *order = tl__order(c->version, &n);
    memset(at, 0, sizeof at);
    for (i = 0; i < n; i++) {
        at[order[i]] = p;
        p += tl__tensor_floats(c, order[i], &ok);  /* sizes checked by the parser */
    }
    m->w.token_embedding = at[TL__EMB];
    m->w.rms_att = at[TL__RMS_ATT];
    m->w.rms_ffn = at[TL__RMS_FFN];
    m->w.rms_final = at[TL__RMS_FINAL];
    m->w.wq = at[TL__WQ];
    m->w.wk = at[TL__WK];
    m->w.wv = at[TL__WV];
    m->w.wo = at[TL__WO];
    m->w.w1 = at[TL__W1];
    m->w.w2 = at[TL__W2];
    m->w.w3 = at[TL__W3];
    m->w.wcls = c->shared_classifier ? at[TL__EMB] : at[TL__WCLS];
}

/* What a file that is not a regular file is, for error messages. */
static const char *tl__file_kind(mode_t mode)
{
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a named pipe";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
#ifdef S_ISSOCK
    if (S_ISSOCK(mode)) return "a socket";
#endif
    return "not a regular file";
}

/* Opens a file for reading; only regular files are accepted. The open does
   not block (a named pipe without a writer would wait forever), and blocking
   reads are restored once the file is known to be regular. Returns the file
   descriptor with its status in *st, or -1 with a message in err. */
static int tl__open_regular(const char *path, const char *what, struct stat *st,
                            char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK), flags;
    if (fd < 0)
        return tl__fail(err, errlen, "cannot open %s %s: %s", what, path, strerror(errno));
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return tl__fail(err, errlen, "cannot stat %s %s: %s", what, path, strerror(e));
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return tl__fail(err, errlen, "%s %s is %s, not a regular file", what, path,
                        tl__file_kind(st->st_mode));
    }
    flags = fcntl(fd, F_GETFL);
    if (flags == -1 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == -1) {
        int e = errno;
        close(fd);
        return tl__fail(err, errlen, "cannot read %s %s: %s", what, path, strerror(e));
    }
    return fd;
}

int tl_build_model(tl_model *m, const char *path, char *err, size_t errlen)
{
    struct stat st;
    size_t size, woff = 0;
    void *map;
    char why[TL_ERR_LEN];
    int fd;

    memset(m, 0, sizeof *m);
    fd = tl__open_regular(path, "checkpoint", &st, err, errlen);
    if (fd < 0)
        return -1;
    size = (size_t)st.st_size;
    if (size == 0) {
        close(fd);
        return tl__fail(err, errlen, "%s: empty file", path);
    }
    map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return tl__fail(err, errlen, "cannot mmap %s: %s", path, strerror(errno));
    if (tl_parse_header((const unsigned char *)map, size < TL_HEADER_V1_SIZE ? size :
                        TL_HEADER_V1_SIZE, size, &m->config, &woff, why, sizeof why)) {
        munmap(map, size);
        memset(m, 0, sizeof *m);
        return tl__fail(err, errlen, "%s: %s", path, why);
    }
    m->map = map;
    m->map_size = size;
    tl__map_weights(m, (const float *)((const unsigned char *)map + woff));
    return 0;
}

void tl_free_model(tl_model *m)
{
    if (m->map)
        munmap(m->map, m->map_size);
    memset(m, 0, sizeof *m);
}

/* ----------------------------------------------------------------------------
   Random checkpoints (for tests and demos) */

static double tl__gauss(unsigned long long *rng)
{
    double u1 = ((double)(tl_rng_next(rng) >> 11) + 1.0) / 9007199254740993.0;
    double u2 = (double)(tl_rng_next(rng) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* count floats of base + scale * N(0, 1), from a stream named by (seed, id, layer) */
static int tl__write_random(FILE *f, unsigned long long seed, int id, int layer,
                            size_t count, double base, double scale)
{
    float chunk[1024];
    unsigned long long rng = tl_rng_seed(seed ^ ((unsigned long long)id << 40) ^
                                         ((unsigned long long)layer * 0x9E3779B97F4A7C15ull));
    while (count > 0) {
        size_t n = count < 1024 ? count : 1024, i;
        for (i = 0; i < n; i++)
            chunk[i] = scale == 0.0 ? (float)base : (float)(base + scale * tl__gauss(&rng));
        if (fwrite(chunk, sizeof(float), n, f) != n)
            return -1;
        count -= n;
    }
    return 0;
}

int tl_write_random_checkpoint(const char *path, const tl_config *config, int legacy,
                               unsigned long long seed, char *err, size_t errlen)
{
    tl_config c = *config;
    unsigned char header[TL_HEADER_V1_SIZE];
    char why[TL_ERR_LEN];
    int i, n, layer, ok = 1;
    const int *order;
    FILE *f;

    c.version = legacy ? 0 : 1;
    if (c.rope_theta == 0.0f)
        c.rope_theta = TL_DEFAULT_ROPE_THETA;
    if (tl_check_config(&c, why, sizeof why))
        return tl__fail(err, errlen, "bad config: %s", why);
    if (legacy && c.rope_theta != TL_DEFAULT_ROPE_THETA)
        return tl__fail(err, errlen, "a legacy header cannot store rope_theta %g",
                        (double)c.rope_theta);
    if (tl_checkpoint_size(&c, c.version) == 0)
        return tl__fail(err, errlen, "bad config: the checkpoint size overflows");
    f = fopen(path, "wb");
    if (!f)
        return tl__fail(err, errlen, "cannot create %s: %s", path, strerror(errno));

    memset(header, 0, sizeof header);
    if (legacy) {
        tl__put_i32(header, c.dim);
        tl__put_i32(header + 4, c.hidden_dim);
        tl__put_i32(header + 8, c.n_layers);
        tl__put_i32(header + 12, c.n_heads);
        tl__put_i32(header + 16, c.n_kv_heads);
        tl__put_i32(header + 20, c.shared_classifier ? c.vocab_size : -c.vocab_size);
        tl__put_i32(header + 24, c.seq_len);
        ok = fwrite(header, 1, TL_HEADER_LEGACY_SIZE, f) == TL_HEADER_LEGACY_SIZE;
    } else {
        unsigned int theta_bits;
        tl__put_u32(header, TL_MAGIC);
        tl__put_i32(header + 4, 1);
        tl__put_i32(header + 8, c.dim);
        tl__put_i32(header + 12, c.hidden_dim);
        tl__put_i32(header + 16, c.n_layers);
        tl__put_i32(header + 20, c.n_heads);
        tl__put_i32(header + 24, c.n_kv_heads);
        tl__put_i32(header + 28, c.vocab_size);
        tl__put_i32(header + 32, c.seq_len);
        header[36] = (unsigned char)c.shared_classifier;
        memcpy(&theta_bits, &c.rope_theta, sizeof theta_bits);
        tl__put_u32(header + 40, theta_bits);
        ok = fwrite(header, 1, TL_HEADER_V1_SIZE, f) == TL_HEADER_V1_SIZE;
    }

    order = tl__order(c.version, &n);
    for (i = 0; i < n && ok; i++) {
        int id = order[i], layers, size_ok = 1;
        size_t slice = tl__tensor_slice(&c, id, &layers, &size_ok);
        double base = 0.0, scale = 1.0 / sqrt((double)c.dim);
        /* Scales that keep the random model from being degenerate: logits
           of standard deviation about 2 (the current token does not simply
           win), attention scores of deviation about 3 (a few positions
           dominate, so which positions are attended matters). */
        switch (id) {
        case TL__RMS_ATT: case TL__RMS_FFN: case TL__RMS_FINAL:
            base = 1.0; scale = 0.1; break;
        case TL__EMB: case TL__WCLS: scale *= 2.0; break;
        case TL__WQ: case TL__WK: scale *= sqrt(3.0); break;
        case TL__W2: scale = 1.0 / sqrt((double)c.hidden_dim); break;
        case TL__ROPE_TABLES: scale = 0.0; break;   /* unused by readers: zeros */
        default: break;
        }
        for (layer = 0; layer < layers && ok; layer++)
            ok = tl__write_random(f, seed, id, layer, slice, base, scale) == 0;
    }
    if (fclose(f) != 0)
        ok = 0;
    if (!ok)
        return tl__fail(err, errlen, "cannot write %s: %s", path, strerror(errno));
    return 0;
}

/* ----------------------------------------------------------------------------
   Run state */

int tl_build_state(tl_state *s, const tl_config *c, int ctx, int n_threads,
                   char *err, size_t errlen)
{
    return tl_build_state_ex(s, c, ctx, n_threads, 0, err, errlen);
}

int tl_build_state_ex(tl_state *s, const tl_config *c, int ctx, int n_threads, int flags,
                      char *err, size_t errlen)
{
    int kv = !(flags & TL_STATE_NO_KV_CACHE);
    size_t cache, ctxz;
    int ok = 1, g;
    memset(s, 0, sizeof *s);
    if (ctx <= 0 || ctx > c->seq_len)
        ctx = c->seq_len;
    s->ctx = ctx;
    ctxz = (size_t)ctx;
    cache = tl__mul(tl__mul((size_t)c->n_layers, ctxz, &ok), (size_t)c->kv_dim, &ok);
    tl__mul(tl__mul(cache, 2, &ok), sizeof(float), &ok);
    tl__mul(tl__mul((size_t)c->n_heads, ctxz, &ok), sizeof(float), &ok);
    if (!ok)
        return tl__fail(err, errlen, "run state for a context of %d does not fit in memory", ctx);
    s->x = (float *)calloc((size_t)c->dim, sizeof(float));
    s->xb = (float *)calloc((size_t)c->dim, sizeof(float));
    s->xb2 = (float *)calloc((size_t)c->dim, sizeof(float));
    s->hb = (float *)calloc((size_t)c->hidden_dim, sizeof(float));
    s->hb2 = (float *)calloc((size_t)c->hidden_dim, sizeof(float));
    s->q = (float *)calloc((size_t)c->dim, sizeof(float));
    s->att = (float *)calloc((size_t)c->n_heads * ctxz, sizeof(float));
    s->logits = (float *)calloc((size_t)c->vocab_size, sizeof(float));
    s->key_cache = kv ? (float *)calloc(cache, sizeof(float)) : NULL;
    s->value_cache = kv ? (float *)calloc(cache, sizeof(float)) : NULL;
    s->rope_cos = (float *)calloc((size_t)c->head_size / 2, sizeof(float));
    s->rope_sin = (float *)calloc((size_t)c->head_size / 2, sizeof(float));
    s->lists = (tl_kv_list *)calloc((size_t)c->n_kv_heads, sizeof(tl_kv_list));
    s->list_pos = (int *)calloc((size_t)c->n_kv_heads * ctxz, sizeof(int));
    s->mass = (float *)calloc(ctxz, sizeof(float));
    s->select_tmp = (float *)calloc(ctxz, sizeof(float));
    if (!s->x || !s->xb || !s->xb2 || !s->hb || !s->hb2 || !s->q || !s->att ||
        !s->logits || (kv && (!s->key_cache || !s->value_cache)) || !s->rope_cos ||
        !s->rope_sin || !s->lists || !s->list_pos || !s->mass || !s->select_tmp) {
        tl_free_state(s);
        return tl__fail(err, errlen, "out of memory for the run state (context %d)", ctx);
    }
    for (g = 0; g < c->n_kv_heads; g++)
        s->lists[g].pos = s->list_pos + (size_t)g * ctxz;
    s->rope_pos = -1;
    s->n_threads = n_threads < 1 ? 1 : n_threads;
    s->thread_min_work = 4096;
    return 0;
}

void tl_free_state(tl_state *s)
{
    free(s->x); free(s->xb); free(s->xb2); free(s->hb); free(s->hb2);
    free(s->q); free(s->att); free(s->logits); free(s->key_cache);
    free(s->value_cache); free(s->rope_cos); free(s->rope_sin); free(s->lists);
    free(s->list_pos); free(s->mass); free(s->select_tmp);
    memset(s, 0, sizeof *s);
}

float *tl_key_row(const tl_config *c, const tl_state *s, int layer, int pos)
{
    if (!s->key_cache)
        return NULL;
    return s->key_cache + ((size_t)layer * (size_t)s->ctx + (size_t)pos) * (size_t)c->kv_dim;
}

float *tl_value_row(const tl_config *c, const tl_state *s, int layer, int pos)
{
    if (!s->value_cache)
        return NULL;
    return s->value_cache + ((size_t)layer * (size_t)s->ctx + (size_t)pos) * (size_t)c->kv_dim;
}

/* ----------------------------------------------------------------------------
   Math kernels. Loops run over contiguous memory and are written so that a
   compiler vectorises them at -O2 without -ffast-math: the dot product keeps
   eight independent partial sums (no reordering of additions needed). */

static float tl__dot(const float *a, const float *b, int n)
{
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0, sum;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
        s4 += a[i + 4] * b[i + 4];
        s5 += a[i + 5] * b[i + 5];
        s6 += a[i + 6] * b[i + 6];
        s7 += a[i + 7] * b[i + 7];
    }
    sum = ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7));
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* out += a * x. Blocks of eight are loaded before they are stored, so the
   compiler may vectorise them without proving that out and x do not overlap. */
static void tl__axpy(float *out, float a, const float *x, int n)
{
    float t[8];
    int i = 0, j;
    for (; i + 8 <= n; i += 8) {
        for (j = 0; j < 8; j++)
            t[j] = out[i + j] + a * x[i + j];
        for (j = 0; j < 8; j++)
            out[i + j] = t[j];
    }
    for (; i < n; i++)
        out[i] += a * x[i];
}

/* out (d) = W (d, n) x (n) */
static void tl__matmul(float *out, const float *x, const float *w, int n, int d)
{
    int i;
    for (i = 0; i < d; i++)
        out[i] = tl__dot(w + (size_t)i * (size_t)n, x, n);
}

static void tl__rmsnorm(float *out, const float *x, const float *weight, int n)
{
    float ss = tl__dot(x, x, n) / (float)n + TL_RMS_EPS;
    float inv = 1.0f / sqrtf(ss);
    int i;
    for (i = 0; i < n; i++)
        out[i] = weight[i] * (inv * x[i]);
}

void tl_softmax(float *x, int n)
{
    float max = x[0], sum = 0.0f;
    int i;
    for (i = 1; i < n; i++)
        if (x[i] > max)
            max = x[i];
    for (i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    for (i = 0; i < n; i++)
        x[i] /= sum;
}

/* rotate each (2i, 2i+1) pair of every head in x by the current angles */
static void tl__rope(float *x, int n_heads, int head_size, const float *cs, const float *sn)
{
    int h, i;
    for (h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * (size_t)head_size;
        for (i = 0; i < head_size / 2; i++) {
            float v0 = v[2 * i], v1 = v[2 * i + 1];
            v[2 * i] = v0 * cs[i] - v1 * sn[i];
            v[2 * i + 1] = v0 * sn[i] + v1 * cs[i];
        }
    }
}

/* ----------------------------------------------------------------------------
   Forward stages */

void tl_embed(const tl_model *m, tl_state *s, int token)
{
    const tl_config *c = &m->config;
    memcpy(s->x, m->w.token_embedding + (size_t)token * (size_t)c->dim,
           (size_t)c->dim * sizeof(float));
}

void tl_layer_qkv(const tl_model *m, tl_state *s, int layer, int pos)
{
    tl_layer_qkv_rows(m, s, layer, pos, tl_key_row(&m->config, s, layer, pos),
                      tl_value_row(&m->config, s, layer, pos));
}

void tl_layer_qkv_rows(const tl_model *m, tl_state *s, int layer, int pos, float *k, float *v)
{
    const tl_config *c = &m->config;
    size_t l = (size_t)layer, dim = (size_t)c->dim, kv = (size_t)c->kv_dim;
    int i;

    if (s->rope_pos != pos) {   /* the angles depend on the position only */
        for (i = 0; i < c->head_size / 2; i++) {
            double freq = pow((double)c->rope_theta, -2.0 * i / (double)c->head_size);
            double angle = (double)pos * freq;
            s->rope_cos[i] = (float)cos(angle);
            s->rope_sin[i] = (float)sin(angle);
        }
        s->rope_pos = pos;
    }
    tl__rmsnorm(s->xb, s->x, m->w.rms_att + l * dim, c->dim);
    tl__matmul(s->q, s->xb, m->w.wq + l * dim * dim, c->dim, c->dim);
    tl__matmul(k, s->xb, m->w.wk + l * kv * dim, c->dim, c->kv_dim);
    tl__matmul(v, s->xb, m->w.wv + l * kv * dim, c->dim, c->kv_dim);
    tl__rope(s->q, c->n_heads, c->head_size, s->rope_cos, s->rope_sin);
    tl__rope(k, c->n_kv_heads, c->head_size, s->rope_cos, s->rope_sin);
}

/* The query heads of KV head g attend over list l: scores, softmax, weighted
   sum of values into xb. Each key and value row is read once for the group. */
static void tl__attend_kv_head(const tl_model *m, tl_state *s, int layer, int g,
                               const tl_kv_list *l)
{
    const tl_config *c = &m->config;
    int hs = c->head_size, group = c->n_heads / c->n_kv_heads;
    int h0 = g * group, i, j, n = l->n;
    float scale = 1.0f / sqrtf((float)hs);
    const float *kbase = NULL, *vbase = NULL;
    size_t stride = l->k ? (size_t)hs : (size_t)c->kv_dim;

    /* A base is only formed where rows are not given one by one (krow, vrow):
       a state without the host KV cache has no base to offer. */
    if (!l->krow)
        kbase = l->k ? l->k : tl_key_row(c, s, layer, 0) + (size_t)g * (size_t)hs;
    if (!l->vrow)
        vbase = l->k ? l->v : tl_value_row(c, s, layer, 0) + (size_t)g * (size_t)hs;
    for (i = 0; i < n; i++) {
        const float *k = l->krow ? (const float *)l->krow[i] : kbase + (size_t)(l->k ? i : l->pos[i]) * stride;
#if defined(__GNUC__) || defined(__clang__)
        if (l->krow && i + 8 < n) { /* scattered rows: fetch ahead of the dot products */
            const char *nk = (const char *)l->krow[i + 8], *nv = (const char *)l->vrow[i + 8];
            int b;
            for (b = 0; b < hs * 4; b += 64) {
                __builtin_prefetch(nk + b);
                __builtin_prefetch(nv + b);
            }
        }
#endif
        for (j = 0; j < group; j++) {
            int h = h0 + j;
            s->att[(size_t)h * (size_t)s->ctx + (size_t)i] =
                tl__dot(s->q + (size_t)h * (size_t)hs, k, hs) * scale;
        }
    }
    for (j = 0; j < group; j++) {
        int h = h0 + j;
        if (n > 0)
            tl_softmax(s->att + (size_t)h * (size_t)s->ctx, n);
        memset(s->xb + (size_t)h * (size_t)hs, 0, (size_t)hs * sizeof(float));
    }
    for (i = 0; i < n; i++) {
        const float *v = l->vrow ? (const float *)l->vrow[i] : vbase + (size_t)(l->k ? i : l->pos[i]) * stride;
        for (j = 0; j < group; j++) {
            int h = h0 + j;
            tl__axpy(s->xb + (size_t)h * (size_t)hs,
                     s->att[(size_t)h * (size_t)s->ctx + (size_t)i], v, hs);
        }
    }
}

typedef struct {
    const tl_model *m;
    tl_state *s;
    int layer, first, step;
    const tl_kv_list *lists;
} tl__attn_job;

static void *tl__attn_worker(void *arg)
{
    const tl__attn_job *job = (const tl__attn_job *)arg;
    int g;
    for (g = job->first; g < job->m->config.n_kv_heads; g += job->step)
        tl__attend_kv_head(job->m, job->s, job->layer, g, &job->lists[g]);
    return NULL;
}

#define TL__MAX_THREADS 64

void tl_layer_attention(const tl_model *m, tl_state *s, int layer, const tl_kv_list *lists)
{
    const tl_config *c = &m->config;
    tl__attn_job jobs[TL__MAX_THREADS];
    pthread_t threads[TL__MAX_THREADS];
    int started[TL__MAX_THREADS];
    int nt = s->n_threads, t, g;
    long work = 0;

    for (g = 0; g < c->n_kv_heads; g++)
        work += lists[g].n;
    if (nt > c->n_kv_heads)
        nt = c->n_kv_heads;
    if (nt > TL__MAX_THREADS)
        nt = TL__MAX_THREADS;
    if (work < s->thread_min_work)
        nt = 1;
    for (t = 0; t < nt; t++) {
        jobs[t].m = m;
        jobs[t].s = s;
        jobs[t].layer = layer;
        jobs[t].first = t;
        jobs[t].step = nt;
        jobs[t].lists = lists;
        started[t] = 0;
    }
    for (t = 1; t < nt; t++)
        started[t] = pthread_create(&threads[t], NULL, tl__attn_worker, &jobs[t]) == 0;
    tl__attn_worker(&jobs[0]);
    for (t = 1; t < nt; t++) {
        if (started[t])
            pthread_join(threads[t], NULL);
        else
            tl__attn_worker(&jobs[t]);   /* no thread: do its share here */
    }

    tl_layer_attn_out(m, s, layer);
}

void tl_layer_attn_out(const tl_model *m, tl_state *s, int layer)
{
    const tl_config *c = &m->config;
    size_t dim = (size_t)c->dim;
    int i;
    tl__matmul(s->xb2, s->xb, m->w.wo + (size_t)layer * dim * dim, c->dim, c->dim);
    for (i = 0; i < c->dim; i++)
        s->x[i] += s->xb2[i];
}

void tl_attend_causal(const tl_config *c, int pos0, int n, const float *q,
                      const float *const *k, const float *const *v, size_t stride,
                      float *att, float *out)
{
    int hs = c->head_size, nh = c->n_heads, group = c->n_heads / c->n_kv_heads;
    int rows = pos0 + n, g, i, t, j;
    size_t as = (size_t)rows, qd = (size_t)nh * (size_t)hs;
    float scale = 1.0f / sqrtf((float)hs);

    for (g = 0; g < c->n_kv_heads; g++) {
        int h0 = g * group;
        for (i = 0; i < rows; i++) {   /* scores: each key row once for the block */
            const float *kr = k[g] + (size_t)i * stride;
            for (t = i > pos0 ? i - pos0 : 0; t < n; t++)
                for (j = 0; j < group; j++) {
                    int h = h0 + j;
                    att[((size_t)t * (size_t)nh + (size_t)h) * as + (size_t)i] =
                        tl__dot(q + (size_t)t * qd + (size_t)h * (size_t)hs, kr, hs) * scale;
                }
        }
        for (t = 0; t < n; t++)
            for (j = 0; j < group; j++) {
                int h = h0 + j;
                tl_softmax(att + ((size_t)t * (size_t)nh + (size_t)h) * as, pos0 + t + 1);
                memset(out + (size_t)t * qd + (size_t)h * (size_t)hs, 0, (size_t)hs * sizeof(float));
            }
        for (i = 0; i < rows; i++) {   /* weighted values: each value row once */
            const float *vr = v[g] + (size_t)i * stride;
            for (t = i > pos0 ? i - pos0 : 0; t < n; t++)
                for (j = 0; j < group; j++) {
                    int h = h0 + j;
                    tl__axpy(out + (size_t)t * qd + (size_t)h * (size_t)hs,
                             att[((size_t)t * (size_t)nh + (size_t)h) * as + (size_t)i], vr, hs);
                }
        }
    }
}

void tl_layer_ffn(const tl_model *m, tl_state *s, int layer)
{
    const tl_config *c = &m->config;
    size_t l = (size_t)layer, dim = (size_t)c->dim, hidden = (size_t)c->hidden_dim;
    int i;
    tl__rmsnorm(s->xb, s->x, m->w.rms_ffn + l * dim, c->dim);
    tl__matmul(s->hb, s->xb, m->w.w1 + l * hidden * dim, c->dim, c->hidden_dim);
    tl__matmul(s->hb2, s->xb, m->w.w3 + l * hidden * dim, c->dim, c->hidden_dim);
    for (i = 0; i < c->hidden_dim; i++) {
        float a = s->hb[i];
        s->hb[i] = a / (1.0f + expf(-a)) * s->hb2[i];   /* silu(w1 x) * w3 x */
    }
    tl__matmul(s->xb, s->hb, m->w.w2 + l * dim * hidden, c->hidden_dim, c->dim);
    for (i = 0; i < c->dim; i++)
        s->x[i] += s->xb[i];
}

float *tl_classify(const tl_model *m, tl_state *s)
{
    const tl_config *c = &m->config;
    tl__rmsnorm(s->xb, s->x, m->w.rms_final, c->dim);
    tl__matmul(s->logits, s->xb, m->w.wcls, c->dim, c->vocab_size);
    return s->logits;
}

/* ----------------------------------------------------------------------------
   Attention selection: full, window, oracle */

void tl_default_policy(tl_policy *p, tl_attn_mode mode)
{
    memset(p, 0, sizeof *p);
    p->mode = mode;
    p->n_sink = 32;
    p->ratio = 0.1f;
}

const char *tl_mode_name(tl_attn_mode mode)
{
    switch (mode) {
    case TL_ATTN_FULL: return "full";
    case TL_ATTN_WINDOW: return "window";
    case TL_ATTN_ORACLE: return "oracle";
    case TL_ATTN_PQCACHE: return "pqcache";
    }
    return "unknown";
}

int tl_check_policy(const tl_policy *p, char *err, size_t errlen)
{
    if ((int)p->mode < (int)TL_ATTN_FULL || (int)p->mode > (int)TL_ATTN_PQCACHE)
        return tl__fail(err, errlen, "unknown attention mode %d", (int)p->mode);
    if (p->n_sink < 0)
        return tl__fail(err, errlen, "sink count %d is negative", p->n_sink);
    if (!(p->ratio >= 0.0f && p->ratio <= 1.0f))
        return tl__fail(err, errlen, "budget ratio %g is not in [0, 1]", (double)p->ratio);
    if (p->mode == TL_ATTN_PQCACHE && !p->select)
        return tl__fail(err, errlen, "pqcache mode not built in this binary");
    return 0;
}

void tl_budget(const tl_policy *p, int n_ctx, int *n_sink, int *n_window, int *n_topk)
{
    int sink = p->n_sink < n_ctx ? p->n_sink : n_ctx;
    int rest = n_ctx - sink;
    double want = floor((double)p->ratio * (double)rest + 0.5);
    int budget = want < 0.0 ? 0 : want > (double)rest ? rest : (int)want;
    int window = p->mode == TL_ATTN_WINDOW ? budget : (budget + 1) / 2;
    if (window < 1 && rest > 0)
        window = 1;   /* the current token is always attended */
    *n_sink = sink;
    *n_window = window;
    *n_topk = p->mode == TL_ATTN_WINDOW ? 0 : budget - window > 0 ? budget - window : 0;
}

/* The k-th largest value (k >= 1) of a[0..n-1], reordering a (quickselect). */
static float tl__kth_largest(float *a, int n, int k)
{
    int lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2], t;
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                t = a[i]; a[i] = a[j]; a[j] = t;
                i++;
                j--;
            }
        }
        if (target <= j)
            hi = j;
        else if (target >= i)
            lo = i;
        else
            break;
    }
    return a[target];
}

/* Sinks, then the top-k middle positions by summed attention probability,
   then the recent window: ascending, so a selection of everything repeats
   full attention exactly. */
static void tl__select_oracle(const tl_model *m, tl_state *s, int layer, int g, int n,
                              int n_sink, int n_window, int n_topk, tl_kv_list *l)
{
    const tl_config *c = &m->config;
    int hs = c->head_size, group = c->n_heads / c->n_kv_heads, i, j, cnt = 0;
    int lo = n_sink, hi = n - n_window, n_mid = hi - lo;
    float scale = 1.0f / sqrtf((float)hs);

    for (i = 0; i < n_sink; i++)
        l->pos[cnt++] = i;
    if (n_topk >= n_mid) {
        for (i = lo; i < hi; i++)
            l->pos[cnt++] = i;
    } else if (n_topk > 0) {
        const float *kbase = tl_key_row(c, s, layer, 0) + (size_t)g * (size_t)hs;
        float thr;
        int ties;
        memset(s->mass, 0, (size_t)n * sizeof(float));
        for (j = 0; j < group; j++) {
            int h = g * group + j;
            float *att = s->att + (size_t)h * (size_t)s->ctx;
            const float *q = s->q + (size_t)h * (size_t)hs;
            for (i = 0; i < n; i++)
                att[i] = tl__dot(q, kbase + (size_t)i * (size_t)c->kv_dim, hs) * scale;
            tl_softmax(att, n);
            for (i = 0; i < n; i++)
                s->mass[i] += att[i];
        }
        memcpy(s->select_tmp, s->mass + lo, (size_t)n_mid * sizeof(float));
        thr = tl__kth_largest(s->select_tmp, n_mid, n_topk);
        ties = n_topk;
        for (i = lo; i < hi; i++)
            if (s->mass[i] > thr)
                ties--;
        for (i = lo; i < hi; i++)
            if (s->mass[i] > thr || (s->mass[i] == thr && ties-- > 0))
                l->pos[cnt++] = i;
    }
    for (i = hi; i < n; i++)
        l->pos[cnt++] = i;
    l->n = cnt;
    l->k = l->v = NULL;
}

int tl_select(const tl_model *m, tl_state *s, const tl_policy *p, int layer, int pos)
{
    const tl_config *c = &m->config;
    int n = pos + 1, g, i, n_sink, n_window, n_topk;
    tl_attn_mode mode = p ? p->mode : TL_ATTN_FULL;

    if (mode == TL_ATTN_PQCACHE) {
        if (!p->select)
            return tl__fail(s->err, sizeof s->err, "pqcache mode not built in this binary");
        return p->select(p->select_user, m, s, layer, pos, s->lists);
    }
    if (!s->key_cache)   /* the lists below point into the host KV cache */
        return tl__fail(s->err, sizeof s->err, "this run state has no KV cache");
    if (mode == TL_ATTN_FULL) {
        for (g = 0; g < c->n_kv_heads; g++) {
            tl_kv_list *l = &s->lists[g];
            for (i = 0; i < n; i++)
                l->pos[i] = i;
            l->n = n;
            l->k = l->v = NULL;
        }
        return 0;
    }
    tl_budget(p, n, &n_sink, &n_window, &n_topk);
    for (g = 0; g < c->n_kv_heads; g++)
        tl__select_oracle(m, s, layer, g, n, n_sink, n_window,
                          mode == TL_ATTN_ORACLE ? n_topk : 0, &s->lists[g]);
    return 0;
}

/* ----------------------------------------------------------------------------
   Forward */

int tl_forward_layers(const tl_model *m, tl_state *s, const tl_policy *p, int token, int pos)
{
    const tl_config *c = &m->config;
    int l;
    if (token < 0 || token >= c->vocab_size)
        return tl__fail(s->err, sizeof s->err, "token %d is outside the vocabulary (0..%d)",
                        token, c->vocab_size - 1);
    if (pos < 0 || pos >= s->ctx)
        return tl__fail(s->err, sizeof s->err, "position %d is outside the context (0..%d)",
                        pos, s->ctx - 1);
    if (!s->key_cache)
        return tl__fail(s->err, sizeof s->err, "this run state has no KV cache");
    tl_embed(m, s, token);
    for (l = 0; l < c->n_layers; l++) {
        tl_layer_qkv(m, s, l, pos);
        if (tl_select(m, s, p, l, pos) != 0)
            return -1;
        tl_layer_attention(m, s, l, s->lists);
        tl_layer_ffn(m, s, l);
    }
    return 0;
}

float *tl_forward(const tl_model *m, tl_state *s, const tl_policy *p, int token, int pos)
{
    if (tl_forward_layers(m, s, p, token, pos) != 0)
        return NULL;
    return tl_classify(m, s);
}

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

/* ----------------------------------------------------------------------------
   Tokenizer */

static int tl__by_str(const void *a, const void *b)
{
    return strcmp(((const tl_token_index *)a)->str, ((const tl_token_index *)b)->str);
}

int tl_build_tokenizer(tl_tokenizer *t, const char *path, int vocab_size,
                       char *err, size_t errlen)
{
    FILE *f;
    struct stat st;
    int i, fd, max_len = 0, longest = 0;
    memset(t, 0, sizeof *t);
    if (vocab_size < 3)
        return tl__fail(err, errlen, "tokenizer: vocabulary size %d is too small (at least 3: "
                        "the ids of <s> and </s> are %d and %d)", vocab_size, TL_BOS, TL_EOS);
    fd = tl__open_regular(path, "tokenizer", &st, err, errlen);
    if (fd < 0)
        return -1;
    /* each token takes at least 8 bytes: refuse a vocabulary the file cannot
       hold before allocating for it */
    if (st.st_size < 4 || (unsigned long long)(st.st_size - 4) / 8u < (unsigned long long)vocab_size) {
        close(fd);
        return tl__fail(err, errlen, "tokenizer %s: %lld bytes cannot hold %d tokens "
                        "(does the tokenizer belong to this model?)", path,
                        (long long)st.st_size, vocab_size);
    }
    f = fdopen(fd, "rb");
    if (!f) {
        int e = errno;
        close(fd);
        return tl__fail(err, errlen, "cannot read tokenizer %s: %s", path, strerror(e));
    }
    t->vocab_size = vocab_size;
    t->vocab = (char **)calloc((size_t)vocab_size, sizeof(char *));
    t->scores = (float *)calloc((size_t)vocab_size, sizeof(float));
    t->sorted = (tl_token_index *)calloc((size_t)vocab_size, sizeof(tl_token_index));
    if (!t->vocab || !t->scores || !t->sorted) {
        fclose(f);
        tl_free_tokenizer(t);
        return tl__fail(err, errlen, "tokenizer: out of memory");
    }
    if (fread(&max_len, sizeof(int), 1, f) != 1 || max_len < 0 || max_len > (1 << 20)) {
        fclose(f);
        tl_free_tokenizer(t);
        return tl__fail(err, errlen, "tokenizer %s: bad or missing header", path);
    }
    for (i = 0; i < vocab_size; i++) {
        int len = -1;
        if (fread(&t->scores[i], sizeof(float), 1, f) != 1 ||
            fread(&len, sizeof(int), 1, f) != 1 || len < 0 || len > (1 << 20) ||
            !(t->vocab[i] = (char *)malloc((size_t)len + 1)) ||
            fread(t->vocab[i], 1, (size_t)len, f) != (size_t)len) {
            fclose(f);
            tl_free_tokenizer(t);
            return tl__fail(err, errlen, "tokenizer %s: token %d is truncated or corrupt "
                            "(does the tokenizer belong to this model?)", path, i);
        }
        t->vocab[i][len] = '\0';
        if (len > longest)
            longest = len;
        t->sorted[i].str = t->vocab[i];
        t->sorted[i].id = i;
    }
    fclose(f);
    t->max_token_length = max_len > longest ? max_len : longest;
    qsort(t->sorted, (size_t)vocab_size, sizeof(tl_token_index), tl__by_str);
    for (i = 0; i < 256; i++) {
        t->byte_pieces[2 * i] = (char)i;
        t->byte_pieces[2 * i + 1] = '\0';
    }
    return 0;
}

void tl_free_tokenizer(tl_tokenizer *t)
{
    int i;
    if (t->vocab)
        for (i = 0; i < t->vocab_size; i++)
            free(t->vocab[i]);
    free(t->vocab);
    free(t->scores);
    free(t->sorted);
    memset(t, 0, sizeof *t);
}

static int tl__lookup(const tl_tokenizer *t, const char *str)
{
    tl_token_index key, *hit;
    key.str = str;
    key.id = 0;
    hit = (tl_token_index *)bsearch(&key, t->sorted, (size_t)t->vocab_size,
                                    sizeof(tl_token_index), tl__by_str);
    return hit ? hit->id : -1;
}

int tl_encode(const tl_tokenizer *t, const char *text, int bos, int eos,
              int *tokens, int *n_tokens)
{
    size_t cap;
    char *buf;
    const char *p;
    int n = 0;
    *n_tokens = 0;
    if (t->vocab_size < 3 || !t->vocab || !t->scores || !t->sorted || t->max_token_length < 0)
        return -1;   /* no tokenizer, or no room for the ids of <s> and </s> */
    cap = 2 * (size_t)t->max_token_length + 8;
    buf = (char *)malloc(cap);
    if (!buf)
        return -1;
    if (bos)
        tokens[n++] = TL_BOS;
    if (text[0] != '\0') {   /* sentencepiece's dummy prefix */
        int id = tl__lookup(t, " ");
        if (id >= 0)
            tokens[n++] = id;
    }
    /* one token per UTF-8 code point, or its bytes (ids 3 + byte) if unknown */
    for (p = text; *p; ) {
        int len = 1, id, b;
        buf[0] = *p;
        while (len < 4 && ((unsigned char)p[len] & 0xC0) == 0x80) {
            buf[len] = p[len];
            len++;
        }
        buf[len] = '\0';
        id = tl__lookup(t, buf);
        if (id >= 0) {
            tokens[n++] = id;
        } else {
            for (b = 0; b < len; b++) {
                int byte_id = (unsigned char)buf[b] + 3;
                tokens[n++] = byte_id < t->vocab_size ? byte_id : 0;
            }
        }
        p += len;
    }
    /* merge the adjacent pair whose union scores best, until none is a token;
       <s> is a marker, not text: it never merges */
    for (;;) {
        float best = -1e30f;
        int best_id = -1, best_i = -1, i;
        for (i = bos ? 1 : 0; i + 1 < n; i++) {
            size_t la = strlen(t->vocab[tokens[i]]), lb = strlen(t->vocab[tokens[i + 1]]);
            int id;
            if (la + lb + 1 > cap)
                continue;
            memcpy(buf, t->vocab[tokens[i]], la);
            memcpy(buf + la, t->vocab[tokens[i + 1]], lb + 1);
            id = tl__lookup(t, buf);
            if (id >= 0 && t->scores[id] > best) {
                best = t->scores[id];
                best_id = id;
                best_i = i;
            }
        }
        if (best_i < 0)
            break;
        tokens[best_i] = best_id;
        memmove(tokens + best_i + 1, tokens + best_i + 2, (size_t)(n - best_i - 2) * sizeof(int));
        n--;
    }
    if (eos)
        tokens[n++] = TL_EOS;
    free(buf);
    *n_tokens = n;
    return 0;
}

static int tl__hex(char ch)
{
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return -1;
}

const char *tl_decode(const tl_tokenizer *t, int prev, int token)
{
    const char *piece;
    if (token < 0 || token >= t->vocab_size)
        return "";
    piece = t->vocab[token];
    if (prev == TL_BOS && piece[0] == ' ')
        piece++;   /* the dummy prefix of the first word */
    /* raw-byte tokens look like <0x0A> */
    if (strlen(piece) == 6 && piece[0] == '<' && piece[1] == '0' && piece[2] == 'x' &&
        tl__hex(piece[3]) >= 0 && tl__hex(piece[4]) >= 0 && piece[5] == '>')
        return t->byte_pieces + 2 * (tl__hex(piece[3]) * 16 + tl__hex(piece[4]));
    return piece;
}

void tl_print_piece(FILE *f, const char *piece)
{
    unsigned char b = (unsigned char)piece[0];
    if (b == 0)
        return;
    if (piece[1] == '\0' && (b < 0x20 || b == 0x7f) && b != '\n' && b != '\t' && b != '\r')
        return;   /* a lone control byte (bytes >= 0x80 are parts of UTF-8 text) */
    fputs(piece, f);
}

#endif /* TINY_LLAMA_IMPLEMENTATION */
