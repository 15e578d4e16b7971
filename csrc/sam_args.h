/*
 * sam_args.h -- the one checking layer of samoyeds._C: every op is a table of
 * tensor specs and three functions (derive, check, run), and sam_run_op
 * (csrc/args.c) does the rest.
 *
 * A binding (csrc/bind_*.c) parses its Python arguments into a C struct
 * (scalars checked with the sam_arg_* helpers below), then calls
 *
 *     sam_run_op(&op, module, tensors, stream, selects_rows, &ctx)
 *
 * which takes every tensor through DLPack and checks, in this order, so that
 * a caller always hears about the first thing to fix:
 *
 *   1. presence (None for a required tensor: TypeError), one device for all
 *   2. dtypes (TypeError): specs without `like` first, then those that take
 *      another argument's dtype
 *   3. dimensions (ValueError), then op->derive: the sizes that follow from
 *      the scalars and from shapes (packed dims, workspace layout), with
 *      checked arithmetic
 *   4. shapes against the size variables (the first tensor naming a variable
 *      binds it), then layout (C-contiguous or rows of unit column stride, GPU
 *      alignment), then writability of outputs, then aliasing of outputs
 *   5. op->check: what a table cannot say (values of small index arrays, ...)
 *   6. op->run: the C reference (all tensors on the CPU) or the CUDA launcher,
 *      with the GIL released; a failed status becomes an exception
 *
 * Every message has one form: "<argument>: expected <what>, got <what>", the
 * argument named once (the op is not repeated: the traceback names it).
 * Everything taken is released at one place, whatever failed.
 */
#ifndef SAM_ARGS_H
#define SAM_ARGS_H

#include "sam_module.h"

#ifndef SAM_WITH_CUDA
#define SAM_WITH_CUDA 0
#endif

#define SAM_OP_MAX_ARGS 16
#define SAM_OP_MAX_VARS 24

/* A spec's dimension: a size >= 0, SAM_DIM_ANY, or size variable i. */
#define SAM_DIM_ANY (-1)
#define SAM_VAR(i) (-2 - (i))

enum {
    SAM_ARG_OPTIONAL = 1 << 0,  /* None accepted (the tensor is then absent) */
    SAM_ARG_OUT = 1 << 1,       /* written: writable, sharing memory with no other argument */
    SAM_ARG_CONTIG = 1 << 2,    /* C-contiguous */
    SAM_ARG_ROWS = 1 << 3,      /* 2-d, unit column stride, rows that do not overlap (row stride in ld[]) */
    SAM_ARG_HALF_GPU = 1 << 4,  /* on the GPU only the float16 / bfloat16 of the accepted dtypes */
    SAM_ARG_LIKE = 1 << 5,      /* dtype that of argument `like` */
    SAM_ARG_F32_OR_LIKE = 1 << 6, /* dtype float32 or that of argument `like` */
    SAM_ARG_PACKED_IDX = 1 << 7 /* the idx of a packed weight: required when the call's format selects
                                   rows, else None or empty (and then absent) */
};

typedef struct sam_arg_spec {
    const char *name;
    unsigned dtypes;          /* SAM_DT mask (0: any; unused with LIKE) */
    int ndim;                 /* -1: any */
    int shape[4];             /* per dimension (ndim <= 4 when given) */
    int flags;
    int like;                 /* LIKE / F32_OR_LIKE: index of that argument in the table */
    int gpu_align;            /* on the GPU: byte alignment of the first element (0: none) */
    int gpu_ld;               /* ROWS on the GPU: the row stride is a multiple of this (0: none) */
} sam_arg_spec;

typedef struct sam_op_call sam_op_call;

typedef struct sam_op {
    const char *name;                 /* for kernel-status messages ("ssmm: ...") */
    const sam_arg_spec *args;
    int n_args;
    /* After the dtype and ndim checks: fix derived size variables (sam_op_bind)
     * and anything computed from the shapes; -1 with an exception set. */
    int (*derive)(sam_op_call *c, void *ctx);
    /* After every table check; -1 with an exception set.  May be NULL. */
    int (*check)(sam_op_call *c, void *ctx);
    /* The C reference or the CUDA launcher (SAM_DISPATCH), without the GIL and,
     * on the GPU, with the tensors' device current; a sam_status. */
    sam_status (*run)(const sam_op_call *c, void *ctx, void *stream);
} sam_op;

/* The value of ref_call for tensors on the CPU, of cuda_call for tensors on a CUDA
 * device (CUDA builds; elsewhere cuda_call is not compiled: such calls never run). */
#if SAM_WITH_CUDA
#define SAM_DISPATCH(c, stream, ref_call, cuda_call) ((void)(stream), (c)->cuda ? (cuda_call) : (ref_call))
#else
#define SAM_DISPATCH(c, stream, ref_call, cuda_call) ((void)(c), (void)(stream), (ref_call))
#endif

/* Defines `static sam_status fn(c, ctx, stream)`, the op->run of an op whose context
 * (ctx_type) holds the launchers' params in member p: ref(&p) or cuda(&p, stream). */
#define SAM_OP_RUN_PARAMS(fn, ctx_type, ref, cuda)                                  \
    static sam_status fn(const sam_op_call *c, void *vctx, void *stream)          \
    {                                                                             \
        const ctx_type *x_ = vctx;                                                \
        return SAM_DISPATCH(c, stream, ref(&x_->p), cuda(&x_->p, stream));        \
    }

