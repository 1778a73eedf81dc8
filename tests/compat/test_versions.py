"""The supported version range, and every fix installing on the installed TensorFlow/Keras pair."""

import pytest

import tfdist
import tfdist.compat
from tests.support import run_python
from tfdist.compat import _versions


def test_installed_versions_are_in_the_supported_range():
    assert tfdist.compat.is_supported(), (tfdist.compat.versions(), tfdist.compat.SUPPORTED)


@pytest.mark.parametrize("tf_version, keras_version, ok", [
    ("2.16.2", "3.10.0", True),
    ("2.21.0", "3.15.1", True),
    ("2.21.0rc1", "3.15.0.dev2026", True),
    ("2.15.1", "3.15.1", False),
    ("2.22.0", "3.15.1", False),
    ("2.21.0", "3.9.2", False),
    ("2.21.0", "3.16.0", False),
    ("2.21.0", "2.15.0", False),
])
def test_supported_range(tf_version, keras_version, ok):
    assert _versions.is_supported({"tensorflow": tf_version, "keras": keras_version}) is ok


def test_make_strategy_refuses_unsupported_versions_before_building_anything(monkeypatch):
    monkeypatch.setattr(_versions, "_checked", False)
    monkeypatch.setattr(_versions, "versions",
                        lambda: {"tensorflow": "2.21.0", "keras": "3.9.2"})
    monkeypatch.delenv(_versions.ALLOW_ENV, raising=False)
    with pytest.raises(tfdist.compat.UnsupportedVersionError) as error:
        tfdist.make_strategy("mirrored", num_devices=2)
    message = str(error.value)
    assert "found TensorFlow 2.21.0 with Keras 3.9.2" in message
    assert "supports TensorFlow 2.16-2.21 with Keras 3.10-3.15" in message
    assert "pip install 'tensorflow>=2.16,<2.22' 'keras>=3.10,<3.16'" in message
    assert _versions.ALLOW_ENV in message


def test_allow_env_turns_the_refusal_into_one_warning(monkeypatch):
    monkeypatch.setattr(_versions, "_checked", False)
    monkeypatch.setattr(_versions, "versions",
                        lambda: {"tensorflow": "2.22.0", "keras": "3.16.0"})
    monkeypatch.setenv(_versions.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="running outside the tested range"):
        strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert strategy.num_replicas_in_sync == 2


_INSTALL_ALL = r"""
import importlib, inspect, json, pkgutil, warnings
warnings.simplefilter("error", RuntimeWarning)  # a preset's "could not make ... safe" fails
import tfdist
import tfdist.compat
from tfdist.compat import _patch

tfdist.make_strategy("multi_worker_mirrored")  # one worker: installs the Keras file fixes
from tfdist.compat import ps_fit
from tfdist.ps import keras_api
ps_fit.set_routes(keras_api.ROUTES)  # what the parameter_server preset routes to
failed, modules = {}, []
for info in pkgutil.iter_modules(tfdist.compat.__path__):
    if info.name.startswith("_"):
        continue
    install = getattr(importlib.import_module("tfdist.compat." + info.name), "install", None)
    if install is None:
        continue
    modules.append(info.name)
    if any(p.default is p.empty for p in inspect.signature(install).parameters.values()):
        failed[info.name] = "install() takes arguments (one install API: none, a tuple back)"
        continue
    try:
        names = install()
    except Exception as e:
        failed[info.name] = f"{type(e).__name__}: {e}"
        continue
    if not (isinstance(names, tuple) and all(isinstance(n, str) for n in names)):
        failed[info.name] = f"install() returned {names!r}, not the tuple of names it installed"
print("RESULT " + json.dumps({"failed": failed, "modules": modules,
                              "installed": list(_patch.installed())}))
"""


def test_every_fix_installs_on_this_tensorflow_keras_pair():
    # The oldest-pair CI stage runs this: a fix whose target moved between Keras versions
    # (keras_files.export: saved_model_export_archive exists from Keras 3.14 only) would
    # otherwise be refused with a warning and leave that version without the fix.
    import json

    from tfdist.compat import keras_files

    result = run_python("-c", _INSTALL_ALL, timeout=180)
    lines = [l for l in result.stdout.splitlines() if l.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(lines[-1][len("RESULT "):])
    assert report["failed"] == {}, report["failed"]
    assert {"keras_files", "batch_norm", "optimizer_update", "ps_variables"} <= set(
        report["modules"]), report["modules"]
    assert set(keras_files.NAMES) <= set(report["installed"]), report["installed"]
