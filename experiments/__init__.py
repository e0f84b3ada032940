"""Training entry point, presets and benchmarks (``python -m experiments.<name>``)."""

import os

# jaxlib runs LAPACK (eigh, QR: SOAP's bases) on scipy's OpenBLAS, which by
# default gives every call a thread per core. Several virtual CPU devices
# calling at once then oversubscribe the cores: 8 devices x 12 QRs of 384^2
# took 5.5 s instead of 0.2 s on 2 cores. Read when OpenBLAS loads, so set
# before numpy is imported; the devices themselves are the parallelism.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
