/*
 * bind_format.c -- format_mask, format_pack, format_unpack: the Samoyeds
 * format's three ops (csrc/format_ref.c, cuda/format.cu).
 *
 * Weights are 3-d ([E, R, C]); callers with one matrix pass a view with E = 1.
 * The packed arrays' shapes follow from the format and the weight's shape
 * (cuda/samoyeds_layout.h).  Pack and unpack on CUDA synchronise the stream to
 * report data that breaks the format.
 */
#include "sam_args.h"
#include "sam_ref.h"

enum { V_E, V_R, V_C, V_RP, V_CP2, V_MR, V_MC, V_SL };

#define PACKED(vflags, like, flags) \
    SAM_PACKED_SPECS("", vflags, like, flags, V_E, V_RP, V_CP2, V_MR, V_MC, V_SL)
#define BIND_PACKED(c, d) sam_op_bind_packed(c, d, V_E, V_RP, V_CP2, V_MR, V_MC, V_SL)

typedef struct format_ctx {
    sam_format f;
    sam_dims d;
} format_ctx;

/* ---- format_mask(mask, w, scores, n, m, v, stream=None) ---------------------------- */

enum { M_W, M_MASK, M_SCORES };
static const sam_arg_spec mask_args[] = {
    [M_W] = {"w", SAM_DT_FLOAT | SAM_DT(SAM_F64), 3, {SAM_VAR(V_E), SAM_VAR(V_R), SAM_VAR(V_C)}, SAM_ARG_CONTIG,
             -1, 0, 0},
    [M_MASK] = {"mask", SAM_DT(SAM_U8) | SAM_DT(SAM_BOOL), 3, {SAM_VAR(V_E), SAM_VAR(V_R), SAM_VAR(V_C)},
                SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
    [M_SCORES] = {"scores", SAM_DT_FLOAT | SAM_DT(SAM_F64), 3, {SAM_VAR(V_E), SAM_VAR(V_R), SAM_VAR(V_C)},
                  SAM_ARG_CONTIG | SAM_ARG_OPTIONAL, -1, 0, 0},
};

static int mask_derive(sam_op_call *c, void *vctx)
{
    format_ctx *x = vctx;
    const sam_tensor *w = &c->t[M_W];
    return sam_arg_dims(x->f, w->shape[0], w->shape[1], w->shape[2], "w", "w", &x->d);
}

static sam_status mask_run(const sam_op_call *c, void *vctx, void *stream)
{
    const format_ctx *x = vctx;
    const sam_tensor *w = &c->t[M_W], *s = &c->t[M_SCORES];
    uint8_t *mask = (uint8_t *)c->t[M_MASK].data;
    const void *scores = s->present ? s->data : NULL;
    const sam_dtype st = s->present ? s->dtype : SAM_F32;
    return SAM_DISPATCH(c, stream, sam_format_mask_ref(mask, w->data, w->dtype, scores, st, x->f, &x->d),
                        sam_format_mask_cuda(mask, w->data, w->dtype, scores, st, x->f, &x->d, stream));
}

static const sam_op mask_op = {"format_mask", mask_args, 3, mask_derive, NULL, mask_run};

PyObject *sam_py_format_mask(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"mask", "w", "scores", "n", "m", "v", "stream", NULL};
    PyObject *o[3], *o_stream = Py_None;
    int n, m, v;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOiii|O:format_mask", kwlist, &o[M_MASK], &o[M_W], &o[M_SCORES],
                                     &n, &m, &v, &o_stream))
        return NULL;
    format_ctx x;
    if (sam_arg_format(n, m, v, 0, &x.f) < 0) return NULL;
    return sam_run_op(&mask_op, module, o, o_stream, 0, &x);
}

/* ---- format_pack(values, meta, idx, w, mask, n, m, v, glu, stream=None) ------------ */

enum { P_W, P_MASK, P_VALUES, P_META, P_IDX };
static const sam_arg_spec pack_args[] = {
    [P_W] = {"w", SAM_DT_FLOAT, 3, {SAM_VAR(V_E), SAM_VAR(V_R), SAM_VAR(V_C)}, SAM_ARG_CONTIG, -1, 0, 0},
    [P_MASK] = {"mask", SAM_DT(SAM_U8) | SAM_DT(SAM_BOOL), 3, {SAM_VAR(V_E), SAM_VAR(V_R), SAM_VAR(V_C)},
                SAM_ARG_CONTIG, -1, 0, 0},
    PACKED(SAM_ARG_LIKE, P_W, SAM_ARG_OUT),
};

/* The dims from the dense weight's shape (argument i), and the packed arrays' sizes. */
static int derive_packed(sam_op_call *c, format_ctx *x, int i)
{
    const sam_tensor *w = &c->t[i];
    if (sam_arg_dims(x->f, w->shape[0], w->shape[1], w->shape[2], w->name, w->name, &x->d) < 0) return -1;
    BIND_PACKED(c, &x->d);
    return 0;
}

static int pack_derive(sam_op_call *c, void *vctx) { return derive_packed(c, vctx, P_W); }

