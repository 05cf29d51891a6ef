/* test_loaders.c - tests of tiny_llama's loaders: llama2.c checkpoints
   (tl_llama2c.h: valid files load, truncated, oversized and corrupted ones
   are refused with a message), checkpoints with random weights, the
   tokenizer file (tl_tokenizer.h), and only regular files being read.

   Checkpoints are written here by a writer of the tests' own
   (test_reference.h). greatest's summary line ends the output: "N passed,
   N failed"; the exit status is non-zero if any test failed. */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../tests/greatest.h"
#include "test_support.h"
#include "test_reference.h"

/* ----------------------------------------------------------------------------
   Tests: checkpoint validation */

/* loading path must fail with a message containing `want` */
static int rejects(const char *path, const char *want)
{
    tl_model m;
    char err[TL_ERR_LEN];
    err[0] = '\0';
    if (tl_build_model(&m, path, err, sizeof err) == 0) {
        printf("  %s was accepted\n", path);
        tl_free_model(&m);
        return 0;
    }
    if (err[0] == '\0' || !strstr(err, want)) {
        printf("  error '%s' does not mention '%s'\n", err, want);
        return 0;
    }
    return 1;
}

static int accepts(const char *path)
{
    tl_model m;
    char err[TL_ERR_LEN];
    if (tl_build_model(&m, path, err, sizeof err) != 0) {
        printf("  rejected: %s\n", err);
        return 0;
    }
    tl_free_model(&m);
    return 1;
}

/* copy of the valid file at src with bytes [off, off+4) replaced by v */
static const char *patched(const char *src, const char *name, size_t off, const void *v, size_t n)
{
    size_t len;
    unsigned char *buf = read_file(src, &len);
    const char *path = tmp_path(name);
    if (!buf)
        return path;
    if (off + n <= len)
        memcpy(buf + off, v, n);
    write_file(path, buf, len);
    free(buf);
    return path;
}

static const char *resized(const char *src, const char *name, long delta)
{
    size_t len;
    unsigned char *buf = read_file(src, &len);
    unsigned char *big;
    const char *path = tmp_path(name);
    if (!buf)
        return path;
    big = (unsigned char *)calloc(len + 64, 1);
    memcpy(big, buf, len);
    write_file(path, big, (size_t)((long)len + delta));
    free(buf);
    free(big);
    return path;
}

TEST valid_checkpoints_load(void)
{
    spec s = small_spec();
    ASSERT(write_spec(tmp_path("v1.bin"), &s) == 0);
    ASSERT(accepts(tmp_path("v1.bin")));
    s.legacy = 1;
    s.shared = 0;
    ASSERT(write_spec(tmp_path("legacy.bin"), &s) == 0);
    ASSERT(accepts(tmp_path("legacy.bin")));
    {
        tl_model m;
        char err[TL_ERR_LEN];
        ASSERT(tl_build_model(&m, tmp_path("legacy.bin"), err, sizeof err) == 0);
        ASSERT(m.config.vocab_size == 40 && m.config.shared_classifier == 0);
        ASSERT(m.config.head_size == 8 && m.config.kv_dim == 16);
        ASSERT(m.config.rope_theta == 10000.0f && m.config.version == 0);
        tl_free_model(&m);
        ASSERT(tl_build_model(&m, tmp_path("v1.bin"), err, sizeof err) == 0);
        ASSERT(m.config.rope_theta == 500000.0f && m.config.version == 1);
        ASSERT(m.config.shared_classifier == 1 && m.w.wcls == m.w.token_embedding);
        tl_free_model(&m);
    }
    PASS();
}

TEST truncated_and_oversized_files_are_rejected(void)
{
    spec s = small_spec();
    char v1[600], leg[600];   /* own copies: tmp_path reuses its buffers */
    size_t len;
    unsigned char *buf;
    strcpy(v1, tmp_path("ok_v1.bin"));
    strcpy(leg, tmp_path("ok_legacy.bin"));
    write_spec(v1, &s);
    s.legacy = 1;
    write_spec(leg, &s);
    ASSERT(rejects(resized(v1, "short.bin", -4), "truncated"));
    ASSERT(rejects(resized(v1, "long.bin", 4), "trailing"));
    ASSERT(rejects(resized(v1, "long1.bin", 1), "trailing"));
    ASSERT(rejects(resized(leg, "lshort.bin", -4), "truncated"));
    ASSERT(rejects(resized(leg, "llong.bin", 8), "trailing"));
    /* header cut off */
    buf = read_file(v1, &len);
    write_file(tmp_path("head100.bin"), buf, 100);
    ASSERT(rejects(tmp_path("head100.bin"), "truncated header"));
    write_file(tmp_path("head3.bin"), buf, 3);
    ASSERT(rejects(tmp_path("head3.bin"), "too small"));
    write_file(tmp_path("empty.bin"), buf, 0);
    ASSERT(rejects(tmp_path("empty.bin"), "empty"));
    free(buf);
    buf = read_file(leg, &len);
    write_file(tmp_path("lhead20.bin"), buf, 20);
    ASSERT(rejects(tmp_path("lhead20.bin"), "not a checkpoint"));
    free(buf);
    ASSERT(rejects(tmp_path("does_not_exist.bin"), "cannot open"));
    PASS();
}

