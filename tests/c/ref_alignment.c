/*
 * ref_alignment.c -- the C reference (csrc/ *_ref.c) on arrays that start at
 * odd addresses and on empty arrays whose data pointer is NULL, as numpy and
 * torch hand them over through DLPack on the CPU.  Built by
 * tests/test_c_safety.py with -fsanitize=alignment,nonnull-attribute,undefined
 * -fno-sanitize-recover=all: any misaligned load or store, or memset(NULL, 0, 0),
 * aborts it.  Every op also runs on aligned copies of the same bytes, and the
 * results must be the same bytes.
 *
 * Build (every csrc/ *_ref.c file):
 *     cc -std=c11 -I cuda -I csrc tests/c/ref_alignment.c csrc/dense_ref.c csrc/format_ref.c \
 *        csrc/moe_ref.c csrc/router_ref.c csrc/ssmm_ref.c -lm
 * `ref_alignment empty` runs only the empty arrays, `ref_alignment odd` only the odd addresses.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sam_ref.h"

#define CHECK(cond)                                                             \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

static unsigned rng_state = 12345u;
static float frand(void)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* n bytes starting at an address that is 1 (mod 8), from one allocation. */
typedef struct { char *block; char *p; } odd_buf;
static odd_buf odd_alloc(size_t n)
{
    odd_buf b;
    b.block = calloc(n + 16, 1);
    CHECK(b.block != NULL);
    b.p = b.block + 1;
    return b;
}

/* Runs the ops once on buffers from `buf` (odd or aligned) with the same contents;
 * writes every output into `res` (res_n bytes). */
