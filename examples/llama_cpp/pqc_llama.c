/* pqc_llama.c - the glue between llama.cpp's attention hook and a pqcache cache (see
   pqc_llama.h for what runs where). */
#define _POSIX_C_SOURCE 199309L
#include "pqc_llama.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct pqcl_layer {
    struct pqc_llama *g;
    int il;      /* the model's layer                       */
    int pl;      /* the cache's layer; -1 = not served      */
    float scale; /* llama.cpp's kq_scale for the layer      */
} pqcl_layer;

struct pqc_llama {
    pqc_llama_params p;
    pqc_rope rope;
    size_t max_tokens;
    int n_layer, n_served;
    pqcl_layer *layers;
    pqc_runtime *rt;
    pqc_cache *cache;
    int observe;            /* queries observed before a layer's first prefill */
    int n_q, n_kv, d;       /* from the tensors of the first op               */
    pqc_selection sel;
    int sel_ready;
    float *k_rows, *v_rows; /* the step's gathered rows: [n_kv][rows_cap][d]   */
    float *scores;          /* [n_q][rows_cap]                                 */
    size_t rows_cap;
    float *tmp[3];          /* packed copies of strided q, k, v                */
    size_t tmp_cap[3];
    int decoded;
    pqc_result status;
    char err[512];
    pqc_llama_stats st;
};

static double pqcl_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void pqcl_fail(pqc_llama *g, pqc_result r, const char *fmt, ...) {
    va_list ap;
    if (g->status != PQC_SUCCESS) return; /* the first failure is the one to report */
    g->status = r;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof g->err, fmt, ap);
    va_end(ap);
}

/* A library call's failure, with the library's message. */
static int pqcl_check(pqc_llama *g, pqc_result r, const char *what, int il) {
    if (r == PQC_SUCCESS) return 0;
    pqcl_fail(g, r, "%s (layer %d): %s", what, il, pqc_last_error());
    return 1;
}

/* Tensor t ([ne0, ne1, n] F32) as n packed rows of ne0*ne1 floats: t's own data when its
   rows are packed, else a copy in g->tmp[slot]. NULL (and the glue failed) otherwise. */
static const float *pqcl_rows(pqc_llama *g, const struct ggml_tensor *t, int slot) {
    size_t row = (size_t)t->ne[0] * (size_t)t->ne[1], n = (size_t)t->ne[2], i, h, e;
    float *out;
    if (t->type != GGML_TYPE_F32 || t->ne[3] != 1) {
        pqcl_fail(g, PQC_ERROR_UNSUPPORTED, "attention input %s: type %d, ne3 %lld (F32 3-D expected)", t->name,
                  (int)t->type, (long long)t->ne[3]);
        return NULL;
    }
    if (t->nb[0] == sizeof(float) && t->nb[1] == t->ne[0] * sizeof(float) && t->nb[2] == row * sizeof(float))
        return (const float *)t->data;
    if (g->tmp_cap[slot] < row * n) {
        float *p = (float *)realloc(g->tmp[slot], row * n * sizeof(float));
        if (!p) {
            pqcl_fail(g, PQC_ERROR_OUT_OF_MEMORY, "out of memory for %zu rows of %zu floats", n, row);
            return NULL;
        }
        g->tmp[slot] = p;
        g->tmp_cap[slot] = row * n;
    }
    out = g->tmp[slot];
    for (i = 0; i < n; i++)
        for (h = 0; h < (size_t)t->ne[1]; h++)
            for (e = 0; e < (size_t)t->ne[0]; e++)
                out[(i * (size_t)t->ne[1] + h) * (size_t)t->ne[0] + e] =
                    *(const float *)((const char *)t->data + i * t->nb[2] + h * t->nb[1] + e * t->nb[0]);
    return out;
}

