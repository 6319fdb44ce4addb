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
 *   y:       [M, N] bfloat16, rows ldy apart (or float32 with out_f32 1: the sums unrounded, for
 *            the LM head, whose logits would otherwise tie at bfloat16's resolution; with
 *            out_f32 2, the sums added to y's own values and rounded once: a LoRA delta)
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
 *
 * On CPUs with AMX (TDPBF16PS), a call with at least amx_min_rows rows (0: never) and K a
 * multiple of 32 runs on the tiles instead, from the same weight: rows kp..kp+15 of a
 * group's pair-major layout, 16 features (64 bytes) each, 256 bytes apart, are exactly an
 * AMX B tile, so no second copy of the weight is needed. A tile step is 16 rows of x
 * against a half-group or group (2 or 4 float32 accumulator tiles) over 32 input features;
 * the sums go through a per-thread float32 scratch tile to the same epilogues (bias and
 * rounding, or SiLU(gate) * up) as above. A last block of fewer than 16 rows is copied into
 * zero-padded rows first. The tiles' summation order is not the vectors', so results differ
 * from the AVX512 path by rounding: callers that need batch invariance pass 0. The caller
 * also decides whether AMX runs at all (amx_probe(): the kernel may be compiled with AMX
 * and the CPU list it, yet the instructions fault, so the probe runs them in a child).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagoda_kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "amx_tiles.h"
#endif

#include "vector_exp.h"
#include "vector_lanes.h"

#define ROWS 6       /* rows of x per tile: 6 x 4 accumulators (4 rows: 16-20% slower at 2048) */
#define GROUP 64     /* output features per weight group */

enum epilogue { PLAIN, PLAIN_F32, SILU_MUL, ADD_BF16 };  /* what a tile does with its sums (see above) */

static inline __m512 bf16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* x rounded to bfloat16 (to nearest even), back in float32 */
static inline __m512 round_bf16(__m512 x) { return bf16_to_f32((__m256i)_mm512_cvtneps_pbh(x)); }

/* One row's sums (vecs vectors of 16 features from feature n0) through the epilogue into y. */
static inline __attribute__((always_inline)) void store_row(const __m512 *acc, const int vecs, const uint16_t *bias,
                                                            uint16_t *y, int64_t n0, int64_t N,
                                                            const enum epilogue epilogue) {
    if (epilogue == SILU_MUL) { /* vectors 0-1: gate of 32 features, 2-3: up of the same ones */
        for (int j = 0; j < 2; j++) {
            const int64_t n = n0 + 16 * j;
            if (n >= N) break;
            const __m512 gate = round_bf16(acc[j]), up = round_bf16(acc[j + 2]);
            const __m512 one = _mm512_set1_ps(1.0f);
            const __m512 silu = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
            _mm256_mask_storeu_epi16(y + n, first_lanes16(N - n), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, up)));
        }
        return;
    }
    for (int j = 0; j < vecs; j++) {
        const int64_t n = n0 + 16 * j;
        if (n >= N) break;
        const __mmask16 mask = first_lanes16(N - n);
        const __m512 b = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + n)) : _mm512_setzero_ps();
        if (epilogue == PLAIN_F32) /* y is float32 here (the caller's pointers count in halves of one) */
            _mm512_mask_storeu_ps((float *)y + n, mask, _mm512_add_ps(acc[j], b));
        else if (epilogue == ADD_BF16) /* y += the sums, rounded once */
            _mm256_mask_storeu_epi16(y + n, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(
                _mm512_add_ps(acc[j], b), bf16_to_f32(_mm256_maskz_loadu_epi16(mask, y + n)))));
        else
            _mm256_mask_storeu_epi16(y + n, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j], b)));
    }
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
    for (int m = 0; m < rows; m++) store_row(acc[m], vecs, bias, y + m * ldy, n0, N, epilogue);
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
DEFINE_ALL_ROWS(all_rows_group_f32, 4, PLAIN_F32)
DEFINE_ALL_ROWS(all_rows_half_f32, 2, PLAIN_F32)
DEFINE_ALL_ROWS(all_rows_group_add, 4, ADD_BF16)
DEFINE_ALL_ROWS(all_rows_half_add, 2, ADD_BF16)
DEFINE_ALL_ROWS(all_rows_silu_mul, 4, SILU_MUL)

int packed_linear_available(void) { return 1; }

