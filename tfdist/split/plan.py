"""Placement plans: which device runs each layer, and which layers are split.

A `SplitPlan` is a frozen, validated table `layer name -> device` in the model's
layer order, plus optional tensor-parallel entries `layer name -> (mode,
devices)`. Plans are plain data: this module imports no TensorFlow, so plans
can be built, edited, saved and printed anywhere (the CLI, notebooks, tests).

Three ways to get one:

    plan = SplitPlan.from_dict({"dense": "/cpu:0", "dense_1": "/cpu:1"})
    plan = plan_balanced(model, 2, by="params")      # in balance.py (needs the model)
    plan = plan_from_rules(model, {"enc.*": "/cpu:0", "dec.*": "/cpu:1"})

Stages are the maximal runs of consecutive layers (in the model's order)
that share a device; a pipeline over K stages has the bubble (K-1)/(M+K-1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Literal, Mapping, Sequence

from tfdist.devices import canonical_device
from tfdist.planning import pipeline

TensorParallelMode = Literal["column", "row"]
TP_MODES: tuple[str, ...] = ("column", "row")
_FORMAT = "tfdist.split.Plan/1"  # the class's former name: saved plans keep loading


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One layer split across devices.

    Attributes:
      mode: "column" splits the output features (each device computes a
        slice of the outputs; results are concatenated), "row" splits the
        input features (each device computes a partial product; results are
        summed).
      devices: the devices holding the shards, in shard order.
    """

    mode: TensorParallelMode
    devices: tuple[str, ...]

    def __post_init__(self):
        if self.mode not in TP_MODES:
            raise ValueError(
                f"tensor-parallel mode must be one of {TP_MODES}. Received: mode={self.mode!r}"
            )
        devices = tuple(canonical_device(d) for d in self.devices)
        if len(devices) < 2 or len(set(devices)) != len(devices):
            raise ValueError(
                "A tensor-parallel layer needs >= 2 distinct devices. "
                f"Received: devices={list(self.devices)!r}"
            )
        object.__setattr__(self, "devices", devices)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """A validated layer -> device table in model order (frozen; edit with `replace`).

    Attributes:
      assignments: ((layer_name, device), ...) in the model's layer order.
      tensor_parallel: ((layer_name, TensorParallel), ...) layers split
        across devices; their `assignments` device is where their inputs
        arrive and their outputs leave (the first shard's device).

    Example:
      >>> plan = SplitPlan.from_dict({"a": "/cpu:0", "b": "/cpu:1"})
      >>> plan.stages
      (('/device:CPU:0', ('a',)), ('/device:CPU:1', ('b',)))
    """

    assignments: tuple[tuple[str, str], ...]
    tensor_parallel: tuple[tuple[str, TensorParallel], ...] = ()

    def __post_init__(self):
        assignments = tuple(self.assignments)
        if not assignments:
            raise ValueError("A plan needs at least one layer. Received: assignments=()")
        seen: set[str] = set()
        canon = []
        for entry in assignments:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                raise ValueError(
                    "Plan assignments must be (layer_name, device) pairs. "
                    f"Received: {entry!r}"
                )
            name, device = entry
            if not isinstance(name, str) or not name:
                raise ValueError(f"Layer names must be non-empty strings. Received: {name!r}")
            if name in seen:
                raise ValueError(
                    f"Layer {name!r} appears twice in the plan; each layer gets one device."
                )
            seen.add(name)
            canon.append((name, canonical_device(device)))
        object.__setattr__(self, "assignments", tuple(canon))
        tp = []
        for name, spec in self.tensor_parallel:
            if name not in seen:
                raise ValueError(
                    f"Tensor-parallel layer {name!r} is not in the plan. "
                    f"Layers: {', '.join(self.layer_names)}"
                )
            if isinstance(spec, Mapping):
                spec = TensorParallel(mode=spec["mode"], devices=tuple(spec["devices"]))
            tp.append((name, spec))
        object.__setattr__(self, "tensor_parallel", tuple(tp))

    # --- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, mapping: Mapping[str, str], *,
                  tensor_parallel: Mapping[str, Any] | None = None) -> "SplitPlan":
        """Plan from {layer_name: device} (in the dict's order)."""
        tp = tuple((k, v if isinstance(v, TensorParallel) else
                    TensorParallel(mode=v[0], devices=tuple(v[1]))
                    if isinstance(v, (tuple, list)) else v)
                   for k, v in (tensor_parallel or {}).items())
        return cls(assignments=tuple(mapping.items()), tensor_parallel=tp)

    def replace(self, updates: Mapping[str, str] | None = None, *,
                tensor_parallel: Mapping[str, Any] | None = None) -> "SplitPlan":
        """A new plan with some layers moved (and/or tensor-parallel entries set).

        Args:
          updates: {layer_name: new_device}; names must already be in the plan.
          tensor_parallel: {layer_name: TensorParallel | (mode, devices) | None}
            (None removes the entry).
        """
        updates = dict(updates or {})
        unknown = sorted(set(updates) - set(self.layer_names))
        if unknown:
            raise ValueError(
                f"Cannot move layers that are not in the plan: {unknown}. "
                f"Layers: {', '.join(self.layer_names)}"
            )
        assignments = tuple((n, updates.get(n, d)) for n, d in self.assignments)
        tp = dict(self.tensor_parallel)
        for name, spec in (tensor_parallel or {}).items():
            if spec is None:
                tp.pop(name, None)
            elif isinstance(spec, TensorParallel):
                tp[name] = spec
            else:
                tp[name] = TensorParallel(mode=spec[0], devices=tuple(spec[1]))
        return SplitPlan(assignments=assignments, tensor_parallel=tuple(tp.items()))

    # --- views ----------------------------------------------------------------------
    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.assignments)

    @property
    def devices(self) -> tuple[str, ...]:
        """Distinct devices in first-use order (tensor-parallel shards included)."""
        out: list[str] = []
        for _, d in self.assignments:
            if d not in out:
                out.append(d)
        for _, spec in self.tensor_parallel:
            for d in spec.devices:
                if d not in out:
                    out.append(d)
        return tuple(out)

    def device_of(self, layer_name: str) -> str:
        for n, d in self.assignments:
            if n == layer_name:
                return d
        raise ValueError(
            f"Layer {layer_name!r} is not in the plan. Layers: {', '.join(self.layer_names)}"
        )

    def tensor_parallel_of(self, layer_name: str) -> TensorParallel | None:
        return dict(self.tensor_parallel).get(layer_name)

    @property
    def stages(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """((device, (layer names...)), ...): maximal runs of layers on one device."""
        runs: list[tuple[str, list[str]]] = []
        for name, device in self.assignments:
            if runs and runs[-1][0] == device:
                runs[-1][1].append(name)
            else:
                runs.append((device, [name]))
        return tuple((d, tuple(names)) for d, names in runs)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # --- files -------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": _FORMAT,
            "assignments": [[n, d] for n, d in self.assignments],
            "tensor_parallel": {n: {"mode": s.mode, "devices": list(s.devices)}
                                for n, s in self.tensor_parallel},
        }, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "SplitPlan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"A plan file must be JSON written by SplitPlan.save: {e}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(
                f"Not a tfdist plan: expected a JSON object with \"format\": \"{_FORMAT}\". "
                "Write plans with SplitPlan.save(path) (or `tfdist.split.save_plan`)."
            )
        tp = tuple((n, TensorParallel(mode=s["mode"], devices=tuple(s["devices"])))
                   for n, s in data.get("tensor_parallel", {}).items())
        return cls(assignments=tuple(tuple(a) for a in data["assignments"]),
                   tensor_parallel=tp)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SplitPlan":
        if not os.path.exists(path):
            raise ValueError(f"Plan file not found. Received: path={str(path)!r}")
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def __str__(self) -> str:
        lines = [f"Plan: {len(self.assignments)} layers, {self.num_stages} stage(s)"]
        for i, (device, names) in enumerate(self.stages):
            lines.append(f"  stage {i} on {device}: {', '.join(names)}")
        for name, spec in self.tensor_parallel:
            lines.append(f"  {name}: {spec.mode}-parallel over {', '.join(spec.devices)}")
        return "\n".join(lines)


