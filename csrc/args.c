/*
 * args.c -- sam_run_op: the one place that takes, checks and releases the
 * tensors of an op, and words every argument error (csrc/sam_args.h says in
 * which order); the scalar-argument helpers; checked size arithmetic.
 *
 * Stream rule: `stream=None` launches on the producer's current stream when
 * the producer says which (DLPack exchange API: torch), else on the legacy
 * default stream; an int is taken as a cudaStream_t.  Producers are asked to
 * order their pending work before that stream.
 */
#include "sam_args.h"
#include "sam_ref.h"

#include <stdio.h>
#include <string.h>

/* ---- checked size arithmetic ----------------------------------------------------- */

int sam_size_mul(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0) return -1;
    if (a != 0 && b > INT64_MAX / a) return -1;
    *out = a * b;
    return 0;
}

int sam_size_add(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0 || a > INT64_MAX - b) return -1;
    *out = a + b;
    return 0;
}

int sam_size_round_up(int64_t n, int64_t a, int64_t *out)
{
    int64_t t;
    if (a <= 0 || sam_size_add(n, a - 1, &t) < 0) return -1;
    *out = t / a * a;
    return 0;
}

/* ---- scalar arguments ---------------------------------------------------------- */

int sam_arg_range(const char *name, long long value, long long lo, long long hi, const char *expect)
{
    if (value >= lo && value <= hi) return 0;
    PyErr_Format(PyExc_ValueError, "%s: expected %s, got %lld", name, expect, value);
    return -1;
}

int sam_arg_int(PyObject *o, const char *name, long long lo, long long hi, const char *expect, int *out)
{
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow != 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected %s, got %R", name, expect, o);
        return -1;
    }
    if (sam_arg_range(name, v, lo, hi, expect) < 0) return -1;
    *out = (int)v;
    return 0;
}

int sam_arg_impl(int impl, sam_impl *out)
{
    if (sam_arg_range("impl", impl, SAM_IMPL_AUTO, SAM_IMPL_DECODE,
                      "0 (auto), 1 (mma.sp), 2 (wgmma.sp) or 3 (decode)") < 0)
        return -1;
    *out = (sam_impl)impl;
    return 0;
}

int sam_arg_format(int n, int m, int v, int glu, sam_format *f)
{
    if (m < 1 || m > SAM_MAX_M || n < 1 || n > m) {
        PyErr_Format(PyExc_ValueError, "n, m: expected 1 <= n <= m <= %d, got n:m = %d:%d", SAM_MAX_M, n, m);
        return -1;
    }
    f->glu = glu ? 1 : 0;
    if (n == m) { f->n = f->m = 1; f->v = 0; return 0; }
    if (v < 32 || v % 32 != 0) {
        PyErr_Format(PyExc_ValueError, "v: expected a positive multiple of 32 (the slice length of a format "
                     "with row selection), got %d", v);
        return -1;
    }
    f->n = n; f->m = m; f->v = v;
    return 0;
}

int sam_arg_dims(sam_format f, int64_t E, int64_t R, int64_t C, const char *rows_name, const char *cols_name,
                 sam_dims *d)
{
    if (E < 0 || R < 0 || R > INT32_MAX || C < 0 || C > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: expected a weight of E, R, C >= 0 with R, C below 2**31, got "
                     "(%lld, %lld, %lld)", R < 0 || R > INT32_MAX ? rows_name : cols_name, (long long)E,
                     (long long)R, (long long)C);
        return -1;
    }
    switch (sam_dims_make(f, E, R, C, d)) {
    case 0: return 0;
    case 1:
        PyErr_Format(PyExc_ValueError, "%s: expected a row count that is a multiple of m = %d%s, got %lld",
                     rows_name, f.m, f.glu ? " per gate/up half" : "", (long long)(f.glu ? R / 2 : R));
        return -1;
    case 2:
        PyErr_Format(PyExc_ValueError, "%s: expected a column count that is a multiple of 4 (2:4 sparsity), "
                     "got %lld", cols_name, (long long)C);
        return -1;
    default:
        PyErr_Format(PyExc_ValueError, "%s: expected an even row count (gate rows, then up rows), got %lld",
                     rows_name, (long long)R);
        return -1;
    }
}

