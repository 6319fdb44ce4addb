/*
 * Attention on AMX tiles for query rows that come many to a set of keys: prefill chunks (a
 * request's rows against its own context, causal) and cascade attention's shared part (the
 * query rows of a step's requests, or of the listed `members` among them, against a prefix
 * they all share, merged with each row's attention over its own keys).
 *
 * The paged kernel (paged_attention.c) works with vectors, a few query rows at a time: a
 * 256-token prefill chunk reads its context once per tile of 2 tokens, and 64 requests over
 * one 512-token prefix read it 64 times. Here the rows that belong to one KV head form one
 * matrix (tokens x the query heads of the group), its keys another, and the scores and the
 * weighted values are tile products (TDPBF16PS) of 16 rows against 64 keys at a time, with a
 * float32 softmax between them.
 *
 * Layout (the cpu_paged backend's cache):
 *   query, out, own_out:  [num_tokens, num_heads, head_dim] bfloat16 (float32 in the _f32 entry
 *                         points: the float32 tiles only)
 *   own_lse:              [num_tokens, num_heads] float32, the log-sum-exp of each row's scaled
 *                         scores over its own keys (paged_attention's)
 *   key cache:            [num_blocks, num_kv_heads, head_dim, block_size] (keys transposed)
 *   value cache:          [num_blocks, num_kv_heads, block_size, head_dim]
 *
 * First the operands are repacked into tile layouts (in parallel): the keys as (dimension
 * pair, key) pairs, 16 keys x 32 dimensions to a kilobyte in one piece (with a whole row of
 * keys between pairs, a tile's rows were 4 KB multiples apart and fell into one L1 set); the
 * values as (key pair, dimension) pairs; the queries of a KV head as one row-major matrix with
 * row t * G + g = token t, head kv * G + g; all padded to whole tiles (padding keys masked,
 * padding rows never stored). Then each task, a KV head and 16 query rows, walks the keys in
 * partitions of 256: the partition's scores (4 tiles per 64 keys); each row's maximum over the
 * partition, masked past the last key the row sees; probabilities rounded to bfloat16 (as the
 * paged kernel and torch's flash attention round them); the weighted values with the float32
 * accumulators held in tiles across the partition. Rescaling and horizontal reductions happen
 * once a partition, as in the paged kernel.
 *
 * Three kinds of tiles (`kind`). Two on the same packed operands and the same softmax: AMX
 * tile products (AMX_TILES), and on CPUs without AMX, AVX512-BF16 dot products (VECTOR_TILES):
 * 16 rows held in 16 vector registers against 16 keys (scores) or 16 dimensions (values) at a
 * time, each packed pair of keys or values loaded once for the 16 rows, each row's pair
 * broadcast from memory (vdpbf16ps: two bfloat16 products into every float32 lane). The paged
 * kernel's decode tile has 3 rows for a group of 3 and repacks its pairs for them; here a pair
 * serves 16. The third, on CPUs with AVX2 and FMA (FLOAT_TILES; in every build for them,
 * AVX-512 ones too), packs the operands in float32 instead and multiplies with FMAs (see
 * "float32 tiles" below).
 *
 * Each entry point returns 0, or 1 where it does not run (that kind not in this build or
 * process, head_dim not 64 or 128, no memory): the caller then takes another path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagoda_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_FLOAT_TILES 1
#include <immintrin.h>

#include "vector_exp.h"
#include "vector_lanes.h"
#else
#define HAVE_FLOAT_TILES 0
#endif

#if HAVE_FLOAT_TILES && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_VECTOR_TILES 1
#else
#define HAVE_VECTOR_TILES 0
#endif

#if HAVE_VECTOR_TILES && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_TILES 1
#include "amx_tiles.h"
#else
#define HAVE_AMX_TILES 0
#endif

/* The kinds of tiles: the entry points' `kind` (cpu_kernels.TILE_KINDS) */
enum { VECTOR_TILES = 0, AMX_TILES = 1, FLOAT_TILES = 2 };

int tile_attention_vector_available(void) { return HAVE_VECTOR_TILES; }
int tile_attention_float_available(void) { return HAVE_FLOAT_TILES; }

#if HAVE_FLOAT_TILES
#define KEYS 64           /* keys per step of a task (AMX), and the padding of every kind's keys */
#define MIN_SCORE (-1e30f)

/* One task: 16 rows (of a KV head's padded row matrix qp, D wide) against the keys of kb and
 * vb (padded_keys of them), row r seeing keys 0..last[r], in partitions of up to PART keys. */
#define PART 256

/* Keys any of a task's `rows` rows sees, rounded up to whole steps of `step` keys. */
static inline int64_t keys_seen(const int64_t *last, int rows, int64_t padded_keys, int64_t step) {
    int64_t seen = 0;
    for (int r = 0; r < rows; r++) seen = last[r] + 1 > seen ? last[r] + 1 : seen;
    seen = (seen + step - 1) / step * step;
    return seen > padded_keys ? padded_keys : seen;
}

static inline void start_rows(float (*acc)[128], float *m, float *l, int64_t D) {
    for (int r = 0; r < 16; r++) {
        m[r] = MIN_SCORE;
        l[r] = 0;
        for (int64_t d = 0; d < D; d++) acc[r][d] = 0;
    }
}

#if HAVE_VECTOR_TILES
/* The softmax over a partition's raw scores (keys p0..p0+width-1), row by row, in base 2 (the
 * scale times log2(e) folded into one FMA with the maximum's subtraction; scale > 0, so the
 * raw maximum scaled is the scaled maximum): masked past the last key each row sees,
 * probabilities rounded to bfloat16 into probs; each row's maximum m (base 2) and sum l take
 * the partition in, its accumulators rescaled to the new maximum. */
