"""tfdist.compat._patch: install, shape checks, pass-through, uninstall."""

import types

import pytest

from tfdist.compat import _patch


class _Target:
    def method(self, x, y):
        return ("original", x, y)


def _fix(name="test.method", owner=_Target, check=None, make=None):
    return _patch.Fix(
        name=name,
        issue="example/repo#1",
        target=lambda: (owner, "method"),
        check=check or (lambda original: _patch.require_signature(original, "x", "y")),
        make=make or (lambda original: _patch.passthrough(
            original, lambda self, x, y: x == "ours")(lambda self, x, y: ("fixed", x, y))),
    )


def test_install_passes_through_and_uninstall_restores():
    original = _Target.__dict__["method"]
    fix = _fix()
    assert _patch.install(fix)
    try:
        assert not _patch.install(fix)  # idempotent
        assert _Target().method("theirs", 1) == ("original", "theirs", 1)
        assert _Target().method("ours", 1) == ("fixed", "ours", 1)
        assert "test.method" in _patch.installed()
    finally:
        assert _patch.uninstall(["test.method"]) == ("test.method",)
    assert _Target.__dict__["method"] is original
    assert _Target().method("ours", 1) == ("original", "ours", 1)


def test_inherited_attribute_is_deleted_again():
    class Child(_Target):
        pass

    _patch.install(_fix(name="test.child", owner=Child))
    assert "method" in Child.__dict__
    _patch.uninstall(["test.child"])
    assert "method" not in Child.__dict__


def test_shape_mismatch_is_refused_and_changes_nothing():
    class Other:
        def method(self, x):  # another signature: an upstream change
            return x

    before = Other.__dict__["method"]
    with pytest.raises(_patch.CompatError, match=r"takes \(x\); the tfdist fix was written for \(x, y\)"):
        _patch.install(_fix(name="test.other", owner=Other))
    assert Other.__dict__["method"] is before
    assert "test.other" not in _patch.installed()


def test_missing_target_is_a_compat_error():
    def target():
        raise ImportError("No module named 'keras.src.gone'")

    fix = _patch.Fix("test.gone", "x#1", target, lambda o: None, lambda o: o)
    with pytest.raises(_patch.CompatError, match="cannot find what it patches"):
        _patch.install(fix)


def test_two_fixes_may_not_replace_one_attribute():
    _patch.install(_fix(name="test.first"))
    try:
        with pytest.raises(_patch.CompatError, match="already replaced by fix 'test.first'"):
            _patch.install(_fix(name="test.second"))
    finally:
        _patch.uninstall(["test.first"])


def test_module_attributes_are_restored():
    module = types.ModuleType("m")

    def function(a):
        return a

    module.function = function
    fix = _patch.Fix("test.module", "x#1", lambda: (module, "function"),
                     lambda o: _patch.require_signature(o, "a"), lambda o: lambda a: -a)
    _patch.install(fix)
    assert module.function(2) == -2
    _patch.uninstall(["test.module"])
    assert module.function is function
