/*
 * dense_ref.c -- dense weights at a few tokens on the CPU: the definition the CUDA
 * kernel (cuda/dense_decode.cu) must agree with.
 *
 * For every token t < T and output row r < R:
 *     g = sum_c x[t][c] * w[r][c]          fp32, in column order
 *     u = sum_c x[t][c] * up[r][c]         (a gated act only)
 *     out[t][r] = act(g, u)                (none: g), rounded once to out's dtype.
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
