"""`echobench calibrate --comm`: this machine's collectives measured for the performance model.

    commbench.py      all-reduce / all-gather / reduce-scatter timed at the sizes a run's layouts issue
    commcalibrate.py  the calibration run: launch the ranks, measure, fit, write the hardware profile

May import: sweep, predict, train, hardware, data, records, backends, model.
The GEMM calibration (`echobench calibrate` alone) is hardware.device.calibrate.
"""
