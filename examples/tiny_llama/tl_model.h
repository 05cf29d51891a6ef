/* tl_model.h - the model and the forward pass of tiny_llama: the config and
   weights, the run state and its KV cache, attention selection (full,
   window, oracle, a library's callback) and the forward stages, token by
   token and in chunks of tokens.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file.

   Model
     RMSNorm (eps 1e-5, or the config's rms_norm_eps), rotary embeddings
     (RoPE) with llama2.c's interleaved pairs: pair i of a head is dims
     (2i, 2i+1), rotated by the angle pos * theta^(-2i/head_size) (Hugging
     Face models: pair i is dims (i, i + head_size/2), rotate_half, and the
     frequencies follow the config's rope_scaling: linear or llama3);
     optional q/k/v biases (Qwen2); grouped-query attention (query head h uses
     KV head h / (n_heads / n_kv_heads)); SwiGLU FFN w2(silu(w1 x) * w3 x);
     optional classifier shared with the token embedding.

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
     callback a library's selection callback (tl_policy.select) fills the
              lists: a KV-cache library without a driver of its own
     pqcache  not a selection: pqcache's driver (tl_pqcache.h) runs the
              stages itself (tl_layer_qkv_rows, tl_attend_prompt,
              tl_layer_attention with explicit rows) on a state without a KV
              cache; tl_select and tl_check_policy refuse the mode
     budget = round(ratio * (context - n_sink)); see tl_budget.
*/
#ifndef TL_MODEL_H
#define TL_MODEL_H

#define TL_DEFAULT_ROPE_THETA 10000.0f
#define TL_RMS_EPS 1e-5f
#define TL_ERR_LEN 256           /* a good size for error buffers */
#define TL_MAX_LAYERS 4096       /* layers a model may have */

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
    /* Gemma-style and hybrid local/global models (all zero otherwise) */
    float attn_scale;      /* softmax scale of q.k; 0 = 1/sqrt(head_size) */
    float embed_scale;     /* the token embedding row is multiplied by it; 0 = 1 */
    int qk_norm;           /* 1: per-head RMSNorm of q and k before RoPE (q_norm, k_norm) */
    int ffn_act;           /* tl_act: the FFN gate's activation */
    int sliding_window;    /* local layers attend to the last sliding_window positions,
                              the current one included */
    float rope_theta_local;/* local layers' RoPE base, unscaled; 0 = the global layers' RoPE */
    unsigned char local[TL_MAX_LAYERS / 8]; /* bit l: layer l is local (tl_layer_window) */
} tl_config;

typedef enum { TL_ARCH_LLAMA2C = 0, TL_ARCH_LLAMA, TL_ARCH_MISTRAL, TL_ARCH_QWEN2, TL_ARCH_GEMMA3 } tl_arch;
typedef enum { TL_ROPE_INTERLEAVED = 0, TL_ROPE_HALF = 1 } tl_rope_layout;
typedef enum { TL_ROPE_SCALING_NONE = 0, TL_ROPE_SCALING_LINEAR, TL_ROPE_SCALING_LLAMA3 } tl_rope_scaling;
typedef enum { TL_F32 = 0, TL_BF16 = 1, TL_F16 = 2 } tl_dtype;
typedef enum { TL_ACT_SILU = 0, TL_ACT_GELU_TANH = 1 } tl_act;

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
    const float *q_norm, *k_norm;  /* (head_size) each with qk_norm, else NULL */
    const float *rms_post_att, *rms_post_ffn; /* Gemma's norms of the attention's and the
                                     FFN's outputs before the residual adds; NULL: none */
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

/* Checks a config's sizes and fills head_size and kv_dim. */
int tl_check_config(tl_config *c, char *err, size_t errlen);
/* The window a layer attends over: 0 for a global layer (every past position),
   sliding_window for a local one. */
int tl_layer_window(const tl_config *c, int layer);
/* Marks layer l local (1) or global (0). */
void tl_set_layer_local(tl_config *c, int layer, int local);
/* The softmax scale of q.k: attn_scale, or 1/sqrt(head_size). */
float tl_attn_scale(const tl_config *c);

/* Bytes of weights one decode token reads (every matrix once, the
   classifier whole, one embedding row). */
double tl_weight_bytes_per_token(const tl_model *m);

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

