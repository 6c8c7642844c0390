"""The options a dataset spec takes (``synthetic:NAME?clients=100&split=dirichlet``) and their types, in a module of
their own: the run's configuration names them in its refusals without importing the loaders (torch, pyarrow)."""

from __future__ import annotations

OPTION_TYPES: dict[str, type] = {
    "dim": int, "seed": int, "feature_shift": float, "scale": float, "classes": int, "clients": int,
    "test": str, "split": str, "alpha": float, "classes_per_client": int, "split_seed": int,
    "images": str, "layout": str, "min_client_size": int,
}
