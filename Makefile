# pqcache: `make run` (demonstration), `make test` (all tests), `make bench` (benchmarks).
CC      ?= cc
CLANG   ?= clang
BUILD   := build
WARN    := -Wall -Wextra -Werror -pedantic
# Test and example builds carry line tables only (-g1: every backtrace, sanitizer report and
# debugger stack has function, file and line); full debug information (DBG=-g) doubles
# the compile time of the header, which is most of make test's build time.
DBG     ?= -g1
CFLAGS  ?= -O2 $(DBG)
STD     := -std=c99
LDLIBS  := -lm -lpthread
SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
TSAN    := -fsanitize=thread
# gcc's sanitizer builds at -Og: half the compile time of -O1 with the same run time
# under the sanitizers (clang's -Og is its -O1)
SANOPT  := -Og

.PHONY: all run run-real test test-long coverage bench bench-real bench-metric clean test-core test-asan test-tsan test-compile test-variants test-header test-harness test-nvrtc test-cuda-emu kernels bench-pq bench-cache lib test-python bench-python bench-transformers

# ----- library tests: each tests/test_NAME.c runs plain, under ASan+UBSan and under TSan
LIBTESTS := core cache contract fidelity golden kernels

# `make` alone: the library's tests and the example engine, built (nothing is run)
all: $(addprefix $(BUILD)/test_,$(LIBTESTS)) build/tiny_llama build/tiny_llama_gen

$(BUILD):
	@mkdir -p $(BUILD)

HDR := pqcache.h
TEST_DEPS := tests/greatest.h tests/synth.h tests/test_size.h tests/test_util.h tests/cache_checksum.h $(HDR) bench/hardkeys.h

$(BUILD)/test_%: tests/test_%.c $(TEST_DEPS) | $(BUILD)
	$(CC) $(STD) $(CFLAGS) $(WARN) -Itests $< -o $@ $(LDLIBS)

