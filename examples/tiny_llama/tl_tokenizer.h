/* tl_tokenizer.h - llama2.c's tokenizer for tiny_llama: tokenizer.bin read
   and checked, text encoded by merging pairs by score, tokens decoded.

   Part of tiny_llama.h, which includes it: include tiny_llama.h, not this file. */
#ifndef TL_TOKENIZER_H
#define TL_TOKENIZER_H

#define TL_BOS 1                 /* llama2.c tokenizer: beginning of sequence */
#define TL_EOS 2                 /* end of sequence */

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

#endif /* TL_TOKENIZER_H */

/* ============================================================================
   Implementation (where tiny_llama.h is included with TINY_LLAMA_IMPLEMENTATION) */

#if defined(TINY_LLAMA_IMPLEMENTED) && !defined(TL_TOKENIZER_IMPLEMENTED)
#define TL_TOKENIZER_IMPLEMENTED

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

#endif /* TL_TOKENIZER implementation */
