"""The lint every converted graph must pass before anything is written, and the checks of an
input graph against what TensorFlow's importer refuses.

A lint failure is an amp-rewrite bug, never the user's: the CLI reports it as an internal
error (exit 70) and writes nothing. An input check failure is the user's (an InputError, raised
by the caller): see "Input checks" below.
"""

from __future__ import annotations

import functools
import re
from typing import Collection, Iterator

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util
from tensorflow.python.framework import function as tf_function

from .before import Before
from .dtypes import INVALID, LOW_PRECISION, dtype_name
from .errors import LintError
from .ir import Graph, Node, copy_except
from .ops import MERGE_OPS, NEXT_ITERATION_OPS, VARIABLE_OPS
from .rules import RuleSet
from .signatures import (TypeAttr, allowed_by_opdef, edge_dtype, fill_defaults, get_dtype,
                         input_dtype, node_types, number_args, op_def, output_dtype,
                         set_call_signature)


def lint_problems(graph: Graph, *, original: Before | None = None,
                  rules: RuleSet | None = None, only: Collection[str] | None = None,
                  imported: bool = False) -> list[str]:
    """Every problem found, as one sentence each naming the node; empty when the graph is sound.

    Checks: node names are unique and every input names an existing node (the IR refuses both,
    so they are checked on the exported GraphDef); each data edge's producer dtype equals what
    the consumer's OpDef expects; every type attribute holds a dtype its OpDef allows; no
    deny-list op runs in low precision (unless a user override forced it); variable ops keep
    their dtypes; an op TensorFlow does not register sees the dtypes it saw before; no node the
    conversion added sits on a v1 loop's back edge. Those last four compare with ``original``,
    the record of the graph before the conversion.

    ``only`` limits the checks to those nodes and the edges into them: a pass that knows what
    it changed (and the readers of what it retyped) need not lint what ``original`` already
    passed. ``imported``: the graph is as :meth:`Graph.from_graph_def` built it, which refused
    repeated names and dangling inputs already, so the names are not checked again.
    """
    names = graph.names() if only is None else [n for n in graph.names() if n in only]
    problems = [] if imported else _name_problems(graph, names)
    if original is not None and original.unregistered_ops:   # a conversion adds none
        problems += _unknown_op_edges(graph, original, names)
    for node in (graph.node(n) for n in names):
        types = node_types(node)
        if types is None:
            continue
        problems += _edge_problems(graph, node, types)
        problems += _attr_problems(node, types)
        if rules is not None:
            problems += _deny_problems(node, types, rules, original)
        if original is not None and node.op in VARIABLE_OPS and node.name in original:
            problems += _variable_problems(node, types, original)
        if original is not None and node.name not in original:
            problems += _back_edge_problems(graph, node)
    return problems


def _back_edge_problems(graph: Graph, node) -> list[str]:
    """A node the conversion added may not read a NextIteration: a v1 loop's back edge must
    run straight into its Merge, so a cast there means the loop's dtypes did not agree."""
    return [f"node {node.name!r} ({node.op}), added by the conversion, sits on the loop back "
            f"edge from {ref.node!r}" for ref in graph.inputs(node.name)
            if graph.node(ref.node).op in NEXT_ITERATION_OPS]


def _name_problems(graph: Graph, names: list[str]) -> list[str]:
    """Names unique and every input naming a node of the graph: what TensorFlow's importer
    checks first. The IR keeps both by construction; this catches an IR that does not."""
    problems = []
    listed = graph.names()
    if len(set(listed)) != len(listed) or len(listed) != len(graph):
        seen: set[str] = set()
        dup = next((n for n in listed if n in seen or seen.add(n)), "?")
        problems.append(f"node name {dup!r} is used twice")
    for name in names:
        for src in [ref.node for ref in graph.inputs(name)] + graph.control_inputs(name):
            if src not in graph:
                problems.append(f"node {name!r} reads missing node {src!r}")
    return problems


