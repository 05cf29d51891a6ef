# pqcache inside llama.cpp (examples/llama_cpp): build/pqc_llama, make test-llamacpp,
# make bench-llamacpp. tools/llama_cpp.sh fetches, patches and builds llama.cpp (cached
# outside the clone; the first build takes minutes) and links build/llama_cpp_src and
# build/llama_cpp_build here.
.PHONY: llama-cpp test-llamacpp bench-llamacpp
LCPP_SRC := $(BUILD)/llama_cpp_src
LCPP_LIB := $(BUILD)/llama_cpp_build
LCPP_LIBS := $(LCPP_LIB)/src/libllama.a $(LCPP_LIB)/ggml/src/libggml.a $(LCPP_LIB)/ggml/src/libggml-cpu.a \
             $(LCPP_LIB)/ggml/src/libggml-base.a
LCPP_DIR := examples/llama_cpp

llama-cpp $(BUILD)/llama_cpp.stamp: $(LCPP_DIR)/llama.cpp.patch tools/llama_cpp.sh | $(BUILD)
	@sh tools/llama_cpp.sh && touch $(BUILD)/llama_cpp.stamp

# The glue and the command line: C99 under the project's warnings; llama.h and ggml.h as
# system headers (their style is not ours to police); the glue at -O3, which vectorizes
# its attention loops. Linked as C++ (libllama is), with
# the library compiled once for the example programs (build/pqcache_lib.o).
LCPP_CFLAGS = $(STD) -O2 $(DBG) $(WARN) -isystem $(LCPP_SRC)/include -isystem $(LCPP_SRC)/ggml/include -I.
$(BUILD)/pqc_llama: $(LCPP_DIR)/main.c $(LCPP_DIR)/pqc_llama.c $(LCPP_DIR)/pqc_llama.h $(BUILD)/pqcache_lib.o \
                    $(BUILD)/llama_cpp.stamp
	$(CC) $(LCPP_CFLAGS) -O3 -c $(LCPP_DIR)/pqc_llama.c -o $(BUILD)/pqc_llama_glue.o
	$(CC) $(LCPP_CFLAGS) -c $(LCPP_DIR)/main.c -o $(BUILD)/pqc_llama_main.o
	$(CXX) -o $@ $(BUILD)/pqc_llama_main.o $(BUILD)/pqc_llama_glue.o $(BUILD)/pqcache_lib.o $(LCPP_LIBS) \
	  -lpthread -lm -ldl

# Tests: the patch applies to the pinned llama.cpp; at a budget covering the sequence the
# greedy tokens are llama.cpp's own; a needle in 4K tokens of real text that llama.cpp's
# full attention finds is found at budget 0.1 (SmolLM2-135M-Instruct's GGUF, fetched by
# tools/setup.sh).
test-llamacpp: $(BUILD)/pqc_llama
	@sh tools/setup.sh --light
	@python3 $(LCPP_DIR)/test_llama_cpp.py

# decode speed and memory against llama.cpp's own attention, side by side
bench-llamacpp: $(BUILD)/pqc_llama
	@sh tools/setup.sh --light
	@python3 $(LCPP_DIR)/test_llama_cpp.py --bench $(BENCH_LLAMACPP_ARGS)
