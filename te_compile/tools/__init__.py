"""Tools around the compile path: they check (`check*.py`), simulate a GPU (`simulate.py`),
report the environment (`doctor.py`), capture CUDA graphs (`graph_capture.py`) and set TF32
(`tf32.py`). Nothing in the compile path (patching, autocast, modules/, ops/) imports them;
`te_compile/__init__.py` and `__main__.py` re-export the public entry points."""
