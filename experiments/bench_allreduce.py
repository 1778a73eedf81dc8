"""Where the bandwidth of a 64 MB all-reduce between 2 local workers goes.

    python -m experiments.bench_allreduce [--quick] [--out results/bench_allreduce.json]
        [--trace_dir results/allreduce_trace]

Layer by layer, each measured in the same run on the same machine:

1. raw loopback TCP, one stream (experiments.bench_multiworker);
2. gRPC (grpcio, the same C core TensorFlow's runtime uses) streaming the
   64 MB as 4 MB messages over loopback: the transport with HTTP/2 framing;
3. protobuf: a 64 MB float32 tensor into a `TensorProto` and its bytes and
   back (TensorFlow's gRPC worker service sends collective chunks as
   `RecvBufResponse` protobufs), and a plain 64 MB memcpy for scale;
4. TensorFlow's ring all-reduce (MultiWorkerMirroredStrategy, RING) of 64 MB:
   as one tensor, and as 4 x 16 MB ... 256 x 256 KB tensors in packs of their
   size (bytes_per_pack: one collective each); and tfdist's `bucket_bytes`
   (4 MB, 1 MB), which cuts one 64 MB gradient into such pieces;
5. gRPC transport settings on the single tensor: the RecvBuf response's
   string size (`ConfigProto.experimental.recv_buf_max_chunk`, default 4 KB)
   and HTTP/2 channel arguments (TF_GRPC_DEFAULT_OPTIONS); every TF row also
   reports worker 0's CPU seconds per wall second (copying-bound or waiting);
6. a TensorFlow profiler trace of one 64 MB all-reduce on worker 0: host
   events aggregated by name (written to --trace_dir for TensorBoard), so the
   report names the events that take the time.

Bus bandwidth of a 2-worker all-reduce is 2(N-1)/N * K / t = K / t.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from absl import app, flags

from experiments.rows import print_rows, row as _row, write_rows
from experiments.workers import launch_workers


def _define_flags() -> None:
    """Flags of this module as a program (not at import: experiments.benchmark and
    other bench modules import it, and define flags of the same names)."""
    flags.DEFINE_bool("quick", False, "Fewer repeats (a smoke run).")
    flags.DEFINE_string("out", "results/bench_allreduce.json", "Where to write the JSON.")
    flags.DEFINE_string("trace_dir", None, "Keep worker 0's profiler trace here.")
    flags.DEFINE_string("role", None, "Internal: run as a launched worker with this JSON config.")
    flags.DEFINE_string("worker_out", None, "Internal: the worker's result file.")


FLAGS = flags.FLAGS

MB = 1024 * 1024
SIZE = 64 * MB
PACK = 4 * MB
PACKS = (16 * MB, 4 * MB, 1 * MB, MB // 4)
BUCKETS = (4 * MB, 1 * MB)
# gRPC transport settings tried on the single 64 MB tensor.
TRANSPORT = {
    "recv_buf_max_chunk 1 MB": {"recv_buf_max_chunk": MB},
    "recv_buf_max_chunk -1 (one string)": {"recv_buf_max_chunk": -1},
    "HTTP/2 lookahead 64 MB": {"grpc_options": "grpc.http2.lookahead_bytes=67108864"},
    "HTTP/2 BDP probe off": {"grpc_options": "grpc.http2.bdp_probe=0"},
}


# --- layers measured without TensorFlow's collectives ----------------------------------


def grpc_stream_bytes_per_sec(total: int = SIZE, message: int = PACK, repeats: int = 3) -> float:
    """grpcio client-streaming of `total` bytes in `message`-byte messages over loopback."""
    from concurrent import futures

    import grpc

    def sink(request_iterator, context):
        n = 0
        for chunk in request_iterator:
            n += len(chunk)
        return n.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler("bench", {
        "Sink": grpc.stream_unary_rpc_method_handler(sink)})
    options = [("grpc.max_receive_message_length", 2 * message),
               ("grpc.max_send_message_length", 2 * message)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    payload = b"\0" * message
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.stream_unary("/bench/Sink")
            call(iter([payload]))  # connect, warm up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                call(iter([payload] * (total // message)))
                times.append(time.perf_counter() - start)
    finally:
        server.stop(0)
    return total / statistics.median(times)


def protobuf_seconds(size: int = SIZE, repeats: int = 3) -> dict:
    """Seconds to put a float32 tensor of `size` bytes into a TensorProto's bytes and back."""
    import numpy as np

    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    array = np.ones(size // 4, np.float32)
    encode, decode, copy = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        data = tf.make_tensor_proto(array).SerializeToString()
        encode.append(time.perf_counter() - start)
        start = time.perf_counter()
        proto = tf.make_tensor_proto(np.zeros(1, np.float32))
        proto.ParseFromString(data)
        tf.make_ndarray(proto)
        decode.append(time.perf_counter() - start)
        start = time.perf_counter()
        array.copy()
        copy.append(time.perf_counter() - start)
    return {"encode": statistics.median(encode), "decode": statistics.median(decode),
            "memcpy": statistics.median(copy)}


# --- worker side: TensorFlow's all-reduce ----------------------------------------------


def _worker(config: dict, out: str) -> None:
    import tfdist
    from tfdist._tf import import_tensorflow

    tfdist.configure_threads(intra_op=1)
    tf = import_tensorflow()
    if config.get("recv_buf_max_chunk"):
        from tfdist.compat import grpc_transport

        grpc_transport.set_recv_buf_max_chunk(config["recv_buf_max_chunk"])
    pieces = config["pieces"]
    elements = SIZE // 4 // pieces
    if config.get("bucket_bytes"):
        # tfdist's buckets: one 64 MB gradient cut into bucket_bytes pieces, one
        # collective each (tfdist.comm.CommSync.sum_dense).
        from tfdist import sync as sync_lib

        strategy = tfdist.make_strategy("multi_worker_mirrored", communication="ring",
                                        bucket_bytes=config["bucket_bytes"])
        sync = sync_lib.gradient_sync(strategy)

        def all_reduce(values):
            return sync.sum_dense(values)
    else:
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING,
            bytes_per_pack=config["pack"])
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

        def all_reduce(values):
            return tf.distribute.get_replica_context().all_reduce("SUM", values)

    @tf.function
    def step():
        def replica_fn():
            values = [tf.ones([elements]) * float(i + 1) for i in range(pieces)]
            summed = all_reduce(values)
            return tf.add_n([s[0] for s in summed])

        return strategy.run(replica_fn)

    step().numpy()
    step().numpy()
    times = []
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for _ in range(config["repeats"]):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    # CPU seconds of all this process's threads per wall second: near 1 (or more) means
    # copying/serialising bounds the transfer; well below 1 means the process waits.
    cpu_per_wall = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
    result = {"seconds": statistics.median(times), "cpu_per_wall": cpu_per_wall}
    task = strategy.cluster_resolver.task_id
    if config.get("trace"):
        # Every worker runs the all-reduce; worker 0 records it (one trace file per host name).
        if task == 0:
            tf.profiler.experimental.start(config["trace"])
        step().numpy()
        if task == 0:
            tf.profiler.experimental.stop()
            from tfdist.compat import profiler_trace

            result["events"] = [(name, seconds * 1e3, count) for name, seconds, count
                                in profiler_trace.host_events(config["trace"])]
    if task == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _launch(config: dict) -> dict:
    # grpc_options: channel arguments TensorFlow's gRPC channels read at start-up.
    env = ({"TF_GRPC_DEFAULT_OPTIONS": config["grpc_options"]}
           if config.get("grpc_options") else None)
    return launch_workers("experiments.bench_allreduce", json.dumps(config), num_workers=2,
                          timeout=600, env=env, what="all-reduce")





