/*
 * y = x @ w.T (+ bias) for the CPU from weights quantized in groups of 32 input features:
 * 8-bit (signed) or 4-bit (unsigned) integers with a float16 scale per group and, optionally,
 * a float16 minimum: w[n][k] = scale[n][g] * q[n][k] + min[n][g], g = k / 32. This holds
 * GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K exactly (engine/models/quantized.py
 * converts them) and Pagoda's own int8.
 *
 * As llama.cpp does, each row of x is quantized too, per group of 32, to int8 with a float32
 * scale (round to nearest, |q| <= 127): the products are then integer dot products, four
 * byte pairs a lane in one instruction (AVX512-VNNI's vpdpbusd, unsigned x signed):
 *   sum_k w x = scale * xscale * sum_k q xq + min * xscale * sum_k xq   (per group)
 * 8-bit weights are stored with 128 added (unsigned), so the sum over a group starts at
 * -128 * sum_k xq; 4-bit weights are 0..15 already.
 *
 * Layout of the weight, for each block of 16 output features (zero past N), for each group:
 *   8-bit: 512 bytes [8][16][4]: vector j holds, for each feature, q[4j .. 4j+3] + 128
 *   4-bit: 256 bytes [4][16][4]: vector j's byte i holds q[8j + i] in its low nibble and
 *          q[8j + 4 + i] in its high one
 *   6-bit: the 4-bit layout of q + 32's low four bits, then 128 bytes [2][16][4] of its top two:
 *          vector t's byte i holds, at bits 2s and 2s + 1 (s = 2 (j - 2t) + h, j = 2t, 2t + 1),
 *          those of nibble vector j's element h (0: the low nibble's, 1: the high one's)
 *   then 16 float16 scales (6-bit: 32, those of inputs 0-15 then of 16-31), then (with mins)
 *   16 float16 minimums.
 * So a block is one contiguous stretch that a tile of rows reads front to back once. The 6-bit
 * form holds GGUF's Q6_K (a scale per 16 inputs, values -32..31) at 7 bits a weight where 8-bit
 * takes 8.5; only the AVX512-VNNI vectors run it (quant_linear_q6), never the AMX tiles.
 *
 * x is [M, K] bfloat16 (or float32 with x_f32), K a multiple of 32; y [M, N] bfloat16 (or
 * float32 with out_f32: the LM head's logits unrounded); bias float32 [N] or NULL. Threads
 * take contiguous ranges of feature blocks. Every output is summed in the same order
 * whatever M is, so a row's result does not depend on its batch.
 *
 * On CPUs whose AMX tiles run, calls of at least amx_min_rows rows of bfloat16 x without bias
 * (0: never; the caller measures the count per shape) run on the tiles instead: the weight
 * dequantized to bfloat16 a chunk at a time into packed_linear.c's layout, x as it is
 * (quant_linear_tiles, below). Their sums round otherwise than the vectors'.
 *
 * Without AVX512-VNNI, AVX2 computes the same integer sums with vpmaddubsw/vpmaddwd (half the
 * width, three instructions where VNNI takes one); without AVX2 a plain C loop does (the
 * compiler vectorizes what it can): correct everywhere, fast only with the instructions.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagoda_kernels.h"

#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vector_lanes.h"
#include "work_share.h"

#define QGROUP 32
#define QBLOCK 16
#define QROWS 4
#define QVECS 4 /* blocks of 16 features a tile, at most */

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            float f = (float)mant * (1.0f / 16777216.0f); /* mant * 2^-24 */
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t float_to_bf16(float f) { /* to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* NOTE: inline for the kernels: the exported function is called through the PLT, once per tile */
static inline int64_t group_bytes(int bits, int has_min) {
    return (bits == 8 ? 512 : bits == 6 ? 384 : 256) + (bits == 6 ? 4 : 2) * QBLOCK + (has_min ? 2 * QBLOCK : 0);
}

/* The byte offset of a group's scales (its values' bytes). */
static inline int64_t values_bytes(int bits) { return bits == 8 ? 512 : bits == 6 ? 384 : 256; }

/* A 6-bit weight's sums start from -32 x its row of x's sums over each 16 inputs (the values are
 * stored + 32): xhalf [M, 2 K / 32], from xq [M, K]. */
static void half_sums(const int8_t *xq, int64_t K, int32_t *xhalf) {
    for (int64_t h = 0; h < K / 16; h++) {
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += xq[16 * h + i];
        xhalf[h] = sum;
    }
}

int64_t quant_group_bytes(int bits, int has_min) { return group_bytes(bits, has_min); }

/* Greedy sampling's LM head (quant_linear_argmax): a row's float32 sums of features n0..n0+n-1
 * taken into its range's best so far (*top at *where, -1 before any): the first of a new
 * largest, or the range's first NaN, which stays (as torch's max picks it). The maximum 16 sums
 * at a time with AVX-512 (8 with AVX2): as a scalar loop it was a chain of dependent vmaxss (4
 * cycles a sum), ~2 ms of a 64-row decode step with a 49152-feature head (perf, Intel AMX). */
static inline void take_best(const float *row, int64_t n, int64_t n0, float *top, int64_t *where) {
    if (*top != *top) return;
    float most = -INFINITY;
    int nan = 0;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 most4[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                       _mm512_set1_ps(-INFINITY)};
    __mmask16 nans = 0;
    for (; j + 64 <= n; j += 64)
        for (int i = 0; i < 4; i++) {
            const __m512 v = _mm512_loadu_ps(row + j + 16 * i);
            most4[i] = _mm512_max_ps(v, most4[i]); /* a NaN v leaves the maximum (the second operand) */
            nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
    most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(most4[0], most4[1]), _mm512_max_ps(most4[2], most4[3])));
    nan = nans != 0;
#elif defined(__AVX2__)
    __m256 most4[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                       _mm256_set1_ps(-INFINITY)};
    __m256 nans = _mm256_setzero_ps();
    for (; j + 32 <= n; j += 32)
        for (int i = 0; i < 4; i++) {
            const __m256 v = _mm256_loadu_ps(row + j + 8 * i);
            most4[i] = _mm256_max_ps(v, most4[i]); /* a NaN v leaves the maximum (the second operand) */
            nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(most4[0], most4[1]), _mm256_max_ps(most4[2], most4[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    most = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    nan = _mm256_movemask_ps(nans) != 0;
#endif
    for (; j < n; j++) {
        most = row[j] > most ? row[j] : most;
        nan |= row[j] != row[j];
    }
    if (nan || most > *top) {
        j = 0;
        while (nan ? row[j] == row[j] : row[j] != most) j++;
        *top = row[j], *where = n0 + j;
    }
}

/* Each row's pick from the bests of `ranges` contiguous ranges in order (best, at: [ranges][M]):
 * an equal later best never wins, the first NaN does; every output -inf gives index 0. */
static void pick_best(const float *best, const int64_t *at, int ranges, int64_t M, int64_t *ids) {
    for (int64_t m = 0; m < M; m++) {
        int64_t pick = -1;
        float most = -INFINITY;
        for (int t = 0; t < ranges; t++) {
            const float value = best[t * M + m];
            if (at[t * M + m] < 0) continue;
            if (value != value) {
                pick = at[t * M + m];
                break;
            }
            if (pick < 0 || value > most) most = value, pick = at[t * M + m];
        }
        ids[m] = pick < 0 ? 0 : pick;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

int quant_linear_vnni(void) { return 1; }
int quant_linear_vector(void) { return 1; }
int quant_linear_q6(void) { return 1; }

/* Row m of x quantized per group: xq [K] int8, xs [K/32] scales, xsum [K/32] sums of xq. */
static void quantize_row(const void *x, int x_f32, int64_t K, int8_t *xq, float *xs, int32_t *xsum) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < K / QGROUP; g++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            const int64_t k = g * QGROUP + 16 * h;
            v[h] = x_f32 ? _mm512_loadu_ps((const float *)x + k)
                         : _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + k))),
                               16));
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], sign), _mm512_and_ps(v[1], sign)));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int h = 0; h < 2; h++) {
            /* to nearest even, as nearbyintf in the default rounding mode */
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(xq + g * QGROUP + 16 * h), _mm512_cvtepi32_epi8(q));
            sum += _mm512_reduce_add_epi32(q);
        }
        xs[g] = amax / 127.0f;
        xsum[g] = sum;
    }
}

