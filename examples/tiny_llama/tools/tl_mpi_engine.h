/* tl_mpi_engine.h - the tensor-parallel engine of tl_mpi.c: the rank's state,
   errors that stop every rank, the kernels (tiny_llama.h's arithmetic, the
   partial sums in double), threads, widening a model and slicing it into the
   rank's heads and FFN units, the per-rank forward pieces, the layer-major
   prefill, decode attention over a selection, pqcache's driver callbacks and
   the host-cache modes (full, window, oracle). Included by tl_mpi.c, after
   pqcache.h, tiny_llama.h and mpi.h. */
#ifndef TL_MPI_ENGINE_H
#define TL_MPI_ENGINE_H

#define TP_MAX_THREADS 64
#define TP_BLOCK 32          /* prefill: tokens per causal-attention block */
#define TP_CHUNK 512         /* prefill: tokens per all-reduce */

typedef enum { TP_FULL = 0, TP_WINDOW, TP_ORACLE, TP_PQCACHE } tp_mode;

typedef struct {
    const char *model, *prompt_file, *save, *check;
    int widen, random_len, steps, threads, quiet;
    unsigned long long seed;
    tp_mode mode;
    int n_sink, pq_m, pq_bits, iters, cache_blocks, split, metric;
    float ratio;
    double tol;
    int same_sel, sel_only, sel_ref_head, vs_engine;
} tp_opts;

typedef struct {
    int rank, size;
    tp_opts o;
    tl_model model;             /* the checkpoint as mapped */
    tl_config c;                /* the model in use (widened when --widen > 1) */
    tl_weights w;               /* its weights (full; only the replicated ones are read) */
    float *wide;                /* storage of the widened weights */
    tl_config lc;               /* the rank's attention as a config: its heads only */
    int kv0, nkv, q0, nq, f0, nf, hs, qd; /* slices; qd = nq * hs */
    float *wq, *wk, *wv, *wo, *w1, *w2, *w3;
    int ctx, nthreads;
    /* host KV cache of the rank's heads (full, window, oracle): [layer][head][ctx][hs] */
    float *kc, *vc;
    /* decode scratch */
    float *x, *xb, *q, *k, *v, *ob, *att, *logits, *mass, *tmp, *rcos, *rsin;
    double *part;
    int rope_pos;
    /* prefill */
    float *hidden;              /* (n, dim) */
    int prefill_n;
    float *patt[TP_MAX_THREADS], *pout[TP_MAX_THREADS], *pxb[TP_MAX_THREADS], *phb[TP_MAX_THREADS],
          *phb2[TP_MAX_THREADS];
    double *ppart;              /* (TP_CHUNK, dim) */
    /* the current decode step's selection: [layer][local head] counts and positions */
    int *sel_n;
    uint32_t *sel_pos;
    /* pqcache */
    pqc_runtime *rt;
    pqc_scheduler *sched;
    pqc_cache *cache;
    pqc_engine eng;
    char err[256];
} tp;

/* ----------------------------------------------------------------------------
   Errors: a message and a clean stop of every rank */

static void tp_die(const tp *t, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "tiny_llama_mpi: rank %d: error: ", t ? t->rank : 0);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

/* An error every rank finds alike (bad options, a bad file): rank 0 says it,
   every rank stops. */
static void tp_fail_all(const tp *t, const char *msg)
{
    if (t->rank == 0)
        fprintf(stderr, "tiny_llama_mpi: error: %s\n", msg);
    MPI_Finalize();
    exit(1);
}

static void *tp_alloc(const tp *t, size_t n, size_t size)
{
    void *p;
    if (n == 0)
        n = 1;
    if (size != 0 && n > (size_t)-1 / size)
        tp_die(t, "allocation of %zu x %zu bytes overflows", n, size);
    p = calloc(n, size);
    if (!p)
        tp_die(t, "out of memory (%zu bytes)", n * size);
    return p;
}

/* ----------------------------------------------------------------------------
   Kernels: tiny_llama.h's dot product (tl__dot_scalar, eight partial sums),
   and the partial sums of the split matrices in double */

/* the partial products of a row-parallel matrix, in double */
static double tp_dot_d(const float *a, const float *b, int n)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)a[i] * (double)b[i];
        s1 += (double)a[i + 1] * (double)b[i + 1];
        s2 += (double)a[i + 2] * (double)b[i + 2];
        s3 += (double)a[i + 3] * (double)b[i + 3];
    }
    s0 = (s0 + s2) + (s1 + s3);
    for (; i < n; i++)
        s0 += (double)a[i] * (double)b[i];
    return s0;
}

static void tp_matmul(float *out, const float *x, const float *w, int n, int d)
{
    int i;
    for (i = 0; i < d; i++)
        out[i] = tl__dot_scalar(w + (size_t)i * (size_t)n, x, n);
}

static void tp_matmul_d(double *out, const float *x, const float *w, int n, int d)
{
    int i;
    for (i = 0; i < d; i++)
        out[i] = tp_dot_d(w + (size_t)i * (size_t)n, x, n);
}

