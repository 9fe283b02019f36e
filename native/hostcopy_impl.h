/* The copy-and-hash loop of ucm._hostcopy, compiled twice: by hostcopy.c for any CPU (SSE2 on
 * x86-64) and by hostcopy_avx2.c for CPUs with AVX2, where xxhash.h picks its AVX2 code and the
 * copy streams 32 bytes a store. HASH_COPY_IMPL names the function this inclusion defines.
 *
 * Each 64 KiB chunk is hashed (which brings it into the CPU cache) and then copied out of the
 * cache with non-temporal stores, which write the destination without first reading it into
 * the cache. The caller guarantees that nothing writes the source during the call: a chunk is
 * copied right after it is hashed, so a concurrent write could make the copy differ from what
 * was hashed. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define STREAM_ALIGN 32
#elif defined(__SSE2__)
#include <emmintrin.h>
#define STREAM_ALIGN 16
#endif

#define CHUNK (64 * 1024)

typedef struct {
    char *buf;
    size_t len;
} piece_t;

static void copy_chunk(char *d, const char *s, size_t n)
{
#if defined(STREAM_ALIGN)
    size_t head = (STREAM_ALIGN - ((uintptr_t)d & (STREAM_ALIGN - 1))) & (STREAM_ALIGN - 1);
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
#if defined(__AVX2__)
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
#else
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
#endif
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* The pieces in order take src's bytes; each chunk of src is hashed, then copied. */
uint64_t HASH_COPY_IMPL(const piece_t *pieces, Py_ssize_t count, const char *src)
{
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (Py_ssize_t p = 0; p < count; p++) {
        char *dst = pieces[p].buf;
        size_t n = pieces[p].len;
        for (size_t off = 0; off < n; off += CHUNK) {
            size_t len = n - off < CHUNK ? n - off : CHUNK;
            XXH3_64bits_update(&state, src, len);
            copy_chunk(dst + off, src, len);
            src += len;
        }
    }
#if defined(STREAM_ALIGN)
    _mm_sfence(); /* the streamed stores are visible before the caller is told */
#endif
    return XXH3_64bits_digest(&state);
}
