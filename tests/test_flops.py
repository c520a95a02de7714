"""FLOPs the cost model counts for gradient convolutions and Einsum, against TensorFlow's own
count (``tf.compat.v1.profiler``, on the same graph with its shapes fixed) or the count by hand
from the shapes."""

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import convert
from amp_rewrite.core.ir import Graph, TensorRef
from amp_rewrite.paint.costs import _FLOPS_PER_OUTPUT, matrix_intensity
from amp_rewrite.schema.shapes import Shapes

v1 = tf.compat.v1
BATCH = 2


def _flops(graph: Graph, shapes: Shapes, name: str) -> float | None:
    """What runtime_estimate counts for one matrix op: FLOPs per output element x elements."""
    node = graph.node(name)
    per = _FLOPS_PER_OUTPUT[node.op](graph, shapes, node)
    count = shapes.elements(TensorRef(name, 0))
    return None if per is None or count is None else per * count


def _profiled(g: tf.Graph) -> dict[str, int]:
    """TensorFlow's FLOPs per node (ops with a registered count)."""
    opts = v1.profiler.ProfileOptionBuilder.float_operation()
    opts["output"] = "none"
    tree = v1.profiler.profile(g, cmd="scope", options=opts)
    out = {}

    def walk(node):
        out[node.name] = node.float_ops
        for child in node.children:
            walk(child)
    walk(tree)
    return out


def conv_grads(batch):
    """Convolutions (stride 1 and 2, SAME and VALID, NHWC) and a depthwise one, with the
    gradients TensorFlow builds for their inputs and filters; the filters are Consts, so
    their sizes come from ShapeN/Shape as a variable's would."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [batch, 12, 12, 8], name="x")
        outs = {}
        for name, (k, cout, stride, pad) in {"same1": (3, 16, 1, "SAME"), "same2": (3, 16, 2, "SAME"),
                                             "valid2": (5, 4, 2, "VALID")}.items():
            w = tf.constant(r.normal(0, 0.1, (k, k, 8, cout)).astype(np.float32), name=f"w_{name}")
            outs[name] = (tf.nn.conv2d(x, w, stride, pad, name=name), w)
        dw = tf.constant(r.normal(0, 0.1, (3, 3, 8, 2)).astype(np.float32), name="w_dw")
        outs["dw"] = (tf.nn.depthwise_conv2d(x, dw, [1, 2, 2, 1], "SAME", name="dw"), dw)
        loss = tf.add_n([tf.reduce_sum(tf.square(y)) for y, _ in outs.values()])
        tf.gradients(loss, [x] + [w for _, w in outs.values()])
    return g


@pytest.fixture(scope="module", params=[BATCH, None], ids=["batch2", "open_batch"])
def grads(request):
    batch = request.param
    g = conv_grads(batch)
    graph = Graph.from_graph_def(g.as_graph_def())
    fixed = g if batch else conv_grads(BATCH)   # the profiler needs every shape known
    return batch, g, graph, Shapes(graph), _profiled(fixed)


def test_gradient_convolutions_do_their_forward_convolutions_flops(grads):
    """Each gradient does exactly the multiply-adds of its forward convolution (TensorFlow's
    count of that, all paddings and strides); with an open batch, per sample."""
    batch, g, graph, shapes, tf_flops = grads
    per_sample = 1 if batch else BATCH
    kinds = {"Conv2DBackpropInput", "Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropInput",
             "DepthwiseConv2dNativeBackpropFilter"}
    seen = set()
    for op in g.get_operations():
        if op.type not in kinds:
            continue
        forward = next(f for f in ("same1", "same2", "valid2", "dw") if f"/{f}_grad/" in op.name)
        ours = _flops(graph, shapes, op.name)
        assert ours is not None, op.name
        assert ours * per_sample == pytest.approx(tf_flops[forward]), op.name
        seen.add(op.type)
    assert seen == kinds


def test_gradient_convolutions_agree_with_tensorflows_own_gradient_counts(grads):
    """TensorFlow counts Conv2DBackpropInput/Filter as 2·N·H·W·kh·kw·cout/stride², exact where
    the stride divides the image ("SAME"): there, ours is the same number."""
    batch, g, graph, shapes, tf_flops = grads
    checked = 0
    for op in g.get_operations():
        if op.type in ("Conv2DBackpropInput", "Conv2DBackpropFilter") and "valid2" not in op.name:
            assert _flops(graph, shapes, op.name) * (1 if batch else BATCH) == pytest.approx(
                tf_flops[op.name]), op.name
            checked += 1
    assert checked == 4


def einsums():
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 6, 32], name="x")
        w = tf.constant(r.normal(0, 0.1, (32, 4, 8)).astype(np.float32))
        q = tf.einsum("bsd,dnh->bsnh", x, w, name="dense")          # EinsumDense
        scores = tf.einsum("bqnh,bknh->bnqk", q, q, name="scores")   # attention
        tf.einsum("bnqk,bknh->bqnh", scores, q, name="attend")
        tf.einsum("...d,dnh->...nh", x, w, name="ellipsis")
        tf.einsum("bsd,dnh", x, w, name="implicit")   # tf.einsum writes "bsd,dnh->bhns"
        y = v1.placeholder(tf.float32, [None, 6, None], name="y")
        tf.einsum("bsd,dnh->bsnh", y, w, name="inner_from_weight")     # d: 32, from w
        tf.einsum("bsd,btd->bst", y, y, name="open_inner")
    return g


def test_einsum_flops_from_its_equation_and_shapes():
    """2 x the summed labels' sizes per output element, per sample where the batch is open;
    the output shape from the equation agrees with TensorFlow's inference."""
    g = einsums()
    graph = Graph.from_graph_def(g.as_graph_def())
    shapes = Shapes(graph)
    einsum_ops = {op.name.split("/")[0]: op for op in g.get_operations() if op.type == "Einsum"}
    for name in ("dense", "scores", "attend", "ellipsis", "implicit"):
        tf_shape = [d if d is not None else -1 for d in einsum_ops[name].outputs[0].shape.as_list()]
        assert list(shapes.shape(TensorRef(einsum_ops[name].name, 0))) == tf_shape, name
    by_hand = {"dense": 6 * 4 * 8 * 2 * 32, "scores": 4 * 6 * 6 * 2 * 8,
               "attend": 6 * 4 * 8 * 2 * 6, "ellipsis": 6 * 4 * 8 * 2 * 32,
               "implicit": 6 * 4 * 8 * 2 * 32, "inner_from_weight": 6 * 4 * 8 * 2 * 32}
    assert {n: _flops(graph, shapes, einsum_ops[n].name) for n in by_hand} == by_hand
    # a summed size the graph leaves open: unknown
    assert _flops(graph, shapes, "open_inner/Einsum") is None


