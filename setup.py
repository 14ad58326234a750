"""Builds native/ into the extension module transfer._native (plain C, CPython API only)."""
from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transfer._native",
            sources=sorted(glob("native/*.c")),
            include_dirs=["native"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
