/*
 * ops.c -- the ops of samoyeds._C: parse arguments, take every tensor through
 * DLPack, check everything a kernel relies on, then run the C reference (all
 * tensors on the CPU) or the CUDA launcher (all on one CUDA device).
 *
 * Convention (BLAS-like): outputs come first and are allocated by the caller.
 * Packed arrays and weights are 3-d ([E, ...]); callers with one matrix pass a
 * view with E = 1.  Every failure raises an exception naming the argument.
 *
 * Stream rule: `stream=None` launches on the producer's current stream when
 * the producer says which (DLPack exchange API: torch), else on the legacy
 * default stream; an int is taken as a cudaStream_t.  Producers are asked to
 * order their pending work before that stream.  No op synchronises the host,
 * except pack and unpack on CUDA, which check the data and report errors.
 */
#include "sam_module.h"
#include "sam_ref.h"

#ifndef SAM_WITH_CUDA
#define SAM_WITH_CUDA 0
#endif

typedef struct op_ctx {
    const char *op;
    sam_call call;
    int cuda;   /* 1: all tensors on one CUDA device */
    int device;
} op_ctx;

static void ctx_init(op_ctx *c, const char *op, int64_t stream)
{
    memset(c, 0, sizeof(*c));
    c->op = op;
    c->call.stream = stream;
}

static int parse_stream(PyObject *o, int64_t *out)
{
    if (o == NULL || o == Py_None) { *out = SAM_STREAM_AUTO; return 0; }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "stream: expected None or an int (cudaStream_t), got %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* All present tensors on one device; fixes ctx->cuda and ctx->device. */
static int ctx_device(op_ctx *c)
{
    const sam_tensor *first = NULL;
    for (int i = 0; i < c->call.n; i++) {
        const sam_tensor *t = c->call.tensors[i];
        if (!t->present) continue;
        if (first == NULL) { first = t; continue; }
        if (sam_check_same_device(t, first) < 0) return -1;
    }
    if (first == NULL) return 0;
    c->cuda = first->device_type == kDLCUDA;
    c->device = first->device_id;
#if !SAM_WITH_CUDA
    if (c->cuda) {
        PyErr_Format(PyExc_RuntimeError, "%s: %s is a CUDA tensor but samoyeds was built without "
                     "CUDA (reinstall with nvcc available, see README)", c->op, first->name);
        return -1;
    }
#endif
    return 0;
}

static int parse_format(const char *op, int n, int m, int v, int glu, sam_format *f)
{
    if (m < 1 || m > SAM_MAX_M || n < 1 || n > m) {
        PyErr_Format(PyExc_ValueError, "%s: format n:m = %d:%d is invalid; expected 1 <= n <= m <= %d",
                     op, n, m, SAM_MAX_M);
        return -1;
    }
    f->glu = glu ? 1 : 0;
    if (n == m) { f->n = f->m = 1; f->v = 0; return 0; }
    if (v < 32 || v % 32 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: format slice length v = %d is invalid; expected a positive "
                     "multiple of 32", op, v);
        return -1;
    }
    f->n = n; f->m = m; f->v = v;
    return 0;
}

static int make_dims(const char *op, const char *name, sam_format f, int64_t E, int64_t R, int64_t C,
                     sam_dims *d)
{
    if (E < 0 || R < 0 || C < 0 || R > INT32_MAX || C > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: %s has shape (%lld, %lld, %lld); expected non-negative "
                     "sizes below 2**31", op, name, (long long)E, (long long)R, (long long)C);
        return -1;
    }
    int code = sam_dims_make(f, E, R, C, d);
    if (code == 1)
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld rows%s; the format needs a multiple of m = %d",
                     op, name, (long long)(f.glu ? R / 2 : R), f.glu ? " per gate/up half" : "", f.m);
    else if (code == 2)
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld columns; 2:4 sparsity needs a multiple of 4",
                     op, name, (long long)C);
    else if (code == 3)
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld rows; a gate/up (glu) matrix needs an even count",
                     op, name, (long long)R);
    return code ? -1 : 0;
}

static PyObject *finish(op_ctx *c, int status, const char *message)
{
    PyObject *res = NULL;
    if (status == SAM_STATUS_OK) res = Py_NewRef(Py_None);
    else sam_raise_status(status, c->op, message);
    sam_call_release(&c->call);
    return res;
}

static PyObject *fail(op_ctx *c)
{
    sam_call_release(&c->call);
    return NULL;
}

#if SAM_WITH_CUDA
#define CUDA_RUN(ctx, status, expr)                                             \
    do {                                                                        \
        int prev_dev_ = 0;                                                      \
        Py_BEGIN_ALLOW_THREADS                                                  \
        status = sam_cuda_device_enter((ctx)->device, &prev_dev_);              \
        if (status == SAM_STATUS_OK) {                                          \
            status = (expr);                                                    \
            sam_cuda_device_exit(prev_dev_);                                    \
        }                                                                       \
        Py_END_ALLOW_THREADS                                                    \
    } while (0)
#endif

#define REF_RUN(status, expr) \
    do { Py_BEGIN_ALLOW_THREADS status = (expr); Py_END_ALLOW_THREADS } while (0)

static const char *last_error(int cuda)
{
#if SAM_WITH_CUDA
    if (cuda) return sam_cuda_last_error();
#endif
    (void)cuda;
    return sam_ref_last_error();
}

static int check_cuda_alignment(op_ctx *c, const sam_tensor *t, int align)
{
    if (!c->cuda || !t->present) return 0;
    if (((uintptr_t)t->data) % (uintptr_t)align != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s must start at a %d-byte aligned address on the GPU",
                     c->op, t->name, align);
        return -1;
    }
    return 0;
}

/* x [T, >= C] as the kernels read it: C columns of unit stride, rows that do not
 * overlap, on the GPU 16-byte rows at a 16-byte aligned address.  *ldx: elements
 * between rows. */
static int check_x_rows(op_ctx *c, sam_tensor *x, int64_t C, int64_t *ldx)
{
    if (x->shape[1] != C) {
        PyErr_Format(PyExc_ValueError, "%s: x: expected %lld columns (the weight's), got %lld", c->op,
                     (long long)C, (long long)x->shape[1]);
        return -1;
    }
    if ((x->shape[1] > 1 && x->strides[1] != 1) || (x->shape[0] > 1 && x->strides[0] < C)) {
        PyErr_Format(PyExc_ValueError, "%s: x: rows must be contiguous and not overlap (strides (%lld, %lld))",
                     c->op, (long long)x->strides[0], (long long)x->strides[1]);
        return -1;
    }
    *ldx = x->shape[0] > 1 && C > 0 ? x->strides[0] : C; /* (no columns: no stride to honour) */
    if (c->cuda && (*ldx % 8 != 0 || check_cuda_alignment(c, x, 16) < 0)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s: x: the row stride (%lld elements) must be a multiple of 8 "
                         "on the GPU (16-byte rows)", c->op, (long long)*ldx);
        return -1;
    }
    return 0;
}

/* ---- format_mask ------------------------------------------------------------------ */

PyObject *sam_py_format_mask(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"mask", "w", "scores", "n", "m", "v", "stream", NULL};
    PyObject *o_mask, *o_w, *o_scores, *o_stream = Py_None;
    int n, m, v;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOiii|O:format_mask", kwlist, &o_mask, &o_w, &o_scores,
                                     &n, &m, &v, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "format_mask", stream);
    sam_tensor mask, w, scores;
    sam_format f;
    sam_dims d;
    if (parse_format(c.op, n, m, v, 0, &f) < 0) return NULL;
    if (sam_tensor_take(&c.call, &mask, o_mask, "mask", 0) < 0 ||
        sam_tensor_take(&c.call, &w, o_w, "w", 0) < 0 ||
        sam_tensor_take(&c.call, &scores, o_scores, "scores", 1) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_dtype(&w, SAM_DT_FLOAT | SAM_DT(SAM_F64)) < 0 || sam_check_ndim(&w, 3) < 0 ||
        sam_check_contiguous(&w) < 0 ||
        sam_check_dtype(&mask, SAM_DT(SAM_U8) | SAM_DT(SAM_BOOL)) < 0 ||
        sam_check_shape(&mask, 3, w.shape) < 0 || sam_check_contiguous(&mask) < 0 ||
        sam_check_writable(&mask) < 0 || sam_check_no_overlap(&mask, &w) < 0)
        return fail(&c);
    if (scores.present &&
        (sam_check_dtype(&scores, SAM_DT_FLOAT | SAM_DT(SAM_F64)) < 0 ||
         sam_check_shape(&scores, 3, w.shape) < 0 || sam_check_contiguous(&scores) < 0 ||
         sam_check_no_overlap(&mask, &scores) < 0))
        return fail(&c);
    if (make_dims(c.op, "w", f, w.shape[0], w.shape[1], w.shape[2], &d) < 0) return fail(&c);
    int status;
    const void *sp = scores.present ? scores.data : NULL;
    sam_dtype sd = scores.present ? scores.dtype : SAM_F32;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_format_mask_cuda((uint8_t *)mask.data, w.data, w.dtype, sp, sd, f, &d,
                                                  c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_format_mask_ref((uint8_t *)mask.data, w.data, w.dtype, sp, sd, f, &d));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- packed-array checks shared by pack, unpack and ssmm ---------------------------- */

