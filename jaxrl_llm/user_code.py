"""The user's own code a config names: ``package.module`` or ``package.module:name``.

Reward functions, environments, surrogates and estimators named in a config are imported from
the import path. ``jaxrl-llm train`` and ``plan`` put the working directory and the config
file's directory on it first (``add_search_paths``), so a module beside the config or in the
project imports without ``PYTHONPATH``; an import that fails says where modules are searched.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

SEARCHED = "modules are found in the working directory, the config's directory and PYTHONPATH"


def add_search_paths(*directories: str | os.PathLike) -> None:
    """Puts ``directories`` (absolute) at the front of ``sys.path``, each once."""
    for directory in reversed(directories):
        path = os.path.abspath(os.fspath(directory))
        if path not in sys.path:
            sys.path.insert(0, path)


def import_module(name: str, what: str) -> Any:
    """Imports module ``name`` for ``what`` (e.g. ``"reward 'my.mod:fn'"``).

    Raises:
      ValueError: it cannot be imported: the reason and where modules are searched.
    """
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"{what}: cannot import {name!r} ({err}); {SEARCHED}") from None


def import_object(spec: str, what: str) -> Any:
    """The object ``module:attr`` names, imported for ``what``.

    Raises:
      ValueError: no ``:``, the module cannot be imported, or it has no such attribute.
    """
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{what}: {spec!r} is not 'package.module:name'")
    found = import_module(module, what)
    try:
        return getattr(found, attr)
    except AttributeError:
        raise ValueError(f"{what}: cannot import {attr!r} from {module!r} (no such name)") from None
