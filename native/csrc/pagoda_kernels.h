/* Pagoda's CPU kernels: every function the library exports, declared once.
 *
 * Every source file of the library includes this header, so the compiler checks each definition
 * against its declaration here; native/library.py reads the same declarations to bind the
 * functions with ctypes (argument and return types), so Python and C cannot drift apart: a
 * function declared here and missing from the library fails the load, and a function that is
 * not declared here cannot be called from Python.
 *
 * Keep each declaration in the plain form library.py parses: a return type of void, int,
 * int64_t or float; parameters of those types, float, or pointers (any `T *`).
 */
#ifndef PAGODA_KERNELS_H
#define PAGODA_KERNELS_H

#include <stdint.h>

struct forward_layer;
struct moe_layer;
struct lora_layer;

/* One product of quant_linear_many: x [M, K] bfloat16 (rows ldx apart) times w's features into
 * y [M, N] (rows ldy apart). */
struct quant_task {
    const void *x;
    int64_t M, ldx;
    const uint8_t *w;
    int64_t N;
    void *y;
    int64_t ldy;
};

/* -- probes: what this CPU runs (1) or not (0) -- */
int packed_linear_available(void);
int amx_probe(void);
int quant_linear_vnni(void);
int quant_linear_vector(void);
int quant_linear_q6(void); /* the 6-bit weights (Q6_K) run: AVX512-VNNI vectors */
int tile_attention_vector_available(void);
int tile_attention_float_available(void);

/* -- the paged KV cache (paged_attention.c) -- */
void paged_write_kv_bf16(const uint16_t *key, const uint16_t *value, const int64_t *slot_mapping,
                         uint16_t *key_cache, uint16_t *value_cache, int64_t num_tokens, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t key_stride, int64_t value_stride);
void paged_write_kv_f32(const float *key, const float *value, const int64_t *slot_mapping,
                        float *key_cache, float *value_cache, int64_t num_tokens, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t key_stride, int64_t value_stride);
void paged_write_kv_u8(const uint8_t *key, const uint8_t *value, const int64_t *slot_mapping,
                       uint8_t *key_cache, uint8_t *value_cache, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, int64_t key_stride, int64_t value_stride);

/* -- paged attention over the block tables (paged_attention.c). window: a row at position p sees
 * keys p - window + 1 .. p, or every earlier key at 0. softcap: scores become softcap * tanh(score
 * / softcap), or stay at 0 -- */
void paged_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, uint16_t *out, float *lse,
    const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float value_scale, int64_t window, float softcap);
void paged_attention_f32(const float *query, const float *key_cache, const float *value_cache, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, float *out, float *lse,
    const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float value_scale, int64_t window, float softcap);
void paged_attention_bf16_e5m2(const uint16_t *query, const uint8_t *key_cache, const uint8_t *value_cache, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, uint16_t *out, float *lse,
    const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float value_scale, int64_t window, float softcap);
void paged_attention_bf16_e4m3(const uint16_t *query, const uint8_t *key_cache, const uint8_t *value_cache, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, uint16_t *out, float *lse,
    const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float value_scale, int64_t window, float softcap);
void paged_attention_f32_e5m2(const float *query, const uint8_t *key_cache, const uint8_t *value_cache, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, float *out, float *lse,
    const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float value_scale, int64_t window, float softcap);
void paged_attention_f32_e4m3(const float *query, const uint8_t *key_cache, const uint8_t *value_cache, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, float *out, float *lse,
    const uint8_t *skip, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float value_scale, int64_t window, float softcap);

/* -- attention on tiles (tile_attention.c) -- */
int shared_prefix_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
    const int32_t *blocks, int64_t num_blocks, int64_t block_size, int64_t num_tokens, const int32_t *members,
    int64_t num_members, const int32_t *query_start, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, const uint16_t *own_out, const float *own_lse, uint16_t *out, int kind);
int prefill_attention_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start,
    const int32_t *requests, int64_t num_listed, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, uint16_t *out, int kind);
int shared_prefix_attention_f32(const float *query, const float *key_cache, const float *value_cache,
    const int32_t *blocks, int64_t num_blocks, int64_t block_size, int64_t num_tokens, const int32_t *members,
    int64_t num_members, const int32_t *query_start, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, const float *own_out, const float *own_lse, float *out, int kind);
int prefill_attention_f32(const float *query, const float *key_cache, const float *value_cache,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start,
    const int32_t *requests, int64_t num_listed, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float *out, int kind);

/* -- matrix products (packed_linear.c, quant_linear.c) -- */
void packed_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
    const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t amx_min_rows, int64_t out_f32);
void packed_linear_halves(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t N, int64_t K,
    int64_t w_k, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t first, int64_t end, int64_t out_f32);
void packed_silu_mul_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
    uint16_t *y, int64_t ldy, int64_t amx_min_rows);
void packed_silu_mul_groups(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t I, int64_t K,
    uint16_t *y, int64_t ldy, int64_t first, int64_t end);
int64_t quant_group_bytes(int bits, int has_min);
int quant_linear(const void *x, int64_t M, int64_t ldx, int x_f32, int64_t K, const uint8_t *w, int bits,
    int has_min, int64_t N, const float *bias, void *y, int64_t ldy, int out_f32, int64_t amx_min_rows);
int quant_linear_many(const struct quant_task *tasks, int64_t count, int64_t K, int bits, int has_min, int out_f32);
int quant_linear_argmax(const void *x, int64_t M, int64_t ldx, int x_f32, int64_t K, const uint8_t *w, int bits,
    int has_min, int64_t N, const float *bias, int64_t *ids, int64_t amx_min_rows);
int quant_silu_mul_tiles(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int bits,
    int has_min, int64_t I, uint16_t *act, int64_t amx_min_rows);

/* -- the whole step in one call (one_call_forward.c) -- */
void silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t intermediate, uint16_t *act);
int quant_silu_mul_linear(const uint16_t *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int bits,
    int has_min, int64_t I, uint16_t *act, int64_t amx_min_rows, uint16_t *gate_up);
int one_call_forward_set_exp16(void *fn);
void moe_route(const uint16_t *logits, int64_t M, int64_t num_experts, int64_t k, int64_t norm, int64_t *experts,
    float *weights);
int moe_experts_forward(const uint16_t *x, int64_t M, int64_t hidden, const int64_t *experts, const float *weights,
    const struct moe_layer *moe, uint16_t *out);
int moe_layer_forward(const uint16_t *x, int64_t M, int64_t hidden, const uint16_t *logits,
    const struct moe_layer *moe, uint16_t *out);
int one_call_forward(const struct forward_layer *layers, int64_t num_layers, int64_t rows, const uint16_t *embed,
    const int64_t *tokens, const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
    int64_t block_table_stride, const int32_t *seq_lens, const int32_t *query_start, const float *cos_table,
    const float *sin_table, const uint16_t *final_norm, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate, int64_t block_size, int64_t vocab, int64_t max_positions, float eps,
    float scale, int64_t window, const int32_t *shared_blocks, int64_t num_groups, const int64_t *group_sizes,
    const int32_t *suffix_seq_lens, const int32_t *members, const uint8_t *others, int tiles, int64_t num_reqs,
    const uint8_t *skip, const int32_t *tile_requests, int64_t num_tile_requests, const struct lora_layer *loras,
    const int64_t *lora_segments, int64_t num_lora_segments, uint16_t *out);

#endif /* PAGODA_KERNELS_H */