static int check_packed(op_ctx *c, sam_tensor *values, sam_tensor *meta, sam_tensor *idx,
                        sam_format f, const sam_dims *d, int writable)
{
    int64_t vs[3] = {d->E, d->rp, d->cp / 2};
    int64_t ms[4] = {d->E, d->rp / 16, d->cp / 32, 16};
    int64_t is[3] = {d->E, d->slices, d->rp};
    if (sam_check_dtype(values, SAM_DT_FLOAT) < 0 || sam_check_shape(values, 3, vs) < 0 ||
        sam_check_contiguous(values) < 0 || sam_check_dtype(meta, SAM_DT(SAM_U32)) < 0 ||
        sam_check_shape(meta, 4, ms) < 0 || sam_check_contiguous(meta) < 0)
        return -1;
    if (writable && (sam_check_writable(values) < 0 || sam_check_writable(meta) < 0)) return -1;
    if (sam_format_has_selection(f)) {
        if (!idx->present) {
            PyErr_Format(PyExc_TypeError, "%s: idx is required for a format with row selection (n < m)", c->op);
            return -1;
        }
        if (sam_check_dtype(idx, SAM_DT(SAM_U8)) < 0 || sam_check_shape(idx, 3, is) < 0 ||
            sam_check_contiguous(idx) < 0 || (writable && sam_check_writable(idx) < 0))
            return -1;
    } else if (idx->present && sam_tensor_numel(idx) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: idx must be None (or empty) for plain 2:4", c->op);
        return -1;
    }
    if (check_cuda_alignment(c, values, 16) < 0 || check_cuda_alignment(c, meta, 16) < 0 ||
        check_cuda_alignment(c, idx, 16) < 0)
        return -1;
    return 0;
}

/* ---- format_pack ------------------------------------------------------------------ */

PyObject *sam_py_format_pack(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"values", "meta", "idx", "w", "mask", "n", "m", "v", "glu", "stream", NULL};
    PyObject *o_values, *o_meta, *o_idx, *o_w, *o_mask, *o_stream = Py_None;
    int n, m, v, glu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOiiip|O:format_pack", kwlist, &o_values, &o_meta,
                                     &o_idx, &o_w, &o_mask, &n, &m, &v, &glu, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "format_pack", stream);
    sam_tensor values, meta, idx, w, mask;
    sam_format f;
    sam_dims d;
    if (parse_format(c.op, n, m, v, glu, &f) < 0) return NULL;
    if (sam_tensor_take(&c.call, &values, o_values, "values", 0) < 0 ||
        sam_tensor_take(&c.call, &meta, o_meta, "meta", 0) < 0 ||
        sam_tensor_take(&c.call, &idx, o_idx, "idx", 1) < 0 ||
        sam_tensor_take(&c.call, &w, o_w, "w", 0) < 0 ||
        sam_tensor_take(&c.call, &mask, o_mask, "mask", 0) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_dtype(&w, SAM_DT_FLOAT) < 0 || sam_check_ndim(&w, 3) < 0 || sam_check_contiguous(&w) < 0 ||
        sam_check_dtype(&mask, SAM_DT(SAM_U8) | SAM_DT(SAM_BOOL)) < 0 ||
        sam_check_shape(&mask, 3, w.shape) < 0 || sam_check_contiguous(&mask) < 0)
        return fail(&c);
    if (make_dims(c.op, "w", f, w.shape[0], w.shape[1], w.shape[2], &d) < 0) return fail(&c);
    if (check_packed(&c, &values, &meta, &idx, f, &d, 1) < 0) return fail(&c);
    if (values.dtype != w.dtype) {
        PyErr_Format(PyExc_TypeError, "%s: values: expected dtype %s (that of w), got %s", c.op,
                     sam_dtype_name(w.dtype), sam_dtype_name(values.dtype));
        return fail(&c);
    }
    sam_tensor *outs[] = {&values, &meta, &idx}, *ins[] = {&w, &mask};
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 2; j++)
            if (sam_check_no_overlap(outs[i], ins[j]) < 0) return fail(&c);
        for (int j = i + 1; j < 3; j++)
            if (sam_check_no_overlap(outs[i], outs[j]) < 0) return fail(&c);
    }
    int status;
    uint8_t *ip = idx.present && sam_format_has_selection(f) ? (uint8_t *)idx.data : NULL;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_format_pack_cuda(values.data, (uint32_t *)meta.data, ip, w.data,
                                                  (const uint8_t *)mask.data, w.dtype, f, &d,
                                                  c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_format_pack_ref(values.data, (uint32_t *)meta.data, ip, w.data,
                                            (const uint8_t *)mask.data, w.dtype, f, &d));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- format_unpack ---------------------------------------------------------------- */

PyObject *sam_py_format_unpack(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"out", "values", "meta", "idx", "n", "m", "v", "glu", "stream", NULL};
    PyObject *o_out, *o_values, *o_meta, *o_idx, *o_stream = Py_None;
    int n, m, v, glu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOiiip|O:format_unpack", kwlist, &o_out, &o_values,
                                     &o_meta, &o_idx, &n, &m, &v, &glu, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "format_unpack", stream);
    sam_tensor out, values, meta, idx;
    sam_format f;
    sam_dims d;
    if (parse_format(c.op, n, m, v, glu, &f) < 0) return NULL;
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 ||
        sam_tensor_take(&c.call, &values, o_values, "values", 0) < 0 ||
        sam_tensor_take(&c.call, &meta, o_meta, "meta", 0) < 0 ||
        sam_tensor_take(&c.call, &idx, o_idx, "idx", 1) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_ndim(&out, 3) < 0 || sam_check_contiguous(&out) < 0 || sam_check_writable(&out) < 0)
        return fail(&c);
    if (make_dims(c.op, "out", f, out.shape[0], out.shape[1], out.shape[2], &d) < 0) return fail(&c);
    if (check_packed(&c, &values, &meta, &idx, f, &d, 0) < 0) return fail(&c);
    if (out.dtype != values.dtype) {
        PyErr_Format(PyExc_TypeError, "%s: out: expected dtype %s (that of values), got %s", c.op,
                     sam_dtype_name(values.dtype), sam_dtype_name(out.dtype));
        return fail(&c);
    }
    if (sam_check_no_overlap(&out, &values) < 0 || sam_check_no_overlap(&out, &meta) < 0 ||
        sam_check_no_overlap(&out, &idx) < 0)
        return fail(&c);
    int status;
    const uint8_t *ip = idx.present && sam_format_has_selection(f) ? (const uint8_t *)idx.data : NULL;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_format_unpack_cuda(out.data, values.data, (const uint32_t *)meta.data, ip,
                                                    values.dtype, f, &d, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_format_unpack_ref(out.data, values.data, (const uint32_t *)meta.data, ip,
                                              values.dtype, f, &d));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- ssmm ------------------------------------------------------------------------- */

