/*
 * Paged attention for the CPU: every query row of a step (prefill chunks and decodes alike)
 * against its request's context, read from the KV blocks in place (no gather, no padding
 * to the longest request), plus the write of the step's new keys and values.
 *
 * Layout (the cpu_paged backend's cache):
 *   query, out:     [num_tokens, num_heads, head_dim]
 *   key cache:      [num_blocks, num_kv_heads, head_dim, block_size]  (keys transposed per block)
 *   value cache:    [num_blocks, num_kv_heads, block_size, head_dim]
 *   block_tables:   [num_reqs, block_table_stride] int32
 *   seq_lens:       [num_reqs] int32 (tokens of context, the step's new ones included)
 *   query_start:    [num_reqs + 1] int32: request i owns query rows query_start[i]..query_start[i+1],
 *                   the last of its seq_lens[i] positions (causal: a row at position p sees keys 0..p)
 *
 * skip (NULL, or a byte per request) leaves the rows of the requests it marks to another
 * kernel (tile_attention.c's prefill path): their output rows are not written.
 *
 * A query row at position p is a decode over a context of p + 1 tokens, so one kernel serves
 * both. A task is a tile of consecutive query tokens of one request and one KV head: its rows
 * (tokens x the query heads sharing the KV head) walk the blocks once with a softmax in
 * float32 (online in the generic path; in partitions of two passes in the vector ones, see
 * PARTITION), so a prefill chunk reads each key and value once per tile, not once per token.
 * Keys are stored transposed within a block so that a block's scores are computed
 * token-parallel (vector lanes over the block's tokens, no horizontal sums); values are
 * accumulated lane-parallel over head_dim.
 *
 * Tasks are spread over OpenMP threads; torch's own libgomp is already loaded when this
 * library is, so both share one thread pool. Built on first use by
 * attention_backends/cpu_kernels.py with the machine's C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagoda_kernels.h"

#include <omp.h>

#define MIN_SCORE (-1e30f)

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_id(float x) { return x; }

/* fp8 caches (--kv-cache-dtype): one byte an element, decoded through float16, whose bits hold
 * an e5m2 byte exactly (as their high byte) and an e4m3 byte's magnitude shifted by 7, which
 * is worth 2^-8 of the e4m3 value (denormals included): the caller folds the 2^8 into the
 * scales, so both kinds decode with a shift and vector float16 conversion. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or denormal: mant x 2^-24 */
        v.f = (float)mant * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else {
        v.u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return v.f;
}
static inline uint16_t e5m2_bits(uint8_t b) { return (uint16_t)((uint16_t)b << 8); }
static inline uint16_t e4m3_bits(uint8_t b) { return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)); }
static inline float e5m2_to_f32(uint8_t b) { return f16_to_f32(e5m2_bits(b)); }
static inline float e4m3_to_f32(uint8_t b) { return f16_to_f32(e4m3_bits(b)); }

/* ---- writing the step's keys and values into their slots --------------------------------- */

/* key/value: [num_tokens, num_kv_heads, head_dim] with the heads of a token contiguous and
 * key_stride/value_stride elements from one token to the next (a view of the qkv product). */