static void tp_rmsnorm(float *out, const float *x, const float *weight, int n)
{
    float ss = tl__dot_scalar(x, x, n) / (float)n + TL_RMS_EPS;
    float inv = 1.0f / sqrtf(ss);
    int i;
    for (i = 0; i < n; i++)
        out[i] = weight[i] * (inv * x[i]);
}

static void tp_axpy(float *out, float a, const float *x, int n)
{
    int i;
    for (i = 0; i < n; i++)
        out[i] += a * x[i];
}

static void tp_rope_angles(const tl_config *c, int pos, float *cs, float *sn)
{
    int i;
    for (i = 0; i < c->head_size / 2; i++) {
        double freq = pow((double)c->rope_theta, -2.0 * i / (double)c->head_size);
        double angle = (double)pos * freq;
        cs[i] = (float)cos(angle);
        sn[i] = (float)sin(angle);
    }
}

static void tp_rope(float *x, int n_heads, int hs, const float *cs, const float *sn)
{
    int h, i;
    for (h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * (size_t)hs;
        for (i = 0; i < hs / 2; i++) {
            float v0 = v[2 * i], v1 = v[2 * i + 1];
            v[2 * i] = v0 * cs[i] - v1 * sn[i];
            v[2 * i + 1] = v0 * sn[i] + v1 * cs[i];
        }
    }
}

/* ----------------------------------------------------------------------------
   Threads: fn(arg, worker, n_workers) on n_workers threads, worker 0 here */

typedef void (*tp_job_fn)(void *arg, int worker, int n_workers);
typedef struct { tp_job_fn fn; void *arg; int worker, n; } tp_job;

static void *tp_job_main(void *p)
{
    tp_job *j = (tp_job *)p;
    j->fn(j->arg, j->worker, j->n);
    return NULL;
}

static void tp_parallel(int n, tp_job_fn fn, void *arg)
{
    tp_job jobs[TP_MAX_THREADS];
    pthread_t th[TP_MAX_THREADS];
    int started[TP_MAX_THREADS], i;
    if (n < 1)
        n = 1;
    for (i = 0; i < n; i++) {
        jobs[i].fn = fn;
        jobs[i].arg = arg;
        jobs[i].worker = i;
        jobs[i].n = n;
        started[i] = 0;
    }
    for (i = 1; i < n; i++)
        started[i] = pthread_create(&th[i], NULL, tp_job_main, &jobs[i]) == 0;
    fn(arg, 0, n);
    for (i = 1; i < n; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            fn(arg, i, n);
    }
}

/* ----------------------------------------------------------------------------
   The model: widening and the rank's slices */

/* K copies of the residual stream (dim K*d), of the heads (K*H query heads,
   K*G KV heads, head_size unchanged) and of the FFN units (K*F): copy c's
   heads and units read residual copy c (block-diagonal wq, wk, wv, w1, w3),
   wo and w2 write the mean over copies to every copy, the classifier reads
   the mean of the copies. Every copy of the residual stays equal to the
   original model's, so the widened model computes the same function. */
