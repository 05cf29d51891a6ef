/* tiny_llama.h - a small Llama-architecture inference engine in plain C.

   The example engine of pqcache. It loads llama2.c checkpoints (fp32) and
   Hugging Face model directories (Llama, Mistral, Qwen2; bf16, fp16 or fp32
   safetensors, see "Hugging Face checkpoints" below), runs the transformer
   on the CPU (a token at a time, or the prompt in chunks of tokens) and
   splits every layer into
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
     RMSNorm (eps 1e-5, or the config's rms_norm_eps), rotary embeddings
     (RoPE) with llama2.c's interleaved pairs: pair i of a head is dims
     (2i, 2i+1), rotated by the angle pos * theta^(-2i/head_size) (Hugging
     Face models: pair i is dims (i, i + head_size/2), rotate_half, and the
     frequencies follow the config's rope_scaling: linear or llama3);
     optional q/k/v biases (Qwen2); grouped-query attention (query head h uses
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
    int head_size;         /* derived: dim / n_heads (a Hugging Face model may set it:
                              its config's head_dim) */
    int kv_dim;            /* derived: n_kv_heads * head_size */
    /* Hugging Face models (all zero for llama2.c checkpoints) */
    int arch;              /* tl_arch */
    int rope_layout;       /* tl_rope_layout: llama2.c interleaved, or rotate_half */
    float rms_eps;         /* 0 means 1e-5 (TL_RMS_EPS) */
    int q_dim;             /* derived: n_heads * head_size (dim for llama2.c) */
    int rope_scaling;      /* tl_rope_scaling */
    float rope_factor;     /* linear and llama3: the scaling factor */
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3 */
    int rope_orig_ctx;     /* llama3: original_max_position_embeddings */
    int qkv_bias;          /* 1: q, k and v projections have biases (Qwen2) */
    int wtype;             /* tl_dtype of the projection matrices */
} tl_config;

typedef enum { TL_ARCH_LLAMA2C = 0, TL_ARCH_LLAMA, TL_ARCH_MISTRAL, TL_ARCH_QWEN2 } tl_arch;
typedef enum { TL_ROPE_INTERLEAVED = 0, TL_ROPE_HALF = 1 } tl_rope_layout;
typedef enum { TL_ROPE_SCALING_NONE = 0, TL_ROPE_SCALING_LINEAR, TL_ROPE_SCALING_LLAMA3 } tl_rope_scaling;
typedef enum { TL_F32 = 0, TL_BF16 = 1, TL_F16 = 2 } tl_dtype;

/* A weight matrix as stored: row-major (out, in), elements of type dtype. */
typedef struct {
    const void *data;
    int dtype;             /* tl_dtype */
} tl_mat;

/* One layer's weights of a Hugging Face model (matrices as stored in the
   mapped files; norms and biases as fp32 copies). */
typedef struct {
    tl_mat wq, wk, wv, wo;         /* q_proj, k_proj, v_proj, o_proj */
    tl_mat w1, w2, w3;             /* gate_proj, down_proj, up_proj */
    const float *rms_att, *rms_ffn;
    const float *bq, *bk, *bv;     /* NULL without biases */
} tl_layer_weights;

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
    /* Hugging Face models: w holds only rms_final (fp32); the rest is here */
    tl_layer_weights *layers;  /* (n_layers), NULL for a llama2.c checkpoint */
    tl_mat emb, cls;           /* token embedding and classifier as stored */
    float *owned;              /* fp32 copies of norms and biases */
    void **shard_maps;         /* the mapped safetensors files */
    size_t *shard_sizes;
    int n_shards;
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

/* ----------------------------------------------------------------------------
   Hugging Face checkpoints: a directory with config.json and model.safetensors,
   or model.safetensors.index.json and the shards it names. tl_build_model
   takes such a directory (tl_build_hf_model directly). Architectures:
   LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM; weights in bf16,
   fp16 or fp32, used as stored in the mapped files. */
int tl_build_hf_model(tl_model *m, const char *dir, char *err, size_t errlen);

/* A tensor of a safetensors file */
typedef struct {
    char name[160];
    int dtype;             /* tl_dtype, or -1 for a type the engine does not use */
    int ndim;
    long long shape[8];
    size_t begin, end;     /* byte range in the file */
} tl_st_tensor;

typedef struct {
    int n;
    tl_st_tensor *t;       /* sorted by name */
} tl_st_file;

/* Parses and validates a safetensors file held in memory (data, size): the
   8-byte header length, the JSON header, the dtypes, shapes and data offsets
   (inside the file, sized as the shape says, not overlapping). */
int tl_st_parse(const unsigned char *data, size_t size, tl_st_file *f, char *err, size_t errlen);
void tl_st_free(tl_st_file *f);
/* Reads a config.json (text of len bytes) into c, checked as tl_check_config
   does. */
int tl_hf_parse_config(const char *json, size_t len, tl_config *c, char *err, size_t errlen);
/* Checks that the tensors of files[0 .. n_files-1] hold every tensor the
   config needs, each once and with the right shape and a usable dtype. With
   m not NULL and bases[i] the data of files[i], fills m's weights (fp32
   copies of the norms and biases in m->owned). */
int tl_hf_bind(const tl_config *c, const tl_st_file *files, const unsigned char *const *bases,
               int n_files, tl_model *m, char *err, size_t errlen);

/* Bytes of weights one decode token reads (every matrix once, the
   classifier whole, one embedding row). */
double tl_weight_bytes_per_token(const tl_model *m);
const char *tl_dtype_name(int dtype);
const char *tl_arch_name(int arch);
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
    void *pool;               /* worker threads of the projections (n_threads > 1) */
    double *rope_freq;        /* (head_size / 2) inverse frequencies, scaling applied */
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

/* Chunked prefill with full attention into s's KV cache: tokens[0 .. n-1] at
   positions pos0 .. pos0+n-1, the projections as matrix-matrix products over
   blocks of tokens. Returns the last token's logits, or NULL with s->err set.
   The logits equal those of tl_forward token by token, to the bit. */
float *tl_forward_chunk(const tl_model *m, tl_state *s, const int *tokens, int n, int pos0);
/* Batched stages (n tokens, rows of x are dim floats): (b) for n tokens at
   positions pos0 .. : q (n, q_dim), k and v (n, kv_dim); and (c, d) after
   attention: x += wo heads, then the FFN. 0, or -1 when memory runs out. */
int tl_layer_qkv_batch(const tl_model *m, tl_state *s, int layer, int pos0, int n,
                       const float *x, float *q, float *k, float *v);
int tl_layer_out_ffn_batch(const tl_model *m, tl_state *s, int layer, int n, float *x,
                           const float *heads);
/* Runs fn(arg, part, nparts) for part 0 .. nparts-1 on s's threads. */
void tl_parallel(tl_state *s, void (*fn)(void *arg, int part, int nparts), void *arg);

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
    if (c->arch == TL_ARCH_LLAMA2C || c->head_size <= 0) {
        if (c->dim % c->n_heads != 0)
            return tl__fail(err, errlen, "dim %d is not a multiple of n_heads %d", c->dim, c->n_heads);
        c->head_size = c->dim / c->n_heads;
    }
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0)
        return tl__fail(err, errlen, "n_heads %d is not a multiple of n_kv_heads %d",
                        c->n_heads, c->n_kv_heads);
    if (c->head_size % 2 != 0)
        return tl__fail(err, errlen, "head size %d (dim / n_heads) is odd; RoPE needs pairs",
                        c->head_size);
    if ((long long)c->n_heads * (long long)c->head_size > (1 << 24))
        return tl__fail(err, errlen, "n_heads %d x head size %d is too large", c->n_heads,
                        c->head_size);
    c->q_dim = c->n_heads * c->head_size;
    c->kv_dim = c->n_kv_heads * c->head_size;
    if (c->arch < 0 || c->arch > TL_ARCH_QWEN2)
        return tl__fail(err, errlen, "unknown architecture %d", c->arch);
    if (c->rope_layout != TL_ROPE_INTERLEAVED && c->rope_layout != TL_ROPE_HALF)
        return tl__fail(err, errlen, "unknown RoPE layout %d", c->rope_layout);
    if (!(c->rms_eps >= 0.0f && c->rms_eps < 1.0f))
        return tl__fail(err, errlen, "rms_norm_eps %g is not in [0, 1)", (double)c->rms_eps);
    if (c->rope_scaling < 0 || c->rope_scaling > TL_ROPE_SCALING_LLAMA3)
        return tl__fail(err, errlen, "unknown rope scaling %d", c->rope_scaling);
    if (c->rope_scaling != TL_ROPE_SCALING_NONE && !(c->rope_factor >= 1e-6f && c->rope_factor <= 1e6f))
        return tl__fail(err, errlen, "rope_scaling factor %g is not a positive number",
                        (double)c->rope_factor);
    if (c->rope_scaling == TL_ROPE_SCALING_LLAMA3 &&
        (!(c->rope_low_freq_factor > 0.0f && c->rope_low_freq_factor <= 1e6f) ||
         !(c->rope_high_freq_factor > c->rope_low_freq_factor && c->rope_high_freq_factor <= 1e6f) ||
         c->rope_orig_ctx <= 0))
        return tl__fail(err, errlen, "llama3 rope_scaling needs low_freq_factor > 0, "
                        "high_freq_factor > low_freq_factor and original_max_position_embeddings > 0");
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
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return tl_build_hf_model(m, path, err, errlen);
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
    int i;
    if (m->map)
        munmap(m->map, m->map_size);
    if (m->shard_maps)
        for (i = 0; i < m->n_shards; i++)
            if (m->shard_maps[i])
                munmap(m->shard_maps[i], m->shard_sizes[i]);
    free(m->shard_maps);
    free(m->shard_sizes);
    free(m->layers);
    free(m->owned);
    memset(m, 0, sizeof *m);
}

/* ----------------------------------------------------------------------------
   Hugging Face checkpoints: a strict JSON reader */

enum { TL__J_NULL, TL__J_BOOL, TL__J_NUM, TL__J_STR, TL__J_ARR, TL__J_OBJ };

typedef struct {
    int type;
    size_t start, end;     /* the value's text (a string: inside the quotes) */
    int first, next;       /* first child, next sibling (-1: none); an object's
                              children alternate key and value */
    int count;             /* children */
} tl__jnode;

typedef struct {
    const char *s;
    size_t len, pos;
    tl__jnode *nodes;
    int n, cap, depth;
    char *err;
    size_t errlen;
} tl__jparser;

#define TL__JSON_MAX_DEPTH 64

static int tl__jfail(tl__jparser *p, const char *what)
{
    return tl__fail(p->err, p->errlen, "bad JSON at byte %zu: %s", p->pos, what);
}

