"""Smoke tests of the tools in scripts/, runnable without a GPU: every Python script imports (nothing touches CUDA at
import time), documents how to run it, and answers --help; every shell script parses (`bash -n`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PY_SCRIPTS = sorted(SCRIPTS.glob("*.py"))
SH_SCRIPTS = sorted(SCRIPTS.glob("*.sh"))


# Packages a script needs beyond the engine's own (the `serve` extra): without them (the GPU machine has none) its
# smoke tests are skipped, as the server's own tests are.
SCRIPT_NEEDS = {"bench_serve_synthetic.py": ("fastapi", "uvicorn"),
                "server_load_test.py": ("fastapi", "uvicorn", "httpx")}


def needs(path: Path) -> None:
    for module in SCRIPT_NEEDS.get(path.name, ()):
        pytest.importorskip(module)


def load_script(path: Path, monkeypatch):
    """The script imported as a module (its `if __name__ == "__main__"` part not run), with scripts/ on sys.path as
    when it runs (bench_serve_synthetic.py imports bench_serve.py)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"scripts_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_scripts_folder_holds_the_tools():
    assert PY_SCRIPTS and SH_SCRIPTS
    assert {p.name for p in SCRIPTS.iterdir()} <= {p.name for p in PY_SCRIPTS + SH_SCRIPTS} | {"test-constraints.txt"}


