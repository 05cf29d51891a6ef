/* passkey_verify.h - the numerical checks of make_passkey.c: the engine's
 * forward pass run literally in fp32 (reference 1), the same math in double
 * precision with layer 0 of the prompt in O(len) (reference 2, see "How
 * --verify computes long contexts exactly" in make_passkey.c), the
 * verification over contexts and depths (--verify) and the reference logits
 * of one prompt (--ref). Included by make_passkey.c, after the model, its
 * checkpoint I/O and the prompts.
 */
#ifndef PASSKEY_VERIFY_H
#define PASSKEY_VERIFY_H

/* ------------------------------------------------------------------------ */
/* Reference 1: the engine's forward pass, literally, in fp32               */

typedef struct {
    const Model *m;
    int cap;
    float *x, *xb, *xb2, *hb, *hb2, *q, *att, *logits;
    float *kc, *vc; /* [L][cap][kv] */
} Fp32;

static void fp32_init(Fp32 *r, const Model *m, int cap)
{
    size_t kv = (size_t)kv_dim(m);
    r->m = m;
    r->cap = cap;
    r->x = fzeros((size_t)m->dim);
    r->xb = fzeros((size_t)m->dim);
    r->xb2 = fzeros((size_t)m->dim);
    r->hb = fzeros((size_t)m->hidden);
    r->hb2 = fzeros((size_t)m->hidden);
    r->q = fzeros((size_t)m->dim);
    r->att = fzeros((size_t)m->n_heads * (size_t)cap);
    r->logits = fzeros((size_t)m->vocab);
    r->kc = fzeros((size_t)m->n_layers * (size_t)cap * kv);
    r->vc = fzeros((size_t)m->n_layers * (size_t)cap * kv);
}

static void fp32_free(Fp32 *r)
{
    free(r->x); free(r->xb); free(r->xb2); free(r->hb); free(r->hb2); free(r->q);
    free(r->att); free(r->logits); free(r->kc); free(r->vc);
}

static void rmsnorm_f(float *o, const float *x, const float *w, int n)
{
    float ss = 0.0f;
    int j;
    for (j = 0; j < n; j++) ss += x[j] * x[j];
    ss = 1.0f / sqrtf(ss / (float)n + 1e-5f);
    for (j = 0; j < n; j++) o[j] = w[j] * (ss * x[j]);
}

static void matmul_f(float *o, const float *x, const float *w, int n, int d)
{
    int i, j;
    for (i = 0; i < d; i++) {
        float v = 0.0f;
        for (j = 0; j < n; j++) v += w[(size_t)i * n + j] * x[j];
        o[i] = v;
    }
}

/* One token at position pos; att0/att1 receive the attention weights of
 * head 0 of layers 0 and 1 when not NULL. Returns the logits. */
static float *fp32_forward(Fp32 *r, int token, int pos, float *att0, float *att1)
{
    const Model *m = r->m;
    int D = m->dim, hs = m->dim / m->n_heads, kvd = kv_dim(m);
    int mul = m->n_heads / m->n_kv_heads, l, i, h, t;
    memcpy(r->x, m->emb + (size_t)token * D, (size_t)D * sizeof(float));
    for (l = 0; l < m->n_layers; l++) {
        size_t lo = (size_t)l * r->cap * kvd;
        float *k = r->kc + lo + (size_t)pos * kvd, *v = r->vc + lo + (size_t)pos * kvd;
        rmsnorm_f(r->xb, r->x, m->rms_att + (size_t)l * D, D);
        matmul_f(r->q, r->xb, m->wq + (size_t)l * D * D, D, D);
        matmul_f(k, r->xb, m->wk + (size_t)l * kvd * D, D, kvd);
        matmul_f(v, r->xb, m->wv + (size_t)l * kvd * D, D, kvd);
        for (i = 0; i < D; i += 2) {
            int hd = i % hs;
            float freq = 1.0f / powf(m->theta, (float)hd / (float)hs);
            float val = (float)pos * freq, fcr = cosf(val), fci = sinf(val);
            float a = r->q[i], b = r->q[i + 1];
            r->q[i] = a * fcr - b * fci;
            r->q[i + 1] = a * fci + b * fcr;
            if (i < kvd) {
                a = k[i];
                b = k[i + 1];
                k[i] = a * fcr - b * fci;
                k[i + 1] = a * fci + b * fcr;
            }
        }
        for (h = 0; h < m->n_heads; h++) {
            float *q = r->q + (size_t)h * hs, *att = r->att + (size_t)h * r->cap;
            float *xo = r->xb + (size_t)h * hs, mx, sum = 0.0f;
            size_t ko = (size_t)(h / mul) * hs;
            for (t = 0; t <= pos; t++) {
                const float *kt = r->kc + lo + (size_t)t * kvd + ko;
                float s = 0.0f;
                for (i = 0; i < hs; i++) s += q[i] * kt[i];
                att[t] = s / sqrtf((float)hs);
            }
            mx = att[0];
            for (t = 1; t <= pos; t++) mx = att[t] > mx ? att[t] : mx;
            for (t = 0; t <= pos; t++) {
                att[t] = expf(att[t] - mx);
                sum += att[t];
            }
            for (t = 0; t <= pos; t++) att[t] /= sum;
            memset(xo, 0, (size_t)hs * sizeof(float));
            for (t = 0; t <= pos; t++) {
                const float *vt = r->vc + lo + (size_t)t * kvd + ko;
                for (i = 0; i < hs; i++) xo[i] += att[t] * vt[i];
            }
            if (h == 0 && l == 0 && att0) memcpy(att0, att, (size_t)(pos + 1) * sizeof(float));
            if (h == 0 && l == 1 && att1) memcpy(att1, att, (size_t)(pos + 1) * sizeof(float));
        }
        matmul_f(r->xb2, r->xb, m->wo + (size_t)l * D * D, D, D);
        for (i = 0; i < D; i++) r->x[i] += r->xb2[i];
        rmsnorm_f(r->xb, r->x, m->rms_ffn + (size_t)l * D, D);
        matmul_f(r->hb, r->xb, m->w1 + (size_t)l * m->hidden * D, D, m->hidden);
        matmul_f(r->hb2, r->xb, m->w3 + (size_t)l * m->hidden * D, D, m->hidden);
        for (i = 0; i < m->hidden; i++) {
            float g = r->hb[i];
            r->hb[i] = g * (1.0f / (1.0f + expf(-g))) * r->hb2[i];
        }
        matmul_f(r->xb, r->hb, m->w2 + (size_t)l * D * m->hidden, m->hidden, D);
        for (i = 0; i < D; i++) r->x[i] += r->xb[i];
    }
    rmsnorm_f(r->x, r->x, m->rms_final, D);
    matmul_f(r->logits, r->x, m->wcls, D, m->vocab);
    return r->logits;
}

