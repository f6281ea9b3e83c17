"""Results of functions of a model, kept with the model: a search asks about one model thousands of times (meshes,
batches, remat policies)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def per_model(fn: Callable) -> Callable:
    """Caches a function of the model alone. Only a frozen dataclass (which cannot change) is cached, by identity; any
    other model is computed afresh. Callers must not mutate what comes back."""
    cache: dict[int, tuple[Any, Any]] = {}  # id(model) -> (model, value): the model held so its id stays its own
    last: list = [None, None]  # the model last asked about and its value (a search asks of one model throughout)

    @functools.wraps(fn)
    def wrapper(model):
        if model is last[0]:
            return last[1]
        hit = cache.get(id(model))
        if hit is not None and hit[0] is model:
            last[:] = hit
            return hit[1]
        value = fn(model)
        params = getattr(type(model), "__dataclass_params__", None)
        if params is not None and params.frozen:
            if len(cache) >= 64:
                cache.clear()
            cache[id(model)] = (model, value)
            last[:] = model, value
        return value

    def cache_clear() -> None:
        cache.clear()
        last[:] = None, None

    wrapper.cache_clear = cache_clear
    return wrapper


@per_model
def model_memo(model) -> dict:
    """A dict for results of this model's functions of small arguments, kept with the model (a fresh, unshared dict
    for a model per_model does not cache)."""
    return {}
