"""The 1F1B pipeline schedule: one forward, one backward per stage in steady state.

GPipe (and the default "free" schedule) runs every micro-batch's forward before
any backward, because the loss is computed on the whole batch: stage 0 holds the
activations of all M micro-batches at the peak. 1F1B (PipeDream-flush, Megatron's
default) computes each micro-batch's loss as soon as its forward leaves the last
stage and starts that micro-batch's backward there, so stage s runs
min(K - s - 1, M) warm-up forwards, then alternates one forward and one backward,
then drains: it never holds more than K - s micro-batches' activations.

How it is built (TensorFlow graph mode, inside Keras's train step):
- each stage's forward for micro-batch i reads its inputs through
  `tf.stop_gradient` copies, so its backward can be taken on its own:
  `tf.gradients(stage outputs, [input copies] + variables, grad_ys=dY)`, with dY
  the gradients later stages (or the loss) sent back for those outputs;
- each stage's tasks are chained by control dependencies in 1F1B order, so the
  executor cannot run ahead of the schedule; `tf.gradients` colocates every
  gradient op with its forward op, so backward work stays on the stage's device;
- the batch's loss is the mean of the micro-batches' losses (equal micro-batches:
  the same as Keras's mean over the batch); weight gradients are summed over the
  micro-batches as they come (one running sum per weight, on its device), weight
  penalties (regularizers) added once.

Numbers equal GPipe and the unsplit model up to fp32 summation order
(tests/split/test_one_f_one_b.py); the peak memory is measured by
`python -m experiments.split_memory`.
"""

from __future__ import annotations

from tfdist._tf import import_tensorflow
from tfdist.compat import keras_graph, placed_training


def schedule(num_stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """Each stage's tasks in 1F1B order: [("F", i) | ("B", i), ...] per stage."""
    k, m = num_stages, micro_batches
    order = []
    for s in range(k):
        warm = min(k - s - 1, m)
        tasks = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            tasks += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        tasks += [("B", i) for i in range(b, m)]
        order.append(tasks)
    return order


def max_in_flight(num_stages: int, micro_batches: int) -> list[int]:
    """Per stage, the most micro-batches forwarded but not yet backwarded (K - s for 1F1B)."""
    peaks = []
    for tasks in schedule(num_stages, micro_batches):
        live = peak = 0
        for kind, _ in tasks:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _is_float(t) -> bool:
    return t is not None and hasattr(t, "dtype") and t.dtype.is_floating


def _sum_gradients(parts):
    tf = import_tensorflow()
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                                tf.concat([p.indices for p in parts], 0), parts[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(p) for p in parts])


def _markers(tensors) -> list:
    tf = import_tensorflow()
    out = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            out.append(t.values)
        elif t is not None and tf.is_tensor(t):
            out.append(t)
    return out


