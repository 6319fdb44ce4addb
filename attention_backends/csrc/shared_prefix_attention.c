/*
 * Cascade attention's shared part on AMX tiles: every query row of a step against the keys
 * that every request of the step starts with (a prefix the prefix cache shares), merged with
 * each row's attention over its own keys.
 *
 * The paged kernel (paged_attention.c) reads a request's keys once per request, so 64
 * requests over one 512-token prefix read it 64 times with a few query rows each. Here the
 * rows of every request that belong to one KV head form one matrix (tokens x the query heads
 * of the group), and the prefix is one matrix of keys: the scores and the weighted values
 * are tile products (TDPBF16PS) of 16 rows against 64 keys at a time, with an online softmax
 * in float32 between them.
 *
 * Layout (the cpu_paged backend's cache):
 *   query, own_out, out:  [num_tokens, num_heads, head_dim] bfloat16
 *   own_lse:              [num_tokens, num_heads] float32, the log-sum-exp of each row's scaled
 *                         scores over its own keys (paged_attention's, from the keys after
 *                         the prefix)
 *   key cache:            [num_blocks, num_kv_heads, head_dim, block_size] (keys transposed)
 *   value cache:          [num_blocks, num_kv_heads, block_size, head_dim]
 *   blocks:               the prefix's block ids, in order (every query row comes after them)
 *
 * First the operands are repacked into tile layouts (per call, in parallel): the keys as
 * (dimension pair, key) pairs, the values as (key pair, dimension) pairs, the queries of a KV
 * head as one row-major matrix, padded to whole tiles (the padding keys masked, the padding
 * rows never stored). Then each task, a KV head and 16 query rows, walks the keys 64 at a
 * time: 4 score tiles; the scores scaled, masked and taken into the rows' running maximum and
 * sum in float32 (vectors), the probabilities rounded to bfloat16 (as the paged kernel and
 * torch's flash attention round them) into 2 tiles of 16 rows x 32 keys; the float32 output
 * accumulators (kept in memory, rescaled there when the maximum grows) loaded into tiles,
 * added to, stored. At the end each row is merged with its own part by the log-sum-exp rule.
 *
 * Returns 0, or 1 where it does not run (no AMX in this build or process, head_dim not 64 or
 * 128, no memory): the caller then computes the shared part otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "avx512_exp.h"

int pagoda_amx_permitted(void); /* packed_linear.c: Linux lets this process use the tiles */

#define KEYS 64           /* keys per step of a task */
#define MIN_SCORE (-1e30f)

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void configure_tiles(void) {
    struct tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* One task: 16 rows (of a KV head's padded row matrix qp, D wide) against all keys, in
 * partitions of up to PART keys: the partition's scores first (tile products, 64 keys at a
 * time), then each row's maximum and probabilities over the whole partition (one rescale of
 * the accumulators and one horizontal reduction a partition, not every 64 keys), then the
 * weighted values with the accumulators held in tiles across the partition. */