/* The cache, created at the first op: by then the graph has named the served layers. */
static int pqcl_ready(pqc_llama *g, const pqcl_layer *L, const struct ggml_tensor *q, const struct ggml_tensor *k,
                      const struct ggml_tensor *v) {
    pqc_cache_desc d, got;
    int i;
    if (g->status != PQC_SUCCESS) return 0;
    if (g->cache) {
        if (q->ne[1] != g->n_q || k->ne[1] != g->n_kv || k->ne[0] != g->d || v->ne[0] != g->d) {
            pqcl_fail(g, PQC_ERROR_BAD_SHAPE, "layer %d: heads %lld/%lld of %lld, unlike the first served layer's %d/%d of %d",
                      L->il, (long long)q->ne[1], (long long)k->ne[1], (long long)k->ne[0], g->n_q, g->n_kv, g->d);
            return 0;
        }
        return 1;
    }
    if (v->ne[0] != k->ne[0] || v->ne[1] != k->ne[1] || q->ne[0] != k->ne[0]) {
        pqcl_fail(g, PQC_ERROR_UNSUPPORTED, "layer %d: value heads %lldx%lld unlike key heads %lldx%lld", L->il,
                  (long long)v->ne[1], (long long)v->ne[0], (long long)k->ne[1], (long long)k->ne[0]);
        return 0;
    }
    for (i = 0; i < g->n_layer; i++)
        if (g->layers[i].pl >= 0 && g->layers[i].scale != L->scale) {
            pqcl_fail(g, PQC_ERROR_UNSUPPORTED, "layers %d and %d attend with different scales (%g, %g)", L->il, i,
                      (double)L->scale, (double)g->layers[i].scale);
            return 0;
        }
    g->n_q = (int)q->ne[1];
    g->n_kv = (int)k->ne[1];
    g->d = (int)k->ne[0];
    d = g->p.desc;
    d.n_layers = g->n_served;
    d.n_kv_heads = g->n_kv;
    d.n_q_heads = g->n_q;
    d.head_dim = g->d;
    if (!d.max_tokens) d.max_tokens = g->max_tokens;
    if (d.pq.rope == PQC_ROPE_NONE) d.pq.rope = g->rope;
    if (d.softmax_scale == 0.0f) d.softmax_scale = L->scale;
    if (pqcl_check(g, pqc_cache_create(g->rt, &d, &g->cache), "pqc_cache_create", L->il)) return 0;
    if (pqcl_check(g, pqc_cache_config(g->cache, &got), "pqc_cache_config", L->il)) return 0;
    g->observe = got.observe > 0 ? got.observe : 0;
    if (pqcl_check(g, pqc_selection_init(g->cache, &g->sel), "pqc_selection_init", L->il)) return 0;
    g->sel_ready = 1;
    g->st.layers = g->n_served;
    g->st.kv_heads = g->n_kv;
    return 1;
}

/* Graph building: the layers pqcache serves (every full-attention layer, as the first
   graph names them). */
static void *pqcl_layer_cb(void *user, int32_t il, int32_t n_tokens, bool swa, float kq_scale) {
    pqc_llama *g = (pqc_llama *)user;
    pqcl_layer *L;
    (void)n_tokens;
    if (swa || il < 0 || il >= g->n_layer) return NULL;
    L = &g->layers[il];
    if (L->pl < 0) {
        if (g->cache) return NULL; /* the cache's layers are fixed */
        L->pl = g->n_served++;
        L->scale = kq_scale;
    }
    return L;
}

/* A prompt ubatch: its K and V into the cache; the layer's first also observes its last
   queries, and the cache starts the layer's build on its worker. */
static void pqcl_store(struct ggml_tensor *dst, int ith, int nth, void *user) {
    pqcl_layer *L = (pqcl_layer *)user;
    pqc_llama *g = L->g;
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const float *kr, *vr, *qr;
    size_t n = (size_t)k->ne[2], row;
    pqc_matrix km, vm;
    (void)nth;
    if (ith != 0 || !pqcl_ready(g, L, q, k, v)) return;
    if (g->decoded) {
        pqcl_fail(g, PQC_ERROR_BAD_STATE,
                  "a prompt after decode steps: llama.cpp's cache lacks the decoded tokens of the layers pqcache serves");
        return;
    }
    row = (size_t)g->n_kv * (size_t)g->d;
    kr = pqcl_rows(g, k, 1);
    vr = pqcl_rows(g, v, 2);
    if (!kr || !vr) return;
    if (g->observe && pqc_cache_tokens(g->cache, L->pl) == 0) {
        size_t m = n < (size_t)g->observe ? n : (size_t)g->observe;
        qr = pqcl_rows(g, q, 0);
        if (!qr) return;
        if (pqcl_check(g, pqc_cache_observe(g->cache, L->pl, qr + (n - m) * (size_t)g->n_q * (size_t)g->d, m),
                       "pqc_cache_observe", L->il))
            return;
    }
    km = pqc_matrix_f32(kr, n, row);
    vm = pqc_matrix_f32(vr, n, row);
    if (pqcl_check(g, pqc_cache_prefill(g->cache, L->pl, &km, &vm), "pqc_cache_prefill", L->il)) return;
    g->st.tokens = pqc_cache_tokens(g->cache, L->pl);
}

