/*
 * bind_moe.c -- the MoE ops: moe_route (stable counting sort of the top-k
 * ids by expert), moe_gather_weights, moe_combine (csrc/moe_ref.c,
 * cuda/moe.cu), and moe_forward: route, gate_up, down and combine in one call
 * on buffers carved from a caller-allocated workspace (moe_workspace_bytes).
 *
 * Every size and byte offset of the workspace is computed with checked
 * arithmetic (sam_size_*): shapes whose products leave int64 are refused with
 * a ValueError before anything is read or written.
 */
#include "sam_args.h"
#include "sam_ref.h"

/* ---- moe_route(offsets, token_ids, perm, pos, top_k_index, stream=None) ---------------------- */

enum { R_INDEX, R_OFFSETS, R_TOKEN_IDS, R_PERM, R_POS, R_COUNT };
enum { VR_T, VR_K, VR_E1, VR_TK };

static const sam_arg_spec route_args[] = {
    [R_INDEX] = {"top_k_index", SAM_DT_INDEX, 2, {SAM_VAR(VR_T), SAM_VAR(VR_K)}, SAM_ARG_CONTIG, -1, 0, 0},
    [R_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(VR_E1)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
    [R_TOKEN_IDS] = {"token_ids", SAM_DT(SAM_I32), 1, {SAM_VAR(VR_TK)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
    [R_PERM] = {"perm", SAM_DT(SAM_I32), 1, {SAM_VAR(VR_TK)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
    [R_POS] = {"pos", SAM_DT(SAM_I32), 2, {SAM_VAR(VR_T), SAM_VAR(VR_K)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
};

/* T*K sorted rows, counted in int32 by the kernels. */
static int sorted_rows(const char *name, int64_t T, int64_t K, int64_t *S)
{
    if (sam_size_mul(T, K, S) == 0 && *S <= INT32_MAX) return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected T*K below 2**31 (int32 sorted rows), got T = %lld, K = %lld", name,
                 (long long)T, (long long)K);
    return -1;
}

/* E + 1 int32 offsets, E >= 1. */
static int expert_count(const char *name, int64_t E)
{
    if (E >= 1 && E < INT32_MAX) return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected 1 <= E < 2**31 - 1 experts (E + 1 int32 offsets), got E = %lld",
                 name, (long long)E);
    return -1;
}

static int route_derive(sam_op_call *c, void *vctx)
{
    (void)vctx;
    int64_t S;
    if (sorted_rows("top_k_index", c->t[R_INDEX].shape[0], c->t[R_INDEX].shape[1], &S) < 0 ||
        expert_count("offsets", c->t[R_OFFSETS].shape[0] - 1) < 0)
        return -1;
    sam_op_bind(c, VR_TK, S);
    return 0;
}

static sam_status route_run(const sam_op_call *c, void *vctx, void *stream)
{
    (void)vctx;
    const sam_tensor *t = c->t, *index = &t[R_INDEX];
    const int64_t T = index->shape[0], K = index->shape[1], E = t[R_OFFSETS].shape[0] - 1;
    int32_t *offsets = (int32_t *)t[R_OFFSETS].data, *token_ids = (int32_t *)t[R_TOKEN_IDS].data;
    int32_t *perm = (int32_t *)t[R_PERM].data, *pos = (int32_t *)t[R_POS].data;
    return SAM_DISPATCH(c, stream, sam_moe_route_ref(index->data, index->dtype, T, K, E, offsets, token_ids, perm, pos),
                        sam_moe_route_cuda(index->data, index->dtype, T, K, E, offsets, token_ids, perm, pos, NULL,
                                           NULL, SAM_F32, stream));
}

static const sam_op route_op = {"moe_route", route_args, R_COUNT, route_derive, NULL, route_run};

PyObject *sam_py_moe_route(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"offsets", "token_ids", "perm", "pos", "top_k_index", "stream", NULL};
    PyObject *o[R_COUNT], *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|O:moe_route", kwlist, &o[R_OFFSETS], &o[R_TOKEN_IDS],
                                     &o[R_PERM], &o[R_POS], &o[R_INDEX], &o_stream))
        return NULL;
    return sam_run_op(&route_op, module, o, o_stream, 0, NULL);
}

/* ---- moe_gather_weights(out, w, perm, offsets, stream=None) ------------------------------------ */

enum { W_W, W_OFFSETS, W_PERM, W_OUT, W_COUNT };
enum { VW_N, VW_E1 };

static const sam_arg_spec gather_args[] = {
    [W_W] = {"w", SAM_DT_FLOAT, -1, {0}, SAM_ARG_CONTIG, -1, 0, 0},
    [W_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(VW_E1)}, SAM_ARG_CONTIG, -1, 0, 0},
    [W_PERM] = {"perm", SAM_DT(SAM_I32), 1, {SAM_VAR(VW_N)}, SAM_ARG_CONTIG, -1, 0, 0},
    [W_OUT] = {"out", SAM_DT(SAM_F32), 1, {SAM_VAR(VW_N)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
};

static int gather_derive(sam_op_call *c, void *vctx)
{
    (void)vctx;
    if (expert_count("offsets", c->t[W_OFFSETS].shape[0] - 1) < 0) return -1;
    sam_op_bind(c, VW_N, sam_tensor_numel(&c->t[W_W]));
    return 0;
}

/* perm comes from the caller: on the CPU it is read before anything reads through it. */
static int gather_check(sam_op_call *c, void *vctx)
{
    (void)vctx;
    if (c->cuda) return 0;
    const int64_t n = c->var[VW_N];
    const char *perm = c->t[W_PERM].data;
    for (int64_t s = 0; s < n; s++) {
        int32_t p;
        memcpy(&p, perm + 4 * s, 4);
        if (p >= n) {
            PyErr_Format(PyExc_ValueError, "perm: expected entries below %lld (w's entries), got perm[%lld] = %d",
                         (long long)n, (long long)s, p);
            return -1;
        }
    }
    return 0;
}

static sam_status gather_run(const sam_op_call *c, void *vctx, void *stream)
{
    (void)vctx;
    const sam_tensor *t = c->t;
    float *out = (float *)t[W_OUT].data;
    const int32_t *perm = (const int32_t *)t[W_PERM].data, *offsets = (const int32_t *)t[W_OFFSETS].data;
    const int64_t E = c->var[VW_E1] - 1, S = c->var[VW_N];
    return SAM_DISPATCH(c, stream, sam_moe_gather_weights_ref(out, t[W_W].data, t[W_W].dtype, perm, offsets, E, S),
                        sam_moe_gather_weights_cuda(out, t[W_W].data, t[W_W].dtype, perm, offsets, E, S, stream));
}

static const sam_op gather_op = {"moe_gather_weights", gather_args, W_COUNT, gather_derive, gather_check,
                                 gather_run};

PyObject *sam_py_moe_gather_weights(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "w", "perm", "offsets", "stream", NULL};
    PyObject *o[W_COUNT], *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|O:moe_gather_weights", kwlist, &o[W_OUT], &o[W_W], &o[W_PERM],
                                     &o[W_OFFSETS], &o_stream))
        return NULL;
    return sam_run_op(&gather_op, module, o, o_stream, 0, NULL);
}

