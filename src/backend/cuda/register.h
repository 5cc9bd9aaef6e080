// Registers the CUDA backend's device model factory (called from main() in CUDA builds).
#pragma once

namespace spindle::cuda {

void register_backend();

}  // namespace spindle::cuda