static void tl__jspace(tl__jparser *p)
{
    while (p->pos < p->len && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' ||
                               p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

static int tl__jnew(tl__jparser *p, int type)
{
    tl__jnode *d;
    if (p->n >= p->cap)
        return -1;
    d = &p->nodes[p->n];
    d->type = type;
    d->start = p->pos;
    d->end = p->pos;
    d->first = d->next = -1;
    d->count = 0;
    return p->n++;
}

static int tl__jhex(char ch)
{
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static int tl__jstring(tl__jparser *p, int *out)
{
    int id;
    p->pos++;   /* the opening quote */
    if ((id = tl__jnew(p, TL__J_STR)) < 0)
        return tl__jfail(p, "too many values");
    while (p->pos < p->len) {
        unsigned char ch = (unsigned char)p->s[p->pos];
        if (ch == '"') {
            p->nodes[id].end = p->pos++;
            *out = id;
            return 0;
        }
        if (ch < 0x20)
            return tl__jfail(p, "control character in a string");
        if (ch == '\\') {
            char e;
            if (p->pos + 1 >= p->len)
                break;
            e = p->s[p->pos + 1];
            if (e == 'u') {
                int k;
                if (p->pos + 6 > p->len)
                    break;
                for (k = 2; k < 6; k++)
                    if (tl__jhex(p->s[p->pos + (size_t)k]) < 0)
                        return tl__jfail(p, "bad \\u escape");
                p->pos += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", e) || e == '\0')
                return tl__jfail(p, "bad escape");
            p->pos += 2;
            continue;
        }
        p->pos++;
    }
    return tl__jfail(p, "unterminated string");
}

static int tl__jnumber(tl__jparser *p, int *out)
{
    size_t i = p->pos;
    int id;
    if (i < p->len && p->s[i] == '-') i++;
    if (i >= p->len || !(p->s[i] >= '0' && p->s[i] <= '9'))
        return tl__jfail(p, "bad number");
    if (p->s[i] == '0') i++;
    else while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
    if (i < p->len && p->s[i] == '.') {
        i++;
        if (i >= p->len || !(p->s[i] >= '0' && p->s[i] <= '9'))
            return tl__jfail(p, "bad fraction");
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
    }
    if (i < p->len && (p->s[i] == 'e' || p->s[i] == 'E')) {
        i++;
        if (i < p->len && (p->s[i] == '+' || p->s[i] == '-')) i++;
        if (i >= p->len || !(p->s[i] >= '0' && p->s[i] <= '9'))
            return tl__jfail(p, "bad exponent");
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
    }
    if ((id = tl__jnew(p, TL__J_NUM)) < 0)
        return tl__jfail(p, "too many values");
    p->nodes[id].end = i;
    p->pos = i;
    *out = id;
    return 0;
}

static int tl__jvalue(tl__jparser *p, int *out);

static int tl__jcontainer(tl__jparser *p, int *out)
{
    int obj = p->s[p->pos] == '{', id, last = -1;
    char close = obj ? '}' : ']';
    if (++p->depth > TL__JSON_MAX_DEPTH)
        return tl__jfail(p, "nested too deeply");
    if ((id = tl__jnew(p, obj ? TL__J_OBJ : TL__J_ARR)) < 0)
        return tl__jfail(p, "too many values");
    p->pos++;
    tl__jspace(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        p->nodes[id].end = p->pos;
        p->depth--;
        *out = id;
        return 0;
    }
    for (;;) {
        int child, val;
        tl__jspace(p);
        if (obj) {
            if (p->pos >= p->len || p->s[p->pos] != '"')
                return tl__jfail(p, "expected a key");
            if (tl__jstring(p, &child))
                return -1;
            if (last >= 0) p->nodes[last].next = child; else p->nodes[id].first = child;
            last = child;
            tl__jspace(p);
            if (p->pos >= p->len || p->s[p->pos] != ':')
                return tl__jfail(p, "expected ':'");
            p->pos++;
        }
        if (tl__jvalue(p, &val))
            return -1;
        if (last >= 0) p->nodes[last].next = val; else p->nodes[id].first = val;
        last = val;
        p->nodes[id].count++;
        tl__jspace(p);
        if (p->pos < p->len && p->s[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
            p->nodes[id].end = p->pos;
            p->depth--;
            *out = id;
            return 0;
        }
        return tl__jfail(p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int tl__jvalue(tl__jparser *p, int *out)
{
    char ch;
    tl__jspace(p);
    if (p->pos >= p->len)
        return tl__jfail(p, "unexpected end");
    ch = p->s[p->pos];
    if (ch == '{' || ch == '[')
        return tl__jcontainer(p, out);
    if (ch == '"')
        return tl__jstring(p, out);
    if (ch == '-' || (ch >= '0' && ch <= '9'))
        return tl__jnumber(p, out);
    {
        static const char *const words[3] = { "true", "false", "null" };
        int w;
        for (w = 0; w < 3; w++) {
            size_t k = strlen(words[w]);
            if (p->len - p->pos >= k && memcmp(p->s + p->pos, words[w], k) == 0) {
                int id = tl__jnew(p, w == 2 ? TL__J_NULL : TL__J_BOOL);
                if (id < 0)
                    return tl__jfail(p, "too many values");
                p->pos += k;
                p->nodes[id].end = p->pos;
                *out = id;
                return 0;
            }
        }
    }
    return tl__jfail(p, "unexpected character");
}

/* Parses a whole JSON text (one value, nothing after it but spaces). *nodes
   is allocated (free it); the root is node 0. */
static int tl__json_parse(const char *s, size_t len, tl__jnode **nodes, char *err, size_t errlen)
{
    tl__jparser p;
    int root;
    memset(&p, 0, sizeof p);
    *nodes = NULL;
    if (len > ((size_t)1 << 30))
        return tl__fail(err, errlen, "JSON text of %zu bytes is too large", len);
    p.s = s;
    p.len = len;
    p.cap = (int)(len / 2 + 2);   /* every value but the first needs 2 bytes at least */
    p.nodes = (tl__jnode *)malloc((size_t)p.cap * sizeof(tl__jnode));
    p.err = err;
    p.errlen = errlen;
    if (!p.nodes)
        return tl__fail(err, errlen, "out of memory for a JSON text of %zu bytes", len);
    if (tl__jvalue(&p, &root)) {
        free(p.nodes);
        return -1;
    }
    tl__jspace(&p);
    if (p.pos != len) {
        tl__jfail(&p, "text after the value");
        free(p.nodes);
        return -1;
    }
    *nodes = p.nodes;
    return 0;
}

/* Decodes a string node into buf (NUL-terminated, UTF-8); -1 when it does not
   fit or holds an escaped NUL or a lone surrogate. */
static int tl__jstr(const char *s, const tl__jnode *d, char *buf, size_t cap)
{
    size_t i = d->start, o = 0;
    while (i < d->end) {
        unsigned long cp;
        if (s[i] != '\\') {
            if (o + 1 >= cap) return -1;
            buf[o++] = s[i++];
            continue;
        }
        switch (s[i + 1]) {
        case 'b': cp = 8; break;
        case 'f': cp = 12; break;
        case 'n': cp = 10; break;
        case 'r': cp = 13; break;
        case 't': cp = 9; break;
        case 'u':
            cp = (unsigned long)(tl__jhex(s[i + 2]) << 12 | tl__jhex(s[i + 3]) << 8 |
                                 tl__jhex(s[i + 4]) << 4 | tl__jhex(s[i + 5]));
            i += 4;
            if (cp >= 0xD800 && cp < 0xDC00) {   /* a high surrogate needs its low half */
                unsigned long lo;
                if (i + 8 > d->end || s[i + 2] != '\\' || s[i + 3] != 'u')
                    return -1;
                lo = (unsigned long)(tl__jhex(s[i + 4]) << 12 | tl__jhex(s[i + 5]) << 8 |
                                     tl__jhex(s[i + 6]) << 4 | tl__jhex(s[i + 7]));
                if (lo < 0xDC00 || lo > 0xDFFF)
                    return -1;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return -1;
            }
            break;
        default: cp = (unsigned long)(unsigned char)s[i + 1]; break;
        }
        i += 2;
        if (cp == 0) return -1;
        if (o + 5 >= cap) return -1;
        if (cp < 0x80) {
            buf[o++] = (char)cp;
        } else if (cp < 0x800) {
            buf[o++] = (char)(0xC0 | (cp >> 6));
            buf[o++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            buf[o++] = (char)(0xE0 | (cp >> 12));
            buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            buf[o++] = (char)(0x80 | (cp & 0x3F));
        } else {
            buf[o++] = (char)(0xF0 | (cp >> 18));
            buf[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
            buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            buf[o++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    buf[o] = '\0';
    return 0;
}

/* The value of key in object node obj, or -1. */
static int tl__jget(const char *s, const tl__jnode *nodes, int obj, const char *key)
{
    int k;
    char buf[256];
    if (obj < 0 || nodes[obj].type != TL__J_OBJ)
        return -1;
    for (k = nodes[obj].first; k >= 0; k = nodes[nodes[k].next].next)
        if (tl__jstr(s, &nodes[k], buf, sizeof buf) == 0 && strcmp(buf, key) == 0)
            return nodes[k].next;
    return -1;
}

/* A non-negative integer (no sign, fraction or exponent) up to max. */
static int tl__juint(const char *s, const tl__jnode *d, unsigned long long max,
                     unsigned long long *out)
{
    size_t i;
    unsigned long long v = 0;
    if (d->type != TL__J_NUM || d->start == d->end)
        return -1;
    for (i = d->start; i < d->end; i++) {
        unsigned digit;
        if (s[i] < '0' || s[i] > '9')
            return -1;
        digit = (unsigned)(s[i] - '0');
        if (v > (max - digit) / 10)
            return -1;
        v = v * 10 + digit;
    }
    *out = v;
    return 0;
}

static int tl__jdouble(const char *s, const tl__jnode *d, double *out)
{
    char buf[64];
    size_t n = d->end - d->start;
    char *end;
    if (d->type != TL__J_NUM || n == 0 || n >= sizeof buf)
        return -1;
    memcpy(buf, s + d->start, n);
    buf[n] = '\0';
    *out = strtod(buf, &end);
    return *end == '\0' && *out == *out ? 0 : -1;
}

/* ----------------------------------------------------------------------------
   Hugging Face checkpoints: safetensors */

static const char *const tl__st_dtypes[] = {
    "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64",
    "BOOL", "F8_E4M3", "F8_E5M2"
};
static const int tl__st_sizes[] = { 4, 2, 2, 8, 8, 4, 2, 1, 1, 2, 4, 8, 1, 1, 1 };

#define TL__ST_MAX_HEADER ((size_t)100 << 20)

static int tl__by_tensor_name(const void *a, const void *b)
{
    return strcmp(((const tl_st_tensor *)a)->name, ((const tl_st_tensor *)b)->name);
}

static int tl__by_begin(const void *a, const void *b)
{
    const tl_st_tensor *x = *(const tl_st_tensor *const *)a, *y = *(const tl_st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->end < y->end ? -1 : x->end > y->end);
}

void tl_st_free(tl_st_file *f)
{
    free(f->t);
    f->t = NULL;
    f->n = 0;
}

int tl_st_parse(const unsigned char *data, size_t size, tl_st_file *f, char *err, size_t errlen)
{
    unsigned long long hlen = 0;
    size_t data0, i;
    const char *js;
    tl__jnode *nodes = NULL;
    tl_st_tensor **by_begin = NULL;
    int k, n = 0, rc = -1;
    char why[TL_ERR_LEN];

    f->n = 0;
    f->t = NULL;
    if (size < 8)
        return tl__fail(err, errlen, "truncated: %zu bytes, a safetensors file starts with an "
                        "8-byte header length", size);
    for (k = 7; k >= 0; k--)
        hlen = hlen << 8 | data[k];
    if (hlen < 2 || hlen > TL__ST_MAX_HEADER || hlen > (unsigned long long)(size - 8))
        return tl__fail(err, errlen, "header length %llu does not fit the file of %zu bytes%s", hlen,
                        size, hlen > TL__ST_MAX_HEADER ? " (limit 100 MB)" : " (truncated?)");
    js = (const char *)data + 8;
    data0 = 8 + (size_t)hlen;
    if (js[0] != '{')
        return tl__fail(err, errlen, "the header is not a JSON object");
    if (tl__json_parse(js, (size_t)hlen, &nodes, why, sizeof why))
        return tl__fail(err, errlen, "header: %s", why);
    if (nodes[0].type != TL__J_OBJ) {
        free(nodes);
        return tl__fail(err, errlen, "the header is not a JSON object");
    }
    f->t = (tl_st_tensor *)calloc((size_t)nodes[0].count + 1, sizeof(tl_st_tensor));
    if (!f->t) {
        int cnt = nodes[0].count;
        free(nodes);
        return tl__fail(err, errlen, "out of memory for %d tensors", cnt);
    }
    for (k = nodes[0].first; k >= 0; k = nodes[nodes[k].next].next) {
        int v = nodes[k].next, dt, sh, off, d, ti;
        tl_st_tensor *t = &f->t[n];
        char dts[32];
        unsigned long long b, e, numel = 1;
        if (tl__jstr(js, &nodes[k], t->name, sizeof t->name) != 0) {
            tl__fail(err, errlen, "a tensor name is longer than %zu bytes or badly escaped",
                     sizeof t->name - 1);
            goto out;
        }
        if (strcmp(t->name, "__metadata__") == 0) {
            if (nodes[v].type != TL__J_OBJ) {
                tl__fail(err, errlen, "__metadata__ is not an object");
                goto out;
            }
            continue;
        }
        if (nodes[v].type != TL__J_OBJ) {
            tl__fail(err, errlen, "tensor %s: not an object", t->name);
            goto out;
        }
        dt = tl__jget(js, nodes, v, "dtype");
        sh = tl__jget(js, nodes, v, "shape");
        off = tl__jget(js, nodes, v, "data_offsets");
        if (dt < 0 || sh < 0 || off < 0 || nodes[dt].type != TL__J_STR ||
            nodes[sh].type != TL__J_ARR || nodes[off].type != TL__J_ARR) {
            tl__fail(err, errlen, "tensor %s: needs dtype (string), shape and data_offsets (arrays)",
                     t->name);
            goto out;
        }
        if (tl__jstr(js, &nodes[dt], dts, sizeof dts) != 0)
            dts[0] = '\0';
        for (ti = 0; ti < (int)(sizeof tl__st_sizes / sizeof tl__st_sizes[0]); ti++)
            if (strcmp(dts, tl__st_dtypes[ti]) == 0)
                break;
        if (ti == (int)(sizeof tl__st_sizes / sizeof tl__st_sizes[0])) {
            tl__fail(err, errlen, "tensor %s: unknown dtype '%s'", t->name, dts);
            goto out;
        }
        t->dtype = ti <= 2 ? ti : -1;   /* F32, BF16, F16 are tl_dtype's values */
        if (nodes[sh].count > 8) {
            tl__fail(err, errlen, "tensor %s: %d dimensions (at most 8)", t->name, nodes[sh].count);
            goto out;
        }
        t->ndim = 0;
        for (d = nodes[sh].first; d >= 0; d = nodes[d].next) {
            unsigned long long dimv;
            if (tl__juint(js, &nodes[d], (unsigned long long)1 << 40, &dimv) != 0) {
                tl__fail(err, errlen, "tensor %s: a shape entry is not an integer in 0..2^40", t->name);
                goto out;
            }
            t->shape[t->ndim++] = (long long)dimv;
            if (dimv != 0 && numel > ((unsigned long long)1 << 50) / dimv) {
                tl__fail(err, errlen, "tensor %s: its shape is too large", t->name);
                goto out;
            }
            numel *= dimv;
        }
        if (nodes[off].count != 2 ||
            tl__juint(js, &nodes[nodes[off].first], (unsigned long long)-1, &b) != 0 ||
            tl__juint(js, &nodes[nodes[nodes[off].first].next], (unsigned long long)-1, &e) != 0) {
            tl__fail(err, errlen, "tensor %s: data_offsets must be two non-negative integers", t->name);
            goto out;
        }
        if (b > e || e > (unsigned long long)(size - data0)) {
            tl__fail(err, errlen, "tensor %s: data_offsets [%llu, %llu] are outside the %zu data bytes "
                     "of the file (truncated?)", t->name, b, e, size - data0);
            goto out;
        }
        if (e - b != numel * (unsigned long long)tl__st_sizes[ti]) {
            tl__fail(err, errlen, "tensor %s: %llu bytes for %llu elements of %s", t->name, e - b,
                     numel, dts);
            goto out;
        }
        t->begin = data0 + (size_t)b;
        t->end = data0 + (size_t)e;
        n++;
    }
    qsort(f->t, (size_t)n, sizeof(tl_st_tensor), tl__by_tensor_name);
    for (k = 1; k < n; k++)
        if (strcmp(f->t[k - 1].name, f->t[k].name) == 0) {
            tl__fail(err, errlen, "tensor %s appears twice", f->t[k].name);
            goto out;
        }
    by_begin = (tl_st_tensor **)malloc((size_t)(n + 1) * sizeof(tl_st_tensor *));
    if (!by_begin) {
        tl__fail(err, errlen, "out of memory");
        goto out;
    }
    for (k = 0; k < n; k++)
        by_begin[k] = &f->t[k];
    qsort(by_begin, (size_t)n, sizeof(tl_st_tensor *), tl__by_begin);
    for (i = 1; i < (size_t)n; i++)
        if (by_begin[i]->begin < by_begin[i - 1]->end) {
            tl__fail(err, errlen, "tensors %s and %s overlap in the file", by_begin[i - 1]->name,
                     by_begin[i]->name);
            goto out;
        }
    f->n = n;
    rc = 0;
out:
    free(by_begin);
    free(nodes);
    if (rc != 0)
        tl_st_free(f);
    return rc;
}

static const tl_st_tensor *tl__st_find(const tl_st_file *f, const char *name)
{
    tl_st_tensor key;
    size_t n = strlen(name);
    if (n >= sizeof key.name || f->n == 0)
        return NULL;
    memcpy(key.name, name, n + 1);
    return (const tl_st_tensor *)bsearch(&key, f->t, (size_t)f->n, sizeof(tl_st_tensor),
                                         tl__by_tensor_name);
}

/* ----------------------------------------------------------------------------
   Hugging Face checkpoints: config.json */

static int tl__jcfg_int(const char *s, const tl__jnode *nodes, const char *key, int required,
                        int def, int lo, int hi, int *out, char *err, size_t errlen)
{
    int v = tl__jget(s, nodes, 0, key);
    unsigned long long x;
    if (v < 0 || nodes[v].type == TL__J_NULL) {
        if (required)
            return tl__fail(err, errlen, "config.json: %s is missing", key);
        *out = def;
        return 0;
    }
    if (tl__juint(s, &nodes[v], (unsigned long long)hi, &x) != 0 || x < (unsigned long long)lo)
        return tl__fail(err, errlen, "config.json: %s must be an integer in %d..%d", key, lo, hi);
    *out = (int)x;
    return 0;
}

static int tl__jcfg_float(const char *s, const tl__jnode *nodes, int obj, const char *key,
                          double def, double lo, double hi, float *out, char *err, size_t errlen)
{
    int v = tl__jget(s, nodes, obj, key);
    double x;
    if (v < 0 || nodes[v].type == TL__J_NULL) {
        *out = (float)def;
        return 0;
    }
    if (tl__jdouble(s, &nodes[v], &x) != 0 || !(x >= lo && x <= hi))
        return tl__fail(err, errlen, "config.json: %s must be a number in [%g, %g]", key, lo, hi);
    *out = (float)x;
    return 0;
}

static int tl__jcfg_bool(const char *s, const tl__jnode *nodes, const char *key, int def,
                         int *out, char *err, size_t errlen)
{
    int v = tl__jget(s, nodes, 0, key);
    if (v < 0 || nodes[v].type == TL__J_NULL) {
        *out = def;
        return 0;
    }
    if (nodes[v].type != TL__J_BOOL)
        return tl__fail(err, errlen, "config.json: %s must be true or false", key);
    *out = s[nodes[v].start] == 't';
    return 0;
}

/* One layout's RoPE settings (the older top-level rope_theta and rope_scaling, or the
   rope_parameters object transformers writes since version 5): what it states. */
typedef struct tl__rope_cfg {
    int theta_given, type_given;
    double theta;
    int scaling;       /* tl_rope_scaling */
    double factor, low, high;
    unsigned long long orig;
} tl__rope_cfg;

/* A number field of object v into *out (given: whether it was there), in [lo, hi]. */
static int tl__jcfg_num(const char *s, const tl__jnode *nodes, int v, const char *what, const char *key,
                        double lo, double hi, double *out, int *given, char *err, size_t errlen)
{
    int n = tl__jget(s, nodes, v, key);
    double x;
    if (given)
        *given = 0;
    if (n < 0 || nodes[n].type == TL__J_NULL)
        return 0;
    if (tl__jdouble(s, &nodes[n], &x) != 0 || !(x >= lo && x <= hi))
        return tl__fail(err, errlen, "config.json: %s.%s must be a number in [%g, %g]", what, key, lo, hi);
    *out = x;
    if (given)
        *given = 1;
    return 0;
}

/* Reads the scaling object v (rope_scaling, or rope_parameters, which also holds
   rope_theta: with_theta) into r: its rope_type (or type) and the fields that type
   uses. The types the engine implements are default, linear and llama3; any other
   type, and any field that would change the arithmetic, is refused by name. */
static int tl__hf_rope_obj(const char *s, const tl__jnode *nodes, int v, const char *what, int with_theta,
                           tl__rope_cfg *r, char *err, size_t errlen)
{
    static const char *const known[] = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                                        "high_freq_factor", "original_max_position_embeddings",
                                        "partial_rotary_factor"};
    char type[64], key[256];
    int t, k, given;
    size_t i;
    double prf = 1.0;
    if (nodes[v].type != TL__J_OBJ)
        return tl__fail(err, errlen, "config.json: %s must be an object or null", what);
    t = tl__jget(s, nodes, v, "rope_type");
    if (t < 0)
        t = tl__jget(s, nodes, v, "type");
    if (t >= 0 && nodes[t].type == TL__J_NULL)
        t = -1;
    if (t >= 0 && (nodes[t].type != TL__J_STR || tl__jstr(s, &nodes[t], type, sizeof type) != 0))
        return tl__fail(err, errlen, "config.json: %s.rope_type must be a string", what);
    if (t < 0 && !with_theta)
        return tl__fail(err, errlen, "config.json: %s needs a rope_type", what);
    if (t < 0)
        strcpy(type, "default"); /* what transformers assumes */
    if (strcmp(type, "default") != 0 && strcmp(type, "linear") != 0 && strcmp(type, "llama3") != 0)
        return tl__fail(err, errlen, "config.json: %s.rope_type '%s' is not supported (default, linear, llama3)",
                        what, type);
    for (k = nodes[v].first; k >= 0; k = nodes[nodes[k].next].next) {
        int ok = 0;
        if (tl__jstr(s, &nodes[k], key, sizeof key) != 0)
            return tl__fail(err, errlen, "config.json: %s has an unreadable key", what);
        for (i = 0; i < sizeof known / sizeof known[0]; i++)
            ok |= strcmp(key, known[i]) == 0;
        if (!ok || (!with_theta && strcmp(key, "rope_theta") == 0))
            return tl__fail(err, errlen, "config.json: %s.%s is not supported (the engine implements "
                            "rope_type default, linear and llama3 with their own fields)", what, key);
    }
    r->type_given = 1;
    if (with_theta && tl__jcfg_num(s, nodes, v, what, "rope_theta", 1.0, 3.0e38, &r->theta, &r->theta_given,
                                   err, errlen))
        return -1;
    if (tl__jcfg_num(s, nodes, v, what, "partial_rotary_factor", 0.0, 1.0, &prf, NULL, err, errlen))
        return -1;
    if (prf != 1.0)
        return tl__fail(err, errlen, "config.json: %s.partial_rotary_factor %g is not supported (the engine "
                        "rotates every dimension)", what, prf);
    if (strcmp(type, "default") == 0) {
        r->scaling = TL_ROPE_SCALING_NONE;
        for (i = 3; i < 7; i++) /* a scaling field under the default type: a contradiction */
            if (tl__jget(s, nodes, v, known[i]) >= 0)
                return tl__fail(err, errlen, "config.json: %s.%s is set but rope_type is default", what, known[i]);
        return 0;
    }
    r->scaling = type[1] == 'i' ? TL_ROPE_SCALING_LINEAR : TL_ROPE_SCALING_LLAMA3;
    if (tl__jcfg_num(s, nodes, v, what, "factor", 1e-6, 1e6, &r->factor, &given, err, errlen))
        return -1;
    if (!given)
        return tl__fail(err, errlen, "config.json: %s needs a factor", what);
    if (r->scaling == TL_ROPE_SCALING_LINEAR) {
        for (i = 4; i < 7; i++)
            if (tl__jget(s, nodes, v, known[i]) >= 0)
                return tl__fail(err, errlen, "config.json: %s.%s is set but rope_type is linear", what, known[i]);
        return 0;
    }
    r->low = 1.0;
    r->high = 4.0;
    if (tl__jcfg_num(s, nodes, v, what, "low_freq_factor", 1e-6, 1e6, &r->low, NULL, err, errlen) ||
        tl__jcfg_num(s, nodes, v, what, "high_freq_factor", 1e-6, 1e6, &r->high, NULL, err, errlen))
        return -1;
    k = tl__jget(s, nodes, v, "original_max_position_embeddings");
    if (k < 0 || tl__juint(s, &nodes[k], 1u << 30, &r->orig) != 0 || r->orig == 0)
        return tl__fail(err, errlen, "config.json: llama3 %s needs original_max_position_embeddings (a positive "
                        "integer)", what);
    return 0;
}

/* The RoPE settings of a config.json in either layout (both may appear: then they must
   agree) into c: theta and the frequency scaling. */
static int tl__hf_rope(const char *s, const tl__jnode *nodes, tl_config *c, char *err, size_t errlen)
{
    tl__rope_cfg o, p, *u;
    int v;
    double prf = 1.0;
    memset(&o, 0, sizeof o);
    memset(&p, 0, sizeof p);
    if (tl__jcfg_num(s, nodes, 0, "config", "rope_theta", 1.0, 3.0e38, &o.theta, &o.theta_given, err, errlen) ||
        tl__jcfg_num(s, nodes, 0, "config", "partial_rotary_factor", 0.0, 1.0, &prf, NULL, err, errlen))
        return -1;
    if (prf != 1.0)
        return tl__fail(err, errlen, "config.json: partial_rotary_factor %g is not supported (the engine rotates "
                        "every dimension)", prf);
    v = tl__jget(s, nodes, 0, "rope_scaling");
    if (v >= 0 && nodes[v].type != TL__J_NULL && tl__hf_rope_obj(s, nodes, v, "rope_scaling", 0, &o, err, errlen))
        return -1;
    v = tl__jget(s, nodes, 0, "rope_parameters");
    if (v >= 0 && nodes[v].type != TL__J_NULL && tl__hf_rope_obj(s, nodes, v, "rope_parameters", 1, &p, err, errlen))
        return -1;
    if (p.theta_given && o.theta_given && p.theta != o.theta)
        return tl__fail(err, errlen, "config.json: rope_theta %g and rope_parameters.rope_theta %g disagree",
                        o.theta, p.theta);
    if (p.type_given && o.type_given &&
        (p.scaling != o.scaling || p.factor != o.factor || p.low != o.low || p.high != o.high || p.orig != o.orig))
        return tl__fail(err, errlen, "config.json: rope_scaling and rope_parameters disagree");
    u = p.type_given ? &p : &o;
    c->rope_theta = p.theta_given ? (float)p.theta : o.theta_given ? (float)o.theta : TL_DEFAULT_ROPE_THETA;
    c->rope_scaling = u->scaling;
    if (u->scaling != TL_ROPE_SCALING_NONE)
        c->rope_factor = (float)u->factor;
    if (u->scaling == TL_ROPE_SCALING_LLAMA3) {
        c->rope_low_freq_factor = (float)u->low;
        c->rope_high_freq_factor = (float)u->high;
        c->rope_orig_ctx = (int)u->orig;
    }
    return 0;
}

int tl_hf_parse_config(const char *json, size_t len, tl_config *c, char *err, size_t errlen)
{
    tl__jnode *nodes = NULL;
    char why[TL_ERR_LEN], buf[64];
    int v, rc = -1, tie = 0, flag = 0;
    memset(c, 0, sizeof *c);
    if (tl__json_parse(json, len, &nodes, why, sizeof why))
        return tl__fail(err, errlen, "config.json: %s", why);
    if (nodes[0].type != TL__J_OBJ) {
        tl__fail(err, errlen, "config.json is not a JSON object");
        goto out;
    }
    v = tl__jget(json, nodes, 0, "architectures");
    if (v < 0 || nodes[v].type != TL__J_ARR || nodes[v].count < 1 ||
        nodes[nodes[v].first].type != TL__J_STR ||
        tl__jstr(json, &nodes[nodes[v].first], buf, sizeof buf) != 0) {
        tl__fail(err, errlen, "config.json: architectures must be a list naming the model class");
        goto out;
    }
    if (strcmp(buf, "LlamaForCausalLM") == 0) c->arch = TL_ARCH_LLAMA;
    else if (strcmp(buf, "MistralForCausalLM") == 0) c->arch = TL_ARCH_MISTRAL;
    else if (strcmp(buf, "Qwen2ForCausalLM") == 0) c->arch = TL_ARCH_QWEN2;
    else {
        tl__fail(err, errlen, "config.json: architecture %s is not supported (LlamaForCausalLM, "
                 "MistralForCausalLM, Qwen2ForCausalLM)", buf);
        goto out;
    }
    v = tl__jget(json, nodes, 0, "hidden_act");
    if (v >= 0 && (nodes[v].type != TL__J_STR || tl__jstr(json, &nodes[v], buf, sizeof buf) != 0 ||
                   strcmp(buf, "silu") != 0)) {
        tl__fail(err, errlen, "config.json: hidden_act must be \"silu\"");
        goto out;
    }
    if (tl__jcfg_int(json, nodes, "hidden_size", 1, 0, 1, 1 << 20, &c->dim, err, errlen) ||
        tl__jcfg_int(json, nodes, "intermediate_size", 1, 0, 1, 1 << 22, &c->hidden_dim, err, errlen) ||
        tl__jcfg_int(json, nodes, "num_hidden_layers", 1, 0, 1, 4096, &c->n_layers, err, errlen) ||
        tl__jcfg_int(json, nodes, "num_attention_heads", 1, 0, 1, 4096, &c->n_heads, err, errlen) ||
        tl__jcfg_int(json, nodes, "num_key_value_heads", 0, c->n_heads, 1, 4096, &c->n_kv_heads,
                     err, errlen) ||
        tl__jcfg_int(json, nodes, "vocab_size", 1, 0, 1, 1 << 24, &c->vocab_size, err, errlen) ||
        tl__jcfg_int(json, nodes, "max_position_embeddings", 0, 2048, 1, 1 << 30, &c->seq_len,
                     err, errlen) ||
        tl__jcfg_int(json, nodes, "head_dim", 0, 0, 2, 1 << 16, &c->head_size, err, errlen) ||
        tl__jcfg_float(json, nodes, 0, "rms_norm_eps", 1e-6, 1e-12, 0.5, &c->rms_eps, err, errlen) ||
        tl__jcfg_bool(json, nodes, "tie_word_embeddings", 0, &tie, err, errlen) ||
        tl__hf_rope(json, nodes, c, err, errlen))
        goto out;
    if (c->arch == TL_ARCH_LLAMA && (tl__jcfg_bool(json, nodes, "attention_bias", 0, &flag, err, errlen) || flag ||
                                     tl__jcfg_bool(json, nodes, "mlp_bias", 0, &flag, err, errlen) || flag)) {
        if (flag)
            tl__fail(err, errlen, "config.json: attention_bias / mlp_bias are not supported");
        goto out;
    }
    if (c->arch == TL_ARCH_QWEN2 && (tl__jcfg_bool(json, nodes, "use_sliding_window", 0, &flag, err, errlen) || flag)) {
        if (flag)
            tl__fail(err, errlen, "config.json: use_sliding_window is not supported");
        goto out;
    }
    v = tl__jget(json, nodes, 0, "layer_types"); /* every layer full attention, or refused */
    if (v >= 0 && nodes[v].type != TL__J_NULL) {
        int e, i = 0;
        if (nodes[v].type != TL__J_ARR) {
            tl__fail(err, errlen, "config.json: layer_types must be a list");
            goto out;
        }
        for (e = nodes[v].first; e >= 0; e = nodes[e].next, i++)
            if (nodes[e].type != TL__J_STR || tl__jstr(json, &nodes[e], buf, sizeof buf) != 0 ||
                strcmp(buf, "full_attention") != 0) {
                tl__fail(err, errlen, "config.json: layer_types[%d] is not \"full_attention\" (only full "
                         "attention is supported)", i);
                goto out;
            }
    }
    if (c->arch == TL_ARCH_MISTRAL) {   /* the model attends over the window only: cap the context */
        int sw = 0;
        if (tl__jcfg_int(json, nodes, "sliding_window", 0, 0, 1, 1 << 30, &sw, err, errlen))
            goto out;
        if (sw > 0 && sw < c->seq_len)
            c->seq_len = sw;
    }
    c->shared_classifier = tie;
    c->qkv_bias = c->arch == TL_ARCH_QWEN2;
    c->rope_layout = TL_ROPE_HALF;
    c->version = 2;
    if (tl_check_config(c, why, sizeof why)) {
        tl__fail(err, errlen, "config.json: %s", why);
        goto out;
    }
    rc = 0;
out:
    free(nodes);
    return rc;
}

/* ----------------------------------------------------------------------------
   Hugging Face checkpoints: binding the tensors */

const char *tl_dtype_name(int dtype)
{
    return dtype == TL_F32 ? "fp32" : dtype == TL_BF16 ? "bf16" : dtype == TL_F16 ? "fp16" : "?";
}

const char *tl_arch_name(int arch)
{
    switch (arch) {
    case TL_ARCH_LLAMA2C: return "llama2.c";
    case TL_ARCH_LLAMA: return "LlamaForCausalLM";
    case TL_ARCH_MISTRAL: return "MistralForCausalLM";
    case TL_ARCH_QWEN2: return "Qwen2ForCausalLM";
    default: return "?";
    }
}

static float tl__half_to_float(unsigned short h)
{
    unsigned int sign = (unsigned int)(h >> 15) << 31, e = (h >> 10) & 31u, mant = h & 0x3FFu, bits;
    float f;
    if (e == 0) {
        f = (float)mant * (1.0f / 16777216.0f);   /* subnormal: mant * 2^-24, exact */
        return sign ? -f : f;
    }
    if (e == 31)
        bits = sign | 0x7F800000u | (mant << 13);
    else
        bits = sign | ((e + 112u) << 23) | (mant << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float tl__bf16_to_float(unsigned short h)
{
    unsigned int bits = (unsigned int)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* element i of a stored vector as fp32 */
static float tl__elem(const void *p, int dtype, size_t i)
{
    unsigned short h;
    float f;
    if (dtype == TL_F32) {
        memcpy(&f, (const unsigned char *)p + i * 4, 4);
        return f;
    }
    memcpy(&h, (const unsigned char *)p + i * 2, 2);
    return dtype == TL_BF16 ? tl__bf16_to_float(h) : tl__half_to_float(h);
}

typedef struct {
    const tl_config *c;
    const tl_st_file *files;
    const unsigned char *const *bases;
    int n_files;
    char *err;
    size_t errlen;
} tl__binder;

/* Finds name (exactly one file holds it), checks its shape (rows x cols; cols 0
   for a vector) and dtype; *data is its bytes when bases are given. */
static int tl__bind_one(const tl__binder *b, const char *name, long long rows, long long cols,
                        const void **data, int *dtype)
{
    const tl_st_tensor *t = NULL;
    int i, file = -1;
    for (i = 0; i < b->n_files; i++) {
        const tl_st_tensor *x = tl__st_find(&b->files[i], name);
        if (x) {
            if (t)
                return tl__fail(b->err, b->errlen, "tensor %s is in two files", name);
            t = x;
            file = i;
        }
    }
    if (!t)
        return tl__fail(b->err, b->errlen, "tensor %s is missing", name);
    if (t->dtype < 0)
        return tl__fail(b->err, b->errlen, "tensor %s: its dtype is not bf16, fp16 or fp32", name);
    if (cols == 0 ? (t->ndim != 1 || t->shape[0] != rows)
                  : (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)) {
        char got[96];
        int k, o = 0;
        got[0] = '\0';
        for (k = 0; k < t->ndim && o < 80; k++)
            o += snprintf(got + o, sizeof got - (size_t)o, "%s%lld", k ? ", " : "", t->shape[k]);
        if (cols == 0)
            return tl__fail(b->err, b->errlen, "tensor %s has shape [%s], expected [%lld]", name,
                            got, rows);
        return tl__fail(b->err, b->errlen, "tensor %s has shape [%s], expected [%lld, %lld]", name,
                        got, rows, cols);
    }
    if (t->begin % (t->dtype == TL_F32 ? 4u : 2u) != 0)
        return tl__fail(b->err, b->errlen, "tensor %s is not aligned to its element size", name);
    *dtype = t->dtype;
    *data = b->bases ? (const void *)(b->bases[file] + t->begin) : NULL;
    return 0;
}

static int tl__bind_mat(const tl__binder *b, const char *name, long long rows, long long cols,
                        tl_mat *m)
{
    return tl__bind_one(b, name, rows, cols, &m->data, &m->dtype);
}

/* a vector bound and copied to fp32 at *dst (when dst is given) */
static int tl__bind_vec(const tl__binder *b, const char *name, long long n, float *dst)
{
    const void *data;
    int dtype;
    long long i;
    if (tl__bind_one(b, name, n, 0, &data, &dtype))
        return -1;
    if (dst && data)
        for (i = 0; i < n; i++)
            dst[i] = tl__elem(data, dtype, (size_t)i);
    return 0;
}

int tl_hf_bind(const tl_config *c, const tl_st_file *files, const unsigned char *const *bases,
               int n_files, tl_model *m, char *err, size_t errlen)
{
    tl__binder b;
    char name[160];
    size_t dim = (size_t)c->dim, qd = (size_t)c->q_dim, kv = (size_t)c->kv_dim, per, total;
    long long D = c->dim, H = c->hidden_dim, Q = c->q_dim, K = c->kv_dim, V = c->vocab_size;
    tl_layer_weights lw, *layers = NULL;
    float *owned = NULL, *o;
    tl_mat emb, cls;
    int l, ok = 1;
    if (m && tl_hf_bind(c, files, NULL, n_files, NULL, err, errlen))
        return -1;   /* everything checked before anything is allocated */
    b.c = c;
    b.files = files;
    b.bases = bases;
    b.n_files = n_files;
    b.err = err;
    b.errlen = errlen;
    per = 2 * dim + (c->qkv_bias ? qd + 2 * kv : 0);
    total = tl__add(tl__mul(per, (size_t)c->n_layers, &ok), dim, &ok);
    if (!ok)
        return tl__fail(err, errlen, "the model's sizes overflow");
    if (m) {
        layers = (tl_layer_weights *)calloc((size_t)c->n_layers, sizeof(tl_layer_weights));
        owned = (float *)malloc(total * sizeof(float));
        if (!layers || !owned) {
            free(layers);
            free(owned);
            return tl__fail(err, errlen, "out of memory for the model's norms");
        }
    }
    o = owned;
    if (tl__bind_mat(&b, "model.embed_tokens.weight", V, D, &emb))
        goto fail;
    if (c->shared_classifier)
        cls = emb;
    else if (tl__bind_mat(&b, "lm_head.weight", V, D, &cls))
        goto fail;
    if (tl__bind_vec(&b, "model.norm.weight", D, o))
        goto fail;
    if (o) o += dim;
    for (l = 0; l < c->n_layers; l++) {
        struct { const char *suffix; long long rows, cols; tl_mat *dst; } mats[7];
        int i;
        memset(&lw, 0, sizeof lw);
        mats[0].suffix = "self_attn.q_proj.weight"; mats[0].rows = Q; mats[0].cols = D; mats[0].dst = &lw.wq;
        mats[1].suffix = "self_attn.k_proj.weight"; mats[1].rows = K; mats[1].cols = D; mats[1].dst = &lw.wk;
        mats[2].suffix = "self_attn.v_proj.weight"; mats[2].rows = K; mats[2].cols = D; mats[2].dst = &lw.wv;
        mats[3].suffix = "self_attn.o_proj.weight"; mats[3].rows = D; mats[3].cols = Q; mats[3].dst = &lw.wo;
        mats[4].suffix = "mlp.gate_proj.weight"; mats[4].rows = H; mats[4].cols = D; mats[4].dst = &lw.w1;
        mats[5].suffix = "mlp.down_proj.weight"; mats[5].rows = D; mats[5].cols = H; mats[5].dst = &lw.w2;
        mats[6].suffix = "mlp.up_proj.weight"; mats[6].rows = H; mats[6].cols = D; mats[6].dst = &lw.w3;
        for (i = 0; i < 7; i++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, mats[i].suffix);
            if (tl__bind_mat(&b, name, mats[i].rows, mats[i].cols, mats[i].dst))
                goto fail;
        }
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        if (tl__bind_vec(&b, name, D, o))
            goto fail;
        lw.rms_att = o;
        if (o) o += dim;
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        if (tl__bind_vec(&b, name, D, o))
            goto fail;
        lw.rms_ffn = o;
        if (o) o += dim;
        if (c->qkv_bias) {
            snprintf(name, sizeof name, "model.layers.%d.self_attn.q_proj.bias", l);
            if (tl__bind_vec(&b, name, Q, o))
                goto fail;
            lw.bq = o;
            if (o) o += qd;
            snprintf(name, sizeof name, "model.layers.%d.self_attn.k_proj.bias", l);
            if (tl__bind_vec(&b, name, K, o))
                goto fail;
            lw.bk = o;
            if (o) o += kv;
            snprintf(name, sizeof name, "model.layers.%d.self_attn.v_proj.bias", l);
            if (tl__bind_vec(&b, name, K, o))
                goto fail;
            lw.bv = o;
            if (o) o += kv;
        }
        if (layers)
            layers[l] = lw;
    }
    if (m) {
        m->layers = layers;
        m->owned = owned;
        m->emb = emb;
        m->cls = cls;
        m->w.rms_final = owned;
        if (emb.dtype == TL_F32)
            m->w.token_embedding = (const float *)emb.data;
        if (cls.dtype == TL_F32)
            m->w.wcls = (const float *)cls.data;
    }
    return 0;
fail:
    free(layers);
    free(owned);
    return -1;
}

/* Reads a small file (config.json, the index) whole; NUL-terminated. */
static char *tl__read_small(const char *path, const char *what, size_t max, size_t *len,
                            char *err, size_t errlen)
{
    struct stat st;
    char *buf;
    size_t got = 0;
    int fd = tl__open_regular(path, what, &st, err, errlen);
    if (fd < 0)
        return NULL;
    if ((size_t)st.st_size > max) {
        close(fd);
        tl__fail(err, errlen, "%s %s is larger than %zu bytes", what, path, max);
        return NULL;
    }
    buf = (char *)malloc((size_t)st.st_size + 1);
    if (!buf) {
        close(fd);
        tl__fail(err, errlen, "out of memory reading %s", path);
        return NULL;
    }
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            close(fd);
            free(buf);
            tl__fail(err, errlen, "cannot read %s %s", what, path);
            return NULL;
        }
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    *len = got;
    return buf;
}

#define TL__MAX_SHARDS 256

static int tl__map_file(const char *path, void **map, size_t *size, char *err, size_t errlen)
{
    struct stat st;
    int fd = tl__open_regular(path, "weights file", &st, err, errlen);
    if (fd < 0)
        return -1;
    *size = (size_t)st.st_size;
    if (*size == 0) {
        close(fd);
        return tl__fail(err, errlen, "%s: empty file", path);
    }
    *map = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (*map == MAP_FAILED) {
        *map = NULL;
        return tl__fail(err, errlen, "cannot mmap %s: %s", path, strerror(errno));
    }
    return 0;
}

/* The shard file names of an index (model.safetensors.index.json): the
   distinct values of its weight_map, each a plain file name. */
static int tl__index_shards(const char *json, size_t len, char names[][128], int *n,
                            char *err, size_t errlen)
{
    tl__jnode *nodes = NULL;
    char why[TL_ERR_LEN], buf[128];
    int wm, k, i, rc = -1;
    *n = 0;
    if (tl__json_parse(json, len, &nodes, why, sizeof why))
        return tl__fail(err, errlen, "model.safetensors.index.json: %s", why);
    wm = tl__jget(json, nodes, 0, "weight_map");
    if (wm < 0 || nodes[wm].type != TL__J_OBJ || nodes[wm].count == 0) {
        tl__fail(err, errlen, "model.safetensors.index.json: weight_map must be a non-empty object");
        goto out;
    }
    for (k = nodes[wm].first; k >= 0; k = nodes[nodes[k].next].next) {
        int v = nodes[k].next;
        size_t bl;
        if (nodes[v].type != TL__J_STR || tl__jstr(json, &nodes[v], buf, sizeof buf) != 0 ||
            (bl = strlen(buf)) < 13 || strcmp(buf + bl - 12, ".safetensors") != 0 ||
            strchr(buf, '/') || buf[0] == '.') {
            tl__fail(err, errlen, "model.safetensors.index.json: a weight_map entry is not a "
                     "plain *.safetensors file name");
            goto out;
        }
        for (i = 0; i < *n; i++)
            if (strcmp(names[i], buf) == 0)
                break;
        if (i == *n) {
            if (*n >= TL__MAX_SHARDS) {
                tl__fail(err, errlen, "model.safetensors.index.json names more than %d files",
                         TL__MAX_SHARDS);
                goto out;
            }
            memcpy(names[(*n)++], buf, strlen(buf) + 1);
        }
    }
    rc = 0;
out:
    free(nodes);
    return rc;
}

int tl_build_hf_model(tl_model *m, const char *dir, char *err, size_t errlen)
{
    char path[4096], why[TL_ERR_LEN];
    char (*names)[128] = NULL;
    char *text = NULL;
    size_t len;
    tl_st_file *files = NULL;
    const unsigned char **bases = NULL;
    int n = 0, i, rc = -1;
    struct stat st;

    memset(m, 0, sizeof *m);
    if (strlen(dir) > sizeof path - 64)
        return tl__fail(err, errlen, "model directory path is too long");
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (stat(path, &st) != 0)
        return tl__fail(err, errlen, "%s is a directory without config.json (not a Hugging Face "
                        "model directory)", dir);
    if (!(text = tl__read_small(path, "config", (size_t)16 << 20, &len, why, sizeof why)) ||
        tl_hf_parse_config(text, len, &m->config, why, sizeof why)) {
        free(text);
        memset(m, 0, sizeof *m);
        return tl__fail(err, errlen, "%s: %s", dir, why);
    }
    free(text);
    text = NULL;
    names = (char (*)[128])calloc(TL__MAX_SHARDS, 128);
    if (!names) {
        tl__fail(err, errlen, "out of memory");
        goto out;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (stat(path, &st) == 0) {
        memcpy(names[0], "model.safetensors", 18);
        n = 1;
    } else {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        if (stat(path, &st) != 0) {
            tl__fail(err, errlen, "%s: neither model.safetensors nor model.safetensors.index.json", dir);
            goto out;
        }
        if (!(text = tl__read_small(path, "index", (size_t)64 << 20, &len, why, sizeof why)) ||
            tl__index_shards(text, len, names, &n, why, sizeof why)) {
            tl__fail(err, errlen, "%s: %s", dir, why);
            goto out;
        }
    }
    m->shard_maps = (void **)calloc((size_t)n, sizeof(void *));
    m->shard_sizes = (size_t *)calloc((size_t)n, sizeof(size_t));
    files = (tl_st_file *)calloc((size_t)n, sizeof(tl_st_file));
    bases = (const unsigned char **)calloc((size_t)n, sizeof(unsigned char *));
    if (!m->shard_maps || !m->shard_sizes || !files || !bases) {
        tl__fail(err, errlen, "out of memory");
        goto out;
    }
    for (i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (tl__map_file(path, &m->shard_maps[i], &m->shard_sizes[i], err, errlen))
            goto out;
        m->n_shards = i + 1;
        bases[i] = (const unsigned char *)m->shard_maps[i];
        if (tl_st_parse(bases[i], m->shard_sizes[i], &files[i], why, sizeof why)) {
            tl__fail(err, errlen, "%s: %s", path, why);
            goto out;
        }
    }
    if (tl_hf_bind(&m->config, files, bases, n, m, why, sizeof why)) {
        tl__fail(err, errlen, "%s: %s", dir, why);
        goto out;
    }
    m->config.wtype = m->layers[0].wq.dtype;
    rc = 0;
out:
    if (files)
        for (i = 0; i < n; i++)
            tl_st_free(&files[i]);
    free(files);
    free(bases);
    free(names);
    free(text);
    if (rc != 0)
        tl_free_model(m);
    return rc;
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

typedef struct tl__pool tl__pool;
static tl__pool *tl__pool_create(int n);
static void tl__pool_destroy(tl__pool *p);

/* RoPE inverse frequencies: theta^(-2i/head_size), then the config's scaling
   (linear: divided by the factor; llama3: long wavelengths divided by the
   factor, short ones kept, a smooth blend between) */
static void tl__rope_freqs(const tl_config *c, double *f)
{
    int i, half = c->head_size / 2;
    for (i = 0; i < half; i++) {
        double freq = pow((double)c->rope_theta, -2.0 * i / (double)c->head_size);
        if (c->rope_scaling == TL_ROPE_SCALING_LINEAR) {
            freq /= (double)c->rope_factor;
        } else if (c->rope_scaling == TL_ROPE_SCALING_LLAMA3) {
            double wavelen = 2.0 * 3.14159265358979323846 / freq;
            double low_wl = (double)c->rope_orig_ctx / (double)c->rope_low_freq_factor;
            double high_wl = (double)c->rope_orig_ctx / (double)c->rope_high_freq_factor;
            if (wavelen > low_wl) {
                freq /= (double)c->rope_factor;
            } else if (wavelen >= high_wl) {
                double smooth = ((double)c->rope_orig_ctx / wavelen - (double)c->rope_low_freq_factor) /
                                ((double)c->rope_high_freq_factor - (double)c->rope_low_freq_factor);
                freq = (1.0 - smooth) * freq / (double)c->rope_factor + smooth * freq;
            }
        }
        f[i] = freq;
    }
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
    int ok = 1, g, qd = c->q_dim > 0 ? c->q_dim : c->dim;
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
    s->xb = (float *)calloc((size_t)(qd > c->dim ? qd : c->dim), sizeof(float));
    s->xb2 = (float *)calloc((size_t)c->dim, sizeof(float));
    s->hb = (float *)calloc((size_t)c->hidden_dim, sizeof(float));
    s->hb2 = (float *)calloc((size_t)c->hidden_dim, sizeof(float));
    s->q = (float *)calloc((size_t)qd, sizeof(float));
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
    s->rope_freq = (double *)calloc((size_t)c->head_size / 2 + 1, sizeof(double));
    if (!s->rope_freq || !s->x || !s->xb || !s->xb2 || !s->hb || !s->hb2 || !s->q || !s->att ||
        !s->logits || (kv && (!s->key_cache || !s->value_cache)) || !s->rope_cos ||
        !s->rope_sin || !s->lists || !s->list_pos || !s->mass || !s->select_tmp) {
        tl_free_state(s);
        return tl__fail(err, errlen, "out of memory for the run state (context %d)", ctx);
    }
    for (g = 0; g < c->n_kv_heads; g++)
        s->lists[g].pos = s->list_pos + (size_t)g * ctxz;
    s->rope_pos = -1;
    tl__rope_freqs(c, s->rope_freq);
    s->n_threads = n_threads < 1 ? 1 : n_threads;
    s->pool = tl__pool_create(s->n_threads);
    s->thread_min_work = 4096;
    return 0;
}

void tl_free_state(tl_state *s)
{
    free(s->x); free(s->xb); free(s->xb2); free(s->hb); free(s->hb2);
    free(s->q); free(s->att); free(s->logits); free(s->key_cache);
    free(s->value_cache); free(s->rope_cos); free(s->rope_sin); free(s->lists);
    free(s->list_pos); free(s->mass); free(s->select_tmp); free(s->rope_freq);
    tl__pool_destroy((tl__pool *)s->pool);
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

static float tl__dot_scalar(const float *a, const float *b, int n)
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
static void tl__axpy_scalar(float *out, float a, const float *x, int n)
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



/* ----------------------------------------------------------------------------
   Projection kernels: matrix-vector (decode) and matrix-matrix (prefill)
   products with weights as stored (fp32, bf16, fp16) and fp32 arithmetic.
   Every output is the dot product of one weight row (converted exactly to
   fp32) with the input, summed as tl__dot sums: eight lanes, lane j adding
   the products of elements 8i + j, then ((s0+s4)+(s1+s5))+((s2+s6)+(s3+s7)),
   then the tail. The AVX2 versions (chosen at run time) keep the lanes in a
   vector register and perform the same operations in the same order, so the
   portable and SIMD kernels, and the decode and prefill paths, agree to the
   bit. */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(TINY_LLAMA_NO_SIMD)
#define TL__X86 1
#include <cpuid.h>
#include <immintrin.h>
#define TL__AVX2 __attribute__((target("avx2,f16c")))
#endif

/* the reduction of the eight lanes and the tail, as in tl__dot */
static float tl__finish(const float *lanes, const void *row, int dtype, const float *x, int i, int n)
{
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; i < n; i++)
        sum += tl__elem(row, dtype, (size_t)i) * x[i];
    return sum;
}

#ifdef TL__X86
static int tl__avx2_flag;
static pthread_once_t tl__avx2_once = PTHREAD_ONCE_INIT;

static void tl__avx2_probe(void)
{
    unsigned int a = 0, b = 0, c = 0, d = 0;
    __builtin_cpu_init();
    /* F16C is CPUID leaf 1, ECX bit 29 (not every compiler's cpu_supports names it) */
    tl__avx2_flag = __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) &&
                    (c >> 29 & 1u);
}

static int tl__have_avx2(void)
{
    pthread_once(&tl__avx2_once, tl__avx2_probe);
    return tl__avx2_flag;
}

/* tl__finish on lanes held in a register: the lanes summed in the same order,
   ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)), in the register (a store and scalar
   reloads of the lanes, and a call, at the end of every row cost a decode
   step a third of its time), then the tail */
TL__AVX2 __attribute__((always_inline)) static inline float tl__finish_v(__m256 v, const void *row, int dtype,
                                                                         const float *x, int i, int n)
{
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    float sum;
    t = _mm_hadd_ps(t, t);
    sum = _mm_cvtss_f32(_mm_hadd_ps(t, t));
    for (; i < n; i++)
        sum += tl__elem(row, dtype, (size_t)i) * x[i];
    return sum;
}

TL__AVX2 static float tl__dot_avx2(const float *a, const float *b, int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    return tl__finish_v(acc, a, TL_F32, b, i, n);
}

TL__AVX2 static void tl__axpy_avx2(float *out, float a, const float *x, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i),
                                                _mm256_mul_ps(av, _mm256_loadu_ps(x + i))));
    for (; i < n; i++)
        out[i] += a * x[i];
}

/* Blocks of cache rows (decode attention): row r of a block is at rows[r].
   att[j * stride + r] = dot(q + j * hs, rows[r]) * scale for r < nr, j < group,
   each dot as tl__dot sums it; hs a multiple of 8. */
TL__AVX2 static void tl__scores_rows_avx2(const float *q, const float *const *rows, int nr, int group,
                                          int hs, float scale, float *att, size_t stride)
{
    int j, r, i;
    const __m256 sv = _mm256_set1_ps(scale);
    for (j = 0; j < group; j++) {
        const float *qj = q + (size_t)j * (size_t)hs;
        float *a = att + (size_t)j * stride;
        for (r = 0; r + 8 <= nr; r += 8) {   /* eight rows: their lanes reduced together */
            const float *k0 = rows[r], *k1 = rows[r + 1], *k2 = rows[r + 2], *k3 = rows[r + 3];
            const float *k4 = rows[r + 4], *k5 = rows[r + 5], *k6 = rows[r + 6], *k7 = rows[r + 7];
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
            __m256 p04, p15, p26, p37;
            for (i = 0; i < hs; i += 8) {
                __m256 qv = _mm256_loadu_ps(qj + i);
                c0 = _mm256_add_ps(c0, _mm256_mul_ps(qv, _mm256_loadu_ps(k0 + i)));
                c1 = _mm256_add_ps(c1, _mm256_mul_ps(qv, _mm256_loadu_ps(k1 + i)));
                c2 = _mm256_add_ps(c2, _mm256_mul_ps(qv, _mm256_loadu_ps(k2 + i)));
                c3 = _mm256_add_ps(c3, _mm256_mul_ps(qv, _mm256_loadu_ps(k3 + i)));
                c4 = _mm256_add_ps(c4, _mm256_mul_ps(qv, _mm256_loadu_ps(k4 + i)));
                c5 = _mm256_add_ps(c5, _mm256_mul_ps(qv, _mm256_loadu_ps(k5 + i)));
                c6 = _mm256_add_ps(c6, _mm256_mul_ps(qv, _mm256_loadu_ps(k6 + i)));
                c7 = _mm256_add_ps(c7, _mm256_mul_ps(qv, _mm256_loadu_ps(k7 + i)));
            }
            /* per row l0+l4 .. l3+l7 (rows r and r+4 in one register, and so on),
               then ((l0+l4)+(l1+l5)) and ((l2+l6)+(l3+l7)), then their sum: the
               eight scores in order, each summed as tl__finish sums it */
            p04 = _mm256_add_ps(_mm256_permute2f128_ps(c0, c4, 0x20), _mm256_permute2f128_ps(c0, c4, 0x31));
            p15 = _mm256_add_ps(_mm256_permute2f128_ps(c1, c5, 0x20), _mm256_permute2f128_ps(c1, c5, 0x31));
            p26 = _mm256_add_ps(_mm256_permute2f128_ps(c2, c6, 0x20), _mm256_permute2f128_ps(c2, c6, 0x31));
            p37 = _mm256_add_ps(_mm256_permute2f128_ps(c3, c7, 0x20), _mm256_permute2f128_ps(c3, c7, 0x31));
            _mm256_storeu_ps(a + r, _mm256_mul_ps(_mm256_hadd_ps(_mm256_hadd_ps(p04, p15),
                                                                 _mm256_hadd_ps(p26, p37)), sv));
        }
        for (; r < nr; r++) {
            const float *k = rows[r];
            __m256 acc = _mm256_setzero_ps();
            for (i = 0; i < hs; i += 8)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(qj + i), _mm256_loadu_ps(k + i)));
            a[r] = tl__finish_v(acc, qj, TL_F32, k, hs, hs) * scale;
        }
    }
}

/* unrolled, so that an array of sums indexed by the loop lives in registers */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define TL__UNROLL8 _Pragma("GCC unroll 8")
#else
#define TL__UNROLL8
#endif

/* o[c .. c + 8w) += a[r] * rows[r][c .. c + 8w) for r < nr, ascending, with
   w (1 .. 8, a constant where it is called) sums held in registers */
TL__AVX2 __attribute__((always_inline)) static inline void tl__axpys_cols(float *o, const float *a,
                                                                          const float *const *rows, int nr,
                                                                          int c, int w)
{
    __m256 acc[8];
    int r, k;
    TL__UNROLL8
    for (k = 0; k < w; k++)
        acc[k] = _mm256_loadu_ps(o + c + 8 * k);
    for (r = 0; r < nr; r++) {
        __m256 av = _mm256_set1_ps(a[r]);
        const float *v = rows[r] + c;
        TL__UNROLL8
        for (k = 0; k < w; k++)
            acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(av, _mm256_loadu_ps(v + 8 * k)));
    }
    TL__UNROLL8
    for (k = 0; k < w; k++)
        _mm256_storeu_ps(o + c + 8 * k, acc[k]);
}

/* out + j * hs += att[j * stride + r] * rows[r] for r < nr (ascending for
   every element, as row-by-row updates add them), j < group; the sums stay
   in registers for the whole block, eight of them where hs allows (two adds
   a cycle despite their latency). hs a multiple of 8. */
TL__AVX2 static void tl__axpys_rows_avx2(float *out, const float *att, size_t stride,
                                         const float *const *rows, int nr, int group, int hs)
{
    int j, c;
    for (j = 0; j < group; j++) {
        float *o = out + (size_t)j * (size_t)hs;
        const float *a = att + (size_t)j * stride;
        for (c = 0; c + 64 <= hs; c += 64)
            tl__axpys_cols(o, a, rows, nr, c, 8);
        for (; c + 32 <= hs; c += 32)
            tl__axpys_cols(o, a, rows, nr, c, 4);
        for (; c < hs; c += 8)
            tl__axpys_cols(o, a, rows, nr, c, 1);
    }
}

#endif

/* the dot product and out += a * x, with the AVX2 versions where the CPU has them
   (the same operations in the same order: the same results to the bit) */
static float tl__dot(const float *a, const float *b, int n)
{
#ifdef TL__X86
    if (tl__have_avx2())
        return tl__dot_avx2(a, b, n);
#endif
    return tl__dot_scalar(a, b, n);
}

static void tl__axpy(float *out, float a, const float *x, int n)
{
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__axpy_avx2(out, a, x, n);
        return;
    }
#endif
    tl__axpy_scalar(out, a, x, n);
}

/* portable: one row (any dtype) with x */
static float tl__dot_row(const void *row, int dtype, const float *x, int n)
{
    float s[8] = { 0, 0, 0, 0, 0, 0, 0, 0 };
    int i = 0, j;
    if (dtype == TL_F32)
        return tl__dot((const float *)row, x, n);
    if (dtype == TL_BF16) {
        const unsigned short *h = (const unsigned short *)row;
        for (; i + 8 <= n; i += 8)
            for (j = 0; j < 8; j++)
                s[j] += tl__bf16_to_float(h[i + j]) * x[i + j];
    } else {
        const unsigned short *h = (const unsigned short *)row;
        for (; i + 8 <= n; i += 8)
            for (j = 0; j < 8; j++)
                s[j] += tl__half_to_float(h[i + j]) * x[i + j];
    }
    return tl__finish(s, row, dtype, x, i, n);
}

#ifdef TL__X86
TL__AVX2 __attribute__((always_inline)) static inline __m256 tl__load8(const void *row, int dtype, int i)
{
    if (dtype == TL_F32)
        return _mm256_loadu_ps((const float *)row + i);
    if (dtype == TL_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)(const void *)((const unsigned short *)row + i))), 16));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)((const unsigned short *)row + i)));
}

