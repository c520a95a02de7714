"""Files in and out: every format loaded into a :class:`~amp_rewrite.io.load.Model` and saved
from one, Keras files exported as SavedModels (:mod:`.keras_files`), and safe writes.
:mod:`.files` uses the standard library only, so the command line checks paths with it before
TensorFlow is imported."""