static inline __attribute__((always_inline)) void partition_softmax(
        const float (*scores)[PART], uint16_t (*probs)[PART], const int64_t *last, int64_t p0, int64_t width,
        const int64_t D, float scale, float (*acc)[128], float *m, float *l) {
    const float scale2 = scale * EXP_LOG2E;
    const __m512 scale16 = _mm512_set1_ps(scale2);
    for (int r = 0; r < 16; r++) {
        const int64_t valid = last[r] + 1 - p0; /* keys of the partition the row sees */
        __m512 vmax = _mm512_set1_ps(MIN_SCORE);
        for (int64_t j = 0; j < width; j += 16)
            vmax = _mm512_mask_max_ps(vmax, first_lanes16(valid - j), vmax, _mm512_load_ps(&scores[r][j]));
        /* NOTE: not fmaxf: gcc calls it through the PLT, spilling the 16 rows' registers */
        const float part_max = valid > 0 ? _mm512_reduce_max_ps(vmax) * scale2 : MIN_SCORE;
        const float new_max = part_max > m[r] ? part_max : m[r];
        const __m512 mrow = _mm512_set1_ps(new_max);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; j += 16) {
            const __m512 e = exp2_softmax16(_mm512_fmsub_ps(_mm512_load_ps(&scores[r][j]), scale16, mrow),
                                            first_lanes16(valid - j));
            sum = _mm512_add_ps(sum, e);
            _mm256_store_si256((__m256i *)&probs[r][j], (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (new_max > m[r] && l[r] > 0) {
            const float correction = exp2f(m[r] - new_max);
            l[r] *= correction;
            const __m512 c16 = _mm512_set1_ps(correction);
            for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(&acc[r][d], _mm512_mul_ps(_mm512_load_ps(&acc[r][d]), c16));
        }
        m[r] = new_max;
        l[r] += _mm512_reduce_add_ps(sum);
    }
}

#if HAVE_AMX_TILES
/* Tiles 0-3 += the products of tiles 4, 5 (loaded from a0, a1, as bytes a row) and 6, 7 (b0,
 * b1, bs): 0 = a0 b0, 1 = a0 b1, 2 = a1 b0, 3 = a1 b1. */
static inline __attribute__((always_inline)) void tile_products_2x2(const void *a0, const void *a1, int64_t as,
                                                                    const void *b0, const void *b1, int64_t bs) {
    _tile_loadd(4, a0, as);
    _tile_loadd(5, a1, as);
    _tile_loadd(6, b0, bs);
    _tile_loadd(7, b1, bs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

static inline __attribute__((always_inline)) void zero_tiles_0_3(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Tiles 0-3 stored to (or loaded from) p0..p3, stride bytes a row. */
static inline __attribute__((always_inline)) void store_tiles_0_3(float *p0, float *p1, float *p2, float *p3,
                                                                  int64_t stride) {
    _tile_stored(0, p0, stride);
    _tile_stored(1, p1, stride);
    _tile_stored(2, p2, stride);
    _tile_stored(3, p3, stride);
}

static inline __attribute__((always_inline)) void load_tiles_0_3(const float *p0, const float *p1, const float *p2,
                                                                 const float *p3, int64_t stride) {
    _tile_loadd(0, p0, stride);
    _tile_loadd(1, p1, stride);
    _tile_loadd(2, p2, stride);
    _tile_loadd(3, p3, stride);
}

static inline __attribute__((always_inline)) void attend_rows_amx(
        const uint16_t *qp, const uint16_t *kb, const uint16_t *vb, const int64_t *last, int64_t padded_keys,
        const int64_t D, float scale, float (*acc)[128], float *m, float *l) {
    float scores[16][PART] __attribute__((aligned(64)));
    uint16_t probs[16][PART] __attribute__((aligned(64)));
    start_rows(acc, m, l, D);
    const int64_t vstride = D * 2 * 2, seen = keys_seen(last, 16, padded_keys, KEYS);
    for (int64_t p0 = 0; p0 < seen; p0 += PART) {
        const int64_t width = seen - p0 < PART ? seen - p0 : PART; /* a multiple of KEYS */
        /* scores: 16 rows x 64 keys at a time, over D in steps of 32 dimensions */
        for (int64_t n = 0; n < width; n += KEYS) {
            zero_tiles_0_3();
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
            store_tiles_0_3(&scores[0][n], &scores[0][n + 16], &scores[0][n + 32], &scores[0][n + 48],
                            sizeof(scores[0]));
        }
        partition_softmax(scores, probs, last, p0, width, D, scale, acc, m, l);
        /* acc += probabilities x values: 64 dimensions (4 tiles) at a time, held over the partition */
        for (int64_t c = 0; c < D; c += 64) {
            load_tiles_0_3(&acc[0][c], &acc[0][c + 16], &acc[0][c + 32], &acc[0][c + 48], sizeof(acc[0]));
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
            store_tiles_0_3(&acc[0][c], &acc[0][c + 16], &acc[0][c + 32], &acc[0][c + 48], sizeof(acc[0]));
        }
    }
}

/* The same for 32 rows at head_dim 64 (two row tiles, qp's rows 0-15 and 16-31), each tile of
 * keys and of values loaded once for both: the scores 32 rows x 32 keys at a time (4
 * accumulators), the weighted values 32 rows x 32 dimensions (4 accumulators held over the
 * partition, twice). With 16 rows a task loaded a kilobyte of keys or values from L2 for every
 * product (512 shared keys: 128 loads against 128 products of 16 cycles); here one load serves
 * two products (a decode step's shared part about 7% faster: docs/attention-backends.md). */
static inline __attribute__((always_inline)) void attend_rows_amx32(
        const uint16_t *qp, const uint16_t *kb, const uint16_t *vb, const int64_t *last, int64_t padded_keys,
        float scale, float (*acc)[128], float *m, float *l) {
    enum { D = 64, VSTRIDE = D * 2 * 2, QSTRIDE = D * 2, SSTRIDE = PART * 4, PSTRIDE = PART * 2, ASTRIDE = 128 * 4 };
    float scores[32][PART] __attribute__((aligned(64)));
    uint16_t probs[32][PART] __attribute__((aligned(64)));
    start_rows(acc, m, l, D);
    start_rows(acc + 16, m + 16, l + 16, D);
    const int64_t seen = keys_seen(last, 32, padded_keys, KEYS);
    for (int64_t p0 = 0; p0 < seen; p0 += PART) {
        const int64_t width = seen - p0 < PART ? seen - p0 : PART; /* a multiple of KEYS */
        /* scores: tiles 0-3 rows 0-15 / 16-31 x keys n..n+15 / n+16..n+31; 4, 5 the rows'
         * queries and 6, 7 the keys, 32 dimensions at a time */
        for (int64_t n = 0; n < width; n += 32) {
            zero_tiles_0_3();
            for (int64_t d = 0; d < D; d += 32) {
                const uint16_t *k = kb + ((p0 + n) / 16 * (D / 2) + d / 2) * 32; /* keys n..n+15 */
                tile_products_2x2(qp + d, qp + 16 * D + d, QSTRIDE, k, k + D / 2 * 32, 64);
            }
            store_tiles_0_3(&scores[0][n], &scores[0][n + 16], &scores[16][n], &scores[16][n + 16], SSTRIDE);
        }
        partition_softmax(scores, probs, last, p0, width, D, scale, acc, m, l);
        partition_softmax(scores + 16, probs + 16, last + 16, p0, width, D, scale, acc + 16, m + 16, l + 16);
        /* acc += probabilities x values, dimensions c..c+31: tiles 0-3 rows 0-15 / 16-31 x
         * dimensions c..c+15 / c+16..c+31; 4, 5 the rows' probabilities, 6, 7 the values */
        for (int64_t c = 0; c < D; c += 32) {
            load_tiles_0_3(&acc[0][c], &acc[0][c + 16], &acc[16][c], &acc[16][c + 16], ASTRIDE);
            for (int64_t t = 0; t < width; t += 32) {
                const uint16_t *v = vb + ((p0 + t) / 2 * D + c) * 2;
                tile_products_2x2(&probs[0][t], &probs[16][t], PSTRIDE, v, v + 32, VSTRIDE);
            }
            store_tiles_0_3(&acc[0][c], &acc[0][c + 16], &acc[16][c], &acc[16][c + 16], ASTRIDE);
        }
    }
}
#endif

/* The same task with AVX512-BF16 dot products: the 16 rows' sums in 16 vector registers, each
 * packed pair of keys (or values) loaded once and multiplied into all 16 against each row's
 * own pair, broadcast from memory. */
static inline __attribute__((always_inline)) void attend_rows_vector(
        const uint16_t *qp, const uint16_t *kb, const uint16_t *vb, const int64_t *last, int64_t padded_keys,
        const int64_t D, float scale, float (*acc)[128], float *m, float *l) {
    float scores[16][PART] __attribute__((aligned(64)));
    uint16_t probs[16][PART] __attribute__((aligned(64)));
    start_rows(acc, m, l, D);
    const int64_t seen = keys_seen(last, 16, padded_keys, 16);
    for (int64_t p0 = 0; p0 < seen; p0 += PART) {
        const int64_t width = seen - p0 < PART ? seen - p0 : PART;
        /* scores: 16 rows x 16 keys at a time; kb holds [keys/16][D/2][16 keys][2] */
        for (int64_t n = 0; n < width; n += 16) {
            const uint16_t *k = kb + (p0 + n) / 16 * (D / 2) * 32;
            __m512 s[16];
            for (int r = 0; r < 16; r++) s[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D / 2; i++) {
                const __m512bh pair = (__m512bh)_mm512_load_si512(k + i * 32);
                for (int r = 0; r < 16; r++) {
                    uint32_t q; /* row r's query pair i */
                    memcpy(&q, qp + r * D + 2 * i, sizeof(q));
                    s[r] = _mm512_dpbf16_ps(s[r], pair, (__m512bh)_mm512_set1_epi32((int)q));
                }
            }
            for (int r = 0; r < 16; r++) _mm512_store_ps(&scores[r][n], s[r]);
        }
        partition_softmax(scores, probs, last, p0, width, D, scale, acc, m, l);
        /* acc += probabilities x values, 16 dimensions at a time; vb holds [keys/2][D][2] */
        for (int64_t c = 0; c < D; c += 16) {
            __m512 a[16];
            for (int r = 0; r < 16; r++) a[r] = _mm512_load_ps(&acc[r][c]);
            for (int64_t t = 0; t < width; t += 2) {
                const __m512bh pair = (__m512bh)_mm512_load_si512(vb + ((p0 + t) / 2 * D + c) * 2);
                for (int r = 0; r < 16; r++) {
                    uint32_t p;
                    memcpy(&p, &probs[r][t], sizeof(p));
                    a[r] = _mm512_dpbf16_ps(a[r], pair, (__m512bh)_mm512_set1_epi32((int)p));
                }
            }
            for (int r = 0; r < 16; r++) _mm512_store_ps(&acc[r][c], a[r]);
        }
    }
}

static __m512i pair_interleave(void) {
    uint16_t pattern[32];
    for (int i = 0; i < 16; i++) pattern[2 * i] = (uint16_t)i, pattern[2 * i + 1] = (uint16_t)(32 + i);
    return _mm512_loadu_si512(pattern);
}

/* The keys of `blocks` (the first `keys` tokens of them) for one KV head in the scores'
 * tile layout: [padded_keys/16][D/2][16][2], zero past `keys`. */
static void pack_keys(uint16_t *dst, const uint16_t *key_cache, const int32_t *blocks, int64_t keys,
                      int64_t padded_keys, int64_t block_size, int64_t block_stride, int64_t h, int64_t D) {
    const __m512i interleave = pair_interleave();
    memset(dst + keys / 16 * (D / 2) * 32, 0, (padded_keys / 16 - keys / 16) * D * 32);
    for (int64_t b = 0; b * block_size < keys; b++) {
        const uint16_t *k = key_cache + (int64_t)blocks[b] * block_stride + h * D * block_size;
        const int64_t n = keys - b * block_size < block_size ? keys - b * block_size : block_size;
        for (int64_t dp = 0; dp < D / 2; dp++) {
            const uint16_t *even = k + 2 * dp * block_size, *odd = even + block_size;
            int64_t t = 0;
            if (block_size % 16 == 0)
                for (; t + 16 <= n; t += 16)
                    _mm512_storeu_si512(dst + ((b * block_size + t) / 16 * (D / 2) + dp) * 32,
                                        _mm512_permutex2var_epi16(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(even + t))), interleave,
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(odd + t)))));
            for (; t < n; t++) {
                const int64_t key = b * block_size + t;
                uint16_t *pair = dst + (key / 16 * (D / 2) + dp) * 32 + key % 16 * 2;
                pair[0] = even[t], pair[1] = odd[t];
            }
        }
    }
}

/* The values of `blocks` (the first `keys` tokens) for one KV head as [padded_keys/2][D][2]. */
static void pack_values(uint16_t *dst, const uint16_t *value_cache, const int32_t *blocks, int64_t keys,
                        int64_t padded_keys, int64_t block_size, int64_t block_stride, int64_t h, int64_t D) {
    const __m512i interleave = pair_interleave();
    for (int64_t kp = 0; kp < padded_keys / 2; kp++) {
        uint16_t *pair = dst + kp * D * 2;
        const int64_t first = 2 * kp, second = first + 1;
        if (second >= keys) { /* padding (and an odd last key beside a zero) */
            memset(pair, 0, D * 4);
            if (first < keys)
                for (int64_t d = 0; d < D; d++)
                    pair[2 * d] = value_cache[(int64_t)blocks[first / block_size] * block_stride
                                              + (h * block_size + first % block_size) * D + d];
            continue;
        }
        const uint16_t *v0 = value_cache + (int64_t)blocks[first / block_size] * block_stride
                             + (h * block_size + first % block_size) * D;
        const uint16_t *v1 = value_cache + (int64_t)blocks[second / block_size] * block_stride
                             + (h * block_size + second % block_size) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_si512(pair + 2 * d, _mm512_permutex2var_epi16(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + d))), interleave,
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v1 + d)))));
    }
}

