/* tiny_llama.h - a small Llama-architecture inference engine in plain C.

   The example engine of pqcache. It loads llama2.c checkpoints (fp32) and
   Hugging Face model directories (Llama, Mistral, Qwen2; bf16, fp16 or fp32
   safetensors, see tl_hf.h), runs the transformer
   on the CPU (a token at a time, or the prompt in chunks of tokens) and
   splits every layer into
   stages, so that the attention of a decode step can run over an explicit
   subset of the past tokens (sinks + recent window + top-k): the subset a
   KV-cache selection library such as pqcache chooses.

   Use
     In exactly one C (or C++) file:
         #define TINY_LLAMA_IMPLEMENTATION
         #include "tiny_llama.h"
     Other files include it without the macro and get the declarations.
     Link with -lm -lpthread. Needs POSIX (mmap, clock_gettime, pthreads).

   Parts: this header includes them, declarations first, then (with the
   macro) their implementations; include this header, not the parts.
     tl_model.h      the model: config, weights, run state, attention
                     selection, the forward stages and the chunked prefill
     tl_kernels.h    projection kernels (fp32, bf16, fp16 weights as stored;
                     AVX2 chosen at run time) and their thread pool
     tl_prefill.h    the prompt's attention as tiles of queries against tiles
                     of keys with an online softmax (AVX2 + FMA at run time)
     tl_llama2c.h    llama2.c checkpoints: formats, header validation,
                     tl_build_model, random checkpoints
     tl_hf.h         Hugging Face model directories: JSON, safetensors,
                     config.json (RoPE included), binding the tensors
     tl_sampler.h    greedy, temperature and top-p sampling
     tl_tokenizer.h  llama2.c's tokenizer.bin
     tl_util.h       errors, checked sizes, bytes, regular files, the clock
   The pqcache mode (tl_pqcache.h) is a separate header over this one.

   Errors: functions that can fail return 0 on success and non-zero on
   failure, with a message in the caller's buffer (or tl_state.err).
*/
#ifndef TINY_LLAMA_H
#define TINY_LLAMA_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "tl_model.h"
#include "tl_kernels.h"
#include "tl_prefill.h"
#include "tl_llama2c.h"
#include "tl_hf.h"
#include "tl_sampler.h"
#include "tl_tokenizer.h"
#include "tl_util.h"

#ifdef __cplusplus
}
#endif

#endif /* TINY_LLAMA_H */

/* ============================================================================
   Implementation: the parts again, now past their declarations, in an order
   where every internal function is defined before it is used */

#if defined(TINY_LLAMA_IMPLEMENTATION) && !defined(TINY_LLAMA_IMPLEMENTED)
#define TINY_LLAMA_IMPLEMENTED

#if !defined(_POSIX_C_SOURCE) && !defined(__cplusplus)
#define _POSIX_C_SOURCE 200809L
#endif

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tl_util.h"
#include "tl_kernels.h"
#include "tl_prefill.h"
#include "tl_llama2c.h"
#include "tl_hf.h"
#include "tl_model.h"
#include "tl_sampler.h"
#include "tl_tokenizer.h"

#endif /* TINY_LLAMA_IMPLEMENTATION */
