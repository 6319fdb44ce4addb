/*
 * first_lanes16: a mask of the first n of 16 lanes (all of them from 16 up, none from 0 down),
 * for the kernels' masked loads, stores and maxima at the end of a row or a block of keys.
 */
#ifndef PAGODA_VECTOR_LANES_H
#define PAGODA_VECTOR_LANES_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __mmask16 first_lanes16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
}
#endif

#endif
