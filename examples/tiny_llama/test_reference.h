/* test_reference.h - the llama2.c checkpoint writer of tiny_llama's tests and a
   reference forward pass that reads such a file and computes the transformer
   with plain loops in double precision, sharing no code with the engine.
   Include it after tiny_llama.h and test_support.h. */
#ifndef TL_TEST_REFERENCE_H
#define TL_TEST_REFERENCE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ----------------------------------------------------------------------------
   The test's own checkpoint writer (llama2.c formats) */

typedef struct {
    int dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared;
    int legacy;
    float theta;      /* written as is in version 1 headers (0 = default) */
    unsigned seed;
} spec;

TLT_FN float next_uniform(unsigned *state)
{
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / 16777216.0f - 0.5f;   /* [-0.5, 0.5) */
}

TLT_FN void put_floats(FILE *f, size_t n, float base, float scale, unsigned *rng)
{
    size_t i;
    for (i = 0; i < n; i++) {
        float v = base + scale * next_uniform(rng);
        fwrite(&v, sizeof v, 1, f);
    }
}

TLT_FN int write_spec(const char *path, const spec *s)
{
    FILE *f = fopen(path, "wb");
    size_t D = (size_t)s->dim, H = (size_t)s->hidden, L = (size_t)s->layers;
    size_t hs = D / (size_t)s->heads, KV = hs * (size_t)s->kv_heads, V = (size_t)s->vocab;
    float mat = 2.0f / sqrtf((float)s->dim);
    unsigned rng = s->seed * 2654435761u + 1u;
    int ints[7];
    if (!f)
        return -1;
    ints[0] = s->dim; ints[1] = s->hidden; ints[2] = s->layers; ints[3] = s->heads;
    ints[4] = s->kv_heads; ints[5] = s->vocab; ints[6] = s->seq_len;
    if (s->legacy) {
        if (!s->shared)
            ints[5] = -s->vocab;
        fwrite(ints, sizeof(int), 7, f);
        put_floats(f, V * D, 0.0f, 2.0f, &rng);        /* token_embedding */
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_att */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wq */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wk */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wv */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wo */
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_ffn */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w1 */
        put_floats(f, L * D * H, 0.0f, mat, &rng);     /* w2 */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w3 */
        put_floats(f, D, 1.0f, 0.4f, &rng);            /* rms_final */
        put_floats(f, (size_t)s->seq_len * hs, 0.0f, 1.0f, &rng);  /* RoPE tables */
    } else {
        unsigned char pad[256];
        unsigned magic = 0x616b3432u;
        int version = 1;
        memset(pad, 0, sizeof pad);
        fwrite(&magic, 4, 1, f);
        fwrite(&version, 4, 1, f);
        fwrite(ints, sizeof(int), 7, f);
        pad[0] = (unsigned char)s->shared;       /* byte 36 */
        memcpy(pad + 4, &s->theta, 4);           /* byte 40 */
        fwrite(pad, 1, 256 - 36, f);
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_att */
        put_floats(f, L * D, 1.0f, 0.4f, &rng);        /* rms_ffn */
        put_floats(f, D, 1.0f, 0.4f, &rng);            /* rms_final */
        put_floats(f, V * D, 0.0f, 2.0f, &rng);        /* token_embedding */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wq */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wk */
        put_floats(f, L * KV * D, 0.0f, mat, &rng);    /* wv */
        put_floats(f, L * D * D, 0.0f, mat, &rng);     /* wo */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w1 */
        put_floats(f, L * D * H, 0.0f, mat, &rng);     /* w2 */
        put_floats(f, L * H * D, 0.0f, mat, &rng);     /* w3 */
    }
    if (!s->shared)
        put_floats(f, V * D, 0.0f, mat * 4.0f, &rng);  /* wcls */
    return fclose(f) == 0 ? 0 : -1;
}

TLT_FN spec small_spec(void)
{
    spec s;
    memset(&s, 0, sizeof s);
    s.dim = 32; s.hidden = 48; s.layers = 2; s.heads = 4; s.kv_heads = 2;
    s.vocab = 40; s.seq_len = 48; s.shared = 1; s.theta = 500000.0f; s.seed = 7;
    return s;
}

TLT_FN tl_config gen_config(void)
{
    tl_config c;
    memset(&c, 0, sizeof c);
    c.dim = 32; c.hidden_dim = 64; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2;
    c.vocab_size = 50; c.seq_len = 64; c.shared_classifier = 1; c.rope_theta = 10000.0f;
    return c;
}

/* ----------------------------------------------------------------------------
   Reference forward: plain loops, double precision, reads the file itself */

typedef struct {
    int dim, hidden, layers, heads, kv_heads, vocab, seq_len, hs, kv_dim;
    double theta;
    float *data;
    const float *emb, *rms_att, *rms_ffn, *rms_final, *wq, *wk, *wv, *wo, *w1, *w2, *w3, *wcls;
    double *kcache, *vcache;   /* [layer][pos][kv_dim] */
} ref_model;

