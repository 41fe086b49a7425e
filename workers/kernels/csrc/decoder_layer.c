/* A decode step's stack of Llama decoder layers for a few fp32 rows on the CPU, in one call from
 * Python: per layer, residual add + RMSNorm, the fused q/k/v projection, neox RoPE of q and k,
 * the new K/V written at each row's slot in the layer's paged cache (fp32 or bf16), paged decode
 * attention, o_proj, residual add + RMSNorm, and the gated MLP. Each projection is a dense fp32
 * weight or an int8 / int4 one packed for the VNNI kernels (int_gemm.c, fp32 activations).
 * A step's LoRA adapter rows (`lora_step_t`) get each projection's products added after its
 * matmul, in its parallel region (small_gemm.c `small_gemm_lora_f32`, `small_mlp_lora_f32`),
 * so steps with adapters stay in this one call.
 *
 * Why: each of these was already one C kernel, but called one by one from Python through
 * ctypes; inside the engine step the gaps between them (50-200 us each, measured) left the
 * matmuls reading weights at ~21 GB/s against 31-36 GB/s alone, and the `small` preset decoding
 * one sequence at ~7 ms a token against llama.cpp's 3.5 ms.
 *
 * The arithmetic is the unfused path's, by the same routines: this file calls the kernels'
 * exported functions (declared in kernels.h), linked in from their own files
 * (workers/models/fused_layer.py builds this one with norm_rope.c, small_gemm.c, int_gemm.c and
 * attention/csrc/paged_decode.c), so each routine has one definition, and the results are the
 * unfused path's bit for bit (the residual adds are the same single fp32 adds; the K/V write
 * the same copy, or bf16 rounding to nearest even as torch's `to`). Each kernel opens its own
 * OpenMP region on torch's threads; nothing returns to Python between them.
 *
 * Layouts: hidden and residual [rows, H] contiguous fp32; a layer's cache [2, num_slots, Hkv, D]
 * (num_slots = num_blocks * block_size, K then V) contiguous; positions and slots [rows] int64;
 * block_tables [rows, table_stride] and seq_lens [rows] int32, as the attention kernel reads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* One projection's weight [N, K]: dense fp32 rows (small_gemm_f32), int8 / int4 blocked by
 * workers/kernels/int_gemm.py for int_gemm.c (fp32 activations in and out: the unfused
 * layer's `QuantizedMatmul` with fp32 rows makes the same call), or a GGUF file's Q8_0 / Q4_0 /
 * Q4_1 rows for gguf_gemm.c (the unfused layer's `GGUFMatmul` makes the same call), or laid out
 * for gguf_vnni.c (`GGUFVnniMatmul`'s). */
typedef struct {
    const void *w;
    const void *scales;    /* int8: fp32 [N]; int4: [tiles, groups, 4], bf16 when scales_bf16 */
    const float *offsets;  /* int4: per group, or NULL (symmetric); GGUF_VNNI: fp16 */
    int64_t group;         /* int4: columns per scale; GGUF_VNNI: the GGUF type's id */
    int32_t kind, scales_bf16;
} proj_t;

/* One projection's LoRA stacks (workers/models/lora/projection.py `LoraProjection`): A [slots,
 * width, K], B transposed and scaled [slots, width, N], the subs' column ends (kernels.h
 * `lora_args_t`); a NULL: the projection takes none. */
typedef struct {
    const float *a, *bt;
    int64_t width, num_subs;
    int64_t column_ends[4];
} lora_t;

/* A step's adapter rows, grouped by slot (`LoraBatch`): rows [num_rows] and segments
 * [num_segments, 3] (slot, first, end) into them. */
typedef struct {
    const int64_t *rows, *segments;
    int64_t num_segments, num_rows;
    float *scratch; /* set here: num_rows * width floats for each of a layer's projections */
} lora_step_t;