def _edge_problems(graph: Graph, node, types) -> list[str]:
    """The node's data inputs: as many as its OpDef has, each of the dtype it expects."""
    problems = []
    inputs = graph.inputs(node.name)
    if len(inputs) != len(types.inputs):
        problems.append(f"node {node.name!r} ({node.op}) has {len(inputs)} data inputs, its "
                        f"OpDef expects {len(types.inputs)}")
    for port, ref in enumerate(inputs):
        src = graph.node(ref.node)
        src_types = node_types(src)
        if src_types is not None and ref.port >= len(src_types.outputs):
            problems.append(f"node {node.name!r} reads output {ref.port} of {ref.node!r}, which "
                            f"has {len(src_types.outputs)} outputs")
            continue
        have = output_dtype(src, ref.port)
        want = input_dtype(node, port)
        if have is not None and want is not None and have != want:
            problems.append(f"edge {ref} -> {node.name!r}:{port} ({node.op}) carries "
                            f"{dtype_name(have)} but the op expects {dtype_name(want)}")
    return problems


def _attr_problems(node, types) -> list[str]:
    problems = []
    for attr in types.attrs:
        dtype = get_dtype(node, attr)
        if dtype and not allowed_by_opdef(node, attr, dtype):
            problems.append(f"node {node.name!r} ({node.op}) has {attr}={dtype_name(dtype)}, "
                            f"which its OpDef does not allow")
    return problems


def _deny_problems(node, types, rules: RuleSet, original: Before | None) -> list[str]:
    """A deny op the conversion moved to low precision, unless the user forced it."""
    if rules.category(node.op) != "deny" or rules.level == "unsafe_force_all":
        return []
    forced = rules.node_rule(node.name)
    if forced is not None and forced.action == "force_lowp":
        return []
    return [f"deny op {node.name!r} ({node.op}) runs in {dtype_name(get_dtype(node, attr))}"
            for attr in types.attrs
            if get_dtype(node, attr) in LOW_PRECISION and _was_float(original, node.name, attr)]


def _variable_problems(node, types, original: Before) -> list[str]:
    was = original.dtypes(node.name)
    return [f"variable op {node.name!r} ({node.op}) changed {attr} from "
            f"{dtype_name(was.get(attr, INVALID))} to {dtype_name(get_dtype(node, attr))}"
            for attr in types.attrs if get_dtype(node, attr) != was.get(attr, INVALID)]


def _unknown_op_edges(graph: Graph, original: Before, names: list[str]) -> list[str]:
    """An op with no OpDef (a custom op) must see the dtypes it saw before on every edge."""
    problems = []
    for name in names:
        for port, ref in enumerate(graph.inputs(name)):
            src, dst = graph.node(ref.node), graph.node(name)
            if name not in original or (node_types(src) is not None and node_types(dst) is not None):
                continue
            was = original.edge_dtype(name, port)
            now = edge_dtype(src, ref.port, dst, port)
            if was is not None and now is not None and was != now:
                problems.append(f"edge {ref} -> {name!r}:{port} of an unregistered op carried "
                                f"{dtype_name(was)} and now carries {dtype_name(now)}")
    return problems


def _was_float(original: Before | None, name: str, attr: TypeAttr) -> bool:
    was = original.dtype(name, attr) if original is not None else None
    return was is None or was not in LOW_PRECISION


def lint(graph: Graph, **kwargs) -> None:
    """Raise :class:`LintError` listing every problem :func:`lint_problems` finds."""
    problems = lint_problems(graph, **kwargs)
    if problems:
        raise LintError(problems)


# ----------------------------------------------------------------- input checks
# What tf.graph_util.import_graph_def refuses, found by importing damaged GraphDefs
# (tests/test_fuzz_input.py): its C++ half (names, input order, colocation, attrs against the
# OpDef, shapes, the function library) is run as it is (tensorflow_import_error); what its
# Python half refuses, and what the C++ half checks where it cannot be run (a graph with custom
# ops), is checked here (graph_def_problems). load.check_importable calls them.