/* ------------------------------------------------------------------------ */
/* Reference 2: the same math in double precision, for contexts up to       */
/* max_seq_len. Decode steps are computed literally over every position.    */
/* Over the prompt, layer 0's scores depend only on the offset (every token */
/* gives the same pre-RoPE query and key; this is checked), so its output  */
/* at position p is sum_j w(p-j) v_j / Z(p) over the few positions whose   */
/* value is non-zero, with Z(p) = sum_{d=0..p} w(d) from a prefix sum: the */
/* exact full-attention result in O(len) instead of O(len^2).              */

typedef struct {
    int rows, cols;
    int *ptr, *col;
    double *val;
} Csr;

static void csr_make(Csr *c, const float *w, int rows, int cols)
{
    int i, j, nnz = 0;
    for (i = 0; i < rows * cols; i++) nnz += w[i] != 0.0f;
    c->rows = rows;
    c->cols = cols;
    c->ptr = (int *)xcalloc((size_t)rows + 1, sizeof(int));
    c->col = (int *)xcalloc((size_t)nnz, sizeof(int));
    c->val = (double *)xcalloc((size_t)nnz, sizeof(double));
    nnz = 0;
    for (i = 0; i < rows; i++) {
        for (j = 0; j < cols; j++) {
            float v = w[(size_t)i * cols + j];
            if (v != 0.0f) {
                c->col[nnz] = j;
                c->val[nnz++] = v;
            }
        }
        c->ptr[i + 1] = nnz;
    }
}

static void csr_free(Csr *c)
{
    free(c->ptr);
    free(c->col);
    free(c->val);
}

static void csr_mv(double *o, const Csr *c, const double *x)
{
    int i, k;
    for (i = 0; i < c->rows; i++) {
        double s = 0.0;
        for (k = c->ptr[i]; k < c->ptr[i + 1]; k++) s += c->val[k] * x[c->col[k]];
        o[i] = s;
    }
}

static int csr_row_nonzero(const Csr *c, int i) { return c->ptr[i + 1] > c->ptr[i]; }

#define MAXL 8

typedef struct {
    const Model *m;
    int D, hs, kvd, cap;
    Csr wq[MAXL], wk[MAXL], wv[MAXL], wo[MAXL], w1[MAXL], w2[MAXL], w3[MAXL], cls;
    /* active kv dims per layer (RoPE-pair closed for keys) and caches */
    int nk[MAXL], nv[MAXL];
    int *kd[MAXL], *vd[MAXL];
    double *kc[MAXL], *vc[MAXL]; /* [cap][nk], [cap][nv] */
    double *freq;                /* [hs/2] */
    /* scratch */
    double *x, *xb, *xo, *q, *k, *v, *h1, *h3, *tmp, *att[MAXL], *logits;
} Ref;

