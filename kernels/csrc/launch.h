// Programmatic dependent launch (PDL), shared by every kernel of this library.
//
// Each kernel is launched with programmatic stream serialization and starts with
// pdl_trigger_then_wait(): its successor may then be scheduled onto the SMs while this kernel
// still runs, and this kernel touches no memory before its own predecessor has finished and
// flushed. A chain of short kernels (a decode step at batch 1) thus hides most launch latency,
// with the same ordering as plain stream serialization.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace flashdecode {

__device__ __forceinline__ void pdl_trigger_then_wait() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

template <typename Kernel, typename... Args>
cudaError_t launch_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// The current device's SM count (cached per device); 0 if it cannot be read.
inline int sm_count() {
  static int known[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return 0;
  int n = __atomic_load_n(&known[device], __ATOMIC_ACQUIRE);
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess)
    __atomic_store_n(&known[device], n, __ATOMIC_RELEASE);
  return n;
}

// Raises ``kernel``'s dynamic shared memory limit to ``bytes``, once per device; ``done`` is the
// caller's per-kernel record (a bit per device).
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, int bytes, uint64_t& done) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 64) return cudaErrorInvalidDevice;
  if (__atomic_load_n(&done, __ATOMIC_ACQUIRE) & (1ull << device)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) __atomic_fetch_or(&done, 1ull << device, __ATOMIC_RELEASE);
  return err;
}

}  // namespace flashdecode