#define DEFINE_WRITE_KV(NAME, T)                                                                           \
void NAME(const T *key, const T *value, const int64_t *slot_mapping, T *key_cache, T *value_cache,          \
          int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t key_stride,  \
          int64_t value_stride) {                                                                            \
    const int64_t block_stride = num_kv_heads * head_dim * block_size;                                     \
    _Pragma("omp parallel for schedule(static) if (num_tokens >= 16)")                                       \
    for (int64_t i = 0; i < num_tokens; i++) {                                                             \
        const int64_t slot = slot_mapping[i];                                                              \
        if (slot < 0) continue; /* a padding row */                                                        \
        const int64_t block = slot / block_size, offset = slot % block_size;                               \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                       \
            const T *k = key + i * key_stride + h * head_dim;                                              \
            T *kdst = key_cache + block * block_stride + h * head_dim * block_size + offset;               \
            for (int64_t d = 0; d < head_dim; d++) kdst[d * block_size] = k[d];                            \
            memcpy(value_cache + block * block_stride + (h * block_size + offset) * head_dim,             \
                   value + i * value_stride + h * head_dim, head_dim * sizeof(T));                         \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_WRITE_KV(paged_write_kv_bf16, uint16_t)
DEFINE_WRITE_KV(paged_write_kv_f32, float)
DEFINE_WRITE_KV(paged_write_kv_u8, uint8_t) /* fp8 caches: the bytes torch converted */

/* ---- the generic path: one query token per task, any block size, no vector extensions ----- */

/* One (query token, KV head) task over a context of len tokens, the first `first` of them outside
 * its window (from the block that holds key `first` on): queries and output of type T, the
 * caches' elements of type TK. */
#define TASK_BODY(T, LOAD, STORE, TK, LOADK, BS)                                                                     \
    float q[group][head_dim], acc[group][head_dim], m[group], l[group];                                    \
    float s[group][BS], krow[BS], vrow[head_dim];                                                          \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        const T *src = query + (row * num_heads + kh * group + g) * head_dim;                              \
        for (int64_t d = 0; d < head_dim; d++) { q[g][d] = LOAD(src[d]) * scale; acc[g][d] = 0; }         \
        m[g] = MIN_SCORE;                                                                                  \
        l[g] = 0;                                                                                          \
    }                                                                                                      \
    for (int64_t start = first / BS * BS; start < len; start += BS) {                                      \
        const int64_t n = len - start < BS ? len - start : BS;                                             \
        const int64_t seen_from = first - start; /* keys of the block before it are outside the window */  \
        const int64_t base = (int64_t)table[start / BS] * block_stride + kh * BS * head_dim;              \
        const TK *k = key_cache + base;                                                                    \
        const TK *v = value_cache + base;                                                                  \
        for (int64_t g = 0; g < group; g++)                                                                \
            for (int64_t t = 0; t < BS; t++) s[g][t] = 0;                                                  \
        for (int64_t d = 0; d < head_dim; d++) {                                                           \
            for (int64_t t = 0; t < BS; t++) krow[t] = LOADK(k[d * BS + t]);                               \
            for (int64_t g = 0; g < group; g++) {                                                          \
                const float qd = q[g][d];                                                                  \
                for (int64_t t = 0; t < BS; t++) s[g][t] += qd * krow[t];                                  \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t g = 0; g < group; g++) {                                                              \
            if (softcap > 0)                                                                               \
                for (int64_t t = 0; t < n; t++) s[g][t] = softcap * tanhf(s[g][t] / softcap);              \
            float block_max = m[g];                                                                        \
            for (int64_t t = seen_from > 0 ? seen_from : 0; t < n; t++)                                    \
                block_max = s[g][t] > block_max ? s[g][t] : block_max;                                     \
            const float correction = expf(m[g] - block_max);                                               \
            float sum = 0;                                                                                 \
            for (int64_t t = 0; t < BS; t++) {                                                             \
                const float p = t < n && t >= seen_from ? expf(s[g][t] - block_max) : 0.0f;                \
                s[g][t] = p;                                                                               \
                sum += p;                                                                                  \
            }                                                                                              \
            l[g] = l[g] * correction + sum;                                                                \
            m[g] = block_max;                                                                              \
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;                                \
        }                                                                                                  \
        for (int64_t t = 0; t < n; t++) {                                                                  \
            for (int64_t d = 0; d < head_dim; d++) vrow[d] = LOADK(v[t * head_dim + d]);                   \
            for (int64_t g = 0; g < group; g++) {                                                          \
                const float p = s[g][t];                                                                   \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * vrow[d];                           \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        T *dst = out + (row * num_heads + kh * group + g) * head_dim;                                      \
        const float inv = l[g] > 0 ? value_scale / l[g] : 0.0f;                                            \
        for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[g][d] * inv);                            \
        if (lse) lse[row * num_heads + kh * group + g] = l[g] > 0 ? m[g] + logf(l[g]) : -INFINITY;         \
    }

/* The request whose query rows hold row: query_start is sorted, so a binary search. */
static inline int64_t request_of_row(const int32_t *query_start, int64_t num_reqs, int64_t row) {
    int64_t lo = 0, hi = num_reqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>

#define FAST_MAX_ROWS 8   /* query rows of a tile: its tokens x the query heads of one KV head */
#define FAST_MAX_CHUNKS 8 /* head_dim up to 128 */

/* The vector paths take 16 float32 lanes at a time (vec16, the v_ operations): one AVX-512
 * register, or on AVX2-only CPUs two 8-lane halves, so one tile code serves both. */
#include "vector_exp.h"
#include "vector_lanes.h"

#define VOP static inline __attribute__((always_inline))
#if defined(__AVX512F__)
typedef __m512 vec16;
VOP vec16 v_zero(void) { return _mm512_setzero_ps(); }
VOP vec16 v_set1(float x) { return _mm512_set1_ps(x); }
VOP vec16 v_add(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
VOP vec16 v_sub(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
VOP vec16 v_mul(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
VOP vec16 v_max(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
VOP vec16 v_fmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }
VOP vec16 v_load(const float *p) { return _mm512_loadu_ps(p); }
VOP void v_store(float *p, vec16 v) { _mm512_storeu_ps(p, v); }
VOP float v_reduce_max(vec16 v) { return _mm512_reduce_max_ps(v); }
VOP float v_reduce_add(vec16 v) { return _mm512_reduce_add_ps(v); }
VOP float v_first(vec16 v) { return _mm512_cvtss_f32(v); }
VOP vec16 v_exp(vec16 v) { return exp16(v); }
/* the first `count` lanes of v, the rest `fill` */
VOP vec16 v_keep_first(vec16 v, int64_t count, float fill) {
    return _mm512_mask_blend_ps(first_lanes16(count), _mm512_set1_ps(fill), v);
}
/* the lanes from `from` on, the first ones `fill` */
VOP vec16 v_keep_from(vec16 v, int64_t from, float fill) {
    return _mm512_mask_blend_ps(first_lanes16(from), v, _mm512_set1_ps(fill));
}
/* cap * tanh(v / cap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (no overflow) */
VOP vec16 v_softcap(vec16 v, float cap) {
    const __m512 x = _mm512_div_ps(v, _mm512_set1_ps(cap)), one = _mm512_set1_ps(1.0f);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(cap));
}

static inline vec16 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vec16 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vec16 load16_e5m2(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}
/* e4m3: the byte sign-extended to 16 bits and shifted by 7 holds the magnitude in bits 7-13 and
 * the sign in bits 14 and 15; clearing bit 14 leaves e4m3_bits(). */
static inline vec16 load16_e4m3(const uint8_t *p) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xbfff)));
}
#else
typedef struct { __m256 lo, hi; } vec16;
#define V2(EXPR_LO, EXPR_HI) ((vec16){EXPR_LO, EXPR_HI})
VOP vec16 v_zero(void) { return V2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
VOP vec16 v_set1(float x) { return V2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
VOP vec16 v_add(vec16 a, vec16 b) { return V2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
VOP vec16 v_sub(vec16 a, vec16 b) { return V2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
VOP vec16 v_mul(vec16 a, vec16 b) { return V2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
VOP vec16 v_max(vec16 a, vec16 b) { return V2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
VOP vec16 v_fmadd(vec16 a, vec16 b, vec16 c) {
    return V2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
VOP vec16 v_load(const float *p) { return V2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
VOP void v_store(float *p, vec16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
VOP float v_reduce_max(vec16 v) {
    __m256 m = _mm256_max_ps(v.lo, v.hi);
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    return _mm256_cvtss_f32(_mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1)));
}
VOP float v_reduce_add(vec16 v) {
    __m256 s = _mm256_add_ps(v.lo, v.hi);
    s = _mm256_add_ps(s, _mm256_permute2f128_ps(s, s, 1));
    s = _mm256_add_ps(s, _mm256_shuffle_ps(s, s, 0x4e));
    return _mm256_cvtss_f32(_mm256_add_ps(s, _mm256_shuffle_ps(s, s, 0xb1)));
}
VOP float v_first(vec16 v) { return _mm256_cvtss_f32(v.lo); }
VOP vec16 v_exp(vec16 v) { return V2(exp8(v.lo), exp8(v.hi)); }
VOP vec16 v_keep_first(vec16 v, int64_t count, float fill) {
    const __m256i n = _mm256_set1_epi32((int)(count < 0 ? 0 : count > 16 ? 16 : count));
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
    return V2(_mm256_blendv_ps(_mm256_set1_ps(fill), v.lo, lo), _mm256_blendv_ps(_mm256_set1_ps(fill), v.hi, hi));
}
VOP vec16 v_keep_from(vec16 v, int64_t from, float fill) {
    const __m256i n = _mm256_set1_epi32((int)(from < 0 ? 0 : from > 16 ? 16 : from));
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
    return V2(_mm256_blendv_ps(v.lo, _mm256_set1_ps(fill), lo), _mm256_blendv_ps(v.hi, _mm256_set1_ps(fill), hi));
}
static inline __m256 softcap8(__m256 v, float cap) {
    const __m256 x = _mm256_div_ps(v, _mm256_set1_ps(cap)), one = _mm256_set1_ps(1.0f);
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(signbit, x), _mm256_set1_ps(-2.0f)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(signbit, x)), _mm256_set1_ps(cap));
}
VOP vec16 v_softcap(vec16 v, float cap) { return V2(softcap8(v.lo, cap), softcap8(v.hi, cap)); }

static inline vec16 load16_f32(const float *p) { return v_load(p); }
static inline vec16 widen16(__m256i halves) { /* 16 float16 bit patterns */
    return V2(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)));
}
static inline vec16 load16_bf16(const uint16_t *p) {
    const __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 8));
    return V2(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
              _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
}
static inline vec16 load16_e5m2(const uint8_t *p) {
    return widen16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}
/* e4m3: as in the AVX-512 path */
static inline vec16 load16_e4m3(const uint8_t *p) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return widen16(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xbfff)));
}
#endif

/* Prefetches into L2 the 16 keys (or values) from key position nstart, elem bytes each: blocks
 * are scattered, so the hardware prefetcher cannot guess the next one. The keys pass of a
 * partition also prefetches the values of the keys it reads, which the values pass then finds
 * in L2 (a partition's values of one head are 32 KB in bfloat16): 64 decodes of 656 tokens
 * over 30 layers from memory, 72.8 -> 64.2 ms. NOTE: into L2 (T1), not
 * L1: 32-64 lines asked of L1 at once wait for its few miss buffers; a 64-request decode's
 * attention over 30 layers at 320 tokens took 32-52 ms with T0 and 25-28 ms with T1. The
 * bfloat16 kernel spreads them over its dot products instead where blocks hold 16 tokens: 64
 * prefetches in a row stalled the core until the memory took them (57% of the kernel's samples
 * on them), and the dot products meanwhile waited; spread, 30.2-30.7 -> 25.6-26.4 ms there
 * (Intel Xeon with AMX). */
static inline __attribute__((always_inline)) int64_t chunk_base(
        const int32_t *table, int64_t start, int64_t bs, int64_t block_stride, int64_t kh, int64_t head_dim) {
    return (int64_t)table[start / bs] * block_stride + kh * bs * head_dim;
}

static inline __attribute__((always_inline)) void prefetch_keys16(
        const char *key_cache, const int32_t *table, int64_t nstart, int64_t bs, int64_t block_stride, int64_t kh,
        int64_t head_dim, int64_t elem) {
    const int64_t nsub = nstart % bs;
    const char *next = key_cache + chunk_base(table, nstart, bs, block_stride, kh, head_dim) * elem;
    if (bs == 16) {
        for (int64_t off = 0; off < 16 * head_dim * elem; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
    } else if ((nsub * elem) % 64 == 0) {
        /* a new cache line in every key row */
        for (int64_t d = 0; d < head_dim; d++) _mm_prefetch(next + (nsub + d * bs) * elem, _MM_HINT_T1);
    }
}

static inline __attribute__((always_inline)) void prefetch_values16(
        const char *value_cache, const int32_t *table, int64_t nstart, int64_t bs, int64_t block_stride, int64_t kh,
        int64_t head_dim, int64_t elem) {
    const char *next = value_cache + (chunk_base(table, nstart, bs, block_stride, kh, head_dim) + nstart % bs * head_dim) * elem;
    for (int64_t off = 0; off < 16 * head_dim * elem; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
}

/* The softmax of a tile is taken in partitions of PARTITION keys, each in two passes: the
 * first computes the partition's scores (kept in float32 on the stack) and each row's maximum
 * with vector max, the second turns them into probabilities against that maximum and adds up
 * the values. So horizontal reductions and the accumulators' rescaling happen once a
 * partition, not once every 16 keys (an online softmax's cost, a third of a decode's
 * arithmetic), and each key and value is still read once per tile. */
#define PARTITION 256

/* The first key a row at position pos sees within a window of `window` keys (0: no window). */
static inline int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

/* The end of the partition that starts at key pstart: partitions end at multiples of PARTITION
 * (or at len) wherever a tile's loop starts, so a row's sums do not depend on its tile. */
static inline int64_t partition_end(int64_t pstart, int64_t len) {
    const int64_t end = (pstart / PARTITION + 1) * PARTITION;
    return end < len ? end : len;
}

/* Keeps 16 scores whose keys start at position start, -inf-like before the row's first key (of
 * its window) and past its last, and takes them into the row's running vector max. */
static inline __attribute__((always_inline)) void keep_scores(
        float *dst, vec16 scores, int64_t start, int64_t first, int64_t last, vec16 *vmax) {
    const int64_t seen = last - start + 1; /* keys of this chunk the row sees */
    vec16 masked = v_keep_first(scores, seen, MIN_SCORE);
    if (first > start) masked = v_keep_from(masked, first - start, MIN_SCORE);
    v_store(dst, masked);
    *vmax = v_max(*vmax, masked);
}

/* Between a partition's passes: each row's maximum m takes in the partition's (vmax); the sum l
 * and accumulators of earlier partitions are rescaled to it; the row's new sum starts at 0. */
static inline __attribute__((always_inline)) void begin_values_pass(
        const vec16 *vmax, float *m, float *l, vec16 acc[][FAST_MAX_CHUNKS], vec16 *mrow, vec16 *lsum,
        int64_t rows, int64_t chunks) {
    for (int64_t r = 0; r < rows; r++) {
        /* NOTE: not fmaxf: gcc calls it through the PLT, and the call spills every vector
         * register (the accumulators) around it */
        const float part_max = v_reduce_max(vmax[r]), new_max = part_max > m[r] ? part_max : m[r];
        if (new_max > m[r] && l[r] > 0) {
            const vec16 correction = v_exp(v_set1(m[r] - new_max));
            l[r] *= v_first(correction);
            for (int64_t c = 0; c < chunks; c++) acc[r][c] = v_mul(acc[r][c], correction);
        }
        m[r] = new_max;
        /* NOTE: a row with no key in the window yet (a tile's earlier rows start the loop) gets
         * probabilities of exactly 0 for its masked scores, not exp(0) */
        mrow[r] = v_set1(new_max > MIN_SCORE ? new_max : -MIN_SCORE);
        lsum[r] = v_zero();
    }
}

/* 16 probabilities from kept scores, added into the row's sum. A masked score (MIN_SCORE) gives
 * exactly 0: exp16 flushes inputs below -87 to 0. The row's maximum gives 1, so a row's sum
 * is at least 1 after the first partition that holds one of its keys. */
static inline __attribute__((always_inline)) vec16 probabilities16(const float *scores, vec16 mrow, vec16 *lsum) {
    const vec16 e = v_exp(v_sub(v_load(scores), mrow));
    *lsum = v_add(*lsum, e);
    return e;
}

/* The end of a partition's values pass: its sums into the rows' totals. */
static inline __attribute__((always_inline)) void end_values_pass(float *l, const vec16 *lsum, int64_t rows) {
    for (int64_t r = 0; r < rows; r++) l[r] += v_reduce_add(lsum[r]);
}

/* The tile's result: each row's accumulators over its softmax sum, and the log of that sum
 * (over scaled scores: m + log l, for merging with attention over other keys). */
static inline __attribute__((always_inline)) void store_rows(
        float *out, float *lse, vec16 acc[][FAST_MAX_CHUNKS], const float *m, const float *l, int64_t rows,
        int64_t chunks, int64_t head_dim) {
    for (int64_t r = 0; r < rows; r++) {
        lse[r] = l[r] > 0 ? m[r] + logf(l[r]) : -INFINITY;
        const vec16 inv = v_set1(l[r] > 0 ? 1.0f / l[r] : 0.0f);
        for (int64_t c = 0; c < chunks; c++) v_store(out + r * head_dim + c * 16, v_mul(acc[r][c], inv));
    }
}

/* A tile for block sizes that are multiples of 16, with vector registers: lanes are 16 key
 * tokens for the scores, and 16 consecutive head_dim entries for the values. The tile's rows
 * are tq consecutive query tokens (first at position first_pos) x group query heads; a tile
 * with fewer tokens (ntok < tq) repeats its last token, whose rows are computed but not kept. */
#define FAST_TASK(NAME, T, LOAD16, TK, LOADK16)                                                            \
static inline __attribute__((always_inline)) void NAME(                                                    \
        const T *qsrc, int64_t q_token_stride, const TK *key_cache, const TK *value_cache, const int32_t *table, \
        int64_t first_pos, int64_t ntok, float *out, float *lse, int64_t group, int64_t tq,              \
        int64_t head_dim, int64_t block_stride, int64_t kh, float scale, int64_t bs, int64_t window,      \
        float softcap) {                                                                                   \
    const int64_t chunks = head_dim / 16, rows = group * tq;                                               \
    const int64_t len = first_pos + ntok; /* keys the tile's last token sees */                           \
    const int64_t from = window_start(first_pos, window); /* the first key of the tile's first row */      \
    float q[FAST_MAX_ROWS][128];                                                                           \
    vec16 acc[FAST_MAX_ROWS][FAST_MAX_CHUNKS];                                                            \
    float m[FAST_MAX_ROWS], l[FAST_MAX_ROWS];                                                              \
    float scores[FAST_MAX_ROWS][PARTITION] __attribute__((aligned(64)));                                   \
    int64_t first[FAST_MAX_ROWS], last[FAST_MAX_ROWS]; /* the first and last key each row sees */          \
    for (int64_t j = 0; j < tq; j++) {                                                                     \
        const int64_t token = j < ntok ? j : ntok - 1;                                                     \
        for (int64_t g = 0; g < group; g++) {                                                              \
            const int64_t r = j * group + g;                                                               \
            const T *src = qsrc + token * q_token_stride + g * head_dim;                                   \
            for (int64_t c = 0; c < chunks; c++) {                                                         \
                v_store(&q[r][c * 16], v_mul(LOAD16(src + c * 16), v_set1(scale))); \
                acc[r][c] = v_zero();                                                           \
            }                                                                                              \
            m[r] = MIN_SCORE;                                                                              \
            l[r] = 0;                                                                                      \
            last[r] = first_pos + token;                                                                   \
            first[r] = window_start(last[r], window);                                                      \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t pstart = from / 16 * 16, pend; pstart < len; pstart = pend) {                             \
        pend = partition_end(pstart, len);                                                                 \
        vec16 vmax[FAST_MAX_ROWS], mrow[FAST_MAX_ROWS], lsum[FAST_MAX_ROWS];                              \
        for (int64_t r = 0; r < rows; r++) vmax[r] = v_set1(MIN_SCORE);                            \
        /* 16 keys at a time: the block's keys are [head_dim][bs], its values [bs][head_dim]. */         \
        for (int64_t start = pstart; start < pend; start += 16) {                                          \
            const TK *k = key_cache + chunk_base(table, start, bs, block_stride, kh, head_dim) + start % bs; \
            if (start + 16 < len)                                                                          \
                prefetch_keys16((const char *)key_cache, table, start + 16, bs, block_stride, kh, head_dim, \
                                sizeof(TK));                                                               \
            prefetch_values16((const char *)value_cache, table, start, bs, block_stride, kh, head_dim,     \
                              sizeof(TK));                                                                 \
            /* NOTE: two partial sums per row (even and odd dimensions), whatever the tile's rows:         \
             * one chain of head_dim dependent FMAs would be bound by their latency; a row's score         \
             * must not depend on how many rows share its tile (batch invariance: a decode's row,          \
             * a prefill chunk's, a verified draft's), and these are the sums of the AVX2 build's          \
             * prefill tiles (tile_attention.c), so a token's attention is the same either way. */         \
            vec16 s[FAST_MAX_ROWS], s1[FAST_MAX_ROWS];                                                     \
            for (int64_t r = 0; r < rows; r++) s[r] = s1[r] = v_zero();                                    \
            for (int64_t d = 0; d < head_dim; d += 2) {                                                    \
                const vec16 k0 = LOADK16(k + d * bs), k1 = LOADK16(k + (d + 1) * bs);                      \
                for (int64_t r = 0; r < rows; r++) {                                                       \
                    s[r] = v_fmadd(v_set1(q[r][d]), k0, s[r]);                                             \
                    s1[r] = v_fmadd(v_set1(q[r][d + 1]), k1, s1[r]);                                       \
                }                                                                                          \
            }                                                                                              \
            for (int64_t r = 0; r < rows; r++) s[r] = v_add(s[r], s1[r]);                                  \
            if (softcap > 0)                                                                               \
                for (int64_t r = 0; r < rows; r++) s[r] = v_softcap(s[r], softcap);                        \
            for (int64_t r = 0; r < rows; r++)                                                             \
                keep_scores(&scores[r][start - pstart], s[r], start, first[r], last[r], &vmax[r]);         \
        }                                                                                                  \
        begin_values_pass(vmax, m, l, acc, mrow, lsum, rows, chunks);                                      \
        for (int64_t start = pstart; start < pend; start += 16) {                                          \
            const int64_t n = len - start < 16 ? len - start : 16;                                         \
            const TK *v = value_cache + chunk_base(table, start, bs, block_stride, kh, head_dim)           \
                         + start % bs * head_dim;                                                          \
            if (start + 16 < len)                                                                          \
                prefetch_values16((const char *)value_cache, table, start + 16, bs, block_stride, kh,      \
                                  head_dim, sizeof(TK));                                                   \
            float p[FAST_MAX_ROWS][16];                                                                    \
            for (int64_t r = 0; r < rows; r++)                                                             \
                v_store(p[r], probabilities16(&scores[r][start - pstart], mrow[r], &lsum[r]));    \
            for (int64_t t = 0; t < n; t++) {                                                              \
                for (int64_t c = 0; c < chunks; c++) {                                                     \
                    const vec16 vv = LOADK16(v + t * head_dim + c * 16);                                  \
                    for (int64_t r = 0; r < rows; r++)                                                     \
                        acc[r][c] = v_fmadd(v_set1(p[r][t]), vv, acc[r][c]);               \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        end_values_pass(l, lsum, rows);                                                                    \
    }                                                                                                      \
    store_rows(out, lse, acc, m, l, rows, chunks, head_dim);                                                       \
}

FAST_TASK(fast_task_f32, float, load16_f32, float, load16_f32)
FAST_TASK(fast_task_f32_e5m2, float, load16_f32, uint8_t, load16_e5m2)
FAST_TASK(fast_task_f32_e4m3, float, load16_f32, uint8_t, load16_e4m3)
FAST_TASK(fast_task_bf16_e5m2, uint16_t, load16_bf16, uint8_t, load16_e5m2)
FAST_TASK(fast_task_bf16_e4m3, uint16_t, load16_bf16, uint8_t, load16_e4m3)

#if defined(__AVX512BF16__)
/* bfloat16 with AVX512-BF16 dot products (vdpbf16ps: two bf16 products added into each float32
 * lane, twice the work of an FMA per instruction): key rows d and d+1 are interleaved into
 * (token, d-pair) lanes against the query's (q[d], q[d+1]) pair; value rows t and t+1 into
 * (dim, t-pair) lanes against the probabilities (p[t], p[t+1]) rounded to bfloat16 (as torch's
 * flash attention rounds them for its second product). The interleave is one permute per
 * pair of rows, shared by every query row of the tile. Scores are scaled in float32 after the
 * product, so the queries stay exact. */
static inline __m512i pair_rows(const uint16_t *a, const uint16_t *b, __m512i index) {
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)), index,
                                     _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b)));
}

static inline __attribute__((always_inline)) void fast_task_bf16(
        const uint16_t *qsrc, int64_t q_token_stride, const uint16_t *key_cache, const uint16_t *value_cache,
        const int32_t *table, int64_t first_pos, int64_t ntok, float *out, float *lse, int64_t group, int64_t tq,
        int64_t head_dim, int64_t block_stride, int64_t kh, float scale, int64_t bs, int64_t window, float softcap) {
    const int64_t chunks = head_dim / 16, rows = group * tq;
    const int64_t len = first_pos + ntok, from = window_start(first_pos, window);
    uint32_t q[FAST_MAX_ROWS][64]; /* (q[2i], q[2i+1]) bf16 pairs */
    __m512 acc[FAST_MAX_ROWS][FAST_MAX_CHUNKS];
    float m[FAST_MAX_ROWS], l[FAST_MAX_ROWS];
    float scores[FAST_MAX_ROWS][PARTITION] __attribute__((aligned(64)));
    int64_t first[FAST_MAX_ROWS], last[FAST_MAX_ROWS];
    /* lane 2i takes a[i], lane 2i+1 takes b[i] (b's lanes are numbered from 32) */
    uint16_t pattern[32];
    for (int i = 0; i < 16; i++) { pattern[2 * i] = (uint16_t)i; pattern[2 * i + 1] = (uint16_t)(32 + i); }
    const __m512i interleave = _mm512_loadu_si512(pattern);
    for (int64_t j = 0; j < tq; j++) {
        const int64_t token = j < ntok ? j : ntok - 1;
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = j * group + g;
            memcpy(q[r], qsrc + token * q_token_stride + g * head_dim, head_dim * sizeof(uint16_t));
            for (int64_t c = 0; c < chunks; c++) acc[r][c] = _mm512_setzero_ps();
            m[r] = MIN_SCORE;
            l[r] = 0;
            last[r] = first_pos + token;
            first[r] = window_start(last[r], window);
        }
    }
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t pstart = from / 16 * 16, pend; pstart < len; pstart = pend) {
        pend = partition_end(pstart, len);
        __m512 vmax[FAST_MAX_ROWS], mrow[FAST_MAX_ROWS], lsum[FAST_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) vmax[r] = _mm512_set1_ps(MIN_SCORE);
        for (int64_t start = pstart; start < pend; start += 16) {
            const uint16_t *k = key_cache + chunk_base(table, start, bs, block_stride, kh, head_dim) + start % bs;
            /* With 16-token blocks, a head's 16 keys (or values) are 32 x head_dim contiguous bytes,
             * which the dot products below prefetch as they go, 32 bytes a dimension (see
             * prefetch_keys16): the keys two blocks ahead (in the first block, of the second too),
             * this block's values; else all at once here. */
            const char *next_keys = NULL, *second_keys = NULL, *values = NULL;
            if (bs == 16) {
                next_keys = start + 32 < len
                            ? (const char *)(key_cache + chunk_base(table, start + 32, bs, block_stride, kh, head_dim))
                            : NULL;
                if (start == from / 16 * 16 && start + 16 < len)
                    second_keys = (const char *)(key_cache + chunk_base(table, start + 16, bs, block_stride, kh,
                                                                        head_dim));
                values = (const char *)(value_cache + chunk_base(table, start, bs, block_stride, kh, head_dim));
            } else {
                if (start + 16 < len)
                    prefetch_keys16((const char *)key_cache, table, start + 16, bs, block_stride, kh, head_dim,
                                    sizeof(uint16_t));
                prefetch_values16((const char *)value_cache, table, start, bs, block_stride, kh, head_dim,
                                  sizeof(uint16_t));
            }
            /* NOTE: two partial sums per row (dimension pairs 4i and 4i + 2), whatever the tile's
             * rows: one chain of dependent dot products would be bound by their latency, and a
             * row's score must not depend on how many rows share its tile (batch invariance: a
             * decode's row, a prefill chunk's and a verified draft's are the same sums). */
            __m512 s[FAST_MAX_ROWS], s1[FAST_MAX_ROWS];
            for (int64_t r = 0; r < rows; r++) s[r] = s1[r] = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 4) {
                if (values) { /* the 128 bytes of dimensions d..d+3 */
                    for (int64_t line = 32 * d; next_keys && line < 32 * d + 128; line += 64)
                        _mm_prefetch(next_keys + line, _MM_HINT_T1);
                    for (int64_t line = 32 * d; second_keys && line < 32 * d + 128; line += 64)
                        _mm_prefetch(second_keys + line, _MM_HINT_T1);
                    _mm_prefetch(values + 32 * d, _MM_HINT_T1);
                    _mm_prefetch(values + 32 * d + 64, _MM_HINT_T1);
                }
                const __m512bh k0 = (__m512bh)pair_rows(k + d * bs, k + (d + 1) * bs, interleave);
                const __m512bh k1 = (__m512bh)pair_rows(k + (d + 2) * bs, k + (d + 3) * bs, interleave);
                for (int64_t r = 0; r < rows; r++) {
                    s[r] = _mm512_dpbf16_ps(s[r], k0, (__m512bh)_mm512_set1_epi32((int)q[r][d / 2]));
                    s1[r] = _mm512_dpbf16_ps(s1[r], k1, (__m512bh)_mm512_set1_epi32((int)q[r][d / 2 + 1]));
                }
            }
            for (int64_t r = 0; r < rows; r++) s[r] = _mm512_mul_ps(_mm512_add_ps(s[r], s1[r]), scale16);
            if (softcap > 0)
                for (int64_t r = 0; r < rows; r++) s[r] = v_softcap(s[r], softcap);
            for (int64_t r = 0; r < rows; r++)
                keep_scores(&scores[r][start - pstart], s[r], start, first[r], last[r], &vmax[r]);
        }
        begin_values_pass(vmax, m, l, acc, mrow, lsum, rows, chunks);
        for (int64_t start = pstart; start < pend; start += 16) {
            const int64_t n = len - start < 16 ? len - start : 16;
            const uint16_t *v = value_cache + chunk_base(table, start, bs, block_stride, kh, head_dim) + start % bs * head_dim;
            /* (with 16-token blocks, the keys pass prefetched every value) */
            if (start + 16 < len && bs != 16)
                prefetch_values16((const char *)value_cache, table, start + 16, bs, block_stride, kh, head_dim,
                                  sizeof(uint16_t));
            uint16_t pb[FAST_MAX_ROWS][16];
            for (int64_t r = 0; r < rows; r++) {
                const __m512 e = probabilities16(&scores[r][start - pstart], mrow[r], &lsum[r]);
                _mm256_storeu_si256((__m256i *)pb[r], (__m256i)_mm512_cvtneps_pbh(e));
            }
            int64_t t = 0;
            for (; t + 1 < n; t += 2) {
                for (int64_t c = 0; c < chunks; c++) {
                    const __m512bh vv = (__m512bh)pair_rows(v + t * head_dim + c * 16, v + (t + 1) * head_dim + c * 16,
                                                            interleave);
                    for (int64_t r = 0; r < rows; r++) {
                        uint32_t pair;
                        memcpy(&pair, &pb[r][t], sizeof(pair));
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv, (__m512bh)_mm512_set1_epi32((int)pair));
                    }
                }
            }
            if (t < n) {
                /* An odd last key: paired with a zero row (the next one may not be written yet),
                 * so that it is added as in a pair, with its probability in bfloat16: a row whose
                 * last key this is gets the sums it gets in a longer tile, where the next key
                 * comes with a probability of exactly 0. */
                static const uint16_t zeros[16] = {0};
                for (int64_t c = 0; c < chunks; c++) {
                    const __m512bh vv = (__m512bh)pair_rows(v + t * head_dim + c * 16, zeros, interleave);
                    for (int64_t r = 0; r < rows; r++)
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv, (__m512bh)_mm512_set1_epi32((int)pb[r][t]));
                }
            }
        }
        end_values_pass(l, lsum, rows);
    }
    store_rows(out, lse, acc, m, l, rows, chunks, head_dim);
}
#else
FAST_TASK(fast_task_bf16, uint16_t, load16_bf16, uint16_t, load16_bf16)
#endif

