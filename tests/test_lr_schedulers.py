"""Unit tests of the "Transformers without Tears" LR schedules (inv_sqrt_decay, val_decay)
and of how every validation reaches them, without running fairseq-train."""
import io
from argparse import Namespace

import pytest
import torch
from omegaconf import OmegaConf

import fairseq_normplug  # noqa: F401  (registers the schedulers)
from fairseq.optim import FairseqOptimizer
from fairseq.optim.lr_scheduler import LR_SCHEDULER_DATACLASS_REGISTRY, LR_SCHEDULER_REGISTRY
from fairseq_normplug import fairseq_patches
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.optim.lr_scheduler.common import inv_sqrt_decay_lr, inv_sqrt_decay_peak
from fairseq_normplug.optim.lr_scheduler.inv_sqrt_decay import InvSqrtDecay
from fairseq_normplug.optim.lr_scheduler.val_decay import ValDecay


class TinyOptimizer(FairseqOptimizer):
    def __init__(self):
        super().__init__(None)
        self._optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def make(name, model=None, lr=(3e-4,), maximize=False, metric="loss", disable_validation=False,
         **flags):
    """A scheduler built the way fairseq's trainer builds it: its config node lives inside a
    full config (optimization, checkpoint, dataset, model as an argparse Namespace)."""
    root = OmegaConf.create({
        "optimization": {"lr": list(lr)},
        "checkpoint": {"best_checkpoint_metric": metric,
                       "maximize_best_checkpoint_metric": maximize},
        "dataset": {"disable_validation": disable_validation},
    }, flags={"allow_objects": True})
    root.model = Namespace(encoder_embed_dim=512) if model is None else model
    root.lr_scheduler = OmegaConf.structured(LR_SCHEDULER_DATACLASS_REGISTRY[name](**flags))
    optimizer = TinyOptimizer()
    scheduler = LR_SCHEDULER_REGISTRY[name](root.lr_scheduler, optimizer)
    scheduler.step_update(0)  # as Trainer._build_optimizer does
    return scheduler


def feed(scheduler, pairs):
    """Validations ``(update, metric)`` as fairseq-train reports them: the updates are made
    (step_update), then the validation result arrives. Returns the decays made."""
    decays = []
    for update, metric in pairs:
        scheduler.step_update(update)
        decay = scheduler.observe_validation(metric)
        if decay is not None:
            decays.append(decay[0])
    return decays


# ---------------------------------------------------------------------------------------
# InvSqrtDecay: equation 7
# ---------------------------------------------------------------------------------------
def test_equation_7_values():
    d, w = 512, 8000
    assert inv_sqrt_decay_lr(1, 1.0, d, w) == pytest.approx(512 ** -0.5 * 8000 ** -1.5, rel=1e-12)
    assert inv_sqrt_decay_lr(1, 1.0, d, w) == pytest.approx(6.1763e-08, rel=1e-4)
    peak = inv_sqrt_decay_peak(1.0, d, w)
    assert peak == pytest.approx((512 * 8000) ** -0.5, rel=1e-12)
    assert peak == pytest.approx(4.9411e-4, rel=1e-4)
    assert inv_sqrt_decay_lr(4000, 1.0, d, w) == pytest.approx(peak / 2, rel=1e-12)
    assert inv_sqrt_decay_lr(32000, 1.0, d, w) == pytest.approx(peak / 2, rel=1e-12)
    assert inv_sqrt_decay_lr(9000, 1.0, d, w) == pytest.approx((512 * 9000) ** -0.5, rel=1e-12)
    # 2xLR (lambda = 2): peak "about 1e-3"
    peak2 = inv_sqrt_decay_peak(2.0, d, w)
    assert peak2 == pytest.approx(9.8821e-4, rel=1e-4)
    assert round(peak2, 5) == 9.9e-4


def test_inv_sqrt_decay_scheduler_lr_of_next_update():
    s = make("inv_sqrt_decay", lr_lambda=2.0)  # d = 512 from the model, warmup 8000
    opt = s.optimizer
    # step_update(N) sets the lr of update N+1: the first update uses lr(1) > 0
    assert s.step_update(0) == pytest.approx(2 * 512 ** -0.5 * 8000 ** -1.5, rel=1e-12)
    assert opt.get_lr() == s.step_update(0)
    assert s.step_update(3999) == pytest.approx(2 * 512 ** -0.5 * 4000 * 8000 ** -1.5, rel=1e-12)
    assert s.step_update(7999) == pytest.approx(9.8821e-4, rel=1e-4)  # update 8000: the peak
    half_peak = inv_sqrt_decay_peak(2.0, 512, 8000) / 2
    assert s.step_update(31999) == pytest.approx(half_peak, rel=1e-12)  # update 32000
    assert opt.get_lr() == pytest.approx(half_peak, rel=1e-12)
    # validations never change it
    s.observe_validation(1.0)
    s.step(1, 99.0)
    assert s.step_update(31999) == pytest.approx(half_peak, rel=1e-12)