/* ---- moe_combine(out, y, pos, stream=None) ------------------------------------------------------ */

enum { C_OUT, C_Y, C_POS, C_COUNT };
enum { VC_T, VC_H, VC_K, VC_S };

static const sam_arg_spec combine_args[] = {
    [C_OUT] = {"out", SAM_DT_FLOAT, 2, {SAM_VAR(VC_T), SAM_VAR(VC_H)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
    [C_Y] = {"y", SAM_DT_FLOAT, 2, {SAM_VAR(VC_S), SAM_VAR(VC_H)}, SAM_ARG_ROWS, -1, 0, 0},
    [C_POS] = {"pos", SAM_DT(SAM_I32), 2, {SAM_VAR(VC_T), SAM_VAR(VC_K)}, SAM_ARG_CONTIG, -1, 0, 0},
};

static int combine_check(sam_op_call *c, void *vctx)
{
    (void)vctx;
    const sam_tensor *y = &c->t[C_Y];
    if (c->cuda && y->dtype != SAM_F32 && (c->ld[C_Y] % 2 != 0 || y->shape[1] % 2 != 0)) {
        PyErr_Format(PyExc_ValueError, "y: expected rows of an even length and an even row stride on the GPU, got "
                     "%lld columns with row stride %lld", (long long)y->shape[1], (long long)c->ld[C_Y]);
        return -1;
    }
    return 0;
}

static sam_status combine_run(const sam_op_call *c, void *vctx, void *stream)
{
    (void)vctx;
    const sam_tensor *out = &c->t[C_OUT], *y = &c->t[C_Y];
    const int32_t *pos = (const int32_t *)c->t[C_POS].data;
    const int64_t T = out->shape[0], H = out->shape[1], K = c->t[C_POS].shape[1], S = y->shape[0];
    return SAM_DISPATCH(c, stream,
                        sam_moe_combine_ref(out->data, out->dtype, y->data, y->dtype, pos, T, K, H, c->ld[C_Y], S),
                        sam_moe_combine_cuda(out->data, out->dtype, y->data, y->dtype, pos, T, K, H, c->ld[C_Y], S,
                                             stream));
}

static const sam_op combine_op = {"moe_combine", combine_args, C_COUNT, NULL, combine_check, combine_run};

PyObject *sam_py_moe_combine(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "y", "pos", "stream", NULL};
    PyObject *o[C_COUNT], *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:moe_combine", kwlist, &o[C_OUT], &o[C_Y], &o[C_POS],
                                     &o_stream))
        return NULL;
    return sam_run_op(&combine_op, module, o, o_stream, 0, NULL);
}

