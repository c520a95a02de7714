"""The loss-scale state: resource variables added to the graph, wired into the user's init op,
the MetaGraph's ``variables`` collection and the Saver, so a checkpoint keeps them.

Variables are resource variables whatever the graph uses, so a read taken in a step is a
value (not a ref that a later assign in the same step could change under it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorflow.core.framework import attr_value_pb2, types_pb2, variable_pb2
from tensorflow.python.framework import tensor_util

from ..errors import UnsupportedGraphError
from ..ir import Graph, TensorRef
from ..ops import SAVER_OPS, VARIABLE_CREATORS
from ..signatures import invalidate
from . import nodes as nd

#: the name scope of every node loss scaling adds
SCOPE = "amp_loss_scale"


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
    proto = tensor_util.make_tensor_proto(values + extra, dtype=types_pb2.DT_STRING)
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
    """Add the variables to the graph's one V2 Saver (SaveV2 + RestoreV2); False if there is none."""
    found = _saver_nodes(graph, meta_graph)
    if found is None:
        return False
    save, restore, restore_all = found
    names = [v.name for v in variables]
    for node, port in ((save, 1), (save, 2), (restore, 1), (restore, 2)):
        _string_list(graph.node(graph.input(node.name, port).node), names if port == 1 else [""] * len(names))
    base = len(restore.attr["dtypes"].list.type)
    _grow(save, [v.dtype for v in variables])
    _grow(restore, [v.dtype for v in variables])
    for var in variables:
        graph.append_input(save.name, var.read)
    scope = restore.name.rsplit("/", 1)[0] + "/" if "/" in restore.name else ""
    for i, var in enumerate(variables):
        value = nd.op(graph, "Identity", f"{scope}{var.name}/restore", [TensorRef(restore.name, base + i)],
                      T=var.dtype)
        done = assign(graph, var, value, f"{scope}{var.name}/restore/Assign")
        graph.add_control_edge(done, restore_all)
    return True