/* rows r0 .. r1-1 of w with x, four rows at a time */
#ifndef TL__PREFETCH
#define TL__PREFETCH 512    /* bytes ahead in each weight row */
#endif
#define TL__ROWS4(DT)                                                                       \
    for (; r + 4 <= r1; r += 4) {                                                           \
        const unsigned char *p0 = base + (size_t)r * rb, *p1 = p0 + rb, *p2 = p1 + rb,      \
                            *p3 = p2 + rb;                                                  \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        int i = 0;                                                                          \
        for (; i + 8 <= n; i += 8) {                                                        \
            __m256 xv = _mm256_loadu_ps(x + i);                                             \
            if ((i & 31) == 0) { /* a cache line of each row, ahead of the loads */         \
                size_t ahead = (size_t)i * es + TL__PREFETCH;                               \
                _mm_prefetch((const char *)p0 + ahead, _MM_HINT_T0);                        \
                _mm_prefetch((const char *)p1 + ahead, _MM_HINT_T0);                        \
                _mm_prefetch((const char *)p2 + ahead, _MM_HINT_T0);                        \
                _mm_prefetch((const char *)p3 + ahead, _MM_HINT_T0);                        \
            }                                                                               \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(tl__load8(p0, DT, i), xv));                \
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(tl__load8(p1, DT, i), xv));                \
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(tl__load8(p2, DT, i), xv));                \
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(tl__load8(p3, DT, i), xv));                \
        }                                                                                   \
        out[r] = tl__finish_v(a0, p0, DT, x, i, n);                                         \
        out[r + 1] = tl__finish_v(a1, p1, DT, x, i, n);                                     \
        out[r + 2] = tl__finish_v(a2, p2, DT, x, i, n);                                     \
        out[r + 3] = tl__finish_v(a3, p3, DT, x, i, n);                                     \
    }

