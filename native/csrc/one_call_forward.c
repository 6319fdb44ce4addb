/*
 * A whole step (decodes, prefill chunks or both) through a Llama-family model whose linear
 * layers all run Pagoda's own kernels (quant_linear.c's quantized weights, packed_linear.c's
 * bfloat16 ones), in one call from Python.
 *
 * The usual path runs the model as compiled regions between the attention calls: around each
 * product there is glue (the regions' guards and wrappers, the ops' dispatch from Python, the
 * second thread spinning while the first runs that Python), which in a decode step costs as
 * much as the small products or more (a Q8_0 step of the default model: about 11 of 16 ms) and
 * in a prefill step about a tenth of it. Here the same sequence of operations runs as C: the
 * element-wise steps (the residual add with RMSNorm, RoPE, SiLU-mul) row by row, spread over
 * the threads from PARALLEL_ROWS rows, the products, the KV write and the attention with the
 * kernels' own OpenMP loops, back to back.
 *
 * Numerics follow the compiled path: the hidden state and each product's input and output in
 * bfloat16, every element-wise step computed in float32 from its bfloat16 inputs and rounded
 * once; the products, the KV write and the attention are the same kernels.
 *
 * Layers are described by an array of struct forward_layer (every field 8 bytes, so Python
 * builds the array as an int64 tensor).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "pagoda_kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vector_lanes.h"
#include "work_share.h"

/* A product's packed weight: QUANTIZED (a: bits, b: with minimums + 2 x the rows from which
 * AMX tiles run) or BLOCKED bfloat16 (a: the rows from which AMX tiles run; gate/up packed
 * for the SiLU-mul epilogue). */
enum { QUANTIZED = 0, BLOCKED = 1 };
struct layer_product {
    const void *weight;
    int64_t kind, a, b;
};

/* A mixture-of-experts layer (engine/models/moe.py's SparseMoE): its router's product (bfloat16
 * logits [tokens, num_experts]; unused where the caller routes), expert 0's gate/up (packed for
 * the SiLU-mul epilogue where BLOCKED) and down products, expert e's weights gate_up_stride and
 * down_stride bytes further on each; top_k experts a token, their weights renormalized to sum to
 * 1 where norm_topk_prob. */
struct moe_layer {
    struct layer_product router, gate_up, down;
    int64_t gate_up_stride, down_stride, num_experts, top_k, norm_topk_prob, intermediate;
};

struct forward_layer {
    const uint16_t *input_norm, *post_norm; /* bfloat16 [hidden] */
    struct layer_product qkv, o, gate_up, down;
    const void *qkv_bias; /* [q + 2 kv] or NULL: float32 for a quantized product, else bfloat16 */
    uint16_t *key_cache, *value_cache;
    const uint16_t *q_norm, *k_norm; /* bfloat16 [head_dim]: an RMS norm per query and key head, or NULL */
    const struct moe_layer *moe;     /* a mixture of experts in place of gate_up and down, or NULL */
};

/* LoRA slots of one projection (engine/models/lora.py): slot s's A at a + s * a_stride (packed
 * [width, in]) and its B at b + s * b_stride (packed [out, width]), in packed_linear's layout,
 * bfloat16; NULL a: the projection has none. Of the width (a multiple of 32, for the AMX tiles),
 * the first `used` columns are the parts' ranks, the rest zero. Products of tile_rows rows or
 * more on AMX tiles (0: never). */
struct lora_product {
    const uint16_t *a, *b;
    int64_t a_stride, b_stride, width, used, tile_rows;
};

struct lora_layer {
    struct lora_product qkv, o, gate_up, down;
};

/* Runs of LoRA rows shorter than this (decodes) share one parallel region per projection. */
#define LORA_FEW_ROWS 16

/* Rows from which the element-wise steps are spread over the threads. */
#define PARALLEL_ROWS 8

/* Cache lines are 64 bytes: the kernels' operands start on one (an AMX tile's rows each one line). */
#define LINE 64

static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t to_bf(float f) { /* to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __AVX512F__
static inline __m512 bf16x16(const uint16_t *p, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

/* to_bf for sixteen lanes */
static inline __m256i to_bf16x16(__m512 v) {
#ifdef __AVX512BF16__
    /* the instruction rounds to nearest even and quiets NaNs as to_bf does, but takes subnormal
     * inputs for zeros: those vectors (rare) take the integer path */
    const __mmask16 subnormal = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ)
                                & _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (!subnormal) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    rounded = _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* sixteen floats rounded to bfloat16 and back */
static inline __m512 rounded16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}

#endif

/* A row of add_rms_norm; `row` float scratch of n (rounded to a multiple of 16) values. */
static void norm_row(uint16_t *h, const uint16_t *y, const uint16_t *weight, int64_t n, float eps, uint16_t *out,
                     float *row) {
#ifdef __AVX512F__
    __m512 sums = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = first_lanes16(n - i);
        __m512 v = bf16x16(h + i, mask);
        if (y) {
            v = rounded16(_mm512_add_ps(v, bf16x16(y + i, mask)));
            _mm256_mask_storeu_epi16(h + i, mask, to_bf16x16(v));
        }
        _mm512_store_ps(row + i, v);
        sums = _mm512_fmadd_ps(v, v, sums);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sums) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 normed = rounded16(_mm512_mul_ps(_mm512_load_ps(row + i), inv));
        const __mmask16 mask = first_lanes16(n - i);
        _mm256_mask_storeu_epi16(out + i, mask, to_bf16x16(_mm512_mul_ps(bf16x16(weight + i, mask), normed)));
    }