#define TL_SCRATCH_SLOTS 6

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
    double *rope_freq;        /* (head_size) inverse frequencies: the global layers', scaling
                                 applied, then the local layers' (rope_theta_local) */
    int rope_local;           /* rope_cos and rope_sin hold the local layers' angles */
    int exact_prefill;        /* 1: the prompt with the decode step's arithmetic, to the
                                 bit (projections by tl__dot's sums, attention by
                                 tl_attend_causal); 0 (default): tiled (projections in
                                 register blocks, tl_attend_prefill), equal to rounding */
    /* tl_forward_chunk's progress, or NULL: called after each block of tokens of each
       layer (layer-major; done of total tokens of that layer) */
    void (*progress)(void *user, int layer, int n_layers, int done, int total);
    void *progress_user;
    /* the batched stages' buffers, kept between calls (grown as needed; internal) */
    float *scratch[TL_SCRATCH_SLOTS];
    size_t scratch_n[TL_SCRATCH_SLOTS];
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
    TL_ATTN_PQCACHE,       /* tl_pqcache.h's driver, not tl_select */
    TL_ATTN_CALLBACK       /* tl_policy.select */
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
    int n_sink;            /* sink tokens (default 4, pqcache's) */
    float ratio;           /* budget as a fraction of the context (default 0.1) */
    tl_select_fn select;   /* TL_ATTN_CALLBACK: the library's selection */
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
   i = 0 .. pos0+n-1; token t attends over 0 .. pos0+t (window > 0: over the
   last `window` of them; rows before pos0 - window + 1 are not read). Writes the heads'
   outputs to out (n, n_heads * head_size). att is scratch of
   n * n_heads * (pos0 + n) floats. Each key and value row is read once for
   the whole block; per token the arithmetic is that of tl_layer_attention
   over positions 0 .. pos0+t, so the results are the same to the bit. */
void tl_attend_causal(const tl_config *c, int pos0, int n, const float *q,
                      const float *const *k, const float *const *v, size_t stride, int window,
                      float *att, float *out);
/* The prompt's attention as the engine runs it: tl_attend_prefill, or with exact
   tl_attend_causal; origin: the position of rows k[g], v[g] (the tiled path starts its
   key tiles at multiples of 128 positions, so a token's output does not depend on which
   rows are passed). tiles (tiled path, origin 0; may be NULL): the rows already packed
   (tl_prefill_pack). work: tl_attend_prompt_work(c, exact, n, pos0 + n) floats. */
struct tl_prefill_tiles; /* tl_prefill.h */
void tl_attend_prompt(const tl_config *c, int exact, int pos0, int n, const float *q,
                      const float *const *k, const float *const *v, size_t stride, int window,
                      int origin, const struct tl_prefill_tiles *tiles, float *work, float *out);
size_t tl_attend_prompt_work(const tl_config *c, int exact, int n, int rows);
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
/* x = softmax(x), in place (attention; the sampler) */
void tl_softmax(float *x, int n);

#endif /* TL_MODEL_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_MODEL_IMPLEMENTED)
#define TL_MODEL_IMPLEMENTED

/* ----------------------------------------------------------------------------
   Config validation */

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
    if (c->arch < 0 || c->arch > TL_ARCH_GEMMA3)
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
    if (!(c->attn_scale >= 0.0f && c->attn_scale <= 1e6f) || !(c->embed_scale >= 0.0f && c->embed_scale <= 1e6f))
        return tl__fail(err, errlen, "attention scale %g / embedding scale %g: not finite and >= 0",
                        (double)c->attn_scale, (double)c->embed_scale);
    if (!(c->rope_theta_local >= 0.0f && c->rope_theta_local <= 3.0e38f))
        return tl__fail(err, errlen, "local rope_theta %g is not a finite number >= 0",
                        (double)c->rope_theta_local);
    if (c->ffn_act != TL_ACT_SILU && c->ffn_act != TL_ACT_GELU_TANH)
        return tl__fail(err, errlen, "unknown FFN activation %d", c->ffn_act);
    if (c->qk_norm != 0 && c->qk_norm != 1)
        return tl__fail(err, errlen, "qk_norm is %d, must be 0 or 1", c->qk_norm);
    if (c->sliding_window < 0)
        return tl__fail(err, errlen, "sliding window %d is negative", c->sliding_window);
    for (i = 0; i < TL_MAX_LAYERS; i++)
        if ((c->local[i / 8] >> (i % 8) & 1) && (i >= c->n_layers || c->sliding_window == 0))
            return tl__fail(err, errlen, "layer %d is marked local but %s", i,
                            i >= c->n_layers ? "the model has fewer layers" : "there is no sliding window");
    return 0;
}

