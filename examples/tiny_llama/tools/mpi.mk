# mpi.mk - the tensor-parallel tiny_llama over MPI (examples/tiny_llama/tools/tl_mpi.c):
# every rank holds its share of the heads and FFN units and its own pqcache over
# its KV heads. Include from the top-level Makefile (paths are relative to the
# repository root). Only these targets need MPI (Debian: openmpi-bin
# libopenmpi-dev); the rest of the build does not.
#
#   make build/tiny_llama_mpi   the engine, compiled with $(MPICC) (Open MPI: OMPI_CC=clang
#                               make build/tiny_llama_mpi compiles it with clang)
#   make run-mpi                the passkey model at a 32K context on 1 rank x 2
#                               threads, then on 2 ranks x 1 thread: per-rank host
#                               K/V and device-tier memory, decode speed, retrieval
#   make test-mpi               the tests on 2 ranks (test_mpi.sh); skipped, with a
#                               SKIP line, where mpirun is missing or cannot start

ifndef TINY_LLAMA_MPI_MK
TINY_LLAMA_MPI_MK := 1

include examples/tiny_llama/flags.mk
include examples/tiny_llama/tools/passkey.mk

MPICC ?= mpicc
MPIRUN ?= mpirun
# --oversubscribe: more ranks than free cores; --bind-to none: a rank's threads may
# use every core (Open MPI binds each rank to one core by default)
MPIRUN_FLAGS ?= --oversubscribe --bind-to none
# Open MPI refuses to run as root without these (harmless otherwise)
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TL_MPI_SRC := examples/tiny_llama/tools/tl_mpi.c

build/tiny_llama_mpi: $(TL_MPI_SRC) examples/tiny_llama/tools/tl_mpi_engine.h $(TINY_LLAMA_ENGINE) pqcache.h \
                      $(TL_LIB_OBJ)
	@mkdir -p build
	$(MPICC) $(TINY_LLAMA_CFLAGS) $(TL_NO_LIB) -o $@ $(TL_MPI_SRC) $(TL_LIB_OBJ) -lm -lpthread

# The passkey model widened to two KV heads (--widen 2: two copies of its head and
# FFN units, the same function), so that each of 2 ranks holds one.
RUN_MPI_MODEL ?= build/passkey_hard.bin
RUN_MPI_PROMPT ?= --hard --prompt
RUN_MPI_LEN ?= 32768
RUN_MPI_DEPTH ?= 50
RUN_MPI_STEPS ?= 128
RUN_MPI_ARGS ?= -a pqcache
RUN_MPI := env $(MPI_ENV) $(MPIRUN) $(MPIRUN_FLAGS)

run-mpi: build/tiny_llama_mpi build/make_passkey $(RUN_MPI_MODEL)
	build/make_passkey $(RUN_MPI_PROMPT) $(RUN_MPI_LEN) $(RUN_MPI_DEPTH) 1 > build/passkey_prompt_mpi.txt
	@echo "=== 1 rank x 2 threads"
	$(RUN_MPI) -np 1 build/tiny_llama_mpi $(RUN_MPI_MODEL) --widen 2 --prompt-file build/passkey_prompt_mpi.txt \
	  -n $(RUN_MPI_STEPS) -t 2 $(RUN_MPI_ARGS)
	@echo "=== 2 ranks x 1 thread"
	$(RUN_MPI) -np 2 build/tiny_llama_mpi $(RUN_MPI_MODEL) --widen 2 --prompt-file build/passkey_prompt_mpi.txt \
	  -n $(RUN_MPI_STEPS) -t 1 $(RUN_MPI_ARGS)

# built by make test alongside the other groups' programs, where MPI is there
ifneq ($(shell command -v $(MPICC) 2>/dev/null),)
DEPS_test-mpi := build/tiny_llama_mpi build/tiny_llama_gen build/make_passkey build/passkey_hard.bin
endif
test-mpi: $(DEPS_test-mpi)
	@MAKE="$(MAKE)" MPICC="$(MPICC)" MPIRUN="$(MPIRUN)" MPIRUN_FLAGS="$(MPIRUN_FLAGS)" \
	  sh examples/tiny_llama/test_mpi.sh

.PHONY: run-mpi test-mpi

endif # TINY_LLAMA_MPI_MK