TLT_FN int ref_load(ref_model *r, const char *path)
{
    size_t len, off;
    unsigned char *buf = read_file(path, &len);
    int ints[7], shared, legacy;
    unsigned magic;
    const float *p;
    size_t D, H, L, KV, V;
    if (!buf)
        return -1;
    memset(r, 0, sizeof *r);
    memcpy(&magic, buf, 4);
    legacy = magic != 0x616b3432u;
    if (legacy) {
        memcpy(ints, buf, sizeof ints);
        shared = ints[5] > 0;
        if (ints[5] < 0)
            ints[5] = -ints[5];
        r->theta = 10000.0;
        off = 28;
    } else {
        float theta;
        memcpy(ints, buf + 8, sizeof ints);
        shared = buf[36];
        memcpy(&theta, buf + 40, 4);
        r->theta = theta == 0.0f ? 10000.0 : (double)theta;
        off = 256;
    }
    r->dim = ints[0]; r->hidden = ints[1]; r->layers = ints[2]; r->heads = ints[3];
    r->kv_heads = ints[4]; r->vocab = ints[5]; r->seq_len = ints[6];
    r->hs = r->dim / r->heads;
    r->kv_dim = r->hs * r->kv_heads;
    r->data = (float *)malloc(len - off);
    memcpy(r->data, buf + off, len - off);
    free(buf);
    D = (size_t)r->dim; H = (size_t)r->hidden; L = (size_t)r->layers;
    KV = (size_t)r->kv_dim; V = (size_t)r->vocab;
    p = r->data;
    if (legacy) {
        r->emb = p; p += V * D;
        r->rms_att = p; p += L * D;
        r->wq = p; p += L * D * D;
        r->wk = p; p += L * KV * D;
        r->wv = p; p += L * KV * D;
        r->wo = p; p += L * D * D;
        r->rms_ffn = p; p += L * D;
        r->w1 = p; p += L * H * D;
        r->w2 = p; p += L * D * H;
        r->w3 = p; p += L * H * D;
        r->rms_final = p; p += D;
        p += (size_t)r->seq_len * (size_t)r->hs;
    } else {
        r->rms_att = p; p += L * D;
        r->rms_ffn = p; p += L * D;
        r->rms_final = p; p += D;
        r->emb = p; p += V * D;
        r->wq = p; p += L * D * D;
        r->wk = p; p += L * KV * D;
        r->wv = p; p += L * KV * D;
        r->wo = p; p += L * D * D;
        r->w1 = p; p += L * H * D;
        r->w2 = p; p += L * D * H;
        r->w3 = p; p += L * H * D;
    }
    r->wcls = shared ? r->emb : p;
    r->kcache = (double *)calloc(L * (size_t)r->seq_len * KV, sizeof(double));
    r->vcache = (double *)calloc(L * (size_t)r->seq_len * KV, sizeof(double));
    return 0;
}

TLT_FN void ref_free(ref_model *r)
{
    free(r->data);
    free(r->kcache);
    free(r->vcache);
}

TLT_FN void ref_rmsnorm(double *out, const double *x, const float *w, int n)
{
    double ss = 0.0;
    int i;
    for (i = 0; i < n; i++)
        ss += x[i] * x[i];
    ss = 1.0 / sqrt(ss / n + 1e-5);
    for (i = 0; i < n; i++)
        out[i] = w[i] * x[i] * ss;
}

/* out[r] = sum_c W[r][c] in[c] */
TLT_FN void ref_matvec(double *out, const float *w, const double *in, int rows, int cols)
{
    int r, c;
    for (r = 0; r < rows; r++) {
        double acc = 0.0;
        for (c = 0; c < cols; c++)
            acc += (double)w[(size_t)r * (size_t)cols + (size_t)c] * in[c];
        out[r] = acc;
    }
}

TLT_FN void ref_rope(double *v, int n, int hs, int pos, double theta)
{
    int d;
    for (d = 0; d < n; d += 2) {
        int pair = (d % hs) / 2;
        double angle = pos * pow(theta, -2.0 * pair / hs);
        double a = v[d], b = v[d + 1];
        v[d] = a * cos(angle) - b * sin(angle);
        v[d + 1] = a * sin(angle) + b * cos(angle);
    }
}

