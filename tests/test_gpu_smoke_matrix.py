"""matrices/gpu-smoke.yaml: the GPU smoke sweep of one 4-GPU node expands to exactly its four layouts,
skips none, and `echobench plan` reads it on a machine without a GPU."""

from conftest import ROOT, run_cli
from echobench.sweep.matrix import expand, load_matrix

MATRIX = ROOT / "matrices" / "gpu-smoke.yaml"
# (framework, parallelism, processes, tp): single on one GPU, the rest on the node's four
LAYOUTS = {("torchtitan", "single", 1, 1), ("torchtitan", "ddp", 4, 1), ("torchtitan", "fsdp2", 4, 1),
           ("megatron", "tp2", 4, 2)}


def test_it_expands_to_the_four_layouts_on_one_node_and_skips_none():
    matrix = load_matrix(MATRIX)
    assert matrix.spec.executor == "local"
    plan = expand(matrix)
    assert not plan.skipped and plan.excluded == 0 and plan.duplicates == 0
    assert {(r.cfg.framework, r.cfg.parallelism, r.cfg.world_size, r.cfg.tp) for r in plan.runs} == LAYOUTS
    assert len(plan.runs) == len(LAYOUTS)
    for run in plan.runs:
        cfg = run.cfg
        assert (cfg.device, cfg.nodes, cfg.precision, cfg.compile) == ("cuda", 1, "bf16", False)
        assert cfg.scale == "800M" and cfg.steps + cfg.warmup_steps <= 15  # a smoke: minutes, not a measurement
        assert cfg.audio_frames <= 250 and cfg.text_tokens <= 64 and cfg.speaker_frames <= 250
        # the memory estimate fits the smallest data-centre GPU of a 4-GPU node (A100 40 GB)
        assert run.memory.total_gib < 40, (run.id, run.memory.total_gib)


def test_plan_reads_it_without_a_gpu(tmp_path):
    proc = run_cli("plan", MATRIX, tmp_path=tmp_path, check=True)  # CUDA_VISIBLE_DEVICES="": no GPU seen
    for run in expand(load_matrix(MATRIX)).runs:
        assert run.id in proc.stdout
    assert "4 runs, 0 skipped, 0 excluded" in proc.stdout
