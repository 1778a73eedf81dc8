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
    with pytest.raises(_patch.CompatError,
                       match=r"takes \(x\); the tfdist fix was written for \(x, y\)"):
        _patch.install(_fix(name="test.other", owner=Other))
    assert Other.__dict__["method"] is before
    assert "test.other" not in _patch.installed()


def test_missing_target_is_a_compat_error():
    def target():
        raise ImportError("No module named 'keras.src.gone'")

    fix = _patch.Fix("test.gone", "x#1", target, lambda o: None, lambda o: o)
    with pytest.raises(_patch.CompatError, match="cannot find what it patches"):
        _patch.install(fix)


def _tagging_fix(name, tag):
    """A fix that appends `tag` to the result for x == "ours" (passes through otherwise)."""
    def make(original):
        return _patch.passthrough(original, lambda self, x, y: x == "ours")(
            lambda self, x, y: original(self, x, y) + (tag,))

    return _fix(name=name, make=make)


def test_two_fixes_of_one_attribute_stack_and_come_apart_in_any_order():
    original = _Target.__dict__["method"]
    first, second = _tagging_fix("test.first", "a"), _tagging_fix("test.second", "b")
    _patch.install(first)
    _patch.install(second)
    try:
        assert _Target().method("ours", 1) == ("original", "ours", 1, "a", "b")
        assert _Target().method("theirs", 1) == ("original", "theirs", 1)
        # Removing the lower fix rebuilds the upper one on the original.
        assert _patch.uninstall(["test.first"]) == ("test.first",)
        assert _patch.installed()[-1] == "test.second"
        assert _Target().method("ours", 1) == ("original", "ours", 1, "b")
        assert _patch.uninstall(["test.second"]) == ("test.second",)
        assert _Target.__dict__["method"] is original
        _patch.install(first)
        _patch.install(second)
    finally:
        _patch.uninstall(["test.first", "test.second"])
    assert _Target.__dict__["method"] is original
    assert "test.first" not in _patch.installed() and "test.second" not in _patch.installed()


def test_uninstall_after_undoes_only_what_the_block_installed():
    original = _Target.__dict__["method"]
    _patch.install(_tagging_fix("test.outer", "a"))
    try:
        with _patch.uninstall_after():
            _patch.install(_tagging_fix("test.inner", "b"))
            assert _Target().method("ours", 1)[-2:] == ("a", "b")
        assert "test.inner" not in _patch.installed()
        assert _Target().method("ours", 1) == ("original", "ours", 1, "a")
    finally:
        _patch.uninstall(["test.outer"])
    assert _Target.__dict__["method"] is original


def test_install_all_installs_nothing_when_one_shape_differs():
    class Other:
        def method(self, x):
            return x

    good = _fix(name="test.good")
    bad = _fix(name="test.bad", owner=Other)
    with pytest.raises(_patch.CompatError):
        _patch.install_all([good, bad])
    assert "test.good" not in _patch.installed()
    assert "method" in _Target.__dict__ and not hasattr(_Target.method, "__tfdist_fix__")


def test_unsupported_versions_are_refused_before_anything_changes(monkeypatch):
    from tfdist.compat import _versions

    monkeypatch.setattr(_versions, "_checked", False)
    monkeypatch.setattr(_versions, "versions",
                        lambda: {"tensorflow": "2.15.1", "keras": "3.15.1"})
    monkeypatch.delenv(_versions.ALLOW_ENV, raising=False)
    with pytest.raises(_versions.UnsupportedVersionError, match="found TensorFlow 2.15.1"):
        _patch.install(_fix(name="test.versions"))
    assert "test.versions" not in _patch.installed()


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


def _every_fix() -> dict:
    """Every `_patch.Fix` tfdist.compat defines (module attributes, lists and `_fixes()`)."""
    import importlib
    import pkgutil

    import tfdist.compat as compat_package

    found = {}
    for info in pkgutil.iter_modules(compat_package.__path__):
        module = importlib.import_module(f"tfdist.compat.{info.name}")
        values = list(vars(module).values())
        if callable(getattr(module, "_fixes", None)):
            values.extend(module._fixes())
        for value in values:
            for fix in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(fix, _patch.Fix):
                    found[fix.name] = fix
    return found


def test_every_fix_names_its_upstream_issue_and_is_in_the_docs_table():
    from tests.support import REPO

    fixes = _every_fix()
    assert len(fixes) >= 30, sorted(fixes)
    with open(f"{REPO}/docs/compat.md", encoding="utf-8") as f:
        table = f.read().split("## The fixes", 1)[1].split("\n## ", 1)[0]
    missing = []
    for name, fix in fixes.items():
        assert fix.issue.strip(), f"{name} names no upstream issue (say 'none known' and why)"
        module, what = name.split(".", 1)
        leaf = what.rsplit(".", 1)[-1]
        if (f"`{name}`" not in table and f"`{module}.*`" not in table
                and not (f"`{module}.*" in table and f"`{leaf}`" in table)
                and not (f"`{module}.*" in table and f"`.{leaf}`" in table)):
            missing.append(name)
    assert not missing, f"docs/compat.md's table of fixes lacks: {missing}"
