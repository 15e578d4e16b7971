/*
 * ssmm_ref.c -- the sparse-sparse matmul on the CPU: the definition the CUDA
 * kernels (cuda/ssmm.cu) must agree with.
 *
 * For every expert e and every sorted row s in [offsets[e], offsets[e+1]):
 *     acc[r] = sum_c x[t][c] * W_e[r][c]        t = token_ids[s] (or s)
 * in fp32, W_e the masked dense weight held by the packed arrays.  Then
 *     acc[r] += bias[e][r]                       (if bias)
 *     y = act(acc)                               (none: R values; GLU: R/2)
 *     y *= scale[s]                              (if scale)
 *     out[s][:] = y, rounded once to out's dtype.
 * Sorted rows past offsets[E] are not written.
 *
 * Work per expert: the packed rows are decoded once into (column, value)
 * lists, then every token is a sparse dot product per stored row and slice.
 */
#include "sam_ref.h"

#include <stdlib.h>

/* The sorted rows' offsets (non-decreasing, from >= 0, ending within the S rows of `what`)
 * and their token ids (inside x's T rows): checked before anything is written.  Sets
 * *first and *last (offsets[0], offsets[E]). */
static sam_status check_rows(const int32_t *offsets, const int32_t *token_ids, int64_t E, int64_t S, int64_t T,
                             const char *what, const char *src, int32_t *first, int32_t *last)
{
    *first = sam_ld_i32(offsets, 0);
    *last = sam_ld_i32(offsets, E);
    if (*first < 0) {
        sam_ref_set_error("offsets: offsets[0] is %d; expected >= 0", *first);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    for (int64_t e = 0; e < E; e++) {
        const int32_t a = sam_ld_i32(offsets, e), b = sam_ld_i32(offsets, e + 1);
        if (b < a) {
            sam_ref_set_error("offsets: offsets[%lld] = %d is below offsets[%lld] = %d; expected "
                              "non-decreasing", (long long)(e + 1), b, (long long)e, a);
            return SAM_STATUS_INVALID_ARGUMENT;
        }
    }
    if (*last > S) {
        sam_ref_set_error("offsets: offsets[E] = %d exceeds the %lld rows of %s", *last, (long long)S, what);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    for (int64_t s = *first; s < *last; s++) {
        int64_t t = token_ids ? sam_ld_i32(token_ids, s) : s;
        if (t < 0 || t >= T) {
            sam_ref_set_error("token_ids: token_ids[%lld] = %lld is outside %s's %lld rows",
                              (long long)s, (long long)t, src, (long long)T);
            return SAM_STATUS_INVALID_ARGUMENT;
        }
    }
    return SAM_STATUS_OK;
}

/* check_rows, then, where some row is routed, the packed arrays as unpack takes them:
 * out-of-range or unordered row indices and invalid 2:4 codes are refused, never read as
 * some other weight.  Every op of this file calls it before writing anything. */
static sam_status check_call(const int32_t *offsets, const int32_t *token_ids, int64_t S, int64_t T,
                             const char *what, const char *src, const uint32_t *meta, const uint8_t *idx,
                             sam_format f, const sam_dims *d, int32_t *first, int32_t *last)
{
    const sam_status rows_ok = check_rows(offsets, token_ids, d->E, S, T, what, src, first, last);
    if (rows_ok != SAM_STATUS_OK || *last == *first) return rows_ok;
    return sam_format_check_ref(meta, idx, f, d);
}

/* Expert e's mask, decoded: rowof[q * nslices + j] the original row storage row q holds in
 * slice j (-1 for padding), cols[q * cp/2 + k] the column of value slot k of row q. */
static void decode_mask(const uint32_t *meta, const uint8_t *idx, sam_format f, const sam_dims *d, int64_t e,
                        int64_t nslices, int64_t *rowof, int32_t *cols)
{
    const int sel = sam_format_has_selection(f);
    const int64_t rp = d->rp, cp = d->cp, half = cp / 2;
    const int64_t mb = e * sam_meta_per_expert(d); /* this expert's first meta word */
    const uint8_t *ie = sel ? idx + e * sam_idx_per_expert(d) : NULL;
    for (int64_t q = 0; q < rp; q++) {
        int h;
        int64_t qq;
        const int live = sam_storage_row(d, f.glu, q, &h, &qq);
        for (int64_t j = 0; j < nslices; j++) {
            const int s = sel ? ie[j * rp + q] : 0;
            rowof[q * nslices + j] = live ? sam_original_row(f, d, h, qq, s) : -1;
        }
        for (int64_t c = 0; c < cp; c += 4) {
            const uint32_t nib = (sam_ld_u32(meta, mb + sam_meta_word(d, q, c)) >> sam_meta_shift(q, c)) & 0xfu;
            const int64_t k = q * half + c / 2;
            cols[k] = (int32_t)(c + (nib & 3u));
            cols[k + 1] = (int32_t)(c + (nib >> 2));
        }
    }
}

sam_status sam_ssmm_ref(const sam_ssmm_params *p)
{
    const sam_format f = p->f;
    const sam_dims *d = &p->d;
    const int64_t R = d->R, C = d->C, cp = d->cp, rp = d->rp, E = d->E;
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : (C > 0 ? C : 1);
    const int64_t nslices = sel ? d->slices : 1;
    const int64_t half = cp / 2;

    /* offsets, token ids and the packed arrays first: nothing is written unless all are valid */
    int32_t first, last;
    const sam_status ok = check_call(p->offsets, p->token_ids, p->S, p->T, "out", "x", p->meta, p->idx, f, d,
                                     &first, &last);
    if (ok != SAM_STATUS_OK || last == first) return ok;

    float *vals = (float *)malloc(sizeof(float) * (size_t)(rp * half + 1));
    int32_t *cols = (int32_t *)malloc(sizeof(int32_t) * (size_t)(rp * half + 1));
    int64_t *rowof = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rp * nslices + 1));
    float *xf = (float *)malloc(sizeof(float) * (size_t)(C + 1));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(R + 1));
    if (!vals || !cols || !rowof || !xf || !acc) {
        free(vals); free(cols); free(rowof); free(xf); free(acc);
        sam_ref_set_error("out of memory decoding an expert of %lld x %lld", (long long)R, (long long)C);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const size_t es = p->dtype == SAM_F32 ? 4 : 2;
    const int64_t nv = sam_values_per_expert(d);
    const int64_t out_cols = p->act == SAM_ACT_NONE ? R : R / 2;
    sam_status status = SAM_STATUS_OK;

    for (int64_t e = 0; e < E && status == SAM_STATUS_OK; e++) {
        const int64_t s0 = sam_ld_i32(p->offsets, e), s1 = sam_ld_i32(p->offsets, e + 1);
        if (s0 == s1) continue;
        const char *ve = (const char *)p->values + e * nv * (int64_t)es;
        decode_mask(p->meta, p->idx, f, d, e, nslices, rowof, cols);
        for (int64_t k = 0; k < rp * half; k++) vals[k] = sam_load_f32(ve, p->dtype, k);
        for (int64_t s = s0; s < s1; s++) {
            const int64_t t = p->token_ids ? sam_ld_i32(p->token_ids, s) : s;
            for (int64_t c = 0; c < C; c++) xf[c] = sam_load_f32(p->x, p->dtype, t * p->ldx + c);
            for (int64_t r = 0; r < R; r++) acc[r] = 0.0f;
            for (int64_t q = 0; q < rp; q++) {
                for (int64_t j = 0; j < nslices; j++) {
                    const int64_t r = rowof[q * nslices + j];
                    if (r < 0) continue;
                    const int64_t c0 = j * V, c1 = c0 + V < C ? c0 + V : C;
                    const float *vq = vals + q * half;
                    const int32_t *cq = cols + q * half;
                    float sum = acc[r];
                    for (int64_t k = c0 / 2; k < c1 / 2; k++) sum += vq[k] * xf[cq[k]];
                    acc[r] = sum;
                }
            }
            if (p->bias)
                for (int64_t r = 0; r < R; r++) acc[r] += sam_load_f32(p->bias, p->bias_dtype, e * R + r);
            const float sc = p->scale ? sam_ld_f32(p->scale, s) : 1.0f;
            if (p->preact && p->act != SAM_ACT_NONE)
                for (int64_t r = 0; r < R; r++) sam_store_f32(p->preact, p->dtype, s * p->ldp + r, acc[r]);
            for (int64_t i = 0; i < out_cols; i++) {
                float y = p->act == SAM_ACT_NONE
                              ? acc[i]
                              : sam_act_glu(p->act, acc[i], acc[R / 2 + i], p->alpha, p->limit);
                sam_store_f32(p->out, p->dtype, s * p->ldo + i, y * sc);
            }
        }
    }
    free(vals); free(cols); free(rowof); free(xf); free(acc);
    return status;
}

