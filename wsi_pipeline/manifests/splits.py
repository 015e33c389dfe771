"""Seeded splits for manifests: label-stratified by slide, and grouped by patient.

Both splitters fix the *number* of items per split and stratum first and only then draw *which*
items go where, so the counts do not depend on the seed and the membership does not depend on
the order of the input rows (items are sorted by key before the seeded shuffle).

Counts per stratum follow the quota rule: for a stratum of ``n`` items and a split of fraction
``f``, the split receives ``floor(f n)`` or ``ceil(f n)`` items (never further than one item from
``f n``). Which splits of a stratum are rounded up is decided by the largest fractional part plus
the rounding carried over from the strata before it, so the split totals also stay within about
one item of ``f N``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["check_fractions", "quota_counts", "stratified_split", "grouped_split"]


def check_fractions(fractions: Mapping[str, float], *, what: str = "split fractions") -> dict[str, float]:
    """Return ``fractions`` as a dict after checking they are >= 0 and sum to 1.

    Raises
    ------
    ValueError
        Naming the offending fractions and the fix.
    """
    fr = {str(k): float(v) for k, v in fractions.items()}
    if not fr:
        raise ValueError(f"{what}: no splits given; pass e.g. {{'train': 0.8, 'val': 0.1, 'test': 0.1}}")
    bad = {k: v for k, v in fr.items() if not (v >= 0.0 and math.isfinite(v))}
    if bad:
        raise ValueError(f"{what}: fractions must be finite and >= 0, found {bad}")
    total = sum(fr.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"{what}: fractions must sum to 1, found {fr} (sum {total:.6g})")
    return fr


def normalise_fractions(fractions: Mapping[str, float], *, what: str = "split fractions") -> dict[str, float]:
    """Return ``fractions`` scaled to sum to 1 (e.g. ``{"train": 2, "val": 1, "test": 1}``), checked.

    Raises
    ------
    ValueError
        When a fraction is negative or not finite, or none is positive.
    """
    fr = {str(k): float(v) for k, v in fractions.items()}
    total = sum(fr.values())
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"{what}: {fr} must have positive fractions")
    return check_fractions({k: v / total for k, v in fr.items()}, what=what)


def quota_counts(sizes: Sequence[int], fractions: Mapping[str, float]) -> np.ndarray:
    """Integer item counts per (stratum, split) under the quota rule.

    Parameters
    ----------
    sizes : number of items in each stratum, in the order the strata are processed.
    fractions : split name -> fraction (sums to 1).

    Returns
    -------
    int64 array (n_strata, n_splits): row ``g`` sums to ``sizes[g]``; every entry is
    ``floor`` or ``ceil`` of ``sizes[g] * fraction``; splits rounded up within a stratum are
    those with the largest fractional part plus the deficit carried from earlier strata
    (ties go to the split listed first).
    """
    fr = np.array(list(check_fractions(fractions).values()))
    fr = fr / fr.sum()
    counts = np.zeros((len(sizes), len(fr)), np.int64)
    carry = np.zeros(len(fr))  # exact minus assigned, summed over the strata done so far
    for g, n in enumerate(sizes):
        exact = fr * int(n)
        base = np.floor(exact + 1e-9)
        frac = np.where(exact - base > 1e-9, exact - base, 0.0)
        extra = int(n) - int(base.sum())
        eligible = np.flatnonzero(frac > 0)
        # stable sort on the negated priority: ties keep the order the splits were given in
        order = eligible[np.argsort(-(frac[eligible] + carry[eligible]), kind="stable")]
        up = np.zeros(len(fr))
        up[order[:extra]] = 1
        counts[g] = (base + up).astype(np.int64)
        carry += exact - counts[g]
    return counts


def stratified_split(
    keys: Iterable[str],
    strata: Iterable[object],
    fractions: Mapping[str, float],
    *,
    seed: int,
) -> np.ndarray:
    """Assign each item to a split, stratified by ``strata``, reproducibly for a seed.

    Parameters
    ----------
    keys : unique item identifiers (e.g. slide ids), length N; they fix the order before the shuffle.
    strata : stratum of each item (e.g. the label), length N.
    fractions : split name -> fraction, e.g. ``{"train": 0.8, "val": 0.1, "test": 0.1}``.
    seed : seed of the shuffle (``numpy.random.default_rng``).

    Returns
    -------
    object array (N,) of split names, aligned with ``keys``.
    """
    key_s = pd.Series(list(keys), dtype="string")
    strata_s = pd.Series(list(strata), dtype="object")
    if len(key_s) != len(strata_s):
        raise ValueError(f"stratified_split: {len(key_s)} keys but {len(strata_s)} strata; give one stratum per item")
    if key_s.duplicated().any():
        raise ValueError(f"stratified_split: duplicate keys {key_s[key_s.duplicated()].unique().tolist()[:5]}; keys must be unique")
    fr = check_fractions(fractions)
    names = np.array(list(fr), dtype=object)
    rng = np.random.default_rng(seed)
    out = np.empty(len(key_s), dtype=object)
    stratum_keys = strata_s.map(repr)
    levels = sorted(stratum_keys.unique())
    members = [np.flatnonzero((stratum_keys == s).to_numpy()) for s in levels]
    counts = quota_counts([len(m) for m in members], fr)
    for idx, row in zip(members, counts):
        idx = idx[np.argsort(key_s.iloc[idx].to_numpy(dtype=str), kind="stable")]
        idx = idx[rng.permutation(len(idx))]
        out[idx] = np.repeat(names, row)
    return out


def grouped_split(
    keys: Sequence[str],
    groups: Sequence[str],
    fractions: Mapping[str, float],
    *,
    seed: int,
    group_strata: Mapping[str, object] | None = None,
) -> np.ndarray:
    """Assign each item to a split with every group (patient) wholly inside one split.

    Groups, not items, are split (stratified by ``group_strata`` when given), so the fractions
    apply to the number of groups.

    Parameters
    ----------
    keys : unique item identifiers, length N.
    groups : group of each item (e.g. patient id), length N.
    fractions : split name -> fraction of the groups.
    seed : seed of the shuffle.
    group_strata : optional group -> stratum (e.g. the patient's pN stage); one stratum if omitted.

    Returns
    -------
    object array (N,) of split names, aligned with ``keys``.
    """
    group_s = pd.Series(list(groups), dtype="string")
    if len(group_s) != len(keys):
        raise ValueError(f"grouped_split: {len(keys)} keys but {len(group_s)} groups; give one group per item")
    if len(set(keys)) != len(keys):
        raise ValueError("grouped_split: keys must be unique")
    uniq = sorted(group_s.unique())
    strata: list[object]
    if group_strata is None:
        strata = [0] * len(uniq)
    else:
        missing = [g for g in uniq if g not in group_strata]
        if missing:
            raise ValueError(f"grouped_split: no stratum for group(s) {missing[:5]}; give group_strata for every group")
        strata = [group_strata[g] for g in uniq]
    split_of_group = dict(zip(uniq, stratified_split(uniq, strata, fractions, seed=seed)))
    return np.array([split_of_group[g] for g in group_s], dtype=object)
