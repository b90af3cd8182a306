"""Notice by itself when the task's tf.distribute strategy is up.

A MultiWorkerMirroredStrategy constructor returns only once every peer has joined the cluster
(measured: it blocks until the last worker connects), so "a strategy object finished construction"
is exactly "this task's cluster is connected". We wrap `StrategyBase.__init__` as soon as TensorFlow
loads the module that defines it, without importing TensorFlow ourselves: a script that never
uses TensorFlow pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("worker")

_MODULE = "tensorflow.python.distribute.distribute_lib"
_SERVER_MODULE = "tensorflow.python.training.server_lib"  # tf.distribute.Server: ps and PS workers
_DEFAULT_STRATEGY = "_DefaultDistributionStrategy"
_DEFAULT_EXTENDED = "_DefaultDistributionExtended"
_PS_MODULE = "tensorflow.python.distribute.parameter_server_strategy_v2"


def install(on_connecting: Callable[[Any], None], on_strategy_up: Callable[[Any], None]) -> None:
    """Call `on_connecting(extended)` when a strategy starts construction (it may wait there for its
    peers; a ParameterServerStrategy's chief: `on_connecting(strategy)` before it connects to its
    servers), and `on_strategy_up(strategy)` after every non-default strategy is constructed."""

    def patch(module: ModuleType) -> None:
        base = getattr(module, "StrategyBase", None)
        extended = getattr(module, "StrategyExtendedV2", None)
        if base is None or extended is None:
            log.warning("tf.distribute changed shape: cannot detect strategy start-up")
            return
        base_init, extended_init = base.__init__, extended.__init__

        # Every strategy builds its "extended" part first (MWMS joins its cluster right after), then
        # calls StrategyBase.__init__: the first marks "connecting", the second "up".
        def extended_init_hooked(self: Any, *args: Any, **kwargs: Any) -> None:
            if type(self).__name__ != _DEFAULT_EXTENDED:
                on_connecting(self)
            extended_init(self, *args, **kwargs)

        def base_init_hooked(self: Any, *args: Any, **kwargs: Any) -> None:
            base_init(self, *args, **kwargs)
            if type(self).__name__ != _DEFAULT_STRATEGY:
                on_strategy_up(self)

        extended.__init__ = extended_init_hooked
        base.__init__ = base_init_hooked

    def patch_server(module: ModuleType) -> None:
        server = getattr(module, "Server", None)
        if server is None:
            log.warning("tf.distribute.Server changed shape: cannot detect a server's start-up")
            return
        server_init = server.__init__

        # A ps or worker task of ParameterServerStrategy has no strategy: its server is its "up".
        def server_init_hooked(self: Any, *args: Any, **kwargs: Any) -> None:
            server_init(self, *args, **kwargs)
            on_strategy_up(self)

        server.__init__ = server_init_hooked

    def patch_ps(module: ModuleType) -> None:
        strategy = getattr(module, "ParameterServerStrategyV2", None)
        connect = getattr(strategy, "_connect_to_cluster", None)
        if strategy is None or connect is None:
            return  # only an optimisation is lost: the chief then connects as it would have

        # A ParameterServerStrategy's chief connects to its servers before it builds its extended
        # part: "connecting" is said (and its servers waited for) just before.
        def connect_hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
            on_connecting(self)
            return connect(self, *args, **kwargs)

        strategy._connect_to_cluster = connect_hooked

    after_import(_MODULE, patch)
    after_import(_SERVER_MODULE, patch_server)
    after_import(_PS_MODULE, patch_ps)


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run `callback(module)` right after module `name` has executed (now, if it has): a
    hook on TensorFlow's or Keras's classes without importing them ourselves."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.pending.setdefault(name, []).append(callback)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after some modules have executed; steps aside once all have."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        callbacks = self.pending.pop(fullname, None)
        if callbacks is None:
            return None
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            for callback in callbacks:
                try:
                    callback(module)
                except Exception as exc:  # noqa: BLE001 - a hook that fails never fails the import
                    log.warning("could not watch %s: %s", fullname, exc)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec
