"""jaxrl_llm: reinforcement-learning post-training of language models in JAX/Flax.

The loss layer's modules live in :mod:`jaxrl_llm.losses`; their old homes at the package root
keep working as aliases of the same module objects (``from jaxrl_llm import kl``,
``import jaxrl_llm.surrogates``, ``from jaxrl_llm.advantages import grpo``), resolved lazily
so that ``import jaxrl_llm`` stays free of JAX.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

__version__ = "0.1.0"

# Root names of the loss layer's modules -> their module in ``jaxrl_llm.losses``.
MOVED_TO_LOSSES = {
    "advantages": "advantages",
    "aggregation": "aggregation",
    "correction": "correction",
    "distillation": "distillation",
    "implicit_prm": "implicit_prm",
    "kl": "kl",
    "masked_stats": "masked",
    "ratios": "ratios",
    "surrogates": "surrogates",
    "token_selection": "token_selection",
    "value": "value",
}


def _new_name(fullname: str) -> str | None:
    """``jaxrl_llm.kl[.sub]`` -> ``jaxrl_llm.losses.kl[.sub]``; None for any other name."""
    parts = fullname.split(".")
    if len(parts) < 2 or parts[0] != __name__ or parts[1] not in MOVED_TO_LOSSES:
        return None
    return ".".join([__name__, "losses", MOVED_TO_LOSSES[parts[1]], *parts[2:]])


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported module under its new name (one module object)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        return None


class _MovedModules(importlib.abc.MetaPathFinder):
    """Resolves the loss modules' root paths to their modules in :mod:`jaxrl_llm.losses`."""

    def find_spec(self, fullname, path=None, target=None):
        new = _new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str):
    if name in MOVED_TO_LOSSES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
