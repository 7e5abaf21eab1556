"""What runs on each node: the launcher and the measured training loop.

    launch.py         the per-node launcher: torchrun under it, the record written whatever happens
    torchrun.py       torchrun with a worker's death reported (signal, exit code)
    distributed.py    the process group, device choice
    bench.py          the benchmark: build, warm up, measure windows of real steps, write the record
    workload.py       what the loop trains (Workload): its FLOPs, batches, warm-up, loss, counts
    bench_echo.py     Echo's workload: its data, draws, loss over real frames, counts
    bench_card.py     a card run's workload: a plain decoder on synthetic tokens
    bench_warmup.py   the micro-batch variants warm-up runs so nothing compiles in the window
    bench_profile.py  the profiled steps after the window
    bench_record.py   the record's figures from the loop's timings
    breakdown.py      where a step's time went (from the profiler trace)
    kernels.py        compile settings and counters, attention kernel choice
    fabric.py         fabric profiles: NCCL / libfabric settings of an interconnect, the network NCCL chose
    nodecheck.py      the preflight's checks on a node
    commvolume.py     bytes each collective of a step moves, counted in a real step (derived: hardware/traffic.py)

May import: hardware, data, records, backends, model.
"""
