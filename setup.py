"""Build hook for the optional C hot path; all project metadata lives in pyproject.toml.

``shmstat._fastpath``, ``shmstat._pubfast`` and ``collector._intake`` are optional: when they cannot be compiled (no
compiler, no Python headers) the install still succeeds and ``Stat.add``, the publisher and the collector's intake
use their pure-Python paths (``shmstat._backend``). Their shared constants come from ``shmstat/_c/layout.h``, which
is generated from the Python modules (``shmstat._clayout``) before the build when shmstat can be imported here, and
otherwise used as committed (tests/project/test_c_layout.py keeps the committed one current).
"""

import sys
from pathlib import Path

from setuptools import Extension, setup

_ROOT = Path(__file__).resolve().parent


def _generate_layout_header() -> None:
    sys.path.insert(0, str(_ROOT))
    try:
        from shmstat._clayout import main
    except Exception as exc:  # an isolated build without shmstat's dependencies: the committed header
        print(f"setup.py: shmstat/_c/layout.h not regenerated ({exc}); using the committed one", file=sys.stderr)
        return
    finally:
        sys.path.pop(0)
    main([])


_generate_layout_header()
_LAYOUT = ["shmstat/_c/layout.h"]

setup(
    ext_modules=[
        Extension("shmstat._fastpath", ["shmstat/_fastpath.c"], optional=True, extra_compile_args=["-O2"],
                  depends=_LAYOUT),
        Extension("shmstat._pubfast", ["shmstat/_pubfast.c"], optional=True, extra_compile_args=["-O2"],
                  depends=_LAYOUT + [f"shmstat/_c/{part}.h" for part in ("pack", "outbox_publish", "outbox_send",
                                                                         "event", "log_event")]),
        Extension("collector._intake", ["collector/_intake.c"], optional=True, extra_compile_args=["-O2"],
                  depends=_LAYOUT),
    ],
)