#else
    (void)row;
    if (y)
        for (int64_t i = 0; i < n; i++) h[i] = to_bf(bf(h[i]) + bf(y[i]));
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += bf(h[i]) * bf(h[i]);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = to_bf(bf(weight[i]) * bf(to_bf(bf(h[i]) * inv)));
#endif
}

/* Each row: h += y (unless y is NULL), rounded to bfloat16, then out = weight * bf16(h *
 * rsqrt(mean(h^2) + eps)), as the residual add and RMSNorm in engine/models/llama.py. */
static void add_rms_norm(uint16_t *h, const uint16_t *y, const uint16_t *weight, int64_t rows, int64_t n, float eps,
                         uint16_t *out) {
#pragma omp parallel if (rows >= PARALLEL_ROWS)
    {
        float row[(n + 15) / 16 * 16] __attribute__((aligned(LINE))); /* a hidden state's width: a few KB */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) norm_row(h + r * n, y ? y + r * n : NULL, weight, n, eps, out + r * n, row);
    }
}

/* RoPE (rotate-half) on `heads` heads of head_dim from x into out (which may be x), cos/sin
 * rounded to bfloat16 as the model does. */
static void rope(const uint16_t *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin,
                 uint16_t *out) {
    const int64_t half = head_dim / 2;
#ifdef __AVX512F__
    if (half % 16 == 0 && half <= 64) {
        __m512 c[4], s[4];
        for (int64_t j = 0; j < half / 16; j++) {
            c[j] = rounded16(_mm512_loadu_ps(cos + 16 * j));
            s[j] = rounded16(_mm512_loadu_ps(sin + 16 * j));
        }
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *v = x + h * head_dim;
            uint16_t *o = out + h * head_dim;
            for (int64_t j = 0; j < half / 16; j++) {
                const __m512 x1 = bf16x16(v + 16 * j, 0xffff), x2 = bf16x16(v + half + 16 * j, 0xffff);
                const __m256i lo = to_bf16x16(_mm512_sub_ps(_mm512_mul_ps(x1, c[j]), _mm512_mul_ps(x2, s[j])));
                const __m256i hi = to_bf16x16(_mm512_add_ps(_mm512_mul_ps(x2, c[j]), _mm512_mul_ps(x1, s[j])));
                _mm256_storeu_si256((__m256i *)(o + 16 * j), lo);
                _mm256_storeu_si256((__m256i *)(o + half + 16 * j), hi);
            }
        }
        return;
    }
#endif
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *v = x + h * head_dim;
        uint16_t *o = out + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float c = bf(to_bf(cos[i])), s = bf(to_bf(sin[i])), x1 = bf(v[i]), x2 = bf(v[i + half]);
            o[i] = to_bf(x1 * c - x2 * s);
            o[i + half] = to_bf(x2 * c + x1 * s);
        }
    }
}

static int product(const uint16_t *x, int64_t rows, int64_t k, const struct layer_product *p, int64_t n,
                   const void *bias, uint16_t *y) {
    if (p->kind == BLOCKED) {
        packed_linear_bf16(x, rows, k, p->weight, n, k, bias, y, n, p->a, 0);
        return 0;
    }
    return quant_linear(x, rows, k, 0, k, p->weight, (int)p->a, (int)(p->b & 1), n, bias, y, n, 0, p->b >> 1);
}

#ifdef __AVX512F__
/* torch's own sixteen-lane exp (SLEEF's Sleef_expf16_u10 in libtorch_cpu), handed over from
 * Python where torch's vector kernels use it: SiLU then takes sixteen elements a call and
 * gives what torch's vectorized SiLU gives (x / (1 + exp(-x)); inductor's compiled code
 * computes it so) bit for bit. Without it, expf per element:
 * six times the time (240 against 40 us a layer at 64 rows on a Zen 4, 6 ms of an ~85 ms step). */
typedef __m512 (*exp16_fn)(__m512);
static exp16_fn torch_exp16;

int one_call_forward_set_exp16(void *fn) {
    torch_exp16 = (exp16_fn)fn;
    return 1;
}

/* the last chunk of a row masked, so any n takes the same exp */
static void silu_mul_row16(exp16_fn exp16, const uint16_t *gate, const uint16_t *up, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = first_lanes16(n - i);
        const __m512 g = bf16x16(gate + i, mask);
        const __m512 e = exp16(_mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm256_mask_storeu_epi16(out + i, mask, to_bf16x16(_mm512_mul_ps(s, bf16x16(up + i, mask))));
    }
}
#else
int one_call_forward_set_exp16(void *fn) {
    (void)fn;
    return 0;
}
#endif