static void run(int odd, char *res, size_t res_n)
{
    enum { E = 2, R = 64, C = 128, T = 6, K = 2 };
    sam_format f = {1, 2, 64, 0};
    sam_dims d;
    CHECK(sam_dims_make(f, E, R, C, &d) == 0);
    const size_t nw = (size_t)E * R * C, nv = (size_t)sam_values_per_expert(&d) * E,
                 nm = (size_t)sam_meta_per_expert(&d) * E, ni = (size_t)sam_idx_per_expert(&d) * E;
    size_t at = 0;
#define BUF(name, type, count)                                                  \
    odd_buf name##_b = odd_alloc(sizeof(type) * (count));                       \
    type *name = (type *)(void *)(odd ? name##_b.p : name##_b.block + 8);
    BUF(w, float, nw);
    BUF(mask, uint8_t, nw);
    BUF(values, float, nv);
    BUF(meta, uint32_t, nm);
    BUF(idx, uint8_t, ni);
    BUF(dense, float, nw);
    BUF(x, float, T * C);
    BUF(topk, int64_t, T * K);
    BUF(offsets, int32_t, E + 1);
    BUF(tok, int32_t, T * K);
    BUF(perm, int32_t, T * K);
    BUF(pos, int32_t, T * K);
    BUF(tkw, float, T * K);
    BUF(scale, float, T * K);
    BUF(y, float, T * K * R);
    BUF(out, float, T * R);
    BUF(ids, int64_t, T * K);
    BUF(logits, float, T * E);
    BUF(rw, float, T * K);
    BUF(wr, float, E * C);
#undef BUF
    rng_state = 12345u;
    for (size_t i = 0; i < nw; i++) { float v = frand(); memcpy((char *)w + 4 * i, &v, 4); }
    for (size_t i = 0; i < (size_t)T * C; i++) { float v = frand(); memcpy((char *)x + 4 * i, &v, 4); }
    for (size_t i = 0; i < (size_t)E * C; i++) { float v = frand(); memcpy((char *)wr + 4 * i, &v, 4); }
    for (int i = 0; i < T * K; i++) {
        int64_t e = (i * 7 + 3) % (E + 1) - (i == 5); /* some ids outside [0, E) */
        float v = frand();
        memcpy((char *)topk + 8 * i, &e, 8);
        memcpy((char *)tkw + 4 * i, &v, 4);
    }
    CHECK(sam_format_mask_ref(mask, w, SAM_F32, NULL, SAM_F32, f, &d) == SAM_STATUS_OK);
    CHECK(sam_format_pack_ref(values, meta, idx, w, mask, SAM_F32, f, &d) == SAM_STATUS_OK);
    CHECK(sam_format_unpack_ref(dense, values, meta, idx, SAM_F32, f, &d) == SAM_STATUS_OK);
    CHECK(sam_moe_route_ref(topk, SAM_I64, T, K, E, offsets, tok, perm, pos) == SAM_STATUS_OK);
    CHECK(sam_moe_gather_weights_ref(scale, tkw, SAM_F32, perm, offsets, E, T * K) == SAM_STATUS_OK);
    sam_ssmm_params p;
    memset(&p, 0, sizeof p);
    p.x = x; p.T = T; p.ldx = C; p.dtype = SAM_F32;
    p.values = values; p.meta = meta; p.idx = idx; p.f = f; p.d = d;
    p.offsets = offsets; p.token_ids = tok; p.S = T * K;
    p.act = SAM_ACT_NONE; p.scale = scale; p.out = y; p.ldo = R;
    CHECK(sam_ssmm_ref(&p) == SAM_STATUS_OK);
    CHECK(sam_moe_combine_ref(out, SAM_F32, y, SAM_F32, pos, T, K, R, R, T * K) == SAM_STATUS_OK);
    sam_router_params r;
    memset(&r, 0, sizeof r);
    r.x = x; r.T = T; r.ldx = C; r.dtype = SAM_F32; r.w = wr; r.E = E; r.H = C; r.k = K;
    r.n_group = r.topk_group = 1; r.scale = 1.0f;
    r.logits = logits; r.logits_dtype = SAM_F32; r.weights = rw; r.weights_dtype = SAM_F32; r.ids = ids;
    CHECK(sam_router_ref(&r) == SAM_STATUS_OK);
    const struct { const void *p; size_t n; } outs[] = {
        {mask, nw}, {values, 4 * nv}, {meta, 4 * nm}, {idx, ni}, {dense, 4 * nw}, {offsets, 4 * (E + 1)},
        {tok, 4 * T * K}, {perm, 4 * T * K}, {pos, 4 * T * K}, {scale, 4 * T * K}, {y, 4 * T * K * R},
        {out, 4 * T * R}, {logits, 4 * T * E}, {rw, 4 * T * K}, {ids, 8 * T * K}};
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
        CHECK(at + outs[i].n <= res_n);
        memcpy(res + at, outs[i].p, outs[i].n);
        at += outs[i].n;
    }
    odd_buf all[] = {w_b, mask_b, values_b, meta_b, idx_b, dense_b, x_b, topk_b, offsets_b, tok_b, perm_b,
                     pos_b, tkw_b, scale_b, y_b, out_b, ids_b, logits_b, rw_b, wr_b};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i].block);
}

/* Empty weights as torch hands them over: every data pointer NULL. */
static void run_empty(void)
{
    sam_format f = {1, 2, 64, 0};
    sam_dims d;
    CHECK(sam_dims_make(f, 0, 64, 128, &d) == 0);
    CHECK(sam_format_mask_ref(NULL, NULL, SAM_F32, NULL, SAM_F32, f, &d) == SAM_STATUS_OK);
    CHECK(sam_format_pack_ref(NULL, NULL, NULL, NULL, NULL, SAM_F32, f, &d) == SAM_STATUS_OK);
    CHECK(sam_format_unpack_ref(NULL, NULL, NULL, NULL, SAM_F32, f, &d) == SAM_STATUS_OK);
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "all";
    if (strcmp(what, "empty") != 0) {
        const size_t n = 1 << 20;
        char *a = calloc(n, 1), *b = calloc(n, 1);
        CHECK(a != NULL && b != NULL);
        run(0, a, n);
        run(1, b, n);
        CHECK(memcmp(a, b, n) == 0);
        free(a);
        free(b);
    }
    if (strcmp(what, "odd") != 0) run_empty();
    puts("ok");
    return 0;
}