/* Query rows t * G + g (tokens first..first+tokens-1, or with `tok` tokens tok[0..tokens-1]) of
 * KV head h as [padded_rows][D], zero padded. */
static void pack_queries(uint16_t *dst, const uint16_t *query, const int32_t *tok, int64_t first, int64_t tokens,
                         int64_t padded_rows, int64_t num_heads, int64_t G, int64_t h, int64_t D) {
    /* a token's G rows lie side by side in the query: G x D elements copied in 32s (D is 64 or
     * 128), inline (a memcpy call a row was 2% of a prefill step) */
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *src = query + ((tok ? tok[t] : first + t) * num_heads + h * G) * D;
        for (int64_t e = 0; e < G * D; e += 32)
            _mm512_storeu_si512(dst + t * G * D + e, _mm512_loadu_si512(src + e));
    }
    memset(dst + tokens * G * D, 0, (padded_rows - tokens * G) * D * 2);
}

/* A row's result into out (bfloat16): acc / l, or with own_out/own_lse, merged with the row's
 * attention over its own keys by each part's share of the softmax's sum (m in base 2, as
 * partition_softmax keeps it; own_lse natural). */
static inline void store_row(uint16_t *out, const float *acc, float m, float l, const uint16_t *own_out,
                             const float *own_lse, int64_t D) {
    __m512 a = _mm512_set1_ps(1.0f / l), b = _mm512_setzero_ps();
    if (own_out) {
        const float shared_lse = m * (float)M_LN2 + logf(l), own = *own_lse, top = fmaxf(shared_lse, own);
        const float ws = expf(shared_lse - top), wo = expf(own - top), total = ws + wo;
        a = _mm512_set1_ps(ws / total / l);
        b = _mm512_set1_ps(wo / total);
    }
    for (int64_t d = 0; d < D; d += 16) {
        __m512 merged = _mm512_mul_ps(_mm512_load_ps(acc + d), a);
        if (own_out)
            merged = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(own_out + d))), 16)), b, merged);
        _mm256_storeu_si256((__m256i *)(out + d), (__m256i)_mm512_cvtneps_pbh(merged));
    }
}

