"""--norm-weight-decay: which parameters count as norm parameters, the two optimizer param
groups fairseq's trainer builds (fp32, --bf16, --memory-efficient-bf16/-fp16, --fp16
--fp16-no-flatten-grads, --amp), the update each group receives (fairseq Adam's decoupled
decay, with zero gradients: exactly p - lr*wd*p), resume, the stock single group without the
flag, refused combinations, and fairseq-train with --weight-decay 0.1 --norm-weight-decay 0."""
import copy
import io
import re
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim.fp16_optimizer import FP16Optimizer
from fairseq.trainer import Trainer

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug import fairseq_patches
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_parameters import norm_parameter_names
from fairseq_normplug.optim import norm_weight_decay as nwd
from model_helpers import build, parse_args, toy_batch
from test_cli import TRAIN_COMMON, log_records

TINY = "transformer_normplug_tiny"
LR = 0.5
#: the parameters the rule must pick, by name (an independent statement of the docstring's rule)
NORM_NAME = re.compile(r"(self_attn_layer_norm|encoder_attn_layer_norm|final_layer_norm|"
                       r"self_attn_out_layer_norm|encoder_attn_out_layer_norm|final_out_layer_norm|"
                       r"resi_dual_layer_norm|attn_ln|ffn_layernorm|_proj\.norm|"
                       r"(encoder|decoder)\.layer_norm|layernorm_embedding)\.|"
                       r"residual_scale\.gains$|q_proj\.g$|embed_scale$|out_proj\.head_scale$")


def make_trainer(data_bin, *flags, arch=TINY):
    """fairseq's Trainer (which builds the optimizer as fairseq-train does) for a model built
    from ``flags``, Adam with a fixed lr ``LR``."""
    model, task, args = build(data_bin, arch, "--optimizer", "adam", "--lr", str(LR),
                              "--lr-scheduler", "fixed", *flags)
    cfg = convert_namespace_to_omegaconf(args)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    assert trainer.optimizer.get_lr() == LR
    return trainer, model, task