/* The activations of a launcher's params, x[T][ldx] of dtype, from table entry i
 * (a SAM_ARG_ROWS tensor): the convention of every params struct in samoyeds_cuda.h. */
#define SAM_SET_X(p, c, i)                     \
    do {                                       \
        (p)->x = (c)->t[i].data;               \
        (p)->T = (c)->t[i].shape[0];           \
        (p)->ldx = (c)->ld[i];                 \
        (p)->dtype = (c)->t[i].dtype;          \
    } while (0)

struct sam_op_call {
    const sam_op *op;
    sam_module_state *st;
    sam_call call;                    /* the DLPack intake (dlpack_consumer.c) */
    sam_tensor t[SAM_OP_MAX_ARGS];    /* in table order */
    int64_t ld[SAM_OP_MAX_ARGS];      /* ROWS: the row stride in elements */
    int64_t var[SAM_OP_MAX_VARS];
    unsigned char bound[SAM_OP_MAX_VARS];
    int selects_rows;                 /* the call's packed format selects rows (PACKED_IDX) */
    int cuda;                         /* 1: every tensor on one CUDA device */
    int device;
};

/* The three arrays of a packed weight (cuda/samoyeds_layout.h), named
 * <prefix>values / meta / idx, over size variables E, RP (storage rows), CP2
 * (padded columns / 2), MR (RP / 16), MC (padded columns / 32), SL (slices).
 * The values take `vflags` and `like` besides `flags`. */
#define SAM_PACKED_SPECS(prefix, vflags, like, flags, E, RP, CP2, MR, MC, SL)                              \
    {prefix "values", SAM_DT_FLOAT, 3, {SAM_VAR(E), SAM_VAR(RP), SAM_VAR(CP2)},                           \
     SAM_ARG_CONTIG | (vflags) | (flags), like, 16, 0},                                                   \
    {prefix "meta", SAM_DT(SAM_U32), 4, {SAM_VAR(E), SAM_VAR(MR), SAM_VAR(MC), 16}, SAM_ARG_CONTIG | (flags), \
     -1, 16, 0},                                                                                          \
    {prefix "idx", SAM_DT(SAM_U8), 3, {SAM_VAR(E), SAM_VAR(SL), SAM_VAR(RP)},                              \
     SAM_ARG_CONTIG | SAM_ARG_PACKED_IDX | (flags), -1, 16, 0}

/* Binds the packed size variables (as SAM_PACKED_SPECS names them) from d. */
void sam_op_bind_packed(sam_op_call *c, const sam_dims *d, int E, int RP, int CP2, int MR, int MC, int SL);

/* Binds size variable i to v (op->derive). */
void sam_op_bind(sam_op_call *c, int i, int64_t v);
/* Runs op for the module's call: the checks and the run; objs in table order
 * (NULL or Py_None for an absent optional tensor); selects_rows: the call's packed
 * format selects rows (SAM_ARG_PACKED_IDX).  Returns None, or NULL with an
 * exception set. */
PyObject *sam_run_op(const sam_op *op, PyObject *module, PyObject *const *objs, PyObject *stream, int selects_rows,
                     void *ctx);

/* ---- scalar arguments (before any tensor is taken) ---------------------------- */

/* The stream argument: None (SAM_STREAM_AUTO) or an int (a cudaStream_t); TypeError. */
int sam_arg_stream(PyObject *o, int64_t *out);
/* The format (n, m, v) with glu; ValueError naming n, m or v. */
int sam_arg_format(int n, int m, int v, int glu, sam_format *f);
/* An int argument in [lo, hi] (within int), from a Python object: TypeError for a non-int,
 * ValueError naming it for one out of range, even past int64 (PyArg's "i" would raise
 * OverflowError, not a documented type). */
int sam_arg_int(PyObject *o, const char *name, long long lo, long long hi, const char *expect, int *out);
/* impl as sam_impl (0 auto, 1 mma.sp, 2 wgmma.sp, 3 decode); ValueError naming impl. */
int sam_arg_impl(int impl, sam_impl *out);
/* lo <= value <= hi, else ValueError "<name>: expected <expect>, got <value>". */
int sam_arg_range(const char *name, long long value, long long lo, long long hi, const char *expect);
/* Dims of a packed weight [E, R, C] in format f; ValueError naming `rows_name`
 * (a row count that breaks the format) or `cols_name`. */
int sam_arg_dims(sam_format f, int64_t E, int64_t R, int64_t C, const char *rows_name, const char *cols_name,
                 sam_dims *d);

/* A dense weight [R, C] (dense_decode's w, the router's): sizes bounded for the
 * kernels' index arithmetic; on the GPU whole 16-byte pieces of rows (bind_dense.c). */
int sam_check_dense_weight(const sam_op_call *c, const sam_tensor *w);

/* ---- checked size arithmetic ----------------------------------------------------- */

/* *out = a * b (a + b); 0, or -1 when the result leaves [0, INT64_MAX] or an
 * operand is negative (nothing is raised: the caller names the argument). */
int sam_size_mul(int64_t a, int64_t b, int64_t *out);
int sam_size_add(int64_t a, int64_t b, int64_t *out);
/* Rounds n up to a multiple of a (a > 0), checked as above. */
int sam_size_round_up(int64_t n, int64_t a, int64_t *out);

#endif /* SAM_ARGS_H */
