"""TensorFlow's gRPC transport settings that no public API reaches (for measurements).

`ConfigProto.experimental.recv_buf_max_chunk` sets how TensorFlow's gRPC
worker cuts a collective's chunk into strings of the `RecvBuf` response
(default 4096 bytes; -1: one string). MultiWorkerMirroredStrategy builds its
server from the eager context's config (`context.context().config`, which
starts from the private `Context._config`), so the setting has to go there
before the strategy is created. experiments/bench_allreduce.py uses it to
show whether this layer bounds the all-reduce bandwidth.
"""

from __future__ import annotations


def set_recv_buf_max_chunk(num_bytes: int) -> None:
    """Makes servers created after this call cut RecvBuf responses into `num_bytes` strings.

    Raises:
      ValueError: `num_bytes` is not an int (-1: no cutting, 0: TensorFlow's default).
    """
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < -1:
        raise ValueError("recv_buf_max_chunk must be an integer >= -1 (-1: one string, 0: "
                         f"TensorFlow's default of 4096). Received: {num_bytes!r}")
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    config = config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    config.experimental.recv_buf_max_chunk = num_bytes
    ctx._config = config
