/* The coding loops of ucm._kvcodec, compiled twice: by kvcodec.c for any CPU and by
 * kvcodec_avx2.c for CPUs with AVX2 and F16C. KV_SUFFIX names the functions an inclusion
 * defines. One part of a block at a time: its [tokens, channels] matrix, stored in the order
 * the plan gives (t-major [T/ti, C/ci, ti, ci] or c-major [C/ci, T/ti, ci, ti]); keys ("k")
 * are grouped per channel along `group` tokens, values per token along `group` channels, with
 * two-level scales (ucm/codecs/quant.py is the reference, bit for bit: no fused multiply-add,
 * float32 throughout, round to nearest even). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__has_include)
#if __has_include(<xxhash.h>)
#define KV_HAVE_XXH 1 /* the payload's xxh3-64 taken while decoding (as ucm.block checks it) */
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif
#endif

#define KV_CAT2(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_FN(name) KV_CAT(name, KV_SUFFIX)

#ifndef KV_SHARED_DONE
#define KV_SHARED_DONE
#define KV_GRID 255

typedef struct {
    size_t kind, tokens, channels, group, out_offset, payload_offset, c_major, ti, ci;
    size_t payload_len; /* the part's bytes in the payload (checked by the caller) */
} kv_part_t;

/* The block's destination: one buffer, or the pieces of a ucm.block.Scatter filled in order as
 * if they were one buffer (vLLM's per-layer pieces). */
typedef struct {
    char *buf;
    size_t len;
} kv_piece_t;

typedef struct {
    const kv_piece_t *pieces;
    size_t count, idx, start; /* the piece last written and its offset in the block */
    char *tmp;                /* a row that crosses a piece boundary is converted here first */
    int stream;               /* non-temporal stores (large destinations: no read for ownership) */
} kv_out_t;

/* Where [off, off + len) of the block lies when one piece holds all of it, else NULL. */
static inline char *kv_out_span(kv_out_t *o, size_t off, size_t len)
{
    if (off < o->start)
        o->idx = o->start = 0;
    while (o->idx < o->count && off - o->start >= o->pieces[o->idx].len)
        o->start += o->pieces[o->idx++].len;
    if (o->idx == o->count)
        return NULL;
    size_t at = off - o->start;
    return len <= o->pieces[o->idx].len - at ? o->pieces[o->idx].buf + at : NULL;
}

/* block[off, off + len) = src, across piece boundaries (the caller checked it fits). */
static void kv_out_copy(kv_out_t *o, size_t off, const char *src, size_t len)
{
    while (len) {
        kv_out_span(o, off, 0); /* moves to the piece holding off */
        if (o->idx == o->count)
            return;
        size_t at = off - o->start, n = o->pieces[o->idx].len - at;
        n = n < len ? n : len;
        memcpy(o->pieces[o->idx].buf + at, src, n);
        off += n;
        src += n;
        len -= n;
    }
}