static inline __m512 load_halves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

static inline __m256i to_bf16(__m512 v) { /* to nearest even (no AVX512-BF16 needed) */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* A 6-bit weight's top two bits of the values of nibble vector j's element h, at bits 4-5 of
 * each byte (s = 2 (j % 2) + h: field s of its vector of top bits; 16-bit shifts move no bit
 * across a byte here). */
static inline __m512i top_bits(const __m512i v, const int s) {
    const __m512i mask = _mm512_set1_epi8(0x30);
    switch (s) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(v, 4), mask);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(v, 2), mask);
    case 2: return _mm512_and_si512(v, mask);
    default: return _mm512_and_si512(_mm512_srli_epi16(v, 2), mask);
    }
}

/* rows rows of quantized x against vecs blocks of 16 features (consecutive, block_bytes
 * apart) over all groups. The weight vectors of a group are loaded once for all rows, each
 * broadcast of x serves every block. With one or two rows each integer sum is kept in two
 * halves (the weight vectors alternate between them): the dot products of a group then form
 * two dependency chains a block instead of one, which a single row needs to keep the
 * multipliers busy (vpdpbusd's latency is several cycles); four rows have chains enough. */
static inline __attribute__((always_inline)) void quant_tile(
        const int8_t *xq, const float *xs, const int32_t *xsum, int64_t K, const int rows, const uint8_t *wb,
        int64_t block_bytes, const int vecs, const int bits, const int has_min, const float *bias, void *y,
        int64_t ldy, int64_t n0, int64_t N, int out_f32) {
    const int64_t groups = K / QGROUP, gbytes = group_bytes(bits, has_min), vbytes = values_bytes(bits);
    const int halves = rows <= 2 ? 2 : 1;
    __m512 acc[QROWS][QVECS];
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < vecs; v++) acc[m][v] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        __m512i isum[QROWS][QVECS][2];
        for (int m = 0; m < rows; m++) {
            const __m512i start = _mm512_set1_epi32(bits == 8   ? -128 * xsum[m * groups + g]
                                                    : bits == 6 ? -32 * xsum[2 * (m * groups + g)]
                                                                : 0);
            for (int v = 0; v < vecs; v++) {
                isum[m][v][0] = start;
                isum[m][v][1] = _mm512_setzero_si512();
            }
        }
        for (int j = 0; j < (bits == 8 ? 8 : 4); j++) {
            if (bits == 6 && j == 2) {
                /* 6-bit: inputs 0-15 done: their sums at their scale, then those of 16-31 in the
                 * same registers (two halves' sums side by side would spill four rows') */
                for (int v = 0; v < vecs; v++) {
                    const __m512 scale = load_halves(wb + v * block_bytes + g * gbytes + vbytes);
                    for (int m = 0; m < rows; m++) {
                        const __m512i sum = halves == 2 ? _mm512_add_epi32(isum[m][v][0], isum[m][v][1])
                                                        : isum[m][v][0];
                        acc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                                    _mm512_mul_ps(scale, _mm512_set1_ps(xs[m * groups + g])),
                                                    acc[m][v]);
                        isum[m][v][0] = _mm512_set1_epi32(-32 * xsum[2 * (m * groups + g) + 1]);
                        isum[m][v][1] = _mm512_setzero_si512();
                    }
                }
            }
            __m512i w[QVECS][2];
            for (int v = 0; v < vecs; v++) {
                const uint8_t *p = wb + v * block_bytes + g * gbytes;
                const __m512i raw = _mm512_loadu_si512(p + 64 * j);
                if (bits == 8) {
                    w[v][0] = raw;
                } else {
                    w[v][0] = _mm512_and_si512(raw, low);
                    w[v][1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
                if (bits == 6) {
                    const __m512i top = _mm512_loadu_si512(p + 256 + 64 * (j / 2));
                    w[v][0] = _mm512_or_si512(w[v][0], top_bits(top, 2 * (j % 2)));
                    w[v][1] = _mm512_or_si512(w[v][1], top_bits(top, 2 * (j % 2) + 1));
                }
            }
            for (int m = 0; m < rows; m++) {
                const int8_t *a = xq + m * K + g * QGROUP;
                for (int h = 0; h < (bits == 8 ? 1 : 2); h++) {
                    int32_t four;
                    __builtin_memcpy(&four, a + 4 * (bits == 8 ? j : 2 * j + h), 4);
                    const __m512i b = _mm512_set1_epi32(four);
                    const int half = halves == 2 ? (bits == 8 ? j & 1 : h) : 0;
                    for (int v = 0; v < vecs; v++)
                        isum[m][v][half] = _mm512_dpbusd_epi32(isum[m][v][half], w[v][h], b);
                }
            }
        }
        for (int v = 0; v < vecs; v++) {
            const uint8_t *p = wb + v * block_bytes + g * gbytes + vbytes;
            /* (6-bit: the second half group's scale) */
            const __m512 scale = load_halves(bits == 6 ? p + 2 * QBLOCK : p);
            const __m512 mins = has_min ? load_halves(p + 2 * QBLOCK) : _mm512_setzero_ps();
            for (int m = 0; m < rows; m++) {
                const float d = xs[m * groups + g];
                const __m512i sum = halves == 2 ? _mm512_add_epi32(isum[m][v][0], isum[m][v][1]) : isum[m][v][0];
                acc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(d)),
                                            acc[m][v]);
                if (has_min) acc[m][v] = _mm512_fmadd_ps(mins, _mm512_set1_ps(d * (float)xsum[m * groups + g]),
                                                         acc[m][v]);
            }
        }
    }
    for (int v = 0; v < vecs; v++) {
        const int64_t n = n0 + 16 * v;
        const __mmask16 mask = first_lanes16(N - n);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) {
            const __m512 out = _mm512_add_ps(acc[m][v], b);
            if (out_f32)
                _mm512_mask_storeu_ps((float *)y + m * ldy + n, mask, out);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + m * ldy + n, mask, to_bf16(out));
        }
    }
}