static void tp_widen(tp *t, int K)
{
    const tl_config *oc = &t->model.config;
    const tl_weights *ow = &t->model.w;
    tl_config c = *oc;
    size_t d = (size_t)oc->dim, D, F = (size_t)oc->hidden_dim, FF, kvd = (size_t)oc->kv_dim, KVD,
           L = (size_t)oc->n_layers, V = (size_t)oc->vocab_size, l, i, j, a, b, total;
    float inv = 1.0f / (float)K, *p;
    float *emb, *ra, *rf, *rfin, *wq, *wk, *wv, *wo, *w1, *w2, *w3, *wc;

    c.dim = oc->dim * K;
    c.hidden_dim = oc->hidden_dim * K;
    c.n_heads = oc->n_heads * K;
    c.n_kv_heads = oc->n_kv_heads * K;
    c.kv_dim = oc->kv_dim * K;
    c.shared_classifier = 0;
    D = (size_t)c.dim;
    FF = (size_t)c.hidden_dim;
    KVD = (size_t)c.kv_dim;
    total = V * D * 2 + L * D * 2 + D + L * (D * D * 2 + KVD * D * 2 + FF * D * 3);
    t->wide = p = (float *)tp_alloc(t, total, sizeof(float));
    emb = p; p += V * D;
    wc = p; p += V * D;
    ra = p; p += L * D;
    rf = p; p += L * D;
    rfin = p; p += D;
    wq = p; p += L * D * D;
    wk = p; p += L * KVD * D;
    wv = p; p += L * KVD * D;
    wo = p; p += L * D * D;
    w1 = p; p += L * FF * D;
    w2 = p; p += L * D * FF;
    w3 = p;
    for (i = 0; i < V; i++)
        for (a = 0; a < (size_t)K; a++)
            for (j = 0; j < d; j++) {
                emb[i * D + a * d + j] = ow->token_embedding[i * d + j];
                wc[i * D + a * d + j] = ow->wcls[i * d + j] * inv;
            }
    for (a = 0; a < (size_t)K; a++) {
        for (j = 0; j < d; j++)
            rfin[a * d + j] = ow->rms_final[j];
        for (l = 0; l < L; l++)
            for (j = 0; j < d; j++) {
                ra[l * D + a * d + j] = ow->rms_att[l * d + j];
                rf[l * D + a * d + j] = ow->rms_ffn[l * d + j];
            }
    }
    for (l = 0; l < L; l++)
        for (a = 0; a < (size_t)K; a++) {
            for (i = 0; i < d; i++)        /* wq: (D, D), wo: (D, D) */
                for (j = 0; j < d; j++) {
                    wq[l * D * D + (a * d + i) * D + a * d + j] = ow->wq[l * d * d + i * d + j];
                    for (b = 0; b < (size_t)K; b++)
                        wo[l * D * D + (b * d + i) * D + a * d + j] = ow->wo[l * d * d + i * d + j] * inv;
                }
            for (i = 0; i < kvd; i++)      /* wk, wv: (KVD, D) */
                for (j = 0; j < d; j++) {
                    wk[l * KVD * D + (a * kvd + i) * D + a * d + j] = ow->wk[l * kvd * d + i * d + j];
                    wv[l * KVD * D + (a * kvd + i) * D + a * d + j] = ow->wv[l * kvd * d + i * d + j];
                }
            for (i = 0; i < F; i++)        /* w1, w3: (FF, D) */
                for (j = 0; j < d; j++) {
                    w1[l * FF * D + (a * F + i) * D + a * d + j] = ow->w1[l * F * d + i * d + j];
                    w3[l * FF * D + (a * F + i) * D + a * d + j] = ow->w3[l * F * d + i * d + j];
                }
            for (i = 0; i < d; i++)        /* w2: (D, FF) */
                for (j = 0; j < F; j++)
                    for (b = 0; b < (size_t)K; b++)
                        w2[l * D * FF + (b * d + i) * FF + a * F + j] = ow->w2[l * d * F + i * F + j] * inv;
        }
    t->c = c;
    t->w.token_embedding = emb;
    t->w.wcls = wc;
    t->w.rms_att = ra;
    t->w.rms_ffn = rf;
    t->w.rms_final = rfin;
    t->w.wq = wq;
    t->w.wk = wk;
    t->w.wv = wv;
    t->w.wo = wo;
    t->w.w1 = w1;
    t->w.w2 = w2;
    t->w.w3 = w3;
}

/* rows [r0, r0 + nr) of every layer's (rows, cols) matrix */
static float *tp_rows(const tp *t, const float *w, int L, int rows, int cols, int r0, int nr)
{
    float *out = (float *)tp_alloc(t, (size_t)L * (size_t)nr * (size_t)cols, sizeof(float));
    int l;
    for (l = 0; l < L; l++)
        memcpy(out + (size_t)l * (size_t)nr * (size_t)cols,
               w + ((size_t)l * (size_t)rows + (size_t)r0) * (size_t)cols,
               (size_t)nr * (size_t)cols * sizeof(float));
    return out;
}

/* columns [c0, c0 + nc) of every layer's (rows, cols) matrix */
static float *tp_cols(const tp *t, const float *w, int L, int rows, int cols, int c0, int nc)
{
    float *out = (float *)tp_alloc(t, (size_t)L * (size_t)rows * (size_t)nc, sizeof(float));
    int l, i;
    for (l = 0; l < L; l++)
        for (i = 0; i < rows; i++)
            memcpy(out + ((size_t)l * (size_t)rows + (size_t)i) * (size_t)nc,
                   w + ((size_t)l * (size_t)rows + (size_t)i) * (size_t)cols + (size_t)c0,
                   (size_t)nc * sizeof(float));
    return out;
}

/* contiguous share r of n items over p ranks: [lo, hi) */
static void tp_share(int n, int p, int r, int *lo, int *cnt)
{
    int a = (int)((long long)n * r / p), b = (int)((long long)n * (r + 1) / p);
    *lo = a;
    *cnt = b - a;
}

