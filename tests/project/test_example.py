"""The README's main example runs end to end and learns (a short run, in a subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def test_train_digits_learns_and_reports_accuracy():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "150"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"steps: (\d+)\s+test accuracy: ([\d.]+)%", done.stdout)
    assert found, done.stdout
    assert int(found[1]) == 150
    # Chance is 10 %; 150 adamw steps of an MLP on digits reach well above 85 %.
    assert float(found[2]) > 85.0, done.stdout
