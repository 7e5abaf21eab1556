"""The device and the interconnect, as the performance model and the runs see them.

    device.py       which device, its precision and peak, the GEMM calibration, the env of a record
    profile.py      a hardware profile (profiles/*.yaml): rates and bandwidths, measured or assumed
    devicerates.py  achieved rates per device family (the in-step clock fitted on published runs)
    commfit.py      fitting collective bandwidth and latency to measurements
    nccltuning.py   NCCL's algorithm and protocol choice, as its tuner makes it
    devicememory.py a device's memory size: the datasheet table by name, the size its name gives
    traffic.py      the bytes each collective of a run's step moves, derived from its settings

May import: records, backends, model.
"""
