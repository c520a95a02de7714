"""The loss-scale state: resource variables added to the graph, wired into the user's init op,
the MetaGraph's ``variables`` collection and the Saver, so a checkpoint keeps them (and a
checkpoint written before conversion still restores: the state then starts fresh).

Variables are resource variables whatever the graph uses, so a read taken in a step is a
value (not a ref that a later assign in the same step could change under it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorflow.core.framework import attr_value_pb2, types_pb2, variable_pb2
from tensorflow.python.framework import tensor_util

from ..core.dtypes import INT32
from ..core.errors import UnsupportedGraphError
from ..core.ir import Graph, TensorRef
from ..core.ops import SAVER_OPS, VARIABLE_CREATORS
from ..schema.opdefs import invalidate
from . import nodes as nd

#: the name scope of every node loss scaling adds
SCOPE = "amp_loss_scale"
STRING = types_pb2.DT_STRING


@dataclass(frozen=True)
class StateVar:
    """One added variable: its handle node, its initializer and its snapshot read."""

    name: str
    dtype: int
    initial: str
    initializer: str
    read: TensorRef


def refuse_scaled(graph: Graph) -> None:
    """A graph that already holds loss-scale state was converted before: scaling it again would
    scale its gradients twice."""
    if any(name.startswith(f"{SCOPE}/") for name in graph.names()):
        raise UnsupportedGraphError(f"the graph already has nodes named {SCOPE}/... (converted "
                                    "before?): convert the FP32 original instead")


def add_variable(graph: Graph, name: str, value, dtype: int) -> StateVar:
    """A scalar resource variable ``name`` laid out the way TF1's ``get_variable`` lays it out."""
    initial = nd.const(graph, f"{name}/Initializer/initial_value", value, dtype)
    attrs = {"dtype": nd.type_attr(dtype), "shape": nd.scalar_shape(),
             "shared_name": attr_value_pb2.AttrValue(s=name.encode()),
             "container": attr_value_pb2.AttrValue(s=b"")}
    ref = nd.add(graph, "VarHandleOp", name, (), attrs)
    nd.op(graph, "VarIsInitializedOp", f"{name}/IsInitialized/VarIsInitializedOp", [ref])
    init = nd.op(graph, "AssignVariableOp", f"{name}/Assign", [ref, initial], dtype=dtype)
    read = nd.op(graph, "ReadVariableOp", f"{name}/Read/ReadVariableOp", [ref], dtype=dtype)
    return StateVar(ref.node, dtype, initial.node, init.node, read)


def assign(graph: Graph, var: StateVar, value: TensorRef, name: str) -> str:
    return nd.op(graph, "AssignVariableOp", name, [TensorRef(var.name), value], dtype=var.dtype).node


def variable_def(var: StateVar) -> bytes:
    proto = variable_pb2.VariableDef(
        variable_name=f"{var.name}:0", initializer_name=var.initializer,
        snapshot_name=f"{var.read}:0", initial_value_name=f"{var.initial}:0",
        is_resource=True, trainable=False)
    return proto.SerializeToString()


def _global_initializers(graph: Graph, meta_graph, exclude: set[str]) -> set[str]:
    """The initializers of the graph's global variables: those of the MetaGraph's ``variables``
    collection where it has one (``local_variables`` are not global), else of every variable
    in the graph (a GraphDef does not say which are local)."""
    names = set()
    if meta_graph is not None and "variables" in meta_graph.collection_def:
        for raw in meta_graph.collection_def["variables"].bytes_list.value:
            names.add(variable_pb2.VariableDef.FromString(raw).initializer_name.split(":")[0])
    else:
        for node in graph.nodes():
            if node.op in VARIABLE_CREATORS and f"{node.name}/Assign" in graph:
                names.add(f"{node.name}/Assign")
    return {n for n in names if n in graph} - exclude


def hook_init_ops(graph: Graph, meta_graph, ours: str) -> list[str]:
    """Make every init op of the graph's global variables run ``ours``.

    An init op is a NoOp whose control inputs include the initializer of every global variable
    (``global_variables_initializer``). Groups of only some initializers
    (``local_variables_initializer``, ``variables_initializer(subset)``) are left alone: an
    eval loop re-runs them to reset metrics, and that must not reset the loss scale.
    """
    inits = _global_initializers(graph, meta_graph, set(graph.control_inputs(ours)))
    hooked = []
    if not inits:
        return hooked
    for node in graph.nodes():
        if node.op == "NoOp" and node.name != ours and inits <= set(graph.control_inputs(node.name)):
            graph.add_control_edge(ours, node.name)
            hooked.append(node.name)
    return hooked