#ifdef HAVE_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Tiles (amx_tiles.h) 0-3: float32 sums of 16 rows x 16 features; 4 and 7: 16 rows x 32 inputs
 * of x; 5, 6: 16 input pairs x 16 features of the weight. */

/* 1 once Linux lets this process use the tiles' state (asked once; without it the first tile
 * instruction faults). Also used by tile_attention.c. */
int pagoda_amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* 1 if the AMX bfloat16 path runs here: permission, then one TDPBF16PS in a forked child (a
 * fault there kills only the child). */
int amx_probe(void) {
    if (!pagoda_amx_permitted()) return 0;
    const pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        static uint16_t a[16 * 32], b[16 * 32];
        static float c[16 * 16];
        for (int i = 0; i < 16 * 32; i++) a[i] = b[i] = 0x3f80; /* 1.0 */
        configure_tiles();
        _tile_zero(0);
        _tile_loadd(4, a, 64);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_stored(0, c, 64);
        _tile_release();
        _exit(c[0] == 32.0f && c[255] == 32.0f ? 0 : 1);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* 16 rows of x (ldx apart) against vecs (2 or 4) x 16 features of a group, over all of K (a
 * multiple of 32), through the epilogue into the first `rows` rows of y; the weight's tiles
 * loaded non-temporally, as in amx_block32. */
static inline __attribute__((always_inline)) void amx_tile(
        const uint16_t *x, int64_t ldx, const int64_t rows, const uint16_t *wg, int64_t K, const int vecs,
        const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t n0, int64_t N, const enum epilogue epilogue) {
    float sums[16][64] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    if (vecs == 4) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int64_t wpair = 2 * GROUP;                      /* elements from one input pair to the next */
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t *b = wg + k / 2 * wpair;
        _tile_loadd(4, x + k, ldx * 2);
        _tile_stream_loadd(5, b, wpair * 2);
        _tile_stream_loadd(6, b + 32, wpair * 2);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if (vecs == 4) {
            _tile_stream_loadd(5, b + 64, wpair * 2);
            _tile_stream_loadd(6, b + 96, wpair * 2);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, &sums[0][0], sizeof(sums[0]));
    _tile_stored(1, &sums[0][16], sizeof(sums[0]));
    if (vecs == 4) {
        _tile_stored(2, &sums[0][32], sizeof(sums[0]));
        _tile_stored(3, &sums[0][48], sizeof(sums[0]));
    }
    for (int64_t m = 0; m < rows; m++) {
        __m512 acc[4];
        for (int j = 0; j < vecs; j++) acc[j] = _mm512_load_ps(&sums[m][16 * j]);
        store_row(acc, vecs, bias, y + m * ldy, n0, N, epilogue);
    }
}

/* A 32-row tile's float32 sums waiting for their epilogue, which runs a few rows at a time
 * between the next tile's products: the vector units round and store while the tiles multiply
 * (one after the other, the epilogue took 30% of a 2048-row product's time). */
struct pending {
    float (*sums)[64]; /* NULL: nothing waiting */
    const uint16_t *bias;
    uint16_t *y;
    int64_t ldy, n0, N, row;
    int vecs;
    enum epilogue epilogue;
};

/* The waiting tile's rows up to `upto` (of 32) through its epilogue. */
static inline __attribute__((always_inline)) void drain(struct pending *p, int64_t upto) {
    if (!p->sums) return;
    if (upto > 32) upto = 32;
    const int whole = p->epilogue == PLAIN && !p->bias && p->n0 + 16 * p->vecs <= p->N;
    for (; p->row < upto; p->row++) {
        const float *row = p->sums[p->row];
        uint16_t *y = p->y + p->row * p->ldy;
        if (whole) { /* whole vectors: two rounded per store */
            for (int j = 0; j < p->vecs; j += 2)
                _mm512_storeu_si512(y + p->n0 + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(row + 16 * j + 16),
                                                                                   _mm512_load_ps(row + 16 * j)));
            continue;
        }
        __m512 acc[4];
        for (int j = 0; j < p->vecs; j++) acc[j] = _mm512_load_ps(row + 16 * j);
        if (p->epilogue == SILU_MUL) store_row(acc, 4, NULL, y, p->n0, p->N, SILU_MUL);
        else if (p->epilogue == PLAIN_F32) store_row(acc, p->vecs, p->bias, y, p->n0, p->N, PLAIN_F32);
        else if (p->epilogue == ADD_BF16) store_row(acc, p->vecs, p->bias, y, p->n0, p->N, ADD_BF16);
        else store_row(acc, p->vecs, p->bias, y, p->n0, p->N, PLAIN);
    }
    if (p->row == 32) p->sums = NULL;
}

