"""What a run is and what it recorded: the settings, the record, and the files around them.

    config.py       RunConfig: every run setting, typed, with its flag and help (one definition)
    layout.py       Layout: a run's parallelism parsed once (single, ddp, fsdp2, hsdp, tpN) and what it splits
    results.py      Record: the versioned result record (schema, migration, load, save), stats over repeats
    run_figures.py  step and window figures from a run's timings; the MFU convention
    states.py       RunState: a run's states in one vocabulary (record status, sweep, job, scheduler)
    peaks.py        datasheet peak FLOP/s per device and precision (MFU's denominator)
    paths.py        the cache directory and the files a sweep or tune directory holds
    rundir.py       a run directory's files (run.yaml, job-state) named and read in one place
    console.py      records as rich text (escaped)
    atomic.py       files written whole or not at all
    yamltext.py     YAML errors as one line

May import: backends, model.
"""