PyObject *sam_py_ssmm(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "x", "values", "meta", "idx", "offsets", "token_ids", "rows", "cols",
                             "n", "m", "v", "glu", "act", "bias", "scale", "alpha", "limit", "impl",
                             "stream", NULL};
    PyObject *o_out, *o_x, *o_values, *o_meta, *o_idx, *o_offsets, *o_tok, *o_bias = Py_None,
             *o_scale = Py_None, *o_stream = Py_None;
    long long rows, cols;
    int n, m, v, glu, act = 0, impl = 0;
    float alpha = 1.702f, limit = 7.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOLLiiip|iOOffiO:ssmm", kwlist, &o_out, &o_x, &o_values,
                                     &o_meta, &o_idx, &o_offsets, &o_tok, &rows, &cols, &n, &m, &v, &glu,
                                     &act, &o_bias, &o_scale, &alpha, &limit, &impl, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "ssmm", stream);
    if (act < SAM_ACT_NONE || act > SAM_ACT_GPTOSS) {
        PyErr_Format(PyExc_ValueError, "ssmm: act = %d; expected 0 (none), 1 (swiglu) or 2 (gptoss)", act);
        return NULL;
    }
    if (act != SAM_ACT_NONE && !glu) {
        PyErr_SetString(PyExc_ValueError, "ssmm: a gated activation needs weights packed with glu=True "
                        "(gate rows first, then up rows)");
        return NULL;
    }
    if (impl < 0 || impl > 3) {
        PyErr_Format(PyExc_ValueError, "ssmm: impl = %d; expected 0 (auto), 1 (mma.sp), 2 (wgmma.sp) or 3 (decode)",
                     impl);
        return NULL;
    }
    sam_tensor out, x, values, meta, idx, offsets, tok, bias, scale;
    sam_format f;
    sam_ssmm_params p;
    memset(&p, 0, sizeof p);
    if (parse_format(c.op, n, m, v, glu, &f) < 0) return NULL;
    if (rows < 0 || rows > INT32_MAX || cols < 0 || cols > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "ssmm: rows = %lld, cols = %lld; expected non-negative sizes below 2**31",
                     rows, cols);
        return NULL;
    }
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 ||
        sam_tensor_take(&c.call, &x, o_x, "x", 0) < 0 ||
        sam_tensor_take(&c.call, &values, o_values, "values", 0) < 0 ||
        sam_tensor_take(&c.call, &meta, o_meta, "meta", 0) < 0 ||
        sam_tensor_take(&c.call, &idx, o_idx, "idx", 1) < 0 ||
        sam_tensor_take(&c.call, &offsets, o_offsets, "offsets", 0) < 0 ||
        sam_tensor_take(&c.call, &tok, o_tok, "token_ids", 1) < 0 ||
        sam_tensor_take(&c.call, &bias, o_bias, "bias", 1) < 0 ||
        sam_tensor_take(&c.call, &scale, o_scale, "scale", 1) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_ndim(&values, 3) < 0) return fail(&c);
    if (make_dims(c.op, "the weight", f, values.shape[0], rows, cols, &p.d) < 0) return fail(&c);
    if (check_packed(&c, &values, &meta, &idx, f, &p.d, 0) < 0) return fail(&c);
    const int64_t E = p.d.E, R = p.d.R, C = p.d.C;
    /* x: [T, >= C], unit stride along columns */
    if (sam_check_dtype(&x, c.cuda ? SAM_DT_HALF : SAM_DT_FLOAT) < 0 || sam_check_ndim(&x, 2) < 0)
        return fail(&c);
    if (x.dtype != values.dtype) {
        PyErr_Format(PyExc_TypeError, "ssmm: x: expected dtype %s (that of the packed weight), got %s",
                     sam_dtype_name(values.dtype), sam_dtype_name(x.dtype));
        return fail(&c);
    }
    int64_t ldx;
    if (check_x_rows(&c, &x, C, &ldx) < 0) return fail(&c);
    /* routing */
    int64_t os[1] = {E + 1};
    if (sam_check_dtype(&offsets, SAM_DT(SAM_I32)) < 0 || sam_check_shape(&offsets, 1, os) < 0 ||
        sam_check_contiguous(&offsets) < 0)
        return fail(&c);
    /* out: [S, R or R/2] */
    const int64_t out_cols = act == SAM_ACT_NONE ? R : R / 2;
    if (sam_check_ndim(&out, 2) < 0 || sam_check_writable(&out) < 0) return fail(&c);
    if (out.dtype != x.dtype) {
        PyErr_Format(PyExc_TypeError, "ssmm: out: expected dtype %s (that of x), got %s",
                     sam_dtype_name(x.dtype), sam_dtype_name(out.dtype));
        return fail(&c);
    }
    if (out.shape[1] != out_cols || (out.shape[1] > 1 && out.strides[1] != 1) ||
        (out.shape[0] > 1 && out.strides[0] < out_cols)) {
        PyErr_Format(PyExc_ValueError, "ssmm: out: expected %lld contiguous columns%s, got shape (%lld, %lld) "
                     "with strides (%lld, %lld)", (long long)out_cols,
                     act == SAM_ACT_NONE ? "" : " (half the weight's rows, after the activation)",
                     (long long)out.shape[0], (long long)out.shape[1], (long long)out.strides[0],
                     (long long)out.strides[1]);
        return fail(&c);
    }
    const int64_t S = out.shape[0];
    const int64_t ldo = S > 1 ? out.strides[0] : out_cols;
    if (c.cuda && (ldo % 2 != 0 || check_cuda_alignment(&c, &out, 4) < 0)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "ssmm: out: the row stride (%lld) must be even on the GPU",
                         (long long)ldo);
        return fail(&c);
    }
    if (tok.present) {
        int64_t ts[1] = {S};
        if (sam_check_dtype(&tok, SAM_DT(SAM_I32)) < 0 || sam_check_shape(&tok, 1, ts) < 0 ||
            sam_check_contiguous(&tok) < 0)
            return fail(&c);
    }
    if (bias.present) {
        int64_t bs[2] = {E, R};
        if (sam_check_dtype(&bias, SAM_DT_FLOAT) < 0 || sam_check_shape(&bias, 2, bs) < 0 ||
            sam_check_contiguous(&bias) < 0)
            return fail(&c);
    }
    if (scale.present) {
        int64_t ss[1] = {S};
        if (sam_check_dtype(&scale, SAM_DT(SAM_F32)) < 0 || sam_check_shape(&scale, 1, ss) < 0 ||
            sam_check_contiguous(&scale) < 0)
            return fail(&c);
    }
    sam_tensor *ins[] = {&x, &values, &meta, &idx, &offsets, &tok, &bias, &scale};
    for (size_t i = 0; i < sizeof(ins) / sizeof(ins[0]); i++)
        if (sam_check_no_overlap(&out, ins[i]) < 0) return fail(&c);

    p.x = x.data;
    p.T = x.shape[0];
    p.ldx = ldx;
    p.dtype = x.dtype;
    p.values = values.data;
    p.meta = (const uint32_t *)meta.data;
    p.idx = sam_format_has_selection(f) ? (const uint8_t *)idx.data : NULL;
    p.f = f;
    p.offsets = (const int32_t *)offsets.data;
    p.token_ids = tok.present ? (const int32_t *)tok.data : NULL;
    p.S = S;
    p.act = (sam_act)act;
    p.bias = bias.present ? bias.data : NULL;
    p.bias_dtype = bias.present ? bias.dtype : SAM_F32;
    p.scale = scale.present ? (const float *)scale.data : NULL;
    p.alpha = alpha;
    p.limit = limit;
    p.out = out.data;
    p.ldo = ldo;
    p.impl = impl;
    p.cfg = ((const sam_module_state *)PyModule_GetState(self))->cfg;
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_ssmm_cuda(&p, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_ssmm_ref(&p));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- dense weights at a few tokens ------------------------------------------------- */

/* w (and up): [R, C] of x's dtype, rows contiguous; on the GPU C a multiple of 8 and a
 * 16-byte aligned start. */
static int check_dense_weight(op_ctx *c, sam_tensor *w, const sam_tensor *x, const sam_tensor *like)
{
    if (sam_check_ndim(w, 2) < 0) return -1;
    if (w->dtype != x->dtype) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected dtype %s (that of x), got %s", c->op, w->name,
                     sam_dtype_name(x->dtype), sam_dtype_name(w->dtype));
        return -1;
    }
    if (like != NULL && (w->shape[0] != like->shape[0] || w->shape[1] != like->shape[1])) {
        PyErr_Format(PyExc_ValueError, "%s: %s: expected shape (%lld, %lld) (that of %s), got (%lld, %lld)",
                     c->op, w->name, (long long)like->shape[0], (long long)like->shape[1], like->name,
                     (long long)w->shape[0], (long long)w->shape[1]);
        return -1;
    }
    if (w->shape[0] > INT32_MAX - 16 || w->shape[1] > INT32_MAX - 512) {
        PyErr_Format(PyExc_ValueError, "%s: %s has shape (%lld, %lld); expected sizes below 2**31", c->op,
                     w->name, (long long)w->shape[0], (long long)w->shape[1]);
        return -1;
    }
    if (sam_check_contiguous(w) < 0) return -1;
    if (c->cuda && w->shape[1] % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s has %lld columns; the GPU kernel reads 16-byte pieces of rows "
                     "and needs a multiple of 8", c->op, w->name, (long long)w->shape[1]);
        return -1;
    }
    return check_cuda_alignment(c, w, 16);
}

