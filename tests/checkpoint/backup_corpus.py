"""Damaged `tfdist.BackupAndRestore` folders, and what a resume makes of each.

Used by tests/checkpoint/test_backup.py (every case must end in a clean error) and
runnable on its own to count outcomes for any tfdist version, each case in a
subprocess so a hang is seen:

    PYTHONPATH=/path/to/tfdist [CORPUS_TIMEOUT=60] python tests/checkpoint/backup_corpus.py

Outcomes: `clean` (an error naming the backup file or folder and what to
do, on one line), `quiet` (resumed with wrong values or from the wrong
epoch, no error), `lost` (no error, training restarted from epoch 0 although
a backup was there), `traceback` (any other exception), `hang`, `ok` (resumed
exactly: the case did not damage anything this version reads), `fresh`
(started from epoch 0 where that is right: no complete backup).
Only the public API is used, so the same file measures old and new code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np

EPOCHS_SAVED, STEPS = 2, 2
STATE = "tfdist_backup.json"


# --- the backup every case starts from ----------------------------------------------


def _model(seed: int, *, wider: bool = False):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5 if wider else 4),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.standard_normal(w.shape).astype("float32")
                       for w in model.get_weights()])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def _dataset():
    import tensorflow as tf

    from tfdist.checkpoint import repeat_shuffled

    x = np.arange(48, dtype="float32").reshape(16, 3) / 48
    return repeat_shuffled(tf.data.Dataset.from_tensor_slices((x, x[:, :1])), buffer_size=16,
                           seed=0).batch(4)


def make_backup(folder: str, *, seed: int = 0, wider: bool = False) -> list[np.ndarray]:
    """Trains EPOCHS_SAVED epochs with a backup in `folder`; returns the saved weights."""
    import tfdist

    model = _model(seed, wider=wider)
    backup = tfdist.BackupAndRestore(folder, delete_on_finish=False)
    model.fit(backup.dataset(_dataset()), epochs=EPOCHS_SAVED, steps_per_epoch=STEPS,
              callbacks=[backup], verbose=0, shuffle=False)
    return model.get_weights()


# --- the damage ---------------------------------------------------------------------


def _pointer(folder):
    return os.path.join(folder, STATE)


def _npz(folder):
    names = sorted(n for n in os.listdir(folder) if n.startswith("backup-"))
    return os.path.join(folder, names[-1])


def _edit_pointer(edit):
    def damage(folder):
        with open(_pointer(folder)) as f:
            state = json.load(f)
        state = edit(state)
        with open(_pointer(folder), "w") as f:
            f.write(state if isinstance(state, str) else json.dumps(state))
    return damage


def _write_pointer(data: bytes):
    def damage(folder):
        with open(_pointer(folder), "wb") as f:
            f.write(data)
    return damage


def _truncate(which, keep):
    def damage(folder):
        path = which(folder)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:int(len(data) * keep)])
    return damage


def _garbage(which):
    def damage(folder):
        with open(which(folder), "wb") as f:
            f.write(os.urandom(64) + b"\x00garbage")
    return damage


def _flip_byte(folder):
    path = _npz(folder)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with zipfile.ZipFile(path) as z:  # a byte inside the largest stored array
        info = max(z.infolist(), key=lambda i: i.file_size)
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2
    data[offset] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


def _arrays(folder):
    with np.load(_npz(folder), allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _rewrite_arrays(edit):
    def damage(folder):
        arrays = edit(_arrays(folder))
        with open(_npz(folder), "wb") as f:
            np.savez(f, **arrays)
    return damage


def _kernel_name(arrays):
    """The name of the first 2-D float array (a Dense kernel)."""
    return next(n for n in sorted(arrays) if arrays[n].ndim == 2 and arrays[n].dtype.kind == "f")


def _set_first(value):
    def edit(arrays):
        name = _kernel_name(arrays)
        arrays[name] = arrays[name].copy()
        arrays[name].flat[0] = value
        return arrays
    return edit


def _reshape(arrays):
    name = _kernel_name(arrays)
    arrays[name] = np.zeros((arrays[name].shape[0] + 1,) + arrays[name].shape[1:], "float32")
    return arrays


def _drop_last(arrays):
    name = sorted(n for n in arrays if n.startswith("v"))[-1]
    del arrays[name]
    return arrays


def _object_array(arrays):
    name = _kernel_name(arrays)
    arrays[name] = np.array([{"pickled": 1}], dtype=object)
    return arrays


def _replace_with(make):
    def damage(folder):
        make(folder)
    return damage


def _remove(which):
    def damage(folder):
        os.remove(which(folder))
    return damage


def _make_directory(which):
    def damage(folder):
        path = which(folder)
        os.remove(path)
        os.mkdir(path)
    return damage


def _make_fifo(which):
    def damage(folder):
        path = which(folder)
        os.remove(path)
        os.mkfifo(path)
    return damage


def _foreign_backup(folder, name):
    """Another backup (zero weights) at `name` next to the folder; returns its path."""
    outside = os.path.join(os.path.dirname(os.path.abspath(folder)), name)
    os.makedirs(outside, exist_ok=True)
    arrays = _arrays(folder)
    for key, value in arrays.items():
        if value.dtype.kind == "f":
            arrays[key] = np.zeros_like(value)
    target = os.path.join(outside, os.path.basename(_npz(folder)))
    with open(target, "wb") as f:
        np.savez(f, **arrays)
    return target


def _point_outside(absolute: bool):
    def damage(folder):
        target = _foreign_backup(folder, "elsewhere")
        with open(_pointer(folder)) as f:
            state = json.load(f)
        state["file"] = target if absolute else os.path.relpath(target, folder)
        with open(_pointer(folder), "w") as f:
            json.dump(state, f)
    return damage


def _symlink_outside(folder):
    target = _foreign_backup(folder, "elsewhere")
    os.remove(_npz(folder))
    os.symlink(target, os.path.join(folder, os.path.basename(target)))


def _another_model(folder):
    shutil.rmtree(folder)
    make_backup(folder, seed=7, wider=True)


def _folder_is_a_file(folder):
    shutil.rmtree(folder)
    with open(folder, "w") as f:
        f.write("not a folder")


def _only_partial_files(folder):
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    with open(os.path.join(folder, ".tmp-killed-save"), "wb") as f:
        f.write(b"PK\x03\x04 half an archive")


def _chmod_pointer(folder):
    os.chmod(_pointer(folder), 0)


def _renamed_to_step(step):
    """Pointer and file name say `step`; the archive's manifest says what was saved."""
    def damage(folder):
        with open(_pointer(folder)) as f:
            state = json.load(f)
        name = f"backup-step{step:012d}.npz"
        os.replace(_npz(folder), os.path.join(folder, name))
        with open(_pointer(folder), "w") as f:
            json.dump({**state, "step": step, "file": name}, f)
    return damage