/* act [rows, intermediate] = SiLU(gate) * up, rounded to bfloat16, from gate_up [rows, 2 *
 * intermediate] (bfloat16, each row's gate then its up). */
void silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t intermediate, uint16_t *act) {
#ifdef __AVX512F__
    const exp16_fn exp16 = torch_exp16; /* one exp for the whole call */
#endif
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * intermediate, *up = gate + intermediate;
#ifdef __AVX512F__
        if (exp16) {
            silu_mul_row16(exp16, gate, up, intermediate, act + r * intermediate);
            continue;
        }
#endif
        for (int64_t i = 0; i < intermediate; i++) {
            const float g = bf(gate[i]);
            act[r * intermediate + i] = to_bf(g / (1.0f + expf(-g)) * bf(up[i]));
        }
    }
}

/* act [M, I] = SiLU(gate) * up of x's product with a quantized gate/up weight [2I, K]: on AMX
 * tiles where quant_silu_mul_tiles takes it, else quant_linear into gate_up (a [M, 2I] scratch,
 * or NULL: allocated here) and silu_mul_bf16. Returns 0, or -1 if memory ran out. */
int quant_silu_mul_linear(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int bits,
                          int has_min, int64_t I, uint16_t *act, int64_t amx_min_rows, uint16_t *gate_up) {
    const int tiles = quant_silu_mul_tiles(x, M, ldx, K, w, bits, has_min, I, act, amx_min_rows);
    if (tiles) return tiles < 0 ? -1 : 0;
    uint16_t *scratch = gate_up ? gate_up : malloc((size_t)(M * 2 * I) * sizeof(uint16_t));
    const int failed = !scratch || quant_linear(x, M, ldx, 0, K, w, bits, has_min, 2 * I, NULL, scratch, 2 * I, 0,
                                                amx_min_rows);
    if (!failed) silu_mul_bf16(scratch, M, I, act);
    if (!gate_up) free(scratch);
    return failed ? -1 : 0;
}

/* y [rows, n] += each LoRA segment's delta: for segment (slot, start, end), rows start..end of
 * (x @ A.T, rounded to bfloat16) @ B.T, added to y in float32 and rounded once (the product's
 * ADD_BF16 epilogue). t: [rows, width] bfloat16 scratch. */
static void lora_add(const uint16_t *x, int64_t k, const struct lora_product *p, const int64_t *segments,
                     int64_t num_segments, int64_t n, uint16_t *y, uint16_t *t) {
    if (!p->a) return;
    int64_t few = 0; /* runs of fewer than LORA_FEW_ROWS rows: decodes */
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t slot = segments[3 * s], start = segments[3 * s + 1], m = segments[3 * s + 2] - start;
        if (m <= 0) continue;
        if (m < LORA_FEW_ROWS) {
            few++;
            continue;
        }
        packed_linear_bf16(x + start * k, m, k, p->a + slot * p->a_stride, p->width, k, NULL, t + start * p->width,
                           p->width, p->tile_rows, 0);
        packed_linear_bf16(t + start * p->width, m, p->width, p->b + slot * p->b_stride, n, p->width, NULL,
                           y + start * n, n, p->tile_rows, 2);
    }
    if (!few) return;
    /* The few-row runs' products in one parallel region, their output groups spread over the
     * threads (one region per product and run cost more than the products: a step of 8
     * decodes over 4 adapters on the default model, about 10 ms). */
    const int64_t a_groups = (p->used + 63) / 64, b_groups = (n + 63) / 64;
    const int64_t a_halves = (p->used + 31) / 32, b_halves = (n + 31) / 32;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_segments * a_groups; item++) {
            const int64_t *seg = segments + 3 * (item / a_groups), g = item % a_groups, m = seg[2] - seg[1];
            if (m <= 0 || m >= LORA_FEW_ROWS) continue;
            packed_linear_halves(x + seg[1] * k, m, k, p->a + seg[0] * p->a_stride, p->used, k, k, NULL,
                                 t + seg[1] * p->width, p->width, 2 * g, 2 * g + 2 < a_halves ? 2 * g + 2 : a_halves, 0);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_segments * b_groups; item++) {
            const int64_t *seg = segments + 3 * (item / b_groups), g = item % b_groups, m = seg[2] - seg[1];
            if (m <= 0 || m >= LORA_FEW_ROWS) continue;
            /* only the used columns of t and B: the zero ones would be read for nothing */
            packed_linear_halves(t + seg[1] * p->width, m, p->width, p->b + seg[0] * p->b_stride, n, p->used,
                                 p->width, NULL, y + seg[1] * n, n, 2 * g, 2 * g + 2 < b_halves ? 2 * g + 2 : b_halves,
                                 2);
        }
    }
}

/* act = SiLU(gate) * up of x's gate/up product. */
static int silu_mul(const uint16_t *x, int64_t rows, int64_t k, const struct layer_product *p,
                    int64_t intermediate, uint16_t *gate_up, uint16_t *act) {
    if (p->kind == BLOCKED) {
        packed_silu_mul_linear_bf16(x, rows, k, p->weight, intermediate, k, act, intermediate, p->a);
        return 0;
    }
    return quant_silu_mul_linear(x, rows, k, k, p->weight, (int)p->a, (int)(p->b & 1), intermediate, act, p->b >> 1,
                                 gate_up);
}

