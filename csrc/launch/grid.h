// Launch sizes shared by the grid-stride launchers (launch/moe.cu, launch/moe_mega.cu).
#pragma once

#include <algorithm>
#include <cstdint>

namespace mok::launch::detail {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

// Blocks of kThreads for n items: at least 1, at most kMaxBlocks (the kernels grid-stride).
inline int grid_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxBlocks, (n + kThreads - 1) / kThreads)));
}

}  // namespace mok::launch::detail