/* A decode step, one thread: append the token, select, gather the selected rows. */
static void pqcl_select(struct ggml_tensor *dst, int ith, int nth, void *user) {
    pqcl_layer *L = (pqcl_layer *)user;
    pqc_llama *g = L->g;
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const float *qr, *kr, *vr;
    size_t most = 0, h;
    pqc_kv_out out;
    double t0, t1, t2;
    (void)nth;
    if (ith != 0 || !pqcl_ready(g, L, q, k, v)) return;
    if (k->ne[2] != 1) {
        pqcl_fail(g, PQC_ERROR_BAD_SHAPE, "layer %d: a decode step of %lld tokens", L->il, (long long)k->ne[2]);
        return;
    }
    t0 = pqcl_now();
    qr = pqcl_rows(g, q, 0);
    kr = pqcl_rows(g, k, 1);
    vr = pqcl_rows(g, v, 2);
    if (!qr || !kr || !vr) return;
    if (pqc_cache_tokens(g->cache, L->pl) == 0) { /* a one-token prompt */
        size_t row = (size_t)g->n_kv * (size_t)g->d;
        pqc_matrix km = pqc_matrix_f32(kr, 1, row), vm = pqc_matrix_f32(vr, 1, row);
        if (pqcl_check(g, pqc_cache_prefill(g->cache, L->pl, &km, &vm), "pqc_cache_prefill", L->il)) return;
    } else if (pqcl_check(g, pqc_cache_append(g->cache, L->pl, kr, vr), "pqc_cache_append", L->il))
        return;
    if (pqcl_check(g, pqc_cache_select(g->cache, L->pl, qr, &g->sel), "pqc_cache_select", L->il)) return;
    t1 = pqcl_now();
    for (h = 0; h < (size_t)g->n_kv; h++) {
        if (g->sel.count[h] > most) most = g->sel.count[h];
        g->st.tokens_selected += g->sel.count[h];
    }
    if (most > g->rows_cap) {
        size_t cap = most + most / 4 + 64, kv = (size_t)g->n_kv * cap * (size_t)g->d;
        float *kp = (float *)realloc(g->k_rows, kv * sizeof(float));
        float *vp = kp ? (float *)realloc(g->v_rows, kv * sizeof(float)) : NULL;
        float *sp = vp ? (float *)realloc(g->scores, (size_t)g->n_q * cap * sizeof(float)) : NULL;
        if (kp) g->k_rows = kp;
        if (vp) g->v_rows = vp;
        if (sp) g->scores = sp;
        if (!sp) {
            pqcl_fail(g, PQC_ERROR_OUT_OF_MEMORY, "out of memory for %zu selected rows per head", cap);
            return;
        }
        g->rows_cap = cap;
    }
    out.k = g->k_rows;
    out.v = g->v_rows;
    out.head_stride = g->rows_cap;
    if (pqcl_check(g, pqc_cache_fetch(g->cache, L->pl, &g->sel, &out), "pqc_cache_fetch", L->il)) return;
    t2 = pqcl_now();
    g->st.select_s += t1 - t0;
    g->st.fetch_s += t2 - t1;
    g->st.tokens = pqc_cache_tokens(g->cache, L->pl);
    if (L->pl == g->n_served - 1) g->st.steps++;
    g->decoded = 1;
}

