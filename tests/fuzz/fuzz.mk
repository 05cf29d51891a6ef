# tests/fuzz/fuzz.mk - libFuzzer targets. Included from the top-level Makefile, whose
# BUILD, CLANG and LDLIBS it uses; paths are relative to the repository root.
#
# Every tests/fuzz/fuzz_NAME.c is built into $(BUILD)/fuzz_NAME (clang, libFuzzer,
# ASan+UBSan); its seed corpus is tests/fuzz/corpus/NAME/.
#
#   make fuzz [FUZZ_SECONDS=600]   each target for FUZZ_SECONDS on a scratch copy of its
#                                  corpus ($(BUILD)/fuzz_corpus/NAME: the seed corpus in
#                                  the repository stays hand-picked); prints each
#                                  target's "Done N runs in S second(s)" line and fails
#                                  on a crash, leak, timeout or sanitizer report
#                                  (reproducers under $(BUILD)/fuzz_artifacts/NAME/,
#                                  logs under $(BUILD)/fuzz_logs/)
#   make test-fuzz                 the bounded run of the test suite: every seed replayed,
#                                  then FUZZ_RUNS inputs per target from a fixed seed
#                                  (FUZZ_RUNS_NAME overrides it for one target): the same
#                                  inputs on every run, however fast the machine; ends
#                                  with "N passed, N failed", one test per target
#   make fuzz-NAME [FUZZ_SECONDS=600]  one target (make -jN runs N of them side by side)
#   make fuzz-build                builds the targets only
#
# Reproduce a finding: $(BUILD)/fuzz_NAME FILE (add -runs=100 to repeat it); for fuzz_api,
# FUZZ_API_TRACE=1 lists every operation and call of the input. The seeds of fuzz_api are
# written by tests/fuzz/api_seeds.py from readable programs.

FUZZ_DIR     := tests/fuzz
FUZZ_SRCS    := $(sort $(wildcard $(FUZZ_DIR)/fuzz_*.c))
FUZZ_NAMES   := $(patsubst $(FUZZ_DIR)/fuzz_%.c,%,$(FUZZ_SRCS))
FUZZ_BINS    := $(addprefix $(BUILD)/fuzz_,$(FUZZ_NAMES))
FUZZ_CFLAGS  := $(DBG) -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -std=c99 \
                -Wall -Wextra -Werror -pedantic -Iexamples/tiny_llama -Itests
FUZZ_DEPS    := $(or $(HDR),pqcache.h) $(wildcard examples/tiny_llama/*.h) $(wildcard $(FUZZ_DIR)/*.h) tests/cache_checksum.h \
                tests/test_util.h tests/synth.h
FUZZ_SECONDS ?= 600
FUZZ_RUNS    ?= 10000
# fuzz_api: each input drives whole caches (builds, selects, files), so fewer of them
# (its seeds, then new inputs up to 3000 runs); make test-long fuzzes every target for
# LONG_FUZZ_SECONDS
FUZZ_RUNS_api ?= 3000
# limits: a hostile size is a failure only when it really exhausts memory or time (an
# api input may start a dozen PQ builds, each within the target's bound: 20-30 s under
# the sanitizers' scalar kernels on a busy two-core machine, so a hang is 60 s)
FUZZ_LIMITS  := -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=60
FUZZ_TOOLCHAIN := $(BUILD)/.fuzz_toolchain

.PHONY: fuzz test-fuzz fuzz-build

# clang and the libFuzzer runtime must be there; say which Debian package is missing
$(FUZZ_TOOLCHAIN):
	@mkdir -p $(BUILD)
	@command -v $(CLANG) >/dev/null 2>&1 || { \
	  echo "fuzz: '$(CLANG)' not found: install clang (Debian: apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
	@printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n);\nint LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
	  > $(BUILD)/fuzz_probe.c
	@$(CLANG) -fsanitize=fuzzer,address,undefined $(BUILD)/fuzz_probe.c -o $(BUILD)/fuzz_probe > $(BUILD)/fuzz_probe.log 2>&1 || { \
	  echo "fuzz: $(CLANG) cannot link -fsanitize=fuzzer,address,undefined (libFuzzer or sanitizer runtime missing):" >&2; \
	  echo "      install libclang-rt-14-dev (Debian; the libclang-rt-N-dev matching your clang-N) and clang" >&2; \
	  sed 's/^/      | /' $(BUILD)/fuzz_probe.log >&2; exit 1; }
	@rm -f $(BUILD)/fuzz_probe $(BUILD)/fuzz_probe.c $(BUILD)/fuzz_probe.log
	@touch $@

# fuzz_calib is about the files' readers (a loaded cache selects on the scalar kernels,
# the same code paths otherwise): built without the SIMD kernels and the CUDA loader,
# half the compile time
FUZZ_DEFS_calib := -DPQCACHE_NO_SIMD -DPQCACHE_NO_CUDA
# the engine's three are about its readers too (checkpoint headers, safetensors files and
# their JSON, tokenizer files; what a forward pass then does with the shapes they let
# through runs the same loops without the SIMD kernels, whose tails and shapes the
# engine's tests check under ASan): built without them, a third of the compile time
FUZZ_DEFS_checkpoint := -DTINY_LLAMA_NO_SIMD
FUZZ_DEFS_safetensors := -DTINY_LLAMA_NO_SIMD
FUZZ_DEFS_tokenizer := -DTINY_LLAMA_NO_SIMD
$(BUILD)/fuzz_%: $(FUZZ_DIR)/fuzz_%.c $(FUZZ_DEPS) | $(FUZZ_TOOLCHAIN)
	$(CLANG) $(FUZZ_CFLAGS) $(FUZZ_DEFS_$*) $< -o $@ $(LDLIBS)

fuzz-build: $(FUZZ_BINS)

fuzz: $(FUZZ_BINS)
	@sh $(FUZZ_DIR)/run.sh time $(BUILD) "$(FUZZ_LIMITS)" $(foreach n,$(FUZZ_NAMES),$(n):$(FUZZ_SECONDS))

# fuzz-NAME: one target for FUZZ_SECONDS (make -j runs several side by side: make test-long)
$(addprefix fuzz-,$(FUZZ_NAMES)): fuzz-%: $(BUILD)/fuzz_%
	@sh $(FUZZ_DIR)/run.sh time $(BUILD) "$(FUZZ_LIMITS)" $*:$(FUZZ_SECONDS)

DEPS_test-fuzz := $(FUZZ_BINS)
test-fuzz: $(DEPS_test-fuzz)
	@sh $(FUZZ_DIR)/run.sh test $(BUILD) "$(FUZZ_LIMITS)" \
	  $(foreach n,$(FUZZ_NAMES),$(n):$(or $(FUZZ_RUNS_$(n)),$(FUZZ_RUNS)))
