"""BHyT (``--norm-type bhyt``): the module against a transcription of the authors' forward,
its bound, its float32 statistics in bf16, its flags' one-line refusals, and on the tiny preset
through fairseq's parser with every placement: finite output, incremental decoding equal to the
full forward within 1e-5, and a gradient for every parameter."""
import pytest
import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.modules.bhyt import BHYT_DEFAULT_KAPPA, BHYT_DEFAULT_LAM, BHyT
from fairseq_normplug.modules.norm_registry import build_norm, norm_args
from model_helpers import build, incremental_and_full, randomized
from test_placements import DESIGNS, one_backward

TINY = "transformer_normplug_tiny"  # d=64, 2 heads, 2+2 layers
D = 64


class AuthorsBHyTStar(torch.nn.Module):
    """Transcription of the authors' ``BHyT_Star`` (MLAI-Yonsei/BHyT e170c9b,
    models/hf_src/llama/modeling_llama.py:71-101), learnable lam, gain on."""

    def __init__(self, hidden_size, eps=1e-6, lam_init=2.0, inv_kappa=0.1):
        super().__init__()
        self.eps = eps
        self.inv_kappa = inv_kappa
        self.lam = torch.nn.Parameter(torch.empty(1).fill_(lam_init))
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states):
        var_x = (hidden_states * hidden_states).mean(dim=-1, keepdim=True, dtype=torch.float32)
        alpha = self.lam * torch.rsqrt(var_x + self.eps) * self.inv_kappa
        tanh_out = torch.tanh(alpha * hidden_states)
        return self.weight * tanh_out.to(dtype=hidden_states.dtype)


def test_defaults_are_the_authors():
    norm = build_norm(norm_args("bhyt"), D)
    assert isinstance(norm, BHyT)
    assert (BHYT_DEFAULT_LAM, BHYT_DEFAULT_KAPPA) == (2.0, 10.0)
    assert norm.lam.item() == 2.0 and norm.kappa == 10.0 and norm.lam.requires_grad
    assert torch.equal(norm.weight, torch.ones(D))


@pytest.mark.parametrize("lam,kappa", [(2.0, 10.0), (0.7, 3.0)])
def test_matches_the_authors_forward_and_gradients(lam, kappa):
    torch.manual_seed(0)
    ours = build_norm(norm_args("bhyt", bhyt_lam_init=lam, bhyt_kappa=kappa), D)
    theirs = AuthorsBHyTStar(D, lam_init=lam, inv_kappa=1 / kappa)
    with torch.no_grad():
        ours.weight.normal_(1, 0.3)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, D) * 7
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert torch.allclose(y_ours, y_theirs, atol=1e-6)
    y_ours.pow(2).sum().backward()
    y_theirs.pow(2).sum().backward()
    assert torch.allclose(x_ours.grad, x_theirs.grad, atol=1e-5)
    assert torch.allclose(ours.lam.grad, theirs.lam.grad.squeeze(), rtol=1e-4)
    assert torch.allclose(ours.weight.grad, theirs.weight.grad, atol=1e-5)


def test_tanh_input_is_bounded_whatever_the_input_scale():
    """The tanh input's RMS is lam / kappa (up to eps) at any scale: scaling x changes nothing."""
    norm = build_norm(norm_args("bhyt"), D).double()
    x = torch.randn(4, D, dtype=torch.float64)
    assert torch.allclose(norm(x * 1e4), norm(x), atol=1e-9)
    assert norm(x * 1e4).abs().max() <= 1.0


def test_bf16_uses_float32_statistics():
    norm = build_norm(norm_args("bhyt"), D)
    x = (torch.randn(4, D) * 300).to(torch.bfloat16)  # x^2 is past bf16's precision
    y = norm.to(torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    expected = build_norm(norm_args("bhyt"), D)(x.float())
    assert torch.allclose(y.float(), expected, atol=1e-2)


@pytest.mark.parametrize("flag,value,message", [
    ("--bhyt-lam-init", "0", "--bhyt-lam-init must be > 0, got 0"),
    ("--bhyt-kappa", "-1", "--bhyt-kappa must be > 0, got -1"),
])
def test_bad_flags_are_refused_in_one_line(tiny_bin, flag, value, message):
    with pytest.raises(NormplugError, match=message):
        build(tiny_bin, TINY, "--prenorm", "--norm-type", "bhyt", flag, value)


def test_bhyt_flags_need_bhyt(tiny_bin):
    with pytest.raises(NormplugError, match="--bhyt-kappa needs --norm-type bhyt, got --norm-type dyt"):
        build(tiny_bin, TINY, "--prenorm", "--dyt", "--bhyt-kappa", "5")


def test_flags_reach_every_norm_of_the_model(tiny_bin):
    model, _, _ = build(tiny_bin, TINY, "--prenorm", "--norm-type", "bhyt", "--bhyt-lam-init", "1.5",
                        "--bhyt-kappa", "4")
    norms = [m for m in model.modules() if isinstance(m, BHyT)]
    assert len(norms) == 2 * 3 + 2 * 2 + 2  # sublayer norms of 2 decoder + 2 encoder layers, 2 final
    assert all(n.lam.item() == 1.5 and n.kappa == 4.0 for n in norms)


@pytest.mark.parametrize("design", list(DESIGNS))
def test_every_placement_is_finite_decodes_incrementally_and_trains_every_parameter(tiny_bin, design):
    model, task, _ = build(tiny_bin, TINY, *DESIGNS[design], "--norm-type", "bhyt")
    assert any(isinstance(m, BHyT) for m in model.modules())
    steps, full = incremental_and_full(randomized(model, seed=1), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < 1e-5 * max(1.0, full.abs().max().item())
    grads = one_backward(model, task)
    missing = [name for name, grad in grads.items() if grad is None]
    assert not missing, missing
    assert all(torch.isfinite(grad).all() for grad in grads.values())
