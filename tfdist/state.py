"""One record per strategy: everything tfdist attaches to a strategy it made.

TensorFlow's strategies cannot be subclassed per preset, so what tfdist adds
to one (Lightning Fabric keeps it on its own `Strategy` object) lives in a
`StrategyState`, kept in one weak map: the entry goes when the strategy does.

    state = tfdist.state.state_of(strategy)   # None: a strategy tfdist did not make
    state.preset, state.features               # "mirrored", ("batch_norm", "optimizer_update", ...)
    state.gradient_sync, state.sharding_plan   # what the features attached

`adopt` creates the record (`make_strategy` calls it); every fix in
tfdist.compat asks `state_of` (through `compat._owner.owns`) before it
changes anything, so objects of strategies tfdist did not make pass through.

Per-model and per-optimizer records stay with their objects' owners: the
parameter-server trainer and exact-evaluation shards of a model
(`tfdist.ps`), an optimizer opted in to summed sparse gradients
(`compat.optimizer_update.opt_in`), and the worker recovery of a
parameter-server coordinator (`compat.ps_recovery`, by TensorFlow's failure
handler, which is what its fixes receive).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable


@dataclasses.dataclass(eq=False)
class StrategyState:
    """What tfdist attached to one strategy.

    Attributes:
      preset: the preset that made it ("mirrored", ...); None when adopted directly.
      options: that preset's frozen options.
      features: the names of the preset's features attached to it, in order
        (`tfdist.strategies.Feature`).
      gradient_sync: how the optimizer update exchanges and applies gradients
        (a `GradientSync`); None: the default (`DEFAULT_SYNC`).
      sync_batch_norm: BatchNormalization statistics over the global batch.
      sharding_plan: the ZeRO sharding plan (`tfdist.sharding.ShardingPlan`), if sharded.
      file_role: "chief", "other" or None (Keras's file writers), once computed
        (`file_role_known`).
      barrier: the traced all-worker barrier of the file writers, once made.
      gather: the traced all-gather function of sharding, once made.
      parallelism: the resolved `tfdist.Parallelism` it was made from
        (`make_strategy(parallelism)`), with its devices; None otherwise.
      skip_completed_reruns: parameter_server: a step re-run after a worker
        failure is skipped if its update already landed.
    """

    preset: str | None = None
    options: Any = None
    features: tuple[str, ...] = ()
    gradient_sync: Any = None
    sync_batch_norm: bool = False
    sharding_plan: Any = None
    file_role: str | None = None
    file_role_known: bool = False
    barrier: Callable[[], Any] | None = None
    gather: Any = None
    parallelism: Any = None
    skip_completed_reruns: bool = False


_lock = threading.RLock()
_states: "weakref.WeakKeyDictionary[Any, StrategyState]" = weakref.WeakKeyDictionary()


def adopt(strategy: Any, *, preset: str | None = None, options: Any = None) -> StrategyState:
    """Makes `strategy` one tfdist made (its fixes apply to it); returns its record.

    Adopting a strategy again returns its record, unchanged.

    Raises:
      ValueError: for TensorFlow's default strategy (shared by every plain model).
    """
    from tfdist.compat import _owner

    if _owner.is_default_strategy(strategy):
        raise ValueError("tfdist never adopts TensorFlow's default strategy: plain models "
                         "in this process must keep running stock Keras.")
    with _lock:
        state = _states.get(strategy)
        if state is None:
            state = _states[strategy] = StrategyState(preset=preset, options=options)
        return state


def state_of(strategy: Any) -> StrategyState | None:
    """The record of a strategy tfdist made; None for any other object (None included)."""
    if strategy is None:
        return None
    try:
        with _lock:
            return _states.get(strategy)
    except TypeError:  # unhashable or not weak-referenceable: not a strategy tfdist made
        return None


def live() -> "list[tuple[Any, StrategyState]]":
    """Every strategy tfdist made that is still alive, with its record."""
    with _lock:
        return list(_states.items())


def lock() -> threading.RLock:
    """The lock guarding every record (for a field computed once and then kept)."""
    return _lock