/* (6-bit: xsum holds each row's two sums a group, half_sums's) */
#define QTILE(R, V, B, H) quant_tile(xq + m * K, xs + m * groups, xsum + m * groups * ((B) == 6 ? 2 : 1), K, R, wb, \
                                     block_bytes, V, B, H, bias, (char *)y + m * ldy * esize, ldy, n0, N, out_f32)

/* Every row of x against V blocks from wb. */
#define DEFINE_QUANT_ROWS(NAME, V, B, H)                                                                  \
static void NAME(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,            \
                 const uint8_t *wb, int64_t block_bytes, const float *bias, void *y, int64_t ldy,         \
                 int64_t n0, int64_t N, int out_f32) {                                                     \
    const int64_t groups = K / QGROUP, esize = out_f32 ? 4 : 2;                                            \
    int64_t m = 0;                                                                                         \
    for (; m + QROWS <= M; m += QROWS) QTILE(QROWS, V, B, H);                                              \
    switch (M - m) {                                                                                       \
    case 1: QTILE(1, V, B, H); break;                                                                      \
    case 2: QTILE(2, V, B, H); break;                                                                      \
    case 3: QTILE(3, V, B, H); break;                                                                      \
    }                                                                                                      \
}
/* One row (decode of one sequence) against V blocks: more blocks at once, each with its two
 * chains, while the bytes stream in. (Two rows so have too few registers: they take two blocks.) */
#define DEFINE_QUANT_ONE_ROW(NAME, V, B, H)                                                              \
static void NAME(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,            \
                 const uint8_t *wb, int64_t block_bytes, const float *bias, void *y, int64_t ldy,         \
                 int64_t n0, int64_t N, int out_f32) {                                                     \
    const int64_t groups = K / QGROUP, esize = out_f32 ? 4 : 2, m = 0;                                     \
    (void)M;                                                                                               \
    QTILE(1, V, B, H);                                                                                     \
}
DEFINE_QUANT_ROWS(rows_q8, 1, 8, 0)
DEFINE_QUANT_ROWS(rows_q8_min, 1, 8, 1)
DEFINE_QUANT_ROWS(rows_q4, 1, 4, 0)
DEFINE_QUANT_ROWS(rows_q4_min, 1, 4, 1)
DEFINE_QUANT_ROWS(rows2_q8, 2, 8, 0)
DEFINE_QUANT_ROWS(rows2_q8_min, 2, 8, 1)
DEFINE_QUANT_ROWS(rows2_q4, 2, 4, 0)
DEFINE_QUANT_ROWS(rows2_q4_min, 2, 4, 1)
DEFINE_QUANT_ONE_ROW(one4_q8, 4, 8, 0)
DEFINE_QUANT_ONE_ROW(one4_q8_min, 4, 8, 1)
DEFINE_QUANT_ONE_ROW(one4_q4, 4, 4, 0)
DEFINE_QUANT_ONE_ROW(one4_q4_min, 4, 4, 1)
DEFINE_QUANT_ROWS(rows_q6, 1, 6, 0)
DEFINE_QUANT_ROWS(rows2_q6, 2, 6, 0)
DEFINE_QUANT_ONE_ROW(one4_q6, 4, 6, 0)

typedef void (*quant_rows_fn)(const int8_t *, const float *, const int32_t *, int64_t, int64_t, const uint8_t *,
                              int64_t, const float *, void *, int64_t, int64_t, int64_t, int);

static void quant_blocks(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
                         const uint8_t *w, int bits, int has_min, const float *bias, void *y, int64_t ldy,
                         int64_t N, int out_f32, int64_t first, int64_t last) {
    const int64_t block_bytes = (K / QGROUP) * group_bytes(bits, has_min);
    const int kind = bits == 6 ? 4 : (bits == 8 ? 0 : 2) + (has_min ? 1 : 0);
    static const quant_rows_fn one4[5] = {one4_q8, one4_q8_min, one4_q4, one4_q4_min, one4_q6};
    static const quant_rows_fn two[5] = {rows2_q8, rows2_q8_min, rows2_q4, rows2_q4_min, rows2_q6};
    static const quant_rows_fn one[5] = {rows_q8, rows_q8_min, rows_q4, rows_q4_min, rows_q6};
    int64_t nb = first;
    if (M == 1)
        for (; nb + 4 <= last; nb += 4)
            one4[kind](xq, xs, xsum, M, K, w + nb * block_bytes, block_bytes, bias, y, ldy, nb * QBLOCK, N, out_f32);
    for (; nb + 2 <= last; nb += 2)
        two[kind](xq, xs, xsum, M, K, w + nb * block_bytes, block_bytes, bias, y, ldy, nb * QBLOCK, N, out_f32);
    if (nb < last)
        one[kind](xq, xs, xsum, M, K, w + nb * block_bytes, block_bytes, bias, y, ldy, nb * QBLOCK, N, out_f32);
}

