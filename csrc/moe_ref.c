/*
 * moe_ref.c -- MoE routing metadata and the combine on the CPU (the definition
 * cuda/moe.cu must agree with, bit for bit: both are integer work, and the
 * combine adds in the same fixed order).
 *
 * route: a stable counting sort of the T*K (token, slot) pairs by expert.
 *   offsets[E+1]   expert e owns sorted rows [offsets[e], offsets[e+1])
 *   token_ids[s]   the token of sorted row s
 *   perm[s]        the flat index t*K + k of sorted row s
 *   pos[t*K + k]   the sorted row of (t, k), or -1 when its expert id is
 *                  outside [0, E) (an expert-parallel placeholder)
 *   Sorted rows from offsets[E] to T*K - 1 are filled with token 0 / perm -1.
 * combine: out[t][h] = sum over k = 0..K-1 (in that order) of y[pos[t*K+k]][h],
 *   accumulated in fp32 and rounded once; rows outside [0, S) count as absent.
 */
#include "sam_ref.h"

#include <stdlib.h>
#include <string.h>

sam_status sam_moe_route_ref(const void *top_k_index, sam_dtype index_dtype,
                             int64_t T, int64_t K, int64_t E,
                             int32_t *offsets, int32_t *token_ids, int32_t *perm, int32_t *pos)
{
    const int64_t n = T * K;
    /* next[e]: the next sorted row of expert e (first the counts, then the offsets) */
    int32_t *next = (int32_t *)calloc((size_t)(E + 1), sizeof(int32_t));
    if (next == NULL) {
        sam_ref_set_error("out of memory for %lld experts", (long long)E);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t e = sam_load_index(top_k_index, index_dtype, i);
        if (e >= 0 && e < E) next[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) next[e + 1] += next[e];
    for (int64_t e = 0; e <= E; e++) sam_st_i32(offsets, e, next[e]);
    const int32_t routed = next[E];
    for (int64_t i = 0; i < n; i++) {
        int64_t e = sam_load_index(top_k_index, index_dtype, i);
        if (e >= 0 && e < E) {
            int32_t s = next[e]++;
            sam_st_i32(token_ids, s, (int32_t)(i / K));
            sam_st_i32(perm, s, (int32_t)i);
            sam_st_i32(pos, i, s);
        } else {
            sam_st_i32(pos, i, -1);
        }
    }
    for (int64_t s = routed; s < n; s++) {
        sam_st_i32(token_ids, s, 0);
        sam_st_i32(perm, s, -1);
    }
    free(next);
    return SAM_STATUS_OK;
}

sam_status sam_moe_gather_weights_ref(float *out, const void *w, sam_dtype wt,
                                      const int32_t *perm, const int32_t *offsets,
                                      int64_t E, int64_t S)
{
    const int32_t routed = sam_ld_i32(offsets, E);
    for (int64_t s = 0; s < S; s++) {
        const int32_t from = sam_ld_i32(perm, s);
        sam_st_f32(out, s, s < routed && from >= 0 ? sam_load_f32(w, wt, from) : 0.0f);
    }
    return SAM_STATUS_OK;
}

sam_status sam_moe_combine_ref(void *out, sam_dtype out_dtype, const void *y,
                               sam_dtype y_dtype, const int32_t *pos,
                               int64_t T, int64_t K, int64_t H, int64_t ldy, int64_t S)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                int32_t s = sam_ld_i32(pos, t * K + k);
                if (s >= 0 && s < S) acc += sam_load_f32(y, y_dtype, (int64_t)s * ldy + h);
            }
            sam_store_f32(out, out_dtype, t * H + h, acc);
        }
    return SAM_STATUS_OK;
}

sam_status sam_moe_zero_unrouted_ref(void *out, int64_t row_bytes, int64_t ld_bytes, const int32_t *offsets,
                                     int64_t E, int64_t S)
{
    int64_t routed = sam_ld_i32(offsets, E);
    if (routed < 0) routed = 0;
    for (int64_t s = routed; s < S; s++) memset((char *)out + s * ld_bytes, 0, (size_t)row_bytes);
    return SAM_STATUS_OK;
}
