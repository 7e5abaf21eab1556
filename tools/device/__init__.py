"""The device kit: one prepared measurement pass on a lent single GPU with no network, and its
rehearsal on a CPU. Run from the repository root:

    check.sh       `tools/device/check.sh OUTDIR`: runs check.py (DEVICE_CHECK_DRY=1: the same steps
                   on the CPU with the tiny model)
    check.py       the pass: the set-up, then each step (runs, the bare loop, the kernel probe, the
                   `gpu` tests, ...) within one deadline; its docstring lists the steps and the knobs
    summary.py     its bookkeeping: records.jsonl, summary.md, the packed trace; `python3 -m
                   tools.device.summary table | unpack | verify RECORDS`
    bare_step.py   a bare PyTorch training loop of the same model and batch, the yardstick of the
                   harness's overhead
    kernel_probe.py  SDPA's choice, attention kernels, memory-bound bandwidth, a fused AdamW step
    packages.txt   the device image's packages and the wheels carried to it
    wheels.sh      downloads the carried wheels into .whl/ (here, with network)
    stack.py       whether that set is closed: every import the check reaches is on the image or
                   carried, every carried wheel's requirements met
    twin.sh        the rehearsal: a virtualenv with the image's versions, the tests collected and
                   the dry pass run on it
"""