$(BUILD)/asan_%: tests/test_%.c $(TEST_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(SAN) -Itests $< -o $@ $(LDLIBS)

$(BUILD)/tsan_%: tests/test_%.c $(TEST_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(TSAN) -Itests $< -o $@ $(LDLIBS)

# tests/test_lib.c: the six programs' suites in one program (the header compiled once, not
# six times), for every build make test runs them in: plain, ASan+UBSan, TSan, without
# threads, AArch64. PQC_TEST_SUITES picks the suites.
LIBTEST_SRCS := $(addprefix tests/test_,$(addsuffix .c,$(LIBTESTS)))
$(BUILD)/test_lib $(BUILD)/asan_lib $(BUILD)/tsan_lib $(BUILD)/nothreads_lib $(BUILD)/aarch64/aarch64_test_lib: $(LIBTEST_SRCS)

$(BUILD)/test_harness: tests/test_harness.c tests/greatest.h | $(BUILD)
	$(CC) $(STD) $(CFLAGS) $(WARN) -Itests $< -o $@

# make test runs the six suites as build/test_lib (the header compiled once); each
# tests/test_NAME.c also builds and runs alone (make build/test_NAME). The allocation-failure
# sweeps run under the sanitizers (make test-asan, test-tsan), whose builds see more of
# what a failure path can do wrong; make test-long runs them here too.
CORE_EXCLUDE ?= -x every_allocation
DEPS_test-core := $(BUILD)/test_lib
test-core: $(DEPS_test-core)
	@echo "== $(LIBTESTS)"; $(BUILD)/test_lib $(CORE_EXCLUDE)

# The sanitizer runs take the small scenarios (tests/test_size.h); make test-long the full.
SAN_SIZE ?= small
# Under TSan the programs that start threads; test_fidelity never does (every cache on the
# inline runtime), so ThreadSanitizer has nothing to check there: make test-long runs it.
TSAN_TESTS ?= core cache contract

# clang's UBSan reports pointer arithmetic on null (its pointer-overflow check), which
# gcc's does not: the contract tests, whose allocation-failure sweeps reach every failure
# path, under that check too. Only that check: everything else gcc's ASan+UBSan build
# above covers, and clang's ASan build took three times as long to compile and run.
CLANG_UB := -fsanitize=pointer-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer
$(BUILD)/clang_ub_%: tests/test_%.c $(TEST_DEPS) | $(BUILD)
	$(CLANG) $(STD) -O1 $(DBG) $(WARN) $(CLANG_UB) -Itests $< -o $@ $(LDLIBS)

# (the two fidelity tests that measure a whole selection against the oracle's on four
# data sets, 20 cache builds each, run in the plain build: under ASan the same rerank,
# outlier and observation paths run in test_golden and the contract tests)
ASAN_EXCLUDE ?= -x the_oracle_keeps
DEPS_test-asan := $(BUILD)/asan_lib $(BUILD)/clang_ub_contract
test-asan: $(DEPS_test-asan)
	@echo "== $(LIBTESTS) (ASan+UBSan, $(SAN_SIZE) scenarios)"; \
	  PQC_TEST_SIZE=$(SAN_SIZE) ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 $(BUILD)/asan_lib $(ASAN_EXCLUDE)
	@echo "== contract (clang's pointer-overflow check, $(SAN_SIZE) scenarios)"; \
	  PQC_TEST_SIZE=$(SAN_SIZE) UBSAN_OPTIONS=print_stacktrace=1 $(BUILD)/clang_ub_contract

# (the slow tests that run on the inline runtime alone have nothing for TSan to check,
# and ASan runs them: the allocation-failure sweep without threads, whose threaded twin
# runs, the failed driver steps, the fork families, and the top-k and SIMD sweeps)
TSAN_EXCLUDE ?= -x every_allocation_inline -x failed_driver_steps -x forks_decode_like_unshared \
  -x forks_hold_the_prefix_once -x topk_matches_sort_reference -x simd_matches_scalar
DEPS_test-tsan := $(BUILD)/tsan_lib
test-tsan: $(DEPS_test-tsan)
	@echo "== $(TSAN_TESTS) (TSan, $(SAN_SIZE) scenarios)"; \
	  PQC_TEST_SUITES="$(TSAN_TESTS)" PQC_TEST_SIZE=$(SAN_SIZE) TSAN_OPTIONS=halt_on_error=1 $(BUILD)/tsan_lib $(TSAN_EXCLUDE)

DEPS_test-harness := $(BUILD)/test_harness
test-harness: $(DEPS_test-harness)
	sh tests/harness_selftest.sh $(BUILD)/test_harness

# the table of contents at the top of pqcache.h matches its section banners
test-header:
	sh tests/header_toc.sh pqcache.h

# The header must compile warning-free as C99 and as C++ under gcc and clang.
COMPILE_SRC := $(BUILD)/compile_check.c
$(COMPILE_SRC): | $(BUILD)
	@printf '#define PQCACHE_IMPLEMENTATION\n#include "../pqcache.h"\nint main(void) { return pqc_version_number() == 0; }\n' > $@

# Each check compiles the whole implementation once; the checks are separate targets, so
# that a parallel make runs them side by side. build/checks/CC--DEFS.o: CC one of the
# compilers below, DEFS "default", "nosimd-static" or one configuration macro. gcc warns
# from its optimisers too (uninitialised values, array bounds), so its checks build at
# -Og, which runs the flow analyses those warnings come from in a third of -O2's time
# (every test program's -O2 build adds -O2's own in the default configuration); clang's
# warnings all come from its front end, the same at every level, so its checks build at
# -O0 (a tenth of the time).
CHK_cc-c99 := $(CC) -std=c99 -Og
CHK_cc-cxx := $(CC) -x c++ -std=c++11 -Og
CHK_clang-c99 := $(CLANG) -std=c99 -O0
CHK_clang-cxx := $(CLANG) -x c++ -std=c++11 -O0
CHKDEF_default :=
CHKDEF_nosimd-static := -DPQCACHE_NO_SIMD -DPQCACHE_STATIC
$(BUILD)/checks/%.o: $(COMPILE_SRC) $(HDR)
	@mkdir -p $(@D)
	$(CHK_$(word 1,$(subst --, ,$*))) $(WARN) $(CHKDEF_$(word 2,$(subst --, ,$*))) -c $(COMPILE_SRC) -o $@

# (gcc as C99 in the default configuration is every test program's build: no check of its own)
COMPILE_CCS := cc-c99 cc-cxx clang-c99 clang-cxx
# and each library test program on its own (make test builds them as one, build/test_lib)
$(BUILD)/checks/alone--%.o: tests/%.c $(TEST_DEPS)
	@mkdir -p $(@D)
	$(CLANG) $(STD) $(WARN) -Itests -fsyntax-only $< && touch $@
DEPS_test-compile := $(filter-out $(BUILD)/checks/cc-c99--default.o, \
                       $(foreach c,$(COMPILE_CCS),$(BUILD)/checks/$(c)--default.o $(BUILD)/checks/$(c)--nosimd-static.o)) \
                     $(addprefix $(BUILD)/checks/alone--test_,$(addsuffix .o,$(LIBTESTS)))
test-compile: $(DEPS_test-compile)
	@for c in $(DEPS_test-compile); do echo "compile check: $$(basename $$c .o) ok"; done

# The configuration macros: each variant compiles warning-free under gcc and clang, and the
# library tests whose caches start threads run in the build without threads (jobs inline,
# no pthreads; the small scenarios, which reach the same code). Under gcc the build without
# threads is those programs, and PQCACHE_NO_SIMD is in the nosimd-static check above (so
# no separate compile checks for them).
VARIANTS := PQCACHE_NO_THREADS PQCACHE_NO_CUDA PQCACHE_NO_SIMD PQCACHE_STATIC
NOTHREADS_TESTS ?= core cache contract
# (without threads the "threaded" allocation-failure sweep is the inline one again; the
# inline one is what test-asan's inline sweep runs, so make test leaves both to test-long)
NOTHREADS_EXCLUDE ?= -x every_allocation
$(foreach v,$(VARIANTS),$(eval CHKDEF_$(v) := -D$(v)))
$(BUILD)/nothreads_%: tests/test_%.c $(TEST_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) -DPQCACHE_NO_THREADS -Itests $< -o $@ -lm

VARIANT_CCS := cc-c99 clang-c99 clang-cxx
DEPS_test-variants := $(filter-out $(BUILD)/checks/cc-c99--PQCACHE_NO_THREADS.o $(BUILD)/checks/cc-c99--PQCACHE_NO_SIMD.o, \
                        $(foreach v,$(VARIANTS),$(foreach c,$(VARIANT_CCS),$(BUILD)/checks/$(c)--$(v).o))) \
                      $(BUILD)/nothreads_lib
test-variants: $(DEPS_test-variants)
	@for c in $(filter %.o,$(DEPS_test-variants)); do echo "compile check: $$(basename $$c .o) ok"; done
	@echo "== $(NOTHREADS_TESTS) (PQCACHE_NO_THREADS, $(SAN_SIZE) scenarios)"; \
	  PQC_TEST_SUITES="$(NOTHREADS_TESTS)" PQC_TEST_SIZE=$(SAN_SIZE) $(BUILD)/nothreads_lib $(NOTHREADS_EXCLUDE)

# ----- AArch64: the NEON kernels, cross-compiled and run under qemu-aarch64. tests/aarch64.sh
# installs the cross compiler and qemu from Debian packages where they are missing and it
# runs as root, else skips; it builds these targets (their compilers may only just be there):
# the library's tests build/aarch64/aarch64_test_NAME (named apart from the x86 programs in
# the lists of slow tests) and compile checks build/aarch64/checks/CC--DEFS.o.
AARCH64_CC ?= aarch64-linux-gnu-gcc
AARCH64_CXX ?= aarch64-linux-gnu-g++
AARCH64_CFLAGS ?= -O2 $(DBG)
$(BUILD)/aarch64/aarch64_test_%: tests/test_%.c $(TEST_DEPS)
	@mkdir -p $(@D)
	$(AARCH64_CC) $(STD) $(AARCH64_CFLAGS) $(WARN) -Itests $< -o $@ $(LDLIBS)

# (gcc's warnings from its optimisers on the NEON code come from the test program's -O2
# build above; the C++ check is about the language, so it builds at -O0: a quarter of
# the time)
ACHK_gcc-c99 = $(AARCH64_CC) -std=c99 -O2
ACHK_gxx-cxx = $(AARCH64_CXX) -x c++ -std=c++11 -O0
ACHK_clang-c99 = $(CLANG) --target=aarch64-linux-gnu -std=c99 -O0
ACHK_clang-cxx = $(CLANG) --target=aarch64-linux-gnu -x c++ -std=c++11 -O0
$(BUILD)/aarch64/checks/%.o: $(COMPILE_SRC) $(HDR)
	@mkdir -p $(@D)
	$(ACHK_$(word 1,$(subst --, ,$*))) $(WARN) $(CHKDEF_$(word 2,$(subst --, ,$*))) -c $(COMPILE_SRC) -o $@

.PHONY: test-aarch64
test-aarch64:
	@MAKE="$(MAKE)" AARCH64_CC="$(AARCH64_CC)" AARCH64_CXX="$(AARCH64_CXX)" CLANG="$(CLANG)" sh tests/aarch64.sh

# ----- CUDA: run-time loader, NVRTC compilation of the embedded kernels (no GPU needed)
# (at -O0: its time is NVRTC's, and it compiles in a third of -O2's time)
$(BUILD)/test_nvrtc: tests/test_nvrtc.c tests/greatest.h tests/test_util.h tests/synth.h pqcache_kernels.cu $(HDR) | $(BUILD)
	$(CC) $(STD) $(CFLAGS) -O0 $(WARN) $< -o $@ $(LDLIBS)

# (make test runs it on the CPU stand-in only, in a second: at -O0, a quarter of -O2's
# compile time; tests/gpu/check.sh builds its own, optimised, on a GPU machine)
$(BUILD)/gpu_check: tests/gpu/gpu_check.c $(HDR) | $(BUILD)
	$(CC) $(STD) $(CFLAGS) -O0 $(WARN) $< -o $@ $(LDLIBS)

DEPS_test-nvrtc := $(BUILD)/test_nvrtc $(BUILD)/gpu_check
test-nvrtc: $(DEPS_test-nvrtc)
	sh tools/embed_kernels.sh --check
	$(BUILD)/test_nvrtc -v

kernels:
	sh tools/embed_kernels.sh

# ----- CUDA device tier without a GPU: a CPU stand-in for libcuda.so.1 runs the kernels
# (tests/cuda_emu); gpu_check's kernel checks and the device-tier tests run against it.
CXX ?= c++
EMU := $(BUILD)/libcuda-emu.so
$(BUILD)/emu_kernels.inc: pqcache_kernels.cu | $(BUILD)
	sed 's/^\( *\)extern __shared__ float pqc_smem_lut\[\];/\1\/* pqc_smem_lut: the emulator'"'"'s *\//' $< > $@

# Optimised, and with the FMA instructions where this machine has them: the kernels' fmaf
# is then one instruction instead of a libm call (the same rounding, so the same bits);
# nothing else is contracted into a fused multiply-add.
EMU_FMA := $(shell $(CXX) -march=native -dM -E -x c++ /dev/null 2>/dev/null | grep -q __FMA__ && echo -mfma)
$(EMU): tests/cuda_emu/libcuda_emu.cpp tests/cuda_emu/emu_device.h $(BUILD)/emu_kernels.inc
	$(CXX) -std=c++14 -O2 $(EMU_FMA) -ffp-contract=off $(DBG) -fPIC -shared -Wall -Wextra -Werror -Wno-unknown-pragmas -Itests/cuda_emu -I$(BUILD) $< -o $@

# build/asan_cuda_tier: the rule of the library's test programs. The device tier's time is
# the stand-in's (its kernels run on the CPU, the same at every level of the test program),
# so the plain build is at -Og too. make test runs the tests under ASan+UBSan on the small
# scenarios and the plain build only for what does not run under ASan (NVRTC compiling the
# kernels); make test-long (SAN_SIZE=full) runs the plain build's every test, full size.
$(BUILD)/test_cuda_tier: tests/test_cuda_tier.c $(TEST_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) -Itests $< -o $@ $(LDLIBS)
DEPS_test-cuda-emu := $(EMU) $(BUILD)/gpu_check $(BUILD)/test_cuda_tier $(BUILD)/asan_cuda_tier build/test_pqcache_mode
test-cuda-emu: $(DEPS_test-cuda-emu)
	sh tests/cuda_emu/run.sh $(BUILD) $(SAN_SIZE)

# ----- the Python binding: pqcache.h as a shared library, python/pqcache.py over ctypes
LIB := $(BUILD)/libpqcache.so
# python3 from PATH when it has numpy and pytest, else the system's (Debian: python3-numpy, python3-pytest)
PYTHON ?= $(shell /usr/bin/env python3 -c 'import numpy, pytest' >/dev/null 2>&1 && echo /usr/bin/env python3 || \
	{ test -x /usr/bin/python3 && echo /usr/bin/python3 || echo /usr/bin/env python3; })

# (the binding's helpers, linked with the implementation the example's programs link too,
# build/pqcache_lib.o, which is compiled position-independent for this)
$(LIB): python/libpqcache.c $(BUILD)/pqcache_lib.o $(HDR) | $(BUILD)
	$(CC) $(STD) $(CFLAGS) -fPIC -shared $(WARN) -DPQCPY_NO_LIBRARY_IMPLEMENTATION $< $(BUILD)/pqcache_lib.o -o $@ $(LDLIBS)

lib: $(LIB)

DEPS_test-python := $(LIB)
test-python: $(DEPS_test-python)
	@mkdir -p $(BUILD)/pytest
	PQCACHE_LIB=$(CURDIR)/$(LIB) $(PYTHON) -m pytest -q -p no:cacheprovider --basetemp=$(BUILD)/pytest/python --durations=5 \
	  --ignore=python/test_pqcache_hf.py python/

# ----- everything ---------------------------------------------------------------------
# The groups, longest first (a parallel make starts them in this order). `make test` runs
# them in one parallel make: each run-GROUP target builds GROUP's programs (DEPS_GROUP)
# alongside everything else, then runs the group (tests/run_group.sh).
TEST_GROUPS := test-transformers test-cuda-emu test-tsan test-asan test-example-san test-fuzz test-variants test-core test-aarch64 \
               tiny_llama_test test-mpi test-compile test-nvrtc test-python test-harness test-header
# (tools/setup.sh first: it installs what the groups need and is missing, once, and where it
# cannot, it says what is missing and make test stops before running anything)
test:
	@sh tools/setup.sh || { echo "make test: stopped before running any test: install what is missing (above)" >&2; exit 1; }
	@MAKE="$(MAKE)" sh tests/run_all.sh $(TEST_GROUPS)


# The long suite: make test with every scenario at full size (the sanitizer runs too, and
# ThreadSanitizer over every test program), then every fuzz target for LONG_FUZZ_SECONDS,
# TEST_JOBS of them side by side. About 45 minutes on 2 cores.
LONG_FUZZ_SECONDS ?= 600
test-long:
	@$(MAKE) --no-print-directory test SAN_SIZE=full TSAN_TESTS="$(LIBTESTS)" NOTHREADS_TESTS="$(LIBTESTS)" \
	  CORE_EXCLUDE= TSAN_EXCLUDE= NOTHREADS_EXCLUDE= ASAN_EXCLUDE=
	@echo "=== every fuzz target for $(LONG_FUZZ_SECONDS) s"
	@$(MAKE) --no-print-directory -j$${TEST_JOBS:-$$(nproc)} FUZZ_SECONDS=$(LONG_FUZZ_SECONDS) $(addprefix fuzz-,$(FUZZ_NAMES)) \
	  > $(BUILD)/logs/fuzz-long.log 2>&1; st=$$?; \
	  grep -E '^fuzz_|^    ' $(BUILD)/logs/fuzz-long.log; \
	  p=$$(grep -c '^fuzz_.*Done' $(BUILD)/logs/fuzz-long.log); f=$$(grep -c '^fuzz_.*FAILED' $(BUILD)/logs/fuzz-long.log); \
	  echo "$$p passed, $$f failed"; [ $$st = 0 ] && [ $$f = 0 ]

# line and branch coverage of pqcache.h and examples/tiny_llama by make test (gcov), in
# build/coverage/summary.txt; tests/coverage/run.sh says how
coverage:
	@COVERAGE_SIZE="$(COVERAGE_SIZE)" COVERAGE_GROUPS="$(COVERAGE_GROUPS)" sh tests/coverage/run.sh

clean:
	rm -rf $(BUILD)

# ----- the example engine, the passkey model and the needle evaluation -----------------
include examples/tiny_llama/build.mk
# tensor parallel over MPI: build/tiny_llama_mpi, run-mpi, test-mpi (skipped without MPI)
include examples/tiny_llama/tools/mpi.mk
# pqcache inside llama.cpp: build/pqc_llama, test-llamacpp, bench-llamacpp
include examples/llama_cpp/build.mk

# the example's tests under the sanitizers too (the pqcache mode runs the library's pool)
$(BUILD)/asan_tiny_llama: examples/tiny_llama/test_tiny_llama.c $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(SAN) $< -o $@ $(LDLIBS)
$(BUILD)/asan_tiny_llama_loaders: examples/tiny_llama/test_loaders.c $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(SAN) $< -o $@ $(LDLIBS)
# (the library's implementation compiled once for the two ASan programs that link it)
$(BUILD)/asan_pqcache_lib.o: examples/tiny_llama/pqcache_lib.c $(HDR) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(SAN) -c $< -o $@
$(BUILD)/asan_pqcache_mode: examples/tiny_llama/test_pqcache_mode.c $(PASSKEY_SRCS) $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) \
                            $(BUILD)/asan_pqcache_lib.o | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(SAN) $(TL_NO_LIB) $< $(BUILD)/asan_pqcache_lib.o -o $@ $(LDLIBS)
# clang's UBSan reports pointer arithmetic on null, which gcc's does not (at -O0: it runs
# only the library-level tests, well under a second, and compiles in a sixth of -O1's time)
$(BUILD)/clang_ub_pqcache_mode: examples/tiny_llama/test_pqcache_mode.c $(PASSKEY_SRCS) $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) | $(BUILD)
	$(CLANG) $(STD) -O0 $(DBG) $(WARN) $(CLANG_UB) $< -o $@ $(LDLIBS)