def run(quick: bool, trace_dir: str | None = None) -> list[dict]:
    from experiments.bench_multiworker import loopback_tcp_bytes_per_sec

    repeats = 3 if quick else 9
    tcp = statistics.median(loopback_tcp_bytes_per_sec(SIZE) for _ in range(3))
    grpc_bw = grpc_stream_bytes_per_sec(repeats=repeats)
    proto = protobuf_seconds(repeats=repeats)
    keep = trace_dir or tempfile.mkdtemp(prefix="allreduce_trace_")
    one = _launch({"pack": 0, "pieces": 1, "repeats": repeats, "trace": keep})
    packed = {pack: _launch({"pack": pack, "pieces": SIZE // pack, "repeats": repeats})
              for pack in PACKS}
    buckets = {size: _launch({"pieces": 1, "repeats": repeats, "bucket_bytes": size})
               for size in BUCKETS}
    transport = {name: _launch({"pack": 0, "pieces": 1, "repeats": repeats, **settings})
                 for name, settings in TRANSPORT.items()}
    bus_one = SIZE / one["seconds"]
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    rows = [
        _row("allreduce64: raw loopback TCP", tcp / 1e9, "GB/s", f"one stream; {load}"),
        _row("allreduce64: gRPC stream of 4 MB messages", grpc_bw / 1e9, "GB/s",
             f"grpcio over loopback: {grpc_bw / tcp:.2f} of raw TCP"),
        _row("allreduce64: TensorProto encode+decode of 64 MB", (proto["encode"] + proto["decode"])
             * 1e3, "ms", f"encode {proto['encode'] * 1e3:.0f} ms, decode "
             f"{proto['decode'] * 1e3:.0f} ms; memcpy of 64 MB {proto['memcpy'] * 1e3:.1f} ms"),
        _row("allreduce64: TF ring all-reduce, one 64 MB tensor", bus_one / 1e9, "GB/s",
             f"bus bandwidth K/t, 2 workers x 1 intra-op thread: {bus_one / tcp:.2f} of raw TCP;"
             f" {one['seconds'] * 1e3:.0f} ms; worker 0 used {one['cpu_per_wall']:.2f} CPU "
             "seconds per second (all threads) while it ran"),
    ]
    def size(nbytes):
        return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // 1024} KB"

    for pack, result in packed.items():
        bus = SIZE / result["seconds"]
        rows.append(_row(
            f"allreduce64: TF ring all-reduce, {SIZE // pack} x {size(pack)} tensors",
            bus / 1e9, "GB/s", f"bytes_per_pack {size(pack)} (one collective per pack): "
            f"{bus / tcp:.2f} of raw TCP, {bus / bus_one:.1f}x the single tensor; "
            f"{result['seconds'] * 1e3:.0f} ms; {result['cpu_per_wall']:.2f} CPU s/s"))
    for bucket, result in buckets.items():
        bus = SIZE / result["seconds"]
        rows.append(_row(
            f"allreduce64: tfdist bucket_bytes={size(bucket)}, one 64 MB tensor", bus / 1e9,
            "GB/s", f"CommSync cuts the tensor into {size(bucket)} pieces, one collective each: "
            f"{bus / tcp:.2f} of raw TCP, {bus / bus_one:.1f}x TensorFlow's single collective; "
            f"{result['seconds'] * 1e3:.0f} ms"))
    for name, result in transport.items():
        bus = SIZE / result["seconds"]
        rows.append(_row(
            f"allreduce64: TF ring all-reduce, one 64 MB tensor, {name}", bus / 1e9, "GB/s",
            f"{bus / tcp:.2f} of raw TCP, {bus / bus_one:.2f}x the default settings; "
            f"{result['seconds'] * 1e3:.0f} ms; {result['cpu_per_wall']:.2f} CPU s/s"))
    events = "; ".join(f"{name} {ms:.0f} ms x{count}" for name, ms, count in one["events"])
    rows.append(_row("allreduce64: profiled host events (worker 0, one all-reduce)",
                     len(one["events"]), "events", f"longest first: {events}; trace in {keep}"))
    return rows


def main(argv):
    del argv
    if FLAGS.role:
        return _worker(json.loads(FLAGS.role), FLAGS.worker_out)
    rows = run(FLAGS.quick, FLAGS.trace_dir)
    print_rows(rows)
    if FLAGS.out:
        write_rows(FLAGS.out, rows, quick=FLAGS.quick,
                   command="python -m experiments.bench_allreduce"
                           + (" --quick" if FLAGS.quick else ""))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
