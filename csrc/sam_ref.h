/*
 * sam_ref.h -- the C reference implementations: the semantic definition of
 * every samoyeds op.  Same argument order as the CUDA launchers (outputs
 * first); host pointers to dense row-major arrays.  Each returns a sam_status;
 * on failure sam_ref_last_error() says why (thread-local).
 */
#ifndef SAM_REF_H
#define SAM_REF_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "../cuda/samoyeds_cuda.h"

const char *sam_ref_last_error(void);
void sam_ref_set_error(const char *fmt, ...);

/* ---- loads and stores of caller arrays -------------------------------------------
 * A caller's array may start at any address on the CPU (numpy exports unaligned
 * arrays through DLPack, and the checks ask for alignment only on the GPU): every
 * element of one is read and written through memcpy, which compilers turn into a
 * plain load or store where the target allows unaligned ones. */

#define SAM_REF_ACCESS(suffix, type)                                                 \
    static inline type sam_ld_##suffix(const void *p, int64_t i)                     \
    {                                                                                \
        type v;                                                                      \
        memcpy(&v, (const char *)p + i * (int64_t)sizeof(type), sizeof(type));       \
        return v;                                                                    \
    }                                                                                \
    static inline void sam_st_##suffix(void *p, int64_t i, type v)                   \
    {                                                                                \
        memcpy((char *)p + i * (int64_t)sizeof(type), &v, sizeof(type));             \
    }
SAM_REF_ACCESS(u16, uint16_t)
SAM_REF_ACCESS(i32, int32_t)
SAM_REF_ACCESS(u32, uint32_t)
SAM_REF_ACCESS(i64, int64_t)
SAM_REF_ACCESS(f32, float)
SAM_REF_ACCESS(f64, double)
#undef SAM_REF_ACCESS

/* ---- element conversions -------------------------------------------------------- */

