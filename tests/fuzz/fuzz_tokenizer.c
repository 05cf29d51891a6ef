/* fuzz_tokenizer.c - libFuzzer target for tiny_llama's tokenizer
   (examples/tiny_llama/tiny_llama.h: tl_build_tokenizer, tl_encode,
   tl_decode, tl_print_piece).

   The input is a tokenizer file, byte for byte (llama2.c's tokenizer.bin:
   int32 max_token_length, then per token float32 score, int32 length and
   the bytes). The target counts the complete tokens the file holds, n (at
   most 65536), and loads the file with vocabulary sizes n, n + 1 and a size
   below 3. The file is written to a directory made once per process and
   removed at exit.

   Checks (a violation prints "FUZZ CHECK FAILED" and aborts, so libFuzzer
   keeps the input):
   - a vocabulary below 3 (no room for <s> and </s>) is refused, and so is
     one larger than the file holds (n + 1); a refusal has a message and
     leaves the tokenizer empty;
   - a loaded tokenizer encodes texts (the file's last bytes, a word of its
     own tokens, an empty text) into at most strlen(text) + 3 ids, each inside
     the vocabulary, starting with <s> and ending with </s> when asked;
   - every id decodes to a string, after any previous id, and prints;
   - tl_encode refuses a tokenizer with fewer than 3 tokens.
   Every allocation is freed (LeakSanitizer checks that). */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"
#define FZ_TARGET "fuzz_tokenizer"
#include "fuzz/fuzz_util.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FZ_MAX_VOCAB 65536
#define FZ_MAX_TEXT 64

static FILE *g_null;

/* the file the loader reads: one per process, in a directory of its own */
static const char *fz_file(void)
{
    if (!g_null) {
        g_null = fopen("/dev/null", "w");
        if (!g_null) {
            perror("fuzz_tokenizer: /dev/null");
            abort();
        }
    }
    return fz_scratch_path(FZ_TARGET, "tokenizer.bin");
}

static int fz_i32(const uint8_t *p)
{
    int v;
    memcpy(&v, p, sizeof v);   /* the loader reads native int32, as llama2.c does */
    return v;
}

/* Complete tokens in the file, as far as a token is well formed (a length
   from 0 to 2^20); stops at FZ_MAX_VOCAB. */
static int fz_count_tokens(const uint8_t *data, size_t size)
{
    size_t at = 4;
    int n = 0;
    if (size < 4)
        return 0;
    while (n < FZ_MAX_VOCAB && size - at >= 8) {
        int len = fz_i32(data + at + 4);
        if (len < 0 || len > (1 << 20) || (size_t)len > size - at - 8)
            break;
        at += 8 + (size_t)len;
        n++;
    }
    return n;
}

static void fz_refused(tl_tokenizer *t, const char *path, int vocab, const char *why)
{
    char err[TL_ERR_LEN];
    err[0] = '\0';
    if (tl_build_tokenizer(t, path, vocab, err, sizeof err) == 0) {
        tl_free_tokenizer(t);
        fz_fail(why, "");
    }
    if (err[0] == '\0')
        fz_fail("a refused tokenizer has no message", why);
    if (t->vocab || t->scores || t->sorted || t->vocab_size != 0)
        fz_fail("a refused tokenizer is not empty", err);
}

static void fz_encode(const tl_tokenizer *t, const char *text)
{
    int tokens[FZ_MAX_TEXT + 3], n = -1, i, bos, eos;
    size_t len = strlen(text);
    if (len > FZ_MAX_TEXT)
        abort();   /* the target's own texts are short */
    for (bos = 0; bos <= 1; bos++)
        for (eos = 0; eos <= 1; eos++) {
            if (tl_encode(t, text, bos, eos, tokens, &n) != 0)
                fz_fail("tl_encode failed on a loaded tokenizer", text);
            if (n < 0 || (size_t)n > len + 3)
                fz_fail("tl_encode gave too many ids", text);
            if (n < bos + eos || (bos && tokens[0] != TL_BOS) || (eos && tokens[n - 1] != TL_EOS))
                fz_fail("tl_encode lost <s> or </s>", text);
            for (i = 0; i < n; i++) {
                const char *piece;
                if (tokens[i] < 0 || tokens[i] >= t->vocab_size)
                    fz_fail("tl_encode gave an id outside the vocabulary", text);
                piece = tl_decode(t, i ? tokens[i - 1] : TL_BOS, tokens[i]);
                if (!piece)
                    fz_fail("tl_decode gave no string", text);
                tl_print_piece(g_null, piece);
            }
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fz_file();
    tl_tokenizer t;
    char err[TL_ERR_LEN], text[FZ_MAX_TEXT + 1];
    int n = fz_count_tokens(data, size), i, tokens[8], m = -1;
    size_t tail;

    fz_write_file(path, data, size);
    fz_refused(&t, path, (int)(size % 3), "a vocabulary below 3 was accepted");
    if (n < FZ_MAX_VOCAB)
        fz_refused(&t, path, n + 1, "a vocabulary larger than the file holds was accepted");
    if (n < 3)
        return 0;
    err[0] = '\0';
    if (tl_build_tokenizer(&t, path, n, err, sizeof err) != 0) {
        if (err[0] == '\0')
            fz_fail("a refused tokenizer has no message", "");
        if (t.vocab || t.vocab_size != 0)
            fz_fail("a refused tokenizer is not empty", err);
        return 0;   /* e.g. a negative max_token_length */
    }
    if (t.vocab_size != n || t.max_token_length < 0)
        fz_fail("the loaded tokenizer's sizes are wrong", "");

    /* texts: the input's last bytes; the concatenation of a few tokens; "" */
    tail = size < FZ_MAX_TEXT ? size : FZ_MAX_TEXT;
    memcpy(text, data + size - tail, tail);
    text[tail] = '\0';
    fz_encode(&t, text);
    text[0] = '\0';
    for (i = 0; i < n && i < 8; i++) {
        const char *piece = t.vocab[(size_t)(n - 1 - i) * 7919u % (size_t)n];
        if (strlen(text) + strlen(piece) > FZ_MAX_TEXT)
            break;
        strcat(text, piece);
    }
    fz_encode(&t, text);
    fz_encode(&t, "");
    for (i = -1; i <= n; i++)   /* every id decodes, and ids outside give "" */
        tl_print_piece(g_null, tl_decode(&t, i > 0 ? i - 1 : TL_BOS, i));
    if (strcmp(tl_decode(&t, 0, n), "") != 0 || strcmp(tl_decode(&t, 0, -1), "") != 0)
        fz_fail("an id outside the vocabulary decodes to a piece", "");

    /* the same tokenizer with room for <s> only is refused by tl_encode */
    t.vocab_size = 2;
    if (tl_encode(&t, "a", 1, 1, tokens, &m) == 0)
        fz_fail("tl_encode accepted a vocabulary of 2", "");
    t.vocab_size = n;
    tl_free_tokenizer(&t);
    return 0;
}