#define PART 256
static inline __attribute__((always_inline)) void attend_rows(
        const uint16_t *qp, const uint16_t *kb, const uint16_t *vb, int64_t keys, int64_t padded_keys,
        const int64_t D, float scale, float (*acc)[128], float *m, float *l) {
    float scores[16][PART] __attribute__((aligned(64)));
    uint16_t probs[16][PART] __attribute__((aligned(64)));
    for (int r = 0; r < 16; r++) {
        m[r] = MIN_SCORE;
        l[r] = 0;
        for (int64_t d = 0; d < D; d++) acc[r][d] = 0;
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    const int64_t vstride = D * 2 * 2;
    for (int64_t p0 = 0; p0 < padded_keys; p0 += PART) {
        const int64_t width = padded_keys - p0 < PART ? padded_keys - p0 : PART; /* a multiple of KEYS */
        /* scores: 16 rows x 64 keys at a time, over D in steps of 32 dimensions */
        for (int64_t n = 0; n < width; n += KEYS) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t d = 0; d < D; d += 32) {
                const uint16_t *k = kb + ((p0 + n) / 16 * (D / 2) + d / 2) * 32; /* keys n..n+15 */
                const int64_t group = D / 2 * 32;                                  /* to the next 16 keys */
                _tile_loadd(4, qp + d, D * 2);
                _tile_loadd(5, k, 64);
                _tile_loadd(6, k + group, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, k + 2 * group, 64);
                _tile_loadd(6, k + 3 * group, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, &scores[0][n], sizeof(scores[0]));
            _tile_stored(1, &scores[0][n + 16], sizeof(scores[0]));
            _tile_stored(2, &scores[0][n + 32], sizeof(scores[0]));
            _tile_stored(3, &scores[0][n + 48], sizeof(scores[0]));
        }
        /* the softmax over the partition, row by row */
        const int64_t valid = keys - p0; /* keys of the partition that exist (the rest are padding) */
        for (int r = 0; r < 16; r++) {
            __m512 vmax = _mm512_set1_ps(MIN_SCORE);
            for (int64_t j = 0; j < width; j += 16) {
                const int64_t seen = valid - j;
                const __mmask16 mask = seen >= 16 ? (__mmask16)0xffff : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1u);
                const __m512 s = _mm512_mask_blend_ps(mask, _mm512_set1_ps(MIN_SCORE),
                                                      _mm512_mul_ps(_mm512_load_ps(&scores[r][j]), scale16));
                _mm512_store_ps(&scores[r][j], s);
                vmax = _mm512_max_ps(vmax, s);
            }
            const float new_max = fmaxf(m[r], _mm512_reduce_max_ps(vmax));
            const __m512 mrow = _mm512_set1_ps(new_max);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < width; j += 16) {
                const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(&scores[r][j]), mrow));
                sum = _mm512_add_ps(sum, e);
                _mm256_store_si256((__m256i *)&probs[r][j], (__m256i)_mm512_cvtneps_pbh(e));
            }
            if (new_max > m[r] && l[r] > 0) {
                const float correction = expf(m[r] - new_max);
                l[r] *= correction;
                const __m512 c16 = _mm512_set1_ps(correction);
                for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(&acc[r][d], _mm512_mul_ps(_mm512_load_ps(&acc[r][d]), c16));
            }
            m[r] = new_max;
            l[r] += _mm512_reduce_add_ps(sum);
        }
        /* acc += probabilities x values: 64 dimensions (4 tiles) at a time, held over the partition */
        for (int64_t c = 0; c < D; c += 64) {
            _tile_loadd(0, &acc[0][c], sizeof(acc[0]));
            _tile_loadd(1, &acc[0][c + 16], sizeof(acc[0]));
            _tile_loadd(2, &acc[0][c + 32], sizeof(acc[0]));
            _tile_loadd(3, &acc[0][c + 48], sizeof(acc[0]));
            for (int64_t t = 0; t < width; t += 32) {
                const uint16_t *v = vb + ((p0 + t) / 2 * D + c) * 2;
                _tile_loadd(4, &probs[0][t], sizeof(probs[0]));
                _tile_loadd(5, v, vstride);
                _tile_loadd(6, v + 32, vstride);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, v + 64, vstride);
                _tile_loadd(6, v + 96, vstride);
                _tile_dpbf16ps(2, 4, 5);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, &acc[0][c], sizeof(acc[0]));
            _tile_stored(1, &acc[0][c + 16], sizeof(acc[0]));
            _tile_stored(2, &acc[0][c + 32], sizeof(acc[0]));
            _tile_stored(3, &acc[0][c + 48], sizeof(acc[0]));
        }
    }
}

