"""What a deduplicator or a selector did to each row, for the decision log.

Data-Juicer drops duplicates and unpicked rows without saying why: a deduplicator keeps the
first row of each cluster of equal hashes (exact) or of connected near-duplicates (MinHash LSH
buckets, SimHash pairs), a selector keeps the rows its order puts first. Here the same
clusters and orders are recomputed from the hash columns and field values, so every dropped
row names the row it duplicates and every unpicked row carries its value and rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

HASH = "__dj__hash"
MINHASH = "__dj__minhash"
SIMHASH = "__dj__simhash"
UID = "__dj__uid"


def _column(data, name: str) -> list:
    """A whole column as a list (indexing a datasets Column item by item is slow)."""
    return data.data.column(name).to_pylist() if data._indices is None else list(data[name])


def _clusters(keys: Iterable) -> list[list[int]]:
    rows: dict[Any, list[int]] = defaultdict(list)
    for index, key in enumerate(keys):
        rows[key].append(index)
    return [members for members in rows.values() if len(members) > 1]


def _roots(n: int, clusters: Iterable[list[int]], rank: list | None = None) -> list[int]:
    """Union-find over row indexes; each row's root is its component's lowest-ranked member
    (the row Data-Juicer keeps)."""
    rank = list(range(n)) if rank is None else rank
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for members in clusters:
        root = find(members[0])
        for member in members[1:]:
            other = find(member)
            if other != root:
                low, high = (root, other) if rank[root] < rank[other] else (other, root)
                parent[high], root = low, low
    return [find(i) for i in range(n)]


def deduplicate(op, data) -> tuple[Any, dict[int, int | None]]:
    """(what op.run(data) returns, {dropped id: id of the kept row it duplicates}); the kept
    row is None for a deduplicator whose clusters are not recomputed here."""
    hashed = op.run(data, reduce=False)  # Data-Juicer's own hashing, not a copy of it
    output, _ = op.process(hashed, 0)
    ids, n = _column(hashed, "id"), len(hashed)
    clusters, rank = _dedup_clusters(op, hashed)
    if clusters is None:
        kept = set(_column(output, "id"))
        return output, {row_id: None for row_id in ids if row_id not in kept}
    roots = _roots(n, clusters, rank) if n > 1 else list(range(n))
    return output, {ids[i]: ids[root] for i, root in enumerate(roots) if root != i}


def _dedup_clusters(op, hashed) -> tuple[list[list[int]] | None, list | None]:
    name = op._name
    if name == "document_deduplicator":
        return _clusters(_column(hashed, HASH)), None
    if name in ("document_minhash_deduplicator", "document_minhash_deduplicator_with_uid"):
        bands = _column(hashed, MINHASH)
        clusters = [members for band in range(op.num_bands)
                    for members in _clusters(row[band] for row in bands)]
        return clusters, (_column(hashed, UID) if name.endswith("_with_uid") else None)
    if name == "document_simhash_deduplicator":
        import numpy as np
        from data_juicer.ops.deduplicator.document_simhash_deduplicator import simhash

        values = _column(hashed, SIMHASH)
        first: dict[str, int] = {}
        for index, value in enumerate(values):
            first.setdefault(value, index)
        pairs = simhash.find_all(np.uint64(values), op.num_blocks, op.hamming_distance)
        return _clusters(values) + [[first[str(a)], first[str(b)]] for a, b in pairs], None
    return None, None


def selector_ranks(op, data) -> dict[int, dict[str, Any]]:
    """{id: {"field", "value", "rank", "of"}} in the order the selector uses (rank 1 first):
    topk by its `reverse` (descending by default), range ascending, frequency by how often
    the value occurs; a random selector has no order (rank None)."""
    ids, n = _column(data, "id"), len(data)
    field = getattr(op, "field_key", "") or ""
    if not field:
        return {row_id: {"field": None, "value": None, "rank": None, "of": n} for row_id in ids}
    values = _field_values(data, field)
    if op._name == "frequency_specified_field_selector":
        counts: dict[Any, int] = defaultdict(int)
        for value in values:
            counts[_hashable(value)] += 1
        order = sorted(dict.fromkeys(_hashable(v) for v in values),
                       key=lambda v: counts[v], reverse=bool(getattr(op, "reverse", True)))
        position = {value: rank for rank, value in enumerate(order, 1)}
        ranks = [position[_hashable(v)] for v in values]
    else:
        from data_juicer.utils.common_utils import stats_to_number

        descending = bool(getattr(op, "reverse", False))
        numbers = [stats_to_number(v, descending) for v in values]
        order = sorted(range(n), key=numbers.__getitem__, reverse=descending)
        ranks = [0] * n
        for rank, index in enumerate(order, 1):
            ranks[index] = rank
    return {row_id: {"field": field, "value": _plain(value), "rank": rank, "of": n}
            for row_id, value, rank in zip(ids, values, ranks)}


def _field_values(data, field: str) -> list:
    head, *rest = field.split(".")
    values = []
    for item in _column(data, head):
        for key in rest:
            item = item.get(key) if isinstance(item, dict) else None
        values.append(item)
    return values


def _hashable(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
