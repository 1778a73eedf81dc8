"""Sharded data parallelism (ZeRO stages 1-3) and host offload for Keras 3 `model.fit`.

An option of the synchronous presets, `mirrored` and `multi_worker_mirrored`:

    strategy = tfdist.make_strategy("mirrored", shard="gradients")
    with strategy.scope():
        model = build_model(); model.compile(optimizer="adam", loss=...)
    model.fit(dataset, epochs=3)

With N replicas:

- shard="optimizer" (ZeRO-1): each replica keeps and updates 1/N of every
  optimizer slot; the updated shards are all-gathered into every replica's
  whole weights.
- shard="gradients" (ZeRO-2): also reduce-scatters the gradients, so a
  replica only ever holds the summed gradient of its own shard.
- shard="parameters" (ZeRO-3, the FSDP idea): also stores 1/N of each large
  weight; each layer gathers its weights when it runs, drops them, and
  gathers them again for its backward pass.
- offload="optimizer" (ZeRO-Offload): the optimizer state and its update live
  on the host CPU, the replicas' devices keep weights and activations.

Variables smaller than `shard_min_bytes` (biases, norms) stay replicated.
Checkpoints hold whole variables: a sharded run saves what an unsharded one
does and loads into one (and back). See docs/sharding.md for the memory
formula, the costs and measured numbers.
"""

from __future__ import annotations

from typing import Any

from tfdist.sharding.plan import ShardingPlan, plan_of

__all__ = [
    "ShardingPlan",
    "attach",
    "plan_of",
    "register_elementwise_optimizer",
    "gatherable_layers",
    "register_gatherable_layer",
    "supported_optimizers",
]


def attach(strategy: Any, options: Any) -> ShardingPlan | None:
    """Makes `strategy` (made by tfdist) shard its training state as `options` say.

    Called by `tfdist.make_strategy` for the mirrored and multi_worker_mirrored
    presets; a no-op for `shard="none"`.

    Returns:
      The plan, or None without sharding.

    Raises:
      ValueError: offload without a host device distinct from the replicas, or
        replicas TensorFlow cannot run collectives between.
    """
    from tfdist import sync as gradient_sync_lib
    from tfdist.compat import _owner, optimizer_update
    from tfdist.compat import sharding_collectives as collectives
    from tfdist.compat import sharding_variables
    from tfdist.sharding import plan as plan_lib
    from tfdist.sharding import sync as sync_lib

    if getattr(options, "shard", "none") == "none":
        return None
    if not _owner.owns(strategy):
        raise ValueError("tfdist.sharding.attach takes a strategy made by tfdist.make_strategy. "
                         f"Received: {type(strategy).__name__}.")
    layout = collectives.replica_layout(strategy)
    host = plan_lib.host_device_for(layout.local_devices)
    if options.offload != "none":
        plan_lib.check_offload(layout.local_devices, host)
    plan = ShardingPlan(shard=options.shard, offload=options.offload != "none",
                        min_bytes=options.shard_min_bytes, num_replicas=layout.num_replicas,
                        local_devices=layout.local_devices, ranks=layout.ranks,
                        host_device=host, remat=getattr(options, "shard_remat", True))
    sharding_variables.install()
    optimizer_update.install()
    plan_lib.register(strategy, plan)
    gradient_sync_lib.set_gradient_sync(strategy, sync_lib.ShardedSync(strategy, plan))
    return plan


def register_elementwise_optimizer(cls: type) -> type:
    """Declares an optimizer class whose `update_step` is element-wise (usable as decorator).

    Sharding runs `update_step` on each replica's shard; that equals the
    unsharded update only if each element's update reads nothing but that
    element of the variable, its gradient and its slots.
    """
    from tfdist.sharding import registry

    return registry.register_elementwise_optimizer(cls)


def register_gatherable_layer(cls: type) -> type:
    """Declares a layer class whose `call` is a pure function of inputs and weights.

    At shard="parameters" such a layer runs under `keras.remat`: the weights
    it gathers are dropped after its forward pass and gathered again for its
    backward pass, so its call runs twice and must not update state or draw
    random numbers. Every other layer is exact too, but keeps its gathered
    weights from its forward to its backward pass. Usable as a decorator.
    """
    from tfdist.sharding import registry

    return registry.register_gatherable_layer(cls)


def supported_optimizers() -> tuple[str, ...]:
    """Optimizer classes sharding accepts (element-wise updates)."""
    from tfdist.sharding import registry

    return registry.supported_optimizers()


def gatherable_layers() -> tuple[str, ...]:
    """Layer classes (module-qualified) that drop their gathered weights after the forward pass.

    Keras's Dense, EinsumDense, Embedding, convolutions and normalizations (and
    their subclasses), the KerasHub layers whose call is pure (position
    embeddings, its RMS and layer norms, ViT's patch embedding, ...), and the
    classes given to `register_gatherable_layer`. Other layers are not refused:
    they keep their gathered weights until their backward pass.
    """
    from tfdist.sharding import registry

    return registry.gatherable_layers()
