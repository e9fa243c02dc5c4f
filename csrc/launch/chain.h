// Chained launches: the kernels of one MoK pass launched with programmatic stream serialization
// (Hopper's programmatic dependent launch), so each may start while the kernel before it on the
// stream finishes and waits for it on the device (ptx::chain_wait), instead of the stream
// starting it only after. The gaps between a pass's many small kernels shrink; the results do
// not change. MoKConfig.chained_launches turns it on for a workspace (its comm field
// `chained`); the op entry points open a ChainScope with it, and every launcher below them that
// calls launch::kernel() launches chained while the scope is open on the calling thread.
// NOTE: only kernels whose every thread calls ptx::chain_wait() first (ptx::chain_begin) may go
// through launch::kernel(); the others keep <<<>>>.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "mok/common/macros.cuh"

namespace mok::launch {

namespace detail {
inline thread_local bool chained_launches = false;
}  // namespace detail

// Chained launches on this host thread while the scope is open (nested scopes restore).
class ChainScope {
 public:
  explicit ChainScope(bool chained) : saved_(detail::chained_launches) {
    detail::chained_launches = chained;
  }
  ~ChainScope() { detail::chained_launches = saved_; }
  ChainScope(const ChainScope&) = delete;
  ChainScope& operator=(const ChainScope&) = delete;

 private:
  bool saved_;
};

// Whether launches on this host thread are chained now.
inline bool chained() { return detail::chained_launches; }

// The launch attribute that makes a launch chained (cudaLaunchKernelEx's form).
inline cudaLaunchAttribute chained_attribute() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

// cudaLaunchKernelEx(&config, fn, args...): a failed launch clears the runtime's error (it is
// ours to report, not left for the next check) and throws, naming the launch.
template <class... Params, class... Args>
void launch_ex(const cudaLaunchConfig_t& config, void (*fn)(Params...), Args&&... args) {
  const cudaError_t err = cudaLaunchKernelEx(&config, fn, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    MOK_HOST_CHECK(false, "kernel launch (%u x %u threads, %zu bytes of shared memory%s) "
                   "failed: %s", config.gridDim.x, config.blockDim.x, config.dynamicSmemBytes,
                   chained() ? ", chained" : "", cudaGetErrorString(err));
  }
}

// kernel<<<grid, block, smem, stream>>>(args...), chained inside a ChainScope(true); a failed
// launch throws (launch_ex; no cudaGetLastError check is needed after it).
template <class... Params, class... Args>
void kernel(void (*fn)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchAttribute attr = chained_attribute();
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = chained() ? 1 : 0;
  launch_ex(config, fn, std::forward<Args>(args)...);
}

}  // namespace mok::launch