/* 32 rows of x (two tiles) against features 16 j0.. and 16 j1.. of a group (two tiles) over
 * all of K, the float32 sums into those columns of sums[32][64]: each tile loaded serves two
 * products (a 16-row tile against a whole group loads 5 tiles for 4 products). The weight's
 * tiles are loaded with the non-temporal hint (TILELOADDT1): each is used once per pass, and
 * through L1 they evicted the 32 rows of x, which every group of the chunk reuses (2048 rows
 * against 30 layers' q/k/v, o and gate/up: 11-17% faster; the down product's x, 32 x 1536,
 * does not fit L1 either way). With `next`,
 * the same tiles of another group are prefetched into L2 meanwhile; `per_step` rows of the
 * pending epilogue run after each step's products. */
static inline __attribute__((always_inline)) void amx_block32(const uint16_t *x, int64_t ldx, const uint16_t *wg,
                                                              int64_t K, int j0, int j1, float sums[32][64],
                                                              const uint16_t *next, struct pending *waiting,
                                                              int64_t per_step) {
    const int64_t wpair = 2 * GROUP;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t *b = wg + k / 2 * wpair;
        if (next)
            for (int r = 0; r < 16; r++) {
                _mm_prefetch((const char *)(next + (k / 2 + r) * wpair + 32 * j0), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + (k / 2 + r) * wpair + 32 * j1), _MM_HINT_T1);
            }
        _tile_loadd(4, x + k, ldx * 2);
        _tile_stream_loadd(5, b + 32 * j0, wpair * 2);
        _tile_stream_loadd(6, b + 32 * j1, wpair * 2);
        _tile_loadd(7, x + 16 * ldx + k, ldx * 2);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 7, 5);
        _tile_dpbf16ps(3, 7, 6);
        drain(waiting, waiting->row + per_step);
    }
    _tile_stored(0, &sums[0][16 * j0], sizeof(sums[0]));
    _tile_stored(1, &sums[0][16 * j1], sizeof(sums[0]));
    _tile_stored(2, &sums[16][16 * j0], sizeof(sums[0]));
    _tile_stored(3, &sums[16][16 * j1], sizeof(sums[0]));
}

/* 32 rows of x against a group (vecs 4) or half-group (2) into sums, finishing the waiting
 * tile's epilogue meanwhile; then this tile waits, for the next one's products. */
static inline __attribute__((always_inline)) void amx_tile32(
        const uint16_t *x, int64_t ldx, const uint16_t *wg, int64_t K, const int vecs, const uint16_t *bias,
        uint16_t *y, int64_t ldy, int64_t n0, int64_t N, const enum epilogue epilogue, const uint16_t *next,
        float sums[32][64], struct pending *waiting) {
    const int64_t steps = K / 32 * (vecs / 2), per_step = (32 + steps - 1) / steps;
    amx_block32(x, ldx, wg, K, 0, 1, sums, next, waiting, per_step);
    if (vecs == 4) amx_block32(x, ldx, wg, K, 2, 3, sums, next, waiting, per_step);
    drain(waiting, 32);
    *waiting = (struct pending){sums, bias, y, ldy, n0, N, 0, vecs, epilogue};
}

/* Every row of x against the half-groups [first, end) of w (silu_mul: the groups), in
 * chunks of about AMX_CHUNK_BYTES of weight: each chunk is read from memory once and stays
 * in L2 while every block of 16 rows passes over it, and the block's rows (16 x K) stay near
 * in L1 meanwhile. (Every block against one group at a time, a 64-row x no longer fits L1 and
 * its tile loads compete with the weight's: 2.2x oneDNN's time at 64 rows.) The last partial
 * block of rows comes from `tail`, copied into 16 zero-padded rows of K. */
