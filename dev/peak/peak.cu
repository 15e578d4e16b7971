// peak.cu -- the issue rate of one tensor-core instruction form (the ceiling the
// matmul kernels are measured against, taken on the same device in the same run) and
// the rate at which SMs fill their shared memory from L2.  A measurement instrument,
// not in the wheel: dev/peak/peak.py builds it with cuda/device.cu (peak.h is its C
// interface).
//
// A cuBLAS matmul rate mixes the instruction's rate with a tile schedule, data
// movement and clocks under that load; the number here has only the instruction.
// Every kernel keeps its operands in registers (and, for wgmma, one B tile in
// shared memory written once), so the loop is nothing but tensor-core
// instructions on independent accumulators, enough of them in flight that the
// tensor pipe, not the instruction latency, sets the pace:
//   mma, mma_sp      256-thread CTAs, as many per SM as fit (the occupancy
//                    query's count times the SM count: one full wave); each warp
//                    cycles over CHAINS accumulator tiles, so CHAINS MMAs are
//                    independent and a sub-partition holds several such warps.
//   wgmma, wgmma_sp  one CTA of two warpgroups per SM (128 accumulator registers
//                    per thread leave no room for a second); each warpgroup issues
//                    WG_BATCH m64n128 MMAs per commit group, alternating between
//                    two accumulators and over the B tile's k slices, and keeps
//                    two groups in flight (wait_group 1), as a matmul main loop
//                    does.  A comes from registers, B through a 128-byte-swizzle
//                    descriptor.
//   wgmma_sp_n64 .. wgmma_sp_ss_n64  the wgmma.sp forms the warp-specialised
//                    kernels issue, N = 64 / 96 / 128 and A from registers or
//                    from shared memory (64-byte swizzle), as wgmma_sp otherwise.
// Operands are pseudo-random bf16 in [-1, 1): the tensor cores' power, and so the
// clock they hold, depends on the data, and a matmul's data is not zeros.  The
// accumulators are written out only under a flag the host never sets, which the
// compiler cannot know.
//
// The host calibrates a launch to TARGET_MS, runs one untimed launch of that
// length (clocks settle), then times TIMED launches with CUDA events and reports
// the median.  Sparse instructions count as their dense-equivalent shape, the
// way a sparse kernel's dense-equivalent TFLOP/s is counted.
#include <string.h>

#include <vector>

#include "common.cuh"
#include "peak.h"
#include "peak_ptx.cuh"
#include "ptx_mma.cuh"
#include "tma.cuh"

namespace sam {
namespace {

constexpr int MMA_THREADS = 256;
constexpr int CHAINS = 8;              // independent accumulator tiles per warp
constexpr int WG_THREADS = 256;        // two warpgroups
constexpr int WG_BATCH = 4;            // wgmmas per commit group
constexpr int B_TILE_BYTES = 128 * 128;  // 128 rows (n) x 128 bytes (k) of bf16, 128-byte swizzle
constexpr uint32_t SP_META = 0x44444444u;  // every 4-group keeps elements 0 and 1: valid 2:4 metadata
constexpr float TARGET_MS = 10.0f;
constexpr int CALIB_STEPS = 256;
constexpr int TIMED = 5;

const char *const KIND_NAMES[] = SAM_TC_KIND_NAMES;

__device__ __forceinline__ uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// Two bf16 in [-1, 1) from one hash.
__device__ __forceinline__ uint32_t rand_bf16x2(uint32_t seed) {
    const uint32_t h = mix(seed);
    const float lo = (float)(int)(h & 0xffffu) * (1.0f / 32768.0f) - 1.0f;
    const float hi = (float)(int)(h >> 16) * (1.0f / 32768.0f) - 1.0f;
    return Elem<__nv_bfloat16>::pack2(lo, hi);
}

// D[64 x 128] = A(64 x 16, registers) * B(16 x 128, shared memory, K-major) +
// (scale_d ? D : 0), bf16 inputs, fp32 accumulate.  Issued by a whole warpgroup;
// the dense counterpart of WgmmaSp (common.cuh).
#ifdef SAM_HAS_WGMMA
__device__ __forceinline__ void wgmma_bf16_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc,
                                                      int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
#endif

// `steps` rounds of CHAINS independent warp MMAs per warp.  Code compiled for
// an architecture before sm_80 sets *missing instead of running.
template <bool SPARSE>
__global__ void __launch_bounds__(MMA_THREADS) mma_rate_kernel(int steps, int keep, float *sink, int *missing) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const uint32_t seed = (blockIdx.x * MMA_THREADS + threadIdx.x) * 16u;
    uint32_t a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        a[i] = rand_bf16x2(seed + i);
        b[i] = rand_bf16x2(seed + 4 + i);
    }
    float acc[CHAINS][4];
#pragma unroll
    for (int c = 0; c < CHAINS; c++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[c][i] = 0.0f;
#pragma unroll 2
    for (int s = 0; s < steps; s++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            if constexpr (SPARSE) MmaSp<__nv_bfloat16>::run(acc[c], a, b, SP_META);
            else Mma16816<__nv_bfloat16>::run(acc[c], a[0], a[1], a[2], a[3], b[0], b[1]);
        }
    }
    if (keep) {
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < CHAINS; c++)
#pragma unroll
            for (int i = 0; i < 4; i++) sum += acc[c][i];
        sink[blockIdx.x * MMA_THREADS + threadIdx.x] = sum;
    }