TL__AVX2 static void tl__rows_avx2(const tl_mat *w, int n, const float *x, float *out, int r0, int r1)
{
    const unsigned char *base = (const unsigned char *)w->data;
    size_t es = w->dtype == TL_F32 ? 4u : 2u, rb = (size_t)n * es;
    int r = r0;
    if (w->dtype == TL_F32) { TL__ROWS4(TL_F32) }
    else if (w->dtype == TL_BF16) { TL__ROWS4(TL_BF16) }
    else { TL__ROWS4(TL_F16) }
    for (; r < r1; r++)
        out[r] = tl__dot_row(base + (size_t)r * rb, w->dtype, x, n);
}

/* a (fp32, n) with b[0..3]: four dot products sharing the row */
/* a stored row (bf16 or fp16) to fp32, 8 at a time (n / 8 * 8 elements) */
TL__AVX2 static void tl__convert_avx2(const void *row, int dtype, int n, float *dst)
{
    int i;
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, tl__load8(row, dtype, i));
}

/* rows a0, a1 (fp32, n) with b[0..3]: eight dot products, out[4 * r + k] for row r
   and input k, each summed as tl__dot sums */
TL__AVX2 static void tl__dot_2x4_avx2(const float *a0, const float *a1, const float *const *b, int n,
                                      float *out)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x0 = _mm256_loadu_ps(a0 + i), x1 = _mm256_loadu_ps(a1 + i), y;
        y = _mm256_loadu_ps(b[0] + i);
        c00 = _mm256_add_ps(c00, _mm256_mul_ps(x0, y));
        c10 = _mm256_add_ps(c10, _mm256_mul_ps(x1, y));
        y = _mm256_loadu_ps(b[1] + i);
        c01 = _mm256_add_ps(c01, _mm256_mul_ps(x0, y));
        c11 = _mm256_add_ps(c11, _mm256_mul_ps(x1, y));
        y = _mm256_loadu_ps(b[2] + i);
        c02 = _mm256_add_ps(c02, _mm256_mul_ps(x0, y));
        c12 = _mm256_add_ps(c12, _mm256_mul_ps(x1, y));
        y = _mm256_loadu_ps(b[3] + i);
        c03 = _mm256_add_ps(c03, _mm256_mul_ps(x0, y));
        c13 = _mm256_add_ps(c13, _mm256_mul_ps(x1, y));
    }
    out[0] = tl__finish_v(c00, a0, TL_F32, b[0], i, n);
    out[1] = tl__finish_v(c01, a0, TL_F32, b[1], i, n);
    out[2] = tl__finish_v(c02, a0, TL_F32, b[2], i, n);
    out[3] = tl__finish_v(c03, a0, TL_F32, b[3], i, n);
    out[4] = tl__finish_v(c10, a1, TL_F32, b[0], i, n);
    out[5] = tl__finish_v(c11, a1, TL_F32, b[1], i, n);
    out[6] = tl__finish_v(c12, a1, TL_F32, b[2], i, n);
    out[7] = tl__finish_v(c13, a1, TL_F32, b[3], i, n);
}

