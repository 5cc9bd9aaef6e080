#include "model/cuda/expert_lanes.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace spindle::cuda {

ExpertLanes::ExpertLanes(int lanes) {
  check(lanes >= 1, "expert lanes: ", lanes, " side streams (expected at least 1)");
  for (int i = 0; i < lanes; ++i) {
    streams_.push_back(std::make_unique<Stream>());
    done_.push_back(std::make_unique<Event>(cudaEventDisableTiming));
  }
}

void ExpertLanes::fork(cudaStream_t main) {
  forked_.record(main);
  for (const auto& lane : streams_) forked_.make_wait(lane->get());
}

void ExpertLanes::join(cudaStream_t main) {
  for (size_t i = 0; i < streams_.size(); ++i) {
    done_[i]->record(*streams_[i]);
    done_[i]->make_wait(main);
  }
}

std::vector<int> ExpertLanes::assign(const std::vector<int32_t>& offsets) const {
  const size_t experts = offsets.empty() ? 0 : offsets.size() - 1;
  const auto rows = [&](size_t e) { return offsets[e + 1] - offsets[e]; };
  std::vector<size_t> busiest_first(experts);
  std::iota(busiest_first.begin(), busiest_first.end(), size_t{0});
  std::stable_sort(busiest_first.begin(), busiest_first.end(),
                   [&](size_t a, size_t b) { return rows(a) > rows(b); });
  std::vector<int64_t> load(streams_.size(), 0);
  std::vector<int> lane(experts, 0);
  for (const size_t e : busiest_first) {
    const auto least = std::min_element(load.begin(), load.end());
    lane[e] = static_cast<int>(least - load.begin());
    *least += rows(e);
  }
  return lane;
}

}  // namespace spindle::cuda