def group_names(trainer, model):
    """The model parameter name of every tensor in each optimizer param group (fp32 master
    copies of FP16Optimizer mapped back to the model parameters they copy)."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt = trainer.optimizer
    if isinstance(opt, FP16Optimizer):
        assert not opt.has_flat_params
        names.update({id(p32): names[id(p)] for p, p32 in zip(opt.fp16_params, opt.fp32_params)})
    return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]


# ---- the rule ----------------------------------------------------------------------------

RULE_CASES = {
    "postnorm-layernorm": [],
    "prenorm-dyt-layerscale-qknorm-learnable-embed": ["--prenorm", "--dyt", "--residual-scale", "layerscale",
                                                      "--qknorm", "--qknorm-g0", "3", "--embed-scale",
                                                      "learnable"],
    "scalenorm-fixnorm-rezero-output-bias": ["--prenorm", "--scalenorm", "--fixnorm", "--residual-scale",
                                             "rezero", "--output-bias"],
    "derf": ["--norm-type", "derf"],
    "identity": ["--norm-type", "identity", "--weight-init", "tfixup"],
    "sandwich-rmsnorm": ["--norm-placement", "sandwich", "--rmsnorm"],
    "resi-dual": ["--norm-placement", "resi-dual"],
    "hybrid": ["--norm-placement", "hybrid", "--dyt"],
    "normformer": ["--prenorm", "--normformer"],
    "admin": ["--residual-scale", "admin"],
}


@pytest.mark.parametrize("name", list(RULE_CASES))
def test_norm_parameters_by_rule_and_tagged(tiny_bin, name):
    model, _, _ = build(tiny_bin, TINY, "--norm-weight-decay", "0.25", *RULE_CASES[name])
    chosen = norm_parameter_names(model)
    all_names = [n for n, _ in model.named_parameters()]
    assert chosen == [n for n in all_names if NORM_NAME.search(n)]
    assert not any(re.search(r"(proj|fc\d)\.(weight|bias)$|embed_tokens\.weight$", n) for n in chosen)
    if name == "identity":
        assert chosen == []
    else:
        assert chosen and any(n.endswith("fc1.bias") for n in all_names)  # Linear biases stay out
    params = dict(model.named_parameters())
    for n in all_names:
        assert nwd.norm_weight_decay_of(params[n]) == (0.25 if n in chosen else None), n
    if name.startswith("prenorm-dyt"):
        for expected in ("encoder.embed_scale", "decoder.layers.1.encoder_attn.q_proj.g",
                         "encoder.layers.0.residual_scale.gains", "decoder.layer_norm.alpha",
                         "decoder.layer_norm.bias"):
            assert expected in chosen
        assert params["encoder.layers.0.residual_scale.gains"].shape == (2, 64)  # per channel
    if name.startswith("scalenorm"):
        assert "decoder.output_projection.bias" in all_names and "decoder.output_projection.bias" not in chosen
        assert sum(n.endswith("residual_scale.gains") for n in chosen) == 4
        assert all(params[n].dim() <= 1 for n in chosen)


# ---- param groups and the update, through fairseq's Trainer --------------------------------

PRECISIONS = {  # name: (flags, optimizer wrapper, --weight-decay, --norm-weight-decay)
    "fp32-norm-decayed": ([], "FairseqAdam", 0.1, 0.3),
    "fp32-norm-excluded": ([], "FairseqAdam", 0.1, 0.0),
    "bf16": (["--bf16"], "FP16Optimizer", 0.1, 0.0),
    "memory-efficient-bf16": (["--memory-efficient-bf16"], "MemoryEfficientFP16Optimizer", 0.1, 0.0),
    "fp16-no-flatten": (["--fp16", "--fp16-no-flatten-grads", "--fp16-init-scale", "1"], "FP16Optimizer",
                        0.1, 0.0),
    "memory-efficient-fp16": (["--memory-efficient-fp16", "--fp16-init-scale", "1"],
                              "MemoryEfficientFP16Optimizer", 0.1, 0.0),
    "amp": (["--amp"], "AMPOptimizer", 0.1, 0.0),
}


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_param_groups_and_one_step_update(tiny_bin, name):
    """Two groups (the norm group with weight_decay = --norm-weight-decay); with zero
    gradients one Adam step moves each tensor by exactly -lr*wd*p of its group's wd."""
    flags, wrapper, wd, norm_wd = PRECISIONS[name]
    trainer, model, _ = make_trainer(tiny_bin, "--prenorm", "--dyt", "--residual-scale", "layerscale",
                                     "--weight-decay", str(wd), "--norm-weight-decay", str(norm_wd), *flags)
    opt = trainer.optimizer
    assert type(opt).__name__ == wrapper
    assert [g["weight_decay"] for g in opt.param_groups] == [wd, norm_wd]
    names = group_names(trainer, model)
    chosen = norm_parameter_names(model)
    # DyT alpha/gamma/beta: 2 x 2 encoder, 2 x 3 decoder and 2 final norms; 4 LayerScale diags
    assert names[1] == chosen and len(chosen) == 3 * (2 * 2 + 2 * 3 + 2) + 4
    assert names[0] == [n for n, p in model.named_parameters() if n not in chosen]
    if "16" in name:
        assert model.encoder.layers[0].fc1.weight.dtype != torch.float32

    opt.zero_grad()  # as the trainer does before each update (also fp16's loss-scale factor)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a zero gradient: Adam's own step is exactly 0
    before = [[p.detach().clone() for p in g["params"]] for g in opt.param_groups]
    opt.step()
    for index, (group_wd, group) in enumerate(zip((wd, norm_wd), opt.param_groups)):
        for n, p, b in zip(names[index], group["params"], before[index]):
            ref = b.float()
            ref = ref.add(ref, alpha=-LR * group_wd).to(b.dtype)  # Adam's decoupled decay, step 0
            assert torch.equal(p.detach(), ref), n
            if group_wd == 0:
                assert torch.equal(p.detach(), b), n
    moved = [not torch.equal(p.detach(), b) for p, b in zip(opt.param_groups[0]["params"], before[0])]
    assert sum(moved) > 20  # the weight matrices (nonzero) were decayed by --weight-decay
    gamma = names[1].index("encoder.layers.0.final_layer_norm.weight")  # DyT gamma, init 1
    assert before[1][gamma].float().eq(1).all()
    after = opt.param_groups[1]["params"][gamma].detach().float()
    assert torch.allclose(after, torch.full_like(after, 1 - LR * norm_wd), rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch,flags", [(TINY, ["--prenorm", "--dyt"]), ("transformer", [])],
                         ids=["normplug", "stock-transformer"])
def test_flag_absent_means_one_stock_group(tiny_bin, arch, flags):
    assert fairseq_patches.installed()["fairseq.optim._build_optimizer"]  # the wrapper is in place
    trainer, model, _ = make_trainer(tiny_bin, *flags, "--weight-decay", "0.1", arch=arch)
    groups = trainer.optimizer.param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert not any(hasattr(p, "optim_overrides") for p in model.parameters())


def _train_steps(trainer, model, task, steps):
    model.eval()  # no dropout: the same batch gives the same gradient in both runs
    for step in steps:
        trainer.optimizer.zero_grad()
        src, lengths, prev = toy_batch(task, seed=step)
        logits, _ = model(src, lengths, prev)
        trainer.optimizer.backward(F.cross_entropy(logits.float().view(-1, logits.size(-1)), src.view(-1)))
        trainer.optimizer.step()