int sam_arg_stream(PyObject *o, int64_t *out)
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

/* ---- messages ---------------------------------------------------------------------- */

static void format_dims(char *buf, size_t n, const int64_t *dims, int ndim)
{
    size_t len = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ", %lld" : "%lld", (long long)dims[i]);
    if (ndim == 1 && len < n) len += (size_t)snprintf(buf + len, n - len, ",");
    if (len < n) snprintf(buf + len, n - len, ")");
}

static void device_str(char *buf, size_t n, const sam_tensor *t)
{
    if (t->device_type == kDLCUDA) snprintf(buf, n, "cuda:%d", t->device_id);
    else snprintf(buf, n, "cpu");
}

static int layout_error(const sam_tensor *t, const char *what)
{
    char s[160], st[160];
    format_dims(s, sizeof s, t->shape, t->ndim);
    format_dims(st, sizeof st, t->strides, t->ndim);
    PyErr_Format(PyExc_ValueError, "%s: expected %s, got shape %s with strides %s (call .contiguous() first)",
                 t->name, what, s, st);
    return -1;
}

/* An exception the producer raised while exporting a tensor (torch's "Unknown device
 * type meta for Dlpack") gets the argument's name and what samoyeds takes; the
 * producer's exception stays its cause.  Exceptions of samoyeds' own start with the name. */
static void producer_error(const char *name)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) return;
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
    const char *msg = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    const size_t len = strlen(name);
    if (msg == NULL || (strncmp(msg, name, len) == 0 && msg[len] == ':') ||
        !PyType_IsSubtype((PyTypeObject *)type, (PyTypeObject *)PyExc_Exception)) {
        PyErr_Clear();
        Py_XDECREF(text);
        PyErr_Restore(type, value, tb);
        return;
    }
    PyErr_Format(type, "%s: expected a tensor that exports through DLPack (on the CPU or a CUDA device), got "
                 "one whose export failed: %s", name, msg);
    Py_DECREF(text);
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyException_SetCause(v2, value); /* steals value */
    Py_INCREF(value);
    PyException_SetContext(v2, value); /* steals the new reference */
    Py_DECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(t2, v2, tb2);
}

/* ---- the phases ------------------------------------------------------------------------ */

static int check_device(sam_op_call *c)
{
    const sam_tensor *first = NULL;
    for (int i = 0; i < c->op->n_args; i++) {
        const sam_tensor *t = &c->t[i];
        if (!t->present) continue;
        if (first == NULL) { first = t; continue; }
        if (t->device_type != first->device_type || t->device_id != first->device_id) {
            char want[32], got[32];
            device_str(want, sizeof want, first);
            device_str(got, sizeof got, t);
            PyErr_Format(PyExc_ValueError, "%s: expected a tensor on %s (where %s is), got one on %s", t->name,
                         want, first->name, got);
            return -1;
        }
    }
    if (first == NULL) return 0;
    c->cuda = first->device_type == kDLCUDA;
    c->device = first->device_id;
#if !SAM_WITH_CUDA
    if (c->cuda) {
        PyErr_Format(PyExc_RuntimeError, "%s: expected a CPU tensor (samoyeds was built without CUDA: reinstall "
                     "with nvcc available, see README), got one on cuda:%d", first->name, first->device_id);
        return -1;
    }
#endif
    return 0;
}

/* The dtypes argument i takes: its spec's, or those that the argument it follows
 * (`like`) fixes once that one is taken (before: the floats it may have). */