#else
    (void)steps; (void)keep; (void)sink;
    if (blockIdx.x == 0 && threadIdx.x == 0) *missing = 1;
#endif
}

// `steps` commit groups of WG_BATCH warpgroup MMAs of form KIND (a sam_tc_kind from
// SAM_TC_WGMMA on) per warpgroup.  SAM_TC_WGMMA, SAM_TC_WGMMA_SP: m64n128 with A from
// registers, each warpgroup alternating between two accumulators and over the B tile's k
// slices.  The forms the warp-specialised kernels issue (SAM_TC_WGMMA_SP_N64 ..._SS_N64):
// wgmma.sp m64nNk32 with A from registers or, as those kernels read it, from shared memory
// through a 64-byte-swizzle descriptor; the two accumulators stand for a tile's two m64
// blocks, each reading its own A rows and the same k slice of B, so a step moves the
// operand bytes a 256-row tile's consumer moves.  Code compiled for anything but sm_90a
// sets *missing instead of running (a trap would leave the context unusable).
constexpr int A_TILE_BYTES = 64 * 64;  // 64 rows x 16 packed values x two k32 steps, 64-byte swizzle
constexpr int WG_SMEM = B_TILE_BYTES + 2 * A_TILE_BYTES + 1024;  // + room to align the tiles

template <int KIND>
__global__ void __launch_bounds__(WG_THREADS, 1) wgmma_rate_kernel(int steps, int keep, float *sink, int *missing) {
#ifdef SAM_HAS_WGMMA
    constexpr bool A_SHARED = KIND >= SAM_TC_WGMMA_SP_SS;
    constexpr int N = KIND == SAM_TC_WGMMA_SP_N64 || KIND == SAM_TC_WGMMA_SP_SS_N64 ? 64
                      : KIND == SAM_TC_WGMMA_SP_SS_N96                             ? 96
                                                                                  : 128;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // 128-byte-swizzle atoms are 1024 bytes: the tiles start on one (smem_desc_sw128)
    unsigned char *tile = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    uint32_t *words = reinterpret_cast<uint32_t *>(tile);
    for (int i = threadIdx.x; i < (B_TILE_BYTES + 2 * A_TILE_BYTES) / 4; i += WG_THREADS)
        words[i] = rand_bf16x2(0x9e3779b9u + i);
    fence_proxy_async();  // written through the generic proxy, read by wgmma through the async one
    __syncthreads();

    const uint32_t sb = smem_u32(tile), sa = sb + B_TILE_BYTES;
    const uint32_t seed = (blockIdx.x * WG_THREADS + threadIdx.x) * 8u;
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = rand_bf16x2(seed + i);
    float acc[2][N / 2];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int i = 0; i < N / 2; i++) acc[j][i] = 0.0f;

    for (int s = 0; s < steps; s++) {
        fence_regs(acc[0]);
        fence_regs(acc[1]);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < WG_BATCH; j++) {
            // k slices of the 128-byte rows: 4 of k16 (32 bytes), 2 of k32 (64 bytes)
            if constexpr (KIND == SAM_TC_WGMMA) {
                wgmma_bf16_m64n128k16(acc[j & 1], a, smem_desc_sw128(sb + (j & 3) * 32), 1);
            } else if constexpr (KIND == SAM_TC_WGMMA_SP) {
                WgmmaSp<__nv_bfloat16>::run(acc[j & 1], a, smem_desc_sw128(sb + (j & 1) * 64), SP_META, 1);
            } else {
                const int blk = j & 1, ks = (j >> 1) & 1;  // block (A rows), k32 step
                const uint64_t bdesc = smem_desc_sw128(sb + ks * 64);
                if constexpr (A_SHARED)
                    WgmmaSpSS<__nv_bfloat16, N>::run(acc[blk], smem_desc_sw64(sa + blk * A_TILE_BYTES + ks * 32),
                                                     bdesc, SP_META, 1);
                else
                    WgmmaSpRS<__nv_bfloat16, N>::run(acc[blk], a, bdesc, SP_META, 1);
            }
        }
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    if (keep) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < N / 2; i++) sum += acc[0][i] + acc[1][i];
        sink[blockIdx.x * WG_THREADS + threadIdx.x] = sum;
    }
