"""An extension of fairseq-normplug from outside the package (docs/extending.md): importing it
registers the norm type ``prmsnorm`` (partial RMSNorm) and the placement ``parallel``
(parallel attention and FFN blocks). Load it with ``--normplug-modules PATH/TO/THIS/FOLDER``,
or install this folder (``pip install examples/normplug_extension``): its entry point
``fairseq_normplug.extensions`` then loads it in every fairseq command that uses the plugin."""
from normplug_extension_example import parallel_layers, partial_rms_norm  # noqa: F401