#else /* AVX2 or the portable path: the same sums without AVX512-VNNI */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int quant_linear_vnni(void) { return 0; }
int quant_linear_vector(void) { return 1; }
int quant_linear_q6(void) { return 0; }

/* Row m of x quantized per group: xq [K] int8, xs [K/32] scales, xsum [K/32] sums of xq. The
 * same values as the portable path's (the same float steps; vcvtps2dq rounds to nearest even,
 * as nearbyintf in the default rounding mode). */
static void quantize_row(const void *x, int x_f32, int64_t K, int8_t *xq, float *xs, int32_t *xsum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < K / QGROUP; g++) {
        __m256 v[4];
        for (int h = 0; h < 4; h++) {
            const int64_t k = g * QGROUP + 8 * h;
            v[h] = x_f32 ? _mm256_loadu_ps((const float *)x + k)
                         : _mm256_castsi256_ps(_mm256_slli_epi32(
                               _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + k))), 16));
        }
        const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
        __m256i q[4];
        for (int h = 0; h < 4; h++) q[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(id)));
        /* |q| <= 127, so the packs do not saturate; they interleave 4-byte runs, which order undoes */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + g * QGROUP), _mm256_permutevar8x32_epi32(bytes, order));
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        xs[g] = d;
        xsum[g] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
    }
}

/* Ends a step of a tile's integer sums with them in registers (an empty asm that takes and gives
 * them), so that the compiler does not hoist the next steps' loads and products above it: it
 * did, and spilled sums to the stack to hold them (a fifth of the loop's instructions). */
#define KEEP_IN_REGISTERS(v, n)                                                                    \
    do {                                                                                           \
        for (int i_ = 0; i_ < (n); i_++) __asm__("" : "+x"((v)[i_]));                             \
    } while (0)

/* Rows (at most QROWS) of x against one block of 16 features, AVX2: the four-byte dot products
 * by vpmaddubsw (unsigned x signed bytes, pairs summed to 16 bits) and vpmaddwd (to 32 bits).
 * 4-bit weights (0..15) are the unsigned side; 8-bit ones (stored + 128) give their magnitude
 * to the unsigned side and their sign to x's bytes, so that no 16-bit pair sum can saturate
 * (at most 2 x 128 x 127). A 4-bit group's pair sums fit 16 bits together (each 16-bit lane
 * adds 16 products, at most 16 x 15 x 127 = 30480), so they are widened by one vpmaddwd per
 * group, not one per vpmaddubsw. AVX2 has 16 vector registers: a group's 8 integer sums (4
 * rows x 2 halves of the block) stay in them, and the float accumulators, touched once a group,
 * live in memory (in registers too, gcc spilled the integer sums instead). */
static inline __attribute__((always_inline)) void quant_tile_avx2(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t K, int rows,
                            const uint8_t *wb, int bits, int has_min, const float *bias, void *y, int64_t ldy,
                            int64_t n0, int64_t N, int out_f32) {
    const int64_t groups = K / QGROUP, gbytes = group_bytes(bits, has_min), vbytes = bits == 8 ? 512 : 256;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    float acc[QROWS][QBLOCK] __attribute__((aligned(32)));
    for (int m = 0; m < rows; m++) _mm256_store_ps(acc[m], _mm256_setzero_ps()), _mm256_store_ps(acc[m] + 8, _mm256_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = wb + g * gbytes;
        __m256i isum[2 * QROWS];
        for (int m = 0; m < 2 * rows; m++) isum[m] = _mm256_setzero_si256();
        for (int j = 0; j < (bits == 8 ? 8 : 4); j++) {
            __m256i w[2][2], sign[2];
            for (int f = 0; f < 2; f++) { /* features 0-7, then 8-15 */
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * f));
                if (bits == 8) {
                    sign[f] = _mm256_xor_si256(raw, flip); /* the signed weights */
                    w[f][0] = _mm256_abs_epi8(sign[f]);
                } else {
                    w[f][0] = _mm256_and_si256(raw, low);
                    w[f][1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
            }
            for (int m = 0; m < rows; m++) {
                const int8_t *a = xq + m * K + g * QGROUP;
                for (int h = 0; h < (bits == 8 ? 1 : 2); h++) {
                    int32_t four;
                    __builtin_memcpy(&four, a + 4 * (bits == 8 ? j : 2 * j + h), 4);
                    const __m256i b = _mm256_set1_epi32(four);
                    for (int f = 0; f < 2; f++) {
                        const __m256i pairs = bits == 8 ? _mm256_maddubs_epi16(w[f][0], _mm256_sign_epi8(b, sign[f]))
                                                        : _mm256_maddubs_epi16(w[f][h], b);
                        isum[2 * m + f] = bits == 8 ? _mm256_add_epi32(isum[2 * m + f], _mm256_madd_epi16(pairs, ones))
                                                    : _mm256_add_epi16(isum[2 * m + f], pairs);
                    }
                }
            }
            KEEP_IN_REGISTERS(isum, 2 * rows);
        }
        for (int f = 0; f < 2; f++) {
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + vbytes + 16 * f)));
            const __m256 mins = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + vbytes + 2 * QBLOCK
                                                                                            + 16 * f)))
                                        : _mm256_setzero_ps();
            for (int m = 0; m < rows; m++) {
                const float d = xs[m * groups + g];
                const __m256i sums = bits == 8 ? isum[2 * m + f] : _mm256_madd_epi16(isum[2 * m + f], ones);
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, _mm256_set1_ps(d)),
                                           _mm256_load_ps(acc[m] + 8 * f));
                if (has_min) a = _mm256_fmadd_ps(mins, _mm256_set1_ps(d * (float)xsum[m * groups + g]), a);
                _mm256_store_ps(acc[m] + 8 * f, a);
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        for (int n = 0; n < QBLOCK && n0 + n < N; n++) {
            const float v = acc[m][n] + (bias ? bias[n0 + n] : 0.0f);
            if (out_f32)
                ((float *)y)[m * ldy + n0 + n] = v;
            else
                ((uint16_t *)y)[m * ldy + n0 + n] = float_to_bf16(v);
        }
    }
}

/* Every row of x against one block (wb) of B-bit weights, H: with minimums; rows, bits and
 * minimums constants in each copy, so that the tile's accumulators live in registers and its
 * loops unroll (with them as arguments the tile kept its sums on the stack: 2.3x slower). */
