"""The ground floor: the exception hierarchy, dtypes as TensorFlow enums, op facts, what this
machine's CPU has, and the graph IR every pass works on. Nothing here knows about painting."""
