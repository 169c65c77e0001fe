"""Finds the compiled extension when pycollectives is imported from a clone.

`python -m ...` or `python -c ...` run from the clone's root put the clone
first on sys.path, so Python imports its source folder pycollectives/, which
has no `_C` until `pip install -e .` builds one there. After a plain
`pip install .` the built package lives in site-packages: the source folder's
package then loads its modules from there (the same version, built), instead of
failing with Python's "partially initialized module" (circular import) error.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path


def _has_extension(folder: Path) -> bool:
    return any((folder / f"_C{s}").is_file() for s in importlib.machinery.EXTENSION_SUFFIXES)


def package_path(path: list[str]) -> list[str]:
    """The package's `__path__`: `path` when one of its folders holds the
    compiled `_C`, else the installed pycollectives found further along
    sys.path (a folder with `_C`).

    Raises ImportError (one line) when there is none: a source tree that was
    never built.
    """
    folders = [Path(p) for p in path]
    if any(_has_extension(f) for f in folders):
        return path
    here = {f.resolve() for f in folders}
    for entry in sys.path:
        candidate = Path(entry or os.getcwd()) / "pycollectives"
        try:
            if candidate.resolve() not in here and _has_extension(candidate):
                return [str(candidate)]
        except OSError:  # an unreadable sys.path entry
            continue
    where = folders[0] if folders else Path("?")
    raise ImportError(
        f"pycollectives is imported from its source tree at {where}, which has no compiled "
        "extension: run `pip install -e .` or run from another directory"
    )


_package = sys.modules[__package__]  # pycollectives, being imported
_package.__path__[:] = package_path(list(_package.__path__))
