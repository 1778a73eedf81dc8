"""The `parameter_server` preset's factory: cluster, Keras fixes, strategy, coordinator."""

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


def make_strategy(options: config_lib.ParameterServerOptions):
    """Builds the strategy (see `tfdist.make_strategy("parameter_server", ...)`).

    In a TF_CONFIG cluster, worker and ps tasks do not return: they serve
    until stopped and then exit 0, so one script runs on every task. On the
    coordinator, the fixes of tfdist.compat.ps_variables, ps_tables and ps_fit are
    installed (they apply only to strategies tfdist made); the preset's
    `ps_recovery` feature (`attach_recovery`) then creates the strategy's
    ClusterCoordinator with tfdist's worker-recovery handling.

    Raises:
      ValueError: no cluster, a cluster without chief, ps or workers, or a task
        type that cannot run here.
      ParameterServerError: a worker or ps unreachable within connect_timeout.
    """
    tf = import_tensorflow()
    resolver, num_ps = servers.resolve_cluster(options)
    # Only the coordinator needs the Keras fixes (servers never import Keras).
    from tfdist.compat import ps_fit, ps_keras, ps_tables, ps_variables
    from tfdist.ps import keras_api

    ps_keras.check()
    ps_variables.install()
    ps_tables.install()
    ps_fit.set_routes(keras_api.ROUTES)
    ps_fit.install()
    strategy = tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=_partitioner(tf, options, num_ps))
    return strategy


def attach_recovery(strategy, options: config_lib.ParameterServerOptions, state) -> None:
    """The preset's `ps_recovery` feature: the strategy's coordinator recovers workers.

    The coordinator is a singleton per strategy: made here, it is also the one a
    custom loop's `ClusterCoordinator(strategy)` gets, with tfdist's recovery.
    """
    from tfdist.compat import ps_recovery
    from tfdist.ps.errors import ParameterServerError
    from tfdist.ps.trainer import coordinator_for

    state.skip_completed_reruns = options.skip_completed_reruns
    ps_recovery.attach(coordinator_for(strategy), all_lost_timeout=options.connect_timeout,
                       reachable=lambda address: servers.reachable(address, timeout=1.0),
                       all_lost_error=ParameterServerError)