#else
    (void)steps; (void)keep; (void)sink;
    if (blockIdx.x == 0 && threadIdx.x == 0) *missing = 1;
#endif
}

// ---------------- shared-memory fill rate ----------------
constexpr int FILL_THREADS = 128;
constexpr int FILL_ROWS = 128, FILL_ROW_BYTES = 128;  // a part: 128 rows x 64 bf16 columns
constexpr int FILL_PART_BYTES = FILL_ROWS * FILL_ROW_BYTES;
constexpr int FILL_MAX_STAGES = 12;
constexpr int FILL_RING_BYTES = 196608;                      // what the ring may take of shared memory
constexpr int FILL_SRC_ROWS = 4096, FILL_SRC_COLS = 2048;    // 16 MiB of bf16: stays in L2

// Bytes of one stage: one part, or for SAM_FILL_TMA_GATHER a box and a gathered part.
__host__ __device__ constexpr int fill_stage_bytes(int kind) {
    return kind == SAM_FILL_TMA_GATHER ? 2 * FILL_PART_BYTES : FILL_PART_BYTES;
}

// Whether a kind loads through a tensor map (boxes of rows, or one-row boxes)
__host__ __device__ constexpr bool fill_uses_map(int kind) {
    return kind == SAM_FILL_TMA || kind == SAM_FILL_TMA_GATHER || kind == SAM_FILL_TMA_MULTICAST ||
           kind == SAM_FILL_TMA_ROWS;
}

// The source row that position r of CTA b's work item `item` reads where rows are chosen
// by index: spread over the source by a hash, the same for every kind that gathers
__device__ __forceinline__ uint32_t fill_random_row(int item, int r) {
    return mix(blockIdx.x * 0x9e3779b9u + (uint32_t)item * 0x85ebca6bu + (uint32_t)r) % FILL_SRC_ROWS;
}

#ifdef SAM_HAS_WGMMA
__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
#endif

