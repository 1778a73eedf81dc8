"""The `parameter_server` preset's factory: the cluster and the strategy.

`build_strategy` is the registry's factory; `tfdist.make_strategy` then
attaches the preset's features (the Keras fixes, exact counters and worker
recovery on the coordinator: `tfdist.strategies.PARAMETER_SERVER_FEATURES`).
"""

from __future__ import annotations

from tfdist import config as config_lib
from tfdist._tf import import_tensorflow
from tfdist.ps import servers


def _partitioner(tf, options: config_lib.ParameterServerOptions, num_ps: int):
    partitioners = tf.distribute.experimental.partitioners
    if options.shard_count is not None:
        return partitioners.FixedShardsPartitioner(num_shards=options.shard_count)
    if options.min_shard_bytes is not None:
        return partitioners.MinSizePartitioner(
            min_shard_bytes=options.min_shard_bytes,
            max_shards=options.max_shards or num_ps)
    return None


def build_strategy(options: config_lib.ParameterServerOptions):
    """The bare ParameterServerStrategy of the cluster `options` describe.

    In a TF_CONFIG cluster, worker and ps tasks do not return: they serve
    until stopped and then exit 0, so one script runs on every task (servers
    never import Keras).

    Raises:
      ValueError: no cluster, a cluster without chief, ps or workers, or a task
        type that cannot run here.
      ParameterServerError: a worker or ps unreachable within connect_timeout.
    """
    tf = import_tensorflow()
    resolver, num_ps = servers.resolve_cluster(options)
    return tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=_partitioner(tf, options, num_ps))


def make_strategy(options: config_lib.ParameterServerOptions):
    """The parameter_server preset's strategy: `tfdist.make_strategy(options)`."""
    from tfdist import strategies

    return strategies.make_strategy(options)