PyObject *sam_py_dense_decode(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"out", "x", "w", "up", "act", "alpha", "limit", "weights_ready", "stream", NULL};
    PyObject *o_out, *o_x, *o_w, *o_up = Py_None, *o_stream = Py_None;
    int act = 0, ready = 0;
    float alpha = 1.702f, limit = 7.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OiffpO:dense_decode", kwlist, &o_out, &o_x, &o_w, &o_up,
                                     &act, &alpha, &limit, &ready, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "dense_decode", stream);
    if (act < SAM_ACT_NONE || act > SAM_ACT_GPTOSS) {
        PyErr_Format(PyExc_ValueError, "dense_decode: act = %d; expected 0 (none), 1 (swiglu) or 2 (gptoss)", act);
        return NULL;
    }
    sam_tensor out, x, w, up;
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 ||
        sam_tensor_take(&c.call, &x, o_x, "x", 0) < 0 ||
        sam_tensor_take(&c.call, &w, o_w, "w", 0) < 0 ||
        sam_tensor_take(&c.call, &up, o_up, "up", 1) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if ((act != SAM_ACT_NONE) != (up.present != 0)) {
        PyErr_SetString(PyExc_ValueError, act != SAM_ACT_NONE
                        ? "dense_decode: up: a gated activation needs the up rows (w holds the gate rows)"
                        : "dense_decode: up: given without a gated activation (act = 0 multiplies by w only)");
        return fail(&c);
    }
    if (sam_check_dtype(&x, c.cuda ? SAM_DT_HALF : SAM_DT_FLOAT) < 0 || sam_check_ndim(&x, 2) < 0 ||
        check_dense_weight(&c, &w, &x, NULL) < 0 || (up.present && check_dense_weight(&c, &up, &x, &w) < 0))
        return fail(&c);
    const int64_t R = w.shape[0], C = w.shape[1], T = x.shape[0];
    int64_t ldx;
    if (check_x_rows(&c, &x, C, &ldx) < 0) return fail(&c);
    if (sam_check_ndim(&out, 2) < 0 || sam_check_writable(&out) < 0) return fail(&c);
    if (out.dtype != x.dtype) {
        PyErr_Format(PyExc_TypeError, "dense_decode: out: expected dtype %s (that of x), got %s",
                     sam_dtype_name(x.dtype), sam_dtype_name(out.dtype));
        return fail(&c);
    }
    if (out.shape[0] != T || out.shape[1] != R || (R > 1 && out.strides[1] != 1) ||
        (T > 1 && out.strides[0] < R)) {
        PyErr_Format(PyExc_ValueError, "dense_decode: out: expected %lld rows (x's) of %lld contiguous columns "
                     "(w's rows), got shape (%lld, %lld) with strides (%lld, %lld)", (long long)T, (long long)R,
                     (long long)out.shape[0], (long long)out.shape[1], (long long)out.strides[0],
                     (long long)out.strides[1]);
        return fail(&c);
    }
    if (sam_check_no_overlap(&out, &x) < 0 || sam_check_no_overlap(&out, &w) < 0 ||
        sam_check_no_overlap(&out, &up) < 0)
        return fail(&c);
    sam_dense_params p;
    memset(&p, 0, sizeof p);
    p.x = x.data;
    p.T = T;
    p.ldx = ldx;
    p.w = w.data;
    p.up = up.present ? up.data : NULL;
    p.R = R;
    p.C = C;
    p.dtype = x.dtype;
    p.act = (sam_act)act;
    p.alpha = alpha;
    p.limit = limit;
    p.out = out.data;
    p.ldo = T > 1 ? out.strides[0] : R;
    p.weights_ready = ready;
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_dense_decode_cuda(&p, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_dense_ref(&p));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- a gated activation ---------------------------------------------------------------- */

/* t: [T, I] of dtype, unit column stride, rows not overlapping; *ld its row stride. */
static int check_glu_rows(op_ctx *c, sam_tensor *t, const sam_tensor *like, int64_t *ld)
{
    if (sam_check_ndim(t, 2) < 0) return -1;
    if (like != NULL && t->dtype != like->dtype) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected dtype %s (that of %s), got %s", c->op, t->name,
                     sam_dtype_name(like->dtype), like->name, sam_dtype_name(t->dtype));
        return -1;
    }
    if (like != NULL && (t->shape[0] != like->shape[0] || t->shape[1] != like->shape[1])) {
        PyErr_Format(PyExc_ValueError, "%s: %s: expected shape (%lld, %lld) (that of %s), got (%lld, %lld)", c->op,
                     t->name, (long long)like->shape[0], (long long)like->shape[1], like->name,
                     (long long)t->shape[0], (long long)t->shape[1]);
        return -1;
    }
    const int64_t T = t->shape[0], I = t->shape[1];
    if ((I > 1 && t->strides[1] != 1) || (T > 1 && t->strides[0] < I)) {
        PyErr_Format(PyExc_ValueError, "%s: %s: rows must have unit column stride and not overlap (strides (%lld, "
                     "%lld))", c->op, t->name, (long long)t->strides[0], (long long)t->strides[1]);
        return -1;
    }
    *ld = T > 1 ? t->strides[0] : I;
    return 0;
}

PyObject *sam_py_glu(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"out", "g", "u", "act", "alpha", "limit", "stream", NULL};
    PyObject *o_out, *o_g, *o_u, *o_stream = Py_None;
    int act = SAM_ACT_SWIGLU;
    float alpha = 1.702f, limit = 7.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|iffO:glu", kwlist, &o_out, &o_g, &o_u, &act, &alpha, &limit,
                                     &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "glu", stream);
    if (act != SAM_ACT_SWIGLU && act != SAM_ACT_GPTOSS) {
        PyErr_Format(PyExc_ValueError, "glu: act = %d; expected 1 (swiglu) or 2 (gptoss)", act);
        return NULL;
    }
    sam_tensor out, g, u;
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 || sam_tensor_take(&c.call, &g, o_g, "g", 0) < 0 ||
        sam_tensor_take(&c.call, &u, o_u, "u", 0) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    int64_t ldg, ldu, ldo;
    if (sam_check_dtype(&g, c.cuda ? SAM_DT_HALF : SAM_DT_FLOAT) < 0 || check_glu_rows(&c, &g, NULL, &ldg) < 0 ||
        check_glu_rows(&c, &u, &g, &ldu) < 0 || check_glu_rows(&c, &out, &g, &ldo) < 0 ||
        sam_check_writable(&out) < 0 || sam_check_no_overlap(&out, &g) < 0 || sam_check_no_overlap(&out, &u) < 0)
        return fail(&c);
    sam_glu_params p;
    memset(&p, 0, sizeof p);
    p.g = g.data;
    p.u = u.data;
    p.ldg = ldg;
    p.ldu = ldu;
    p.out = out.data;
    p.ldo = ldo;
    p.T = g.shape[0];
    p.I = g.shape[1];
    p.dtype = g.dtype;
    p.act = (sam_act)act;
    p.alpha = alpha;
    p.limit = limit;
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_glu_cuda(&p, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_glu_ref(&p));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- the router --------------------------------------------------------------------- */

/* t: float32 or x's dtype, [rows, cols] contiguous, writable (an output). */
static int check_router_out(op_ctx *c, sam_tensor *t, const sam_tensor *x, int64_t rows, int64_t cols,
                            unsigned dtypes)
{
    int64_t shape[2] = {rows, cols};
    if (sam_check_shape(t, 2, shape) < 0 || sam_check_contiguous(t) < 0 || sam_check_writable(t) < 0) return -1;
    if (dtypes == 0 && t->dtype != SAM_F32 && t->dtype != x->dtype) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected dtype float32 or %s (that of x), got %s", c->op, t->name,
                     sam_dtype_name(x->dtype), sam_dtype_name(t->dtype));
        return -1;
    }
    return dtypes == 0 ? 0 : sam_check_dtype(t, dtypes);
}