static inline float sam_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t sam_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float sam_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            man &= 0x3ffu;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t sam_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);     /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);    /* overflow -> inf (RNE boundary) */
    if (a < 0x38800000u) {                                      /* subnormal or zero in f16 */
        if (a < 0x33000000u) return (uint16_t)sign;             /* below half the smallest subnormal */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;                               /* 14 - (e - 127) + 13 - 1 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - ((127 - 15) << 23);
    return (uint16_t)(sign | (r >> 13));
}

static inline float sam_load_f32(const void *p, sam_dtype t, int64_t i)
{
    switch (t) {
    case SAM_F32: return sam_ld_f32(p, i);
    case SAM_F16: return sam_f16_to_f32(sam_ld_u16(p, i));
    case SAM_BF16: return sam_bf16_to_f32(sam_ld_u16(p, i));
    case SAM_F64: return (float)sam_ld_f64(p, i);
    default: return 0.0f;
    }
}

static inline double sam_load_f64(const void *p, sam_dtype t, int64_t i)
{
    if (t == SAM_F64) return sam_ld_f64(p, i);
    return (double)sam_load_f32(p, t, i);
}

static inline void sam_store_f32(void *p, sam_dtype t, int64_t i, float v)
{
    switch (t) {
    case SAM_F32: sam_st_f32(p, i, v); break;
    case SAM_F16: sam_st_u16(p, i, sam_f32_to_f16(v)); break;
    case SAM_BF16: sam_st_u16(p, i, sam_f32_to_bf16(v)); break;
    case SAM_F64: sam_st_f64(p, i, (double)v); break;
    default: break;
    }
}

static inline int64_t sam_load_index(const void *p, sam_dtype t, int64_t i)
{
    return t == SAM_I64 ? sam_ld_i64(p, i) : (int64_t)sam_ld_i32(p, i);
}

/* A gated activation of gate g and up u, as every op defines it: SwiGLU silu(g) * u,
 * or GPT-OSS's clamped variant (alpha, limit).  The clamps keep a NaN a NaN, as
 * torch.clamp does (fminf would turn it into the limit). */
static inline float sam_act_glu(sam_act act, float g, float u, float alpha, float limit)
{
    if (act == SAM_ACT_SWIGLU) return g / (1.0f + expf(-g)) * u;
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

/* ---- format (csrc/format_ref.c) ---------------------------------------------------- */

sam_status sam_format_mask_ref(uint8_t *mask, const void *w, sam_dtype wt,
                               const void *scores, sam_dtype st,
                               sam_format f, const sam_dims *d);
sam_status sam_format_pack_ref(void *values, uint32_t *meta, uint8_t *idx,
                               const void *w, const uint8_t *mask, sam_dtype t,
                               sam_format f, const sam_dims *d);
/* out[i] = values[src[i]] for 0 <= src[i] < n, else 0 (cuda/samoyeds_cuda.h). */
sam_status sam_format_gather_ref(void *out, const void *values, int64_t n, int elem_bytes, const int32_t *src,
                                 int64_t count);
/* out (the values of W^T's plain 2:4 packing, [E][td->rp][td->cp/2]) from the packed weight W:
 * every place the value of W that tmeta, W^T's metadata, names there, 0 where W keeps none
 * (cuda/samoyeds_cuda.h). */
sam_status sam_format_transpose_values_ref(void *out, const uint32_t *tmeta, const void *values,
                                           const uint32_t *meta, const uint8_t *idx, int elem_bytes,
                                           sam_format f, const sam_dims *d, const sam_dims *td);
sam_status sam_format_unpack_ref(void *out, const void *values, const uint32_t *meta,
                                 const uint8_t *idx, sam_dtype t,
                                 sam_format f, const sam_dims *d);
/* SAM_STATUS_BAD_DATA (the message names the expert, slice, storage row) unless every
 * live storage row holds valid 2:4 codes and, with row selection, row indices below m
 * that increase within each group; unpack and ssmm call it before writing anything. */
sam_status sam_format_check_ref(const uint32_t *meta, const uint8_t *idx, sam_format f, const sam_dims *d);

/* ---- ssmm (csrc/ssmm_ref.c): same params struct as the CUDA launcher ----------- */

sam_status sam_ssmm_ref(const sam_ssmm_params *p);
/* The weight gradient in the packed layout (sam_ssmm_dw_params in cuda/samoyeds_cuda.h). */
sam_status sam_ssmm_dw_ref(const sam_ssmm_dw_params *p);
/* The input gradient from the forward's packing (sam_ssmm_dx_params in cuda/samoyeds_cuda.h). */
sam_status sam_ssmm_dx_ref(const sam_ssmm_dx_params *p);

/* ---- dense weights (csrc/dense_ref.c): same params struct as the CUDA launcher ---- */

sam_status sam_dense_ref(const sam_dense_params *p);
sam_status sam_router_ref(const sam_router_params *p);
sam_status sam_glu_ref(const sam_glu_params *p);
sam_status sam_glu_backward_ref(const sam_glu_backward_params *p);

/* ---- MoE routing and combine (csrc/moe_ref.c) ------------------------------------ */

sam_status sam_moe_route_ref(const void *top_k_index, sam_dtype index_dtype,
                             int64_t T, int64_t K, int64_t E,
                             int32_t *offsets, int32_t *token_ids, int32_t *perm, int32_t *pos);
sam_status sam_moe_gather_weights_ref(float *out, const void *w, sam_dtype wt,
                                      const int32_t *perm, const int32_t *offsets,
                                      int64_t E, int64_t S);
/* Rows s of out (S rows of row_bytes, ld_bytes apart) from offsets[E] on (no routed pair)
 * set to zero bytes; the routed rows are not touched. */
sam_status sam_moe_zero_unrouted_ref(void *out, int64_t row_bytes, int64_t ld_bytes, const int32_t *offsets,
                                     int64_t E, int64_t S);
sam_status sam_moe_combine_ref(void *out, sam_dtype out_dtype, const void *y,
                               sam_dtype y_dtype, const int32_t *pos,
                               int64_t T, int64_t K, int64_t H, int64_t ldy, int64_t S);

#endif /* SAM_REF_H */