/* ---- moe_zero_unrouted(out, offsets, stream=None) ------------------------------------------------ */

enum { Z_OUT, Z_OFFSETS, Z_COUNT };
enum { VZ_S, VZ_E1 };

static const sam_arg_spec zero_args[] = {
    [Z_OUT] = {"out", 0, 2, {SAM_VAR(VZ_S), SAM_DIM_ANY}, SAM_ARG_ROWS | SAM_ARG_OUT, -1, 0, 0},
    [Z_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(VZ_E1)}, SAM_ARG_CONTIG, -1, 0, 0},
};

static int zero_derive(sam_op_call *c, void *vctx)
{
    (void)vctx;
    return expert_count("offsets", c->t[Z_OFFSETS].shape[0] - 1) < 0 ? -1 : 0;
}

static sam_status zero_run(const sam_op_call *c, void *vctx, void *stream)
{
    (void)vctx;
    const sam_tensor *out = &c->t[Z_OUT];
    const int64_t es = (int64_t)sam_dtype_size(out->dtype);
    const int64_t S = out->shape[0], row = out->shape[1] * es, ld = c->ld[Z_OUT] * es;
    const int64_t E = c->t[Z_OFFSETS].shape[0] - 1;
    const int32_t *offsets = (const int32_t *)c->t[Z_OFFSETS].data;
    return SAM_DISPATCH(c, stream, sam_moe_zero_unrouted_ref(out->data, row, ld, offsets, E, S),
                        sam_moe_zero_unrouted_cuda(out->data, row, ld, offsets, E, S, stream));
}

static const sam_op zero_op = {"moe_zero_unrouted", zero_args, Z_COUNT, zero_derive, NULL, zero_run};

PyObject *sam_py_moe_zero_unrouted(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "offsets", "stream", NULL};
    PyObject *o[Z_COUNT], *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O:moe_zero_unrouted", kwlist, &o[Z_OUT], &o[Z_OFFSETS],
                                     &o_stream))
        return NULL;
    return sam_run_op(&zero_op, module, o, o_stream, 0, NULL);
}

/* ---- the workspace of moe_forward ---------------------------------------------------------------- */

/* Byte offsets of the intermediates in a moe_forward workspace (each 256-byte
 * aligned) for T tokens, K experts per token, E experts, hidden H, expert
 * width I and elem-byte activations; S = T*K sorted rows. */
