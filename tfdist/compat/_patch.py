"""The one way tfdist replaces a TensorFlow or Keras attribute: a named, checked, undoable fix.

A `Fix` says what it replaces (`target()` -> (owner, attribute), imported
lazily), which upstream issue it works around, what the code it replaces must
look like (`check(original)` raises `CompatError` naming what differs, so a
Keras or TensorFlow release that changed that code is refused clearly instead
of being patched blindly), and how to build the replacement from the
original (`make(original)`).

Replacements must pass straight through to `original` for objects tfdist did
not create (see `tfdist.compat._owner`); `uninstall()` puts every original
back, so a process can return to stock Keras. Two fixes of one attribute
stack (the newer wraps the older's replacement; each passes through for what
it does not own); uninstalling either takes the stack apart in order.
Installing refuses TensorFlow/Keras versions outside `tfdist.compat.SUPPORTED`.

    FIX = Fix(
        name="keras_multi_worker.reduce_per_replica",
        issue="https://github.com/keras-team/keras/issues/20585",
        target=lambda: (trainer_module, "reduce_per_replica"),
        check=lambda original: require_signature(original, "values", "strategy", "reduction"),
        make=lambda original: ...,
    )
    install(FIX)        # idempotent
    install_all(FIXES)  # all or none
    uninstall()         # every fix, newest first
    with uninstall_after(): ...   # what the block installed
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
from typing import Any, Callable, Iterable


class CompatError(RuntimeError):
    """The TensorFlow/Keras code a fix targets is not shaped as the fix expects."""


@dataclasses.dataclass(frozen=True)
class Fix:
    """One replacement of one attribute.

    Attributes:
      name: unique, "module.what" (e.g. "keras_multi_worker.symbolic_build").
      issue: the upstream issue (URL or "owner/repo#N") the fix works around.
      target: returns (owner, attribute name); imports lazily.
      check: raises CompatError if `original` is not the code this fix was
        written for (signature, loop form, attributes it reads).
      make: builds the replacement from the original. The replacement must
        defer to the original for objects tfdist does not own.
    """

    name: str
    issue: str
    target: Callable[[], tuple[Any, str]]
    check: Callable[[Any], None]
    make: Callable[[Any], Any]


@dataclasses.dataclass
class _Installed:
    fix: Fix
    owner: Any
    attribute: str
    original: Any
    had_own: bool  # the attribute was in owner.__dict__ (not inherited)
    replacement: Any


_lock = threading.RLock()
_active: dict[str, _Installed] = {}


def _raw(owner: Any, attribute: str) -> Any:
    """The attribute as stored (a staticmethod/classmethod stays wrapped)."""
    for klass in (owner.__mro__ if isinstance(owner, type) else (owner,)):
        namespace = getattr(klass, "__dict__", {})
        if attribute in namespace:
            return namespace[attribute]
    return getattr(owner, attribute)


def install(fix: Fix) -> bool:
    """Installs `fix` once (thread-safe, idempotent).

    Returns:
      True if it was installed by this call, False if it already was.

    Raises:
      UnsupportedVersionError: TensorFlow/Keras outside the supported range
        (see tfdist.compat.SUPPORTED); nothing is changed then.
      CompatError: the target is missing or its shape differs from what the
        fix was written for (nothing is changed then).
    """
    from tfdist.compat import _versions

    with _lock:
        if fix.name in _active:
            return False
        _versions.check_supported()
        try:
            owner, attribute = fix.target()
        except (ImportError, AttributeError) as e:
            raise CompatError(
                f"tfdist fix {fix.name!r} ({fix.issue}) cannot find what it patches: "
                f"{type(e).__name__}: {e}. This TensorFlow/Keras version is outside what "
                "tfdist supports; see tfdist.compat.SUPPORTED.") from None
        if not hasattr(owner, attribute):
            raise CompatError(
                f"tfdist fix {fix.name!r} ({fix.issue}): {_name(owner)} has no attribute "
                f"{attribute!r} in this TensorFlow/Keras version.")
        # If another fix already replaced this attribute, this one wraps that fix's
        # replacement (each passes through for what it does not own); uninstall()
        # takes such a stack apart in order.
        stored = _raw(owner, attribute)
        original = getattr(owner, attribute)
        fix.check(original)
        replacement = fix.make(original)
        function = _unwrap_descriptor(replacement)
        function.__tfdist_fix__ = fix.name
        function.__wrapped__ = _unwrap_descriptor(original)
        if isinstance(stored, staticmethod) and not isinstance(replacement, staticmethod):
            replacement = staticmethod(replacement)
        had_own = attribute in getattr(owner, "__dict__", {})
        setattr(owner, attribute, replacement)
        _active[fix.name] = _Installed(fix, owner, attribute, stored, had_own, replacement)
        return True


def install_all(fixes: Iterable[Fix]) -> tuple[str, ...]:
    """Installs several fixes that only make sense together: all of them, or none.

    Returns:
      The names of the fixes installed by this call.

    Raises:
      UnsupportedVersionError, CompatError: as `install`; fixes this call had
        already installed are uninstalled again first.
    """
    done: list[str] = []
    with _lock:
        try:
            for fix in fixes:
                if install(fix):
                    done.append(fix.name)
        except BaseException:
            uninstall(done)
            raise
    return tuple(done)


def uninstall(names: Iterable[str] | None = None) -> tuple[str, ...]:
    """Restores the originals of the named fixes (default: all), newest first.

    A fix that another, newer fix wraps (both replace one attribute) is taken
    out of the stack: the newer one is rebuilt on what lies below.

    Returns:
      The names of the fixes removed.
    """
    with _lock:
        chosen = list(_active) if names is None else [n for n in names if n in _active]
        removed = []
        for name in reversed(chosen):
            if name not in _active:
                continue
            entry = _active[name]
            order = list(_active)
            above = [_active[n] for n in order[order.index(name) + 1:]
                     if _active[n].owner is entry.owner
                     and _active[n].attribute == entry.attribute]
            for other in reversed(above):  # newest first, down to `entry`
                _restore(_active.pop(other.fix.name))
            _restore(_active.pop(name))
            removed.append(name)
            for other in above:  # rebuilt on what is now below them
                install(other.fix)
        return tuple(removed)


def _restore(entry: _Installed) -> None:
    if entry.had_own:
        setattr(entry.owner, entry.attribute, entry.original)
    else:
        delattr(entry.owner, entry.attribute)


@contextlib.contextmanager
def uninstall_after():
    """Undoes, when the block ends, every fix installed inside it (earlier ones stay).

        with tfdist.compat.uninstall_after():
            strategy = tfdist.make_strategy("multi_worker_mirrored")
            ...
        # stock Keras again; strategies made inside the block no longer get fixes

    Yields:
      None.
    """
    with _lock:
        before = set(_active)
    try:
        yield
    finally:
        with _lock:
            uninstall([name for name in _active if name not in before])


def installed() -> tuple[str, ...]:
    """Names of the fixes currently installed, oldest first."""
    with _lock:
        return tuple(_active)


def stored_original(name: str) -> Any:
    """The attribute the fix `name` replaced (as stored; raises KeyError if not installed).

    (Not called `original`: replacements traced by AutoGraph inside tf.function
    refer to their closure variable `original`, and AutoGraph resolved that
    name to a module-level function of the same name here.)
    """
    with _lock:
        return _active[name].original


def _unwrap_descriptor(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


# --- reaching upstream code ----------------------------------------------------------


def upstream(path: str) -> Any:
    """A TensorFlow or Keras module, or a class in one, by dotted path, TensorFlow imported
    first (tfdist's way: `tfdist._tf.import_tensorflow`).

    >>> upstream("keras.src.backend.tensorflow.trainer")            # a module
    >>> upstream("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")  # a class in one
    """
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as missing:
        module, _, attribute = path.rpartition(".")
        if not module or missing.name != path:
            raise
        owner = importlib.import_module(module)
        if not hasattr(owner, attribute):
            raise ImportError(f"cannot import name {attribute!r} from {module!r}") from None
        return getattr(owner, attribute)


# --- shape checks ---------------------------------------------------------------


def require_signature(function: Any, *parameters: str, what: str | None = None) -> None:
    """Raises CompatError unless `function` takes exactly these parameters, in order.

    `self`/`cls` are ignored; keyword-only and var-arguments count by name.
    """
    try:
        signature = inspect.signature(_unwrap_descriptor(function))
    except (TypeError, ValueError) as e:
        raise CompatError(f"cannot read the signature of {what or function!r}: {e}") from None
    names = [p for p in signature.parameters if p not in ("self", "cls")]
    if names != list(parameters):
        raise CompatError(
            f"{what or getattr(function, '__qualname__', function)} takes ({', '.join(names)}); "
            f"the tfdist fix was written for ({', '.join(parameters)}). This Keras/TensorFlow "
            "version changed that code: see tfdist.compat.SUPPORTED for the tested versions.")


def require_attributes(owner: Any, *attributes: str, what: str | None = None) -> None:
    """Raises CompatError unless `owner` has every attribute (what the fix calls or reads)."""
    missing = [a for a in attributes if not hasattr(owner, a)]
    if missing:
        raise CompatError(
            f"{what or _name(owner)} has no {', '.join(missing)}; the tfdist fix relies on "
            f"{'it' if len(missing) == 1 else 'them'}. See tfdist.compat.SUPPORTED for the "
            "tested versions.")


def passthrough(original: Callable, applies: Callable[..., bool]):
    """Decorator for replacements: call `original` unless `applies(*args, **kwargs)`.

        @passthrough(original, lambda self, *a, **k: _owner.owns(self._distribution_strategy))
        def replacement(self, ...): ...
    """

    def decorator(replacement):
        @functools.wraps(_unwrap_descriptor(original))
        def wrapper(*args, **kwargs):
            if not applies(*args, **kwargs):
                return original(*args, **kwargs)
            return replacement(*args, **kwargs)

        return wrapper

    return decorator