#endif /* HAVE_VECTOR_TILES */

/* -- float32 tiles (AVX2 with FMA) -------------------------------------------------------------
 * The operands packed to float32 once (bfloat16 widened by a shift), so the products are FMAs
 * with nothing to convert in the loops: keys as [padded_keys/16][D][16] (16 keys a dimension),
 * values as [padded_keys][D], queries as [padded_rows][D] (scaled as packed). A task's 16 rows
 * go through the products a few at a time against 16 or 8 keys (scores) or 16 dimensions
 * (values), each row's query or probability broadcast from memory. Probabilities stay float32.
 *
 * A prefill row's result is bit for bit the paged kernel's AVX2 one (csrc/paged_attention.c,
 * its tiles for prefill chunks; block sizes that are multiples of 16): the same operations in
 * the same order on each lane, so a token's attention does not depend on which of the two took
 * its chunk (one chunk on the tiles, the same tokens' tail after a prefix-cache hit on the
 * kernel, as a repeated prompt has it): the query scaled before the products, each score as
 * the kernel's 2 partial sums over the dimensions (paged_partials), the softmax's sum in
 * two 8-lane halves of 16 keys, the rescaling by exp8, the values added key by key. */

/* Two loaded vectors kept in registers: gcc otherwise folds their loads into every FMA that uses
 * them (4 rows: 8 loads besides the 4 broadcasts per 8 FMAs, as many as the FMAs' cycles). */
#define IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))

/* The partial sums per score of the paged kernel's tiles: 2 for every group and head size (the
 * FAST_TASK there sums even and odd dimensions apart whatever its rows, for batch invariance). */
static inline int paged_partials(int64_t G, int64_t D) {
    (void)G;
    (void)D;
    return 2;
}

static inline __m256 widen8(const uint16_t *p) { /* 8 bfloat16 -> float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 float32 rounded to bfloat16 (to nearest even; a NaN stays NaN) into p. */
static inline void narrow8(uint16_t *p, __m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                             _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    /* [r0..r3 r0..r3 | r4..r7 r4..r7] as 16-bit, then the two low quarters together */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline float reduce_max8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4e));
    return _mm256_cvtss_f32(_mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xb1)));
}

static inline float reduce_add8(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4e));
    return _mm256_cvtss_f32(_mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xb1)));
}

/* partition_softmax on 8 lanes over scores already scaled, the probabilities written over them;
 * the sum in two halves of each 16 keys, as the paged kernel's. */
static inline __attribute__((always_inline)) void partition_softmax_float(
        float (*scores)[PART], const int64_t *last, int64_t p0, int64_t width, const int64_t D,
        float (*acc)[128], float *m, float *l) {
    const __m256 floor8 = _mm256_set1_ps(MIN_SCORE);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < 16; r++) {
        const int64_t valid = last[r] + 1 - p0; /* keys of the partition the row sees */
        __m256 vmax = floor8;
        for (int64_t j = 0; j < width; j += 8) {
            const int64_t visible = valid - j < 0 ? 0 : valid - j > 8 ? 8 : valid - j;
            const __m256 shown = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)visible), lane));
            const __m256 s = _mm256_blendv_ps(floor8, _mm256_loadu_ps(&scores[r][j]), shown);
            _mm256_storeu_ps(&scores[r][j], s);
            vmax = _mm256_max_ps(vmax, s);
        }
        const float part_max = reduce_max8(vmax), new_max = part_max > m[r] ? part_max : m[r];
        const __m256 mrow = _mm256_set1_ps(new_max);
        __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < width; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[r][j]), mrow));
            sum[j / 8 % 2] = _mm256_add_ps(sum[j / 8 % 2], e);
            _mm256_storeu_ps(&scores[r][j], e);
        }
        if (new_max > m[r] && l[r] > 0) {
            const float correction = _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[r] - new_max)));
            l[r] *= correction;
            const __m256 c8 = _mm256_set1_ps(correction);
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(&acc[r][d], _mm256_mul_ps(_mm256_loadu_ps(&acc[r][d]), c8));
        }
        m[r] = new_max;
        l[r] += reduce_add8(_mm256_add_ps(sum[0], sum[1]));
    }
}

/* Scores of R rows (q, D apart) against 8 V keys (k: the first 8 V lanes of a [D][16] group)
 * into scores[0..R-1][0..8 V - 1], each as P partial sums over the dimensions (d % P) added at
 * the end as the paged kernel adds them (P 1: one sum). */
