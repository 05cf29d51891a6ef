# fidelity.mk - the fidelity benchmark: how much of the attention that matters PQ selection
# keeps, against exact attention, on hard LLM-like keys (bench/hardkeys.h). Include from the
# top-level Makefile (which defines CC, BUILD and HDR); paths are relative to the
# repository root.
#
#   make bench-fidelity         build/bench_fidelity, then the run at s = 32768 (12 data sets
#                               x 10 settings of PQ and technique, 3 repetitions of each
#                               timing; about 10-15 minutes on 2 cores), then
#                               build/fidelity.png
#   make bench-fidelity-quick   s = 8192, 1 repetition (a minute or two), then
#                               build/fidelity_quick.png
#   make bench-fidelity-plot    only the drawing, from an earlier run's build/fidelity.dat
#   make bench-suite            build/bench_suite: the cache's default and settings on the
#                               second key family (bench/suitekeys.h), its tuning part and
#                               its reported part apart (a few minutes); bench-fidelity
#                               runs it too, bench-fidelity-quick its quick form
#   make bench-fidelity FIDELITY_ARGS="--s 65536 --reps 1"
#
# gnuplot draws the plot; when it is missing and we run as root with apt-get, gnuplot-nox
# is installed, otherwise a message says how to draw the data later.

ifndef PQC_BENCH_FIDELITY_MK
PQC_BENCH_FIDELITY_MK := 1

BUILD ?= build
HDR ?= pqcache.h
FIDELITY_ARGS ?=

$(BUILD)/bench_fidelity: bench/bench_fidelity.c bench/hardkeys.h bench/bench_util.h $(HDR)
	@mkdir -p $(BUILD)
	$(CC) -std=c99 -O2 -Wall -Wextra -Werror -pedantic $< -o $@ -lm -lpthread

# $(call FIDELITY_PLOT,name): draws $(BUILD)/name.png from $(BUILD)/name.dat
define FIDELITY_PLOT
if ! command -v gnuplot >/dev/null 2>&1; then \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
    echo "bench-fidelity: gnuplot is missing; apt-get install -y gnuplot-nox"; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y gnuplot-nox >/dev/null 2>&1 || \
    { DEBIAN_FRONTEND=noninteractive apt-get update >/dev/null 2>&1 && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y gnuplot-nox >/dev/null 2>&1; } || \
    echo "bench-fidelity: apt-get could not install gnuplot-nox"; \
  else \
    echo "bench-fidelity: gnuplot is missing (installing needs root: apt-get install gnuplot-nox);"; \
    echo "bench-fidelity: the data is in $(BUILD)/$(1).dat; draw it later with:"; \
    echo "  gnuplot -e \"dat='$(BUILD)/$(1).dat'; png='$(BUILD)/$(1).png'\" bench/fidelity.gp"; \
  fi; \
fi; \
if command -v gnuplot >/dev/null 2>&1; then \
  gnuplot -e "dat='$(BUILD)/$(1).dat'; png='$(BUILD)/$(1).png'" bench/fidelity.gp && \
  echo "bench-fidelity: wrote $(BUILD)/$(1).png"; \
fi
endef

$(BUILD)/bench_suite: bench/bench_suite.c bench/suitekeys.h bench/hardkeys.h bench/bench_util.h $(HDR)
	@mkdir -p $(BUILD)
	$(CC) -std=c99 -O2 -Wall -Wextra -Werror -pedantic $< -o $@ -lm -lpthread

bench-fidelity: $(BUILD)/bench_fidelity $(BUILD)/bench_suite
	$(BUILD)/bench_fidelity --out $(BUILD)/fidelity.dat $(FIDELITY_ARGS)
	@$(call FIDELITY_PLOT,fidelity)
	$(BUILD)/bench_suite

bench-fidelity-quick: $(BUILD)/bench_fidelity $(BUILD)/bench_suite
	$(BUILD)/bench_fidelity --quick --out $(BUILD)/fidelity_quick.dat $(FIDELITY_ARGS)
	@$(call FIDELITY_PLOT,fidelity_quick)
	$(BUILD)/bench_suite --quick

bench-suite: $(BUILD)/bench_suite
	$(BUILD)/bench_suite $(SUITE_ARGS)

bench-fidelity-plot:
	@$(call FIDELITY_PLOT,fidelity)

.PHONY: bench-fidelity bench-fidelity-quick bench-fidelity-plot bench-suite

endif # PQC_BENCH_FIDELITY_MK
