/*
 * module.c -- samoyeds._C: module definition (multi-phase init, module state),
 * error mapping, build/device information and the ssmm configuration.
 *
 * The ops are bindings over one checking layer (csrc/args.c): bind_format.c,
 * bind_ssmm.c, bind_moe.c, bind_router.c, bind_dense.c.  Every binding reaches
 * the module state through its module argument; nothing here is process-wide
 * but the CUDA runtime's own state (and PDL, which sam_cuda_set_pdl sets).
 */
#include "sam_module.h"
#include "sam_args.h"
#include "sam_ref.h"

#include <string.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#ifndef SAM_WITH_CUDA
#define SAM_WITH_CUDA 0
#endif
#ifndef SAM_VERSION
#define SAM_VERSION "0.0.0"
#endif

PyObject *sam_raise_status(const sam_module_state *st, int status, const char *op, const char *message)
{
    const char *msg = message && message[0] ? message : "unknown error";
    /* messages of the kernels' layer may already name the op ("ssmm: ..."): name it once */
    const size_t n = strlen(op);
    if (strncmp(msg, op, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ') msg += n + 2;
    switch (status) {
    case SAM_STATUS_INVALID_ARGUMENT:
    case SAM_STATUS_BAD_DATA:
        PyErr_Format(PyExc_ValueError, "%s: %s", op, msg);
        break;
    case SAM_STATUS_UNSUPPORTED:
        PyErr_Format(PyExc_NotImplementedError, "%s: %s", op, msg);
        break;
    default:
        PyErr_Format(st != NULL && st->cuda_error != NULL ? st->cuda_error : PyExc_RuntimeError,
                     "%s: %s", op, msg);
        break;
    }
    return NULL;
}

static PyObject *py_cuda_device_count(PyObject *self, PyObject *unused)
{
    (void)self; (void)unused;
#if SAM_WITH_CUDA
    return PyLong_FromLong(sam_cuda_device_count());
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *py_cuda_device_capability(PyObject *self, PyObject *arg)
{
    long dev = PyLong_AsLong(arg);
    if (dev == -1 && PyErr_Occurred()) return NULL;
#if SAM_WITH_CUDA
    int cc = sam_cuda_device_cc((int)dev);
    if (cc < 0)
        return sam_raise_status(PyModule_GetState(self), SAM_STATUS_CUDA_ERROR, "device_capability",
                                sam_cuda_last_error());
    return Py_BuildValue("(ii)", cc / 10, cc % 10);
#else
    (void)self;
    PyErr_SetString(PyExc_RuntimeError, "samoyeds was built without CUDA");
    return NULL;
#endif
}

static PyObject *py_build_info(PyObject *self, PyObject *unused)
{
    (void)self; (void)unused;
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    PyObject *archs = NULL;
#if SAM_WITH_CUDA
    archs = PyUnicode_FromString(sam_cuda_archs());
    PyObject *rt = PyLong_FromLong(sam_cuda_runtime_version());
#else
    archs = PyUnicode_FromString("");
    PyObject *rt = Py_NewRef(Py_None);
#endif
    PyObject *vals[] = {
        PyUnicode_FromString(SAM_VERSION), PyBool_FromLong(SAM_WITH_CUDA), archs, rt,
        PyLong_FromLong(SAM_LAYOUT_VERSION), PyUnicode_FromFormat("%d.%d", SAM_DLPACK_MAJOR, SAM_DLPACK_MINOR),
        PyLong_FromUnsignedLong((unsigned long)NPY_API_VERSION),
    };
    const char *keys[] = {"version", "cuda_compiled", "cuda_archs", "cuda_runtime_version",
                          "layout_version", "dlpack_max_version", "numpy_c_api_version"};
    int ok = 1;
    for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++) {
        if (vals[i] == NULL || PyDict_SetItemString(d, keys[i], vals[i]) < 0) ok = 0;
        Py_XDECREF(vals[i]);
    }
    if (!ok) { Py_DECREF(d); return NULL; }
    return d;
}

static PyObject *py_set_fast_dlpack(PyObject *self, PyObject *arg)
{
    sam_module_state *st = (sam_module_state *)PyModule_GetState(self);
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    int old = st->fast_dlpack;
    st->fast_dlpack = on;
    return PyBool_FromLong(old);
}

/* tensor_info(t, stream=None) -> dict: what the DLPack consumer sees of t. */
static PyObject *py_tensor_info(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"t", "stream", NULL};
    PyObject *o_t, *o_stream = Py_None, *res = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:tensor_info", kwlist, &o_t, &o_stream)) return NULL;
    sam_call call;
    memset(&call, 0, sizeof call);
    call.st = (sam_module_state *)PyModule_GetState(self);
    if (sam_arg_stream(o_stream, &call.stream) < 0) return NULL;
    sam_tensor t;
    PyObject *shape = NULL, *strides = NULL;
    if (sam_tensor_take(&call, &t, o_t, "t", 0) < 0) goto error;
    shape = PyTuple_New(t.ndim);
    strides = PyTuple_New(t.ndim);
    if (shape == NULL || strides == NULL) goto error;
    for (int i = 0; i < t.ndim; i++) {
        PyObject *a = PyLong_FromLongLong(t.shape[i]), *b = PyLong_FromLongLong(t.strides[i]);
        PyTuple_SET_ITEM(shape, i, a);
        PyTuple_SET_ITEM(strides, i, b);
        if (a == NULL || b == NULL) goto error;
    }
    const char *path = t.versioned ? "versioned" : (t.legacy ? "legacy" : "exchange_api");
    res = Py_BuildValue("{s:s,s:O,s:O,s:s,s:i,s:i,s:K,s:s,s:K}", "dtype", sam_dtype_name(t.dtype), "shape", shape,
                        "strides", strides, "device", t.device_type == kDLCUDA ? "cuda" : "cpu", "device_id",
                        t.device_id, "readonly", t.readonly, "data_ptr", (unsigned long long)(uintptr_t)t.data,
                        "path", path, "stream", (unsigned long long)(uintptr_t)call.launch_stream);
error:
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    sam_call_release(&call);
    return res;
}

/* set_config(decode_max_rows, decode_rows_per_expert, tile, token_rows, pdl, split_k=0, x_copy=0): stores
 * the ssmm selection's tunables in the module state (every ssmm and moe_forward copies them
 * into its params) and turns programmatic dependent launch on or off process-wide. */
static PyObject *py_set_config(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"decode_max_rows", "decode_rows_per_expert", "tile", "token_rows", "pdl", "split_k",
                             "x_copy", NULL};
    int max_rows, per_expert, tile, token_rows, pdl, split_k = 0, x_copy = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiip|ii:set_config", kwlist, &max_rows, &per_expert, &tile,
                                     &token_rows, &pdl, &split_k, &x_copy))
        return NULL;
    if (max_rows < -1 || per_expert < -1) {
        PyErr_Format(PyExc_ValueError, "decode_max_rows, decode_rows_per_expert: expected -1 (the kernel's default "
                     "rule) or a count >= 0, got %d, %d", max_rows, per_expert);
        return NULL;
    }
    if (sam_arg_range("tile", tile, SAM_TILE_AUTO, SAM_TILE_256X96,
                      "0 (auto), 1 (128x128), 2 (256x64) or 3 (256x96)") < 0 ||
        sam_arg_range("token_rows", token_rows, SAM_TOKEN_ROWS_AUTO, SAM_TOKEN_ROWS_TMA,
                      "0 (auto), 1 (gather) or 2 (tma)") < 0 ||
        sam_arg_range("x_copy", x_copy, SAM_X_COPY_AUTO, SAM_X_COPY_ALWAYS, "0 (auto), 1 (never) or 2 (always)") < 0)
        return NULL;
    if (split_k < 0) {
        PyErr_Format(PyExc_ValueError, "split_k: expected 0 (auto), 1 (off) or a count of splits, got %d", split_k);
        return NULL;
    }
    sam_module_state *st = (sam_module_state *)PyModule_GetState(self);
    st->cfg.decode_max_rows = max_rows;
    st->cfg.decode_rows_per_expert = per_expert;
    st->cfg.tile = (sam_tile)tile;
    st->cfg.token_rows = (sam_token_rows)token_rows;
    st->cfg.split_k = split_k;
    st->cfg.x_copy = (sam_x_copy)x_copy;
    st->pdl = pdl;
