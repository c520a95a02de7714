"""The training pass: find the backward pass (:mod:`.detect`), add loss scaling and skipped
steps (:mod:`.scaling`) and its state variables (:mod:`.state`). :mod:`amp_rewrite.loss_scaling`
is the entry point the pipeline and the CLI use."""
