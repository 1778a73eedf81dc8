"""Placement report of a SplitModel, read from the actual variables.

Every device shown comes from the variables themselves (`variable.device`),
not from the plan, so the report shows where things really are.
"""

from __future__ import annotations

import numpy as np

from tfdist.split import plan as plan_lib


def _short(device: str) -> str:
    return device.split("device:")[-1] if device else "<unplaced>"


def _var_device(variable) -> str:
    value = getattr(variable, "value", variable)
    values = getattr(value, "values", None)  # distributed (mirrored) variable
    if values is not None:
        return ",".join(_short(v.device) for v in values)
    return _short(value.device)


def _nbytes(variable) -> int:
    return int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def placement_summary(split, *, batch_size: int | None = None,
                      sequence_length: int | None = None) -> dict:
    """The numbers behind placement_report, as a dict (for tests and JSON).

    Args:
      split: a SplitModel.
      batch_size: global batch size used to compute activation bytes per
        micro-batch (per replica: batch_size / replicas / micro_batches).
      sequence_length: the length to use for dimensions unknown until run time
        (a text model's sequence). Without it, such cuts report their bytes per
        sample as a formula in L.
    """
    layers = []
    param_bytes: dict[str, int] = {}
    for name, layer in split.placed_layers().items():
        devices = sorted({_var_device(w) for w in layer.weights})
        nbytes = sum(_nbytes(w) for w in layer.weights)
        for w in layer.weights:
            for d in _var_device(w).split(","):  # each mirrored copy counts on its device
                param_bytes[d] = param_bytes.get(d, 0) + _nbytes(w)
        tp = split.plan.tensor_parallel_of(name)
        layers.append({
            "layer": name,
            "planned": _short(split.plan.device_of(name)),
            "devices": devices,
            "param_bytes": nbytes,
            "tensor_parallel": None if tp is None else
            {"mode": "heads" if type(layer).__name__ == "MultiHeadAttention" else tp.mode,
             "devices": [_short(d) for d in tp.devices]},
        })
    opt_bytes: dict[str, int] = {}
    optimizer = getattr(split, "optimizer", None)
    built = bool(optimizer is not None and getattr(optimizer, "built", False))
    if built:
        for v in optimizer.variables:
            for d in _var_device(v).split(","):
                opt_bytes[d] = opt_bytes.get(d, 0) + _nbytes(v)
    k, m = len(split.stages), split.micro_batches
    micro = None
    if batch_size is not None:
        micro = batch_size // split.replicas // m
    cuts = []
    for cut in split.cuts:
        per_sample = cut.bytes_per_sample(sequence_length=sequence_length)
        cuts.append({
            "after_stage": cut.after,
            "tensors": [{"from": p, "shape": list(s), "dtype": d} for p, s, d in cut.tensors],
            "bytes_per_sample": per_sample,
            "bytes_per_sample_formula": cut.formula(),
            "bytes_per_micro_batch": None if micro is None or per_sample is None
            else per_sample * micro,
        })
    return {
        "stages": [{"stage": s.index, "device": _short(s.device), "layers": list(s.layer_names)}
                   for s in split.stages],
        "replicas": [[_short(d) for d in devs] for devs in split.replica_devices],
        "layers": layers,
        "param_bytes_per_device": param_bytes,
        "optimizer_bytes_per_device": opt_bytes if built else None,
        "cuts": cuts,
        "micro_batches": m,
        "micro_batch_size": micro,
        "num_stages": k,
        "bubble": plan_lib.bubble_fraction(k, m),
        "ideal_speedup": plan_lib.ideal_speedup(k, m),
    }


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def describe(model) -> dict:
    """What a split model does, as plain data (for logs and metrics files)."""
    if hasattr(model, "plan"):
        return {"stages": [[d, list(names)] for d, names in model.plan.stages],
                "micro_batches": model.micro_batches, "schedule": model.schedule}
    return {"sequence_parallel": len(model.devices), "devices": list(model.devices),
            "replicas": model.replicas}


def placement_report(split, *, batch_size: int | None = None,
                     sequence_length: int | None = None) -> str:
    """A printable table: layer -> device, bytes per device, cuts, bubble.

    Args:
      split: a SplitModel from tfdist.split_model.
      batch_size: global batch size, to show activation bytes per micro-batch.
      sequence_length: value for dimensions unknown until run time (text
        models); without it those cuts show bytes per sample as a formula in L.

    Example:
      >>> print(tfdist.placement_report(split, batch_size=64))
    """
    if not hasattr(split, "plan"):  # a SequenceParallelModel
        return (f"Sequence parallel: each sequence cut over {len(split.devices)} devices "
                f"({', '.join(_short(d) for d in split.devices)}) x {split.replicas} "
                "replica(s); position-wise layers run on their slice, attention gathers "
                "keys and values; variables stay where the model created them.")
    s = placement_summary(split, batch_size=batch_size, sequence_length=sequence_length)
    lines = [f"Placement: {s['num_stages']} stage(s) x {len(s['replicas'])} replica(s), "
             f"micro_batches={s['micro_batches']}"]
    if len(s["replicas"]) > 1:
        for r, devs in enumerate(s["replicas"]):
            lines.append(f"  replica {r}: stages on {', '.join(devs)}")
    width = max([len("layer")] + [len(l["layer"]) for l in s["layers"]]) + 2
    lines.append(f"  {'layer':<{width}}{'stage device':<14}{'variables on':<24}{'params':>10}")
    for l in s["layers"]:
        where = ", ".join(l["devices"]) or "(no variables)"
        if l["tensor_parallel"]:
            where = f"{l['tensor_parallel']['mode']}-split: " + where
        lines.append(f"  {l['layer']:<{width}}{l['planned']:<14}{where:<24}"
                     f"{_fmt_bytes(l['param_bytes']):>10}")
    lines.append("  bytes per device (from the variables):")
    opt = s["optimizer_bytes_per_device"]
    for d in sorted(set(s["param_bytes_per_device"]) | set(opt or {})):
        o = "optimizer not built yet" if opt is None else _fmt_bytes(opt.get(d, 0))
        lines.append(f"    {d:<20} params {_fmt_bytes(s['param_bytes_per_device'].get(d, 0)):>10}"
                     f"   optimizer state {o}")
    for c in s["cuts"]:
        names = ", ".join(f"{t['from']} {tuple(t['shape'][1:])}" for t in c["tensors"])
        if c["bytes_per_sample"] is None:
            lines.append(f"  cut after stage {c['after_stage']}: {names}: "
                         f"{c['bytes_per_sample_formula']} B/sample (L: the length of the "
                         "unknown dimensions; pass sequence_length= for bytes)")
            continue
        per_mb = (f"{_fmt_bytes(c['bytes_per_micro_batch'])} per micro-batch of "
                  f"{s['micro_batch_size']}" if c["bytes_per_micro_batch"] is not None
                  else "pass batch_size= for bytes per micro-batch")
        lines.append(f"  cut after stage {c['after_stage']}: {names}: "
                     f"{_fmt_bytes(c['bytes_per_sample'])}/sample, {per_mb}")
    lines.append(f"  expected bubble (K-1)/(M+K-1) = {s['bubble']:.3f}; ideal speed-up "
                 f"K*M/(M+K-1) = {s['ideal_speedup']:.2f}x")
    return "\n".join(lines)
