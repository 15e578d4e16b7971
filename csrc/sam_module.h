/*
 * sam_module.h -- state of the samoyeds._C module and the bindings it registers.
 *
 * Every binding finds the state through its module argument (multi-phase init:
 * two copies of the module, e.g. one made by importlib, keep two states; there
 * is no process-wide pointer to one of them).
 */
#ifndef SAM_MODULE_H
#define SAM_MODULE_H

#include "sam_dlpack.h"

#define SAM_API_CACHE 8

typedef struct sam_module_state {
    PyObject *cuda_error;                 /* samoyeds.CudaError (a RuntimeError) */
    int fast_dlpack;                      /* use __dlpack_c_exchange_api__ when offered */
    PyObject *api_types[SAM_API_CACHE];   /* types whose exchange API was looked up */
    const DLPackExchangeAPI *api_tables[SAM_API_CACHE];
    int api_next;
    sam_ssmm_config cfg;                  /* copied into every sam_ssmm_params (set_config) */
    int pdl;                              /* programmatic dependent launch (set_config) */
} sam_module_state;

/* Raises samoyeds.CudaError of st (or ValueError / NotImplementedError by
 * status) for a failed launcher; `op` names the operation.  Returns NULL. */
PyObject *sam_raise_status(const sam_module_state *st, int status, const char *op, const char *message);

/* The bindings (METH_VARARGS | METH_KEYWORDS), by file. */
PyObject *sam_py_format_mask(PyObject *module, PyObject *args, PyObject *kw);    /* bind_format.c */
PyObject *sam_py_format_pack(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_format_unpack(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_format_gather(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_format_transpose_values(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_ssmm(PyObject *module, PyObject *args, PyObject *kw);           /* bind_ssmm.c */
PyObject *sam_py_ssmm_dw(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_ssmm_dx(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_dense_decode(PyObject *module, PyObject *args, PyObject *kw);   /* bind_dense.c */
PyObject *sam_py_glu(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_glu_backward(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_router(PyObject *module, PyObject *args, PyObject *kw);         /* bind_router.c */
PyObject *sam_py_moe_route(PyObject *module, PyObject *args, PyObject *kw);      /* bind_moe.c */
PyObject *sam_py_moe_gather_weights(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_combine(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_zero_unrouted(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_forward(PyObject *module, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_workspace_bytes(PyObject *module, PyObject *args, PyObject *kw);

#endif /* SAM_MODULE_H */