def _as_format_2(folder):
    """The same backup as tfdist 0.2 wrote it: named by epoch, positions in epochs."""
    arrays = _arrays(folder)
    manifest = json.loads(str(arrays["manifest"][()]))
    epoch = manifest.pop("step") // manifest["steps_per_epoch"]
    arrays["manifest"] = np.array(json.dumps({**manifest, "format": 2, "epoch": epoch}))
    os.remove(_npz(folder))
    name = f"backup-epoch{epoch:06d}.npz"
    with open(os.path.join(folder, name), "wb") as f:
        np.savez(f, **arrays)
    with open(_pointer(folder), "w") as f:
        json.dump({"format": 2, "epoch": epoch, "steps_per_epoch": manifest["steps_per_epoch"],
                   "file": name}, f)


# name -> (damage, the outcome the fixed code must give)
CASES = {
    "pointer deleted": (_remove(_pointer), "clean"),
    "pointer empty": (_write_pointer(b""), "clean"),
    "pointer truncated": (_truncate(_pointer, 0.5), "clean"),
    "pointer garbage bytes": (_garbage(_pointer), "clean"),
    "pointer is a JSON list": (_write_pointer(b"[1, 2]"), "clean"),
    "pointer without step": (_edit_pointer(lambda s: {k: v for k, v in s.items()
                                                      if k != "step"}), "clean"),
    "pointer step is a string": (_edit_pointer(lambda s: {**s, "step": "4"}), "clean"),
    "pointer step negative": (_edit_pointer(lambda s: {**s, "step": -1}), "clean"),
    "pointer step NaN": (_edit_pointer(
        lambda s: json.dumps(s).replace(f'"step": {s["step"]}', '"step": NaN')), "clean"),
    "pointer step 10**30": (_edit_pointer(lambda s: {**s, "step": 10**30}), "clean"),
    "pointer step edited (4 -> 2)": (_edit_pointer(lambda s: {**s, "step": 2}), "clean"),
    "pointer and file renamed to step 2": (_renamed_to_step(2), "clean"),
    "pointer steps_per_epoch 0": (_edit_pointer(lambda s: {**s, "steps_per_epoch": 0}),
                                  "clean"),
    "pointer format 99": (_edit_pointer(lambda s: {**s, "format": 99}), "clean"),
    "pointer file ../ (outside the folder)": (_point_outside(absolute=False), "clean"),
    "pointer file absolute path": (_point_outside(absolute=True), "clean"),
    "pointer is a directory": (_make_directory(_pointer), "clean"),
    "pointer is a FIFO": (_make_fifo(_pointer), "clean"),
    "backup file deleted": (_remove(_npz), "clean"),
    "backup file empty": (_truncate(_npz, 0.0), "clean"),
    "backup file truncated": (_truncate(_npz, 0.6), "clean"),
    "backup file garbage": (_garbage(_npz), "clean"),
    "backup file one byte flipped": (_flip_byte, "clean"),
    "backup file a variable missing": (_rewrite_arrays(_drop_last), "clean"),
    "backup file wrong shape": (_rewrite_arrays(_reshape), "clean"),
    "backup file NaN": (_rewrite_arrays(_set_first(np.nan)), "clean"),
    "backup file Inf": (_rewrite_arrays(_set_first(np.inf)), "clean"),
    "backup file pickled object array": (_rewrite_arrays(_object_array), "clean"),
    "backup file is a directory": (_make_directory(_npz), "clean"),
    "backup file is a FIFO": (_make_fifo(_npz), "clean"),
    "backup file symlink outside the folder": (_symlink_outside, "clean"),
    "backup from another model": (_another_model, "clean"),
    "backup_dir is a file": (_folder_is_a_file, "clean"),
    "only a killed save's partial file": (_only_partial_files, "fresh"),
    "an epoch backup in the previous format (2)": (_as_format_2, "ok"),
    "pointer unreadable (chmod 000)": (_chmod_pointer, "clean"),
}