/* The activations' memory, kept from call to call: a prefill step's (tens of MB) would be mapped
 * and faulted in afresh by every call. Aligned to a line: malloc's block starts 16 bytes past
 * one, which split every AMX tile row's load in two (a 2048-token prefill workload 8% slower
 * than the compiled path's, whose tensors torch aligns). Calls come from one thread at a time
 * (the worker's). */
static void *scratch;
static size_t scratch_bytes;

static void *scratch_of(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        if (posix_memalign(&scratch, LINE, bytes)) scratch = NULL;
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* The next of the buffers laid out in the scratch from *at: `bytes` long, on a line of its
 * own (see scratch_of); each also a line further from a 4 KB boundary than
 * the last, so that a loop reading one buffer and writing another at the same row does not
 * meet 4K aliasing (a precaution: not measured apart). */
static void *carve(char **at, size_t bytes, int index) {
    char *start = *at + (size_t)index * LINE;
    *at = start + (bytes + LINE - 1) / LINE * LINE;
    return start;
}

/* -- a mixture-of-experts layer's experts (engine/models/moe.py) -- */

/* Each token's top_k experts (by its logits, bfloat16 [M, num_experts]; the lower id first
 * among equal logits, as a stable sort puts them) and their routing weights: a softmax over all
 * of its logits in float32, the top k's renormalized where norm, rounded to bfloat16 (as
 * SparseMoE.route computes them, to within float32's rounding). A NaN logit's expert is picked
 * last (torch's sort picks it first); its token's weights are NaN either way. */
void moe_route(const uint16_t *logits, int64_t M, int64_t num_experts, int64_t k, int64_t norm, int64_t *experts,
               float *weights) {
    for (int64_t t = 0; t < M; t++) {
        const uint16_t *l = logits + t * num_experts;
        int64_t *ids = experts + t * k;
        float *w = weights + t * k;
#define LOGIT(e) (isnan(bf(l[e])) ? -INFINITY : bf(l[e]))
        int64_t n = 0; /* ids[0..n) in descending order of their logits */
        for (int64_t e = 0; e < num_experts; e++) {
            const float v = LOGIT(e);
            if (n == k && !(v > LOGIT(ids[k - 1]))) continue;
            int64_t at = n < k ? n++ : k - 1;
            for (; at > 0 && v > LOGIT(ids[at - 1]); at--) ids[at] = ids[at - 1];
            ids[at] = e;
        }
        const float top = LOGIT(ids[0]);
        float sum = 0.0f, chosen = 0.0f;
        for (int64_t e = 0; e < num_experts; e++) sum += expf(bf(l[e]) - top);
        for (int64_t j = 0; j < k; j++) chosen += (w[j] = expf(bf(l[ids[j]]) - top) / sum);
        for (int64_t j = 0; j < k; j++) w[j] = bf(to_bf(norm ? w[j] / chosen : w[j]));
#undef LOGIT
    }
}

static void *moe_scratch;
static size_t moe_scratch_bytes;

/* The experts' products where both are quantized (without AMX tiles): every expert's gate/up
 * product on its rows (rows, the groups start[e]..start[e + 1]) in one call of
 * quant_linear_many, SiLU-mul over all of them, then every down product in another, into y
 * (float32). Returns 0, or -1 if memory ran out. */
static int quantized_experts(const uint16_t *rows, const int64_t *start, int64_t hidden, const struct moe_layer *moe,
                             uint16_t *gate_up, uint16_t *act, float *y) {
    const int64_t num_experts = moe->num_experts, intermediate = moe->intermediate;
    struct quant_task *tasks = malloc((size_t)num_experts * sizeof(*tasks));
    if (!tasks) return -1;
    int64_t n = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t first = start[e], count = start[e + 1] - first;
        if (count)
            tasks[n++] = (struct quant_task){rows + first * hidden, count, hidden,
                                             (const uint8_t *)moe->gate_up.weight + e * moe->gate_up_stride,
                                             2 * intermediate, gate_up + first * 2 * intermediate, 2 * intermediate};
    }
    int failed = quant_linear_many(tasks, n, hidden, (int)moe->gate_up.a, (int)(moe->gate_up.b & 1), 0);
    if (!failed) {
        silu_mul_bf16(gate_up, start[num_experts], intermediate, act);
        n = 0;
        for (int64_t e = 0; e < num_experts; e++) {
            const int64_t first = start[e], count = start[e + 1] - first;
            if (count)
                tasks[n++] = (struct quant_task){act + first * intermediate, count, intermediate,
                                                 (const uint8_t *)moe->down.weight + e * moe->down_stride, hidden,
                                                 y + first * hidden, hidden};
        }
        failed = quant_linear_many(tasks, n, intermediate, (int)moe->down.a, (int)(moe->down.b & 1), 1);
    }
    free(tasks);
    return failed ? -1 : 0;
}