static void tp_slice(tp *t)
{
    const tl_config *c = &t->c;
    int group = c->n_heads / c->n_kv_heads, L = c->n_layers;
    char msg[256];
    if (t->size > c->n_kv_heads) {
        snprintf(msg, sizeof msg, "%d ranks but the model has %d KV heads: every rank needs at "
                 "least one (whole GQA groups per rank; --widen K multiplies the heads by K)",
                 t->size, c->n_kv_heads);
        tp_fail_all(t, msg);
    }
    if (t->size > c->hidden_dim) {
        snprintf(msg, sizeof msg, "%d ranks but the FFN has %d hidden units", t->size, c->hidden_dim);
        tp_fail_all(t, msg);
    }
    t->hs = c->head_size;
    tp_share(c->n_kv_heads, t->size, t->rank, &t->kv0, &t->nkv);
    t->q0 = t->kv0 * group;
    t->nq = t->nkv * group;
    t->qd = t->nq * t->hs;
    tp_share(c->hidden_dim, t->size, t->rank, &t->f0, &t->nf);
    t->wq = tp_rows(t, t->w.wq, L, c->n_heads * t->hs, c->dim, t->q0 * t->hs, t->qd);
    t->wk = tp_rows(t, t->w.wk, L, c->kv_dim, c->dim, t->kv0 * t->hs, t->nkv * t->hs);
    t->wv = tp_rows(t, t->w.wv, L, c->kv_dim, c->dim, t->kv0 * t->hs, t->nkv * t->hs);
    t->wo = tp_cols(t, t->w.wo, L, c->dim, c->n_heads * t->hs, t->q0 * t->hs, t->qd);
    t->w1 = tp_rows(t, t->w.w1, L, c->hidden_dim, c->dim, t->f0, t->nf);
    t->w3 = tp_rows(t, t->w.w3, L, c->hidden_dim, c->dim, t->f0, t->nf);
    t->w2 = tp_cols(t, t->w.w2, L, c->dim, c->hidden_dim, t->f0, t->nf);
    /* the rank's attention seen as a model of its own heads (tl_attend_causal reads
       head_size, n_heads and n_kv_heads) */
    t->lc = *c;
    t->lc.n_heads = t->nq;
    t->lc.n_kv_heads = t->nkv;
    t->lc.kv_dim = t->nkv * t->hs;
    t->lc.dim = t->qd;
}

/* ----------------------------------------------------------------------------
   Per-rank forward pieces */

/* q (qd), k, v (nkv * hs) of the rank's heads for residual x at pos */
static void tp_qkv(const tp *t, int layer, const float *x, float *xb, const float *cs, const float *sn,
                   float *q, float *k, float *v)
{
    const tl_config *c = &t->c;
    size_t l = (size_t)layer, dim = (size_t)c->dim, kvl = (size_t)t->nkv * (size_t)t->hs;
    tp_rmsnorm(xb, x, t->w.rms_att + l * dim, c->dim);
    tp_matmul(q, xb, t->wq + l * (size_t)t->qd * dim, c->dim, t->qd);
    tp_matmul(k, xb, t->wk + l * kvl * dim, c->dim, (int)kvl);
    tp_matmul(v, xb, t->wv + l * kvl * dim, c->dim, (int)kvl);
    tp_rope(q, t->nq, t->hs, cs, sn);
    tp_rope(k, t->nkv, t->hs, cs, sn);
}

/* partial residual update of the attention output projection: part = wo_r ob */
static void tp_attn_part(const tp *t, int layer, const float *ob, double *part)
{
    size_t l = (size_t)layer, dim = (size_t)t->c.dim;
    tp_matmul_d(part, ob, t->wo + l * dim * (size_t)t->qd, t->qd, t->c.dim);
}

/* partial residual update of the FFN for residual x */
static void tp_ffn_part(const tp *t, int layer, const float *x, float *xb, float *hb, float *hb2,
                        double *part)
{
    const tl_config *c = &t->c;
    size_t l = (size_t)layer, dim = (size_t)c->dim, nf = (size_t)t->nf;
    int i;
    tp_rmsnorm(xb, x, t->w.rms_ffn + l * dim, c->dim);
    tp_matmul(hb, xb, t->w1 + l * nf * dim, c->dim, t->nf);
    tp_matmul(hb2, xb, t->w3 + l * nf * dim, c->dim, t->nf);
    for (i = 0; i < t->nf; i++) {
        float a = hb[i];
        hb[i] = a / (1.0f + expf(-a)) * hb2[i];
    }
    tp_matmul_d(part, hb, t->w2 + l * dim * nf, t->nf, c->dim);
}

/* x (n tokens of dim) += the all-reduced partial sums */
static void tp_allreduce_add(const tp *t, double *part, float *x, size_t n)
{
    size_t i;
    if (t->size > 1 && MPI_Allreduce(MPI_IN_PLACE, part, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD)
        != MPI_SUCCESS)
        tp_die(t, "MPI_Allreduce failed");
    for (i = 0; i < n; i++)
        x[i] += (float)part[i];
}

/* ----------------------------------------------------------------------------
   Prefill, layer-major, threads over tokens (both the pqcache driver's callbacks
   and the host-cache modes run these) */

typedef struct {
    tp *t;
    int layer, pos0, n;
    float *q, *k, *v;              /* qkv outputs: (n, qd), (n, nkv*hs) x 2 */
    const float *cq;               /* attend: queries (n, qd) */
    const float *const *kr, *const *vr; /* attend: per local head, rows 0.. at stride hs */
    int first;                     /* attend: first token to run (last layer: n - 1) */
    int c0, c1;                    /* attend: the chunk of tokens [c0, c1) */
} tp_pjob;