TL__AVX2 static void tl__dot_1x4_avx2(const float *a, const float *const *b, int n, float *out)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 av = _mm256_loadu_ps(a + i);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(av, _mm256_loadu_ps(b[0] + i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(av, _mm256_loadu_ps(b[1] + i)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(av, _mm256_loadu_ps(b[2] + i)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(av, _mm256_loadu_ps(b[3] + i)));
    }
    out[0] = tl__finish_v(a0, a, TL_F32, b[0], i, n);
    out[1] = tl__finish_v(a1, a, TL_F32, b[1], i, n);
    out[2] = tl__finish_v(a2, a, TL_F32, b[2], i, n);
    out[3] = tl__finish_v(a3, a, TL_F32, b[3], i, n);
}

#endif

static void tl__rows(const tl_mat *w, int n, const float *x, float *out, int r0, int r1)
{
    size_t rb = (size_t)n * (w->dtype == TL_F32 ? 4u : 2u);
    int r;
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__rows_avx2(w, n, x, out, r0, r1);
        return;
    }
#endif
    for (r = r0; r < r1; r++)
        out[r] = tl__dot_row((const unsigned char *)w->data + (size_t)r * rb, w->dtype, x, n);
}

static void tl__dot_1x4(const float *a, const float *const *b, int n, float *out);

