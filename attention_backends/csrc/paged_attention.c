/*
 * Paged decode attention for the CPU: one query token per request, read from the KV
 * blocks in place (no gather, no padding to the longest request).
 *
 * Layout (the cpu_paged backend's cache):
 *   query, out:     [num_reqs, num_heads, head_dim]
 *   key cache:      [num_blocks, num_kv_heads, head_dim, block_size]  (keys transposed per block)
 *   value cache:    [num_blocks, num_kv_heads, block_size, head_dim]
 *   block_tables:   [num_reqs, block_table_stride] int32
 *   seq_lens:       [num_reqs] int32 (tokens of context, the new one included)
 *
 * Each (request, KV head) is one task: its query heads (num_heads / num_kv_heads of them)
 * walk the request's blocks once with an online softmax in float32, so every key and
 * value is read from memory once per step. Keys are stored transposed within a block so
 * that a block's scores are computed token-parallel (vector lanes over the block's
 * tokens, no horizontal sums); values are accumulated lane-parallel over head_dim.
 *
 * Tasks are spread over OpenMP threads; torch's own libgomp is already loaded when this
 * library is, so both share one thread pool. Built on first use by
 * attention_backends/cpu_kernels.py with the machine's C compiler.
 */
#include <math.h>
#include <stdint.h>

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

