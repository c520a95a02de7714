"""Tools around a conversion, the only code that runs graphs: the runner and its replay of
SavedModel function bodies, ``verify``, ``kernels``, ``bench`` and ``tune``."""