#define AVX2_TILE(R, B, H) quant_tile_avx2(xq + m * K, xs + m * groups, xsum + m * groups, K, R, wb, B, H, bias, \
                                           (char *)y + m * ldy * esize, ldy, n0, N, out_f32)
#define DEFINE_AVX2_ROWS(NAME, B, H)                                                                      \
static void NAME(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,            \
                 const uint8_t *wb, const float *bias, void *y, int64_t ldy, int64_t n0, int64_t N,       \
                 int out_f32) {                                                                            \
    const int64_t groups = K / QGROUP, esize = out_f32 ? 4 : 2;                                            \
    int64_t m = 0;                                                                                         \
    for (; m + QROWS <= M; m += QROWS) AVX2_TILE(QROWS, B, H);                                             \
    switch (M - m) {                                                                                       \
    case 1: AVX2_TILE(1, B, H); break;                                                                     \
    case 2: AVX2_TILE(2, B, H); break;                                                                     \
    case 3: AVX2_TILE(3, B, H); break;                                                                     \
    }                                                                                                      \
}
DEFINE_AVX2_ROWS(avx2_q8, 8, 0)
DEFINE_AVX2_ROWS(avx2_q8_min, 8, 1)
DEFINE_AVX2_ROWS(avx2_q4, 4, 0)
DEFINE_AVX2_ROWS(avx2_q4_min, 4, 1)

static void quant_blocks(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
                         const uint8_t *w, int bits, int has_min, const float *bias, void *y, int64_t ldy,
                         int64_t N, int out_f32, int64_t first, int64_t last) {
    typedef void (*rows_fn)(const int8_t *, const float *, const int32_t *, int64_t, int64_t, const uint8_t *,
                            const float *, void *, int64_t, int64_t, int64_t, int);
    static const rows_fn kinds[4] = {avx2_q8, avx2_q8_min, avx2_q4, avx2_q4_min};
    const rows_fn rows = kinds[(bits == 8 ? 0 : 2) + (has_min ? 1 : 0)];
    const int64_t block_bytes = (K / QGROUP) * group_bytes(bits, has_min);
    for (int64_t nb = first; nb < last; nb++)
        rows(xq, xs, xsum, M, K, w + nb * block_bytes, bias, y, ldy, nb * QBLOCK, N, out_f32);
}

#else /* the portable path */

int quant_linear_vnni(void) { return 0; }
int quant_linear_vector(void) { return 0; }
int quant_linear_q6(void) { return 0; }

/* Row m of x quantized per group: xq [K] int8, xs [K/32] scales, xsum [K/32] sums of xq. */
static void quantize_row(const void *x, int x_f32, int64_t K, int8_t *xq, float *xs, int32_t *xsum) {
    float v[QGROUP];
    for (int64_t g = 0; g < K / QGROUP; g++) {
        float amax = 0.0f;
        for (int i = 0; i < QGROUP; i++) {
            v[i] = x_f32 ? ((const float *)x)[g * QGROUP + i] : bf16_to_float(((const uint16_t *)x)[g * QGROUP + i]);
            const float a = fabsf(v[i]); /* no fmaxf: a call through the PLT for every element */
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QGROUP; i++) {
            const int32_t q = (int32_t)nearbyintf(v[i] * id);
            xq[g * QGROUP + i] = (int8_t)q;
            sum += q;
        }
        xs[g] = d;
        xsum[g] = sum;
    }
}

static void quant_blocks(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t M, int64_t K,
                         const uint8_t *w, int bits, int has_min, const float *bias, void *y, int64_t ldy,
                         int64_t N, int out_f32, int64_t first, int64_t last) {
    const int64_t groups = K / QGROUP, gbytes = group_bytes(bits, has_min), vbytes = bits == 8 ? 512 : 256;
    for (int64_t nb = first; nb < last; nb++) {
        const uint8_t *wb = w + nb * groups * gbytes;
        for (int64_t m = 0; m < M; m++) {
            float acc[QBLOCK] = {0};
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *p = wb + g * gbytes;
                const int8_t *a = xq + m * K + g * QGROUP;
                const int32_t s = xsum[m * groups + g];
                const float d = xs[m * groups + g];
                for (int n = 0; n < QBLOCK; n++) {
                    int32_t isum = bits == 8 ? -128 * s : 0;
                    for (int k = 0; k < QGROUP; k++) {
                        int32_t q;
                        if (bits == 8) {
                            q = p[(k / 4) * 64 + n * 4 + k % 4];
                        } else {
                            const int j = k / 8, i = k % 8;
                            const uint8_t byte = p[j * 64 + n * 4 + (i & 3)];
                            q = i < 4 ? (byte & 0x0f) : (byte >> 4);
                        }
                        isum += q * a[k];
                    }
                    uint16_t sh, mh = 0;
                    memcpy(&sh, p + vbytes + 2 * n, 2);
                    if (has_min) memcpy(&mh, p + vbytes + 2 * QBLOCK + 2 * n, 2);
                    acc[n] += (float)isum * (half_to_float(sh) * d);
                    if (has_min) acc[n] += half_to_float(mh) * (d * (float)s);
                }
            }
            for (int n = 0; n < QBLOCK && nb * QBLOCK + n < N; n++) {
                const int64_t col = nb * QBLOCK + n;
                const float out = acc[n] + (bias ? bias[col] : 0.0f);
                if (out_f32)
                    ((float *)y)[m * ldy + col] = out;
                else
                    ((uint16_t *)y)[m * ldy + col] = float_to_bf16(out);
            }
        }
    }
}
#endif
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
#define QUANT_TILES 1
#include "amx_tiles.h"

/* packed_linear.c's tile loop, over weights in its bfloat16 layout; its epilogues */
void amx_tile_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *tail, const uint16_t *w, int64_t K,
                   void *y, int64_t ldy, int64_t N, int64_t units, int epilogue);
uint16_t *amx_padded_tail(const uint16_t *x, int64_t M, int64_t ldx, int64_t K);
enum { TILES_PLAIN, TILES_PLAIN_F32, TILES_SILU_MUL };

#define TILE_CHUNK_BYTES (512 * 1024) /* of dequantized weight per pass of the rows (packed_linear.c's chunk) */
/* x's bytes from which quant_linear_tiles splits the rows between the threads: a 2048-token
 * prefill workload (Q4_1, x 2048 x 576 and 2048 x 1536) ran 5-7% faster with the rows split
 * (Intel Xeon with AMX, 2 cores, 2 MB of L2 a core; also for the down product's 3 MB x) */