/* The experts' products where both are packed bfloat16 and no expert's rows reach its AMX tiles
 * (rows, the groups start[e]..start[e + 1]): one parallel region, every expert's gate/up groups
 * (SiLU-mul in the product's epilogue) laid end to end, each costing the expert's rows, and
 * split into one contiguous range of the cost a thread (work_share.h), then every down
 * product's half-groups likewise, into y (float32). The sums of each expert's own
 * packed_silu_mul_linear_bf16 and packed_linear_bf16, output for output. */
static void blocked_experts(const uint16_t *rows, const int64_t *start, int64_t hidden, const struct moe_layer *moe,
                            uint16_t *act, float *y) {
    const int64_t num_experts = moe->num_experts, intermediate = moe->intermediate;
    /* 32 activations a gate/up group, 32 features a down half-group (packed_linear.c's GROUP / 2) */
    const int64_t up_groups = (intermediate + 31) / 32, down_halves = (hidden + 31) / 32;
#pragma omp parallel
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int pass = 0; pass < 2; pass++) {
            const int64_t per_expert = pass ? down_halves : up_groups, cost = start[num_experts] * per_expert;
            const int64_t first = cost * t / nt, last = cost * (t + 1) / nt;
            int64_t at = 0; /* the cost before expert e's items */
            for (int64_t e = 0; e < num_experts && at < last; e++) {
                const int64_t from_row = start[e], count = start[e + 1] - from_row;
                int64_t from, to;
                if (!count) continue;
                share_of(at, per_expert, count, first, last, &from, &to);
                const char *gate_up = (const char *)moe->gate_up.weight + e * moe->gate_up_stride;
                const char *down = (const char *)moe->down.weight + e * moe->down_stride;
                if (from < to && !pass)
                    packed_silu_mul_groups(rows + from_row * hidden, count, hidden, (const uint16_t *)gate_up,
                                           intermediate, hidden, act + from_row * intermediate, intermediate, from, to);
                else if (from < to)
                    packed_linear_halves(act + from_row * intermediate, count, intermediate, (const uint16_t *)down,
                                         hidden, intermediate, intermediate, NULL, (uint16_t *)(y + from_row * hidden),
                                         hidden, from, to, 1);
                at += per_expert * count;
            }
            if (!pass) {
#pragma omp barrier
            }
        }
    }
}

/* out [M, hidden] (bfloat16) = for each token t, the sum over its k experts e = experts[t, j] of
 * weights[t, j] * down_e(SiLU(gate_e x_t) * up_e x_t). The token-expert pairs are grouped by
 * expert (stable, so an expert's rows keep the tokens' order); each expert that got rows gathers
 * them and runs its two products once (silu_mul and product above); an expert with no row costs
 * nothing. The down products come out in float32 and each token's k terms are summed in
 * float32 in the order of its experts, then rounded once: a token's output does not depend on
 * the other tokens of the step; the layer's router is not used. Returns 0, -1 if memory ran out,
 * or -2 if an expert id is out of range. */
