"""docs/resume.md's loop, killed with SIGKILL mid-training and resumed, gives the same losses.

The page's own code (every ```python block up to the loop) runs in a child
process that prints each step's loss as a float's exact hex form. One child
runs 40 steps uninterrupted. Another stops itself at step 25, just after its
checkpoint of step 20 may still be being written, and is killed there with
SIGKILL; a third resumes from whatever checkpoint survived. Every loss either
child printed must equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from _helpers import python_blocks

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "resume.md"
TOTAL_STEPS = 40
STOP_AT = 25

RUNNER = """
import sys

checkpoint_dir, total_steps, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def log_exactly(step, loss):
    print(step, float(loss).hex(), flush=True)
    if step == stop_at:
        print("waiting to be killed", flush=True)
        sys.stdin.read()  # blocks until the test kills this process


train(checkpoint_dir, total_steps, log=log_exactly)
print("finished", flush=True)
"""


def page_program(tmp_path: Path) -> Path:
    """The page's code up to and including ``def train``, then the runner."""
    blocks = []
    for _, code in python_blocks(PAGE.read_text()):
        blocks.append(code)
        if "def train(" in code:
            break
    else:
        raise AssertionError("docs/resume.md defines no train(...) loop")
    program = tmp_path / "resume_page.py"
    program.write_text("\n".join(blocks) + RUNNER)
    return program


def start(program: Path, checkpoint_dir: Path, stop_at: int = -1) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, str(program), str(checkpoint_dir), str(TOTAL_STEPS), str(stop_at)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def losses_until(proc: subprocess.Popen[str], last_line: str) -> dict[int, str]:
    """``{step: loss hex}`` read from ``proc`` until it prints ``last_line``."""
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    losses: dict[int, str] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == last_line:
                return losses
            step, loss = line.split()
            assert int(step) not in losses, f"step {step} ran twice in one process"
            losses[int(step)] = loss
    finally:
        watchdog.cancel()
    stderr = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"the child ended before printing {last_line!r}:\n{stderr[-3000:]}")


@pytest.mark.slow  # three children training the page's loop: the slow tier (-m slow) runs it
def test_losses_after_a_sigkill_and_resume_equal_the_uninterrupted_run(tmp_path):
    program = page_program(tmp_path)

    reference_proc = start(program, tmp_path / "reference")
    reference = losses_until(reference_proc, "finished")
    assert reference_proc.wait(timeout=60) == 0
    assert sorted(reference) == list(range(TOTAL_STEPS))

    killed = start(program, tmp_path / "run", stop_at=STOP_AT)
    before_kill = losses_until(killed, "waiting to be killed")
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert sorted(before_kill) == list(range(STOP_AT + 1))

    resumed_proc = start(program, tmp_path / "run")
    resumed = losses_until(resumed_proc, "finished")
    assert resumed_proc.wait(timeout=60) == 0
    first = min(resumed)
    # Checkpoint 10 is complete before the save of 20 starts; 20 may or may not be.
    assert first in (10, 20), f"resumed at step {first}"
    assert sorted(resumed) == list(range(first, TOTAL_STEPS))

    assert before_kill == {step: reference[step] for step in before_kill}
    assert resumed == {step: reference[step] for step in resumed}