static void tp_qkv_worker(void *arg, int wk, int nw)
{
    tp_pjob *j = (tp_pjob *)arg;
    tp *t = j->t;
    size_t kvl = (size_t)t->nkv * (size_t)t->hs, dim = (size_t)t->c.dim;
    float cs[512], sn[512];
    int i;
    for (i = wk; i < j->n; i += nw) {
        tp_rope_angles(&t->c, j->pos0 + i, cs, sn);
        tp_qkv(t, j->layer, t->hidden + (size_t)i * dim, t->pxb[wk], cs, sn,
               j->q + (size_t)i * (size_t)t->qd, j->k + (size_t)i * kvl, j->v + (size_t)i * kvl);
    }
}

/* causal attention of tokens [c0, c1) (blocks of TP_BLOCK), then wo: partial sums */
static void tp_attend_worker(void *arg, int wk, int nw)
{
    tp_pjob *j = (tp_pjob *)arg;
    tp *t = j->t;
    size_t dim = (size_t)t->c.dim;
    int b0, i;
    for (b0 = j->c0 + wk * TP_BLOCK; b0 < j->c1; b0 += nw * TP_BLOCK) {
        int nb = j->c1 - b0 < TP_BLOCK ? j->c1 - b0 : TP_BLOCK;
        tl_attend_causal(&t->lc, j->pos0 + b0, nb, j->cq + (size_t)b0 * (size_t)t->qd, j->kr, j->vr,
                         (size_t)t->hs, 0, t->patt[wk], t->pout[wk]);
        for (i = 0; i < nb; i++)
            tp_attn_part(t, j->layer, t->pout[wk] + (size_t)i * (size_t)t->qd,
                         t->ppart + (size_t)(b0 - j->c0 + i) * dim);
    }
}

static void tp_ffn_worker(void *arg, int wk, int nw)
{
    tp_pjob *j = (tp_pjob *)arg;
    tp *t = j->t;
    size_t dim = (size_t)t->c.dim;
    int i;
    for (i = j->c0 + wk; i < j->c1; i += nw)
        tp_ffn_part(t, j->layer, t->hidden + (size_t)i * dim, t->pxb[wk], t->phb[wk], t->phb2[wk],
                    t->ppart + (size_t)(i - j->c0) * dim);
}

/* qkv of the n prompt tokens at this layer */
static void tp_prefill_qkv(tp *t, int layer, int pos0, int n, float *q, float *k, float *v)
{
    tp_pjob j;
    memset(&j, 0, sizeof j);
    j.t = t;
    j.layer = layer;
    j.pos0 = pos0;
    j.n = n;
    j.q = q;
    j.k = k;
    j.v = v;
    tp_parallel(t->nthreads, tp_qkv_worker, &j);
}

/* attention over rows kr/vr (0 .. pos0+n-1 per local head), wo, all-reduce, FFN,
   all-reduce, for the prompt's tokens; the last layer only for the last token */
static void tp_prefill_attend(tp *t, int layer, int pos0, int n, const float *q,
                              const float *const *kr, const float *const *vr)
{
    tp_pjob j;
    size_t dim = (size_t)t->c.dim;
    int first = layer == t->c.n_layers - 1 ? n - 1 : 0, c0;
    memset(&j, 0, sizeof j);
    j.t = t;
    j.layer = layer;
    j.pos0 = pos0;
    j.n = n;
    j.cq = q;
    j.kr = kr;
    j.vr = vr;
    for (c0 = first; c0 < n; c0 += TP_CHUNK) {
        int c1 = c0 + TP_CHUNK < n ? c0 + TP_CHUNK : n;
        size_t m = (size_t)(c1 - c0) * dim;
        j.c0 = c0;
        j.c1 = c1;
        tp_parallel(t->nthreads, tp_attend_worker, &j);
        tp_allreduce_add(t, t->ppart, t->hidden + (size_t)c0 * dim, m);
        tp_parallel(t->nthreads, tp_ffn_worker, &j);
        tp_allreduce_add(t, t->ppart, t->hidden + (size_t)c0 * dim, m);
    }
}

/* ----------------------------------------------------------------------------
   Decode attention over a selection (rows by pointer) */

typedef struct {
    tp *t;
    int layer;
    const float *const *const *krow, *const *const *vrow; /* [local head][i] */
    const int *cnt;
} tp_djob;

static void tp_attend_head(tp *t, int g, int n, const float *const *krow, const float *const *vrow)
{
    int hs = t->hs, group = t->nq / t->nkv, i, j;
    float scale = 1.0f / sqrtf((float)hs);
    for (j = 0; j < group; j++) {
        int h = g * group + j;
        float *att = t->att + (size_t)h * (size_t)t->ctx, *o = t->ob + (size_t)h * (size_t)hs;
        const float *q = t->q + (size_t)h * (size_t)hs;
        for (i = 0; i < n; i++)
            att[i] = tl__dot_scalar(q, krow[i], hs) * scale;
        if (n > 0)
            tl_softmax(att, n);
        memset(o, 0, (size_t)hs * sizeof(float));
        for (i = 0; i < n; i++)
            tp_axpy(o, att[i], vrow[i], hs);
    }
}