PyObject *sam_py_router(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"logits", "weights", "ids", "x", "w", "k", "bias", "mode", "n_group", "topk_group",
                             "renorm", "scale", "choice_bias", "stream", NULL};
    PyObject *o_logits, *o_weights, *o_ids, *o_x, *o_w, *o_bias = Py_None, *o_choice = Py_None, *o_stream = Py_None;
    int k, mode = 0, n_group = 1, topk_group = 1, renorm = 0;
    float scale = 1.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOi|OiiipfOO:router", kwlist, &o_logits, &o_weights, &o_ids,
                                     &o_x, &o_w, &k, &o_bias, &mode, &n_group, &topk_group, &renorm, &scale,
                                     &o_choice, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "router", stream);
    if (mode < SAM_ROUTER_SOFTMAX_TOPK || mode > SAM_ROUTER_SIGMOID_TOPK) {
        PyErr_Format(PyExc_ValueError, "router: mode = %d; expected 0 (softmax, then top-k), 1 (top-k, then "
                     "softmax) or 2 (sigmoid, top-k by score + choice_bias)", mode);
        return NULL;
    }
    if (o_choice != Py_None && mode != SAM_ROUTER_SIGMOID_TOPK) {
        PyErr_SetString(PyExc_ValueError, "router: choice_bias: only with mode 2 (sigmoid, then top-k)");
        return NULL;
    }
    sam_tensor logits, weights, ids, x, w, bias, choice;
    if (sam_tensor_take(&c.call, &logits, o_logits, "logits", 0) < 0 ||
        sam_tensor_take(&c.call, &weights, o_weights, "weights", 0) < 0 ||
        sam_tensor_take(&c.call, &ids, o_ids, "ids", 0) < 0 ||
        sam_tensor_take(&c.call, &x, o_x, "x", 0) < 0 ||
        sam_tensor_take(&c.call, &w, o_w, "w", 0) < 0 ||
        sam_tensor_take(&c.call, &bias, o_bias, "bias", 1) < 0 ||
        sam_tensor_take(&c.call, &choice, o_choice, "choice_bias", 1) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_dtype(&x, c.cuda ? SAM_DT_HALF : SAM_DT_FLOAT) < 0 || sam_check_ndim(&x, 2) < 0 ||
        check_dense_weight(&c, &w, &x, NULL) < 0)
        return fail(&c);
    const int64_t E = w.shape[0], H = w.shape[1], T = x.shape[0];
    int64_t ldx;
    if (check_x_rows(&c, &x, H, &ldx) < 0) return fail(&c);
    if (E < 1 || E > SAM_ROUTER_MAX_EXPERTS) {
        PyErr_Format(PyExc_ValueError, "router: w has %lld rows (experts); expected 1 to %d", (long long)E,
                     SAM_ROUTER_MAX_EXPERTS);
        return fail(&c);
    }
    if (k < 1 || k > E || k > SAM_ROUTER_MAX_K) {
        PyErr_Format(PyExc_ValueError, "router: k = %d; expected 1 <= k <= min(experts = %lld, %d)", k,
                     (long long)E, SAM_ROUTER_MAX_K);
        return fail(&c);
    }
    if (n_group < 1 || n_group > SAM_ROUTER_MAX_GROUPS || E % n_group != 0 || topk_group < 1 ||
        topk_group > n_group || (mode == SAM_ROUTER_TOPK_SOFTMAX && n_group != 1) ||
        (mode == SAM_ROUTER_SIGMOID_TOPK && n_group > 1 && E / n_group < 2)) {
        PyErr_Format(PyExc_ValueError, "router: n_group = %d, topk_group = %d; expected n_group <= %d dividing the "
                     "%lld experts and 1 <= topk_group <= n_group (groups only with modes 0 and 2; mode 2: at "
                     "least two experts per group)", n_group, topk_group, SAM_ROUTER_MAX_GROUPS, (long long)E);
        return fail(&c);
    }
    sam_tensor *biases[] = {&bias, &choice};
    for (int i = 0; i < 2; i++) {
        sam_tensor *b = biases[i];
        if (!b->present) continue;
        int64_t bs[1] = {E};
        if (sam_check_shape(b, 1, bs) < 0 || sam_check_contiguous(b) < 0) return fail(&c);
        if (b->dtype != SAM_F32 && b->dtype != x.dtype) {
            PyErr_Format(PyExc_TypeError, "router: %s: expected dtype float32 or %s (that of x), got %s", b->name,
                         sam_dtype_name(x.dtype), sam_dtype_name(b->dtype));
            return fail(&c);
        }
    }
    if (check_router_out(&c, &logits, &x, T, E, 0) < 0 || check_router_out(&c, &weights, &x, T, k, 0) < 0 ||
        check_router_out(&c, &ids, &x, T, k, SAM_DT(SAM_I64)) < 0)
        return fail(&c);
    sam_tensor *outs[] = {&logits, &weights, &ids};
    sam_tensor *ins[] = {&x, &w, &bias, &choice};
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 4; j++)
            if (sam_check_no_overlap(outs[i], ins[j]) < 0) return fail(&c);
        for (int j = i + 1; j < 3; j++)
            if (sam_check_no_overlap(outs[i], outs[j]) < 0) return fail(&c);
    }
    sam_router_params p;
    memset(&p, 0, sizeof p);
    p.x = x.data;
    p.T = T;
    p.ldx = ldx;
    p.dtype = x.dtype;
    p.w = w.data;
    p.E = E;
    p.H = H;
    p.bias = bias.present ? bias.data : NULL;
    p.bias_dtype = bias.present ? bias.dtype : SAM_F32;
    p.choice_bias = choice.present ? choice.data : NULL;
    p.choice_bias_dtype = choice.present ? choice.dtype : SAM_F32;
    p.k = k;
    p.mode = mode;
    p.n_group = n_group;
    p.topk_group = topk_group;
    p.renorm = renorm;
    p.scale = scale;
    p.logits = logits.data;
    p.logits_dtype = logits.dtype;
    p.weights = weights.data;
    p.weights_dtype = weights.dtype;
    p.ids = (int64_t *)ids.data;
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_router_cuda(&p, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_router_ref(&p));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- MoE routing ------------------------------------------------------------------ */

PyObject *sam_py_moe_route(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"offsets", "token_ids", "perm", "pos", "top_k_index", "stream", NULL};
    PyObject *o_off, *o_tok, *o_perm, *o_pos, *o_idx, *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|O:moe_route", kwlist, &o_off, &o_tok, &o_perm, &o_pos,
                                     &o_idx, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "moe_route", stream);
    sam_tensor off, tok, perm, pos, idx;
    if (sam_tensor_take(&c.call, &off, o_off, "offsets", 0) < 0 ||
        sam_tensor_take(&c.call, &tok, o_tok, "token_ids", 0) < 0 ||
        sam_tensor_take(&c.call, &perm, o_perm, "perm", 0) < 0 ||
        sam_tensor_take(&c.call, &pos, o_pos, "pos", 0) < 0 ||
        sam_tensor_take(&c.call, &idx, o_idx, "top_k_index", 0) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_dtype(&idx, SAM_DT_INDEX) < 0 || sam_check_ndim(&idx, 2) < 0 ||
        sam_check_contiguous(&idx) < 0)
        return fail(&c);
    const int64_t T = idx.shape[0], K = idx.shape[1];
    if (sam_check_dtype(&off, SAM_DT(SAM_I32)) < 0 || sam_check_ndim(&off, 1) < 0 ||
        sam_check_contiguous(&off) < 0 || sam_check_writable(&off) < 0)
        return fail(&c);
    const int64_t E = off.shape[0] - 1;
    if (E < 1 || T * K > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "moe_route: offsets needs E + 1 >= 2 entries and T*K < 2**31 "
                     "(got %lld entries, T*K = %lld)", (long long)(E + 1), (long long)(T * K));
        return fail(&c);
    }
    int64_t flat[1] = {T * K}, tk[2] = {T, K};
    if (sam_check_dtype(&tok, SAM_DT(SAM_I32)) < 0 || sam_check_shape(&tok, 1, flat) < 0 ||
        sam_check_contiguous(&tok) < 0 || sam_check_writable(&tok) < 0 ||
        sam_check_dtype(&perm, SAM_DT(SAM_I32)) < 0 || sam_check_shape(&perm, 1, flat) < 0 ||
        sam_check_contiguous(&perm) < 0 || sam_check_writable(&perm) < 0 ||
        sam_check_dtype(&pos, SAM_DT(SAM_I32)) < 0 || sam_check_shape(&pos, 2, tk) < 0 ||
        sam_check_contiguous(&pos) < 0 || sam_check_writable(&pos) < 0)
        return fail(&c);
    sam_tensor *outs[] = {&off, &tok, &perm, &pos};
    for (int i = 0; i < 4; i++) {
        if (sam_check_no_overlap(outs[i], &idx) < 0) return fail(&c);
        for (int j = i + 1; j < 4; j++)
            if (sam_check_no_overlap(outs[i], outs[j]) < 0) return fail(&c);
    }
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_moe_route_cuda(idx.data, idx.dtype, T, K, E, (int32_t *)off.data,
                                                (int32_t *)tok.data, (int32_t *)perm.data, (int32_t *)pos.data,
                                                NULL, NULL, SAM_F32, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_moe_route_ref(idx.data, idx.dtype, T, K, E, (int32_t *)off.data, (int32_t *)tok.data,
                                          (int32_t *)perm.data, (int32_t *)pos.data));
    }
    return finish(&c, status, last_error(c.cuda));
}