static inline __attribute__((always_inline)) void score_rows(const float *q, const float *k, const int R, const int P,
                                                             const int V, const int64_t D, float (*scores)[PART]) {
    __m256 s[4][6][2];
    for (int j = 0; j < P; j++)
        for (int i = 0; i < R; i++)
            for (int v = 0; v < V; v++) s[j][i][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += P)
        for (int j = 0; j < P; j++) {
            __m256 k0 = _mm256_loadu_ps(k + (d + j) * 16), k1 = V == 2 ? _mm256_loadu_ps(k + (d + j) * 16 + 8) : k0;
            IN_REGISTERS(k0, k1);
            for (int i = 0; i < R; i++) {
                const __m256 x = _mm256_broadcast_ss(q + i * D + d + j);
                s[j][i][0] = _mm256_fmadd_ps(x, k0, s[j][i][0]);
                if (V == 2) s[j][i][1] = _mm256_fmadd_ps(x, k1, s[j][i][1]);
            }
        }
    for (int i = 0; i < R; i++)
        for (int v = 0; v < V; v++) {
            __m256 sum = s[0][i][v];
            if (P == 2) sum = _mm256_add_ps(sum, s[1][i][v]);
            if (P == 4) sum = _mm256_add_ps(_mm256_add_ps(sum, s[1][i][v]), _mm256_add_ps(s[2][i][v], s[3][i][v]));
            _mm256_storeu_ps(scores[i] + 8 * v, sum);
        }
}

/* acc[0..R-1][c..c+15] += probabilities (probs[0..R-1][0..width-1]) x values (v: [width][D]). */
static inline __attribute__((always_inline)) void weigh_rows(float (*acc)[128], float (*probs)[PART], const float *v,
                                                             const int R, int64_t width, const int64_t D, int64_t c) {
    __m256 a[12];
    for (int i = 0; i < R; i++) a[2 * i] = _mm256_loadu_ps(&acc[i][c]), a[2 * i + 1] = _mm256_loadu_ps(&acc[i][c + 8]);
    for (int64_t t = 0; t < width; t++) {
        __m256 v0 = _mm256_loadu_ps(v + t * D + c), v1 = _mm256_loadu_ps(v + t * D + c + 8);
        IN_REGISTERS(v0, v1);
        for (int i = 0; i < R; i++) {
            const __m256 x = _mm256_broadcast_ss(&probs[i][t]);
            a[2 * i] = _mm256_fmadd_ps(x, v0, a[2 * i]);
            a[2 * i + 1] = _mm256_fmadd_ps(x, v1, a[2 * i + 1]);
        }
    }
    for (int i = 0; i < R; i++) _mm256_storeu_ps(&acc[i][c], a[2 * i]), _mm256_storeu_ps(&acc[i][c + 8], a[2 * i + 1]);
}

/* The task on float32 operands, its scores as P partial sums (1: the shared part of a cascade,
 * which need not match the kernel). Rows in blocks that keep their sums in registers beside the
 * keys or values and a broadcast (AVX2's 16): against 16 keys 6, 6 and 4 rows (P 1) or five of
 * 3 and one (P 2), against 8 keys five of 3 and one (P 4); against 16 dimensions of the values
 * 6, 6 and 4. */
static inline __attribute__((always_inline)) void attend_rows_float(
        const float *qf, const float *kf, const float *vf, const int64_t *last, int64_t padded_keys,
        const int64_t D, const int P, float (*acc)[128], float *m, float *l) {
    float scores[16][PART] __attribute__((aligned(64)));
    start_rows(acc, m, l, D);
    const int64_t seen = keys_seen(last, 16, padded_keys, 16);
    for (int64_t p0 = 0; p0 < seen; p0 += PART) {
        const int64_t width = seen - p0 < PART ? seen - p0 : PART; /* a multiple of 16 */
        for (int64_t n = 0; n < width; n += 16) {
            const float *k = kf + (p0 + n) / 16 * D * 16;
            float (*to)[PART] = (float (*)[PART])&scores[0][n]; /* row r's scores of keys n.. at to[r] */
            if (P == 1) {
                score_rows(qf, k, 6, 1, 2, D, to);
                score_rows(qf + 6 * D, k, 6, 1, 2, D, to + 6);
                score_rows(qf + 12 * D, k, 4, 1, 2, D, to + 12);
            } else if (P == 2) {
                for (int r0 = 0; r0 < 15; r0 += 3) score_rows(qf + r0 * D, k, 3, 2, 2, D, to + r0);
                score_rows(qf + 15 * D, k, 1, 2, 2, D, to + 15);
            } else {
                for (int half = 0; half < 16; half += 8) { /* keys n + half.. */
                    float (*half_to)[PART] = (float (*)[PART])&scores[0][n + half];
                    for (int r0 = 0; r0 < 15; r0 += 3) score_rows(qf + r0 * D, k + half, 3, 4, 1, D, half_to + r0);
                    score_rows(qf + 15 * D, k + half, 1, 4, 1, D, half_to + 15);
                }
            }
        }
        partition_softmax_float(scores, last, p0, width, D, acc, m, l);
        const float *v = vf + p0 * D;
        for (int64_t c = 0; c < D; c += 16) {
            weigh_rows(acc, scores, v, 6, width, D, c);
            weigh_rows(acc + 6, scores + 6, v, 6, width, D, c);
            weigh_rows(acc + 12, scores + 12, v, 4, width, D, c);
        }
    }
}

/* 8 elements from p + i of a bfloat16 (f32 = 0) or float32 (f32 = 1) array, as float32. */
static inline __m256 load8(const void *p, int64_t i, int f32) {
    return f32 ? _mm256_loadu_ps((const float *)p + i) : widen8((const uint16_t *)p + i);
}

static inline float load1(const void *p, int64_t i, int f32) {
    if (f32) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof(x));
    return x;
}

/* The keys of `blocks` (the first `keys` tokens) for one KV head as [padded_keys/16][D][16]. */
static void pack_keys_float(float *dst, const void *key_cache, int f32, const int32_t *blocks, int64_t keys,
                            int64_t padded_keys, int64_t block_size, int64_t block_stride, int64_t h, int64_t D) {
    memset(dst + keys / 16 * D * 16, 0, (padded_keys / 16 - keys / 16) * D * 16 * sizeof(float));
    for (int64_t b = 0; b * block_size < keys; b++) {
        const int64_t k = (int64_t)blocks[b] * block_stride + h * D * block_size;
        const int64_t n = keys - b * block_size < block_size ? keys - b * block_size : block_size;
        for (int64_t d = 0; d < D; d++) {
            const int64_t row = k + d * block_size; /* dimension d of the block's keys */
            int64_t t = 0;
            if (block_size % 8 == 0) /* 8 keys never straddle two groups of 16 */
                for (; t + 8 <= n; t += 8) {
                    const int64_t key = b * block_size + t;
                    _mm256_storeu_ps(dst + (key / 16 * D + d) * 16 + key % 16, load8(key_cache, row + t, f32));
                }
            for (; t < n; t++) {
                const int64_t key = b * block_size + t;
                dst[(key / 16 * D + d) * 16 + key % 16] = load1(key_cache, row + t, f32);
            }
        }
    }
}

