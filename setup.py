"""Builds pycollectives._C from csrc/.

The core includes and links no torch: it builds in seconds from C++17 sources
with pybind11. PYCOLL_CUDA=auto|0|1 decides whether the CUDA sources in
csrc/cuda/ are compiled (auto: when nvcc is found).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]


def _find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cuda_mode() -> str | None:
    """Returns the nvcc path when CUDA sources are to be built, else None."""
    mode = os.environ.get("PYCOLL_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"PYCOLL_CUDA must be auto, 0 or 1, not {mode!r}")
    if mode == "0":
        return None
    nvcc = _find_nvcc()
    if nvcc is None and mode == "1":
        raise SystemExit("PYCOLL_CUDA=1 but nvcc was not found (set CUDA_HOME or PATH)")
    if not list((CSRC / "cuda").glob("*.cu")):
        return None
    return nvcc


def _sources(pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob(pattern) if "cuda" not in p.parts)


class BuildExt(build_ext):
    """build_ext that also compiles csrc/cuda/*.cu with nvcc when enabled."""

    def build_extension(self, ext):  # noqa: D102
        nvcc = _cuda_mode()
        if nvcc:
            objs = []
            tmp = Path(self.build_temp) / "cuda"
            tmp.mkdir(parents=True, exist_ok=True)
            cuda_home = Path(nvcc).resolve().parent.parent
            for cu in sorted((CSRC / "cuda").glob("*.cu")):
                obj = tmp / (cu.stem + ".o")
                cmd = [
                    nvcc,
                    "-c",
                    str(cu),
                    "-o",
                    str(obj),
                    "-std=c++17",
                    "-O3",
                    "-Xcompiler",
                    "-fPIC,-Wall,-Wextra",
                    f"-I{CSRC}",
                    *CUDA_ARCH_FLAGS,
                ]
                print(" ".join(cmd))
                subprocess.check_call(cmd)
                objs.append(str(obj))
            ext.extra_objects = list(ext.extra_objects or []) + objs
            ext.define_macros = list(ext.define_macros or []) + [("PYCOLL_WITH_CUDA", "1")]
            ext.include_dirs = list(ext.include_dirs) + [str(cuda_home / "include")]
            ext.library_dirs = list(ext.library_dirs or []) + [
                str(cuda_home / "lib64"),
                str(cuda_home / "lib64" / "stubs"),
            ]
            ext.libraries = list(ext.libraries or []) + ["cudart"]
        super().build_extension(ext)


ext = Pybind11Extension(
    "pycollectives._C",
    _sources("*.cc"),
    include_dirs=[str(CSRC)],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-fno-strict-aliasing"],
    libraries=["rt"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