/* Query tokens per tile: as many as keep a tile's rows and accumulators in registers. */
static inline int64_t tile_tokens(int64_t group, int64_t head_dim) {
    const int64_t max_rows = head_dim <= 64 ? FAST_MAX_ROWS : FAST_MAX_ROWS / 2;
    return group >= max_rows ? 1 : max_rows / group;
}

/* Calls the task with the group size, tile tokens and head_dim as constants, so that the
 * compiler unrolls its loops and keeps the accumulators in registers. */
#define FAST_CASE(FAST, G, TQ, D)                                                                          \
    case ((G) * 100 + (TQ)) * 1000 + (D):                                                                  \
        FAST(qsrc, q_token_stride, key_cache, value_cache, table, first_pos, ntok, result, tile_lse, G, TQ, \
             D, block_stride, kh, scale, block_size, window, softcap);                                     \
        break;

/* The shapes with a copy of their own: group size x tile tokens for head_dim 64 and 128. On
 * AVX2, whose 16 lanes are two registers, only the decodes' (each copy costs seconds of the
 * library's build); other tiles take the default, with their sizes as variables. */
#if defined(__AVX512F__)
#define FAST_CASES(FAST)                                                                                   \
    FAST_CASE(FAST, 1, 1, 64) FAST_CASE(FAST, 2, 1, 64) FAST_CASE(FAST, 3, 1, 64) FAST_CASE(FAST, 4, 1, 64)  \
    FAST_CASE(FAST, 8, 1, 64) FAST_CASE(FAST, 1, 8, 64) FAST_CASE(FAST, 2, 4, 64) FAST_CASE(FAST, 3, 2, 64)  \
    FAST_CASE(FAST, 4, 2, 64) FAST_CASE(FAST, 1, 1, 128) FAST_CASE(FAST, 2, 1, 128) FAST_CASE(FAST, 4, 1, 128) \
    FAST_CASE(FAST, 8, 1, 128) FAST_CASE(FAST, 1, 4, 128) FAST_CASE(FAST, 2, 2, 128)
