"""Child processes that run ``python -m tests.support.…``.

Such a child imports ``tests``, so the checkout's root must be on its ``sys.path`` whatever its
working directory and environment are (the main venv, each engine's venv, the RDMA VM, where
``PYTHONPATH`` already names pyverbs).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """``os.environ`` with the checkout's root prepended to ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), path]))}
