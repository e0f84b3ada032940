"""Muon against AdamW on the tiny preset (two full training runs)."""

import pytest

from experiments.compare_optimizers import compare


@pytest.mark.slow   # two training runs: about 3 minutes on 2 cores; run with -m slow
def test_muon_reaches_a_lower_validation_loss_than_adamw(tmp_path):
    adamw, muon = compare(steps=150, out_dir=str(tmp_path))
    assert muon["val_loss"] < adamw["val_loss"], (muon, adamw)
