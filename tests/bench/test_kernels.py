"""`zerorun bench adam` and `bench quantize` run every implementation side by side (tiny sizes here; no timing
asserts)."""

from __future__ import annotations

from typer.testing import CliRunner

from zerorun.bench import adam
from zerorun.cli import app


def test_bench_reports_every_implementation_against_the_roofline() -> None:
    bench = adam.run([1000, 4097], threads=1, repeats=2, budget_s=0.5, bandwidth_numel=10**5)
    assert bench.bandwidth_gb_s > 0
    assert [(r.numel, r.implementation) for r in bench.results] == \
        [(n, name) for n in (1000, 4097) for name in adam.IMPLEMENTATIONS]
    for r in bench.results:
        assert (r.median_s is not None and r.runs >= 1) or r.note, r
        assert r.bytes_per_param == (30 if r.implementation.endswith("+bf16") else 28)


def test_bench_times_implementations_in_the_same_rounds_against_one_reference() -> None:
    """Each row's ratio is its time over the reference's in the same round (DeepSpeedCPUAdam where it imports,
    else torch's fused AdamW), so the reference's own ratio is exactly 1 and every row ran as many rounds."""
    import importlib.util

    bench = adam.run([3000], threads=1, repeats=3, implementations=("zerorun", "torch fused", "deepspeed"),
                     budget_s=5.0, bandwidth_numel=10**5)
    assert bench.reference == ("deepspeed" if importlib.util.find_spec("deepspeed") else "torch fused")
    ran = [r for r in bench.results if r.median_s is not None]
    assert {r.implementation: r.runs for r in ran} == {r.implementation: 3 for r in ran}
    assert [r.ratio for r in ran if r.implementation == bench.reference] == [1.0]
    assert all(r.ratio is not None and r.ratio > 0 for r in ran)


def test_bench_adam_command_prints_the_table() -> None:
    result = CliRunner().invoke(app, ["bench", "adam", "--sizes", "2K", "--repeats", "1", "--bandwidth-size", "100K",
                                      "--implementations", "zerorun,torch fused"])
    assert result.exit_code == 0, result.output
    assert "roofline" in result.output and "zerorun" in result.output and "torch fused" in result.output


def test_bench_adam_rejects_unknown_implementations_and_sizes() -> None:
    for args in (["--implementations", "apex"], ["--sizes", "-3M"]):
        result = CliRunner().invoke(app, ["bench", "adam", *args])
        assert result.exit_code == 2 and "zerorun: error:" in result.output, result.output


def test_sizes_are_parameter_counts_in_powers_of_ten() -> None:
    from zerorun.config.counts import parse_count

    assert [parse_count(s) for s in ("1M", "16m", "2.5K", "100")] == [10**6, 16 * 10**6, 2500, 100]


def test_bench_quantize_times_each_operation_of_both_implementations() -> None:
    from zerorun.bench import quantize

    bench = quantize.run([1000, 4097], threads=1, repeats=2, budget_s=0.5, bandwidth_numel=10**5)
    assert [(r.numel, r.operation, r.implementation) for r in bench.results] == \
        [(n, op, name) for n in (1000, 4097) for op in quantize.OPERATIONS for name in quantize.IMPLEMENTATIONS]
    assert all((r.median_s is not None and r.runs >= 1) or r.note for r in bench.results)
    result = CliRunner().invoke(app, ["bench", "quantize", "--sizes", "5K", "--repeats", "1", "--bandwidth-size", "100K"])
    assert result.exit_code == 0, result.output
    assert "roofline" in result.output and "dequantize+add" in result.output
    result = CliRunner().invoke(app, ["bench", "quantize", "--sizes", "-3M"])
    assert result.exit_code == 2 and "zerorun: error:" in result.output, result.output


def test_bench_rows_force_a_kernel_variant_and_leave_the_default_behind() -> None:
    """'zerorun avx2' and 'zerorun avx512' run that variant of the kernel (AVX-512 only where measured to help
    runs by default), or say why not; the default variant is back afterwards."""
    from zerorun import ops

    default = ops.use_cpu_isa(-1)
    bench = adam.run([5000], threads=1, repeats=2, implementations=("zerorun", "zerorun avx2", "zerorun avx512"),
                     budget_s=5.0, bandwidth_numel=10**5)
    rows = {r.implementation: r for r in bench.results}
    assert bench.isa == default == ops.use_cpu_isa(-1)
    for name, level in adam.ISA_ROWS.items():
        has = ops.use_cpu_isa(level) == name.removeprefix("zerorun ")
        ops.use_cpu_isa(-1)
        assert (rows[name].median_s is not None) if has else rows[name].note == f"this CPU has no {name[8:]}"