def validate_against(plan: SplitPlan, layer_names: Sequence[str]) -> None:
    """Checks that a plan covers exactly the model's layers, in the model's order.

    Raises:
      ValueError: naming missing / unknown layers.
    """
    model_names = list(layer_names)
    missing = [n for n in model_names if n not in plan.layer_names]
    unknown = [n for n in plan.layer_names if n not in model_names]
    if missing or unknown:
        raise ValueError(
            "The plan does not match the model's layers. "
            + (f"Layers without a device: {missing}. " if missing else "")
            + (f"Plan entries for layers the model does not have: {unknown}. " if unknown else "")
            + f"Model layers: {model_names}."
        )


def in_model_order(plan: SplitPlan, layer_names: Sequence[str]) -> SplitPlan:
    """The same plan with assignments sorted into the model's layer order.

    Stages follow the model's order (the data flow), whatever order a
    hand-written plan lists its layers in.
    """
    validate_against(plan, layer_names)
    devices = dict(plan.assignments)
    return SplitPlan(assignments=tuple((n, devices[n]) for n in layer_names),
                     tensor_parallel=plan.tensor_parallel)


def rules_to_assignments(layer_names: Iterable[str],
                         rules: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Applies {regex: device} rules like Keras's LayoutMap: exactly one rule per layer.

    A rule matches a layer when `re.search(rule, layer_name)` succeeds.

    Raises:
      ValueError: an invalid regex, a rule that matches no layer, a layer
        that matches no rule, or a layer that matches more than one rule.
    """
    if not rules:
        raise ValueError("rules must map at least one regex to a device. Received: rules={}")
    compiled = []
    for pattern, device in rules.items():
        try:
            compiled.append((pattern, re.compile(pattern), canonical_device(device)))
        except re.error as e:
            raise ValueError(f"Invalid regex in rules: {pattern!r} ({e}).") from None
    names = list(layer_names)
    out, unmatched, ambiguous = [], [], []
    used: set[str] = set()
    for name in names:
        hits = [(p, d) for p, rx, d in compiled if rx.search(name)]
        if not hits:
            unmatched.append(name)
        elif len(hits) > 1:
            ambiguous.append(f"{name!r} matches {[p for p, _ in hits]}")
        else:
            used.add(hits[0][0])
            out.append((name, hits[0][1]))
    if ambiguous:
        raise ValueError(
            "Ambiguous placement rules: " + "; ".join(ambiguous)
            + ". Each layer must match exactly one rule (like keras LayoutMap); "
            "make the patterns more specific, e.g. anchor them with ^...$."
        )
    if unmatched:
        raise ValueError(
            f"Layers matching no placement rule: {unmatched}. Rules: {list(rules)}. "
            "Add a rule for them (each layer needs exactly one device)."
        )
    unused = [p for p, _, _ in compiled if p not in used]
    if unused:
        raise ValueError(
            f"Placement rules matching no layer: {unused}. Layers: {names}. "
            "Fix or remove these rules."
        )
    return tuple(out)


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction (K-1)/(M+K-1) (`tfdist.planning.pipeline_bubble`)."""
    return pipeline.pipeline_bubble(stages=num_stages, micro_batches=micro_batches)


def ideal_speedup(num_stages: int, micro_batches: int) -> float:
    """K*M/(M+K-1): K stages busy except during the fill/drain bubble."""
    return pipeline.pipeline_speedup(stages=num_stages, micro_batches=micro_batches)


def __getattr__(name: str):
    if name == "Plan":  # SplitPlan's former name (the planner had a Plan too)
        import warnings

        warnings.warn("tfdist.split.Plan is now tfdist.split.SplitPlan.", DeprecationWarning,
                      stacklevel=2)
        return SplitPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
