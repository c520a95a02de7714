"""Graph edits, each its own module: casts applied from a painting, v1 ops upgraded where
painting needs it, TensorFlow's constant folding, batch norms folded into convolutions,
function boundaries moved into low precision, and float16's float32 emulation."""