/* The values of `blocks` (the first `keys` tokens) for one KV head as [padded_keys][D]. */
static void pack_values_float(float *dst, const void *value_cache, int f32, const int32_t *blocks, int64_t keys,
                              int64_t padded_keys, int64_t block_size, int64_t block_stride, int64_t h, int64_t D) {
    for (int64_t key = 0; key < keys; key++) {
        const int64_t v = (int64_t)blocks[key / block_size] * block_stride + (h * block_size + key % block_size) * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + key * D + d, load8(value_cache, v + d, f32));
    }
    memset(dst + keys * D, 0, (padded_keys - keys) * D * sizeof(float));
}

/* pack_queries in float32, times the softmax's scale (as the paged kernel scales them). */
static void pack_queries_float(float *dst, const void *query, int f32, const int32_t *tok, int64_t first,
                               int64_t tokens, int64_t padded_rows, int64_t num_heads, int64_t G, int64_t h, int64_t D,
                               float scale) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t r = 0; r < padded_rows; r++) {
        if (r < tokens * G) {
            const int64_t q = ((tok ? tok[r / G] : first + r / G) * num_heads + h * G + r % G) * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(dst + r * D + d, _mm256_mul_ps(load8(query, q + d, f32), scale8));
        } else {
            memset(dst + r * D, 0, D * sizeof(float));
        }
    }
}

/* store_row on 8 lanes, into a bfloat16 or (f32) float32 row; own_out in the same dtype. */
static inline void store_row_float(void *out, const float *acc, float m, float l, const void *own_out,
                                   const float *own_lse, int64_t D, int f32) {
    __m256 a = _mm256_set1_ps(1.0f / l), b = _mm256_setzero_ps();
    if (own_out) {
        const float shared_lse = m + logf(l), own = *own_lse, top = shared_lse > own ? shared_lse : own;
        const float ws = expf(shared_lse - top), wo = expf(own - top), total = ws + wo;
        a = _mm256_set1_ps(ws / total / l);
        b = _mm256_set1_ps(wo / total);
    }
    for (int64_t d = 0; d < D; d += 8) {
        __m256 merged = _mm256_mul_ps(_mm256_loadu_ps(acc + d), a);
        if (own_out) merged = _mm256_fmadd_ps(load8(own_out, d, f32), b, merged);
        if (f32) _mm256_storeu_ps((float *)out + d, merged);
        else narrow8((uint16_t *)out + d, merged);
    }
}

/* -- every kind: packing, a task, a row's result ------------------------------------------------ */

static size_t element_bytes(int kind) { return kind == FLOAT_TILES ? sizeof(float) : sizeof(uint16_t); }

/* Operand `part` (0 keys, 1 values, 2 queries) of KV head h into dst, in `kind`'s layout, from
 * bfloat16 or (f32, the float32 tiles only) float32 operands. */
static void pack_operand(int kind, int f32, int part, void *dst, const void *key_cache, const void *value_cache,
                         const void *query, const int32_t *tok, const int32_t *blocks, int64_t keys,
                         int64_t padded_keys, int64_t block_size, int64_t block_stride, int64_t first, int64_t tokens,
                         int64_t padded_rows,
                         int64_t num_heads, int64_t G, int64_t h, int64_t D, float scale) {
#if HAVE_VECTOR_TILES
    if (kind != FLOAT_TILES) {
        if (part == 0) pack_keys(dst, key_cache, blocks, keys, padded_keys, block_size, block_stride, h, D);
        else if (part == 1) pack_values(dst, value_cache, blocks, keys, padded_keys, block_size, block_stride, h, D);
        else pack_queries(dst, query, tok, first, tokens, padded_rows, num_heads, G, h, D);
        return;
    }
#endif
    (void)kind;
    if (part == 0) pack_keys_float(dst, key_cache, f32, blocks, keys, padded_keys, block_size, block_stride, h, D);
    else if (part == 1)
        pack_values_float(dst, value_cache, f32, blocks, keys, padded_keys, block_size, block_stride, h, D);
    else pack_queries_float(dst, query, f32, tok, first, tokens, padded_rows, num_heads, G, h, D, scale);
}

/* Query rows a task takes, of a KV head's `rows`: 32 on AMX tiles at head_dim 64
 * (attend_rows_amx32), unless that pads a few rows with 16 more (48 rows: 2 tasks of 32 took
 * 5% longer than 3 of 16, 64 chunks of 16 tokens over 300); else 16. */
static inline int task_rows(int kind, int64_t D, int64_t rows) {
    if (kind != AMX_TILES || D != 64) return 16;
    return (rows + 31) / 32 * 32 - rows < 16 || rows >= 128 ? 32 : 16;
}

/* A task of R rows (task_rows) on tiles of `kind`; on the float32 ones (whose queries come scaled) each score as
 * `partials` partial sums (a prefill's as the paged kernel's, paged_partials; a shared prefix's
 * in one). */
static inline void attend(int kind, int R, const void *qp, const void *kb, const void *vb, const int64_t *last,
                          int64_t padded_keys, int64_t D, float scale, int partials, float (*acc)[128], float *m,
                          float *l) {
#if HAVE_AMX_TILES
    if (kind == AMX_TILES) {
        if (R == 32) attend_rows_amx32(qp, kb, vb, last, padded_keys, scale, acc, m, l);
        else if (D == 64) attend_rows_amx(qp, kb, vb, last, padded_keys, 64, scale, acc, m, l);
        else attend_rows_amx(qp, kb, vb, last, padded_keys, 128, scale, acc, m, l);
        return;
    }
#endif
#if HAVE_VECTOR_TILES
    if (kind == VECTOR_TILES) {
        if (D == 64) attend_rows_vector(qp, kb, vb, last, padded_keys, 64, scale, acc, m, l);
        else attend_rows_vector(qp, kb, vb, last, padded_keys, 128, scale, acc, m, l);
        return;
    }
#endif
    (void)kind, (void)R, (void)scale;
#define FLOAT_TASK(P)                                                                                      \
    do {                                                                                                   \
        if (D == 64) attend_rows_float(qp, kb, vb, last, padded_keys, 64, P, acc, m, l);                  \
        else attend_rows_float(qp, kb, vb, last, padded_keys, 128, P, acc, m, l);                         \
    } while (0)
    if (partials == 1) FLOAT_TASK(1);
    else if (partials == 2) FLOAT_TASK(2);
    else FLOAT_TASK(4);
#undef FLOAT_TASK
}

static inline void store(int kind, int f32, void *out, const float *acc, float m, float l, const void *own_out,
                         const float *own_lse, int64_t D) {
#if HAVE_VECTOR_TILES
    if (kind != FLOAT_TILES) {
        store_row(out, acc, m, l, own_out, own_lse, D);
        return;
    }
#endif
    (void)kind;
    store_row_float(out, acc, m, l, own_out, own_lse, D, f32);
}

/* Whether tiles of the kind asked for run here (AMX: built with them and permitted). */
static int kind_runs(int kind) {
    if (kind == AMX_TILES) {
#if HAVE_AMX_TILES
        return pagoda_amx_permitted();
#else
        return 0;
#endif
    }
    return kind == FLOAT_TILES || (kind == VECTOR_TILES && HAVE_VECTOR_TILES);
}

