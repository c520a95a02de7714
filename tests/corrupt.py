"""Corrupted graphs for the fuzz test: structural damage to real GraphDefs, and the judge of
what the converter did with them.

An edit is a tuple of small integers ``(kind, where, a, b)``; :func:`apply` turns it into one
change of a GraphDef, as a damaged file or a careless generator would make it: inputs renamed,
dropped or pointed at other nodes, control inputs added (also before the data inputs),
``_class`` colocation attrs, device strings, op types, deleted nodes, dtypes and attrs, and
function names retargeted (a func attr, a call, the library's own names). ``where`` picks the
node, in the graph or in a library function's body; every index is taken modulo what exists,
so any integers make a valid edit and hypothesis can shrink them freely.

:func:`judge` says whether an outcome keeps the contract: the converter refuses with an
:class:`InputError` in one line, or it converts and TensorFlow's importer takes the result.
"""

from __future__ import annotations

import functools
from pathlib import Path

import graphs
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from amp_rewrite.schema.opdefs import op_def

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"

# names a node could take: valid ones, one TensorFlow refuses, clashes are made from the graph
_NAMES = ["renamed", "a/b_c.d-e", "bad name", "_hidden", "x:1", "", "/lead", "9digit", "a//b"]
# device strings: the kinds real graphs carry and the kinds a damaged file could
DEVICES = ["", "/device:CPU:0", "/device:GPU:0", "/job:localhost/replica:0/task:0/device:CPU:0",
           "/cpu:0", "gpu:1", "/device:TPU:0", "/device:XLA_CPU:0", "/job:w", "CPU:0",
           "garbage::", "/device:GPU:x", "/cpu:0/gpu:1", "/job:w/job:v", "/device:CPU:-1",
           "/replica:x", "/device:", "//", "/task:1/device:CPU:*", "/device:CPU:0 "]
# ops a node's type could change to: registered ones of every kind, and one nobody registers
OPS = ["MatMul", "AddV2", "Identity", "IdentityN", "Exp", "Merge", "Switch", "Enter", "Exit",
       "NextIteration", "Cast", "ConcatV2", "Relu", "Const", "Placeholder", "NoOp", "Softmax",
       "FusedBatchNormV3", "Conv2D", "ReadVariableOp", "VarHandleOp", "StatelessWhile", "If",
       "PartitionedCall", "Reshape", "Shape", "Pack", "BiasAdd", "Mean", "NoSuchOp"]
# DataType values: float ones, others, ref types, and numbers no DataType has
DTYPES = [1, 2, 3, 9, 10, 14, 19, 20, 21, 0, 101, 114, 34, 1000, -1]
KINDS = ("rename", "rename_everywhere", "drop_node", "drop_input", "rewire", "add_control",
         "colocate", "device", "op", "dtype", "attr_int", "drop_attr", "func_attr", "call",
         "library")


@functools.lru_cache(maxsize=None)
def _source_bytes(index: int) -> bytes:
    if index == 0:
        return EXAMPLE.read_bytes()
    builder = (graphs.while_v1, graphs.functional_while)[index - 1]
    return builder()[0].SerializeToString()


SOURCES = ("cnn_fp32", "while_v1", "functional_while")


def source(index: int) -> graph_pb2.GraphDef:
    """A fresh copy of real graph ``index`` of :data:`SOURCES`."""
    gd = graph_pb2.GraphDef()
    gd.ParseFromString(_source_bytes(index % len(SOURCES)))
    return gd


