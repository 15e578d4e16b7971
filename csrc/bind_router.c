/*
 * bind_router.c -- router: an MoE router's logits, routing weights and top-k
 * expert ids in one call (csrc/router_ref.c, cuda/router.cu; the computation
 * is written out in cuda/samoyeds_cuda.h).
 */
#include "sam_args.h"
#include "sam_ref.h"

enum { V_T, V_H, V_E, V_K };
enum { A_W, A_X, A_BIAS, A_CHOICE, A_LOGITS, A_WEIGHTS, A_IDS, A_COUNT };

static const sam_arg_spec router_args[] = {
    [A_W] = {"w", 0, 2, {SAM_VAR(V_E), SAM_VAR(V_H)}, SAM_ARG_CONTIG | SAM_ARG_LIKE, A_X, 16, 0},
    [A_X] = {"x", SAM_DT_FLOAT, 2, {SAM_VAR(V_T), SAM_VAR(V_H)}, SAM_ARG_ROWS | SAM_ARG_HALF_GPU, -1, 16, 8},
    [A_BIAS] = {"bias", 0, 1, {SAM_VAR(V_E)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL | SAM_ARG_F32_OR_LIKE, A_X, 0, 0},
    [A_CHOICE] = {"choice_bias", 0, 1, {SAM_VAR(V_E)}, SAM_ARG_CONTIG | SAM_ARG_OPTIONAL | SAM_ARG_F32_OR_LIKE, A_X,
                  0, 0},
    [A_LOGITS] = {"logits", 0, 2, {SAM_VAR(V_T), SAM_VAR(V_E)}, SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_F32_OR_LIKE,
                  A_X, 0, 0},
    [A_WEIGHTS] = {"weights", 0, 2, {SAM_VAR(V_T), SAM_VAR(V_K)},
                   SAM_ARG_CONTIG | SAM_ARG_OUT | SAM_ARG_F32_OR_LIKE, A_X, 0, 0},
    [A_IDS] = {"ids", SAM_DT(SAM_I64), 2, {SAM_VAR(V_T), SAM_VAR(V_K)}, SAM_ARG_CONTIG | SAM_ARG_OUT, -1, 0, 0},
};

typedef struct router_ctx {
    sam_router_params p;
} router_ctx;

/* The experts, k and the groups against w's expert count. */
static int router_derive(sam_op_call *c, void *vctx)
{
    const sam_router_params *p = &((const router_ctx *)vctx)->p;
    const int64_t E = c->t[A_W].shape[0];
    if (E < 1 || E > SAM_ROUTER_MAX_EXPERTS) {
        PyErr_Format(PyExc_ValueError, "w: expected 1 to %d rows (experts), got %lld", SAM_ROUTER_MAX_EXPERTS,
                     (long long)E);
        return -1;
    }
    if (p->k < 1 || p->k > E || p->k > SAM_ROUTER_MAX_K) {
        PyErr_Format(PyExc_ValueError, "k: expected 1 <= k <= min(experts = %lld, %d), got %d", (long long)E,
                     SAM_ROUTER_MAX_K, p->k);
        return -1;
    }
    if (p->n_group < 1 || p->n_group > SAM_ROUTER_MAX_GROUPS || E % p->n_group != 0 || p->topk_group < 1 ||
        p->topk_group > p->n_group || (p->mode == SAM_ROUTER_TOPK_SOFTMAX && p->n_group != 1) ||
        (p->mode == SAM_ROUTER_SIGMOID_TOPK && p->n_group > 1 && E / p->n_group < 2)) {
        PyErr_Format(PyExc_ValueError, "n_group, topk_group: expected n_group <= %d dividing the %lld experts and "
                     "1 <= topk_group <= n_group (groups only with modes 0 and 2; mode 2: at least two experts "
                     "per group), got %d, %d", SAM_ROUTER_MAX_GROUPS, (long long)E, p->n_group, p->topk_group);
        return -1;
    }
    sam_op_bind(c, V_K, p->k);
    return sam_check_dense_weight(c, &c->t[A_W]);
}

static int router_check(sam_op_call *c, void *vctx)
{
    sam_router_params *p = &((router_ctx *)vctx)->p;
    const sam_tensor *t = c->t;
    SAM_SET_X(p, c, A_X);
    p->w = t[A_W].data;
    p->E = t[A_W].shape[0];
    p->H = t[A_W].shape[1];
    p->bias = t[A_BIAS].present ? t[A_BIAS].data : NULL;
    p->bias_dtype = t[A_BIAS].present ? t[A_BIAS].dtype : SAM_F32;
    p->choice_bias = t[A_CHOICE].present ? t[A_CHOICE].data : NULL;
    p->choice_bias_dtype = t[A_CHOICE].present ? t[A_CHOICE].dtype : SAM_F32;
    p->logits = t[A_LOGITS].data;
    p->logits_dtype = t[A_LOGITS].dtype;
    p->weights = t[A_WEIGHTS].data;
    p->weights_dtype = t[A_WEIGHTS].dtype;
    p->ids = (int64_t *)t[A_IDS].data;
    return 0;
}

SAM_OP_RUN_PARAMS(router_run, router_ctx, sam_router_ref, sam_router_cuda)

static const sam_op router_op = {"router", router_args, A_COUNT, router_derive, router_check, router_run};

/* router(logits, weights, ids, x, w, k, bias=None, mode=0, n_group=1, topk_group=1, renorm=False,
 *        scale=1.0, choice_bias=None, stream=None) */
PyObject *sam_py_router(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"logits", "weights", "ids", "x", "w", "k", "bias", "mode", "n_group", "topk_group",
                             "renorm", "scale", "choice_bias", "stream", NULL};
    PyObject *o[A_COUNT] = {NULL}, *o_stream = Py_None, *o_k, *o_mode = NULL, *o_ng = NULL, *o_tg = NULL;
    router_ctx x = {.p = {.n_group = 1, .topk_group = 1, .scale = 1.0f}};
    sam_router_params *p = &x.p;
    int mode = 0;
    o[A_BIAS] = o[A_CHOICE] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OOOOpfOO:router", kwlist, &o[A_LOGITS], &o[A_WEIGHTS],
                                     &o[A_IDS], &o[A_X], &o[A_W], &o_k, &o[A_BIAS], &o_mode, &o_ng, &o_tg,
                                     &p->renorm, &p->scale, &o[A_CHOICE], &o_stream))
        return NULL;
    /* (the ints are range-checked against the shapes later; here only what an int holds) */
    if (sam_arg_int(o_k, "k", INT32_MIN, INT32_MAX, "a 32-bit int", &p->k) < 0 ||
        (o_mode && sam_arg_int(o_mode, "mode", INT32_MIN, INT32_MAX, "0, 1 or 2", &mode) < 0) ||
        (o_ng && sam_arg_int(o_ng, "n_group", INT32_MIN, INT32_MAX, "a 32-bit int", &p->n_group) < 0) ||
        (o_tg && sam_arg_int(o_tg, "topk_group", INT32_MIN, INT32_MAX, "a 32-bit int", &p->topk_group) < 0))
        return NULL;
    if (o_mode)
        p->mode = (sam_router_mode)mode;
    if (sam_arg_range("mode", p->mode, SAM_ROUTER_SOFTMAX_TOPK, SAM_ROUTER_SIGMOID_TOPK,
                      "0 (softmax, then top-k), 1 (top-k, then softmax) or 2 (sigmoid, top-k by score + "
                      "choice_bias)") < 0)
        return NULL;
    if (o[A_CHOICE] != Py_None && p->mode != SAM_ROUTER_SIGMOID_TOPK) {
        PyErr_Format(PyExc_ValueError, "choice_bias: expected None with mode %d (only mode 2, sigmoid then top-k, "
                     "chooses by score + choice_bias), got a tensor", p->mode);
        return NULL;
    }
    return sam_run_op(&router_op, module, o, o_stream, 0, &x);
}
