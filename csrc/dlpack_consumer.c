/*
 * dlpack_consumer.c -- every tensor enters the extension here.
 *
 * A tensor argument is any object with __dlpack__ and __dlpack_device__
 * (torch, numpy, cupy, jax, ...).  Two ways in:
 *
 *  1. Fast path (DLPack 1.3 C exchange API): when the object's type carries
 *     __dlpack_c_exchange_api__, dltensor_from_py_object_no_sync fills a
 *     DLTensor view without allocating; the view lives as long as the object,
 *     which the call holds.  "No sync" means the kernels must run on the
 *     producer's current stream: SAM_STREAM_AUTO resolves to exactly that
 *     through the same table (current_work_stream).
 *  2. The protocol: __dlpack__(max_version=(1, 0), stream=S) (retried with
 *     fewer keywords for older producers).  S is the stream the kernels will
 *     run on (1 for the legacy default stream), so the producer orders its
 *     pending work before ours.  Both capsule kinds are accepted; a consumed
 *     capsule is renamed used_dltensor[_versioned] and its deleter is called
 *     exactly once, when the call releases its tensors.
 *
 * Read-only tensors (versioned flag READ_ONLY) are accepted as inputs and
 * refused as outputs.  Strides are in elements; NULL strides mean C order.
 */
#include "sam_dlpack.h"
#include "sam_module.h"
#include "sam_args.h"

#include <stdio.h>
#include <string.h>

size_t sam_dtype_size(sam_dtype t)
{
    switch (t) {
    case SAM_F32: case SAM_I32: case SAM_U32: return 4;
    case SAM_F16: case SAM_BF16: case SAM_U16: return 2;
    case SAM_U8: case SAM_BOOL: return 1;
    case SAM_I64: case SAM_F64: return 8;
    default: return 0;
    }
}

const char *sam_dtype_name(sam_dtype t)
{
    static const char *names[SAM_DTYPE_COUNT] = {
        "float32", "float16", "bfloat16", "uint8", "int32", "int64", "uint32", "uint16",
        "float64", "bool"};
    return (unsigned)t < SAM_DTYPE_COUNT ? names[t] : "?";
}

static int dtype_from_dl(DLDataType dt, sam_dtype *out)
{
    if (dt.lanes != 1) return -1;
    switch (dt.code) {
    case kDLFloat:
        if (dt.bits == 32) { *out = SAM_F32; return 0; }
        if (dt.bits == 16) { *out = SAM_F16; return 0; }
        if (dt.bits == 64) { *out = SAM_F64; return 0; }
        return -1;
    case kDLBfloat:
        if (dt.bits == 16) { *out = SAM_BF16; return 0; }
        return -1;
    case kDLUInt:
        if (dt.bits == 8) { *out = SAM_U8; return 0; }
        if (dt.bits == 16) { *out = SAM_U16; return 0; }
        if (dt.bits == 32) { *out = SAM_U32; return 0; }
        return -1;
    case kDLInt:
        if (dt.bits == 32) { *out = SAM_I32; return 0; }
        if (dt.bits == 64) { *out = SAM_I64; return 0; }
        return -1;
    case kDLBool:
        if (dt.bits == 8) { *out = SAM_BOOL; return 0; }
        return -1;
    default:
        return -1;
    }
}

/* ---- exchange-API lookup, cached per type -------------------------------------- */

static const DLPackExchangeAPI *exchange_api_for(sam_module_state *st, PyObject *obj)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (st == NULL || !st->fast_dlpack) return NULL;
    for (int i = 0; i < SAM_API_CACHE; i++)
        if (st->api_types[i] == (PyObject *)tp) return st->api_tables[i];

    const DLPackExchangeAPI *api = NULL;
    PyObject *cap = PyObject_GetAttrString((PyObject *)tp, "__dlpack_c_exchange_api__");
    if (cap == NULL) {
        PyErr_Clear();
    } else {
        if (PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
            const DLPackExchangeAPI *a = (const DLPackExchangeAPI *)PyCapsule_GetPointer(cap, "dlpack_exchange_api");
            if (a != NULL && a->header.version.major == SAM_DLPACK_MAJOR &&
                a->dltensor_from_py_object_no_sync != NULL)
                api = a;
        }
        Py_DECREF(cap);
    }
    /* Remember the answer (NULL too); the type is kept alive by the cache. */
    int slot = st->api_next;
    st->api_next = (st->api_next + 1) % SAM_API_CACHE;
    Py_XDECREF(st->api_types[slot]);
    Py_INCREF(tp);
    st->api_types[slot] = (PyObject *)tp;
    st->api_tables[slot] = api;
    return api;
}