/* Whether tiles of `kind` run here on operands of that dtype (float32 on the float32 tiles only). */
static int runs(int kind, int f32) { return kind_runs(kind) && (!f32 || kind == FLOAT_TILES); }

/* Per thread, around its tasks: the AMX tile configuration and its release. */
static inline void begin_tiles(int kind) {
#if HAVE_AMX_TILES
    if (kind == AMX_TILES) configure_tiles();
#endif
    (void)kind;
}
static inline void end_tiles(int kind) {
#if HAVE_AMX_TILES
    if (kind == AMX_TILES) _tile_release();
#endif
    (void)kind;
}

/* The entry points below on bfloat16 or (f32) float32 operands; out and own_out in that dtype. */
static int shared_prefix(const void *query, const void *key_cache, const void *value_cache, const int32_t *blocks,
                         int64_t num_blocks, int64_t block_size, int64_t num_tokens, const int32_t *members,
                         int64_t num_members, const int32_t *query_start, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, float scale, const void *own_out, const float *own_lse, void *out, int kind,
                         int f32) {
    const int64_t D = head_dim, G = num_heads / num_kv_heads, KV = num_kv_heads, OE = f32 ? 4 : 2;
    if ((D != 64 && D != 128) || num_blocks <= 0 || !runs(kind, f32)) return 1;
    /* with members, their rows alone: tok lists their tokens (the rows' order in the tiles) */
    int32_t *tok = NULL;
    if (members) {
        int64_t n = 0;
        for (int64_t j = 0; j < num_members; j++) n += query_start[members[j] + 1] - query_start[members[j]];
        if (!(tok = malloc(sizeof(int32_t) * (size_t)(n ? n : 1)))) return 1;
        num_tokens = 0;
        for (int64_t j = 0; j < num_members; j++)
            for (int32_t t = query_start[members[j]]; t < query_start[members[j] + 1]; t++) tok[num_tokens++] = t;
    }
    const int64_t keys = num_blocks * block_size, padded_keys = (keys + KEYS - 1) / KEYS * KEYS;
    const int64_t rows = num_tokens * G;
    const int R = task_rows(kind, D, rows);
    const int64_t padded_rows = (rows + R - 1) / R * R;
    const int64_t block_stride = KV * D * block_size;
    const size_t E = element_bytes(kind);
    char *kb = aligned_alloc(64, (size_t)(2 * KV * D * padded_keys + KV * padded_rows * D) * E);
    if (!kb) {
        free(tok);
        return 1;
    }
    char *vb = kb + KV * D * padded_keys * E, *qp = vb + KV * padded_keys * D * E;
    /* dynamic: the keys' jobs (first) take longest; statically the first thread got them all */
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t job = 0; job < 3 * KV; job++) {
        const int64_t part = job / KV, h = job % KV;
        char *dst = part == 0 ? kb + h * D * padded_keys * E : part == 1 ? vb + h * padded_keys * D * E
                                                                          : qp + h * padded_rows * D * E;
        pack_operand(kind, f32, (int)part, dst, key_cache, value_cache, query, tok, blocks, keys, padded_keys,
                     block_size, block_stride, 0, num_tokens, padded_rows, num_heads, G, h, D, scale);
    }
    const int64_t tasks_per_head = padded_rows / R;
    #pragma omp parallel
    {
        begin_tiles(kind);
        float acc[32][128] __attribute__((aligned(64)));
        float m[32], l[32];
        int64_t last[32];
        for (int r = 0; r < R; r++) last[r] = keys - 1; /* every row sees every shared key */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * tasks_per_head; task++) {
            const int64_t h = task / tasks_per_head, r0 = task % tasks_per_head * R;
            attend(kind, R, qp + (h * padded_rows + r0) * D * E, kb + h * D * padded_keys * E,
                   vb + h * padded_keys * D * E, last, padded_keys, D, scale, 1, acc, m, l);
            for (int64_t i = 0; i < R && r0 + i < rows; i++) {
                const int64_t r = r0 + i, at = (tok ? tok[r / G] : r / G) * num_heads + h * G + r % G;
                store(kind, f32, (char *)out + at * D * OE, acc[i], m[i], l[i], (const char *)own_out + at * D * OE,
                      own_lse + at, D);
            }
        }
        end_tiles(kind);
    }
    free(kb);
    free(tok);
    return 0;
}

/* Bytes of packed operands at a time in a prefill: the listed requests go in groups of about
 * this much, each packed and then attended. All at once, 64 chunks of 16 tokens over 300 took
 * 34 MB in float32: past glibc's largest mmap threshold (32 MB), so every call mapped (and the
 * kernel zeroed) fresh pages, and the tiles lost to the paged kernel (0.6-0.8x). Groups of 4 and
 * of 16 MB measured the same (AMD Zen 3). */
#ifndef PACK_BUDGET /* (tests build with a small one, to cross groups) */
#define PACK_BUDGET ((int64_t)16 << 20)
#endif

/* The causal attention of the query rows of the requests listed in `requests` (prefill chunks:
 * request i owns rows query_start[i]..query_start[i+1], the last of its seq_lens[i] tokens)
 * over their contexts, into out. */