#define ROWS_SPLIT_X_BYTES (1024 * 1024)
/* The chunk where the threads split the rows: each pass over a chunk streams the thread's rows of
 * x from beyond L2 (the down product's 1024 rows x 1536 a thread: 3 MB), so fewer, larger chunks
 * (half of L2): a 2048-token prefill step's down products over 30 layers 51.6-52.7 -> 44.4-45.9
 * ms, o 16.6-16.9 -> 15.5-16.1 (1.5 MB: slower again; Intel Xeon with AMX, 2 MB of L2 a core) */
#ifndef SPLIT_CHUNK_BYTES
#define SPLIT_CHUNK_BYTES (1024 * 1024)
#endif

/* Input feature k (0..31) of a group, for each of a block's 16 features: scale * q + min. */
static inline __attribute__((always_inline)) __m512 weight_column(const uint8_t *p, const int k, const int bits,
                                                                  const __m512 scale, const __m512 mins) {
    if (bits == 8) { /* byte k % 4 of each feature's 4 in vector k / 4, stored + 128 */
        const __m512i v = _mm512_loadu_si512(p + 64 * (k / 4));
        const __m512i q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * (k % 4)), _mm512_set1_epi32(0xff)),
                                           _mm512_set1_epi32(128));
        return _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(q), mins);
    }
    /* 4-bit: vector k / 8; byte (k % 8) & 3, its low nibble for k % 8 < 4. vpermps reads only an
     * index's low 4 bits, so it takes the nibble and converts it in one step. */
    const __m512i v = _mm512_loadu_si512(p + 64 * (k / 8));
    const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int shift = 8 * (k % 8 & 3) + (k % 8 < 4 ? 0 : 4);
    return _mm512_fmadd_ps(scale, _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(v, shift) : v, values), mins);
}

/* Block b of the weight (16 features) dequantized to bfloat16 (rounded to nearest even) into
 * its 16 features' place of a group of packed_linear.c's layout ([K / 2][64][2], dst the first
 * pair's first of those features). */
static void dequantize_block(const uint8_t *w, int64_t b, int64_t K, int bits, int has_min, uint16_t *dst) {
    const int64_t groups = K / QGROUP, gbytes = group_bytes(bits, has_min), vbytes = bits == 8 ? 512 : 256;
    const uint8_t *wb = w + b * groups * gbytes;
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = wb + g * gbytes;
        const __m512 scale = load_halves(p + vbytes);
        const __m512 mins = has_min ? load_halves(p + vbytes + 2 * QBLOCK) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int k = 0; k < QGROUP; k += 2) {
            /* 16 features' k then their k + 1, rounded together, then interleaved into pairs */
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(weight_column(p, k + 1, bits, scale, mins),
                                                               weight_column(p, k, bits, scale, mins));
            _mm512_storeu_si512(dst + (g * QGROUP + k) / 2 * 128, _mm512_permutexvar_epi16(pairs, both));
        }
    }
}

/* quant_linear of many bfloat16 rows without bias on AMX tiles (TILES_PLAIN, TILES_PLAIN_F32:
 * y [M, N]), or SiLU(gate) * up of a gate/up weight [2N, K] (TILES_SILU_MUL: y [M, N], N a
 * multiple of 32). The output in units of 32 features; each thread dequantizes its contiguous
 * range of units a chunk at a time (L2-sized) into packed_linear.c's layout (for SiLU-mul:
 * group c holds gate features 32c.. then up features 32c..) and passes every row over the
 * chunk with packed_linear.c's tile loop; or, where x is large (split_rows), every unit, in
 * chunks of SPLIT_CHUNK_BYTES, and passes its own range of the rows. The weight's bytes are
 * read once (with the rows split, once by each thread); the dequantizing costs a few operations
 * a weight, which the rows share. x is not quantized here: the sums differ from the vectors'
 * (int8 x) by rounding. With `ids` (TILES_PLAIN_F32,
 * y NULL), each chunk's float32 sums go to a scratch of the thread's and each row's index of
 * its largest into ids (quant_linear_argmax). Returns 0, or -1 if memory ran out. */
static int quant_linear_tiles(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int bits,
                              int has_min, int64_t N, void *y, int64_t ldy, int epilogue, int64_t *ids) {
    const int silu = epilogue == TILES_SILU_MUL;
    const int64_t blocks = (N + QBLOCK - 1) / QBLOCK, units = (N + 2 * QBLOCK - 1) / (2 * QBLOCK);
    const int64_t unit_elements = (silu ? 4 : 2) * QBLOCK * K; /* bfloat16 weights a unit */
    const int threads = omp_get_max_threads();
    const int split_rows = !ids && threads > 1 && M * K * (int64_t)sizeof(uint16_t) > ROWS_SPLIT_X_BYTES;
    int64_t chunk = (split_rows ? SPLIT_CHUNK_BYTES : TILE_CHUNK_BYTES) / (unit_elements * (int64_t)sizeof(uint16_t));
    if (!silu) chunk = chunk / 2 * 2; /* whole groups */
    if (chunk < 2) chunk = 2;
    uint16_t *tail = amx_padded_tail(x, M, ldx, K);
    const size_t chunk_elements = (size_t)(chunk * unit_elements);
    uint16_t *buffers = aligned_alloc(64, threads * chunk_elements * sizeof(uint16_t));
    const int64_t width = 2 * QBLOCK * chunk; /* features a chunk */
    float *scratch = ids ? malloc((size_t)(threads * M * width) * sizeof(float)) : NULL;
    float *best = ids ? malloc((size_t)(threads * M) * sizeof(float)) : NULL;
    int64_t *at = ids ? malloc((size_t)(threads * M) * sizeof(int64_t)) : NULL;
    if ((M % 16 && !tail) || !buffers || (ids && (!scratch || !best || !at))) {
        free(tail), free(buffers), free(scratch), free(best), free(at);
        return -1;
    }
    int used = threads;
    /* Where x is larger than L2 holds beside a chunk, the threads split the rows instead of
     * the units: each thread dequantizes every chunk (twice the dequantizing) and passes its
     * own rows over it, which stay in L2 from chunk to chunk, where with the units split each
     * thread streamed all of x from memory once a chunk (see ROWS_SPLIT_X_BYTES). */
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *buffer = buffers + t * chunk_elements;
        float *sums = ids ? scratch + t * M * width : NULL, *top = ids ? best + t * M : NULL;
        int64_t *where = ids ? at + t * M : NULL;
        if (t == 0) used = (int)nt;
        for (int64_t m = 0; ids && m < M; m++) top[m] = -INFINITY, where[m] = -1;
        configure_tiles();
        /* the thread's units and rows: a range of the units and every row, or (split_rows) every
         * unit and a range of pairs of 16-row tiles, the last thread's with the padded tail */
        const int64_t pairs = (M + 31) / 32, first = split_rows ? 0 : units * t / nt;
        const int64_t end = split_rows ? units : units * (t + 1) / nt;
        const int64_t r0 = split_rows ? 32 * (pairs * t / nt) : 0;
        const int64_t r1 = split_rows && t + 1 < nt ? 32 * (pairs * (t + 1) / nt) : M;
        const size_t esize = epilogue == TILES_PLAIN_F32 ? 4 : 2;
        for (int64_t u = first; u < end && r1 > r0; u += chunk) {
            const int64_t count = end - u < chunk ? end - u : chunk, f0 = 2 * QBLOCK * u;
            for (int64_t i = 0; i < (silu ? 4 : 2) * count; i++) {
                /* SiLU-mul: group u + i / 4 of gate's two blocks then up's; else blocks 2u.. */
                const int64_t b = silu ? (i % 4 < 2 ? 0 : blocks) + 2 * (u + i / 4) + i % 2 : 2 * u + i;
                if (silu || b < blocks)
                    dequantize_block(w, b, K, bits, has_min, buffer + i / 4 * (K * 64) + i % 4 * 2 * QBLOCK);
            }
            const int64_t n = N - f0 < 2 * QBLOCK * count ? N - f0 : 2 * QBLOCK * count;
            if (ids) {
                amx_tile_rows(x, ldx, M, tail, buffer, K, sums, width, n, count, TILES_PLAIN_F32);
                for (int64_t m = 0; m < M; m++) take_best(sums + m * width, n, f0, &top[m], &where[m]);
            } else {
                amx_tile_rows(x + r0 * ldx, ldx, r1 - r0, r1 == M ? tail : NULL, buffer, K,
                              (char *)y + (size_t)(r0 * ldy + f0) * esize, ldy, n, count, epilogue);
            }
        }
        _tile_release();
    }
    if (ids) pick_best(best, at, used, M, ids);
    free(tail), free(buffers), free(scratch), free(best), free(at);
    return 0;
}
#endif

