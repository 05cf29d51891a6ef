# flags.mk - the compile flags of the tiny_llama example's rules. build.mk,
# passkey.mk and needle.mk include it (including it twice is harmless).
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

endif # TINY_LLAMA_FLAGS_MK