/* q . k in eight partial sums (which the compiler keeps in vector registers) */
static float pqcl_dot(const float *q, const float *k, int d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int e = 0, l;
    for (; e + 8 <= d; e += 8)
        for (l = 0; l < 8; l++) acc[l] += q[e + l] * k[e + l];
    for (; e < d; e++) acc[0] += q[e] * k[e];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* A decode step, every thread: softmax attention of the thread's query heads over their
   KV head's gathered rows. After a failure: zeros. */
static void pqcl_attend(struct ggml_tensor *dst, int ith, int nth, void *user) {
    pqcl_layer *L = (pqcl_layer *)user;
    pqc_llama *g = L->g;
    const struct ggml_tensor *q = dst->src[0];
    int n_q = (int)dst->ne[1], d = (int)dst->ne[0];
    int h0 = ith * n_q / nth, h1 = (ith + 1) * n_q / nth, h, e;
    float *out = (float *)dst->data;
    double t0 = ith == 0 ? pqcl_now() : 0.0;
    if (g->status != PQC_SUCCESS || !g->cache) {
        memset(out + (size_t)h0 * (size_t)d, 0, (size_t)(h1 - h0) * (size_t)d * sizeof(float));
        return;
    }
    for (h = h0; h < h1; h++) {
        int kvh = h / (g->n_q / g->n_kv);
        size_t n = g->sel.count[kvh], i;
        const float *qh = (const float *)((const char *)q->data + (size_t)h * q->nb[1]);
        const float *K = g->k_rows + (size_t)kvh * g->rows_cap * (size_t)d;
        const float *V = g->v_rows + (size_t)kvh * g->rows_cap * (size_t)d;
        float *s = g->scores + (size_t)h * g->rows_cap, *o = out + (size_t)h * (size_t)d;
        float most = -INFINITY, sum = 0.0f;
        for (i = 0; i < n; i++) {
            s[i] = pqcl_dot(qh, K + i * (size_t)d, d) * L->scale;
            if (s[i] > most) most = s[i];
        }
        for (e = 0; e < d; e++) o[e] = 0.0f;
        for (i = 0; i < n; i++) {
            float p = expf(s[i] - most);
            sum += p;
            for (e = 0; e < d; e++) o[e] += p * V[i * (size_t)d + (size_t)e];
        }
        for (e = 0; e < d; e++) o[e] = n ? o[e] / sum : 0.0f;
    }
    if (ith == 0) g->st.attend_s += pqcl_now() - t0;
}

pqc_result pqc_llama_create(const struct llama_model *model, const pqc_llama_params *p, pqc_llama **out) {
    pqc_llama *g;
    pqc_runtime_desc rd;
    int i;
    pqc_result r;
    if (!model || !out) return PQC_ERROR_INVALID_ARGUMENT;
    g = (pqc_llama *)calloc(1, sizeof *g);
    if (!g) return PQC_ERROR_OUT_OF_MEMORY;
    if (p) g->p = *p;
    if (!g->p.desc.kv_dtype && !g->p.kv_f32) g->p.desc.kv_dtype = PQC_F16;
    /* the selected rows are read in host memory, where the store is: a block cache would
       only copy them twice */
    if (!g->p.desc.cache_blocks) g->p.desc.cache_blocks = -1;
    g->n_layer = llama_model_n_layer(model);
    g->max_tokens = g->p.max_tokens ? g->p.max_tokens : (size_t)llama_model_n_ctx_train(model);
    switch (llama_model_rope_type(model)) {
    case LLAMA_ROPE_TYPE_NORM: g->rope = PQC_ROPE_INTERLEAVED; break;
    case LLAMA_ROPE_TYPE_NEOX: g->rope = PQC_ROPE_HALF; break;
    default: g->rope = PQC_ROPE_NONE; break; /* no rotation, or one the library has no layout for */
    }
    g->layers = (pqcl_layer *)calloc((size_t)(g->n_layer > 0 ? g->n_layer : 1), sizeof *g->layers);
    if (!g->layers) {
        free(g);
        return PQC_ERROR_OUT_OF_MEMORY;
    }
    for (i = 0; i < g->n_layer; i++) {
        g->layers[i].g = g;
        g->layers[i].il = i;
        g->layers[i].pl = -1;
    }
    memset(&rd, 0, sizeof rd);
    rd.n_threads = g->p.threads > 0 ? g->p.threads : 1;
    r = pqc_runtime_create(&rd, &g->rt);
    if (r != PQC_SUCCESS) {
        free(g->layers);
        free(g);
        return r;
    }
    *out = g;
    return PQC_SUCCESS;
}

void pqc_llama_attach(pqc_llama *g, struct llama_context *ctx) {
    struct llama_attn_hook h;
    h.layer = pqcl_layer_cb;
    h.store = pqcl_store;
    h.select = pqcl_select;
    h.attend = pqcl_attend;
    h.user = g;
    llama_set_attn_hook(ctx, &h);
}

pqc_result pqc_llama_status(const pqc_llama *g) { return g->status; }

const char *pqc_llama_error(const pqc_llama *g) { return g->status == PQC_SUCCESS ? "" : g->err; }

void pqc_llama_stats_get(const pqc_llama *g, pqc_llama_stats *out) {
    size_t own = 0, shared = 0;
    *out = g->st;
    if (g->cache) {
        int l;
        pqc_cache_host_memory(g->cache, &own, &shared);
        for (l = 0; l < g->n_served; l++) {
            pqc_layer_stats ls;
            if (pqc_cache_stats(g->cache, l, &ls) == PQC_SUCCESS) out->build_wait_s += ls.wait_s;
        }
    }
    out->host_bytes = own + shared;
}

pqc_cache *pqc_llama_cache(pqc_llama *g) { return g->cache; }

void pqc_llama_destroy(pqc_llama *g) {
    int i;
    if (!g) return;
    if (g->sel_ready) pqc_selection_free(&g->sel);
    pqc_cache_destroy(g->cache);
    pqc_runtime_destroy(g->rt);
    for (i = 0; i < 3; i++) free(g->tmp[i]);
    free(g->k_rows);
    free(g->v_rows);
    free(g->scores);
    free(g->layers);
    free(g);
}
