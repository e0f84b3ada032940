"""Tests run on 8 virtual CPU devices; this must happen before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see experiments/__init__.py

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