typedef struct moe_ws {
    int64_t offsets, token_ids, perm, pos, scale, h, y, total;
} moe_ws;

/* *where = *at; *at = align256(*at + a*b*c); -1 on overflow. */
static int ws_place(int64_t *at, int64_t *where, int64_t a, int64_t b, int64_t c)
{
    int64_t n;
    *where = *at;
    if (sam_size_mul(a, b, &n) < 0 || sam_size_mul(n, c, &n) < 0 || sam_size_add(*at, n, &n) < 0) return -1;
    return sam_size_round_up(n, 256, at);
}

static int moe_ws_layout(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, int64_t elem, moe_ws *w)
{
    int64_t S, E1, at = 0;
    if (sam_size_mul(T, K, &S) < 0 || sam_size_add(E, 1, &E1) < 0) return -1;
    if (ws_place(&at, &w->offsets, 4, E1, 1) < 0 || ws_place(&at, &w->token_ids, 4, S, 1) < 0 ||
        ws_place(&at, &w->perm, 4, S, 1) < 0 || ws_place(&at, &w->pos, 4, S, 1) < 0 ||
        ws_place(&at, &w->scale, 4, S, 1) < 0 ||
        ws_place(&at, &w->h, elem, S, I) < 0 ||  /* act(gate_up(x)) of every sorted row */
        ws_place(&at, &w->y, elem, S, H) < 0)    /* scale * down(h) */
        return -1;
    w->total = at;
    return 0;
}

/* The sizes moe_forward accepts and its workspace layout; the names say which
 * argument carries each size. */
typedef struct moe_names {
    const char *tk, *e, *h, *i, *all;
} moe_names;

static int moe_sizes(const moe_names *nm, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, int64_t elem,
                     moe_ws *L)
{
    int64_t S;
    if (sorted_rows(nm->tk, T, K, &S) < 0 || expert_count(nm->e, E) < 0 ||
        sam_arg_range(nm->h, H, 0, INT32_MAX, "0 <= H < 2**31") < 0 ||
        sam_arg_range(nm->i, I, 0, INT32_MAX / 2, "0 <= I < 2**30") < 0)
        return -1;
    if (moe_ws_layout(T, K, E, H, I, elem, L) == 0) return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected sizes whose workspace stays below 2**63 bytes, got T = %lld, "
                 "K = %lld, E = %lld, H = %lld, I = %lld with %d-byte activations", nm->all, (long long)T,
                 (long long)K, (long long)E, (long long)H, (long long)I, (int)elem);
    return -1;
}

PyObject *sam_py_moe_workspace_bytes(PyObject *module, PyObject *args, PyObject *kw)
{
    (void)module;
    static char *kwlist[] = {"T", "K", "E", "H", "I", "itemsize", NULL};
    static const moe_names names = {"T, K", "E", "H", "I", "T, K, E, H, I"};
    long long T, K, E, H, I;
    int elem;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLLi:moe_workspace_bytes", kwlist, &T, &K, &E, &H, &I, &elem))
        return NULL;
    if (elem != 2 && elem != 4) {
        PyErr_Format(PyExc_ValueError, "itemsize: expected 2 or 4, got %d", elem);
        return NULL;
    }
    moe_ws L;
    if (moe_sizes(&names, T, K, E, H, I, elem, &L) < 0) return NULL;
    return PyLong_FromLongLong(L.total);
}

/* ---- moe_forward ------------------------------------------------------------------------------------ */


/* One MoE forward: the steps of route, gather_weights, ssmm (gate_up, gated
 * activation), ssmm (down, routing weight) and combine. */
typedef struct moe_plan {
    sam_format fg, fd;
    int64_t I;
    sam_act act;
    float alpha, limit;
    sam_impl impl;
    moe_ws L;
    int32_t *offsets, *token_ids, *perm, *pos;
    float *scale;
    sam_ssmm_params gate_up, down;
} moe_plan;

enum { F_GV, F_GM, F_GI, F_DV, F_DM, F_DI, F_X, F_INDEX, F_WEIGHTS, F_GBIAS, F_DBIAS, F_OUT, F_WS, F_COUNT };
enum { VF_E, VF_GRP, VF_GCP2, VF_GMR, VF_GMC, VF_GSL, VF_DRP, VF_DCP2, VF_DMR, VF_DMC, VF_DSL, VF_T, VF_H, VF_K,
       VF_I2 };

