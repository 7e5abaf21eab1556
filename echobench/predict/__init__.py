"""`echobench predict`: a performance model of one training step, from a run's settings and a
hardware profile (echobench.hardware.profile), and its residual against measured records.

Per rank and step (docs/explanation/predict.md):

    device  = (forward + backward + optimizer + exposed communication) x (1 + straggler share)
    forward = sum over the step's GEMMs of 2 m n k / gemm_tflops(m, n, k)        (flops.py's matmuls,
              + attention FLOPs / attention_tflops(seq_q, seq_k, kernel)        at the run's rows,
              + element-wise bytes / memory_gbps                                TP-split per rank)
    backward: the same for the input- and weight-gradient GEMMs (and AC's recompute)
    optimizer = AdamW + gradient-clipping bytes of this rank's parameters / memory_gbps
    host    = dispatched ATen ops of the step x the host's cost per op (the profile's host point,
              else its assumed host_op)
    step    = device + host on a CPU (the host runs the kernels itself), max(device, host) on a GPU
              (the host queues kernels ahead of the device)

Communication: each collective of traffic.step_bytes priced with hwprofile.collective_cost: the
profile's fit of the group's kind (its ranks per node, Traffic.per_node), its bus bandwidth scaled to
the links the group can use (a cross-node group's share of its node's NICs, the profile's
topology.nics_per_node; a pair of pairwise-wired GPUs its own NVLink links), its latency the fit's
fixed part + NCCL's tuner latency at the group's size (ring: 2(n-1) or n-1 hops over NVLink and the
network; tree for all-reduce: 2 log2(nodes) network hops; the cheapest algorithm and protocol per
call, echobench.hardware.nccltuning); then placed: DDP's bucketed gradient all-reduce overlaps backward but its last bucket; FSDP2's
all-gathers are prefetched (the first exposed), its reduce-scatters overlap backward (the last
exposed), HSDP's replica all-reduce likewise; the frame-count all-reduce overlaps forward; TP's
collectives and the gradient-norm all-reduce are on the critical path. Exposed = the unhideable
part + max(0, the rest - the compute of the phase it overlaps). Gradient accumulation: each
micro-batch's compute, host ops and collectives grad_accum times, the once-per-step collectives
(the gradients' reductions and norms, traffic.Traffic.once) and the optimizer once. A profile's
measured latency per network step (topology.net_step_latency_s) replaces NCCL's; where its topology
says the spine is shared (nodes_per_leaf, oversubscription) a group spanning more nodes than a leaf
holds gets that share of the bandwidth. Stragglers: the step ends with the slowest of the run's ranks,
each rank's step a Gaussian draw of the profile's jitter (cv): x (1 + cv x E[max of N standard
normals]) (hwprofile.straggler_share; none without a jitter).

The device's rates are echobench.hardware.devicerates' (each with its source). GEMM rates: a measured shape
within 10% of the GEMM's stands for it (a calibration measures the run's own); else, where the
profile gives its sm_count, the best point's rate x the shape model's rate / the best shape's, at
most 1 (devicerates.gemm_rate: tile and wave quantization over the SMs, a k-loop cost per tile and a
launch cost per GEMM, constants fitted to OpenXLA's measured H100 table); float8 GEMMs (precision
fp8) at the profile's float8 points (MAMF's) through the same model. Attention: the points of the
kernel the run takes (pricing.attention_kernel; a CPU: the profile's own), at its causality, every
score counted; devicerates.attention_points' fallback order where the profile lacks them, each
fallback a note. GEMMs and attention x the sustained clock (devicerates.sustained_clock): the
profile's clock (another power limit than its points': 1 where none) x the in-step clock of its GPU
family, the ONE fitted term (validation/fit.json: fitted to published runs, held out a source at a
time by crossval.py; 1 on a CPU, on a measured profile and for a run on one GPU). Memory: on a GPU
the add bandwidth at the size of the run's tensors (the shipped GPU profiles: 86% of the datasheet,
the H200's measured ratio); on a CPU the DRAM add's (every op writes a fresh allocation).

Element-wise bytes: counted (elementwise.py), on a CPU profile as on a GPU's: echobench.predict.stepcount's bytes read +
written by every memory-bound op of one step of the run's configuration (its width, lengths,
micro-batch, precision, AC and attention path; the optimizer and clipping apart), counted at 1 and 2
layers per stack and extrapolated per layer, which equals a full count (a test holds it), cached in
memory and under the echobench cache; TP splits them as memory.estimate_memory. An eager bf16
800M / 3B / 8B step at micro-batch 8 counts 5.0 .. 5.3 x forward and 9.6 .. 10.2 x backward the bytes
of what autograd saves per step (memory.activation_elements_per_sample x micro-batch x the compute
dtype's size). Compiled runs: work.ELEMENTWISE's 1.68 x / 2.23 x those bytes, 3B's count at
micro-batch 8 taken for every run, because counting inductor's kernels takes 40 .. 90 s per reduced
count (two per configuration, 2 CPU cores): ECHOBENCH_COUNT_COMPILED=1 counts each run's instead
(about 1.4 .. 1.9 x forward and 2.0 .. 2.5 x backward for 800M .. 8B). A count that fails (no torch)
keeps the fixed eager ratios 3.3 x forward and 5.22 x backward (counted as 6.0 / 9.5 against an
earlier activation estimate 1.82 x smaller). A float8 run (GPU): its float8 linears' casts, transposes and amax reductions on top
(work.float8_work). The prediction's notes say which.

AdamW: 56 bytes per parameter (foreach, CPU: counted) or 28 (fused, GPU: p, g, m, v read, p, m, v
written), at the profile's measured AdamW rate (memory op "adamw") where it has one, else
at its add bandwidth; clipping 8 (counted) at the add bandwidth.

Host ops per step: HOST_OPS, counted on real tiny steps of each layout (per DiT, speaker and text
encoder layer, plus a fixed part; a test holds the single-process rows against a count).

The MFU convention is the record's: model FLOPs / (step time x world x peak), the peak the run's
(the matrix's peak_tflops, else the datasheet entry of the profile's device, else the profile's
best GEMM rate). The interval: the wider of the model's cross-validated error (intervals.py: the
10th to 90th percentile of its leave-one-source-out residuals on published runs, never zero width)
and the calibration's spread (each GEMM, attention and memory point's min / max, the host step's
min / max, the clock's range; each collective fit +- its rel_rms). Plain functions over RunConfig; no
torch import (hardware.traffic's param_units imports it where the collectives are derived).

The package, by what each file is (every name callers use is re-exported here):

    work.py           what a step of Echo runs on a rank: its GEMMs and attentions (step_work), its
                      element-wise bytes at the fixed ratios and optimizer bytes, the parameters a rank
                      updates, the host's ATen ops (host_ops)
    elementwise.py    an Echo step's element-wise bytes counted (stepcount at reduced depth,
                      extrapolated per layer, cached): counted_bytes, echo_elementwise
    pricing.py        that work priced on a profile: Rates (GEMM, attention, memory and collective
                      figures at one bound, devicerates' rates x the fitted terms), device_seconds,
                      the host point, run_peak, priced (the run as the profile's device runs it)
    communication.py  the step's collectives priced and placed (Collective, collectives), exposed,
                      link_bytes, hide_gbps
    model.py          the prediction: predict -> Prediction (host_per_op, the interval, MFU, memory,
                      notes); predict_runs, ranks, at_nodes, parse_nodes
    profiles.py       which profile a run takes: load_profiles, profile_for_device, machine_device,
                      choose_profile; profile_lines, no_profile_message, other_device_lines
    measured.py       a prediction held against a measured record (a card run's by predict_card):
                      against -> Comparison, summary, predicted_shares / measured_shares
    memory.py         an Echo run's memory per GPU before it runs (estimate_memory -> MemoryEstimate:
                      weights, gradients, optimizer, activations, ...), the training state's bytes
                      (adam_state_bytes, which the cards' memory counts with too)
    cards/            a plain decoder as a model card, predicted as Echo is: its work, memory,
                      collectives and step (predict_card -> CardPrediction); cards/__init__.py lists them
    reference.py      a card run beside its row's published figures and prediction: reference_row -> ReferenceRow
    frameworks.py     each framework's defaults at its version (overlap flags, reduce dtype, attention
                      kernel, eager or fused kernels), the generic default where a row names none, a
                      framework described by its settings: framework, layout_framework, resolved
    recompute.py      activation checkpointing as named recompute policies (what each re-runs)
    pipeline.py       pipeline parallelism's 1F1B / interleaved schedule: bubble, point-to-point
    validate.py       `validate published`: published rows (load_rows, a strict schema) predicted over
                      their assumed values at a fit (validate -> ValidationRow: the interval, the memory
                      against the device's), validation_summary
    crossval.py       the fitted term held out a source at a time: crossval, write_fit; the fit a
                      validation priced at (fit_used: the committed one, or refit on the file's rows)
    intervals.py      the interval of every prediction, from crossval's residuals
    tables.py         rich tables: prediction_table, comparison_table, validation_table, reference_table
    errors.py         PredictError
    stepcount.py      one step counted, not timed (FakeTensors, a dispatch mode): kernels, FLOPs, bytes by part
    stepcount_ops.py  one ATen op as a GPU runs it (kind, launches, FLOPs, bytes)
    stepcount_project.py  a counted step priced on a profile's device (the projection a GPU record meets)

May import: train, hardware, data, records, backends, model.
"""

