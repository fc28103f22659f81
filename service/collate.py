"""Pure helpers between requests and a runtime batch: pad per-request arrays and stack them, split results back."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# Fill value of padding per batch key; 0 elsewhere ([PAD] is id 0, masks 0 = padding, zero features/boxes).
PAD_VALUES: Mapping[str, int] = {"tag_ids": -1, "phrase_index": -1}


def pad_to_shape(array: np.ndarray, shape: Sequence[int], value: float | int = 0) -> np.ndarray:
    """`array` padded at the end of every axis to `shape` with `value` (never cropped)."""
    array = np.asarray(array)
    if array.ndim != len(shape):
        raise ValueError(f"cannot pad a {array.ndim}-d array to shape {tuple(shape)}")
    widths = [(0, target - have) for have, target in zip(array.shape, shape)]
    if any(w < 0 for _, w in widths):
        raise ValueError(f"cannot pad shape {array.shape} to the smaller shape {tuple(shape)}")
    if not any(w for _, w in widths):
        return array
    return np.pad(array, widths, constant_values=value)


def _padded(items: Sequence[Mapping[str, np.ndarray]], pad_values: Mapping[str, int], leading: bool) -> dict[str, list[np.ndarray]]:
    """Per key, every item's array padded to the largest size on each axis (past the leading row axis if `leading`)."""
    if not items:
        raise ValueError("no items to batch")
    keys = set(items[0])
    for i, item in enumerate(items):
        if set(item) != keys:
            raise ValueError(f"item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    out = {}
    for key in items[0]:
        arrays = [np.asarray(item[key]) for item in items]
        ndims = {a.ndim for a in arrays}
        if len(ndims) != 1:
            raise ValueError(f"{key}: items have different numbers of dimensions {sorted(ndims)}")
        shape = np.max([a.shape for a in arrays], axis=0).tolist()
        value = pad_values.get(key, 0)
        out[key] = [pad_to_shape(a, [a.shape[0], *shape[1:]] if leading else shape, value) for a in arrays]
    return out


def pad_and_stack(items: Sequence[Mapping[str, np.ndarray]], pad_values: Mapping[str, int] = PAD_VALUES) -> dict[str, np.ndarray]:
    """One row per item: each key's arrays padded to the longest on every axis (tokens T, regions N) and stacked.

    Items are per-request dicts of arrays without a batch axis, e.g. input_ids (T,), region_features (N, D),
    or (2, N, D) for an NLVR2 pair; every item must have the same keys.
    """
    if len(items) == 1:  # nothing to pad: a batch axis on views of the item's arrays
        return {key: np.asarray(value)[None] for key, value in items[0].items()}
    return {key: np.stack(arrays) for key, arrays in _padded(items, pad_values, leading=False).items()}


def pad_and_concat(items: Sequence[Mapping[str, np.ndarray]], pad_values: Mapping[str, int] = PAD_VALUES) -> dict[str, np.ndarray]:
    """Like pad_and_stack for items that are already several rows each (e.g. one image x K captions)."""
    padded = _padded(items, pad_values, leading=True)
    counts = {key: [a.shape[0] for a in arrays] for key, arrays in padded.items()}
    if len({tuple(c) for c in counts.values()}) != 1:
        raise ValueError(f"items disagree on their numbers of rows per key: {counts}")
    return {key: np.concatenate(arrays) for key, arrays in padded.items()}


def split_rows(array: np.ndarray, counts: int | Sequence[int]) -> list[np.ndarray]:
    """A batch result back per request: `counts` rows each (an int n means n requests of one row)."""
    array = np.asarray(array)
    if isinstance(counts, int):
        if array.shape[0] != counts:
            raise ValueError(f"result has {array.shape[0]} rows, expected {counts}")
        return list(array)
    if sum(counts) != array.shape[0] or any(c < 0 for c in counts):
        raise ValueError(f"result has {array.shape[0]} rows, requests account for {list(counts)}")
    return np.split(array, np.cumsum(counts)[:-1])
