/* The CPU kernels' functions that another kernel calls (decoder_layer.c calls them in turn),
 * declared once: each defining file includes this too, so a signature that drifts from its
 * declaration fails to compile instead of being called wrongly. */
#ifndef CLEAVE_KERNELS_H
#define CLEAVE_KERNELS_H
#include <stdint.h>

/* norm_rope.c */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
                  int64_t n, float eps, int num_threads);
int rope_f32(const float *x, int64_t tok_stride, int64_t head_stride, float *out,
             const int64_t *positions, const float *cos_sin, int64_t cache_stride,
             int64_t max_position, int64_t tokens, int64_t heads, int64_t half, int num_threads);

/* small_gemm.c */
int small_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads);
int small_mlp_f32(const float *x, const float *w_gate_up, const float *w_down, float *y,
                  int64_t M, int64_t H, int64_t I, int gelu, int num_threads);
int act_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I, int gelu,
                int num_threads);
/* One projection's LoRA for a step (small_gemm.c): A [slots, width, K], B transposed and scaled
 * [slots, width, N]; sub j of num_subs fills output columns [column_ends[j - 1] (0 for j = 0),
 * column_ends[j]) from stack rows [j * width / num_subs, (j + 1) * width / num_subs) (B's other
 * blocks are zeros); rows [num_rows] grouped by slot, segments [num_segments, 3] (slot, first,
 * end) into them; scratch: num_rows * width floats. */
typedef struct {
    const float *a, *bt;
    int64_t width, num_subs;
    const int64_t *column_ends;
    const int64_t *rows, *segments;
    int64_t num_segments, num_rows;
    float *scratch;
} lora_args_t;
int small_gemm_lora_f32(const float *x, const float *w, float *y, int64_t M, int64_t N,
                        int64_t K, const lora_args_t *l, int num_threads);
int small_mlp_lora_f32(const float *x, const float *w_gate_up, const float *w_down, float *y,
                       int64_t M, int64_t H, int64_t I, int gelu, const lora_args_t *gu_lora,
                       const lora_args_t *down_lora, int num_threads);
int lora_add_f32(const float *x, float *y, int64_t N, int64_t K, const lora_args_t *l,
                 int num_threads);

/* int_gemm.c */
/* x quantized to int8 in blocks of 32 columns: xq [M, K], each block's scale xs, the sum of its
 * integers xsum and that times its scale xw, all [M, K / 32]; NULLs when out of memory. */
typedef struct {
    int8_t *xq;
    float *xs, *xw;
    int32_t *xsum;
} acts_t;
int int_acts_quantize(const void *x, int x_bf16, int64_t M, int64_t K, acts_t *a);
void int_acts_release(acts_t *a);
int int8_gemm(const void *x, int x_bf16, const uint8_t *w, const float *scales, void *y,
              int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads);
int int4_gemm(const void *x, int x_bf16, const uint8_t *w, const void *scales, int s_bf16,
              const float *offsets, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
              int64_t group, int num_threads);

/* gguf_vnni.c */
int gguf_vnni_gemm(const float *x, const uint8_t *w, const uint16_t *scales,
                   const uint16_t *offsets, int type, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads);

/* gguf_gemm.c */
int gguf_gemm(const float *x, const uint8_t *w, int type, float *y, int64_t M, int64_t N,
              int64_t K, int num_threads);
int gguf_dequant(const uint8_t *w, int type, int64_t K, const int64_t *rows, int64_t start,
                 int64_t count, float *out, int num_threads);

/* attention/csrc/paged_decode.c */
int paged_decode_f32(const float *q, const void *k, const void *v, const float *sinks,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int batch, int num_heads, int num_kv_heads, int head_dim,
                     int block_size, float scale, int window, int kv_bf16, int num_threads);
#endif