#if SAM_WITH_CUDA
    sam_cuda_set_pdl(pdl);
#endif
    Py_RETURN_NONE;
}

static PyObject *py_get_config(PyObject *self, PyObject *unused)
{
    (void)unused;
    const sam_module_state *st = (const sam_module_state *)PyModule_GetState(self);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:O,s:i,s:i}", "decode_max_rows", st->cfg.decode_max_rows,
                         "decode_rows_per_expert", st->cfg.decode_rows_per_expert, "tile", (int)st->cfg.tile,
                         "token_rows", (int)st->cfg.token_rows, "pdl", st->pdl ? Py_True : Py_False,
                         "split_k", st->cfg.split_k, "x_copy", (int)st->cfg.x_copy);
}

/* ssmm_split_k(units, unit_tiles, items, sms, split_k) -> int: the wgmma.sp kernel's K
 * splits for these sizes (sam_ssmm_split_k, cuda/samoyeds_cuda.h); for the rule's tests. */
static PyObject *py_ssmm_split_k(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"units", "unit_tiles", "items", "sms", "split_k", NULL};
    long long units, items;
    int unit_tiles, sms, split_k;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LiLii:ssmm_split_k", kwlist, &units, &unit_tiles, &items, &sms,
                                     &split_k))
        return NULL;
    if (units < 1 || unit_tiles < 1 || items < 0 || sms < 0 || split_k < 0) {
        PyErr_Format(PyExc_ValueError, "ssmm_split_k: expected units >= 1, unit_tiles >= 1 and items, sms, split_k "
                     ">= 0, got %lld, %d, %lld, %d, %d", units, unit_tiles, items, sms, split_k);
        return NULL;
    }
    return PyLong_FromLong(sam_ssmm_split_k(units, unit_tiles, items, sms, split_k));
}

