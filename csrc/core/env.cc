#include "core/env.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace pyc {

size_t env_size(const char* name, size_t dflt, size_t min, size_t max) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v, &end);
  const bool range_error = errno == ERANGE;
  size_t mult = 1;
  if (end != v && (*end == 'K' || *end == 'k'))
    mult = size_t{1} << 10;
  else if (end != v && (*end == 'M' || *end == 'm'))
    mult = size_t{1} << 20;
  else if (end != v && (*end == 'G' || *end == 'g'))
    mult = size_t{1} << 30;
  if (end == v || *(mult > 1 ? end + 1 : end) != '\0')
    PYC_THROW(InvalidArgument, "pycollectives: cannot parse " << name << "=" << v
                                                              << " (a size such as 65536, 512K, "
                                                                 "4M or 1G)");
  if (!std::isfinite(x) || range_error)
    PYC_THROW(InvalidArgument, "pycollectives: " << name << "=" << v << " is not a finite number");
  // 64 bits of mantissa: every size_t is exact, and x * mult cannot overflow.
  const long double scaled = static_cast<long double>(x) * mult;
  if (!(scaled >= static_cast<long double>(min) && scaled <= static_cast<long double>(max)))
    PYC_THROW(InvalidArgument,
              "pycollectives: " << name << " must be in [" << min << ", " << max << "], not " << v);
  return static_cast<size_t>(scaled);
}

}  // namespace pyc
