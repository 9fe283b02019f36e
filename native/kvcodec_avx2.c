/* ucm._kvcodec's coding loops for CPUs with AVX2 and F16C (kvcodec.c picks them at import when
 * the CPU has both); a compiler that ignores the pragma builds the portable loops again. */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,f16c")
#define KV_SUFFIX avx2
#include "kvcodec_impl.h"
#endif
