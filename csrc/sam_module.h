/*
 * sam_module.h -- state of the samoyeds._C module and the helpers its ops share.
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

/* The state of the (single) loaded module; NULL before it is initialised. */
sam_module_state *sam_state(void);

/* Raises samoyeds.CudaError (or ValueError/NotImplementedError by status) for a
 * failed launcher; `op` names the operation.  Always returns NULL. */
PyObject *sam_raise_status(int status, const char *op, const char *message);

/* Op entry points (csrc/ops.c). */
PyObject *sam_py_format_mask(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_format_pack(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_format_unpack(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_ssmm(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_dense_decode(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_router(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_glu(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_route(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_gather_weights(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_combine(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_forward(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_moe_workspace_bytes(PyObject *self, PyObject *args, PyObject *kw);
PyObject *sam_py_tensor_info(PyObject *self, PyObject *args, PyObject *kw);

#endif /* SAM_MODULE_H */
