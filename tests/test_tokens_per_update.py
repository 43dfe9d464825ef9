"""Tokens per update are a property of the recipe: reached exactly on any number of devices
(--max-tokens per device and --update-freq), refused in one line when they cannot be, and the
same batches with 1 and 2 gloo processes on CPU."""
import json
import os
import shutil
import socket

import pytest

from conftest import REPO
from inprocess import run_forked
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import reproduce
from fairseq_normplug.experiments.configs import CONFIG_DIR, load_recipes, load_table
from fairseq_normplug.experiments.runner import Run, last_flag_value, plan_batching
from fairseq_normplug.experiments.training_log import parse_training_log


@pytest.mark.parametrize("tokens,cap,devices,expected", [
    (28672, 4096, 1, (4096, 7)), (28672, 4096, 2, (3584, 4)), (28672, 4096, 4, (3584, 2)),
    (28672, 4096, 7, (4096, 1)), (28672, 4096, 8, (3584, 1)), (4096, 4096, 1, (4096, 1)),
    (4096, 4096, 2, (2048, 1)), (4096, 4096, 8, (512, 1)), (4096, 1000, 1, (512, 8)),
    (1500, 1500, 2, (750, 1)), (1000, 500, 1, (500, 2)),
])
def test_the_batching_reaches_the_tokens_per_update_exactly(tokens, cap, devices, expected):
    batching = plan_batching(tokens, cap, devices)
    assert (batching.max_tokens, batching.update_freq) == expected
    assert batching.max_tokens <= cap and batching.devices == devices
    assert batching.tokens_per_update == tokens


@pytest.mark.parametrize("tokens,cap,devices,why", [
    (4096, 4096, 3, "4096 is not a multiple of 3"), (28672, 4096, 5, "28672 is not a multiple of 5"),
    (1009, 100, 1, "no split of 1009 tokens per device into batches of at most 100"),
])
def test_an_unreachable_combination_is_refused_in_one_line(tokens, cap, devices, why):
    with pytest.raises(NormplugError) as error:
        plan_batching(tokens, cap, devices, "ted")
    message = str(error.value)
    assert message.startswith(f"recipe 'ted': {tokens} tokens per update cannot be reached exactly on {devices} ")
    assert why in message and "device counts that work: " in message and "\n" not in message


def test_every_recipe_states_its_tokens_per_update():
    with open(os.path.join(CONFIG_DIR, "recipes.json"), encoding="utf-8") as f:
        raw = {name: value for name, value in json.load(f).items() if not name.startswith("_")}
    assert {name: data.get("tokens_per_update") for name, data in raw.items()} == {
        "ted": 4096, "iwslt15": 4096, "wmt14": 28672, "cpu_converge": 2000, "cpu_short": 2000, "cpu_small": 1000, "cpu_tiny": 1500}
    recipes = load_recipes()
    for name in ("ted", "iwslt15"):  # the authors' --max-tokens 4096 per update on one device
        assert last_flag_value(recipes[name].train, "--max-tokens") == "4096"
    for name, recipe in recipes.items():  # CPU recipes: one device holds the whole update, as before
        if name.startswith("cpu_"):
            assert last_flag_value(recipe.train, "--max-tokens") == str(recipe.tokens_per_update)


@pytest.fixture
def fake_data(tmp_path):
    """A folder that passes the runner's checks (no training reads it)."""
    data = tmp_path / "gl-en"
    for path in ("bin/dict.gl.txt", "bin/train.gl-en.gl.bin", "ref/test.tok.en"):
        (data / path).parent.mkdir(parents=True, exist_ok=True)
        (data / path).write_text("")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return str(data)


@pytest.mark.parametrize("devices,max_tokens,update_freq", [(1, "4096", "1"), (2, "2048", "1"), (8, "512", "1")])
def test_ted_runs_train_with_4096_tokens_per_update_on_any_device_count(fake_data, tmp_path, devices, max_tokens,
                                                                        update_freq):
    table = load_table("table3")
    run = Run(table=table, row=table.rows[0], pair="gl-en", data_dir=fake_data, run_dir=str(tmp_path / "run"),
              num_devices=devices)
    command = run.train_command()
    assert (last_flag_value(command, "--max-tokens"), last_flag_value(command, "--update-freq")) == (
        max_tokens, update_freq)
    assert run.batching().describe() == (f"4096 tokens per update (--max-tokens {max_tokens} x {devices} "
                                         f"device{'s' if devices > 1 else ''} x --update-freq {update_freq})")


