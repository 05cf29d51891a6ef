# examples/tiny_llama/build.mk - Makefile fragment for the tiny_llama example.
# Include it from the top-level Makefile (paths are relative to the repository
# root). It uses the includer's CC and CFLAGS, and includes tools/passkey.mk
# and tools/needle.mk (targets build/passkey.bin, passkey-check, needle).
#
#   make tiny_llama         build/tiny_llama (engine) and build/tiny_llama_gen
#   make tiny_llama_test    build and run the tests, a command-line smoke test
#                           and the warning checks
#   make tiny_llama_check   compile every file with -Wall -Wextra -Werror
#                           -pedantic as C99 (gcc, clang) and as C++ (g++,
#                           clang++); compilers that are missing are skipped
#   make bench-hf           memory bandwidth and the decode of a generated
#                           Llama-3.2-1B-shaped bf16 model at a 4K context:
#                           GB/s of weights read per token vs the bandwidth
#   make tiny_llama_demo    the passkey model at a 32K context: full, pqcache,
#                           oracle and window side by side (retrieval, decode
#                           speed, pqcache's select/fetch time, hit rate, bytes
#                           moved, device memory, agreement and KL vs full)

# Compile flags: $(CFLAGS), then -std=c99 and the warnings (flags.mk).
include examples/tiny_llama/flags.mk
include examples/tiny_llama/tools/passkey.mk
include examples/tiny_llama/tools/needle.mk

TINY_LLAMA_DIR := examples/tiny_llama
TINY_LLAMA_LIBS := -lm -lpthread
TINY_LLAMA_TOOLS := $(TINY_LLAMA_DIR)/tools
TINY_LLAMA_SRCS := $(TINY_LLAMA_DIR)/run.c $(TINY_LLAMA_TOOLS)/gen_random.c \
                   $(TINY_LLAMA_DIR)/test_tiny_llama.c $(TINY_LLAMA_DIR)/test_loaders.c \
                   $(TINY_LLAMA_DIR)/test_pqcache_mode.c \
                   $(TINY_LLAMA_TOOLS)/needle.c $(TINY_LLAMA_TOOLS)/make_passkey.c \
                   $(TINY_LLAMA_TOOLS)/bench_hf.c
TINY_LLAMA_PQ_DEPS := $(TINY_LLAMA_ENGINE) $(TINY_LLAMA_DIR)/tl_pqcache.h pqcache.h
# the C tests' harness (the project's greatest.h) and shared helpers
TINY_LLAMA_TEST_DEPS := tests/greatest.h $(TINY_LLAMA_DIR)/test_support.h $(TINY_LLAMA_DIR)/test_reference.h

# pqcache.h's implementation compiled once for the programs below that link it
# (TL_PQCACHE_NO_LIBRARY_IMPLEMENTATION: the header's implementation is not compiled again)
# and for the Python binding's shared library (so position-independent)
TL_LIB_OBJ := build/pqcache_lib.o
TL_NO_LIB := -DTL_PQCACHE_NO_LIBRARY_IMPLEMENTATION
$(TL_LIB_OBJ): $(TINY_LLAMA_DIR)/pqcache_lib.c pqcache.h
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) -fPIC -c -o $@ $<

build/tiny_llama: $(TINY_LLAMA_DIR)/run.c $(TINY_LLAMA_PQ_DEPS) $(TL_LIB_OBJ)
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) $(TL_NO_LIB) -o $@ $< $(TL_LIB_OBJ) $(TINY_LLAMA_LIBS)

build/tiny_llama_gen: $(TINY_LLAMA_TOOLS)/gen_random.c $(TINY_LLAMA_ENGINE)
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) -o $@ $< $(TINY_LLAMA_LIBS)

build/test_tiny_llama: $(TINY_LLAMA_DIR)/test_tiny_llama.c $(TINY_LLAMA_ENGINE) $(TINY_LLAMA_TEST_DEPS)
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) -o $@ $< $(TINY_LLAMA_LIBS)