/* One (request, KV head) task for a block size known at compile time (BS) or not (bs). */
#define TASK_BODY(T, LOAD, STORE, BS)                                                                      \
    float q[group][head_dim], acc[group][head_dim], m[group], l[group];                                    \
    float s[group][BS], krow[BS], vrow[head_dim];                                                          \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        const T *src = query + (r * num_heads + kh * group + g) * head_dim;                                \
        for (int64_t d = 0; d < head_dim; d++) { q[g][d] = LOAD(src[d]) * scale; acc[g][d] = 0; }         \
        m[g] = MIN_SCORE;                                                                                  \
        l[g] = 0;                                                                                          \
    }                                                                                                      \
    const int32_t *table = block_tables + r * block_table_stride;                                          \
    const int64_t len = seq_lens[r];                                                                       \
    for (int64_t start = 0; start < len; start += BS) {                                                    \
        const int64_t n = len - start < BS ? len - start : BS;                                             \
        const int64_t base = (int64_t)table[start / BS] * block_stride + kh * BS * head_dim;              \
        const T *k = key_cache + base;                                                                     \
        const T *v = value_cache + base;                                                                   \
        for (int64_t g = 0; g < group; g++)                                                                \
            for (int64_t t = 0; t < BS; t++) s[g][t] = 0;                                                  \
        for (int64_t d = 0; d < head_dim; d++) {                                                           \
            for (int64_t t = 0; t < BS; t++) krow[t] = LOAD(k[d * BS + t]);                                \
            for (int64_t g = 0; g < group; g++) {                                                          \
                const float qd = q[g][d];                                                                  \
                for (int64_t t = 0; t < BS; t++) s[g][t] += qd * krow[t];                                  \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t g = 0; g < group; g++) {                                                              \
            float block_max = m[g];                                                                        \
            for (int64_t t = 0; t < n; t++) block_max = s[g][t] > block_max ? s[g][t] : block_max;         \
            const float correction = expf(m[g] - block_max);                                               \
            float sum = 0;                                                                                 \
            for (int64_t t = 0; t < BS; t++) {                                                             \
                const float p = t < n ? expf(s[g][t] - block_max) : 0.0f;                                  \
                s[g][t] = p;                                                                               \
                sum += p;                                                                                  \
            }                                                                                              \
            l[g] = l[g] * correction + sum;                                                                \
            m[g] = block_max;                                                                              \
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;                                \
        }                                                                                                  \
        for (int64_t t = 0; t < n; t++) {                                                                  \
            for (int64_t d = 0; d < head_dim; d++) vrow[d] = LOAD(v[t * head_dim + d]);                    \
            for (int64_t g = 0; g < group; g++) {                                                          \
                const float p = s[g][t];                                                                   \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * vrow[d];                           \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        T *dst = out + (r * num_heads + kh * group + g) * head_dim;                                        \
        const float inv = l[g] > 0 ? 1.0f / l[g] : 0.0f;                                                   \
        for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[g][d] * inv);                            \
    }

#if defined(__AVX512F__)
#include <immintrin.h>

/* glibc's libmvec: 16 expf at once (what gcc's vectorizer calls). */
__m512 _ZGVeN16v_expf(__m512 x);

#define FAST_MAX_GROUP 8
#define FAST_MAX_CHUNKS 8 /* head_dim up to 128 */

static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

/* The task for block sizes that are multiples of 16, with vector registers: lanes are 16 tokens for
 * the scores, and 16 consecutive head_dim entries for the values. */
#define FAST_TASK(T, LOAD16)                                                                               \
static inline __attribute__((always_inline)) void NAME_FAST_##T(const T *query, const T *key_cache, const T *value_cache, const int32_t *table,   \
                          int64_t len, float *out, int64_t group, int64_t head_dim, int64_t block_stride,   \
                          int64_t kh, float scale, const T *qsrc, int64_t bs) {                             \
    const int64_t chunks = head_dim / 16;                                                                  \
    float q[FAST_MAX_GROUP][128];                                                                          \
    __m512 acc[FAST_MAX_GROUP][FAST_MAX_CHUNKS];                                                           \
    float m[FAST_MAX_GROUP], l[FAST_MAX_GROUP];                                                            \
    float p[FAST_MAX_GROUP][16];                                                                           \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        for (int64_t c = 0; c < chunks; c++) {                                                             \
            _mm512_storeu_ps(&q[g][c * 16], _mm512_mul_ps(LOAD16(qsrc + g * head_dim + c * 16),            \
                                                          _mm512_set1_ps(scale)));                          \
            acc[g][c] = _mm512_setzero_ps();                                                               \
        }                                                                                                  \
        m[g] = MIN_SCORE;                                                                                  \
        l[g] = 0;                                                                                          \
    }                                                                                                      \
    for (int64_t start = 0; start < len; start += 16) {                                                    \
        const int64_t n = len - start < 16 ? len - start : 16;                                             \
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);                                               \
        /* 16 tokens at a time: the block's keys are [head_dim][bs], its values [bs][head_dim]. */       \
        const int64_t base = (int64_t)table[start / bs] * block_stride + kh * bs * head_dim;               \
        const int64_t sub = start % bs;                                                                    \
        const T *k = key_cache + base + sub;                                                               \
        const T *v = value_cache + base + sub * head_dim;                                                  \
        if (start + 16 < len) {                                                                            \
            /* NOTE: blocks are scattered, so the hardware prefetcher cannot guess the next   \
             * one: ask for the next 16 tokens while these are computed. */                               \
            const int64_t nstart = start + 16, nsub = nstart % bs;                                         \
            const int64_t next = (int64_t)table[nstart / bs] * block_stride + kh * bs * head_dim;          \
            const char *nv = (const char *)(value_cache + next + nsub * head_dim);                         \
            for (int64_t off = 0; off < 16 * head_dim * (int64_t)sizeof(T); off += 64)                     \
                _mm_prefetch(nv + off, _MM_HINT_T0);                                                       \
            if (bs == 16) {                                                                                \
                const char *nk = (const char *)(key_cache + next);                                         \
                for (int64_t off = 0; off < 16 * head_dim * (int64_t)sizeof(T); off += 64)                 \
                    _mm_prefetch(nk + off, _MM_HINT_T0);                                                   \
            } else if (nsub % (64 / (int64_t)sizeof(T)) == 0) {                                            \
                /* a new cache line in every key row */                                                    \
                for (int64_t d = 0; d < head_dim; d++)                                                     \
                    _mm_prefetch((const char *)(key_cache + next + nsub + d * bs), _MM_HINT_T0);           \
            }                                                                                              \
        }                                                                                                  \
        /* NOTE: four partial sums per head: one chain of head_dim dependent FMAs would be    \
         * bound by their latency, not by the FMA units. */                                               \
        __m512 s[FAST_MAX_GROUP], s1[FAST_MAX_GROUP], s2[FAST_MAX_GROUP], s3[FAST_MAX_GROUP];              \
        for (int64_t g = 0; g < group; g++)                                                                \
            s[g] = s1[g] = s2[g] = s3[g] = _mm512_setzero_ps();                                            \
        for (int64_t d = 0; d < head_dim; d += 4) {                                                        \
            const __m512 k0 = LOAD16(k + d * bs), k1 = LOAD16(k + (d + 1) * bs);                           \
            const __m512 k2 = LOAD16(k + (d + 2) * bs), k3 = LOAD16(k + (d + 3) * bs);                     \
            for (int64_t g = 0; g < group; g++) {                                                          \
                s[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d]), k0, s[g]);                                 \
                s1[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d + 1]), k1, s1[g]);                           \
                s2[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d + 2]), k2, s2[g]);                           \
                s3[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d + 3]), k3, s3[g]);                           \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t g = 0; g < group; g++)                                                                \
            s[g] = _mm512_add_ps(_mm512_add_ps(s[g], s1[g]), _mm512_add_ps(s2[g], s3[g]));                 \
        for (int64_t g = 0; g < group; g++) {                                                              \
            const __m512 masked = _mm512_mask_blend_ps(valid, _mm512_set1_ps(MIN_SCORE), s[g]);            \
            const float block_max = fmaxf(m[g], _mm512_reduce_max_ps(masked));                             \
            const float correction = expf(m[g] - block_max);                                               \
            __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(masked, _mm512_set1_ps(block_max)));                   \
            e = _mm512_maskz_mov_ps(valid, e);                                                             \
            l[g] = l[g] * correction + _mm512_reduce_add_ps(e);                                            \
            m[g] = block_max;                                                                              \
            _mm512_storeu_ps(p[g], e);                                                                     \
            const __m512 corr = _mm512_set1_ps(correction);                                                \
            for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], corr);               \
        }                                                                                                  \
        for (int64_t t = 0; t < n; t++) {                                                                  \
            for (int64_t c = 0; c < chunks; c++) {                                                         \
                const __m512 vv = LOAD16(v + t * head_dim + c * 16);                                       \
                for (int64_t g = 0; g < group; g++)                                                        \
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), vv, acc[g][c]);                   \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        const __m512 inv = _mm512_set1_ps(l[g] > 0 ? 1.0f / l[g] : 0.0f);                                  \
        for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(out + g * head_dim + c * 16,                 \
                                                              _mm512_mul_ps(acc[g][c], inv));              \
    }                                                                                                      \
}

