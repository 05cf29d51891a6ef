/* pqcache_lib.c - pqcache.h's implementation alone, compiled once for the example's
   programs that include tl_pqcache.h (or pqcache.h) with TL_PQCACHE_NO_LIBRARY_IMPLEMENTATION
   (build.mk: build/pqcache_lib.o, and its sanitizer builds in the top-level Makefile). */
#define PQCACHE_IMPLEMENTATION
#include "../../pqcache.h"
