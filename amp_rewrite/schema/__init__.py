"""What a graph's parts are, read from TensorFlow's own descriptions: the type model from OpDefs
(which type attribute governs each port), function bodies as IR and the contracts at their
calls, static shapes, Const values, and the snapshot of a graph taken before it is converted."""