build/test_tiny_llama_loaders: $(TINY_LLAMA_DIR)/test_loaders.c $(TINY_LLAMA_ENGINE) $(TINY_LLAMA_TEST_DEPS)
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) -o $@ $< $(TINY_LLAMA_LIBS)

build/test_pqcache_mode: $(TINY_LLAMA_DIR)/test_pqcache_mode.c $(PASSKEY_SRCS) $(TINY_LLAMA_TEST_DEPS) \
                         $(TINY_LLAMA_PQ_DEPS) $(TL_LIB_OBJ)
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) $(TL_NO_LIB) -o $@ $< $(TL_LIB_OBJ) $(TINY_LLAMA_LIBS)

build/bench_hf: $(TINY_LLAMA_TOOLS)/bench_hf.c $(TINY_LLAMA_PQ_DEPS)
	@mkdir -p $(@D)
	$(CC) $(TINY_LLAMA_CFLAGS) -o $@ $< $(TINY_LLAMA_LIBS)

# Hugging Face checkpoints (test_hf.py) and the token helper (tools/test_hf_tokens.py):
# python3 with numpy, pytest and tokenizers (the top-level Makefile's PYTHON when set)
TINY_LLAMA_PY ?= $(or $(PYTHON),python3)
TINY_LLAMA_PYTEST := $(TINY_LLAMA_PY) -m pytest -q -p no:cacheprovider

.PHONY: tiny_llama tiny_llama_test tiny_llama_check tiny_llama_demo bench-hf tiny_llama_hf_test test-transformers

# BENCH_HF_ARGS: e.g. --threads 1 --ctx 8192 --steps 32 --mb 2048
BENCH_HF_ARGS ?=
bench-hf: build/bench_hf
	@echo "=== Hugging Face layout: memory bandwidth vs decode of a 1B-shaped bf16 model at 4K ==="
	build/bench_hf $(BENCH_HF_ARGS)

tiny_llama_hf_test: build/tiny_llama
	$(TINY_LLAMA_PYTEST) $(TINY_LLAMA_DIR)/test_hf.py $(TINY_LLAMA_DIR)/test_transformers.py tools/test_hf_tokens.py

# The example and the Python backend against transformers itself, with torch: models
# built, saved and run by transformers (test_transformers.py), and pqcache as its
# attention backend (python/test_pqcache_hf.py), the real SmolLM2 through both
# (test_real_models.py: build/models); then test_transformers.py again with
# transformers 4 (build/hf4 in front: checkpoints in the layout version 4 writes). A
# group of make test; the python comes from tests/transformers_env.sh (tools/setup.sh
# makes build/venv-hf, build/hf4 and build/models, once).
DEPS_test-transformers := build/tiny_llama build/libpqcache.so build/make_passkey
TRANSFORMERS_ENV := PQC_REQUIRE_TORCH=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
                    TRANSFORMERS_VERBOSITY=error PQCACHE_LIB=$(CURDIR)/build/libpqcache.so
test-transformers: $(DEPS_test-transformers)
	@py=$$(sh tests/transformers_env.sh --check) && mkdir -p build/pytest && \
	  $(TRANSFORMERS_ENV) PQC_TEST_SIZE=$(SAN_SIZE) PYTHONPATH=python $$py -m pytest -q -s -p no:cacheprovider \
	    --basetemp=build/pytest/transformers --durations=5 $(TINY_LLAMA_DIR)/test_transformers.py python/test_pqcache_hf.py \
	    $(TINY_LLAMA_DIR)/test_real_models.py && \
	  echo "== the same checkpoints with transformers $$(PYTHONPATH=build/hf4 $$py -c 'import transformers; print(transformers.__version__)')" && \
	  $(TRANSFORMERS_ENV) PYTHONPATH=build/hf4:python $$py -m pytest -q -p no:cacheprovider -p conftest \
	    --basetemp=build/pytest/transformers4 --durations=3 $(TINY_LLAMA_DIR)/test_transformers.py

tiny_llama: build/tiny_llama build/tiny_llama_gen

