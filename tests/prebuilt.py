"""Models that tests share, made by one child process while the tests that need none of them run.

Each test process runs on one core (OMP_NUM_THREADS=1), and CI's machine has two: training the shared models in a
child (make-tiny's Qwen3, about half a minute of a core on an idle machine; the tool-calling models, a quarter of a
minute) costs the run little when the tests that need no model run meanwhile (conftest.py puts the files that use one
last). The child builds the models one after the other and marks each one done (ROOT/NAME.done), or writes what went
wrong (ROOT/failed). Under pytest-xdist the controller starts the child and the workers wait on its folder
(`Prebuilt.attach`), so the models are made once per run, not once per worker.

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
    """The child process building `names` under a temporary folder, and the wait for one of them. `Prebuilt(names)`
    starts the child; `Prebuilt.attach(root, names)` waits on a child another process started (xdist workers)."""

    def __init__(self, names: list[str], root: Path | None = None) -> None:
        self.names = names
        self.proc: subprocess.Popen | None = None
        self.log: IO[str] | None = None
        if root is not None:  # attached: the starting process owns the child and the folder
            self.root = root
            return
        self.root = Path(tempfile.mkdtemp(prefix="orinfer-tests-prebuilt-"))
        self.log = open(self.root / "build.log", "w+")
        # The child inherits OMP_NUM_THREADS=1 (conftest sets it); make_tiny also trains on one thread whatever it
        # is. It exits when its stdin, a pipe nobody writes to, closes: when this process ends, however it ends.
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.root), *names], stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        (self.root / "pid").write_text(str(self.proc.pid))

    @classmethod
    def attach(cls, root: Path, names: list[str]) -> "Prebuilt":
        return cls(names, root)

    def _failure(self) -> str | None:
        """What went wrong in the child, or None while it is alive and well."""
        failed = self.root / "failed"
        if failed.exists():
            return failed.read_text()
        if self.proc is not None:
            if self.proc.poll() is None:
                return None
            self.log.seek(0)
            return f"exit {self.proc.returncode}:\n{self.log.read()}"
        return None if _running(int((self.root / "pid").read_text())) else "the child process is gone"

    def wait(self, name: str) -> Path:
        """The folder of `name` once it is built; RuntimeError (with the child's log) if the child failed."""
        done = self.root / f"{name}.done"
        while not done.exists():
            failure = self._failure()
            if failure is not None and not done.exists():
                raise RuntimeError(f"building {name} failed in the child process: {failure}")
            time.sleep(0.1)
        return self.root / name

    def close(self) -> None:
        """Stops the child if it still runs (the run ended before a test waited) and removes what it built; an
        attached waiter leaves both to the process that started them."""
        import shutil

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether process `pid` still runs. A child that died unreaped (its parent, the xdist controller, waits on it
    only at the end) is a zombie, which a signal-0 probe would count as alive: the waiters would hang."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _main(root: Path, names: list[str]) -> None:
    threading.Thread(target=lambda: sys.stdin.read() or os._exit(1), daemon=True).start()
    for name in names:
        try:
            build(name, root / name)
        except BaseException:
            import traceback

            (root / "failed").write_text(f"building {name}:\n{traceback.format_exc()}")
            raise
        (root / f"{name}.done").touch()


if __name__ == "__main__":
    _main(Path(sys.argv[1]), sys.argv[2:])
