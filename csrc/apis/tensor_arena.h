// Many small tensors from one allocation (torch-facing only): a pass's schedule and plan are
// about 25 tensors, and each at::empty costs microseconds of host time (dispatch, the caching
// allocator's lock and search), which the GPU waits out before the megakernel starts.
// NOTE: the tensors share one storage, so it lives as long as any of them: use an arena only for
// tensors that are kept (or dropped) together, never for an output the caller keeps alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <vector>

namespace mok::apis {

class TensorArena {
 public:
  // Each tensor starts at a multiple of this many bytes (above the API's 16-byte rule).
  static constexpr int64_t kAlign = 256;

  explicit TensorArena(const at::Tensor& like) : options_(like.options()) {}

  // Reserves a contiguous tensor of `sizes` and `dtype`; returns its index in make()'s result.
  int add(at::IntArrayRef sizes, at::ScalarType dtype) {
    specs_.push_back({sizes.vec(), dtype});
    return static_cast<int>(specs_.size()) - 1;
  }

  // One allocation for every reserved tensor; the tensors in the order they were added.
  std::vector<at::Tensor> make() const {
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (const Spec& s : specs_) {
      offsets.push_back(total);
      int64_t numel = 1;
      for (const int64_t d : s.sizes) numel *= d;
      const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(s.dtype));
      total += (bytes + kAlign - 1) / kAlign * kAlign;
    }
    const at::Tensor buffer = at::empty({std::max<int64_t>(total, 1)}, options_.dtype(at::kByte));
    std::vector<at::Tensor> out;
    out.reserve(specs_.size());
    for (size_t i = 0; i < specs_.size(); ++i) {
      const Spec& s = specs_[i];
      auto impl = c10::make_intrusive<c10::TensorImpl>(
          c10::Storage(buffer.storage()), buffer.key_set(), c10::scalarTypeToTypeMeta(s.dtype));
      impl->set_storage_offset(offsets[i] / static_cast<int64_t>(c10::elementSize(s.dtype)));
      impl->set_sizes_contiguous(s.sizes);
      out.emplace_back(std::move(impl));
    }
    return out;
  }

 private:
  struct Spec {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };
  at::TensorOptions options_;
  std::vector<Spec> specs_;
};

}  // namespace mok::apis