# GraphConstructor's IsValidNodeName (allow_internal_ops=false)
_NODE_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-/]*(?:>[A-Za-z0-9.][A-Za-z0-9_.\-/]*)*\Z")
_COLOCATION = b"loc:@"
# the AttrValue list fields after "s", in the order Operation.get_attr reads them
_NOT_STRINGS = ("i", "f", "b", "type", "shape", "tensor", "func")


def graph_def_problems(graph_def: graph_pb2.GraphDef, *, structure: bool = True,
                       serialized: bytes | None = None) -> Iterator[str]:
    """The problems TensorFlow's importer would find in ``graph_def``'s nodes and library, as
    one sentence each naming the node (lazily: the caller usually wants the first).

    Always, what the importer's Python half reads: ``_class`` colocation attrs are lists of
    UTF-8 strings, device strings parse as ``tf.DeviceSpec`` parses them, the library's
    gradients name its functions; and function attrs name a function of the library or an op
    (the importer lets a missing one through, but the graph cannot run), no function is
    defined twice. With ``structure``, also what its C++ half checks, for a graph it cannot
    be run on (one with custom ops): node names as TensorFlow spells them, control inputs
    after the data inputs, the attrs an OpDef requires, colocation with nodes of the graph,
    no cycle but a v1 loop's, no library function named like an op. ``serialized``: the
    GraphDef's bytes, if at hand (they tell which attrs no node has).
    """
    functions = {f.signature.name for f in graph_def.library.function}
    names = _Names(graph_def) if structure else None
    # reading each node's attr map costs more than the rest: only where a node may have it
    colocated = serialized is None or b"_class" in serialized
    for nd in graph_def.node:
        problem = ((_name_problem(nd) or _input_order_problem(nd) or _missing_attr_problem(nd))
                   if structure else None) \
            or (_colocation_problem(nd, names) if colocated else None) or _device_problem(nd) \
            or _function_attr_problem(nd, functions)
        if problem:
            yield f"node {nd.name!r} ({nd.op}) {problem}"
    if structure:
        yield from _cycle_problems(graph_def)
        yield from _custom_port_problems(graph_def, functions)
    yield from _library_problems(graph_def.library, functions, structure)


class _Names:
    """The graph's node names, collected when first asked about (few graphs colocate)."""

    def __init__(self, graph_def):
        self._graph_def, self._names = graph_def, None

    def __contains__(self, name: str) -> bool:
        if self._names is None:
            self._names = {nd.name for nd in self._graph_def.node}
        return name in self._names


def _name_problem(nd) -> str | None:
    if _NODE_NAME.match(nd.name):
        return None
    return ("has a name TensorFlow refuses (a letter, digit or '.' first, then letters, digits "
            "and '_.-/')")


def _input_order_problem(nd) -> str | None:
    control = next((i for i, text in enumerate(nd.input) if text.startswith("^")), None)
    if control is None or all(text.startswith("^") for text in nd.input[control:]):
        return None
    return f"lists control input {nd.input[control]!r} before a data input"


def _missing_attr_problem(nd) -> str | None:
    missing = next((name for name in _required_attrs(nd.op) if name not in nd.attr), None)
    return f"lacks attr {missing!r}, which its OpDef requires" if missing else None


@functools.lru_cache(maxsize=None)
def _required_attrs(op: str) -> tuple[str, ...]:
    od = op_def(op)
    return tuple(a.name for a in od.attr if not a.HasField("default_value")) if od else ()


