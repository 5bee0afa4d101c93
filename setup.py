"""The one compiled part of kvbroker: the SIGBUS guard (kvbroker/_memguard.c). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvbroker._memguard", ["kvbroker/_memguard.c"],
                             extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Werror"])])