static const sam_arg_spec forward_args[] = {
    SAM_PACKED_SPECS("gate_up_", SAM_ARG_HALF_GPU, -1, 0, VF_E, VF_GRP, VF_GCP2, VF_GMR, VF_GMC, VF_GSL),
    SAM_PACKED_SPECS("down_", SAM_ARG_LIKE, F_GV, 0, VF_E, VF_DRP, VF_DCP2, VF_DMR, VF_DMC, VF_DSL),
    [F_X] = {"x", 0, 2, {SAM_VAR(VF_T), SAM_VAR(VF_H)}, SAM_ARG_ROWS | SAM_ARG_LIKE, F_GV, 16, 8},
    [F_INDEX] = {"top_k_index", SAM_DT_INDEX, 2, {SAM_VAR(VF_T), SAM_VAR(VF_K)}, SAM_ARG_CONTIG, -1, 0, 0},
    [F_WEIGHTS] = {"top_k_weights", SAM_DT_FLOAT, -1, {0}, SAM_ARG_CONTIG, -1, 0, 0},
    [F_GBIAS] = {"gate_up_bias", SAM_DT_FLOAT, 2, {SAM_VAR(VF_E), SAM_VAR(VF_I2)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL,
                 -1, 0, 0},
    [F_DBIAS] = {"down_bias", SAM_DT_FLOAT, 2, {SAM_VAR(VF_E), SAM_VAR(VF_H)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL,
                 -1, 0, 0},
    [F_OUT] = {"out", SAM_DT_FLOAT, 2, {SAM_VAR(VF_T), SAM_VAR(VF_H)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
    [F_WS] = {"workspace", SAM_DT(SAM_U8), 1, {SAM_DIM_ANY}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 16, 0},
};

/* The sizes, the workspace layout and both weights' packed dims, from x, top_k_index,
 * gate_up_values and intermediate. */
static int forward_derive(sam_op_call *c, void *vctx)
{
    static const moe_names names = {"top_k_index", "gate_up_values", "x", "intermediate", "x, top_k_index"};
    moe_plan *p = vctx;
    const sam_tensor *x = &c->t[F_X];
    const int64_t T = x->shape[0], H = x->shape[1], K = c->t[F_INDEX].shape[1], E = c->t[F_GV].shape[0];
    if (moe_sizes(&names, T, K, E, H, p->I, (int64_t)sam_dtype_size(x->dtype), &p->L) < 0) return -1;
    sam_dims dg, dd;
    if (sam_arg_dims(p->fg, E, 2 * p->I, H, "intermediate", "x", &dg) < 0 ||
        sam_arg_dims(p->fd, E, H, p->I, "x", "intermediate", &dd) < 0)
        return -1;
    sam_op_bind_packed(c, &dg, VF_E, VF_GRP, VF_GCP2, VF_GMR, VF_GMC, VF_GSL);
    sam_op_bind_packed(c, &dd, VF_E, VF_DRP, VF_DCP2, VF_DMR, VF_DMC, VF_DSL);
    sam_op_bind(c, VF_I2, 2 * p->I);
    p->gate_up.d = dg;
    p->down.d = dd;
    return 0;
}

/* What the table cannot say, then the plan on the workspace. */
static int forward_check(sam_op_call *c, void *vctx)
{
    moe_plan *p = vctx;
    const sam_tensor *t = c->t;
    const int64_t T = c->var[VF_T], K = c->var[VF_K], H = c->var[VF_H], S = T * K; /* (checked) */
    if (c->cuda && p->I % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "intermediate: expected a multiple of 8 on the GPU, got %lld", (long long)p->I);
        return -1;
    }
    if (sam_tensor_numel(&t[F_WEIGHTS]) != S) {
        PyErr_Format(PyExc_ValueError, "top_k_weights: expected %lld entries (top_k_index's T*K), got %lld",
                     (long long)S, (long long)sam_tensor_numel(&t[F_WEIGHTS]));
        return -1;
    }
    if (t[F_WS].shape[0] < p->L.total) {
        PyErr_Format(PyExc_ValueError, "workspace: expected at least %lld bytes (moe_workspace_bytes(%lld, %lld, "
                     "%lld, %lld, %lld, %d)), got %lld", (long long)p->L.total, (long long)T, (long long)K,
                     (long long)c->var[VF_E], (long long)H, (long long)p->I, (int)sam_dtype_size(t[F_X].dtype),
                     (long long)t[F_WS].shape[0]);
        return -1;
    }
    char *base = t[F_WS].data;
    p->offsets = (int32_t *)(base + p->L.offsets);
    p->token_ids = (int32_t *)(base + p->L.token_ids);
    p->perm = (int32_t *)(base + p->L.perm);
    p->pos = (int32_t *)(base + p->L.pos);
    p->scale = (float *)(base + p->L.scale);
    sam_ssmm_params *g = &p->gate_up, *d = &p->down;
    SAM_SET_X(g, c, F_X);
    g->values = t[F_GV].data; g->meta = (const uint32_t *)t[F_GM].data;
    g->idx = t[F_GI].present ? (const uint8_t *)t[F_GI].data : NULL;
    g->f = p->fg;
    g->offsets = p->offsets; g->token_ids = p->token_ids; g->S = S;
    g->act = p->act;
    g->bias = t[F_GBIAS].present ? t[F_GBIAS].data : NULL;
    g->bias_dtype = t[F_GBIAS].present ? t[F_GBIAS].dtype : SAM_F32;
    g->alpha = p->alpha; g->limit = p->limit;
    g->out = base + p->L.h; g->ldo = p->I;
    g->impl = p->impl;
    g->cfg = c->st->cfg;
    d->x = base + p->L.h; d->T = S; d->ldx = p->I; d->dtype = t[F_X].dtype;
    d->values = t[F_DV].data; d->meta = (const uint32_t *)t[F_DM].data;
    d->idx = t[F_DI].present ? (const uint8_t *)t[F_DI].data : NULL;
    d->f = p->fd;
    d->offsets = p->offsets; d->token_ids = NULL; d->S = S;
    d->act = SAM_ACT_NONE;
    d->bias = t[F_DBIAS].present ? t[F_DBIAS].data : NULL;
    d->bias_dtype = t[F_DBIAS].present ? t[F_DBIAS].dtype : SAM_F32;
    d->scale = p->scale;
    d->alpha = p->alpha; d->limit = p->limit;
    d->out = base + p->L.y; d->ldo = H;
    d->impl = p->impl;
    d->cfg = c->st->cfg;
    d->offsets_ready = 1; /* routed two launches back (cuda/samoyeds_cuda.h) */
    return 0;
}

#define MOE_STEP(expr) do { const sam_status st_ = (expr); if (st_ != SAM_STATUS_OK) return st_; } while (0)

static sam_status forward_ref(const sam_op_call *c, const moe_plan *p)
{
    const sam_tensor *t = c->t;
    const int64_t T = c->var[VF_T], K = c->var[VF_K], E = c->var[VF_E], H = c->var[VF_H];
    MOE_STEP(sam_moe_route_ref(t[F_INDEX].data, t[F_INDEX].dtype, T, K, E, p->offsets, p->token_ids, p->perm,
                               p->pos));
    MOE_STEP(sam_moe_gather_weights_ref(p->scale, t[F_WEIGHTS].data, t[F_WEIGHTS].dtype, p->perm, p->offsets, E,
                                        T * K));
    MOE_STEP(sam_ssmm_ref(&p->gate_up));
    MOE_STEP(sam_ssmm_ref(&p->down));
    return sam_moe_combine_ref(t[F_OUT].data, t[F_OUT].dtype, p->down.out, p->down.dtype, p->pos, T, K, H,
                               p->down.ldo, T * K);
}

#if SAM_WITH_CUDA
static sam_status forward_cuda(const sam_op_call *c, const moe_plan *p, void *stream)
{
    const sam_tensor *t = c->t;
    const int64_t T = c->var[VF_T], K = c->var[VF_K], E = c->var[VF_E], H = c->var[VF_H];
    /* the routing weights of the sorted rows come with the routing, in its launch */
    MOE_STEP(sam_moe_route_cuda(t[F_INDEX].data, t[F_INDEX].dtype, T, K, E, p->offsets, p->token_ids, p->perm,
                                p->pos, p->scale, t[F_WEIGHTS].data, t[F_WEIGHTS].dtype, stream));
    /* gate_up's rows from x by index, or copied in expert order to y's place first (read
     * by gate_up only; down writes y after gate_up has ended: cuda/common.cuh) */
    void *copy = p->down.out;
    if (sam_moe_copy_x(&p->gate_up, copy)) {
        MOE_STEP(sam_moe_gather_rows_cuda(copy, p->gate_up.x, p->gate_up.dtype, p->gate_up.ldx, H, p->token_ids,
                                          p->offsets, E, T * K, stream));
        sam_ssmm_params g = p->gate_up;
        g.x = copy;
        g.T = T * K;
        g.ldx = H;
        g.token_ids = NULL;
        MOE_STEP(sam_ssmm_cuda(&g, stream));
    } else {
        MOE_STEP(sam_ssmm_cuda(&p->gate_up, stream));
    }
    MOE_STEP(sam_ssmm_cuda(&p->down, stream));
    return sam_moe_combine_cuda(t[F_OUT].data, t[F_OUT].dtype, p->down.out, p->down.dtype, p->pos, T, K, H,
                                p->down.ldo, T * K, stream);
}
#endif

static sam_status forward_run(const sam_op_call *c, void *vctx, void *stream)
{
    const moe_plan *p = vctx;
    return SAM_DISPATCH(c, stream, forward_ref(c, p), forward_cuda(c, p, stream));
}

static const sam_op forward_op = {"moe_forward", forward_args, F_COUNT, forward_derive, forward_check,
                                  forward_run};

/* moe_forward(out, workspace, x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
 *             down_values, down_meta, down_idx, intermediate, n, m, v, act=1, gate_up_bias=None,
 *             down_bias=None, alpha=1.702, limit=7.0, impl=0, stream=None) */
PyObject *sam_py_moe_forward(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "workspace", "x", "top_k_index", "top_k_weights", "gate_up_values",
                             "gate_up_meta", "gate_up_idx", "down_values", "down_meta", "down_idx",
                             "intermediate", "n", "m", "v", "act", "gate_up_bias", "down_bias", "alpha",
                             "limit", "impl", "stream", NULL};
    PyObject *o[F_COUNT] = {NULL}, *o_stream = Py_None;
    long long inter;
    int n, m, v, act = SAM_ACT_SWIGLU, impl = 0;
    moe_plan p = {.alpha = 1.702f, .limit = 7.0f};
    o[F_GBIAS] = o[F_DBIAS] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOOLiii|iOOffiO:moe_forward", kwlist, &o[F_OUT], &o[F_WS],
                                     &o[F_X], &o[F_INDEX], &o[F_WEIGHTS], &o[F_GV], &o[F_GM], &o[F_GI], &o[F_DV],
                                     &o[F_DM], &o[F_DI], &inter, &n, &m, &v, &act, &o[F_GBIAS], &o[F_DBIAS],
                                     &p.alpha, &p.limit, &impl, &o_stream))
        return NULL;
    if (sam_arg_range("act", act, SAM_ACT_SWIGLU, SAM_ACT_GPTOSS, "1 (swiglu) or 2 (gptoss)") < 0 ||
        sam_arg_impl(impl, &p.impl) < 0 ||
        sam_arg_range("intermediate", inter, 0, INT32_MAX / 2, "0 <= intermediate < 2**30") < 0 ||
        sam_arg_format(n, m, v, 1, &p.fg) < 0 || sam_arg_format(n, m, v, 0, &p.fd) < 0)
        return NULL;
    p.I = inter;
    p.act = (sam_act)act;
    return sam_run_op(&forward_op, module, o, o_stream, sam_format_has_selection(p.fg), &p);
}