static int prefill(const void *query, const void *key_cache, const void *value_cache, const int32_t *block_tables,
                   int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start,
                   const int32_t *requests, int64_t num_listed, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, float scale, void *out, int kind, int f32) {
    const int64_t D = head_dim, G = num_heads / num_kv_heads, KV = num_kv_heads, OE = f32 ? 4 : 2;
    if ((D != 64 && D != 128) || !runs(kind, f32) || num_listed == 0) return num_listed ? 1 : 0;
    const int64_t block_stride = KV * D * block_size;
    const int64_t E = (int64_t)element_bytes(kind);
    /* per listed request: its padded keys and rows, where its packed operands start (in
     * elements, from its group's start) and its first task (in its group) */
    int64_t *plan = malloc(sizeof(int64_t) * 4 * (num_listed + 1));
    if (!plan) return 1;
    int64_t *padded_keys = plan, *padded_rows = plan + num_listed, *offset = plan + 2 * num_listed;
    int64_t *first_task = plan + 3 * num_listed; /* num_listed + 1 entries */
    int64_t largest = 0, all = 0;
    for (int64_t j = 0; j < num_listed; j++) {
        const int64_t i = requests[j], tokens = query_start[i + 1] - query_start[i];
        padded_keys[j] = (seq_lens[i] + KEYS - 1) / KEYS * KEYS;
        const int R = task_rows(kind, D, tokens * G);
        padded_rows[j] = (tokens * G + R - 1) / R * R;
        const int64_t size = KV * (2 * D * padded_keys[j] + padded_rows[j] * D);
        largest = size > largest ? size : largest;
        all += size;
    }
    /* bytes: the budget (or all of it, if less), or the largest request where that is more */
    const int64_t budget = all * E < PACK_BUDGET ? all * E : PACK_BUDGET;
    const int64_t capacity = largest * E > budget ? largest * E : budget;
    char *work = aligned_alloc(64, (size_t)(capacity + 63) / 64 * 64);
    if (!work) {
        free(plan);
        return 1;
    }
    for (int64_t j0 = 0, j1; j0 < num_listed; j0 = j1) {
        int64_t total = 0, tasks = 0;
        for (j1 = j0; j1 < num_listed; j1++) {
            const int64_t size = KV * (2 * D * padded_keys[j1] + padded_rows[j1] * D);
            if (j1 > j0 && (total + size) * E > capacity) break;
            offset[j1] = total;
            total += size;
            first_task[j1] = tasks;
            const int64_t i = requests[j1];
            tasks += KV * padded_rows[j1] / task_rows(kind, D, (query_start[i + 1] - query_start[i]) * G);
        }
        first_task[j1] = tasks;
        /* per request: keys [kv][...], then values [kv][...], then queries [kv][...] */
        #pragma omp parallel for schedule(dynamic, 1)
        for (int64_t job = 3 * KV * j0; job < 3 * KV * j1; job++) {
            const int64_t j = job / (3 * KV), part = job % (3 * KV) / KV, h = job % KV, i = requests[j];
            const int64_t pk = padded_keys[j], pr = padded_rows[j];
            char *base = work + offset[j] * E;
            char *dst = base + (part == 0 ? h * D * pk : part == 1 ? KV * D * pk + h * pk * D : 2 * KV * D * pk + h * pr * D) * E;
            pack_operand(kind, f32, (int)part, dst, key_cache, value_cache, query, NULL,
                         block_tables + i * block_table_stride, seq_lens[i], pk, block_size, block_stride,
                         query_start[i], query_start[i + 1] - query_start[i], pr, num_heads, G, h, D, scale);
        }
        #pragma omp parallel
        {
            begin_tiles(kind);
            float acc[32][128] __attribute__((aligned(64)));
            float m[32], l[32];
            int64_t last[32];
            #pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < tasks; task++) {
                int64_t j = j0;
                while (first_task[j + 1] <= task) j++;
                const int64_t i = requests[j], pk = padded_keys[j], pr = padded_rows[j];
                const int64_t tokens = query_start[i + 1] - query_start[i], start = seq_lens[i] - tokens;
                const int R = task_rows(kind, D, tokens * G);
                const int64_t per_head = pr / R, h = (task - first_task[j]) / per_head;
                const int64_t r0 = (task - first_task[j]) % per_head * R;
                for (int r = 0; r < R; r++) { /* row r0 + r is token (r0 + r) / G, at start + that */
                    const int64_t token = (r0 + r) / G < tokens ? (r0 + r) / G : tokens - 1;
                    last[r] = start + token;
                }
                const char *base = work + offset[j] * E;
                attend(kind, R, base + (2 * KV * D * pk + (h * pr + r0) * D) * E, base + h * D * pk * E,
                       base + (KV * D * pk + h * pk * D) * E, last, pk, D, scale, paged_partials(G, D), acc, m,
                       l);
                for (int64_t k = 0; k < R && r0 + k < tokens * G; k++) {
                    const int64_t r = r0 + k, at = (query_start[i] + r / G) * num_heads + h * G + r % G;
                    store(kind, f32, (char *)out + at * D * OE, acc[k], m[k], l[k], NULL, NULL, D);
                }
            }
            end_tiles(kind);
        }
    }
    free(work);
    free(plan);
    return 0;
}

#else
/* No tiles in this build: every entry point declines, and the caller takes the paged kernel. */
static int shared_prefix(const void *query, const void *key_cache, const void *value_cache, const int32_t *blocks,
                         int64_t num_blocks, int64_t block_size, int64_t num_tokens, const int32_t *members,
                         int64_t num_members, const int32_t *query_start, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, float scale, const void *own_out, const float *own_lse, void *out, int kind,
                         int f32) {
    (void)query, (void)key_cache, (void)value_cache, (void)blocks, (void)num_blocks, (void)block_size;
    (void)members, (void)num_members, (void)query_start, (void)num_tokens, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)scale, (void)own_out;
    (void)own_lse, (void)out, (void)kind, (void)f32;
    return 1;
}

static int prefill(const void *query, const void *key_cache, const void *value_cache, const int32_t *block_tables,
                   int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start,
                   const int32_t *requests, int64_t num_listed, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, float scale, void *out, int kind, int f32) {
    (void)query, (void)key_cache, (void)value_cache, (void)block_tables, (void)block_table_stride, (void)seq_lens;
    (void)query_start, (void)requests, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size;
    (void)scale, (void)out, (void)kind, (void)f32;
    return num_listed ? 1 : 0;
}
#endif

/* -- the entry points ------------------------------------------------------------------------- */

int shared_prefix_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                                 const int32_t *blocks, int64_t num_blocks, int64_t block_size, int64_t num_tokens,
                                 const int32_t *members, int64_t num_members, const int32_t *query_start,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                 const uint16_t *own_out, const float *own_lse, uint16_t *out, int kind) {
    return shared_prefix(query, key_cache, value_cache, blocks, num_blocks, block_size, num_tokens, members,
                         num_members, query_start, num_heads, num_kv_heads, head_dim, scale, own_out, own_lse, out,
                         kind, 0);
}

int shared_prefix_attention_f32(const float *query, const float *key_cache, const float *value_cache,
                                const int32_t *blocks, int64_t num_blocks, int64_t block_size, int64_t num_tokens,
                                const int32_t *members, int64_t num_members, const int32_t *query_start,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                const float *own_out, const float *own_lse, float *out, int kind) {
    return shared_prefix(query, key_cache, value_cache, blocks, num_blocks, block_size, num_tokens, members,
                         num_members, query_start, num_heads, num_kv_heads, head_dim, scale, own_out, own_lse, out,
                         kind, 1);
}

int prefill_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                           const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                           const int32_t *query_start, const int32_t *requests, int64_t num_listed,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           uint16_t *out, int kind) {
    return prefill(query, key_cache, value_cache, block_tables, block_table_stride, seq_lens, query_start, requests,
                   num_listed, num_heads, num_kv_heads, head_dim, block_size, scale, out, kind, 0);
}

int prefill_attention_f32(const float *query, const float *key_cache, const float *value_cache,
                          const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                          const int32_t *query_start, const int32_t *requests, int64_t num_listed, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                          int kind) {
    return prefill(query, key_cache, value_cache, block_tables, block_table_stride, seq_lens, query_start, requests,
                   num_listed, num_heads, num_kv_heads, head_dim, block_size, scale, out, kind, 1);
}