/* ---- taking a tensor ---------------------------------------------------------------- */

void sam_dtype_list(char *buf, size_t n, unsigned mask)
{
    size_t len = 0;
    int count = 0, total = 0;
    buf[0] = 0;
    for (int d = 0; d < SAM_DTYPE_COUNT; d++) total += (mask >> d) & 1;
    for (int d = 0; d < SAM_DTYPE_COUNT && len < n; d++) {
        if (!(mask & SAM_DT(d))) continue;
        count++;
        const char *sep = count == 1 ? "" : (count == total ? " or " : ", ");
        len += (size_t)snprintf(buf + len, n - len, "%s%s", sep, sam_dtype_name((sam_dtype)d));
    }
}

/* A DLPack dtype samoyeds does not take: its torch and numpy name where both agree on one
 * (int8, int16, uint64, complex64, ...), else the DLPack triple. */
static void dl_dtype_name(char *buf, size_t n, DLDataType dt)
{
    if (dt.lanes == 1 && (dt.code == kDLInt || dt.code == kDLUInt) && (dt.bits == 8 || dt.bits == 16 ||
                                                                      dt.bits == 32 || dt.bits == 64))
        snprintf(buf, n, "%s%d", dt.code == kDLInt ? "int" : "uint", (int)dt.bits);
    else if (dt.lanes == 1 && dt.code == 5 /* kDLComplex */ && (dt.bits == 64 || dt.bits == 128))
        snprintf(buf, n, "complex%d", (int)dt.bits);
    else
        snprintf(buf, n, "DLPack code %d, %d bits, %d lanes", (int)dt.code, (int)dt.bits, (int)dt.lanes);
}

static int fill_from_dltensor(sam_tensor *t, const DLTensor *dl, unsigned accept)
{
    if (dl->ndim < 0 || dl->ndim > SAM_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: expected at most %d dimensions, got %d",
                     t->name, SAM_MAX_NDIM, (int)dl->ndim);
        return -1;
    }
    if (dtype_from_dl(dl->dtype, &t->dtype) != 0) {
        char want[160], got[80];
        sam_dtype_list(want, sizeof want, accept ? accept : SAM_DT(SAM_DTYPE_COUNT) - 1u);
        dl_dtype_name(got, sizeof got, dl->dtype);
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got an unsupported one (%s)", t->name, want, got);
        return -1;
    }
    t->ndim = dl->ndim;
    if (dl->ndim > 0 && (dl->shape == NULL)) {
        PyErr_Format(PyExc_BufferError, "%s: producer reported no shape", t->name);
        return -1;
    }
    for (int i = 0; i < dl->ndim; i++) {
        t->shape[i] = dl->shape[i];
        if (t->shape[i] < 0) {
            PyErr_Format(PyExc_BufferError, "%s: producer reported a negative extent", t->name);
            return -1;
        }
    }
    /* Every size and byte offset derived from this tensor later (element count,
     * C-order strides, the byte range for aliasing) stays below 2**63: checked once
     * here, so a producer's shape cannot make them wrap. */
    int64_t numel = 1, expect = 1, span = 0, bytes;
    int empty = 0;
    for (int i = 0; i < dl->ndim; i++) empty |= t->shape[i] == 0;
    for (int i = dl->ndim - 1; i >= 0; i--) {
        t->strides[i] = dl->strides ? dl->strides[i] : expect;
        if (!empty) {
            const int64_t st = t->strides[i] < 0 ? -t->strides[i] : t->strides[i];
            int64_t ext;
            if (t->strides[i] == INT64_MIN || sam_size_mul(numel, t->shape[i], &numel) < 0 ||
                sam_size_mul(t->shape[i] - 1, st, &ext) < 0 || sam_size_add(span, ext, &span) < 0)
                goto too_large;
        }
        if (dl->strides == NULL && sam_size_mul(expect, t->shape[i], &expect) < 0) expect = 0; /* empty */
    }
    if (!empty && (sam_size_add(span, 1, &span) < 0 || sam_size_mul(span, (int64_t)sam_dtype_size(t->dtype),
                                                                     &bytes) < 0))
        goto too_large;
    t->data = (char *)dl->data + dl->byte_offset;
    switch (dl->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
        t->device_type = kDLCPU;
        t->device_id = 0;
        break;
    case kDLCUDA:
    case kDLCUDAManaged:
        t->device_type = kDLCUDA;
        t->device_id = dl->device.device_id;
        break;
    default:
        PyErr_Format(PyExc_ValueError, "%s: expected a tensor on the CPU or a CUDA device, got DLPack "
                     "device type %d", t->name, (int)dl->device.device_type);
        return -1;
    }
    return 0;
