"""Tests run on 8 virtual CPU devices; this must happen before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see experiments/__init__.py
# Test programs are small: compiling dominates, and LLVM's optimization passes cost
# more than they save (test_layouts: 93 s instead of about 170 s on 2 cores). It sets
# LLVM's level only: every HLO, collective and memory check passes unchanged.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
