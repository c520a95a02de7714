"""The checks on both sides of a conversion: :mod:`.input` refuses a graph TensorFlow would not
import, :mod:`.lint` holds every converted graph and function to its OpDefs and to what it was."""