#ifndef AMX_CHUNK_BYTES
#define AMX_CHUNK_BYTES (512 * 1024)
#endif
static void amx_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *tail, const uint16_t *w, int64_t K,
                     const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t N, int64_t first, int64_t end,
                     const enum epilogue epilogue, const int chunk_in_l2) {
    const int64_t group_stride = K * GROUP, unit = epilogue == SILU_MUL ? 1 : 2; /* units per group */
    /* (with chunk_in_l2, the caller's chunk whole, as quant_linear.c sized it) */
    int64_t chunk = chunk_in_l2 ? end - first : AMX_CHUNK_BYTES / (group_stride * (int64_t)sizeof(uint16_t)) * unit;
    if (chunk < 2) chunk = 2;
    float sums[2][32][64] __attribute__((aligned(64)));  /* one tile's being computed, the other's waiting */
    /* NOTE: 32-row blocks (2 x 2 tiles) where they make one pass over the weight or many; from
     * 48 to 127 rows, 16-row tiles against whole groups (1 x 4), whose first pass reads each
     * 4 KB slice of the weight in one piece: 64 rows over 30 layers' weights, 24.9 -> 22.5 ms
     * (oneDNN: 22.8-23.2). Not where the caller has just written the weight into L2
     * (`chunk_in_l2`: quant_linear.c's dequantized chunks): there the pairs load half the
     * weight tiles (Q4_1 at 64 rows, 30 layers: 22.4 -> 19.4 ms). */
    const int pairs = M < 48 || M >= 128 || chunk_in_l2;
    struct pending waiting = {0};
    int which = 0;
    for (int64_t c0 = first; c0 < end; c0 += chunk) {
        const int64_t c1 = c0 + chunk < end ? c0 + chunk : end;
        for (int64_t m = 0; m < M; m += 16) {
            if (pairs && m + 32 <= M) { /* two blocks at once */
                for (int64_t h = c0; h < c1;) {
                    const int64_t g = epilogue == SILU_MUL ? h : h / 2, half = epilogue == SILU_MUL ? 0 : h % 2;
                    const int whole = epilogue == SILU_MUL || (half == 0 && h + 1 < c1);
                    const uint16_t *part = w + g * group_stride + half * GROUP;
                    const int64_t n0 = epilogue == SILU_MUL ? g * GROUP / 2 : g * GROUP + half * GROUP / 2;
                    /* the last pass over a chunk, reading it from L2, prefetches the next one's weight
                     * from memory (the first pass waits on memory anyway) */
                    const uint16_t *next = m > 0 && m + 64 > M && h + chunk < end
                                           ? part + chunk / unit * group_stride : NULL;
                    if (whole)
                        amx_tile32(x + m * ldx, ldx, part, K, 4, bias, y + m * ldy, ldy, n0, N, epilogue, next,
                                   sums[which], &waiting);
                    else
                        amx_tile32(x + m * ldx, ldx, part, K, 2, bias, y + m * ldy, ldy, n0, N, epilogue, next,
                                   sums[which], &waiting);
                    which ^= 1;
                    h += epilogue == SILU_MUL ? 1 : whole ? 2 : 1;
                }
                m += 16;
                continue;
            }
            const int full = m + 16 <= M;
            const uint16_t *xb = full ? x + m * ldx : tail;
            const int64_t lxb = full ? ldx : K, rows = full ? 16 : M - m;
            uint16_t *yb = y + m * ldy;
            for (int64_t h = c0; h < c1;) {
                if (epilogue == SILU_MUL) {
                    amx_tile(xb, lxb, rows, w + h * group_stride, K, 4, NULL, yb, ldy, h * GROUP / 2, N, SILU_MUL);
                    h++;
                    continue;
                }
                const int64_t g = h / 2, half = h % 2;
                const uint16_t *part = w + g * group_stride + half * GROUP;
                const int64_t n0 = g * GROUP + half * GROUP / 2;
                if (half == 0 && h + 1 < c1) {
                    if (epilogue == PLAIN_F32) amx_tile(xb, lxb, rows, part, K, 4, bias, yb, ldy, n0, N, PLAIN_F32);
                    else if (epilogue == ADD_BF16) amx_tile(xb, lxb, rows, part, K, 4, bias, yb, ldy, n0, N, ADD_BF16);
                    else amx_tile(xb, lxb, rows, part, K, 4, bias, yb, ldy, n0, N, PLAIN);
                    h += 2;
                } else {
                    if (epilogue == PLAIN_F32) amx_tile(xb, lxb, rows, part, K, 2, bias, yb, ldy, n0, N, PLAIN_F32);
                    else if (epilogue == ADD_BF16) amx_tile(xb, lxb, rows, part, K, 2, bias, yb, ldy, n0, N, ADD_BF16);
                    else amx_tile(xb, lxb, rows, part, K, 2, bias, yb, ldy, n0, N, PLAIN);
                    h += 1;
                }
            }
        }
    }
    drain(&waiting, 32);
}

