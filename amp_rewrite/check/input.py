"""The input side of the checks: refuse, with one line naming the node, a graph TensorFlow
would not import, so that an exit 0 always means a file TensorFlow imports.

Two levels. :func:`check_importable` takes a GraphDef as loaded: TensorFlow's own C++ importer
runs on it (its weights left out, custom ops stood in for), and what the importer's Python half
refuses (devices, ``_class`` colocation, the library's gradients), and what its C++ half checks
where it cannot run (a graph with custom ops), is checked here (:func:`graph_def_problems`);
the damage was found by importing damaged GraphDefs (tests/test_fuzz_input.py). Then
:func:`check_input` takes the IR each conversion paints: sane port counts and the lint's
checks, so that a broken input is the user's problem, never a failed lint of our output.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
from typing import Iterator

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util
from tensorflow.python.framework import function as tf_function

from ..core.errors import InputError
from ..core.ir import Graph, Node, TensorRef, copy_except, unused_name
from ..core.ops import MERGE_OPS, NEXT_ITERATION_OPS
from ..schema.opdefs import (
    fill_defaults,
    graph_with_defaults,
    input_dtype,
    node_types,
    number_args,
    op_def,
    set_call_signature,
)
from .lint import lint_problems

# the ops TensorFlow's importer lets close a cycle (IsMerge), where its check aborts the process
_MERGES = MERGE_OPS | {"_XlaMerge"}
# Ports a graph may declare through number attrs (N of ConcatV2, num_split of Split ...) beyond
# one per data edge: the type model lists every port, so a forged N of 2**40 in a tiny file
# would otherwise exhaust memory.
_SPARE_PORTS = 1 << 20


def check_input(graph: Graph) -> None:
    """Refuse, with an :class:`InputError` naming the node, a graph TensorFlow would not import.

    Port counts must be sane before anything lists ports; then the lint's checks (each input's
    arity and dtype matches its OpDef, type attrs hold allowed dtypes) run on the input, so a
    broken input is reported as the user's problem, not as a failed lint of our output.
    """
    declared = 0
    budget = None   # counted only once the ports declared pass the spare: edges cost a pass
    for node in graph.nodes():
        if node.op == "Const":
            _check_const(node)
        for name in number_args(node.op):
            n = node.attr[name].i if name in node.attr else -1
            declared += max(n, 0)
            if declared > _SPARE_PORTS and budget is None:
                budget = _SPARE_PORTS + sum(1 for _ in graph.data_edges())
            if n < 0 or (budget is not None and declared > budget):
                raise InputError(f"node {node.name!r} ({node.op}) has {name}={n}, "
                                 "not a usable port count")
    problems = lint_problems(graph, imported=True)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"the input graph is not valid: {problems[0]}{more}")


def _check_const(node) -> None:
    # TensorFlow refuses a Const whose tensor is not of its dtype; converting its values would
    # silently reinterpret them
    have = node.attr["value"].tensor.dtype if "value" in node.attr else None
    want = node.attr["dtype"].type if "dtype" in node.attr else None
    if have is None or have != want:
        raise InputError(f"Const {node.name!r}: its value is missing or not a tensor of its dtype")


def check_importable(graph_def: graph_pb2.GraphDef, serialized: bytes | None = None) -> None:
    """Raise an :class:`InputError` naming the node for a graph that
    ``tf.graph_util.import_graph_def`` refuses in a fresh graph, or whose function attrs name
    functions it lacks: a converted file of it would be refused too, or could not run.

    ``serialized``: the GraphDef's bytes, if at hand. A graph with custom ops, which TensorFlow
    imports only where their library is loaded, is imported with stand-ins for their nodes
    (:func:`~amp_rewrite.check.with_stand_ins`), after our checks of what the importer checks.
    """
    ops = {nd.op for nd in graph_def.node}
    custom = unregistered_ops(graph_def, ops)
    light = without_weights(graph_def)   # the importer checks shapes, not weights
    if light is not None:
        serialized = None
    if serialized is None and not custom:
        serialized = (graph_def if light is None else light).SerializeToString()
    # The importer aborts the process on a cycle only at a Merge; any other cycle it refuses,
    # and ours (a pass over every edge) is then asked for the words, in the order it comes.
    merges = not ops.isdisjoint(_MERGES)
    problem = next(graph_def_problems(graph_def, structure=bool(custom),
                                      serialized=serialized, cycles=merges), None)
    if problem and not merges:   # the first problem, cycles included, as every check orders them
        problem = next(graph_def_problems(graph_def, structure=bool(custom),
                                          serialized=serialized))
    if problem:
        raise InputError(problem)
    if custom:   # the importer refuses ops it does not know: it checks the rest around them
        serialized = with_stand_ins(graph_def if light is None else light,
                                         custom).SerializeToString()
    error = tensorflow_import_error(serialized, graph_def.library)
    _return_freed_memory()
    if error is not None:
        # TensorFlow's words quote whole NodeDefs and OpDefs and do not always name the node;
        # ours, asked only now that the graph is refused anyway, do: a cycle first, as the
        # checks before the importer would have found it
        cycle = None if merges else next(_cycle_problems(graph_def), None)
        if cycle:
            raise InputError(cycle)
        _refuse_in_our_words(graph_def)
        raise InputError(f"TensorFlow's importer refuses the graph: {error}")


def _refuse_in_our_words(graph_def: graph_pb2.GraphDef) -> None:
    """Raise the first problem our own input checks find in ``graph_def``, if any."""
    problem = next(graph_def_problems(graph_def), None)
    if problem:
        raise InputError(problem)
    graph, _ = graph_with_defaults(graph_def)
    calls = {f.signature.name: f.signature for f in graph_def.library.function}
    for node in graph.nodes():
        if node.op in calls:
            set_call_signature(node, calls[node.op])
    check_input(graph)


# ----------------------------------------------------------------- what the importer refuses

# GraphConstructor's IsValidNodeName (allow_internal_ops=false)
_NODE_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-/]*(?:>[A-Za-z0-9.][A-Za-z0-9_.\-/]*)*\Z")
_COLOCATION = b"loc:@"
# the AttrValue list fields after "s", in the order Operation.get_attr reads them
_NOT_STRINGS = ("i", "f", "b", "type", "shape", "tensor", "func")


def graph_def_problems(graph_def: graph_pb2.GraphDef, *, structure: bool = True,
                       serialized: bytes | None = None, cycles: bool = True) -> Iterator[str]:
    """The problems TensorFlow's importer would find in ``graph_def``'s nodes and library, as
    one sentence each naming the node (lazily: the caller usually wants the first).

    Always, what the importer's Python half reads: ``_class`` colocation attrs are lists of
    UTF-8 strings, device strings parse as ``tf.DeviceSpec`` parses them, the library's
    gradients name its functions; and function attrs name a function of the library or an op
    (the importer lets a missing one through, but the graph cannot run), no function is
    defined twice. With ``structure``, also what its C++ half checks, for a graph it cannot
    be run on (one with custom ops): node names as TensorFlow spells them, control inputs
    after the data inputs, the attrs an OpDef requires, colocation with nodes of the graph,
    no library function named like an op. And always no cycle but a v1 loop's: where the
    importer's own check fails, it aborts the process (``cycles=False`` leaves that out, for a
    graph with no Merge, where the importer refuses a cycle itself). ``serialized``: the
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
    # TensorFlow's importer aborts the process (not an error) on a Merge whose other input
    # waits on it
    if cycles:
        yield from _cycle_problems(graph_def)
    if structure:
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
    """A node in a cycle that is not a v1 loop's: the only edge a cycle may close is a
    NextIteration's into a Merge (the loop's back edge). TensorFlow's importer adds such a Merge
    once one data input is in, and aborts the process (a CHECK in graph_constructor.cc) where
    the Merge's other inputs wait on the Merge itself; so here a Merge waits for every input
    but its back edges, and any node left waiting is refused (the IR lets a NextIteration's
    edges through whatever they feed). Then each Merge reading a back edge with more than one
    other data input (:func:`_loop_merge_problem`)."""
    nodes = {nd.name: nd for nd in graph_def.node}
    pending, consumers, merges = {}, {}, []
    for nd in graph_def.node:
        merge = nd.op in MERGE_OPS
        sources, back, data = [], [], 0
        for text in nd.input:
            src = _input_node(text)
            control = text.startswith("^")
            data += merge and not control
            if src in nodes and merge and not control and nodes[src].op in NEXT_ITERATION_OPS:
                back.append(src)   # a back edge
            elif src in nodes:
                sources.append(src)
        pending[nd.name] = len(sources)
        for src in sources:
            consumers.setdefault(src, []).append(nd.name)
        if back:
            merges.append((nd, back, data - len(back)))
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
    for nd, back, entering in merges:
        if entering > 1:
            yield _loop_merge_problem(nd, back, entering)