static void tp_decode_worker(void *arg, int wk, int nw)
{
    tp_djob *j = (tp_djob *)arg;
    int g;
    for (g = wk; g < j->t->nkv; g += nw)
        tp_attend_head(j->t, g, j->cnt[g], j->krow[g], j->vrow[g]);
}

static void tp_decode_attend(tp *t, int layer, const int *cnt, const float *const *const *krow,
                             const float *const *const *vrow)
{
    tp_djob j;
    long work = 0;
    int g, nt = t->nthreads < t->nkv ? t->nthreads : t->nkv;
    for (g = 0; g < t->nkv; g++)
        work += cnt[g];
    if (work < 4096)
        nt = 1;
    j.t = t;
    j.layer = layer;
    j.krow = krow;
    j.vrow = vrow;
    j.cnt = cnt;
    tp_parallel(nt, tp_decode_worker, &j);
    tp_attn_part(t, layer, t->ob, t->part);
    tp_allreduce_add(t, t->part, t->x, (size_t)t->c.dim);
    tp_ffn_part(t, layer, t->x, t->xb, t->phb[0], t->phb2[0], t->part);
    tp_allreduce_add(t, t->part, t->x, (size_t)t->c.dim);
}

static float *tp_classify(tp *t)
{
    tp_rmsnorm(t->xb, t->x, t->w.rms_final, t->c.dim);
    tp_matmul(t->logits, t->xb, t->w.wcls, t->c.dim, t->c.vocab_size);
    return t->logits;
}

/* ----------------------------------------------------------------------------
   pqcache: the driver's callbacks over the rank's heads */

static int tp_cb_qkv(void *user, int layer, size_t pos0, size_t n, float *q, float *k, float *v)
{
    tp *t = (tp *)user;
    if (t->prefill_n > 0) {
        if (n != (size_t)t->prefill_n) {
            snprintf(t->err, sizeof t->err, "qkv: %zu tokens, expected %d", n, t->prefill_n);
            return -1;
        }
        tp_prefill_qkv(t, layer, (int)pos0, (int)n, q, k, v);
        return 0;
    }
    if (n != 1) {
        snprintf(t->err, sizeof t->err, "qkv: %zu tokens in a decode step", n);
        return -1;
    }
    if (t->rope_pos != (int)pos0) {
        tp_rope_angles(&t->c, (int)pos0, t->rcos, t->rsin);
        t->rope_pos = (int)pos0;
    }
    tp_qkv(t, layer, t->x, t->xb, t->rcos, t->rsin, q, k, v);
    return 0;
}

static int tp_cb_attend(void *user, int layer, size_t pos0, size_t n, const float *q,
                        const pqc_kv_view *kv)
{
    tp *t = (tp *)user;
    const float *kr[TP_MAX_THREADS * 4], *vr[TP_MAX_THREADS * 4];
    const float *const *krow[TP_MAX_THREADS * 4], *const *vrow[TP_MAX_THREADS * 4];
    const float **own_k = NULL, **own_v = NULL;
    int cnt[TP_MAX_THREADS * 4], g;
    size_t i;
    if (kv->dtype != PQC_F32 || kv->n_kv_heads != t->nkv || kv->head_dim != t->hs) {
        snprintf(t->err, sizeof t->err, "attend: a K/V view of %d heads x %d, expected %d x %d fp32",
                 kv->n_kv_heads, kv->head_dim, t->nkv, t->hs);
        return -1;
    }
    if (t->prefill_n > 0) {
        if (kv->pos != NULL || n != (size_t)t->prefill_n) {
            snprintf(t->err, sizeof t->err, "attend: unexpected prefill view");
            return -1;
        }
        for (g = 0; g < t->nkv; g++) {
            if (kv->count[g] != pos0 + n) {
                snprintf(t->err, sizeof t->err, "attend: head %d has %zu rows", g, kv->count[g]);
                return -1;
            }
            kr[g] = (const float *)kv->k[g];
            vr[g] = (const float *)kv->v[g];
        }
        tp_prefill_attend(t, layer, (int)pos0, (int)n, q, kr, vr);
        return 0;
    }
    if (n != 1 || kv->pos == NULL) {
        snprintf(t->err, sizeof t->err, "attend: unexpected decode view");
        return -1;
    }
    memcpy(t->q, q, (size_t)t->qd * sizeof(float));
    for (g = 0; g < t->nkv; g++) {
        size_t c = kv->count[g];
        uint32_t *rec = t->sel_pos + ((size_t)layer * (size_t)t->nkv + (size_t)g) * (size_t)t->ctx;
        if (c > (size_t)t->ctx) {
            snprintf(t->err, sizeof t->err, "attend: %zu rows selected", c);
            return -1;
        }
        cnt[g] = (int)c;
        t->sel_n[layer * t->nkv + g] = (int)c;
        for (i = 0; i < c; i++)
            rec[i] = kv->pos[g][i];
        if (kv->krows) {
            krow[g] = (const float *const *)kv->krows[g];
            vrow[g] = (const float *const *)kv->vrows[g];
        }
    }
    if (!kv->krows) {   /* gathered rows: point at them one by one */
        size_t tot = 0, off = 0;
        for (g = 0; g < t->nkv; g++)
            tot += (size_t)cnt[g];
        own_k = (const float **)malloc((tot ? tot : 1) * sizeof(float *));
        own_v = (const float **)malloc((tot ? tot : 1) * sizeof(float *));
        if (!own_k || !own_v) {
            free(own_k);
            free(own_v);
            snprintf(t->err, sizeof t->err, "attend: out of memory");
            return -1;
        }
        for (g = 0; g < t->nkv; g++) {
            for (i = 0; i < (size_t)cnt[g]; i++) {
                own_k[off + i] = (const float *)kv->k[g] + i * (size_t)t->hs;
                own_v[off + i] = (const float *)kv->v[g] + i * (size_t)t->hs;
            }
            krow[g] = own_k + off;
            vrow[g] = own_v + off;
            off += (size_t)cnt[g];
        }
    }
    tp_decode_attend(t, layer, cnt, krow, vrow);
    free(own_k);
    free(own_v);
    return 0;
}