$(BUILD)/tsan_pqcache_mode: examples/tiny_llama/test_pqcache_mode.c $(PASSKEY_SRCS) $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(TSAN) $< -o $@ $(LDLIBS)
# the engine's thread pool (polling, then sleeping) under ThreadSanitizer; the loaders too
$(BUILD)/tsan_tiny_llama: examples/tiny_llama/test_tiny_llama.c $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(TSAN) $< -o $@ $(LDLIBS)
$(BUILD)/tsan_tiny_llama_loaders: examples/tiny_llama/test_loaders.c $(TINY_LLAMA_TEST_DEPS) $(TINY_LLAMA_PQ_DEPS) | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(TSAN) $< -o $@ $(LDLIBS)
# the command line under ASan+UBSan refuses damaged Hugging Face checkpoints (test_hf.py)
$(BUILD)/asan_tiny_llama_run: examples/tiny_llama/run.c $(TINY_LLAMA_PQ_DEPS) $(BUILD)/asan_pqcache_lib.o | $(BUILD)
	$(CC) $(STD) $(SANOPT) $(DBG) $(WARN) $(SAN) $(TL_NO_LIB) $< $(BUILD)/asan_pqcache_lib.o -o $@ $(LDLIBS)
DEPS_test-example-san := $(BUILD)/asan_tiny_llama $(BUILD)/asan_tiny_llama_loaders $(BUILD)/asan_pqcache_mode \
                         $(BUILD)/clang_ub_pqcache_mode $(BUILD)/tsan_pqcache_mode $(BUILD)/asan_tiny_llama_run \
                         $(BUILD)/tsan_tiny_llama $(BUILD)/tsan_tiny_llama_loaders
