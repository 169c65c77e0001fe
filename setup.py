"""Builds pycollectives._C from csrc/.

The core includes and links no torch: it builds in seconds from C++17 sources
with pybind11. PYCOLL_CUDA=auto|0|1 decides whether the CUDA sources in
csrc/cuda/ are compiled (auto: when nvcc is found).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
# Never --use_fast_math, -ftz=true or -prec-div=false: the kernels reproduce the
# CPU kernels' IEEE results bit for bit (csrc/cuda/kernels_device.cuh).
NVCC_FLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-Wall,-Wextra"]


def _find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cuda_home(nvcc: str) -> Path:
    """The CUDA toolkit directory (include/, lib64/) that `nvcc` belongs to.

    nvcc may be a wrapper script (/usr/local/bin/nvcc): ask nvcc itself, through
    the TOP directory that `nvcc -dryrun` prints, before guessing from its path.
    Raises SystemExit when no directory with include/cuda_runtime_api.h is found.
    """
    candidates = []
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidates.append(Path(home))
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "--version"], capture_output=True, text=True, timeout=60
        )
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("#$ TOP="):
                candidates.append(Path(line.split("=", 1)[1].strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    candidates += [Path(nvcc).resolve().parent.parent, Path("/usr/local/cuda")]
    for c in candidates:
        if (c / "include" / "cuda_runtime_api.h").exists():
            return c.resolve()
    raise SystemExit(f"no CUDA toolkit with include/cuda_runtime_api.h found for {nvcc}")


def _cuda_lib_dir(home: Path) -> Path:
    """The directory of libcudart_static.a under the toolkit `home`."""
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        if (home / sub / "libcudart_static.a").exists():
            return home / sub
    raise SystemExit(f"libcudart_static.a not found under {home}")


def _cuda_files(pattern: str) -> list[Path]:
    return sorted((CSRC / "cuda").glob(pattern))


def _cuda_mode() -> str | None:
    """Returns the nvcc path when CUDA sources are to be built, else None.

    Raises SystemExit for a bad PYCOLL_CUDA or when PYCOLL_CUDA=1 and nvcc is missing.
    """
    mode = os.environ.get("PYCOLL_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"PYCOLL_CUDA must be auto, 0 or 1, not {mode!r}")
    if mode == "0":
        return None
    nvcc = _find_nvcc()
    if nvcc is None and mode == "1":
        raise SystemExit("PYCOLL_CUDA=1 but nvcc was not found (set CUDA_HOME or PATH)")
    if not _cuda_files("*.cu") and not _cuda_files("*.cc"):
        if mode == "1":
            raise SystemExit("PYCOLL_CUDA=1 but csrc/cuda has no sources")
        return None
    return nvcc


def _sources(pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob(pattern) if "cuda" not in p.parts)


def _headers() -> list[Path]:
    return [p for ext in ("*.h", "*.cuh") for p in CSRC.rglob(ext)]


def _compile_cu(nvcc: str, sources: list[Path], tmp: Path) -> list[str]:
    """Compiles each .cu file with nvcc, in parallel, skipping objects newer than
    their source and every header; returns the object paths.

    Raises subprocess.CalledProcessError when nvcc fails (so a build, and CI, fail).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    newest_header = max((h.stat().st_mtime for h in _headers()), default=0.0)
    jobs = []
    objs = []
    for cu in sources:
        obj = tmp / (cu.stem + ".o")
        objs.append(str(obj))
        if obj.exists() and obj.stat().st_mtime > max(cu.stat().st_mtime, newest_header):
            continue
        jobs.append((cu, obj))
    if not jobs:
        return objs
    cpus = os.cpu_count() or 1
    workers = max(1, min(len(jobs), cpus))
    threads = max(1, cpus // workers)  # nvcc --threads: its gencode targets in parallel

    def run(job: tuple[Path, Path]) -> None:
        cu, obj = job
        cmd = [nvcc, "-c", str(cu), "-o", str(obj), *NVCC_FLAGS, f"-I{CSRC}", *CUDA_ARCH_FLAGS]
        cmd += [f"--threads={threads}"]
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)

    with ThreadPoolExecutor(workers) as pool:
        for fut in [pool.submit(run, j) for j in jobs]:
            fut.result()
    return objs


class BuildExt(build_ext):
    """build_ext that, with CUDA enabled, compiles csrc/cuda/*.cu with nvcc and
    csrc/cuda/*.cc with the C++ compiler, defines PYCOLL_WITH_CUDA and links the
    CUDA runtime statically (the module imports without libcudart or a driver)."""

    def build_extension(self, ext):  # noqa: D102
        nvcc = _cuda_mode()
        if nvcc:
            home = _cuda_home(nvcc)
            cu = _cuda_files("*.cu")
            objs = _compile_cu(nvcc, cu, Path(self.build_temp) / "cuda")
            ext.extra_objects = list(ext.extra_objects or []) + objs
            ext.sources = list(ext.sources) + [
                str(p.relative_to(ROOT)) for p in _cuda_files("*.cc")
            ]
            ext.depends = list(ext.depends) + [str(p) for p in cu]
            ext.define_macros = list(ext.define_macros or []) + [("PYCOLL_WITH_CUDA", "1")]
            ext.include_dirs = list(ext.include_dirs) + [str(home / "include")]
            ext.library_dirs = list(ext.library_dirs or []) + [str(_cuda_lib_dir(home))]
            ext.libraries = list(ext.libraries or []) + ["cudart_static", "dl", "rt", "pthread"]
        super().build_extension(ext)


ext = Pybind11Extension(
    "pycollectives._C",
    _sources("*.cc"),
    include_dirs=[str(CSRC)],
    depends=[str(p.relative_to(ROOT)) for p in _headers()],  # a header edit rebuilds too
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-fno-strict-aliasing"],
    libraries=["rt"],
    extra_link_args=["-pthread"],
)


def _packages() -> tuple[list[str], dict[str, str]]:
    """The packages and where their folders are: pycollectives/ and, below it in the
    import namespace, the strategies/ folder of the repository's root, installed and
    imported as pycollectives.strategies (a top-level `strategies` would clash with PyPI's
    package of that name and with any user project's strategies/ folder)."""
    ours = find_packages(include=["pycollectives", "pycollectives.*"])
    strategies = ["pycollectives.strategies"] + [
        f"pycollectives.strategies.{p}" for p in find_packages(where="strategies")
    ]
    return ours + strategies, {"pycollectives.strategies": "strategies"}


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
