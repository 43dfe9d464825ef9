"""Benchmarks of the plugin's speed: ``bench_norms`` (the norm layers alone, against torch's
fused ``layer_norm`` and the memory-bandwidth floor) and ``bench_train`` (end-to-end
``fairseq-train`` throughput against stock ``transformer``). See docs/speed.md."""
