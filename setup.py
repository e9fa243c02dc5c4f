"""Build mok_megatron, with its CUDA extension ``mok_megatron._C`` when it can be built.

The extension is built from every ``csrc/**/*.cpp`` and ``csrc/**/*.cu`` when nvcc is found and
the installed torch is a CUDA build; otherwise (or with ``MOK_SKIP_CUDA=1``) the pure-Python
package is installed and one line says why.

Environment:
  MOK_ARCH              comma list of sm_90a, sm_100a, sm_103a (wins over TORCH_CUDA_ARCH_LIST)
  TORCH_CUDA_ARCH_LIST  9.0a -> sm_90a, 10.0a -> sm_100a, 10.3a -> sm_103a; default sm_90a
  MOK_SKIP_CUDA=1       install without the extension
  MAX_JOBS              parallel compile jobs (ninja)

  pip install . --no-build-isolation        (torch must be importable while building)
  pip install -e . --no-build-isolation
  python setup.py build_ext --inplace
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
TORCH_ARCH_NAMES = {"sm_90a": "9.0a", "sm_100a": "10.0a", "sm_103a": "10.3a"}
NVCC_FLAGS = ["-O3", "-DNDEBUG", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]


def _parse_arch_list() -> list[str]:
    """Target architectures: MOK_ARCH, else TORCH_CUDA_ARCH_LIST, else sm_90a."""
    if os.environ.get("MOK_ARCH"):
        archs = [a.strip() for a in os.environ["MOK_ARCH"].split(",") if a.strip()]
        bad = [a for a in archs if a not in SUPPORTED_ARCHS]
        if bad:
            raise SystemExit(f"MOK_ARCH={os.environ['MOK_ARCH']!r}: {bad} not in {SUPPORTED_ARCHS}")
        return archs
    archs = []
    for entry in re.split(r"[;, ]+", os.environ.get("TORCH_CUDA_ARCH_LIST", "")):
        match = re.fullmatch(r"(9\.0|10\.0|10\.3)a?(\+PTX)?", entry.strip())
        if match:
            arch = "sm_" + match.group(1).replace(".", "") + "a"
            if arch not in archs:
                archs.append(arch)
    return archs or ["sm_90a"]


def _gencode_flags(archs: list[str]) -> list[str]:
    # Explicit -gencode per arch: `-arch=sm_90a` alone does not give wgmma-capable SASS.
    return [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]


def _find_cuda_home() -> str | None:
    """A CUDA root with bin/nvcc and the runtime headers (a bare nvcc wrapper is not enough)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for root in filter(None, candidates):
        has_nvcc = os.path.exists(os.path.join(root, "bin", "nvcc"))
        if has_nvcc and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return root
    return None


def _cutlass_include_dir() -> str | None:
    try:
        import cutlass_library
    except ImportError:
        return None
    include = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return include if os.path.isdir(os.path.join(include, "cute")) else None


def _why_no_extension() -> str | None:
    """None when the CUDA extension can be built, else the reason it cannot."""
    if os.environ.get("MOK_SKIP_CUDA") == "1":
        return "MOK_SKIP_CUDA=1"
    try:
        import torch
    except ImportError:
        return "torch is not importable while building (use pip's --no-build-isolation)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return "nvcc (with the CUDA runtime headers) was not found; set CUDA_HOME"
    os.environ["CUDA_HOME"] = cuda_home  # read when torch.utils.cpp_extension is imported
    return None


def _extension_setup_args() -> dict:
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    archs = _parse_arch_list()
    # Keep torch's own arch logic consistent; the -gencode flags below are the only ones used.
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(TORCH_ARCH_NAMES[a] for a in archs)
    sources = sorted(
        glob.glob("csrc/**/*.cpp", root_dir=ROOT, recursive=True)
        + glob.glob("csrc/**/*.cu", root_dir=ROOT, recursive=True)
    )
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    cutlass = _cutlass_include_dir()
    include_dirs += [cutlass] if cutlass else []
    defines = [f"-DMOK_HAS_CUTLASS={1 if cutlass else 0}"]
    extension = CUDAExtension(
        name="mok_megatron._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": CXX_FLAGS + defines,
            "nvcc": NVCC_FLAGS + defines + _gencode_flags(archs),
        },
    )
    return {
        "ext_modules": [extension],
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
    }


def main() -> None:
    reason = _why_no_extension()
    if reason is None:
        extension_args = _extension_setup_args()
    else:
        print(f"mok_megatron: installing the pure-Python package only ({reason})", file=sys.stderr)
        extension_args = {}
    setup(
        packages=find_packages(include=["mok_megatron", "mok_megatron.*"]),
        package_data={"mok_megatron": ["tuned/*.yaml"]},  # MoKConfig's "auto" knobs read them
        **extension_args,
    )


if __name__ == "__main__":
    main()
