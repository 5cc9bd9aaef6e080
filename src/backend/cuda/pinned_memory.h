// Page-locked host memory, which the GPU copies to and from at PCIe speed (pageable memory goes
// through a staging buffer at a fraction of it).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace spindle::cuda {

// `bytes` of pinned host memory, freed with the last owner; fails with `what` in the message
// when the host cannot pin that much.
std::shared_ptr<void> allocate_pinned(size_t bytes, const std::string& what);

}  // namespace spindle::cuda