/*
 * The weight gradient of an ssmm in the packed layout (cuda/samoyeds_cuda.h,
 * sam_ssmm_dw_params): for every kept value of expert e,
 *     out[e][p][j] = sum over sorted rows s of e of dy[u][r] * scale[s] * x[t][col]
 * (r, col: the original row and column the value sits at; t = token_ids[s], u = dy_ids[s],
 * or s), fp32, one rounding.
 *
 * Work per expert: the storage rows are decoded once into (row per slice, column
 * per value) lists; then every sorted row adds its outer-product terms to an fp32
 * accumulator of the expert's values, rows in increasing s (the fixed order).
 */
sam_status sam_ssmm_dw_ref(const sam_ssmm_dw_params *p)
{
    const sam_format f = p->f;
    const sam_dims *d = &p->d;
    const int64_t R = d->R, C = d->C, cp = d->cp, rp = d->rp, E = d->E;
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : (C > 0 ? C : 1);
    const int64_t nslices = sel ? d->slices : 1;
    const int64_t half = cp / 2;

    int32_t first, last;
    const sam_status ok = check_call(p->offsets, p->token_ids, p->S, p->T, "dy", "x", p->meta, p->idx, f, d,
                                     &first, &last);
    if (ok != SAM_STATUS_OK) return ok;
    for (int64_t s = first; p->dy_ids && s < last; s++) {
        const int64_t u = sam_ld_i32(p->dy_ids, s);
        if (u < 0 || u >= p->Tdy) {
            sam_ref_set_error("dy_token_ids: dy_token_ids[%lld] = %lld is outside dy's %lld rows", (long long)s,
                              (long long)u, (long long)p->Tdy);
            return SAM_STATUS_INVALID_ARGUMENT;
        }
    }

    const int64_t nv = sam_values_per_expert(d);
    float *acc = (float *)malloc(sizeof(float) * (size_t)(nv + 1));
    int32_t *cols = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nv + 1));
    int64_t *rowof = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rp * nslices + 1));
    float *xf = (float *)malloc(sizeof(float) * (size_t)(C + 1));
    float *gf = (float *)malloc(sizeof(float) * (size_t)(R + 1));
    if (!acc || !cols || !rowof || !xf || !gf) {
        free(acc); free(cols); free(rowof); free(xf); free(gf);
        sam_ref_set_error("out of memory for the gradient of an expert of %lld x %lld", (long long)R,
                          (long long)C);
        return SAM_STATUS_INVALID_ARGUMENT;
    }

    for (int64_t e = 0; e < E; e++) {
        const int64_t s0 = sam_ld_i32(p->offsets, e), s1 = sam_ld_i32(p->offsets, e + 1);
        for (int64_t k = 0; k < nv; k++) acc[k] = 0.0f;
        if (s1 > s0) {
            decode_mask(p->meta, p->idx, f, d, e, nslices, rowof, cols);
            for (int64_t s = s0; s < s1; s++) {
                const int64_t t = p->token_ids ? sam_ld_i32(p->token_ids, s) : s;
                const float sc = p->scale ? sam_ld_f32(p->scale, s) : 1.0f;
                for (int64_t c = 0; c < C; c++) xf[c] = sam_load_f32(p->x, p->dtype, t * p->ldx + c);
                const int64_t u = p->dy_ids ? sam_ld_i32(p->dy_ids, s) : s;
                if (p->dy_t != NULL) { /* dy * scale, transposed by segment (samoyeds_layout.h) */
                    const int64_t W = sam_dyt_cols(p->S, E), col = sam_dyt_segment(s0, e) + s - s0;
                    for (int64_t r = 0; r < R; r++) gf[r] = sam_load_f32(p->dy_t, p->dtype, r * W + col);
                } else {
                    for (int64_t r = 0; r < R; r++) gf[r] = sam_load_f32(p->dy, p->dtype, u * p->lddy + r) * sc;
                }
                for (int64_t q = 0; q < rp; q++) {
                    for (int64_t j = 0; j < nslices; j++) {
                        const int64_t r = rowof[q * nslices + j];
                        if (r < 0) continue;
                        const int64_t c0 = j * V, c1 = c0 + V < C ? c0 + V : C;
                        const float g = gf[r];
                        float *aq = acc + q * half;
                        const int32_t *cq = cols + q * half;
                        for (int64_t k = c0 / 2; k < c1 / 2; k++) aq[k] += g * xf[cq[k]];
                    }
                }
            }
        }
        for (int64_t k = 0; k < nv; k++) sam_store_f32(p->out, p->dtype, e * nv + k, acc[k]);
    }
    free(acc); free(cols); free(rowof); free(xf); free(gf);
    return SAM_STATUS_OK;
}

