"""The one compiled part of kvbroker: the SIGBUS guard (kvbroker/memory/_memguard.c); the rest is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvbroker.memory._memguard", ["kvbroker/memory/_memguard.c"],
                             extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Werror"])])
