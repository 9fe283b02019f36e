/* The copy-and-hash loop of ucm._hostcopy, compiled twice: by hostcopy.c for any CPU (SSE2 on
 * x86-64) and by hostcopy_avx2.c for CPUs with AVX2, where xxhash.h picks its AVX2 code and the
 * copy streams 32 bytes a store. HASH_COPY_IMPL names the function this inclusion defines.
 *
 * Each 64 KiB chunk is copied with non-temporal stores, which write the destination without
 * first reading it into the CPU cache, and then hashed: the copy's loads have brought the chunk
 * into the cache, so the hash reads it from there. Copying first lets the copy's independent
 * loads overlap the memory latency; hashing first left that to the hash's loads and was slower
 * (figures: docs/performance.md, Copy and checksum in one pass). The caller guarantees that
 * nothing writes the source during the call: a chunk is hashed right after it is copied, so a
 * concurrent write could make the copy differ from what was hashed. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__AVX2__)
#include <immintrin.h>
typedef __m256i vec_t;
#define STREAM_ALIGN 32
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSTREAM(p, v) _mm256_stream_si256((__m256i *)(p), (v))
#elif defined(__SSE2__)
#include <emmintrin.h>
typedef __m128i vec_t;
#define STREAM_ALIGN 16
#define VLOAD(p) _mm_loadu_si128((const __m128i *)(p))
#define VSTREAM(p, v) _mm_stream_si128((__m128i *)(p), (v))
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
    const size_t w = sizeof(vec_t);
    for (; i + 4 * w <= n; i += 4 * w) { /* four vectors in flight, streamed past the cache */
        vec_t a = VLOAD(s + i), b = VLOAD(s + i + w), c = VLOAD(s + i + 2 * w);
        vec_t e = VLOAD(s + i + 3 * w);
        VSTREAM(d + i, a);
        VSTREAM(d + i + w, b);
        VSTREAM(d + i + 2 * w, c);
        VSTREAM(d + i + 3 * w, e);
    }
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* The pieces in order take src's bytes; each chunk of src is copied, then hashed. */
uint64_t HASH_COPY_IMPL(const piece_t *pieces, Py_ssize_t count, const char *src)
{
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (Py_ssize_t p = 0; p < count; p++) {
        char *dst = pieces[p].buf;
        size_t n = pieces[p].len;
        for (size_t off = 0; off < n; off += CHUNK) {
            size_t len = n - off < CHUNK ? n - off : CHUNK;
            copy_chunk(dst + off, src, len);
            XXH3_64bits_update(&state, src, len);
            src += len;
        }
    }
#if defined(STREAM_ALIGN)
    _mm_sfence(); /* the streamed stores are visible before the caller is told */
#endif
    return XXH3_64bits_digest(&state);
}
