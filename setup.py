"""Build hook for the optional C hot path; all project metadata lives in pyproject.toml.

``shmstat._fastpath``, ``shmstat._pubfast`` and ``collector._intake`` are optional: when they cannot be compiled (no
compiler, no Python headers) the install still succeeds and ``Stat.add``, the publisher and the collector's intake
use their pure-Python paths.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("shmstat._fastpath", ["shmstat/_fastpath.c"], optional=True, extra_compile_args=["-O2"]),
        Extension("shmstat._pubfast", ["shmstat/_pubfast.c"], optional=True, extra_compile_args=["-O2"],
                  depends=[f"shmstat/_c/{part}.h" for part in ("pack", "outbox_publish", "outbox_send", "event",
                                                               "log_event")]),
        Extension("collector._intake", ["collector/_intake.c"], optional=True, extra_compile_args=["-O2"]),
    ],
)