static inline float kv_bits_float(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t kv_float_bits(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits;
}

static inline float kv_half_to_float_sw(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 113;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return kv_bits_float(bits);
}

static inline uint16_t kv_float_to_half_sw(float f)
{
    uint32_t x = kv_float_bits(f);
    uint32_t sign = (x >> 16) & 0x8000, absx = x & 0x7fffffff;
    if (absx >= 0x477ff000) { /* rounds to inf (65520 and above), inf or nan */
        if (absx > 0x7f800000)
            return (uint16_t)(sign | 0x7e00);
        return (uint16_t)(sign | 0x7c00);
    }
    if (absx < 0x38800000) { /* subnormal or zero: round to nearest even in float arithmetic */
        float a = kv_bits_float(absx) + 0.5f; /* the subnormal half bits land in the mantissa */
        return (uint16_t)(sign | (kv_float_bits(a) - 0x3f000000));
    }
    uint32_t mant_odd = (absx >> 13) & 1;
    absx += 0xc8000fff + mant_odd; /* rebias exponent and round to nearest even */
    return (uint16_t)(sign | (absx >> 13));
}

static inline int kv_half_finite(uint16_t h) { return (h & 0x7c00) != 0x7c00; }

/* A 16-bit element stored at any address: a piece of a Scatter may start at an odd byte. */
static inline void kv_put16(char *p, uint16_t v) { memcpy(p, &v, 2); }

/* The float16 next to h toward -inf (down) or +inf (up), as numpy's nextafter. */
static inline uint16_t kv_half_next(uint16_t h, int up)
{
    if ((h & 0x7fff) == 0)
        return up ? 0x0001 : 0x8001;
    int negative = h >> 15;
    return (uint16_t)(negative == !up ? h + 1 : h - 1);
}

/* Element offsets of a part's token and channel indices in its stored order. */
static void kv_offsets(const kv_part_t *p, size_t *toff, size_t *coff)
{
    size_t t = p->tokens, c = p->channels, ti = p->ti, ci = p->ci;
    for (size_t i = 0; i < t; i++)
        toff[i] = p->c_major ? (i / ti) * ti * ci + i % ti : (i / ti) * (c / ci) * ti * ci +
                                                             (i % ti) * ci;
    for (size_t j = 0; j < c; j++)
        coff[j] = p->c_major ? (j / ci) * (t / ti) * ti * ci + (j % ci) * ti : (j / ci) * ti * ci +
                                                                              j % ci;
}

static inline size_t kv_groups(const kv_part_t *p)
{
    return p->kind == 1 ? (p->tokens / p->group) * p->channels
                        : p->tokens * (p->channels / p->group);
}
#endif /* KV_SHARED_DONE */

static inline float KV_FN(kv_half_to_float)(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return kv_half_to_float_sw(h);
#endif
}

static inline uint16_t KV_FN(kv_float_to_half)(float f)
{
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return kv_float_to_half_sw(f);
#endif
}

/* row (float, n values) -> out in `dtype` (1 fp16, 2 bf16, 3 fp32), contiguous. `stream`:
 * non-temporal stores where out is 16-byte aligned (AVX2 loops only). */
static inline void KV_FN(kv_store_row)(const float *row, char *out, size_t n, int dtype,
                                       int stream)
{
    size_t i = 0;
#if defined(__AVX2__)
    size_t itemsize = dtype == 3 ? 4 : 2;
    if (stream && ((uintptr_t)out & (itemsize - 1)))
        stream = 0; /* elements never reach a 16-byte boundary */
#define KV_PUT(p, v) (stream ? _mm_stream_si128((__m128i *)(p), (v)) \
                             : _mm_storeu_si128((__m128i *)(p), (v)))
#else
    (void)stream;
#endif
    if (dtype == 3) {
#if defined(__AVX2__)
        if (stream) {
            for (; i < n && ((uintptr_t)(out + 4 * i) & 15); i++)
                memcpy(out + 4 * i, row + i, 4);
            for (; i + 4 <= n; i += 4)
                _mm_stream_si128((__m128i *)(out + 4 * i), _mm_castps_si128(_mm_loadu_ps(row + i)));
        }
#endif
        memcpy(out + 4 * i, row + i, (n - i) * 4);
        return;
    }
    if (dtype == 1) {
#if defined(__AVX2__) && defined(__F16C__)
        for (; stream && i < n && ((uintptr_t)(out + 2 * i) & 15); i++)
            kv_put16(out + 2 * i, KV_FN(kv_float_to_half)(row[i]));
        for (; i + 8 <= n; i += 8)
            KV_PUT(out + 2 * i, _mm256_cvtps_ph(_mm256_loadu_ps(row + i),
                                                _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++)
            kv_put16(out + 2 * i, KV_FN(kv_float_to_half)(row[i]));
        return;
    }
    const uint32_t *u = (const uint32_t *)row;
#if defined(__AVX2__)
    for (; stream && i < n && ((uintptr_t)(out + 2 * i) & 15); i++)
        kv_put16(out + 2 * i, (uint16_t)((u[i] + 0x7fffu + ((u[i] >> 16) & 1u)) >> 16));
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    for (; i + 8 <= n; i += 8) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(u + i));
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, half), lsb), 16);
        KV_PUT(out + 2 * i, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                             _mm256_extracti128_si256(r, 1)));
    }