static void tp_pqcache_create(tp *t, int max_tokens)
{
    pqc_runtime_desc rd;
    pqc_scheduler_desc sd;
    pqc_cache_desc cd;
    memset(&rd, 0, sizeof rd);
    rd.n_threads = t->nthreads;
    if (pqc_runtime_create(&rd, &t->rt) != PQC_SUCCESS)
        tp_die(t, "pqcache runtime: %s", pqc_last_error());
    if (t->o.iters == 0) {
        memset(&sd, 0, sizeof sd);
        sd.parallel = (double)t->nthreads;
        if (pqc_scheduler_create(&sd, &t->sched) != PQC_SUCCESS)
            tp_die(t, "pqcache scheduler: %s", pqc_last_error());
    }
    memset(&cd, 0, sizeof cd);
    cd.n_layers = t->c.n_layers;
    cd.n_kv_heads = t->nkv;          /* this rank's KV heads only */
    cd.first_kv_head = t->kv0;       /* seeded as in one cache over every head */
    cd.n_q_heads = t->nq;
    cd.head_dim = t->hs;
    cd.kv_dtype = PQC_F32;
    cd.max_tokens = (size_t)max_tokens;
    cd.n_sink = t->o.n_sink > 0 ? t->o.n_sink : -1;
    cd.budget_ratio = (double)t->o.ratio;
    cd.pq.m = t->o.pq_m;
    cd.pq.bits = t->o.pq_bits;
    cd.pq.iters = t->o.iters;
    cd.pq.seed = t->o.seed;
    cd.pq.rope = PQC_ROPE_INTERLEAVED;
    cd.cache_blocks = t->o.cache_blocks;
    cd.metric = (pqc_metric)t->o.metric;
    cd.split = (pqc_split)t->o.split;
    cd.scheduler = t->sched;
    if (pqc_cache_create(t->rt, &cd, &t->cache) != PQC_SUCCESS)
        tp_die(t, "pqcache: %s", pqc_last_error());
    t->eng.user = t;
    t->eng.qkv = tp_cb_qkv;
    t->eng.attend = tp_cb_attend;
    t->eng.accepts_row_pointers = 1;
}

/* ----------------------------------------------------------------------------
   Host-cache modes: full, window, oracle */

static float *tp_krow(const tp *t, int layer, int g, int pos)
{
    return t->kc + (((size_t)layer * (size_t)t->nkv + (size_t)g) * (size_t)t->ctx + (size_t)pos) *
           (size_t)t->hs;
}

static float *tp_vrow(const tp *t, int layer, int g, int pos)
{
    return t->vc + (((size_t)layer * (size_t)t->nkv + (size_t)g) * (size_t)t->ctx + (size_t)pos) *
           (size_t)t->hs;
}

