"""The user's tools around the backend: the ``fxoffload`` command and what it and users call.

Owns: the command line (``cli``: argparse and printing; ``flags``: the flags ``plan``, ``fit`` and
``check`` share), the fake-tensor step tracer (``tracing``) and the model sources it builds
(``models``), ``fxoffload plan`` (``plan_command``, ``report``), ``fxoffload fit`` (``fit_command``;
``fit``, its search, free of FX; ``layer_step``, a step whose layers run one graph, beside its eager
parts), ``fxoffload check`` (``check``), measured peaks of real runs
(``measure``) and the plots (``plot``). ``fxoffload.plot``, ``fxoffload.plot_step`` and
``fxoffload.measure_peak`` are re-exported by the package's face.

May import: every other room (the passes, the runtime, the top-level modules, the backend); nothing
imports the tools but the package's face and ``python -m fxoffload`` (``tests/test_architecture.py``
checks the rooms' order). This ``__init__`` imports nothing, so that ``fxoffload.tools.plot`` does not
load the command line.
"""
