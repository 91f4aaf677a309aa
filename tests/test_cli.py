"""The command line, run as users run it."""

from __future__ import annotations

import re
import subprocess
import sys

from orinfer.cli import main

TIMING = re.compile(r"\[prompt \d+ tokens, generated \d+ tokens, prefill [\d.]+ tok/s, decode [\d.]+ tok/s, "
                    r"TTFT [\d.]+ ms, finish: \w+\]")


def test_generate_prints_text_and_timing(tiny_dir, capsys):
    rc = main(["generate", "-m", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "-p",
               "Alice was beginning to get very", "--max-tokens", "12", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith(" tired of sitting")
    assert TIMING.search(err), err


def test_python_dash_m_and_chat_session(tiny_dir):
    # `python -m orinfer chat` reads turns from stdin; EOF ends the session cleanly.
    proc = subprocess.run([sys.executable, "-m", "orinfer", "chat", "-m", str(tiny_dir), "--device", "cpu",
                           "--max-tokens", "8", "--temperature", "0", "--no-think"],
                          input="Who is Alice?\n/reset\nAnd the rabbit?\n", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(TIMING.findall(proc.stderr)) == 2  # one timing line per answered turn
