import subprocess
import sys
import time


def test_import_is_fast():
    # Best of three: the first run may pay for disk caches.
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import jmegatron"], check=True)
        times.append(time.perf_counter() - start)
    assert min(times) < 3.0, times


def test_submodules_load_lazily():
    code = ("import sys, jmegatron; assert 'jax' not in sys.modules; "
            "jmegatron.sharding; assert 'jax' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
