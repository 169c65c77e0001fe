#include "core/env.h"

#include <cstdlib>

#include "core/error.h"

namespace pyc {

size_t env_size(const char* name, size_t dflt, size_t min) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  size_t mult = 1;
  if (*end == 'K' || *end == 'k')
    mult = 1 << 10;
  else if (*end == 'M' || *end == 'm')
    mult = 1 << 20;
  else if (*end == 'G' || *end == 'g')
    mult = size_t{1} << 30;
  else if (*end != '\0' || end == v)
    PYC_THROW(InvalidArgument, "pycollectives: cannot parse " << name << "=" << v);
  if (!(x >= static_cast<double>(min)))
    PYC_THROW(InvalidArgument, "pycollectives: " << name << " must be >= " << min << ", not " << v);
  return static_cast<size_t>(x * mult);
}

}  // namespace pyc