/* A NumPy array holding the 2:4 positions of a metadata array: out[..., j]
 * for the j-th nibble (little end first).  For docs and debugging; CPU only. */
static PyObject *py_decode_meta(PyObject *self, PyObject *arg)
{
    (void)self;
    /* aligned: the words are read as uint32_t (numpy copies an unaligned array) */
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(arg, NPY_UINT32, 0, 0,
                                                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (a == NULL) return NULL;
    int nd = PyArray_NDIM(a);
    if (nd > NPY_MAXDIMS - 2) { /* the result has two more dimensions */
        PyErr_Format(PyExc_ValueError, "meta: expected at most %d dimensions, got %d", NPY_MAXDIMS - 2, nd);
        Py_DECREF(a);
        return NULL;
    }
    npy_intp dims[NPY_MAXDIMS];
    for (int i = 0; i < nd; i++) dims[i] = PyArray_DIM(a, i);
    dims[nd] = 8;
    dims[nd + 1] = 2;
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(nd + 2, dims, NPY_UINT8);
    if (out == NULL) { Py_DECREF(a); return NULL; }
    const uint32_t *src = (const uint32_t *)PyArray_DATA(a);
    uint8_t *dst = (uint8_t *)PyArray_DATA(out);
    npy_intp n = PyArray_SIZE(a);
    for (npy_intp i = 0; i < n; i++)
        for (int j = 0; j < 8; j++) {
            dst[i * 16 + 2 * j] = (uint8_t)((src[i] >> (4 * j)) & 3u);
            dst[i * 16 + 2 * j + 1] = (uint8_t)((src[i] >> (4 * j + 2)) & 3u);
        }
    Py_DECREF(a);
    return (PyObject *)out;
}

static PyMethodDef sam_methods[] = {
    {"format_mask", (PyCFunction)(void (*)(void))sam_py_format_mask, METH_VARARGS | METH_KEYWORDS,
     "format_mask(mask, w, scores, n, m, v, stream=None): best mask of the format into mask."},
    {"format_pack", (PyCFunction)(void (*)(void))sam_py_format_pack, METH_VARARGS | METH_KEYWORDS,
     "format_pack(values, meta, idx, w, mask, n, m, v, glu, stream=None)."},
    {"format_unpack", (PyCFunction)(void (*)(void))sam_py_format_unpack, METH_VARARGS | METH_KEYWORDS,
     "format_unpack(out, values, meta, idx, n, m, v, glu, stream=None)."},
    {"format_gather", (PyCFunction)(void (*)(void))sam_py_format_gather, METH_VARARGS | METH_KEYWORDS,
     "format_gather(out, values, src, stream=None): out[i] = values.flat[src[i]], 0 where src[i] is outside "
     "values."},
    {"format_transpose_values", (PyCFunction)(void (*)(void))sam_py_format_transpose_values,
     METH_VARARGS | METH_KEYWORDS,
     "format_transpose_values(out, tmeta, values, meta, idx, n, m, v, glu, rows, cols, stream=None): out = the "
     "values of W^T's 2:4 packing under its metadata tmeta, from the packed W of logical shape [E, rows, cols]."},
    {"ssmm", (PyCFunction)(void (*)(void))sam_py_ssmm, METH_VARARGS | METH_KEYWORDS,
     "ssmm(out, x, values, meta, idx, offsets, token_ids, rows, cols, n, m, v, glu, act=0, "
     "bias=None, scale=None, alpha=1.702, limit=7.0, impl=0, stream=None)."},
    {"ssmm_dw", (PyCFunction)(void (*)(void))sam_py_ssmm_dw, METH_VARARGS | METH_KEYWORDS,
     "ssmm_dw(out, dy, x, meta, idx, offsets, token_ids, rows, cols, n, m, v, glu, scale=None, stream=None, "
     "impl=0, dy_token_ids=None, dy_t=None): the gradient of an ssmm with respect to the packed values, in their layout."},
    {"ssmm_dx", (PyCFunction)(void (*)(void))sam_py_ssmm_dx, METH_VARARGS | METH_KEYWORDS,
     "ssmm_dx(out, dy, values, meta, idx, offsets, token_ids, rows, cols, n, m, v, glu, scale=None, stream=None): "
     "the gradient of an ssmm with respect to its input, from the forward's packing (no transposed copy)."},
    {"dense_decode", (PyCFunction)(void (*)(void))sam_py_dense_decode, METH_VARARGS | METH_KEYWORDS,
     "dense_decode(out, x, w, up=None, act=0, alpha=1.702, limit=7.0, weights_ready=False, stream=None)."},
    {"glu", (PyCFunction)(void (*)(void))sam_py_glu, METH_VARARGS | METH_KEYWORDS,
     "glu(out, gate, up, act=1, alpha=1.702, limit=7.0, stream=None): out = act(gate, up) elementwise."},
    {"glu_backward", (PyCFunction)(void (*)(void))sam_py_glu_backward, METH_VARARGS | METH_KEYWORDS,
     "glu_backward(out, dh, preact, scale=None, offsets=None, act=1, alpha=1.702, limit=7.0, stream=None, hdot=None, "
     "out_t=None): "
     "out = (d gate, d up) of act(gate, up) = preact's halves from dh (times scale), rows past offsets[E] 0."},
    {"router", (PyCFunction)(void (*)(void))sam_py_router, METH_VARARGS | METH_KEYWORDS,
     "router(logits, weights, ids, x, w, k, bias=None, mode=0, n_group=1, topk_group=1, renorm=False, scale=1.0, "
     "choice_bias=None, stream=None): router logits, weights and top-k expert ids."},
    {"moe_route", (PyCFunction)(void (*)(void))sam_py_moe_route, METH_VARARGS | METH_KEYWORDS,
     "moe_route(offsets, token_ids, perm, pos, top_k_index, stream=None)."},
    {"moe_gather_weights", (PyCFunction)(void (*)(void))sam_py_moe_gather_weights,
     METH_VARARGS | METH_KEYWORDS, "moe_gather_weights(out, w, perm, offsets, stream=None)."},
    {"moe_combine", (PyCFunction)(void (*)(void))sam_py_moe_combine, METH_VARARGS | METH_KEYWORDS,
     "moe_combine(out, y, pos, stream=None)."},
    {"moe_zero_unrouted", (PyCFunction)(void (*)(void))sam_py_moe_zero_unrouted, METH_VARARGS | METH_KEYWORDS,
     "moe_zero_unrouted(out, offsets, stream=None): rows of out from offsets[E] on set to zero."},
    {"moe_forward", (PyCFunction)(void (*)(void))sam_py_moe_forward, METH_VARARGS | METH_KEYWORDS,
     "moe_forward(out, workspace, x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx, "
     "down_values, down_meta, down_idx, intermediate, n, m, v, act=1, gate_up_bias=None, down_bias=None, "
     "alpha=1.702, limit=7.0, impl=0, stream=None): route, gate_up, down and combine in one call."},
    {"moe_workspace_bytes", (PyCFunction)(void (*)(void))sam_py_moe_workspace_bytes, METH_VARARGS | METH_KEYWORDS,
     "moe_workspace_bytes(T, K, E, H, I, itemsize) -> int: the workspace moe_forward needs."},
    {"tensor_info", (PyCFunction)(void (*)(void))py_tensor_info, METH_VARARGS | METH_KEYWORDS,
     "tensor_info(t, stream=None) -> dict: what the DLPack consumer sees of t."},
    {"build_info", py_build_info, METH_NOARGS, "build_info() -> dict."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, "Number of usable CUDA devices (0 without)."},
    {"cuda_device_capability", py_cuda_device_capability, METH_O, "(major, minor) of a device."},
    {"set_config", (PyCFunction)(void (*)(void))py_set_config, METH_VARARGS | METH_KEYWORDS,
     "set_config(decode_max_rows, decode_rows_per_expert, tile, token_rows, pdl, split_k=0, x_copy=0): the ssmm selection's "
     "tunables (-1: the kernel's default rule; tile and token_rows as the sam_tile / sam_token_rows enums; split_k "
     "0 auto, 1 off, n splits) and "
     "programmatic dependent launch, for every later call."},
    {"get_config", py_get_config, METH_NOARGS, "get_config() -> dict: what set_config stored."},
    {"ssmm_split_k", (PyCFunction)(void (*)(void))py_ssmm_split_k, METH_VARARGS | METH_KEYWORDS,
     "ssmm_split_k(units, unit_tiles, items, sms, split_k) -> int: the wgmma.sp kernel's K splits."},
    {"set_fast_dlpack", py_set_fast_dlpack, METH_O,
     "Enable/disable the DLPack C exchange-API fast path; returns the old setting."},
    {"decode_meta", py_decode_meta, METH_O, "decode_meta(meta) -> uint8 ndarray [..., 8, 2] of positions."},
    {NULL, NULL, 0, NULL}};

static int sam_exec(PyObject *m)
{
    if (_import_array() < 0) return -1;
    sam_module_state *st = (sam_module_state *)PyModule_GetState(m);
    st->cuda_error = PyErr_NewExceptionWithDoc(
        "samoyeds.CudaError", "A CUDA runtime error raised by a samoyeds kernel launch.",
        PyExc_RuntimeError, NULL);
    if (st->cuda_error == NULL) return -1;
    if (PyModule_AddObjectRef(m, "CudaError", st->cuda_error) < 0) return -1;
    st->fast_dlpack = 1;
    if (PyModule_AddIntConstant(m, "LAYOUT_VERSION", SAM_LAYOUT_VERSION) < 0) return -1;
    if (PyModule_AddIntConstant(m, "ROW_ALIGN", SAM_ROW_ALIGN) < 0) return -1;
    if (PyModule_AddIntConstant(m, "COL_ALIGN", SAM_COL_ALIGN) < 0) return -1;
    if (PyModule_AddIntConstant(m, "GLU_CHUNK", SAM_GLU_CHUNK) < 0) return -1;
    if (PyModule_AddIntConstant(m, "MAX_M", SAM_MAX_M) < 0) return -1;
    if (PyModule_AddIntConstant(m, "WITH_CUDA", SAM_WITH_CUDA) < 0) return -1;
    st->cfg = sam_ssmm_config_default();
    st->pdl = 1;
    if (PyModule_AddStringConstant(m, "__version__", SAM_VERSION) < 0) return -1;
    return 0;
}

static int sam_traverse(PyObject *m, visitproc visit, void *arg)
{
    sam_module_state *st = (sam_module_state *)PyModule_GetState(m);
    Py_VISIT(st->cuda_error);
    for (int i = 0; i < SAM_API_CACHE; i++) Py_VISIT(st->api_types[i]);
    return 0;
}

static int sam_clear(PyObject *m)
{
    sam_module_state *st = (sam_module_state *)PyModule_GetState(m);
    Py_CLEAR(st->cuda_error);
    for (int i = 0; i < SAM_API_CACHE; i++) {
        Py_CLEAR(st->api_types[i]);
        st->api_tables[i] = NULL;
    }
    return 0;
}

static void sam_free(void *m) { sam_clear((PyObject *)m); }

static PyModuleDef_Slot sam_slots[] = {
    {Py_mod_exec, (void *)sam_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* one CUDA context and one type cache per process */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL}};

static struct PyModuleDef sam_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "samoyeds._C",
    .m_doc = "samoyeds C extension: DLPack intake, the Samoyeds format and ops (C reference and CUDA).",
    .m_size = sizeof(sam_module_state),
    .m_methods = sam_methods,
    .m_slots = sam_slots,
    .m_traverse = sam_traverse,
    .m_clear = sam_clear,
    .m_free = sam_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&sam_module); }