static unsigned accepted_dtypes(const sam_op_call *c, int i)
{
    const sam_arg_spec *s = &c->op->args[i];
    if (!(s->flags & (SAM_ARG_LIKE | SAM_ARG_F32_OR_LIKE))) return s->dtypes;
    const sam_tensor *like = &c->t[s->like];
    if (!like->present) return s->dtypes ? s->dtypes : SAM_DT_FLOAT;
    return SAM_DT(like->dtype) | ((s->flags & SAM_ARG_F32_OR_LIKE) ? SAM_DT(SAM_F32) : 0u);
}

static int check_dtype(sam_op_call *c, int i)
{
    const sam_arg_spec *s = &c->op->args[i];
    const sam_tensor *t = &c->t[i];
    unsigned allowed = accepted_dtypes(c, i);
    const sam_tensor *like = (s->flags & (SAM_ARG_LIKE | SAM_ARG_F32_OR_LIKE)) ? &c->t[s->like] : NULL;
    if (c->cuda && (s->flags & SAM_ARG_HALF_GPU)) allowed &= SAM_DT_HALF;
    if (allowed == 0 || (allowed & SAM_DT(t->dtype))) return 0;
    char buf[160];
    sam_dtype_list(buf, sizeof buf, allowed);
    if (like != NULL && like->present)
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s (that of %s), got %s", t->name, buf, like->name,
                     sam_dtype_name(t->dtype));
    else
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s%s, got %s", t->name, buf,
                     c->cuda && (s->flags & SAM_ARG_HALF_GPU) ? " (on the GPU)" : "", sam_dtype_name(t->dtype));
    return -1;
}

static int check_ndim(sam_op_call *c, int i)
{
    const sam_arg_spec *s = &c->op->args[i];
    const sam_tensor *t = &c->t[i];
    const int ndim = (s->flags & SAM_ARG_ROWS) ? 2 : s->ndim;
    if (ndim < 0 || t->ndim == ndim) return 0;
    char got[160];
    format_dims(got, sizeof got, t->shape, t->ndim);
    PyErr_Format(PyExc_ValueError, "%s: expected a %d-d tensor, got %d-d with shape %s", t->name, ndim, t->ndim,
                 got);
    return -1;
}

/* The shape against the spec; binds the variables this tensor names first. */
static int check_shape(sam_op_call *c, int i)
{
    const sam_arg_spec *s = &c->op->args[i];
    const sam_tensor *t = &c->t[i];
    if (s->ndim < 0) return 0;
    int64_t want[SAM_MAX_NDIM];
    int ok = 1;
    for (int d = 0; d < t->ndim; d++) {
        const int code = s->shape[d];
        if (code >= 0) want[d] = code;
        else if (code == SAM_DIM_ANY) want[d] = t->shape[d];
        else want[d] = c->bound[SAM_VAR(0) - code] ? c->var[SAM_VAR(0) - code] : t->shape[d];
        ok &= want[d] == t->shape[d];
    }
    if (!ok) {
        char w[160], g[160];
        format_dims(w, sizeof w, want, t->ndim);
        format_dims(g, sizeof g, t->shape, t->ndim);
        PyErr_Format(PyExc_ValueError, "%s: expected shape %s, got %s", t->name, w, g);
        return -1;
    }
    for (int d = 0; d < t->ndim; d++)
        if (s->shape[d] <= SAM_VAR(0)) sam_op_bind(c, SAM_VAR(0) - s->shape[d], t->shape[d]);
    return 0;
}

