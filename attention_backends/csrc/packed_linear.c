/*
 * y = x @ w.T (+ bias) in bfloat16 for the CPU, with AVX512-BF16 dot products (vdpbf16ps),
 * from a weight repacked once at load time.
 *
 * Layout:
 *   x:       [M, K] bfloat16, rows ldx apart
 *   weight:  [ceil(N / 64)][ceil(K / 2)][64][2] bfloat16: for each group of 64 output
 *            features, each pair of input features (2k, 2k + 1), the 64 features' two
 *            weights side by side; zero where n >= N or k >= K. One 64-byte vector holds 16
 *            features x one input pair, which is what vdpbf16ps multiplies against a
 *            broadcast pair of x, so a group is read front to back exactly once per tile of
 *            rows. (The same layout that oneDNN's bfloat16 reorder makes for AVX512-BF16.)
 *   bias:    [N] bfloat16 or NULL
 *   y:       [M, N] bfloat16, rows ldy apart
 *
 * A tile is up to ROWS rows of x against a whole group (64 features: 4 accumulators a row)
 * or half of one (32 features); its sums stay in float32 registers over all of K and are
 * rounded to bfloat16 (to nearest even) once, after the bias. Every output is the same
 * sequential sum over K whatever M is and however the work is split between threads, so a
 * request's result does not depend on what it is batched with.
 *
 * packed_silu_mul_linear_bf16 is gate_proj and up_proj of an MLP as one product, followed by
 * SiLU(gate) * up in the tile's epilogue, so the [M, 2I] product never goes to memory: its
 * weight's group c holds gate features 32c..32c+31, then up features 32c..32c+31 (zero
 * beyond I), and y is [M, I]. The epilogue rounds as eager torch does in bfloat16: gate and up
 * to bfloat16, SiLU(gate) = gate / (1 + exp(-gate)) in float32 and rounded, the product rounded.
 * (The compiled element-wise pass it replaces kept SiLU(gate) in float32, unrounded.)
 *
 * Threads take contiguous ranges of half-groups (the fused product: of whole groups), so
 * each reads one contiguous stretch of the weight (the hardware prefetcher keeps up; software
 * prefetch measured slower) and two threads split 9 groups 4.5 : 4.5, not 5 : 4.
 */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "avx512_exp.h"

#define ROWS 6       /* rows of x per tile: 6 x 4 accumulators (4 rows: 16-20% slower at 2048) */
#define GROUP 64     /* output features per weight group */

enum epilogue { PLAIN, SILU_MUL };  /* what a tile does with its sums (see above) */

static inline __m512 bf16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* x rounded to bfloat16 (to nearest even), back in float32 */
static inline __m512 round_bf16(__m512 x) { return bf16_to_f32((__m256i)_mm512_cvtneps_pbh(x)); }

static inline __mmask16 tail_mask(int64_t n, int64_t N) {
    return N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
}

static inline __attribute__((always_inline)) void linear_tile(
        const uint16_t *x, int64_t ldx, const int rows, const uint16_t *wg, int64_t K, const int vecs,
        const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t n0, int64_t N, const enum epilogue epilogue) {
    /* rows, vecs (16 features each) and epilogue are constants after inlining, so the
     * accumulators live in registers and the loops unroll. */
    __m512 acc[ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < vecs; j++) acc[m][j] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t kp = 0; kp < pairs; kp++) {
        const uint16_t *p = wg + kp * 2 * GROUP;
        __m512bh w[4];
        for (int j = 0; j < vecs; j++) w[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
        for (int m = 0; m < rows; m++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < vecs; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w[j], xb);
        }
    }
    if (K % 2) { /* the last input feature, paired with a zero */
        const uint16_t *p = wg + pairs * 2 * GROUP;
        for (int m = 0; m < rows; m++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[m * ldx + K - 1]);
            for (int j = 0; j < vecs; j++)
                acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)_mm512_loadu_si512(p + 32 * j), xb);
        }
    }
    if (epilogue == SILU_MUL) { /* vectors 0-1: gate of 32 features, 2-3: up of the same ones */
        for (int j = 0; j < 2; j++) {
            const int64_t n = n0 + 16 * j;
            if (n >= N) break;
            const __mmask16 mask = tail_mask(n, N);
            for (int m = 0; m < rows; m++) {
                const __m512 gate = round_bf16(acc[m][j]), up = round_bf16(acc[m][j + 2]);
                const __m512 one = _mm512_set1_ps(1.0f);
                const __m512 silu = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
                _mm256_mask_storeu_epi16(y + m * ldy + n, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, up)));
            }
        }
        return;
    }
    for (int j = 0; j < vecs; j++) {
        const int64_t n = n0 + 16 * j;
        if (n >= N) break;
        const __mmask16 mask = tail_mask(n, N);
        const __m512 b = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + n)) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++)
            _mm256_mask_storeu_epi16(y + m * ldy + n, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b)));
    }
}

