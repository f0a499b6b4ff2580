"""The process-lifetime caches behind the ``warm_process`` preset.

With ``cache_pinned_weights``, ``remove()`` keeps the pinned host copy of the streamed weights in
a cache keyed by ``pinned_weight_cache_namespace``, the model class and the execution device; the
model's weights keep pointing at that memory (it is held once), and the next ``enable_offload``
of the same model pins nothing and copies nothing. With ``cache_plan`` the plan of the same model,
settings and card is reused. The C++ side explains ownership and staleness (Note [Pinned-weight
cache] in torch/src/weight_cache.cpp).

    >>> result = ddo.enable_offload(transformer, preset="warm_process", execution_device="sim")
    >>> result.remove()                       # slabs cached, the model usable on the host
    >>> result = ddo.enable_offload(transformer, preset="warm_process", execution_device="sim")
    >>> result.report()["setup"]["weight_cache"]["status"]
    'hit'
    >>> ddo.clear_pinned_weight_cache()       # bytes dropped
"""

from __future__ import annotations

from typing import Any

from . import _C


def pinned_weight_cache_stats() -> dict[str, Any]:
    """Entries and bytes held now; hits, misses, evictions, stale and rejected entries, bytes
    reused without a copy and refilled, weights changed in place while cached (since start)."""
    return _C.pinned_weight_cache_stats()


def clear_pinned_weight_cache(namespace: str | None = None) -> int:
    """Drops every cached entry (or those of ``namespace``); returns the slab bytes dropped.

    Memory a restored model still points at is freed once the model lets go of it."""
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, not {type(namespace).__name__}")
    return _C.clear_pinned_weight_cache(namespace)


def plan_cache_stats() -> dict[str, Any]:
    """Plans cached now, and plans reused (hits) or computed (misses) with ``cache_plan``."""
    return _C.plan_cache_stats()


def clear_plan_cache() -> None:
    """Forgets every cached plan."""
    _C.clear_plan_cache()
