"""Half precision on CPU: every {PostNorm, PreNorm} x norm type x {FixNorm or not} model in
float16 and bfloat16 (forward, backward), autocast, float32 scalars, and fairseq-train with
--fp16 / --memory-efficient-bf16 followed by fairseq-generate --fp16."""
import copy
import itertools

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug.modules import fused
from fairseq_normplug.modules.derf import Derf
from fairseq_normplug.modules.dyisru import DyISRU
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.norm_registry import NORM_TYPES
from fairseq_normplug.modules.scale_norm import ScaleNorm, scale_norm_reference
from model_helpers import build, norm_type_flags, parse_args, toy_batch
from test_cli import HALF_BATCHES, NO_LOADER_WORKERS, TRAIN_COMMON, USER_DIR, log_records

TINY = "transformer_normplug_tiny"
COMBINATIONS = list(itertools.product(("--postnorm", "--prenorm"), NORM_TYPES, (False, True)))
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: largest |log p(fp16/bf16) - log p(fp32)| over non-pad words, tiny model at init
AGREEMENT = {torch.float16: 0.05, torch.bfloat16: 0.3}


def combination_model(tiny_bin, placement, norm_type, fixnorm):
    flags = [placement, *norm_type_flags(norm_type), "--share-decoder-input-output-embed"]
    return build(tiny_bin, TINY, *flags, *(["--fixnorm"] if fixnorm else []))


def padded_batch(task):
    """A toy batch with left-padded source and right-padded target, and its targets."""
    pad = task.target_dictionary.pad()
    src, lengths, prev = toy_batch(task, batch=4, length=9)
    src[0, :3], prev[1, -2:] = pad, pad
    target = torch.roll(prev, -1, dims=1)
    target[1, -3:] = pad
    return src, lengths, prev, target


def smoothed_loss(model, batch):
    """fairseq's label-smoothed loss (which sums log p over the whole vocabulary, pad
    column included) and the log-probabilities."""
    src, lengths, prev, target = batch
    logits, extra = model(src, lengths, prev)
    lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
    loss, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1, 1), 0.1,
                                      ignore_index=model.decoder.padding_idx)
    return logits, lprobs, loss


@pytest.mark.parametrize("dtype_name", list(HALF))
@pytest.mark.parametrize("placement,norm_type,fixnorm", COMBINATIONS,
                         ids=[f"{p[2:]}-{n}{'-fixnorm' if f else ''}" for p, n, f in COMBINATIONS])
def test_half_precision_matrix(tiny_bin, placement, norm_type, fixnorm, dtype_name):
    """Finite outputs, loss and gradients in fp16/bf16, close to fp32; FixNorm's pad exact."""
    dtype = HALF[dtype_name]
    model, task, _ = combination_model(tiny_bin, placement, norm_type, fixnorm)
    batch = padded_batch(task)
    pad = task.target_dictionary.pad()
    with torch.no_grad():
        _, reference, _ = smoothed_loss(model.eval(), batch)
    half = copy.deepcopy(model).to(dtype)  # eval mode: no dropout, same batch as fp32
    logits, lprobs, loss = smoothed_loss(half, batch)
    loss.backward()

    assert logits.dtype == dtype and torch.isfinite(logits).all() and torch.isfinite(lprobs).all()
    assert torch.isfinite(loss)
    for name, p in half.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if p.dim() == 0 and "_norm" in name:  # g, alpha, shift, beta of the norms
            assert p.dtype == p.grad.dtype == torch.float32, name
    words = [i for i in range(lprobs.size(-1)) if i != pad]
    error = (lprobs[..., words].float() - reference[..., words]).abs().max()
    assert error < AGREEMENT[dtype], error
    if fixnorm:
        others = logits[..., words].float().amin(-1)
        assert (logits[..., pad].float() < others - 25).all()
        assert half.decoder.embed_tokens.weight.grad[pad].abs().max() == 0
        assert half.decoder.embed_tokens.normalized_weight()[pad].abs().max() == 0


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_autocast_fixnorm(tiny_bin, norm_type):
    """What --amp does on a GPU, on the CPU: float32 weights, float16 matmuls."""
    model, task, _ = combination_model(tiny_bin, "--prenorm", norm_type, True)
    with torch.autocast("cpu", dtype=torch.float16):
        logits, lprobs, loss = smoothed_loss(model, padded_batch(task))
    (loss * 1024).backward()  # a loss scale
    assert logits.dtype == torch.float16 and torch.isfinite(lprobs).all()
    assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32
               for p in model.parameters())


@pytest.mark.parametrize("cast", [torch.nn.Module.half, lambda m: m.to(torch.bfloat16),
                                  lambda m: m.to("cpu", torch.float16)])
def test_scalars_stay_float32_in_half_models(cast):
    for module in (ScaleNorm(8), DynamicTanh(8), Derf(8), DyISRU(8)):
        cast(module)
        scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
        assert scalars and all(getattr(module, n).dtype == torch.float32 for n in scalars)
        assert all(p.dtype != torch.float32 for n, p in module.named_parameters() if n not in scalars)
        module.double()  # float64 (gradcheck) is left alone
        assert all(getattr(module, n).dtype == torch.float64 for n in scalars)


def _scalar_gradient(module, x, grad):
    with fused.disable("compiled"):
        x = x.clone().requires_grad_(True)
        module(x).backward(grad)
    return next(p.grad for n, p in module.named_parameters() if n in ("g", "alpha"))


