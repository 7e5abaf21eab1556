"""Dropped conditioning through unmasked kernels (components.merged_attention, the DiT's "split" path)
holds to the masked reference: outputs and gradients, alone and in the model's step."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from conftest import counted_model_flops
from echobench.data.dataset import Padding
from echobench.model import components
from echobench.model.components import merged_attention, merged_attention_runs
from echobench.model.config import PRESETS
from echobench.model.echo import EchoTTS, diffusion_draws
from echobench.model.flops import model_flops

aten = torch.ops.aten
KEEPS = ([True, True, True, True], [False, False, False, False], [True, False, False, True], [False, True, True, True])


def qkv(dtype, b=4, heads=2, latent=9, cond=7, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, heads, latent, dim)] * 3 + [(b, heads, cond, dim)] * 2
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def masked_reference(q, k_a, v_a, k_b, v_b, keep):
    """SDPA over [k_a; k_b] with a key mask hiding k_b from the dropped samples, in float32."""
    mask = torch.cat([torch.ones(q.shape[0], k_a.shape[2], dtype=torch.bool), keep[:, None].expand(-1, k_b.shape[2])],
                     dim=1)
    return F.scaled_dot_product_attention(q.float(), torch.cat([k_a, k_b], 2).float(), torch.cat([v_a, v_b], 2).float(),
                                          attn_mask=mask[:, None, None, :])


def outputs_and_grads(fn, inputs, keep, grad):
    out = fn(*inputs, keep)
    return out.float(), [g.float() for g in torch.autograd.grad(out, inputs, grad.to(out.dtype))]


@pytest.mark.parametrize("keep", KEEPS)
def test_merged_attention_equals_the_masked_reference_in_fp32(keep):
    inputs, keep = qkv(torch.float32), torch.tensor(keep)
    grad = torch.randn(4, 2, 9, 8, generator=torch.Generator().manual_seed(1))
    out, grads = outputs_and_grads(merged_attention, inputs, keep, grad)
    ref, ref_grads = outputs_and_grads(masked_reference, inputs, keep, grad)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
    for name, g, r in zip(("q", "k_latent", "v_latent", "k_cond", "v_cond"), grads, ref_grads):
        assert torch.allclose(g, r, atol=5e-6, rtol=1e-5), name
    # A dropped sample's conditioning keys get no gradient at all: zeros, not small numbers.
    assert not grads[3][~keep].any() and not grads[4][~keep].any()


def test_merged_attention_carries_the_gpu_kernel_s_extras_to_its_backward(monkeypatch):
    """The GPU's flash kernel returns, beside its output and log-sum-exp, tensors (cumulative lengths,
    the philox seed and offset) and ints (max_q, max_k) that its backward takes again; autograd saves
    tensors only. The CPU's kernel wrapped to return extras of those kinds: the same output and
    gradients as the masked reference, and each backward given back its own call's extras."""
    cpu_forward, cpu_backward = components._flash_forward, components._flash_backward
    given = []

    def forward(q, k, v):
        out, lse, _, _ = cpu_forward(q, k, v)
        return out, lse, (torch.tensor(k.shape[2]), torch.tensor(0)), (q.shape[2], k.shape[2])

    def backward(grad, q, k, v, out, lse, tensors, ints):
        given.append((int(tensors[0]), ints))
        return cpu_backward(grad, q, k, v, out, lse, (), ())

    monkeypatch.setattr(components, "_flash_forward", forward)
    monkeypatch.setattr(components, "_flash_backward", backward)
    inputs, keep = qkv(torch.float32), torch.tensor(KEEPS[2])
    grad = torch.randn(4, 2, 9, 8, generator=torch.Generator().manual_seed(1))
    out, grads = outputs_and_grads(merged_attention, inputs, keep, grad)
    ref, ref_grads = outputs_and_grads(masked_reference, inputs, keep, grad)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
    assert all(torch.allclose(g, r, atol=5e-6, rtol=1e-5) for g, r in zip(grads, ref_grads))
    assert given == [(9, (9, 9)), (7, (9, 7))]  # the latent keys' call, then the conditioning's


