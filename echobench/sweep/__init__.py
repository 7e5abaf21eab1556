"""`echobench sweep / plan / preflight / status / cancel / reproduce`: a matrix file to runs on an executor.

    matrix.py     the matrix file: axes, include / exclude, limits; expanded to planned and skipped runs
    estimate.py   a run's time limit and GPU-hours
    plan.py       the plan printed before a sweep: memory, time, predicted MFU
    preflight.py  one short job that checks what the runs need on the nodes
    executors/    local (this machine) and slurm (sbatch per run): job scripts, job state
    loop.py       the sweep: choose, preflight, submit, wait, collect (resumable)
    state.py      sweep.json: what was submitted, attempts, records
    status.py     one row per run, refreshed from the scheduler
    reproduce.py  published rows as a matrix of card runs (their layout mapped, or scaled down; refusals)

May import: predict, train, hardware, data, records, backends, model.
"""