@pytest.mark.parametrize("path", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_script_imports_and_says_how_to_run_it(path, monkeypatch, capsys):
    needs(path)
    module = load_script(path, monkeypatch)
    assert module.__doc__ and f"scripts/{path.name}" in module.__doc__, "the docstring shows its command line"
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_script_runs_with_help(path):
    """As a program (`python3 scripts/NAME.py --help`): its own folder on sys.path, no package state from this run."""
    needs(path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


@pytest.mark.parametrize("path", SH_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses_and_says_how_to_run_it(path):
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    header = "".join(line for line in path.read_text().splitlines(keepends=True)[:12] if line.startswith("#"))
    assert "Usage" in header


def test_sass_mix_arguments(monkeypatch):
    sass_mix = load_script(SCRIPTS / "sass_mix.py", monkeypatch)
    assert sass_mix.parse_args([]) == (None, set())
    assert sass_mix.parse_args(["8", "512", "4", "gated", "int"]) == ((8, 512, 4), {"gated", "int"})
    for bad in (["8", "512"], ["fast"]):
        with pytest.raises(SystemExit):
            sass_mix.parse_args(bad)


def test_sass_mix_reads_the_issue_order(monkeypatch):
    sass_mix = load_script(SCRIPTS / "sass_mix.py", monkeypatch)
    listing = "\n".join(f"        /*{4 * i:04x}*/                   {op} R0, R1 ;" for i, op in enumerate(
        ["LDG.E.EF.128", "LDG.E.EF.128", "LDG.E.64", "ACQBULK", "IDP.2A.LO.S16.U8", "IDP.2A.HI.S16.U8", "MOV",
         "@P0 STG.E.U16"]))
    assert sass_mix.opcodes(listing)[-2:] == ["MOV", "STG.E.U16"]
    assert sass_mix.load_order(listing) == "Wx2 Lx1 ACQx1 IDPx2 STGx1"
    assert sass_mix.opcode_mix(listing)["IDP"] == 2


@pytest.mark.slow
def test_server_load_test_runs_a_small_mix(tmp_path):
    """The load test of the server at 5% of its mix (a tiny Qwen3-VL model it builds, `orinfer serve` on loopback):
    every request answered with the status it should get, no 5xx, no traceback logged, slow clients cut off, every
    KV block free afterwards, memory back within 20%. Latencies are not judged at this size (see the script)."""
    needs(SCRIPTS / "server_load_test.py")
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(SCRIPTS / "server_load_test.py"), "--scale", "0.05",
                          "--no-latency-checks", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["server_5xx"] == 0 and report["tracebacks_logged"] == 0
    assert report["statuses"]["stream 200"] >= 15 and report["slow_clients_cut_off"] == 5
    assert report["free_blocks"] == report["total_blocks"] > 0


def test_serving_bench_reports_ttft_by_wave_of_requests(monkeypatch):
    """A level of 5 requests at concurrency 2 is 3 waves in the order the requests were issued: the first wave (the
    burst) and the later ones (steady state) are summarised apart; failed requests count in no wave."""
    pytest.importorskip("httpx")
    import asyncio

    bench_serve = load_script(SCRIPTS / "bench_serve.py", monkeypatch)
    ttfts = {0: 0.9, 1: 1.1, 2: 0.1, 3: 0.3, 4: 0.2}

    async def fake_request(client, args, model, i):
        if i == 3:
            return bench_serve.Result(False, error="boom")
        return bench_serve.Result(True, ttft=ttfts[i], tpot=0.01, e2e=1.0, tokens=4)

    monkeypatch.setattr(bench_serve, "one_request", fake_request)
    args = bench_serve.parse_args(["--requests", "5"])
    level = asyncio.run(bench_serve.run_level(args, "m", 2, offset=0))
    assert level.failed == 1 and len(level.ttft_ms_by_wave) == 3
    assert level.ttft_ms_by_wave[0]["p50"] == pytest.approx(1000.0)
    assert level.ttft_ms_by_wave[1]["p50"] == pytest.approx(100.0)   # request 3 failed: request 2 alone
    assert level.ttft_ms_by_wave[2]["p50"] == pytest.approx(200.0)


def test_serving_bench_warms_up_with_a_few_requests_not_the_measured_count(monkeypatch):
    """The warm-up runs WARMUP_REQUESTS requests one at a time whatever --requests says (512 of them at batch 1 once
    took minutes, so runs were cut before the measured level), then the level runs --requests."""
    pytest.importorskip("httpx")
    import asyncio

    bench_serve = load_script(SCRIPTS / "bench_serve.py", monkeypatch)
    seen = []

    async def fake_request(client, args, model, i):
        seen.append(i)
        return bench_serve.Result(True, ttft=0.1, tpot=0.01, e2e=1.0, tokens=4)

    monkeypatch.setattr(bench_serve, "one_request", fake_request)
    args = bench_serve.parse_args(["--requests", "40", "--concurrency", "8", "--model", "m"])
    report = asyncio.run(bench_serve.main_async(args))
    warmup = [i for i in seen if i >= 10_000_000]
    assert len(warmup) == bench_serve.WARMUP_REQUESTS < 40
    assert len(seen) - len(warmup) == 40 and report["levels"][0]["requests"] == 40


def test_serving_bench_reads_the_servers_latency_histograms(monkeypatch):
    """The server's TTFT quantiles over a level come from the difference of two /metrics pages: p50 / p99 are the
    upper bounds of the buckets that hold them."""
    bench_serve = load_script(SCRIPTS / "bench_serve.py", monkeypatch)
    name = "orinfer_time_to_first_token_seconds"

    def page(counts):
        return "\n".join(f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(("0.05", "0.1", "1.0", "+Inf"), counts))

    before = bench_serve.histogram_buckets(page((5, 5, 5, 5)), name)
    after = bench_serve.histogram_buckets(page((5, 55, 104, 105)) + "\nother_bucket{le=\"1\"} 9", name)
    assert bench_serve.bucket_quantiles(before, after) == {"count": 100, "p50": 100.0, "p99": 1000.0}
    assert bench_serve.bucket_quantiles({}, {}) == {"count": 0, "p50": None, "p99": None}


def test_serving_bench_places_the_load_from_the_servers_counters(monkeypatch):
    """Engine busy share, mean step and each process's CPU share come from two /metrics pages taken a wall time
    apart; counters a server lacks are left out."""
    bench_serve = load_script(SCRIPTS / "bench_serve.py", monkeypatch)
    page = ("orinfer_engine_steps_total 100\norinfer_engine_step_seconds_total 1.5\n"
            "process_cpu_seconds_total 3\n")
    before = {k: bench_serve.counter_value(page, n) for k, n in bench_serve.SERVER_COUNTERS.items()}
    assert before == {"steps": 100.0, "step_s": 1.5, "engine_cpu_s": None, "server_cpu_s": 3.0}
    after = {"steps": 300.0, "step_s": 3.5, "engine_cpu_s": None, "server_cpu_s": 5.0, "client_cpu_s": 11.0}
    shares = bench_serve.load_shares({**before, "client_cpu_s": 9.0}, after, wall=4.0)
    assert shares == {"engine_busy": 0.5, "step_ms": 10.0, "server_cpu": 0.5, "client_cpu": 0.5}


def _bench_serve_against_tiny_server(tiny_dir, out, *args: str) -> subprocess.CompletedProcess:
    """scripts/bench_serve.py with `args` (and --out `out`, no warm-up) against a tiny CPU model's server."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    from orinfer import LLM
    from orinfer.args import EngineArgs
    from orinfer.server.app import build_app
    from orinfer.server.cli import BackgroundServer

    llm = LLM(tiny_dir, EngineArgs(dtype="float32", device="cpu", progress=False, num_kv_blocks=128))
    with BackgroundServer(build_app(llm, "tiny")) as server:
        done = subprocess.run([sys.executable, str(SCRIPTS / "bench_serve.py"), "--url", server.url, "--no-warmup",
                               *args, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_serving_bench_splits_a_level_over_client_processes(tiny_dir, tmp_path):
    """--client-processes 2: the level's requests go out from two spawned load-generator processes; every request
    is counted once, in issue order (waves), with the wall time from the first send to the last finish."""
    out = tmp_path / "serve.json"
    _bench_serve_against_tiny_server(tiny_dir, out, "--concurrency", "4", "--requests", "8", "--max-tokens", "3",
                                     "--prompt-words", "5", "--client-processes", "2")
    level = json.loads(out.read_text())["levels"][0]
    assert (level["requests"], level["failed"], len(level["ttft_ms_by_wave"])) == (8, 0, 2)
    assert level["output_tok_s"] == pytest.approx(8 * 3 / level["wall_s"], rel=0.01)
    assert level["server_ms"]["ttft"]["count"] == 8 and level["load"]["client_cpu"] > 0


def test_serving_bench_gives_the_servers_view_of_a_multi_turn_run(tiny_dir, tmp_path):
    """The multi-turn workload reports, beside the client's TTFT per turn, when each turn's responses were accepted
    (headers), the server's TTFT and queue quantiles over all its turns (from two /metrics pages) and the engine's
    load, in the JSON and in the markdown."""
    out = tmp_path / "mt.json"
    done = _bench_serve_against_tiny_server(tiny_dir, out, "--workload", "multi-turn", "--conversations", "2",
                                            "--turns", "2", "--system-words", "6", "--user-words", "3",
                                            "--max-tokens", "2")
    mt = json.loads(out.read_text())["multi_turn"]
    assert [t["requests"] for t in mt["per_turn"]] == [2, 2]
    assert all(0 < t["headers_ms"]["p50"] <= t["ttft_ms"]["p50"] for t in mt["per_turn"])
    assert mt["server_ms"]["ttft"]["count"] == 4 and mt["server_ms"]["queue"]["count"] == 4
    assert mt["load"]["engine_busy"] > 0
    assert "server (bucket bounds" in done.stdout
    # the later turns' row (the multi-turn figure: TTFT p50 over every request after the first turn)
    later = mt["later_turns_ttft_ms"]
    assert f"| 2-2 | 2 | {later['p50']:.1f} | {later['p99']:.1f} |" in done.stdout
