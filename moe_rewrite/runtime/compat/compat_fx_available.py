"""The compat rewrite's stand-in for transformers.utils.import_utils.is_torch_fx_available, which transformers 5.0
removed; it goes in the `except ImportError:` branch of the file's own import.
"""


def is_torch_fx_available():
    """What transformers 4.x answered with torch >= 1.10 (moe-rewrite): torch.fx is there."""
    return True