// `steps` stages through a ring of `stages`; clk[2 b] / clk[2 b + 1]: CTA b's SM clocks
// and nanoseconds from the first issue to the last stage landed.
template <int KIND>
__global__ void __launch_bounds__(FILL_THREADS, 1)
    fill_rate_kernel(const __grid_constant__ CUtensorMap map, const __nv_bfloat16 *src, int steps, int stages,
                     long long *clk, int *missing) {
#ifdef SAM_HAS_WGMMA
    constexpr bool MC = KIND == SAM_FILL_TMA_MULTICAST;  // clusters of 2, each CTA half of every box
    constexpr bool BOX = KIND == SAM_FILL_TMA || KIND == SAM_FILL_TMA_GATHER || MC;
    constexpr bool ROWS = KIND == SAM_FILL_CP_ASYNC || KIND == SAM_FILL_GATHER || KIND == SAM_FILL_TMA_GATHER;
    constexpr bool TROWS = KIND == SAM_FILL_TMA_ROWS;  // thread r: row r of every stage, a one-row box
    constexpr int SB = fill_stage_bytes(KIND);
    constexpr int FILL_KT = FILL_SRC_COLS * 2 / FILL_ROW_BYTES;  // stages per item (its rows fixed)
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[FILL_MAX_STAGES];
    __shared__ __align__(8) uint64_t empty[MC ? FILL_MAX_STAGES : 1];  // multicast: both CTAs' stage landed
    const uint32_t ring = smem_u32(smem_raw) + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const int tid = threadIdx.x;
    if (tid == 0) {
        // arrivals: the box thread's expect_tx, each copying thread's cp.async arrival
        for (int s = 0; s < stages; s++) {
            mbar_init(smem_u32(&bars[s]), (BOX || TROWS ? 1 : 0) + (ROWS ? FILL_THREADS : 0));
            if (MC) mbar_init(smem_u32(&empty[s]), 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (MC) cluster_sync();  // the peer's barriers exist before any multicast or remote arrival
    else __syncthreads();
    const uint32_t rank = MC ? cluster_rank() : 0;
    if (!ROWS && !TROWS && tid != 0) {  // one thread issues the boxes
        if (MC) cluster_sync();  // no CTA leaves while its peer may still write into it
        return;
    }
    const long long c0 = clock64();
    const uint64_t t0 = global_ns();
    const int row = tid >> 3, ch = tid & 7;  // rows row + 16 j, 16-byte piece ch: a warp reads 4 whole rows
    const __nv_bfloat16 *rp[FILL_ROWS / 16];
    int trow = 0;  // TROWS: this thread's source row
    const long long b = MC ? blockIdx.x / 2 : blockIdx.x, nb = MC ? gridDim.x / 2 : gridDim.x;  // (clusters)
    for (int i = 0, s = 0, ph = 0; i < steps; i++) {
        const int kt = i % FILL_KT, item = i / FILL_KT;
        const uint32_t bar = smem_u32(&bars[s]), dst = ring + s * SB;
        const int row0 = (int)((b + (long long)item * nb) * FILL_ROWS % FILL_SRC_ROWS);
        if (i >= stages) mbar_wait(bar, ph ^ 1);  // the stage's previous load has landed
        if (MC && i >= stages) {  // ... in the peer too, before this CTA's half lands there again
            const uint32_t eb = smem_u32(&empty[s]);
            mbar_arrive(eb);
            mbar_arrive_cluster(eb, rank ^ 1u);
            mbar_wait(eb, ph ^ 1);
        }
        if (BOX && tid == 0) {
            mbar_arrive_expect_tx(bar, FILL_PART_BYTES);
            if constexpr (MC)  // rows row0 + 64 rank .. + 63 into both CTAs' stage
                tma_load_2d_mc(dst + rank * (FILL_PART_BYTES / 2), &map, kt * (FILL_ROW_BYTES / 2),
                               row0 + (int)rank * (FILL_ROWS / 2), bar, (uint16_t)3);
            else
                tma_load_2d(dst, &map, kt * (FILL_ROW_BYTES / 2), row0, bar);
        }
        if constexpr (TROWS) {
            // one 128-byte row box into row tid of the stage: the 128-byte swizzle follows the
            // destination's address, so the row lands as it would in a 128-row box
            if (kt == 0) trow = (int)fill_random_row(item, tid);
            if (tid == 0) mbar_arrive_expect_tx(bar, FILL_PART_BYTES);
            tma_load_2d(dst + tid * FILL_ROW_BYTES, &map, kt * (FILL_ROW_BYTES / 2), trow, bar);
        }
        if constexpr (ROWS) {
            const uint32_t part = dst + (BOX ? FILL_PART_BYTES : 0);
            if (kt == 0) {
#pragma unroll
                for (int j = 0; j < FILL_ROWS / 16; j++) {
                    const int r = row + 16 * j;
                    const uint32_t t = KIND == SAM_FILL_CP_ASYNC ? (uint32_t)(row0 + r) : fill_random_row(item, r);
                    rp[j] = src + (int64_t)t * FILL_SRC_COLS + ch * 8;
                }
            }
#pragma unroll
            for (int j = 0; j < FILL_ROWS / 16; j++) {
                const int r = row + 16 * j;
                cp_async16(part + r * FILL_ROW_BYTES + ((ch ^ (r & 7)) << 4), rp[j] + kt * (FILL_ROW_BYTES / 2), true);
            }
            cp_async_mbar_arrive(bar);
        }
        if (++s == stages) {
            s = 0;
            ph ^= 1;
        }
    }
    for (int i = steps > stages ? steps - stages : 0; i < steps; i++)
        mbar_wait(smem_u32(&bars[i % stages]), (i / stages) & 1);
    if (tid == 0) {
        clk[2 * blockIdx.x] = clock64() - c0;
        clk[2 * blockIdx.x + 1] = (long long)(global_ns() - t0);
    }
    if constexpr (MC) cluster_sync();
#else
    (void)map; (void)src; (void)steps; (void)stages; (void)clk;
    if (blockIdx.x == 0 && threadIdx.x == 0) *missing = 1;
#endif
}

typedef void (*RateKernel)(int, int, float *, int *);

struct Plan {
    RateKernel kernel;
    int threads;
    int smem;
    double flop_per_step;  // per CTA, dense-equivalent
};

Plan plan_for(sam_tc_kind kind) {
    const double warps = MMA_THREADS / 32, wgs = WG_THREADS / 128;
    const double wg_flop = wgs * WG_BATCH * 2.0 * 64;  // per CTA and step, times N x K (dense-equivalent)
    switch (kind) {
    case SAM_TC_MMA: return {mma_rate_kernel<false>, MMA_THREADS, 0, warps * CHAINS * 2.0 * 16 * 8 * 16};
    case SAM_TC_MMA_SP: return {mma_rate_kernel<true>, MMA_THREADS, 0, warps * CHAINS * 2.0 * 16 * 8 * 32};
    case SAM_TC_WGMMA: return {wgmma_rate_kernel<SAM_TC_WGMMA>, WG_THREADS, WG_SMEM, wg_flop * 128 * 16};
    case SAM_TC_WGMMA_SP: return {wgmma_rate_kernel<SAM_TC_WGMMA_SP>, WG_THREADS, WG_SMEM, wg_flop * 128 * 32};
    case SAM_TC_WGMMA_SP_N64: return {wgmma_rate_kernel<SAM_TC_WGMMA_SP_N64>, WG_THREADS, WG_SMEM, wg_flop * 64 * 32};
    case SAM_TC_WGMMA_SP_SS: return {wgmma_rate_kernel<SAM_TC_WGMMA_SP_SS>, WG_THREADS, WG_SMEM, wg_flop * 128 * 32};
    case SAM_TC_WGMMA_SP_SS_N96:
        return {wgmma_rate_kernel<SAM_TC_WGMMA_SP_SS_N96>, WG_THREADS, WG_SMEM, wg_flop * 96 * 32};
    default: return {wgmma_rate_kernel<SAM_TC_WGMMA_SP_SS_N64>, WG_THREADS, WG_SMEM, wg_flop * 64 * 32};
    }
}

// Device buffers and events of one measurement, released on every path.
// (The fill-rate measurement uses src and clk instead of sink.)
struct Scratch {
    float *sink = nullptr;
    __nv_bfloat16 *src = nullptr;
    long long *clk = nullptr;
    int *missing = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Scratch() {
        if (start) cudaEventDestroy(start);
        if (stop) cudaEventDestroy(stop);
        if (sink) cudaFree(sink);
        if (src) cudaFree(src);
        if (clk) cudaFree(clk);
        if (missing) cudaFree(missing);
    }
};

// A failed CUDA call of the measurement of `kind`.  No code for the device in
// this build is a launch-configuration error (nothing sticky): it is reported
// as unsupported, as a missing sm_90a kernel is.
sam_status cuda_fail(cudaError_t err, const char *kind, const char *what) {
    if (err == cudaErrorNoKernelImageForDevice) {
        cudaGetLastError();
        set_error("%s: this build (%s) has no code for the current device", kind, sam_cuda_archs());
        return SAM_STATUS_UNSUPPORTED;
    }
    char op[96];
    snprintf(op, sizeof op, "%s: %s", kind, what);
    return cuda_status(err, op);
}

#define PEAK_TRY(expr, kind, what)                                    \
    do {                                                              \
        cudaError_t err_ = (expr);                                    \
        if (err_ != cudaSuccess) return cuda_fail(err_, kind, what);  \
    } while (0)

// One launch of `steps` on the legacy default stream; *ms its time.
// launch() (returning the launch's error) on the legacy default stream between s's
// events; *ms its time.
template <typename L> sam_status timed(const char *kind, Scratch &s, L &&launch, float *ms) {
    PEAK_TRY(cudaEventRecord(s.start, 0), kind, "cudaEventRecord");
    PEAK_TRY(launch(), kind, "launch");
    PEAK_TRY(cudaEventRecord(s.stop, 0), kind, "cudaEventRecord");
    PEAK_TRY(cudaEventSynchronize(s.stop), kind, "kernel");
    PEAK_TRY(cudaEventElapsedTime(ms, s.start, s.stop), kind, "cudaEventElapsedTime");
    return SAM_STATUS_OK;
}

sam_status timed_launch(const Plan &p, const char *kind, int grid, int steps, Scratch &s, float *ms) {
    return timed(kind, s, [&] {
        p.kernel<<<grid, p.threads, p.smem, 0>>>(steps, 0, s.sink, s.missing);
        return cudaGetLastError();
    }, ms);
}

// The device checks of a measurement named `name`: compute capability 8.0 or
// later, and for `hopper` an sm_90 device and sm_90a code in this build; *sms, and
// *cc = 10 major + minor.
sam_status device_gate(const char *name, int device, bool hopper, int *sms, int *cc) {
    int cc_major = 0, cc_minor = 0;
    PEAK_TRY(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device), name,
             "cudaDeviceGetAttribute");
    PEAK_TRY(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device), name,
             "cudaDeviceGetAttribute");
    PEAK_TRY(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device), name, "cudaDeviceGetAttribute");
    *cc = 10 * cc_major + cc_minor;
    // sm_90a code runs on compute capability 9.0 only; wgmma, TMA and mbarrier
    // transaction counts exist nowhere else
    if (hopper && !(cc_major == 9 && cc_minor == 0)) {
        set_error("%s needs an sm_90 (Hopper) device; device %d is sm_%d%d", name, device, cc_major, cc_minor);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (hopper && strstr(sam_cuda_archs(), "sm_90a") == nullptr) {
        set_error("%s needs sm_90a code and this build has %s (rebuild with 90a in SAMOYEDS_CUDA_ARCHS)", name,
                  sam_cuda_archs());
        return SAM_STATUS_UNSUPPORTED;
    }
    if (cc_major < 8) {
        set_error("%s needs compute capability 8.0 or later; device %d is sm_%d%d", name, device, cc_major,
                  cc_minor);
        return SAM_STATUS_UNSUPPORTED;
    }
    return SAM_STATUS_OK;
}

sam_status measure(sam_tc_kind kind, int device, double *tflops) {
    const char *name = KIND_NAMES[kind];
    int sms = 0, cc = 0;
    const bool wg = kind >= SAM_TC_WGMMA;  // every wgmma form
    if (sam_status st = device_gate(name, device, wg, &sms, &cc)) return st;

    const Plan p = plan_for(kind);
    if (p.smem > 48 * 1024)
        PEAK_TRY(cudaFuncSetAttribute(p.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem), name,
                 "cudaFuncSetAttribute");
    int per_sm = 0;
    PEAK_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, p.kernel, p.threads, p.smem), name,
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (per_sm < 1) {
        set_error("%s: the rate kernel does not fit on an SM of device %d", name, device);
        return SAM_STATUS_UNSUPPORTED;
    }
    const int grid = per_sm * sms;  // one full wave: every SM busy until the end

    Scratch s;
    PEAK_TRY(cudaMalloc(&s.sink, sizeof(float) * (size_t)grid * p.threads), name, "cudaMalloc");
    PEAK_TRY(cudaMalloc(&s.missing, sizeof(int)), name, "cudaMalloc");
    PEAK_TRY(cudaMemset(s.missing, 0, sizeof(int)), name, "cudaMemset");
    PEAK_TRY(cudaEventCreate(&s.start), name, "cudaEventCreate");
    PEAK_TRY(cudaEventCreate(&s.stop), name, "cudaEventCreate");

    // first launch: module loading, and whether the code the device got can issue this kind
    float ms = 0.0f;
    if (sam_status st = timed_launch(p, name, grid, 16, s, &ms)) return st;
    int missing = 0;
    PEAK_TRY(cudaMemcpy(&missing, s.missing, sizeof(int), cudaMemcpyDeviceToHost), name, "cudaMemcpy");
    if (missing) {
        set_error("%s: the code this build (%s) has for device %d (sm_%d%d) cannot issue it", name,
                  sam_cuda_archs(), device, cc / 10, cc % 10);
        return SAM_STATUS_UNSUPPORTED;
    }

    // calibration: steps for a launch of about TARGET_MS (a launch's fixed costs, a few
    // microseconds, are then well under 1 %)
    if (sam_status st = timed_launch(p, name, grid, CALIB_STEPS, s, &ms)) return st;
    const double want = CALIB_STEPS * (double)TARGET_MS / std::max((double)ms, 1e-3);
    const int steps = (int)std::min(std::max(want, (double)CALIB_STEPS), (double)(1 << 26));
    if (sam_status st = timed_launch(p, name, grid, steps, s, &ms)) return st;  // clocks settle under load

    float times[TIMED];
    for (int i = 0; i < TIMED; i++)
        if (sam_status st = timed_launch(p, name, grid, steps, s, &times[i])) return st;
    std::sort(times, times + TIMED);
    const double median_s = times[TIMED / 2] * 1e-3;
    if (!(median_s > 0.0)) {
        set_error("%s: the timed launches took no measurable time", name);
        return SAM_STATUS_CUDA_ERROR;
    }
    *tflops = p.flop_per_step * grid * (double)steps / median_s / 1e12;
    return SAM_STATUS_OK;
}

