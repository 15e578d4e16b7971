// ssmm_kernels.h -- the launchers of the ssmm kernels, called by the selection in
// ssmm.cu after its checks (one translation unit each; internal to cuda/).
#pragma once

#include <cuda_runtime.h>

#include "samoyeds_cuda.h"

namespace sam {

// The mma.sp kernel (ssmm_mma_sp.cu): every format with n = 1, sm_80 and later.
sam_status ssmm_mma_sp_launch(const sam_ssmm_params *ps, cudaStream_t stream);

// The warp-specialised wgmma.sp kernel (ssmm_wgmma_sp.cu): 2:4 (tile ignored) and 1:2:V
// with V % 128 == 0 in `tile` (not SAM_TILE_AUTO), the token rows as `rows` says
// (SAM_TOKEN_ROWS_AUTO: by TMA where ssmm_tokens_mappable and the encoder takes them), K
// in nsplit splits (1 <= nsplit <= the K units, sam_ssmm_split_k): nsplit > 1 adds the
// splits' fp32 partial sums in a stream-ordered workspace and a second kernel.
sam_status ssmm_wgmma_sp_launch(const sam_ssmm_params *ps, cudaStream_t stream, sam_tile tile, sam_token_rows rows,
                                int nsplit);

// Whether this process can run the wgmma.sp kernel on the current device: an sm_90
// device, sm_90a code in this build and the driver's tensor-map encoder (cached per device).
bool ssmm_wgmma_sp_available();

// Whether the weights can be read by TMA: values and meta 16-byte aligned (always so for
// arrays the library allocates).
bool ssmm_weights_mappable(const sam_ssmm_params *ps);

// Whether x's rows can be TMA boxes: read without a row map (token_ids null), x and its
// row stride 16-byte aligned, int32-indexable.
bool ssmm_tokens_mappable(const sam_ssmm_params *ps);

}  // namespace sam