/* logits (vocab) for token at pos; positions before pos must have been run */
TLT_FN void ref_forward(ref_model *r, int token, int pos, double *logits)
{
    int D = r->dim, H = r->hidden, hs = r->hs, KV = r->kv_dim, l, h, i, t;
    double *x = (double *)calloc((size_t)D, sizeof(double));
    double *xn = (double *)calloc((size_t)D, sizeof(double));
    double *q = (double *)calloc((size_t)D, sizeof(double));
    double *att_out = (double *)calloc((size_t)D, sizeof(double));
    double *o = (double *)calloc((size_t)D, sizeof(double));
    double *h1 = (double *)calloc((size_t)H, sizeof(double));
    double *h3 = (double *)calloc((size_t)H, sizeof(double));
    double *scores = (double *)calloc((size_t)pos + 1, sizeof(double));
    for (i = 0; i < D; i++)
        x[i] = r->emb[(size_t)token * (size_t)D + (size_t)i];
    for (l = 0; l < r->layers; l++) {
        double *k = r->kcache + ((size_t)l * (size_t)r->seq_len + (size_t)pos) * (size_t)KV;
        double *v = r->vcache + ((size_t)l * (size_t)r->seq_len + (size_t)pos) * (size_t)KV;
        ref_rmsnorm(xn, x, r->rms_att + (size_t)l * (size_t)D, D);
        ref_matvec(q, r->wq + (size_t)l * (size_t)D * (size_t)D, xn, D, D);
        ref_matvec(k, r->wk + (size_t)l * (size_t)KV * (size_t)D, xn, KV, D);
        ref_matvec(v, r->wv + (size_t)l * (size_t)KV * (size_t)D, xn, KV, D);
        ref_rope(q, D, hs, pos, r->theta);
        ref_rope(k, KV, hs, pos, r->theta);
        for (h = 0; h < r->heads; h++) {
            int g = h / (r->heads / r->kv_heads);
            double max = -1e300, sum = 0.0;
            for (t = 0; t <= pos; t++) {
                const double *kt = r->kcache +
                    ((size_t)l * (size_t)r->seq_len + (size_t)t) * (size_t)KV + (size_t)g * (size_t)hs;
                double dot = 0.0;
                for (i = 0; i < hs; i++)
                    dot += q[h * hs + i] * kt[i];
                scores[t] = dot / sqrt((double)hs);
                if (scores[t] > max)
                    max = scores[t];
            }
            for (t = 0; t <= pos; t++) {
                scores[t] = exp(scores[t] - max);
                sum += scores[t];
            }
            for (i = 0; i < hs; i++)
                att_out[h * hs + i] = 0.0;
            for (t = 0; t <= pos; t++) {
                const double *vt = r->vcache +
                    ((size_t)l * (size_t)r->seq_len + (size_t)t) * (size_t)KV + (size_t)g * (size_t)hs;
                for (i = 0; i < hs; i++)
                    att_out[h * hs + i] += scores[t] / sum * vt[i];
            }
        }
        ref_matvec(o, r->wo + (size_t)l * (size_t)D * (size_t)D, att_out, D, D);
        for (i = 0; i < D; i++)
            x[i] += o[i];
        ref_rmsnorm(xn, x, r->rms_ffn + (size_t)l * (size_t)D, D);
        ref_matvec(h1, r->w1 + (size_t)l * (size_t)H * (size_t)D, xn, H, D);
        ref_matvec(h3, r->w3 + (size_t)l * (size_t)H * (size_t)D, xn, H, D);
        for (i = 0; i < H; i++)
            h1[i] = h1[i] / (1.0 + exp(-h1[i])) * h3[i];
        ref_matvec(o, r->w2 + (size_t)l * (size_t)D * (size_t)H, h1, D, H);
        for (i = 0; i < D; i++)
            x[i] += o[i];
    }
    ref_rmsnorm(xn, x, r->rms_final, D);
    ref_matvec(logits, r->wcls, xn, r->vocab, D);
    free(x); free(xn); free(q); free(att_out); free(o); free(h1); free(h3); free(scores);
}

/* Runs the engine (full attention) and the reference over n tokens of the
   checkpoint at path; returns the largest absolute logit difference. */
TLT_FN double max_diff_vs_reference(const char *path, int n)
{
    tl_model m;
    tl_state s;
    ref_model r;
    char err[TL_ERR_LEN];
    double worst = -1.0, *ref_logits;
    int pos, i;
    if (tl_build_model(&m, path, err, sizeof err)) {
        printf("  load failed: %s\n", err);
        return 1e30;
    }
    if (tl_build_state(&s, &m.config, 0, 1, err, sizeof err) || ref_load(&r, path)) {
        tl_free_model(&m);
        return 1e30;
    }
    ref_logits = (double *)calloc((size_t)r.vocab, sizeof(double));
    for (pos = 0; pos < n && pos < r.seq_len; pos++) {
        int token = (pos * 7 + 3) % r.vocab;
        float *logits = tl_forward(&m, &s, NULL, token, pos);
        ref_forward(&r, token, pos, ref_logits);
        if (!logits)
            return 1e30;
        for (i = 0; i < r.vocab; i++) {
            double d = fabs((double)logits[i] - ref_logits[i]);
            if (d > worst)
                worst = d;
        }
    }
    free(ref_logits);
    ref_free(&r);
    tl_free_state(&s);
    tl_free_model(&m);
    return worst;
}

#endif