#define TILE(R, V, E) linear_tile(x + m * ldx, ldx, R, wg, K, V, bias, y + m * ldy, ldy, n0, N, E)

/* Every row of x against one weight group (vecs 4) or half of one (vecs 2). */
#define DEFINE_ALL_ROWS(NAME, V, E)                                                                        \
static void NAME(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *wg, int64_t K,                 \
                 const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t n0, int64_t N) {                  \
    int64_t m = 0;                                                                                          \
    for (; m + ROWS <= M; m += ROWS) TILE(ROWS, V, E);                                                      \
    switch (M - m) {                                                                                        \
    case 1: TILE(1, V, E); break;                                                                           \
    case 2: TILE(2, V, E); break;                                                                           \
    case 3: TILE(3, V, E); break;                                                                           \
    case 4: TILE(4, V, E); break;                                                                           \
    case 5: TILE(5, V, E); break;                                                                           \
    }                                                                                                       \
}
DEFINE_ALL_ROWS(all_rows_group, 4, PLAIN)
DEFINE_ALL_ROWS(all_rows_half, 2, PLAIN)
DEFINE_ALL_ROWS(all_rows_silu_mul, 4, SILU_MUL)

int packed_linear_available(void) { return 1; }

void packed_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                        const uint16_t *bias, uint16_t *y, int64_t ldy) {
    const int64_t halves = (N + GROUP / 2 - 1) / (GROUP / 2);
    const int64_t group_stride = (K + 1) / 2 * 2 * GROUP;
    /* NOTE: below about 64k multiply-adds the threads' start-up costs more than they save. */
    #pragma omp parallel if (M * N * K >= 65536)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t first = halves * t / threads, end = halves * (t + 1) / threads;
        for (int64_t h = first; h < end;) {
            const int64_t g = h / 2;
            const uint16_t *group = w + g * group_stride;
            if (h % 2 == 0 && h + 1 < end) {
                all_rows_group(x, ldx, M, group, K, bias, y, ldy, g * GROUP, N);
                h += 2;
            } else {
                const int64_t half = h % 2;
                all_rows_half(x, ldx, M, group + half * GROUP, K, bias, y, ldy, g * GROUP + half * GROUP / 2, N);
                h += 1;
            }
        }
    }
}

void packed_silu_mul_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
                                 uint16_t *y, int64_t ldy) {
    const int64_t groups = (I + GROUP / 2 - 1) / (GROUP / 2);
    const int64_t group_stride = (K + 1) / 2 * 2 * GROUP;
    #pragma omp parallel if (M * I * K >= 32768)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        for (int64_t g = groups * t / threads; g < groups * (t + 1) / threads; g++)
            all_rows_silu_mul(x, ldx, M, w + g * group_stride, K, NULL, y, ldy, g * GROUP / 2, I);
    }
}
#else
int packed_linear_available(void) { return 0; }

void packed_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                        const uint16_t *bias, uint16_t *y, int64_t ldy) {
    (void)x, (void)M, (void)ldx, (void)w, (void)N, (void)K, (void)bias, (void)y, (void)ldy;
}

void packed_silu_mul_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
                                 uint16_t *y, int64_t ldy) {
    (void)x, (void)M, (void)ldx, (void)w, (void)I, (void)K, (void)y, (void)ldy;
}
#endif