static void ref_init(Ref *r, const Model *m, int cap)
{
    int l, i;
    memset(r, 0, sizeof *r);
    r->m = m;
    r->D = m->dim;
    r->hs = m->dim / m->n_heads;
    r->kvd = kv_dim(m);
    r->cap = cap;
    for (l = 0; l < m->n_layers; l++) {
        size_t D = (size_t)m->dim, kv = (size_t)r->kvd, H = (size_t)m->hidden;
        csr_make(&r->wq[l], m->wq + l * D * D, m->dim, m->dim);
        csr_make(&r->wk[l], m->wk + l * kv * D, r->kvd, m->dim);
        csr_make(&r->wv[l], m->wv + l * kv * D, r->kvd, m->dim);
        csr_make(&r->wo[l], m->wo + l * D * D, m->dim, m->dim);
        csr_make(&r->w1[l], m->w1 + l * H * D, m->hidden, m->dim);
        csr_make(&r->w2[l], m->w2 + l * D * H, m->dim, m->hidden);
        csr_make(&r->w3[l], m->w3 + l * H * D, m->hidden, m->dim);
        r->kd[l] = (int *)xcalloc((size_t)r->kvd, sizeof(int));
        r->vd[l] = (int *)xcalloc((size_t)r->kvd, sizeof(int));
        for (i = 0; i < r->kvd; i += 2)
            if (csr_row_nonzero(&r->wk[l], i) || csr_row_nonzero(&r->wk[l], i + 1)) {
                r->kd[l][r->nk[l]++] = i;
                r->kd[l][r->nk[l]++] = i + 1;
            }
        for (i = 0; i < r->kvd; i++)
            if (csr_row_nonzero(&r->wv[l], i)) r->vd[l][r->nv[l]++] = i;
        r->kc[l] = (double *)xcalloc((size_t)cap * (size_t)(r->nk[l] ? r->nk[l] : 1), sizeof(double));
        r->vc[l] = (double *)xcalloc((size_t)cap * (size_t)(r->nv[l] ? r->nv[l] : 1), sizeof(double));
        r->att[l] = (double *)xcalloc((size_t)cap * (size_t)m->n_heads, sizeof(double));
    }
    csr_make(&r->cls, m->wcls, m->vocab, m->dim);
    r->freq = (double *)xcalloc((size_t)r->hs / 2, sizeof(double));
    for (i = 0; i < r->hs / 2; i++) r->freq[i] = rope_freq(m->theta, i, r->hs);
    r->x = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->xb = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->xo = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->q = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->k = (double *)xcalloc((size_t)r->kvd, sizeof(double));
    r->v = (double *)xcalloc((size_t)r->kvd, sizeof(double));
    r->tmp = (double *)xcalloc((size_t)r->D, sizeof(double));
    r->h1 = (double *)xcalloc((size_t)m->hidden, sizeof(double));
    r->h3 = (double *)xcalloc((size_t)m->hidden, sizeof(double));
    r->logits = (double *)xcalloc((size_t)m->vocab, sizeof(double));
}

static void ref_free(Ref *r)
{
    int l;
    for (l = 0; l < r->m->n_layers; l++) {
        csr_free(&r->wq[l]); csr_free(&r->wk[l]); csr_free(&r->wv[l]); csr_free(&r->wo[l]);
        csr_free(&r->w1[l]); csr_free(&r->w2[l]); csr_free(&r->w3[l]);
        free(r->kd[l]); free(r->vd[l]); free(r->kc[l]); free(r->vc[l]); free(r->att[l]);
    }
    csr_free(&r->cls);
    free(r->freq); free(r->x); free(r->xb); free(r->xo); free(r->q); free(r->k);
    free(r->v); free(r->tmp); free(r->h1); free(r->h3); free(r->logits);
}

static void rmsnorm_d(double *o, const double *x, const float *w, int n)
{
    double ss = 0.0;
    int j;
    for (j = 0; j < n; j++) ss += x[j] * x[j];
    ss = 1.0 / sqrt(ss / n + PK_EPS);
    for (j = 0; j < n; j++) o[j] = w[j] * ss * x[j];
}

static void rope_d(double *x, int n, int hs, const double *freq, double pos)
{
    int i;
    for (i = 0; i < n; i += 2) {
        double a = pos * freq[(i % hs) / 2], c = cos(a), s = sin(a);
        double u = x[i], w = x[i + 1];
        x[i] = u * c - w * s;
        x[i + 1] = u * s + w * c;
    }
}

/* The FFN of layer l applied to r->x in place. */
static void ref_ffn(Ref *r, int l)
{
    const Model *m = r->m;
    int i;
    rmsnorm_d(r->xb, r->x, m->rms_ffn + (size_t)l * r->D, r->D);
    csr_mv(r->h1, &r->w1[l], r->xb);
    csr_mv(r->h3, &r->w3[l], r->xb);
    for (i = 0; i < m->hidden; i++) r->h1[i] = r->h1[i] / (1.0 + exp(-r->h1[i])) * r->h3[i];
    csr_mv(r->tmp, &r->w2[l], r->h1);
    for (i = 0; i < r->D; i++) r->x[i] += r->tmp[i];
}