from echobench.records.config import run_id  # callers reach it as predict.run_id
from echobench.predict.cards.card import Layout, ModelCard, card_params, load_card_file, model_card, run_layout
from echobench.predict.cards.work import card_work
from echobench.predict.cards.model import CardPrediction, predict_card
from echobench.predict.cards.traffic import StepTraffic, card_traffic, place_card
from echobench.predict.communication import Collective, collectives, exposed, hide_gbps, link_bytes
from echobench.predict.errors import PredictError
from echobench.predict.measured import (
    BREAKDOWN_PARTS,
    AgainstRecords,
    Comparison,
    against,
    against_records,
    measured_shares,
    predicted_shares,
    summary,
)
from echobench.predict.model import Prediction, at_nodes, host_per_op, parse_nodes, predict, predict_runs, ranks
from echobench.predict.pricing import (
    BOUNDS,
    Rates,
    compute_bytes,
    device_seconds,
    device_type,
    host_point,
    in_situ_factor,
    is_cpu,
    is_cpu_name,
    priced,
    run_peak,
)
from echobench.predict.profiles import (
    choose_profile,
    load_profiles,
    machine_device,
    no_profile_message,
    other_device_lines,
    profile_for_device,
    profile_lines,
    profile_processes,
)
from echobench.hardware.devicerates import InStepFit, committed_fit
from echobench.predict.tables import comparison_table, crossval_table, prediction_table, validation_table
from echobench.predict.validate import ValidationRow, load_rows, validate, validation_summary
from echobench.predict.work import (
    AC_BACKWARD_OPS,
    ADAMW_BYTES,
    CLIP_BYTES,
    COMPILED_BLOCK_OPS,
    ELEMENTWISE,
    HOST_OPS,
    AttentionWork,
    Matmul,
    elementwise_bytes,
    host_ops,
    rank_params,
    run_work,
    step_work,
)