/* The last M % 16 rows of x, zero-padded to 16 rows of K (NULL when M is a multiple of 16). */
static uint16_t *padded_tail(const uint16_t *x, int64_t M, int64_t ldx, int64_t K) {
    const int64_t left = M % 16;
    if (!left) return NULL;
    uint16_t *tail = aligned_alloc(64, (16 * K * sizeof(uint16_t) + 63) / 64 * 64);
    if (!tail) return NULL;
    memset(tail, 0, 16 * K * sizeof(uint16_t));
    for (int64_t m = 0; m < left; m++) memcpy(tail + m * K, x + (M - left + m) * ldx, K * sizeof(uint16_t));
    return tail;
}

/* Whether this call runs on the tiles (and then *tail: x's last rows padded, see padded_tail). */
static int use_amx(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, int64_t amx_min_rows, uint16_t **tail) {
    *tail = NULL;
    if (!(amx_min_rows > 0 && M >= amx_min_rows && K % 32 == 0 && pagoda_amx_permitted())) return 0;
    *tail = padded_tail(x, M, ldx, K);
    return !(M % 16 && !*tail); /* no memory for the padded rows: the vectors */
}
/* For quant_linear.c, whose products of many rows run here on weights it dequantizes a chunk
 * at a time into this file's layout: every row of x against the units [0, units) of w (half-
 * groups; with SILU_MUL, groups packed for it) through the epilogue (enum epilogue) into y,
 * ldy elements of y's type apart, the tiles configured by the calling thread; tail as from
 * amx_padded_tail. No bias. */
void amx_tile_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *tail, const uint16_t *w, int64_t K,
                   void *y, int64_t ldy, int64_t N, int64_t units, int epilogue) {
    /* NOTE: the tiles count y in bfloat16 elements (see packed_linear_bf16) */
    if (epilogue == PLAIN_F32) amx_rows(x, ldx, M, tail, w, K, NULL, y, 2 * ldy, N, 0, units, PLAIN_F32, 1);
    else if (epilogue == SILU_MUL) amx_rows(x, ldx, M, tail, w, K, NULL, y, ldy, N, 0, units, SILU_MUL, 1);
    else amx_rows(x, ldx, M, tail, w, K, NULL, y, ldy, N, 0, units, PLAIN, 1);
}

uint16_t *amx_padded_tail(const uint16_t *x, int64_t M, int64_t ldx, int64_t K) { return padded_tail(x, M, ldx, K); }
#else
int amx_probe(void) { return 0; }
#endif

/* Every row of x against the half-groups [first, end) of w (packed for w_k input features, of
 * which the first K are used), on the vector units (y's rows ldy bfloat16 elements apart,
 * out_f32 as for packed_linear_bf16). */
static void vector_halves(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                          int64_t w_k, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t first, int64_t end,
                          int64_t out_f32) {
    const int64_t group_stride = (w_k + 1) / 2 * 2 * GROUP;
    for (int64_t h = first; h < end;) {
        const int64_t g = h / 2;
        const uint16_t *group = w + g * group_stride;
        const int whole = h % 2 == 0 && h + 1 < end;
        const int64_t half = whole ? 0 : h % 2;
        const uint16_t *part = group + half * GROUP;
        const int64_t n0 = g * GROUP + half * GROUP / 2;
        if (out_f32 == 1) {
            if (whole) all_rows_group_f32(x, ldx, M, part, K, bias, y, ldy, n0, N);
            else all_rows_half_f32(x, ldx, M, part, K, bias, y, ldy, n0, N);
        } else if (out_f32 == 2) {
            if (whole) all_rows_group_add(x, ldx, M, part, K, bias, y, ldy, n0, N);
            else all_rows_half_add(x, ldx, M, part, K, bias, y, ldy, n0, N);
        } else if (whole) all_rows_group(x, ldx, M, part, K, bias, y, ldy, n0, N);
        else all_rows_half(x, ldx, M, part, K, bias, y, ldy, n0, N);
        h += whole ? 2 : 1;
    }
}

