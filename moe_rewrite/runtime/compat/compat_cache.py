"""Module-level helpers of the compat rewrite (moe_rewrite/codemods/compat.py), added to the moe-rewrite block: the
Cache methods of transformers 4.36-4.47 that later releases removed, answered with what the installed release has.
Each one calls the original method where it still exists, so older releases run exactly as before.
"""


def _moe_rewrite_cache_max_length(cache):
    """Cache.get_max_length() as of transformers 4.46: the most tokens the cache holds, None when it grows without
    limit (4.48 renamed it get_max_cache_shape; 4.56+ and 5.x answer -1 for no limit)."""
    if not getattr(cache, "layers", True):  # 5.x: a DynamicCache builds its layers lazily and has no limit
        return None
    getter = getattr(cache, "get_max_length", None) or cache.get_max_cache_shape
    length = getter()
    return None if length is None or length < 0 else length


def _moe_rewrite_cache_usable_length(cache, new_seq_length, layer_idx=0):
    """Cache.get_usable_length (removed in 4.56): how many cached tokens of layer_idx the new tokens attend to."""
    if hasattr(cache, "get_usable_length"):
        return cache.get_usable_length(new_seq_length, layer_idx)
    max_length = _moe_rewrite_cache_max_length(cache)
    previous = cache.get_seq_length(layer_idx)
    if max_length is not None and previous + new_seq_length > max_length:
        return max_length - new_seq_length
    return previous


def _moe_rewrite_cache_seen_tokens(cache):
    """Cache.seen_tokens (removed in 4.56): the tokens the cache has seen, its length for a DynamicCache."""
    seen = getattr(cache, "seen_tokens", None)
    return cache.get_seq_length() if seen is None else seen


def _moe_rewrite_cache_from_legacy(cache_class, past_key_values):
    """cache_class.from_legacy_cache (removed in 5.0): a cache holding legacy ((key, value), ...) tuples."""
    if hasattr(cache_class, "from_legacy_cache"):
        return cache_class.from_legacy_cache(past_key_values)
    cache = cache_class()
    for layer_idx, (key, value) in enumerate(past_key_values or ()):
        cache.update(key, value, layer_idx)
    return cache


def _moe_rewrite_cache_to_legacy(cache):
    """Cache.to_legacy_cache (removed in 5.0): the cache as ((key, value), ...) tuples, one per layer."""
    if hasattr(cache, "to_legacy_cache"):
        return cache.to_legacy_cache()
    return tuple((layer.keys, layer.values) for layer in cache.layers)
