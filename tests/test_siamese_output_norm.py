"""--norm-placement siamese (SiameseNorm) and output-norm (OLMo 2's output-only norm): each
stack's formula against a direct re-implementation with the model's own modules, the refused
combinations (one line), fp16/bf16, and fairseq-train for 20 updates then fairseq-generate.
The generic tests of tests/test_placements.py (norm slots, every norm type, incremental
decoding, activation checkpointing) cover both placements through the registry."""
import copy
import math

import pytest
import torch

from conftest import cli
from inprocess import run_fairseq
from fairseq_normplug.errors import NormplugError
from model_helpers import build, parse_args, toy_batch
from test_cli import HALF_BATCHES, NO_LOADER_WORKERS, USER_DIR, log_records, train
from test_placements import TINY, future_mask, placed, sublayers
from test_precision import AGREEMENT, HALF, padded_batch, smoothed_loss

PREFIXES = {"self_attn_layer_norm": "self_attn", "encoder_attn_layer_norm": "encoder_attn", "final_layer_norm": "ffn"}


def stack_inputs_and_outputs(model, task):
    """The embeddings entering each stack and the outputs of its final norm, no padding:
    (x0 encoder, encoder output, y0 decoder, decoder features, decoder self-attention mask)."""
    src, lengths, prev = toy_batch(task)
    with torch.no_grad():
        x0 = model.encoder.forward_embedding(src)[0].transpose(0, 1)
        encoder_out = model.encoder(src, src_lengths=lengths)
        features = model.decoder.extract_features(prev, encoder_out=encoder_out)[0].transpose(0, 1)
        positions = model.decoder.embed_positions(prev)
        y0 = (model.decoder.embed_scale * model.decoder.embed_tokens(prev) + positions).transpose(0, 1)
    return x0, encoder_out["encoder_out"][0], y0, features, future_mask(prev.size(1))


def test_siamese_stack_formula(tiny_bin):
    """Qwen-Applications/SiameseNorm deit-model-siamesenorm.py lines 216-226 and 352-356:
    x' = LN_post(x); z = F(LN_in(x' + LN_pre(y))); x = x' + z / sqrt(2(i+1)); y = y + z;
    y_0 = x_0; output LN_f(LN_post_f(x) + LN_pre_f(y))."""
    model, task, _ = placed(tiny_bin, "siamese")

    def reference(stack, x, mask=None, enc=None):
        y = x
        for i, layer in enumerate(stack.layers):
            for norm, f in sublayers(layer, mask, enc):
                x = getattr(layer, f"{PREFIXES[norm]}_post_stream_norm")(x)
                z = f(getattr(layer, norm)(x + getattr(layer, f"{PREFIXES[norm]}_pre_stream_norm")(y)))
                x, y = x + z / math.sqrt(2 * (i + 1)), y + z
        last = stack.layers[-1]
        return stack.layer_norm(last.post_stream_final_norm(x) + last.pre_stream_final_norm(y))

    x0, enc, y0, features, mask = stack_inputs_and_outputs(model, task)
    with torch.no_grad():
        assert torch.allclose(enc, reference(model.encoder, x0), atol=1e-5)
        assert torch.allclose(features, reference(model.decoder, y0, mask, enc), atol=1e-5)
    assert [layer.siamese_c for layer in model.encoder.layers] == [math.sqrt(2), 2.0]


def test_output_norm_stack_formula(tiny_bin):
    """allenai/OLMo olmo/model.py lines 786-794, 814-821 and 1447: x = x + LN_out(F(x)) for
    every sublayer, no input norm, and the stack's final norm."""
    model, task, _ = placed(tiny_bin, "output-norm")

    def reference(stack, x, mask=None, enc=None):
        for layer in stack.layers:
            for norm, f in sublayers(layer, mask, enc):
                assert getattr(layer, norm) is None  # fairseq's input norms are gone
                x = x + getattr(layer, norm.replace("layer_norm", "out_layer_norm"))(f(x))
        return stack.layer_norm(x)

    x0, enc, y0, features, mask = stack_inputs_and_outputs(model, task)
    with torch.no_grad():
        assert torch.allclose(enc, reference(model.encoder, x0), atol=1e-5)
        assert torch.allclose(features, reference(model.decoder, y0, mask, enc), atol=1e-5)


BAD = [
    (["--norm-placement", "siamese", "--residual-scale", "rezero"],
     "--residual-scale rezero cannot be combined with --norm-placement siamese"),
    (["--norm-placement", "siamese", "--norm-type", "identity", "--weight-init", "tfixup"],
     "--weight-init tfixup cannot be combined with --norm-placement siamese"),
    (["--norm-placement", "siamese", "--decoder-layerdrop", "0.1"],
     "--decoder-layerdrop 0.1 cannot be combined with --norm-placement siamese"),
    *[(["--norm-placement", placement, "--no-decoder-final-norm"],
       f"--no-decoder-final-norm cannot be combined with --norm-placement {placement}")
      for placement in ("siamese", "output-norm")],
    (["--norm-placement", "output-norm", "--layernorm-scaling"],
     "--layernorm-scaling cannot be combined with --norm-placement output-norm"),
    (["--norm-placement", "siamese", "--normformer"], "--normformer needs the PreNorm placement"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_refused_in_one_line(tiny_bin, flags, message):
    with pytest.raises(NormplugError) as error:
        parse_args(tiny_bin, TINY, *flags)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("placement", ["siamese", "output-norm"])
def test_half_precision(tiny_bin, placement):
    """fp16 and bf16 (LayerNorm and RMSNorm): finite logits, loss and gradients, log-probabilities
    close to float32's."""
    for norm_type in ("layernorm", "rmsnorm"):
        model, task, _ = build(tiny_bin, TINY, "--norm-placement", placement, "--norm-type", norm_type)
        batch = padded_batch(task)
        with torch.no_grad():
            reference = smoothed_loss(model.eval(), batch)[1]
        for dtype in HALF.values():
            half = copy.deepcopy(model).to(dtype)
            logits, lprobs, loss = smoothed_loss(half, batch)
            loss.backward()
            assert logits.dtype == dtype and torch.isfinite(lprobs).all() and torch.isfinite(loss)
            assert all(torch.isfinite(p.grad).all() for p in half.parameters())
            words = torch.arange(lprobs.size(-1)) != task.target_dictionary.pad()
            assert (lprobs.float() - reference)[..., words].abs().max() < AGREEMENT[dtype], (norm_type, dtype)


@pytest.mark.parametrize("placement", ["siamese", "output-norm"])
def test_train_20_updates_and_generate(tiny_bin, tmp_path, placement):
    save_dir = tmp_path / placement
    # 20 updates of 600 tokens (half TRAIN_COMMON's batches): enough for the loss to fall
    proc = train(tiny_bin, save_dir, ["--norm-placement", placement], 20,
                 extra=["--log-interval", "5", *HALF_BATCHES])
    losses = [float(r["loss"]) for r in log_records(proc, "train_inner")]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    gen = run_fairseq([cli("fairseq-generate"), tiny_bin, "--user-dir", USER_DIR, "--path",
                       str(save_dir / "checkpoint_last.pt"), "--beam", "2", "--cpu", "--max-tokens", "4000",
                       "--gen-subset", "test", "--required-batch-size-multiple", "1", "--max-len-a", "0",
                       "--max-len-b", "6", *NO_LOADER_WORKERS])
    assert len([line for line in gen.stdout.splitlines() if line.startswith("H-")]) == 100