typedef void (*FillKernel)(CUtensorMap, const __nv_bfloat16 *, int, int, long long *, int *);

struct FillPlan {
    FillKernel k;
    int grid, stages, smem, cluster;
};

sam_status fill_launch(const FillPlan &f, const CUtensorMap &map, const char *name, int steps, Scratch &s,
                       float *ms) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = f.cluster;
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(f.grid);
    cfg.blockDim = dim3(FILL_THREADS);
    cfg.dynamicSmemBytes = f.smem;
    cfg.stream = 0;
    cfg.attrs = attr;
    cfg.numAttrs = f.cluster > 1 ? 1 : 0;
    return timed(name, s, [&] {
        return cudaLaunchKernelEx(&cfg, f.k, map, (const __nv_bfloat16 *)s.src, steps, f.stages, s.clk, s.missing);
    }, ms);
}

const char *const FILL_NAMES[] = SAM_FILL_KIND_NAMES;

sam_status measure_fill(sam_fill_kind kind, int device, int ctas, int stages, double out[5]) {
    const char *name = FILL_NAMES[kind];
    int sms = 0, cc = 0;
    if (sam_status st = device_gate(name, device, true, &sms, &cc)) return st;
    const FillKernel k = kind == SAM_FILL_TMA          ? fill_rate_kernel<SAM_FILL_TMA>
                         : kind == SAM_FILL_CP_ASYNC   ? fill_rate_kernel<SAM_FILL_CP_ASYNC>
                         : kind == SAM_FILL_GATHER     ? fill_rate_kernel<SAM_FILL_GATHER>
                         : kind == SAM_FILL_TMA_GATHER ? fill_rate_kernel<SAM_FILL_TMA_GATHER>
                         : kind == SAM_FILL_TMA_ROWS   ? fill_rate_kernel<SAM_FILL_TMA_ROWS>
                                                       : fill_rate_kernel<SAM_FILL_TMA_MULTICAST>;
    const int sb = fill_stage_bytes(kind), max_stages = std::min(FILL_MAX_STAGES, FILL_RING_BYTES / sb);
    if (ctas < 0 || ctas > sms) {
        set_error("ctas = %d; expected 0 (every SM) or 1 <= ctas <= %d (the SMs of device %d)", ctas, sms, device);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    if (stages < 0 || stages > max_stages) {
        set_error("stages = %d; expected 0 (128 KB of stages) or 1 <= stages <= %d (stages of %d KB)", stages,
                  max_stages, sb / 1024);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    FillPlan f;
    f.k = k;
    f.cluster = kind == SAM_FILL_TMA_MULTICAST ? 2 : 1;
    if (ctas % f.cluster) {
        set_error("ctas = %d; %s runs clusters of 2 CTAs and needs an even count", ctas, name);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    // one CTA per SM (the ring takes most of its shared memory); every SM: less one for
    // clusters of 2 on an odd count
    f.grid = ctas ? ctas : sms - sms % f.cluster;
    f.stages = stages ? stages : 131072 / sb;
    f.smem = f.stages * sb + 1024;  // + room to align the ring
    PEAK_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, f.smem), name,
             "cudaFuncSetAttribute");
    const int grid = f.grid;

    Scratch s;
    const size_t src_bytes = (size_t)FILL_SRC_ROWS * FILL_SRC_COLS * sizeof(__nv_bfloat16);
    PEAK_TRY(cudaMalloc(&s.src, src_bytes), name, "cudaMalloc");
    PEAK_TRY(cudaMemset(s.src, 0x3c, src_bytes), name, "cudaMemset");  // bf16 0x3c3c: ~0.0115, every row
    PEAK_TRY(cudaMalloc(&s.clk, sizeof(long long) * 2 * grid), name, "cudaMalloc");
    PEAK_TRY(cudaMalloc(&s.missing, sizeof(int)), name, "cudaMalloc");
    PEAK_TRY(cudaMemset(s.missing, 0, sizeof(int)), name, "cudaMemset");
    PEAK_TRY(cudaEventCreate(&s.start), name, "cudaEventCreate");
    PEAK_TRY(cudaEventCreate(&s.stop), name, "cudaEventCreate");

    CUtensorMap map;
    memset(&map, 0, sizeof map);
    if (fill_uses_map(kind)) {
        TensorMapEncodeFn enc = tensor_map_encoder();
        if (enc == nullptr) {
            set_error("%s: the CUDA driver has no cuTensorMapEncodeTiled", name);
            return SAM_STATUS_UNSUPPORTED;
        }
        const cuuint64_t dim[2] = {FILL_SRC_COLS, FILL_SRC_ROWS}, stride[1] = {FILL_SRC_COLS * 2};
        const cuuint32_t rows = kind == SAM_FILL_TMA_MULTICAST ? FILL_ROWS / 2  // (a CTA's half)
                                : kind == SAM_FILL_TMA_ROWS    ? 1
                                                               : FILL_ROWS;
        const cuuint32_t box[2] = {FILL_ROW_BYTES / 2, rows}, one[2] = {1, 1};
        if (enc(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, s.src, dim, stride, box, one,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
            set_error("%s: cuTensorMapEncodeTiled refused the source", name);
            return SAM_STATUS_CUDA_ERROR;
        }
    }

    float ms = 0.0f;
    if (sam_status st = fill_launch(f, map, name, 2 * f.stages, s, &ms)) return st;
    int missing = 0;
    PEAK_TRY(cudaMemcpy(&missing, s.missing, sizeof(int), cudaMemcpyDeviceToHost), name, "cudaMemcpy");
    if (missing) {
        set_error("%s: the code this build (%s) has for device %d (sm_%d%d) cannot run it", name, sam_cuda_archs(), device,
                  cc / 10, cc % 10);
        return SAM_STATUS_UNSUPPORTED;
    }
    if (sam_status st = fill_launch(f, map, name, CALIB_STEPS * 4, s, &ms)) return st;
    const double want = CALIB_STEPS * 4 * (double)TARGET_MS / std::max((double)ms, 1e-3);
    const int steps = (int)std::min(std::max(want, (double)CALIB_STEPS * 4), (double)(1 << 26));
    if (sam_status st = fill_launch(f, map, name, steps, s, &ms)) return st;  // clocks settle

    float times[TIMED];
    long long clk_sum = 0, ns_sum = 0;
    std::vector<long long> clk(2 * (size_t)grid);
    for (int i = 0; i < TIMED; i++) {
        if (sam_status st = fill_launch(f, map, name, steps, s, &times[i])) return st;
        PEAK_TRY(cudaMemcpy(clk.data(), s.clk, sizeof(long long) * clk.size(), cudaMemcpyDeviceToHost), name,
                 "cudaMemcpy");
        for (int b = 0; b < grid; b++) {
            clk_sum += clk[2 * b];
            ns_sum += clk[2 * b + 1];
        }
    }
    std::sort(times, times + TIMED);
    const double median_s = times[TIMED / 2] * 1e-3;
    if (!(median_s > 0.0) || clk_sum <= 0 || ns_sum <= 0) {
        set_error("%s: the timed launches took no measurable time", name);
        return SAM_STATUS_CUDA_ERROR;
    }
    const double bytes_per_cta = (double)steps * sb;
    out[0] = bytes_per_cta * grid / median_s / 1e12;
    out[1] = bytes_per_cta / ((double)clk_sum / (TIMED * grid));  // per SM per clock of that SM
    out[2] = (double)clk_sum / (double)ns_sum * 1e3;               // clocks per ns -> MHz
    out[3] = grid;
    out[4] = (double)f.stages * sb;
    return SAM_STATUS_OK;
}

#undef PEAK_TRY

// f() with `device` checked and current while it runs.
template <typename F> sam_status on_device(int device, F &&f) {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();  // no driver / no device: not sticky, do not leave it for the next launcher
        return cuda_status(err, "cudaGetDeviceCount");
    }
    if (device < 0 || device >= n) {
        set_error("device = %d; expected 0 <= device < %d (the CUDA devices visible)", device, n);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    int prev = 0;
    if (sam_status st = sam_cuda_device_enter(device, &prev)) return st;
    const sam_status st = f();
    sam_cuda_device_exit(prev);
    return st;
}

}  // namespace
}  // namespace sam

extern "C" sam_status sam_tc_rate_cuda(sam_tc_kind kind, int device, double *tflops) {
    *tflops = 0.0;
    if ((int)kind < 0 || (int)kind >= SAM_TC_KIND_COUNT) {
        sam::set_error("kind = %d; expected 0 <= kind < %d", (int)kind, SAM_TC_KIND_COUNT);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    return sam::on_device(device, [&] { return sam::measure(kind, device, tflops); });
}

extern "C" sam_status sam_fill_rate_cuda(sam_fill_kind kind, int device, int ctas, int stages, double out[5]) {
    for (int i = 0; i < 5; i++) out[i] = 0.0;
    if ((int)kind < 0 || (int)kind >= SAM_FILL_KIND_COUNT) {
        sam::set_error("kind = %d; expected 0 <= kind < %d", (int)kind, SAM_FILL_KIND_COUNT);
        return SAM_STATUS_INVALID_ARGUMENT;
    }
    return sam::on_device(device, [&] { return sam::measure_fill(kind, device, ctas, stages, out); });
}