void packed_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                        const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t amx_min_rows, int64_t out_f32) {
    /* NOTE: with out_f32 1, y holds float32 rows ldy floats apart; the tiles below count in
     * bfloat16 elements, so its pointers advance by twice as many. With out_f32 2 (ADD_BF16), the
     * sums are added to y's bfloat16 values, rounded once. */
    const enum epilogue plain = out_f32 == 1 ? PLAIN_F32 : out_f32 == 2 ? ADD_BF16 : PLAIN;
    (void)plain;
    if (out_f32 == 1) ldy *= 2;
    const int64_t halves = (N + GROUP / 2 - 1) / (GROUP / 2);
    int amx = 0;
    uint16_t *tail = NULL;
#ifdef HAVE_AMX
    amx = use_amx(x, M, ldx, K, amx_min_rows, &tail);
#endif
    (void)amx_min_rows, (void)amx;
    /* NOTE: below about 64k multiply-adds the threads' start-up costs more than they save. */
    #pragma omp parallel if (M * N * K >= 65536)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t first = halves * t / threads, end = halves * (t + 1) / threads;
#ifdef HAVE_AMX
        if (amx) {
            configure_tiles();
            amx_rows(x, ldx, M, tail, w, K, bias, y, ldy, N, first, end, plain, 0);
            _tile_release();
        }
        else
#endif
        vector_halves(x, M, ldx, w, N, K, K, bias, y, ldy, first, end, out_f32);
    }
    free(tail);
}

/* packed_linear_bf16's vector path for the output half-groups [first, end) only (32 features
 * each), on the calling thread: for callers that spread many small products over their own
 * threads (the one-call forward's LoRA deltas). w was packed for w_k >= K input features, of
 * which the first K are multiplied (the others zero: the same sums). out_f32 and ldy as for
 * packed_linear_bf16. */
void packed_linear_halves(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                          int64_t w_k, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t first, int64_t end,
                          int64_t out_f32) {
    vector_halves(x, M, ldx, w, N, K, w_k, bias, y, out_f32 == 1 ? 2 * ldy : ldy, first, end, out_f32);
}

void packed_silu_mul_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
                                 uint16_t *y, int64_t ldy, int64_t amx_min_rows) {
    const int64_t groups = (I + GROUP / 2 - 1) / (GROUP / 2);
    int amx = 0;
    uint16_t *tail = NULL;
#ifdef HAVE_AMX
    amx = use_amx(x, M, ldx, K, amx_min_rows, &tail);
#endif
    (void)amx_min_rows, (void)amx;
    #pragma omp parallel if (M * I * K >= 32768)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t first = groups * t / threads, end = groups * (t + 1) / threads;
#ifdef HAVE_AMX
        if (amx) {
            configure_tiles();
            amx_rows(x, ldx, M, tail, w, K, NULL, y, ldy, I, first, end, SILU_MUL, 0);
            _tile_release();
        }
        else
#endif
        packed_silu_mul_groups(x, M, ldx, w, I, K, y, ldy, first, end);
    }
    free(tail);
}

/* packed_silu_mul_linear_bf16's vector path for the activation groups [first, end) only (32
 * activations each), on the calling thread (for callers that spread many small products over
 * their own threads: a mixture of experts' experts). */
void packed_silu_mul_groups(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
                            uint16_t *y, int64_t ldy, int64_t first, int64_t end) {
    const int64_t group_stride = (K + 1) / 2 * 2 * GROUP;
    for (int64_t g = first; g < end; g++)
        all_rows_silu_mul(x, ldx, M, w + g * group_stride, K, NULL, y, ldy, g * GROUP / 2, I);
}
#else
int packed_linear_available(void) { return 0; }
int amx_probe(void) { return 0; }

void packed_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                        const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t amx_min_rows, int64_t out_f32) {
    (void)x, (void)M, (void)ldx, (void)w, (void)N, (void)K, (void)bias, (void)y, (void)ldy, (void)amx_min_rows;
    (void)out_f32;
}

void packed_silu_mul_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
                                 uint16_t *y, int64_t ldy, int64_t amx_min_rows) {
    (void)x, (void)M, (void)ldx, (void)w, (void)I, (void)K, (void)y, (void)ldy, (void)amx_min_rows;
}

void packed_linear_halves(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
                          int64_t w_k, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t first, int64_t end,
                          int64_t out_f32) {
    (void)x, (void)M, (void)ldx, (void)w, (void)N, (void)K, (void)w_k, (void)bias, (void)y, (void)ldy, (void)first;
    (void)end, (void)out_f32;
}

void packed_silu_mul_groups(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
                            uint16_t *y, int64_t ldy, int64_t first, int64_t end) {
    (void)x, (void)M, (void)ldx, (void)w, (void)I, (void)K, (void)y, (void)ldy, (void)first, (void)end;
}
#endif