TEST corrupted_headers_are_rejected(void)
{
    spec s = small_spec();
    char v1[600], leg[600];   /* own copies: tmp_path reuses its buffers */
    const char *names[7] = { "dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                             "vocab_size", "seq_len" };
    unsigned char bad_magic[4] = { 0x32, 0x34, 0x6b, 0x62 };
    unsigned char one = 1, two = 2;
    int i, v, zero = 0, neg = -3, big = 0x40000000, int_min = -2147483647 - 1;
    float theta;
    strcpy(v1, tmp_path("ok_v1.bin"));
    strcpy(leg, tmp_path("ok_legacy.bin"));
    write_spec(v1, &s);
    s.legacy = 1;
    write_spec(leg, &s);

    ASSERT(rejects(patched(v1, "magic.bin", 0, bad_magic, 4), "not a checkpoint"));
    v = 2;
    ASSERT(rejects(patched(v1, "ver2.bin", 4, &v, 4), "version 2 is not supported"));
    v = 0;
    ASSERT(rejects(patched(v1, "ver0.bin", 4, &v, 4), "version 0 is not supported"));
    for (i = 0; i < 7; i++) {
        char name[64];
        snprintf(name, sizeof name, "zero%d.bin", i);
        ASSERT(rejects(patched(v1, name, 8 + 4 * (size_t)i, &zero, 4), names[i]));
        snprintf(name, sizeof name, "neg%d.bin", i);
        ASSERT(rejects(patched(v1, name, 8 + 4 * (size_t)i, &neg, 4), names[i]));
        snprintf(name, sizeof name, "lzero%d.bin", i);
        ASSERT(rejects(patched(leg, name, 4 * (size_t)i, &zero, 4), names[i]));
        /* 2^30: inconsistent with the file size (a version 1 file's size does
           not depend on seq_len, a legacy one's does through the RoPE tables) */
        snprintf(name, sizeof name, "big%d.bin", i);
        if (i < 6)
            ASSERT(rejects(patched(v1, name, 8 + 4 * (size_t)i, &big, 4), "version 1 header"));
        else
            ASSERT(rejects(patched(leg, name, 4 * (size_t)i, &big, 4), "legacy header"));
    }
    /* legacy: negative vocab is valid (own classifier), INT_MIN is not */
    ASSERT(rejects(patched(leg, "lmin.bin", 20, &int_min, 4), "vocab_size"));
    /* n_heads 4, n_kv_heads 3 */
    v = 3;
    ASSERT(rejects(patched(v1, "gqa.bin", 24, &v, 4), "multiple of n_kv_heads"));
    ASSERT(rejects(patched(leg, "lgqa.bin", 16, &v, 4), "multiple of n_kv_heads"));
    /* n_kv_heads > n_heads: 8 > 4 */
    v = 8;
    ASSERT(rejects(patched(v1, "kvbig.bin", 24, &v, 4), "multiple of n_kv_heads"));
    /* dim 32 with 3 heads does not divide; with 16 heads the head size is 2,
       with 32 heads it is 1 (odd), with 4 heads and dim 12 it is 3 (odd) */
    v = 3;
    ASSERT(rejects(patched(v1, "heads3.bin", 20, &v, 4), "not a multiple of n_heads"));
    v = 12;
    ASSERT(rejects(patched(v1, "odd.bin", 8, &v, 4), "odd"));
    v = 32;
    {
        const char *p = patched(v1, "odd32a.bin", 20, &v, 4);
        ASSERT(rejects(patched(p, "odd32.bin", 24, &v, 4), "odd"));
    }
    ASSERT(rejects(patched(v1, "shared2.bin", 36, &two, 1), "shared_classifier"));
    ASSERT(rejects(patched(v1, "pad.bin", 100, &one, 1), "padding byte 100"));
    ASSERT(rejects(patched(v1, "pad37.bin", 37, &one, 1), "padding byte 37"));
    theta = -1.0f;
    ASSERT(rejects(patched(v1, "theta_neg.bin", 40, &theta, 4), "rope_theta"));
    theta = (float)NAN;
    ASSERT(rejects(patched(v1, "theta_nan.bin", 40, &theta, 4), "rope_theta"));
    theta = (float)INFINITY;
    ASSERT(rejects(patched(v1, "theta_inf.bin", 40, &theta, 4), "rope_theta"));
    /* sizes whose product overflows size_t */
    {
        const char *p = patched(v1, "ovf_a.bin", 8, &big, 4);        /* dim 2^30 */
        p = patched(p, "ovf_b.bin", 12, &big, 4);                     /* hidden 2^30 */
        v = 0x7fffffff;
        p = patched(p, "ovf_c.bin", 16, &v, 4);                       /* layers */
        ASSERT(rejects(p, "version 1 header"));
    }
    PASS();
}

TEST header_parsing_gives_the_weights_offset_and_the_file_size(void)
{
    unsigned char h[256];
    tl_config c;
    size_t off = 0;
    char err[TL_ERR_LEN];
    tl_config want;
    memset(h, 0, sizeof h);
    /* a legacy header claims 28 + n floats; check the size it computes */
    memset(&want, 0, sizeof want);
    want.dim = 8; want.hidden_dim = 16; want.n_layers = 1; want.n_heads = 2;
    want.n_kv_heads = 1; want.vocab_size = 10; want.seq_len = 4;
    want.shared_classifier = 1; want.rope_theta = 10000.0f;
    ASSERT(tl_check_config(&want, err, sizeof err) == 0);
    /* floats: emb 80, rms_att 8, wq 64, wk 32, wv 32, wo 64, rms_ffn 8,
       w1 128, w2 128, w3 128, rms_final 8, rope 4 * 4 = 16 */
    ASSERT(tl_checkpoint_size(&want, 0) == 28 + 4 * (80 + 8 + 64 + 32 + 32 + 64 + 8 +
                                                    128 * 3 + 8 + 16));
    ASSERT(tl_checkpoint_size(&want, 1) == 256 + 4 * (80 + 8 + 64 + 32 + 32 + 64 + 8 +
                                                     128 * 3 + 8));
    {
        int ints[7] = { 8, 16, 1, 2, 1, 10, 4 };
        memcpy(h, ints, sizeof ints);
        ASSERT(tl_parse_header(h, 28, tl_checkpoint_size(&want, 0), &c, &off, err, sizeof err) == 0);
        ASSERT(off == 28 && c.kv_dim == 4 && c.head_size == 4);
        ASSERT(tl_parse_header(h, 28, tl_checkpoint_size(&want, 0) + 4, &c, &off, err,
                              sizeof err) != 0);
        ASSERT(tl_parse_header(h, 2, 2, &c, &off, err, sizeof err) != 0);
    }
    PASS();
}

/* ----------------------------------------------------------------------------
   Tests: random checkpoints */

TEST random_checkpoints_give_the_same_model_in_both_formats(void)
{
    tl_config c = gen_config();
    char err[TL_ERR_LEN];
    tl_model a, b;
    tl_state sa, sb;
    int pos, same = 1;
    double d;
    c.shared_classifier = 0;
    ASSERT(tl_write_random_checkpoint(tmp_path("gen1.bin"), &c, 0, 3, err, sizeof err) == 0);
    ASSERT(tl_write_random_checkpoint(tmp_path("gen0.bin"), &c, 1, 3, err, sizeof err) == 0);
    d = max_diff_vs_reference(tmp_path("gen1.bin"), 16);
    ASSERT(d >= 0.0 && d < 1e-4);
    /* same seed: the same model in both formats */
    ASSERT(tl_build_model(&a, tmp_path("gen1.bin"), err, sizeof err) == 0);
    ASSERT(tl_build_model(&b, tmp_path("gen0.bin"), err, sizeof err) == 0);
    ASSERT(a.config.version == 1 && b.config.version == 0);
    ASSERT(tl_build_state(&sa, &a.config, 0, 1, err, sizeof err) == 0);
    ASSERT(tl_build_state(&sb, &b.config, 0, 1, err, sizeof err) == 0);
    for (pos = 0; pos < 10; pos++) {
        float *la = tl_forward(&a, &sa, NULL, pos * 3 % 50, pos);
        float *lb = tl_forward(&b, &sb, NULL, pos * 3 % 50, pos);
        same &= la && lb && memcmp(la, lb, 50 * sizeof(float)) == 0;
    }
    ASSERT(same);
    tl_free_state(&sa); tl_free_state(&sb);
    tl_free_model(&a); tl_free_model(&b);
    /* a legacy header cannot carry theta; a bad config is refused */
    c.rope_theta = 5e5f;
    ASSERT(tl_write_random_checkpoint(tmp_path("gen2.bin"), &c, 1, 3, err, sizeof err) != 0);
    c.rope_theta = 0.0f;
    c.n_kv_heads = 3;
    ASSERT(tl_write_random_checkpoint(tmp_path("gen3.bin"), &c, 0, 3, err, sizeof err) != 0);
    PASS();
}

/* ----------------------------------------------------------------------------
   Tests: the tokenizer file */

static int write_tokenizer(const char *path, int *vocab_size)
{
    FILE *f = fopen(path, "wb");
    int max_len = 8, i;
    char piece[16];
    const char *extra[] = { " ", "a", "b", "ab", " ab", "c", "\xc3\xa9" };
    float extra_score[] = { -1.0f, -2.0f, -2.0f, 1.0f, 2.0f, -2.0f, -3.0f };
    if (!f)
        return -1;
    fwrite(&max_len, 4, 1, f);
    for (i = 0; i < 3 + 256 + 7; i++) {
        float score = 0.0f;
        int len;
        if (i == 0) strcpy(piece, "<unk>");
        else if (i == 1) strcpy(piece, "\n<s>\n");
        else if (i == 2) strcpy(piece, "\n</s>\n");
        else if (i < 259) snprintf(piece, sizeof piece, "<0x%02X>", i - 3);
        else {
            strcpy(piece, extra[i - 259]);
            score = extra_score[i - 259];
        }
        len = (int)strlen(piece);
        fwrite(&score, 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(piece, 1, (size_t)len, f);
    }
    *vocab_size = 3 + 256 + 7;
    return fclose(f);
}

TEST tokenizer_encodes_by_merges_and_falls_back_to_bytes(void)
{
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    int vocab = 0, tokens[32], n = 0;
    ASSERT(write_tokenizer(tmp_path("tok.bin"), &vocab) == 0);
    ASSERT(tl_build_tokenizer(&t, tmp_path("tok.bin"), vocab, err, sizeof err) == 0);
    /* " " a b " " c -> " " ab " " c -> " ab" " " c */
    ASSERT(tl_encode(&t, "ab c", 1, 0, tokens, &n) == 0);
    ASSERT(n == 4 && tokens[0] == 1 && tokens[1] == 263 && tokens[2] == 259 && tokens[3] == 264);
    ASSERT(strcmp(tl_decode(&t, 1, 263), "ab") == 0);      /* first word loses its space */
    ASSERT(strcmp(tl_decode(&t, 5, 263), " ab") == 0);
    /* a known code point, and unknown bytes falling back to <0xNN> tokens */
    ASSERT(tl_encode(&t, "\xc3\xa9\xe2\x82\xac", 0, 1, tokens, &n) == 0);
    ASSERT(n == 6 && tokens[0] == 259 && tokens[1] == 265 && tokens[2] == 3 + 0xe2 &&
          tokens[3] == 3 + 0x82 && tokens[4] == 3 + 0xac && tokens[5] == 2);
    ASSERT(strcmp(tl_decode(&t, 0, 3 + 0x41), "A") == 0);
    ASSERT(tl_decode(&t, 0, 3 + 0xe2)[0] == '\xe2');
    ASSERT(strcmp(tl_decode(&t, 0, 9999), "") == 0);
    ASSERT(tl_encode(&t, "", 1, 0, tokens, &n) == 0 && n == 1 && tokens[0] == 1);
    tl_free_tokenizer(&t);
    /* a vocabulary larger than the file holds is an error, not a crash */
    ASSERT(tl_build_tokenizer(&t, tmp_path("tok.bin"), vocab + 1, err, sizeof err) != 0);
    /* a vocabulary the file's size cannot hold is refused before allocating */
    err[0] = '\0';
    ASSERT(tl_build_tokenizer(&t, tmp_path("tok.bin"), 1 << 30, err, sizeof err) != 0);
    ASSERT(strstr(err, "cannot hold 1073741824 tokens") != NULL && t.vocab == NULL);
    ASSERT(tl_build_tokenizer(&t, tmp_path("nope.bin"), vocab, err, sizeof err) != 0);
    PASS();
}

/* A tokenizer file of the given pieces and scores (max_token_length 8). */
static int write_pieces(const char *path, const char *const *pieces, const float *scores, int n)
{
    FILE *f = fopen(path, "wb");
    int max_len = 8, i;
    if (!f)
        return -1;
    fwrite(&max_len, 4, 1, f);
    for (i = 0; i < n; i++) {
        int len = (int)strlen(pieces[i]);
        fwrite(&scores[i], 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(pieces[i], 1, (size_t)len, f);
    }
    return fclose(f);
}

/* <s> is a marker, not text: it stays first even when its piece joined to
   the next one spells a token (an empty piece for <s> joins with anything) */
TEST tokenizer_keeps_bos_first(void)
{
    const char *pieces[] = { "<unk>", "", "</s>", "a", "b", "ab", " ", "x", "xa" };
    const float scores[] = { 0.0f, 0.0f, 0.0f, -1.0f, -1.0f, 1.0f, -1.0f, -1.0f, 5.0f };
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    int tokens[16], n = -1;
    ASSERT(write_pieces(tmp_path("tok_bos.bin"), pieces, scores, 9) == 0);
    ASSERT(tl_build_tokenizer(&t, tmp_path("tok_bos.bin"), 9, err, sizeof err) == 0);
    /* " " a b -> " " ab; <s> stays in front */
    ASSERT(tl_encode(&t, "ab", 1, 1, tokens, &n) == 0);
    ASSERT(n == 4 && tokens[0] == TL_BOS && tokens[1] == 6 && tokens[2] == 5 && tokens[3] == TL_EOS);
    /* without <s>, the same pieces merge as before */
    ASSERT(tl_encode(&t, "xa", 0, 0, tokens, &n) == 0);
    ASSERT(n == 2 && tokens[0] == 6 && tokens[1] == 8);
    tl_free_tokenizer(&t);
    /* <s> spelled "x" and no dummy prefix (" " is "y" now): "x" + "a" would
       be "xa", the best-scored merge */
    pieces[1] = "x";
    pieces[6] = "y";
    ASSERT(write_pieces(tmp_path("tok_bos2.bin"), pieces, scores, 9) == 0);
    ASSERT(tl_build_tokenizer(&t, tmp_path("tok_bos2.bin"), 9, err, sizeof err) == 0);
    ASSERT(tl_encode(&t, "a", 1, 0, tokens, &n) == 0);
    ASSERT(n == 2 && tokens[0] == TL_BOS && tokens[1] == 3);
    tl_free_tokenizer(&t);
    PASS();
}

/* A vocabulary without room for the ids of <s> (1) and </s> (2) is refused
   when the tokenizer is read, and tl_encode refuses a tokenizer built by
   hand with one (it would look up the pieces of ids past the end). */
TEST tokenizer_refuses_a_vocabulary_too_small_for_bos_and_eos(void)
{
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    char piece_a[] = "a", piece_b[] = "b";
    char *vocab[2];
    float scores[2] = { 0.0f, 0.0f };
    tl_token_index sorted[2];
    int full = 0, tokens[16], n = -1, size;
    ASSERT(write_tokenizer(tmp_path("tok_small.bin"), &full) == 0);
    for (size = -1; size < 3; size++) {
        err[0] = '\0';
        ASSERT(tl_build_tokenizer(&t, tmp_path("tok_small.bin"), size, err, sizeof err) != 0);
        ASSERT(strstr(err, "too small") != NULL);
        ASSERT(t.vocab == NULL && t.vocab_size == 0);
    }
    ASSERT(tl_build_tokenizer(&t, tmp_path("tok_small.bin"), 3, err, sizeof err) == 0);
    /* three tokens are enough: the bytes of "ab" fall back to <unk> (0) */
    ASSERT(tl_encode(&t, "ab", 1, 1, tokens, &n) == 0 && n == 4 && tokens[0] == TL_BOS &&
          tokens[1] == 0 && tokens[2] == 0 && tokens[3] == TL_EOS);
    tl_free_tokenizer(&t);

    vocab[0] = piece_a;
    vocab[1] = piece_b;
    sorted[0].str = piece_a;
    sorted[0].id = 0;
    sorted[1].str = piece_b;
    sorted[1].id = 1;
    memset(&t, 0, sizeof t);
    t.max_token_length = 1;
    t.vocab = vocab;
    t.scores = scores;
    t.sorted = sorted;
    for (size = 1; size <= 2; size++) {
        t.vocab_size = size;
        n = -1;
        ASSERT(tl_encode(&t, "ab", 1, 1, tokens, &n) != 0 && n == 0);
        n = -1;
        ASSERT(tl_encode(&t, "a", 0, 0, tokens, &n) != 0 && n == 0);
    }
    /* an empty (freed or failed) tokenizer encodes nothing */
    memset(&t, 0, sizeof t);
    ASSERT(tl_encode(&t, "a", 1, 0, tokens, &n) != 0 && n == 0);
    PASS();
}

/* ----------------------------------------------------------------------------
   Tests: only regular files are read */

/* The loaders read regular files only; a named pipe must not block them (it
   would wait for a writer forever), and a device or directory is refused. */
TEST loaders_refuse_pipes_devices_and_directories(void)
{
    tl_model m;
    tl_tokenizer t;
    char err[TL_ERR_LEN];
    const char *fifo = tmp_path("pipe");
    double t0 = tl_time_s();
    ASSERT(mkfifo(fifo, 0600) == 0);
    err[0] = '\0';
    ASSERT(tl_build_model(&m, fifo, err, sizeof err) != 0);
    ASSERT(strstr(err, "named pipe") != NULL && strstr(err, "not a regular file") != NULL);
    ASSERT(m.map == NULL);
    err[0] = '\0';
    ASSERT(tl_build_tokenizer(&t, fifo, 300, err, sizeof err) != 0);
    ASSERT(strstr(err, "named pipe") != NULL && t.vocab == NULL);
    /* a directory */
    err[0] = '\0';
    ASSERT(tl_build_model(&m, g_dir, err, sizeof err) != 0 && strstr(err, "directory") != NULL);
    err[0] = '\0';
    ASSERT(tl_build_tokenizer(&t, g_dir, 300, err, sizeof err) != 0 &&
          strstr(err, "directory") != NULL);
    /* character devices: /dev/null reads as empty, /dev/zero as an endless
       run of zeros (which would make a tokenizer of empty tokens) */
    if (access("/dev/null", R_OK) == 0) {
        err[0] = '\0';
        ASSERT(tl_build_model(&m, "/dev/null", err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
        err[0] = '\0';
        ASSERT(tl_build_tokenizer(&t, "/dev/null", 300, err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
    }
    if (access("/dev/zero", R_OK) == 0) {
        err[0] = '\0';
        ASSERT(tl_build_model(&m, "/dev/zero", err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
        err[0] = '\0';
        ASSERT(tl_build_tokenizer(&t, "/dev/zero", 300, err, sizeof err) != 0 &&
              strstr(err, "character device") != NULL);
    }
    /* a missing file still says why */
    err[0] = '\0';
    ASSERT(tl_build_model(&m, tmp_path("missing.bin"), err, sizeof err) != 0 &&
          strstr(err, "cannot open") != NULL);
    ASSERT(tl_time_s() - t0 < 10.0);
    PASS();
}

/* ----------------------------------------------------------------------------
   Main */

SUITE(llama2c_checkpoints)
{
    RUN_TEST(valid_checkpoints_load);
    RUN_TEST(truncated_and_oversized_files_are_rejected);
    RUN_TEST(corrupted_headers_are_rejected);
    RUN_TEST(header_parsing_gives_the_weights_offset_and_the_file_size);
    RUN_TEST(random_checkpoints_give_the_same_model_in_both_formats);
}

SUITE(tokenizer)
{
    RUN_TEST(tokenizer_encodes_by_merges_and_falls_back_to_bytes);
    RUN_TEST(tokenizer_refuses_a_vocabulary_too_small_for_bos_and_eos);
    RUN_TEST(tokenizer_keeps_bos_first);
}

SUITE(regular_files)
{
    RUN_TEST(loaders_refuse_pipes_devices_and_directories);
}

GREATEST_MAIN_DEFS();

int main(int argc, char **argv)
{
    GREATEST_MAIN_BEGIN();
    if (make_test_dir("tiny_llama_loaders") != 0) {
        printf("cannot create a temporary directory\n0 passed, 1 failed\n");
        return 1;
    }
    RUN_SUITE(llama2c_checkpoints);
    RUN_SUITE(tokenizer);
    RUN_SUITE(regular_files);
    remove_test_dir();
    GREATEST_MAIN_END();
}
