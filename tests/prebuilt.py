"""Models that tests share, made by one child process while the tests that need none of them run.

The test run is one process on one core (OMP_NUM_THREADS=1), and CI's machine has two: training the shared models in a
child (make-tiny's Qwen3, about half a minute of a core; the tool-calling models, a quarter of a minute) costs the run
nothing when the tests that need no model run meanwhile (conftest.py puts the files that use one last). The child
builds the models one after the other (one core is all it takes from the run) and marks each one done.

    python tests/prebuilt.py ROOT NAME...     # the child: builds ROOT/NAME for each NAME, writes ROOT/NAME.done
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

# make-tiny's settings for the `tiny_dir` model.
TINY_ARGS = dict(arch="qwen3", train_steps=160, progress=False)


def build(name: str, out: Path) -> None:
    """Makes the model a fixture of this name returns, in `out`."""
    if name == "tiny_dir":
        from orinfer.tiny import make_tiny

        make_tiny(out, **TINY_ARGS)
    elif name == "tool_dirs":
        from tool_model import make_tool_models

        make_tool_models(out)
    else:
        raise ValueError(f"no prebuilt model {name!r}")


NAMES = ("tiny_dir", "tool_dirs")


class Prebuilt:
    """The child process building `names` under a temporary folder (`start`), and the wait for one of them."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.root = Path(tempfile.mkdtemp(prefix="orinfer-tests-prebuilt-"))
        self.log: IO[str] = open(self.root / "build.log", "w+")
        # The child inherits OMP_NUM_THREADS=1 (conftest sets it); make_tiny also trains on one thread whatever it
        # is. It exits when its stdin, a pipe nobody writes to, closes: when this process ends, however it ends.
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.root), *names], stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, name: str) -> Path:
        """The folder of `name` once it is built; RuntimeError (with the child's log) if the child failed."""
        done = self.root / f"{name}.done"
        while not done.exists():
            if self.proc.poll() is not None and not done.exists():
                self.log.seek(0)
                raise RuntimeError(f"building {name} failed in the child process (exit {self.proc.returncode}):\n"
                                   f"{self.log.read()}")
            time.sleep(0.1)
        return self.root / name

    def close(self) -> None:
        """Stops the child if it still runs (the run ended before a test waited) and removes what it built."""
        import shutil

        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _main(root: Path, names: list[str]) -> None:
    threading.Thread(target=lambda: sys.stdin.read() or os._exit(1), daemon=True).start()
    for name in names:
        build(name, root / name)
        (root / f"{name}.done").touch()


if __name__ == "__main__":
    _main(Path(sys.argv[1]), sys.argv[2:])
