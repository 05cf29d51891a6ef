# flags.mk - the compile flags of the tiny_llama example's rules, and the
# engine's headers they depend on. build.mk and tools/passkey.mk, needle.mk and
# mpi.mk include it (including it twice is harmless).
#
# Every rule compiles with the includer's CFLAGS (optimisation, debugging,
# sanitizers) followed by TINY_LLAMA_STD and TINY_LLAMA_WARN, so the sources
# are always compiled as C99 with warnings as errors, whatever CFLAGS holds
# (a Makefile that sets CFLAGS first, like the top-level one, included).

ifndef TINY_LLAMA_FLAGS_MK
TINY_LLAMA_FLAGS_MK := 1

CFLAGS ?= -O2
TINY_LLAMA_STD := -std=c99
TINY_LLAMA_WARN := -Wall -Wextra -Werror -pedantic
TINY_LLAMA_CFLAGS = $(CFLAGS) $(TINY_LLAMA_STD) $(TINY_LLAMA_WARN)

# tiny_llama.h and the parts it includes
TINY_LLAMA_ENGINE := $(addprefix examples/tiny_llama/,tiny_llama.h tl_model.h tl_kernels.h tl_prefill.h \
                       tl_llama2c.h tl_hf.h tl_gemma.h tl_sampler.h tl_tokenizer.h tl_util.h)

endif # TINY_LLAMA_FLAGS_MK