PyObject *sam_py_moe_gather_weights(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"out", "w", "perm", "offsets", "stream", NULL};
    PyObject *o_out, *o_w, *o_perm, *o_off, *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|O:moe_gather_weights", kwlist, &o_out, &o_w, &o_perm,
                                     &o_off, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "moe_gather_weights", stream);
    sam_tensor out, w, perm, off;
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 ||
        sam_tensor_take(&c.call, &w, o_w, "w", 0) < 0 ||
        sam_tensor_take(&c.call, &perm, o_perm, "perm", 0) < 0 ||
        sam_tensor_take(&c.call, &off, o_off, "offsets", 0) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_dtype(&w, SAM_DT_FLOAT) < 0 || sam_check_contiguous(&w) < 0 ||
        sam_check_dtype(&off, SAM_DT(SAM_I32)) < 0 || sam_check_ndim(&off, 1) < 0 ||
        sam_check_contiguous(&off) < 0)
        return fail(&c);
    const int64_t n = sam_tensor_numel(&w), E = off.shape[0] - 1;
    int64_t flat[1] = {n};
    if (E < 1) {
        PyErr_SetString(PyExc_ValueError, "moe_gather_weights: offsets needs at least 2 entries");
        return fail(&c);
    }
    if (sam_check_dtype(&out, SAM_DT(SAM_F32)) < 0 || sam_check_shape(&out, 1, flat) < 0 ||
        sam_check_contiguous(&out) < 0 || sam_check_writable(&out) < 0 ||
        sam_check_dtype(&perm, SAM_DT(SAM_I32)) < 0 || sam_check_shape(&perm, 1, flat) < 0 ||
        sam_check_contiguous(&perm) < 0 || sam_check_no_overlap(&out, &w) < 0 ||
        sam_check_no_overlap(&out, &perm) < 0 || sam_check_no_overlap(&out, &off) < 0)
        return fail(&c);
    int status;
    if (!c.cuda) { /* perm comes from the caller: check it before reading through it */
        const int32_t *pp = (const int32_t *)perm.data;
        for (int64_t s = 0; s < n; s++)
            if (pp[s] >= n) {
                PyErr_Format(PyExc_ValueError, "moe_gather_weights: perm[%lld] = %d is outside w's %lld "
                             "entries", (long long)s, pp[s], (long long)n);
                return fail(&c);
            }
    }
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_moe_gather_weights_cuda((float *)out.data, w.data, w.dtype,
                                                         (const int32_t *)perm.data, (const int32_t *)off.data,
                                                         E, n, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_moe_gather_weights_ref((float *)out.data, w.data, w.dtype, (const int32_t *)perm.data,
                                                   (const int32_t *)off.data, E, n));
    }
    return finish(&c, status, last_error(c.cuda));
}

PyObject *sam_py_moe_combine(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"out", "y", "pos", "stream", NULL};
    PyObject *o_out, *o_y, *o_pos, *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:moe_combine", kwlist, &o_out, &o_y, &o_pos, &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "moe_combine", stream);
    sam_tensor out, y, pos;
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 ||
        sam_tensor_take(&c.call, &y, o_y, "y", 0) < 0 ||
        sam_tensor_take(&c.call, &pos, o_pos, "pos", 0) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    if (sam_check_dtype(&out, SAM_DT_FLOAT) < 0 || sam_check_ndim(&out, 2) < 0 ||
        sam_check_contiguous(&out) < 0 || sam_check_writable(&out) < 0 ||
        sam_check_dtype(&y, SAM_DT_FLOAT) < 0 || sam_check_ndim(&y, 2) < 0 ||
        sam_check_dtype(&pos, SAM_DT(SAM_I32)) < 0 || sam_check_ndim(&pos, 2) < 0 ||
        sam_check_contiguous(&pos) < 0)
        return fail(&c);
    const int64_t T = out.shape[0], H = out.shape[1], K = pos.shape[1], S = y.shape[0];
    if (pos.shape[0] != T) {
        PyErr_Format(PyExc_ValueError, "moe_combine: pos: expected %lld rows (out's), got %lld",
                     (long long)T, (long long)pos.shape[0]);
        return fail(&c);
    }
    if (y.shape[1] != H || (H > 1 && y.strides[1] != 1) || (S > 1 && y.strides[0] < H)) {
        PyErr_Format(PyExc_ValueError, "moe_combine: y: expected %lld contiguous columns (out's), got shape "
                     "(%lld, %lld)", (long long)H, (long long)S, (long long)y.shape[1]);
        return fail(&c);
    }
    const int64_t ldy = S > 1 ? y.strides[0] : H;
    if (c.cuda && y.dtype != SAM_F32 && (ldy % 2 != 0 || H % 2 != 0)) {
        PyErr_SetString(PyExc_ValueError, "moe_combine: y: rows and the row stride must have an even length "
                        "on the GPU");
        return fail(&c);
    }
    if (sam_check_no_overlap(&out, &y) < 0 || sam_check_no_overlap(&out, &pos) < 0) return fail(&c);
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, sam_moe_combine_cuda(out.data, out.dtype, y.data, y.dtype, (const int32_t *)pos.data,
                                                  T, K, H, ldy, S, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, sam_moe_combine_ref(out.data, out.dtype, y.data, y.dtype, (const int32_t *)pos.data,
                                            T, K, H, ldy, S));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- the whole MoE forward in one call ------------------------------------------- */

/* Byte offsets of the intermediates in a moe_forward workspace (each 256-byte
 * aligned), for T tokens, K experts per token, E experts, hidden H, expert
 * width I and elem-byte activations; S = T*K sorted rows. */
typedef struct moe_ws {
    size_t offsets, token_ids, perm, pos, scale, h, y, total;
} moe_ws;

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

static void moe_ws_layout(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, size_t elem, moe_ws *w)
{
    const size_t S = (size_t)(T * K);
    size_t at = 0;
    w->offsets = at;   at = align256(at + sizeof(int32_t) * (size_t)(E + 1));
    w->token_ids = at; at = align256(at + sizeof(int32_t) * S);
    w->perm = at;      at = align256(at + sizeof(int32_t) * S);
    w->pos = at;       at = align256(at + sizeof(int32_t) * S);
    w->scale = at;     at = align256(at + sizeof(float) * S);
    w->h = at;         at = align256(at + elem * S * (size_t)I);   /* act(gate_up(x)) of every sorted row */
    w->y = at;         at = align256(at + elem * S * (size_t)H);   /* scale * down(h) */
    w->total = at;
}

/* The sizes moe_forward accepts (the workspace layout's products stay far from overflow). */
static int moe_sizes_ok(const char *op, long long T, long long K, long long E, long long H, long long I)
{
    if (T < 0 || K < 0 || E < 1 || H < 0 || I < 0 || E >= INT32_MAX || H > INT32_MAX || I > INT32_MAX ||
        (K > 0 && T > INT32_MAX / K)) {
        PyErr_Format(PyExc_ValueError, "%s: T = %lld, K = %lld, E = %lld, H = %lld, I = %lld; expected "
                     "T*K < 2**31, 1 <= E < 2**31 - 1 and H, I below 2**31", op, T, K, E, H, I);
        return -1;
    }
    return 0;
}