def test_scalar_gradients_are_summed_in_float32():
    """A sum over 2048 rows that overflows float16 (65504) stays finite and exact."""
    torch.manual_seed(0)
    x = torch.randn(2048, 64).half()
    scale = ScaleNorm(64).half()
    grad = 8 * x  # <x, dy> / ||x|| = 8 ||x|| ~ 64 per row
    g_grad = _scalar_gradient(scale, x, grad)
    x32, g32 = x.float().requires_grad_(True), torch.tensor(8.0, requires_grad=True)
    scale_norm_reference(x32, g32, 1e-5).backward(grad.float())
    assert g_grad.dtype == torch.float32 and abs(g32.grad.item()) > 65504
    torch.testing.assert_close(g_grad, g32.grad, rtol=1e-3, atol=0)

    dyt = DynamicTanh(64).half()
    alpha_grad = _scalar_gradient(dyt, x, 16 * x.sign())
    assert alpha_grad.dtype == torch.float32 and torch.isfinite(alpha_grad)
    assert abs(alpha_grad.item()) > 65504


def test_bf16_means_bfloat16_without_torch_xla(tiny_bin):
    """fairseq turns --bf16 into --tpu; without torch_xla the plugin takes that back."""
    args = parse_args(tiny_bin, TINY, "--bf16")
    assert args.bf16 and not args.tpu


@pytest.mark.parametrize("optimizer,flatten", [(FP16Optimizer, True), (FP16Optimizer, False),
                                              (MemoryEfficientFP16Optimizer, False)],
                         ids=["FP16Optimizer", "FP16Optimizer-no-flatten", "MemoryEfficient"])
@pytest.mark.parametrize("dtype_name", list(HALF))
def test_fairseq_half_optimizers_update_float32_scalars(tiny_bin, monkeypatch, optimizer, flatten,
                                                        dtype_name):
    """fairseq's wrappers (fp32 master copy / fp32 update math) with a half model whose g is
    float32: a few steps, finite, and g moves in float32."""
    flags = ["--fp16" if dtype_name == "float16" else "--bf16"]
    if flatten:  # the GPU default: one flat fp32 copy keyed by the CUDA device (None on a CPU)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    else:
        flags.append("--fp16-no-flatten-grads")
    model, task, args = build(tiny_bin, TINY, "--prenorm", "--scalenorm", "--fixnorm",
                              "--optimizer", "adam", "--lr", "1e-3", *flags)
    model = model.to(HALF[dtype_name])
    opt = optimizer.build_optimizer(convert_namespace_to_omegaconf(args),
                                    [p for p in model.parameters() if p.requires_grad])
    g = model.decoder.layer_norm.g
    values = [g.item()]
    for step in range(3):
        src, lengths, prev = toy_batch(task, seed=step)
        logits, _ = model(src, lengths, prev)
        opt.backward(torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), src.view(-1)))
        assert torch.isfinite(opt.clip_grad_norm(1.0))
        opt.step()
        opt.zero_grad()
        values.append(g.item())
    assert g.dtype == torch.float32 and len(set(values)) == 4  # 8 - 1e-3 steps: below fp16/bf16 resolution
    assert all(torch.isfinite(p).all() for p in model.parameters())


# fairseq's CPU limits, not the plugin's: the flattened FP16Optimizer asks for
# torch.cuda.current_device(), and a loss-scale overflow calls .cuda(); so on the CPU
# --fp16 runs with --fp16-no-flatten-grads and a loss scale that does not overflow.
HALF_TRAINING = {
    "fp16": ["--fp16", "--fp16-no-flatten-grads", "--fp16-init-scale", "1"],
    "memory-efficient-bf16": ["--memory-efficient-bf16"],
}


@pytest.fixture(scope="module")
def half_trained(tiny_bin, tmp_path_factory):
    runs = {}
    for name, flags in HALF_TRAINING.items():
        save_dir = tmp_path_factory.mktemp(name)
        proc = run_fairseq([cli("fairseq-train"), tiny_bin, "--arch", TINY, *TRAIN_COMMON,
                            "--log-interval", "2", "--save-dir", str(save_dir), "--max-update", "6",
                            *HALF_BATCHES, "--prenorm", "--scalenorm", "--fixnorm", *flags],
                           env={"NORMPLUG_COMPILE": "0"})
        runs[name] = (save_dir, proc)
    return runs


@pytest.mark.parametrize("name", list(HALF_TRAINING))
def test_half_precision_training(half_trained, name):
    save_dir, proc = half_trained[name]
    records = log_records(proc, "train_inner")
    assert [r["num_updates"] for r in records] == ["2", "4", "6"]
    losses = [float(r["loss"]) for r in records]
    assert all(l == l and l < 20 for l in losses) and losses[-1] < losses[0], losses
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=False)["model"]
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_generate_fp16_from_a_half_trained_fixnorm_checkpoint(half_trained, tiny_bin):
    save_dir, _ = half_trained["fp16"]
    proc = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR,
                        "--path", str(save_dir / "checkpoint_last.pt"), "--fp16", "--cpu",
                        "--beam", "2", "--max-sentences", "50", "--required-batch-size-multiple", "1",
                        "--gen-subset", "valid", "--max-len-b", "10", *NO_LOADER_WORKERS],
                       env={"NORMPLUG_COMPILE": "0"})
    scores = [float(line.split("\t")[1]) for line in proc.stdout.splitlines()
              if line.startswith("H-")]
    assert len(scores) == 100 and all(-1e4 < s <= 0 for s in scores)
