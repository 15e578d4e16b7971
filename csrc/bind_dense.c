/*
 * bind_dense.c -- the dense ops: dense_decode (dense weights at a few tokens,
 * csrc/dense_ref.c, cuda/dense_decode.cu), glu (a gated activation of two
 * matrices, cuda/glu.cu) and glu_backward (its gradient, same files).
 */
#include "sam_args.h"
#include "sam_ref.h"

/* ---- dense_decode(out, x, w, up=None, act=0, alpha=1.702, limit=7.0, weights_ready=False, stream=None) ---- */

enum { V_T, V_C, V_R };
enum { D_W, D_UP, D_X, D_OUT, D_COUNT };

static const sam_arg_spec dense_args[] = {
    [D_W] = {"w", 0, 2, {SAM_VAR(V_R), SAM_VAR(V_C)}, SAM_ARG_CONTIG | SAM_ARG_LIKE, D_X, 16, 0},
    [D_UP] = {"up", 0, 2, {SAM_VAR(V_R), SAM_VAR(V_C)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL | SAM_ARG_LIKE, D_X, 16,
              0},
    [D_X] = {"x", SAM_DT_FLOAT, 2, {SAM_VAR(V_T), SAM_VAR(V_C)}, SAM_ARG_ROWS | SAM_ARG_HALF_GPU, -1, 16, 8},
    [D_OUT] = {"out", 0, 2, {SAM_VAR(V_T), SAM_VAR(V_R)}, SAM_ARG_ROWS | SAM_ARG_OUT | SAM_ARG_LIKE, D_X, 0, 0},
};

typedef struct dense_ctx {
    sam_dense_params p;
} dense_ctx;

int sam_check_dense_weight(const sam_op_call *c, const sam_tensor *w)
{
    if (w->shape[0] > INT32_MAX - 16 || w->shape[1] > INT32_MAX - 512) {
        PyErr_Format(PyExc_ValueError, "%s: expected rows below 2**31 - 16 and columns below 2**31 - 512, got "
                     "shape (%lld, %lld)", w->name, (long long)w->shape[0], (long long)w->shape[1]);
        return -1;
    }
    if (c->cuda && w->shape[1] % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected a column count that is a multiple of 8 on the GPU (16-byte "
                     "pieces of rows), got %lld", w->name, (long long)w->shape[1]);
        return -1;
    }
    return 0;
}

static int dense_derive(sam_op_call *c, void *vctx)
{
    const sam_act act = ((const dense_ctx *)vctx)->p.act;
    const sam_tensor *up = &c->t[D_UP];
    if ((act != SAM_ACT_NONE) != (up->present != 0)) {
        PyErr_SetString(PyExc_ValueError, act != SAM_ACT_NONE
                        ? "up: expected a tensor with a gated activation (w holds the gate rows), got None"
                        : "up: expected None without a gated activation (act = 0 multiplies by w only), got a tensor");
        return -1;
    }
    return sam_check_dense_weight(c, &c->t[D_W]);
}

static int dense_check(sam_op_call *c, void *vctx)
{
    sam_dense_params *p = &((dense_ctx *)vctx)->p;
    const sam_tensor *t = c->t;
    SAM_SET_X(p, c, D_X);
    p->w = t[D_W].data;
    p->up = t[D_UP].present ? t[D_UP].data : NULL;
    p->R = t[D_W].shape[0];
    p->C = t[D_W].shape[1];
    p->out = t[D_OUT].data;
    p->ldo = c->ld[D_OUT];
    return 0;
}

SAM_OP_RUN_PARAMS(dense_run, dense_ctx, sam_dense_ref, sam_dense_decode_cuda)

static const sam_op dense_op = {"dense_decode", dense_args, D_COUNT, dense_derive, dense_check, dense_run};

PyObject *sam_py_dense_decode(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "x", "w", "up", "act", "alpha", "limit", "weights_ready", "stream", NULL};
    PyObject *o[D_COUNT] = {NULL}, *o_stream = Py_None;
    int act = 0;
    dense_ctx x = {.p = {.alpha = 1.702f, .limit = 7.0f}};
    o[D_UP] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OiffpO:dense_decode", kwlist, &o[D_OUT], &o[D_X], &o[D_W],
                                     &o[D_UP], &act, &x.p.alpha, &x.p.limit, &x.p.weights_ready, &o_stream))
        return NULL;
    if (sam_arg_range("act", act, SAM_ACT_NONE, SAM_ACT_GPTOSS, "0 (none), 1 (swiglu) or 2 (gptoss)") < 0)
        return NULL;
    x.p.act = (sam_act)act;
    return sam_run_op(&dense_op, module, o, o_stream, 0, &x);
}