static sam_status pack_run(const sam_op_call *c, void *vctx, void *stream)
{
    const format_ctx *x = vctx;
    const sam_tensor *t = c->t;
    void *values = t[P_VALUES].data;
    uint32_t *meta = (uint32_t *)t[P_META].data;
    uint8_t *idx = t[P_IDX].present ? (uint8_t *)t[P_IDX].data : NULL;
    const uint8_t *mask = (const uint8_t *)t[P_MASK].data;
    return SAM_DISPATCH(c, stream, sam_format_pack_ref(values, meta, idx, t[P_W].data, mask, t[P_W].dtype, x->f, &x->d),
                        sam_format_pack_cuda(values, meta, idx, t[P_W].data, mask, t[P_W].dtype, x->f, &x->d,
                                             stream));
}

static const sam_op pack_op = {"format_pack", pack_args, 5, pack_derive, NULL, pack_run};

PyObject *sam_py_format_pack(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"values", "meta", "idx", "w", "mask", "n", "m", "v", "glu", "stream", NULL};
    PyObject *o[5], *o_stream = Py_None;
    int n, m, v, glu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOiiip|O:format_pack", kwlist, &o[P_VALUES], &o[P_META],
                                     &o[P_IDX], &o[P_W], &o[P_MASK], &n, &m, &v, &glu, &o_stream))
        return NULL;
    format_ctx x;
    if (sam_arg_format(n, m, v, glu, &x.f) < 0) return NULL;
    return sam_run_op(&pack_op, module, o, o_stream, sam_format_has_selection(x.f), &x);
}

/* ---- format_unpack(out, values, meta, idx, n, m, v, glu, stream=None) -------------- */

enum { U_VALUES, U_META, U_IDX, U_OUT };
static const sam_arg_spec unpack_args[] = {
    PACKED(0, -1, 0),
    [U_OUT] = {"out", 0, 3, {SAM_VAR(V_E), SAM_VAR(V_R), SAM_VAR(V_C)}, SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_LIKE,
               U_VALUES, 0, 0},
};

static int unpack_derive(sam_op_call *c, void *vctx) { return derive_packed(c, vctx, U_OUT); }

static sam_status unpack_run(const sam_op_call *c, void *vctx, void *stream)
{
    const format_ctx *x = vctx;
    const sam_tensor *t = c->t;
    const uint32_t *meta = (const uint32_t *)t[U_META].data;
    const uint8_t *idx = t[U_IDX].present ? (const uint8_t *)t[U_IDX].data : NULL;
    const sam_dtype dt = t[U_VALUES].dtype;
    return SAM_DISPATCH(c, stream, sam_format_unpack_ref(t[U_OUT].data, t[U_VALUES].data, meta, idx, dt, x->f, &x->d),
                        sam_format_unpack_cuda(t[U_OUT].data, t[U_VALUES].data, meta, idx, dt, x->f, &x->d,
                                               stream));
}

static const sam_op unpack_op = {"format_unpack", unpack_args, 4, unpack_derive, NULL, unpack_run};

PyObject *sam_py_format_unpack(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "values", "meta", "idx", "n", "m", "v", "glu", "stream", NULL};
    PyObject *o[4], *o_stream = Py_None;
    int n, m, v, glu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOiiip|O:format_unpack", kwlist, &o[U_OUT], &o[U_VALUES],
                                     &o[U_META], &o[U_IDX], &n, &m, &v, &glu, &o_stream))
        return NULL;
    format_ctx x;
    if (sam_arg_format(n, m, v, glu, &x.f) < 0) return NULL;
    return sam_run_op(&unpack_op, module, o, o_stream, sam_format_has_selection(x.f), &x);
}

/* ---- format_gather(out, values, src, stream=None) --------------------------------------- */

enum { G_VALUES, G_SRC, G_OUT, G_COUNT };
enum { V_GN };
static const sam_arg_spec gather_args[] = {
    [G_VALUES] = {"values", SAM_DT_FLOAT, -1, {0}, SAM_ARG_CONTIG, -1, 0, 0},
    [G_SRC] = {"src", SAM_DT(SAM_I32), 1, {SAM_VAR(V_GN)}, SAM_ARG_CONTIG, -1, 0, 0},
    [G_OUT] = {"out", 0, -1, {0}, SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_LIKE, G_VALUES, 0, 0},
};

static int gather_check(sam_op_call *c, void *vctx)
{
    (void)vctx;
    const int64_t count = c->t[G_SRC].shape[0], n = sam_tensor_numel(&c->t[G_OUT]);
    if (n != count) {
        PyErr_Format(PyExc_ValueError, "out: expected %lld elements (src's), got %lld", (long long)count,
                     (long long)n);
        return -1;
    }
    return 0;
}

static sam_status gather_run(const sam_op_call *c, void *vctx, void *stream)
{
    (void)vctx;
    const sam_tensor *v = &c->t[G_VALUES];
    const int64_t n = sam_tensor_numel(v), count = c->t[G_SRC].shape[0];
    const int eb = (int)sam_dtype_size(v->dtype);
    const int32_t *src = (const int32_t *)c->t[G_SRC].data;
    return SAM_DISPATCH(c, stream, sam_format_gather_ref(c->t[G_OUT].data, v->data, n, eb, src, count),
                        sam_format_gather_cuda(c->t[G_OUT].data, v->data, n, eb, src, count, stream));
}