int moe_experts_forward(const uint16_t *x, int64_t M, int64_t hidden, const int64_t *experts, const float *weights,
                        const struct moe_layer *moe, uint16_t *out) {
    const int64_t k = moe->top_k, num_experts = moe->num_experts, intermediate = moe->intermediate;
    const int64_t pairs = M * k;
    int64_t *start = calloc((size_t)(num_experts + 1), sizeof(int64_t));
    int64_t *slot = malloc((size_t)(pairs ? pairs : 1) * sizeof(int64_t)); /* pair -> its row in the groups */
    int64_t *token = malloc((size_t)(pairs ? pairs : 1) * sizeof(int64_t)); /* a group row's token */
    if (!start || !slot || !token) {
        free(start), free(slot), free(token);
        return -1;
    }
    for (int64_t p = 0; p < pairs; p++) {
        if (experts[p] < 0 || experts[p] >= num_experts) {
            free(start), free(slot), free(token);
            return -2;
        }
        start[experts[p] + 1]++;
    }
    for (int64_t e = 0; e < num_experts; e++) start[e + 1] += start[e];
    {
        int64_t *next = malloc((size_t)num_experts * sizeof(int64_t));
        if (!next) {
            free(start), free(slot), free(token);
            return -1;
        }
        memcpy(next, start, (size_t)num_experts * sizeof(int64_t));
        for (int64_t p = 0; p < pairs; p++) {
            slot[p] = next[experts[p]]++;
            token[slot[p]] = p / k;
        }
        free(next);
    }
    /* the groups' rows, their gate/up scratch (quantized), activations and float32 outputs */
    const size_t rows_bytes = (size_t)(pairs * hidden) * 2, gate_up_bytes = (size_t)(pairs * 2 * intermediate) * 2;
    const size_t act_bytes = (size_t)(pairs * intermediate) * 2, y_bytes = (size_t)(pairs * hidden) * 4;
    const size_t bytes = rows_bytes + gate_up_bytes + act_bytes + y_bytes + 12 * LINE; /* carve's offsets */
    if (bytes > moe_scratch_bytes) {
        free(moe_scratch);
        if (posix_memalign(&moe_scratch, LINE, bytes)) moe_scratch = NULL;
        moe_scratch_bytes = moe_scratch ? bytes : 0;
    }
    if (!moe_scratch) {
        free(start), free(slot), free(token);
        return -1;
    }
    char *at = moe_scratch;
    uint16_t *rows = carve(&at, rows_bytes, 0), *gu = carve(&at, gate_up_bytes, 1), *act = carve(&at, act_bytes, 2);
    float *y = carve(&at, y_bytes, 3);
#pragma omp parallel for schedule(static) if (pairs >= PARALLEL_ROWS)
    for (int64_t r = 0; r < pairs; r++) memcpy(rows + r * hidden, x + token[r] * hidden, (size_t)hidden * 2);
    int64_t most = 0; /* an expert's most rows */
    for (int64_t e = 0; e < num_experts; e++) most = start[e + 1] - start[e] > most ? start[e + 1] - start[e] : most;
    /* all the experts' products at once, unless some expert's rows would run on AMX tiles */
    const int quantized = moe->gate_up.kind == QUANTIZED && moe->down.kind == QUANTIZED &&
                          (!(moe->gate_up.b >> 1) || most < moe->gate_up.b >> 1) &&
                          (!(moe->down.b >> 1) || most < moe->down.b >> 1);
    const int blocked = moe->gate_up.kind == BLOCKED && moe->down.kind == BLOCKED &&
                        (!moe->gate_up.a || most < moe->gate_up.a) && (!moe->down.a || most < moe->down.a);
    int failed = quantized ? quantized_experts(rows, start, hidden, moe, gu, act, y) : 0;
    if (blocked) blocked_experts(rows, start, hidden, moe, act, y);
    for (int64_t e = 0; e < num_experts && !failed && !quantized && !blocked; e++) { /* one expert at a time */
        const int64_t first = start[e], count = start[e + 1] - first;
        if (!count) continue;
        struct layer_product up = moe->gate_up, d = moe->down;
        up.weight = (const char *)up.weight + e * moe->gate_up_stride;
        d.weight = (const char *)d.weight + e * moe->down_stride;
        failed = silu_mul(rows + first * hidden, count, hidden, &up, intermediate, gu + first * 2 * intermediate,
                          act + first * intermediate);
        if (failed) break;
        if (d.kind == BLOCKED)
            packed_linear_bf16(act + first * intermediate, count, intermediate, d.weight, hidden, intermediate, NULL,
                               (uint16_t *)(y + first * hidden), hidden, d.a, 1);
        else
            failed = quant_linear(act + first * intermediate, count, intermediate, 0, intermediate, d.weight,
                                  (int)d.a, (int)(d.b & 1), hidden, NULL, y + first * hidden, hidden, 1, d.b >> 1);
    }
    if (!failed) {
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
        for (int64_t t = 0; t < M; t++) {
            for (int64_t i = 0; i < hidden; i++) {
                float sum = 0.0f;
                for (int64_t j = 0; j < k; j++) sum += weights[t * k + j] * y[slot[t * k + j] * hidden + i];
                out[t * hidden + i] = to_bf(sum);
            }
        }
    }
    free(start), free(slot), free(token);
    return failed ? -1 : 0;
}

/* The layer's experts for tokens x whose router logits are given (moe_route, then
 * moe_experts_forward). */
int moe_layer_forward(const uint16_t *x, int64_t M, int64_t hidden, const uint16_t *logits,
                      const struct moe_layer *moe, uint16_t *out) {
    const size_t pairs = (size_t)(M * moe->top_k) + 1;
    int64_t *experts = malloc(pairs * sizeof(int64_t));
    float *weights = malloc(pairs * sizeof(float));
    int failed = -1;
    if (experts && weights) {
        moe_route(logits, M, moe->num_experts, moe->top_k, moe->norm_topk_prob, experts, weights);
        failed = moe_experts_forward(x, M, hidden, experts, weights, moe, out);
    }
    free(experts), free(weights);
    return failed;
}

/* The forward of a step (rows query tokens of num_reqs sequences, query_start's ranges: decodes,
 * prefill chunks or both): the final-normed hidden states into out (bfloat16 [rows, hidden]).
 * Returns 0, -1 if memory ran out, -2 if a token is not below vocab or a position not below
 * max_positions. tokens, positions, slots (int64 [rows]), block_tables (int32 [num_reqs,
 * block_table_stride]), seq_lens and query_start (int32 [num_reqs], [num_reqs + 1]) are the
 * step's tensors; embed is bfloat16 [vocab, hidden], cos/sin float32 [max_positions, head_dim].
 *
 * Attention as the cpu_paged backend computes it (its plan for the step):
 * - with num_groups prefixes, a cascade: group g's group_sizes[g] = (n, m) are its n shared
 *   blocks (the next n of shared_blocks), which every sequence's table starts with (m = 0,
 *   one group) or the next m of `members` (their tables); each member row's own keys (the
 *   tables from the first block after them, the group's row of suffix_seq_lens, int32
 *   [num_groups, num_reqs]) by the paged kernel (others, uint8 [num_groups, num_reqs], marking
 *   the rest), the shared keys once for all of them by tile_attention.c (on tiles of the kind
 *   `tiles`, cpu_kernels.TILE_KINDS), merged by their log-sum-exps; with members, the rows of
 *   the requests in no group as without a cascade, skip marking the members too;
 * - else (and for a cascade's other requests) the num_tile_requests tile_requests' rows
 *   (prefill chunks; skip marks them, uint8 [num_reqs]) causally on the tiles, the others by
 *   the paged kernel;
 * where the tiles cannot run (no memory), every row by the paged kernel over its whole table.
 * window > 0 (a model whose every layer attends within a window, in a step where some row is
 * past it): every row by the paged kernel within it; the plan has no cascade and no tiles then. */
