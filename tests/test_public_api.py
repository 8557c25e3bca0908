"""The public surface is declared, and importing kvconnect stays light."""

from __future__ import annotations

import subprocess
import sys

import kvconnect
import kvconnect.errors
import kvconnect.transfer


def test_every_exported_error_is_a_kvconnect_error() -> None:
    for name in kvconnect.errors.__all__:
        cls = getattr(kvconnect.errors, name)
        assert issubclass(cls, kvconnect.errors.KVConnectError), name


def test_public_names_snapshot() -> None:
    assert sorted(kvconnect.transfer.__all__) == [
        "Capabilities",
        "EmbeddedMetadata",
        "EngineStats",
        "FileSource",
        "ListenerStats",
        "MemoryKind",
        "MemoryRegion",
        "MetadataBackend",
        "P2PMetadata",
        "RegionInfo",
        "SegmentDescriptor",
        "SegmentRegistry",
        "TransferBatch",
        "TransferConfig",
        "TransferEngine",
        "TransferOp",
        "TransferRequest",
        "TransferStatus",
        "Transport",
        "TransportStats",
    ]
    for name in kvconnect.__all__:
        assert hasattr(kvconnect, name), name


def test_import_pulls_no_heavy_dependency() -> None:
    code = (
        "import sys, kvconnect, kvconnect.transfer; "
        "heavy = ('torch', 'cupy', 'sglang', 'vllm', 'pyverbs', 'matplotlib', 'pyetcd', 'grpc'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_library_installs_no_logging_handler_but_a_null_one() -> None:
    import logging

    handlers = logging.getLogger("kvconnect").handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]