/* positions of local head g for a context of n (the current token included) */
static int tp_select_host(tp *t, int layer, int g, int n, uint32_t *out)
{
    tl_policy p;
    int n_sink, n_window, n_topk, cnt = 0, i, j;
    if (t->o.mode == TP_FULL) {
        for (i = 0; i < n; i++)
            out[i] = (uint32_t)i;
        return n;
    }
    tl_default_policy(&p, t->o.mode == TP_WINDOW ? TL_ATTN_WINDOW : TL_ATTN_ORACLE);
    p.n_sink = t->o.n_sink;
    p.ratio = t->o.ratio;
    tl_budget(&p, n, &n_sink, &n_window, &n_topk);
    {
        int lo = n_sink, hi = n - n_window, n_mid = hi - lo, hs = t->hs, group = t->nq / t->nkv;
        float scale = 1.0f / sqrtf((float)hs);
        for (i = 0; i < n_sink; i++)
            out[cnt++] = (uint32_t)i;
        if (n_topk >= n_mid) {
            for (i = lo; i < hi; i++)
                out[cnt++] = (uint32_t)i;
        } else if (n_topk > 0) {
            float thr;
            int ties;
            memset(t->mass, 0, (size_t)n * sizeof(float));
            for (j = 0; j < group; j++) {
                int h = g * group + j;
                float *att = t->att + (size_t)h * (size_t)t->ctx;
                const float *q = t->q + (size_t)h * (size_t)hs;
                for (i = 0; i < n; i++)
                    att[i] = tl__dot_scalar(q, tp_krow(t, layer, g, i), hs) * scale;
                tl_softmax(att, n);
                for (i = 0; i < n; i++)
                    t->mass[i] += att[i];
            }
            memcpy(t->tmp, t->mass + lo, (size_t)n_mid * sizeof(float));
            thr = tl__kth_largest(t->tmp, n_mid, n_topk);
            ties = n_topk;
            for (i = lo; i < hi; i++)
                if (t->mass[i] > thr)
                    ties--;
            for (i = lo; i < hi; i++)
                if (t->mass[i] > thr || (t->mass[i] == thr && ties-- > 0))
                    out[cnt++] = (uint32_t)i;
        }
        for (i = hi; i < n; i++)
            out[cnt++] = (uint32_t)i;
    }
    return cnt;
}

static void tp_host_prefill(tp *t, const int *tokens, int n)
{
    size_t dim = (size_t)t->c.dim, kvl = (size_t)t->nkv * (size_t)t->hs;
    float *q = (float *)tp_alloc(t, (size_t)n * (size_t)t->qd, sizeof(float));
    float *k = (float *)tp_alloc(t, (size_t)n * kvl, sizeof(float));
    float *v = (float *)tp_alloc(t, (size_t)n * kvl, sizeof(float));
    const float *kr[256], *vr[256];
    int layer, i, g;
    for (i = 0; i < n; i++)
        memcpy(t->hidden + (size_t)i * dim, t->w.token_embedding + (size_t)tokens[i] * dim,
               dim * sizeof(float));
    for (layer = 0; layer < t->c.n_layers; layer++) {
        tp_prefill_qkv(t, layer, 0, n, q, k, v);
        for (g = 0; g < t->nkv; g++) {
            for (i = 0; i < n; i++) {
                memcpy(tp_krow(t, layer, g, i), k + (size_t)i * kvl + (size_t)g * (size_t)t->hs,
                       (size_t)t->hs * sizeof(float));
                memcpy(tp_vrow(t, layer, g, i), v + (size_t)i * kvl + (size_t)g * (size_t)t->hs,
                       (size_t)t->hs * sizeof(float));
            }
            kr[g] = tp_krow(t, layer, g, 0);
            vr[g] = tp_vrow(t, layer, g, 0);
        }
        tp_prefill_attend(t, layer, 0, n, q, kr, vr);
    }
    free(q);
    free(k);
    free(v);
}

static void tp_host_decode(tp *t, int pos)
{
    const float **rows = (const float **)tp_alloc(t, (size_t)2 * (size_t)t->nkv * (size_t)(pos + 1),
                                                  sizeof(float *));
    const float *const *krow[256], *const *vrow[256];
    int cnt[256], layer, g, i;
    if (t->rope_pos != pos) {
        tp_rope_angles(&t->c, pos, t->rcos, t->rsin);
        t->rope_pos = pos;
    }
    for (layer = 0; layer < t->c.n_layers; layer++) {
        tp_qkv(t, layer, t->x, t->xb, t->rcos, t->rsin, t->q, t->k, t->v);
        for (g = 0; g < t->nkv; g++) {
            memcpy(tp_krow(t, layer, g, pos), t->k + (size_t)g * (size_t)t->hs, (size_t)t->hs * sizeof(float));
            memcpy(tp_vrow(t, layer, g, pos), t->v + (size_t)g * (size_t)t->hs, (size_t)t->hs * sizeof(float));
        }
        for (g = 0; g < t->nkv; g++) {
            uint32_t *sel = t->sel_pos + ((size_t)layer * (size_t)t->nkv + (size_t)g) * (size_t)t->ctx;
            const float **kp = rows + (size_t)2 * (size_t)g * (size_t)(pos + 1), **vp = kp + pos + 1;
            cnt[g] = tp_select_host(t, layer, g, pos + 1, sel);
            t->sel_n[layer * t->nkv + g] = cnt[g];
            for (i = 0; i < cnt[g]; i++) {
                kp[i] = tp_krow(t, layer, g, (int)sel[i]);
                vp[i] = tp_vrow(t, layer, g, (int)sel[i]);
            }
            krow[g] = kp;
            vrow[g] = vp;
        }
        tp_decode_attend(t, layer, cnt, krow, vrow);
    }
    free(rows);
}

#endif /* TL_MPI_ENGINE_H */