enum { DENSE = 0, INT8 = 1, INT4 = 2, GGUF_Q8_0 = 3, GGUF_Q4_0 = 4, GGUF_Q4_1 = 5,
       GGUF_VNNI = 6 };

/* One layer's weights and settings, fixed at load (workers/models/fused_layer.py `Layer` mirrors it). */
typedef struct {
    const float *input_norm, *post_norm; /* [H] each */
    proj_t qkv;                          /* [(Hq + 2 Hkv) D, H]: q rows, then k, then v */
    proj_t o;                            /* [H, Hq D] */
    proj_t gate_up, down;                /* [2I, H] (gate rows, then up), [H, I] */
    const float *cos_sin;                /* [max_position, D]: cos, then sin, per row */
    int64_t cos_sin_stride, max_position;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float input_eps, post_eps, scale;
    int32_t window, gelu; /* window 0: the whole context */
    lora_t qkv_lora, o_lora, gate_up_lora, down_lora;
} layer_t;

enum { OK = 0, BAD_POSITION = -1, BAD_SLOT = -2, NO_MEMORY = -3, INT_KERNEL = -4 };

static int dense_mlp(const layer_t *L) { return L->gate_up.kind == DENSE && L->down.kind == DENSE; }

/* floats of LoRA scratch (the shrunk rows) one layer's projections need for `rows` rows: the
 * MLP's two side by side, an attention projection's at the start */
static int64_t lora_floats(const layer_t *L, int64_t rows) {
    return rows * (L->gate_up_lora.width + L->down_lora.width + L->qkv_lora.width
                   + L->o_lora.width);
}

/* The step's LoRA arguments of a projection's stacks `p` in `out`, with scratch at `scratch`;
 * NULL when the step has no adapter rows or the projection no stacks. */
static const lora_args_t *lora_args(const lora_t *p, const lora_step_t *step, float *scratch,
                                    lora_args_t *out) {
    if (step == NULL || p->a == NULL) return NULL;
    *out = (lora_args_t){p->a, p->bt, p->width, p->num_subs, p->column_ends, step->rows,
                         step->segments, step->num_segments, step->num_rows, scratch};
    return out;
}

/* floats of scratch one layer needs for `rows` rows */
static int64_t scratch_floats(const layer_t *L, int64_t rows) {
    const int64_t q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
    /* normed, qkv, rotated q and k, attention output, o_proj output; a quantized MLP's gate/up
     * and activation rows (the dense one keeps them in small_mlp_f32) */
    return rows * (L->hidden + (q + 2 * kv) + q + kv + q + L->hidden
                   + (dense_mlp(L) ? 0 : 3 * L->inter));
}

/* y [M, N] = x [M, K] times p's weight, plus the step's LoRA products `l` (NULL: none: a
 * dense weight's in the same parallel region); int_gemm.c's errors (no VNNI, shape, memory) as
 * INT_KERNEL. */
static int matmul(const proj_t *p, const lora_args_t *l, const float *x, float *y, int64_t M,
                  int64_t N, int64_t K, int nt) {
    int rc = 0;
    if (p->kind == DENSE)
        small_gemm_lora_f32(x, p->w, y, M, N, K, l, nt);
    else if (p->kind == INT8)
        rc = int8_gemm(x, 0, p->w, p->scales, y, 0, M, N, K, nt);
    else if (p->kind == GGUF_VNNI)
        rc = gguf_vnni_gemm(x, p->w, p->scales, (const uint16_t *)p->offsets, (int)p->group, y,
                            M, N, K, nt);
    else if (p->kind >= GGUF_Q8_0)
        rc = gguf_gemm(x, p->w, p->kind - GGUF_Q8_0, y, M, N, K, nt);
    else
        rc = int4_gemm(x, 0, p->w, p->scales, p->scales_bf16, p->offsets, y, 0, M, N, K,
                       p->group, nt);
    if (rc == 0 && l != NULL && p->kind != DENSE) lora_add_f32(x, y, N, K, l, nt);
    return rc == 0 ? OK : INT_KERNEL;
}