def add_to_collections(meta_graph, variables: list[StateVar]) -> bool:
    """List the variables in the MetaGraph's global ``variables`` collection, where it has one."""
    if meta_graph is None or "variables" not in meta_graph.collection_def:
        return False
    values = meta_graph.collection_def["variables"].bytes_list.value
    for var in variables:
        values.append(variable_def(var))
    return True


def _string_list(node, extra: list[str]) -> None:
    values = [v.decode() for v in tensor_util.MakeNdarray(node.attr["value"].tensor).ravel()]
    proto = tensor_util.make_tensor_proto(values + extra, dtype=STRING)
    node.attr["value"].tensor.CopyFrom(proto)
    node.attr.pop("_output_shapes", None)   # a recorded shape would contradict the longer list


def _grow(node, dtypes: list[int]) -> None:
    node.attr["dtypes"].list.type.extend(dtypes)
    node.attr.pop("_output_shapes", None)
    invalidate(node)   # the port layout follows the dtypes list


def _saver_nodes(graph: Graph, meta_graph):
    saves = [n for n in graph.nodes() if n.op == "SaveV2"]
    restores = [n for n in graph.nodes() if n.op == "RestoreV2"]
    if len(saves) != 1 or len(restores) != 1:
        return None
    restore_all = None
    if meta_graph is not None and meta_graph.HasField("saver_def"):
        restore_all = meta_graph.saver_def.restore_op_name.split(":")[0].lstrip("^")
    if restore_all is None or restore_all not in graph:
        readers = {c for c, _ in graph.consumers(restores[0].name)}
        readers |= {c for r in list(readers) for c, _ in graph.consumers(r)}
        groups = {g for r in readers for g in graph.control_consumers(r) if graph.node(g).op == "NoOp"}
        if len(groups) != 1:
            return None
        restore_all = groups.pop()
    return saves[0], restores[0], restore_all


def has_saver(graph: Graph) -> bool:
    """Whether the graph holds save/restore ops of any kind."""
    return any(n.op in SAVER_OPS for n in graph.nodes())


def add_to_saver(graph: Graph, meta_graph, variables: list[StateVar]) -> bool:
    """Save the variables with the graph's one V2 Saver (SaveV2 + RestoreV2), and restore them
    only from a checkpoint that holds them; False if there is no such Saver.

    The Saver's own RestoreV2 is left as it was, so a checkpoint written before conversion
    restores whole with the converted graph's Saver. The state is restored beside it, under
    a condition read off the checkpoint's index file (:func:`_restore_if_saved`): from a
    checkpoint written after conversion, the state is restored; from one written before, it
    starts fresh (its initial values), and the restore prints a line saying so.
    """
    found = _saver_nodes(graph, meta_graph)
    if found is None:
        return False
    save, restore, restore_all = found
    names = [v.name for v in variables]
    for port in (1, 2):
        _string_list(graph.node(graph.input(save.name, port).node),
                     names if port == 1 else [""] * len(names))
    _grow(save, [v.dtype for v in variables])
    for var in variables:
        graph.append_input(save.name, var.read)
    _restore_if_saved(graph, graph.input(restore.name, 0), restore_all, variables)
    return True


