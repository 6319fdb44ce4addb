/*
 * exp16 and exp8: sixteen (AVX-512F) or eight (AVX2 with FMA) float32 exp at once, inlined, for
 * the CPU kernels.
 *
 * exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 (in two parts), exp(r) by Cephes'
 * expf polynomial (about 1 ulp); below -87 it gives 0 (expf is below 1.7e-38 there, and
 * denormal from -87.3 down), past expf's range (about 88.7) +inf, as expf does; a NaN stays NaN.
 * exp2_softmax16: 2^x for a softmax whose scores are already in base 2 (tile_attention.c).
 *
 * NOTE: not glibc's libmvec (_ZGVeN16v_expf): a call there makes the compiler spill every
 * vector register a kernel keeps its accumulators in (measured in the attention kernel).
 */
#ifndef PAGODA_VECTOR_EXP_H
#define PAGODA_VECTOR_EXP_H

#include <immintrin.h>
#include <math.h>

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_TINY (-87.0f)
/* c0 + r (c1 + r (c2 + r (c3 + r (c4 + r c5)))) by Horner's rule, in vectors of type T */
#define HORNER5(T, FMA, SET1, r, c0, c1, c2, c3, c4, c5)                                                   \
    ({                                                                                                     \
        T h_ = SET1(c5);                                                                                   \
        h_ = FMA(h_, r, SET1(c4));                                                                         \
        h_ = FMA(h_, r, SET1(c3));                                                                         \
        h_ = FMA(h_, r, SET1(c2));                                                                         \
        h_ = FMA(h_, r, SET1(c1));                                                                         \
        FMA(h_, r, SET1(c0));                                                                              \
    })
/* exp(r) - 1 - r = r^2 (P0 + r (P1 + r (P2 + r (P3 + r (P4 + r P5))))) */
#define EXP_POLY(T, FMA, SET1, r)                                                                          \
    HORNER5(T, FMA, SET1, r, 5.0000001201e-1f, 1.6666665459e-1f, 4.1665795894e-2f, 8.3334519073e-3f,       \
            1.3981999507e-3f, 1.9875691500e-4f)

#define EXP2_TINY (-126.0f)
/* 2^r = 1 + r (Q0 + r (Q1 + r (Q2 + r (Q3 + r Q4)))) on [-1/2, 1/2], fitted for relative error
 * (at most 2e-7 in float32; 2^0 is exactly 1) */
#define EXP2_POLY(T, FMA, SET1, r)                                                                         \
    HORNER5(T, FMA, SET1, r, 1.0f, 6.931470036506653e-1f, 2.4022242426872253e-1f, 5.550733581185341e-2f,   \
            9.671512991189957e-3f, 1.326472731307149e-3f)

#if defined(__AVX512F__)
/* 2^x for a softmax's exponents, x <= 0 (scores in base 2, less their maximum), in the lanes
 * of `keep` (0 in the others): below -126 it gives 0 (no denormals), a NaN stays NaN; the range
 * reduction is exact (x - round(x)), with nothing to clamp above. Five fewer operations than
 * exp16 and no log2(e) to multiply by. */
static inline __attribute__((always_inline)) __m512 exp2_softmax16(__m512 x, __mmask16 keep) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP2_TINY), _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    return _mm512_maskz_scalef_ps(keep & (__mmask16)~tiny, EXP2_POLY(__m512, _mm512_fmadd_ps, _mm512_set1_ps, r), n);
}
#endif

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_TINY), _CMP_LT_OQ);
    /* NOTE: the constant first, so that a NaN (the second operand) passes through both. At
     * 100, n is 144 and scalef overflows to +inf; unclamped, r would lose every digit. */
    x = _mm512_min_ps(_mm512_set1_ps(100.0f), _mm512_max_ps(_mm512_set1_ps(EXP_TINY), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    const __m512 poly = EXP_POLY(__m512, _mm512_fmadd_ps, _mm512_set1_ps, r);
    const __m512 p = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps((__mmask16)~tiny, p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The same on 8 lanes; AVX2 has no scalef, so 2^n is applied in two halves, each a normal
 * float for n in [-126, 128], and x past 88.72 (where expf overflows) gives +inf. */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_TINY), _CMP_LT_OQ);
    const __m256 huge = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    /* the constant first, so that a NaN (the second operand) passes through both */
    x = _mm256_min_ps(_mm256_set1_ps(88.72283935546875f), _mm256_max_ps(_mm256_set1_ps(EXP_TINY), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    const __m256 poly = EXP_POLY(__m256, _mm256_fmadd_ps, _mm256_set1_ps, r);
    const __m256 p = _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    const __m256 e = _mm256_andnot_ps(tiny, _mm256_mul_ps(_mm256_mul_ps(p, a), b));
    return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), huge);
}
#endif

#endif