#else
#define FAST_CASES(FAST)
#endif

#define FAST_PATH(T, STORE, FAST)                                                                          \
    if (block_size % 16 == 0 && head_dim % 16 == 0 && head_dim <= 128 && group <= FAST_MAX_ROWS) {          \
        const int64_t tq = tile_tokens(group, head_dim);                                                   \
        /* The tiles: (request, first query row) pairs; decodes are one tile each. */                     \
        int32_t *tile_req = malloc(2 * sizeof(int32_t) * (size_t)(query_start[num_reqs] + 1));             \
        int32_t *tile_row = tile_req + query_start[num_reqs] + 1;                                          \
        if (tile_req != NULL) { /* else the generic path */                                                \
            int64_t num_tiles = 0;                                                                         \
            for (int64_t i = 0; i < num_reqs; i++) {                                                       \
                if (skip && skip[i]) continue; /* another kernel's */                                      \
                const int64_t step = query_start[i + 1] - query_start[i] == 1 ? 1 : tq;                    \
                for (int64_t row = query_start[i]; row < query_start[i + 1]; row += step) {                \
                    tile_req[num_tiles] = (int32_t)i;                                                      \
                    tile_row[num_tiles++] = (int32_t)row;                                                  \
                }                                                                                          \
            }                                                                                              \
            /* Where there are tiles enough for every thread, a tile's KV heads in a row on one   \
             * thread: its keys (and values) of one block lie together, head after head (64       \
             * decodes over 30 layers, 320 tokens: 25.8 -> 23.0 ms; 96 tokens: 7.0 -> 6.2 ms, with \
             * the heads dealt one by one; Intel Xeon with AMX). A few tiles keep them dealt. */  \
            const int64_t heads_in_a_row = num_tiles >= 4 * omp_get_max_threads() ? num_kv_heads : 1;     \
            _Pragma("omp parallel for schedule(dynamic, heads_in_a_row) collapse(2)")                       \
            for (int64_t tile = 0; tile < num_tiles; tile++) {                                             \
                for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                            \
                    float result[FAST_MAX_ROWS * 128], tile_lse[FAST_MAX_ROWS];                            \
                    const int64_t i = tile_req[tile], row = tile_row[tile];                                \
                    const int64_t end = query_start[i + 1];                                                \
                    const int64_t ntok = end - row < tq ? end - row : tq;                                  \
                    const int64_t tile_tq = end - query_start[i] == 1 ? 1 : tq;                            \
                    const int32_t *table = block_tables + i * block_table_stride;                          \
                    const int64_t first_pos = seq_lens[i] - (end - row);                                   \
                    const int64_t q_token_stride = num_heads * head_dim;                                   \
                    const T *qsrc = query + (row * num_heads + kh * group) * head_dim;                     \
                    switch ((group * 100 + tile_tq) * 1000 + head_dim) {                                   \
                        FAST_CASES(FAST)                                                                   \
                        default:                                                                           \
                            FAST(qsrc, q_token_stride, key_cache, value_cache, table, first_pos, ntok,     \
                                 result, tile_lse, group, tile_tq, head_dim, block_stride, kh, scale,      \
                                 block_size, window, softcap);                                             \
                    }                                                                                      \
                    for (int64_t j = 0; j < ntok; j++) {                                                   \
                        T *dst = out + ((row + j) * num_heads + kh * group) * head_dim;                    \
                        const float *src = result + j * group * head_dim;                                  \
                        for (int64_t e = 0; e < group * head_dim; e++) dst[e] = STORE(src[e] * value_scale); \
                        if (lse)                                                                           \
                            for (int64_t g = 0; g < group; g++)                                            \
                                lse[(row + j) * num_heads + kh * group + g] = tile_lse[j * group + g];     \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            free(tile_req);                                                                                \
            return;                                                                                        \
        }                                                                                                  \
    }
#else
#define FAST_PATH(T, STORE, FAST)
#endif

/* value_scale multiplies the output (an fp8 cache's factor for its values; 1 otherwise); the
 * keys' factor is in scale. */
#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE, FAST, TK, LOADK)                                      \
void NAME(const T *query, const TK *key_cache, const TK *value_cache, const int32_t *block_tables,          \
          int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, T *out,           \
          float *lse, const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,        \
          int64_t head_dim, int64_t block_size, float scale, float value_scale, int64_t window, float softcap) { \
    const int64_t group = num_heads / num_kv_heads;                                                        \
    const int64_t block_stride = num_kv_heads * block_size * head_dim;                                     \
    FAST_PATH(T, STORE, FAST)                                                                              \
    const int64_t num_rows = query_start[num_reqs];                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1) collapse(2)")                                            \
    for (int64_t row = 0; row < num_rows; row++) {                                                         \
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                                    \
            const int64_t i = request_of_row(query_start, num_reqs, row);                                  \
            if (skip && skip[i]) continue;                                                                 \
            const int32_t *table = block_tables + i * block_table_stride;                                  \
            const int64_t len = seq_lens[i] - (query_start[i + 1] - row) + 1;                              \
            const int64_t first = window > 0 && len > window ? len - window : 0;                           \
            if (block_size == 16) { TASK_BODY(T, LOAD, STORE, TK, LOADK, 16) }                             \
            else { TASK_BODY(T, LOAD, STORE, TK, LOADK, block_size) }                                      \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, fast_task_bf16, uint16_t, bf16_to_f32)
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, f32_id, f32_id, fast_task_f32, float, f32_id)
DEFINE_PAGED_ATTENTION(paged_attention_bf16_e5m2, uint16_t, bf16_to_f32, f32_to_bf16, fast_task_bf16_e5m2, uint8_t,
                       e5m2_to_f32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16_e4m3, uint16_t, bf16_to_f32, f32_to_bf16, fast_task_bf16_e4m3, uint8_t,
                       e4m3_to_f32)
DEFINE_PAGED_ATTENTION(paged_attention_f32_e5m2, float, f32_id, f32_id, fast_task_f32_e5m2, uint8_t, e5m2_to_f32)
DEFINE_PAGED_ATTENTION(paged_attention_f32_e4m3, float, f32_id, f32_id, fast_task_f32_e4m3, uint8_t, e4m3_to_f32)