static const sam_op gather_op = {"format_gather", gather_args, G_COUNT, NULL, gather_check, gather_run};

PyObject *sam_py_format_gather(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "values", "src", "stream", NULL};
    PyObject *o[G_COUNT], *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:format_gather", kwlist, &o[G_OUT], &o[G_VALUES], &o[G_SRC],
                                     &o_stream))
        return NULL;
    return sam_run_op(&gather_op, module, o, o_stream, 0, NULL);
}

/* ---- format_transpose_values(out, tmeta, values, meta, idx, n, m, v, glu, rows, cols, stream=None)
 * out: the values of W^T's plain 2:4 packing under its metadata tmeta, from the packed W
 * (logical [E, rows, cols]): the refresh of PackedWeight.transposed() (samoyeds/packed.py). */

enum { T_VALUES, T_META, T_IDX, T_OUT, T_TMETA, T_COUNT };
enum { V_TRP = V_SL + 1, V_TCP2, V_TMR, V_TMC };
static const sam_arg_spec transpose_args[] = {
    PACKED(0, -1, 0),
    [T_OUT] = {"out", 0, 3, {SAM_VAR(V_E), SAM_VAR(V_TRP), SAM_VAR(V_TCP2)},
               SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_LIKE, T_VALUES, 16, 0},
    [T_TMETA] = {"tmeta", SAM_DT(SAM_U32), 4, {SAM_VAR(V_E), SAM_VAR(V_TMR), SAM_VAR(V_TMC), 16}, SAM_ARG_CONTIG,
                 -1, 16, 0},
};

typedef struct transpose_ctx {
    sam_format f;
    sam_dims d, td;
    int rows, cols;
} transpose_ctx;

static int transpose_derive(sam_op_call *c, void *vctx)
{
    transpose_ctx *x = vctx;
    if (sam_arg_dims(x->f, c->t[T_VALUES].shape[0], x->rows, x->cols, "rows", "cols", &x->d) < 0) return -1;
    BIND_PACKED(c, &x->d);
    const sam_format plain = {1, 1, 0, 0};
    if (sam_dims_make(plain, x->d.E, x->cols, x->rows, &x->td) != 0) {
        PyErr_Format(PyExc_ValueError, "rows: expected a multiple of 4 (the columns of W^T, 2:4-packed), got %d",
                     x->rows);
        return -1;
    }
    sam_op_bind(c, V_TRP, x->td.rp);
    sam_op_bind(c, V_TCP2, x->td.cp / 2);
    sam_op_bind(c, V_TMR, x->td.rp / 16);
    sam_op_bind(c, V_TMC, x->td.cp / 32);
    return 0;
}

static sam_status transpose_run(const sam_op_call *c, void *vctx, void *stream)
{
    const transpose_ctx *x = vctx;
    const sam_tensor *t = c->t;
    const uint32_t *tmeta = (const uint32_t *)t[T_TMETA].data, *meta = (const uint32_t *)t[T_META].data;
    const uint8_t *idx = t[T_IDX].present ? (const uint8_t *)t[T_IDX].data : NULL;
    const int eb = (int)sam_dtype_size(t[T_VALUES].dtype);
    return SAM_DISPATCH(c, stream,
                        sam_format_transpose_values_ref(t[T_OUT].data, tmeta, t[T_VALUES].data, meta, idx, eb, x->f,
                                                        &x->d, &x->td),
                        sam_format_transpose_values_cuda(t[T_OUT].data, tmeta, t[T_VALUES].data, meta, idx, eb,
                                                         x->f, &x->d, &x->td, stream));
}

static const sam_op transpose_op = {"format_transpose_values", transpose_args, T_COUNT, transpose_derive, NULL,
                                    transpose_run};

PyObject *sam_py_format_transpose_values(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "tmeta", "values", "meta", "idx", "n", "m", "v", "glu", "rows", "cols",
                             "stream", NULL};
    PyObject *o[T_COUNT], *o_rows, *o_cols, *o_stream = Py_None;
    int n, m, v, glu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOiiipOO|O:format_transpose_values", kwlist, &o[T_OUT],
                                     &o[T_TMETA], &o[T_VALUES], &o[T_META], &o[T_IDX], &n, &m, &v, &glu, &o_rows,
                                     &o_cols, &o_stream))
        return NULL;
    transpose_ctx x;
    if (sam_arg_format(n, m, v, glu, &x.f) < 0) return NULL;
    if (sam_arg_int(o_rows, "rows", 0, INT32_MAX, "0 <= rows < 2**31", &x.rows) < 0 ||
        sam_arg_int(o_cols, "cols", 0, INT32_MAX, "0 <= cols < 2**31", &x.cols) < 0)
        return NULL;
    return sam_run_op(&transpose_op, module, o, o_stream, sam_format_has_selection(x.f), &x);
}