/* ---- glu(out, gate, up, act=1, alpha=1.702, limit=7.0, stream=None) --------------------------- */

enum { G_GATE, G_UP, G_OUT, G_COUNT };
enum { V_GT, V_GI };

static const sam_arg_spec glu_args[] = {
    [G_GATE] = {"gate", SAM_DT_FLOAT, 2, {SAM_VAR(V_GT), SAM_VAR(V_GI)}, SAM_ARG_ROWS | SAM_ARG_HALF_GPU, -1, 0, 0},
    [G_UP] = {"up", 0, 2, {SAM_VAR(V_GT), SAM_VAR(V_GI)}, SAM_ARG_ROWS | SAM_ARG_LIKE, G_GATE, 0, 0},
    [G_OUT] = {"out", 0, 2, {SAM_VAR(V_GT), SAM_VAR(V_GI)}, SAM_ARG_ROWS | SAM_ARG_OUT | SAM_ARG_LIKE, G_GATE, 0, 0},
};

typedef struct glu_ctx {
    sam_glu_params p;
} glu_ctx;

static int glu_check(sam_op_call *c, void *vctx)
{
    sam_glu_params *p = &((glu_ctx *)vctx)->p;
    p->g = c->t[G_GATE].data;
    p->u = c->t[G_UP].data;
    p->ldg = c->ld[G_GATE];
    p->ldu = c->ld[G_UP];
    p->out = c->t[G_OUT].data;
    p->ldo = c->ld[G_OUT];
    p->T = c->t[G_GATE].shape[0];
    p->I = c->t[G_GATE].shape[1];
    p->dtype = c->t[G_GATE].dtype;
    return 0;
}

SAM_OP_RUN_PARAMS(glu_run, glu_ctx, sam_glu_ref, sam_glu_cuda)

static const sam_op glu_op = {"glu", glu_args, G_COUNT, NULL, glu_check, glu_run};

PyObject *sam_py_glu(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "gate", "up", "act", "alpha", "limit", "stream", NULL};
    PyObject *o[G_COUNT], *o_stream = Py_None;
    int act = SAM_ACT_SWIGLU;
    glu_ctx x = {.p = {.alpha = 1.702f, .limit = 7.0f}};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|iffO:glu", kwlist, &o[G_OUT], &o[G_GATE], &o[G_UP], &act,
                                     &x.p.alpha, &x.p.limit, &o_stream))
        return NULL;
    if (sam_arg_range("act", act, SAM_ACT_SWIGLU, SAM_ACT_GPTOSS, "1 (swiglu) or 2 (gptoss)") < 0) return NULL;
    x.p.act = (sam_act)act;
    return sam_run_op(&glu_op, module, o, o_stream, 0, &x);
}

/* ---- glu_backward(out, dh, preact, scale=None, offsets=None, act=1, alpha=1.702, limit=7.0, stream=None,
 *                   hdot=None, out_t=None) ---- */

enum { B_PRE, B_DH, B_SCALE, B_OFFSETS, B_OUT, B_HDOT, B_OUT_T, B_COUNT };
enum { V_BS, V_BI, V_B2I, V_BE1, V_B2I1, V_BW };

