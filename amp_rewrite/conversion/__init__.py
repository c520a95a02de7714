"""The conversion itself, from one graph to a whole model: :mod:`.rewrite` paints, casts,
reports and lints one IR graph; :mod:`.library` does that for every function a graph reaches;
:mod:`.graph` converts one MetaGraph with its options, training included; :mod:`.pipeline`
loads a model, converts each graph and saves the result."""