#define NAME_FAST_uint16_t fast_task_bf16
#define NAME_FAST_float fast_task_f32
FAST_TASK(uint16_t, load16_bf16)
FAST_TASK(float, load16_f32)

/* Calls the task with the group size and head_dim (and a block size of 16) as constants, so
 * that the compiler unrolls its loops and keeps the accumulators in registers. */
#define FAST_CASE(FAST, G, D)                                                                              \
    case 1000000 + (G) * 1000 + (D):                                                                       \
        FAST(query, key_cache, value_cache, table, len, result, G, D, block_stride, kh, scale, qsrc, 16);  \
        break;                                                                                             \
    case (G) * 1000 + (D):                                                                                 \
        FAST(query, key_cache, value_cache, table, len, result, G, D, block_stride, kh, scale, qsrc,       \
             block_size);                                                                                  \
        break;

#define FAST_PATH(T, STORE, FAST)                                                                          \
    if (block_size % 16 == 0 && head_dim % 16 == 0 && head_dim <= 128 && group <= FAST_MAX_GROUP) {         \
        _Pragma("omp parallel for schedule(dynamic, 1) collapse(2)")                                        \
        for (int64_t r = 0; r < num_reqs; r++) {                                                           \
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                                \
                float result[FAST_MAX_GROUP * 128];                                                        \
                const int32_t *table = block_tables + r * block_table_stride;                              \
                const int64_t len = seq_lens[r];                                                           \
                const T *qsrc = query + (r * num_heads + kh * group) * head_dim;                           \
                switch ((block_size == 16) * 1000000 + group * 1000 + head_dim) {                          \
                    FAST_CASE(FAST, 1, 64) FAST_CASE(FAST, 2, 64) FAST_CASE(FAST, 3, 64)                   \
                    FAST_CASE(FAST, 4, 64) FAST_CASE(FAST, 8, 64) FAST_CASE(FAST, 1, 128)                  \
                    FAST_CASE(FAST, 2, 128) FAST_CASE(FAST, 4, 128) FAST_CASE(FAST, 8, 128)                \
                    default:                                                                               \
                        FAST(query, key_cache, value_cache, table, len, result, group, head_dim,           \
                             block_stride, kh, scale, qsrc, block_size);                                   \
                }                                                                                          \
                T *dst = out + (r * num_heads + kh * group) * head_dim;                                    \
                for (int64_t i = 0; i < group * head_dim; i++) dst[i] = STORE(result[i]);                  \
            }                                                                                              \
        }                                                                                                  \
        return;                                                                                            \
    }
#else
#define FAST_PATH(T, STORE, FAST)
#endif

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE, FAST)                                                    \
void NAME(const T *query, const T *key_cache, const T *value_cache, const int32_t *block_tables,            \
          int64_t block_table_stride, const int32_t *seq_lens, T *out, int64_t num_reqs, int64_t num_heads,  \
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {                         \
    const int64_t group = num_heads / num_kv_heads;                                                        \
    const int64_t block_stride = num_kv_heads * block_size * head_dim;                                     \
    FAST_PATH(T, STORE, FAST)                                                                              \
    if (block_size == 16) {                                                                                \
        _Pragma("omp parallel for schedule(dynamic, 1) collapse(2)")                                        \
        for (int64_t r = 0; r < num_reqs; r++)                                                             \
            for (int64_t kh = 0; kh < num_kv_heads; kh++) { TASK_BODY(T, LOAD, STORE, 16) }                \
    } else {                                                                                               \
        _Pragma("omp parallel for schedule(dynamic, 1) collapse(2)")                                        \
        for (int64_t r = 0; r < num_reqs; r++)                                                             \
            for (int64_t kh = 0; kh < num_kv_heads; kh++) { TASK_BODY(T, LOAD, STORE, block_size) }        \
    }                                                                                                      \
}

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, fast_task_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, f32_id, f32_id, fast_task_f32)
