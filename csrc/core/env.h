// Settings from the environment.
#pragma once

#include <cstddef>

namespace pyc {

// Reads a size such as "1G", "4M", "512K" or "65536" from environment variable
// `name`; `dflt` when unset or empty. Raises InvalidArgument naming the
// variable for a value that does not parse, is not finite (inf, nan, 1e400)
// or lies outside [min, max] once scaled by its suffix: the arithmetic is
// done in a type wide enough that nothing wraps on the way.
size_t env_size(const char* name, size_t dflt, size_t min, size_t max);

}  // namespace pyc