test-example-san: $(DEPS_test-example-san)
	@mkdir -p $(BUILD)/pytest
	$(BUILD)/asan_tiny_llama
	$(BUILD)/asan_tiny_llama_loaders
	TSAN_OPTIONS=halt_on_error=1 $(BUILD)/tsan_tiny_llama -x prompt_attention_tiles   # one thread: ASan covers it
	TSAN_OPTIONS=halt_on_error=1 $(BUILD)/tsan_tiny_llama_loaders
	TINY_LLAMA=$(CURDIR)/$(BUILD)/asan_tiny_llama_run ASAN_OPTIONS=detect_leaks=1 \
	  $(PYTHON) -m pytest -q -p no:cacheprovider --basetemp=$(BUILD)/pytest/example-san --durations=5 examples/tiny_llama/test_hf.py
	$(BUILD)/asan_pqcache_mode --quick
	$(BUILD)/clang_ub_pqcache_mode --quick
	TSAN_OPTIONS=halt_on_error=1 $(BUILD)/tsan_pqcache_mode --quick

# `make run`: the passkey model at a 32K context, full vs pqcache vs oracle vs window
run: tiny_llama_demo

# `make run-real`: a real model (SmolLM2-135M-Instruct from PyPI, converted without torch by
# tools/setup.sh --light) answers a question about 6K tokens of real prose with full
# attention, pqcache and the window side by side. RUN_REAL_ARGS: e.g. --model gemma3
# --tokens 30000 (examples/tiny_llama/tools/run_real.py --help)
RUN_REAL_ARGS ?=
run-real: build/tiny_llama
	@sh tools/setup.sh --light
	$(PYTHON) examples/tiny_llama/tools/run_real.py $(RUN_REAL_ARGS)