def train_step(split, data):
    """Keras's train step for a SplitModel with schedule="1f1b" (graph mode)."""
    tf = import_tensorflow()
    import keras

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    k, m = len(split.stages), split.micro_batches
    micro, _ = split.micro_batch_inputs(x, True)
    def pieces(structure):
        if structure is None:
            return [None] * m
        if m == 1:
            return [structure]
        flat = [tf.split(t, m, axis=0) for t in keras.tree.flatten(structure)]
        return [keras.tree.pack_sequence_as(structure, [f[i] for f in flat]) for i in range(m)]

    with tf.device(split.stage_device(k - 1)):
        ys, sws = pieces(y), pieces(sample_weight)
    variables = list(split.trainable_weights)
    var_values = [v.value for v in variables]
    grads: list[list] = [[] for _ in variables]
    copies: dict[tuple[int, int], list] = {}     # (stage, micro) -> [(key, copy)]
    dys: list[dict] = [{} for _ in range(m)]       # micro -> {key: [gradient parts]}
    preds: list[list] = [None] * m
    losses: list = [None] * m
    last_task: list[list] = [[] for _ in range(k)]
    done: set[tuple[str, int, int]] = set()
    order = schedule(k, m)
    position = [0] * k
    final_keys = split.layer_graph.output_keys
    model_inputs = set(split.layer_graph.input_keys)  # no gradient needed for the data

    def forward(s, i):
        stage = split.stages[s]
        values = micro[i]
        own = []
        with tf.device(split.stage_device(s)), tf.control_dependencies(last_task[s]):
            for key in stage.input_keys:
                if _is_float(values[key]) and key not in model_inputs:
                    copy = tf.stop_gradient(values[key])
                    own.append((key, copy))
            local = dict(values)
            local.update(own)
            stage.run(local, True)
            for key in stage.output_keys:
                values[key] = local[key]
            copies[(s, i)] = own
            markers = [local[key] for key in stage.output_keys]
            if s == k - 1:
                pred_copies = [(key, tf.stop_gradient(values[key])) if key not in
                               stage.output_keys and _is_float(values[key]) else
                               (key, values[key]) for key in final_keys]
                copies[(s, i)] = own + [(key, c) for key, c in pred_copies
                                        if key not in stage.output_keys and _is_float(c)]
                y_pred = split.layer_graph.pack_outputs([c for _, c in pred_copies])
                preds[i] = [values[key] for key in final_keys]
                loss = placed_training.compiled_loss(split, ys[i], y_pred, sws[i])
                losses[i] = loss
                markers = [loss]
        last_task[s] = _markers(markers)

    def backward(s, i):
        stage = split.stages[s]
        values = micro[i]
        with tf.device(split.stage_device(s)), tf.control_dependencies(last_task[s]):
            if s == k - 1:
                scaled = split.optimizer.scale_loss(losses[i] / m) \
                    if split.optimizer is not None else losses[i] / m
                ys_, grad_ys = [scaled], None
            else:
                pairs = [(values[key], _sum_gradients(dys[i].pop(key)))
                         for key in stage.output_keys if key in dys[i]]
                pairs = [(t, g) for t, g in pairs if g is not None and _is_float(t)]
                if not pairs:
                    last_task[s] = []
                    return
                ys_, grad_ys = [t for t, _ in pairs], [tf.convert_to_tensor(g) for _, g in pairs]
            inputs = copies.pop((s, i))
            xs = [c for _, c in inputs] + var_values
            out = tf.gradients(ys_, xs, grad_ys=grad_ys,
                               unconnected_gradients=tf.UnconnectedGradients.NONE)
            for (key, _), g in zip(inputs, out[:len(inputs)]):
                if g is not None:
                    dys[i].setdefault(key, []).append(g)
            sums = []
            for j, g in enumerate(out[len(inputs):]):
                if g is not None:  # a running sum: one accumulator per weight stays alive
                    grads[j] = [_sum_gradients(grads[j] + [g])]
                    sums.append(grads[j][0])
        # The stage's next task waits for the sums: the executor adds each micro-batch's
        # weight gradients in before moving on, and Grappler cannot fold the chain of
        # additions into one AddN over all M gradients (which would keep M alive).
        last_task[s] = _markers(sums) or _markers(out)

    while any(position[s] < len(order[s]) for s in range(k)):
        progressed = False
        for s in range(k):
            if position[s] >= len(order[s]):
                continue
            kind, i = order[s][position[s]]
            if kind == "F":
                ready = s == 0 or ("F", s - 1, i) in done
            else:
                ready = ("F", s, i) in done and (s == k - 1 or ("B", s + 1, i) in done)
            if not ready:
                continue
            (forward if kind == "F" else backward)(s, i)
            done.add((kind, s, i))
            position[s] += 1
            progressed = True
        if not progressed:  # pragma: no cover - the schedule is always executable
            raise RuntimeError(f"1F1B schedule stalled at {position}")
    extra = keras_graph.call_losses(split)
    if extra:
        raise ValueError(
            "schedule='1f1b' cannot train layers that add losses during their call "
            "(add_loss: a mixture of experts' load-balancing loss, activity regularizers): "
            "their gradients would cross stages outside the schedule. Use schedule='gpipe' "
            "or 'free' for this model.")
    penalties = keras_graph.regularization_losses(split)
    total = tf.add_n(losses) / m
    if penalties:
        penalty = tf.add_n(penalties)
        total = total + penalty
        scaled = split.optimizer.scale_loss(penalty) if split.optimizer is not None else penalty
        for j, g in enumerate(tf.gradients(scaled, var_values)):
            if g is not None:
                grads[j].append(g)
    batch = tf.shape(next(t for t in keras.tree.flatten(x) if t is not None))[0]
    placed_training.track_loss(split, total, batch)
    final = [_sum_gradients(g) for g in grads]
    pairs = [(g, v) for g, v in zip(final, variables) if g is not None]
    split.optimizer.apply_gradients(pairs)
    with tf.device(split.stage_device(k - 1)):
        outs = [tf.concat([p[j] for p in preds], 0) if m > 1 else preds[0][j]
                for j in range(len(final_keys))]
    y_pred = split.layer_graph.pack_outputs(outs)
    return split.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
