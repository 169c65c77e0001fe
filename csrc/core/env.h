// Settings from the environment.
#pragma once

#include <cstddef>

namespace pyc {

// Reads a size such as "1G", "4M", "512K" or "65536" from environment variable
// `name`; `dflt` when unset or empty. Raises InvalidArgument for a value that
// does not parse or is below `min`.
size_t env_size(const char* name, size_t dflt, size_t min = 0);

}  // namespace pyc