# ----- benchmarks (not tests) -----------------------------------------------------------
BENCH_SIZES ?= 32768 131072
BENCH_THREADS ?= 1 2
BENCH_REPS ?= 3
FAISS_ENV := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE

$(BUILD)/bench_pq: bench/bench_pq.c bench/bench_util.h tests/synth.h $(HDR) | $(BUILD)
	$(CC) $(STD) -O2 $(WARN) $< -o $@ $(LDLIBS)

bench-pq: $(BUILD)/bench_pq
	sh bench/setup.sh
	@set -e; for s in $(BENCH_SIZES); do for t in $(BENCH_THREADS); do \
	  echo "=== PQ: s=$$s, threads=$$t, d_h=128, GQA group 4, k=s/10 ==="; \
	  $(BUILD)/bench_pq --s $$s --threads $$t --reps $(BENCH_REPS) --data $(BUILD)/bench_$$s.bin > $(BUILD)/ours_$${s}_$$t.txt; \
	  $(FAISS_ENV) $(BUILD)/venv/bin/python bench/faiss_ref.py $(BUILD)/bench_$$s.bin --threads $$t --reps $(BENCH_REPS) > $(BUILD)/faiss_$${s}_$$t.txt; \
	  python3 bench/report.py $(BUILD)/ours_$${s}_$$t.txt $(BUILD)/faiss_$${s}_$$t.txt; \
	done; done