static int check_layout(sam_op_call *c, int i)
{
    const sam_arg_spec *s = &c->op->args[i];
    const sam_tensor *t = &c->t[i];
    if ((s->flags & SAM_ARG_CONTIG) && sam_tensor_numel(t) != 0) { /* (empty: no element to misplace) */
        int64_t expect = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != expect) return layout_error(t, "a C-contiguous tensor");
            expect *= t->shape[d];
        }
    }
    if (s->flags & SAM_ARG_ROWS) {
        const int64_t rows = t->shape[0], cols = t->shape[1];
        /* (empty: no element to misplace; NumPy gives a [0, n] array zero strides) */
        const int empty = rows == 0 || cols == 0;
        if (!empty && ((cols > 1 && t->strides[1] != 1) || (rows > 1 && t->strides[0] < cols)))
            return layout_error(t, "rows of unit column stride that do not overlap");
        c->ld[i] = rows > 1 && cols > 0 ? t->strides[0] : cols; /* (no columns: no stride to honour) */
        if (c->cuda && s->gpu_ld > 1 && c->ld[i] % s->gpu_ld != 0) {
            PyErr_Format(PyExc_ValueError, "%s: expected a row stride that is a multiple of %d elements on the "
                         "GPU, got %lld (call .contiguous() first)", t->name, s->gpu_ld, (long long)c->ld[i]);
            return -1;
        }
    }
    if (c->cuda && s->gpu_align > 1 && (uintptr_t)t->data % (uintptr_t)s->gpu_align != 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected a %d-byte aligned address on the GPU, got %p (a fresh tensor "
                     "is: call .clone() first)", t->name,
                     s->gpu_align, (void *)t->data);
        return -1;
    }
    return 0;
}

static void byte_range(const sam_tensor *t, const char **lo, const char **hi)
{
    const int64_t es = (int64_t)sam_dtype_size(t->dtype);
    int64_t min_off = 0, max_off = 0; /* (bounded: dlpack_consumer.c checked the extent) */
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) { *lo = *hi = t->data; return; }
        const int64_t ext = (t->shape[i] - 1) * t->strides[i];
        if (ext < 0) min_off += ext; else max_off += ext;
    }
    *lo = t->data + min_off * es;
    *hi = t->data + (max_off + 1) * es;
}

static int check_no_overlap(const sam_tensor *out, const sam_tensor *other)
{
    if (!out->present || !other->present) return 0;
    const char *a0, *a1, *b0, *b1;
    byte_range(out, &a0, &a1);
    byte_range(other, &b0, &b1);
    if (a0 < b1 && b0 < a1) {
        PyErr_Format(PyExc_ValueError, "%s: expected an output that shares no memory with %s, got overlapping "
                     "memory", out->name, other->name);
        return -1;
    }
    return 0;
}

/* The packed idx: required with row selection; otherwise None or empty, then absent. */
static int check_packed_idx(sam_op_call *c, int i)
{
    sam_tensor *t = &c->t[i];
    if (c->selects_rows && !t->present) {
        PyErr_Format(PyExc_TypeError, "%s: expected a tensor (the format selects rows: n < m), got None", t->name);
        return -1;
    }
    if (!c->selects_rows && t->present) {
        if (sam_tensor_numel(t) != 0) {
            PyErr_Format(PyExc_ValueError, "%s: expected None or an empty tensor (plain 2:4 selects no rows), got "
                         "%lld entries", t->name, (long long)sam_tensor_numel(t));
            return -1;
        }
        t->present = 0; /* still released with the call */
    }
    return 0;
}

/* ---- sam_run_op ------------------------------------------------------------------------ */

void sam_op_bind(sam_op_call *c, int i, int64_t v)
{
    c->var[i] = v;
    c->bound[i] = 1;
}

void sam_op_bind_packed(sam_op_call *c, const sam_dims *d, int E, int RP, int CP2, int MR, int MC, int SL)
{
    sam_op_bind(c, E, d->E);
    sam_op_bind(c, RP, d->rp);
    sam_op_bind(c, CP2, d->cp / 2);
    sam_op_bind(c, MR, d->rp / 16);
    sam_op_bind(c, MC, d->cp / 32);
    sam_op_bind(c, SL, d->slices);
}

