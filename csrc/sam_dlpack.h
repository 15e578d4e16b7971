/*
 * sam_dlpack.h -- the DLPack ABI (v1.x) as this extension consumes it, and the
 * extension's borrowed view of a tensor.
 *
 * The struct layouts below are the DLPack C ABI (dlpack.h, major version 1):
 * they must match it byte for byte.  Only what a consumer needs is declared.
 */
#ifndef SAM_DLPACK_H
#define SAM_DLPACK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../cuda/samoyeds_cuda.h"

/* ---- DLPack ABI ------------------------------------------------------------ */

#define SAM_DLPACK_MAJOR 1
#define SAM_DLPACK_MINOR 0

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };

#define SAM_DLPACK_FLAG_READ_ONLY (UINT64_C(1) << 0)

typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL = C-contiguous (before DLPack 1.2) */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* DLPack 1.3 C exchange API: a capsule named "dlpack_exchange_api" on the
 * producer's type, attribute __dlpack_c_exchange_api__. */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

/* ---- the extension's view of one tensor argument ----------------------------- */

#define SAM_MAX_NDIM 8

typedef struct sam_tensor {
    const char *name;            /* argument name, for messages */
    PyObject *obj;               /* the Python object (strong reference) */
    PyObject *capsule;           /* consumed capsule, or NULL (fast path) */
    DLManagedTensor *legacy;     /* owned managed tensor (legacy capsule) */
    DLManagedTensorVersioned *versioned; /* owned managed tensor (versioned) */
    char *data;                  /* first element (byte_offset applied) */
    sam_dtype dtype;
    int ndim;
    int64_t shape[SAM_MAX_NDIM];
    int64_t strides[SAM_MAX_NDIM]; /* in elements */
    int device_type;             /* kDLCPU or kDLCUDA (others rejected) */
    int device_id;
    int readonly;
    int present;                 /* 0 for an optional argument given as None */
} sam_tensor;

/* Stream to pass to producers and to launch on.  SAM_STREAM_AUTO: the
 * producer's current stream where it tells (DLPack exchange API), else the
 * legacy default stream. */
#define SAM_STREAM_AUTO INT64_MIN

struct sam_module_state;

typedef struct sam_call {
    struct sam_module_state *st; /* the calling module's state (exchange-API cache, fast_dlpack) */
    int64_t stream;              /* as given by the caller (SAM_STREAM_AUTO or a cudaStream_t) */
    int stream_resolved;         /* 1 once stream holds the launch stream */
    void *launch_stream;         /* the cudaStream_t to launch on */
    unsigned accept;             /* SAM_DT mask of the tensor being taken (0: every dtype samoyeds
                                    names), for the message about a dtype it has no name for */
    int n;                       /* tensors taken so far */
    sam_tensor *tensors[16];
} sam_call;

/* Takes obj (may be Py_None when optional) as tensor `name`.  Returns 0, or -1
 * with an exception set (TypeError, ValueError or BufferError naming `name`). */
int sam_tensor_take(sam_call *call, sam_tensor *t, PyObject *obj, const char *name, int optional);
/* Releases every tensor taken by the call: deleters run exactly once. */
void sam_call_release(sam_call *call);

/* Elements of t (its extent was checked when it was taken). */
int64_t sam_tensor_numel(const sam_tensor *t);
size_t sam_dtype_size(sam_dtype t);
const char *sam_dtype_name(sam_dtype t);
/* "float32, float16 or bfloat16": the dtypes of a SAM_DT mask, in enum order. */
void sam_dtype_list(char *buf, size_t n, unsigned mask);

#define SAM_DT(x) (1u << (x))
#define SAM_DT_FLOAT (SAM_DT(SAM_F32) | SAM_DT(SAM_F16) | SAM_DT(SAM_BF16))
#define SAM_DT_HALF (SAM_DT(SAM_F16) | SAM_DT(SAM_BF16))
#define SAM_DT_INDEX (SAM_DT(SAM_I32) | SAM_DT(SAM_I64))

#endif /* SAM_DLPACK_H */
