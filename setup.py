"""Builds kvshard._kvshard with the project's CMake (pyproject.toml holds the metadata).

Environment:
  KVSHARD_CMAKE_BUILD_DIR  reuse this CMake build tree (e.g. build/) instead of a fresh one; it
                           keeps the interpreter it was configured for (same Python version)
  KVSHARD_BUILD_JOBS       parallel compile jobs (default: all CPUs)
"""

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE_DIR = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        reuse = os.environ.get("KVSHARD_CMAKE_BUILD_DIR")
        build = pathlib.Path(reuse or self.build_temp).resolve()
        configure = ["cmake", "-S", str(SOURCE_DIR), "-B", str(build), "-DKVSHARD_PYTHON=ON"]
        if not reuse:
            configure += [f"-DPython3_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                          "-DKVSHARD_BUILD_TESTS=OFF",
                          "-DKVSHARD_BUILD_BENCH=OFF"]
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("KVSHARD_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build), "--target", "kvshard_python", "-j", jobs],
                       check=True)
        built = sorted((build / "python" / "kvshard").glob("_kvshard*.so"))
        if not built:
            raise RuntimeError(f"kvshard: no _kvshard module under {build}/python/kvshard")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], target)


setup(ext_modules=[CMakeExtension("kvshard._kvshard")], cmdclass={"build_ext": CMakeBuild})
