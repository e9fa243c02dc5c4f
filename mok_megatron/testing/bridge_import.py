"""Import the real Megatron-Bridge 0.6.2 on a CPU machine, for its config code only.

The wheel is installed with ``--no-deps`` (requirements/bridge.txt) into ``bridge_site`` beside
the venv, off ``sys.path``. Its package ``__init__``s import every model's HF bridge, so
``megatron.bridge.training.config`` pulls in packages the config code never calls. Those are
stubbed (modules whose every attribute is a dummy class):

- ``transformer_engine`` users in Bridge: ``megatron.bridge.peft.lora_layers`` and
  ``megatron.bridge.models.gpt_full_te_layer_autocast_spec`` import TE unconditionally (a GPU
  build). These two modules are stubbed, not TE itself, so Megatron-Core still sees no TE.
- ``transformers``, ``datasets``, ``safetensors``, ``rich``, ``megatron.energon``,
  ``torch.utils.tensorboard`` (it needs the tensorboard package): HF model / data / logging
  code, not GPU builds but large installs that the config round trip does not use.

``install(hf=True)`` (the HF conversion test) keeps the real ``transformers`` and ``safetensors``
(requirements/bridge.txt installs them, with the packages their imports need, ``--no-deps``):
Bridge's ``AutoBridge`` reads the HF config and safetensors through them.

Bridge's own package ``__init__``s are made lazy (a name they import loads when first used).
Call ``install()`` only in a process of its own (the test runs a subprocess): the stubs would
shadow real packages for everything else in the process.
"""

from __future__ import annotations

import abc
import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["HF_PACKAGES", "STUBBED", "bridge_site", "install"]

STUBBED = (
    "datasets",
    "megatron.bridge.models.gpt_full_te_layer_autocast_spec",
    "megatron.bridge.peft.lora_layers",
    "megatron.energon",
    "rich",
    "safetensors",
    "torch.utils.tensorboard",
    "transformers",
)

#: Stubbed by default, real with ``install(hf=True)``.
HF_PACKAGES = ("safetensors", "transformers")


def bridge_site() -> str:
    """Where requirements/bridge.txt is installed: $MOK_BRIDGE_SITE or <venv>/bridge_site."""
    return os.environ.get("MOK_BRIDGE_SITE") or os.path.join(sys.prefix, "bridge_site")


def install(hf: bool = False) -> bool:
    """Make ``import megatron.bridge...`` work here; False where bridge_site has no Bridge.

    hf: import the real ``transformers`` / ``safetensors`` from bridge_site (else stubs)."""
    site = bridge_site()
    if not os.path.isdir(os.path.join(site, "megatron", "bridge")):
        return False
    sys.path.insert(0, site)  # megatron is a namespace package: megatron.bridge joins it
    sys.meta_path.insert(0, _LazyInitFinder("megatron.bridge"))
    stubbed = [n for n in STUBBED if not (hf and n in HF_PACKAGES)]
    sys.meta_path.insert(0, _StubFinder(stubbed))
    return True


class _DummyMeta(abc.ABCMeta):  # ABCMeta: stubbed classes are mixed with ABCs
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _dummy(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return super().__call__(*args, **kwargs)

    def register(cls, *args, **kwargs):  # AutoConfig.register(..., exist_ok=True)
        return None

    def __getitem__(cls, item):  # Generic[...] style annotations
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _DummyBase:
    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):  # TypedDict-style class keywords (total=False)
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __enter__(self):  # ``with rich.progress.Progress(...)`` in Bridge's weight conversion
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _dummy(name)()


def _dummy(name: str) -> type:
    return _DummyMeta(name, (_DummyBase,), {"__module__": "mok_megatron.testing.bridge_stub"})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _dummy(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, name, path, target=None):
        if any(name == n or name.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class _LazyInitFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Packages under ``prefix`` run no ``__init__``; its ``from x import y`` names load lazily."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def find_spec(self, name, path, target=None):
        if name != self.prefix and not name.startswith(self.prefix + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not (spec.origin or "").endswith("__init__.py"):
            return None
        lazy = importlib.machinery.ModuleSpec(name, self, origin=spec.origin, is_package=True)
        lazy.submodule_search_locations = spec.submodule_search_locations
        return lazy

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(module.__spec__.origin) as f:
            tree = ast.parse(f.read())
        where = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), module.__name__
                )
                where.update({a.asname or a.name: (base, a.name) for a in node.names})
        module.__getattr__ = _lazy_getattr(module.__name__, where)


def _lazy_getattr(package: str, where: dict[str, tuple[str, str]]):
    def __getattr__(name):
        if name not in where or where[name][1] == "*":
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        base, original = where[name]
        module = importlib.import_module(base)
        if hasattr(module, original):
            return getattr(module, original)
        return importlib.import_module(f"{base}.{original}")

    return __getattr__
