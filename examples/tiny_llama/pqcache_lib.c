/* pqcache_lib.c - pqcache.h's implementation alone, compiled once for the example's
   programs that include tl_pqcache.h (or pqcache.h) with TL_PQCACHE_NO_LIBRARY_IMPLEMENTATION
   and for the Python binding's shared library (build.mk: build/pqcache_lib.o,
   position-independent; its sanitizer builds in the top-level Makefile). */
#define PQCACHE_IMPLEMENTATION
#include "../../pqcache.h"
