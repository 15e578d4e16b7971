/*
 * dense_ref.c -- dense weights at a few tokens on the CPU: the definition the CUDA
 * kernel (cuda/dense_decode.cu) must agree with.
 *
 * For every token t < T and output row r < R:
 *     g = sum_c x[t][c] * w[r][c]          fp32, in column order
 *     u = sum_c x[t][c] * up[r][c]         (a gated act only)
 *     out[t][r] = act(g, u)                (none: g), rounded once to out's dtype.
 *
 * Also the gated activation of two matrices (glu, cuda/glu.cu) and its backward
 * (glu_backward: the formulas are in cuda/samoyeds_cuda.h).
 */
#include "sam_ref.h"

#include <stdlib.h>

sam_status sam_dense_ref(const sam_dense_params *p)
{
    const int64_t T = p->T, R = p->R, C = p->C;
    const int gated = p->act != SAM_ACT_NONE;
    if (gated && p->up == NULL && R > 0 && C > 0) {
        sam_ref_set_error("up: a gated activation needs the up rows");
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (T == 0 || R == 0) return SAM_STATUS_OK;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(C + 1));
    if (xf == NULL) {
        sam_ref_set_error("out of memory for a row of %lld columns", (long long)C);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c = 0; c < C; c++) xf[c] = sam_load_f32(p->x, p->dtype, t * p->ldx + c);
        for (int64_t r = 0; r < R; r++) {
            float g = 0.0f, u = 0.0f;
            for (int64_t c = 0; c < C; c++) g += xf[c] * sam_load_f32(p->w, p->dtype, r * C + c);
            if (gated)
                for (int64_t c = 0; c < C; c++) u += xf[c] * sam_load_f32(p->up, p->dtype, r * C + c);
            const float y = gated ? sam_act_glu(p->act, g, u, p->alpha, p->limit) : g;
            sam_store_f32(p->out, p->dtype, t * p->ldo + r, y);
        }
    }
    free(xf);
    return SAM_STATUS_OK;
}

/* out[t][i] = act(g[t][i], u[t][i]), rounded once to out's dtype. */
sam_status sam_glu_ref(const sam_glu_params *p)
{
    if (p->act != SAM_ACT_SWIGLU && p->act != SAM_ACT_GPTOSS) {
        sam_ref_set_error("glu: act %d is not a gated activation", (int)p->act);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    for (int64_t t = 0; t < p->T; t++)
        for (int64_t i = 0; i < p->I; i++) {
            const float g = sam_load_f32(p->g, p->dtype, t * p->ldg + i);
            const float u = sam_load_f32(p->u, p->dtype, t * p->ldu + i);
            sam_store_f32(p->out, p->dtype, t * p->ldo + i, sam_act_glu(p->act, g, u, p->alpha, p->limit));
        }
    return SAM_STATUS_OK;
}

/* The gradients of one gate/up pair from d (dh times the row's scale), in the order of
 * _glu_backward in samoyeds/torch_ops.py; the clamps are written so that a NaN stays NaN,
 * as in torch's clamp. */
static inline void glu_backward_pair(sam_act act, float alpha, float limit, float d, float g, float u, float *dg,
                                     float *du)
{
    if (act == SAM_ACT_SWIGLU) {
        const float sg = 1.0f / (1.0f + expf(-g));
        *dg = (d * u) * (sg * (1.0f + g * (1.0f - sg)));
        *du = d * (g * sg);
        return;
    }
    const float gc = g > limit ? limit : g;
    const float uc = u > limit ? limit : (u < -limit ? -limit : u);
    const float sg = 1.0f / (1.0f + expf(-(alpha * gc)));
    *dg = g <= limit ? (d * (uc + 1.0f)) * (sg + ((alpha * gc) * sg) * (1.0f - sg)) : 0.0f;
    *du = (u >= -limit && u <= limit) ? d * (gc * sg) : 0.0f;
}

/* out[s] = (dgate, dup) of row s, zeros for the rows past offsets[E] (never read). */
sam_status sam_glu_backward_ref(const sam_glu_backward_params *p)
{
    if (p->act != SAM_ACT_SWIGLU && p->act != SAM_ACT_GPTOSS) {
        sam_ref_set_error("glu_backward: act %d is not a gated activation", (int)p->act);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const int64_t I = p->I, live = p->offsets != NULL ? (int64_t)sam_ld_i32(p->offsets, p->E) : p->S;
    if (p->out_t != NULL) { /* its columns come from the offsets: checked before anything is written */
        for (int64_t e = 0; e <= p->E; e++) {
            const int64_t a = sam_ld_i32(p->offsets, e), lo = e > 0 ? sam_ld_i32(p->offsets, e - 1) : 0;
            if (a < lo || a > p->S) {
                sam_ref_set_error("offsets: offsets[%lld] = %lld; expected non-decreasing offsets in [0, %lld] "
                                  "(the rows of preact) with out_t", (long long)e, (long long)a, (long long)p->S);
                return SAM_STATUS_INVALID_ARGUMENT;
            }
        }
    }
    for (int64_t s = 0; s < p->S; s++) {
        if (s >= live) {
            for (int64_t i = 0; i < 2 * I; i++) sam_store_f32(p->out, p->out_dtype, s * p->ldo + i, 0.0f);
            if (p->hdot != NULL) p->hdot[s] = 0.0f;
            continue;
        }
        const float sc = p->scale != NULL ? sam_ld_f32(p->scale, s) : 1.0f;
        float dot = 0.0f;
        for (int64_t i = 0; i < I; i++) {
            float d = sam_load_f32(p->dh, p->dh_dtype, s * p->lddh + i), dg, du;
            const float g = sam_load_f32(p->pre, p->dtype, s * p->ldp + i);
            const float u = sam_load_f32(p->pre, p->dtype, s * p->ldp + I + i);
            if (p->hdot != NULL) {  /* h as glu writes it: rounded to the pre-activation's dtype */
                double h = 0.0;  /* (room for any dtype's element) */
                sam_store_f32(&h, p->dtype, 0, sam_act_glu(p->act, g, u, p->alpha, p->limit));
                dot += d * sam_load_f32(&h, p->dtype, 0);
            }
            if (p->scale != NULL) d *= sc;
            glu_backward_pair(p->act, p->alpha, p->limit, d, g, u, &dg, &du);
            sam_store_f32(p->out, p->out_dtype, s * p->ldo + i, dg);
            sam_store_f32(p->out, p->out_dtype, s * p->ldo + I + i, du);
        }
        if (p->hdot != NULL) p->hdot[s] = dot;
    }
    if (p->out_t != NULL) { /* out again, rounded to dtype, transposed by expert segment */
        const int64_t W = sam_dyt_cols(p->S, p->E);
        for (int64_t k = 0; k < (2 * I + 1) * W; k++) sam_store_f32(p->out_t, p->dtype, k, 0.0f);
        for (int64_t e = 0; e < p->E; e++) {
            const int64_t s0 = sam_ld_i32(p->offsets, e), s1 = sam_ld_i32(p->offsets, e + 1);
            const int64_t c0 = sam_dyt_segment(s0, e);
            for (int64_t s = s0; s < s1; s++)
                for (int64_t i = 0; i < 2 * I; i++)
                    sam_store_f32(p->out_t, p->dtype, i * W + c0 + s - s0,
                                  sam_load_f32(p->out, p->out_dtype, s * p->ldo + i));
        }
    }
    return SAM_STATUS_OK;
}
