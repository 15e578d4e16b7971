/*
 * peak.h -- the C interface of the issue-rate and fill-rate probes (dev/peak/peak.cu):
 * measurement instruments, not part of the library.  dev/peak/peak.py builds peak.cu
 * with cuda/device.cu into a shared library (build/peak/) and loads it with ctypes.
 */
#ifndef SAMOYEDS_PEAK_H
#define SAMOYEDS_PEAK_H

#include "samoyeds_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- tensor-core issue rate (dev/peak/peak.cu) -------------------------------- */

/* One tensor-core instruction form, bf16 inputs and fp32 accumulation, as the
 * kernels issue it: the dense and 2:4-sparse warp MMAs (sm_80 on) and the
 * dense and sparse warpgroup MMAs with A from registers and B from shared
 * memory (sm_90a builds on sm_90 devices only). */
typedef enum sam_tc_kind {
    SAM_TC_MMA = 0,      /* mma.sync m16n8k16 */
    SAM_TC_MMA_SP = 1,   /* mma.sp::ordered_metadata.sync m16n8k32 */
    SAM_TC_WGMMA = 2,    /* wgmma.mma_async m64n128k16 */
    SAM_TC_WGMMA_SP = 3, /* wgmma.mma_async.sp m64n128k32 */
    /* The forms the warp-specialised kernels issue, A read from shared memory by
     * descriptor (64-byte swizzle) as TMA wrote it, and N = 64 from registers: */
    SAM_TC_WGMMA_SP_N64 = 4,    /* wgmma.mma_async.sp m64n64k32, A in registers */
    SAM_TC_WGMMA_SP_SS = 5,     /* m64n128k32, A in shared memory (2:4 tiles) */
    SAM_TC_WGMMA_SP_SS_N96 = 6, /* m64n96k32, A in shared memory (1:M:V 256 x 96) */
    SAM_TC_WGMMA_SP_SS_N64 = 7, /* m64n64k32, A in shared memory (1:M:V 256 x 64) */
    SAM_TC_KIND_COUNT = 8
} sam_tc_kind;
/* The kinds' names, in enum order (the Python API takes these). */
#define SAM_TC_KIND_NAMES \
    {"mma", "mma_sp", "wgmma", "wgmma_sp", "wgmma_sp_n64", "wgmma_sp_ss", "wgmma_sp_ss_n96", "wgmma_sp_ss_n64"}

/* *tflops = the rate at which `device` executes instructions of `kind` when
 * nothing but that instruction runs (operands in registers and shared memory,
 * every SM full, independent accumulators), in dense-equivalent TFLOP/s: a
 * sparse m16n8k32 counts 2*16*8*32 flop.  The ceiling of a kernel built on that
 * instruction.  Blocks the calling thread for under a tenth of a second on the
 * legacy default stream (so it waits for, and is not overlapped by, other
 * blocking-stream work); makes `device` current only while it runs.
 * SAM_STATUS_UNSUPPORTED for a kind the device or this build cannot run. */
sam_status sam_tc_rate_cuda(sam_tc_kind kind, int device, double *tflops);

/* ---- shared-memory fill rate (dev/peak/peak.cu) ------------------------------- */

/* One way of streaming operand tiles from L2 into shared memory, as the
 * warp-specialised matmul kernels stream them: stages of 128 rows x 128 bytes
 * (64 bf16 columns; one k-tile of token rows) in a ring per SM, each stage
 * completing on an mbarrier, a stage reused once its previous load landed.  The
 * source (16 MiB) stays in L2; nothing computes on the data. */
typedef enum sam_fill_kind {
    SAM_FILL_TMA = 0,      /* one 2-d TMA box per stage, 128-byte swizzle */
    SAM_FILL_CP_ASYNC = 1, /* 16-byte cp.async by 128 threads, rows in order */
    SAM_FILL_GATHER = 2,   /* the same with every row chosen by index (random) */
    SAM_FILL_TMA_GATHER = 3, /* stages of two parts: a TMA box and gathered rows, as the kernels' */
    SAM_FILL_TMA_MULTICAST = 4, /* clusters of two CTAs, each loading half of every box by TMA
                                   multicast into both: half the L2 reads for the same bytes landed */
    SAM_FILL_TMA_ROWS = 5, /* every row chosen by index, each its own one-row TMA box (128 threads,
                              one box each per stage): the gather without cp.async */
    SAM_FILL_KIND_COUNT = 6
} sam_fill_kind;
#define SAM_FILL_KIND_NAMES {"tma", "cp_async", "cp_async_gather", "tma_and_gather", "tma_multicast", "tma_rows"}

/* The rate at which `ctas` SMs of `device` (0: every SM) fill their shared
 * memory that way, one CTA per SM, `stages` stages in flight per SM (0: 128 KB of
 * them; at most 12 and 192 KB): out[0] TB/s over those SMs, out[1] bytes per
 * SM clock per SM (the SMs' own clock64 over the run), out[2] the SMs' mean clock
 * in MHz during the run, out[3] the CTAs that ran (SMs taking part), out[4] the
 * bytes in flight per CTA (its stages).  Bytes count as they land in shared memory
 * (multicast: in both CTAs; clusters of 2 need an even `ctas`, and with 0 leave one
 * SM of an odd count out).  Blocking, on the legacy default
 * stream, under a tenth of a second; `device` current only while it runs.
 * SAM_STATUS_UNSUPPORTED off sm_90 or without sm_90a code (mbarrier transaction
 * counts and TMA are Hopper's), and for TMA where the driver has no tensor-map
 * encoder. */
sam_status sam_fill_rate_cuda(sam_fill_kind kind, int device, int ctas, int stages, double out[5]);

#ifdef __cplusplus
}
#endif

#endif /* SAMOYEDS_PEAK_H */