def _colocation_problem(nd, names: _Names | None) -> str | None:
    """``_class``: what the importer's Python half reads (a list of UTF-8 strings), and with
    ``names`` what its C++ half checks (each ``loc:@X`` names a node of the graph)."""
    if "_class" not in nd.attr:
        return None
    value = nd.attr["_class"]
    kind = value.WhichOneof("value")
    if kind is None or (kind == "s" and not value.s):
        return None
    if kind != "list" or (not value.list.s and any(getattr(value.list, f) for f in _NOT_STRINGS)):
        return "has a _class attr that is not a list of strings"
    for entry in value.list.s:
        try:
            text = entry.decode("utf-8")
        except UnicodeDecodeError:
            return f"has a _class entry that is not UTF-8 text: {entry[:40]!r}"
        target = text[len("loc:@"):] if entry.startswith(_COLOCATION) else None
        if names is not None and target is not None and target not in names:
            return f"is to be colocated with {target!r}, which is not a node of the graph"
    return None


def _device_problem(nd) -> str | None:
    error = _device_error(nd.device) if nd.device else None
    return f"has device {nd.device!r}, which TensorFlow cannot parse: {error}" if error else None


@functools.lru_cache(maxsize=None)
def _device_error(device: str) -> str | None:
    # a graph names a few devices on many nodes: each string parsed once
    try:
        tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def _function_attr_problem(nd, functions: set[str]) -> str | None:
    for key in _function_attrs(nd.op):
        if key not in nd.attr:
            continue
        value = nd.attr[key]
        named = [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
        missing = next((name for name in named if name and name not in functions
                        and op_def(name) is None), None)
        if missing is not None:
            return f"has {key} naming function {missing!r}, which the graph's library lacks"
    return None


@functools.lru_cache(maxsize=None)
def _function_attrs(op: str) -> tuple[str, ...]:
    od = op_def(op)
    return tuple(a.name for a in od.attr if a.type in ("func", "list(func)")) if od else ()


def _cycle_problems(graph_def) -> Iterator[str]:
    """A node the importer never reaches: it adds a node once its inputs are in, but a Merge fed
    by a NextIteration (a v1 loop's back edge) once one data input is. A cycle any other way
    is refused (the IR lets a NextIteration's edges through whatever they feed)."""
    nodes = {nd.name: nd for nd in graph_def.node}
    pending, consumers = {}, {}
    for nd in graph_def.node:
        sources = [_input_node(text) for text in nd.input]
        sources = [src for src in sources if src in nodes]
        back = nd.op in MERGE_OPS and any(nodes[_input_node(text)].op in NEXT_ITERATION_OPS
                                          for text in nd.input if not text.startswith("^")
                                          and _input_node(text) in nodes)
        controls = sum(text.startswith("^") for text in nd.input)
        pending[nd.name] = controls + 1 if back else len(sources)
        for src in sources:
            consumers.setdefault(src, []).append(nd.name)
    ready = [name for name, count in pending.items() if count <= 0]
    while ready:
        for name in consumers.get(ready.pop(), ()):
            pending[name] -= 1
            if pending[name] == 0:
                ready.append(name)
    stuck = [nd for nd in graph_def.node if pending[nd.name] > 0]
    if stuck:
        yield (f"node {stuck[0].name!r} ({stuck[0].op}) is in a cycle that is not a while loop's "
               f"(a Merge reading a NextIteration), with {len(stuck) - 1} other nodes")


def _custom_port_problems(graph_def, functions: set[str]) -> Iterator[str]:
    """A custom op's node reading an output its producer does not have: the importer checks
    the port of every edge, into ops it does not know too (their stand-ins read no data)."""
    nodes = {nd.name: nd for nd in graph_def.node}
    calls = {f.signature.name: f.signature for f in graph_def.library.function}
    for nd in graph_def.node:
        if op_def(nd.op) is not None or nd.op in functions:
            continue
        for text in nd.input:
            src = nodes.get(_input_node(text))
            # a forged port count (N=2**40) is check_input's to refuse, before ports are listed
            if text.startswith("^") or src is None or any(
                    not 0 <= src.attr[n].i <= 1 << 16 for n in number_args(src.op) if n in src.attr):
                continue
            port = int(text.rpartition(":")[2]) if text != _input_node(text) else 0
            types = node_types(_typed(src, calls))
            if types is not None and port >= len(types.outputs):
                yield (f"node {nd.name!r} ({nd.op}) reads output {port} of {src.name!r}, which "
                       f"has {len(types.outputs)} outputs")


def _input_node(text: str) -> str:
    name, sep, port = text.lstrip("^").rpartition(":")
    return name if sep and port.isdigit() else text.lstrip("^")


def _library_problems(library, functions: set[str], structure: bool) -> Iterator[str]:
    seen = set()
    for fdef in library.function:
        name = fdef.signature.name
        if name in seen:
            # the importer takes a function twice if both copies are the same; they would not
            # stay the same once converted (one is painted, the other left as it is)
            yield f"the function library defines {name!r} more than once"
        seen.add(name)
        if structure and op_def(name) is not None:
            yield f"library function {name!r} has the name of a TensorFlow op"
        for nd in fdef.node_def:
            problem = _function_attr_problem(nd, functions)
            if problem:
                yield f"node {nd.name!r} ({nd.op}) of function {name!r} {problem}"
    # the importer reads the gradients only of a library that has functions
    for grad in library.gradient if functions else ():
        for name in (grad.function_name, grad.gradient_func):
            if name not in functions:
                yield f"the function library names {name!r} in a gradient but does not define it"
    with_gradients = {grad.function_name for grad in library.gradient}
    if library.gradient and functions and not functions - with_gradients:
        yield "the function library's gradients form a cycle (every function has one)"


def unregistered_ops(graph_def: graph_pb2.GraphDef) -> set[str]:
    """The ops of the graph's nodes that neither TensorFlow registers nor its library defines:
    custom ops, which TensorFlow imports only where their library is loaded."""
    functions = {f.signature.name for f in graph_def.library.function}
    return {op for op in {nd.op for nd in graph_def.node}
            if op_def(op) is None and op not in functions}


# A Const holding more bytes than this reaches the importer as a Placeholder of its dtype and
# shape (:func:`without_weights`): the importer checks shapes, not values, and its own copy of
# every weight raised a conversion's peak memory from 3x to 5x a weight-heavy GraphDef.
_WEIGHT_BYTES = 1 << 12


def without_weights(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef | None:
    """A copy of ``graph_def`` for the importer in which every Const of more than 4 KiB is a
    Placeholder of its dtype and shape (name, device, ``_class`` and control inputs kept), or
    None when it has none. Runs of other nodes are copied a slice at a time."""
    nodes = graph_def.node
    big = [i for i, nd in enumerate(nodes) if nd.op == "Const" and "value" in nd.attr
           and nd.attr["value"].tensor.ByteSize() > _WEIGHT_BYTES]
    if not big:
        return None
    out = graph_pb2.GraphDef()
    copy_except(graph_def, out, "node")
    start = 0
    for i in big:
        out.node.extend(nodes[start:i])
        out.node.append(_shaped_placeholder(nodes[i]))
        start = i + 1
    out.node.extend(nodes[start:])
    return out


def _shaped_placeholder(const) -> node_def_pb2.NodeDef:
    """A Placeholder standing for Const ``const``: its value's dtype and shape, no value."""
    nd = node_def_pb2.NodeDef(name=const.name, op="Placeholder", device=const.device,
                              input=[text for text in const.input if text.startswith("^")])
    tensor = const.attr["value"].tensor
    nd.attr["dtype"].type = tensor.dtype
    nd.attr["shape"].shape.CopyFrom(tensor.tensor_shape)
    if "_class" in const.attr:
        nd.attr["_class"].CopyFrom(const.attr["_class"])
    return nd


def with_stand_ins(graph_def: graph_pb2.GraphDef, custom: set[str]) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` TensorFlow's importer takes although ops ``custom`` are not
    registered, so that it checks the rest of the graph, shapes included, as it would where
    they are: each node of one becomes a NoOp waiting on the nodes it read, and each tensor of
    it a node reads, a Placeholder (of unknown shape) of the dtype the reader expects, after it;
    a VariableV2 where the reader takes references."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    standing = {nd.name for nd in out.node if nd.op in custom}
    names = {nd.name for nd in out.node}
    calls = {f.signature.name: f.signature for f in out.library.function}
    added = []
    for nd in out.node:
        if nd.name in standing:
            reads = list(dict.fromkeys("^" + _input_node(text) for text in nd.input))
            kept = {k: v for k, v in nd.attr.items() if k.startswith("_")}   # _class among them
            nd.op = "NoOp"
            nd.ClearField("attr")
            for key, value in kept.items():
                nd.attr[key].CopyFrom(value)
            del nd.input[:]
            nd.input.extend(reads)
            continue
        reader = None
        for port, text in enumerate(nd.input):
            if text.startswith("^") or _input_node(text) not in standing:
                continue
            reader = reader or _typed(nd, calls)
            name = _fresh(f"{_input_node(text)}/amp_stand_in", names)
            added.append(_stand_in(name, _input_node(text), input_dtype(reader, port), nd.op))
            nd.input[port] = name
    out.node.extend(added)
    return out


def _typed(nd, calls) -> Node:
    """``nd`` as a typed IR node (its defaults filled in a copy), to ask what it reads."""
    proto = node_def_pb2.NodeDef()
    proto.CopyFrom(nd)
    fill_defaults(proto)
    node = Node(proto)
    if nd.op in calls:
        set_call_signature(node, calls[nd.op])
    return node


def _fresh(base: str, names: set[str]) -> str:
    name, n = base, 0
    while name in names:
        n += 1
        name = f"{base}_{n}"
    names.add(name)
    return name


def _stand_in(name: str, after: str, dtype: int | None, reader_op: str):
    od = op_def(reader_op)
    refs = od is not None and any(arg.is_ref for arg in od.input_arg)
    nd = node_def_pb2.NodeDef(name=name, op="VariableV2" if refs else "Placeholder",
                              input=["^" + after])
    nd.attr["dtype"].type = dtype or tf.float32.as_datatype_enum
    nd.attr["shape"].shape.unknown_rank = True
    return nd


def tensorflow_import_error(serialized: bytes, library) -> str | None:
    """Why ``tf.graph_util.import_graph_def`` refuses the serialized GraphDef (in a fresh
    graph), in one line naming the node where TensorFlow does; None when it imports.

    Its C++ half (the nodes, their OpDefs and shapes, the library) runs on the bytes; of its
    Python half, the function library ``library`` is read back as it does (what else it reads,
    devices and ``_class``, :func:`graph_def_problems` checks). Whatever either raises is its
    refusal. The graph is imported into a scratch graph and dropped.
    """
    graph = tf.Graph()   # no Python operations: they are made only when asked for
    options = c_api_util.ScopedTFImportGraphDefOptions()
    buffer = c_api.TF_NewBufferFromString(serialized)
    try:
        with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
            c_api.TF_DeleteImportGraphDefResults(
                c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options.options))
        if library.function:
            with graph.as_default():   # so the functions go to it, not to the eager context
                for fn in tf_function.from_library(library):
                    fn.add_to_graph(graph)
    except Exception as exc:  # noqa: BLE001 - the importer's refusal, whatever it raises
        return _tidy(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
    finally:
        c_api.TF_DeleteBuffer(buffer)
    return None


def _tidy(message: str) -> str:
    """TensorFlow's message, with the NodeDefs and OpDefs it quotes whole cut to their names."""
    text = re.sub(r"'\{\{node ([^}]*)\}\}[^']*'", r"node '\1'", message)
    text = re.sub(r"\{\{node ([^}]*)\}\}", r"node '\1'", text)
    text = re.sub(r"Op<name=([^;>]*)(?:->|[^>])*>", r"op \1", text)
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:400] + " ..."