too_large:
    PyErr_Format(PyExc_ValueError, "%s: expected a tensor of fewer than 2**63 bytes, got shape and strides that "
                 "span more", t->name);
    return -1;
}

static int query_device(PyObject *obj, const char *name, int *dev_type, int *dev_id)
{
    PyObject *res = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (res == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a tensor supporting DLPack (__dlpack__ and "
                         "__dlpack_device__), got %.100s", name, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    int ok = PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 2;
    if (ok) {
        *dev_type = (int)PyLong_AsLong(PyTuple_GET_ITEM(res, 0));
        *dev_id = (int)PyLong_AsLong(PyTuple_GET_ITEM(res, 1));
        ok = !PyErr_Occurred();
    }
    Py_DECREF(res);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_BufferError, "%s: __dlpack_device__ did not return (type, id)", name);
        return -1;
    }
    return 0;
}

/* The stream the kernels of this call run on (set once per call). */
static int resolve_stream(sam_call *call, const DLPackExchangeAPI *api, int dev_type, int dev_id)
{
    if (call->stream_resolved) return 0;
    call->stream_resolved = 1;
    call->launch_stream = NULL;
    if (call->stream != SAM_STREAM_AUTO) {
        call->launch_stream = (void *)(intptr_t)call->stream;
        return 0;
    }
    if (api != NULL && api->current_work_stream != NULL) {
        void *s = NULL;
        if (api->current_work_stream(dev_type, dev_id, &s) == 0) {
            call->launch_stream = s;
        } else {
            PyErr_Clear();
        }
    }
    return 0;
}

static PyObject *call_dlpack(PyObject *obj, int cuda, int64_t stream_arg)
{
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (meth == NULL) return NULL;
    PyObject *empty = PyTuple_New(0);
    PyObject *res = NULL;
    for (int attempt = 0; attempt < 3 && res == NULL; attempt++) {
        PyObject *kw = PyDict_New();
        if (kw == NULL || empty == NULL) { Py_XDECREF(kw); break; }
        int bad = 0;
        if (attempt == 0) {
            PyObject *v = Py_BuildValue("(ii)", SAM_DLPACK_MAJOR, SAM_DLPACK_MINOR);
            bad |= v == NULL || PyDict_SetItemString(kw, "max_version", v) < 0;
            Py_XDECREF(v);
        }
        if (cuda && attempt < 2) {
            PyObject *s = PyLong_FromLongLong(stream_arg);
            bad |= s == NULL || PyDict_SetItemString(kw, "stream", s) < 0;
            Py_XDECREF(s);
        }
        if (!bad) res = PyObject_Call(meth, empty, kw);
        Py_DECREF(kw);
        if (res == NULL && attempt < 2 && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear(); /* an older producer: fewer keywords */
            continue;
        }
        break;
    }
    Py_XDECREF(empty);
    Py_DECREF(meth);
    return res;
}

