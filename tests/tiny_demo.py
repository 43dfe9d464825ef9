"""demo.sh's main at test size: the table's first row only, its --preset tiny recipe shrunk to
4 updates (dev BLEU at 2 and 4). Used by tests/test_demo.py in-process, and run as a script
(``python tests/tiny_demo.py DEMO_ARGS...``) by tests/test_wheel.py with an installed wheel."""
import dataclasses
import sys


def shrink(demo, setattr=setattr) -> None:
    """Make ``demo`` (the module fairseq_normplug.experiments.demo) train at test size;
    ``setattr`` is pytest's monkeypatch.setattr in a test process."""
    from fairseq_normplug.experiments import configs

    recipes = configs.load_recipes()
    tiny = dataclasses.replace(recipes["cpu_tiny"], train=[*recipes["cpu_tiny"].train, "--max-update", "4",
                                                           "--validate-interval-updates", "2"])
    setattr(demo, "load_recipes", lambda: {**recipes, "cpu_tiny": tiny})
    setattr(demo, "load_table", lambda name: dataclasses.replace(configs.load_table(name),
                                                                 rows=configs.load_table(name).rows[:1]))


if __name__ == "__main__":
    from fairseq_normplug.experiments import demo as demo_module

    shrink(demo_module)
    demo_module.main(sys.argv[1:])
