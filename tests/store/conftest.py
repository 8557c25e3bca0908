"""The master's pure tests run once per key index: the C table and the Python reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnect.store.master import objects
from kvconnect.store.master.keys import KeyTable, PythonKeyTable, native_key_table

KEY_TABLES = ["native", "python"]


def make_key_table(kind: str) -> KeyTable:
    """A new index of ``kind``; the native one must really be built."""
    if kind == "python":
        return PythonKeyTable()
    table = native_key_table()
    if table is None:
        pytest.fail("kvconnect._native is not built (setup.py build_ext --inplace)")
    return table


@pytest.fixture(scope="module", params=KEY_TABLES)
def key_table(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every ObjectTable the module's tests create uses this kind of index. Module-scoped so
    that hypothesis tests may use it (one patch for all their examples)."""
    kind: str = request.param
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(objects, "new_key_table", lambda _mode: make_key_table(kind))
        yield kind
