"""Hash tags spread over a cluster's slot space, for keys partitioned on purpose.

The agent inbox and the webhook outbox each split their keys into partitions; partition n
of P takes a hash tag whose slot lies in the n-th of P equal slot ranges, so on a cluster
whose primaries split the slots evenly the partitions spread evenly too.
"""

from __future__ import annotations

import functools

from redis.crc import REDIS_CLUSTER_HASH_SLOTS as SLOTS
from redis.crc import key_slot


@functools.cache
def spread_tags(count: int) -> tuple[str, ...]:
    """``count`` hash tags: tag n is the first ``"n.k"`` (k = 0, 1, ...) whose slot lies in
    the n-th of ``count`` equal slot ranges."""
    if not 0 < count <= SLOTS:
        raise ValueError(f"partitions must be 1-{SLOTS}, not {count}")
    found = []
    for n in range(count):
        low, high = n * SLOTS // count, (n + 1) * SLOTS // count
        k = 0
        while not low <= key_slot(f"{n}.{k}".encode()) < high:
            k += 1
        found.append(f"{n}.{k}")
    return tuple(found)