#if SAM_WITH_CUDA
static sam_status run_cuda(const sam_op_call *c, void *ctx)
{
    int prev = 0;
    sam_status status = sam_cuda_device_enter(c->device, &prev);
    if (status != SAM_STATUS_OK) return status;
    status = c->op->run(c, ctx, c->call.launch_stream);
    sam_cuda_device_exit(prev);
    return status;
}
#endif

PyObject *sam_run_op(const sam_op *op, PyObject *module, PyObject *const *objs, PyObject *stream, int selects_rows,
                     void *ctx)
{
    sam_op_call call, *c = &call;
    memset(c, 0, sizeof *c);
    c->op = op;
    c->st = (sam_module_state *)PyModule_GetState(module);
    c->call.st = c->st;
    c->selects_rows = selects_rows;
    const int n = op->n_args;
    PyObject *res = NULL;
    if (sam_arg_stream(stream, &c->call.stream) < 0) return NULL;
    for (int i = 0; i < n; i++) {
        const sam_arg_spec *s = &op->args[i];
        const int optional = (s->flags & (SAM_ARG_OPTIONAL | SAM_ARG_PACKED_IDX)) != 0;
        c->call.accept = accepted_dtypes(c, i);
        if (sam_tensor_take(&c->call, &c->t[i], objs[i], s->name, optional) < 0) {
            producer_error(s->name);
            goto error;
        }
        if ((s->flags & SAM_ARG_PACKED_IDX) && check_packed_idx(c, i) < 0) goto error;
    }
    if (check_device(c) < 0) goto error;
    for (int pass = 0; pass < 2; pass++) /* dtypes that another argument fixes come second */
        for (int i = 0; i < n; i++)
            if (c->t[i].present && ((op->args[i].flags & (SAM_ARG_LIKE | SAM_ARG_F32_OR_LIKE)) != 0) == pass &&
                check_dtype(c, i) < 0)
                goto error;
    for (int i = 0; i < n; i++)
        if (c->t[i].present && check_ndim(c, i) < 0) goto error;
    if (op->derive != NULL && op->derive(c, ctx) < 0) goto error;
    for (int i = 0; i < n; i++)
        if (c->t[i].present && check_shape(c, i) < 0) goto error;
    for (int i = 0; i < n; i++)
        if (c->t[i].present && check_layout(c, i) < 0) goto error;
    for (int i = 0; i < n; i++)
        if (c->t[i].present && (op->args[i].flags & SAM_ARG_OUT) && c->t[i].readonly) {
            PyErr_Format(PyExc_ValueError, "%s: expected a writable tensor (an output), got a read-only one",
                         c->t[i].name);
            goto error;
        }
    for (int i = 0; i < n; i++) {
        if (!(op->args[i].flags & SAM_ARG_OUT)) continue;
        for (int j = 0; j < n; j++) /* every pair once: outputs against all, earlier outputs first */
            if (j != i && !((op->args[j].flags & SAM_ARG_OUT) && j < i) &&
                check_no_overlap(&c->t[i], &c->t[j]) < 0)
                goto error;
    }
    if (op->check != NULL && op->check(c, ctx) < 0) goto error;

    sam_status status;
    if (c->cuda) {
#if SAM_WITH_CUDA
        Py_BEGIN_ALLOW_THREADS
        status = run_cuda(c, ctx);
        Py_END_ALLOW_THREADS
#else
        status = SAM_STATUS_UNSUPPORTED;
#endif
    } else {
        Py_BEGIN_ALLOW_THREADS
        status = op->run(c, ctx, NULL);
        Py_END_ALLOW_THREADS
    }
    if (status != SAM_STATUS_OK) {
#if SAM_WITH_CUDA
        const char *msg = c->cuda ? sam_cuda_last_error() : sam_ref_last_error();
#else
        const char *msg = sam_ref_last_error();
#endif
        sam_raise_status(c->st, status, op->name, msg);
        goto error;
    }
    res = Py_NewRef(Py_None);
error:
    sam_call_release(&c->call);
    return res;
}