/* act [M, I] = SiLU(gate) * up of x's product with a quantized gate/up weight [2I, K] (gate's
 * features, then up's), rounded to bfloat16, on AMX tiles with the activation in the product's
 * epilogue (as packed_linear.c's), where they take it: from amx_min_rows rows (0: never), I a
 * multiple of 32. Returns 1 if done, 0 if not taken (the caller then runs quant_linear and
 * the activation: one_call_forward.c's quant_silu_mul_linear), -1 if memory ran out. */
int quant_silu_mul_tiles(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int bits,
                         int has_min, int64_t I, uint16_t *act, int64_t amx_min_rows) {
#ifdef QUANT_TILES
    if (amx_min_rows > 0 && M >= amx_min_rows && I % 32 == 0 && bits != 6 && pagoda_amx_permitted())
        return quant_linear_tiles(x, M, ldx, K, w, bits, has_min, I, act, I, TILES_SILU_MUL, NULL) ? -1 : 1;
#else
    (void)x, (void)M, (void)ldx, (void)K, (void)w, (void)bits, (void)has_min, (void)I, (void)act, (void)amx_min_rows;
#endif
    return 0;
}

/* The entry point (see the top of the file); returns 0, or -1 if memory ran out. From
 * amx_min_rows rows (0: never) of bfloat16 x without bias, on a CPU whose AMX tiles the caller
 * has proved to run, the product runs on the tiles (quant_linear_tiles). */
int quant_linear(const void *x, int64_t M, int64_t ldx, int x_f32, int64_t K, const uint8_t *w, int bits,
                 int has_min, int64_t N, const float *bias, void *y, int64_t ldy, int out_f32, int64_t amx_min_rows) {
    const int64_t groups = K / QGROUP;
    if (bits == 6 && !quant_linear_q6()) return -2;
#ifdef QUANT_TILES
    if (amx_min_rows > 0 && M >= amx_min_rows && !x_f32 && !bias && bits != 6 && pagoda_amx_permitted())
        return quant_linear_tiles(x, M, ldx, K, w, bits, has_min, N, y, ldy, out_f32 ? TILES_PLAIN_F32 : TILES_PLAIN,
                                  NULL);
#else
    (void)amx_min_rows;
#endif
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    /* each row's sums of xq a group, then (6-bit) a half group */
    int32_t *xsum = malloc((size_t)(M * groups) * (bits == 6 ? 3 : 1) * sizeof(int32_t));
    int32_t *xhalf = xsum + M * groups;
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    const int64_t esize = x_f32 ? 4 : 2, blocks = (N + QBLOCK - 1) / QBLOCK;
    const int threads = omp_get_max_threads();
#pragma omp parallel num_threads(M * K >= 4096 || blocks >= 2 * threads ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row((const char *)x + m * ldx * esize, x_f32, K, xq + m * K, xs + m * groups, xsum + m * groups);
            if (bits == 6) half_sums(xq + m * K, K, xhalf + 2 * m * groups);
        }
        /* contiguous ranges of blocks, one per thread */
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        quant_blocks(xq, xs, bits == 6 ? xhalf : xsum, M, K, w, bits, has_min, bias, y, ldy, N, out_f32,
                     blocks * t / nt, blocks * (t + 1) / nt);
    }
    free(xq), free(xs), free(xsum);
    return 0;
}

/* Several products at once (a mixture of experts' experts, each on its own rows): for each
 * task, y = x @ w.T over bfloat16 x [M, K] (rows ldx apart) into y [M, N] (rows ldy apart;
 * float32 with out_f32, else bfloat16), every weight of the same bits and minimums, no bias.
 * One parallel region for all: every task's rows quantized, then every task's blocks of
 * features laid end to end, each costing its task's rows, and split into one contiguous range
 * of the cost a thread (work_share.h). Run one product at a
 * time (quant_linear), a decode's experts opened two regions each and waited at their ends
 * (a Qwen3-MoE layer's 8 experts for one token, AMD Zen 4: 841 -> 805 us, alternated). The sums
 * are quant_linear's, output for output. Returns 0, or -1 if memory ran out. */
