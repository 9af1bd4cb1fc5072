"""IPython startup file of .ci/wheel-check's Colab-like kernels: imports the modules named in
COLAB_KERNEL_IMPORTS (default: google.colab, as Colab's kernel does when it starts)."""

import importlib
import os

for _module in os.environ.get("COLAB_KERNEL_IMPORTS", "google.colab").split():
    importlib.import_module(_module)