# --- one resume ------------------------------------------------------------------


def resume(folder: str, saved: list[np.ndarray]) -> tuple[str, str]:
    """Resumes from `folder` (3 epochs in all); returns (outcome, detail)."""
    import keras

    import tfdist

    seen = {}

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["weights"] = self.model.get_weights()

        def on_epoch_begin(self, epoch, logs=None):
            seen.setdefault("epoch", epoch)

    try:
        model = _model(seed=3)
        backup = tfdist.BackupAndRestore(folder, delete_on_finish=False)
        model.fit(backup.dataset(_dataset()), epochs=EPOCHS_SAVED + 1, steps_per_epoch=STEPS,
                  callbacks=[backup, Record()], verbose=0, shuffle=False)
    except Exception as e:  # noqa: BLE001 - classifying every failure is the point
        message = str(e)
        named = folder in message or os.path.abspath(folder) in message
        advice = any(word in message for word in ("elete", "estore", "Give", "Pass"))
        if isinstance(e, ValueError) and named and advice and "\n" not in message.strip():
            return "clean", message
        return "traceback", f"{type(e).__name__}: {' '.join(message.split())[:160]}"
    if seen.get("epoch") == 0:
        return "lost", "no error; restarted from epoch 0"
    exact = seen.get("epoch") == EPOCHS_SAVED and all(
        np.array_equal(a, b) for a, b in zip(seen["weights"], saved))
    if exact:
        return "ok", "resumed exactly"
    return "quiet", f"no error; resumed at epoch {seen.get('epoch')} with other weights"


def run_case(name: str, template: str, work: str) -> tuple[str, str]:
    """Copies the template backup to `work`, damages it as `name` says, resumes."""
    folder = os.path.join(work, "backup")
    shutil.copytree(template, folder)
    damage, _ = CASES[name]
    damage(folder)
    with open(os.path.join(template, "..", "saved.json")) as f:
        saved = [np.asarray(w, "float32") for w in json.load(f)]
    outcome, detail = resume(folder, saved)
    if outcome == "lost" and CASES[name][1] == "fresh":
        return "fresh", "no complete backup: started from epoch 0"
    return outcome, detail


def prepare(root: str) -> str:
    """Makes the template backup under `root`; returns its folder."""
    template = os.path.join(root, "template", "backup")
    saved = make_backup(template)
    with open(os.path.join(root, "template", "saved.json"), "w") as f:
        json.dump([w.tolist() for w in saved], f)
    return template


def main() -> int:
    import tempfile

    timeout = float(os.environ.get("CORPUS_TIMEOUT", "60"))
    root = tempfile.mkdtemp(prefix="tfdist_backup_corpus_")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        if len(sys.argv) > 1 and sys.argv[1] == "--case":
            outcome, detail = run_case(sys.argv[2], sys.argv[3], sys.argv[4])
            print(json.dumps([outcome, detail]))
            return 0
        template = prepare(root)
        counts: dict[str, int] = {}
        for i, name in enumerate(CASES):
            work = os.path.join(root, f"case{i}")
            os.makedirs(work)
            try:
                result = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--case", name, template, work],
                    capture_output=True, text=True, timeout=timeout, env=env)
                outcome, detail = json.loads(result.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                outcome, detail = "hang", f"no answer within {timeout:g} s"
            except (IndexError, ValueError):
                outcome, detail = "traceback", result.stderr.strip().splitlines()[-1][:160]
            counts[outcome] = counts.get(outcome, 0) + 1
            print(f"{outcome:9} {name}: {detail}", flush=True)
        print("counts:", json.dumps(counts, sort_keys=True))
    finally:
        for dirpath, _, filenames in os.walk(root):
            for filename in filenames:
                path = os.path.join(dirpath, filename)
                if not os.path.islink(path):
                    os.chmod(path, 0o600)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