def test_inv_sqrt_decay_zero_warmup_does_not_crash():
    s = make("inv_sqrt_decay", warmup_updates=0, lr_d_model=64)
    assert s.step_update(0) == pytest.approx(64 ** -0.5, rel=1e-12)  # lr(1) = lambda d^-0.5
    assert s.step_update(99) == pytest.approx((64 * 100) ** -0.5, rel=1e-12)


@pytest.mark.parametrize("model, expected", [
    (Namespace(encoder_embed_dim=256, decoder_embed_dim=128), 256),
    (Namespace(decoder_embed_dim=128), 128),
    (OmegaConf.create({"encoder": {"embed_dim": 320}}), 320),  # hydra-style nested config
])
def test_d_comes_from_the_model(model, expected):
    s = make("inv_sqrt_decay", model=model, warmup_updates=100)
    assert s.d == expected
    assert s.step_update(99) == pytest.approx((expected * 100) ** -0.5, rel=1e-12)


def test_lr_d_model_overrides_the_model():
    s = make("inv_sqrt_decay", model=Namespace(encoder_embed_dim=256), lr_d_model=1024)
    assert s.d == 1024


def test_missing_d_is_a_one_line_error():
    with pytest.raises(NormplugError, match="--lr-d-model"):
        make("inv_sqrt_decay", model=Namespace(arch="x"))


