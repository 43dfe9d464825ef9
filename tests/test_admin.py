"""Admin (``--residual-scale admin``, Liu et al. 2020): PostNorm(residual * omega + F), omega
set by a profiling pass on the first training batch (modules/residual_scale.py AdminProfile)."""
import math

import pytest
import torch

from model_helpers import build, toy_batch
from test_cli import rank_parameters, train_data_parallel

TINY = "transformer_normplug_tiny"
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]


def record_residuals(model):
    """Wrap every layer's residual connection; returns the list of (stack, x, residual, out)."""
    seen = []
    for name, stack in (("enc", model.encoder), ("dec", model.decoder)):
        for layer in stack.layers:
            connect = layer.residual_connection

            def recording(x, residual, connect=connect, name=name):
                out = connect(x, residual)
                seen.append((name, x.detach().clone(), residual.detach().clone(), out.detach().clone()))
                return out

            layer.residual_connection = recording
    return seen


def variance(t):
    return t.double().var(unbiased=False).item()


def test_profiling_sets_omega_by_the_authors_rule(tiny_bin):
    """omega_1 = 1 per stack; omega_{i+1} = sqrt(Var[residual_i * omega_i] + Var[F_i]), over
    the whole batch, in a profiling forward before the first training forward."""
    model, task, _ = build(tiny_bin, TINY, "--residual-scale", "admin", *NO_DROPOUT)
    omegas = [layer.residual_scale.gains for layer in [*model.encoder.layers, *model.decoder.layers]]
    assert [tuple(w.shape) for w in omegas] == [(2, 64)] * 2 + [(3, 64)] * 2
    assert all((w == 1).all() for w in omegas)
    src, lengths, prev = toy_batch(task, batch=4, length=9)
    model.eval()
    with torch.no_grad():
        model(src, lengths, prev)  # an evaluation forward does not profile
    assert all((w == 1).all() for w in omegas)

    model.train()
    seen = record_residuals(model)
    profiled = model(src, lengths, prev)[0]
    # the profiling forward (no gradients), then the training forward with the chosen omegas
    assert len(seen) == 2 * (2 * 2 + 2 * 3)
    seen, trained = seen[:10], seen[10:]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(seen, trained))
    assert profiled.requires_grad
    by_stack = {"enc": [w[i] for w in omegas[:2] for i in range(2)],
                "dec": [w[i] for w in omegas[2:] for i in range(3)]}
    for stack, chosen in by_stack.items():
        ratio = 1.0
        records = [r for r in seen if r[0] == stack]
        for omega, (_, x, residual, out) in zip(chosen, records):
            assert torch.equal(omega, torch.full_like(omega, ratio))  # one value per residual
            assert torch.allclose(out, residual * omega + x)
            ratio = math.sqrt(variance(residual * omega) + variance(x))
        assert chosen[-1][0].item() > 1.2  # the variances really add up
    # omega is now fixed: the same forward gives the profiled output again, without profiling
    before = [w.clone() for w in omegas]
    again = model(src, lengths, prev)[0]
    assert torch.allclose(again, profiled, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, omegas))


def test_loaded_omegas_are_not_profiled_again(tiny_bin):
    trained, task, _ = build(tiny_bin, TINY, "--residual-scale", "admin", *NO_DROPOUT)
    with torch.no_grad():
        for layer in trained.encoder.layers:
            layer.residual_scale.gains.fill_(3.0)
    fresh, _, _ = build(tiny_bin, TINY, "--residual-scale", "admin", *NO_DROPOUT)
    fresh.load_state_dict(trained.state_dict())
    fresh.train()
    fresh(*toy_batch(task))
    assert all((layer.residual_scale.gains == 3.0).all() for layer in fresh.encoder.layers)


@pytest.mark.slow
def test_two_gloo_ranks_choose_the_same_omegas_and_resume_does_not_profile(tiny_bin, tmp_path):
    """The ranks see different batches; the moments are summed over both, so their omegas
    agree after every update; a resumed run profiles nothing."""
    flags = ["--residual-scale", "admin"]
    first = train_data_parallel(tiny_bin, tmp_path / "run", flags, 2)
    logged = [line for line in first[0].splitlines() if "Admin: omega" in line]
    assert len(logged) == 2 and all("2 data-parallel ranks" in line for line in logged), logged
    params = rank_parameters(tmp_path / "run" / "params")
    omegas = {k: v for k, v in params.items() if k.endswith("residual_scale.gains")}
    assert len(omegas) == 4 and all((v[-1] - 1).abs().max() > 0.1 for v in omegas.values())
    resumed = train_data_parallel(tiny_bin, tmp_path / "run", flags, 3)
    assert "@ 2 updates" in resumed[0] and "Admin: omega" not in resumed[0]
    rank_parameters(tmp_path / "run" / "params")


def test_refused_combinations_name_the_flag(tiny_bin):
    from fairseq_normplug.errors import NormplugError

    for flags, message in ((["--prenorm"], "defined for PostNorm only"),
                           (["--norm-placement", "sandwich"], "defined for PostNorm only"),
                           (["--norm-type", "identity"], "needs a norm after each residual"),
                           (["--bf16"], "cannot be combined with --bf16")):
        with pytest.raises(NormplugError, match=message):
            build(tiny_bin, TINY, "--residual-scale", "admin", *flags)
    build(tiny_bin, TINY, "--residual-scale", "admin", "--bf16", "--amp")  # amp: fp32 weights
