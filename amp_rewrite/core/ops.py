"""Facts about TensorFlow ops that the passes share, each written once.

Which ops hold state, carry TensorList handles, call functions, run loops, sum across
replicas, save checkpoints: every module asks here, so two of them cannot disagree. Which ops
write a variable is read off their OpDefs (:func:`amp_rewrite.schema.opdefs.is_variable_write`):
this layer does not import TensorFlow's registry.
"""

from __future__ import annotations

#: the MatMul/Conv family: ops whose work is matrix products, the work Tensor Cores and 16-bit
#: CPU matrix units (AMX, AVX512-BF16) speed up. Counted in reports whatever the rules paint.
MATRIX_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput",
    "Conv3D", "Conv3DBackpropFilter", "Conv3DBackpropFilterV2", "Conv3DBackpropInput",
    "Conv3DBackpropInputV2", "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput",
    "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3", "CudnnRNNBackprop", "CudnnRNNBackpropV2",
    "CudnnRNNBackpropV3", "BlockLSTM", "BlockLSTMV2", "BlockLSTMGrad", "BlockLSTMGradV2",
    "LSTMBlockCell", "LSTMBlockCellGrad", "GRUBlockCell", "GRUBlockCellGrad",
    "_FusedMatMul", "_FusedConv2D",
})

#: ops that hold or move the model's state: their dtypes never change (the weights stay
#: float32 on disk and in memory, the master weights) and a Cast follows each read
VARIABLE_OPS = frozenset({
    "VarHandleOp", "VariableV2", "Variable", "ReadVariableOp", "AssignVariableOp",
    "AssignAddVariableOp", "AssignSubVariableOp", "Assign", "AssignAdd", "AssignSub",
    "VarIsInitializedOp", "IsVariableInitialized", "ResourceGather", "ResourceGatherNd",
    "DestroyResourceOp", "_VarHandlesOp", "_ReadVariablesOp",
})
#: ops that compute nothing: they hold a value, pass it on, reshape it, feed the graph or steer
#: its control flow. With the variable ops (and nodes of no float type) they are the plumbing
#: the HTML report folds away behind a count, so the math is what a reader sees first
PLUMBING_OPS = frozenset({
    "Const", "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient",
    "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size", "Rank", "NoOp",
    "Placeholder", "PlaceholderWithDefault", "PlaceholderV2", "Enter", "RefEnter", "Exit",
    "RefExit", "Merge", "RefMerge", "Switch", "RefSwitch", "NextIteration", "RefNextIteration",
    "LoopCond", "ControlTrigger",
}) | VARIABLE_OPS
#: ops that create a variable (a checkpoint must hold its value)
VARIABLE_CREATORS = frozenset({"VarHandleOp", "VariableV2", "Variable"})
#: graph inputs
PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderWithDefault", "PlaceholderV2"})

#: ops a TensorList handle (a DT_VARIANT) passes through unchanged
VARIANT_PASSTHROUGH = frozenset({
    "Identity", "IdentityN", "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge",
    "Switch", "RefSwitch", "NextIteration", "RefNextIteration", "StopGradient", "Snapshot",
})


def is_tensorlist_op(op: str) -> bool:
    """Whether ``op`` works on a TensorList: its name holds ``TensorList`` anywhere, as
    grappler's ``IsTensorListOp`` asks, so the creator ``EmptyTensorList`` (the accumulator of
    TF2 while-loop gradients) counts with ``TensorListReserve``, the pushes and the pops."""
    return "TensorList" in op


#: control flow v1: a loop's back edge runs NextIteration -> Merge
NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})
ENTER_OPS = frozenset({"Enter", "RefEnter"})
EXIT_OPS = frozenset({"Exit", "RefExit"})
SWITCH_OPS = frozenset({"Switch", "RefSwitch"})

#: control flow v2 and calls: functional ops and the attrs that name their callees
WHILE_OPS = ("While", "StatelessWhile")
IF_OPS = ("If", "StatelessIf")
CASE_OPS = ("Case", "StatelessCase")
BRANCH_OPS = IF_OPS + CASE_OPS
CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
FUNCTIONAL_OPS = WHILE_OPS + BRANCH_OPS + CALL_OPS

#: ops that sum a gradient across replicas: loss scaling unscales and checks after them
ALL_REDUCE_OPS = frozenset({
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "NcclAllReduce",
    "HorovodAllreduce", "HorovodAllgather", "_ScopedAllocatorConcat",
})

#: ops that fill a lookup table from its keys and values or a vocabulary file: what
#: ``tables_initializer`` and a SavedModel's main op run before the first lookup (a
#: ``KeyValueTensorInitializer`` imports its tensors; a saver's import restores a mutable table)
TABLE_INITIALIZERS = frozenset({"InitializeTable", "InitializeTableV2", "InitializeTableFromTextFile",
                                "InitializeTableFromTextFileV2", "InitializeTableFromDataset",
                                "LookupTableImportV2"})
#: ops that change a mutable lookup table's entries (``MutableHashTable.insert`` ...): state a
#: function can write that is no variable
TABLE_WRITES = frozenset({"LookupTableInsert", "LookupTableInsertV2", "LookupTableRemoveV2",
                          "LookupTableImport", "LookupTableImportV2"})

#: ops whose OpDefs read like a variable write's (stateful, a resource and a typed value in,
#: nothing out) but whose resource is no variable: a lookup table's entries, a summary file, a
#: gradient accumulator. :func:`amp_rewrite.schema.opdefs.is_variable_write` leaves them out
#: (the OpDef does not say what kind of resource an op takes)
NOT_VARIABLE_WRITES = TABLE_WRITES | TABLE_INITIALIZERS | frozenset({
    "WriteSummary", "WriteScalarSummary", "WriteHistogramSummary", "WriteImageSummary",
    "WriteAudioSummary", "WriteRawProtoSummary", "WriteGraphSummary",
    "ResourceAccumulatorApplyGradient",
})

#: save and restore ops, V1 and V2 (only a V2 Saver, SaveV2 + RestoreV2, can be extended)
SAVER_OPS = frozenset({"SaveV2", "RestoreV2", "Save", "SaveSlices", "Restore", "RestoreSlice"})

#: tf.data: the op that reads one batch out of an iterator (an input a run can feed), and the
#: op that (re)starts an initializable iterator on its dataset (its ``initializer``)
ITERATOR_GET_NEXT_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync"})
ITERATOR_INIT_OPS = frozenset({"MakeIterator"})
#: ops whose outputs nothing reads but that are not results a user wants compared
NOT_OUTPUTS = frozenset({"Placeholder", "PlaceholderWithDefault", "Const", "ReadVariableOp",
                         "VarIsInitializedOp", "IsVariableInitialized", "VarHandleOp", "VariableV2"})