def test_a_refused_combination_stops_the_table_before_anything_runs(fake_data, tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["table3", "gl-en", "--data", f"gl-en={fake_data}", "--runs-dir", str(runs_dir),
                        "--results-dir", str(tmp_path / "results"),
                        "--train-flags", "--distributed-world-size 3"])
    assert str(exit_info.value.code) == (
        "reproduce.sh: error: recipe 'ted': 4096 tokens per update cannot be reached exactly on 3 device(s) "
        "(4096 is not a multiple of 3); device counts that work: 1, 2, 4, 8, 16, 32, 64")
    assert not runs_dir.exists() and not (tmp_path / "results").exists()
    assert "[reproduce]" not in capsys.readouterr().out


GLOO_RECIPE = {"base": "cpu_tiny", "train": {"--max-tokens": "500", "--max-update": "6", "--log-interval": "1"},
               "tokens_per_update": 1000}


@pytest.fixture(scope="module")
def gloo_run(tiny_raw, tiny_bin, tmp_path_factory):
    """A Run of a recipe of 1,000 tokens per update of which one device holds 500, on the tiny
    corpus (bin/ from the session's fairseq-preprocess)."""
    root = tmp_path_factory.mktemp("gloo")
    config_dir = root / "configs"
    shutil.copytree(CONFIG_DIR, config_dir)
    recipes = json.loads((config_dir / "recipes.json").read_text())
    recipes["test_gloo"] = GLOO_RECIPE
    (config_dir / "recipes.json").write_text(json.dumps(recipes))
    (config_dir / "experiments" / "gloo.json").write_text(json.dumps({
        "recipe": "test_gloo", "pairs": ["src-tgt"],
        "rows": [{"name": "PreNorm", "model": ["--prenorm"], "schedule": "inv_sqrt_decay"}]}))
    table = load_table("gloo", str(config_dir))
    data = root / "data"
    (data / "ref").mkdir(parents=True)
    os.symlink(tiny_bin, data / "bin")
    shutil.copy(os.path.join(tiny_raw, "test.tgt"), data / "ref" / "test.tok.tgt")
    (data / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return Run(table=table, row=table.rows[0], pair="src-tgt", data_dir=str(data), run_dir=str(root / "run"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_update(log_text: str, path) -> list:
    path.write_text(log_text)
    records = parse_training_log(str(path)).kind("train_inner")
    return [(int(r["num_updates"]), r["wpb"], r["bsz"]) for r in records]


@pytest.mark.slow
def test_one_and_two_gloo_processes_train_with_the_same_tokens_per_update(gloo_run, tmp_path):
    """1 process: 500-token batches, --update-freq 2; 2 gloo processes: one 500-token batch
    each. fairseq deals the shuffled batches round-robin to the ranks, so every update sums the
    same two batches: the same target tokens (wpb) and sentences (bsz) per update."""
    quiet = ["--disable-validation", "--no-save", "--cpu"]
    alone = gloo_run.train_command(quiet)
    assert (last_flag_value(alone, "--max-tokens"), last_flag_value(alone, "--update-freq")) == ("500", "2")
    port = free_port()
    ranks = [gloo_run.train_command(quiet + [
        "--distributed-world-size", "2", "--distributed-rank", str(rank), "--distributed-no-spawn",
        "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-backend", "gloo",
        "--ddp-backend", "legacy_ddp", "--device-id", "0"]) for rank in (0, 1)]
    for command in ranks:
        assert (last_flag_value(command, "--max-tokens"), last_flag_value(command, "--update-freq")) == ("500", "1")
    # the single process and the two gloo ranks at once, each a fork of this one (tests/inprocess.py's
    # ForkedCommand: a process all the same, without starting Python, torch and fairseq again)
    procs = run_forked([alone, *ranks], cwd=REPO, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                       timeout=240, peers=True)
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    one = per_update(procs[0].stdout + procs[0].stderr, tmp_path / "one.log")
    two = per_update(procs[1].stdout + procs[1].stderr, tmp_path / "two.log")
    assert [u for u, _, _ in one] == [1, 2, 3, 4, 5, 6]
    assert two == one
    assert all(wpb > 500 for _, wpb, _ in one)  # two batches' worth of target tokens in every update