@pytest.mark.parametrize("flags", [[], ["--memory-efficient-bf16"]], ids=["fp32", "memory-efficient-bf16"])
def test_resume_from_saved_state_continues_identically(tiny_bin, flags):
    """Steps 0-3 in one go equal steps 0-1, save (model and optimizer state through
    torch.save, as in a checkpoint), a fresh trainer that loads them, steps 2-3."""
    wd_flags = ["--prenorm", "--scalenorm", "--weight-decay", "0.1", "--norm-weight-decay", "0", *flags]
    trainer, model, task = make_trainer(tiny_bin, *wd_flags)
    _train_steps(trainer, model, task, [0, 1])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict()}, buffer)
    _train_steps(trainer, model, task, [2, 3])

    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.1, 0.0]
    resumed, model2, task2 = make_trainer(tiny_bin, *wd_flags)
    model2.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.1, 0.0]
    _train_steps(resumed, model2, task2, [2, 3])
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
    if not flags:  # a two-group state does not load into a stock (one-group) optimizer
        stock, _, _ = make_trainer(tiny_bin, "--prenorm", "--scalenorm", "--weight-decay", "0.1")
        with pytest.raises(ValueError, match="different number of parameter groups"):
            stock.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))


# ---- refused combinations ----------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--norm-weight-decay", "-0.5"], "--norm-weight-decay must be >= 0, got -0.5"),
    (["--norm-weight-decay", "nan"], "got nan"),
    (["--norm-weight-decay", "0", "--fp16"], "needs --fp16-no-flatten-grads"),
    (["--norm-weight-decay", "0", "--optimizer", "composite"], "--optimizer composite is not one"),
    (["--norm-weight-decay", "0", "--ddp-backend", "fully_sharded"], "--ddp-backend fully_sharded"),
    (["--norm-weight-decay", "0", "--optimizer-overrides", "{'weight_decay': 0.2}"], "every param group"),
])
def test_refused_at_argument_time(tiny_bin, flags, message):
    with pytest.raises(NormplugError, match=re.escape(message)) as info:
        parse_args(tiny_bin, TINY, *flags)
    assert "\n" not in str(info.value)


def test_accepted_combinations():
    base = dict(norm_weight_decay=0, fp16=True, bf16=False, amp=False, memory_efficient_fp16=False,
                memory_efficient_bf16=False, fp16_no_flatten_grads=False, optimizer="sgd")
    for extra in ({"fp16_no_flatten_grads": True}, {"memory_efficient_fp16": True}, {"amp": True},
                  {"fp16": False, "bf16": True}, {"fp16": False, "optimizer_overrides": "{'lr': 1}"}):
        assert nwd.check_norm_weight_decay_args(Namespace(**{**base, **extra})) == 0.0
    assert nwd.check_norm_weight_decay_args(Namespace(norm_weight_decay=None, fp16=True)) is None


# ---- fairseq-train -----------------------------------------------------------------------

CLI_FLAGS = ["--prenorm", "--dyt", "--residual-scale", "rezero", "--weight-decay", "0.1",
             "--norm-weight-decay", "0"]


def _train(tiny_bin, save_dir, max_update, *extra):
    return run_fairseq([cli("fairseq-train"), tiny_bin, "--arch", TINY, *TRAIN_COMMON, "--log-interval", "2",
                        "--save-dir", str(save_dir), "--max-update", str(max_update), *CLI_FLAGS, *extra],
                       check=False)


def _optimizer_groups(save_dir):
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=False)["last_optimizer_state"]
    return [(g["weight_decay"], len(g["params"])) for g in state["param_groups"]]


def test_fairseq_train_and_resume(tiny_bin, tmp_path):
    model, _, _ = build(tiny_bin, TINY, "--optimizer", "adam", *CLI_FLAGS)
    n_norm = len(norm_parameter_names(model))
    n_all = len([p for p in model.parameters() if p.requires_grad])
    first = _train(tiny_bin, tmp_path, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"--norm-weight-decay 0.0: {n_norm} norm/gain parameters" in first.stdout + first.stderr
    assert log_records(first, "train")[-1]["train_num_updates"] == "4"
    assert _optimizer_groups(tmp_path) == [(0.1, n_all - n_norm), (0.0, n_norm)]

    resumed = _train(tiny_bin, tmp_path, 8)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Loaded checkpoint" in out and "@ 4 updates" in out
    assert log_records(resumed, "train")[-1]["train_num_updates"] == "8"
    assert _optimizer_groups(tmp_path) == [(0.1, n_all - n_norm), (0.0, n_norm)]


def test_fairseq_train_bad_value_is_one_line_before_data(tiny_bin, tmp_path):
    proc = _train(tiny_bin, tmp_path, 4, "--norm-weight-decay", "-1")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["fairseq-normplug: error: --norm-weight-decay must be >= 0, got -1.0"]
    assert "Traceback" not in proc.stderr and "loaded" not in proc.stdout + proc.stderr
    assert not (tmp_path / "checkpoint_last.pt").exists()