int shared_prefix_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                                 const int32_t *blocks, int64_t num_blocks, int64_t block_size, int64_t num_tokens,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                 const uint16_t *own_out, const float *own_lse, uint16_t *out) {
    const int64_t D = head_dim, G = num_heads / num_kv_heads, KV = num_kv_heads;
    if ((D != 64 && D != 128) || !pagoda_amx_permitted()) return 1;
    const int64_t keys = num_blocks * block_size, padded_keys = (keys + KEYS - 1) / KEYS * KEYS;
    const int64_t rows = num_tokens * G, padded_rows = (rows + 15) / 16 * 16;
    const int64_t block_stride = KV * D * block_size;
    uint16_t *kb = aligned_alloc(64, (size_t)(KV * D * padded_keys * 2 + KV * padded_keys * D * 2 + KV * padded_rows * D * 2));
    if (!kb) return 1;
    uint16_t *vb = kb + KV * D * padded_keys, *qp = vb + KV * padded_keys * D;
    /* keys as [kv][padded_keys/16][D/2][16][2] (a score tile's 16 keys x 32 dimensions are 1 KB
     * in one piece: with the keys' pairs a whole row apart, a tile's rows were 4 KB multiples
     * apart and fell into one L1 set), values as [kv][padded_keys/2][D][2], queries as
     * [kv][padded_rows][D] with row t * G + g = query token t, head kv * G + g; zero padding.
     * Pairs are interleaved 16 at a time (one permute of two 16-wide rows). */
    uint16_t pattern[32];
    for (int i = 0; i < 16; i++) pattern[2 * i] = (uint16_t)i, pattern[2 * i + 1] = (uint16_t)(32 + i);
    const __m512i interleave = _mm512_loadu_si512(pattern);
    for (int64_t h = 0; h < KV; h++) /* the keys' padding (groups of 16 from the last real one) */
        memset(kb + (h * padded_keys / 16 + keys / 16) * (D / 2) * 32, 0, (padded_keys / 16 - keys / 16) * D * 32);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < KV; h++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint16_t *k = key_cache + (int64_t)blocks[b] * block_stride + h * D * block_size;
            uint16_t *head = kb + h * padded_keys / 16 * (D / 2) * 32;
            for (int64_t dp = 0; dp < D / 2; dp++) {
                const uint16_t *even = k + 2 * dp * block_size, *odd = even + block_size;
                int64_t t = 0;
                if (block_size % 16 == 0)
                    for (; t < block_size; t += 16)
                        _mm512_storeu_si512(head + ((b * block_size + t) / 16 * (D / 2) + dp) * 32,
                                            _mm512_permutex2var_epi16(
                            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(even + t))), interleave,
                            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(odd + t)))));
                for (; t < block_size; t++) {
                    const int64_t key = b * block_size + t;
                    uint16_t *dst = head + (key / 16 * (D / 2) + dp) * 32 + key % 16 * 2;
                    dst[0] = even[t], dst[1] = odd[t];
                }
            }
        }
    }
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < KV; h++) {
        for (int64_t kp = 0; kp < padded_keys / 2; kp++) {
            uint16_t *dst = vb + (h * padded_keys / 2 + kp) * D * 2;
            const int64_t first = 2 * kp, second = first + 1;
            if (second >= keys) { /* padding (and an odd last key beside a zero) */
                memset(dst, 0, D * 4);
                if (first < keys)
                    for (int64_t d = 0; d < D; d++)
                        dst[2 * d] = value_cache[(int64_t)blocks[first / block_size] * block_stride
                                                 + (h * block_size + first % block_size) * D + d];
                continue;
            }
            const uint16_t *v0 = value_cache + (int64_t)blocks[first / block_size] * block_stride
                                 + (h * block_size + first % block_size) * D;
            const uint16_t *v1 = value_cache + (int64_t)blocks[second / block_size] * block_stride
                                 + (h * block_size + second % block_size) * D;
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + d))), interleave,
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v1 + d)))));
        }
    }
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < KV; h++)
        for (int64_t r = 0; r < padded_rows; r++) {
            uint16_t *dst = qp + (h * padded_rows + r) * D;
            if (r < rows) memcpy(dst, query + ((r / G) * num_heads + h * G + r % G) * D, D * 2);
            else memset(dst, 0, D * 2);
        }
    const int64_t tasks_per_head = padded_rows / 16;
    #pragma omp parallel
    {
        configure_tiles();
        float acc[16][128] __attribute__((aligned(64)));
        float m[16], l[16];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * tasks_per_head; task++) {
            const int64_t h = task / tasks_per_head, r0 = task % tasks_per_head * 16;
            if (D == 64)
                attend_rows(qp + (h * padded_rows + r0) * D, kb + h * D * padded_keys, vb + h * padded_keys * D, keys,
                            padded_keys, 64, scale, acc, m, l);
            else
                attend_rows(qp + (h * padded_rows + r0) * D, kb + h * D * padded_keys, vb + h * padded_keys * D, keys,
                            padded_keys, 128, scale, acc, m, l);
            /* merge with the row's own keys: weights by each part's share of the softmax's sum */
            for (int64_t i = 0; i < 16 && r0 + i < rows; i++) {
                const int64_t r = r0 + i, at = (r / G) * num_heads + h * G + r % G;
                const float shared_lse = m[i] + logf(l[i]), own = own_lse[at];
                const float top = fmaxf(shared_lse, own);
                const float ws = expf(shared_lse - top), wo = expf(own - top), total = ws + wo;
                const __m512 a = _mm512_set1_ps(ws / total / l[i]), b = _mm512_set1_ps(wo / total);
                for (int64_t d = 0; d < D; d += 16) {
                    const __m512 own_part = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(own_out + at * D + d))), 16));
                    const __m512 merged = _mm512_fmadd_ps(_mm512_load_ps(&acc[i][d]), a, _mm512_mul_ps(own_part, b));
                    _mm256_storeu_si256((__m256i *)(out + at * D + d), (__m256i)_mm512_cvtneps_pbh(merged));
                }
            }
        }
        _tile_release();
    }
    free(kb);
    return 0;
}
#else
int shared_prefix_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                                 const int32_t *blocks, int64_t num_blocks, int64_t block_size, int64_t num_tokens,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                 const uint16_t *own_out, const float *own_lse, uint16_t *out) {
    (void)query, (void)key_cache, (void)value_cache, (void)blocks, (void)num_blocks, (void)block_size;
    (void)num_tokens, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)scale, (void)own_out;
    (void)own_lse, (void)out;
    return 1;
}
#endif