int tl_layer_window(const tl_config *c, int layer)
{
    if (layer < 0 || layer >= TL_MAX_LAYERS || !(c->local[layer / 8] >> (layer % 8) & 1))
        return 0;
    return c->sliding_window;
}

void tl_set_layer_local(tl_config *c, int layer, int local)
{
    if (layer < 0 || layer >= TL_MAX_LAYERS)
        return;
    if (local)
        c->local[layer / 8] = (unsigned char)(c->local[layer / 8] | (1u << (layer % 8)));
    else
        c->local[layer / 8] = (unsigned char)(c->local[layer / 8] & ~(1u << (layer % 8)));
}

float tl_attn_scale(const tl_config *c)
{
    return c->attn_scale > 0.0f ? c->attn_scale : 1.0f / sqrtf((float)c->head_size);
}

/* ----------------------------------------------------------------------------
   Run state */

/* RoPE inverse frequencies: theta^(-2i/head_size), then the config's scaling
   (linear: divided by the factor; llama3: long wavelengths divided by the
   factor, short ones kept, a smooth blend between); then the local layers'
   (f + head_size/2) */
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
    for (i = 0; i < half; i++)   /* the local layers': their own base, unscaled */
        f[half + i] = c->rope_theta_local > 0.0f ? pow((double)c->rope_theta_local, -2.0 * i / (double)c->head_size)
                                                 : f[i];
}

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
    s->rope_freq = (double *)calloc((size_t)c->head_size + 1, sizeof(double));
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
    int i;
    free(s->x); free(s->xb); free(s->xb2); free(s->hb); free(s->hb2);
    free(s->q); free(s->att); free(s->logits); free(s->key_cache);
    free(s->value_cache); free(s->rope_cos); free(s->rope_sin); free(s->lists);
    free(s->list_pos); free(s->mass); free(s->select_tmp); free(s->rope_freq);
    for (i = 0; i < TL_SCRATCH_SLOTS; i++)
        free(s->scratch[i]);
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
   RMSNorm, softmax, RoPE and a layer's weights */

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

/* s->rope_cos and s->rope_sin for a layer's RoPE at pos (kept while the position and the
   layer's kind stay) */
static void tl__rope_at(const tl_config *c, tl_state *s, int layer, int pos)
{
    int local = tl_layer_window(c, layer) > 0 && c->rope_theta_local > 0.0f;
    if (s->rope_pos != pos || s->rope_local != local) {
        tl__rope_angles(c, s->rope_freq + (local ? c->head_size / 2 : 0), pos, s->rope_cos, s->rope_sin);
        s->rope_pos = pos;
        s->rope_local = local;
    }
}

/* q and k of one token: biases, per-head norms (qk_norm), RoPE at the layer's angles */
static void tl__qk_finish(const tl_config *c, const tl_layer_weights *lw, float *q, float *k, float *v)
{
    int i, qd = tl__qdim(c);
    if (lw->bq) {
        for (i = 0; i < qd; i++)
            q[i] += lw->bq[i];
        for (i = 0; i < c->kv_dim; i++) {
            k[i] += lw->bk[i];
            v[i] += lw->bv[i];
        }
    }
    if (lw->q_norm) {
        for (i = 0; i < c->n_heads; i++)
            tl__rmsnorm(q + (size_t)i * (size_t)c->head_size, q + (size_t)i * (size_t)c->head_size, lw->q_norm,
                        c->head_size, c->rms_eps);
        for (i = 0; i < c->n_kv_heads; i++)
            tl__rmsnorm(k + (size_t)i * (size_t)c->head_size, k + (size_t)i * (size_t)c->head_size, lw->k_norm,
                        c->head_size, c->rms_eps);
    }
}

/* the FFN gate: act(h1) * h3 into h1 */
/* ----------------------------------------------------------------------------
   Forward stages */

