"""Host-pool slots a transfer may still touch, kept from reuse until it lets go.

SGLang frees the host slots of pages the backend reported missing (a read) and, later, of
pages it backed up (a write), and hands them to other requests. A transfer that could not be
stopped by its deadline (the store client's ``Code.UNSETTLED``) may still write into those
slots (read) or read them (write): a late write would land in another request's KV. So the
backend withholds exactly those slots: it wraps the pool's ``free`` and ``clear``, keeps
withheld slots that SGLang frees out of the pool, and frees them itself once the transfer has
settled (``BatchResult.on_settled``, on a transport thread).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvconnect.store.client import BatchResult
from kvconnect.store.messages import Code


class WithheldSlots:
    """Wraps one SGLang host pool (``HostKVCache``); thread-safe under the pool's own lock.

    Installed at attach (the scheduler thread), called by SGLang from its scheduler and cache
    controller threads (``free``, ``clear``) and by transport threads (:meth:`release`).
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._lock = pool.lock  # an RLock: the pool's own methods nest inside our sections
        self._holds: Counter[int] = Counter()  # slot -> unsettled transfers touching it
        self._freed: set[int] = set()  # withheld slots SGLang has freed: ours to free later
        self._free = pool.free
        self._clear = pool.clear
        pool.free = self._free_unless_withheld
        pool.clear = self._clear_keeping_withheld

    def hold(self, slots: torch.Tensor) -> None:
        """Withhold ``slots`` (token slots of the pool) until :meth:`release` of the same."""
        with self._lock:
            self._holds.update(slots.tolist())

    def release(self, slots: torch.Tensor) -> None:
        """The transfer that touched ``slots`` has settled: the ones SGLang freed meanwhile go
        back to the pool now; the others are SGLang's again."""
        with self._lock:
            ready = []
            for slot in slots.tolist():
                self._holds[slot] -= 1
                if self._holds[slot] == 0:
                    del self._holds[slot]
                    if slot in self._freed:
                        self._freed.discard(slot)
                        ready.append(slot)
            if ready:
                self._free(torch.tensor(ready, dtype=torch.int64))

    @property
    def withheld(self) -> int:
        """Slots withheld now (held by a transfer that has not settled)."""
        with self._lock:
            return len(self._holds)

    def uninstall(self) -> None:
        """Give the pool its own ``free``/``clear`` back (at detach), unless slots are still
        withheld: then they stay out of the pool, which is the safe side."""
        with self._lock:
            if not self._holds:
                del self._pool.free, self._pool.clear

    def _free_unless_withheld(self, indices: torch.Tensor) -> int:
        with self._lock:
            if not self._holds:
                return int(self._free(indices))
            indices = indices.cpu()
            keep = torch.tensor(sorted(self._holds), dtype=torch.int64)
            withheld = torch.isin(indices, keep)
            self._freed.update(indices[withheld].tolist())
            self._free(indices[~withheld])
            return len(indices)  # SGLang counts them freed; they come back at release

    def _clear_keeping_withheld(self) -> None:
        # clear() makes every slot free (flush_cache): take the withheld ones out again, by
        # allocating everything and freeing the rest back; they count as freed by SGLang.
        with self._lock:
            self._clear()
            if not self._holds:
                return
            everything = self._pool.alloc(self._pool.available_size())
            keep = torch.tensor(sorted(self._holds), dtype=torch.int64)
            self._free(everything[~torch.isin(everything, keep)])
            self._freed = set(self._holds)


def pages_with(codes: Sequence[Code], objects: int, code: Code) -> list[int]:
    """The pages (of ``objects`` consecutive codes each) with an object of ``code``."""
    return [
        page
        for page in range(len(codes) // objects)
        if code in codes[page * objects : (page + 1) * objects]
    ]


def withhold_unsettled(
    pools: Iterable[WithheldSlots],
    host_indices: torch.Tensor,
    page_size: int,
    codes: Sequence[Code],
    objects: int,
    result: BatchResult,
) -> int:
    """Withhold in each of ``pools`` the host slots of the pages (``page_size`` slots and
    ``objects`` codes each) with an UNSETTLED object, until ``result`` settles; the pages
    withheld. Call before SGLang gets the result: it may free the slots at once."""
    unsettled = pages_with(codes, objects, Code.UNSETTLED)
    if not unsettled:
        return 0
    slots = torch.cat([host_indices[p * page_size : (p + 1) * page_size] for p in unsettled])
    for withheld in pools:
        withheld.hold(slots)
        result.on_settled(functools.partial(withheld.release, slots))
    return len(unsettled)
