// Minimal logging to stderr; progress and warnings a person should see.
#pragma once

#include <iostream>
#include <sstream>
#include <utility>

namespace spindle {

template <class... Parts>
void log_info(Parts&&... parts) {
  std::ostringstream out;
  out << "spindle: ";
  (out << ... << std::forward<Parts>(parts));
  std::cerr << out.str() << '\n';
}

template <class... Parts>
void log_warn(Parts&&... parts) {
  std::ostringstream out;
  out << "spindle: WARNING: ";
  (out << ... << std::forward<Parts>(parts));
  std::cerr << out.str() << '\n';
}

}  // namespace spindle