@pytest.mark.parametrize("keep", KEEPS[2:])
def test_merged_attention_in_bf16_errs_no_more_than_the_masked_kernel(keep):
    """In bf16 both paths round: the merged one (each half's output rounded, then merged in float32)
    stays within twice the masked bf16 kernel's own error against the float32 reference."""
    inputs, keep = qkv(torch.bfloat16), torch.tensor(keep)
    exact = [t.detach().float().requires_grad_() for t in inputs]
    grad = torch.randn(4, 2, 9, 8, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = outputs_and_grads(masked_reference, exact, keep, grad)
    merged, merged_grads = outputs_and_grads(merged_attention, inputs, keep, grad)
    masked_bf16 = F.scaled_dot_product_attention(
        inputs[0], torch.cat(inputs[1:4:2], 2), torch.cat(inputs[2:5:2], 2),
        attn_mask=torch.cat([torch.ones(4, 9, dtype=torch.bool), keep[:, None].expand(-1, 7)], 1)[:, None, None])
    masked_grads = torch.autograd.grad(masked_bf16, inputs[:3], grad.bfloat16())
    assert (merged - ref).abs().max() <= 2 * max((masked_bf16.float() - ref).abs().max(), 2 ** -8)
    for g, m, r in zip(merged_grads[:3], masked_grads, ref_grads[:3]):
        assert (g - r).abs().max() <= 2 * max((m.float() - r).abs().max(), 2 ** -8)


def test_merged_attention_traces_whole_under_compile():
    """One graph (fullgraph), the same outputs and gradients: the compiled DiT block can take it."""
    inputs, keep = qkv(torch.float32), torch.tensor(KEEPS[2])

    def fn(q, k_a, v_a, k_b, v_b, keep):
        return merged_attention(q.sin(), k_a, v_a, k_b, v_b, keep).cos()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    grad = torch.randn(4, 2, 9, 8)
    out, grads = outputs_and_grads(compiled, inputs, keep, grad)
    ref, ref_grads = outputs_and_grads(fn, inputs, keep, grad)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_merged_attention_runs_where_the_flash_kernel_does():
    assert merged_attention_runs(torch.device("cpu"), torch.float32, 128) is None
    assert "bf16 or fp16" in merged_attention_runs(torch.device("cuda"), torch.float32, 128)
    assert "head_dim" in merged_attention_runs(torch.device("cuda"), torch.bfloat16, 512)
    assert merged_attention_runs(torch.device("cuda"), torch.bfloat16, 128) is None


# ---- in the model's step ----

def full_batch(b, la=24, lt=8, ls=16, seed=0, padded=False):
    g = torch.Generator().manual_seed(seed)
    batch = SimpleNamespace(
        latent=torch.randn(b, la, 128, generator=g), latent_mask=torch.ones(b, la, dtype=torch.bool),
        ref=torch.randn(b, ls, 128, generator=g), ref_mask=torch.ones(b, ls, dtype=torch.bool),
        text_ids=torch.randint(3, 300, (b, lt), generator=g), text_mask=torch.ones(b, lt, dtype=torch.bool),
        padding=Padding(latent=padded, text=padded, speaker=padded))
    if padded:  # the second sample shorter in every stream
        batch.latent_mask[1, 17:] = False
        batch.text_mask[1, 5:] = False
        batch.ref_mask[1, 9:] = False
    return batch


def models(**kw):
    """The tiny model twice, same weights (AdaLN perturbed so that every path matters): split, masked."""
    out = []
    for mode in ("split", "masked"):
        torch.manual_seed(0)
        model = EchoTTS(PRESETS["tiny"], cfg_drop_attention=mode, **kw)
        torch.manual_seed(1)
        for m in model.modules():
            if type(m).__name__ == "LowRankAdaLN":
                torch.nn.init.normal_(m.up.weight, std=0.02)
        out.append(model)
    return out


def draws_with(keep: list[bool]):
    draws = diffusion_draws(0, list(range(len(keep))), 24, 128, 0.1, torch.device("cpu"))
    draws.keep[:] = keep
    return draws


def step(model, batch, draws):
    model.zero_grad()
    seen = []
    sdpa, merged = components.F.scaled_dot_product_attention, components.merged_attention

    def spy_sdpa(q, k, v, attn_mask=None, **kw):
        seen.append("masked" if attn_mask is not None else "none")
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def spy_merged(*args):
        seen.append("merged")
        return merged(*args)

    import echobench.model.dit as dit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(components.F, "scaled_dot_product_attention", spy_sdpa)
        mp.setattr(dit, "merged_attention", spy_merged)
        loss = model(batch, draws=draws)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, seen


@pytest.mark.parametrize("keep", [[True, False, True], [False, False, False], [True, True, True]])
@pytest.mark.parametrize("padded", [False, True])
def test_the_split_step_equals_the_masked_step(keep, padded):
    """Loss and every gradient of a training step, split vs masked, fp32: no padding takes no mask
    anywhere (the dropped samples through merged_attention); a padded batch takes the key mask in both."""
    split, masked = models()
    batch, draws = full_batch(len(keep), padded=padded), draws_with(keep)
    dropped = not all(keep)
    paths = split.attention_paths(batch.padding, dropped, 8)
    assert paths["dit"] == ("dense" if padded else "split" if dropped else "none")
    assert masked.attention_paths(batch.padding, dropped, 8)["dit"] == ("dense" if padded or dropped else "none")
    loss_a, grads_a, seen_a = step(split, batch, draws)
    loss_b, grads_b, seen_b = step(masked, batch, draws)
    if not padded:
        assert "masked" not in seen_a  # neither the DiT nor the speaker encoder gave a kernel a mask
        assert ("merged" in seen_a) == dropped
    assert torch.allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7), name