PyObject *sam_py_moe_workspace_bytes(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"T", "K", "E", "H", "I", "itemsize", NULL};
    long long T, K, E, H, I;
    int elem;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLLi:moe_workspace_bytes", kwlist, &T, &K, &E, &H, &I, &elem))
        return NULL;
    if (moe_sizes_ok("moe_workspace_bytes", T, K, E, H, I) < 0) return NULL;
    if (elem != 2 && elem != 4) {
        PyErr_Format(PyExc_ValueError, "moe_workspace_bytes: itemsize = %d; expected 2 or 4", elem);
        return NULL;
    }
    moe_ws w;
    moe_ws_layout(T, K, E, H, I, (size_t)elem, &w);
    return PyLong_FromSize_t(w.total);
}

/* One MoE forward: the steps of route, gather_weights, ssmm (gate_up, gated
 * activation), ssmm (down, routing weight) and combine, on buffers carved from
 * the workspace. */
typedef struct moe_plan {
    const void *index;
    sam_dtype index_dtype;
    const void *weights;
    sam_dtype weights_dtype;
    int64_t T, K, E, H;
    int32_t *offsets, *token_ids, *perm, *pos;
    float *scale;
    sam_ssmm_params gate_up, down;
    void *out;
    sam_dtype out_dtype;
} moe_plan;

#define MOE_STEP(expr) do { const sam_status st_ = (expr); if (st_ != SAM_STATUS_OK) return st_; } while (0)

static sam_status moe_run_ref(const moe_plan *p)
{
    const int64_t S = p->T * p->K;
    MOE_STEP(sam_moe_route_ref(p->index, p->index_dtype, p->T, p->K, p->E, p->offsets, p->token_ids, p->perm,
                               p->pos));
    MOE_STEP(sam_moe_gather_weights_ref(p->scale, p->weights, p->weights_dtype, p->perm, p->offsets, p->E, S));
    MOE_STEP(sam_ssmm_ref(&p->gate_up));
    MOE_STEP(sam_ssmm_ref(&p->down));
    return sam_moe_combine_ref(p->out, p->out_dtype, p->down.out, p->down.dtype, p->pos, p->T, p->K, p->H,
                               p->down.ldo, S);
}

#if SAM_WITH_CUDA
static sam_status moe_run_cuda(const moe_plan *p, void *stream)
{
    const int64_t S = p->T * p->K;
    /* the routing weights of the sorted rows come with the routing, in its launch */
    MOE_STEP(sam_moe_route_cuda(p->index, p->index_dtype, p->T, p->K, p->E, p->offsets, p->token_ids, p->perm,
                                p->pos, p->scale, p->weights, p->weights_dtype, stream));
    MOE_STEP(sam_ssmm_cuda(&p->gate_up, stream));
    MOE_STEP(sam_ssmm_cuda(&p->down, stream));
    return sam_moe_combine_cuda(p->out, p->out_dtype, p->down.out, p->down.dtype, p->pos, p->T, p->K, p->H,
                                p->down.ldo, S, stream);
}
#endif

/* A packed weight of the MoE: 3-d values, dims from (E, rows, cols), the packed
 * arrays' shapes, the activations' dtype. */
static int moe_weight(op_ctx *c, const char *name, sam_tensor *values, sam_tensor *meta, sam_tensor *idx,
                      sam_format f, int64_t E, int64_t rows, int64_t cols, sam_dtype dtype, sam_dims *d)
{
    if (sam_check_ndim(values, 3) < 0) return -1;
    if (values->shape[0] != E) {
        PyErr_Format(PyExc_ValueError, "%s: %s: expected %lld experts (gate_up's), got %lld", c->op,
                     values->name, (long long)E, (long long)values->shape[0]);
        return -1;
    }
    if (make_dims(c->op, name, f, E, rows, cols, d) < 0 || check_packed(c, values, meta, idx, f, d, 0) < 0)
        return -1;
    if (values->dtype != dtype) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected dtype %s (that of gate_up_values), got %s", c->op,
                     values->name, sam_dtype_name(dtype), sam_dtype_name(values->dtype));
        return -1;
    }
    return 0;
}

