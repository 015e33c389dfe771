"""``--shard K/N``: the K-th of N disjoint, deterministic subsets of a cohort's slides.

For plain job arrays (``sbatch --array=1-N``): array task K runs ``--shard K/N`` on the same
slide list and ``--out``; together the N tasks tile every slide exactly once, and each merges
its rows into the shared ``tiling_report.csv`` under the report lock.

The split sorts the slides by ``(slide_id, path)`` and deals them out round-robin, so shard
sizes differ by at most one and do not depend on the order of a manifest's rows. The same
slide list always gives the same split; adding slides may move others to another shard (a
store already complete is then ``skipped`` there, so a rerun after adding slides stays cheap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

__all__ = ["parse_shard", "shard_indices", "shard_items"]

class SlideItem(Protocol):
    """What sharding reads of an item: its slide id and path (any value; compared as text)."""

    @property
    def slide_id(self) -> object: ...

    @property
    def path(self) -> object: ...


T = TypeVar("T", bound=SlideItem)


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with 1 <= K <= N (1-based, as ``$SLURM_ARRAY_TASK_ID`` of ``--array=1-N``).

    Raises
    ------
    ValueError : not of the form K/N with integers 1 <= K <= N.
    """
    parts = str(text).strip().split("/")
    try:
        if len(parts) != 2:
            raise ValueError
        k, n = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N with integers 1 <= K <= N, e.g. 3/8") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text!r}: K={k} must lie in 1..N (N={n}); array tasks count from 1 (sbatch --array=1-{n})")
    return k, n


def shard_indices(keys: Sequence[tuple[str, str]], k: int, n: int) -> list[int]:
    """Indices (ascending) of the items of shard ``k`` of ``n``, given each item's ``(slide_id, path)`` key."""
    if not 1 <= k <= n:
        raise ValueError(f"shard {k}/{n}: K must lie in 1..N")
    order = sorted(range(len(keys)), key=lambda i: (keys[i], i))
    return sorted(order[k - 1::n])


def shard_items(items: Sequence[T], k: int, n: int) -> list[T]:
    """The items (objects with ``slide_id`` and ``path``) of shard ``k`` of ``n``, in their original order."""
    keys = [(str(x.slide_id), str(x.path)) for x in items]
    return [items[i] for i in shard_indices(keys, k, n)]
