import re
import subprocess
import sys
import time
from pathlib import Path


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


def test_the_quick_tier_names_a_test_of_every_module_that_exists():
    """tests/conftest.py's QUICK: each name is a test function of its module (a renamed
    test would silently leave the tier), and every module but the one-minute
    comparison and the GPU scripts' CPU runs (a minute or more each, code the edit loop
    rarely touches) has one."""
    from conftest import QUICK
    here = Path(__file__).parent
    slow = {"test_optimizer_comparison.py", "test_gpu_scripts.py"}
    assert set(QUICK) | slow == {p.name for p in here.glob("test_*.py")}
    for module, names in QUICK.items():
        source = (here / module).read_text()
        for name in names:
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M), (
                module, name)
        assert names, module