/* q, k, v of layer l for r->x at pos; k and v stored in the caches. */
static void ref_qkv(Ref *r, int l, int pos)
{
    int i;
    rmsnorm_d(r->xb, r->x, r->m->rms_att + (size_t)l * r->D, r->D);
    csr_mv(r->q, &r->wq[l], r->xb);
    csr_mv(r->k, &r->wk[l], r->xb);
    csr_mv(r->v, &r->wv[l], r->xb);
    rope_d(r->q, r->D, r->hs, r->freq, pos);
    rope_d(r->k, r->kvd, r->hs, r->freq, pos);
    for (i = 0; i < r->nk[l]; i++) r->kc[l][(size_t)pos * r->nk[l] + i] = r->k[r->kd[l][i]];
    for (i = 0; i < r->nv[l]; i++) r->vc[l][(size_t)pos * r->nv[l] + i] = r->v[r->vd[l][i]];
}

/* Literal decode step: token at pos attends to all of 0..pos in every layer. */
static double *ref_step(Ref *r, int token, int pos)
{
    const Model *m = r->m;
    int l, h, i, t, mul = m->n_heads / m->n_kv_heads;
    for (i = 0; i < r->D; i++) r->x[i] = m->emb[(size_t)token * r->D + i];
    for (l = 0; l < m->n_layers; l++) {
        ref_qkv(r, l, pos);
        memset(r->xo, 0, (size_t)r->D * sizeof(double));
        for (h = 0; h < m->n_heads; h++) {
            int lo = (h / mul) * r->hs, hi = lo + r->hs;
            double *att = r->att[l] + (size_t)h * r->cap, mx = -1e300, sum = 0.0;
            for (t = 0; t <= pos; t++) {
                const double *kt = r->kc[l] + (size_t)t * r->nk[l];
                double s = 0.0;
                for (i = 0; i < r->nk[l]; i++) {
                    int d = r->kd[l][i];
                    if (d >= lo && d < hi) s += r->q[h * r->hs + d - lo] * kt[i];
                }
                att[t] = s / sqrt((double)r->hs);
                if (att[t] > mx) mx = att[t];
            }
            for (t = 0; t <= pos; t++) sum += att[t] = exp(att[t] - mx);
            for (t = 0; t <= pos; t++) att[t] /= sum;
            for (t = 0; t <= pos; t++) {
                const double *vt = r->vc[l] + (size_t)t * r->nv[l];
                if (att[t] == 0.0) continue;
                for (i = 0; i < r->nv[l]; i++) {
                    int d = r->vd[l][i];
                    if (d >= lo && d < hi) r->xo[h * r->hs + d - lo] += att[t] * vt[i];
                }
            }
        }
        csr_mv(r->tmp, &r->wo[l], r->xo);
        for (i = 0; i < r->D; i++) r->x[i] += r->tmp[i];
        ref_ffn(r, l);
    }
    rmsnorm_d(r->xb, r->x, m->rms_final, r->D);
    csr_mv(r->logits, &r->cls, r->xb);
    return r->logits;
}

/* Offset table of layer 0, head h: s(d) = score of a query at p with the key
 * at p-d (d = 0..cap-1), shifted so that the maximum is 0. Fails (returns
 * -1) when the pre-RoPE query or key of layer 0 depends on the token. */
typedef struct {
    double *w;      /* [H][cap] exp(s(d) - max)              */
    double *z;      /* [H][cap] prefix sums of w             */
    double *zoff;   /* [H][cap] prefix sums of w without d=1 */
    double *v;      /* [vocab][kvd] layer-0 value per token  */
    int *vnz;       /* [vocab] value non-zero                */
} Layer0;

