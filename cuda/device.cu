// device.cu -- device queries, the launchers' error reporting and the process-wide
// programmatic-dependent-launch switch.
#include <atomic>
#include <string.h>

#include "common.cuh"

#ifndef SAM_ARCHS
#define SAM_ARCHS "unknown"
#endif

namespace sam {

static thread_local char g_error[512];

void set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
}

sam_status cuda_status(cudaError_t err, const char *op) {
    if (err == cudaSuccess) return SAM_STATUS_OK;
    set_error("%s: CUDA error %d (%s): %s", op, (int)err, cudaGetErrorName(err), cudaGetErrorString(err));
    return SAM_STATUS_CUDA_ERROR;
}

// sam_cuda_set_pdl: programmatic dependent launches on (1, the default) or off.
static std::atomic<int> g_pdl{1};

int device_sm_count() {
    static int cache[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return 0;
    }
    if (cache[dev] <= 0) {
        int n = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) n = 0;
        cudaGetLastError();
        cache[dev] = n;
    }
    return cache[dev];
}

bool device_runs_sm90a() {
    static int cache[64];  // 0: not asked yet, 1: no, 2: yes
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return false;
    }
    if (cache[dev] == 0) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        cudaGetLastError();
        cache[dev] = major == 9 && minor == 0 && strstr(sam_cuda_archs(), "sm_90a") != nullptr ? 2 : 1;
    }
    return cache[dev] == 2;
}

bool pdl_enabled() {
    static int cache[64];  // 0: not asked yet, 1: no, 2: yes
    int dev = 0;
    if (g_pdl.load(std::memory_order_relaxed) == 0) return false;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return false;
    }
    if (cache[dev] == 0) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) major = 0;
        cudaGetLastError();
        cache[dev] = major >= 9 ? 2 : 1;
    }
    return cache[dev] == 2;
}

}  // namespace sam

extern "C" {

const char *sam_cuda_last_error(void) { return sam::g_error; }

void sam_cuda_set_pdl(int enabled) { sam::g_pdl.store(enabled != 0 ? 1 : 0, std::memory_order_relaxed); }

int sam_cuda_pdl(void) { return sam::g_pdl.load(std::memory_order_relaxed); }

int sam_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // no driver / no device: not an error for the caller
        return 0;
    }
    return n;
}

int sam_cuda_device_cc(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        sam::cuda_status(cudaGetLastError(), "device_capability");
        return -1;
    }
    return major * 10 + minor;
}

int sam_cuda_runtime_version(void) { return CUDART_VERSION; }

const char *sam_cuda_archs(void) { return SAM_ARCHS; }

sam_status sam_cuda_device_enter(int device, int *prev) {
    SAM_CUDA_TRY(cudaGetDevice(prev), "cudaGetDevice");
    if (*prev != device) SAM_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice");
    return SAM_STATUS_OK;
}

void sam_cuda_device_exit(int prev) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
}

}  // extern "C"