/*
 * The input gradient of an ssmm from the forward's packing (cuda/samoyeds_cuda.h,
 * sam_ssmm_dx_params): for every sorted row s of expert e and column c,
 *     out[s][c] = scale[s] * sum_r dy[t][r] * W_e[r][c]
 * fp32, one rounding; rows outside [offsets[0], offsets[E]) written as 0.
 *
 * Work per expert: the storage rows are decoded once into (row per slice, column per
 * value) lists and their values into fp32; then every sorted row scatters, storage row by
 * storage row and slice by slice, dy[t][orig row] times the kept values into an fp32
 * accumulator of its columns (the contraction over the kept rows only, as the kernel's).
 */
sam_status sam_ssmm_dx_ref(const sam_ssmm_dx_params *p)
{
    const sam_format f = p->f;
    const sam_dims *d = &p->d;
    const int64_t R = d->R, C = d->C, cp = d->cp, rp = d->rp, E = d->E;
    const int sel = sam_format_has_selection(f);
    const int64_t V = sel ? f.v : (C > 0 ? C : 1);
    const int64_t nslices = sel ? d->slices : 1;
    const int64_t half = cp / 2;

    int32_t first, last;
    const sam_status ok = check_call(p->offsets, p->token_ids, p->S, p->T, "out", "dy", p->meta, p->idx, f, d,
                                     &first, &last);
    if (ok != SAM_STATUS_OK) return ok;

    float *vals = (float *)malloc(sizeof(float) * (size_t)(rp * half + 1));
    int32_t *cols = (int32_t *)malloc(sizeof(int32_t) * (size_t)(rp * half + 1));
    int64_t *rowof = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rp * nslices + 1));
    float *gf = (float *)malloc(sizeof(float) * (size_t)(R + 1));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(C + 1));
    if (!vals || !cols || !rowof || !gf || !acc) {
        free(vals); free(cols); free(rowof); free(gf); free(acc);
        sam_ref_set_error("out of memory for the input gradient of an expert of %lld x %lld", (long long)R,
                          (long long)C);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const size_t es = p->dtype == SAM_F32 ? 4 : 2;
    const int64_t nv = sam_values_per_expert(d);

    /* the rows no expert owns: 0 */
    for (int64_t s = 0; s < p->S; s++) {
        if (s >= first && s < last) continue;
        for (int64_t c = 0; c < C; c++) sam_store_f32(p->out, p->dtype, s * p->ldo + c, 0.0f);
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t s0 = sam_ld_i32(p->offsets, e), s1 = sam_ld_i32(p->offsets, e + 1);
        if (s0 == s1) continue;
        const char *ve = (const char *)p->values + e * nv * (int64_t)es;
        decode_mask(p->meta, p->idx, f, d, e, nslices, rowof, cols);
        for (int64_t k = 0; k < rp * half; k++) vals[k] = sam_load_f32(ve, p->dtype, k);
        for (int64_t s = s0; s < s1; s++) {
            const int64_t t = p->token_ids ? sam_ld_i32(p->token_ids, s) : s;
            for (int64_t r = 0; r < R; r++) gf[r] = sam_load_f32(p->dy, p->dtype, t * p->lddy + r);
            for (int64_t c = 0; c < C; c++) acc[c] = 0.0f;
            for (int64_t q = 0; q < rp; q++) {
                for (int64_t j = 0; j < nslices; j++) {
                    const int64_t r = rowof[q * nslices + j];
                    if (r < 0) continue;
                    const int64_t c0 = j * V, c1 = c0 + V < C ? c0 + V : C;
                    const float g = gf[r];
                    const float *vq = vals + q * half;
                    const int32_t *cq = cols + q * half;
                    for (int64_t k = c0 / 2; k < c1 / 2; k++) acc[cq[k]] += g * vq[k];
                }
            }
            const float sc = p->scale ? sam_ld_f32(p->scale, s) : 1.0f;
            for (int64_t c = 0; c < C; c++) sam_store_f32(p->out, p->dtype, s * p->ldo + c, acc[c] * sc);
        }
    }
    free(vals); free(cols); free(rowof); free(gf); free(acc);
    return SAM_STATUS_OK;
}