def einsum_dense(width: int) -> tf.compat.v1.GraphDef:
    """Two EinsumDense-style projections (weights of width x 4 x width/4, Consts) and a relu."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8, width], name="x")
        w1 = tf.constant(r.normal(0, 0.1, (width, 4, width // 4)).astype(np.float32))
        w2 = tf.constant(r.normal(0, 0.1, (4, width // 4, width)).astype(np.float32))
        h = tf.nn.relu(tf.einsum("bsd,dnh->bsnh", x, w1, name="proj"))
        tf.identity(tf.einsum("bsnh,nhd->bsd", h, w2, name="back"), name="out")
    return g.as_graph_def()


@pytest.mark.parametrize("width", [32, 512])
def test_einsum_weights_count_as_matmul_weights(width):
    """An Einsum reading a stored weight has a MatMul's intensity (p summed, q kept): 32 wide,
    under the CPU's minimum, it stays float32 as a 32-wide MatMul would; 512 wide it is painted."""
    gd = einsum_dense(width)
    graph = Graph.from_graph_def(gd)
    proj = next(n for n in graph.nodes() if n.op == "Einsum" and n.name.startswith("proj"))
    assert matrix_intensity(graph, proj) == pytest.approx(2 * width * width / (2 * width))
    _, report = convert(gd, target="bfloat16", device="cpu")
    einsums = [n for n in report.nodes if n.op == "Einsum"]
    assert len(einsums) == 2
    if width == 32:
        assert all(n.precision == "float32" and n.code == "cost" for n in einsums)
    else:
        assert all(n.precision == "bfloat16" for n in einsums)


