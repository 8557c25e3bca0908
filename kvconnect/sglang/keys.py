"""How SGLang's pages become store keys. Pure: no sglang, no torch.

SGLang names a page by a chained SHA-256 of its tokens. That name says nothing about the
bytes' format, so the store key adds what makes two pages' bytes interchangeable: the model,
the host memory layout (``page_first`` and ``page_first_direct`` order bytes differently), the
dtype and the page size — and, for MHA models, which shard of the heads this TP rank holds.
MLA pages hold the whole latent KV on every rank: one object per page, shared by all ranks and
written by one. Each MHA page is two objects, its K and its V (two separate ranges of the
host pool); a page counts as stored only when all its objects are.

The ``page_head`` layout keeps each head's bytes of a page together, so instances of
different TP sizes can share pages: the heads are cut into ``tp_lcm_size`` shards (SGLang's
extra-config key, the least common multiple of the TP sizes; else this instance's TP size)
and each shard is a K and a V object named by its place among all heads, not by the rank. A
TP-1 instance with ``tp_lcm_size`` 2 writes shards 0 and 1 of every page; rank 1 of a TP-2
instance reads shard 1. Hybrid models' sidecar
pools (sliding window, Mamba state, indexer, draft) store their share of a page under the same
prefix with the pool in the suffix (:func:`sidecar_keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What determines a page's bytes, besides its tokens."""

    model: str
    layout: str
    dtype: str
    page_size: int
    mla: bool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    tp_lcm_size: int = 0  # SGLang's, for page_head: head shards of a page (0: tp_size)
    namespace: str = ""

    @property
    def head_split(self) -> int:
        """Head shards of this rank's part of a page: above 1 only for ``page_head`` MHA
        pages of an instance with fewer ranks than ``tp_lcm_size``."""
        if self.mla or self.layout != "page_head":
            return 1
        return (self.tp_lcm_size or self.tp_size) // self.tp_size


@dataclass(frozen=True, slots=True)
class PageKeys:
    """Turns page hashes into store keys: ``objects`` keys per page, page by page."""

    prefix: str
    suffixes: tuple[str, ...]

    @property
    def objects(self) -> int:
        """Store objects per page."""
        return len(self.suffixes)

    def keys(self, hashes: Sequence[str]) -> list[str]:
        """Every object key of ``hashes``, grouped by page, in page order."""
        return [f"{self.prefix}{h}{suffix}" for h in hashes for suffix in self.suffixes]

    def leading_pages(self, found: Sequence[bool]) -> int:
        """Pages from the first whose every object is in ``found`` (one flag per object)."""
        per_page = self.objects
        for page in range(len(found) // per_page):
            if not all(found[page * per_page : (page + 1) * per_page]):
                return page
        return len(found) // per_page


def page_keys(fmt: PageFormat) -> PageKeys:
    """The key scheme of one rank for pages of ``fmt``."""
    prefix, where = _placement(fmt)
    if fmt.mla:
        return PageKeys(prefix, (f"{where}/kv",))
    if fmt.layout == "page_head":  # shards of all heads: the same names at every TP size
        shards = fmt.tp_lcm_size or fmt.tp_size
        first = fmt.tp_rank * fmt.head_split
        names = [f"{where}/heads{g}of{shards}" for g in range(first, first + fmt.head_split)]
    else:
        names = [f"{where}/tp{fmt.tp_rank}of{fmt.tp_size}"]
    return PageKeys(prefix, tuple(f"{name}/{kv}" for name in names for kv in ("k", "v")))


def _placement(fmt: PageFormat) -> tuple[str, str]:
    """The key prefix of ``fmt``'s pages, and the part of a suffix naming the rank's share
    of a page that is not its TP shard (pipeline stage, context-parallel ranks)."""
    model = fmt.model.replace("/", "--")
    namespace = f"{fmt.namespace}/" if fmt.namespace else ""
    prefix = f"{namespace}sglang/{model}/{fmt.layout}/{fmt.dtype}/p{fmt.page_size}/"
    where = f"/pp{fmt.pp_rank}" if fmt.pp_size > 1 else ""
    if fmt.cp_size > 1:
        where += f"/cp{fmt.cp_rank}of{fmt.cp_size}"
    if fmt.dcp_size > 1:  # decode context parallelism shards the tokens of a page
        where += f"/dcp{fmt.dcp_rank}of{fmt.dcp_size}"
    return prefix, where


@dataclass(frozen=True, slots=True)
class SidecarFormat:
    """What determines a sidecar pool's bytes for a page, besides the page's format.

    ``name`` is SGLang's pool name (``swa``, ``mamba``, ``indexer``, ``draft``…); ``objects``
    the pool's objects per page (its ``get_page_buffer_meta`` ranges for one page); ``shared``
    whether every TP rank holds the same bytes (MLA-shaped pools: one object set, no rank).
    """

    name: str
    layout: str
    dtype: str
    objects: int
    shared: bool


def sidecar_keys(fmt: PageFormat, pool: SidecarFormat) -> PageKeys:
    """The key scheme of one rank for a sidecar pool's share of pages of ``fmt``: the page's
    prefix, then the pool's name, layout and dtype, so no pool's objects can be taken for the
    KV's (``/k``, ``/v``, ``/kv``) or another pool's."""
    prefix, where = _placement(fmt)
    shard = where if pool.shared else f"{where}/tp{fmt.tp_rank}of{fmt.tp_size}"
    tag = f"{shard}/{pool.name}.{pool.layout}.{pool.dtype}"
    return PageKeys(prefix, tuple(f"{tag}/{i}" for i in range(pool.objects)))