def _restore_if_saved(graph: Graph, prefix: TensorRef, restore_all: str,
                      variables: list[StateVar]) -> None:
    """Before ``restore_all`` completes: if the checkpoint at ``prefix`` holds the variables,
    restore them, else assign their initial values and print that they start fresh.

    TensorFlow has no op that asks a checkpoint for a key, and RestoreV2 fails on a missing
    one. The checkpoint's ``.index`` file names every key it holds; keys there are stored
    after the prefix they share with the key before them, so the test looks for the first
    variable's name without its scope's first word (``loss_scale/...``), which no key outside
    the scope shares. A Switch on the answer runs one branch (v1 control flow, as the Saver's
    graph is v1); a Merge joins them into ``restore_all``.
    """
    scope = f"{SCOPE}/restore_if_saved"
    ordered = sorted(variables, key=lambda v: v.name)    # the checkpoint's key order
    names = [v.name for v in ordered]
    key = names[0].split("_", 1)[1]
    index = nd.add(graph, "StringJoin", f"{scope}/index_path",
                   [prefix, nd.const(graph, f"{scope}/suffix", ".index", STRING)],
                   {"N": attr_value_pb2.AttrValue(i=2), "separator": attr_value_pb2.AttrValue(s=b"")})
    contents = nd.add(graph, "ReadFile", f"{scope}/index", [index])
    size = nd.add(graph, "StringLength", f"{scope}/size", [contents],
                  {"unit": attr_value_pb2.AttrValue(s=b"BYTE")})
    last = nd.binary(graph, "Maximum", f"{scope}/last",
                     nd.binary(graph, "Sub", f"{scope}/span", size,
                               nd.const(graph, f"{scope}/key_length", len(key) - 1, INT32), INT32),
                     nd.const(graph, f"{scope}/zero", 0, INT32), INT32)
    starts = nd.op(graph, "Range", f"{scope}/starts", [nd.const(graph, f"{scope}/first", 0, INT32),
                   last, nd.const(graph, f"{scope}/step", 1, INT32)], Tidx=INT32)
    lengths = nd.add(graph, "Fill", f"{scope}/lengths",
                     [nd.op(graph, "Shape", f"{scope}/count", [starts], T=INT32, out_type=INT32),
                      nd.const(graph, f"{scope}/key_length_full", len(key), INT32)],
                     {"T": nd.type_attr(INT32), "index_type": nd.type_attr(INT32)})
    windows = nd.add(graph, "Substr", f"{scope}/windows", [contents, starts, lengths],
                     {"T": nd.type_attr(INT32), "unit": attr_value_pb2.AttrValue(s=b"BYTE")})
    equal = nd.add(graph, "Equal", f"{scope}/is_key",
                   [windows, nd.const(graph, f"{scope}/key", key, STRING)],
                   {"T": nd.type_attr(STRING),
                    "incompatible_shape_error": attr_value_pb2.AttrValue(b=True)})
    saved = nd.add(graph, "Any", f"{scope}/saved", [equal, nd.const(graph, f"{scope}/axis", 0, INT32)],
                   {"Tidx": nd.type_attr(INT32), "keep_dims": attr_value_pb2.AttrValue(b=False)})
    switch = nd.op(graph, "Switch", f"{scope}/switch", [prefix, saved], T=STRING)
    fresh, held = TensorRef(switch.node, 0), TensorRef(switch.node, 1)
    values = nd.add(graph, "RestoreV2", f"{scope}/restore",
                    [held, nd.const(graph, f"{scope}/names", names, STRING),
                     nd.const(graph, f"{scope}/slices", [""] * len(names), STRING)],
                    {"dtypes": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                        type=[v.dtype for v in ordered]))})
    restored = [assign(graph, v, nd.op(graph, "Identity", f"{scope}/{v.name}/value",
                                       [TensorRef(values.node, i)], T=v.dtype),
                       f"{scope}/{v.name}/restore")
                for i, v in enumerate(ordered)]
    gate = nd.op(graph, "Identity", f"{scope}/fresh", [fresh], T=STRING)
    # a control edge from the untaken branch makes a node dead too: the initial values pass
    # only when the checkpoint does not hold the state
    started = [assign(graph, var, nd.op(graph, "Identity", f"{scope}/{var.name}/initial",
                                         [TensorRef(var.initial)], control=[gate.node], T=var.dtype),
                      f"{scope}/{var.name}/start") for var in variables]
    note = nd.add(graph, "StringJoin", f"{scope}/note",
                  [nd.const(graph, f"{scope}/note_head", "amp-rewrite: checkpoint ", STRING), fresh,
                   nd.const(graph, f"{scope}/note_tail", " holds no loss-scale state "
                            "(written before conversion): the loss scale starts fresh", STRING)],
                  {"N": attr_value_pb2.AttrValue(i=3), "separator": attr_value_pb2.AttrValue(s=b"")})
    printed = nd.add(graph, "PrintV2", f"{scope}/print", [note],
                     {"output_stream": attr_value_pb2.AttrValue(s=b"stderr"),
                      "end": attr_value_pb2.AttrValue(s=b"\n")})
    joined = nd.add(graph, "Merge", f"{scope}/done", [
        nd.op(graph, "Identity", f"{scope}/restored", [held], control=restored,
              T=STRING),
        nd.op(graph, "Identity", f"{scope}/started", [fresh], control=started + [printed.node],
              T=STRING)],
        {"T": nd.type_attr(STRING), "N": attr_value_pb2.AttrValue(i=2)})
    graph.add_control_edge(joined.node, restore_all)
