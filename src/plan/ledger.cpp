#include "plan/ledger.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace spindle::plan {

int64_t allocator_rounded(int64_t bytes) { return device_allocation_bytes(bytes); }

Ledger::Block::Block(Block&& other) noexcept
    : ledger_(std::exchange(other.ledger_, nullptr)), bytes_(other.bytes_), category_(other.category_) {}

Ledger::Block& Ledger::Block::operator=(Block&& other) noexcept {
  if (this != &other) {
    release();
    ledger_ = std::exchange(other.ledger_, nullptr);
    bytes_ = other.bytes_;
    category_ = other.category_;
  }
  return *this;
}

Ledger::Block::~Block() { release(); }

void Ledger::Block::release() {
  if (ledger_ == nullptr) return;
  const int c = static_cast<int>(category_);
  ledger_->stats_.current[c] -= bytes_;
  ledger_->stats_.current_total -= bytes_;
  ledger_ = nullptr;
}

Ledger::Block Ledger::take(int64_t bytes, MemoryCategory category) {
  check(bytes >= 0, "memory model: negative allocation of ", bytes, " bytes");
  const int64_t size = allocator_rounded(bytes);
  const int c = static_cast<int>(category);
  stats_.current[c] += size;
  stats_.current_total += size;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.current[c]);
  stats_.peak_total = std::max(stats_.peak_total, stats_.current_total);
  return Block(this, size, category);
}

}  // namespace spindle::plan
