"""Build hook for the optional C hot path; all project metadata lives in pyproject.toml.

``shmstat._fastpath`` is optional: when it cannot be compiled (no compiler, no Python headers) the install
still succeeds and ``Stat.add`` uses the pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("shmstat._fastpath", ["shmstat/_fastpath.c"], optional=True, extra_compile_args=["-O2"]),
    ],
)