/* The gated MLP: fp32 weights in one small_mlp_lora_f32 call (the step's LoRA products added
 * inside it); else gate/up, the activation product (act_mul_f32) and down one after another, as
 * the unfused layer's `PackedMLP` calls them. */
static int mlp(const layer_t *L, const lora_step_t *step, const float *x, float *y,
               float *scratch, int64_t rows, int nt) {
    const int64_t H = L->hidden, I = L->inter;
    lora_args_t gu_args, down_args; /* down's scratch after gate/up's */
    float *ls = step != NULL ? step->scratch : NULL;
    const lora_args_t *gl = lora_args(&L->gate_up_lora, step, ls, &gu_args);
    const lora_args_t *dl = lora_args(
        &L->down_lora, step, ls == NULL ? NULL : ls + rows * L->gate_up_lora.width, &down_args);
    if (dense_mlp(L))
        return small_mlp_lora_f32(x, L->gate_up.w, L->down.w, y, rows, H, I, L->gelu, gl, dl,
                                  nt) != 0 ? NO_MEMORY : OK;
    float *gu = scratch, *a = gu + rows * 2 * I;
    int rc = matmul(&L->gate_up, gl, x, gu, rows, 2 * I, H, nt);
    if (rc != OK) return rc;
    act_mul_f32(gu, a, rows, I, L->gelu, nt);
    return matmul(&L->down, dl, a, y, rows, H, I, nt);
}

/* New K/V rows into the cache at their slots: k rotated [rows, Hkv D], v strided in qkv. */
static void write_kv(void *cache, int kv_bf16, int64_t num_slots, const float *k,
                     const float *v, int64_t v_stride, const int64_t *slots, int64_t rows,
                     int64_t kv) {
    for (int64_t t = 0; t < rows; t++) {
        const int64_t dk = slots[t] * kv, dv = (num_slots + slots[t]) * kv;
        const float *kr = k + t * kv, *vr = v + t * v_stride;
        if (kv_bf16) {
            uint16_t *c = cache;
            for (int64_t i = 0; i < kv; i++) {
                c[dk + i] = f32_to_bf16(kr[i]);
                c[dv + i] = f32_to_bf16(vr[i]);
            }
        } else {
            float *c = cache;
            memcpy(c + dk, kr, sizeof(float) * (size_t)kv);
            memcpy(c + dv, vr, sizeof(float) * (size_t)kv);
        }
    }
}

/* One layer: (h_in, r_in) -> (h_out, r_out), as LlamaDecoderLayer.forward. r_in NULL on the
 * first layer (h_in is then the residual too). h_out may be h_in and r_out r_in: h_in and r_in
 * are read once, at the start. */