__all__ = ["AC_BACKWARD_OPS", "ADAMW_BYTES", "AttentionWork", "BOUNDS", "BREAKDOWN_PARTS", "CLIP_BYTES", "load_card_file",
           "CardPrediction", "Layout", "ModelCard", "StepTraffic", "ValidationRow", "card_params", "card_traffic",
           "card_work", "load_rows", "model_card", "place_card", "predict_card", "run_layout", "validate",
           "validation_summary", "validation_table", "crossval_table", "InStepFit", "committed_fit",
           "COMPILED_BLOCK_OPS", "Collective", "Comparison", "ELEMENTWISE", "HOST_OPS", "Matmul",
           "AgainstRecords", "PredictError", "Prediction", "Rates", "against", "against_records", "at_nodes", "choose_profile", "collectives",
           "comparison_table", "compute_bytes", "device_seconds", "device_type", "elementwise_bytes", "exposed",
           "hide_gbps", "host_ops", "host_per_op", "host_point", "in_situ_factor", "is_cpu", "is_cpu_name",
           "link_bytes", "load_profiles", "machine_device", "measured_shares", "no_profile_message",
           "other_device_lines", "parse_nodes", "predict", "predict_runs", "predicted_shares", "prediction_table",
           "priced", "profile_for_device", "profile_lines", "profile_processes", "rank_params", "ranks", "run_id",
           "run_peak", "run_work", "step_work", "summary"]