static int layer0_table(Ref *r, Layer0 *t)
{
    const Model *m = r->m;
    int H = m->n_heads, hs = r->hs, mul = m->n_heads / m->n_kv_heads;
    int tok, h, d, i;
    double *q0 = (double *)xcalloc((size_t)r->D, sizeof(double));
    double *k0 = (double *)xcalloc((size_t)r->kvd, sizeof(double));
    double *s = (double *)xcalloc((size_t)r->cap, sizeof(double));
    t->w = (double *)xcalloc((size_t)H * r->cap, sizeof(double));
    t->z = (double *)xcalloc((size_t)H * r->cap, sizeof(double));
    t->zoff = (double *)xcalloc((size_t)H * r->cap, sizeof(double));
    t->v = (double *)xcalloc((size_t)m->vocab * r->kvd, sizeof(double));
    t->vnz = (int *)xcalloc((size_t)m->vocab, sizeof(int));
    for (tok = 0; tok < m->vocab; tok++) {
        for (i = 0; i < r->D; i++) r->x[i] = m->emb[(size_t)tok * r->D + i];
        rmsnorm_d(r->xb, r->x, m->rms_att, r->D);
        csr_mv(r->q, &r->wq[0], r->xb);
        csr_mv(r->k, &r->wk[0], r->xb);
        csr_mv(t->v + (size_t)tok * r->kvd, &r->wv[0], r->xb);
        for (i = 0; i < r->kvd; i++) t->vnz[tok] |= t->v[(size_t)tok * r->kvd + i] != 0.0;
        if (tok == 0) {
            memcpy(q0, r->q, (size_t)r->D * sizeof(double));
            memcpy(k0, r->k, (size_t)r->kvd * sizeof(double));
            continue;
        }
        /* 1e-6: the harder variant's filler embeddings have norm sqrt 2 up to float
           rounding (a few 1e-8 relative), which moves layer-0 scores by < 1e-5 */
        for (i = 0; i < r->D; i++)
            if (fabs(r->q[i] - q0[i]) > 1e-6 * (1.0 + fabs(q0[i]))) goto dependent;
        for (i = 0; i < r->kvd; i++)
            if (fabs(r->k[i] - k0[i]) > 1e-6 * (1.0 + fabs(k0[i]))) goto dependent;
    }
    for (h = 0; h < H; h++) {
        const double *qh = q0 + (size_t)h * hs, *kh = k0 + (size_t)(h / mul) * hs;
        double mx = -1e300, *w = t->w + (size_t)h * r->cap;
        for (d = 0; d < r->cap; d++) {
            double acc = 0.0;
            for (i = 0; i < hs; i += 2) {
                double a = -(double)d * r->freq[i / 2], c = cos(a), sn = sin(a);
                acc += qh[i] * (kh[i] * c - kh[i + 1] * sn) + qh[i + 1] * (kh[i] * sn + kh[i + 1] * c);
            }
            s[d] = acc / sqrt((double)hs);
            if (s[d] > mx) mx = s[d];
        }
        for (d = 0; d < r->cap; d++) {
            w[d] = exp(s[d] - mx);
            t->z[(size_t)h * r->cap + d] = (d ? t->z[(size_t)h * r->cap + d - 1] : 0.0) + w[d];
            t->zoff[(size_t)h * r->cap + d] =
                (d ? t->zoff[(size_t)h * r->cap + d - 1] : 0.0) + (d == 1 ? 0.0 : w[d]);
        }
    }
    free(q0); free(k0); free(s);
    return 0;
dependent:
    free(q0); free(k0); free(s);
    return -1;
}

static void layer0_free(Layer0 *t)
{
    free(t->w); free(t->z); free(t->zoff); free(t->v); free(t->vnz);
}

/* Prompt pass: fills the layer caches for positions 0..len-1 exactly.
 * Returns the largest off-peak mass of layer 0 (mass not on p-1, p >= 1). */
static double ref_prompt(Ref *r, const Layer0 *t, const int *toks, int len)
{
    const Model *m = r->m;
    int H = m->n_heads, mul = H / m->n_kv_heads, p, h, i, c, nsrc = 0;
    int *src = (int *)xcalloc((size_t)len, sizeof(int));
    double worst = 0.0;
    for (p = 0; p < len; p++) {
        int tok = toks[p];
        for (i = 0; i < r->D; i++) r->x[i] = m->emb[(size_t)tok * r->D + i];
        ref_qkv(r, 0, p);
        if (t->vnz[tok]) src[nsrc++] = p;
        memset(r->xo, 0, (size_t)r->D * sizeof(double));
        for (h = 0; h < H; h++) {
            const double *w = t->w + (size_t)h * r->cap;
            double z = t->z[(size_t)h * r->cap + p];
            int ko = (h / mul) * r->hs;
            for (c = 0; c < nsrc; c++) {
                double a = w[p - src[c]] / z;
                const double *vt = t->v + (size_t)toks[src[c]] * r->kvd + ko;
                for (i = 0; i < r->hs; i++) r->xo[h * r->hs + i] += a * vt[i];
            }
            if (p >= 1) {
                double off = t->zoff[(size_t)h * r->cap + p] / z;
                if (off > worst) worst = off;
            }
        }
        csr_mv(r->tmp, &r->wo[0], r->xo);
        for (i = 0; i < r->D; i++) r->x[i] += r->tmp[i];
        ref_ffn(r, 0);
        ref_qkv(r, 1, p); /* layer-1 keys and values; its output is not needed */
    }
    free(src);
    return worst;
}

/* ------------------------------------------------------------------------ */
/* Verification                                                              */

typedef struct {
    int cases, solved;      /* greedy decoding reproduced v1..vn          */
    double margin;          /* min logit(right) - max logit(other)        */
    double right;           /* min logit of the right token               */
    double match_miss;      /* max layer-1 mass not on the right position */
    double match_gap;       /* min log(att right / att best other)        */
    double prev_off;        /* max layer-0 mass not on p-1 (prompt+decode) */
    double k_needle;        /* min |layer-1 key| at needle + 1            */
    double k_other;         /* max |layer-1 key| off needle+1..needle+n+1 */
    double q_query;         /* min |layer-1 query| of the K decode step   */
    double qk_cos;          /* min cosine of that query with that key     */
} Stats;

