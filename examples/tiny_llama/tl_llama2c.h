/* tl_llama2c.h - llama2.c checkpoints for tiny_llama: the two formats,
   header validation, mapping the file (tl_build_model, which hands a
   directory to tl_build_hf_model), and checkpoints with random weights.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file.

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
*/
#ifndef TL_LLAMA2C_H
#define TL_LLAMA2C_H

#define TL_MAGIC 0x616b3432u     /* "ak42" in llama2.c's versioned header */
#define TL_HEADER_V1_SIZE 256
#define TL_HEADER_LEGACY_SIZE 28

/* Reads and validates a header. `data` holds the first min(file_size, 256)
   bytes of a file of `file_size` bytes. On success fills *c and the byte
   offset where the weights start. */
int tl_parse_header(const unsigned char *data, size_t data_len, size_t file_size,
                    tl_config *c, size_t *weights_offset, char *err, size_t errlen);
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

#endif /* TL_LLAMA2C_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_LLAMA2C_IMPLEMENTED)
#define TL_LLAMA2C_IMPLEMENTED

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

#endif /* TL_LLAMA2C implementation */
