"""Build plugin and stock models in-process from command-line style flags."""
import math
from argparse import Namespace

import torch
from fairseq import options, tasks, utils

from conftest import REPO


def parse_args(data_bin, arch, *flags, task="translation"):
    parser = options.get_training_parser()
    argv = [data_bin, "--user-dir", f"{REPO}/fairseq_normplug", "--task", task,
            "--arch", arch, "--cpu", *flags]
    return options.parse_args_and_arch(parser, argv)


#: the flags a norm type cannot be built without, for the tests that loop over every norm type
REQUIRED_NORM_FLAGS = {"tapernorm": ("--taper-updates", "1", "2")}


def norm_type_flags(norm_type):
    """``--norm-type norm_type`` and the flags it requires (:data:`REQUIRED_NORM_FLAGS`)."""
    return ["--norm-type", norm_type, *REQUIRED_NORM_FLAGS.get(norm_type, ())]


def build(data_bin, arch, *flags, seed=1, task="translation"):
    """(model, task, args) built exactly as fairseq-train builds them, with a fixed seed."""
    args = parse_args(data_bin, arch, *flags, task=task)
    utils.import_user_module(args)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    return model, task, args


def toy_batch(task, batch=3, length=7, seed=0):
    """A deterministic batch of (src_tokens, src_lengths, prev_output_tokens)."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    low = d.nspecial
    src = torch.randint(low, len(d), (batch, length), generator=g)
    src[:, -1] = d.eos()
    prev = torch.randint(low, len(task.target_dictionary), (batch, length), generator=g)
    prev[:, 0] = task.target_dictionary.eos()
    return src, torch.full((batch,), length), prev


def randomized(module, seed=0):
    """Give every parameter a random non-default value (0.5-1.5 times its own, plus noise)
    so formulas and gradients are really exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(torch.rand(p.shape, generator=g) + 0.5)
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module


def incremental_and_full(model, task, batch=2, length=6):
    """The decoder's output on a toy batch step by step with ``incremental_state`` (concatenated)
    and in one full forward, in eval mode without gradients: (steps, full)."""
    model.eval()
    src, lengths, prev = toy_batch(task, batch=batch, length=length)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        full = model.decoder(prev, encoder_out=encoder_out)[0]
        state = {}
        steps = [model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                 for t in range(prev.size(1))]
    return torch.cat(steps, dim=1), full


def assert_same_model(ours, stock, task, same_stack_classes=True):
    """Same parameter names (in order) and values, same module types (the encoder's and decoder's
    own classes too unless ``same_stack_classes`` is False), same output."""
    ours_sd, stock_sd = ours.state_dict(), stock.state_dict()
    assert list(ours_sd) == list(stock_sd)
    for name in stock_sd:
        assert torch.equal(ours_sd[name], stock_sd[name]), name
    stacks = () if same_stack_classes else (ours.encoder, ours.decoder, stock.encoder, stock.decoder)
    assert ([type(m) for m in ours.modules() if m not in stacks][1:]
            == [type(m) for m in stock.modules() if m not in stacks][1:])
    ours.eval(), stock.eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        assert torch.equal(ours(src, lengths, prev)[0], stock(src, lengths, prev)[0])


def assert_incremental_equals_full(model, task, dtype=torch.float32, tolerance=None):
    """Incremental decoding equals the full forward (randomised parameters, in ``dtype``): within
    ``tolerance`` of the output's scale, by default 1e-5 in float32 and 1e-9 in float64 (some
    compositions, identity norms above all, amplify float32 rounding past 1e-5; float64 shows it
    is rounding)."""
    if tolerance is None:
        tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    steps, full = incremental_and_full(randomized(model, seed=1).to(dtype), task)
    assert torch.isfinite(full).all()
    assert (steps - full).abs().max().item() < tolerance * max(1.0, full.abs().max().item())


