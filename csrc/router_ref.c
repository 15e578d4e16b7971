/*
 * router_ref.c -- the router on the CPU: logits, scores and the top-k experts of every
 * token, the definition the CUDA kernels (cuda/router.cu) must agree with (the rule is
 * written out at sam_router_params in cuda/samoyeds_cuda.h).
 *
 * Logits accumulate in fp32 in column order; the scores come from the logits as stored
 * (rounded to logits_dtype), so a model whose router computes in bfloat16 picks from the
 * same values it would.
 */
#include "sam_ref.h"

#include <math.h>
#include <stdlib.h>

static float round_to(sam_dtype t, float v)
{
    switch (t) {
    case SAM_F16: return sam_f16_to_f32(sam_f32_to_f16(v));
    case SAM_BF16: return sam_bf16_to_f32(sam_f32_to_bf16(v));
    default: return v;
    }
}

/* The index of the largest of s[0..n) not yet taken; equal values: the lower index.
 * A NaN never wins over a number; -1 only when every entry is taken. */
static int arg_best(const float *s, const unsigned char *taken, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        if (best < 0 || s[i] > s[best] || (isnan(s[best]) && !isnan(s[i]))) best = i;
    }
    return best;
}

/* The group limit: s[e] keeps its value where e's group of E / G contiguous experts is
 * among the topk_group best and becomes `masked` elsewhere; a group's score is its largest
 * value, or with top2 the sum of its two largest (equal scores: the lower group first). */
static void group_limit(float *s, int64_t E, int G, int topk_group, int top2, float masked)
{
    const int gs = (int)(E / G);
    float gsc[SAM_ROUTER_MAX_GROUPS];
    unsigned char gtaken[SAM_ROUTER_MAX_GROUPS] = {0};
    for (int g = 0; g < G; g++) {
        float a = -INFINITY, b = -INFINITY;
        for (int i = 0; i < gs; i++) {
            const float c = s[g * gs + i];
            if (c > a) b = a, a = c;
            else if (c > b) b = c;
        }
        gsc[g] = top2 ? a + b : a;
    }
    for (int j = 0; j < topk_group; j++) gtaken[arg_best(gsc, gtaken, G)] = 1;
    for (int64_t e = 0; e < E; e++)
        if (!gtaken[e / gs]) s[e] = masked;
}

sam_status sam_router_ref(const sam_router_params *p)
{
    const int64_t T = p->T, E = p->E, H = p->H;
    const int k = p->k;
    if (E < 1 || E > SAM_ROUTER_MAX_EXPERTS || k < 1 || k > E || k > SAM_ROUTER_MAX_K || p->n_group < 1 ||
        p->n_group > SAM_ROUTER_MAX_GROUPS || E % p->n_group != 0 || p->topk_group < 1 ||
        p->topk_group > p->n_group || p->mode < SAM_ROUTER_SOFTMAX_TOPK || p->mode > SAM_ROUTER_SIGMOID_TOPK ||
        (p->mode == SAM_ROUTER_TOPK_SOFTMAX && p->n_group != 1) ||
        (p->mode == SAM_ROUTER_SIGMOID_TOPK && p->n_group > 1 && E / p->n_group < 2)) {
        sam_ref_set_error("router: E = %lld, k = %d, mode = %d, n_group = %d, topk_group = %d out of range",
                          (long long)E, k, p->mode, p->n_group, p->topk_group);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (T == 0) return SAM_STATUS_OK;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(H + 1));
    float *l = (float *)malloc(sizeof(float) * (size_t)E);
    float *s = (float *)malloc(sizeof(float) * (size_t)E);
    float *ch = (float *)malloc(sizeof(float) * (size_t)E);
    unsigned char *taken = (unsigned char *)malloc((size_t)E);
    if (xf == NULL || l == NULL || s == NULL || ch == NULL || taken == NULL) {
        free(xf), free(l), free(s), free(ch), free(taken);
        sam_ref_set_error("router: out of memory for %lld experts", (long long)E);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    const int G = p->n_group;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c = 0; c < H; c++) xf[c] = sam_load_f32(p->x, p->dtype, t * p->ldx + c);
        for (int64_t e = 0; e < E; e++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < H; c++) acc += xf[c] * sam_load_f32(p->w, p->dtype, e * H + c);
            if (p->bias != NULL) acc += sam_load_f32(p->bias, p->bias_dtype, e);
            l[e] = round_to(p->logits_dtype, acc);
            sam_store_f32(p->logits, p->logits_dtype, t * E + e, acc);
        }
        float v[SAM_ROUTER_MAX_K];
        int sel[SAM_ROUTER_MAX_K];
        for (int64_t e = 0; e < E; e++) taken[e] = 0;
        if (p->mode == SAM_ROUTER_SOFTMAX_TOPK) {
            float m = l[0];
            for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
            float sum = 0.0f;
            for (int64_t e = 0; e < E; e++) sum += (s[e] = expf(l[e] - m));
            for (int64_t e = 0; e < E; e++) s[e] /= sum;
            if (G > 1) group_limit(s, E, G, p->topk_group, 0, 0.0f);
            for (int j = 0; j < k; j++) {
                sel[j] = arg_best(s, taken, (int)E);
                taken[sel[j]] = 1;
                v[j] = s[sel[j]];
            }
            if (p->renorm) {
                float tot = 0.0f;
                for (int j = 0; j < k; j++) tot += v[j];
                for (int j = 0; j < k; j++) v[j] /= tot;
            }
        } else if (p->mode == SAM_ROUTER_SIGMOID_TOPK) {
            for (int64_t e = 0; e < E; e++) {
                s[e] = 1.0f / (1.0f + expf(-l[e]));
                ch[e] = s[e] + (p->choice_bias != NULL ? sam_load_f32(p->choice_bias, p->choice_bias_dtype, e) : 0.0f);
            }
            if (G > 1) group_limit(ch, E, G, p->topk_group, 1, -INFINITY);
            float tot = 0.0f;
            for (int j = 0; j < k; j++) {
                sel[j] = arg_best(ch, taken, (int)E);
                taken[sel[j]] = 1;
                tot += (v[j] = s[sel[j]]);
            }
            if (p->renorm)
                for (int j = 0; j < k; j++) v[j] /= tot + 1e-20f;
        } else {
            for (int j = 0; j < k; j++) {
                sel[j] = arg_best(l, taken, (int)E);
                taken[sel[j]] = 1;
                v[j] = l[sel[j]];
            }
            const float m = v[0];
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += (v[j] = expf(v[j] - m));
            for (int j = 0; j < k; j++) v[j] /= sum;
        }
        for (int j = 0; j < k; j++) {
            sam_store_f32(p->weights, p->weights_dtype, t * k + j, v[j] * p->scale);
            sam_st_i64(p->ids, t * k + j, sel[j]);
        }
    }
    free(xf), free(l), free(s), free(ch), free(taken);
    return SAM_STATUS_OK;
}
