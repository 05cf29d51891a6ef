/* pqc_llama.h - pqcache serving llama.cpp's full-attention layers.

   llama.cpp, with llama.cpp.patch applied, asks a llama_attn_hook for each attention
   layer of a graph. This glue answers for the layers that attend to the whole context
   (sliding-window layers stay llama.cpp's) and then, per layer:
     prompt (a ubatch of several tokens): llama.cpp attends over its own KV cache as
       usual; the store op hands the ubatch's K and V to the pqcache cache (and, for the
       layer's first ubatch, its last queries to observe first), which stores them and
       starts the layer's PQ build on its worker while llama.cpp computes the layers
       after it;
     decode (one token): the select op appends the token's K and V to pqcache, selects
       with the step's queries (sinks + top-k by PQ score + the recent window) and
       gathers the selected rows; the attend op, on every thread of llama.cpp's pool,
       computes each query head's softmax attention over them. The token's K/V goes to
       pqcache only, not to llama.cpp's cache.

   One sequence per context. Custom ops cannot return an error: a failing call records
   its result and message (pqc_llama_status, pqc_llama_error), the ops of the failed
   step and of every later one write zeros, and the caller checks the status after each
   llama_decode and stops. A prompt after decode steps is refused the same way: llama.cpp
   would attend over a cache that lacks the decoded tokens of the served layers. */
#ifndef PQC_LLAMA_H
#define PQC_LLAMA_H

#include "llama.h"
#include "pqcache.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pqc_llama_params {
    pqc_cache_desc desc; /* the cache's settings (zero: the library's defaults). The glue
                            fills in the shape (layers, heads, head size, capacity), the
                            keys' RoPE layout and the model's softmax scale;
                            cache_blocks 0 means none here (the rows are read where
                            they are stored, in host memory)                          */
    int kv_f32;          /* 1: K/V stored as fp32; else desc.kv_dtype, where 0 (fp32 in
                            the library) means fp16 here, as llama.cpp's cache stores */
    int threads;         /* pqcache worker threads for the background builds; 0 = 1    */
    size_t max_tokens;   /* sequence capacity; 0 = the model's training context        */
} pqc_llama_params;

typedef struct pqc_llama_stats {
    int layers;             /* layers served by pqcache                                 */
    int kv_heads;           /* KV heads per layer                                       */
    uint64_t steps;         /* decode steps (select + attend on every served layer)     */
    double select_s;        /* append + select, summed over layers and steps            */
    double fetch_s;         /* gathering the selected rows                              */
    double attend_s;        /* the attention over them (wall time of the attend ops)   */
    size_t host_bytes;      /* pqcache's host memory (K/V store, codes, codebooks, ...) */
    size_t tokens_selected; /* rows attended, summed over layers, KV heads and steps   */
    size_t tokens;          /* tokens held per layer                                    */
    double build_wait_s;    /* time selects waited for the layers' first PQ builds      */
} pqc_llama_stats;

typedef struct pqc_llama pqc_llama;

/* A glue for model; p may be NULL (defaults). The cache itself is created at the first
   op, when the graph has said which layers are served and the tensors give the heads. */
pqc_result pqc_llama_create(const struct llama_model *model, const pqc_llama_params *p, pqc_llama **out);
/* Installs the hook on ctx (before its first llama_decode). One context per glue. */
void pqc_llama_attach(pqc_llama *g, struct llama_context *ctx);
/* PQC_SUCCESS, or the first failure of an op, with its message. */
pqc_result pqc_llama_status(const pqc_llama *g);
const char *pqc_llama_error(const pqc_llama *g);
void pqc_llama_stats_get(const pqc_llama *g, pqc_llama_stats *out);
/* The cache (NULL before the first op), for the library's own calls: stats, save. */
pqc_cache *pqc_llama_cache(pqc_llama *g);
void pqc_llama_destroy(pqc_llama *g);

#ifdef __cplusplus
}
#endif
#endif
