// C++ exceptions of the core as Python exceptions (pycollectives.errors).
#pragma once

#include <exception>

namespace pyc {

// Looks up the Python exception classes once (needs the GIL; called at import).
void init_error_classes();

// Sets the Python error for `p` (the GIL held): the core's error types map to
// pycollectives.errors (InvalidArgument to ValueError, an interrupted wait to
// KeyboardInterrupt), any other std::exception to RuntimeError.
void set_python_error(std::exception_ptr p);

}  // namespace pyc
