/* The dequantizing loop of ucm._kvcodec, compiled twice: by kvcodec.c for any CPU and by
 * kvcodec_avx2.c for CPUs with AVX2 and F16C (the vector float16 conversions). KV_IMPL names
 * the function this inclusion defines. One part of a block: a row-major [tokens, channels]
 * matrix; keys ("k") have a minimum and a step per channel and group of `group` tokens,
 * values per token and group of `group` channels (ucm/codecs/quant.py is the reference). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float kv_half_to_float(uint16_t h)
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
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t kv_float_to_half(float f)
{
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, absx = x & 0x7fffffff;
    if (absx >= 0x47800000) /* overflow, inf or nan */
        return (uint16_t)(sign | (absx > 0x7f800000 ? 0x7e00 : 0x7c00));
    if (absx < 0x38800000) { /* subnormal or zero: round to nearest even in float arithmetic */
        float a;
        memcpy(&a, &absx, 4);
        a += 0.5f; /* 2^-1: the subnormal half bits land in the low mantissa */
        uint32_t b;
        memcpy(&b, &a, 4);
        return (uint16_t)(sign | (b - 0x3f000000));
    }
    uint32_t mant_odd = (absx >> 13) & 1;
    absx += 0xc8000fff + mant_odd; /* rebias exponent and round to nearest even */
    return (uint16_t)(sign | (absx >> 13));
#endif
}

/* row (float, n values) -> out in `dtype` (1 fp16, 2 bf16, 3 fp32) */
static inline void kv_store_row(const float *row, char *out, size_t n, int dtype)
{
    size_t i = 0;
    if (dtype == 3) {
        memcpy(out, row, n * 4);
        return;
    }
    uint16_t *o = (uint16_t *)out;
    if (dtype == 1) {
#if defined(__AVX2__) && defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(o + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++)
            o[i] = kv_float_to_half(row[i]);
        return;
    }
    const uint32_t *u = (const uint32_t *)row;
#if defined(__AVX2__)
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    for (; i + 8 <= n; i += 8) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(u + i));
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, half), lsb), 16);
        _mm_storeu_si128((__m128i *)(o + i), _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                             _mm256_extracti128_si256(r, 1)));
    }
#endif
    for (; i < n; i++) /* bf16: round to nearest even (the values are finite) */
        o[i] = (uint16_t)((u[i] + 0x7fffu + ((u[i] >> 16) & 1u)) >> 16);
}

/* Returns 0, or -1 when `channels` is too large for the row buffer the caller gave. */
int KV_IMPL(char *out, const uint8_t *codes, const uint16_t *mins, const uint16_t *steps,
                   int key, int bits, int dtype, size_t tokens, size_t channels, size_t group,
                   float *row, float *pmin, float *pstep)
{
    size_t groups_per_row = key ? channels : channels / group;
    size_t nparams = key ? (tokens / group) * channels : tokens * (channels / group);
    for (size_t i = 0; i < nparams; i++) {
        pmin[i] = kv_half_to_float(mins[i]);
        pstep[i] = kv_half_to_float(steps[i]);
    }
    size_t itemsize = dtype == 3 ? 4 : 2;
    for (size_t t = 0; t < tokens; t++) {
        const uint8_t *c8 = codes + (bits == 8 ? t * channels : t * channels / 2);
        if (bits == 8) {
            for (size_t c = 0; c < channels; c++)
                row[c] = (float)c8[c];
        } else {
            for (size_t c = 0; c < channels / 2; c++) {
                row[2 * c] = (float)(c8[c] & 15);
                row[2 * c + 1] = (float)(c8[c] >> 4);
            }
        }
        if (key) {
            const float *m = pmin + (t / group) * groups_per_row, *s = pstep + (t / group) *
                                                                       groups_per_row;
            for (size_t c = 0; c < channels; c++)
                row[c] = row[c] * s[c] + m[c];
        } else {
            const float *m = pmin + t * groups_per_row, *s = pstep + t * groups_per_row;
            for (size_t j = 0; j < groups_per_row; j++) {
                float mj = m[j], sj = s[j];
                float *r = row + j * group;
                for (size_t i = 0; i < group; i++)
                    r[i] = r[i] * sj + mj;
            }
        }
        kv_store_row(row, out + t * channels * itemsize, channels, dtype);
    }
    return 0;
}
