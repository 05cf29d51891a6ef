/* fuzz_checkpoint.c - libFuzzer target for tiny_llama's checkpoint loader
   (examples/tiny_llama/tiny_llama.h: tl_parse_header, tl_build_model).

   The input is a checkpoint file, byte for byte (either llama2.c format: a
   version 1 header of 256 bytes or a legacy header of 7 int32).

   Checks (a violation prints "FUZZ CHECK FAILED" and aborts, so libFuzzer
   keeps the input):
   - tl_parse_header on the input in memory either fails with a message, or
     accepts a config that passes tl_check_config, whose tl_checkpoint_size is
     the input's size exactly, and whose weights start right after the header;
   - an accepted input is a usable model: its weights are mapped onto a copy
     of exactly the input's bytes and one forward step runs (token 0 at
     position 0) and gives finite or non-finite logits but reads no byte
     outside the copy (ASan checks that);
   - tl_build_model on the same bytes written to a regular file agrees: it
     loads an accepted input with the same config and refuses a rejected one
     with a message. The file lives in a directory made once per process and
     removed at exit.
   Every allocation is freed (LeakSanitizer checks that). */
#ifndef __cplusplus
#define _POSIX_C_SOURCE 200809L
#endif
#define TINY_LLAMA_IMPLEMENTATION
#include "tiny_llama.h"
#define FZ_TARGET "fuzz_checkpoint"
#include "fuzz/fuzz_util.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* the file the loader reads: one per process, in a directory of its own */
static const char *fz_file(void)
{
    return fz_scratch_path(FZ_TARGET, "checkpoint.bin");
}

static int fz_same_config(const tl_config *a, const tl_config *b)
{
    return a->dim == b->dim && a->hidden_dim == b->hidden_dim && a->n_layers == b->n_layers &&
           a->n_heads == b->n_heads && a->n_kv_heads == b->n_kv_heads &&
           a->vocab_size == b->vocab_size && a->seq_len == b->seq_len &&
           a->shared_classifier == b->shared_classifier && a->rope_theta == b->rope_theta &&
           a->version == b->version && a->head_size == b->head_size && a->kv_dim == b->kv_dim;
}

/* one forward step of the model whose weights are the bytes at copy */
static void fz_forward(const tl_config *c, const unsigned char *copy, size_t woff)
{
    tl_model m;
    tl_state s;
    char err[TL_ERR_LEN];
    memset(&m, 0, sizeof m);
    m.config = *c;
    tl__map_weights(&m, (const float *)(const void *)(copy + woff));
    if (tl_build_state(&s, c, 1, 1, err, sizeof err) != 0)
        return;   /* a config too large for this machine's memory: a message, no crash */
    if (!tl_forward(&m, &s, NULL, 0, 0))
        fz_fail("the forward step of an accepted checkpoint failed", s.err);
    tl_free_state(&s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tl_config c, loaded;
    tl_model m;
    char err[TL_ERR_LEN], why[TL_ERR_LEN];
    size_t woff = 0;
    int ok;

    err[0] = '\0';
    ok = tl_parse_header(data, size < TL_HEADER_V1_SIZE ? size : TL_HEADER_V1_SIZE, size, &c,
                         &woff, err, sizeof err) == 0;
    if (ok) {
        tl_config check = c;
        unsigned char *copy;
        if (tl_check_config(&check, why, sizeof why) != 0 || !fz_same_config(&check, &c))
            fz_fail("an accepted header fails tl_check_config", why);
        if (tl_checkpoint_size(&c, c.version) != size)
            fz_fail("an accepted checkpoint's size is not the size its header implies", "");
        if (woff != (c.version == 1 ? (size_t)TL_HEADER_V1_SIZE : (size_t)TL_HEADER_LEGACY_SIZE))
            fz_fail("the weights of an accepted checkpoint start at a wrong offset", "");
        copy = (unsigned char *)malloc(size);
        if (!copy)
            abort();
        memcpy(copy, data, size);
        fz_forward(&c, copy, woff);
        free(copy);
    } else if (err[0] == '\0') {
        fz_fail("tl_parse_header failed without a message", "");
    }

    fz_write_file(fz_file(), data, size);
    err[0] = '\0';
    if (tl_build_model(&m, fz_file(), err, sizeof err) == 0) {
        loaded = m.config;
        tl_free_model(&m);
        if (!ok)
            fz_fail("tl_build_model accepts a file tl_parse_header rejects", "");
        if (!fz_same_config(&loaded, &c))
            fz_fail("tl_build_model and tl_parse_header read different configs", "");
    } else {
        if (ok && size > 0)
            fz_fail("tl_build_model rejects a file tl_parse_header accepts", err);
        if (err[0] == '\0')
            fz_fail("tl_build_model failed without a message", "");
        if (m.map != NULL)
            fz_fail("a failed tl_build_model left a mapping", err);
    }
    return 0;
}
