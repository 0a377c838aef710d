"""``chattts-velocity bench`` end to end on a tiny random model on CPU: the JSON's schema, figures that are
positive and consistent with each other, the printed table, ``--skip-reference``, and clear errors for bad
arguments. Speed targets are judged on a GPU, never here."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from dataclasses import fields

import pytest

from chattts_velocity.bench.cli import bench_config
from chattts_velocity.cli import build_parser, main
from chattts_velocity.constants import SAMPLE_RATE, SAMPLES_PER_TOKEN
from chattts_velocity.device import default_engine_dtype

TOKENS_PER_AUDIO_S = SAMPLE_RATE / SAMPLES_PER_TOKEN  # 46.875
ROW_KEYS = {
    "path",
    "dtype",
    "batch",
    "tokens",
    "step_ms_p50",
    "steps_per_s",
    "tokens_per_s",
    "gpt_audio_s_per_s",
    "e2e_audio_s_per_s",
    "ttfa_s",
    "ttfa_generate_s",
    "ttfa_decode_s",
    "peak_mem_gib",
    "prefill_s",
    "gpt_s",
    "decode_s",
    "generated_tokens",
}
SPEEDUP_KEYS = {
    "batch",
    "dtype",
    "step_ms_p50",
    "steps_per_s",
    "tokens_per_s",
    "gpt_audio_s_per_s",
    "e2e_audio_s_per_s",
    "ttfa_s",
}
META_KEYS = {
    "device",
    "torch",
    "triton",
    "dtype",
    "dtypes",
    "size",
    "tokens",
    "batches",
    "command",
    "date",
    "peak_mem_kind",
}
TINY_CPU = ["bench", "--size", "tiny", "--device", "cpu", "--no-progress"]


def run_cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory):
    """One run of both paths at batches 1 and 2, 8 tokens: (report, printed output)."""
    path = tmp_path_factory.mktemp("bench") / "out" / "bench.json"
    rc, printed = run_cli([*TINY_CPU, "--batch", "1", "2", "--tokens", "8", "--json", str(path)])
    assert rc == 0
    return json.loads(path.read_text()), printed


def test_json_has_meta_a_row_per_path_and_batch_and_speedups(both_paths):
    report, _ = both_paths
    assert META_KEYS <= report["meta"].keys()
    # the tiny model on the CPU: float32, not the CPU's default packed format (per-call cost on tiny matrices)
    assert report["meta"]["dtype"] == "float32" and report["meta"]["size"] == "tiny"
    assert report["meta"]["dtypes"] == ["float32"]
    assert report["meta"]["command"].startswith("chattts-velocity bench --size tiny --batch 1 2 --tokens 8")
    assert set(report["definitions"]) >= {"ttfa_s", "steps_per_s", "tokens_per_s", "e2e_audio_s_per_s"}
    assert sorted((r["path"], r["batch"]) for r in report["rows"]) == [
        ("reference", 1),
        ("reference", 2),
        ("velocity", 1),
        ("velocity", 2),
    ]
    for row in report["rows"]:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
        assert row["dtype"] == "float32"  # the reference, and the tiny model's velocity engine on the CPU
    assert [s["batch"] for s in report["speedups"]] == [1, 2]
    for s in report["speedups"]:
        assert s.keys() == SPEEDUP_KEYS


def test_figures_are_positive_and_consistent(both_paths):
    report, _ = both_paths
    for row in report["rows"]:
        b = row["batch"]
        for key in ROW_KEYS - {"path", "dtype"}:
            assert row[key] > 0, (row["path"], b, key)
        assert row["generated_tokens"] == b * 8
        assert row["tokens_per_s"] == pytest.approx(b * row["steps_per_s"], rel=1e-6)
        assert row["gpt_audio_s_per_s"] == pytest.approx(row["tokens_per_s"] / TOKENS_PER_AUDIO_S, rel=1e-6)
        assert row["e2e_audio_s_per_s"] < row["gpt_audio_s_per_s"]  # the wav decode only adds time
        assert row["prefill_s"] < row["gpt_s"]
        assert row["ttfa_generate_s"] <= row["gpt_s"]
        assert row["ttfa_s"] == pytest.approx(row["ttfa_generate_s"] + row["ttfa_decode_s"], rel=1e-9)
        assert row["step_ms_p50"] / 1000 < row["gpt_s"]


def test_speedups_are_velocity_over_reference(both_paths):
    report, _ = both_paths
    rows = {(r["path"], r["batch"]): r for r in report["rows"]}
    for s in report["speedups"]:
        ref, vel = rows[("reference", s["batch"])], rows[("velocity", s["batch"])]
        assert s["dtype"] == vel["dtype"]
        assert s["tokens_per_s"] == pytest.approx(vel["tokens_per_s"] / ref["tokens_per_s"])
        assert s["ttfa_s"] == pytest.approx(ref["ttfa_s"] / vel["ttfa_s"])
        assert s["step_ms_p50"] == pytest.approx(ref["step_ms_p50"] / vel["step_ms_p50"])


def test_table_fits_100_columns_with_a_line_per_path_and_the_speedups(both_paths):
    _, printed = both_paths
    lines = printed.splitlines()
    assert max(len(line) for line in lines) <= 100
    for batch in ("1", "2"):
        i = next(i for i, line in enumerate(lines) if line.split()[:2] == [batch, "reference"])
        assert lines[i + 1].split()[0] == "velocity" and lines[i + 2].split()[0] == "speedup"
        assert lines[i + 2].count("x") == 4  # four speedup columns filled
    assert "The step-time speedup leaves out what tokens/s" in printed
    assert any(line.startswith("wrote ") and line.endswith("bench.json") for line in lines)


def test_several_dtypes_are_measured_in_one_run_their_timed_runs_taking_turns(tmp_path, monkeypatch):
    """Each velocity dtype gets its rows, speedups and table lines; after every variant's warm-up, the timed runs
    go variant after variant, repeat after repeat, so a busy machine slows them alike."""
    from chattts_velocity.bench import runner

    order = []
    run_velocity = runner.run_velocity

    def recording(engine, prompt, batch, tokens, seed, clock):
        order.append((engine.config.dtype, tokens))
        return run_velocity(engine, prompt, batch, tokens, seed, clock)

    monkeypatch.setattr(runner, "run_velocity", recording)
    path = tmp_path / "bench.json"
    rc, printed = run_cli([*TINY_CPU, "--batch", "1", "--tokens", "30", "--repeats", "2", "--dtype", "float32",
                           "int8", "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert [(r["path"], r["dtype"], r["batch"]) for r in report["rows"]] == [
        ("reference", "float32", 1), ("velocity", "float32", 1), ("velocity", "int8", 1)]
    assert [(s["dtype"], s["batch"]) for s in report["speedups"]] == [("float32", 1), ("int8", 1)]
    assert report["meta"]["dtypes"] == ["float32", "int8"] and "--dtype float32 int8" in report["meta"]["command"]
    warm = min(30, 24)  # the warm-up's short run: TTFA_TOKENS
    assert order == [("float32", warm), ("int8", warm), ("float32", 30), ("int8", 30), ("float32", 30),
                     ("int8", 30)]
    lines = printed.splitlines()
    i = next(i for i, line in enumerate(lines) if line.split()[:2] == ["1", "reference"])
    assert [" ".join(line.split()[:2]) for line in lines[i + 1 : i + 5]] == [
        "velocity fp32", "speedup fp32", "velocity int8", "speedup int8"]
    assert max(len(line) for line in lines) <= 100


def test_agreement_mode_reports_each_cpu_dtype_against_float32(tmp_path):
    path = tmp_path / "agreement.json"
    rc, printed = run_cli(["bench", "agreement", "--size", "tiny", "--batch", "1", "2", "--tokens", "20",
                           "--dtype", "float16", "int8", "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert (report["size"], report["tokens"]) == ("tiny", 20)
    assert [(r["batch"], r["dtype"]) for r in report["rows"]] == [(1, "float16"), (1, "int8"), (2, "float16"),
                                                                  (2, "int8")]
    for row in report["rows"]:
        assert 0.9 <= row["agreement"] <= 1 and row["offline_snr_db"] > 20 and row["streamed_snr_db"] > 20
    assert "| 1 | int8 |" in printed and printed.rstrip().endswith("agreement.json")


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float32"], "bench agreement compares the CPU engine dtypes float16, bfloat16, int8"),
    (["--device", "cuda"], "bench agreement compares the CPU engine dtypes: leave out --device"),
])
def test_agreement_mode_refuses_what_it_cannot_compare(args, message, tmp_path, capsys):
    assert main(["bench", "agreement", "--size", "tiny", *args, "--json", str(tmp_path / "a.json")]) == 2
    assert message in capsys.readouterr().err


def test_skip_reference_omits_reference_rows(tmp_path):
    path = tmp_path / "bench.json"
    rc, printed = run_cli(
        [*TINY_CPU, "--batch", "1", "--tokens", "4", "--skip-reference", "--json", str(path)]
    )
    assert rc == 0
    report = json.loads(path.read_text())
    assert [(r["path"], r["batch"]) for r in report["rows"]] == [("velocity", 1)]
    assert report["speedups"] == []
    assert "--skip-reference" in report["meta"]["command"]
    assert " - " in printed  # the reference's cells are dashes


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch must be an int >= 1"),
        (["--batch", "1", "1"], "--batch sizes must be distinct"),
        (["--tokens", "0"], "--tokens must be an int >= 2"),
        (["--tokens", "1"], "--tokens must be an int >= 2"),
        (["--repeats", "0"], "--repeats must be an int >= 1"),
        (["--decode-batch", "0"], "--decode-batch must be an int >= 1"),
        (["--reference-max-batch", "0"], "--reference-max-batch must be an int >= 1"),
        (["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0"),
        (["--device", "tpu"], "--device must be"),
        (["--dtype", "int8", "int8"], "--dtype values must be distinct"),
        (["stream", "--dtype", "int8", "float16"], "bench stream measures one engine dtype"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(args, message, tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main([*TINY_CPU, *args, "--json", str(path)]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not path.exists()


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench", "--device", "cuda", "--json", str(tmp_path / "b.json")]) == 2
    assert "CUDA is not available; use --device cpu" in capsys.readouterr().err


def test_too_many_tokens_for_the_context_is_a_clear_error(tmp_path, capsys):
    assert main([*TINY_CPU, "--tokens", "5000", "--json", str(tmp_path / "b.json")]) == 2
    assert "exceed the model's context" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "bench.json"
    assert main([*TINY_CPU, "--tokens", "4", "--json", str(path), "--plot", str(tmp_path / "b.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not path.exists()


def test_plot_draws_a_png(both_paths, tmp_path):
    pytest.importorskip("matplotlib")
    from chattts_velocity.bench.report import plot

    plot(both_paths[0], str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recorded_command_repeats_the_run():
    args = build_parser().parse_args(
        [
            *TINY_CPU,
            "--batch",
            "3",
            "1",
            "--tokens",
            "7",
            "--reference-max-batch",
            "2",
            "--kv-cache-gib",
            "0.5",
            "--prefix-caching",
            "--json",
            "a b.json",
        ]
    )
    config = bench_config(args)
    again = bench_config(build_parser().parse_args(shlex.split(config.command())[1:]))
    assert again.command() == config.command()
    assert (again.batches, again.tokens, again.json_path, again.kv_cache_gib) == ((3, 1), 7, "a b.json", 0.5)


def test_engine_config_fits_the_whole_batch_at_once():
    from chattts_velocity.bench.config import BenchConfig
    from chattts_velocity.bench.runner import engine_config
    from chattts_velocity.engine import EngineConfig

    cfg = engine_config(BenchConfig(size="tiny", device="cpu", batches=(3,)), batch=3, seq_len=40)
    assert cfg.max_num_seqs == 3 and not cfg.enable_prefix_caching and cfg.dtype == "float32"
    full = BenchConfig(size="full", device="cpu", batches=(3,))
    assert full.resolved_dtypes == (default_engine_dtype("cpu"),)
    assert engine_config(BenchConfig(size="tiny", device="cpu", dtypes=("float32", "int8")), 3, 40).dtype == "float32"
    assert engine_config(BenchConfig(size="tiny", device="cpu"), 3, 40, dtype="int8").dtype == "int8"
    per_seq = -(-40 // cfg.block_size)
    assert cfg.num_kv_blocks * (1 - cfg.watermark) >= 3 * per_seq
    assert engine_config(BenchConfig(size="tiny", device="cpu", max_num_seqs=2), 3, 40).max_num_seqs == 2
    given = engine_config(BenchConfig(size="tiny", device="cpu", kv_cache_gib=0.25), 3, 40)
    assert given.kv_cache_gib == 0.25 and given.num_kv_blocks is None
    eager = BenchConfig(size="tiny", device="cpu", enforce_eager=True)
    if "enforce_eager" in {f.name for f in fields(EngineConfig)}:
        assert engine_config(eager, 3, 40).enforce_eager
    else:
        with pytest.raises(ValueError, match="no enforce_eager setting"):
            engine_config(eager, 3, 40)


def test_serve_bench_fails_at_once_when_a_client_process_dies():
    """A client process that exits without its results fails the level within a second or so, instead of the
    level waiting out its whole timeout; results that did arrive are gathered as they come."""
    import queue
    import time
    from types import SimpleNamespace

    from chattts_velocity.bench.serve import gather_parts

    out = queue.Queue()
    out.put(([{"ok": True}], 0.1))
    alive, dead = SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died \\(exit code 1\\)"):
        gather_parts(out, [alive, dead], timeout_s=600)
    assert time.monotonic() - start < 30
    out.put(("a", 0.1))
    out.put(("b", 0.2))
    assert gather_parts(out, [alive, SimpleNamespace(exitcode=0)], timeout_s=600) == [("a", 0.1), ("b", 0.2)]
    with pytest.raises(RuntimeError, match="did not finish within 0 s"):
        gather_parts(out, [alive], timeout_s=0)


def test_serve_bench_stops_when_its_warm_up_gets_nothing_through(capsys):
    """No server at the address: ``bench serve`` says so and exits 2 (it printed a table of NaNs and a
    client-bound warning, exit 0); a warm-up with any success goes on, one refused by status names it."""
    import socket

    from chattts_velocity.bench.serve import check_warm_up

    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--streams", "2", "--requests-per-stream",
                 "1", "--json", ""])
    err = capsys.readouterr().err
    assert code == 2 and f"no speech request to http://127.0.0.1:{port} succeeded" in err, err
    assert "Connection" in err, err
    check_warm_up({"failures": 1, "requests": 2, "errors": [], "statuses": ["200", "503"]}, "http://x")
    with pytest.raises(ValueError, match="HTTP status 401"):
        check_warm_up({"failures": 2, "requests": 2, "errors": [], "statuses": ["401"]}, "http://x")
    with pytest.raises(ValueError, match="a response without audio"):
        check_warm_up({"failures": 1, "requests": 1, "errors": [], "statuses": ["200"]}, "http://x")


def test_cpu_speed_times_the_audio_rounds_both_ways():
    """``benchmarks/cpu_speed.py --parts rounds`` (run as a script, so it keeps up with the pump's signatures):
    host ms a round for feeds woken every round and for feeds woken only with audio, at each streams count."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_speed.py"
    run = subprocess.run([sys.executable, str(script), "--parts", "rounds", "--streams", "2", "6", "--hidden", "16", "--rounds", "1"],
                         check=True, capture_output=True, text=True, timeout=300)
    rows = re.findall(r"(\d+) streams, 16 floats a token: every round ([\d.]+) \(best [\d.]+\)\s+with audio ([\d.]+)", run.stdout)
    assert [n for n, _, _ in rows] == ["2", "6"], run.stdout
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in rows), run.stdout