static void tl__dot_2x4(const float *a0, const float *a1, const float *const *b, int n, float *out)
{
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__dot_2x4_avx2(a0, a1, b, n, out);
        return;
    }
#endif
    tl__dot_1x4(a0, b, n, out);
    tl__dot_1x4(a1, b, n, out + 4);
}

static void tl__dot_1x4(const float *a, const float *const *b, int n, float *out)
{
    int k;
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__dot_1x4_avx2(a, b, n, out);
        return;
    }
#endif
    for (k = 0; k < 4; k++)
        out[k] = tl__dot(a, b[k], n);
}

/* ----------------------------------------------------------------------------
   Worker threads for the projections (one pool per run state)

   A decode step hands the pool a hundred or so jobs of a few hundred
   microseconds each. A thread that sleeps on a condition variable between
   them can wake late (on a virtual machine an idle CPU is handed back to the
   host, and waking it can cost tens of microseconds), leaving the caller to
   run the start of the job alone. So the workers, and the caller waiting for
   them, first poll the job counter for a while (TL_POOL_SPIN_US, 0 to 1e6,
   default 200 microseconds; 0 turns polling off) and only then sleep. */

#define TL__POOL_MAX 63

#if defined(__GNUC__) || defined(__clang__)
#define TL__POOL_POLL 1
#define TL__LOAD(p) __atomic_load_n(p, __ATOMIC_ACQUIRE)
#define TL__STORE(p, v) __atomic_store_n(p, v, __ATOMIC_RELEASE)
#else
#define TL__LOAD(p) (*(p))
#define TL__STORE(p, v) (*(p) = (v))
#endif

struct tl__pool {
    int n;                    /* threads including the caller */
    int n_started;
    pthread_t th[TL__POOL_MAX];
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    unsigned long gen;        /* jobs handed out; written under mu */
    int pending, quit;        /* workers still on the job; written under mu */
    double spin_s;            /* how long to poll before sleeping */
    void (*fn)(void *, int, int);
    void *arg;
};

#ifdef TL__POOL_POLL
#if defined(__x86_64__) || defined(__i386__)
#define TL__PAUSE() __builtin_ia32_pause()
#else
#define TL__PAUSE() ((void)0)
#endif
/* what a thread waits for: the caller (seen unused) all workers done, a
   worker a job after generation seen, or the pool's end */
static int tl__pool_ready(tl__pool *p, int caller, unsigned long seen)
{
    if (caller)
        return TL__LOAD(&p->pending) == 0;
    return TL__LOAD(&p->gen) != seen || TL__LOAD(&p->quit);
}

/* poll for it for up to p->spin_s seconds (then the thread sleeps on its
   condition variable, which also covers what arrives in between) */
static void tl__pool_poll(tl__pool *p, int caller, unsigned long seen)
{
    double t0 = 0;
    int i;
    if (p->spin_s <= 0)
        return;
    for (;;) {
        for (i = 0; i < 64; i++) {
            if (tl__pool_ready(p, caller, seen))
                return;
            TL__PAUSE();
        }
        if (t0 == 0)
            t0 = tl_time_s();
        else if (tl_time_s() - t0 > p->spin_s)
            return;
    }
}
#endif

