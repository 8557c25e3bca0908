"""Build hook for the optional native extension (csrc/); metadata lives in pyproject.toml.

The extension is optional so that machines without a compiler still install kvconnect and use the
pure-Python data path. Set KVCONNECT_REQUIRE_NATIVE=1 (CI does) to make a failed build an error.
"""

import os

from setuptools import Extension, setup

REQUIRED = os.environ.get("KVCONNECT_REQUIRE_NATIVE", "") == "1"

setup(
    ext_modules=[
        Extension(
            "kvconnect._native",
            sources=["csrc/native.c", "csrc/keytable.c"],
            depends=["csrc/keytable.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
            optional=not REQUIRED,
        )
    ]
)