def assert_incremental_matches_full(model, task):
    """:func:`assert_incremental_equals_full` within 1e-4 of the output's scale (DyISRU with
    randomised parameters amplifies float32 noise to ~1e-5 of the scale)."""
    assert_incremental_equals_full(model, task, tolerance=1e-4)


def assert_bf16_close_to_float32(model, task):
    """The model cast to bfloat16 (randomised parameters, eval) gives a finite bfloat16 output
    within 5% of the float32 output's scale; returns the bfloat16 model."""
    randomized(model).eval()
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        full = model(src, lengths, prev)[0]
        half = model.to(torch.bfloat16)(src, lengths, prev)[0]
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    assert (half.float() - full).abs().max().item() < 0.05 * max(1.0, full.abs().max().item())
    return model


def one_backward(model, task, seed=0):
    """Gradients of one training forward/backward on the toy batch (dropout on, seeded):
    {parameter name: its gradient, None where none reached it}."""
    model.train()
    torch.manual_seed(seed)
    src, lengths, prev = toy_batch(task)
    model(src, lengths, prev)[0].float().pow(2).mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def assert_every_parameter_trains(model, task):
    """One backward gives every parameter a finite, non-zero gradient."""
    grads = one_backward(model, task)
    missing = [name for name, grad in grads.items() if grad is None or not grad.abs().sum() > 0]
    assert not missing, missing
    assert all(torch.isfinite(grad).all() for grad in grads.values())


def toy_sample(task, seed=0):
    """A training sample (net_input, target) built on :func:`toy_batch` (batch 4, length 7)."""
    src, lengths, prev = toy_batch(task, batch=4, length=7, seed=seed)
    target = torch.cat([prev[:, 1:], torch.full((4, 1), task.target_dictionary.eos())], dim=1)
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
            "target": target, "ntokens": target.numel(), "nsentences": 4}


def assert_training_steps_reach_every_parameter(model, task, args, after_first_backward=None, steps=4):
    """Forward/backward + Adam steps on one repeated toy sample (label smoothing 0.1): every
    parameter gets a gradient on the first step (``after_first_backward(model)`` may check
    more), the losses are finite and go down; returns them."""
    criterion = task.build_criterion(Namespace(**{**vars(args), "label_smoothing": 0.1}))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    sample = toy_sample(task, seed=3)
    losses = []
    for step in range(steps):
        loss = criterion(model, sample)[0]
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            assert not missing, missing
            if after_first_backward is not None:
                after_first_backward(model)
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    return losses


def train_briefly(model, task, updates=40, lr=3e-3, epochs=1, max_tokens=1200):
    """Train ``model`` in float32 on the tiny corpus (Adam, cross entropy) for up to ``updates``
    batches of ``max_tokens`` tokens within ``epochs`` passes over it; return the first and last losses."""
    task.load_dataset("train")
    iterator = task.get_batch_iterator(task.dataset("train"), max_tokens=max_tokens, seed=1)
    batches = (sample for _ in range(epochs) for sample in iterator.next_epoch_itr(shuffle=True))
    losses = adam_updates(model, (sample for _, sample in zip(range(updates), batches)), lr,
                          task.target_dictionary.pad())
    return losses[0], losses[-1]


def adam_updates(model, samples, lr: float, pad: int):
    """One Adam update (learning rate ``lr``, token cross entropy ignoring ``pad``, dropout on)
    of ``model`` per sample of ``samples`` (fairseq batches); the losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for sample in samples:
        logits, _ = model(**sample["net_input"])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), sample["target"].view(-1),
                                                 ignore_index=pad)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def save_checkpoint(model, args, path):
    """``model`` with its training ``args`` as a fairseq checkpoint at ``path`` (what
    fairseq-generate, the hub and the plugin's tools load)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    torch.save({"cfg": cfg, "model": model.state_dict(), "args": None, "extra_state": {},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {}, "num_updates": 0}]}, str(path))
    return str(path)