static int layer_f32(const layer_t *L, void *cache, int kv_bf16, int64_t num_slots,
                     int64_t block_size, const float *h_in, const float *r_in, float *h_out,
                     float *r_out, float *scratch, int64_t rows, const int64_t *positions,
                     const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                     const int32_t *seq_lens, const lora_step_t *step, int nt) {
    const int64_t H = L->hidden, D = L->head_dim, q_size = L->heads * D;
    const int64_t kv = L->kv_heads * D, n_qkv = q_size + 2 * kv;
    float *normed = scratch, *qkv = normed + rows * H, *q = qkv + rows * n_qkv;
    float *k = q + rows * q_size, *attn = k + rows * kv, *o = attn + rows * q_size;
    float *mlp_scratch = o + rows * H;
    int rc;
    for (int64_t i = 0; i < rows * H; i++) r_out[i] = r_in != NULL ? h_in[i] + r_in[i] : h_in[i];
    rms_norm_f32(r_out, H, L->input_norm, normed, rows, H, L->input_eps, nt);
    lora_args_t args;
    float *ls = step != NULL ? step->scratch : NULL;
    if ((rc = matmul(&L->qkv, lora_args(&L->qkv_lora, step, ls, &args), normed, qkv, rows,
                     n_qkv, H, nt)) != OK)
        return rc;
    if (rope_f32(qkv, n_qkv, D, q, positions, L->cos_sin, L->cos_sin_stride, L->max_position,
                 rows, L->heads, D / 2, nt) != 0
        || rope_f32(qkv + q_size, n_qkv, D, k, positions, L->cos_sin, L->cos_sin_stride,
                    L->max_position, rows, L->kv_heads, D / 2, nt) != 0)
        return BAD_POSITION;
    write_kv(cache, kv_bf16, num_slots, k, qkv + q_size + kv, n_qkv, slots, rows, kv);
    const int64_t plane = num_slots * kv * (kv_bf16 ? 2 : 4); /* bytes of the K half */
    if (paged_decode_f32(q, cache, (const char *)cache + plane, NULL, block_tables,
                         table_stride, seq_lens, attn, (int)rows, (int)L->heads,
                         (int)L->kv_heads, (int)D, (int)block_size, L->scale, L->window,
                         kv_bf16, nt) != 0)
        return NO_MEMORY;
    if ((rc = matmul(&L->o, lora_args(&L->o_lora, step, ls, &args), attn, o, rows, H, q_size,
                     nt)) != OK)
        return rc;
    for (int64_t i = 0; i < rows * H; i++) r_out[i] = o[i] + r_out[i];
    rms_norm_f32(r_out, H, L->post_norm, normed, rows, H, L->post_eps, nt);
    return mlp(L, step, normed, h_out, mlp_scratch, rows, nt);
}

/* `num_layers` layers in turn; kv_caches[i] is layer i's cache. residual_in NULL: the stack's
 * first layer is the model's (hidden_in is then the residual). hidden_in and residual_in are
 * not written. Returns OK, or (before anything is written) BAD_POSITION for a position outside
 * a layer's rotary cache or BAD_SLOT for a slot outside the caches; NO_MEMORY when scratch could
 * not be allocated. `step`: the step's adapter rows (NULL: none), their LoRA products added to
 * each projection that has stacks (`lora_t`). */
int decoder_stack_f32(const layer_t *layers, int num_layers, void *const *kv_caches,
                      int kv_bf16, int64_t num_slots, int64_t block_size, const float *hidden_in,
                      const float *residual_in, float *hidden_out, float *residual_out,
                      int64_t rows, const int64_t *positions, const int64_t *slots,
                      const int32_t *block_tables, int64_t table_stride,
                      const int32_t *seq_lens, const lora_step_t *adapters,
                      int num_threads) {
    int64_t floats = 0, extra = 0;
    for (int l = 0; l < num_layers; l++) {
        const int64_t need = scratch_floats(&layers[l], rows);
        const int64_t more = adapters != NULL ? lora_floats(&layers[l], rows) : 0;
        floats = need > floats ? need : floats;
        extra = more > extra ? more : extra;
        for (int64_t t = 0; t < rows; t++)
            if (positions[t] < 0 || positions[t] >= layers[l].max_position) return BAD_POSITION;
    }
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return BAD_SLOT;
    float *scratch = malloc(sizeof(float) * (size_t)(floats + extra));
    if (scratch == NULL) return NO_MEMORY;
    lora_step_t local, *step = NULL;
    if (adapters != NULL) {
        local = *adapters;
        local.scratch = scratch + floats;
        step = &local;
    }
    int rc = OK;
    for (int l = 0; l < num_layers && rc == OK; l++)
        rc = layer_f32(&layers[l], kv_caches[l], kv_bf16, num_slots, block_size,
                       l == 0 ? hidden_in : hidden_out, l == 0 ? residual_in : residual_out,
                       hidden_out, residual_out, scratch, rows, positions, slots, block_tables,
                       table_stride, seq_lens, step, num_threads);
    free(scratch);
    return rc;
}
