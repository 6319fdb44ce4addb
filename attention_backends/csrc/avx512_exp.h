/*
 * exp16: sixteen float32 exp at once, inlined, for the CPU kernels (AVX-512F).
 *
 * exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 (in two parts), exp(r) by Cephes'
 * expf polynomial (about 1 ulp); below -87 it gives 0 (expf is below 1.7e-38 there, and
 * denormal from -87.3 down), past expf's range (about 88.7) +inf, as expf does; a NaN stays NaN.
 *
 * NOTE: not glibc's libmvec (_ZGVeN16v_expf): a call there makes the compiler spill every
 * vector register a kernel keeps its accumulators in (measured in the attention kernel).
 */
#ifndef PAGODA_AVX512_EXP_H
#define PAGODA_AVX512_EXP_H

#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    /* NOTE: the constant first, so that a NaN (the second operand) passes through both. At
     * 100, n is 144 and scalef overflows to +inf; unclamped, r would lose every digit. */
    x = _mm512_min_ps(_mm512_set1_ps(100.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps((__mmask16)~tiny, p, n);
}

#endif
