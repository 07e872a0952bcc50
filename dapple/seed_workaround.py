"""A workaround for tf_keras on Python 3.12: seeded layers fail after `set_random_seed`.

`tf.keras.utils.set_random_seed(seed)` (the tf_keras versions: docs/stacks.md) stores
`random.Random(seed)` in `tf_keras.src.backend._SEED_GENERATOR.generator`, and every layer or
initializer without a seed of its own then draws one with `generator.randint(1, 1e9)`. Python
3.12's `randint` refuses the float bound (`TypeError: 'float' object cannot be interpreted as an
integer`; Python 3.11 warned and used `int(1e9)`). Upstream: keras-team/tf-keras issue #803.

`install_when_imported()` (called by `import dapple`) runs `install()` now if tf_keras is loaded,
else right after tf_keras's backend module is first imported (by `import tf_keras`, or by `tf.keras`
with TF_USE_LEGACY_KERAS=1), whichever comes first; dapple imports no tf_keras of its own.
`install()` replaces that per-thread holder, once, with one that
wraps each generator stored in it in `_IntegralBoundsRandom`, whose `randint` takes integral
float bounds as the integers they are. The seeds drawn are those Python 3.11 draws, so a seeded
model gets the same weights on both. Nothing installed is modified, tf_keras's functions are
not replaced, and other Python versions are left alone.
"""
from __future__ import annotations

import importlib.abc
import random
import sys
import threading

_BACKEND = "tf_keras.src.backend"


class _IntegralBoundsRandom(random.Random):
    """random.Random whose randint accepts floats with integral values (1e9), as 3.11 did."""

    def randint(self, a, b):
        return super().randint(_integral(a), _integral(b))


def _integral(x):
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def _wrapped(generator):
    if generator is None or isinstance(generator, _IntegralBoundsRandom):
        return generator
    fixed = _IntegralBoundsRandom()
    fixed.setstate(generator.getstate())   # the same stream from where it stands
    return fixed


class _SeedGeneratorHolder(threading.local):
    """Stands in for tf_keras's `threading.local()`; its `generator` is stored wrapped."""

    @property
    def generator(self):
        return self.__dict__.get("_generator")

    @generator.setter
    def generator(self, value):
        self.__dict__["_generator"] = _wrapped(value)


def needed() -> bool:
    return sys.version_info >= (3, 12)


def install() -> bool:
    """Put the holder in place if tf_keras is the one behind tf.keras; True if installed."""
    if not needed():
        return False
    backend = sys.modules.get("tf_keras.src.backend")
    if backend is None or not hasattr(backend, "_SEED_GENERATOR"):
        return False
    current = backend._SEED_GENERATOR
    if isinstance(current, _SeedGeneratorHolder):
        return True
    holder = _SeedGeneratorHolder()
    holder.generator = getattr(current, "generator", None)   # this thread's, if already seeded
    backend._SEED_GENERATOR = holder
    return True


def installed() -> bool:
    backend = sys.modules.get("tf_keras.src.backend")
    return backend is not None and isinstance(getattr(backend, "_SEED_GENERATOR", None),
                                              _SeedGeneratorHolder)


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when tf_keras's backend module is about to load, wraps the
    loader's `exec_module` so that `install()` runs right after it."""

    def find_spec(self, name, path, target=None):
        if name != _BACKEND:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            install()

        loader.exec_module = exec_module   # this spec's own loader instance
        return spec


_HOOK = _InstallAfterImport()


def install_when_imported() -> bool:
    """`install()` now if tf_keras's backend is loaded, else once it is; True if installed now."""
    if not needed():
        return False
    if _BACKEND in sys.modules:
        return install()
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    return False
