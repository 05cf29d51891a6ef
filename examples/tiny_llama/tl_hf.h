/* tl_hf.h - Hugging Face model directories for tiny_llama: a strict JSON
   reader, safetensors files, config.json (the architecture, its sizes and
   RoPE: rope_parameters or rope_theta and rope_scaling), and binding the
   mapped tensors to the model's weights.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file. */
#ifndef TL_HF_H
#define TL_HF_H

/* ----------------------------------------------------------------------------
   Hugging Face checkpoints: a directory with config.json and model.safetensors,
   or model.safetensors.index.json and the shards it names. tl_build_model
   takes such a directory (tl_build_hf_model directly). Architectures:
   LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Gemma3ForCausalLM
   (its text model, tl_gemma.h); weights in bf16,
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
const char *tl_dtype_name(int dtype);
const char *tl_arch_name(int arch);

#endif /* TL_HF_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_HF_IMPLEMENTED)
#define TL_HF_IMPLEMENTED

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

static int tl__gemma_config(const char *s, const tl__jnode *nodes, tl_config *c, int *tie, char *err,
                            size_t errlen); /* tl_gemma.h */

int tl_hf_parse_config(const char *json, size_t len, tl_config *c, char *err, size_t errlen)
{
    tl__jnode *nodes = NULL;
    char why[TL_ERR_LEN], buf[64];
    int v, rc = -1, tie = 0, flag = 0, gemma;
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
    else if (strcmp(buf, "Gemma3ForCausalLM") == 0) c->arch = TL_ARCH_GEMMA3;
    else {
        tl__fail(err, errlen, "config.json: architecture %s is not supported (LlamaForCausalLM, "
                 "MistralForCausalLM, Qwen2ForCausalLM, Gemma3ForCausalLM)", buf);
        goto out;
    }
    gemma = c->arch == TL_ARCH_GEMMA3;
    v = gemma ? -1 : tl__jget(json, nodes, 0, "hidden_act");
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
        (gemma ? tl__gemma_config(json, nodes, c, &tie, err, errlen)
               : tl__jcfg_bool(json, nodes, "tie_word_embeddings", 0, &tie, err, errlen) ||
                     tl__hf_rope(json, nodes, c, err, errlen)))
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
    v = gemma ? -1 : tl__jget(json, nodes, 0, "layer_types"); /* every layer full attention, or refused */
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
    case TL_ARCH_GEMMA3: return "Gemma3ForCausalLM";
    default: return "?";
    }
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

#include "tl_gemma.h"

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
    per = c->arch == TL_ARCH_GEMMA3 ? TL__GEMMA_LAYER_FLOATS(c) : 2 * dim + (c->qkv_bias ? qd + 2 * kv : 0);
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
    if (c->arch == TL_ARCH_GEMMA3 ? tl__gemma_norm(&b, "model.norm.weight", D, o)
                                  : tl__bind_vec(&b, "model.norm.weight", D, o))
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
        if (c->arch == TL_ARCH_GEMMA3) {
            if (tl__gemma_bind_layer(&b, l, &lw, &o))
                goto fail;
            if (layers)
                layers[l] = lw;
            continue;
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

#endif /* TL_HF implementation */