void tl_embed(const tl_model *m, tl_state *s, int token)
{
    const tl_config *c = &m->config;
    if (m->layers) {
        size_t row = (size_t)token * (size_t)c->dim, i;
        for (i = 0; i < (size_t)c->dim; i++)
            s->x[i] = tl__elem(m->emb.data, m->emb.dtype, row + i);
        if (c->embed_scale > 0.0f)
            for (i = 0; i < (size_t)c->dim; i++)
                s->x[i] *= c->embed_scale;
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

    tl__layer(m, layer, &lw);
    tl__rope_at(c, s, layer, pos);
    tl__rmsnorm(s->xb, s->x, lw.rms_att, c->dim, c->rms_eps);
    j.count = 3;
    j.n = c->dim;
    j.x = s->xb;
    j.w[0] = &lw.wq; j.out[0] = s->q; j.d[0] = tl__qdim(c);
    j.w[1] = &lw.wk; j.out[1] = k; j.d[1] = c->kv_dim;
    j.w[2] = &lw.wv; j.out[2] = v; j.d[2] = c->kv_dim;
    j.next = 0;
    tl__mv_run(s, &j);
    tl__qk_finish(c, &lw, s->q, k, v);
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
    float scale = tl_attn_scale(c);
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
    float scale = tl_attn_scale(c);
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
    if (lw.rms_post_att)
        tl__rmsnorm(s->xb2, s->xb2, lw.rms_post_att, c->dim, c->rms_eps);
    for (i = 0; i < c->dim; i++)
        s->x[i] += s->xb2[i];
}

void tl_attend_causal(const tl_config *c, int pos0, int n, const float *q,
                      const float *const *k, const float *const *v, size_t stride, int window,
                      float *att, float *out)
{
    int hs = c->head_size, nh = c->n_heads, group = c->n_heads / c->n_kv_heads;
    int rows = pos0 + n, g, i, t, j, first = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    size_t as = (size_t)rows, qd = (size_t)nh * (size_t)hs;
    float scale = tl_attn_scale(c);

    for (g = 0; g < c->n_kv_heads; g++) {
        int h0 = g * group;
        for (i = first; i < rows; i++) {   /* scores: each key row once for the block */
            const float *kr = k[g] + (size_t)i * stride;
            int t1 = window > 0 && i + window - pos0 < n ? i + window - pos0 : n; /* t < t1: i in t's window */
            for (t = i > pos0 ? i - pos0 : 0; t < t1; t++)
                for (j = 0; j < group; j++) {
                    int h = h0 + j;
                    att[((size_t)t * (size_t)nh + (size_t)h) * as + (size_t)i] =
                        tl__dot(q + (size_t)t * qd + (size_t)h * (size_t)hs, kr, hs) * scale;
                }
        }
        for (t = 0; t < n; t++)
            for (j = 0; j < group; j++) {
                int h = h0 + j, lo = window > 0 && pos0 + t - window + 1 > 0 ? pos0 + t - window + 1 : 0;
                tl_softmax(att + ((size_t)t * (size_t)nh + (size_t)h) * as + lo, pos0 + t + 1 - lo);
                memset(out + (size_t)t * qd + (size_t)h * (size_t)hs, 0, (size_t)hs * sizeof(float));
            }
        for (i = first; i < rows; i++) {   /* weighted values: each value row once */
            const float *vr = v[g] + (size_t)i * stride;
            int t1 = window > 0 && i + window - pos0 < n ? i + window - pos0 : n;
            for (t = i > pos0 ? i - pos0 : 0; t < t1; t++)
                for (j = 0; j < group; j++) {
                    int h = h0 + j;
                    tl__axpy(out + (size_t)t * qd + (size_t)h * (size_t)hs,
                             att[((size_t)t * (size_t)nh + (size_t)h) * as + (size_t)i], vr, hs);
                }
        }
    }
}

void tl_attend_prompt(const tl_config *c, int exact, int pos0, int n, const float *q,
                      const float *const *k, const float *const *v, size_t stride, int window,
                      int origin, const struct tl_prefill_tiles *tiles, float *work, float *out)
{
    if (exact)
        tl_attend_causal(c, pos0, n, q, k, v, stride, window, work, out);
    else
        tl__attend_prefill_ex(c, pos0, n, q, k, v, stride, window, work, out, 1, origin, tiles);
}

size_t tl_attend_prompt_work(const tl_config *c, int exact, int n, int rows)
{
    return exact ? (size_t)n * (size_t)c->n_heads * (size_t)rows : tl_attend_prefill_work(c);
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
    tl__gate(c, s->hb, s->hb2, (size_t)c->hidden_dim);
    tl__mv(s, s->xb, s->hb, &lw.w2, c->hidden_dim, c->dim);
    if (lw.rms_post_ffn)
        tl__rmsnorm(s->xb, s->xb, lw.rms_post_ffn, c->dim, c->rms_eps);
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
    float *xn = tl__scratch(s, TL__SCRATCH_XN, (size_t)n * dim);
    const tl_mat *w[3];
    float *out[3];
    int d[3], t;
    if (!xn)
        return -1;
    tl__layer(m, layer, &lw);
    for (t = 0; t < n; t++)
        tl__rmsnorm(xn + (size_t)t * dim, x + (size_t)t * dim, lw.rms_att, c->dim, c->rms_eps);
    w[0] = &lw.wq; out[0] = q; d[0] = (int)qd;
    w[1] = &lw.wk; out[1] = k; d[1] = (int)kv;
    w[2] = &lw.wv; out[2] = v; d[2] = (int)kv;
    if (tl__mm_multi(s, xn, n, c->dim, 3, w, out, d))
        return -1;
    for (t = 0; t < n; t++) {
        float *qt = q + (size_t)t * qd, *kt = k + (size_t)t * kv, *vt = v + (size_t)t * kv;
        tl__qk_finish(c, &lw, qt, kt, vt);
        tl__rope_at(c, s, layer, pos0 + t);
        tl__rope(qt, c->n_heads, c->head_size, s->rope_cos, s->rope_sin, c->rope_layout);
        tl__rope(kt, c->n_kv_heads, c->head_size, s->rope_cos, s->rope_sin, c->rope_layout);
    }
    return 0;
}

int tl_layer_out_ffn_batch(const tl_model *m, tl_state *s, int layer, int n, float *x,
                           const float *heads)
{
    const tl_config *c = &m->config;
    size_t dim = (size_t)c->dim, hid = (size_t)c->hidden_dim, i, all = (size_t)n * dim;
    tl_layer_weights lw;
    float *tmp = tl__scratch(s, TL__SCRATCH_TMP, all), *xn = tl__scratch(s, TL__SCRATCH_XN, all);
    float *h1 = tl__scratch(s, TL__SCRATCH_H1, (size_t)n * hid), *h3 = tl__scratch(s, TL__SCRATCH_H3, (size_t)n * hid);
    const tl_mat *w[2];
    float *out[2];
    int d[2], t;
    if (!tmp || !xn || !h1 || !h3)
        return -1;
    tl__layer(m, layer, &lw);
    if (tl__mm(s, tmp, heads, n, &lw.wo, tl__qdim(c), c->dim))
        return -1;
    if (lw.rms_post_att)
        for (t = 0; t < n; t++)
            tl__rmsnorm(tmp + (size_t)t * dim, tmp + (size_t)t * dim, lw.rms_post_att, c->dim, c->rms_eps);
    for (i = 0; i < all; i++)
        x[i] += tmp[i];
    for (t = 0; t < n; t++)
        tl__rmsnorm(xn + (size_t)t * dim, x + (size_t)t * dim, lw.rms_ffn, c->dim, c->rms_eps);
    w[0] = &lw.w1; out[0] = h1; d[0] = c->hidden_dim;
    w[1] = &lw.w3; out[1] = h3; d[1] = c->hidden_dim;
    if (tl__mm_multi(s, xn, n, c->dim, 2, w, out, d))
        return -1;
    tl__gate_run(s, c, h1, h3, (size_t)n * hid);
    if (tl__mm(s, tmp, h1, n, &lw.w2, c->hidden_dim, c->dim))
        return -1;
    if (lw.rms_post_ffn)
        for (t = 0; t < n; t++)
            tl__rmsnorm(tmp + (size_t)t * dim, tmp + (size_t)t * dim, lw.rms_post_ffn, c->dim, c->rms_eps);
    for (i = 0; i < all; i++)
        x[i] += tmp[i];
    return 0;
}

typedef struct {
    const tl_config *c;
    int pos0, n, window;
    const float *q;
    const float *const *k, *const *v;
    size_t stride;
    float *att, *out;
    size_t att_per_part;          /* at least tl_attend_prompt_work(c, exact, ...) */
    int exact;                    /* tl_state.exact_prefill */
    int origin;                   /* position of rows k[g], v[g] (tiled only) */
    const tl_prefill_tiles *tiles; /* the rows packed (tiled, origin 0), or NULL */
} tl__causal_job;

static void tl__causal_part(void *arg, int part, int nparts)
{
    const tl__causal_job *j = (const tl__causal_job *)arg;
    size_t qd = (size_t)tl__qdim(j->c);
    int t0 = (int)((long)j->n * part / nparts), t1 = (int)((long)j->n * (part + 1) / nparts);
    if (t1 > t0)
        tl_attend_prompt(j->c, j->exact, j->pos0 + t0, t1 - t0, j->q + (size_t)t0 * qd, j->k, j->v, j->stride,
                         j->window, j->origin, j->tiles, j->att + (size_t)part * j->att_per_part,
                         j->out + (size_t)t0 * qd);
}

#define TL_PREFILL_CHUNK 128

float *tl_forward_chunk(const tl_model *m, tl_state *s, const int *tokens, int n, int pos0)
{
    const tl_config *c = &m->config;
    size_t dim = (size_t)c->dim, qd = (size_t)tl__qdim(c), kv = (size_t)c->kv_dim, hs = (size_t)c->head_size;
    int parts = s->pool ? ((tl__pool *)s->pool)->n : 1, t, l, g, b0;
    float *x = NULL, *q = NULL, *heads = NULL, *att = NULL;
    const float **kp = NULL, **vp = NULL;
    float *ret = NULL;
    size_t att_part;
    tl_prefill_tiles tiles = { NULL, NULL, 0 };

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
    /* layer by layer, each in chunks of TL_PREFILL_CHUNK tokens (a token's arithmetic is
       the same in either order): the tiled attention then packs a layer's keys and
       values once (tiles), not once per chunk and thread */
    att_part = tl_attend_prompt_work(c, s->exact_prefill, (TL_PREFILL_CHUNK + parts - 1) / parts, pos0 + n);
    x = (float *)malloc((size_t)n * dim * sizeof(float));
    q = (float *)malloc((size_t)TL_PREFILL_CHUNK * qd * sizeof(float));
    heads = (float *)malloc((size_t)TL_PREFILL_CHUNK * qd * sizeof(float));
    att = (float *)malloc((size_t)parts * att_part * sizeof(float));
    kp = (const float **)malloc((size_t)c->n_kv_heads * sizeof(float *));
    vp = (const float **)malloc((size_t)c->n_kv_heads * sizeof(float *));
    if (!x || !q || !heads || !att || !kp || !vp ||
        (!s->exact_prefill && tl_prefill_tiles_init(&tiles, c, pos0 + n))) {
        tl__fail(s->err, sizeof s->err, "out of memory for the prefill of %d tokens", n);
        goto out;
    }
    for (t = 0; t < n; t++) {
        tl_embed(m, s, tokens[t]);
        memcpy(x + (size_t)t * dim, s->x, dim * sizeof(float));
    }
    for (l = 0; l < c->n_layers; l++) {
        for (g = 0; g < c->n_kv_heads; g++) {
            kp[g] = tl_key_row(c, s, l, 0) + (size_t)g * hs;
            vp[g] = tl_value_row(c, s, l, 0) + (size_t)g * hs;
        }
        if (tiles.kt)   /* the positions before this prompt */
            tl_prefill_pack(c, kp, vp, kv, 0, pos0, &tiles);
        for (b0 = 0; b0 < n; b0 += TL_PREFILL_CHUNK) {
            int nb = n - b0 < TL_PREFILL_CHUNK ? n - b0 : TL_PREFILL_CHUNK, p0 = pos0 + b0, done = b0 + nb;
            float *xb = x + (size_t)b0 * dim, *qb = q;
            tl__causal_job j;
            if (tl_layer_qkv_batch(m, s, l, p0, nb, xb, q, tl_key_row(c, s, l, p0), tl_value_row(c, s, l, p0)))
                goto oom;
            if (tiles.kt)
                tl_prefill_pack(c, kp, vp, kv, p0, p0 + nb, &tiles);
            if (l == c->n_layers - 1) {   /* the last layer: only the last token's output */
                if (done < n)             /* is read (its logits); the others' keys and   */
                    continue;             /* values are in the cache now                  */
                xb += (size_t)(nb - 1) * dim;
                qb += (size_t)(nb - 1) * qd;
                p0 += nb - 1;
                nb = 1;
            }
            j.c = c;
            j.pos0 = p0;
            j.n = nb;
            j.window = tl_layer_window(c, l);
            j.q = qb;
            j.k = kp;
            j.v = vp;
            j.stride = kv;
            j.att = att;
            j.out = heads;
            j.att_per_part = att_part;
            j.exact = s->exact_prefill;
            j.origin = 0;
            j.tiles = tiles.kt ? &tiles : NULL;
            tl_parallel(s, tl__causal_part, &j);
            if (tl_layer_out_ffn_batch(m, s, l, nb, xb, heads))
                goto oom;
            if (s->progress)
                s->progress(s->progress_user, l, c->n_layers, done, n);
        }
    }
    memcpy(s->x, x + (size_t)(n - 1) * dim, dim * sizeof(float));
    ret = tl_classify(m, s);
    goto out;
oom:
    tl__fail(s->err, sizeof s->err, "out of memory for the prefill of %d tokens", n);
out:
    tl_prefill_tiles_free(&tiles);
    free(x);
    free(q);
    free(heads);
    free(att);
    free((void *)kp);
    free((void *)vp);
    return ret;
}

/* ----------------------------------------------------------------------------
   Attention selection: full, window, oracle, a callback's */

#define TL__PQCACHE_NOT_HERE "pqcache mode runs through tl_pqcache.h's driver, not tl_select"

void tl_default_policy(tl_policy *p, tl_attn_mode mode)
{
    memset(p, 0, sizeof *p);
    p->mode = mode;
    p->n_sink = 4;
    p->ratio = 0.1f;
}

const char *tl_mode_name(tl_attn_mode mode)
{
    switch (mode) {
    case TL_ATTN_FULL: return "full";
    case TL_ATTN_WINDOW: return "window";
    case TL_ATTN_ORACLE: return "oracle";
    case TL_ATTN_PQCACHE: return "pqcache";
    case TL_ATTN_CALLBACK: return "callback";
    }
    return "unknown";
}

int tl_check_policy(const tl_policy *p, char *err, size_t errlen)
{
    if ((int)p->mode < (int)TL_ATTN_FULL || (int)p->mode > (int)TL_ATTN_CALLBACK)
        return tl__fail(err, errlen, "unknown attention mode %d", (int)p->mode);
    if (p->mode == TL_ATTN_PQCACHE)
        return tl__fail(err, errlen, TL__PQCACHE_NOT_HERE);
    if (p->n_sink < 0)
        return tl__fail(err, errlen, "sink count %d is negative", p->n_sink);
    if (!(p->ratio >= 0.0f && p->ratio <= 1.0f))
        return tl__fail(err, errlen, "budget ratio %g is not in [0, 1]", (double)p->ratio);
    if (p->mode == TL_ATTN_CALLBACK && !p->select)
        return tl__fail(err, errlen, "callback mode without a selection callback");
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
    float scale = tl_attn_scale(c);

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

    if (mode == TL_ATTN_PQCACHE)
        return tl__fail(s->err, sizeof s->err, TL__PQCACHE_NOT_HERE);
    if (mode == TL_ATTN_CALLBACK) {
        if (!p->select)
            return tl__fail(s->err, sizeof s->err, "callback mode without a selection callback");
        return p->select(p->select_user, m, s, layer, pos, s->lists);
    }
    if (!s->key_cache)   /* the lists below point into the host KV cache */
        return tl__fail(s->err, sizeof s->err, "this run state has no KV cache");
    if (mode == TL_ATTN_FULL || tl_layer_window(c, layer) > 0) {   /* a local layer: its window */
        int w = tl_layer_window(c, layer), first = w > 0 && n > w ? n - w : 0;
        for (g = 0; g < c->n_kv_heads; g++) {
            tl_kv_list *l = &s->lists[g];
            for (i = first; i < n; i++)
                l->pos[i - first] = i;
            l->n = n - first;
            l->k = l->v = NULL;
            l->krow = l->vrow = NULL;
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

#endif /* TL_MODEL implementation */