static const sam_arg_spec glu_backward_args[] = {
    [B_PRE] = {"preact", SAM_DT_FLOAT, 2, {SAM_VAR(V_BS), SAM_VAR(V_B2I)}, SAM_ARG_ROWS, -1, 0, 0},
    [B_DH] = {"dh", 0, 2, {SAM_VAR(V_BS), SAM_VAR(V_BI)}, SAM_ARG_ROWS | SAM_ARG_F32_OR_LIKE, B_PRE, 0, 0},
    [B_SCALE] = {"scale", SAM_DT(SAM_F32), 1, {SAM_VAR(V_BS)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [B_OFFSETS] = {"offsets", SAM_DT(SAM_I32), 1, {SAM_VAR(V_BE1)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
    [B_OUT] = {"out", 0, 2, {SAM_VAR(V_BS), SAM_VAR(V_B2I)}, SAM_ARG_ROWS | SAM_ARG_OUT | SAM_ARG_F32_OR_LIKE, B_PRE,
               0, 0},
    [B_HDOT] = {"hdot", SAM_DT(SAM_F32), 1, {SAM_VAR(V_BS)}, SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_OPTIONAL, -1, 0,
                0},
    [B_OUT_T] = {"out_t", 0, 2, {SAM_VAR(V_B2I1), SAM_VAR(V_BW)},
                 SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_LIKE | SAM_ARG_OPTIONAL, B_PRE, 16, 0},
};

typedef struct glu_backward_ctx {
    sam_glu_backward_params p;
} glu_backward_ctx;

static int glu_backward_derive(sam_op_call *c, void *vctx)
{
    (void)vctx;
    const sam_tensor *pre = &c->t[B_PRE], *off = &c->t[B_OFFSETS];
    if (pre->shape[1] % 2 != 0) {
        PyErr_Format(PyExc_ValueError, "preact: expected an even column count (gate columns, then up columns), got "
                     "%lld", (long long)pre->shape[1]);
        return -1;
    }
    if (off->present && (off->shape[0] < 2 || off->shape[0] > INT32_MAX)) {
        PyErr_Format(PyExc_ValueError, "offsets: expected shape (E + 1,) with 1 <= E < 2**31 - 1, got (%lld,)",
                     (long long)off->shape[0]);
        return -1;
    }
    sam_op_bind(c, V_BI, pre->shape[1] / 2);
    if (c->t[B_OUT_T].present) { /* 2I + 1 rows of the segmented columns (samoyeds_layout.h) */
        if (!off->present) {
            PyErr_SetString(PyExc_ValueError, "offsets: expected the expert offsets with out_t (its columns are "
                            "laid out by expert), got None");
            return -1;
        }
        sam_op_bind(c, V_B2I1, pre->shape[1] + 1);
        sam_op_bind(c, V_BW, sam_dyt_cols(pre->shape[0], off->shape[0] - 1));
    }
    return 0;
}

static int glu_backward_check(sam_op_call *c, void *vctx)
{
    sam_glu_backward_params *p = &((glu_backward_ctx *)vctx)->p;
    const sam_tensor *t = c->t;
    p->pre = t[B_PRE].data;
    p->ldp = c->ld[B_PRE];
    p->dtype = t[B_PRE].dtype;
    p->dh = t[B_DH].data;
    p->lddh = c->ld[B_DH];
    p->dh_dtype = t[B_DH].dtype;
    p->scale = t[B_SCALE].present ? (const float *)t[B_SCALE].data : NULL;
    p->offsets = t[B_OFFSETS].present ? (const int32_t *)t[B_OFFSETS].data : NULL;
    p->E = t[B_OFFSETS].present ? t[B_OFFSETS].shape[0] - 1 : 0;
    p->out = t[B_OUT].data;
    p->ldo = c->ld[B_OUT];
    p->out_dtype = t[B_OUT].dtype;
    p->S = t[B_PRE].shape[0];
    p->I = t[B_PRE].shape[1] / 2;
    p->hdot = t[B_HDOT].present ? (float *)t[B_HDOT].data : NULL;
    p->out_t = t[B_OUT_T].present ? t[B_OUT_T].data : NULL;
    return 0;
}

SAM_OP_RUN_PARAMS(glu_backward_run, glu_backward_ctx, sam_glu_backward_ref, sam_glu_backward_cuda)

static const sam_op glu_backward_op = {"glu_backward", glu_backward_args, B_COUNT, glu_backward_derive,
                                       glu_backward_check, glu_backward_run};

PyObject *sam_py_glu_backward(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "dh", "preact", "scale", "offsets", "act", "alpha", "limit", "stream", "hdot",
                             "out_t", NULL};
    PyObject *o[B_COUNT], *o_stream = Py_None;
    int act = SAM_ACT_SWIGLU;
    glu_backward_ctx x = {.p = {.alpha = 1.702f, .limit = 7.0f}};
    o[B_SCALE] = o[B_OFFSETS] = o[B_HDOT] = o[B_OUT_T] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOiffOOO:glu_backward", kwlist, &o[B_OUT], &o[B_DH], &o[B_PRE],
                                     &o[B_SCALE], &o[B_OFFSETS], &act, &x.p.alpha, &x.p.limit, &o_stream,
                                     &o[B_HDOT], &o[B_OUT_T]))
        return NULL;
    if (sam_arg_range("act", act, SAM_ACT_SWIGLU, SAM_ACT_GPTOSS, "1 (swiglu) or 2 (gptoss)") < 0) return NULL;
    x.p.act = (sam_act)act;
    return sam_run_op(&glu_backward_op, module, o, o_stream, 0, &x);
}