int sam_tensor_take(sam_call *call, sam_tensor *t, PyObject *obj, const char *name, int optional)
{
    memset(t, 0, sizeof(*t));
    t->name = name;
    if (obj == NULL || obj == Py_None) {
        if (optional) return 0;
        PyErr_Format(PyExc_TypeError, "%s: expected a tensor supporting DLPack (__dlpack__ and "
                     "__dlpack_device__), got NoneType", name);
        return -1;
    }
    if (call->n >= (int)(sizeof(call->tensors) / sizeof(call->tensors[0]))) {
        PyErr_SetString(PyExc_RuntimeError, "samoyeds: too many tensor arguments");
        return -1;
    }
    /* Fast path: the producer's C exchange API gives a borrowed view, device
     * included, without any Python call (the protocol below costs two per tensor,
     * which at decode sizes is more host time than the kernels). */
    const DLPackExchangeAPI *api = exchange_api_for(call->st, obj);
    if (api != NULL) {
        DLTensor view;
        memset(&view, 0, sizeof(view));
        if (api->dltensor_from_py_object_no_sync((void *)obj, &view) == 0) {
            Py_INCREF(obj);
            t->obj = obj;
            t->present = 1;
            call->tensors[call->n++] = t; /* from here on, sam_call_release cleans up */
            const int vt = (int)view.device.device_type;
            if (vt == kDLCUDA || vt == kDLCUDAManaged) resolve_stream(call, api, vt, (int)view.device.device_id);
            return fill_from_dltensor(t, &view, call->accept);
        }
        PyErr_Clear(); /* fall back to the protocol, which explains any refusal */
    }

    int dev_type = 0, dev_id = 0;
    if (query_device(obj, name, &dev_type, &dev_id) < 0) return -1;

    Py_INCREF(obj);
    t->obj = obj;
    t->present = 1;
    call->tensors[call->n++] = t; /* from here on, sam_call_release cleans up */

    int is_cuda = dev_type == kDLCUDA || dev_type == kDLCUDAManaged;
    if (is_cuda) resolve_stream(call, api, dev_type, dev_id);

    int64_t stream_arg = (int64_t)(intptr_t)call->launch_stream;
    if (stream_arg == 0) stream_arg = 1; /* DLPack's name for the legacy default stream */
    PyObject *cap = call_dlpack(obj, is_cuda, stream_arg);
    if (cap == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) { /* __dlpack_device__ without __dlpack__ */
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a tensor supporting DLPack (__dlpack__ and "
                         "__dlpack_device__), got %.100s", name, Py_TYPE(obj)->tp_name);
            return -1;
        }
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject *msg = value ? PyObject_Str(value) : NULL;
            PyErr_Format(PyExc_BufferError, "%s: the producer refused DLPack export: %s", name,
                         msg ? PyUnicode_AsUTF8(msg) : "?");
            Py_XDECREF(msg);
            Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
        }
        return -1;
    }
    t->capsule = cap;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *mt = (DLManagedTensorVersioned *)PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (PyCapsule_SetName(cap, "used_dltensor_versioned") < 0) return -1;
        t->versioned = mt;
        if (mt->version.major != SAM_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is not supported (expected 1.x)",
                         name, mt->version.major, mt->version.minor);
            return -1;
        }
        t->readonly = (mt->flags & SAM_DLPACK_FLAG_READ_ONLY) != 0;
        return fill_from_dltensor(t, &mt->dl_tensor, call->accept);
    }
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
        if (PyCapsule_SetName(cap, "used_dltensor") < 0) return -1;
        t->legacy = mt;
        return fill_from_dltensor(t, &mt->dl_tensor, call->accept);
    }
    PyErr_Format(PyExc_BufferError, "%s: __dlpack__ returned %.100s, not a DLPack capsule",
                 name, Py_TYPE(cap)->tp_name);
    return -1;
}

void sam_call_release(sam_call *call)
{
    /* Deleters and the last references may run Python code, which must not
     * see (or clobber) the exception a failing op is about to raise. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int i = call->n - 1; i >= 0; i--) {
        sam_tensor *t = call->tensors[i];
        if (t->versioned != NULL && t->versioned->deleter != NULL) t->versioned->deleter(t->versioned);
        if (t->legacy != NULL && t->legacy->deleter != NULL) t->legacy->deleter(t->legacy);
        t->versioned = NULL;
        t->legacy = NULL;
        Py_CLEAR(t->capsule);
        Py_CLEAR(t->obj);
    }
    call->n = 0;
    PyErr_Restore(type, value, tb);
}

int64_t sam_tensor_numel(const sam_tensor *t)
{
    for (int i = 0; i < t->ndim; i++) /* an empty tensor's other extents may multiply past int64 */
        if (t->shape[i] == 0) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}