def _loop_merge_problem(nd, back: list[str], entering: int) -> str:
    """A Merge reading a loop's back edge (a NextIteration) with more than one other data
    input. TensorFlow's importer takes such a Merge to be ready once one data input is in (the
    value entering the loop) and counts each further one down from there: a second one fails a
    CHECK in graph_constructor.cc ("current_pending_count > 0") and aborts the process, whatever
    the order, so it is refused here."""
    return (f"node {nd.name!r} ({nd.op}) reads a while loop's back edge ({back[0]!r}) "
            f"and {entering} other data inputs; a loop's Merge takes one "
            "value entering the loop beside its back edges (TensorFlow's importer would "
            "abort the process on the second)")


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
    """The node a NodeDef input string (``^n``, ``n``, ``n:2``) reads."""
    return TensorRef.parse(text.lstrip("^")).node


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


def unregistered_ops(graph_def: graph_pb2.GraphDef, ops: set[str] | None = None) -> set[str]:
    """The ops of the graph's nodes (``ops``, if at hand) that neither TensorFlow registers nor
    its library defines: custom ops, which TensorFlow imports only where their library is
    loaded."""
    functions = {f.signature.name for f in graph_def.library.function}
    return {op for op in ({nd.op for nd in graph_def.node} if ops is None else ops)
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
            name = unused_name(f"{_input_node(text)}/amp_stand_in", names)
            names.add(name)
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
    except (tf.errors.OpError, ValueError, TypeError, KeyError) as exc:
        # the importer's refusal: its C++ half's status errors (OpError), the Python half's
        # reading of the library (ValueError for a missing or cyclic gradient function, a bad
        # attr; TypeError, KeyError for a malformed one); anything else is not known to be
        # the graph's (exit 70)
        return _tidy(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
    finally:
        c_api.TF_DeleteBuffer(buffer)
    return None


def _return_freed_memory() -> None:
    """Give the heap TensorFlow's scratch import freed back to the system, where the C library
    can (glibc's ``malloc_trim``): kept, it stays in the process's memory under the conversion
    that follows, whose peak it raised from 5.2 to 6.8 KiB a node of a graph of small nodes
    (tests/test_bad_input.py's memory test)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):   # not glibc (macOS, musl): nothing to give back
        return None


def _tidy(message: str) -> str:
    """TensorFlow's message, with the NodeDefs and OpDefs it quotes whole cut to their names."""
    text = re.sub(r"'\{\{node ([^}]*)\}\}[^']*'", r"node '\1'", message)
    text = re.sub(r"\{\{node ([^}]*)\}\}", r"node '\1'", text)
    text = re.sub(r"Op<name=([^;>]*)(?:->|[^>])*>", r"op \1", text)
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:400] + " ..."
