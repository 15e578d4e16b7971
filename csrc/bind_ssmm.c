/*
 * bind_ssmm.c -- ssmm: the grouped sparse-sparse matmul over experts
 * (csrc/ssmm_ref.c, cuda/ssmm.cu), out[s] = act(x[token_ids[s]] @ W_e^T + bias[e]) * scale[s]
 * for the sorted rows s of expert e.
 *
 * The weight's logical rows and columns come as ints (its packed arrays are
 * padded); x is read by row index with its own row stride, out written with
 * its own.  The module's ssmm configuration (set_config) goes into the params.
 */
#include "sam_args.h"
#include "sam_ref.h"

enum { V_E, V_RP, V_CP2, V_MR, V_MC, V_SL, V_T, V_C, V_R, V_E1, V_S, V_OC };
enum { A_VALUES, A_META, A_IDX, A_X, A_OFFSETS, A_OUT, A_TOKEN_IDS, A_BIAS, A_SCALE, A_PREACT, A_COUNT };

static const sam_arg_spec ssmm_args[] = {
    SAM_PACKED_SPECS("", SAM_ARG_HALF_GPU, -1, 0, V_E, V_RP, V_CP2, V_MR, V_MC, V_SL),
    [A_X] = {"x", 0, 2, {SAM_VAR(V_T), SAM_VAR(V_C)}, SAM_ARG_ROWS | SAM_ARG_LIKE, A_VALUES, 16, 8},
    [A_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(V_E1)}, SAM_ARG_CONTIG, -1, 0, 0},
    [A_OUT] = {"out", 0, 2, {SAM_VAR(V_S), SAM_VAR(V_OC)}, SAM_ARG_ROWS | SAM_ARG_OUT | SAM_ARG_LIKE, A_X, 4, 2},
    [A_TOKEN_IDS] = {"token_ids", SAM_DT(SAM_I32), 1, {SAM_VAR(V_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [A_BIAS] = {"bias", SAM_DT_FLOAT, 2, {SAM_VAR(V_E), SAM_VAR(V_R)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [A_SCALE] = {"scale", SAM_DT(SAM_F32), 1, {SAM_VAR(V_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [A_PREACT] = {"preact", 0, 2, {SAM_VAR(V_S), SAM_VAR(V_R)},
                  SAM_ARG_ROWS | SAM_ARG_OUT | SAM_ARG_LIKE | SAM_ARG_OPTIONAL, A_X, 4, 2},
};

typedef struct ssmm_ctx {
    sam_format f;
    int64_t rows, cols;
    sam_act act;
    float alpha, limit;
    sam_impl impl;
    sam_ssmm_params p;
} ssmm_ctx;

static int ssmm_derive(sam_op_call *c, void *vctx)
{
    ssmm_ctx *x = vctx;
    sam_dims d;
    if (sam_arg_dims(x->f, c->t[A_VALUES].shape[0], x->rows, x->cols, "rows", "cols", &d) < 0) return -1;
    sam_op_bind_packed(c, &d, V_E, V_RP, V_CP2, V_MR, V_MC, V_SL);
    sam_op_bind(c, V_C, d.C);
    sam_op_bind(c, V_R, d.R);
    sam_op_bind(c, V_E1, d.E + 1);
    sam_op_bind(c, V_OC, x->act == SAM_ACT_NONE ? d.R : d.R / 2);
    x->p.d = d;
    return 0;
}

/* The params from the checked tensors (after every check). */
static int ssmm_check(sam_op_call *c, void *vctx)
{
    ssmm_ctx *x = vctx;
    sam_ssmm_params *p = &x->p;
    const sam_tensor *t = c->t;
    SAM_SET_X(p, c, A_X);
    p->values = t[A_VALUES].data;
    p->meta = (const uint32_t *)t[A_META].data;
    p->idx = t[A_IDX].present ? (const uint8_t *)t[A_IDX].data : NULL;
    p->f = x->f;
    p->offsets = (const int32_t *)t[A_OFFSETS].data;
    p->token_ids = t[A_TOKEN_IDS].present ? (const int32_t *)t[A_TOKEN_IDS].data : NULL;
    p->S = t[A_OUT].shape[0];
    p->act = x->act;
    p->bias = t[A_BIAS].present ? t[A_BIAS].data : NULL;
    p->bias_dtype = t[A_BIAS].present ? t[A_BIAS].dtype : SAM_F32;
    p->scale = t[A_SCALE].present ? (const float *)t[A_SCALE].data : NULL;
    p->alpha = x->alpha;
    p->limit = x->limit;
    p->out = t[A_OUT].data;
    p->ldo = c->ld[A_OUT];
    if (t[A_PREACT].present && x->act == SAM_ACT_NONE) {
        PyErr_SetString(PyExc_ValueError, "preact: the pre-activation is written only with a gated act "
                                          "(swiglu or gptoss); with act none it is out itself");
        return -1;
    }
    p->preact = t[A_PREACT].present ? t[A_PREACT].data : NULL;
    p->ldp = t[A_PREACT].present ? c->ld[A_PREACT] : 0;
    p->impl = x->impl;
    p->cfg = c->st->cfg;
    return 0;
}

SAM_OP_RUN_PARAMS(ssmm_run, ssmm_ctx, sam_ssmm_ref, sam_ssmm_cuda)

static const sam_op ssmm_op = {"ssmm", ssmm_args, A_COUNT, ssmm_derive, ssmm_check, ssmm_run};

/* ssmm(out, x, values, meta, idx, offsets, token_ids, rows, cols, n, m, v, glu, act=0, bias=None,
 *      scale=None, alpha=1.702, limit=7.0, impl=0, stream=None, preact=None) */
PyObject *sam_py_ssmm(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "x", "values", "meta", "idx", "offsets", "token_ids", "rows", "cols",
                             "n", "m", "v", "glu", "act", "bias", "scale", "alpha", "limit", "impl",
                             "stream", "preact", NULL};
    PyObject *o[A_COUNT] = {NULL}, *o_stream = Py_None;
    long long rows, cols;
    int n, m, v, glu, act = 0, impl = 0;
    ssmm_ctx x = {.alpha = 1.702f, .limit = 7.0f};
    o[A_BIAS] = o[A_SCALE] = o[A_PREACT] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOLLiiip|iOOffiOO:ssmm", kwlist, &o[A_OUT], &o[A_X],
                                     &o[A_VALUES], &o[A_META], &o[A_IDX], &o[A_OFFSETS], &o[A_TOKEN_IDS], &rows,
                                     &cols, &n, &m, &v, &glu, &act, &o[A_BIAS], &o[A_SCALE], &x.alpha, &x.limit,
                                     &impl, &o_stream, &o[A_PREACT]))
        return NULL;
    if (sam_arg_range("act", act, SAM_ACT_NONE, glu ? SAM_ACT_GPTOSS : SAM_ACT_NONE,
                      glu ? "0 (none), 1 (swiglu) or 2 (gptoss)"
                          : "0 (none) for weights packed with glu=False (a gated activation needs gate rows, "
                            "then up rows)") < 0 ||
        sam_arg_impl(impl, &x.impl) < 0 ||
        sam_arg_range("rows", rows, 0, INT32_MAX, "0 <= rows < 2**31") < 0 ||
        sam_arg_range("cols", cols, 0, INT32_MAX, "0 <= cols < 2**31") < 0 ||
        sam_arg_format(n, m, v, glu, &x.f) < 0)
        return NULL;
    x.rows = rows;
    x.cols = cols;
    x.act = (sam_act)act;
    return sam_run_op(&ssmm_op, module, o, o_stream, sam_format_has_selection(x.f), &x);
}

/* ---- ssmm_dw: the gradient of an ssmm with respect to the packed values ------------------------- */
/*
 * out[e][p][j] = sum over the sorted rows s of expert e of dy[s][r] * scale[s] * x[t][col], the
 * value's original row r and column col (cuda/samoyeds_cuda.h, sam_ssmm_dw_params): the packed
 * layout of the weight described by meta, idx and the format, every entry written.
 */
enum { W_E, W_RP, W_CP2, W_MR, W_MC, W_SL, W_T, W_C, W_R, W_E1, W_S, W_TDY, W_R1, W_DYC };
enum { D_OUT, D_DY, D_X, D_META, D_IDX, D_OFFSETS, D_TOKEN_IDS, D_SCALE, D_DY_IDS, D_DY_T, D_COUNT };

static const sam_arg_spec ssmm_dw_args[] = {
    [D_OUT] = {"out", 0, 3, {SAM_VAR(W_E), SAM_VAR(W_RP), SAM_VAR(W_CP2)},
               SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_LIKE, D_X, 16, 0},
    [D_DY] = {"dy", 0, 2, {SAM_VAR(W_TDY), SAM_VAR(W_R)}, SAM_ARG_ROWS | SAM_ARG_LIKE, D_X, 16, 8},
    [D_X] = {"x", SAM_DT_FLOAT, 2, {SAM_VAR(W_T), SAM_VAR(W_C)}, SAM_ARG_ROWS | SAM_ARG_HALF_GPU, -1, 16, 8},
    [D_META] = {"meta", SAM_DT(SAM_U32), 4, {SAM_VAR(W_E), SAM_VAR(W_MR), SAM_VAR(W_MC), 16}, SAM_ARG_CONTIG, -1,
                16, 0},
    [D_IDX] = {"idx", SAM_DT(SAM_U8), 3, {SAM_VAR(W_E), SAM_VAR(W_SL), SAM_VAR(W_RP)},
               SAM_ARG_CONTIG | SAM_ARG_PACKED_IDX, -1, 16, 0},
    [D_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(W_E1)}, SAM_ARG_CONTIG, -1, 0, 0},
    [D_TOKEN_IDS] = {"token_ids", SAM_DT(SAM_I32), 1, {SAM_VAR(W_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [D_SCALE] = {"scale", SAM_DT(SAM_F32), 1, {SAM_VAR(W_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [D_DY_IDS] = {"dy_token_ids", SAM_DT(SAM_I32), 1, {SAM_VAR(W_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0,
                  0},
    [D_DY_T] = {"dy_t", 0, 2, {SAM_VAR(W_R1), SAM_VAR(W_DYC)}, SAM_ARG_CONTIG | SAM_ARG_LIKE | SAM_ARG_OPTIONAL, D_X,
                16, 0},
};

#if SAM_WITH_CUDA
/* Until cuda/ssmm_dw.cu is linked in, a CUDA build still links: sam_ssmm_dw_cuda is then
 * this weak alias, and a call on CUDA tensors raises NotImplementedError (ssmm_dw_check). */
static sam_status ssmm_dw_cuda_missing(const sam_ssmm_dw_params *p, void *stream)
{
    (void)p;
    (void)stream;
    return SAM_STATUS_UNSUPPORTED;
}
sam_status sam_ssmm_dw_cuda(const sam_ssmm_dw_params *p, void *stream)
    __attribute__((weak, alias("ssmm_dw_cuda_missing")));
#endif

typedef struct ssmm_dw_ctx {
    sam_format f;
    int64_t rows, cols;
    sam_ssmm_dw_params p;
} ssmm_dw_ctx;

static int ssmm_dw_derive(sam_op_call *c, void *vctx)
{
    ssmm_dw_ctx *x = vctx;
    sam_dims d;
    if (sam_arg_dims(x->f, c->t[D_META].shape[0], x->rows, x->cols, "rows", "cols", &d) < 0) return -1;
    sam_op_bind_packed(c, &d, W_E, W_RP, W_CP2, W_MR, W_MC, W_SL);
    sam_op_bind(c, W_C, d.C);
    sam_op_bind(c, W_R, d.R);
    sam_op_bind(c, W_E1, d.E + 1);
    /* the sorted rows: dy's own, or as many as dy_token_ids names (dy then any number of rows) */
    const int64_t S = c->t[D_DY_IDS].present ? c->t[D_DY_IDS].shape[0] : c->t[D_DY].shape[0];
    if (!c->t[D_DY_IDS].present) sam_op_bind(c, W_S, S);
    /* dy_t: R + 1 rows of the segmented columns (samoyeds_layout.h) */
    sam_op_bind(c, W_R1, d.R + 1);
    sam_op_bind(c, W_DYC, sam_dyt_cols(S, d.E));
    x->p.d = d;
    return 0;
}

static int ssmm_dw_check(sam_op_call *c, void *vctx)
{
    ssmm_dw_ctx *x = vctx;
    sam_ssmm_dw_params *p = &x->p;
    const sam_tensor *t = c->t;
#if SAM_WITH_CUDA
    if (c->cuda && sam_ssmm_dw_cuda == ssmm_dw_cuda_missing) {
        PyErr_SetString(PyExc_NotImplementedError, "out: expected a CPU tensor (this build has no CUDA kernel "
                        "for ssmm_dw: cuda/ssmm_dw.cu was not compiled in), got one on a CUDA device");
        return -1;
    }
#endif
    SAM_SET_X(p, c, D_X);
    p->dy = t[D_DY].data;
    p->lddy = c->ld[D_DY];
    p->Tdy = t[D_DY].shape[0];
    p->dy_ids = t[D_DY_IDS].present ? (const int32_t *)t[D_DY_IDS].data : NULL;
    p->S = p->dy_ids ? t[D_DY_IDS].shape[0] : p->Tdy;
    p->dy_t = t[D_DY_T].present ? t[D_DY_T].data : NULL;
    p->meta = (const uint32_t *)t[D_META].data;
    p->idx = t[D_IDX].present ? (const uint8_t *)t[D_IDX].data : NULL;
    p->f = x->f;
    p->offsets = (const int32_t *)t[D_OFFSETS].data;
    p->token_ids = t[D_TOKEN_IDS].present ? (const int32_t *)t[D_TOKEN_IDS].data : NULL;
    p->scale = t[D_SCALE].present ? (const float *)t[D_SCALE].data : NULL;
    p->out = t[D_OUT].data;
    return 0;
}

SAM_OP_RUN_PARAMS(ssmm_dw_run, ssmm_dw_ctx, sam_ssmm_dw_ref, sam_ssmm_dw_cuda)

static const sam_op ssmm_dw_op = {"ssmm_dw", ssmm_dw_args, D_COUNT, ssmm_dw_derive, ssmm_dw_check, ssmm_dw_run};

/* ssmm_dw(out, dy, x, meta, idx, offsets, token_ids, rows, cols, n, m, v, glu, scale=None, stream=None,
 *         impl=0, dy_token_ids=None, dy_t=None) */
PyObject *sam_py_ssmm_dw(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "dy", "x", "meta", "idx", "offsets", "token_ids", "rows", "cols",
                             "n", "m", "v", "glu", "scale", "stream", "impl", "dy_token_ids", "dy_t", NULL};
    PyObject *o[D_COUNT] = {NULL}, *o_stream = Py_None;
    long long rows, cols;
    int n, m, v, glu, impl = 0;
    ssmm_dw_ctx x;
    memset(&x, 0, sizeof x);
    o[D_SCALE] = o[D_DY_IDS] = o[D_DY_T] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOLLiiip|OOiOO:ssmm_dw", kwlist, &o[D_OUT], &o[D_DY], &o[D_X],
                                     &o[D_META], &o[D_IDX], &o[D_OFFSETS], &o[D_TOKEN_IDS], &rows, &cols, &n, &m,
                                     &v, &glu, &o[D_SCALE], &o_stream, &impl, &o[D_DY_IDS],
                                     &o[D_DY_T]))
        return NULL;
    if (sam_arg_range("impl", impl, 0, 3, "0 (the rule), 1 (the mma.sync kernel), 2 (the wgmma kernel, dy "
                      "gathered) or 3 (the wgmma kernel, dy's transposed copy)") < 0 ||
        sam_arg_range("rows", rows, 0, INT32_MAX, "0 <= rows < 2**31") < 0 ||
        sam_arg_range("cols", cols, 0, INT32_MAX, "0 <= cols < 2**31") < 0 ||
        sam_arg_format(n, m, v, glu, &x.f) < 0)
        return NULL;
    x.rows = rows;
    x.cols = cols;
    x.p.impl = impl;
    return sam_run_op(&ssmm_dw_op, module, o, o_stream, sam_format_has_selection(x.f), &x);
}


/* ---- ssmm_dx: the gradient of an ssmm with respect to its input, from the forward's packing ------ */
/*
 * out[s][c] = scale[s] * sum_r dy[token_ids[s]][r] * W_e[r][c] for the sorted rows s of expert e
 * (cuda/samoyeds_cuda.h, sam_ssmm_dx_params); rows outside the offsets' ranges 0.
 */
enum { X_E, X_RP, X_CP2, X_MR, X_MC, X_SL, X_T, X_R, X_E1, X_S, X_C };
enum { G_VALUES, G_META, G_IDX, G_DY, G_OFFSETS, G_OUT, G_TOKEN_IDS, G_SCALE, G_COUNT };

static const sam_arg_spec ssmm_dx_args[] = {
    SAM_PACKED_SPECS("", SAM_ARG_HALF_GPU, -1, 0, X_E, X_RP, X_CP2, X_MR, X_MC, X_SL),
    [G_DY] = {"dy", 0, 2, {SAM_VAR(X_T), SAM_VAR(X_R)}, SAM_ARG_ROWS | SAM_ARG_LIKE, G_VALUES, 16, 8},
    [G_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(X_E1)}, SAM_ARG_CONTIG, -1, 0, 0},
    [G_OUT] = {"out", 0, 2, {SAM_VAR(X_S), SAM_VAR(X_C)}, SAM_ARG_ROWS | SAM_ARG_OUT | SAM_ARG_LIKE, G_DY, 16, 8},
    [G_TOKEN_IDS] = {"token_ids", SAM_DT(SAM_I32), 1, {SAM_VAR(X_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [G_SCALE] = {"scale", SAM_DT(SAM_F32), 1, {SAM_VAR(X_S)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
};

typedef struct ssmm_dx_ctx {
    sam_format f;
    int64_t rows, cols;
    sam_ssmm_dx_params p;
} ssmm_dx_ctx;

static int ssmm_dx_derive(sam_op_call *c, void *vctx)
{
    ssmm_dx_ctx *x = vctx;
    sam_dims d;
    if (sam_arg_dims(x->f, c->t[G_VALUES].shape[0], x->rows, x->cols, "rows", "cols", &d) < 0) return -1;
    sam_op_bind_packed(c, &d, X_E, X_RP, X_CP2, X_MR, X_MC, X_SL);
    sam_op_bind(c, X_R, d.R);
    sam_op_bind(c, X_C, d.C);
    sam_op_bind(c, X_E1, d.E + 1);
    x->p.d = d;
    return 0;
}

static int ssmm_dx_check(sam_op_call *c, void *vctx)
{
    ssmm_dx_ctx *x = vctx;
    sam_ssmm_dx_params *p = &x->p;
    const sam_tensor *t = c->t;
    p->dy = t[G_DY].data;
    p->T = t[G_DY].shape[0];
    p->lddy = c->ld[G_DY];
    p->dtype = t[G_DY].dtype;
    p->values = t[G_VALUES].data;
    p->meta = (const uint32_t *)t[G_META].data;
    p->idx = t[G_IDX].present ? (const uint8_t *)t[G_IDX].data : NULL;
    p->f = x->f;
    p->offsets = (const int32_t *)t[G_OFFSETS].data;
    p->token_ids = t[G_TOKEN_IDS].present ? (const int32_t *)t[G_TOKEN_IDS].data : NULL;
    p->S = t[G_OUT].shape[0];
    p->scale = t[G_SCALE].present ? (const float *)t[G_SCALE].data : NULL;
    p->out = t[G_OUT].data;
    p->ldo = c->ld[G_OUT];
    return 0;
}

SAM_OP_RUN_PARAMS(ssmm_dx_run, ssmm_dx_ctx, sam_ssmm_dx_ref, sam_ssmm_dx_cuda)

static const sam_op ssmm_dx_op = {"ssmm_dx", ssmm_dx_args, G_COUNT, ssmm_dx_derive, ssmm_dx_check, ssmm_dx_run};

/* ssmm_dx(out, dy, values, meta, idx, offsets, token_ids, rows, cols, n, m, v, glu, scale=None, stream=None,
 *         impl=0) */
PyObject *sam_py_ssmm_dx(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "dy", "values", "meta", "idx", "offsets", "token_ids", "rows", "cols",
                             "n", "m", "v", "glu", "scale", "stream", "impl", NULL};
    PyObject *o[G_COUNT] = {NULL}, *o_stream = Py_None;
    long long rows, cols;
    int n, m, v, glu, impl = 0;
    ssmm_dx_ctx x;
    memset(&x, 0, sizeof x);
    o[G_SCALE] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOLLiiip|OOi:ssmm_dx", kwlist, &o[G_OUT], &o[G_DY],
                                     &o[G_VALUES], &o[G_META], &o[G_IDX], &o[G_OFFSETS], &o[G_TOKEN_IDS], &rows,
                                     &cols, &n, &m, &v, &glu, &o[G_SCALE], &o_stream, &impl))
        return NULL;
    if (sam_arg_range("impl", impl, 0, 2, "0 (the rule), 1 (the mma.sync kernel) or 2 (the wgmma kernel)") < 0 ||
        sam_arg_range("rows", rows, 0, INT32_MAX, "0 <= rows < 2**31") < 0 ||
        sam_arg_range("cols", cols, 0, INT32_MAX, "0 <= cols < 2**31") < 0 ||
        sam_arg_format(n, m, v, glu, &x.f) < 0)
        return NULL;
    x.rows = rows;
    x.cols = cols;
    x.p.impl = impl;
    return sam_run_op(&ssmm_dx_op, module, o, o_stream, sam_format_has_selection(x.f), &x);
}