$(BUILD)/bench_cache: bench/bench_cache.c bench/bench_util.h tests/synth.h $(HDR) | $(BUILD)
	$(CC) $(STD) -O2 $(WARN) $< -o $@ $(LDLIBS)

# the same at 4 KV heads and 8 query heads of 256 (wide keys: the default m is 8 there)
$(BUILD)/bench_cache_d256: bench/bench_cache.c bench/bench_util.h tests/synth.h $(HDR) | $(BUILD)
	$(CC) $(STD) -O2 $(WARN) -DBENCH_HKV=4 -DBENCH_HQ=8 -DBENCH_D=256 $< -o $@ $(LDLIBS)

bench-cache: $(BUILD)/bench_cache $(BUILD)/bench_cache_d256
	@echo "=== sequence cache: select+fetch, block cache traffic, build overlap ==="
	$(BUILD)/bench_cache --sizes 4096,32768,131072 --threads 2
	@echo "=== select+fetch at d_h 256, one core: the default (m 8) against m 4 ==="
	$(BUILD)/bench_cache_d256 --select-only --sizes 131072 --threads 1 --alt 4,8

# fidelity against exact attention on hard LLM-like keys (bench-fidelity, bench-fidelity-quick)
include bench/fidelity.mk

# the Python binding's overhead per select against the same call timed in C (about 20 s)
bench-python: $(LIB)
	PQCACHE_LIB=$(CURDIR)/$(LIB) $(PYTHON) bench/bench_python.py