def test_d_from_real_fairseq_arguments():
    """The arch defaults are applied before the scheduler reads d (--arch transformer: 512)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def cfg_for(*extra):
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, [
            "/nonexistent-data", "--task", "translation", "--optimizer", "adam",
            "--lr-scheduler", "inv_sqrt_decay", "--lr-lambda", "2", *extra])
        return convert_namespace_to_omegaconf(args)

    cfg = cfg_for("--arch", "transformer")
    assert cfg.lr_scheduler.lr_lambda == 2.0 and cfg.lr_scheduler.warmup_updates == 8000
    s = InvSqrtDecay(cfg.lr_scheduler, TinyOptimizer())
    assert s.d == 512
    assert s.step_update(7999) == pytest.approx(9.8821e-4, rel=1e-4)
    s = InvSqrtDecay(cfg_for("--arch", "transformer_tiny", "--encoder-embed-dim", "32")
                     .lr_scheduler, TinyOptimizer())
    assert s.d == 32


# ---------------------------------------------------------------------------------------
# ValDecay / NoWarmup: lr values
# ---------------------------------------------------------------------------------------
def test_val_decay_warmup_follows_equation_7_then_flat():
    v = make("val_decay")  # lambda 1, warmup 8000, d 512
    i = make("inv_sqrt_decay")
    for n in (0, 1, 999, 4000, 7998, 7999):
        assert v.step_update(n) == i.step_update(n)
    peak = inv_sqrt_decay_peak(1.0, 512, 8000)
    assert v.step_update(7999) == peak
    for n in (8000, 9000, 100000):  # flat, unlike InvSqrtDecay
        assert v.step_update(n) == peak
    assert i.step_update(31999) == pytest.approx(peak / 2)


def test_val_decay_2xlr_peak():
    v = make("val_decay", lr_lambda=2.0)
    assert v.step_update(50000) == pytest.approx(9.8821e-4, rel=1e-4)


def test_val_decay_warmup_to_lr():
    v = make("val_decay", lr=(5e-4,), warmup_updates=100, warmup_peak="lr")
    assert v.step_update(0) == pytest.approx(5e-6, rel=1e-12)
    assert v.step_update(49) == pytest.approx(2.5e-4, rel=1e-12)
    assert v.step_update(99) == pytest.approx(5e-4, rel=1e-12)
    assert v.step_update(5000) == pytest.approx(5e-4, rel=1e-12)


def test_nowarmup_is_constant_lr_from_the_first_update():
    v = make("val_decay", lr=(3e-4,), warmup_updates=0, model=Namespace())  # d not needed
    assert v.mode == "NoWarmup"
    assert v.step_update(0) == 3e-4
    assert v.optimizer.get_lr() == 3e-4
    assert v.step_update(1) == 3e-4 and v.step_update(12345) == 3e-4
    # decisions from the very first validations (no warmup)
    decays = feed(v, [(1000, 5.0), (2000, 5.1), (3000, 5.2), (4000, 5.3)])
    assert decays == [4000]
    assert v.step_update(4000) == pytest.approx(3e-4 * 0.8, rel=1e-12)


# ---------------------------------------------------------------------------------------
# ValDecay: decisions
# ---------------------------------------------------------------------------------------
SEQ = [10, 9, 8, 8.5, 8.6, 8.7, 8.4, 9.0, 9.1]  # validation i at update 1000 * (i + 1)


def test_decisions_minimising():
    v = make("val_decay", lr=(1e-3,), warmup_updates=0)
    decays = feed(v, [(1000 * (i + 1), m) for i, m in enumerate(SEQ)])
    # 8.7 > (8, 8.5, 8.6); 9.0 > (8.6, 8.7, 8.4); 9.1 > (8.7, 8.4, 9.0)
    assert decays == [6000, 8000, 9000]
    assert v.step_update(9000) == pytest.approx(1e-3 * 0.8 ** 3, rel=1e-12)
    assert v.optimizer.get_lr() == pytest.approx(1e-3 * 0.8 ** 3, rel=1e-12)
    assert [u for u, _, _ in v.decays] == [6000, 8000, 9000]


def test_decisions_maximising_bleu():
    v = make("val_decay", lr=(1e-3,), warmup_updates=0, maximize=True, metric="bleu")
    bleu = [20 - m for m in SEQ]  # the mirror image: same decisions
    assert feed(v, [(1000 * (i + 1), b) for i, b in enumerate(bleu)]) == [6000, 8000, 9000]
    # the minimising sequence read as BLEU: worse = lower than each of the previous 3
    w = make("val_decay", lr=(1e-3,), warmup_updates=0, maximize=True, metric="bleu")
    # 8 < (10, 9) but only 2 previous; 8.4 < (8.5, 8.6, 8.7)
    assert feed(w, [(1000 * (i + 1), m) for i, m in enumerate(SEQ)]) == [7000]


def test_plateaus_and_ties_do_not_decay():
    v = make("val_decay", lr=(1e-3,), warmup_updates=0)
    assert feed(v, [(100 * i, 5.0) for i in range(1, 9)]) == []  # flat plateau: ties
    w = make("val_decay", lr=(1e-3,), warmup_updates=0)
    # 4 ties with the best of the window: not worse than each -> no decay; 4.0001 is
    assert feed(w, [(100, 3.0), (200, 4.0), (300, 4.0), (400, 4.0), (500, 4.0001)]) == [500]


def test_patience_one_and_zero():
    v = make("val_decay", lr=(1e-3,), warmup_updates=0, lr_patience=1)
    assert feed(v, [(1, 5.0), (2, 4.0), (3, 4.5), (4, 4.5), (5, 4.6)]) == [3, 5]
    z = make("val_decay", lr=(1e-3,), warmup_updates=0, lr_patience=0, lr_decay=0.5)
    assert feed(z, [(1, 5.0), (2, 4.0), (3, 3.0)]) == [1, 2, 3]  # decays after each one
    assert z.step_update(3) == pytest.approx(1.25e-4, rel=1e-12)


def test_duplicate_reports_count_once():
    v = make("val_decay", lr=(1e-3,), warmup_updates=0, lr_patience=1)
    v.step_update(10)
    assert v.observe_validation(5.0) is None
    v.step_update(20)
    assert v.observe_validation(6.0) == [20, 1e-3, pytest.approx(8e-4)]
    # the same validation again (fairseq's end-of-epoch lr_step) and a hook repeat
    v.step(1, 6.0)
    assert v.observe_validation(6.0) is None
    assert v.on_validate_and_save(6.0) is False
    assert v.history == [[10, 5.0], [20, 6.0]]
    assert len(v.decays) == 1 and v.flat_lr == pytest.approx(8e-4)
    # a stale report (older update) is ignored too
    assert v.observe_validation(7.0, num_updates=15) is None
    # lr_step with a validation at a new update counts (epoch-end path without the hook)
    v.step_update(30)
    v.step(2, 7.0)
    assert v.history[-1] == [30, 7.0] and len(v.decays) == 2


def test_no_decision_during_warmup():
    v = make("val_decay", warmup_updates=1000)
    # getting worse during warmup: recorded, never decayed
    assert feed(v, [(200, 5.0), (400, 6.0), (600, 7.0), (800, 8.0), (999, 9.0)]) == []
    assert len(v.history) == 5
    peak = inv_sqrt_decay_peak(1.0, 512, 1000)
    assert v.step_update(999) == pytest.approx(peak)
    # update 1000 done: warmup over; compared with the previous 3 (warmup ones included)
    assert feed(v, [(1000, 9.5)]) == [1000]
    assert v.step_update(1000) == pytest.approx(peak * 0.8, rel=1e-12)


def test_decay_factor_and_lr_floor_stop():
    v = make("val_decay", lr=(1e-4,), warmup_updates=0, lr_patience=0, lr_decay=0.5,
             stop_lr=5e-5)
    v.step_update(5)
    assert v.on_validate_and_save(None) is False
    assert v.on_validate_and_save(3.0) is False  # 1e-4 -> 5e-5: not below 5e-5
    assert v.current_lr() == pytest.approx(5e-5)
    v.step_update(6)
    assert v.on_validate_and_save(None) is False
    v.step_update(7)
    assert v.on_validate_and_save(2.0) is True  # 5e-5 -> 2.5e-5 < 5e-5
    off = make("val_decay", lr=(1e-4,), warmup_updates=0, lr_patience=0, stop_lr=0.0)
    off.step_update(1)
    for u in range(1, 60):
        off.step_update(u)
        assert off.on_validate_and_save(1.0) is False


def test_lr_floor_not_checked_during_warmup():
    v = make("val_decay", warmup_updates=8000)  # lr(1) ~ 6e-8 < 5e-5
    v.step_update(10)
    assert v.current_lr() < 5e-5
    assert v.on_validate_and_save(None) is False
    i = make("inv_sqrt_decay", warmup_updates=100, lr_d_model=64, lr_lambda=0.01, stop_lr=1e-4)
    i.step_update(50)
    assert i.on_validate_and_save(None) is False  # in warmup
    # after warmup: lr(n) = 0.01 * (64 n)^-0.5 < 1e-4 once n > 156.25
    i.step_update(155)
    assert i.on_validate_and_save(None) is False  # update 156 would use 1.0016e-4
    i.step_update(156)
    assert i.on_validate_and_save(None) is True


# ---------------------------------------------------------------------------------------
# --stop-patience: stop when dev BLEU (or loss) has stalled
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["inv_sqrt_decay", "val_decay"])
def test_stop_patience_stops_after_n_validations_without_gain(name):
    s = make(name, maximize=True, metric="bleu", warmup_updates=100, stop_lr=0.0, stop_patience=2,
             lr=(1e-3,))
    stops = []
    # BLEU rises, ties (no gain), dips, then a tie again: the 2nd validation without gain stops
    for update, bleu in [(50, 1.0), (100, 5.0), (150, 9.0), (200, 9.0), (250, 12.0), (300, 11.5),
                         (350, 12.0), (400, 13.0)]:
        s.step_update(update)
        stops.append(s.on_validate_and_save(bleu))
        s.step_update(update + 1)  # an update without validation: the decision stands
        assert s.on_validate_and_save(None) is stops[-1]
        if stops[-1]:
            break
    assert stops == [False, False, False, False, False, False, True]
    assert s.stop_reason() == ("no gain for 2 validations (best 12 at update 250, "
                               "--stop-patience 2)")


def test_stop_patience_minimising_and_not_during_warmup():
    s = make("inv_sqrt_decay", warmup_updates=1000, stop_lr=0.0, stop_patience=1)
    s.step_update(100)
    assert s.on_validate_and_save(5.0) is False
    s.step_update(200)
    assert s.on_validate_and_save(6.0) is False  # worse, but in warmup
    s.step_update(1000)
    assert s.on_validate_and_save(4.0) is False  # lower loss is a gain
    s.step_update(1100)
    assert s.on_validate_and_save(4.0) is True  # a tie is no gain
    off = make("inv_sqrt_decay", warmup_updates=0, stop_lr=0.0)  # default 0: never
    for update in range(1, 20):
        off.step_update(update)
        assert off.on_validate_and_save(1.0) is False


def test_stop_patience_survives_a_state_round_trip():
    kw = dict(maximize=True, metric="bleu", warmup_updates=0, lr=(1e-3,), stop_lr=0.0, stop_patience=3)
    a = make("val_decay", **kw)
    feed(a, [(100, 10.0), (200, 12.0), (300, 11.0)])
    b = make("val_decay", **kw)
    b.load_state_dict(a.state_dict())
    b.step_update(300)
    for s in (a, b):
        s.step_update(400)
        assert s.on_validate_and_save(11.5) is False
        s.step_update(500)
        assert s.on_validate_and_save(12.0) is True  # 3 validations since the best (12 at 200)


# ---------------------------------------------------------------------------------------
# State round trip
# ---------------------------------------------------------------------------------------
def _plain(value):
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (int, float, bool, str)


@pytest.mark.parametrize("maximize", [False, True])
def test_state_round_trip_mid_plateau(maximize):
    sign = -1 if maximize else 1
    seq = [(1000 * (i + 1), sign * m) for i, m in enumerate(SEQ)]
    first, rest = seq[:5], seq[5:]  # stop after 8.6: two validations into the plateau
    kw = dict(lr=(1e-3,), warmup_updates=500, warmup_peak="lr", maximize=maximize)
    a = make("val_decay", **kw)
    feed(a, first)
    state = a.state_dict()
    assert _plain(state)
    # through a checkpoint file, loaded the safe way (torch >= 2.6 default)
    buffer = io.BytesIO()
    torch.save({"lr_scheduler_state": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["lr_scheduler_state"]
    assert loaded == state

    b = make("val_decay", **kw)  # a fresh scheduler as after a restart
    b.load_state_dict(loaded)
    b.step_update(5000)  # Trainer.load_checkpoint: set_num_updates(last num_updates)
    assert b.optimizer.get_lr() == a.optimizer.get_lr()
    assert b.history == a.history and b.decays == a.decays
    assert feed(b, rest) == feed(a, rest) == [6000, 8000, 9000]
    assert b.state_dict() == a.state_dict()
    assert b.step_update(9000) == a.step_update(9000) == pytest.approx(1e-3 * 0.8 ** 3)


def test_state_round_trip_inv_sqrt_decay():
    a = make("inv_sqrt_decay", warmup_updates=100)
    a.step_update(250)
    state = a.state_dict()
    assert _plain(state)
    b = make("inv_sqrt_decay", warmup_updates=100)
    b.load_state_dict(state)
    assert b.num_updates == 250 and b.current_lr() == a.current_lr()


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, flags, pattern", [
    ("inv_sqrt_decay", {"lr_lambda": 0.0}, r"--lr-lambda .*> 0 \(got 0\)"),
    ("val_decay", {"lr_lambda": -1.0}, r"--lr-lambda .*> 0 \(got -1\)"),
    ("inv_sqrt_decay", {"warmup_updates": -1}, r"--warmup-updates must be >= 0 \(got -1\)"),
    ("val_decay", {"warmup_updates": -8000}, r"--warmup-updates must be >= 0 \(got -8000\)"),
    ("val_decay", {"lr_decay": 0.0}, r"--lr-decay must be in the open interval \(0, 1\) \(got 0\)"),
    ("val_decay", {"lr_decay": 1.0}, r"--lr-decay .*\(got 1\)"),
    ("val_decay", {"lr_decay": 1.5}, r"--lr-decay .*\(got 1.5\)"),
    ("val_decay", {"lr_decay": -0.8}, r"--lr-decay .*\(got -0.8\)"),
    ("val_decay", {"lr_patience": -1}, r"--lr-patience must be >= 0 \(got -1\)"),
    ("val_decay", {"stop_lr": -1e-5}, r"--stop-lr must be >= 0"),
    ("inv_sqrt_decay", {"stop_patience": -2}, r"--stop-patience must be >= 0 \(got -2\)"),
    ("inv_sqrt_decay", {"lr_d_model": 0}, r"--lr-d-model must be a positive integer \(got 0\)"),
    ("val_decay", {"disable_validation": True}, r"validation is disabled \(--disable-validation\)"),
    ("val_decay", {"warmup_updates": 0, "lr": (1e-3, 5e-4)}, r"--lr must be a single value"),
    ("val_decay", {"warmup_updates": 0, "lr": (0.0,)}, r"--lr must be > 0 \(got 0\)"),
])
def test_bad_input(name, flags, pattern):
    with pytest.raises(NormplugError, match=pattern) as info:
        make(name, **flags)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("flag, value", [
    ("--lr-decay", "1.5"), ("--lr-decay", "0"), ("--lr-lambda", "-2"), ("--lr-patience", "-1"),
    ("--warmup-updates", "-1"), ("--stop-lr", "-0.001"), ("--lr-d-model", "0"), ("--stop-patience", "-1"),
])
def test_bad_values_fail_at_argument_time(flag, value):
    from fairseq import options

    parser = options.get_training_parser()
    with pytest.raises(NormplugError, match=f"{flag} .*got {value}"):
        options.parse_args_and_arch(parser, [
            "/nonexistent-data", "--task", "translation", "--arch", "transformer",
            "--optimizer", "adam", "--lr-scheduler", "val_decay", flag, value])


def test_good_values_parse():
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "/nonexistent-data", "--task", "translation", "--arch", "transformer",
        "--optimizer", "adam", "--lr-scheduler", "val_decay", "--lr-decay", "0.5",
        "--lr-patience", "0", "--warmup-updates", "0", "--lr", "3e-4", "--stop-lr", "0",
        "--warmup-peak", "lr", "--lr-lambda", "2", "--lr-d-model", "256"])
    assert (args.lr_decay, args.lr_patience, args.warmup_updates, args.stop_lr,
            args.warmup_peak, args.lr_lambda, args.lr_d_model) == (0.5, 0, 0, 0.0, "lr", 2.0, 256)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent-data", "--task", "translation", "--arch", "transformer",
        "--optimizer", "adam", "--lr-scheduler", "val_decay"])
    assert (args.lr_decay, args.lr_patience, args.warmup_updates, args.stop_lr,
            args.lr_lambda, args.lr_d_model) == (0.8, 3, 8000, 5e-5, 1.0, None)


# ---------------------------------------------------------------------------------------
# Registration and the validation hook
# ---------------------------------------------------------------------------------------
def test_registered_with_fairseq_and_no_rerouted_flag_names():
    assert LR_SCHEDULER_REGISTRY["inv_sqrt_decay"] is InvSqrtDecay
    assert LR_SCHEDULER_REGISTRY["val_decay"] is ValDecay
    for name in ("inv_sqrt_decay", "val_decay"):
        for field in LR_SCHEDULER_DATACLASS_REGISTRY[name].__dataclass_fields__:
            assert not field.startswith(("encoder_", "decoder_", "quant_noise_"))


def test_every_validation_reaches_the_last_built_scheduler_which_stops_training():
    import fairseq_cli.train as train_module

    # fairseq calls it by its module-level name after every update with valid_losses[0]
    import inspect
    assert "should_stop_early(cfg, valid_losses[0])" in inspect.getsource(
        train_module.validate_and_save)
    cfg = OmegaConf.create({"checkpoint": {"patience": -1,
                                           "maximize_best_checkpoint_metric": False}})
    try:
        v = make("val_decay", lr=(1e-4,), warmup_updates=0, lr_patience=0, lr_decay=0.5,
                 stop_lr=4e-5)
        assert fairseq_patches.validation_listener() is v
        assert fairseq_patches.installed()["fairseq_cli.train.should_stop_early"]  # by make() at the latest
        wrapper = train_module.should_stop_early
        v.step_update(1)
        assert wrapper(cfg, None) is False
        v.step_update(2)
        assert wrapper(cfg, 3.0) is False and v.history == [[2, 3.0]]
        v.step_update(3)
        assert wrapper(cfg, 2.5) is True  # 5e-5 -> 2.5e-5 < 4e-5: stop now, mid-epoch
        assert v.history == [[2, 3.0], [3, 2.5]]
        # a config naming another scheduler: a pass-through
        other = OmegaConf.create({"checkpoint": {"patience": -1},
                                  "lr_scheduler": {"_name": "inverse_sqrt"}})
        v.step_update(4)
        assert wrapper(other, 1.0) is False and len(v.history) == 2
        # fairseq's own --patience early stopping still works through the wrapper
        cfg.checkpoint.patience = 1
        fairseq_patches.stop_feeding_validations()
        assert wrapper(cfg, 1.0) is False
        assert wrapper(cfg, 2.0) is True
    finally:
        for attr in ("best", "num_runs"):
            if hasattr(train_module.should_stop_early, attr):
                delattr(train_module.should_stop_early, attr)
