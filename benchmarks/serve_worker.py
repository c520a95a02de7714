"""Time one SavedModel as a server runs it, in this process alone: the benchmarks' worker.

A server holds one model per process: this script loads the SavedModel at ``PATH`` into a TF1
session as TF Serving does (``tf.compat.v1.saved_model.loader.load``, tag ``serve``, the
signature ``--signature``), optionally with grappler's oneDNN bfloat16 pass on (``--grappler``),
feeds the inputs of an ``.npz`` (one array per signature input key, the batch first; ``KEY@B``
for batch B when several batches are timed), runs warm-up calls, then times calls for about
``--seconds`` (at least ``--min-runs``) per batch, and prints one JSON line: batch -> the
median seconds of a call, with the runs' 10th and 90th percentiles.

Run: ``python benchmarks/serve_worker.py PATH FEEDS.npz [--grappler] [--seconds 3]``; a frozen
GraphDef: ``PATH.pb FEEDS.npz --fetch TENSOR`` (the .npz keys the tensors fed)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("feeds")
    ap.add_argument("--signature", default="serving_default")
    ap.add_argument("--grappler", action="store_true")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--min-runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fetch", help="a GraphDef file (.pb) instead: the tensor to fetch; the "
                    ".npz keys are then the tensors to feed")
    args = ap.parse_args(argv)

    import numpy as np
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    v1 = tf.compat.v1
    config = config_pb2.ConfigProto()
    if args.grappler:
        config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = (
            rewriter_config_pb2.RewriterConfig.ON)
    g = tf.Graph()
    sess = v1.Session(graph=g, config=config)
    with g.as_default():
        if args.fetch:   # a frozen GraphDef, as a TF1 server holds one
            graph_def = tf.compat.v1.GraphDef()
            with open(args.path, "rb") as f:
                graph_def.ParseFromString(f.read())
            tf.graph_util.import_graph_def(graph_def, name="")
            fetches, tensor = [args.fetch], (lambda name: name)
        else:
            meta = v1.saved_model.loader.load(sess, ["serve"], args.path)
            sig = meta.signature_def[args.signature]
            fetches = [t.name for _, t in sorted(sig.outputs.items())]
            tensor = (lambda name: sig.inputs[name].name)
    data = np.load(args.feeds)
    batches: dict[int, dict[str, np.ndarray]] = {}
    for key in data.files:
        name, _, batch = key.partition("@")
        batches.setdefault(int(batch or len(data[key])), {})[tensor(name)] = data[key]
    result = {}
    for batch, feed in sorted(batches.items()):
        for _ in range(args.warmup):
            sess.run(fetches, feed)
        times: list[float] = []
        deadline = time.perf_counter() + args.seconds
        while len(times) < args.min_runs or time.perf_counter() < deadline:
            start = time.perf_counter()
            sess.run(fetches, feed)
            times.append(time.perf_counter() - start)
        times.sort()
        result[batch] = {"median": statistics.median(times), "runs": len(times),
                         "p10": times[len(times) // 10], "p90": times[(len(times) * 9) // 10]}
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)   # skip the interpreter's teardown of TensorFlow


if __name__ == "__main__":
    sys.exit(main())