# tiny_llama_check: one target per file, compiler and mode (build/checks/tl/CC--FILE--MODE.ok),
# so that a parallel make runs them side by side; a missing compiler is skipped
TL_CHECK_CCS := $(foreach c,gcc clang,$(if $(shell command -v $(c) 2>/dev/null),$(c)))
TL_CHECK_CXXS := $(foreach c,g++ clang++,$(if $(shell command -v $(c) 2>/dev/null),$(c)))
TL_CHECK_MODE_c99 := -std=c99
TL_CHECK_MODE_nosimd := -std=c99 -DTINY_LLAMA_NO_SIMD
TL_CHECK_MODE_cxx := -x c++ -std=c++11
TL_CHECK_STAMPS :=
define TL_CHECK_RULE
build/checks/tl/$(1)--$(notdir $(2))--$(3).ok: $(2) $(TINY_LLAMA_PQ_DEPS) $(wildcard $(TINY_LLAMA_DIR)/*.h $(TINY_LLAMA_TOOLS)/*.h)
	@mkdir -p $$(@D)
	$(1) $$(TL_CHECK_MODE_$(3)) $$(TINY_LLAMA_WARN) -fsyntax-only $(2)
	@touch $$@
TL_CHECK_STAMPS += build/checks/tl/$(1)--$(notdir $(2))--$(3).ok
endef
# (without the engine's SIMD kernels: the sources whose code that changes, the engine's
# headers through run.c, which includes them all, and bench_hf.c's own SIMD code)
TL_NOSIMD_SRCS := $(TINY_LLAMA_DIR)/run.c $(TINY_LLAMA_TOOLS)/bench_hf.c
$(foreach c,$(TL_CHECK_CCS),$(foreach f,$(TINY_LLAMA_SRCS),$(eval $(call TL_CHECK_RULE,$(c),$(f),c99))))
$(foreach c,$(TL_CHECK_CCS),$(foreach f,$(TL_NOSIMD_SRCS),$(eval $(call TL_CHECK_RULE,$(c),$(f),nosimd))))
$(foreach c,$(TL_CHECK_CXXS),$(foreach f,$(TINY_LLAMA_SRCS),$(eval $(call TL_CHECK_RULE,$(c),$(f),cxx))))

tiny_llama_check: $(TL_CHECK_STAMPS)
	@for c in gcc clang g++ clang++; do \
	  case " $(TL_CHECK_CCS) $(TL_CHECK_CXXS) " in *" $$c "*) echo "tiny_llama_check: $$c ok (every source$$(case $$c in *++) echo ', as C++';; *) echo ', and without the SIMD kernels where that changes the code';; esac))";; \
	  *) echo "tiny_llama_check: $$c not found, skipped";; esac; \
	done

# The smoke test runs the command line: every mode on a small random model
# (full attention compared with itself, and pqcache at budget 1, must agree
# exactly; pqcache reports its statistics), a sink count far beyond the
# context (pqcache must finish or fail with a message, not crash), and the
# errors for a pqcache budget of 0 and a truncated checkpoint.
TINY_LLAMA_SMOKE := build/tiny_llama_smoke

DEPS_tiny_llama_test := build/test_tiny_llama build/test_tiny_llama_loaders build/test_pqcache_mode build/tiny_llama \
                        build/tiny_llama_gen $(TL_CHECK_STAMPS)
tiny_llama_test: $(DEPS_tiny_llama_test) tiny_llama_check
	./build/test_tiny_llama
	./build/test_tiny_llama_loaders
	./build/test_pqcache_mode
	@mkdir -p build/pytest
	$(TINY_LLAMA_PYTEST) --basetemp=build/pytest/tiny_llama_test --durations=5 $(TINY_LLAMA_DIR)/test_hf.py \
	  $(TINY_LLAMA_DIR)/test_transformers.py tools/test_hf_tokens.py
	@./build/tiny_llama_gen $(TINY_LLAMA_SMOKE).bin -d 64 -f 128 -v 64 -s 512 -t 50000 2>/dev/null
	@for a in full window oracle pqcache; do \
	  ./build/tiny_llama $(TINY_LLAMA_SMOKE).bin -P 200 -n 20 -a $$a -c -q -t 0 \
	    2>$(TINY_LLAMA_SMOKE).$$a.log || { cat $(TINY_LLAMA_SMOKE).$$a.log; exit 1; }; \
	  grep -q "compare: next-token agreement" $(TINY_LLAMA_SMOKE).$$a.log || exit 1; \
	done
	@grep -q "agreement 100.00% (19/19), mean KL(full || full) 0.000000" $(TINY_LLAMA_SMOKE).full.log
	@grep -q "pqcache: select .* us/token, fetch" $(TINY_LLAMA_SMOKE).pqcache.log
	@grep -q "pqcache: block cache hit rate" $(TINY_LLAMA_SMOKE).pqcache.log
	@grep -q "pqcache: device tier .* vs full KV cache" $(TINY_LLAMA_SMOKE).pqcache.log
	@./build/tiny_llama $(TINY_LLAMA_SMOKE).bin -P 200 -n 20 -a pqcache -b 1 -c -q -t 0 -j 2 \
	  -m 4 -B 4 -T 3 -C 2 -K 16 -E lru 2>$(TINY_LLAMA_SMOKE).log || { cat $(TINY_LLAMA_SMOKE).log; exit 1; }
	@grep -q "agreement 100.00% (19/19), mean KL(full || pqcache) 0.000000" $(TINY_LLAMA_SMOKE).log
	@! ./build/tiny_llama $(TINY_LLAMA_SMOKE).bin -a pqcache -b 0 2>$(TINY_LLAMA_SMOKE).log
	@grep -q "pqcache needs a budget ratio above 0" $(TINY_LLAMA_SMOKE).log
	@st=0; ./build/tiny_llama $(TINY_LLAMA_SMOKE).bin -P 100 -n 8 -a pqcache -S 1000000 -q -t 0 \
	  >/dev/null 2>$(TINY_LLAMA_SMOKE).log || st=$$?; \
	if [ $$st -ge 128 ]; then cat $(TINY_LLAMA_SMOKE).log; \
	  echo "tiny_llama -a pqcache -S 1000000 crashed (exit status $$st)"; exit 1; fi; \
	if [ $$st -ne 0 ] && ! grep -q "error" $(TINY_LLAMA_SMOKE).log; then cat $(TINY_LLAMA_SMOKE).log; \
	  echo "tiny_llama -a pqcache -S 1000000 failed (exit status $$st) without an error message"; exit 1; fi
	@head -c 1000 $(TINY_LLAMA_SMOKE).bin >$(TINY_LLAMA_SMOKE)_cut.bin
	@! ./build/tiny_llama $(TINY_LLAMA_SMOKE)_cut.bin 2>$(TINY_LLAMA_SMOKE).log
	@grep -q "truncated" $(TINY_LLAMA_SMOKE).log
	@rm -f $(TINY_LLAMA_SMOKE)*
	@echo "tiny_llama command-line smoke test: ok"

# The demonstration behind `make run`: the harder passkey model (where plain PQ
# loses the needle) at TINY_LLAMA_DEMO_LEN tokens with the needle at
# TINY_LLAMA_DEMO_DEPTH percent, every mode fed the key and decoding
# TINY_LLAMA_DEMO_STEPS tokens (about 30-40 s on 2 cores).
# TINY_LLAMA_DEMO_MODEL=build/passkey.bin runs the original passkey model.
TINY_LLAMA_DEMO_LEN ?= 32768
TINY_LLAMA_DEMO_DEPTH ?= 50
TINY_LLAMA_DEMO_STEPS ?= 128
TINY_LLAMA_DEMO_ARGS ?=
TINY_LLAMA_DEMO_MODEL ?= build/passkey_hard.bin

tiny_llama_demo: build/needle $(TINY_LLAMA_DEMO_MODEL)
	build/needle $(TINY_LLAMA_DEMO_MODEL) --compare $(TINY_LLAMA_DEMO_LEN) $(TINY_LLAMA_DEMO_DEPTH) \
	  --steps $(TINY_LLAMA_DEMO_STEPS) $(TINY_LLAMA_DEMO_ARGS)