int one_call_forward(const struct forward_layer *layers, int64_t num_layers, int64_t rows, const uint16_t *embed,
                     const int64_t *tokens, const int64_t *positions, const int64_t *slots,
                     const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                     const int32_t *query_start, const float *cos_table, const float *sin_table,
                     const uint16_t *final_norm, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t intermediate, int64_t block_size, int64_t vocab,
                     int64_t max_positions, float eps, float scale, int64_t window, const int32_t *shared_blocks,
                     int64_t num_groups, const int64_t *group_sizes, const int32_t *suffix_seq_lens,
                     const int32_t *members, const uint8_t *others, int tiles, int64_t num_reqs, const uint8_t *skip,
                     const int32_t *tile_requests, int64_t num_tile_requests, const struct lora_layer *loras,
                     const int64_t *lora_segments, int64_t num_lora_segments, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= vocab || positions[r] < 0 || positions[r] >= max_positions) return -2;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    int64_t lora_width = 0; /* the widest of the LoRA products' widths (0: no LoRA rows this step) */
    int64_t num_experts = 0; /* the most experts of a layer (their router's logits) */
    for (int64_t l = 0; l < num_layers; l++)
        if (layers[l].moe && layers[l].moe->num_experts > num_experts) num_experts = layers[l].moe->num_experts;
    for (int64_t l = 0; loras && num_lora_segments && l < num_layers; l++) {
        const struct lora_product *p = &loras[l].qkv;
        for (int i = 0; i < 4; i++) lora_width = p[i].width > lora_width ? p[i].width : lora_width;
    }
    const size_t bf16 = sizeof(uint16_t), row_sizes[] = {hidden, hidden, hidden, hidden, qkv_size, q_size,
                                                           2 * intermediate, intermediate, q_size, q_size,
                                                           lora_width, num_experts};
    enum { BUFFERS = sizeof(row_sizes) / sizeof(row_sizes[0]) };
    size_t bytes = (size_t)(rows * num_heads) * sizeof(float) + (BUFFERS + 1) * (BUFFERS + 2) * LINE;
    for (int i = 0; i < BUFFERS; i++) bytes += row_sizes[i] * (size_t)rows * bf16;
    char *at = scratch_of(bytes);
    if (!at) return -1;
    uint16_t *buffers[BUFFERS];
    for (int i = 0; i < BUFFERS; i++) buffers[i] = carve(&at, row_sizes[i] * (size_t)rows * bf16, i);
    uint16_t *h = buffers[0], *x = buffers[1], *o = buffers[2], *d = buffers[3], *qkv = buffers[4];
    uint16_t *attn = buffers[5], *gate_up = buffers[6], *act = buffers[7], *queries = buffers[8];
    uint16_t *own = buffers[9];                                                  /* a cascade's own attention */
    uint16_t *lora_t = buffers[10];                                              /* LoRA: x @ A.T */
    uint16_t *logits = buffers[11];                                              /* a router's */
    float *own_lse = carve(&at, (size_t)(rows * num_heads) * sizeof(float), BUFFERS); /* and its log-sum-exps */
    const uint8_t *skip_tiled = num_tile_requests ? skip : NULL;
    int failed = 0;
    for (int64_t r = 0; r < rows; r++)
        memcpy(h + r * hidden, embed + tokens[r] * hidden, sizeof(uint16_t) * (size_t)hidden);
    for (int64_t l = 0; l < num_layers; l++) {
        const struct forward_layer *layer = layers + l;
        add_rms_norm(h, l ? d : NULL, layer->input_norm, rows, hidden, eps, x); /* d: the last layer's MLP */
        const struct lora_layer *lora = loras ? loras + l : NULL;
        if ((failed = product(x, rows, hidden, &layer->qkv, qkv_size, layer->qkv_bias, qkv))) break;
        if (lora_width) lora_add(x, hidden, &lora->qkv, lora_segments, num_lora_segments, qkv_size, qkv, lora_t);
        /* Qwen3's RMS norm of each query and key head, in place (as add_rms_norm's rows: rounded to
         * bfloat16, then times the weight, rounded again); then RoPE: the queries apart ([rows,
         * heads, head_dim]), the keys in place; keys and values are written to the cache from the
         * qkv rows */
#pragma omp parallel if (rows >= PARALLEL_ROWS)
        {
            float head[(head_dim + 15) / 16 * 16] __attribute__((aligned(LINE)));
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *row = qkv + r * qkv_size;
                const float *cos = cos_table + positions[r] * head_dim, *sin = sin_table + positions[r] * head_dim;
                if (layer->q_norm) {
                    for (int64_t i = 0; i < num_heads; i++)
                        norm_row(row + i * head_dim, NULL, layer->q_norm, head_dim, eps, row + i * head_dim, head);
                    for (int64_t i = 0; i < num_kv_heads; i++)
                        norm_row(row + q_size + i * head_dim, NULL, layer->k_norm, head_dim, eps,
                                 row + q_size + i * head_dim, head);
                }
                rope(row, num_heads, head_dim, cos, sin, queries + r * q_size);
                rope(row + q_size, num_kv_heads, head_dim, cos, sin, row + q_size);
            }
        }
        paged_write_kv_bf16(qkv + q_size, qkv + q_size + kv_size, slots, layer->key_cache, layer->value_cache, rows,
                            num_kv_heads, head_dim, block_size, qkv_size, qkv_size);
        int whole = 1; /* every row's attention over its whole table by the paged kernel */
        if (num_groups) {
            const int32_t *blocks = shared_blocks, *listed = members;
            whole = 0;
            for (int64_t g = 0; g < num_groups && !whole; g++) {
                const int64_t n = group_sizes[2 * g], m = group_sizes[2 * g + 1];
                paged_attention_bf16(queries, layer->key_cache, layer->value_cache, block_tables + n,
                                     block_table_stride, suffix_seq_lens + g * num_reqs, query_start, own, own_lse,
                                     m ? others + g * num_reqs : NULL, num_reqs, num_heads, num_kv_heads, head_dim,
                                     block_size, scale, 1.0f, 0, 0.0f);
                whole = shared_prefix_attention_bf16(queries, layer->key_cache, layer->value_cache, blocks, n,
                                                     block_size, rows, m ? listed : NULL, m, query_start, num_heads,
                                                     num_kv_heads, head_dim, scale, own, own_lse, attn, tiles);
                blocks += n;
                listed += m;
            }
            if (!whole && group_sizes[1]) { /* the rows of the requests in no group */
                paged_attention_bf16(queries, layer->key_cache, layer->value_cache, block_tables, block_table_stride,
                                     seq_lens, query_start, attn, NULL, skip, num_reqs, num_heads, num_kv_heads,
                                     head_dim, block_size, scale, 1.0f, 0, 0.0f);
                whole = num_tile_requests &&
                        prefill_attention_bf16(queries, layer->key_cache, layer->value_cache, block_tables,
                                               block_table_stride, seq_lens, query_start, tile_requests,
                                               num_tile_requests, num_heads, num_kv_heads, head_dim, block_size,
                                               scale, attn, tiles);
            }
        } else {
            paged_attention_bf16(queries, layer->key_cache, layer->value_cache, block_tables, block_table_stride,
                                 seq_lens, query_start, attn, NULL, skip_tiled, num_reqs, num_heads, num_kv_heads,
                                 head_dim, block_size, scale, 1.0f, window, 0.0f);
            whole = skip_tiled && prefill_attention_bf16(queries, layer->key_cache, layer->value_cache, block_tables,
                                                         block_table_stride, seq_lens, query_start, tile_requests,
                                                         num_tile_requests, num_heads, num_kv_heads, head_dim,
                                                         block_size, scale, attn, tiles);
        }
        if (whole)
            paged_attention_bf16(queries, layer->key_cache, layer->value_cache, block_tables, block_table_stride,
                                 seq_lens, query_start, attn, NULL, NULL, num_reqs, num_heads, num_kv_heads, head_dim,
                                 block_size, scale, 1.0f, window, 0.0f);
        if ((failed = product(attn, rows, q_size, &layer->o, hidden, NULL, o))) break;
        if (lora_width) lora_add(attn, q_size, &lora->o, lora_segments, num_lora_segments, hidden, o, lora_t);
        add_rms_norm(h, o, layer->post_norm, rows, hidden, eps, x);
        if (layer->moe) { /* the router's logits, then the experts' sum into d */
            const struct moe_layer *moe = layer->moe;
            if ((failed = product(x, rows, hidden, &moe->router, moe->num_experts, NULL, logits))) break;
            if ((failed = moe_layer_forward(x, rows, hidden, logits, moe, d))) break;
            continue;
        }
        if (lora) { /* gate/up packed plain (no SiLU-mul epilogue): the delta joins before the activation */
            if ((failed = product(x, rows, hidden, &layer->gate_up, 2 * intermediate, NULL, gate_up))) break;
            if (lora_width) lora_add(x, hidden, &lora->gate_up, lora_segments, num_lora_segments, 2 * intermediate,
                                     gate_up, lora_t);
            silu_mul_bf16(gate_up, rows, intermediate, act);
        } else if ((failed = silu_mul(x, rows, hidden, &layer->gate_up, intermediate, gate_up, act))) {
            break;
        }
        if ((failed = product(act, rows, intermediate, &layer->down, hidden, NULL, d))) break;
        if (lora_width) lora_add(act, intermediate, &lora->down, lora_segments, num_lora_segments, hidden, d, lora_t);
    }
    if (!failed) add_rms_norm(h, num_layers ? d : NULL, final_norm, rows, hidden, eps, out);
    return failed ? -1 : 0;
}