#undef KV_PUT
#endif
    for (; i < n; i++) /* bf16: round to nearest even (the values are finite) */
        kv_put16(out + 2 * i, (uint16_t)((u[i] + 0x7fffu + ((u[i] >> 16) & 1u)) >> 16));
}

/* block[off, off + n elements) = row in `dtype`: straight into the piece that holds it, else
 * converted into o->tmp and copied across the pieces. */
static inline void KV_FN(kv_emit)(kv_out_t *o, size_t off, const float *row, size_t n,
                                  int dtype)
{
    size_t len = n * (dtype == 3 ? 4 : 2);
    char *dst = kv_out_span(o, off, len);
    if (dst != NULL) {
        KV_FN(kv_store_row)(row, dst, n, dtype, o->stream);
        return;
    }
    KV_FN(kv_store_row)(row, o->tmp, n, dtype, 0);
    kv_out_copy(o, off, o->tmp, len);
}

/* One element of `dtype` at element index i of in, as float. */
static inline float KV_FN(kv_load)(const char *in, size_t i, int dtype)
{
    if (dtype == 3) {
        float f;
        memcpy(&f, in + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, in + 2 * i, 2);
    return dtype == 1 ? KV_FN(kv_half_to_float)(h) : kv_bits_float((uint32_t)h << 16);
}

/* The code at stored position i of a part's codes (int8: a byte each; int4: two a byte, the
 * even position in the low nibble). */
static inline float KV_FN(kv_code)(const uint8_t *codes, size_t i, int bits)
{
    return (float)(bits == 8 ? codes[i] : (codes[i >> 1] >> ((i & 1) * 4)) & 15);
}

#if defined(__AVX2__)
/* Eight codes from stored position i (a multiple of 8), as floats. */
static inline __m256 KV_FN(kv_codes8)(const uint8_t *codes, size_t i, int bits)
{
    __m128i b;
    if (bits == 8) {
        b = _mm_loadl_epi64((const __m128i *)(codes + i));
    } else {
        uint32_t w;
        memcpy(&w, codes + i / 2, 4);
        __m128i x = _mm_cvtsi32_si128((int)w), m = _mm_set1_epi8(15);
        b = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

/* a[s], a[s + d], ... (n of them: 1, 2, 4 or 8) repeated over eight lanes */
static inline __m256 KV_FN(kv_pattern)(const float *a, size_t s, size_t n, size_t d)
{
    if (n == 1)
        return _mm256_set1_ps(a[s]);
    if (n == 2) {
        float x = a[s], y = a[s + d];
        return _mm256_setr_ps(x, y, x, y, x, y, x, y);
    }
    if (n == 4) {
        float x = a[s], y = a[s + d], z = a[s + 2 * d], w = a[s + 3 * d];
        return _mm256_setr_ps(x, y, z, w, x, y, z, w);
    }
    return _mm256_setr_ps(a[s], a[s + d], a[s + 2 * d], a[s + 3 * d], a[s + 4 * d],
                          a[s + 5 * d], a[s + 6 * d], a[s + 7 * d]);
}
#endif

/* dst[0..n) = code * step + min with one (min, step), the codes of stored positions i.. */
static inline void KV_FN(kv_run)(float *dst, const uint8_t *codes, size_t i, size_t n, int bits,
                                 float mn, float st)
{
    size_t k = 0;
#if defined(__AVX2__)
    if (bits == 8 || i % 2 == 0) {
        __m256 vm = _mm256_set1_ps(mn), vs = _mm256_set1_ps(st);
        for (; k + 8 <= n; k += 8)
            _mm256_storeu_ps(dst + k, _mm256_add_ps(_mm256_mul_ps(
                                          KV_FN(kv_codes8)(codes, i + k, bits), vs), vm));
    }
#endif
    for (; k < n; k++)
        dst[k] = KV_FN(kv_code)(codes, i + k, bits) * st + mn;
}

/* A part whose codes are in its stored order, decoded in that order (writes are sequential).
 * Group (scale) index of logical (t, c): keys (t / group) * channels + c, values
 * t * (channels / group) + c / group. The stored order is [A, B, I, J] (t-major: T/ti, C/ci,
 * ti, ci; c-major: C/ci, T/ti, ci, ti). Fast cases: row-major parts; tiles whose groups vary
 * only along J (keys t-major, values c-major, the group a multiple of the tile along the other
 * axis: vLLM's AMX tiles) in runs of 1, 2, 4 or 8; channel-major keys ([C, T]) in runs of
 * whole groups. Anything else takes each element's group from a table built for the part.
 * scratch: floats 3 * count + channels + 2 * groups + 16; size_t tokens + channels. Writes
 * block bytes [out_offset, out_offset + count * itemsize) through `out`. */
static void KV_FN(kv_decode_part)(const kv_part_t *p, kv_out_t *out, const uint8_t *in,
                                  int bits, int dtype, float *scratch, size_t *toff,
                                  size_t *coff)
{
    size_t T = p->tokens, C = p->channels, g = p->group, ng = kv_groups(p), n = T * C;
    size_t ti = p->ti, ci = p->ci, per_row = p->kind == 1 ? C : C / g;
    size_t itemsize = dtype == 3 ? 4 : 2;
    float levels = (float)((1 << bits) - 1);
    float *pmin = scratch, *pstep = scratch + ng, *f = scratch + 2 * ng;
    uint16_t mh, sh;
    memcpy(&mh, in, 2);
    memcpy(&sh, in + 2, 2);
    float m = KV_FN(kv_half_to_float)(mh), s = KV_FN(kv_half_to_float)(sh);
    const uint8_t *lo = in + 4, *hi = in + 4 + ng, *codes = in + 4 + 2 * ng;
    for (size_t i = 0; i < ng; i++) {
        pmin[i] = m + (float)lo[i] * s;
        pstep[i] = ((float)((int)hi[i] - (int)lo[i]) * s) / levels;
    }
    size_t o = p->out_offset; /* the block offset written next */
    if (!p->c_major && ti == 1 && ci == 1) { /* row-major: a row at a time (kept in L1) */
        for (size_t t = 0; t < T; t++, o += C * itemsize) {
            if (p->kind == 2) {
                for (size_t j = 0; j < per_row; j++)
                    KV_FN(kv_run)(f + j * g, codes, t * C + j * g, g, bits,
                                  pmin[t * per_row + j], pstep[t * per_row + j]);
            } else {
                const float *mm = pmin + (t / g) * per_row, *ss = pstep + (t / g) * per_row;
                size_t i = t * C, c = 0;
#if defined(__AVX2__)
                if (bits == 8 || i % 2 == 0)
                    for (; c + 8 <= C; c += 8)
                        _mm256_storeu_ps(f + c, _mm256_add_ps(_mm256_mul_ps(
                            KV_FN(kv_codes8)(codes, i + c, bits), _mm256_loadu_ps(ss + c)),
                            _mm256_loadu_ps(mm + c)));
#endif
                for (; c < C; c++)
                    f[c] = KV_FN(kv_code)(codes, i + c, bits) * ss[c] + mm[c];
            }
            KV_FN(kv_emit)(out, o, f, C, dtype);
        }
        return;
    }
    size_t tile = ti * ci;
    size_t nJ = p->c_major ? ti : ci, nA = p->c_major ? C / ci : T / ti;
    size_t nB = p->c_major ? T / ti : C / ci;
    /* keys t-major: J runs along channels (step 1); values c-major: along tokens (C/g) */
    int along_j = p->kind == 1 ? !p->c_major && g % ti == 0 : p->c_major && g % ci == 0;
    size_t d = p->kind == 1 ? 1 : C / g;
    if (along_j && tile % 8 == 0 && (nJ == 1 || nJ == 2 || nJ == 4 || nJ == 8)) {
        size_t i = 0;
        for (size_t a = 0; a < nA; a++, o += nB * tile * itemsize) { /* nB tiles, in L1 */
            float *fa = f;
            for (size_t b = 0; b < nB; b++, i += tile, fa += tile) {
                size_t t0 = p->c_major ? b * ti : a * ti, c0 = p->c_major ? a * ci : b * ci;
                size_t s0 = p->kind == 1 ? (t0 / g) * C + c0 : t0 * (C / g) + c0 / g;
#if defined(__AVX2__)
                __m256 vm = KV_FN(kv_pattern)(pmin, s0, nJ, d);
                __m256 vs = KV_FN(kv_pattern)(pstep, s0, nJ, d);
                for (size_t k = 0; k < tile; k += 8)
                    _mm256_storeu_ps(fa + k, _mm256_add_ps(_mm256_mul_ps(
                                                 KV_FN(kv_codes8)(codes, i + k, bits), vs), vm));
#else
                for (size_t k = 0; k < tile; k++) {
                    size_t sj = s0 + (k % nJ) * d;
                    fa[k] = KV_FN(kv_code)(codes, i + k, bits) * pstep[sj] + pmin[sj];
                }
#endif
            }
            KV_FN(kv_emit)(out, o, f, nB * tile, dtype);
        }
        return;
    }
    if (p->kind == 1 && p->c_major && ti == 1 && ci == 1) { /* keys [C, T]: a channel a time */
        for (size_t c = 0; c < C; c++, o += T * itemsize) {
            for (size_t t0 = 0; t0 < T; t0 += g) {
                size_t sj = (t0 / g) * C + c;
                KV_FN(kv_run)(f + t0, codes, c * T + t0, g, bits, pmin[sj], pstep[sj]);
            }
            KV_FN(kv_emit)(out, o, f, T, dtype);
        }
        return;
    }
    /* any order: each element's (min, step) from the part's group table */
    float *rmin = f + n, *rstep = f + 2 * n;
    kv_offsets(p, toff, coff);
    for (size_t t = 0; t < T; t++)
        for (size_t c = 0; c < C; c++) {
            size_t sj = p->kind == 1 ? (t / g) * C + c : t * per_row + c / g;
            rmin[toff[t] + coff[c]] = pmin[sj];
            rstep[toff[t] + coff[c]] = pstep[sj];
        }
    for (size_t i = 0; i < n; i++)
        f[i] = KV_FN(kv_code)(codes, i, bits) * rstep[i] + rmin[i];
    KV_FN(kv_emit)(out, o, f, n, dtype);
}

/* Returns 0, 1 (a non-finite value) or 2 (the range overflows float16). The codes are written
 * in the part's stored order. scratch: as kv_decode_part's. */
static int KV_FN(kv_encode_part)(const kv_part_t *p, const char *in, uint8_t *dst, int bits,
                                 int dtype, float *scratch, size_t *toff, size_t *coff)
{
    size_t tokens = p->tokens, channels = p->channels, group = p->group, ng = kv_groups(p);
    size_t per_row = p->kind == 1 ? channels : channels / group, n = tokens * channels;
    float *x = scratch, *gmin = scratch + n, *gmax = scratch + n + ng;
    uint8_t *order = (uint8_t *)(scratch + n + 2 * ng); /* int4 codes before packing */
    int levels = (1 << bits) - 1;
    /* int4 rows of odd length do not start on a byte: those parts pack through `order` */
    int plain = !p->c_major && p->ti == 1 && p->ci == 1 && !(bits == 4 && channels % 2);
    if (plain) {
        for (size_t i = 0; i < n; i++)
            x[i] = KV_FN(kv_load)(in, i, dtype);
    } else {
        kv_offsets(p, toff, coff);
        for (size_t t = 0; t < tokens; t++)
            for (size_t c = 0; c < channels; c++)
                x[t * channels + c] = KV_FN(kv_load)(in, toff[t] + coff[c], dtype);
    }
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad |= (kv_float_bits(x[i]) & 0x7f800000u) == 0x7f800000u;
    if (bad)
        return 1;
    /* group minimums and maximums */
    if (p->kind == 1) {
        for (size_t gt = 0; gt < tokens / group; gt++) {
            float *mn = gmin + gt * per_row, *mx = gmax + gt * per_row;
            const float *r = x + gt * group * channels;
            for (size_t c = 0; c < channels; c++)
                mn[c] = mx[c] = r[c];
            for (size_t i = 1; i < group; i++) {
                r += channels;
                for (size_t c = 0; c < channels; c++) {
                    mn[c] = r[c] < mn[c] ? r[c] : mn[c];
                    mx[c] = r[c] > mx[c] ? r[c] : mx[c];
                }
            }
        }
    } else {
        for (size_t t = 0; t < tokens; t++)
            for (size_t j = 0; j < per_row; j++) {
                const float *r = x + t * channels + j * group;
                float mn = r[0], mx = r[0];
                for (size_t i = 1; i < group; i++) {
                    mn = r[i] < mn ? r[i] : mn;
                    mx = r[i] > mx ? r[i] : mx;
                }
                gmin[t * per_row + j] = mn;
                gmax[t * per_row + j] = mx;
            }
    }
    float lo_all = gmin[0], hi_all = gmax[0];
    for (size_t i = 1; i < ng; i++) {
        lo_all = gmin[i] < lo_all ? gmin[i] : lo_all;
        hi_all = gmax[i] > hi_all ? gmax[i] : hi_all;
    }
    /* the part's grid: M rounded down, S up, M + 255 S >= every value */
    uint16_t mh = KV_FN(kv_float_to_half)(lo_all);
    if (KV_FN(kv_half_to_float)(mh) > lo_all)
        mh = kv_half_next(mh, 0);
    if (!kv_half_finite(mh))
        return 2;
    float m = KV_FN(kv_half_to_float)(mh);
    float span = (hi_all - m) / (float)KV_GRID;
    if (!(span > 0))
        span = 1.0f;
    uint16_t sh = KV_FN(kv_float_to_half)(span);
    if (KV_FN(kv_half_to_float)(sh) < span)
        sh = kv_half_next(sh, 1);
    if (!kv_half_finite(sh))
        return 2;
    while (m + (float)KV_GRID * KV_FN(kv_half_to_float)(sh) < hi_all) {
        sh = kv_half_next(sh, 1);
        if (!kv_half_finite(sh))
            return 2;
    }
    float s = KV_FN(kv_half_to_float)(sh);
    memcpy(dst, &mh, 2);
    memcpy(dst + 2, &sh, 2);
    uint8_t *lo = dst + 4, *hi = dst + 4 + ng, *codes = dst + 4 + 2 * ng;
    /* per group: the grid lines around it; gmin/gmax become its minimum and 1 / step */
    for (size_t i = 0; i < ng; i++) {
        float l = floorf((gmin[i] - m) / s);
        l = l < 0 ? 0 : (l > KV_GRID - 1 ? KV_GRID - 1 : l);
        int li = (int)l;
        if (m + (float)li * s > gmin[i] && li > 0)
            li--;
        float h = ceilf((gmax[i] - m) / s);
        h = h < 1 ? 1 : (h > KV_GRID ? KV_GRID : h);
        int hi_ = (int)h;
        if (hi_ < li + 1)
            hi_ = li + 1;
        float mn = m + (float)li * s, step = ((float)(hi_ - li) * s) / (float)levels;
        if (mn + (float)levels * step < gmax[i] && hi_ < KV_GRID) {
            hi_++;
            step = ((float)(hi_ - li) * s) / (float)levels;
        }
        lo[i] = (uint8_t)li;
        hi[i] = (uint8_t)hi_;
        gmin[i] = mn;
        gmax[i] = 1.0f / step;
    }
    float flevels = (float)levels;
    for (size_t t = 0; t < tokens; t++) {
        const float *r = x + t * channels;
        const float *mm, *inv;
        size_t stride;
        if (p->kind == 1) {
            mm = gmin + (t / group) * per_row;
            inv = gmax + (t / group) * per_row;
            stride = 1; /* one parameter per channel */
        } else {
            mm = gmin + t * per_row;
            inv = gmax + t * per_row;
            stride = 0; /* one per group of channels */
        }
        float *q = (float *)r; /* codes overwrite the row in place, as floats */
        for (size_t c = 0; c < channels; c++) {
            size_t k = stride ? c : c / group;
            float v = nearbyintf((r[c] - mm[k]) * inv[k]);
            q[c] = v < 0 ? 0 : (v > flevels ? flevels : v);
        }
        if (!plain) { /* codes in the stored order: int8 in place, int4 through `order` */
            uint8_t *o = bits == 8 ? codes : order;
            for (size_t c = 0; c < channels; c++)
                o[toff[t] + coff[c]] = (uint8_t)q[c];
        } else if (bits == 8) {
            uint8_t *o = codes + t * channels;
            for (size_t c = 0; c < channels; c++)
                o[c] = (uint8_t)q[c];
        } else {
            uint8_t *o = codes + t * channels / 2;
            for (size_t c = 0; c < channels / 2; c++)
                o[c] = (uint8_t)((uint8_t)q[2 * c] | ((uint8_t)q[2 * c + 1] << 4));
        }
    }
    if (!plain && bits == 4) {
        for (size_t i = 0; i < n / 2; i++)
            codes[i] = (uint8_t)(order[2 * i] | (order[2 * i + 1] << 4));
        if (n % 2) /* an odd count: the last code alone in the low nibble */
            codes[n / 2] = order[n - 1];
    }
    return 0;
}

/* A whole block, parts already checked against the buffers. With `hash` (a reset XXH3 state,
 * when built with xxhash.h) the payload is hashed in the same pass, in order, each part's
 * bytes just before they are decoded (then read from the cache), and all `payload_len` of them:
 * the digest covers exactly what is stored. */
void KV_FN(kv_decode_block)(const kv_part_t *parts, size_t nparts, kv_out_t *out,
                            const uint8_t *in, size_t payload_len, int bits, int dtype,
                            float *fscratch, size_t *zscratch, void *hash)
{
    size_t hashed = 0;
    for (size_t i = 0; i < nparts; i++) {
        const kv_part_t *p = parts + i;
#if defined(KV_HAVE_XXH)
        size_t end = p->payload_offset + p->payload_len;
        if (hash != NULL && end > hashed) {
            XXH3_64bits_update((XXH3_state_t *)hash, in + hashed, end - hashed);
            hashed = end;
        }
#endif
        if (p->kind == 0) {
            kv_out_copy(out, p->out_offset, (const char *)in + p->payload_offset, p->tokens);
            continue;
        }
        KV_FN(kv_decode_part)(p, out, in + p->payload_offset, bits, dtype, fscratch, zscratch,
                              zscratch + p->tokens);
    }
#if defined(KV_HAVE_XXH)
    if (hash != NULL && payload_len > hashed)
        XXH3_64bits_update((XXH3_state_t *)hash, in + hashed, payload_len - hashed);
#else
    (void)hash;
    (void)hashed;
#endif
#if defined(__AVX2__)
    if (out->stream)
        _mm_sfence(); /* the streamed stores are visible before the caller reads the block */
#endif
}

int KV_FN(kv_encode_block)(const kv_part_t *parts, size_t nparts, uint8_t *out, const char *in,
                           int bits, int dtype, float *fscratch, size_t *zscratch)
{
    for (size_t i = 0; i < nparts; i++) {
        const kv_part_t *p = parts + i;
        if (p->kind == 0) {
            memcpy(out + p->payload_offset, in + p->out_offset, p->tokens);
            continue;
        }
        int status = KV_FN(kv_encode_part)(p, in + p->out_offset, out + p->payload_offset, bits,
                                           dtype, fscratch, zscratch, zscratch + p->tokens);
        if (status)
            return status;
    }
    return 0;
}
