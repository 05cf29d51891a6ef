# needle.mk - needle-in-a-haystack evaluation of the attention modes on the
# passkey model (examples/tiny_llama/tools/needle.c). Include from the top-level
# Makefile (build.mk includes it too; including it twice is harmless); paths
# are relative to the repository root. Uses the includer's CC and CFLAGS
# (NEEDLE_CFLAGS overrides them), with -std=c99 and the warnings of flags.mk.
#
#   make needle          build/needle and the harder passkey model
#                        (build/passkey_hard.bin), then the grid: lengths 4K 8K
#                        16K 32K x depths 0 25 50 75 100 % x modes full,
#                        pq-plain (plain PQ), pqcache (the default), oracle and
#                        window at budget 0.1 (about 2.5 minutes on 2 cores);
#                        prints the accuracy table, writes build/needle.dat and
#                        build/needle.gp and draws examples/tiny_llama/needle.png
#                        with gnuplot (installed with apt-get when missing and
#                        running as root; otherwise a message says how to get it)
#   make needle NEEDLE_MODEL=build/passkey.bin the original passkey model
#   make needle NEEDLE_ARGS=--long             adds 64K and 128K (much longer)
#   make needle NEEDLE_ARGS="--depths 0,10,20,30,40,50,60,70,80,90,100 --seeds 3"

ifndef TINY_LLAMA_NEEDLE_MK
TINY_LLAMA_NEEDLE_MK := 1

include examples/tiny_llama/flags.mk
include examples/tiny_llama/tools/passkey.mk

NEEDLE_ARGS ?=
NEEDLE_MODEL ?= build/passkey_hard.bin
NEEDLE_OUT ?= build/needle
NEEDLE_PNG ?= examples/tiny_llama/needle.png
NEEDLE_CFLAGS ?= $(if $(CFLAGS),$(CFLAGS),-O2)
NEEDLE_DEPS := examples/tiny_llama/tools/needle.c $(PASSKEY_SRCS) \
               $(TINY_LLAMA_ENGINE) examples/tiny_llama/tl_pqcache.h pqcache.h

build/needle: $(NEEDLE_DEPS)
	@mkdir -p build
	$(CC) $(NEEDLE_CFLAGS) $(TINY_LLAMA_STD) $(TINY_LLAMA_WARN) -o $@ examples/tiny_llama/tools/needle.c -lm -lpthread

# Draws the heatmap from the data the grid wrote; installs gnuplot if missing.
define NEEDLE_PLOT
if ! command -v gnuplot >/dev/null 2>&1; then \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
    echo "needle: gnuplot is missing; apt-get install -y gnuplot-nox"; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y gnuplot-nox >/dev/null 2>&1 || \
    { DEBIAN_FRONTEND=noninteractive apt-get update >/dev/null 2>&1 && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y gnuplot-nox >/dev/null 2>&1; } || \
    echo "needle: apt-get could not install gnuplot-nox"; \
  else \
    echo "needle: gnuplot is missing (installing needs root: apt-get install gnuplot-nox);"; \
    echo "needle: the data is in $(NEEDLE_OUT).dat; draw it later with: gnuplot $(NEEDLE_OUT).gp"; \
  fi; \
fi; \
if command -v gnuplot >/dev/null 2>&1; then \
  gnuplot $(NEEDLE_OUT).gp && echo "needle: wrote $(NEEDLE_PNG)"; \
fi
endef

needle: build/needle $(NEEDLE_MODEL)
	build/needle $(NEEDLE_MODEL) $(NEEDLE_ARGS) --out $(NEEDLE_OUT) --png $(NEEDLE_PNG)
	@$(NEEDLE_PLOT)

# Only the drawing, from an earlier run's data.
needle-plot:
	@$(NEEDLE_PLOT)

.PHONY: needle needle-plot

endif # TINY_LLAMA_NEEDLE_MK