int quant_linear_many(const struct quant_task *tasks, int64_t count, int64_t K, int bits, int has_min, int out_f32) {
    const int64_t groups = K / QGROUP;
    if (bits == 6 && !quant_linear_q6()) return -2;
    int64_t rows = 0, blocks = 0, cost = 0, *row_of = malloc((size_t)(count + 1) * sizeof(int64_t));
    if (!row_of) return -1;
    for (int64_t i = 0; i < count; i++) { /* the task's first quantized row */
        row_of[i] = rows;
        rows += tasks[i].M;
        blocks += (tasks[i].N + QBLOCK - 1) / QBLOCK;
        cost += (tasks[i].N + QBLOCK - 1) / QBLOCK * tasks[i].M;
    }
    int8_t *xq = malloc((size_t)(rows * K) + 1);
    float *xs = malloc((size_t)(rows * groups) * sizeof(float) + 1);
    /* each row's sums of xq a group, then (6-bit) a half group */
    int32_t *xsum = malloc((size_t)(rows * groups) * (bits == 6 ? 3 : 1) * sizeof(int32_t) + 1);
    int32_t *xhalf = xsum + rows * groups;
    if (!xq || !xs || !xsum) {
        free(row_of), free(xq), free(xs), free(xsum);
        return -1;
    }
    const int threads = omp_get_max_threads();
#pragma omp parallel num_threads(rows * K >= 4096 || blocks >= 2 * threads ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++)
            for (int64_t m = 0; m < tasks[i].M; m++) {
                const int64_t r = row_of[i] + m;
                quantize_row((const uint16_t *)tasks[i].x + m * tasks[i].ldx, 0, K, xq + r * K, xs + r * groups,
                             xsum + r * groups);
                if (bits == 6) half_sums(xq + r * K, K, xhalf + 2 * r * groups);
            }
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = cost * t / nt, last = cost * (t + 1) / nt;
        int64_t at = 0; /* the cost before task i's blocks */
        for (int64_t i = 0; i < count && at < last; i++) {
            const struct quant_task *task = tasks + i;
            const int64_t n = (task->N + QBLOCK - 1) / QBLOCK, r = row_of[i];
            int64_t from, to;
            if (!task->M) continue;
            share_of(at, n, task->M, first, last, &from, &to);
            if (from < to)
                quant_blocks(xq + r * K, xs + r * groups, bits == 6 ? xhalf + 2 * r * groups : xsum + r * groups,
                             task->M, K, task->w, bits, has_min, NULL, task->y, task->ldy, task->N, out_f32, from, to);
            at += n * task->M;
        }
    }
    free(row_of), free(xq), free(xs), free(xsum);
    return 0;
}

/* Greedy sampling's LM head: each row's index of its largest output (the first on ties), the
 * outputs never written out. Each thread takes its contiguous range of blocks four at a time
 * (64 features, the tiles' widest) into a scratch of M x 64 float32 sums, the same sums as
 * quant_linear's with out_f32, and keeps its range's best per row; the ranges, in order, then
 * give each row the first of the largest, or its first NaN (as torch's max). From amx_min_rows
 * rows (0: never), where quant_linear runs on the tiles, so does this (quant_linear_tiles with
 * ids). Returns 0, or -1 if memory ran out. */
#define ARGMAX_BLOCKS 4
int quant_linear_argmax(const void *x, int64_t M, int64_t ldx, int x_f32, int64_t K, const uint8_t *w, int bits,
                        int has_min, int64_t N, const float *bias, int64_t *ids, int64_t amx_min_rows) {
    if (bits == 6 && !quant_linear_q6()) return -2;
#ifdef QUANT_TILES
    /* as quant_linear takes the tiles, so that the pick is the largest of its sums */
    if (amx_min_rows > 0 && M >= amx_min_rows && !x_f32 && !bias && bits != 6 && pagoda_amx_permitted())
        return quant_linear_tiles(x, M, ldx, K, w, bits, has_min, N, NULL, 0, TILES_PLAIN_F32, ids);
#else
    (void)amx_min_rows;
#endif
    const int64_t groups = K / QGROUP, blocks = (N + QBLOCK - 1) / QBLOCK, width = ARGMAX_BLOCKS * QBLOCK;
    const int64_t block_bytes = groups * group_bytes(bits, has_min), esize = x_f32 ? 4 : 2;
    const int threads = omp_get_max_threads();
    int8_t *xq = malloc((size_t)(M * K));
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    int32_t *xsum = malloc((size_t)(M * groups) * (bits == 6 ? 3 : 1) * sizeof(int32_t));
    int32_t *xhalf = xsum + M * groups;
    float *scratch = malloc((size_t)(threads * M * width) * sizeof(float));
    float *best = malloc((size_t)(threads * M) * sizeof(float));
    int64_t *at = malloc((size_t)(threads * M) * sizeof(int64_t));
    if (!xq || !xs || !xsum || !scratch || !best || !at) {
        free(xq), free(xs), free(xsum), free(scratch), free(best), free(at);
        return -1;
    }
    int used = 1;
#pragma omp parallel num_threads(M * K >= 4096 || blocks >= 2 * threads ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row((const char *)x + m * ldx * esize, x_f32, K, xq + m * K, xs + m * groups, xsum + m * groups);
            if (bits == 6) half_sums(xq + m * K, K, xhalf + 2 * m * groups);
        }
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), end = blocks * (t + 1) / nt;
        if (t == 0) used = (int)nt;
        float *sums = scratch + t * M * width, *top = best + t * M;
        int64_t *where = at + t * M;
        for (int64_t m = 0; m < M; m++) top[m] = -INFINITY, where[m] = -1;
        for (int64_t nb = blocks * t / nt; nb < end; nb += ARGMAX_BLOCKS) {
            const int64_t count = end - nb < ARGMAX_BLOCKS ? end - nb : ARGMAX_BLOCKS, n0 = nb * QBLOCK;
            const int64_t n = N - n0 < count * QBLOCK ? N - n0 : count * QBLOCK;
            quant_blocks(xq, xs, bits == 6 ? xhalf : xsum, M, K, w + nb * block_bytes, bits, has_min,
                         bias ? bias + n0 : NULL, sums, width, N - n0, 1, 0, count);
            for (int64_t m = 0; m < M; m++) take_best(sums + m * width, n, n0, &top[m], &where[m]);
        }
    }
    pick_best(best, at, used, M, ids);
    free(xq), free(xs), free(xsum), free(scratch), free(best), free(at);
    return 0;
}