def _scope(gd, where: int):
    """The node list ``where`` picks: the graph's (most often) or a library function's."""
    functions = gd.library.function
    if not functions or where % 3:
        return gd.node, None
    fdef = functions[(where // 3) % len(functions)]
    return fdef.node_def, fdef


def _ref(name: str, fdef, node=None) -> str:
    """An input string naming ``name``'s first output, in the graph's or a body's syntax."""
    if fdef is None or node is None:
        return name
    od = op_def(node.op)
    if od is None or not od.output_arg:
        return name
    return f"{name}:{od.output_arg[0].name}:0"


def apply(gd: graph_pb2.GraphDef, edit: tuple[int, int, int, int]) -> None:
    """Apply one edit (see the module docstring) to ``gd``, in place."""
    kind, where, a, b = edit
    kind = KINDS[kind % len(KINDS)]
    if kind == "library":
        _library_edit(gd, a, b)
        return
    nodes, fdef = _scope(gd, where)
    if not nodes:
        return
    node = nodes[where % len(nodes)]
    other = nodes[a % len(nodes)]
    _NODE_EDITS[kind](gd, nodes, fdef, node, other, a, b)


def _rename(gd, nodes, fdef, node, other, a, b):
    node.name = [other.name, *_NAMES][b % (len(_NAMES) + 1)]


def _rename_everywhere(gd, nodes, fdef, node, other, a, b):
    """A rename that also updates every input and colocation naming the node."""
    old, new = node.name, [f"{node.name}_{a % 7}", other.name, *_NAMES][b % (len(_NAMES) + 2)]
    node.name = new
    for n in nodes:
        for i, text in enumerate(n.input):
            bare = text.lstrip("^")
            head, sep, tail = bare.partition(":")
            if head == old:
                n.input[i] = ("^" if text.startswith("^") else "") + new + sep + tail
        if "_class" in n.attr:
            values = n.attr["_class"].list.s
            for i, v in enumerate(values):
                if v == b"loc:@" + old.encode():
                    values[i] = b"loc:@" + new.encode()


def _drop_node(gd, nodes, fdef, node, other, a, b):
    nodes.remove(node)


def _drop_input(gd, nodes, fdef, node, other, a, b):
    if node.input:
        del node.input[a % len(node.input)]


def _rewire(gd, nodes, fdef, node, other, a, b):
    if not node.input:
        return
    i = b % len(node.input)
    if fdef is None:
        choices = [other.name, f"{other.name}:1", f"{other.name}:5", "missing", f"{other.name}:x"]
    else:
        choices = [_ref(other.name, fdef, other), other.name, f"{other.name}:output:0",
                   "missing:y:0"] + [arg.name for arg in fdef.signature.input_arg]
    node.input[i] = choices[a % len(choices)]


def _add_control(gd, nodes, fdef, node, other, a, b):
    """A control input, at any position: TensorFlow wants them after the data inputs."""
    node.input.insert(b % (len(node.input) + 1), "^" + other.name)


def _colocate(gd, nodes, fdef, node, other, a, b):
    value = node.attr["_class"]
    names = [other.name, node.name, "missing", ""]
    choice = b % 6
    if choice < 4:
        value.list.s.append(b"loc:@" + names[choice].encode())
    elif choice == 4:
        value.list.s.append(b"some_class")
    else:
        value.s = b"loc:@" + other.name.encode()   # a string where a list belongs


def _device(gd, nodes, fdef, node, other, a, b):
    node.device = DEVICES[b % len(DEVICES)]


def _op(gd, nodes, fdef, node, other, a, b):
    node.op = (OPS + [other.op])[b % (len(OPS) + 1)]


def _attr_of(node, b, kind):
    keys = sorted(k for k, v in node.attr.items() if v.WhichOneof("value") == kind)
    return node.attr[keys[b % len(keys)]] if keys else None


def _dtype(gd, nodes, fdef, node, other, a, b):
    value = _attr_of(node, b, "type")
    if value is not None:
        value.type = DTYPES[a % len(DTYPES)]
        return
    value = _attr_of(node, b, "list")
    if value is not None and value.list.type:
        value.list.type[a % len(value.list.type)] = DTYPES[a % len(DTYPES)]


def _attr_int(gd, nodes, fdef, node, other, a, b):
    value = _attr_of(node, b, "i")
    if value is not None:
        value.i = [-1, 0, 1, 2, 3, 7, 2**31, 2**40][a % 8]
    else:
        node.attr["bogus"].i = a   # an attr the OpDef does not have


def _drop_attr(gd, nodes, fdef, node, other, a, b):
    keys = sorted(node.attr)
    if keys:
        del node.attr[keys[b % len(keys)]]


def _function_names(gd) -> list[str]:
    return [f.signature.name for f in gd.library.function]


def _func_attr(gd, nodes, fdef, node, other, a, b):
    """Point a function attr at another function, a missing one, an op, or nothing."""
    holders = [n for n in list(gd.node) + [x for f in gd.library.function for x in f.node_def]
               if any(v.WhichOneof("value") == "func" for v in n.attr.values())]
    if not holders:
        return
    holder = holders[a % len(holders)]
    value = _attr_of(holder, b, "func")
    value.func.name = (_function_names(gd) + ["missing_fn", "MatMul", ""])[b % (len(gd.library.function) + 3)]


def _call(gd, nodes, fdef, node, other, a, b):
    """Turn a node into a direct call of a library function (or of a missing one)."""
    names = _function_names(gd) + ["missing_fn"]
    node.op = names[a % len(names)]


def _library_edit(gd, a, b):
    functions = gd.library.function
    choice = b % 6
    if choice == 0:
        gd.library.gradient.add(function_name=(_function_names(gd) + ["missing_fn"])[a % (len(functions) + 1)],
                                gradient_func=(_function_names(gd) + ["missing_grad"])[(a // 7) % (len(functions) + 1)])
        return
    if not functions:
        return
    fdef = functions[a % len(functions)]
    if choice == 1:
        functions.remove(fdef)
    elif choice == 2:
        fdef.signature.name = ["renamed_fn", "MatMul", functions[(a + 1) % len(functions)].signature.name,
                               "", "bad name"][(a // 3) % 5]
    elif choice == 3:
        functions.add().CopyFrom(fdef)            # the same function twice
    elif choice == 4:
        copy = functions.add()
        copy.CopyFrom(fdef)
        if copy.node_def:
            del copy.node_def[-1]                 # a different function of the same name
    else:
        fdef.signature.input_arg.add(name="extra", type=tf.float32.as_datatype_enum)


_NODE_EDITS = {"rename": _rename, "rename_everywhere": _rename_everywhere, "drop_node": _drop_node,
               "drop_input": _drop_input, "rewire": _rewire, "add_control": _add_control,
               "colocate": _colocate, "device": _device, "op": _op, "dtype": _dtype,
               "attr_int": _attr_int, "drop_attr": _drop_attr, "func_attr": _func_attr,
               "call": _call}


# ----------------------------------------------------------------- TensorFlow's verdict
def import_error(gd: graph_pb2.GraphDef) -> str | None:
    """Why ``tf.graph_util.import_graph_def`` refuses ``gd`` in a fresh graph, or None."""
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(gd)      # the importer adds default attrs to the message it is given
    try:
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(copy, name="")
    except Exception as exc:    # noqa: BLE001 - whatever TensorFlow raises is its refusal
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def unregistered_ops(gd: graph_pb2.GraphDef) -> set[str]:
    """Ops of the graph's own nodes that TensorFlow does not register and no function defines:
    custom ops, which the converter leaves alone and the importer refuses in any file."""
    functions = set(_function_names(gd))
    return {n.op for n in gd.node if op_def(n.op) is None and n.op not in functions}


def refused_only_for_custom_ops(error: str, before: graph_pb2.GraphDef) -> bool:
    """Whether TensorFlow's refusal ``error`` names an op the input already had unregistered."""
    return any(f"Op type not registered '{op}'" in error for op in unregistered_ops(before))