static void *tl__pool_main(void *arg)
{
    tl__pool *p = (tl__pool *)((void **)arg)[0];
    int part = (int)(size_t)((void **)arg)[1];
    unsigned long seen = 0;
    free(arg);
    for (;;) {
        void (*fn)(void *, int, int);
        void *a;
#ifdef TL__POOL_POLL
        tl__pool_poll(p, 0, seen);
#endif
        pthread_mutex_lock(&p->mu);
        while (p->gen == seen && !p->quit)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->quit) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        seen = p->gen;
        fn = p->fn;
        a = p->arg;
        pthread_mutex_unlock(&p->mu);
        fn(a, part, p->n);
        pthread_mutex_lock(&p->mu);
        TL__STORE(&p->pending, p->pending - 1);
        if (p->pending == 0)
            pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

static void tl__pool_destroy(tl__pool *p)
{
    int t;
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    TL__STORE(&p->quit, 1);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (t = 0; t < p->n_started; t++)
        pthread_join(p->th[t], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p);
}

/* n threads in all (the caller is part 0); NULL when n < 2 or nothing starts */
static tl__pool *tl__pool_create(int n)
{
    tl__pool *p;
    int t;
    if (n < 2)
        return NULL;
    if (n > TL__POOL_MAX + 1)
        n = TL__POOL_MAX + 1;
    p = (tl__pool *)calloc(1, sizeof *p);
    if (!p)
        return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->spin_s = 200e-6;
    {
        const char *e = getenv("TL_POOL_SPIN_US");   /* 0 .. 1e6; anything else: the default */
        double us = e && *e ? atof(e) : -1.0;
        if (us >= 0.0 && us <= 1e6)
            p->spin_s = us * 1e-6;
    }
    for (t = 1; t < n; t++) {
        void **a = (void **)malloc(2 * sizeof(void *));
        if (!a)
            break;
        a[0] = p;
        a[1] = (void *)(size_t)t;
        if (pthread_create(&p->th[t - 1], NULL, tl__pool_main, a) != 0) {
            free(a);
            break;
        }
        p->n_started = t;
    }
    p->n = p->n_started + 1;
    if (p->n < 2) {
        tl__pool_destroy(p);
        return NULL;
    }
    return p;
}

void tl_parallel(tl_state *s, void (*fn)(void *arg, int part, int nparts), void *arg)
{
    tl__pool *p = (tl__pool *)s->pool;
    if (!p) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    TL__STORE(&p->pending, p->n - 1);
    TL__STORE(&p->gen, p->gen + 1);  /* a worker that sees it takes mu to read fn and arg */
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, p->n);
#ifdef TL__POOL_POLL
    tl__pool_poll(p, 1, 0);
#endif
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* Up to three products sharing the input x (n): out[j] (d[j]) = w[j] x. */
typedef struct {
    int count, n;
    const float *x;
    const tl_mat *w[3];
    float *out[3];
    int d[3];
    long next;                /* the next row to hand out */
} tl__mv_job;

/* rows lo .. hi-1 of the products, counted over all of them */
static void tl__mv_range(const tl__mv_job *j, long lo, long hi)
{
    long base = 0;
    int k;
    for (k = 0; k < j->count; k++) {
        long a = lo > base ? lo : base, b = hi < base + j->d[k] ? hi : base + j->d[k];
        if (a < b)
            tl__rows(j->w[k], j->n, j->x, j->out[k], (int)(a - base), (int)(b - base));
        base += j->d[k];
    }
}

#define TL__MV_BLOCK 64   /* rows a thread takes at a time */

static void tl__mv_part(void *arg, int part, int nparts)
{
    tl__mv_job *j = (tl__mv_job *)arg;
    long total = 0, lo, hi;
    int k;
    for (k = 0; k < j->count; k++)
        total += j->d[k];
#if defined(__GNUC__) || defined(__clang__)
    /* blocks of rows handed out as threads ask: a thread that runs late (a busy
       machine) takes fewer */
    (void)part;
    (void)nparts;
    for (;;) {
        lo = __atomic_fetch_add(&j->next, (long)TL__MV_BLOCK, __ATOMIC_RELAXED);
        if (lo >= total)
            break;
        hi = lo + TL__MV_BLOCK < total ? lo + TL__MV_BLOCK : total;
        tl__mv_range(j, lo, hi);
    }
#else
    /* split the rows of all products in blocks of 4 */
    lo = (total / 4 * part / nparts) * 4;
    hi = part == nparts - 1 ? total : (total / 4 * (part + 1) / nparts) * 4;
    tl__mv_range(j, lo, hi);
#endif
}

static void tl__mv_run(tl_state *s, tl__mv_job *j)
{
    double work = 0;
    int k;
    for (k = 0; k < j->count; k++)
        work += (double)j->d[k] * (double)j->n;
    if (!s->pool || work < 65536.0)
        tl__mv_part(j, 0, 1);
    else
        tl_parallel(s, tl__mv_part, j);
}

/* out (d) = w (d, n) x (n) */
static void tl__mv(tl_state *s, float *out, const float *x, const tl_mat *w, int n, int d)
{
    tl__mv_job j;
    j.next = 0;
    j.count = 1;
    j.n = n;
    j.x = x;
    j.w[0] = w;
    j.out[0] = out;
    j.d[0] = d;
    tl__mv_run(s, &j);
}

/* Matrix-matrix: out (t, d) = x (t, n) w^T for t tokens; each thread converts
   its rows to fp32 once and multiplies them with every token. */
typedef struct {
    const tl_mat *w;
    int n, d, t;
    const float *x;
    float *out;
    float *buf;               /* nparts * 2 * n floats */
} tl__mm_job;

/* row r of w as fp32: the stored floats, or a conversion into buf */
static const float *tl__row_f32(const tl_mat *w, int n, int r, float *buf)
{
    size_t rb = (size_t)n * (w->dtype == TL_F32 ? 4u : 2u);
    const unsigned char *row = (const unsigned char *)w->data + (size_t)r * rb;
    int i = 0;
    if (w->dtype == TL_F32)
        return (const float *)(const void *)row;
#ifdef TL__X86
    if (tl__have_avx2()) {
        tl__convert_avx2(row, w->dtype, n, buf);
        i = n / 8 * 8;
    }
#endif
    for (; i < n; i++)
        buf[i] = tl__elem(row, w->dtype, (size_t)i);
    return buf;
}

static void tl__mm_part(void *arg, int part, int nparts)
{
    const tl__mm_job *j = (const tl__mm_job *)arg;
    int r0 = (int)((long)j->d * part / nparts), r1 = (int)((long)j->d * (part + 1) / nparts), r, t, k;
    size_t n = (size_t)j->n, d = (size_t)j->d;
    float *buf = j->buf + (size_t)part * 2 * n;
    for (r = r0; r < r1; r += 2) {
        int two = r + 1 < r1;
        const float *a0 = tl__row_f32(j->w, j->n, r, buf);
        const float *a1 = two ? tl__row_f32(j->w, j->n, r + 1, buf + n) : NULL;
        for (t = 0; t + 4 <= j->t; t += 4) {
            const float *b[4];
            float o[8];
            for (k = 0; k < 4; k++)
                b[k] = j->x + (size_t)(t + k) * n;
            if (two) {
                tl__dot_2x4(a0, a1, b, j->n, o);
                for (k = 0; k < 4; k++) {
                    j->out[(size_t)(t + k) * d + (size_t)r] = o[k];
                    j->out[(size_t)(t + k) * d + (size_t)r + 1] = o[4 + k];
                }
            } else {
                tl__dot_1x4(a0, b, j->n, o);
                for (k = 0; k < 4; k++)
                    j->out[(size_t)(t + k) * d + (size_t)r] = o[k];
            }
        }
        for (; t < j->t; t++) {
            j->out[(size_t)t * d + (size_t)r] = tl__dot(a0, j->x + (size_t)t * n, j->n);
            if (two)
                j->out[(size_t)t * d + (size_t)r + 1] = tl__dot(a1, j->x + (size_t)t * n, j->n);
        }
    }
}

static int tl__mm(tl_state *s, float *out, const float *x, int t, const tl_mat *w, int n, int d)
{
    tl__mm_job j;
    int parts = s->pool ? ((tl__pool *)s->pool)->n : 1;
    j.w = w;
    j.n = n;
    j.d = d;
    j.t = t;
    j.x = x;
    j.out = out;
    j.buf = (float *)malloc((size_t)parts * 2 * (size_t)n * sizeof(float));
    if (!j.buf)
        return -1;
    tl_parallel(s, tl__mm_part, &j);
    free(j.buf);
    return 0;
}

static void tl__rmsnorm(float *out, const float *x, const float *weight, int n, float eps)
{
    float ss = tl__dot(x, x, n) / (float)n + (eps > 0.0f ? eps : TL_RMS_EPS);
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

/* rotate pair i of every head in x by the current angles: dims (2i, 2i+1)
   (llama2.c) or (i, i + head_size/2) (rotate_half, Hugging Face) */
static void tl__rope(float *x, int n_heads, int head_size, const float *cs, const float *sn,
                     int layout)
{
    int h, i, half = head_size / 2;
    for (h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * (size_t)head_size;
        if (layout == TL_ROPE_HALF) {
            for (i = 0; i < half; i++) {
                float v0 = v[i], v1 = v[i + half];
                v[i] = v0 * cs[i] - v1 * sn[i];
                v[i + half] = v1 * cs[i] + v0 * sn[i];
            }
            continue;
        }
        for (i = 0; i < half; i++) {
            float v0 = v[2 * i], v1 = v[2 * i + 1];
            v[2 * i] = v0 * cs[i] - v1 * sn[i];
            v[2 * i + 1] = v0 * sn[i] + v1 * cs[i];
        }
    }
}

/* A layer's weights: a Hugging Face model's as bound, a llama2.c
   checkpoint's as slices of its fp32 tensors. */
static void tl__layer(const tl_model *m, int layer, tl_layer_weights *lw)
{
    const tl_config *c = &m->config;
    size_t l = (size_t)layer, dim = (size_t)c->dim, kv = (size_t)c->kv_dim;
    size_t hidden = (size_t)c->hidden_dim, qd = (size_t)(c->q_dim > 0 ? c->q_dim : c->dim);
    if (m->layers) {
        *lw = m->layers[layer];
        return;
    }
    memset(lw, 0, sizeof *lw);
    lw->wq.data = m->w.wq + l * qd * dim;
    lw->wk.data = m->w.wk + l * kv * dim;
    lw->wv.data = m->w.wv + l * kv * dim;
    lw->wo.data = m->w.wo + l * dim * qd;
    lw->w1.data = m->w.w1 + l * hidden * dim;
    lw->w2.data = m->w.w2 + l * dim * hidden;
    lw->w3.data = m->w.w3 + l * hidden * dim;
    lw->rms_att = m->w.rms_att + l * dim;
    lw->rms_ffn = m->w.rms_ffn + l * dim;
}

static int tl__qdim(const tl_config *c)
{
    return c->q_dim > 0 ? c->q_dim : c->dim;
}

/* angles of position pos into cs, sn (head_size / 2 each) */
static void tl__rope_angles(const tl_config *c, const double *freq, int pos, float *cs, float *sn)
{
    int i;
    for (i = 0; i < c->head_size / 2; i++) {
        double angle = (double)pos * freq[i];
        cs[i] = (float)cos(angle);
        sn[i] = (float)sin(angle);
    }
}

/* ----------------------------------------------------------------------------
   Forward stages */

void tl_embed(const tl_model *m, tl_state *s, int token)
{
    const tl_config *c = &m->config;
    if (m->layers) {
        size_t row = (size_t)token * (size_t)c->dim, i;
        for (i = 0; i < (size_t)c->dim; i++)
            s->x[i] = tl__elem(m->emb.data, m->emb.dtype, row + i);
        return;
    }
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
    tl_layer_weights lw;
    tl__mv_job j;
    int i;

    tl__layer(m, layer, &lw);
    if (s->rope_pos != pos) {   /* the angles depend on the position only */
        tl__rope_angles(c, s->rope_freq, pos, s->rope_cos, s->rope_sin);
        s->rope_pos = pos;
    }
    tl__rmsnorm(s->xb, s->x, lw.rms_att, c->dim, c->rms_eps);
    j.count = 3;
    j.n = c->dim;
    j.x = s->xb;
    j.w[0] = &lw.wq; j.out[0] = s->q; j.d[0] = tl__qdim(c);
    j.w[1] = &lw.wk; j.out[1] = k; j.d[1] = c->kv_dim;
    j.w[2] = &lw.wv; j.out[2] = v; j.d[2] = c->kv_dim;
    j.next = 0;
    tl__mv_run(s, &j);
    if (lw.bq) {
        for (i = 0; i < tl__qdim(c); i++)
            s->q[i] += lw.bq[i];
        for (i = 0; i < c->kv_dim; i++) {
            k[i] += lw.bk[i];
            v[i] += lw.bv[i];
        }
    }
    tl__rope(s->q, c->n_heads, c->head_size, s->rope_cos, s->rope_sin, c->rope_layout);
    tl__rope(k, c->n_kv_heads, c->head_size, s->rope_cos, s->rope_sin, c->rope_layout);
}

/* The query heads of KV head g attend over list l: scores, softmax, weighted
   sum of values into xb. Each key and value row is read once for the group. */
#ifndef TL__KV_AHEAD
#define TL__KV_AHEAD 8    /* cache rows fetched ahead of the one in use */
#endif

/* row i of a list: its key (which 0) or value (which 1) */
static const float *tl__list_row(const tl_kv_list *l, const float *base, size_t stride, int which, int i)
{
    const void *const *rows = which ? l->vrow : l->krow;
    if (rows)
        return (const float *)rows[i];
    return base + (size_t)(l->k ? i : l->pos[i]) * stride;
}

#ifdef TL__X86
#define TL__ATT_BLOCK 32  /* cache rows per block of the SIMD attention */

/* the block's row pointers, and the first TL__KV_AHEAD rows after it fetched ahead */
static void tl__block_rows(const tl_kv_list *l, const float *base, size_t stride, int which, int i0,
                           int nr, int hs, const float **rows)
{
    int r, b, n = l->n;
    for (r = 0; r < nr; r++)
        rows[r] = tl__list_row(l, base, stride, which, i0 + r);
#if defined(__GNUC__) || defined(__clang__)
    for (r = i0 + nr; r < i0 + nr + TL__KV_AHEAD && r < n; r++) {
        const char *p = (const char *)tl__list_row(l, base, stride, which, r);
        for (b = 0; b < hs * 4; b += 64)
            __builtin_prefetch(p + b);
    }
#else
    (void)b;
    (void)n;
#endif
}

/* One pass over the rows of KV heads g0 .. g1-1, a block at a time (base:
   head g0's column of the keys, which 0, or of the values, which 1; a block's
   rows fetched once for all the heads): the scores, or the outputs. */
static void tl__heads_pass(const tl_config *c, tl_state *s, int g0, int g1, const tl_kv_list *l,
                           const float *base, size_t stride, int which)
{
    int hs = c->head_size, group = c->n_heads / c->n_kv_heads;
    int i0, g, r, n = l->n, nr;
    float scale = 1.0f / sqrtf((float)hs);
    const float *rows[TL__ATT_BLOCK], *hr[TL__ATT_BLOCK];
    size_t ctx = (size_t)s->ctx;
    for (i0 = 0; i0 < n; i0 += nr) {
        nr = n - i0 < TL__ATT_BLOCK ? n - i0 : TL__ATT_BLOCK;
        tl__block_rows(l, base, stride, which, i0, nr, (g1 - g0) * hs, rows);
        for (g = g0; g < g1; g++) {
            size_t h0 = (size_t)g * (size_t)group;
            float *att = s->att + h0 * ctx + (size_t)i0;
            for (r = 0; r < nr; r++)
                hr[r] = rows[r] + (size_t)(g - g0) * (size_t)hs;
            if (which == 0)
                tl__scores_rows_avx2(s->q + h0 * (size_t)hs, hr, nr, group, hs, scale, att, ctx);
            else
                tl__axpys_rows_avx2(s->xb + h0 * (size_t)hs, att, ctx, hr, nr, group, hs);
        }
    }
}

/* tl__attend_kv_head with the SIMD kernels for KV heads g0 .. g1-1: the same
   operations in the same order for every score and output element. Several
   heads only where their lists hold the same positions of the host cache
   (full attention): then each block's rows are read once for all of them, a
   contiguous span of each cache row. kbase and vbase are head g0's columns. */
static void tl__attend_heads_avx2(const tl_config *c, tl_state *s, int g0, int g1, const tl_kv_list *l,
                                  const float *kbase, const float *vbase, size_t stride)
{
    int hs = c->head_size, group = c->n_heads / c->n_kv_heads, j;
    tl__heads_pass(c, s, g0, g1, l, kbase, stride, 0);
    for (j = g0 * group; j < g1 * group; j++) {
        if (l->n > 0)
            tl_softmax(s->att + (size_t)j * (size_t)s->ctx, l->n);
        memset(s->xb + (size_t)j * (size_t)hs, 0, (size_t)hs * sizeof(float));
    }
    tl__heads_pass(c, s, g0, g1, l, vbase, stride, 1);
}

/* whether lists g0+1 .. g1-1 hold the positions of list g0, all of the host cache */
static int tl__lists_shared(const tl_kv_list *lists, int g0, int g1)
{
    const tl_kv_list *a = &lists[g0];
    int g;
    if (a->k || a->krow || a->vrow)
        return 0;
    for (g = g0 + 1; g < g1; g++) {
        const tl_kv_list *b = &lists[g];
        if (b->k || b->krow || b->vrow || b->n != a->n ||
            (b->pos != a->pos && (a->n > 0 && memcmp(b->pos, a->pos, (size_t)a->n * sizeof(int)) != 0)))
            return 0;
    }
    return 1;
}
#endif

static void tl__attend_kv_head(const tl_model *m, tl_state *s, int layer, int g,
                               const tl_kv_list *l)
{
    const tl_config *c = &m->config;
    int hs = c->head_size, group = c->n_heads / c->n_kv_heads;
    int h0 = g * group, i, j, n = l->n;
    float scale = 1.0f / sqrtf((float)hs);
    const float *kbase = NULL, *vbase = NULL;
    size_t stride = l->k ? (size_t)hs : (size_t)c->kv_dim;
#ifdef TL__X86
    int fast = tl__have_avx2() && hs % 8 == 0;
#endif

    /* A base is only formed where rows are not given one by one (krow, vrow):
       a state without the host KV cache has no base to offer. */
    if (!l->krow)
        kbase = l->k ? l->k : tl_key_row(c, s, layer, 0) + (size_t)g * (size_t)hs;
    if (!l->vrow)
        vbase = l->k ? l->v : tl_value_row(c, s, layer, 0) + (size_t)g * (size_t)hs;
#ifdef TL__X86
    if (fast) {
        tl__attend_heads_avx2(c, s, g, g + 1, l, kbase, vbase, stride);
        return;
    }
#endif
    for (i = 0; i < n; i++) {
        const float *k = tl__list_row(l, kbase, stride, 0, i);
#if defined(__GNUC__) || defined(__clang__)
        if (l->krow && i + TL__KV_AHEAD < n) { /* scattered rows: fetch ahead of the dot products */
            const char *nk = (const char *)l->krow[i + TL__KV_AHEAD], *nv = (const char *)l->vrow[i + TL__KV_AHEAD];
            int b;
            for (b = 0; b < hs * 4; b += 64) {
                __builtin_prefetch(nk + b);
                __builtin_prefetch(nv + b);
            }
        } else if (!l->krow && i + TL__KV_AHEAD < n) { /* strided rows of the cache: the same */
            const char *nk = (const char *)(kbase + (size_t)(l->k ? i + TL__KV_AHEAD : l->pos[i + TL__KV_AHEAD]) * stride);
            int b;
            for (b = 0; b < hs * 4; b += 64)
                __builtin_prefetch(nk + b);
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
        const float *v = tl__list_row(l, vbase, stride, 1, i);
#if defined(__GNUC__) || defined(__clang__)
        if (!l->vrow && i + TL__KV_AHEAD < n) {
            const char *nv = (const char *)(vbase + (size_t)(l->k ? i + TL__KV_AHEAD : l->pos[i + TL__KV_AHEAD]) * stride);
            int b;
            for (b = 0; b < hs * 4; b += 64)
                __builtin_prefetch(nv + b);
        }
#endif
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
    int layer, g0, g1;        /* KV heads g0 .. g1-1 */
    const tl_kv_list *lists;
} tl__attn_job;

static void *tl__attn_worker(void *arg)
{
    const tl__attn_job *job = (const tl__attn_job *)arg;
    int g;
#ifdef TL__X86
    const tl_config *c = &job->m->config;
    if (job->g1 - job->g0 > 1 && tl__have_avx2() && c->head_size % 8 == 0 &&
        tl__lists_shared(job->lists, job->g0, job->g1)) {
        size_t off = (size_t)job->g0 * (size_t)c->head_size;
        tl__attend_heads_avx2(c, job->s, job->g0, job->g1, &job->lists[job->g0],
                              tl_key_row(c, job->s, job->layer, 0) + off,
                              tl_value_row(c, job->s, job->layer, 0) + off, (size_t)c->kv_dim);
        return NULL;
    }
#endif
    for (g = job->g0; g < job->g1; g++)
        tl__attend_kv_head(job->m, job->s, job->layer, g, &job->lists[g]);
    return NULL;
}

static void tl__attn_part(void *arg, int part, int nparts)
{
    (void)nparts;
    tl__attn_worker((tl__attn_job *)arg + part);
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
        jobs[t].g0 = (int)((long)c->n_kv_heads * t / nt);   /* contiguous heads per thread */
        jobs[t].g1 = (int)((long)c->n_kv_heads * (t + 1) / nt);
        jobs[t].lists = lists;
        started[t] = 0;
    }
    if (nt > 1 && s->pool && ((tl__pool *)s->pool)->n == nt) {   /* the state's threads */
        tl_parallel(s, tl__attn_part, jobs);
        tl_layer_attn_out(m, s, layer);
        return;
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
    tl_layer_weights lw;
    int i;
    tl__layer(m, layer, &lw);
    tl__mv(s, s->xb2, s->xb, &lw.wo, tl__qdim(c), c->dim);
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
    tl_layer_weights lw;
    tl__mv_job j;
    int i;
    tl__layer(m, layer, &lw);
    tl__rmsnorm(s->xb, s->x, lw.rms_ffn, c->dim, c->rms_eps);
    j.count = 2;
    j.n = c->dim;
    j.x = s->xb;
    j.w[0] = &lw.w1; j.out[0] = s->hb; j.d[0] = c->hidden_dim;
    j.w[1] = &lw.w3; j.out[1] = s->hb2; j.d[1] = c->hidden_dim;
    j.next = 0;
    tl__mv_run(s, &j);
    for (i = 0; i < c->hidden_dim; i++) {
        float a = s->hb[i];
        s->hb[i] = a / (1.0f + expf(-a)) * s->hb2[i];   /* silu(w1 x) * w3 x */
    }
    tl__mv(s, s->xb, s->hb, &lw.w2, c->hidden_dim, c->dim);
    for (i = 0; i < c->dim; i++)
        s->x[i] += s->xb[i];
}

float *tl_classify(const tl_model *m, tl_state *s)
{
    const tl_config *c = &m->config;
    tl_mat cls;
    tl__rmsnorm(s->xb, s->x, m->w.rms_final, c->dim, c->rms_eps);
    if (m->layers) {
        cls = m->cls;
    } else {
        cls.data = m->w.wcls;
        cls.dtype = TL_F32;
    }
    tl__mv(s, s->logits, s->xb, &cls, c->dim, c->vocab_size);
    return s->logits;
}

double tl_weight_bytes_per_token(const tl_model *m)
{
    const tl_config *c = &m->config;
    tl_layer_weights lw;
    double b = 0, es;
    int l;
    for (l = 0; l < c->n_layers; l++) {
        tl__layer(m, l, &lw);
        es = lw.wq.dtype == TL_F32 ? 4.0 : 2.0;
        b += es * (double)c->dim * (2.0 * tl__qdim(c) + 2.0 * c->kv_dim + 3.0 * c->hidden_dim);
    }
    es = m->layers && m->cls.dtype != TL_F32 ? 2.0 : 4.0;
    return b + es * (double)c->vocab_size * (double)c->dim + es * (double)c->dim;
}

/* ----------------------------------------------------------------------------
   Batched stages and the chunked prefill */

int tl_layer_qkv_batch(const tl_model *m, tl_state *s, int layer, int pos0, int n,
                       const float *x, float *q, float *k, float *v)
{
    const tl_config *c = &m->config;
    size_t dim = (size_t)c->dim, qd = (size_t)tl__qdim(c), kv = (size_t)c->kv_dim;
    tl_layer_weights lw;
    float *xn = (float *)malloc((size_t)n * dim * sizeof(float));
    int t, i, rc = -1;
    if (!xn)
        return -1;
    tl__layer(m, layer, &lw);
    for (t = 0; t < n; t++)
        tl__rmsnorm(xn + (size_t)t * dim, x + (size_t)t * dim, lw.rms_att, c->dim, c->rms_eps);
    if (tl__mm(s, q, xn, n, &lw.wq, c->dim, (int)qd) || tl__mm(s, k, xn, n, &lw.wk, c->dim, (int)kv) ||
        tl__mm(s, v, xn, n, &lw.wv, c->dim, (int)kv))
        goto out;
    for (t = 0; t < n; t++) {
        float *qt = q + (size_t)t * qd, *kt = k + (size_t)t * kv, *vt = v + (size_t)t * kv;
        if (lw.bq) {
            for (i = 0; i < (int)qd; i++)
                qt[i] += lw.bq[i];
            for (i = 0; i < (int)kv; i++) {
                kt[i] += lw.bk[i];
                vt[i] += lw.bv[i];
            }
        }
        if (s->rope_pos != pos0 + t) {
            tl__rope_angles(c, s->rope_freq, pos0 + t, s->rope_cos, s->rope_sin);
            s->rope_pos = pos0 + t;
        }
        tl__rope(qt, c->n_heads, c->head_size, s->rope_cos, s->rope_sin, c->rope_layout);
        tl__rope(kt, c->n_kv_heads, c->head_size, s->rope_cos, s->rope_sin, c->rope_layout);
    }
    rc = 0;
out:
    free(xn);
    return rc;
}

int tl_layer_out_ffn_batch(const tl_model *m, tl_state *s, int layer, int n, float *x,
                           const float *heads)
{
    const tl_config *c = &m->config;
    size_t dim = (size_t)c->dim, hid = (size_t)c->hidden_dim, i, all = (size_t)n * dim;
    tl_layer_weights lw;
    float *tmp = (float *)malloc(all * sizeof(float));
    float *xn = (float *)malloc(all * sizeof(float));
    float *h1 = (float *)malloc((size_t)n * hid * sizeof(float));
    float *h3 = (float *)malloc((size_t)n * hid * sizeof(float));
    int t, rc = -1;
    if (!tmp || !xn || !h1 || !h3)
        goto out;
    tl__layer(m, layer, &lw);
    if (tl__mm(s, tmp, heads, n, &lw.wo, tl__qdim(c), c->dim))
        goto out;
    for (i = 0; i < all; i++)
        x[i] += tmp[i];
    for (t = 0; t < n; t++)
        tl__rmsnorm(xn + (size_t)t * dim, x + (size_t)t * dim, lw.rms_ffn, c->dim, c->rms_eps);
    if (tl__mm(s, h1, xn, n, &lw.w1, c->dim, c->hidden_dim) ||
        tl__mm(s, h3, xn, n, &lw.w3, c->dim, c->hidden_dim))
        goto out;
    for (i = 0; i < (size_t)n * hid; i++) {
        float a = h1[i];
        h1[i] = a / (1.0f + expf(-a)) * h3[i];
    }
    if (tl__mm(s, tmp, h1, n, &lw.w2, c->hidden_dim, c->dim))
        goto out;
    for (i = 0; i < all; i++)
        x[i] += tmp[i];
    rc = 0;
out:
    free(tmp);
    free(xn);
    free(h1);
    free(h3);
    return rc;
}

typedef struct {
    const tl_config *c;
    int pos0, n;
    const float *q;
    const float *const *k, *const *v;
    size_t stride;
    float *att, *out;
    size_t att_per_part;
} tl__causal_job;

static void tl__causal_part(void *arg, int part, int nparts)
{
    const tl__causal_job *j = (const tl__causal_job *)arg;
    size_t qd = (size_t)tl__qdim(j->c);
    int t0 = (int)((long)j->n * part / nparts), t1 = (int)((long)j->n * (part + 1) / nparts);
    if (t1 > t0)
        tl_attend_causal(j->c, j->pos0 + t0, t1 - t0, j->q + (size_t)t0 * qd, j->k, j->v, j->stride,
                         j->att + (size_t)part * j->att_per_part, j->out + (size_t)t0 * qd);
}

#define TL_PREFILL_CHUNK 64

float *tl_forward_chunk(const tl_model *m, tl_state *s, const int *tokens, int n, int pos0)
{
    const tl_config *c = &m->config;
    size_t dim = (size_t)c->dim, qd = (size_t)tl__qdim(c), kv = (size_t)c->kv_dim, hs = (size_t)c->head_size;
    int parts = s->pool ? ((tl__pool *)s->pool)->n : 1, t, l, g, b0;
    float *x = NULL, *q = NULL, *heads = NULL, *att = NULL;
    const float **kp = NULL, **vp = NULL;
    float *ret = NULL;
    size_t att_part;

    if (n < 1 || pos0 < 0 || pos0 + n > s->ctx) {
        tl__fail(s->err, sizeof s->err, "prefill of %d tokens at %d: the context holds %d", n, pos0, s->ctx);
        return NULL;
    }
    if (!s->key_cache) {
        tl__fail(s->err, sizeof s->err, "this run state has no KV cache");
        return NULL;
    }
    for (t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= c->vocab_size) {
            tl__fail(s->err, sizeof s->err, "token %d is outside the vocabulary (0..%d)", tokens[t],
                     c->vocab_size - 1);
            return NULL;
        }
    att_part = (size_t)((TL_PREFILL_CHUNK + parts - 1) / parts) * (size_t)c->n_heads * (size_t)(pos0 + n);
    x = (float *)malloc((size_t)TL_PREFILL_CHUNK * dim * sizeof(float));
    q = (float *)malloc((size_t)TL_PREFILL_CHUNK * qd * sizeof(float));
    heads = (float *)malloc((size_t)TL_PREFILL_CHUNK * qd * sizeof(float));
    att = (float *)malloc((size_t)parts * att_part * sizeof(float));
    kp = (const float **)malloc((size_t)c->n_kv_heads * sizeof(float *));
    vp = (const float **)malloc((size_t)c->n_kv_heads * sizeof(float *));
    if (!x || !q || !heads || !att || !kp || !vp) {
        tl__fail(s->err, sizeof s->err, "out of memory for the prefill of %d tokens", n);
        goto out;
    }
    for (b0 = 0; b0 < n; b0 += TL_PREFILL_CHUNK) {
        int nb = n - b0 < TL_PREFILL_CHUNK ? n - b0 : TL_PREFILL_CHUNK, p0 = pos0 + b0;
        for (t = 0; t < nb; t++) {
            tl_embed(m, s, tokens[b0 + t]);
            memcpy(x + (size_t)t * dim, s->x, dim * sizeof(float));
        }
        for (l = 0; l < c->n_layers; l++) {
            tl__causal_job j;
            if (tl_layer_qkv_batch(m, s, l, p0, nb, x, q, tl_key_row(c, s, l, p0),
                                   tl_value_row(c, s, l, p0)))
                goto oom;
            for (g = 0; g < c->n_kv_heads; g++) {
                kp[g] = tl_key_row(c, s, l, 0) + (size_t)g * hs;
                vp[g] = tl_value_row(c, s, l, 0) + (size_t)g * hs;
            }
            j.c = c;
            j.pos0 = p0;
            j.n = nb;
            j.q = q;
            j.k = kp;
            j.v = vp;
            j.stride = kv;
            j.att = att;
            j.out = heads;
            j.att_per_part = att_part;
            tl_parallel(s, tl__causal_part, &j);
            if (tl_layer_out_ffn_batch(m, s, l, nb, x, heads))
                goto oom;
        }
        memcpy(s->x, x + (size_t)(nb - 1) * dim, dim * sizeof(float));
    }
    ret = tl_classify(m, s);
    goto out;
oom:
    tl__fail(s->err, sizeof s->err, "out of memory for the prefill of %d tokens", n);
out:
    free(x);
    free(q);
    free(heads);
    free(att);
    free((void *)kp);
    free((void *)vp);
    return ret;
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