# pqcache in transformers: a 1B-shaped Llama's decode steps at 4K, eager vs the pqcache
# backend (torch from tests/transformers_env.sh; several minutes, not part of make bench)
BENCH_TF_ARGS ?=
bench-transformers: $(LIB)
	@py=$$(sh tests/transformers_env.sh --check) && PQCACHE_LIB=$(CURDIR)/$(LIB) PYTHONPATH=python \
	  $$py bench/bench_transformers.py $(BENCH_TF_ARGS)

# real models and real text against full attention: the needle grid, teacher-forced NLL
# and attention mass, both halves (the models and torch from tools/setup.sh; about two
# hours on 2 cores; BENCH_REAL_ARGS=--quick for a smoke run, "--half report" for the
# reported half, "--model gemma3" for Gemma 3). Figures in build/bench_real/.
BENCH_REAL_ARGS ?=
bench-real: $(LIB)
	@sh tools/setup.sh && py=$$(sh tests/transformers_env.sh --check) && \
	  PQCACHE_LIB=$(CURDIR)/$(LIB) TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error $$py bench/bench_real.py $(BENCH_REAL_ARGS)

# codebook metrics side by side on the real models' captured keys and
# queries (bench/bench_metric.py says how): BENCH_METRIC_ARGS="--model gemma3" for Gemma 3
BENCH_METRIC_ARGS ?=
bench-metric: $(LIB)
	@sh tools/setup.sh && py=$$(sh tests/transformers_env.sh --check) && \
	  PQCACHE_LIB=$(CURDIR)/$(LIB) TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error $$py bench/bench_metric.py $(BENCH_METRIC_ARGS)

bench: bench-pq bench-cache bench-python bench-hf
include tests/fuzz/fuzz.mk

# run-GROUP (make test): GROUP's programs, then GROUP run into build/logs/GROUP.log
.SECONDEXPANSION:
run-%: $$(DEPS_$$*)
	@sh tests/run_group.sh $* "$(MAKE)"