def recorded_graph():
    """A convolution, a depthwise one and a MatMul at batch 2, and a MatMul whose inner size
    the graph leaves open; the weights are Consts."""
    r = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [BATCH, 12, 12, 8], name="x")
        w = tf.constant(r.normal(0, 0.1, (3, 3, 8, 16)).astype(np.float32))
        y = tf.nn.relu(tf.nn.conv2d(x, w, 2, "SAME", name="conv"))
        dw = tf.constant(r.normal(0, 0.1, (3, 3, 16, 1)).astype(np.float32))
        y = tf.nn.depthwise_conv2d(y, dw, [1, 1, 1, 1], "SAME", name="dw")
        flat = tf.reshape(y, [BATCH, 6 * 6 * 16])
        m = tf.constant(r.normal(0, 0.1, (6 * 6 * 16, 10)).astype(np.float32))
        tf.identity(tf.matmul(flat, m, name="dense"), name="logits")
        z = v1.placeholder(tf.float32, [BATCH, None], name="z")
        tf.identity(tf.matmul(z, tf.transpose(z), name="open"), name="gram")
    return g


def test_the_report_records_each_matrix_ops_flops_as_tensorflow_counts_them():
    """The report's ``flops`` on each matrix op are TensorFlow's profiler count; an op whose
    inner size the graph leaves open has none (null), and the summary counts it apart; the
    summary's FLOPs by dtype add up the known ones."""
    g = recorded_graph()
    tf_flops = _profiled(g)
    _, report = convert(g.as_graph_def(), target="bfloat16", device="cpu", min_matrix_intensity=0)
    matrix = {n.name: n for n in report.nodes if n.op in ("Conv2D", "DepthwiseConv2dNative",
                                                          "MatMul")}
    assert set(matrix) == {"conv", "dw", "dense", "open"}
    for name in ("conv", "dw", "dense"):
        assert matrix[name].flops == tf_flops[name], name
    assert matrix["open"].flops is None
    s = report.summary()
    assert s["matrix_flops_unknown"] == 1
    assert s["matrix_flops_by_dtype"] == {"bfloat16": sum(tf_flops[n] for n in ("conv", "dw", "dense"))}
    data = report.to_dict()
    written = {n["name"]: n for n in data["nodes"]}
    assert written["open"]["flops"] is None and "flops" not in written["logits"]


def test_the_cost_models_estimate_for_the_whole_graph_reads_the_recorded_flops():
    """bfloat16 on a CPU with the cost model on: the matrix work at float32's rate, what the
    bfloat16 matrix ops save at the rate the islands are weighed at; the op whose FLOPs are
    not known counted apart. float16 (no cost model) has no estimate."""
    from amp_rewrite.rules.cost_table import shipped
    FP32_PS_PER_FLOP, SAVED_PS_PER_FLOP = shipped().fp32_ps_per_flop, shipped().saved_ps_per_flop
    gd = recorded_graph().as_graph_def()
    _, report = convert(gd, target="bfloat16", device="cpu", min_matrix_intensity=1e-9)
    est = report.to_dict()["estimate"]
    flops = {n.name: n.flops for n in report.nodes if n.flops is not None}
    lowp = sum(f for name, f in flops.items() if report.node(name).precision == "bfloat16")
    assert lowp and est["fp32_us"] == pytest.approx(sum(flops.values()) * FP32_PS_PER_FLOP * 1e-6,
                                                    abs=1e-3)
    # each op at its kind's rate (the depthwise convolution's is the table's own)
    saved = sum(f * shipped().saved(report.node(name).op) for name, f in flops.items()
                if report.node(name).precision == "bfloat16")
    assert shipped().saved("DepthwiseConv2dNative") != SAVED_PS_PER_FLOP
    assert est["saved_us"] == pytest.approx(saved * 1e-6, abs=1e-3)
    assert est["unknown"] == (report.node("open").precision == "bfloat16")
    assert "estimate" not in convert(gd, target="float16")[1].to_dict()
