# passkey.mk - the constructed passkey model (examples/tiny_llama/tools/make_passkey.c
# and passkey_verify.h, its numerical checks).
# Include from the top-level Makefile (build.mk includes it too; including it
# twice is harmless); paths are relative to the repository root.
#
#   make build/make_passkey    generator, prompt writer and numerical checker
#   make build/passkey.bin     the checkpoint (max_seq_len 131072, rope_theta 1e9)
#   make passkey-check         write the checkpoint and verify retrieval up to
#                              131072 tokens (PASSKEY_VERIFY=--quick: 5 depths)
#   make build/passkey_hard.bin  the harder variant (make_passkey --hard):
#                              layer-1 filler keys in topic clusters with noise,
#                              where plain PQ loses the needle; max_seq_len
#                              135168, so that a 131072-token prompt and its
#                              decode steps fit
#   make passkey-check-hard    write and verify the harder variant
#   make passkey-cxx           the same source compiled as C++

ifndef TINY_LLAMA_PASSKEY_MK
TINY_LLAMA_PASSKEY_MK := 1

include examples/tiny_llama/flags.mk

PASSKEY_SRC := examples/tiny_llama/tools/make_passkey.c
# the source and the file it includes
PASSKEY_SRCS := $(PASSKEY_SRC) examples/tiny_llama/tools/passkey_verify.h
PASSKEY_VERIFY ?= --quick

build/make_passkey: $(PASSKEY_SRCS)
	@mkdir -p build
	$(CC) $(TINY_LLAMA_CFLAGS) -o $@ $(PASSKEY_SRC) -lm

build/make_passkey_cxx: $(PASSKEY_SRCS)
	@mkdir -p build
	$(CXX) $(CFLAGS) -x c++ -std=c++11 $(TINY_LLAMA_WARN) -o $@ $(PASSKEY_SRC) -lm

build/passkey.bin: build/make_passkey
	build/make_passkey $@

PASSKEY_HARD_SEQ ?= 135168
build/passkey_hard.bin: build/make_passkey
	build/make_passkey --hard --seq-len $(PASSKEY_HARD_SEQ) $@

passkey-check-hard: build/make_passkey
	build/make_passkey --hard --seq-len $(PASSKEY_HARD_SEQ) --verify build/passkey_hard.bin $(PASSKEY_VERIFY)

passkey-check: build/make_passkey
	build/make_passkey --verify build/passkey.bin $(PASSKEY_VERIFY)

passkey-cxx: build/make_passkey_cxx

.PHONY: passkey-check passkey-check-hard passkey-cxx

endif # TINY_LLAMA_PASSKEY_MK
