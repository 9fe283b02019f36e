/* ucm._hostcopy's copy-and-hash loop for CPUs with AVX2 (hostcopy.c picks it at import when
 * the CPU has it). The pragma compiles this file as if with -mavx2, which also makes xxhash.h
 * choose its AVX2 code; a compiler that ignores it builds the portable loop here again. */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2")
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define HASH_COPY_IMPL hash_copy_avx2
#include "hostcopy_impl.h"
#endif
