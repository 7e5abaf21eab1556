"""echobench: throughput and MFU of Echo TTS training, measured on real training steps.

The packages, in layers: a package imports only from the layers below it (tests/test_imports.py
holds it), so the arrows run one way and each layer can be read without the ones above.

    cli        the `echobench` commands: parse, call the package that does the work, print
    report     dashboard and tables, from stored records only
    tune       the best layout of a scale: searched by predict, proven by a sweep
    calibrate  this machine's collectives measured for predict
    sweep      a matrix file to runs on an executor (local, SLURM): plan, preflight, submit, state
    predict    the performance model: a step priced from a hardware profile; the memory estimate; the step counter
    train      what runs on each node: the launcher, the measured loop, its record and breakdown
    hardware   the device and the interconnect: probing, GEMM calibration, profiles, memory sizes
    data       tar shards, the tokenizer, the batch loader
    records    the run config and its layout, the result record, peaks, the files a sweep keeps, console text
    backends   torchtitan and megatron: parallelize the plain model from outside
    model      Echo TTS in plain PyTorch, and its exact FLOP count

report, tune and calibrate are one layer (none imports another), as are hardware and data.

Measuring ends with train (a run's record); scheduling starts with sweep.
"""

__version__ = "0.1.0"  # pyproject.toml reads it; preflight holds every node's against the submitter's

# Top to bottom; packages on one line are siblings (neither imports the other).
LAYERS = (
    ("cli",),
    ("report", "tune", "calibrate"),
    ("sweep",),
    ("predict",),
    ("train",),
    ("hardware", "data"),
    ("records",),
    ("backends",),
    ("model",),
)