PyObject *sam_py_moe_forward(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"out", "workspace", "x", "top_k_index", "top_k_weights", "gate_up_values",
                             "gate_up_meta", "gate_up_idx", "down_values", "down_meta", "down_idx",
                             "intermediate", "n", "m", "v", "act", "gate_up_bias", "down_bias", "alpha",
                             "limit", "impl", "stream", NULL};
    PyObject *o_out, *o_ws, *o_x, *o_index, *o_weights, *o_gv, *o_gm, *o_gi, *o_dv, *o_dm, *o_di,
             *o_gbias = Py_None, *o_dbias = Py_None, *o_stream = Py_None;
    long long inter;
    int n, m, v, act = SAM_ACT_SWIGLU, impl = 0;
    float alpha = 1.702f, limit = 7.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOOLiii|iOOffiO:moe_forward", kwlist, &o_out, &o_ws,
                                     &o_x, &o_index, &o_weights, &o_gv, &o_gm, &o_gi, &o_dv, &o_dm, &o_di,
                                     &inter, &n, &m, &v, &act, &o_gbias, &o_dbias, &alpha, &limit, &impl,
                                     &o_stream))
        return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "moe_forward", stream);
    if (act != SAM_ACT_SWIGLU && act != SAM_ACT_GPTOSS) {
        PyErr_Format(PyExc_ValueError, "moe_forward: act = %d; expected 1 (swiglu) or 2 (gptoss)", act);
        return NULL;
    }
    if (impl < 0 || impl > 3) {
        PyErr_Format(PyExc_ValueError, "moe_forward: impl = %d; expected 0 (auto), 1 (mma.sp), 2 (wgmma.sp) or "
                     "3 (decode)", impl);
        return NULL;
    }
    if (inter < 0 || inter > INT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "moe_forward: intermediate = %lld; expected 0 <= intermediate < 2**30",
                     inter);
        return NULL;
    }
    sam_format fg, fd;
    if (parse_format(c.op, n, m, v, 1, &fg) < 0 || parse_format(c.op, n, m, v, 0, &fd) < 0) return NULL;
    sam_tensor out, ws, x, index, weights, gv, gm, gi, dv, dm, di, gbias, dbias;
    if (sam_tensor_take(&c.call, &out, o_out, "out", 0) < 0 ||
        sam_tensor_take(&c.call, &ws, o_ws, "workspace", 0) < 0 ||
        sam_tensor_take(&c.call, &x, o_x, "x", 0) < 0 ||
        sam_tensor_take(&c.call, &index, o_index, "top_k_index", 0) < 0 ||
        sam_tensor_take(&c.call, &weights, o_weights, "top_k_weights", 0) < 0 ||
        sam_tensor_take(&c.call, &gv, o_gv, "gate_up_values", 0) < 0 ||
        sam_tensor_take(&c.call, &gm, o_gm, "gate_up_meta", 0) < 0 ||
        sam_tensor_take(&c.call, &gi, o_gi, "gate_up_idx", 1) < 0 ||
        sam_tensor_take(&c.call, &dv, o_dv, "down_values", 0) < 0 ||
        sam_tensor_take(&c.call, &dm, o_dm, "down_meta", 0) < 0 ||
        sam_tensor_take(&c.call, &di, o_di, "down_idx", 1) < 0 ||
        sam_tensor_take(&c.call, &gbias, o_gbias, "gate_up_bias", 1) < 0 ||
        sam_tensor_take(&c.call, &dbias, o_dbias, "down_bias", 1) < 0 || ctx_device(&c) < 0)
        return fail(&c);
    /* x [T, H] */
    if (sam_check_dtype(&x, c.cuda ? SAM_DT_HALF : SAM_DT_FLOAT) < 0 || sam_check_ndim(&x, 2) < 0)
        return fail(&c);
    const int64_t T = x.shape[0], H = x.shape[1];
    int64_t ldx;
    if (check_x_rows(&c, &x, H, &ldx) < 0) return fail(&c);
    /* the two weights */
    if (sam_check_ndim(&gv, 3) < 0) return fail(&c);
    const int64_t E = gv.shape[0];
    if (sam_check_dtype(&gv, SAM_DT_FLOAT) < 0) return fail(&c);
    if (x.dtype != gv.dtype) {
        PyErr_Format(PyExc_TypeError, "moe_forward: x: expected dtype %s (that of the packed weights), got %s",
                     sam_dtype_name(gv.dtype), sam_dtype_name(x.dtype));
        return fail(&c);
    }
    sam_dims dg, dd;
    if (moe_weight(&c, "gate_up", &gv, &gm, &gi, fg, E, 2 * inter, H, gv.dtype, &dg) < 0 ||
        moe_weight(&c, "down", &dv, &dm, &di, fd, E, H, inter, gv.dtype, &dd) < 0)
        return fail(&c);
    if (c.cuda && inter % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "moe_forward: intermediate = %lld; the GPU kernels need a multiple of 8",
                     inter);
        return fail(&c);
    }
    /* routing [T, K] */
    if (sam_check_dtype(&index, SAM_DT_INDEX) < 0 || sam_check_ndim(&index, 2) < 0 ||
        sam_check_contiguous(&index) < 0)
        return fail(&c);
    if (index.shape[0] != T) {
        PyErr_Format(PyExc_ValueError, "moe_forward: top_k_index: expected %lld rows (x's), got %lld",
                     (long long)T, (long long)index.shape[0]);
        return fail(&c);
    }
    const int64_t K = index.shape[1];
    if (moe_sizes_ok(c.op, T, K, E, H, inter) < 0) return fail(&c);
    if (sam_check_dtype(&weights, SAM_DT_FLOAT) < 0 || sam_check_contiguous(&weights) < 0) return fail(&c);
    if (sam_tensor_numel(&weights) != T * K) {
        PyErr_Format(PyExc_ValueError, "moe_forward: top_k_weights: expected %lld entries (top_k_index's [T, K]), "
                     "got %lld", (long long)(T * K), (long long)sam_tensor_numel(&weights));
        return fail(&c);
    }
    int64_t gbs[2] = {E, 2 * inter}, dbs[2] = {E, H};
    if ((gbias.present && (sam_check_dtype(&gbias, SAM_DT_FLOAT) < 0 || sam_check_shape(&gbias, 2, gbs) < 0 ||
                           sam_check_contiguous(&gbias) < 0)) ||
        (dbias.present && (sam_check_dtype(&dbias, SAM_DT_FLOAT) < 0 || sam_check_shape(&dbias, 2, dbs) < 0 ||
                           sam_check_contiguous(&dbias) < 0)))
        return fail(&c);
    /* out [T, H], workspace */
    int64_t os[2] = {T, H};
    if (sam_check_dtype(&out, SAM_DT_FLOAT) < 0 || sam_check_shape(&out, 2, os) < 0 ||
        sam_check_contiguous(&out) < 0 || sam_check_writable(&out) < 0)
        return fail(&c);
    moe_ws L;
    moe_ws_layout(T, K, E, H, inter, sam_dtype_size(x.dtype), &L);
    if (sam_check_dtype(&ws, SAM_DT(SAM_U8)) < 0 || sam_check_ndim(&ws, 1) < 0 ||
        sam_check_contiguous(&ws) < 0 || sam_check_writable(&ws) < 0 || check_cuda_alignment(&c, &ws, 16) < 0)
        return fail(&c);
    if ((size_t)ws.shape[0] < L.total) {
        PyErr_Format(PyExc_ValueError, "moe_forward: workspace: expected at least %zu bytes "
                     "(moe_workspace_bytes(%lld, %lld, %lld, %lld, %lld, %d)), got %lld", L.total, (long long)T,
                     (long long)K, (long long)E, (long long)H, inter, (int)sam_dtype_size(x.dtype),
                     (long long)ws.shape[0]);
        return fail(&c);
    }
    sam_tensor *ins[] = {&x, &index, &weights, &gv, &gm, &gi, &dv, &dm, &di, &gbias, &dbias};
    for (size_t i = 0; i < sizeof(ins) / sizeof(ins[0]); i++)
        if (sam_check_no_overlap(&out, ins[i]) < 0 || sam_check_no_overlap(&ws, ins[i]) < 0) return fail(&c);
    if (sam_check_no_overlap(&out, &ws) < 0) return fail(&c);

    char *base = ws.data;
    moe_plan p;
    memset(&p, 0, sizeof p);
    p.index = index.data;
    p.index_dtype = index.dtype;
    p.weights = weights.data;
    p.weights_dtype = weights.dtype;
    p.T = T; p.K = K; p.E = E; p.H = H;
    p.offsets = (int32_t *)(base + L.offsets);
    p.token_ids = (int32_t *)(base + L.token_ids);
    p.perm = (int32_t *)(base + L.perm);
    p.pos = (int32_t *)(base + L.pos);
    p.scale = (float *)(base + L.scale);
    p.out = out.data;
    p.out_dtype = out.dtype;
    const int64_t S = T * K;
    sam_ssmm_params *g = &p.gate_up, *d = &p.down;
    g->x = x.data; g->T = T; g->ldx = ldx; g->dtype = x.dtype;
    g->values = gv.data; g->meta = (const uint32_t *)gm.data;
    g->idx = sam_format_has_selection(fg) ? (const uint8_t *)gi.data : NULL;
    g->f = fg; g->d = dg;
    g->offsets = p.offsets; g->token_ids = p.token_ids; g->S = S;
    g->act = (sam_act)act;
    g->bias = gbias.present ? gbias.data : NULL;
    g->bias_dtype = gbias.present ? gbias.dtype : SAM_F32;
    g->alpha = alpha; g->limit = limit;
    g->out = base + L.h; g->ldo = inter;
    g->impl = impl;
    g->cfg = ((const sam_module_state *)PyModule_GetState(self))->cfg;
    d->x = base + L.h; d->T = S; d->ldx = inter; d->dtype = x.dtype;
    d->values = dv.data; d->meta = (const uint32_t *)dm.data;
    d->idx = sam_format_has_selection(fd) ? (const uint8_t *)di.data : NULL;
    d->f = fd; d->d = dd;
    d->offsets = p.offsets; d->token_ids = NULL; d->S = S;
    d->act = SAM_ACT_NONE;
    d->bias = dbias.present ? dbias.data : NULL;
    d->bias_dtype = dbias.present ? dbias.dtype : SAM_F32;
    d->scale = p.scale;
    d->alpha = alpha; d->limit = limit;
    d->out = base + L.y; d->ldo = H;
    d->impl = impl;
    d->cfg = g->cfg;
    d->offsets_ready = 1;  /* routed two launches back (cuda/samoyeds_cuda.h) */
    int status;
    if (c.cuda) {
#if SAM_WITH_CUDA
        CUDA_RUN(&c, status, moe_run_cuda(&p, c.call.launch_stream));
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        REF_RUN(status, moe_run_ref(&p));
    }
    return finish(&c, status, last_error(c.cuda));
}

/* ---- introspection ------------------------------------------------------------------ */

PyObject *sam_py_tensor_info(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"t", "stream", NULL};
    PyObject *o_t, *o_stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:tensor_info", kwlist, &o_t, &o_stream)) return NULL;
    op_ctx c;
    int64_t stream;
    if (parse_stream(o_stream, &stream) < 0) return NULL;
    ctx_init(&c, "tensor_info", stream);
    sam_tensor t;
    if (sam_tensor_take(&c.call, &t, o_t, "t", 0) < 0) return fail(&c);
    PyObject *shape = PyTuple_New(t.ndim), *strides = PyTuple_New(t.ndim);
    if (shape == NULL || strides == NULL) {
        Py_XDECREF(shape); Py_XDECREF(strides);
        return fail(&c);
    }
    for (int i = 0; i < t.ndim; i++) {
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(t.shape[i]));
        PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(t.strides[i]));
    }
    const char *path = t.versioned ? "versioned" : (t.legacy ? "legacy" : "exchange_api");
    PyObject *res = Py_BuildValue(
        "{s:s,s:N,s:N,s:s,s:i,s:i,s:K,s:s,s:K}", "dtype", sam_dtype_name(t.dtype), "shape", shape,
        "strides", strides, "device", t.device_type == kDLCUDA ? "cuda" : "cpu", "device_id", t.device_id,
        "readonly", t.readonly, "data_ptr", (unsigned long long)(uintptr_t)t.data, "path", path, "stream",
        (unsigned long long)(uintptr_t)c.call.launch_stream);
    sam_call_release(&c.call);
    return res;
}