static void stats_init(Stats *s)
{
    s->cases = s->solved = 0;
    s->margin = s->right = s->match_gap = 1e300;
    s->match_miss = s->prev_off = s->k_other = 0.0;
    s->k_needle = s->q_query = s->qk_cos = 1e300;
}

static double norm_d(const double *x, int n)
{
    double s = 0.0;
    int i;
    for (i = 0; i < n; i++) s += x[i] * x[i];
    return sqrt(s);
}

static int argmax_d(const double *x, int n)
{
    int i, b = 0;
    for (i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One haystack: prompt of ctx - n tokens, then n decode steps. When got is
 * not NULL it receives the n x vocab logits. */
static int run_case(Ref *r, const Layer0 *t, int ctx, double depth, uint64_t seed, int n,
                    Stats *st, double *got)
{
    const Model *m = r->m;
    int len = ctx - n, query, answer[N_VALUE], s, i, ok = 1, tok;
    int *toks = (int *)xcalloc((size_t)len, sizeof(int));
    int needle = make_prompt(len, depth, seed, n, toks, &query, answer);
    double off = ref_prompt(r, t, toks, len);
    if (off > st->prev_off) st->prev_off = off;
    for (i = 0; i < len; i++) {
        double kn = norm_d(r->kc[1] + (size_t)i * r->nk[1], r->nk[1]);
        if (i == needle + 1 && kn < st->k_needle) st->k_needle = kn;
        if ((i <= needle || i > needle + n + 1) && kn > st->k_other) st->k_other = kn;
    }
    tok = query;
    for (s = 0; s < n; s++) {
        int pos = len + s, target = needle + 1 + s, best;
        double *lg = ref_step(r, tok, pos), wrong = -1e300, miss = 0.0, other = 0.0;
        const double *a0 = r->att[0], *a1 = r->att[1];
        for (i = 0; i < m->vocab; i++)
            if (i != answer[s] && lg[i] > wrong) wrong = lg[i];
        if (lg[answer[s]] - wrong < st->margin) st->margin = lg[answer[s]] - wrong;
        if (lg[answer[s]] < st->right) st->right = lg[answer[s]];
        for (i = 0; i <= pos; i++)
            if (i != target) {
                miss += a1[i];
                if (a1[i] > other) other = a1[i];
            }
        if (miss > st->match_miss) st->match_miss = miss;
        if (log(a1[target] / other) < st->match_gap) st->match_gap = log(a1[target] / other);
        miss = 0.0;
        for (i = 0; i <= pos; i++)
            if (i != pos - 1) miss += a0[i];
        if (miss > st->prev_off) st->prev_off = miss;
        if (s == 0) { /* r->q holds the layer-1 query of the K step */
            const double *kt = r->kc[1] + (size_t)(needle + 1) * r->nk[1];
            double qn, dot = 0.0;
            for (i = 0; i < r->nk[1]; i++) dot += r->q[r->kd[1][i]] * kt[i];
            qn = norm_d(r->q, r->D);
            if (qn < st->q_query) st->q_query = qn;
            dot /= qn * norm_d(kt, r->nk[1]);
            if (dot < st->qk_cos) st->qk_cos = dot;
        }
        if (got) memcpy(got + (size_t)s * m->vocab, lg, (size_t)m->vocab * sizeof(double));
        best = argmax_d(lg, m->vocab);
        if (best != answer[s]) ok = 0;
        tok = best;
    }
    st->cases++;
    st->solved += ok;
    free(toks);
    return ok;
}

/* The engine's fp32 forward over the whole prompt (O(len^2)); returns the
 * largest |logit - double reference logit| over the decode steps. */
static double fp32_case(const Model *m, int ctx, double depth, uint64_t seed, int n,
                        const double *want, int *ok)
{
    Fp32 f;
    int len = ctx - n, query, answer[N_VALUE], p, s, i, tok;
    int *toks = (int *)xcalloc((size_t)len, sizeof(int));
    double worst = 0.0;
    make_prompt(len, depth, seed, n, toks, &query, answer);
    fp32_init(&f, m, ctx);
    for (p = 0; p < len; p++) fp32_forward(&f, toks[p], p, NULL, NULL);
    *ok = 1;
    tok = query;
    for (s = 0; s < n; s++) {
        float *lg = fp32_forward(&f, tok, len + s, NULL, NULL);
        int b = 0;
        for (i = 0; i < m->vocab; i++) {
            double d = fabs((double)lg[i] - want[(size_t)s * m->vocab + i]);
            if (d > worst) worst = d;
            if (lg[i] > lg[b]) b = i;
        }
        if (b != answer[s]) *ok = 0;
        tok = b;
    }
    fp32_free(&f);
    free(toks);
    return worst;
}

/* Layer 0 at every position with the engine's fp32 RoPE (angle = (float)pos
 * * freq, freq = 1/powf(theta, hd/hs)): smallest gap between the score of
 * p-1 and the best of p, p-2, ..., p-8. */
static double fp32_prev_gap(const Model *m, int *where)
{
    int D = m->dim, hs = m->dim / m->n_heads, kvd = kv_dim(m), p, d, i;
    float *xb = fzeros((size_t)D), *q0 = fzeros((size_t)D), *k0 = fzeros((size_t)kvd);
    float *q = fzeros((size_t)hs), *ring = fzeros((size_t)9 * hs);
    double worst = 1e300;
    rmsnorm_f(xb, m->emb + (size_t)TOK_BOS * D, m->rms_att, D);
    matmul_f(q0, xb, m->wq, D, D);
    matmul_f(k0, xb, m->wk, D, kvd);
    for (p = 0; p < m->seq_len; p++) {
        float *k = ring + (size_t)(p % 9) * hs;
        for (i = 0; i < hs; i += 2) {
            float freq = 1.0f / powf(m->theta, (float)i / (float)hs);
            float val = (float)p * freq, c = cosf(val), s = sinf(val);
            q[i] = q0[i] * c - q0[i + 1] * s;
            q[i + 1] = q0[i] * s + q0[i + 1] * c;
            k[i] = k0[i] * c - k0[i + 1] * s;
            k[i + 1] = k0[i] * s + k0[i + 1] * c;
        }
        if (p >= 9) {
            float sc[9], other = -1e30f;
            for (d = 0; d < 9; d++) {
                const float *kt = ring + (size_t)((p - d) % 9) * hs;
                float acc = 0.0f;
                for (i = 0; i < hs; i++) acc += q[i] * kt[i];
                sc[d] = acc / sqrtf((float)hs);
                if (d != 1 && sc[d] > other) other = sc[d];
            }
            if ((double)(sc[1] - other) < worst) {
                worst = (double)(sc[1] - other);
                *where = p;
            }
        }
    }
    free(xb); free(q0); free(k0); free(q); free(ring);
    return worst;
}

static int verify(const char *path, int n, int quick)
{
    Model m;
    Ref r;
    Layer0 t;
    Stats all;
    int ctx, nd = quick ? 5 : 11, di, fails = 0, where = 0;
    double gap, off_peak, far_gap;
    if (model_read(&m, path)) return 1;
    if (pk_use_vocab(m.vocab)) {
        fprintf(stderr, "%s: vocabulary %d is neither variant's (%d, %d)\n", path, m.vocab,
                PK_VOCAB, PK_HARD_VOCAB);
        model_free(&m);
        return 1;
    }
    if (m.n_layers != 2) {
        fprintf(stderr, "verify: expects a two-layer model\n");
        model_free(&m);
        return 1;
    }
    printf("checkpoint %s: dim %d hidden %d layers %d heads %d vocab %d seq_len %d "
           "theta %g shared %d\n", path, m.dim, m.hidden, m.n_layers, m.n_heads, m.vocab,
           m.seq_len, (double)m.theta, m.shared);
    ref_init(&r, &m, m.seq_len);
    if (layer0_table(&r, &t)) {
        fprintf(stderr, "verify: layer-0 scores depend on the token\n");
        ref_free(&r);
        model_free(&m);
        return 1;
    }
    {   /* layer-0 offset profile over the whole window */
        const double *w = t.w;
        int d, dbest = 2;
        double s1 = log(w[1]), best = -1e300, fbest = -1e300;
        for (d = 0; d < r.cap; d++) {
            if (d == 1) continue;
            if (log(w[d]) > best) best = log(w[d]);
            if (d >= 2 && log(w[d]) > fbest && d > 2) {
                fbest = log(w[d]);
                dbest = d;
            }
        }
        gap = s1 - best;
        far_gap = s1 - fbest;
        off_peak = t.zoff[r.cap - 1] / t.z[r.cap - 1];
        printf("layer 0 (previous-token head), exact offsets 0..%d:\n"
               "  peak at offset 1; nearest competitor %.2f logits below; best offset >= 3 "
               "(%d) %.2f below\n  off-peak mass at the last position %.3g\n",
               r.cap - 1, gap, dbest, far_gap, off_peak);
    }
    gap = fp32_prev_gap(&m, &where);
    printf("  engine fp32 RoPE, offsets 0..8 at every position: min gap %.2f logits (pos %d)\n",
           gap, where);
    if (gap < 10.0) fails++;

    stats_init(&all);
    printf("greedy passkey retrieval, full attention, %d depths per context (double):\n", nd);
    printf("  %7s %7s %9s %9s %9s %10s %10s %10s\n", "context", "solved", "margin", "right",
           "match_gap", "match_miss", "prev_off", "seconds");
    for (ctx = 4096;; ctx *= 2) {
        Stats st;
        clock_t c0 = clock();
        int c = ctx < m.seq_len ? ctx : m.seq_len;
        stats_init(&st);
        for (di = 0; di < nd; di++) {
            double depth = 100.0 * di / (nd - 1);
            run_case(&r, &t, c, depth, (uint64_t)c * 1000u + (uint64_t)di, n, &st, NULL);
        }
        printf("  %7d %3d/%-3d %9.3f %9.3f %9.3f %10.3g %10.3g %10.2f\n", c, st.solved,
               st.cases, st.margin, st.right, st.match_gap, st.match_miss, st.prev_off,
               (double)(clock() - c0) / CLOCKS_PER_SEC);
        fails += st.cases - st.solved;
        if (st.k_needle < all.k_needle) all.k_needle = st.k_needle;
        if (st.k_other > all.k_other) all.k_other = st.k_other;
        if (st.q_query < all.q_query) all.q_query = st.q_query;
        if (st.qk_cos < all.qk_cos) all.qk_cos = st.qk_cos;
        if (c == m.seq_len) break;
    }

    printf("layer-1 (matching) keys: |k| at the position after the needle's key >= %.3f,\n"
           "  |k| at filler-preceded positions <= %.3g; K query |q| >= %.3f, cos(q, k) >= %.6f\n",
           all.k_needle, all.k_other, all.q_query, all.qk_cos);

    {   /* the engine's own fp32 forward, literally, on short contexts */
        int fctx = quick ? 1024 : 2048, ok, nf = quick ? 3 : 5;
        double *want = (double *)xcalloc((size_t)n * m.vocab, sizeof(double)), diff = 0.0;
        int fsolved = 0;
        Stats st;
        stats_init(&st);
        if (fctx > m.seq_len) fctx = m.seq_len;
        for (di = 0; di < nf; di++) {
            double depth = 100.0 * di / (nf - 1), d;
            uint64_t seed = 777u + (uint64_t)di;
            run_case(&r, &t, fctx, depth, seed, n, &st, want);
            d = fp32_case(&m, fctx, depth, seed, n, want, &ok);
            if (d > diff) diff = d;
            fsolved += ok;
        }
        printf("fp32 engine-order forward (full O(n^2) attention), context %d: solved %d/%d, "
               "max |logit - double| %.3g\n", fctx, fsolved, nf, diff);
        fails += nf - fsolved;
        free(want);
    }
    layer0_free(&t);
    ref_free(&r);
    model_free(&m);
    printf(fails ? "FAILED\n" : "OK\n");
    return fails ? 1 : 0;
}

/* Reference logits of the decode steps of one prompt (double precision). */
static int reference(const char *path, int len, double depth, uint64_t seed, int n)
{
    Model m;
    Ref r;
    Layer0 t;
    Stats st;
    double *lg;
    int query, answer[N_VALUE], needle, s, i, j, ok;
    int *toks;
    if (model_read(&m, path)) return 1;
    if (pk_use_vocab(m.vocab)) {
        fprintf(stderr, "%s: vocabulary %d is neither variant's (%d, %d)\n", path, m.vocab,
                PK_VOCAB, PK_HARD_VOCAB);
        model_free(&m);
        return 1;
    }
    if (m.n_layers != 2 || len < n + 2 || len + n > m.seq_len) {
        fprintf(stderr, "--ref: needs a two-layer model and passkey_len + 2 <= LEN <= "
                        "max_seq_len - passkey_len\n");
        model_free(&m);
        return 1;
    }
    ref_init(&r, &m, len + n);
    if (layer0_table(&r, &t)) {
        fprintf(stderr, "--ref: layer-0 scores depend on the token\n");
        ref_free(&r);
        model_free(&m);
        return 1;
    }
    toks = (int *)xcalloc((size_t)len, sizeof(int));
    needle = make_prompt(len, depth, seed, n, toks, &query, answer);
    lg = (double *)xcalloc((size_t)n * m.vocab, sizeof(double));
    stats_init(&st);
    ok = run_case(&r, &t, len + n, depth, seed, n, &st, lg);
    printf("prompt %d tokens, needle at %d, query %d\n", len, needle, query);
    for (s = 0; s < n; s++) {
        const double *l = lg + (size_t)s * m.vocab;
        int top[5], k;
        for (k = 0; k < 5; k++) {
            int b = -1;
            for (i = 0; i < m.vocab; i++) {
                for (j = 0; j < k; j++)
                    if (top[j] == i) break;
                if (j == k && (b < 0 || l[i] > l[b])) b = i;
            }
            top[k] = b;
        }
        printf("step %d pos %d: expected %d, top", s, len + s, answer[s]);
        for (k = 0; k < 5; k++) printf(" %d:%.7g", top[k], l[top[k]]);
        printf("\n");
    }
    printf("%s: min margin %.4f, layer-1 mass off the needle %.3g\n", ok ? "solved" : "FAILED",
           st.margin, st.match_miss);
    free(lg);
    free(toks);
    layer0_free(&t);
    ref_free(&r);
    model_free(&m);
    return ok ? 0 : 1;
}

#endif /* PASSKEY_VERIFY_H */
