"""Training graphs: FP32 master weights and loss scaling inside the converted graph.

:mod:`.detect` finds the backward pass; :mod:`.scaling` scales a graph's own train step and
:mod:`.in_graph` drives it (state variables in the graph's init op, collections and Saver,
:mod:`.state`); :mod:`.in_functions` scales TF2 train steps held in library functions;
:mod:`.config` checks the loss-scale options (standard library only: the command line reads it
before TensorFlow is imported)."""