def test_the_split_step_equals_the_masked_step_under_selective_checkpointing():
    """Op-level selective AC (the policy saves the flash kernels' outputs) re-runs merged_attention's
    forward with the saved outputs: the same loss and gradients."""
    from echobench.backends.torchtitan import ECHO_PARTS, apply_ac

    split, masked = models()
    apply_ac(split, ECHO_PARTS, "selective")
    batch, draws = full_batch(3), draws_with([True, False, True])
    loss_a, grads_a, _ = step(split, batch, draws)
    loss_b, grads_b, _ = step(masked, batch, draws)
    assert torch.allclose(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    strip = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads_a.items()}
    assert strip.keys() == grads_b.keys()
    assert all(torch.allclose(strip[n], grads_b[n], rtol=1e-5, atol=1e-7) for n in grads_b)


def test_the_split_step_counts_the_flop_model_s_flops():
    """The split path computes every sample's scores against every key (a dropped sample's conditioning
    keys weighted zero): FlopCounterMode sees the masked step's FLOPs, the FLOP model's (the CPU flash
    kernel's backward counted at 2x its forward, as the model counts attention: not flash's recompute
    of the scores)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    split, masked = models()
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu:
               lambda q, k, v, *args, out_shape=None, **kw: sdpa_flop_count(q, k, v),
               aten._scaled_dot_product_flash_attention_for_cpu_backward:
               lambda grad, q, k, v, *args, out_shape=None, **kw: 2 * sdpa_flop_count(q, k, v)}
    batch, draws = full_batch(3), draws_with([True, False, True])
    counted = []
    for model in (split, masked):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            model(batch, draws=draws).backward()
        counted.append(counted_model_flops(counter))
    assert counted[0] == counted[1]  # the masked step's attention runs as matmuls (math), counted as such
    predicted = 3 * model_flops(PRESETS["tiny"], 24, 8, 16).total
    assert abs(counted[0] - predicted) / predicted < 0.01  # as tests/test_flops.py holds the masked one


def test_backend_resolves_split_where_the_flash_kernel_runs():
    from echobench.backends.torchtitan import cfg_drop_attention
    from echobench.records.config import RunConfig

    cfg = RunConfig(scale="tiny")
    assert cfg.cfg_drop_attention == "split"
    assert cfg_drop_attention(cfg, torch.device("cpu"), torch.float32) == ("split", None)
    mode, note = cfg_drop_attention(cfg, torch.device("cuda"), torch.float32)
    assert mode == "masked" and "bf16 or fp16" in note
    assert cfg_drop_attention(cfg, torch.device("cuda"), torch.bfloat16) == ("split", None)
    pinned = RunConfig(scale="tiny", sdpa_backend="efficient")
    assert cfg_drop_attention(pinned, torch.device("cpu"), torch.float32)[0] == "masked"
    assert cfg_drop_attention(RunConfig(scale="tiny", cfg_drop_attention="masked"), torch.device("cpu"),
                              torch.float32) == ("masked", None)


def test_unknown_cfg_drop_attention_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown cfg_drop_attention 'fast': allowed split, masked"):
        EchoTTS(PRESETS["tiny"], cfg_drop_attention="fast")
